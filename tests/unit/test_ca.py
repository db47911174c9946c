"""A kernel's egress CA: what its certificates let a TLS client in the sandbox trust."""

from __future__ import annotations

import ssl
import stat
from pathlib import Path

import pytest

from sandbox_kernel.egress.ca import KernelCA, LeafContexts
from sandbox_kernel.egress.rules import EgressRules
from sandbox_kernel.errors import ConfigurationError

ALLOWED = EgressRules.parse(["api.example.com", "*.warehouse.example.net:8443"])


@pytest.fixture(scope="module")
def ca() -> KernelCA:
    return KernelCA.create("0123456789abcdef", ALLOWED)


def handshake(ca: KernelCA, server: ssl.SSLContext, server_name: str) -> str | None:
    """A TLS handshake in memory between a client trusting ``ca`` (Python's defaults, as
    code in the sandbox has) and ``server``; the ALPN protocol both chose."""
    client = ssl.create_default_context(cadata=ca.cert_pem.decode())
    client.set_alpn_protocols(["h2", "http/1.1"])
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    c = client.wrap_bio(c_in, c_out, server_hostname=server_name)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, side in (("client", c), ("server", s)):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return c.selected_alpn_protocol()
    raise AssertionError("no handshake")


def test_a_site_certificate_is_trusted_for_its_host_only(ca: KernelCA) -> None:
    contexts = LeafContexts(ca)
    assert handshake(ca, contexts.get("api.example.com"), "api.example.com") == "http/1.1"
    assert handshake(ca, contexts.get("db.warehouse.example.net"), "db.warehouse.example.net") == "http/1.1"
    with pytest.raises(ssl.SSLCertVerificationError, match="match"):
        handshake(ca, contexts.get("api.example.com"), "other.example.com")


def test_the_ca_cannot_vouch_for_a_site_outside_the_allowed_domains(ca: KernelCA) -> None:
    """Were its key to leak, it would sign for nothing but the kernel's allowed domains."""
    with pytest.raises(ssl.SSLCertVerificationError, match=r"(?i)name constraint|permitted"):
        handshake(ca, LeafContexts(ca).get("bank.example.org"), "bank.example.org")


def test_each_kernel_has_its_own_ca(ca: KernelCA) -> None:
    other = KernelCA.create("fedcba9876543210", ALLOWED)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(ca, LeafContexts(other).get("api.example.com"), "api.example.com")


def test_the_key_is_kept_private(ca: KernelCA, tmp_path: Path) -> None:
    assert b"PRIVATE KEY" not in ca.cert_pem
    assert "PRIVATE" not in repr(ca)
    path = tmp_path / "egress-ca.pem"
    ca.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert KernelCA.load(path) == ca
    path.write_bytes(ca.cert_pem)
    with pytest.raises(ConfigurationError, match="does not hold a kernel's egress CA"):
        KernelCA.load(path)


def test_contexts_are_kept_per_host_up_to_a_limit(ca: KernelCA) -> None:
    contexts = LeafContexts(ca, limit=2)
    first = contexts.get("api.example.com")
    assert contexts.get("API.example.com.") is first
    contexts.get("a.warehouse.example.net")
    contexts.get("b.warehouse.example.net")
    assert contexts.get("api.example.com") is not first
    with pytest.raises(ConfigurationError, match="not a domain name"):
        contexts.get("10.0.0.1")
