"""Credentials the proxy adds to a kernel's HTTPS requests, on real sockets: client ->
relay -> host proxy (ending the kernel's TLS with the kernel's CA) -> upstream (trustme).

The kernel's side of each test trusts only what a sandboxed kernel would: its own CA for
the hosts with a credential, the test CA (as the world's CAs) for the rest. The upstream
answers what it received, so the tests see exactly which headers arrived.
"""

from __future__ import annotations

import json
import os
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
import trustme

from sandbox_kernel.egress import EgressProxy
from sandbox_kernel.egress.ca import KernelCA
from sandbox_kernel.egress.credentials import BoundCredential, Secret
from sandbox_kernel.egress.rules import EgressRules
from sandbox_kernel.errors import ConfigurationError

from . import test_egress
from .test_egress import Echo, Relay, Sandbox, Upstreams, policy

# The relay and upstream fixtures of the egress tests.
relay, relay_dir, upstreams = test_egress.relay, test_egress.relay_dir, test_egress.upstreams

TOKEN = "sk-live-0123456789abcdef"


class KeepAliveEcho(Echo):
    """The echo handler over HTTP/1.1: the connection stays open between requests;
    ``/redirect?to=URL`` answers 302 to URL."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path.startswith("/redirect?to="):
            self.send_response(302)
            self.send_header("Location", self.path.split("=", 1)[1])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.reply()


class TlsUpstream(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, context: ssl.SSLContext) -> None:
        super().__init__(("127.0.0.1", 0), KeepAliveEcho)
        self.context = context
        self.connections = 0
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def finish_request(self, request: Any, client_address: Any) -> None:
        self.connections += 1
        request.settimeout(10)
        super().finish_request(self.context.wrap_socket(request, server_side=True), client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Tests cut connections on purpose."""

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TlsUpstream, Path]]:
    """An HTTPS keep-alive echo server for allowed.test and other.test, and its CA file."""
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("allowed.test", "other.test").configure_cert(context)
    ca_file = tmp_path_factory.mktemp("site") / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server = TlsUpstream(context)
    yield server, ca_file
    server.stop()


class Kernel:
    """A registered kernel with a credential for allowed.test, as its code sees the network."""

    def __init__(
        self, relay: Relay, upstreams: Upstreams, port: int, ca_file: Path, tmp: Path, **changes: Any
    ):
        self.kernel_id = f"test-{uuid.uuid4().hex[:8]}"
        self.port = port
        self.rules = EgressRules.parse([f"allowed.test:{port}", f"other.test:{port}"])
        self.ca = KernelCA.create(self.kernel_id, self.rules)
        self.sandbox = Sandbox(self.kernel_id, relay.port, upstreams)
        # What the sandbox trusts: its kernel's CA, and the world's (here the site's test CA).
        self.bundle = tmp / f"{self.kernel_id}.pem"
        self.bundle.write_bytes(self.ca.cert_pem + ca_file.read_bytes())
        settings: dict[str, Any] = {"rules": self.rules, "upstream_cafile": str(ca_file), **changes}
        EgressProxy.instance().add_kernel(
            self.kernel_id,
            relay.socket_path,
            policy(upstreams, **settings),
            self.sandbox.decisions.append,
            ca=self.ca,
            credentials=[self.credential("warehouse")],
        )

    def credential(
        self, name: str, expires_at: float | None = None, header: str = "Authorization"
    ) -> BoundCredential:
        rules = EgressRules.parse([f"allowed.test:{self.port}"])
        return BoundCredential(name, rules, ((header, Secret(f"Bearer {TOKEN}")),), expires_at, "api")

    def session(self) -> requests.Session:
        session = requests.Session()
        session.trust_env = False
        session.proxies = {"https": self.sandbox.proxy_url}
        session.verify = str(self.bundle)
        return session

    def get(self, session: requests.Session, host: str = "allowed.test", **kwargs: Any) -> requests.Response:
        return session.get(f"https://{host}:{self.port}/data", timeout=10, **kwargs)

    def reasons(self, count: int) -> list[str]:
        return [str(d["reason"]) for d in self.sandbox.take(count)]


@pytest.fixture
def kernel(
    relay: Relay, upstreams: Upstreams, site: tuple[TlsUpstream, Path], tmp_path: Path
) -> Iterator[Kernel]:
    server, ca_file = site
    kernel = Kernel(relay, upstreams, server.port, ca_file, tmp_path)
    yield kernel
    EgressProxy.instance().remove_kernel(kernel.kernel_id)
    assert TOKEN not in json.dumps(kernel.sandbox.decisions), "a decision shows the credential"


def received(response: requests.Response) -> dict[str, list[str]]:
    headers: dict[str, list[str]] = {}
    for name, value in response.json()["headers"]:
        headers.setdefault(name, []).append(value)
    return headers


def test_the_credential_is_added_in_place_of_any_the_kernel_sends(kernel: Kernel) -> None:
    with kernel.session() as session:
        response = kernel.get(session, headers={"Authorization": "Bearer forged", "X-Trace": "1"})
    assert response.status_code == 200
    headers = received(response)
    assert headers["authorization"] == [f"Bearer {TOKEN}"]
    assert headers["x-trace"] == ["1"]
    assert headers["host"] == [f"allowed.test:{kernel.port}"]
    connect, request = kernel.reasons(2)
    assert (
        connect
        == f"allowed by 'allowed.test:{kernel.port}'; TLS ends at the proxy, for credentials 'warehouse'"
    )
    assert request == f"allowed by 'allowed.test:{kernel.port}'; credential 'warehouse' added"


def test_requests_on_a_kept_connection_each_get_a_decision(
    kernel: Kernel, site: tuple[TlsUpstream, Path]
) -> None:
    before = site[0].connections
    with kernel.session() as session:
        for _ in range(3):
            assert received(kernel.get(session))["authorization"] == [f"Bearer {TOKEN}"]
    assert site[0].connections - before == 1, "one connection upstream, kept open"
    reasons = kernel.reasons(4)
    assert "TLS ends at the proxy" in reasons[0]
    assert all("credential 'warehouse' added" in reason for reason in reasons[1:])


def test_the_credential_never_goes_to_another_host_named_in_the_tunnel(kernel: Kernel) -> None:
    with kernel.session() as session:
        response = kernel.get(session, headers={"Host": "other.test"})
    assert response.status_code == 421
    assert "its credential goes to allowed.test only" in response.reason
    (connect, refused) = kernel.sandbox.take(2)
    assert connect["verdict"] == "allowed"
    assert refused["verdict"] == "denied"


def test_a_redirect_to_another_host_does_not_take_the_credential_along(kernel: Kernel) -> None:
    target = f"https://other.test:{kernel.port}/data"
    with kernel.session() as session:
        response = session.get(f"https://allowed.test:{kernel.port}/redirect?to={target}", timeout=10)
    assert response.url == target
    assert "authorization" not in received(response)
    reasons = kernel.reasons(3)
    assert "credential 'warehouse' added" in reasons[1], "the request to allowed.test had it"
    assert reasons[2] == f"allowed by 'other.test:{kernel.port}'", "other.test: an opaque tunnel"


def test_a_host_without_a_credential_stays_an_opaque_tunnel(kernel: Kernel) -> None:
    """other.test is allowed but has no credential: its own certificate reaches the kernel."""
    with kernel.session() as session:
        response = kernel.get(session, host="other.test")
        assert "authorization" not in received(response)
    assert kernel.reasons(1) == [f"allowed by 'other.test:{kernel.port}'"]
    context = ssl.create_default_context(cadata=kernel.ca.cert_pem.decode())
    with kernel.sandbox.tunnel("other.test", kernel.port) as sock:
        with pytest.raises(ssl.SSLCertVerificationError):
            context.wrap_socket(sock, server_hostname="other.test")
    kernel.sandbox.take(1)


def test_an_expired_credential_is_not_sent_and_says_when_it_expired(kernel: Kernel) -> None:
    EgressProxy.instance().bind_credential(
        kernel.kernel_id, kernel.credential("warehouse", expires_at=time.time() - 1)
    )
    with kernel.session() as session, pytest.raises(requests.exceptions.ProxyError, match="expired at"):
        kernel.get(session)
    (refused,) = kernel.sandbox.take(1)
    assert refused["verdict"] == "denied"
    assert "credential 'warehouse' expired at" in str(refused["reason"])


def test_a_revoked_credential_stops_on_an_open_connection(kernel: Kernel) -> None:
    with kernel.session() as session:
        assert kernel.get(session).status_code == 200
        assert EgressProxy.instance().revoke_credential(kernel.kernel_id, "warehouse")
        response = kernel.get(session)
    assert response.status_code == 403
    assert "credential 'warehouse' was revoked at" in response.reason
    assert [d["verdict"] for d in kernel.sandbox.take(3)] == ["allowed", "allowed", "denied"]
    assert not EgressProxy.instance().revoke_credential(kernel.kernel_id, "warehouse")


def test_trace_would_echo_the_credential_and_is_refused(kernel: Kernel) -> None:
    with kernel.session() as session:
        response = session.request("TRACE", f"https://allowed.test:{kernel.port}/", timeout=10)
    assert response.status_code == 405
    kernel.sandbox.take(2)


def test_an_upstream_whose_certificate_cannot_be_verified_is_not_sent_the_credential(
    relay: Relay, upstreams: Upstreams, site: tuple[TlsUpstream, Path], tmp_path: Path
) -> None:
    server, ca_file = site
    kernel = Kernel(relay, upstreams, server.port, ca_file, tmp_path, upstream_cafile=None)
    try:
        with kernel.session() as session, pytest.raises(requests.exceptions.ProxyError, match="502"):
            kernel.get(session)
        (refused,) = kernel.sandbox.take(1)
        assert "CERTIFICATE_VERIFY_FAILED" in str(refused["reason"])
    finally:
        EgressProxy.instance().remove_kernel(kernel.kernel_id)


def test_a_credential_needs_the_kernel_s_ca(relay: Relay, upstreams: Upstreams) -> None:
    credential = BoundCredential("w", EgressRules.parse(["allowed.test"]), (("X-Key", Secret("k")),))
    with pytest.raises(ConfigurationError, match="need the kernel's egress CA"):
        EgressProxy.instance().add_kernel(
            "no-ca", relay.socket_path, policy(upstreams), print, credentials=[credential]
        )
    with pytest.raises(ConfigurationError, match="no egress proxy"):
        EgressProxy.instance().bind_credential("unknown-kernel", credential)


def test_the_handshake_shows_the_kernel_its_ca_certificate_never_the_key(kernel: Kernel) -> None:
    context = ssl.create_default_context(cadata=kernel.ca.cert_pem.decode())
    with kernel.sandbox.tunnel("allowed.test", kernel.port) as raw:
        with context.wrap_socket(raw, server_hostname="allowed.test") as tls:
            leaf = tls.getpeercert(binary_form=True) or b""
            tls.sendall(b"GET /data HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
            while tls.recv(65536):
                pass
    assert leaf
    assert b"PRIVATE" not in leaf
    kernel.sandbox.take(2)


def test_the_relay_has_the_kernel_trust_its_ca_besides_what_it_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca_file, theirs, bundle = tmp_path / "egress-ca.pem", tmp_path / "theirs.pem", tmp_path / "bundle.pem"
    ca_file.write_bytes(b"-----BEGIN CERTIFICATE-----\nKERNEL\n-----END CERTIFICATE-----\n")
    theirs.write_bytes(b"-----BEGIN CERTIFICATE-----\nTHEIRS\n-----END CERTIFICATE-----")
    for name in (*test_egress.egress_relay.CA_VARIABLES, "NODE_EXTRA_CA_CERTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(theirs))  # as a kernelspec's env may
    test_egress.egress_relay.trust(str(ca_file), str(bundle))
    assert bundle.read_bytes().count(b"BEGIN CERTIFICATE") == 2
    assert b"THEIRS" in bundle.read_bytes()
    assert all(os.environ[name] == str(bundle) for name in test_egress.egress_relay.CA_VARIABLES)
    assert os.environ["NODE_EXTRA_CA_CERTS"] == str(ca_file)
    for name in test_egress.egress_relay.CA_VARIABLES:
        monkeypatch.delenv(name)
    test_egress.egress_relay.trust(str(ca_file), str(bundle))
    assert bundle.read_bytes().count(b"BEGIN CERTIFICATE") > 10, "the system's CAs, and the kernel's"
