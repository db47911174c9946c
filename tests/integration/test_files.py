"""The host side's files API with real kernels: what the host uploads the kernel reads and
overwrites, what the kernel writes the host downloads, for folder and volume workspaces;
links planted on the host are never followed."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from pathlib import Path

import pytest
from jupyter_client import KernelManager

from sandbox_kernel.agents.files import WorkspaceFiles, workspace_files
from sandbox_kernel.errors import WorkspaceError

from .conftest import KERNEL, KernelStarter, make_workspace, run_ok

pytestmark = pytest.mark.integration


def files_of(km: KernelManager) -> WorkspaceFiles:
    """The files API for a running kernel, from its provisioner's info, as a program gets it."""

    async def build() -> WorkspaceFiles:
        return await workspace_files(await km.provisioner.get_provisioner_info())

    return asyncio.run(build())


def kernelspec(make_kernelspec: Callable[..., str], kind: str, volume_prefix: str) -> str:
    if kind == "folder":
        return KERNEL
    config = {"workspace_volume": volume_prefix + "-{project}"}
    return make_kernelspec(f"py-files-{secrets.token_hex(2)}", config=config)


@pytest.mark.parametrize("kind", ["folder", "volume"])
def test_files_go_both_ways_and_belong_to_the_kernel(
    kind: str,
    volume_prefix: str,
    make_kernelspec: Callable[..., str],
    start_kernel: KernelStarter,
    workspace: Path,
) -> None:
    km, kc = start_kernel(kernelspec(make_kernelspec, kind, volume_prefix))
    files = files_of(km)
    if kind == "folder":
        assert files.root == workspace
    else:
        assert files.root != workspace
        assert files.root.name == "_data", "the volume's host mountpoint"

    assert files.upload("data/input.csv", "a,b\n1,2\n") == "/workspace/data/input.csv"
    st = (files.root / "data" / "input.csv").stat()
    assert (st.st_uid, st.st_gid) == (files.uid, files.gid)
    out = run_ok(
        kc,
        "import os\n"
        "print(open('data/input.csv').read(), end='')\n"
        "open('data/input.csv', 'a').write('3,4\\n')\n"  # the kernel may overwrite it
        "os.makedirs('data/more', exist_ok=True)\n"  # and write in the folder the host made
        "open('data/more/result.txt', 'w').write('42')\n"
        "print(os.getuid(), os.stat('data/input.csv').st_uid)",
    )
    assert out.splitlines()[:2] == ["a,b", "1,2"]
    assert out.splitlines()[2] == f"{files.uid} {files.uid}"

    assert files.download("data/input.csv") == b"a,b\n1,2\n3,4\n"
    assert files.download("/workspace/data/more/result.txt") == b"42"
    assert [(i.name, i.is_dir) for i in files.list("data")] == [("input.csv", False), ("more", True)]
    assert [i.path for i in files.list("data/more")] == ["data/more/result.txt"]
    assert [i.size for i in files.list("data/more")] == [2]

    files.delete("data/input.csv")
    with pytest.raises(WorkspaceError, match="not empty"):
        files.delete("data")
    files.delete("data", recursive=True)
    assert run_ok(kc, "print(os.path.exists('data/input.csv'), os.path.exists('data'))").split() == [
        "False",
        "False",
    ]
    assert files.list() == []


def test_a_working_folder_below_the_workspace_root(
    start_kernel: KernelStarter, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paths are relative to the kernel's working folder; list names entries above it absolutely."""
    folder = make_workspace(make_workspace(workspace / "team") / "analysis")
    monkeypatch.setenv("SANDBOX_KERNEL_WORKSPACE_ROOT", str(workspace))
    km, kc = start_kernel(cwd=folder)
    files = files_of(km)
    assert files.upload("notes.txt", "hi") == "/workspace/team/analysis/notes.txt"
    assert run_ok(kc, "import os; print(os.getcwd(), open('notes.txt').read())").split() == [
        "/workspace/team/analysis",
        "hi",
    ]
    assert [i.path for i in files.list("/workspace")] == ["/workspace/team"]
    with pytest.raises(WorkspaceError, match="kernel's working folder or holds it"):
        files.delete("/workspace/team", recursive=True)


def test_links_planted_on_the_host_are_never_followed(
    start_kernel: KernelStarter, workspace: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    (workspace / "data").mkdir()
    (workspace / "data" / "report.txt").symlink_to(secret)
    (workspace / "elsewhere").symlink_to(tmp_path)
    km, kc = start_kernel()
    files = files_of(km)

    # The kernel itself cannot make links (its seccomp profile refuses them).
    out = run_ok(
        kc,
        "import os\ntry:\n    os.symlink('/etc/passwd', 'mine')\n    print('made')\n"
        "except OSError as e:\n    print('refused', e.errno)",
    )
    assert out.startswith("refused"), out

    with pytest.raises(WorkspaceError, match=r"'data/report\.txt' is a symbolic link"):
        files.download("data/report.txt")
    with pytest.raises(WorkspaceError, match=r"'data/report\.txt' is a symbolic link"):
        files.upload("data/report.txt", "overwritten")
    with pytest.raises(WorkspaceError, match="'elsewhere' is a symbolic link"):
        files.upload("elsewhere/secret.txt", "overwritten")
    with pytest.raises(WorkspaceError, match="'elsewhere' is a symbolic link"):
        files.list("elsewhere")
    with pytest.raises(WorkspaceError, match="leaves the workspace"):
        files.download("../secret.txt")
    assert secret.read_text() == "host secret"
    assert [i.name for i in files.list()] == ["data"]
    assert files.list("data") == []


def test_uploads_land_where_a_pooled_kernel_sees_its_workspace(
    start_sandboxed: KernelStarter, inside: str
) -> None:
    km, kc = start_sandboxed()
    files = files_of(km)
    assert files.upload("in.txt", "pooled or not") == f"{inside}/in.txt"
    assert run_ok(kc, f"print(open({inside + '/in.txt'!r}).read())").strip() == "pooled or not"
    run_ok(kc, "open('out.txt', 'w').write('back')")
    assert files.download(f"{inside}/out.txt") == b"back"
