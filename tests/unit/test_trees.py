"""Removing and measuring folder trees kernel code made: deeper than Python's recursion
limit, full of links, read-only, another uid's, changing under the walk."""

from __future__ import annotations

import errno
import os
import resource
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox_kernel.host.trees import delete_tree, tree_size

from .conftest import deep_tree

SANDBOX_UID = 1000
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="trees of another uid need root")


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside the tree with a secret: links in trees point here."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret.txt").write_text("host secret")
    return folder


@pytest.fixture
def few_descriptors() -> Iterator[None]:
    """At most 64 open files: a walk holding one per level would run out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_tree_deeper_than_the_recursion_limit_is_removed(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    deep_tree(tree)
    delete_tree(tree)
    assert not tree.exists()
    assert Path("/etc/passwd").exists(), "the link at the bottom was removed, not followed"


def test_a_deep_tree_costs_one_descriptor_at_a_time(tmp_path: Path, few_descriptors: None) -> None:
    tree = tmp_path / "tree"
    deep_tree(tree)
    assert tree_size(tree) == len(b"deep")
    delete_tree(tree)
    assert not tree.exists()


def test_links_are_removed_never_followed(tmp_path: Path, outside: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "to-folder").symlink_to(outside)
    (tree / "sub" / "to-file").symlink_to(outside / "secret.txt")
    (tree / "sub" / "dangling").symlink_to(tmp_path / "nothing")
    os.mkfifo(tree / "fifo")
    delete_tree(tree)
    assert not tree.exists()
    assert (outside / "secret.txt").read_text() == "host secret"
    link = tmp_path / "link"
    link.symlink_to(outside)
    delete_tree(link)
    assert not link.is_symlink()
    assert (outside / "secret.txt").exists(), "a link given as the tree is unlinked, not followed"


def test_read_only_and_unreadable_folders_are_removed(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "locked" / "inner").mkdir(parents=True)
    (tree / "locked" / "inner" / "f").write_text("x")
    (tree / "hidden").mkdir()
    (tree / "hidden" / "f").write_text("x")
    (tree / "locked" / "inner").chmod(0o555)
    (tree / "locked").chmod(0o500)
    (tree / "hidden").chmod(0o000)
    tree.chmod(0o555)
    delete_tree(tree)
    assert not tree.exists()


def test_missing_paths_and_files(tmp_path: Path) -> None:
    delete_tree(tmp_path / "nothing")
    delete_tree(tmp_path / "no" / "parent")
    (tmp_path / "file").write_text("x")
    delete_tree(tmp_path / "file")
    assert not (tmp_path / "file").exists()
    assert tree_size(tmp_path / "nothing") == 0


def test_a_name_in_an_open_folder(tmp_path: Path, outside: Path) -> None:
    deep_tree(tmp_path / "tree", 50)
    (tmp_path / "tree" / "to-outside").symlink_to(outside)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        delete_tree("tree", dir_fd=fd)
    finally:
        os.close(fd)
    assert not (tmp_path / "tree").exists()
    assert (outside / "secret.txt").exists()


def test_the_size_counts_regular_files_only(tmp_path: Path, outside: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "one").write_bytes(b"1")
    (tree / "a" / "b" / "two").write_bytes(b"22")
    (tree / "a" / "b" / "link").symlink_to(outside / "secret.txt")
    (tree / "to-outside").symlink_to(outside)
    assert tree_size(tree) == 3


@as_root
def test_another_uids_deep_read_only_tree(tmp_path: Path) -> None:
    """As a kernel leaves it in its launch folder: the sandbox's uid owns every folder."""
    tree = tmp_path / "tree"
    tree.mkdir()
    os.chown(tree, SANDBOX_UID, SANDBOX_UID)
    deep_tree(tree, owner=(SANDBOX_UID, SANDBOX_UID))
    tree.chmod(0o500)
    delete_tree(tree)
    assert not tree.exists()


@as_root
def test_a_server_not_root_removes_its_own_locked_folders(tmp_path: Path) -> None:
    """Without root, read-only and unreadable folders of the process's own uid are made
    writable first (root needs no such thing)."""
    tree = tmp_path / "tree"
    (tree / "hidden" / "deeper").mkdir(parents=True)
    (tree / "hidden" / "deeper" / "f").write_text("x")
    deep_tree(tree / "hidden", 100, owner=(SANDBOX_UID, SANDBOX_UID))
    for path in (tmp_path, tree, tree / "hidden", tree / "hidden" / "deeper"):
        os.chown(path, SANDBOX_UID, SANDBOX_UID)
    (tree / "hidden" / "deeper").chmod(0o000)
    (tree / "hidden").chmod(0o500)
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)  # its own parents are root's, 0700
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.setgid(SANDBOX_UID)
            os.setuid(SANDBOX_UID)
            delete_tree("tree", dir_fd=parent)
            code = 0
        finally:
            os._exit(code)
    os.close(parent)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not tree.exists()


def test_each_folder_is_handed_over_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``owner``, kernel code still running can add nothing to a folder being emptied."""
    tree = tmp_path / "tree"
    deep_tree(tree, 20)
    (tree / "wide").mkdir()
    for n in range(5):
        (tree / "wide" / str(n)).mkdir(mode=0o777)
    owner = (os.getuid(), os.getgid())
    seen: list[tuple[int, int, int]] = []
    real_scandir = os.scandir

    def scandir(fd: Any) -> Any:
        st = os.fstat(fd)
        seen.append((st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)))
        return real_scandir(fd)

    monkeypatch.setattr(os, "scandir", scandir)
    delete_tree(tree, owner=owner)
    assert not tree.exists()
    assert len(seen) == 1 + 20 + 1 + 5
    assert set(seen) == {(*owner, 0o700)}


def test_a_folder_moved_out_from_under_the_walk_stops_it(
    tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Climbing back through ``..`` from a folder that was moved would lead out of the tree."""
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_text("x")
    real_open = os.open

    def racing_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if path == "b" and dir_fd is not None and (tree / "a").exists():
            (tree / "a").rename(outside / "a")  # the walk is in a, about to enter b
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", racing_open)
    with pytest.raises(OSError, match="a folder was moved while the host walked it") as raised:
        delete_tree(tree)
    assert raised.value.errno == errno.ESTALE
    assert (outside / "secret.txt").read_text() == "host secret"
    assert (outside / "a").is_dir(), "nothing above the moved folder was removed"


def test_a_failure_does_not_stop_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = tmp_path / "tree"
    for name in ("a", "b", "c"):
        (tree / name).mkdir(parents=True)
        (tree / name / "f").write_text("x")
    real_unlink = os.unlink

    def unlink(path: Any, *, dir_fd: int | None = None) -> None:
        if path == "f" and os.fstat(dir_fd).st_ino == (tree / "b").stat().st_ino:  # type: ignore[arg-type]
            raise OSError(errno.EBUSY, "busy", path)
        real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(OSError, match="busy"):
        delete_tree(tree)
    assert sorted(os.listdir(tree)) == ["b"]
    assert os.listdir(tree / "b") == ["f"]


@as_root
def test_another_file_system_mounted_inside_is_not_entered(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    mount_point = tree / "mnt"
    mount_point.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mount_point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        (mount_point / "kept").write_text("x")
        with pytest.raises(OSError, match="another file system is mounted there"):
            delete_tree(tree)
        assert (mount_point / "kept").exists()
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)
    delete_tree(tree)
    assert not tree.exists()
