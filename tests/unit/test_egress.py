"""The egress allow-list end to end on real sockets: client -> relay -> host proxy -> upstream.

Upstream servers (plain HTTP, and HTTPS with a trustme test CA) listen on 127.0.0.1; the
relay runs in the foreground as a subprocess on a temporary unix socket; the test names
reach them through the policy's host_map, so nothing here touches the internet or DNS.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
import trustme

from sandbox_kernel.channels.bridge import ipc_in_use
from sandbox_kernel.egress import Decision, DomainRule, EgressPolicy, EgressProxy, EgressRules
from sandbox_kernel.egress import proxy as egress
from sandbox_kernel.egress import relay as egress_relay
from sandbox_kernel.egress.http1 import (
    CHUNKED,
    NO_BODY,
    UNTIL_CLOSE,
    Framing,
    FramingError,
    chunk_size,
    closing_response_head,
    request_framing,
    response_framing,
    response_status,
)
from sandbox_kernel.egress.tls import IncompleteHello, client_hello_sni
from sandbox_kernel.errors import ConfigurationError

from ..upstreams import KeepAliveUpstream

RELAY = Path(egress_relay.__file__)
HOST_MAP = {
    "allowed.test": "127.0.0.1",
    "other.test": "127.0.0.1",
    "wild.test": "127.0.0.1",
    "a.wild.test": "127.0.0.1",
    "deep.a.wild.test": "127.0.0.1",
    "evilwild.test": "127.0.0.1",
    "loopback2.test": "127.0.0.2",
    "private.test": "10.0.0.1",
    "metadata.test": "169.254.169.254",
    "mapped.test": "::ffff:127.0.0.2",
    "multicast.test": "224.0.0.1",
    "sixtofour.test": "2002:a00:1::1",
}
NON_PUBLIC = {
    "loopback2.test": "127.0.0.2",
    "private.test": "10.0.0.1",
    "metadata.test": "169.254.169.254",
    "mapped.test": "::ffff:127.0.0.2",
    "multicast.test": "224.0.0.1",
    "sixtofour.test": "2002:a00:1::1",
}


# --- upstream servers -------------------------------------------------------------------


class Echo(BaseHTTPRequestHandler):
    """Answers every request with what it received, as JSON."""

    def reply(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length).decode() if length else ""
        payload = {
            "method": self.command,
            "path": self.path,
            "headers": [[name.lower(), value] for name, value in self.headers.items()],
            "body": body,
        }
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = reply

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Upstream(ThreadingHTTPServer):
    """An echo server on 127.0.0.1; with a context, TLS is set up in the request's thread."""

    daemon_threads = True

    def __init__(self, context: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), Echo)
        self.context = context
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(10)
        if self.context is not None:
            request = self.context.wrap_socket(request, server_side=True)
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Tests cut connections on purpose: no tracebacks."""

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


@dataclass(frozen=True)
class Upstreams:
    http: int
    https: int
    ca_file: Path
    client_context: ssl.SSLContext
    keepalive: KeepAliveUpstream


@pytest.fixture(scope="module")
def upstreams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstreams]:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("allowed.test", "other.test", "*.wild.test").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    ca_file = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    plain, tls, keepalive = Upstream(), Upstream(server_context), KeepAliveUpstream()
    yield Upstreams(plain.port, tls.port, ca_file, client_context, keepalive)
    plain.stop()
    tls.stop()
    keepalive.stop()


@pytest.fixture
def keepalive(upstreams: Upstreams) -> KeepAliveUpstream:
    """The keep-alive upstream (allowed.test on its port), with nothing seen yet."""
    upstreams.keepalive.seen.clear()
    return upstreams.keepalive


# --- the relay and the kernel's registration ---------------------------------------------


@dataclass
class Relay:
    socket_path: Path
    port: int
    process: subprocess.Popen[str]


@pytest.fixture
def relay_dir() -> Iterator[Path]:
    """A short folder: unix socket paths are limited to about 100 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="sk-egress-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def start_relay(socket_path: Path) -> Relay:
    process = subprocess.Popen(
        [sys.executable, str(RELAY), str(socket_path), "0"], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    return Relay(socket_path, int(process.stdout.readline()), process)


def stop_relay(relay: Relay) -> None:
    relay.process.terminate()
    relay.process.wait(timeout=5)
    assert relay.process.stdout is not None
    relay.process.stdout.close()


@pytest.fixture
def relay(relay_dir: Path) -> Iterator[Relay]:
    relay = start_relay(relay_dir / "egress.sock")
    yield relay
    stop_relay(relay)


@dataclass
class Sandbox:
    """A registered kernel as its code sees the network: a proxy on 127.0.0.1:port."""

    kernel_id: str
    port: int
    upstreams: Upstreams
    decisions: list[Decision] = field(default_factory=list)
    seen: int = 0

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def take(self, count: int = 1) -> list[Decision]:
        """The next ``count`` decisions: there must be exactly that many new ones."""
        deadline = time.monotonic() + 5
        while len(self.decisions) < self.seen + count and time.monotonic() < deadline:
            time.sleep(0.01)
        new = self.decisions[self.seen :]
        self.seen = len(self.decisions)
        assert len(new) == count, new
        return new

    def decision(self) -> Decision:
        return self.take()[0]

    def opener(self) -> urllib.request.OpenerDirector:
        return urllib.request.build_opener(
            urllib.request.ProxyHandler({"http": self.proxy_url, "https": self.proxy_url}),
            urllib.request.HTTPSHandler(context=self.upstreams.client_context),
        )

    def get(self, url: str) -> dict[str, Any]:
        with self.opener().open(url, timeout=10) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result

    def session(self) -> requests.Session:
        session = requests.Session()
        session.trust_env = False
        session.proxies = {"http": self.proxy_url, "https": self.proxy_url}
        session.verify = str(self.upstreams.ca_file)
        return session

    def raw(self, data: bytes, timeout: float = 10) -> bytes:
        """Send ``data`` to the proxy and return everything it answers until it closes."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
            sock.sendall(data)
            return read_all(sock)

    def tunnel(self, host: str, port: int) -> socket.socket:
        """A socket through which CONNECT host:port succeeded."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(1)
            assert chunk, head
            head += chunk
        assert head.startswith(b"HTTP/1.1 200 "), head
        return sock


def read_all(sock: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def rules(upstreams: Upstreams) -> EgressRules:
    http, https = upstreams.http, upstreams.https
    return EgressRules.parse(
        [
            f"allowed.test:{http}",
            f"allowed.test:{https}",
            f"allowed.test:{upstreams.keepalive.port}",
            f"other.test:{https}",
            f"*.wild.test:{http}",
            *(f"{name}:{http}" for name in NON_PUBLIC),
        ]
    )


def policy(upstreams: Upstreams, **changes: Any) -> EgressPolicy:
    settings: dict[str, Any] = {
        "rules": rules(upstreams),
        "host_map": HOST_MAP,
        "private_networks": ("127.0.0.1/32",),
        "connect_timeout": 5.0,
    }
    return EgressPolicy(**{**settings, **changes})


def register(relay: Relay, upstreams: Upstreams, **changes: Any) -> Sandbox:
    sandbox = Sandbox(f"test-{uuid.uuid4().hex[:8]}", relay.port, upstreams)
    EgressProxy.instance().add_kernel(
        sandbox.kernel_id, relay.socket_path, policy(upstreams, **changes), sandbox.decisions.append
    )
    return sandbox


@pytest.fixture
def sandbox(relay: Relay, upstreams: Upstreams) -> Iterator[Sandbox]:
    sandbox = register(relay, upstreams)
    yield sandbox
    started = time.monotonic()
    EgressProxy.instance().remove_kernel(sandbox.kernel_id)
    assert time.monotonic() - started < 1, "removing a kernel closes its connections at once"
    assert sandbox.decisions[sandbox.seen :] == [], "every request gives exactly one decision"


def expected(sandbox: Sandbox, **fields: Any) -> Decision:
    return {"kernel_id": sandbox.kernel_id, "address": None, **fields}


def status_line(response: bytes) -> str:
    return response.split(b"\r\n", 1)[0].decode("ascii")


# --- allowed traffic ---------------------------------------------------------------------


def test_allowed_plain_http_arrives_with_the_host_header_rewritten(sandbox: Sandbox) -> None:
    port = sandbox.upstreams.http
    echoed = sandbox.get(f"http://allowed.test:{port}/path/x?q=1")
    assert echoed["method"] == "GET"
    assert echoed["path"] == "/path/x?q=1"
    headers = dict(echoed["headers"])
    assert headers["host"] == f"allowed.test:{port}"
    assert headers["connection"] == "close"
    assert sandbox.decision() == expected(
        sandbox,
        method="GET",
        host="allowed.test",
        port=port,
        verdict="allowed",
        reason=f"allowed by 'allowed.test:{port}'",
        address="127.0.0.1",
    )


def test_plain_http_cannot_front_another_domain_or_leak_proxy_headers(sandbox: Sandbox) -> None:
    port = sandbox.upstreams.http
    request = (
        f"GET http://allowed.test:{port}/ HTTP/1.1\r\n"
        "Host: evil.test\r\n"
        "Proxy-Authorization: Basic c2VjcmV0\r\n"
        "Proxy-Connection: keep-alive\r\n"
        "Connection: keep-alive\r\n"
        "Keep-Alive: timeout=5\r\n"
        "X-Kept: yes\r\n\r\n"
    )
    response = sandbox.raw(request.encode())
    assert status_line(response) == "HTTP/1.0 200 OK"
    headers = json.loads(response.split(b"\r\n\r\n", 1)[1])["headers"]
    assert ["host", f"allowed.test:{port}"] in headers
    names = [name for name, _ in headers]
    assert names.count("host") == 1
    assert not {"proxy-authorization", "proxy-connection", "keep-alive"} & set(names)
    assert ["connection", "close"] in headers
    assert ["x-kept", "yes"] in headers
    assert sandbox.decision()["verdict"] == "allowed"


def test_a_request_body_is_passed_on(sandbox: Sandbox) -> None:
    url = f"http://allowed.test:{sandbox.upstreams.http}/upload"
    with sandbox.session() as session:
        response = session.post(url, data="x" * 100_000, timeout=10)
    assert response.status_code == 200
    assert response.json()["body"] == "x" * 100_000
    assert sandbox.decision()["method"] == "POST"


def test_allowed_https_passes_through_a_connect_tunnel(sandbox: Sandbox) -> None:
    port = sandbox.upstreams.https
    echoed = sandbox.get(f"https://allowed.test:{port}/secure")
    assert echoed["path"] == "/secure"
    assert sandbox.decision() == expected(
        sandbox,
        method="CONNECT",
        host="allowed.test",
        port=port,
        verdict="allowed",
        reason=f"allowed by 'allowed.test:{port}'",
        address="127.0.0.1",
    )
    with sandbox.session() as session:
        response = session.get(f"https://other.test:{port}/with-requests", timeout=10)
    assert response.json()["path"] == "/with-requests"
    assert sandbox.decision()["host"] == "other.test"


# --- denied by the rules -----------------------------------------------------------------


def test_a_domain_not_allowed_is_denied_with_the_reason_in_the_status_line(sandbox: Sandbox) -> None:
    port = sandbox.upstreams.https
    reason = f"sandbox-kernel egress denied: evil.test:{port} is not in this kernel's allowed domains"
    with pytest.raises(urllib.error.URLError, match=f"Tunnel connection failed: 403 {reason}"):
        sandbox.get(f"https://evil.test:{port}/")
    assert sandbox.decision() == expected(
        sandbox,
        method="CONNECT",
        host="evil.test",
        port=port,
        verdict="denied",
        reason=f"evil.test:{port} is not in this kernel's allowed domains",
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        sandbox.get(f"http://evil.test:{sandbox.upstreams.http}/")
    assert info.value.code == 403
    assert "is not in this kernel's allowed domains" in info.value.reason
    assert info.value.read().decode().startswith("sandbox-kernel egress denied: evil.test:")
    assert sandbox.decision()["method"] == "GET"
    with sandbox.session() as session, pytest.raises(requests.exceptions.ProxyError, match="egress denied"):
        session.get(f"https://evil.test:{port}/", timeout=10)
    assert sandbox.decision()["verdict"] == "denied"


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("a.wild.test", True),
        ("deep.a.wild.test", True),
        ("A.Wild.Test.", True),
        ("wild.test", False),
        ("evilwild.test", False),
    ],
)
def test_a_wildcard_allows_subdomains_at_any_depth_but_not_the_apex(
    sandbox: Sandbox, host: str, allowed: bool
) -> None:
    url = f"http://{host}:{sandbox.upstreams.http}/"
    if allowed:
        assert sandbox.get(url)["path"] == "/"
    else:
        with pytest.raises(urllib.error.HTTPError, match="not in this kernel's allowed domains"):
            sandbox.get(url)
    decision = sandbox.decision()
    assert decision["verdict"] == ("allowed" if allowed else "denied")
    assert decision["host"] == host.lower().rstrip(".")


def test_an_allowed_domain_on_another_port_is_denied(sandbox: Sandbox) -> None:
    port = sandbox.upstreams.http
    with pytest.raises(urllib.error.HTTPError, match=f"other.test:{port} is not in"):
        sandbox.get(f"http://other.test:{port}/")
    assert sandbox.decision()["port"] == port


@pytest.mark.parametrize(
    "target",
    [
        "CONNECT 127.0.0.1:{https}",
        "CONNECT [::1]:{https}",
        "CONNECT 2130706433:{https}",
        "GET http://127.0.0.1:{http}/",
    ],
)
def test_ip_literals_are_denied(sandbox: Sandbox, target: str) -> None:
    line = target.format(http=sandbox.upstreams.http, https=sandbox.upstreams.https)
    response = sandbox.raw(f"{line} HTTP/1.1\r\n\r\n".encode())
    assert status_line(response) == (
        "HTTP/1.1 403 sandbox-kernel egress denied: IP literals are not allowed; use a domain name"
    )
    decision = sandbox.decision()
    assert decision["verdict"] == "denied"
    assert decision["reason"] == "IP literals are not allowed; use a domain name"
    assert decision["method"] == line.split()[0]


@pytest.mark.parametrize(("host", "address"), NON_PUBLIC.items())
def test_names_resolving_to_non_public_addresses_are_denied(
    sandbox: Sandbox, host: str, address: str
) -> None:
    port = sandbox.upstreams.http
    with pytest.raises(urllib.error.HTTPError, match="non-public address") as info:
        sandbox.get(f"http://{host}:{port}/")
    assert info.value.code == 403
    assert sandbox.decision() == expected(
        sandbox,
        method="GET",
        host=host,
        port=port,
        verdict="denied",
        reason=f"{host} resolves to a non-public address {ipaddress.ip_address(address)}",
    )


# --- what a CONNECT tunnel may carry -----------------------------------------------------


def test_a_tls_server_name_other_than_the_connect_host_is_cut_off(sandbox: Sandbox) -> None:
    port = sandbox.upstreams.https
    sock = sandbox.tunnel("allowed.test", port)
    # other.test is allowed too: the name must match the tunnel's host, not just any rule.
    with sock, pytest.raises((ssl.SSLError, ConnectionResetError)):
        sandbox.upstreams.client_context.wrap_socket(sock, server_hostname="other.test")
    assert sandbox.decision() == expected(
        sandbox,
        method="CONNECT",
        host="allowed.test",
        port=port,
        verdict="denied",
        reason="TLS SNI 'other.test' does not match the requested host 'allowed.test'",
        address="127.0.0.1",
    )


def test_a_tunnel_carrying_anything_but_tls_is_cut_off(sandbox: Sandbox) -> None:
    with sandbox.tunnel("allowed.test", sandbox.upstreams.https) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        assert read_all(sock) == b""
    decision = sandbox.decision()
    assert decision["verdict"] == "denied"
    assert decision["reason"] == "no TLS ClientHello with SNI: only TLS may pass a CONNECT tunnel"


def test_removing_the_kernel_closes_its_open_tunnels(sandbox: Sandbox) -> None:
    sock = sandbox.tunnel("allowed.test", sandbox.upstreams.https)
    with sandbox.upstreams.client_context.wrap_socket(sock, server_hostname="allowed.test") as tls:
        assert sandbox.decision()["verdict"] == "allowed"
        started = time.monotonic()
        EgressProxy.instance().remove_kernel(sandbox.kernel_id)
        with contextlib.suppress(OSError):
            assert tls.recv(1) == b""
        assert time.monotonic() - started < 3
    EgressProxy.instance().remove_kernel(sandbox.kernel_id)  # idempotent


def test_a_half_closed_request_still_gets_its_response(sandbox: Sandbox) -> None:
    request = (
        f"POST http://allowed.test:{sandbox.upstreams.http}/half HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"
    )
    with socket.create_connection(("127.0.0.1", sandbox.port), timeout=10) as sock:
        sock.sendall(request.encode())
        sock.shutdown(socket.SHUT_WR)
        response = read_all(sock)
    assert status_line(response) == "HTTP/1.0 200 OK"
    assert json.loads(response.split(b"\r\n\r\n", 1)[1])["body"] == "hello"
    assert sandbox.decision()["verdict"] == "allowed"


# --- one request per connection ---------------------------------------------------------

SMUGGLED = "GET /smuggled HTTP/1.1\r\nHost: evil.internal\r\n\r\n"


def response_head(response: bytes) -> tuple[str, dict[str, str]]:
    """The status line and the (lowercased) header fields of the first response in ``response``."""
    lines = response.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    fields = (line.partition(":") for line in lines[1:])
    return lines[0], {name.strip().lower(): value.strip() for name, _, value in fields}


def further_request(sandbox: Sandbox, host: str, port: int) -> Decision:
    return expected(
        sandbox,
        method="GET",
        host=host,
        port=port,
        verdict="denied",
        reason=egress.ONE_REQUEST_PER_CONNECTION,
    )


@pytest.mark.parametrize(
    ("second", "host", "port"),
    [
        (SMUGGLED, "evil.internal", 80),
        ("GET http://evil.test:{port}/smuggled HTTP/1.1\r\nHost: evil.test\r\n\r\n", "evil.test", None),
        # even an allowed one: every request is checked and logged on its own connection
        (
            "GET http://allowed.test:{port}/smuggled HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
            "allowed.test",
            None,
        ),
    ],
)
def test_a_request_pipelined_behind_an_allowed_one_never_reaches_the_upstream(
    sandbox: Sandbox, keepalive: KeepAliveUpstream, second: str, host: str, port: int | None
) -> None:
    """The attack of issue #8: a second request in the same write as an allowed one."""
    first = f"GET http://allowed.test:{keepalive.port}/first HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    started = time.monotonic()
    response = sandbox.raw((first + second.format(port=keepalive.port)).encode())
    assert keepalive.paths() == ["/first"]
    assert response.count(b"HTTP/1.1 200 OK") == 1, response
    status, fields = response_head(response)
    assert status == "HTTP/1.1 200 OK"
    assert fields["connection"] == "close"
    assert json.loads(response.split(b"\r\n\r\n", 1)[1])["path"] == "/first"
    assert time.monotonic() - started < 3, "closed at the end of the response, not when the upstream is"
    first_decision, second_decision = sandbox.take(2)
    assert first_decision["verdict"] == "allowed"
    assert second_decision == further_request(sandbox, host, port or keepalive.port)


def test_a_keep_alive_client_sends_each_request_on_its_own_checked_connection(
    sandbox: Sandbox, keepalive: KeepAliveUpstream
) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", sandbox.port, timeout=10)
    try:
        connection.request("GET", f"http://allowed.test:{keepalive.port}/first")
        first = connection.getresponse()
        assert json.loads(first.read())["path"] == "/first"
        assert first.getheader("Connection") == "close"
        connection.request("GET", f"http://evil.test:{keepalive.port}/smuggled")
        second = connection.getresponse()
        second.read()
    finally:
        connection.close()
    assert second.status == 403
    assert keepalive.paths() == ["/first"]
    assert [(d["host"], d["verdict"]) for d in sandbox.take(2)] == [
        ("allowed.test", "allowed"),
        ("evil.test", "denied"),
    ]


@pytest.mark.parametrize(
    ("version", "framing", "reason"),
    [
        (
            "1.1",
            "Content-Length: 5\r\nTransfer-Encoding: chunked",
            "both Content-Length and Transfer-Encoding",
        ),
        (
            "1.1",
            "Transfer-Encoding: chunked\r\nContent-Length: 5",
            "both Content-Length and Transfer-Encoding",
        ),
        (
            "1.1",
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
            "more than one Transfer-Encoding",
        ),
        ("1.1", "Transfer-Encoding: gzip, chunked", "Transfer-Encoding 'gzip, chunked' is not supported"),
        ("1.1", "Transfer-Encoding: xchunked", "Transfer-Encoding 'xchunked' is not supported"),
        ("1.1", "Transfer-Encoding: chunked, identity", "is not supported"),
        ("1.0", "Transfer-Encoding: chunked", "Transfer-Encoding in an HTTP/1.0 request"),
        ("1.1", "Content-Length: 5\r\nContent-Length: 6", "more than one Content-Length"),
        ("1.1", "Content-Length: 5\r\nContent-Length: 5", "more than one Content-Length"),
        ("1.1", "Content-Length: 5, 5", "Content-Length '5, 5' is not a number of bytes"),
        ("1.1", "Content-Length: -1", "is not a number of bytes"),
        ("1.1", "Content-Length: +5", "is not a number of bytes"),
        ("1.1", "Content-Length: 0x5", "is not a number of bytes"),
        ("1.1", "Content-Length: 99999999999999999999", "is not a number of bytes"),
    ],
)
def test_requests_with_ambiguous_framing_are_refused(
    sandbox: Sandbox, keepalive: KeepAliveUpstream, version: str, framing: str, reason: str
) -> None:
    request = (
        f"POST http://allowed.test:{keepalive.port}/ambiguous HTTP/{version}\r\n{framing}\r\n\r\n"
        f"0\r\n\r\n{SMUGGLED}"
    )
    response = sandbox.raw(request.encode())
    assert status_line(response).startswith("HTTP/1.1 400 sandbox-kernel egress denied: "), response
    assert keepalive.seen == []
    decision = sandbox.decision()
    assert decision["verdict"] == "denied"
    assert reason in decision["reason"]
    assert decision["host"] == "allowed.test"


@pytest.mark.parametrize(
    ("framing", "body"),
    [
        ("Content-Length: 5", "hello"),
        ("Transfer-Encoding: chunked", "2;ext=1\r\nhe\r\n3\r\nllo\r\n0\r\nX-Trailer: t\r\n\r\n"),
        ("Transfer-Encoding: Chunked", "5\nhello\n0\n\n"),
    ],
)
def test_only_the_body_its_framing_announces_is_forwarded(
    sandbox: Sandbox, keepalive: KeepAliveUpstream, framing: str, body: str
) -> None:
    request = (
        f"POST http://allowed.test:{keepalive.port}/upload HTTP/1.1\r\n{framing}\r\n\r\n{body}{SMUGGLED}"
    )
    response = sandbox.raw(request.encode())
    assert status_line(response) == "HTTP/1.1 200 OK"
    (seen,) = keepalive.seen
    assert seen["body"] == "hello"
    if "chunked" in framing.lower():
        # passed on re-framed, without extensions or trailers
        assert ["transfer-encoding", "chunked"] in seen["headers"]
    allowed, further = sandbox.take(2)
    assert allowed["verdict"] == "allowed"
    assert further == further_request(sandbox, "evil.internal", 80)


def test_a_malformed_chunked_body_cuts_the_connection(sandbox: Sandbox, keepalive: KeepAliveUpstream) -> None:
    request = (
        f"POST http://allowed.test:{keepalive.port}/upload HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        f"5\r\nhello\r\nzz\r\n\r\n{SMUGGLED}"
    )
    sandbox.raw(request.encode())
    assert keepalive.paths() in ([], ["/upload"])  # the head may be there; the smuggled request never
    assert sandbox.decision()["verdict"] == "allowed"


def test_expect_100_continue_passes_through(sandbox: Sandbox, keepalive: KeepAliveUpstream) -> None:
    head = (
        f"POST http://allowed.test:{keepalive.port}/upload HTTP/1.1\r\n"
        "Content-Length: 5\r\nExpect: 100-continue\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", sandbox.port), timeout=10) as sock:
        sock.sendall(head.encode())
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += sock.recv(1)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"hello")
        response = read_all(sock)
    assert status_line(response) == "HTTP/1.1 200 OK"
    assert json.loads(response.split(b"\r\n\r\n", 1)[1])["body"] == "hello"
    assert sandbox.decision()["verdict"] == "allowed"


def test_no_body_is_forwarded_after_the_upstream_answered(
    sandbox: Sandbox, keepalive: KeepAliveUpstream
) -> None:
    """An upstream answering before it read the body (417 to Expect: 100-continue) and
    reading on would take the body for a request: the body is dropped instead."""
    head = (
        f"POST http://allowed.test:{keepalive.port}/early HTTP/1.1\r\n"
        f"Content-Length: {len(SMUGGLED)}\r\nExpect: 100-continue\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", sandbox.port), timeout=10) as sock:
        sock.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(1)
        assert answer.startswith(b"HTTP/1.1 417 ")
        with contextlib.suppress(OSError):
            sock.sendall(SMUGGLED.encode())
            read_all(sock)
    time.sleep(0.5)
    assert keepalive.paths() == ["/early"]
    assert sandbox.decision()["verdict"] == "allowed"


@pytest.mark.parametrize(("method", "path"), [("GET", "/plain"), ("HEAD", "/plain"), ("GET", "/chunked")])
def test_the_connection_closes_when_the_response_ends(
    sandbox: Sandbox, keepalive: KeepAliveUpstream, method: str, path: str
) -> None:
    """However long the upstream keeps its connection open."""
    started = time.monotonic()
    response = sandbox.raw(f"{method} http://allowed.test:{keepalive.port}{path} HTTP/1.1\r\n\r\n".encode())
    assert time.monotonic() - started < 3
    status, fields = response_head(response)
    assert status == "HTTP/1.1 200 OK"
    assert fields["connection"] == "close"
    body = response.split(b"\r\n\r\n", 1)[1]
    if method == "HEAD":
        assert body == b""
    elif path == "/chunked":
        assert fields["transfer-encoding"] == "chunked"
        assert body.endswith(b"\r\n0\r\n\r\n")
        assert b'"path": "/chunked"' in body
    else:
        assert json.loads(body)["path"] == "/plain"
    assert sandbox.decision()["verdict"] == "allowed"


@pytest.mark.parametrize("setting", ["HEAD_TIMEOUT", "CLIENT_HELLO_TIMEOUT", "IDLE_TIMEOUT"])
def test_silent_clients_are_cut_off(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    monkeypatch.setattr(egress, setting, 0.3)
    started = time.monotonic()
    if setting == "HEAD_TIMEOUT":
        with socket.create_connection(("127.0.0.1", sandbox.port), timeout=10) as sock:
            sock.sendall(b"GET http://allowed.test/ HTTP/1.1\r\n")
            assert read_all(sock) == b""
        reason = "the request head did not arrive within 0.3 s"
    elif setting == "CLIENT_HELLO_TIMEOUT":
        with sandbox.tunnel("allowed.test", sandbox.upstreams.https) as sock:
            assert read_all(sock) == b""
        reason = "no TLS ClientHello with SNI: only TLS may pass a CONNECT tunnel (none within 0.3 s)"
    else:
        sock = sandbox.tunnel("allowed.test", sandbox.upstreams.https)
        with sandbox.upstreams.client_context.wrap_socket(sock, server_hostname="allowed.test") as tls:
            assert tls.recv(1) == b""
        reason = f"allowed by 'allowed.test:{sandbox.upstreams.https}'"
    assert time.monotonic() - started < 3
    assert sandbox.decision()["reason"] == reason


# --- malformed requests ------------------------------------------------------------------


def test_an_oversized_request_head_is_refused(sandbox: Sandbox) -> None:
    request = f"GET http://allowed.test:{sandbox.upstreams.http}/ HTTP/1.1\r\nX-Big: {'a' * 20_000}\r\n\r\n"
    response = sandbox.raw(request.encode())
    assert status_line(response).startswith("HTTP/1.1 431 sandbox-kernel egress denied: the request head is")
    assert sandbox.decision() == expected(
        sandbox,
        method="",
        host="",
        port=None,
        verdict="denied",
        reason="the request head is larger than 16 KiB",
    )


@pytest.mark.parametrize(
    ("request_bytes", "method", "reason"),
    [
        (b"\x16\x03\x01\x02\x00garbage\r\n\r\n", "", "not an HTTP/1.x proxy request"),
        (b"HELLO\r\n\r\n", "", "not an HTTP/1.x proxy request: 'HELLO'"),
        (b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n", "GET", "not a proxy request"),
        (b"GET https://allowed.test/ HTTP/1.1\r\n\r\n", "GET", "only http:// URLs are proxied"),
        (b"GET http://allowed.test/ HTTP/1.1\r\nBad header\r\n\r\n", "GET", "malformed header line"),
        (b"CONNECT allowed.test HTTP/1.1\r\n\r\n", "CONNECT", "does not end with a port"),
        (b"CONNECT allowed.test:99999 HTTP/1.1\r\n\r\n", "CONNECT", "does not end with a port"),
        (b"CONNECT bad\x7fname.test:443 HTTP/1.1\r\n\r\n", "", "not an HTTP/1.x proxy request"),
        (b"CONNECT bad_-.test:443 HTTP/1.1\r\n\r\n", "CONNECT", "is not a valid host name"),
    ],
)
def test_malformed_requests_get_400(sandbox: Sandbox, request_bytes: bytes, method: str, reason: str) -> None:
    response = sandbox.raw(request_bytes)
    assert status_line(response).startswith("HTTP/1.1 400 sandbox-kernel egress denied: ")
    decision = sandbox.decision()
    assert decision["verdict"] == "denied"
    assert decision["method"] == method
    assert reason in decision["reason"]
    assert decision["reason"].isascii()
    assert decision["reason"].isprintable()


# --- the pool, failures, and the relay ---------------------------------------------------


def test_a_relay_without_the_host_proxy_fails_closed_with_503(relay: Relay) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as sock:
        sock.sendall(b"CONNECT allowed.test:443 HTTP/1.1\r\n\r\n")
        response = read_all(sock)
    assert response == egress_relay.UNAVAILABLE
    assert 4 < time.monotonic() - started < 8


def test_the_proxy_keeps_dialing_until_the_relay_comes_up(relay_dir: Path, upstreams: Upstreams) -> None:
    socket_path = relay_dir / "egress.sock"
    sandbox = Sandbox(f"test-{uuid.uuid4().hex[:8]}", 0, upstreams)
    EgressProxy.instance().add_kernel(
        sandbox.kernel_id, socket_path, policy(upstreams), sandbox.decisions.append
    )
    try:
        time.sleep(0.5)
        relay = start_relay(socket_path)
        try:
            sandbox.port = relay.port
            assert sandbox.get(f"http://allowed.test:{upstreams.http}/late")["path"] == "/late"
        finally:
            stop_relay(relay)
    finally:
        EgressProxy.instance().remove_kernel(sandbox.kernel_id)
    assert sandbox.decision()["verdict"] == "allowed"


def test_the_proxy_does_not_follow_a_symlink_in_place_of_the_relay_socket(
    relay_dir: Path, upstreams: Upstreams
) -> None:
    """The sandbox owns the socket's folder: a link there must not lead to a host socket."""
    proxy = EgressProxy.instance()
    with socket.socket(socket.AF_UNIX) as host_service:
        host_service.bind(str(relay_dir / "host-service.sock"))
        host_service.listen()
        host_service.settimeout(0.5)
        (relay_dir / "egress.sock").symlink_to(relay_dir / "host-service.sock")
        proxy.add_kernel("test-symlink", relay_dir / "egress.sock", policy(upstreams), lambda d: None)
        try:
            with pytest.raises(TimeoutError):
                host_service.accept()
        finally:
            proxy.remove_kernel("test-symlink")
        # The same socket named directly is dialed: the refusal above was the link's.
        proxy.add_kernel("test-symlink", relay_dir / "host-service.sock", policy(upstreams), lambda d: None)
        try:
            host_service.accept()[0].close()
        finally:
            proxy.remove_kernel("test-symlink")


def test_active_connections_are_capped_per_kernel(relay: Relay, upstreams: Upstreams) -> None:
    sandbox = register(relay, upstreams, max_connections=2)
    try:
        held = [sandbox.tunnel("allowed.test", upstreams.https) for _ in range(2)]
        assert sandbox.raw(f"CONNECT allowed.test:{upstreams.https} HTTP/1.1\r\n\r\n".encode()) == (
            egress_relay.UNAVAILABLE
        )
    finally:
        EgressProxy.instance().remove_kernel(sandbox.kernel_id)
    for sock in held:
        sock.close()
    assert [d["reason"] for d in sandbox.decisions] == ["egress for this kernel was stopped"] * 2


def test_a_failing_decision_callback_does_not_break_the_proxy(
    relay: Relay, upstreams: Upstreams, caplog: pytest.LogCaptureFixture
) -> None:
    def explode(decision: Decision) -> None:
        raise RuntimeError("audit log is full")

    kernel_id = f"test-{uuid.uuid4().hex[:8]}"
    EgressProxy.instance().add_kernel(kernel_id, relay.socket_path, policy(upstreams), explode)
    sandbox = Sandbox(kernel_id, relay.port, upstreams)
    try:
        assert sandbox.get(f"http://allowed.test:{upstreams.http}/")["path"] == "/"
    finally:
        EgressProxy.instance().remove_kernel(kernel_id)
    assert "decision callback" in caplog.text


def test_the_relay_reports_a_port_in_use_before_running_the_command(relay_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        marker = relay_dir / "ran"
        result = subprocess.run(
            [
                sys.executable,
                str(RELAY),
                str(relay_dir / "e.sock"),
                str(busy.getsockname()[1]),
                "--",
                "touch",
                str(marker),
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    assert result.returncode == 1
    assert "egress relay: cannot listen on 127.0.0.1:" in result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("args", [[], ["only-a-path"], ["p", "port"], ["p", "70000"], ["p", "0", "--"]])
def test_the_relay_refuses_bad_arguments(args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, str(RELAY), *args], capture_output=True, text=True, timeout=10, check=False
    )
    assert result.returncode == 2
    assert "usage: egress_relay.py SOCKET_PATH PORT" in result.stderr


def test_the_relay_daemonizes_and_execs_the_command(relay_dir: Path) -> None:
    socket_path = relay_dir / "egress.sock"
    check = "import os, sys; print(os.getpid()); print(os.path.exists(sys.argv[1]))"
    process = subprocess.Popen(
        [
            sys.executable,
            str(RELAY),
            str(socket_path),
            "0",
            "--",
            sys.executable,
            "-c",
            check,
            str(socket_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    output, _ = process.communicate(timeout=10)
    daemons = [
        int(pid)
        for pid in os.listdir("/proc")
        if pid.isdigit() and str(socket_path).encode() in _cmdline(pid) and int(pid) != process.pid
    ]
    try:
        assert process.returncode == 0
        assert output.split() == [str(process.pid), "True"], "the command replaced the relay's process"
        assert len(daemons) == 1
        assert os.getsid(daemons[0]) != os.getsid(0)
        with socket.socket(socket.AF_UNIX) as host_side:
            host_side.connect(str(socket_path))
    finally:
        for pid in daemons:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while any(_running(pid) for pid in daemons) and time.monotonic() < deadline:
            time.sleep(0.01)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# --- HTTP/1.x framing -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "headers", "framing"),
    [
        ("1.1", [], NO_BODY),
        ("1.1", [("Content-Length", "0")], Framing("length", 0)),
        ("1.0", [("content-length", "12")], Framing("length", 12)),
        ("1.1", [("Transfer-Encoding", "chunked")], CHUNKED),
        ("1.1", [("transfer-encoding", "CHUNKED")], CHUNKED),
    ],
)
def test_request_framing(version: str, headers: list[tuple[str, str]], framing: Framing) -> None:
    assert request_framing(version, headers) == framing


@pytest.mark.parametrize(
    ("method", "head", "framing"),
    [
        ("GET", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", Framing("length", 5)),
        ("GET", b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\n", Framing("length", 5)),
        ("GET", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", UNTIL_CLOSE),
        ("GET", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 5\r\n\r\n", CHUNKED),
        ("GET", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", UNTIL_CLOSE),
        ("GET", b"HTTP/1.0 200 OK\r\n\r\n", UNTIL_CLOSE),
        ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", NO_BODY),
        ("GET", b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n", NO_BODY),
        ("GET", b"HTTP/1.1 304 Not Modified\r\n\r\n", NO_BODY),
        ("GET", b"HTTP/1.1 101 Switching Protocols\r\n\r\n", UNTIL_CLOSE),
    ],
)
def test_response_framing(method: str, head: bytes, framing: Framing) -> None:
    assert response_framing(method, response_status(head), head) == framing


def test_a_response_head_is_made_to_close_the_connection() -> None:
    head = (
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive,\r\n Upgrade\r\nKeep-Alive: timeout=5\r\n"
        b"X-Folded: a\r\n\tb\r\nContent-Length: 2\r\n\r\n"
    )
    assert closing_response_head(head) == (
        b"HTTP/1.1 200 OK\r\nX-Folded: a\r\n\tb\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
    )
    with pytest.raises(FramingError, match=r"not an HTTP/1\.x response"):
        response_status(b"SSH-2.0-OpenSSH\r\n\r\n")


@pytest.mark.parametrize(("line", "size"), [(b"0", 0), (b"1a", 26), (b"FF ; name=value", 255), (b"5;x", 5)])
def test_chunk_sizes(line: bytes, size: int) -> None:
    assert chunk_size(line) == size


@pytest.mark.parametrize("line", [b"", b"-1", b"0x5", b"zz", b"1" * 16, b"+5"])
def test_malformed_chunk_sizes_are_refused(line: bytes) -> None:
    with pytest.raises(FramingError, match="malformed chunk size line"):
        chunk_size(line)


# --- rules and policies ------------------------------------------------------------------


def test_patterns_are_normalized_and_deduplicated() -> None:
    parsed = EgressRules.parse(["Docs.Python.org.", " *.PyPI.org:443 ", "docs.python.org", "x_y.example"])
    assert parsed.patterns == ("docs.python.org", "*.pypi.org:443", "x_y.example")
    assert parsed.rules[1] == DomainRule("pypi.org", wildcard=True, port=443)


def test_rules_match_hosts_and_ports() -> None:
    parsed = EgressRules.parse(["docs.python.org", "*.example.org:8443"])
    assert parsed.allows("docs.python.org", 443)
    assert parsed.allows("DOCS.python.org.", 80)
    assert not parsed.allows("docs.python.org", 8080)
    assert not parsed.allows("python.org", 443)
    assert not parsed.allows("x.docs.python.org", 443)
    assert parsed.allows("a.b.example.org", 8443)
    assert not parsed.allows("a.example.org", 443)
    assert not parsed.allows("example.org", 8443)
    assert not parsed.allows("badexample.org", 8443)
    assert not parsed.allows("evil\x00.example.org", 8443)
    assert not parsed.allows("1.2.3.4", 443)
    assert not EgressRules.parse([]).allows("docs.python.org", 443)


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("", "it is empty"),
        ("   ", "it is empty"),
        ("*", "'*' alone would allow every host"),
        ("*.", "'*' alone would allow every host"),
        ("*.com", "'*.com' is too broad"),
        ("*.com:443", "'*.com' is too broad"),
        ("a*.example.org", "'*' may only be the whole first label"),
        ("*.*.example.org", "'*' may only be the whole first label"),
        ("1.2.3.4", "IP addresses are not accepted"),
        ("10.0.0.1:80", "IP addresses are not accepted"),
        ("2130706433", "IP addresses are not accepted"),
        ("[::1]:443", "IP addresses are not accepted"),
        ("::1", "IP addresses are not accepted"),
        ("bücher.example", "use the punycode form ('xn--bcher-kva.example')"),
        ("https://docs.python.org/3/", "use 'docs.python.org'"),
        ("http://user@docs.python.org:8080/", "use 'docs.python.org:8080'"),
        ("docs.python.org/3", "use 'docs.python.org'"),
        ("docs.python.org:0", "the port '0' is not a number from 1 to 65535"),
        ("docs.python.org:65536", "the port '65536'"),
        ("docs.python.org:https", "the port 'https'"),
        ("docs.python.org:", "the port ''"),
        ("exa mple.org", "dot-separated labels"),
        ("-bad.example.org", "dot-separated labels"),
        ("a..example.org", "dot-separated labels"),
        ("a" * 64 + ".example.org", "dot-separated labels"),
    ],
)
def test_bad_patterns_are_refused_with_the_accepted_forms(pattern: str, why: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        EgressRules.parse(["ok.example.org", pattern], "max_allowed_domains")
    message = str(info.value)
    assert message.startswith(f"max_allowed_domains: {pattern!r} is not a domain pattern: ")
    assert why in message
    assert "'*.example.org' (its subdomains at any depth" in message


def test_a_single_string_is_not_a_list_of_patterns() -> None:
    with pytest.raises(ConfigurationError, match=r"allowed_domains='docs\.python\.org' must be a list"):
        EgressRules.parse("docs.python.org")


@pytest.mark.parametrize(
    ("asked", "ceiling", "uncovered"),
    [
        (["a.b.com"], ["*.b.com"], []),
        (["a.b.com"], ["a.b.com"], []),
        (["b.com"], ["*.b.com"], ["b.com"]),
        (["*.a.b.com"], ["*.b.com"], []),
        (["*.b.com"], ["*.b.com"], []),
        (["*.a.b.com"], ["a.b.com"], ["*.a.b.com"]),
        (["*.b.com"], ["*.a.b.com"], ["*.b.com"]),
        (["a.b.com:443"], ["*.b.com"], []),
        (["a.b.com"], ["*.b.com:443"], ["a.b.com"]),
        (["a.b.com"], ["*.b.com:443", "a.b.com:80"], ["a.b.com"]),
        (["a.b.com:8080"], ["a.b.com"], ["a.b.com:8080"]),
        (["a.b.com:8080", "c.com", "x.b.com"], ["*.b.com", "c.com"], ["a.b.com:8080"]),
        (["a.b.com"], [], ["a.b.com"]),
    ],
)
def test_uncovered_by_a_ceiling(asked: list[str], ceiling: list[str], uncovered: list[str]) -> None:
    assert EgressRules.parse(asked).uncovered_by(EgressRules.parse(ceiling)) == uncovered


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"host_map": {"mirror.test": "not-an-ip"}}, "host_map: 'mirror.test' maps to 'not-an-ip'"),
        ({"host_map": {"10.0.0.1": "10.0.0.1"}}, "host_map: '10.0.0.1' is not a domain name"),
        ({"private_networks": ("10.0.0.0/33",)}, "private_networks: '10.0.0.0/33' is not a network"),
        ({"connect_timeout": 0}, "connect_timeout=0 must be a positive"),
        ({"max_connections": 0}, "max_connections=0 must be at least 1"),
    ],
)
def test_bad_policies_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        EgressPolicy(EgressRules(), **changes)


@pytest.mark.parametrize(
    ("address", "permitted"),
    [
        ("93.184.215.14", True),
        ("2606:4700::1111", True),
        ("::ffff:93.184.215.14", True),
        ("127.0.0.1", True),  # in private_networks
        ("::ffff:127.0.0.1", True),
        ("127.0.0.2", False),
        ("10.0.0.1", False),
        ("192.168.1.1", False),
        ("100.64.0.1", False),
        ("169.254.169.254", False),
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("ff02::1", False),
        ("::ffff:10.0.0.1", False),
        ("2002:a00:1::1", False),  # 6to4 wrapping 10.0.0.1
        ("64:ff9b::a00:1", False),  # NAT64 wrapping 10.0.0.1
    ],
)
def test_only_public_addresses_or_private_networks_are_permitted(address: str, permitted: bool) -> None:
    policy = EgressPolicy(EgressRules(), private_networks=("127.0.0.1/32",))
    assert policy.permits_address(ipaddress.ip_address(address)) is permitted


def test_host_map_names_are_normalized() -> None:
    policy = EgressPolicy(EgressRules(), host_map={"Mirror.Test.": "10.1.2.3"})
    assert policy.mapped_address("mirror.test") == ipaddress.ip_address("10.1.2.3")
    assert policy.mapped_address("other.test") is None


def client_hello(server_hostname: str | None) -> bytes:
    context = ssl.create_default_context()
    if server_hostname is None:
        context.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_the_server_name_is_read_from_a_client_hello_split_across_records() -> None:
    hello = client_hello("Docs.Example.org")
    assert client_hello_sni(hello) == "Docs.Example.org"
    body = hello[5:]
    records = b"".join(
        hello[:3] + len(part).to_bytes(2, "big") + part for part in (body[:7], body[7:100], body[100:])
    )
    assert client_hello_sni(records) == "Docs.Example.org"
    for cut in (0, 4, 5, 50, len(records) - 1):
        with pytest.raises(IncompleteHello):
            client_hello_sni(records[:cut])
    assert client_hello_sni(client_hello(None)) is None
    with pytest.raises(ValueError, match="not a TLS handshake record"):
        client_hello_sni(b"GET / HTTP/1.1\r\n\r\n")


def test_a_paused_kernels_relay_and_proxy_let_go_of_each_other_and_egress_works_after(
    sandbox: Sandbox, relay: Relay, upstreams: Upstreams
) -> None:
    """A pause: the proxy stops dialing and closes the kernel's connections (its rules
    stay), the relay lets go of its socket (SIGUSR1); after it binds again (SIGUSR2) and
    the proxy dials again, requests pass, a keep-alive session's among them."""
    proxy = EgressProxy.instance()
    session = sandbox.session()
    url = f"http://allowed.test:{upstreams.http}/before"
    assert session.get(url, timeout=10).json()["path"] == "/before"
    assert sandbox.decision()["verdict"] == "allowed"

    proxy.suspend_kernel(sandbox.kernel_id)
    served = proxy._kernels[sandbox.kernel_id]
    assert (served.idle, served.active) == (0, 0), "no connection left to the relay"
    relay.process.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 5
    while ipc_in_use(str(relay.socket_path)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not ipc_in_use(str(relay.socket_path)), "the relay let go of its unix socket"
    time.sleep(0.3)
    assert (served.idle, served.active) == (0, 0), "a suspended kernel is not dialed"

    relay.process.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 5
    while not ipc_in_use(str(relay.socket_path)) and time.monotonic() < deadline:
        time.sleep(0.02)
    proxy.resume_kernel(sandbox.kernel_id)
    after = f"http://allowed.test:{upstreams.http}/after"
    assert session.get(after, timeout=10).json()["path"] == "/after", "the session reconnects"
    assert sandbox.get(after)["path"] == "/after"
    assert [d["verdict"] for d in sandbox.take(2)] == ["allowed", "allowed"]
