"""Saving a sandbox with runsc itself: the command, where its state root comes from, and
the links that let Docker start from the image without copying it."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from sandbox_kernel.backends import gvisor_checkpoint
from sandbox_kernel.backends.gvisor_checkpoint import (
    checkpoint_command,
    containerd_temp_dirs,
    dirty_room,
    image_folder,
    is_state_root,
    link_image,
    restore_copies,
    runsc_root,
    supports_direct_io,
    writes_through_cache,
)

SANDBOX_CMDLINE = b"\0".join(
    [
        b"--log-format=json",
        b"--host-uds=create",
        b"--network=none",
        b"--oci-seccomp=true",
        b"--root=/var/run/docker/runtime-runc/moby",
        b"--log-fd=3",
        b"boot",
        b"--root=/not/this/one",
        b"abc",
        b"",
    ]
)


def test_the_state_root_is_read_from_runscs_own_flags_only() -> None:
    assert runsc_root(SANDBOX_CMDLINE) == "/var/run/docker/runtime-runc/moby"
    assert runsc_root(b"--root\0/run/x\0boot\0") == "/run/x", "a flag and its value apart"
    assert runsc_root(b"--network=none\0boot\0--root=/run/x\0") is None, "after the subcommand: not runsc's"
    assert runsc_root(b"--root=relative\0boot\0") is None
    assert runsc_root(b"") is None


def test_the_command_saves_uncompressed_with_the_runtimes_flags_and_its_root(tmp_path: Path) -> None:
    image = image_folder(tmp_path / "containers" / "c1", "sk-1")
    assert image == tmp_path / "containers" / "c1" / "sandbox-kernel-checkpoints" / "sk-1"
    args = ["--network=none", "--host-uds=create", "--root=/elsewhere", "--platform=ptrace"]
    command = checkpoint_command("/usr/bin/runsc", args, "/run/r", image, "c1", direct=True)
    assert command == [
        "/usr/bin/runsc",
        "--network=none",
        "--host-uds=create",
        "--platform=ptrace",
        "--root=/run/r",
        "checkpoint",
        "-compression=none",
        "-exclude-committed-zero-pages",
        "-direct",
        f"--image-path={image}",
        "c1",
    ]
    assert "-direct" not in checkpoint_command("/usr/bin/runsc", [], "/run/r", image, "c1", direct=False)
    assert "-direct" not in checkpoint_command("/usr/bin/runsc", args, "/run/r", image, "c1"), "by default"


def test_dockers_checkpoint_folder_gets_links_to_the_image_not_copies(tmp_path: Path) -> None:
    image = tmp_path / "image"
    image.mkdir()
    (image / "pages.img").write_bytes(b"p" * 4096)
    (image / "checkpoint.img").write_bytes(b"c")
    checkpoint = tmp_path / "checkpoints" / "sk-1"
    link_image(image, checkpoint)
    assert sorted(p.name for p in checkpoint.iterdir()) == ["checkpoint.img", "pages.img"]
    for entry in checkpoint.iterdir():
        assert entry.is_symlink()
        assert os.readlink(entry) == str(image / entry.name), "absolute: read from containerd's copy"
    assert (checkpoint / "pages.img").read_bytes() == b"p" * 4096
    assert checkpoint.stat().st_mode & 0o777 == 0o700


def test_direct_io_is_used_only_where_the_file_system_takes_it(tmp_path: Path) -> None:
    folder = tmp_path / "image"
    assert supports_direct_io(folder) is False, "no folder: no probe"
    folder.mkdir()
    assert isinstance(supports_direct_io(folder), bool)
    assert list(folder.iterdir()) == [], "the probe leaves nothing"


def test_the_image_goes_through_the_page_cache_where_it_fits_in_the_dirty_memory_allowed() -> None:
    """Docker's restore reads the pages file buffered: an image in the page cache is read
    from memory (1 GiB: 1.5 s to the first reply, against 2.3-3.4 s from the disk). Past
    the dirty limit the writer would wait for the disk: O_DIRECT then, as when unknown."""
    gib = 2**30
    assert writes_through_cache(1 * gib, (20 * gib, 20)), "4 GiB may be dirty"
    assert writes_through_cache(4 * gib, (20 * gib, 20))
    assert not writes_through_cache(5 * gib, (20 * gib, 20)), "more than the host lets wait for the disk"
    assert not writes_through_cache(None, (20 * gib, 20)), "the kernel's memory unknown"
    assert not writes_through_cache(1 * gib, (None, 0)), "the host's unknown"


def test_the_dirty_room_is_read_from_meminfo_and_the_vm_settings(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "sys" / "vm").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       24683520 kB\nMemAvailable:   20000000 kB\n")
    (proc / "sys" / "vm" / "dirty_ratio").write_text("20\n")
    (proc / "sys" / "vm" / "dirty_bytes").write_text("0\n")
    assert dirty_room(proc) == (20000000 * 1024, 20)
    (proc / "sys" / "vm" / "dirty_bytes").write_text("1073741824\n")
    assert dirty_room(proc) == (2**30, 100), "dirty_bytes, where set, replaces the ratio"
    (proc / "meminfo").unlink()
    (proc / "sys" / "vm" / "dirty_bytes").write_text("0\n")
    assert dirty_room(proc) == (None, 0)
    available, percent = dirty_room()
    assert available is None or (available > 0 and 0 <= percent <= 100), "this host's"


def test_a_state_root_must_hold_the_containers_state_in_folders_only_root_may_write(
    tmp_path: Path,
) -> None:
    """The root comes from the sandbox process's command line, its own memory: runsc is run
    as root only on a folder no other user could have made."""
    state = "c1_sandbox:c1.state"
    other = tmp_path / "theirs"  # under /tmp, which everyone may write to
    other.mkdir()
    (other / state).write_text("{}")
    assert not is_state_root(str(other), "c1")
    assert not is_state_root("relative/root", "c1")
    if os.geteuid() != 0 or Path("/run").stat().st_mode & 0o022:
        pytest.skip("needs root and a /run only root may write to (CI has both)")
    root = Path(tempfile.mkdtemp(dir="/run", prefix="sk-test-"))
    try:
        root.chmod(0o700)
        assert not is_state_root(str(root), "c1"), "no state of this container"
        (root / state).write_text("{}")
        assert is_state_root(str(root), "c1")
        assert is_state_root(f"/var/run/{root.name}", "c1") == Path("/var/run").resolve().samefile("/run")
        assert not is_state_root(str(root), "c2")
        root.chmod(0o777)
        assert not is_state_root(str(root), "c1"), "writable by others"
    finally:
        shutil.rmtree(root)


def test_only_the_root_flag_of_the_runtime_is_replaced() -> None:
    args = ["--rootless=false", "--root", "/elsewhere", "-root=/x", "--network=none"]
    command = checkpoint_command("runsc", args, "/run/r", Path("/i"), "c1", direct=False)
    assert command[:4] == ["runsc", "--rootless=false", "--network=none", "--root=/run/r"]


# ---------------------------------------------------------------- what a resume leaves


def test_containerds_temp_folders_are_found_in_its_own_mount_namespace(tmp_path: Path) -> None:
    """containerd unpacks a checkpoint with Go's os.MkdirTemp(XDG_RUNTIME_DIR, ...):
    there, else in $TMPDIR, else /tmp; reached through /proc/PID/root."""
    proc = tmp_path / "proc"
    for pid, comm, environ in [
        ("101", b"containerd\n", b"PATH=/bin\0TMPDIR=/var/tmp\0"),
        ("102", b"containerd\n", b"XDG_RUNTIME_DIR=/run/user/0\0TMPDIR=/var/tmp\0"),
        ("103", b"containerd\n", b"XDG_RUNTIME_DIR=\0"),
        ("104", b"containerd-shim\n", b""),
        ("105", b"dockerd\n", b""),
    ]:
        (proc / pid).mkdir(parents=True)
        (proc / pid / "comm").write_bytes(comm)
        (proc / pid / "environ").write_bytes(environ)
    (proc / "106").mkdir()  # gone meanwhile: nothing to read
    (proc / "self").mkdir()
    assert sorted(containerd_temp_dirs(proc)) == [
        proc / "101" / "root" / "var" / "tmp",
        proc / "102" / "root" / "run" / "user" / "0",
        proc / "103" / "root" / "tmp",
    ]
    assert containerd_temp_dirs(tmp_path / "no-proc") == []


def _checkpoint_with_links(tmp_path: Path, container: str = "c1") -> Path:
    """Docker's folder of a checkpoint runsc saved: links to the image's files."""
    image = tmp_path / "containers" / container / "sandbox-kernel-checkpoints" / "sk-1"
    image.mkdir(parents=True)
    (image / "pages.img").write_bytes(b"p" * 4096)
    (image / "checkpoint.img").write_bytes(b"c")
    checkpoint = tmp_path / "containers" / container / "checkpoints" / "sk-1"
    link_image(image, checkpoint)
    return checkpoint


def _unpacked(temp: Path, name: str, checkpoint: Path) -> Path:
    """What containerd unpacks of ``checkpoint`` (its tar of it: links stay links)."""
    folder = temp / name
    folder.mkdir(parents=True)
    for entry in checkpoint.iterdir():
        if entry.is_symlink():
            (folder / entry.name).symlink_to(os.readlink(entry))
        else:
            shutil.copyfile(entry, folder / entry.name)
    return folder


def test_only_containerds_copy_of_this_checkpoint_is_found(tmp_path: Path) -> None:
    """Each resume left a ctrd-checkpoint* folder in the host's temp folder (issue #21);
    the one holding this checkpoint is found, never another program's."""
    checkpoint = _checkpoint_with_links(tmp_path)
    other = _checkpoint_with_links(tmp_path, "c2")
    temp = tmp_path / "tmp"
    ours = _unpacked(temp, "ctrd-checkpoint123", checkpoint)
    theirs = _unpacked(temp, "ctrd-checkpoint456", other)  # another container's resume
    more = _unpacked(temp, "ctrd-checkpoint789", checkpoint)
    (more / "notes.txt").write_text("not containerd's")
    named = _unpacked(temp, "my-checkpoint", checkpoint)  # not containerd's name
    (temp / "ctrd-checkpoint-link").symlink_to(ours)
    (temp / "ctrd-checkpoint-file").write_text("x")
    uid = os.getuid()
    assert restore_copies([temp, tmp_path / "missing"], checkpoint, owner=uid) == [ours]
    assert restore_copies([temp], checkpoint, owner=uid + 1) == [], "only containerd's own (root's)"
    assert restore_copies([temp], tmp_path / "no-checkpoint", owner=uid) == []
    assert all(path.exists() for path in (ours, theirs, more, named)), "finding removes nothing"


def test_a_copy_of_dockers_own_checkpoint_is_told_by_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Docker's own (slower) checkpoint holds the image's files themselves, and so does
    containerd's copy: same names, sizes and bytes (a big file's at both ends)."""
    monkeypatch.setattr(gvisor_checkpoint, "_WHOLE", 64)
    monkeypatch.setattr(gvisor_checkpoint, "_SAMPLE", 16)
    checkpoint = tmp_path / "checkpoints" / "sk-1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "checkpoint.img").write_bytes(b"state")
    (checkpoint / "pages.img").write_bytes(b"a" * 16 + b"m" * 100 + b"z" * 16)
    temp = tmp_path / "tmp"
    ours = _unpacked(temp, "ctrd-checkpoint1", checkpoint)
    small = _unpacked(temp, "ctrd-checkpoint2", checkpoint)
    (small / "checkpoint.img").write_bytes(b"State")
    big = _unpacked(temp, "ctrd-checkpoint3", checkpoint)
    (big / "pages.img").write_bytes(b"a" * 16 + b"m" * 100 + b"y" * 16)
    assert restore_copies([temp], checkpoint, owner=os.getuid()) == [ours]
    (checkpoint / "criu.work").mkdir()  # not a flat folder of files: nothing is told
    assert restore_copies([temp], checkpoint, owner=os.getuid()) == []


@pytest.mark.parametrize(
    ("version", "release", "resurrects"),
    [
        ("runsc version 0.0~20240729.0\nspec: 1.0.2-dev\n", 20240729, True),  # Debian's
        ("runsc version release-20260330.0\nspec: 1.2.0\n", 20260330, False),  # the fix's
        ("runsc version release-20260817.0\n", 20260817, False),
        ("runsc version 0.0~20221219.0\n", 20221219, True),
        ("runsc version VERSION_MISSING\n", None, True),  # a build from source: assume the bug
        ("", None, True),
    ],
)
def test_runsc_releases_that_restore_a_deleted_epoll_entry(
    version: str, release: int | None, resurrects: bool
) -> None:
    assert gvisor_checkpoint.runsc_release(version) == release
    assert gvisor_checkpoint.resurrects_epoll_entries(version) is resurrects
