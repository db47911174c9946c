"""The host side's files API on a temporary workspace: every refusal, races with a hostile
kernel simulated by swapping things in mid-walk, ownership, atomic uploads, limits."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sandbox_kernel.agents.files import (
    DEFAULT_MAX_BYTES,
    FileInfo,
    WorkspaceFiles,
    from_printable,
    printable,
    workspace_files,
)
from sandbox_kernel.backends.docker import DockerBackend
from sandbox_kernel.errors import WorkspaceError

from .conftest import deep_tree

UID, GID = 1234, 1235
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="handing files to another uid needs root")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A workspace holding ``team/analysis`` (the kernel's working folder) and a secret
    outside it."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("host secret")
    workspace = tmp_path / "workspace"
    (workspace / "team" / "analysis").mkdir(parents=True)
    return workspace


@pytest.fixture
def files(root: Path) -> WorkspaceFiles:
    return WorkspaceFiles(root, "/workspace/team/analysis", "/workspace", os.geteuid(), os.getegid())


@pytest.fixture
def at_root(root: Path) -> WorkspaceFiles:
    """The same workspace, with the kernel working at its root."""
    return WorkspaceFiles(root, "/workspace", "/workspace", os.geteuid(), os.getegid())


def refused(match: str) -> Any:
    return pytest.raises(WorkspaceError, match=match)


# ---------------------------------------------------------------- the round trip


def test_upload_download_list_delete(files: WorkspaceFiles, root: Path) -> None:
    here = root / "team" / "analysis"
    assert files.upload("data/x.csv", "a,b\n1,2\n") == "/workspace/team/analysis/data/x.csv"
    assert (here / "data" / "x.csv").read_text() == "a,b\n1,2\n"
    assert files.download("data/x.csv") == b"a,b\n1,2\n"
    assert files.download("/workspace/team/analysis/data/x.csv") == b"a,b\n1,2\n"
    (here / "notes.txt").write_bytes(b"12345")

    listed = files.list()
    assert [(i.name, i.path, i.is_dir) for i in listed] == [
        ("data", "data", True),
        ("notes.txt", "notes.txt", False),
    ]
    notes = listed[1]
    assert notes.size == 5
    assert notes.modified == pytest.approx((here / "notes.txt").stat().st_mtime)
    assert files.list("data") == [
        FileInfo("x.csv", "data/x.csv", 8, False, (here / "data" / "x.csv").stat().st_mtime)
    ]

    files.delete("data/x.csv")
    files.delete("data")
    assert files.list() == [FileInfo("notes.txt", "notes.txt", 5, False, notes.modified)]


def test_paths_outside_the_working_folder_are_absolute_in_the_sandbox(
    files: WorkspaceFiles, root: Path
) -> None:
    (root / "shared.txt").write_text("s")
    assert [i.path for i in files.list("/workspace")] == ["/workspace/shared.txt", "/workspace/team"]
    assert files.download("/workspace/shared.txt") == b"s"
    assert files.upload("/workspace/new.txt", b"n") == "/workspace/new.txt"
    assert (root / "new.txt").read_bytes() == b"n"


def test_a_pooled_layout_maps_its_own_workspace_path(root: Path) -> None:
    files = WorkspaceFiles(root, "/workspace/proj/team", "/workspace/proj", os.geteuid(), os.getegid())
    assert files.upload("x", "1") == "/workspace/proj/team/x"
    assert (root / "team" / "x").read_text() == "1"
    with refused("outside the workspace"):
        files.download("/workspace/other/x")


def test_a_working_folder_outside_the_workspace_path_is_refused(root: Path) -> None:
    with refused("not under its workspace's path"):
        WorkspaceFiles(root, "/tmp", "/workspace", 1000, 1000)


# ---------------------------------------------------------------- paths that leave


@pytest.mark.parametrize("path", ["../../../outside/secret.txt", "../../..", "a/../../../../x"])
def test_dotdot_out_of_the_workspace_is_refused(files: WorkspaceFiles, path: str) -> None:
    with refused(f"{path!r} leaves the workspace"):
        files.download(path)


def test_dotdot_even_inside_the_workspace_is_not_followed(files: WorkspaceFiles) -> None:
    with refused(r"contains '\.\.'.*'/workspace/team/x'"):
        files.upload("../x", "x")


@pytest.mark.parametrize("path", ["/etc/passwd", "/workspaces/x", "/", "/tmp/x"])
def test_absolute_paths_outside_the_workspace_are_refused(files: WorkspaceFiles, path: str) -> None:
    with refused("is outside the workspace: only paths under /workspace"):
        files.download(path)
    with refused("is outside the workspace"):
        files.upload(path, "x")


def test_a_nul_character_is_refused(files: WorkspaceFiles) -> None:
    with refused("NUL"):
        files.upload("a\0b", "x")


@pytest.mark.parametrize("call", ["download", "list", "delete"])
def test_no_such_file_says_so(files: WorkspaceFiles, call: str) -> None:
    with refused("No such (file|folder) 'nope'"):
        getattr(files, call)("nope")
    with refused(r"No such folder 'nope' in the workspace \(for 'nope/x'\)"):
        getattr(files, call)("nope/x")


@pytest.mark.parametrize("call", ["download", "list", "delete"])
def test_a_missing_file_is_a_file_not_found_error_too(files: WorkspaceFiles, call: str) -> None:
    """#23 item 14: code written for local files catches FileNotFoundError."""
    for path in ("nope", "nope/x"):
        with pytest.raises(FileNotFoundError, match="No such") as caught:
            getattr(files, call)(path)
        assert isinstance(caught.value, WorkspaceError)
        assert caught.value.errno == errno.ENOENT
        assert str(caught.value).startswith("No such"), "the message as it was, no [Errno 2]"


def test_a_workspace_folder_gone_from_the_host_says_so(tmp_path: Path) -> None:
    files = WorkspaceFiles(tmp_path / "gone", "/workspace", "/workspace", 1, 1)
    with refused("no longer exists on the host"):
        files.list()


# ---------------------------------------------------------------- odd names, one-line errors


@pytest.mark.parametrize("call", ["upload", "download", "list", "delete"])
def test_a_name_too_long_is_a_clear_one_line_error(files: WorkspaceFiles, call: str) -> None:
    """A 300-byte name once raised OSError(36) ("File name too long") out of the files API
    and through MCP; the message also quoted the whole name."""
    path = "data/" + "x" * 300 + ".csv"
    arguments = (path, "x") if call == "upload" else (path,)
    with refused("has a name of 304 bytes: a file or folder name may be at most 255 bytes") as caught:
        getattr(files, call)(*arguments)
    message = str(caught.value)
    assert "\n" not in message
    assert len(message) < 300, "a long name is quoted shortened"


def test_a_path_the_kernel_could_not_open_is_refused(files: WorkspaceFiles, root: Path) -> None:
    deep = "/".join(["abcdefgh"] * 500) + "/f.txt"
    with refused(r"is 4\d{3} bytes long in the sandbox: the kernel could not open a path over 4095"):
        files.upload(deep, "x")
    assert not (root / "team" / "analysis" / "abcdefgh").exists(), "nothing was made on the way"


def test_odd_names_give_one_line_messages(files: WorkspaceFiles, root: Path) -> None:
    with refused(r"'line\\none\\x1b\[2J'"):  # quoted with escapes: the message stays one line
        files.download("line\none\x1b[2J")
    with refused("a lone surrogate"):
        files.upload("bad\ud800.txt", "x")
    with refused("ends with '/', so it names a folder"):
        files.upload("data/", "x")
    assert files.upload("tab\tand\nnewline.txt", "fine") == "/workspace/team/analysis/tab\tand\nnewline.txt"
    assert files.download("tab\tand\nnewline.txt") == b"fine"


# ---------------------------------------------------------------- the root itself


def swap_root_for_link(root: Path, target: Path) -> None:
    """What the owner of the folder above the workspace can do while a kernel runs."""
    root.rename(root.with_name("moved-away"))
    root.symlink_to(target, target_is_directory=True)


@pytest.mark.parametrize("call", ["upload", "download", "list", "delete"])
def test_a_workspace_swapped_for_a_link_is_refused(
    files: WorkspaceFiles, root: Path, tmp_path: Path, call: str
) -> None:
    """A local user who owns the folder above the workspace swapped it for a link to a
    root-only folder: the root was opened following links, so root's files API read and
    wrote there."""
    private = tmp_path / "root-only"
    (private / "team" / "analysis").mkdir(parents=True)
    (private / "team" / "analysis" / "secret.txt").write_text("root's")
    private.chmod(0o700)
    swap_root_for_link(root, private)
    arguments = {"upload": ("new.txt", "x"), "list": (".",)}.get(call, ("secret.txt",))
    with refused(f"The workspace's folder '{root}' on the host is now a symbolic link"):
        getattr(files, call)(*arguments)
    assert sorted(os.listdir(private / "team" / "analysis")) == ["secret.txt"]
    assert (private / "team" / "analysis" / "secret.txt").read_text() == "root's"


def test_a_workspace_swapped_for_another_folder_is_refused(
    files: WorkspaceFiles, root: Path, tmp_path: Path
) -> None:
    """A link above the root is followed by the kernel's mount path too; what the files
    API checks is that the root is still the folder it was."""
    other = tmp_path / "other"
    (other / "team" / "analysis").mkdir(parents=True)
    root.rename(root.with_name("moved-away"))
    other.rename(root)
    with refused("is no longer the folder the kernel was started with"):
        files.list()
    with refused("is no longer the folder the kernel was started with"):
        files.upload("x.txt", "x")
    assert os.listdir(root / "team" / "analysis") == []


def test_a_workspace_that_is_a_link_from_the_start_is_refused(root: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(root, target_is_directory=True)
    files = WorkspaceFiles(link, "/workspace", "/workspace", os.geteuid(), os.getegid())
    with refused("is now a symbolic link"):
        files.list()


async def test_the_kernels_info_names_the_folder_it_mounts(root: Path, tmp_path: Path) -> None:
    """The identity the provisioner recorded at the start wins over what the root is now."""
    st = root.stat()
    same = await workspace_files(info(root, workspace_identity=[st.st_dev, st.st_ino]))
    assert same.identity == (st.st_dev, st.st_ino)
    assert same.list("/workspace") == same.list("/workspace")
    other = await workspace_files(info(root, workspace_identity=[st.st_dev, st.st_ino + 1]))
    with refused("is no longer the folder the kernel was started with"):
        other.list()


# ---------------------------------------------------------------- links and special files


@pytest.fixture
def links(root: Path) -> Path:
    """Host-made links in the working folder: to a file and a folder outside, and inside."""
    here = root / "team" / "analysis"
    outside = root.parent / "outside"
    (here / "data").mkdir()
    (here / "data" / "ok.txt").write_text("ok")
    (here / "data" / "link").symlink_to(outside / "secret.txt")
    (here / "linkdir").symlink_to(outside)
    (here / "inner").symlink_to(here / "data")
    return here


@pytest.mark.parametrize(
    ("path", "shown"),
    [
        ("data/link", "data/link"),  # at the end, to a file outside
        ("linkdir/secret.txt", "linkdir"),  # in the middle, to a folder outside
        ("inner/ok.txt", "inner"),  # in the middle, even to a folder inside
        ("/workspace/team/analysis/linkdir/secret.txt", "linkdir"),
    ],
)
def test_symbolic_links_are_never_followed(files: WorkspaceFiles, links: Path, path: str, shown: str) -> None:
    message = f"{shown!r} is a symbolic link: the files API never follows links"
    with refused(message):
        files.download(path)
    with refused(message):
        files.upload(path, "overwrite")
    with refused(message):
        files.delete(path)
    assert (links.parent.parent.parent / "outside" / "secret.txt").read_text() == "host secret"
    assert os.path.islink(links / "data" / "link")


@pytest.mark.parametrize("path", ["linkdir", "inner"])
def test_a_link_to_a_folder_is_not_listed_through(files: WorkspaceFiles, links: Path, path: str) -> None:
    with refused(f"{path!r} is a symbolic link"):
        files.list(path)


def test_links_are_left_out_of_listings(files: WorkspaceFiles, links: Path) -> None:
    assert [i.name for i in files.list()] == ["data"]
    assert [i.name for i in files.list("data")] == ["ok.txt"]


def test_a_symlinked_working_folder_is_refused(root: Path, tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.mkdir()
    (root / "team" / "analysis").rmdir()
    (root / "team" / "analysis").symlink_to(real)
    files = WorkspaceFiles(root, "/workspace/team/analysis", "/workspace", 1, 1)
    with refused("'/workspace/team/analysis' is a symbolic link"):
        files.list()


def test_a_fifo_is_refused_without_waiting_for_a_writer(files: WorkspaceFiles, root: Path) -> None:
    fifo = root / "team" / "analysis" / "pipe"
    os.mkfifo(fifo)
    with refused("'pipe' is a fifo, not a regular file"):
        files.download("pipe")
    with refused("'pipe' is a fifo: an upload only creates or replaces regular files"):
        files.upload("pipe", "x")
    with refused(r"'pipe' is a fifo, not a folder \(for 'pipe/x'\)"):
        files.upload("pipe/x", "x")
    assert files.list() == []
    files.delete("pipe")  # removing the name is harmless
    assert not fifo.exists()


@as_root
def test_a_device_file_is_refused_unopened(files: WorkspaceFiles, root: Path) -> None:
    os.mknod(root / "team" / "analysis" / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    with refused("'null' is a device file, not a regular file"):
        files.download("null")
    with refused("'null' is a device file: an upload only creates or replaces regular files"):
        files.upload("null", "x")
    assert files.list() == []


def test_a_file_swapped_for_a_device_after_the_check_is_refused(
    files: WorkspaceFiles, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (root / "team" / "analysis" / "dev").write_text("")
    real_fstat = os.fstat

    def as_device(fd: int) -> os.stat_result:  # what fstat says of what was opened
        st = real_fstat(fd)
        return os.stat_result((stat.S_IFCHR | 0o666, *tuple(st)[1:]))

    monkeypatch.setattr(os, "fstat", as_device)
    with refused("'dev' is a device file, not a regular file"):
        files.download("dev")


def test_a_file_with_more_than_one_hard_link_is_not_read(files: WorkspaceFiles, root: Path) -> None:
    outside = root.parent / "outside" / "secret.txt"
    os.link(outside, root / "team" / "analysis" / "hard")
    with refused("'hard' has 2 hard links, so it may be a file from outside the workspace"):
        files.download("hard")
    files.upload("hard", "mine")  # replaces the name; the other file is untouched
    assert files.download("hard") == b"mine"
    assert outside.read_text() == "host secret"


# ---------------------------------------------------------------- a kernel racing the host


def swap_before_open(monkeypatch: pytest.MonkeyPatch, name: str, swap: Callable[[], None]) -> list[str]:
    """Make ``swap()`` happen just before the files API opens ``name``, as a kernel
    racing the host would; what was opened by name is recorded."""
    real_open = os.open
    opened: list[str] = []

    def racing_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if path == name and dir_fd is not None and name not in opened:
            swap()
        opened.append(str(path) if dir_fd is None else f"{dir_fd}:{path}")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", racing_open)
    return opened


def test_a_folder_swapped_for_a_link_mid_walk_is_not_followed(
    files: WorkspaceFiles, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = root / "team" / "analysis"
    outside = root.parent / "outside"
    (here / "data").mkdir()

    def swap() -> None:
        (here / "data").rename(here / "data.old")
        (here / "data").symlink_to(outside)

    swap_before_open(monkeypatch, "data", swap)
    with refused("'data' is a symbolic link"):
        files.upload("data/secret.txt", "pwned")
    assert (outside / "secret.txt").read_text() == "host secret"


def test_a_file_swapped_for_a_link_before_reading_is_not_followed(
    files: WorkspaceFiles, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = root / "team" / "analysis"
    (here / "result.txt").write_text("result")

    def swap() -> None:
        (here / "result.txt").unlink()
        (here / "result.txt").symlink_to(root.parent / "outside" / "secret.txt")

    swap_before_open(monkeypatch, "result.txt", swap)
    with refused("'result.txt' is a symbolic link"):
        files.download("result.txt")


def test_a_folder_swapped_for_a_link_during_a_recursive_delete_is_not_followed(
    at_root: WorkspaceFiles, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = root.parent / "outside"
    (root / "tree" / "sub").mkdir(parents=True)
    (root / "tree" / "sub" / "f").write_text("f")

    def swap() -> None:
        (root / "tree" / "sub" / "f").unlink()
        (root / "tree" / "sub").rmdir()
        (root / "tree" / "sub").symlink_to(outside)

    swap_before_open(monkeypatch, "sub", swap)
    at_root.delete("tree", recursive=True)  # the link is removed in the folder's place
    assert not (root / "tree").exists()
    assert (outside / "secret.txt").read_text() == "host secret"


def test_a_folder_moved_during_a_recursive_delete_stops_it_inside_the_workspace(
    at_root: WorkspaceFiles, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernel code moving a folder the delete is in: climbing back through '..' would
    lead elsewhere, so the delete stops with a WorkspaceError."""
    (root / "tree" / "a" / "b").mkdir(parents=True)
    (root / "tree" / "a" / "b" / "f").write_text("f")
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "kept").write_text("kept")
    swap_before_open(monkeypatch, "b", lambda: (root / "tree" / "a").rename(root / "elsewhere" / "a"))
    with refused("Cannot delete 'tree' in the workspace: a folder was moved while the host walked it"):
        at_root.delete("tree", recursive=True)
    assert (root / "elsewhere" / "kept").read_text() == "kept"
    assert (root / "elsewhere" / "a").is_dir()


def test_the_walk_never_opens_a_path_string_after_the_root(
    files: WorkspaceFiles, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened = swap_before_open(monkeypatch, "-", lambda: None)
    files.upload("a/b/c.txt", "x")
    files.download("a/b/c.txt")
    by_path = [name for name in opened if ":" not in name]
    assert by_path == [str(root), str(root)], "only the root is opened by its path"
    by_name = [name.split(":", 1)[1] for name in opened if ":" in name]
    assert all("/" not in name for name in by_name), by_name


# ---------------------------------------------------------------- ownership and modes


@as_root
def test_what_the_host_writes_belongs_to_the_kernel(root: Path) -> None:
    files = WorkspaceFiles(root, "/workspace/team/analysis", "/workspace", UID, GID)
    old = os.umask(0o077)  # the host's umask does not decide the kernel's modes
    try:
        files.upload("new/deeper/x.txt", "x")
    finally:
        os.umask(old)
    here = root / "team" / "analysis"
    for path, mode in [
        (here / "new", 0o755),
        (here / "new" / "deeper", 0o755),
        (here / "new/deeper/x.txt", 0o644),
    ]:
        st = path.lstat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (UID, GID, mode), path
    assert (here.stat().st_uid, here.stat().st_gid) == (0, 0), "existing folders are left as they are"


@as_root
def test_an_overwritten_file_becomes_the_kernels(root: Path) -> None:
    target = root / "team" / "analysis" / "report.txt"
    target.write_text("root's")
    target.chmod(0o600)
    WorkspaceFiles(root, "/workspace/team/analysis", "/workspace", UID, GID).upload("report.txt", "new")
    st = target.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (UID, GID, 0o644)
    assert target.read_text() == "new"


def test_a_server_not_root_cannot_write_for_another_uid(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 4321)
    files = WorkspaceFiles(root, "/workspace", "/workspace", UID, GID)
    with refused("runs as uid 4321, not root, so what it writes cannot belong to the kernel's uid 1234"):
        files.upload("x", "x")
    assert not (root / "x").exists()


# ---------------------------------------------------------------- atomic uploads


def test_an_upload_replaces_the_file_in_one_step(
    at_root: WorkspaceFiles, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = root / "model.bin"
    target.write_bytes(b"old")
    seen: list[bytes] = []
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        seen.append(target.read_bytes())  # what a reader sees meanwhile
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    at_root.upload("model.bin", b"new" * 1000)
    assert seen == [b"old"]
    assert target.read_bytes() == b"new" * 1000
    assert sorted(p.name for p in root.iterdir()) == ["model.bin", "team"]


def test_a_failed_upload_leaves_the_old_file_and_no_temporary(
    at_root: WorkspaceFiles, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (root / "model.bin").write_bytes(b"old")

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with refused("Cannot write 'model.bin' in the workspace: No space left on device"):
        at_root.upload("model.bin", b"new")
    assert (root / "model.bin").read_bytes() == b"old"
    assert sorted(p.name for p in root.iterdir()) == ["model.bin", "team"]


def test_uploads_in_progress_are_not_listed(at_root: WorkspaceFiles, root: Path) -> None:
    (root / ".sandbox-kernel-upload-0123").write_text("partial")
    assert [i.name for i in at_root.list()] == ["team"]


def test_an_upload_never_replaces_a_folder(files: WorkspaceFiles, root: Path) -> None:
    (root / "team" / "analysis" / "data").mkdir()
    with refused("'data' is a folder: an upload only creates or replaces regular files"):
        files.upload("data", "x")
    with refused("is the workspace's folder, not a file name"):
        files.upload("/workspace", "x")


def test_a_file_in_the_way_of_a_folder_is_named(files: WorkspaceFiles, root: Path) -> None:
    (root / "team" / "analysis" / "data").write_text("a file")
    with refused(r"'data' is a regular file, not a folder \(for 'data/x'\)"):
        files.upload("data/x", "x")


# ---------------------------------------------------------------- sizes


def test_downloads_are_bounded(at_root: WorkspaceFiles, root: Path) -> None:
    (root / "big").write_bytes(b"x" * 1001)
    assert at_root.download("big", max_bytes=1001) == b"x" * 1001
    with refused(r"'big' \(1001 bytes\) is larger than the download limit of 1000 bytes"):
        at_root.download("big", max_bytes=1000)
    assert DEFAULT_MAX_BYTES == 100 * 1024 * 1024


def test_a_file_growing_while_read_is_still_bounded(
    at_root: WorkspaceFiles, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (root / "growing").write_bytes(b"x" * 10)
    real_fstat = os.fstat

    def stale(fd: int) -> os.stat_result:  # the size when opened, before the kernel wrote on
        st = real_fstat(fd)
        fields = list(st)
        fields[stat.ST_SIZE] = 1
        return os.stat_result(fields)

    monkeypatch.setattr(os, "fstat", stale)
    with refused(r"\(at least 6 bytes\) is larger than the download limit of 5 bytes"):
        at_root.download("growing", max_bytes=5)


# ---------------------------------------------------------------- delete


def test_delete_rules(at_root: WorkspaceFiles, root: Path) -> None:
    (root / "empty").mkdir()
    at_root.delete("empty")
    (root / "full" / "sub").mkdir(parents=True)
    (root / "full" / "sub" / "f").write_text("f")
    with refused("'full' is a folder that is not empty: delete it with recursive=True"):
        at_root.delete("full")
    assert (root / "full" / "sub" / "f").exists()
    at_root.delete("full", recursive=True)
    assert not (root / "full").exists()


def test_a_recursive_delete_unlinks_links_inside_without_following(
    at_root: WorkspaceFiles, root: Path
) -> None:
    outside = root.parent / "outside"
    (root / "tree").mkdir()
    (root / "tree" / "to-outside").symlink_to(outside)
    (root / "tree" / "to-secret").symlink_to(outside / "secret.txt")
    at_root.delete("tree", recursive=True)
    assert not (root / "tree").exists()
    assert (outside / "secret.txt").read_text() == "host secret"


def test_a_recursive_delete_of_a_tree_deeper_than_the_recursion_limit(
    at_root: WorkspaceFiles, root: Path
) -> None:
    """Kernel code (or an upload of deep/.../f) made 3000 levels: the delete once raised a
    raw RecursionError."""
    deep_tree(root / "deep")
    at_root.delete("deep", recursive=True)
    assert not (root / "deep").exists()
    assert Path("/etc/passwd").exists()


@pytest.mark.parametrize("path", [".", "/workspace", "/workspace/team", "/workspace/team/analysis", ""])
def test_the_working_folder_and_what_holds_it_are_never_deleted(files: WorkspaceFiles, path: str) -> None:
    with refused("is the kernel's working folder or holds it"):
        files.delete(path, recursive=True)


def test_names_that_are_not_utf8_are_listed_flagged_and_taken_back(
    at_root: WorkspaceFiles, root: Path
) -> None:
    """Kernel code named a file and a folder with a byte that is not UTF-8
    (``os.open(b'/workspace/bad\\xff.txt', ...)``)."""
    raw = os.fsencode(root)
    os.close(os.open(raw + b"/bad\xff.txt", os.O_WRONLY | os.O_CREAT, 0o644))
    os.mkdir(raw + b"/dir\xfe")
    with open(raw + b"/dir\xfe/inner.txt", "wb") as f:
        f.write(b"inner")
    (root / "plain.txt").write_text("plain")

    listed = {info.name: info for info in at_root.list()}
    bad = listed["bad\udcff.txt"]
    assert (bad.path, bad.undecodable) == ("bad\udcff.txt", True)
    assert not listed["plain.txt"].undecodable
    (inner,) = at_root.list(listed["dir\udcfe"].path)
    assert (inner.name, inner.path, inner.undecodable) == ("inner.txt", "dir\udcfe/inner.txt", True)
    assert printable(inner.path) == "dir\\xfe/inner.txt"
    assert from_printable(printable(inner.path)) == inner.path
    assert printable("caf\u00e9 \\x41") == "caf\u00e9 \\x41", "UTF-8 names are shown as they are"

    assert at_root.download(inner.path) == b"inner"
    at_root.delete(bad.path)
    at_root.delete(listed["dir\udcfe"].path, recursive=True)
    assert sorted(os.listdir(raw)) == [b"plain.txt", b"team"]


# ---------------------------------------------------------------- from a kernel's info


def info(root: Path, **changes: Any) -> dict[str, Any]:
    return {
        "workspace": str(root),
        "workdir": "/workspace/team/analysis",
        "workspace_path": "/workspace",
        "volume": None,
        "uid": UID,
        "gid": GID,
        **changes,
    }


async def test_a_folder_workspace_from_the_kernels_info(root: Path) -> None:
    files = await workspace_files(info(root))
    assert (files.root, files.workdir, files.workspace_path, files.uid, files.gid) == (
        root,
        "/workspace/team/analysis",
        "/workspace",
        UID,
        GID,
    )


async def test_a_volume_workspace_is_found_through_the_backend(root: Path) -> None:
    class Backend(DockerBackend):
        async def volume_path(self, name: str) -> Path:
            assert name == "vol-1"
            return root

    files = await workspace_files(info(Path("/launch/folder"), volume="vol-1"), Backend())
    assert files.root == root


async def test_info_of_a_kernel_that_never_started_is_refused() -> None:
    with refused("lacks workspace, workdir, workspace_path, uid, gid: it is not a started sandboxed kernel"):
        await workspace_files({"volume": None})
