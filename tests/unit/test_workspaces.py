"""A session without cwd gets a fresh workspace of its own (#23 item 3): where it is, whose,
what refuses it, and that removing it never follows a link out."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
from traitlets.config import Config

from sandbox_kernel.agents.mcp_server import KernelTools
from sandbox_kernel.agents.session import AsyncSandboxSession, SandboxSession
from sandbox_kernel.agents.workspaces import (
    check_fresh_workspace_allowed,
    keep_workspace,
    make_fresh_workspace,
    remove_workspace,
    sweep_abandoned_workspaces,
    workspaces_parent,
)
from sandbox_kernel.errors import WorkspaceError
from sandbox_kernel.lifecycle.ownership import server_identity
from sandbox_kernel.plan.plan import DEFAULT_KERNEL_UID


@pytest.fixture(autouse=True)
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    data = tmp_path / "data"
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(data))
    return data


def test_each_fresh_workspace_is_a_new_private_folder_in_the_users_data_folder(data_dir: Path) -> None:
    first = make_fresh_workspace("sandboxed-python")
    second = make_fresh_workspace("sandboxed-python")
    assert first != second
    assert first.parent == second.parent == workspaces_parent() == data_dir / "sandbox-kernel" / "workspaces"
    for folder in (first, second, first.parent):
        info = os.lstat(folder)
        assert stat.S_ISDIR(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o700
    assert list(first.iterdir()) == []
    # The folders above stay this process's; the workspace is the kernel's uid's.
    assert os.lstat(first.parent).st_uid == os.getuid()
    kernel_uid = DEFAULT_KERNEL_UID if os.getuid() == 0 else os.getuid()
    assert (os.lstat(first).st_uid, os.lstat(first).st_gid) == (
        kernel_uid,
        kernel_uid if os.getuid() == 0 else os.getgid(),
    )


@pytest.mark.skipif(os.getuid() != 0, reason="a root process's kernel_uid")
def test_under_root_the_workspace_goes_to_kernel_uid_when_one_is_set() -> None:
    config = Config({"SandboxProvisioner": {"kernel_uid": 64000}})
    folder = make_fresh_workspace("sandboxed-python", config)
    assert (os.lstat(folder).st_uid, os.lstat(folder).st_gid) == (64000, 64000)


@pytest.mark.parametrize(
    ("setting", "where"),
    [
        ("config", "the server's config"),
        ("env", "$SANDBOX_KERNEL_WORKSPACE_ROOT"),
    ],
)
def test_an_administrators_workspace_root_says_to_pass_cwd(
    setting: str, where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_dir: Path
) -> None:
    root = tmp_path / "team"
    root.mkdir()
    config = Config()
    if setting == "config":
        config = Config({"SandboxProvisioner": {"workspace_root": str(root)}})
    else:
        monkeypatch.setenv("SANDBOX_KERNEL_WORKSPACE_ROOT", str(root))
    with pytest.raises(WorkspaceError) as raised:
        make_fresh_workspace("sandboxed-python", config)
    message = str(raised.value)
    assert message.startswith(f"Pass cwd= a folder under {str(root)!r}")
    assert where in message
    assert not workspaces_parent().exists()  # refused before anything was made


def test_without_a_root_a_fresh_workspace_is_allowed() -> None:
    check_fresh_workspace_allowed("no-such-kernelspec")
    check_fresh_workspace_allowed("x", Config({"SandboxProvisioner": {"workspace_volume": "{user}-scratch"}}))


def test_a_volume_named_after_the_folder_says_to_pass_cwd() -> None:
    config = Config({"SandboxProvisioner": {"workspace_volume": "team-{project}"}})
    with pytest.raises(WorkspaceError, match=r"^Pass cwd= a folder whose name names the project"):
        make_fresh_workspace("sandboxed-python", config)


def test_a_workspaces_folder_that_is_a_link_or_open_to_others_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    parent = workspaces_parent()
    parent.parent.mkdir(parents=True)
    parent.symlink_to(elsewhere)
    with pytest.raises(WorkspaceError, match="must be a folder of uid"):
        make_fresh_workspace("sandboxed-python")
    assert list(elsewhere.iterdir()) == []
    parent.unlink()
    parent.mkdir(mode=0o755)
    os.chmod(parent, 0o755)  # noqa: S103  (the mistake under test)
    with pytest.raises(WorkspaceError, match=r"drwxr-xr-x.*Remove it"):
        make_fresh_workspace("sandboxed-python")


def test_removing_a_workspace_removes_what_the_kernel_left_and_never_follows_links(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    folder = make_fresh_workspace("sandboxed-python")
    (folder / "results" / "deep").mkdir(parents=True)
    (folder / "results" / "deep" / "a.csv").write_text("1,2")
    (folder / "link").symlink_to(outside)
    os.chmod(folder / "results", 0o500)  # read-only, as kernel code may leave it
    remove_workspace(folder)
    assert not folder.exists()
    assert (outside / "keep.txt").read_text() == "mine"


def test_a_session_without_cwd_has_none_until_it_starts_and_one_with_cwd_keeps_it(tmp_path: Path) -> None:
    assert AsyncSandboxSession().cwd is None
    assert AsyncSandboxSession().fresh_workspace
    given = AsyncSandboxSession(cwd=tmp_path)
    assert given.cwd == tmp_path
    assert not given.fresh_workspace
    assert SandboxSession(cwd=tmp_path).cwd == tmp_path


def test_a_fresh_session_removes_its_workspace_at_shutdown_unless_kept() -> None:
    for keep in (False, True):
        session = AsyncSandboxSession(keep_workspace=keep)
        session.cwd = folder = make_fresh_workspace("sandboxed-python")
        (folder / "out.txt").write_text("x")
        asyncio.run(session.shutdown())
        assert folder.exists() is keep
        assert session.cwd == (folder if keep else None)


def test_a_detached_session_keeps_its_fresh_workspace_for_the_kernel() -> None:
    session = AsyncSandboxSession()
    session.cwd = folder = make_fresh_workspace("sandboxed-python")
    asyncio.run(session.detach())
    asyncio.run(session.shutdown())
    assert folder.is_dir()


def test_an_mcp_servers_fresh_workspace_goes_once_its_kernels_are_shut_down() -> None:
    folder = make_fresh_workspace("sandboxed-python")
    (folder / "out.txt").write_text("x")
    kept = make_fresh_workspace("sandboxed-python")
    asyncio.run(
        KernelTools(
            "sandboxed-python", str(folder), AsyncSandboxSession, remove_workspace=True
        ).shutdown_all()
    )
    asyncio.run(KernelTools("sandboxed-python", str(kept), AsyncSandboxSession).shutdown_all())
    assert not folder.exists()
    assert kept.is_dir()


def test_a_fresh_workspace_of_a_process_that_died_goes_with_the_next_one() -> None:
    """A session killed outright (SIGKILL) cannot remove its folder: the next fresh
    workspace of this user does, never one that is kept or whose process is alive."""
    alive = make_fresh_workspace("sandboxed-python", sweep=True)
    kept = make_fresh_workspace("sandboxed-python")
    dead = make_fresh_workspace("sandboxed-python", sweep=True)
    marker = dead.with_name(dead.name + ".owner")
    assert marker.read_text() == server_identity()
    assert stat.S_IMODE(marker.stat().st_mode) == 0o600
    assert not kept.with_name(kept.name + ".owner").exists()
    (dead / "left.txt").write_text("x")
    # The same pid with another start time: the process that made it is gone.
    marker.write_text(server_identity().rsplit("/", 1)[0] + "/1")
    new = make_fresh_workspace("sandboxed-python")
    assert not dead.exists()
    assert not marker.exists()
    assert alive.is_dir()
    assert kept.is_dir()
    assert new.is_dir()
    assert sweep_abandoned_workspaces() == []
    remove_workspace(alive)
    assert not alive.with_name(alive.name + ".owner").exists()


def test_detaching_keeps_the_fresh_workspace_from_the_sweep() -> None:
    session = AsyncSandboxSession()
    session.cwd = folder = make_fresh_workspace("sandboxed-python", sweep=True)
    asyncio.run(session.detach())
    assert not folder.with_name(folder.name + ".owner").exists()
    keep_workspace(folder)  # twice is fine
