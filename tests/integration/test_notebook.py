"""The analyst's path: the demo notebook executed by nbclient in a sandboxed kernel."""

from __future__ import annotations

import csv
import os
import shutil
from pathlib import Path

import docker
import nbformat
import pytest
from nbclient import NotebookClient

from sandbox_kernel.app import SandboxKernelApp
from sandbox_kernel.sandbox_spec import LABEL_MANAGED

from .conftest import KERNEL, SANDBOX_UID, make_workspace

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
