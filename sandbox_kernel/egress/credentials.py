"""Credentials the egress proxy adds to a kernel's requests, which the kernel never holds.

The server's administrator defines them (``SandboxProvisioner.credentials``): the domains
each is for, the headers it adds, with values read on the host from the server's
environment (``{env:NAME}``) or a file (``{file:/path}``), and an optional lifetime. A
kernelspec names the ones its kernels get; a program may bind more to one kernel while it
runs. Values live only in the server process, as :class:`Secret`; what is logged, saved
or shown names a credential and its header names, never a value.

Pure logic, no I/O but reading the values.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sandbox_kernel.egress.rules import EgressRules
from sandbox_kernel.errors import ConfigurationError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{(env|file):([^{}]*)\}|[{}]")
#: Headers a credential may not set: the connection's and the message's own framing.
_RESERVED_HEADERS = frozenset(
    {
        "connection",
        "content-length",
        "expect",
        "host",
        "keep-alive",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_KEYS = frozenset({"domains", "headers", "ttl"})
#: A value read from a file is at most this long.
MAX_VALUE = 64 * 1024


class Secret:
    """A credential's value: shown as ``<secret>`` wherever it is printed or logged."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


@dataclass(frozen=True)
class CredentialSpec:
    """A credential as configured: its name, the domains it is for, its headers (values
    still templates) and its lifetime in seconds (0: for as long as the kernel runs)."""

    name: str
    rules: EgressRules
    #: Templates; one may be the literal value itself, so they are never shown.
    headers: tuple[tuple[str, str], ...] = field(repr=False)
    ttl: float = 0.0

    @property
    def header_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.headers)

    def resolve(self, environ: Mapping[str, str] | None = None) -> tuple[tuple[str, Secret], ...]:
        """The headers with their values read (on the host, as the server's user).

        Raises:
            ConfigurationError: naming the credential and what could not be read, never a value.
        """
        return tuple((header, resolve(template, self.name, environ)) for header, template in self.headers)


def _problem(setting: str, name: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"{setting}: credential {name!r} {why}")


def parse_definitions(
    value: Any, setting: str = "SandboxProvisioner.credentials"
) -> dict[str, CredentialSpec]:
    """The credentials of a server's configuration, checked; no value is read.

    ``{"warehouse": {"domains": ["api.example.com"], "headers": {"Authorization":
    "Bearer {env:WAREHOUSE_TOKEN}"}, "ttl": 3600}}``

    Raises:
        ConfigurationError: naming the setting, the credential and what is wrong.
    """
    if not isinstance(value, Mapping):
        msg = f"{setting} must map credential names to their definitions, not {type(value).__name__}."
        raise ConfigurationError(msg)
    specs: dict[str, CredentialSpec] = {}
    for name, definition in value.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            msg = f"{setting}: {name!r} is not a credential name (letters, digits, '_', '.', '-')."
            raise ConfigurationError(msg)
        if not isinstance(definition, Mapping):
            raise _problem(setting, name, "must be a mapping with 'domains' and 'headers'")
        unknown = sorted(set(definition) - _KEYS)
        if unknown:
            raise _problem(setting, name, f"has unknown keys {unknown}; it takes {sorted(_KEYS)}")
        domains = definition.get("domains")
        if not domains:
            raise _problem(setting, name, "names no domains: say which hosts it is sent to")
        rules = EgressRules.parse(domains, f"{setting}[{name!r}].domains")
        headers = definition.get("headers")
        if not isinstance(headers, Mapping) or not headers:
            raise _problem(
                setting, name, "adds no headers: give 'headers', as {'Authorization': 'Bearer {env:TOKEN}'}"
            )
        checked: list[tuple[str, str]] = []
        for header, template in headers.items():
            if not isinstance(header, str) or not _HEADER_NAME.fullmatch(header):
                raise _problem(setting, name, f"has {header!r}, which is not a header name")
            if header.lower() in _RESERVED_HEADERS or header.lower().startswith("proxy-"):
                raise _problem(setting, name, f"may not set {header!r}: it belongs to the connection")
            if not isinstance(template, str):
                raise _problem(setting, name, f"gives {header!r} a {type(template).__name__}, not a string")
            _check_template(template, setting, name)
            checked.append((header, template))
        ttl = definition.get("ttl", 0) or 0
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl < 0:
            raise _problem(setting, name, f"has ttl={ttl!r}; give seconds (0: no expiry)")
        specs[name] = CredentialSpec(name, rules, tuple(checked), float(ttl))
    check_overlaps(specs.values(), setting)
    return specs


def check_overlaps(specs: Iterable[CredentialSpec], setting: str) -> None:
    """Two credentials that could both apply to one request may not set the same header.

    Raises:
        ConfigurationError: naming both.
    """
    seen: list[CredentialSpec] = []
    for spec in specs:
        for other in seen:
            shared = {h.lower() for h in spec.header_names} & {h.lower() for h in other.header_names}
            overlap = any(a.covers(b) or b.covers(a) for a in spec.rules.rules for b in other.rules.rules)
            if shared and overlap:
                msg = (
                    f"{setting}: credentials {other.name!r} and {spec.name!r} both set "
                    f"{sorted(shared)[0]!r} for the same domains; give each its own domains."
                )
                raise ConfigurationError(msg)
        seen.append(spec)


def _check_template(template: str, setting: str, name: str) -> None:
    for match in _PLACEHOLDER.finditer(template):
        text = match.group(0)
        if text in ("{{", "}}"):
            continue
        if match.group(1) is None:
            raise _problem(
                setting,
                name,
                f"has a lone {text!r}: placeholders are {{env:NAME}} and {{file:/path}}, "
                "and '{{' is a brace",
            )
        kind, argument = match.group(1), match.group(2)
        if kind == "env" and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", argument):
            raise _problem(setting, name, f"names {argument!r}, which is not an environment variable")
        if kind == "file" and not os.path.isabs(argument):
            raise _problem(setting, name, f"names the file {argument!r}: give an absolute path")


def resolve(template: str, name: str, environ: Mapping[str, str] | None = None) -> Secret:
    """``template`` with its placeholders filled in, from ``environ`` (default: this
    process's environment) and files.

    Raises:
        ConfigurationError: naming the credential and the placeholder that could not be
            filled, never a value.
    """
    environ = os.environ if environ is None else environ

    def fill(match: re.Match[str]) -> str:
        text = match.group(0)
        if text in ("{{", "}}"):
            return text[0]
        kind, argument = match.group(1), match.group(2)
        if kind == "env":
            if argument not in environ:
                msg = f"Credential {name!r} needs the server's environment variable {argument}, not set."
                raise ConfigurationError(msg)
            return environ[argument]
        try:
            with open(argument, "rb") as f:
                data = f.read(MAX_VALUE + 1)
        except OSError as exc:
            msg = f"Credential {name!r} could not read {argument}: {exc.strerror or exc}"
            raise ConfigurationError(msg) from None
        if len(data) > MAX_VALUE:
            msg = f"Credential {name!r}: {argument} is larger than {MAX_VALUE} bytes."
            raise ConfigurationError(msg)
        text = data.decode("utf-8", "replace")
        return text[:-1] if text.endswith("\n") else text

    value = _PLACEHOLDER.sub(fill, template)
    if not all(" " <= c <= "~" or c == "\t" for c in value):
        msg = (
            f"Credential {name!r}: a value holds a line break, a control character or non-ASCII "
            "text, which a header cannot carry."
        )
        raise ConfigurationError(msg)
    return Secret(value)


@dataclass(frozen=True)
class BoundCredential:
    """A credential bound to one kernel: headers with their values, and when it ends."""

    name: str
    rules: EgressRules
    headers: tuple[tuple[str, Secret], ...] = field(repr=False)
    expires_at: float | None = None
    #: Who bound it: "config" (the kernelspec named it) or "api" (a program, at run time).
    by: str = "config"

    @classmethod
    def bind(
        cls,
        spec: CredentialSpec,
        by: str = "config",
        expires_at: float | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> BoundCredential:
        """``spec`` with its values read; it ends at ``expires_at``, or its ttl from now."""
        if expires_at is None and spec.ttl:
            expires_at = time.time() + spec.ttl
        return cls(spec.name, spec.rules, spec.resolve(environ), expires_at, by)

    @property
    def header_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.headers)

    def applies(self, host: str, port: int) -> bool:
        return self.rules.allows(host, port)


class CredentialTable:
    """The credentials bound to one kernel, as the proxy uses them: which hosts to
    intercept, what to add to a request, and why not (expired, revoked). Not thread-safe:
    the proxy's thread alone touches it."""

    def __init__(self, credentials: Iterable[BoundCredential] = ()) -> None:
        self._live: dict[str, BoundCredential] = {}
        #: Credentials that ended: name -> (credential, why), so a request learns why.
        self._ended: dict[str, tuple[BoundCredential, str]] = {}
        for credential in credentials:
            self.bind(credential)

    def bind(self, credential: BoundCredential) -> None:
        """Bind ``credential``, replacing one of the same name.

        Raises:
            ConfigurationError: another bound credential sets one of its headers for
                the same domains; nothing changes.
        """
        live = {**self._live, credential.name: credential}
        check_overlaps(
            (CredentialSpec(c.name, c.rules, tuple((h, "") for h in c.header_names)) for c in live.values()),
            "bind_credential",
        )
        self._ended.pop(credential.name, None)
        self._live = live

    def revoke(self, name: str, now: float | None = None) -> bool:
        """Stop adding ``name``; whether it was bound."""
        credential = self._live.pop(name, None)
        if credential is None:
            return False
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if now is None else now))
        self._ended[name] = (credential, f"credential {name!r} was revoked at {when}")
        return True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._live)

    def intercepts(self, host: str, port: int) -> bool:
        """Whether a connection to ``host``:``port`` must be read to add a credential
        (or to refuse it for one that ended)."""
        return any(c.applies(host, port) for c in self._live.values()) or any(
            c.applies(host, port) for c, _ in self._ended.values()
        )

    def lookup(
        self, host: str, port: int, now: float | None = None
    ) -> tuple[list[BoundCredential], list[str]]:
        """(the live credentials for ``host``:``port``, why others for it no longer apply)."""
        now = time.time() if now is None else now
        for name, credential in list(self._live.items()):
            if credential.expires_at is not None and now >= credential.expires_at:
                del self._live[name]
                when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(credential.expires_at))
                self._ended[name] = (credential, f"credential {name!r} expired at {when}")
        live = [c for c in self._live.values() if c.applies(host, port)]
        ended = [why for c, why in self._ended.values() if c.applies(host, port)]
        return live, ended
