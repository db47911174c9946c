"""Removing and measuring folder trees kernel code made: deeper than Python's recursion
limit, full of links, read-only, another uid's, changing under the walk; and opening one
folder of a user's by its path, the way a gateway pins a workspace: no link followed at any
level, whose each folder is read on the descriptor opened, any name, any depth."""

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

from sandbox_kernel.host.trees import ForeignFolderError, delete_tree, open_folder, tree_size

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


# ---------------------------------------------------------------------- opening one folder


def same_folder(fd: int, path: Path) -> bool:
    st, there = os.fstat(fd), os.stat(path)
    return (st.st_dev, st.st_ino) == (there.st_dev, there.st_ino)


@pytest.fixture
def chain(tmp_path: Path) -> Path:
    """``root/a/b/c``, folders of this process's uid (``root`` is the walk's ``owned_from``)."""
    (tmp_path / "root" / "a" / "b" / "c").mkdir(parents=True)
    return tmp_path / "root"


def test_a_folder_is_opened_as_the_one_its_path_names_now(chain: Path) -> None:
    fd = open_folder(chain / "a" / "b" / "c", os.getuid(), chain)
    try:
        assert same_folder(fd, chain / "a" / "b" / "c")
        assert os.fstat(fd).st_mode & stat.S_IFDIR
    finally:
        os.close(fd)
    fd = open_folder("/")
    assert same_folder(fd, Path("/"))
    os.close(fd)


@pytest.mark.parametrize("level", ["a", "a/b", "a/b/c"])
def test_a_link_at_any_level_is_refused_naming_it(chain: Path, tmp_path: Path, level: str) -> None:
    """Even a link to the very folder it replaces, and one of the folder's own owner."""
    swapped = chain / level
    swapped.rename(tmp_path / "aside")
    swapped.symlink_to(tmp_path / "aside")
    with pytest.raises(NotADirectoryError, match="is a link or not a folder") as refused:
        open_folder(chain / "a" / "b" / "c", os.getuid(), chain)
    assert refused.value.filename == str(swapped)


def test_a_link_above_the_checked_folders_is_refused_too(tmp_path: Path) -> None:
    (tmp_path / "real" / "root").mkdir(parents=True)
    (tmp_path / "via").symlink_to(tmp_path / "real")
    with pytest.raises(NotADirectoryError) as refused:
        open_folder(tmp_path / "via" / "root", os.getuid(), tmp_path / "via" / "root")
    assert refused.value.filename == str(tmp_path / "via")


def test_a_file_or_a_missing_name_on_the_way_is_refused(chain: Path) -> None:
    (chain / "a" / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        open_folder(chain / "a" / "file", os.getuid(), chain)
    with pytest.raises(FileNotFoundError):
        open_folder(chain / "a" / "missing" / "c", os.getuid(), chain)


@pytest.mark.parametrize(
    "path", ["relative/a", "/tmp/../etc", "/tmp/./x", "/tmp//x", "/tmp/x/", "", "/tmp/x/.."]
)
def test_only_an_absolute_normalised_path_is_walked(path: str) -> None:
    with pytest.raises(ValueError, match=r"not an absolute path without '\.', '\.\.' or empty names"):
        open_folder(path)


def test_the_checked_folders_start_at_or_above_the_folder(chain: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"is not .* or a folder above it"):
        open_folder(chain / "a", os.getuid(), chain / "a" / "b")
    with pytest.raises(ValueError, match=r"is not .* or a folder above it"):
        open_folder(chain / "a", os.getuid(), tmp_path / "elsewhere")


@as_root
def test_a_folder_of_another_uid_from_the_root_down_is_refused_naming_it(chain: Path) -> None:
    b, c = chain / "a" / "b", chain / "a" / "b" / "c"
    os.chown(b, SANDBOX_UID, SANDBOX_UID)
    with pytest.raises(ForeignFolderError, match=f"belongs to uid {SANDBOX_UID}") as refused:
        open_folder(c, 0, chain)
    assert (refused.value.filename, refused.value.owner) == (str(b), SANDBOX_UID)
    with pytest.raises(ForeignFolderError) as refused:
        open_folder(c, SANDBOX_UID, b)
    assert (refused.value.filename, refused.value.owner) == (str(c), 0)
    # Above the checked folders any owner goes (root's /, /home); from there down, only the one.
    os.chown(c, SANDBOX_UID, SANDBOX_UID)
    fd = open_folder(c, SANDBOX_UID, b)
    assert same_folder(fd, c)
    os.close(fd)
    with pytest.raises(ForeignFolderError) as refused:
        open_folder(c, SANDBOX_UID, chain)
    assert (refused.value.filename, refused.value.owner) == (str(chain), 0)


@pytest.mark.parametrize(
    "name",
    [
        "with spaces",
        "new\nline",
        "carriage\rreturn",
        "tab\there",
        "back\\slash",
        os.fsdecode(b"latin-1 caf\xe9"),  # not UTF-8: a lone surrogate for the byte
        "n" * 255,
        "é" * 127,  # 254 bytes of UTF-8
        "-starts-with-a-dash",
    ],
)
def test_any_name_a_file_system_takes_is_walked(chain: Path, name: str) -> None:
    folder = chain / name / "inner"
    folder.mkdir(parents=True)
    fd = open_folder(folder, os.getuid(), chain)
    try:
        assert same_folder(fd, folder)
    finally:
        os.close(fd)


def test_a_path_longer_than_the_system_takes_is_walked_a_descriptor_at_a_time(
    tmp_path: Path, few_descriptors: None
) -> None:
    """300 levels of 30-byte names: 9300 bytes, beyond PATH_MAX (4096), with 64 descriptors."""
    name = "d" * 30
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(300):
        os.mkdir(name, dir_fd=fd)
        below = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = below
    bottom = os.fstat(fd)
    os.close(fd)
    deep = f"{tmp_path}/" + "/".join([name] * 300)
    assert len(os.fsencode(deep)) > 4096
    fd = open_folder(deep, os.getuid(), tmp_path)
    try:
        st = os.fstat(fd)
        assert (st.st_dev, st.st_ino) == (bottom.st_dev, bottom.st_ino)
    finally:
        os.close(fd)
    delete_tree(tmp_path / name)


def test_a_folder_swapped_once_checked_is_not_what_the_walk_opens_next(
    chain: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user swaps ``a/b`` for a link just after the walk checked ``a`` (and the walk goes
    on from ``a``'s descriptor), or ``a`` itself just after it was checked: the first is
    refused, the second opens the folder checked, not the one put in its place."""
    real_fstat = os.fstat
    swaps = {1: chain / "a" / "b"}

    def fstat(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        swapped = swaps.pop(len(calls), None)
        calls.append(fd)
        if swapped is not None:
            swapped.rename(tmp_path / f"aside-{swapped.name}")
            swapped.symlink_to(tmp_path / f"aside-{swapped.name}")
        return st

    calls: list[int] = []
    monkeypatch.setattr(os, "fstat", fstat)
    with pytest.raises(NotADirectoryError):
        open_folder(chain / "a" / "b" / "c", os.getuid(), chain)
    monkeypatch.undo()

    (chain / "a" / "b").unlink()
    (tmp_path / "aside-b").rename(chain / "a" / "b")
    fd = open_folder(chain / "a", os.getuid(), chain)
    (chain / "a").rename(tmp_path / "moved")
    (chain / "a").mkdir()  # another folder under the old name, as the user could
    try:
        assert same_folder(fd, tmp_path / "moved"), "the descriptor is the folder checked, wherever it went"
    finally:
        os.close(fd)
