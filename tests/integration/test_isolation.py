"""What code inside the sandbox can and cannot see or do."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import SANDBOX_UID, KernelStarter, attempt_each, run, run_ok


def test_kernel_runs_under_gvisor_as_unprivileged_user(start_sandboxed: KernelStarter, inside: str) -> None:
    _, kc = start_sandboxed()
    out = run_ok(
        kc,
        "import ctypes, os\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)\n"
        "no_new_privs = ctypes.CDLL(None).prctl(39, 0, 0, 0, 0)  # PR_GET_NO_NEW_PRIVS\n"
        "print(os.uname().release, os.getuid(), os.getgid())\n"
        "print(status['CapEff'].strip(), status['CapBnd'].strip(), no_new_privs)\n"
        "print(os.getcwd())",
    )
    release_uid, caps, cwd = out.splitlines()
    release, uid, gid = release_uid.split()
    assert release == "4.4.0", "the kernel is not running under gVisor"
    assert int(uid) != 0
    assert int(gid) != 0
    assert caps == "0000000000000000 0000000000000000 1"
    assert cwd == inside


def test_writes_only_reach_workspace_and_tmp(start_sandboxed: KernelStarter, workspace: Path) -> None:
    secret = workspace.parent / "next-to-workspace.txt"
    secret.write_text("host only")
    _, kc = start_sandboxed()
    out = run_ok(
        kc,
        "import os\n"
        "for path in ['/etc/x', '/usr/x', '/opt/kernel/x', '/x', '/run/x', '/home/x', '/var/x', '/proc/x']:\n"
        "    try:\n"
        "        open(path, 'w').write('x'); print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print('denied', path, e.errno)\n"
        "open('/tmp/scratch', 'w').write('tmp ok')\n"
        "os.makedirs('results', exist_ok=True)\n"
        "open('results/out.csv', 'w').write('a,b\\n1,2\\n')\n"
        "print(sorted(os.listdir('.')))\n"
        "print(os.path.exists('/var/run/docker.sock'), os.path.exists('/run/docker.sock'))\n"
        "print(os.path.exists(os.path.join(os.getcwd(), '..', 'next-to-workspace.txt')))",
    )
    assert "WROTE" not in out
    assert out.count("denied") == 8
    assert "['results']" in out
    assert "False False\nFalse" in out
    result = workspace / "results" / "out.csv"
    assert result.read_text() == "a,b\n1,2\n"
    owner = result.stat().st_uid
    assert owner == (os.getuid() or SANDBOX_UID), "the host user must own what the kernel writes"


@pytest.fixture
def host_server() -> Iterator[int]:
    """A TCP service the host offers on every interface (0.0.0.0)."""
    server = socket.create_server(("0.0.0.0", 0))
    server.settimeout(0.2)
    stop = threading.Event()
    hits: list[str] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, addr = server.accept()
            except TimeoutError:
                continue
            hits.append(addr[0])
            conn.sendall(b"host secret")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    # The host reaches its own service, so a refusal in the test is the sandbox's doing.
    with socket.create_connection(("127.0.0.1", port), timeout=2) as probe:
        assert probe.recv(20) == b"host secret"
    hits.clear()
    yield port
    stop.set()
    thread.join()
    server.close()
    assert hits == [], f"the sandbox reached the host's service from {hits}"


def host_addresses() -> list[str]:
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False).stdout.split()
    return [a for a in out if ":" not in a]


def test_no_network_at_all(start_sandboxed: KernelStarter, host_server: int) -> None:
    targets = [("1.1.1.1", 443), ("1.1.1.1", 53), ("172.17.0.1", host_server)]
    targets += [(addr, host_server) for addr in host_addresses()]
    _, kc = start_sandboxed()
    out = run_ok(
        kc,
        "import socket\n"
        f"for host, port in {targets!r}:\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=2).close(); print('REACHED', host, port)\n"
        "    except OSError as e:\n"
        "        print('blocked', host, port, type(e).__name__)\n"
        "for name in ['example.com', 'pypi.org', 'localhost.localdomain']:\n"
        "    try:\n"
        "        socket.getaddrinfo(name, 443); print('RESOLVED', name)\n"
        "    except OSError as e:\n"
        "        print('no dns', name)\n"
        "print('interfaces', sorted(n for _, n in socket.if_nameindex()))",
        timeout=120,
    )
    assert "REACHED" not in out, out
    assert "RESOLVED" not in out, out
    assert out.count("blocked") == len(targets)
    assert "interfaces ['lo']" in out


@pytest.mark.parametrize(
    "code",
    [
        "import urllib.request\nurllib.request.urlopen('https://example.com', timeout=10)",
        "import requests\nrequests.get('https://example.com/data.csv', timeout=10)",
        "import pandas\npandas.read_csv('https://example.com/data.csv')",
    ],
    ids=["urllib", "requests", "pandas"],
)
def test_code_that_tries_the_network_learns_in_one_line_that_there_is_none(
    code: str, start_sandboxed: KernelStarter
) -> None:
    """What a notebook shows: one line saying why, not forty lines of retries ending in
    'Temporary failure in name resolution'."""
    _, kc = start_sandboxed()
    result = run(kc, code, timeout=60)
    assert result.status == "error"
    (error,) = [output for output in result.outputs if output["type"] == "error"]
    (line,) = error["traceback"]
    assert line.endswith(
        ": cannot resolve 'example.com': this sandboxed kernel has no network (network policy: none)"
    ), line
    assert "Traceback" not in line


def test_server_secrets_do_not_enter_the_sandbox(start_sandboxed: KernelStarter) -> None:
    env = dict(os.environ)
    env.update(
        AWS_SECRET_ACCESS_KEY="aws-secret-123",
        JUPYTER_TOKEN="jupyter-token-456",
        JPY_PARENT_PID=str(os.getpid()),
        TZ="Europe/Paris",
    )
    _, kc = start_sandboxed(env=env)
    out = run_ok(
        kc,
        "import os, glob\n"
        "print(sorted(os.environ))\n"
        "blob = b''\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        blob += open(path, 'rb').read()\n"
        "    except OSError:\n"
        "        pass\n"
        "print(b'aws-secret-123' in blob, b'jupyter-token-456' in blob)\n"
        "print(os.environ.get('TZ'))",
    )
    names, leaked, tz = out.splitlines()
    for secret in ("AWS_SECRET_ACCESS_KEY", "JUPYTER_TOKEN", "JPY_PARENT_PID", "DOCKER_HOST"):
        assert secret not in names
    assert leaked == "False False"
    assert tz == "Europe/Paris", "allow-listed variables pass"


def test_matplotlib_figure_arrives_as_png(start_sandboxed: KernelStarter) -> None:
    _, kc = start_sandboxed()
    result = run(
        kc,
        "import matplotlib.pyplot as plt, numpy as np\n"
        "x = np.linspace(0, 6, 50)\n"
        "plt.plot(x, np.sin(x)); plt.title('sine'); plt.show()",
    )
    assert result.status == "ok"
    pngs = [o["data"]["image/png"] for o in result.outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 1
    assert pngs[0].startswith("iVBORw0KGgo")  # base64 of the PNG signature


def test_kernel_cannot_make_links_or_device_nodes(start_sandboxed: KernelStarter) -> None:
    """Host code follows paths in folders the kernel writes: no path there may lead elsewhere."""
    _, kc = start_sandboxed()
    denied = attempt_each(
        kc,
        {
            "symlink in workspace": "os.symlink('/etc/passwd', 'notebook.ipynb')",
            "symlink in /tmp": "os.symlink('/etc', '/tmp/etc')",
            "symlink in runtime folder": "os.symlink('/x', '/run/sandbox-kernel/kernel-9')",
            "hard link": "os.link('target', 'hardlink')",
            "fifo": "os.mkfifo('pipe.ipynb')",
        },
        setup="open('target', 'w').write('x')",
    )
    assert denied == {
        "symlink in workspace",
        "symlink in /tmp",
        "symlink in runtime folder",
        "hard link",
        "fifo",
    }


@pytest.mark.skipif(os.getuid() != 0, reason="only a root server can seal the runtime folder")
def test_runtime_folder_is_sealed_once_the_kernel_is_up(start_sandboxed: KernelStarter) -> None:
    km, kc = start_sandboxed()
    attempts = {
        "new file": "open('/run/sandbox-kernel/junk', 'w')",
        "new folder": "os.mkdir('/run/sandbox-kernel/d')",
        "swap a socket": "os.rename('/run/sandbox-kernel/kernel-5', '/run/sandbox-kernel/x')",
        "remove a socket": "os.unlink('/run/sandbox-kernel/kernel-1')",
    }
    assert attempt_each(kc, attempts) == set(attempts)
    # ...and the next kernel gets a fresh folder anyway.
    km.restart_kernel(now=True)
    kc.wait_for_ready(timeout=60)
    assert run_ok(kc, "print('up')").strip() == "up"
