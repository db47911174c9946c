"""The analyst's path: the demo notebook executed by nbclient in a sandboxed kernel, and a
kernel that would run without its start-up code, which is never handed over."""

from __future__ import annotations

import csv
import os
import shutil
import time
from pathlib import Path

import docker
import nbformat
import pytest
from jupyter_client import KernelManager
from nbclient import NotebookClient
from traitlets.config import Config

from sandbox_kernel.cli.app import SandboxKernelApp
from sandbox_kernel.errors import KernelStartupError
from sandbox_kernel.lifecycle import launch_folder
from sandbox_kernel.plan.sandbox_spec import LABEL_MANAGED

from .conftest import KERNEL, SANDBOX_UID, KernelStarter, make_workspace, run

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


@pytest.fixture
def notebook_folder(workspace: Path) -> Path:
    shutil.copytree(NOTEBOOKS, workspace, dirs_exist_ok=True)
    for path in [workspace, *workspace.rglob("*")]:
        if os.getuid() == 0:
            os.chown(path, SANDBOX_UID, SANDBOX_UID)
    return workspace


def stream_text(nb: nbformat.NotebookNode) -> str:
    return "".join(
        o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.output_type == "stream"
    )


def test_demo_notebook_runs_in_gvisor_and_keeps_results(jupyter_dirs: Path, notebook_folder: Path) -> None:
    nb = nbformat.read(notebook_folder / "demo.ipynb", as_version=4)
    NotebookClient(
        nb, kernel_name=KERNEL, timeout=120, resources={"metadata": {"path": str(notebook_folder)}}
    ).execute()
    text = stream_text(nb)
    assert "Linux 4.4.0 (gVisor)" in text
    assert "network: none" in text
    pngs = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(pngs) == 1
    with open(notebook_folder / "results" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["region"] for r in rows} == {"North", "South", "East", "West"}
    assert abs(sum(float(r["share"]) for r in rows) - 1) < 0.01
    assert (notebook_folder / "results" / "revenue_by_region.png").read_bytes().startswith(b"\x89PNG")


def _kernel_containers(client: docker.DockerClient) -> set[str]:
    return {c.id for c in client.containers.list(all=True, filters={"label": LABEL_MANAGED})}


@pytest.mark.parametrize("fails", [False, True], ids=["ok", "failing"])
def test_run_command_executes_a_notebook_and_leaves_no_kernel(
    jupyter_dirs: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    docker_client: docker.DockerClient,
    fails: bool,
) -> None:
    """`jupyter sandbox-kernel run` once left every kernel it started running (nbclient
    shuts down only a kernel manager it made itself): none may stay, failed run or not."""
    folder = make_workspace(tmp_path / "nb")
    code = "print('sum is', sum(range(10)))" + ("\n1/0" if fails else "")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    nbformat.write(nb, folder / "tiny.ipynb")
    before = _kernel_containers(docker_client)
    app = SandboxKernelApp()
    app.initialize(["run", str(folder / "tiny.ipynb")])
    if fails:
        with pytest.raises(SystemExit):
            app.start()
    else:
        app.start()
    assert _kernel_containers(docker_client) - before == set()
    out = capsys.readouterr().out
    assert "sum is 45" in out
    executed = nbformat.read(folder / "tiny.executed.ipynb", as_version=4)
    assert stream_text(executed) == "sum is 45\n"


NO_NETWORK = (
    "URLError: cannot resolve 'example.com': this sandboxed kernel has no network (network policy: none)"
)


@pytest.mark.skipif(os.getuid() != 0, reason="only a root server seals the launch folder")
def test_a_kernel_sealed_while_ipython_looks_for_its_start_up_code_still_runs_it(
    start_kernel: KernelStarter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under heavy load a fresh kernel once came up without its start-up code: a raw
    30-frame DNS traceback instead of the one line, a memory loop killed instead of a
    MemoryError. The seal hands the launch folder to root, then opens it to all: a kernel
    that looks for its start-up file in between cannot see it, and IPython starts without
    it. Here the seal is held between its two steps, as a loaded host may hold its thread."""
    seal = launch_folder.seal_launch_dir

    def held(launch_dir: Path, owner: tuple[int, int] = (0, 0)) -> list[str]:
        os.chown(launch_dir, *owner)
        time.sleep(4)
        return seal(launch_dir, owner)

    monkeypatch.setattr(launch_folder, "seal_launch_dir", held)
    _, kc = start_kernel()
    execution = run(kc, "import urllib.request\nurllib.request.urlopen('https://example.com', timeout=10)")
    (error,) = [output for output in execution.outputs if output["type"] == "error"]
    assert error["traceback"] == [NO_NETWORK], f"{len(error['traceback'])} lines"


def test_a_kernel_whose_start_up_code_did_not_run_is_not_handed_over(
    jupyter_dirs: Path, workspace: Path, docker_client: docker.DockerClient
) -> None:
    """IPython runs a kernel without its PYTHONSTARTUP file, saying so at most in a warning."""
    before = _kernel_containers(docker_client)
    km = KernelManager(kernel_name=KERNEL, config=Config({"SandboxProvisioner": {"startup_timeout": 10}}))
    began = time.monotonic()
    with pytest.raises(KernelStartupError, match="did not finish its start-up code within 10 s") as failed:
        km.start_kernel(cwd=str(workspace), extra_arguments=["--IPKernelApp.exec_PYTHONSTARTUP=False"])
    assert time.monotonic() - began < 50  # its 10 s start-up timeout, with a start and a removal
    assert "it was not handed over" in str(failed.value)
    assert not km.has_kernel
    assert _kernel_containers(docker_client) - before == set()
