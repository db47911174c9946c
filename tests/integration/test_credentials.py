"""Credentials the egress proxy adds to a kernel's HTTPS requests: the kernel's requests
carry them, the kernel never holds them.

A local HTTPS upstream (trustme, as in test_egress.py) stands for the API: it answers
whether the Authorization header it got is the expected one, and how many it got, and
never echoes it. The token is random per test, so finding it anywhere means a leak.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import secrets
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
import trustme
from jupyter_client import KernelManager
from jupyter_client.blocking.client import BlockingKernelClient

from sandbox_kernel.errors import ConfigurationError

from .conftest import KernelStarter, run_ok
from .test_egress import Upstreams, _server_config
from .test_egress import upstreams as upstreams  # the egress tests' upstreams: host map, ports

pytestmark = pytest.mark.integration

TOKEN_ENV = "SK_TEST_WAREHOUSE_TOKEN"


class _Api(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        sent = self.headers.get_all("Authorization") or []
        digest = self.server.expected  # type: ignore[attr-defined]
        body = json.dumps(
            {"ok": [hashlib.sha256(v.encode()).hexdigest() for v in sent] == [digest], "count": len(sent)}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    """The credential's value, in the server's environment only."""
    value = f"tok-{secrets.token_hex(16)}"
    monkeypatch.setenv(TOKEN_ENV, value)
    return value


@pytest.fixture
def api(token: str, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """The API's HTTPS port, and the CA file that the proxy verifies it with."""
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("api.allowed.test", "allowed.test").configure_cert(context)
    ca_file = tmp_path / "api-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    server.daemon_threads = True
    server.expected = hashlib.sha256(f"Bearer {token}".encode()).hexdigest()  # type: ignore[attr-defined]
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1]), ca_file
    server.shutdown()
    server.server_close()


def _credential_kernel(
    start_kernel: KernelStarter,
    make_kernelspec: Any,
    upstreams: Upstreams,
    api: tuple[int, Path],
    tmp_path: Path,
    **config: Any,
) -> tuple[KernelManager, BlockingKernelClient, Path, int]:
    port, ca_file = api
    domains = [f"api.allowed.test:{port}"]
    name = make_kernelspec(
        "py-credentials",
        config={
            "network": "allowlist",
            "allowed_domains": [*domains, f"other.test:{upstreams.https_port}"],
            "credentials": ["warehouse"],
            **config,
        },
    )
    audit_log = tmp_path / "audit" / "audit.jsonl"
    server_config = _server_config(
        upstreams,
        audit_log,
        credentials={
            "warehouse": {"domains": domains, "headers": {"Authorization": "Bearer {env:" + TOKEN_ENV + "}"}}
        },
        max_credentials=["warehouse"],
        egress_ca_bundle=str(ca_file),
    )
    server_config.SandboxProvisioner.max_allowed_domains.append(f"api.allowed.test:{port}")
    km, kc = start_kernel(name, config=server_config)
    return km, kc, audit_log, port


@pytest.fixture
def credential_kernel(
    start_kernel: KernelStarter,
    make_kernelspec: Any,
    upstreams: Upstreams,
    api: tuple[int, Path],
    tmp_path: Path,
) -> tuple[KernelManager, BlockingKernelClient, Path, int]:
    return _credential_kernel(start_kernel, make_kernelspec, upstreams, api, tmp_path)


def _call(port: int, forged: bool = False) -> str:
    """Cell code: call the API with urllib as any code would, print its answer or error."""
    headers = {"Authorization": "Bearer forged-by-the-kernel"} if forged else {}
    return (
        "import urllib.request, urllib.error\n"
        f"request = urllib.request.Request('https://api.allowed.test:{port}/data', headers={headers!r})\n"
        "try:\n"
        "    print(urllib.request.urlopen(request, timeout=20).read().decode())\n"
        "except urllib.error.HTTPError as e:\n"
        "    print('HTTPError', e.code, e.reason)\n"
        "except (urllib.error.URLError, OSError) as e:\n"
        "    print('FAILED', e)\n"
    )


def test_the_kernel_s_requests_carry_a_credential_it_cannot_find(
    credential_kernel: tuple[KernelManager, BlockingKernelClient, Path, int],
    token: str,
    docker_client: docker.DockerClient,
) -> None:
    km, kc, audit_log, port = credential_kernel
    assert json.loads(run_ok(kc, _call(port))) == {"ok": True, "count": 1}
    assert json.loads(run_ok(kc, _call(port, forged=True))) == {"ok": True, "count": 1}, (
        "the kernel's own is replaced"
    )

    # The hunt, as code in the kernel would go about it.
    found = run_ok(
        kc,
        "import os\n"
        # The value's tail, written reversed: the cell's code is kept (IPython's history).
        f"needle = {token[-12:][::-1]!r}[::-1]\n"
        "marker = b'YEK ETAVIRP'[::-1]\n"
        "hits = [k for k, v in os.environ.items() if needle in v]\n"
        "for pid in os.listdir('/proc'):\n"
        "    for part in ('environ', 'cmdline'):\n"
        "        try:\n"
        "            if needle.encode() in open(f'/proc/{pid}/{part}', 'rb').read():\n"
        "                hits.append(f'/proc/{pid}/{part}')\n"
        "        except OSError:\n"
        "            pass\n"
        "for top in ('/run', '/tmp', '/workspace', '/etc', '/var', '/home'):\n"
        "    for folder, _, files in os.walk(top):\n"
        "        for name in files:\n"
        "            path = os.path.join(folder, name)\n"
        "            try:\n"
        "                data = open(path, 'rb').read(10_000_000)\n"
        "            except OSError:\n"
        "                continue\n"
        "            if needle.encode() in data or marker in data:\n"
        "                hits.append(path)\n"
        # Its own memory, for anything shaped like the token (which the kernel never knew).
        "import re\n"
        "shape, scanned = re.compile(rb'tok-[0-9a-f]{32}'), 0\n"
        "with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:\n"
        "    for line in maps:\n"
        "        span, perms = line.split()[:2]\n"
        "        start, end = (int(x, 16) for x in span.split('-'))\n"
        "        if 'r' not in perms or end - start > 2**30:\n"
        "            continue\n"
        "        try:\n"
        "            mem.seek(start)\n"
        "            chunk = mem.read(end - start)\n"
        "        except (OSError, ValueError, OverflowError):\n"
        "            continue\n"
        "        scanned += len(chunk)\n"
        "        hits += ['memory'] if shape.search(chunk) else []\n"
        "print(scanned // 2**20, sorted(os.listdir('/run/sandbox-kernel')), hits)",
    )
    scanned, rest = found.strip().split(" ", 1)
    listing, hits = rest.rsplit("] ", 1)
    assert hits == "[]", f"the kernel found the credential or the CA key: {hits}"
    assert int(scanned) > 20, f"only {scanned} MiB of the kernel's memory could be read"
    assert "'egress-ca.pem'" in listing

    # On the host: not in the container's configuration, the runtime folder or the audit log.
    attrs = docker_client.containers.get(km.provisioner.container_id).attrs
    assert token not in json.dumps(attrs)
    runtime_dir = Path(km.provisioner.runtime_dir)
    for path in runtime_dir.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path
    records = [json.loads(line) for line in audit_log.read_text().splitlines()]
    assert token not in json.dumps(records)
    (bound,) = [r for r in records if r["event"] == "credential"]
    assert bound["name"] == "warehouse"
    assert bound["action"] == "bound"
    assert bound["headers"] == ["Authorization"]
    assert any(
        "credential 'warehouse' added" in str(r.get("reason")) for r in records if r["event"] == "egress"
    )


def test_a_program_binds_and_revokes_a_credential_while_the_kernel_runs(
    credential_kernel: tuple[KernelManager, BlockingKernelClient, Path, int], tmp_path: Path
) -> None:
    km, kc, audit_log, port = credential_kernel
    km.provisioner.revoke_credential("warehouse")
    out = run_ok(kc, _call(port))
    assert out.startswith("FAILED"), out
    assert "was revoked at" in out, out
    # Bound again from a file the server reads, for ten seconds (a call through the proxy
    # comes well within them, on a busy machine too).
    secret_file = tmp_path / "token"
    secret_file.write_text("Bearer " + "x" * 8)
    bound = time.monotonic()
    km.provisioner.bind_credential(
        "adhoc", [f"api.allowed.test:{port}"], {"Authorization": "{file:" + str(secret_file) + "}"}, ttl=10
    )
    assert json.loads(run_ok(kc, _call(port))) == {"ok": False, "count": 1}, (
        "its value arrives, not the kernel's"
    )
    time.sleep(max(0, bound + 10.5 - time.monotonic()))
    out = run_ok(kc, _call(port))
    assert out.startswith("FAILED"), out
    assert "credential 'adhoc' expired at" in out, out
    with pytest.raises(ConfigurationError, match="never widens egress"):
        km.provisioner.bind_credential("wide", ["evil.test"], {"X-Key": "k"})
    # A restart renews neither: "warehouse" stays revoked, "adhoc" stays expired.
    km.restart_kernel(now=True)
    kc.wait_for_ready(timeout=60)
    out = run_ok(kc, _call(port))
    assert "credential 'adhoc' expired at" in out, out
    assert "warehouse" not in out, out
    actions = [
        (r["name"], r["action"])
        for r in map(json.loads, audit_log.read_text().splitlines())
        if r["event"] == "credential"
    ]
    assert actions == [("warehouse", "bound"), ("warehouse", "revoked"), ("adhoc", "bound")]


def test_a_credential_kernel_restarts_into_a_pooled_sandbox_and_its_requests_still_carry_it(
    start_kernel: KernelStarter,
    make_kernelspec: Any,
    upstreams: Upstreams,
    api: tuple[int, Path],
    tmp_path: Path,
) -> None:
    """Allow-list kernels restarted cold (#23 item 10): the egress proxy kept the kernel's
    own CA, which a pooled sandbox does not trust. Now a restart claims a pooled sandbox
    too and the proxy signs with the CA made with it: the kernel's TLS to a domain whose
    requests carry a credential (intercepted, so signed by that CA) verifies as before."""
    from sandbox_kernel import SandboxPool

    km, kc, _, port = _credential_kernel(start_kernel, make_kernelspec, upstreams, api, tmp_path, pool_size=1)
    pool = SandboxPool.instance()
    try:
        assert json.loads(run_ok(kc, _call(port))) == {"ok": True, "count": 1}
        assert pool.wait_ready(km.kernel_name, timeout=120) == 1
        km.restart_kernel(now=True)
        kc.wait_for_ready(timeout=60)
        assert km.provisioner.from_pool, "the restart claimed a pooled sandbox"
        out = run_ok(kc, _call(port))
        assert json.loads(out) == {"ok": True, "count": 1}, out
    finally:
        pool.drain()  # the sandbox it made again for the next claim
