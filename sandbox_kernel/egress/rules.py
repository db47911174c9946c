"""What a kernel's egress allow-list means: domain patterns, ceilings, address rules.

Pure logic, no I/O: ``EgressRules.parse`` validates the patterns a kernelspec or the
administrator writes, ``uncovered_by`` checks a kernel's rules against the ceiling, and
``EgressPolicy`` says which addresses the proxy may connect to.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sandbox_kernel.errors import ConfigurationError

#: A rule without a port allows these.
DEFAULT_PORTS = frozenset({80, 443})

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_ACCEPTED_FORMS = (
    "accepted forms are 'example.org' (that host), '*.example.org' (its subdomains at any depth, "
    "not example.org itself), each with an optional ':PORT' (without one, ports 80 and 443)"
)
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
# getaddrinfo reads "127.1", "2130706433" and "0x7f.1" as IPv4 addresses.
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")
PORT = re.compile(r"[0-9]{1,5}")


def normalize_host(host: str) -> str:
    host = host.lower()
    return host[:-1] if host.endswith(".") else host


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return ":" in host or _NUMERIC_LABEL.fullmatch(host.rsplit(".", 1)[-1]) is not None
    return True


def is_domain_name(host: str) -> bool:
    return (
        len(host) <= 253
        and host.isascii()
        and all(_LABEL.fullmatch(label) for label in host.split("."))
        and not is_ip_literal(host)
    )


def shown(text: str, limit: int = 100) -> str:
    """Untrusted text made safe for a single-line ASCII reason."""
    text = "".join(c if " " <= c <= "~" else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bad_pattern(setting: str, pattern: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"{setting}: {pattern!r} is not a domain pattern: {why}. {_ACCEPTED_FORMS}.")


def _url_host_suggestion(text: str) -> str:
    rest = text.split("://", 1)[-1]
    for separator in "/?#":
        rest = rest.split(separator, 1)[0]
    return rest.rsplit("@", 1)[-1]


@dataclass(frozen=True)
class DomainRule:
    """One allowed pattern: ``docs.python.org`` (that host) or ``*.python.org`` (its
    subdomains at any depth, not python.org itself), with one optional port; without a
    port the rule allows 80 and 443."""

    domain: str
    wildcard: bool = False
    port: int | None = None

    @classmethod
    def parse(cls, pattern: str, setting: str = "allowed_domains") -> DomainRule:
        """The rule written as ``pattern``, normalized (lowercase, no trailing dot).

        Raises:
            ConfigurationError: naming the setting and the pattern, saying what is wrong
                and showing the accepted forms.
        """
        if not isinstance(pattern, str):
            raise _bad_pattern(setting, pattern, "it is not a string")
        text = pattern.strip()
        if not text:
            raise _bad_pattern(setting, pattern, "it is empty")
        if not text.isascii():
            try:
                suggestion = f" ({text.encode('idna').decode('ascii')!r})"
            except UnicodeError:
                suggestion = ""
            raise _bad_pattern(
                setting, pattern, f"non-ASCII names are not accepted; use the punycode form{suggestion}"
            )
        if "/" in text:
            suggestion = _url_host_suggestion(text)
            raise _bad_pattern(setting, pattern, f"schemes and paths are not accepted; use {suggestion!r}")
        if text.startswith("[") or text.count(":") > 1:
            raise _bad_pattern(setting, pattern, "IP addresses are not accepted; use a domain name")
        host, _, port_text = text.partition(":")
        port = None
        if port_text or text.endswith(":"):
            if not PORT.fullmatch(port_text) or not 1 <= int(port_text) <= 65535:
                raise _bad_pattern(
                    setting, pattern, f"the port {port_text!r} is not a number from 1 to 65535"
                )
            port = int(port_text)
        host = normalize_host(host)
        if host in ("*", "*."):
            raise _bad_pattern(setting, pattern, "'*' alone would allow every host; list the domains instead")
        wildcard = host.startswith("*.")
        domain = host[2:] if wildcard else host
        if "*" in domain:
            raise _bad_pattern(
                setting, pattern, "'*' may only be the whole first label, as in '*.example.org'"
            )
        if is_ip_literal(domain):
            raise _bad_pattern(setting, pattern, "IP addresses are not accepted; use a domain name")
        if not is_domain_name(domain):
            raise _bad_pattern(
                setting, pattern, "a host name is dot-separated labels of letters, digits, '-' and '_'"
            )
        if wildcard and "." not in domain:
            raise _bad_pattern(
                setting,
                pattern,
                f"'*.{domain}' is too broad; name a domain under it, as in '*.example.{domain}'",
            )
        return cls(domain, wildcard, port)

    @property
    def pattern(self) -> str:
        """The rule written as a pattern."""
        prefix = "*." if self.wildcard else ""
        suffix = "" if self.port is None else f":{self.port}"
        return f"{prefix}{self.domain}{suffix}"

    @property
    def ports(self) -> frozenset[int]:
        return DEFAULT_PORTS if self.port is None else frozenset({self.port})

    def allows(self, host: str, port: int) -> bool:
        """Whether the normalized ``host`` on ``port`` matches this rule."""
        if port not in self.ports:
            return False
        if self.wildcard:
            return host.endswith("." + self.domain)
        return host == self.domain

    def covers(self, other: DomainRule) -> bool:
        """Whether every host and port ``other`` allows is allowed by this rule too."""
        if not other.ports <= self.ports:
            return False
        if not self.wildcard:
            return not other.wildcard and other.domain == self.domain
        if other.wildcard and other.domain == self.domain:
            return True
        return other.domain.endswith("." + self.domain)


@dataclass(frozen=True)
class EgressRules:
    """The domains a kernel may reach; no rules allow nothing."""

    rules: tuple[DomainRule, ...] = ()

    @classmethod
    def parse(cls, patterns: Sequence[str], setting: str = "allowed_domains") -> EgressRules:
        """Rules from patterns such as ``["pypi.org", "*.pythonhosted.org:443"]``.

        Raises:
            ConfigurationError: naming ``setting`` and the bad pattern, with the accepted forms.
        """
        if isinstance(patterns, str):
            msg = f"{setting}={patterns!r} must be a list of domain patterns, not one string."
            raise ConfigurationError(msg)
        rules: list[DomainRule] = []
        for pattern in patterns:
            rule = DomainRule.parse(pattern, setting)
            if rule not in rules:
                rules.append(rule)
        return cls(tuple(rules))

    @property
    def patterns(self) -> tuple[str, ...]:
        """The normalized patterns (lowercase, no trailing dot)."""
        return tuple(rule.pattern for rule in self.rules)

    def match(self, host: str, port: int) -> DomainRule | None:
        """The first rule allowing ``host`` on ``port``, if any."""
        host = normalize_host(host)
        if not is_domain_name(host):
            return None
        return next((rule for rule in self.rules if rule.allows(host, port)), None)

    def allows(self, host: str, port: int) -> bool:
        """Whether a connection to the domain name ``host`` on ``port`` is allowed; an IP
        literal or a malformed name never is."""
        return self.match(host, port) is not None

    def uncovered_by(self, ceiling: EgressRules) -> list[str]:
        """The patterns of these rules that no rule of ``ceiling`` covers."""
        return [rule.pattern for rule in self.rules if not any(top.covers(rule) for top in ceiling.rules)]


@dataclass(frozen=True)
class EgressPolicy:
    """What one kernel may reach, and how the proxy reaches it.

    ``host_map`` pins names to addresses (like ``curl --resolve``), used instead of DNS;
    ``private_networks`` are CIDRs the proxy may connect to although they are not
    globally routable (an internal package mirror, say).
    """

    rules: EgressRules
    host_map: Mapping[str, str] = field(default_factory=dict)
    private_networks: tuple[str, ...] = ()
    connect_timeout: float = 10.0
    max_connections: int = 32
    #: The CAs (a PEM file) that the proxy verifies a host with when it ends the kernel's
    #: TLS there to add a credential; None: the system's.
    upstream_cafile: str | None = None
    #: "egress": a request outside ``rules`` but within ``approvable`` waits for the
    #: kernel's holder to approve it, at most ``approval_timeout`` seconds; "off": denied.
    approval: str = "off"
    approval_timeout: float = 60.0
    approvable: EgressRules = field(default_factory=EgressRules)
    #: What the kernel's start took out of its kernelspec's allowed domains: denied,
    #: never asked about (a session that narrowed its domains meant them closed).
    withheld: EgressRules = field(default_factory=EgressRules)
    _networks: tuple[IPNetwork, ...] = field(init=False, repr=False, compare=False, default=())
    _addresses: Mapping[str, IPAddress] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        """Raises ConfigurationError for a bad host_map entry, network, timeout or limit."""
        addresses: dict[str, IPAddress] = {}
        for name, address in self.host_map.items():
            host = normalize_host(str(name))
            if not is_domain_name(host):
                msg = (
                    f"host_map: {name!r} is not a domain name; "
                    "map names like 'mirror.example.org' to addresses."
                )
                raise ConfigurationError(msg)
            try:
                addresses[host] = ipaddress.ip_address(address)
            except ValueError:
                msg = (
                    f"host_map: {name!r} maps to {address!r}, which is not an IP address; "
                    "use one like '10.0.0.5'."
                )
                raise ConfigurationError(msg) from None
        networks: list[IPNetwork] = []
        for network in self.private_networks:
            try:
                networks.append(ipaddress.ip_network(network, strict=False))
            except ValueError:
                msg = f"private_networks: {network!r} is not a network; use CIDR notation like '10.1.0.0/16'."
                raise ConfigurationError(msg) from None
        if not self.connect_timeout > 0:
            msg = f"connect_timeout={self.connect_timeout!r} must be a positive number of seconds."
            raise ConfigurationError(msg)
        if self.max_connections < 1:
            msg = f"max_connections={self.max_connections!r} must be at least 1."
            raise ConfigurationError(msg)
        object.__setattr__(self, "_addresses", addresses)
        object.__setattr__(self, "_networks", tuple(networks))

    def mapped_address(self, host: str) -> IPAddress | None:
        """The address ``host_map`` pins the normalized ``host`` to, if any."""
        return self._addresses.get(host)

    def permits_address(self, address: IPAddress) -> bool:
        """Whether the proxy may connect to ``address``: globally routable and not
        multicast, or inside ``private_networks``. IPv4 embedded in IPv6 (mapped, 6to4,
        Teredo, NAT64) must pass too."""
        candidates: list[IPAddress] = [address]
        if isinstance(address, ipaddress.IPv6Address):
            if address.ipv4_mapped is not None:
                candidates = [address.ipv4_mapped]
            if address.sixtofour is not None:
                candidates.append(address.sixtofour)
            if address.teredo is not None:
                candidates.extend(address.teredo)
            if address in ipaddress.IPv6Network("64:ff9b::/96"):
                candidates.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
        return all(self._permits_one(candidate) for candidate in candidates)

    def _permits_one(self, address: IPAddress) -> bool:
        if any(address in network for network in self._networks):
            return True
        return address.is_global and not address.is_multicast
