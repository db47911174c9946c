"""Packages at run time: ``%pip install`` in real kernels, from an internal package index
reached through the egress proxy, and without network.

No test reaches the internet: a PEP 503 "simple" index (static files, served as
``python -m http.server`` serves them) on 127.0.0.1 stands in for an internal mirror,
reached as ``pypi.internal`` through the server's ``egress_host_map`` and
``egress_private_networks``, the configuration the README documents.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import io
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from traitlets.config import Config

from .conftest import KERNEL, KernelStarter, run, run_ok

pytestmark = pytest.mark.integration

NO_NETWORK = (
    "this sandboxed kernel has no network (network policy: none): pip can install only local "
    "files (wheels in the workspace); ask for a kernelspec whose allowed_domains include a package index"
)


def build_wheel(folder: Path, name: str, code: str) -> Path:
    """A pure-Python wheel of ``name`` 1.0 whose one module runs ``code``."""
    info = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": code,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = io.StringIO()
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.write(f"{path},sha256={digest},{len(text.encode())}\n")
    record.write(f"{info}/RECORD,,\n")
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in {**files, f"{info}/RECORD": record.getvalue()}.items():
            archive.writestr(path, text)
    return wheel


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A simple index holding ``sk_demo_pkg`` and ``sk_demo_extra``; its port on 127.0.0.1."""
    root = tmp_path_factory.mktemp("index")
    (root / "files").mkdir()
    names = ("sk_demo_pkg", "sk_demo_extra")
    for name in names:
        wheel = build_wheel(root / "files", name, f"VALUE = {len(name)}\n")
        project = root / "simple" / name.replace("_", "-")
        project.mkdir(parents=True)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        link = f'<a href="../../files/{wheel.name}#sha256={digest}">{wheel.name}</a>'
        (project / "index.html").write_text(f"<!DOCTYPE html><html><body>{link}</body></html>\n")
    projects = "".join(f'<a href="{name.replace("_", "-")}/">{name}</a>' for name in names)
    (root / "simple" / "index.html").write_text(f"<!DOCTYPE html><html><body>{projects}</body></html>\n")
    handler = functools.partial(_Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def index_kernel(
    start_kernel: KernelStarter, make_kernelspec: Callable[..., str], index: int
) -> BlockingKernelClient:
    """A kernel allowed the internal index ``pypi.internal`` and nothing else, set up as the
    README says: the name mapped to the mirror's address, its private network allowed, and
    pip pointed at it by the kernelspec's ``env``."""
    domain = f"pypi.internal:{index}"
    name = make_kernelspec(
        "py-internal-index",
        config={"network": "allowlist", "allowed_domains": [domain]},
        env={"PIP_INDEX_URL": f"http://{domain}/simple", "PIP_TRUSTED_HOST": "pypi.internal"},
    )
    server = Config(
        {
            "SandboxProvisioner": {
                "max_allowed_domains": [domain],
                "egress_host_map": {"pypi.internal": "127.0.0.1"},
                "egress_private_networks": ["127.0.0.1/32"],
            }
        }
    )
    _, kc = start_kernel(name, config=server)
    return kc


def test_pip_installs_from_an_internal_index_and_the_next_cell_imports_it(
    index_kernel: BlockingKernelClient,
) -> None:
    kc = index_kernel
    installed = run(kc, "%pip install sk_demo_pkg", timeout=180)
    assert installed.status == "ok", installed.outputs or installed.stderr
    assert "Successfully installed sk_demo_pkg-1.0" in installed.stdout.replace("-demo-pkg", "_demo_pkg")
    out = run_ok(
        kc,
        "import subprocess, sys, sk_demo_pkg\n"
        "print(sk_demo_pkg.VALUE, sk_demo_pkg.__file__)\n"
        "child = [sys.executable, '-c', 'import sk_demo_pkg; print(sk_demo_pkg.VALUE)']\n"
        "print('child', subprocess.run(child, capture_output=True, text=True).stdout)\n",
    )
    assert out.split() == [
        "11",
        "/tmp/python-packages/lib/python3.11/site-packages/sk_demo_pkg/__init__.py",
        "child",
        "11",
    ]
    # A shell escape installs to the same place, and the next cell imports it too.
    shell = run(kc, "!pip install sk_demo_extra", timeout=180)
    assert "Successfully installed sk_demo_extra-1.0" in shell.stdout.replace("-demo-extra", "_demo_extra")
    assert run_ok(kc, "import sk_demo_extra; print(sk_demo_extra.VALUE)").strip() == "13"


def test_a_failing_pip_fails_the_cell(index_kernel: BlockingKernelClient) -> None:
    """IPython's own %pip reports success whatever pip did; this one fails the cell."""
    failed = run(index_kernel, "%pip install sk-no-such-pkg", timeout=180)
    assert failed.status == "error"
    assert "No matching distribution found for sk-no-such-pkg" in failed.stderr
    error = failed.reply["content"]
    assert (error["ename"], error["evalue"]) == (
        "PipError",
        "pip install failed (exit status 1): see pip's output above",
    )
    assert error["traceback"] == [f"PipError: {error['evalue']}"]


def test_without_network_pip_fails_at_once_and_says_why(start_kernel: KernelStarter) -> None:
    _, kc = start_kernel(KERNEL)
    # (requests is in the image: "Requirement already satisfied", so an absent package.)
    started = time.monotonic()
    failed = run(kc, "%pip install sk_demo_pkg", timeout=120)
    took = time.monotonic() - started
    assert failed.status == "error"
    assert failed.reply["content"]["evalue"] == f"pip install failed (exit status 1): {NO_NETWORK}"
    assert failed.reply["content"]["traceback"] == [f"PipError: {failed.reply['content']['evalue']}"]
    # It does not retry (9 s of retries with an index): nothing says so, and it is quick.
    # (pip's own start takes a few seconds under gVisor, more on a busy machine.)
    assert "Retrying" not in failed.stdout + failed.stderr
    assert took < 30, f"pip took {took:.1f} s to fail without network"
    # A shell escape or a script cannot fail the cell, but fails as fast.
    started = time.monotonic()
    shell = run(kc, "!pip install sk_demo_pkg", timeout=120)
    assert "No matching distribution found for sk_demo_pkg" in shell.stdout + shell.stderr
    assert "Retrying" not in shell.stdout + shell.stderr
    assert time.monotonic() - started < 30
    assert run_ok(kc, "%pip install requests", timeout=120).count("Requirement already satisfied") >= 1


def test_without_network_a_wheel_in_the_workspace_installs(
    start_kernel: KernelStarter, workspace: Path
) -> None:
    wheel = build_wheel(workspace, "sk_demo_pkg", "VALUE = 42\n")
    _, kc = start_kernel(KERNEL)
    installed = run(kc, f"%pip install {wheel.name}", timeout=120)
    assert installed.status == "ok", installed.outputs or installed.stderr
    assert run_ok(kc, "import sk_demo_pkg; print(sk_demo_pkg.VALUE)").strip() == "42"
