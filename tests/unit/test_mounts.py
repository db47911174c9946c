"""Host mounts a gateway's kernels need: a user's folder pinned (mounted from the descriptor its
check opened, whatever happens to its path), and every mount found again to be detached,
whatever its folder is named, also in the runtime folder of a start its gateway died in."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox_kernel.host.mounts import detach_mounts, mounts_under, pin_folder
from sandbox_kernel.host.trees import ForeignFolderError
from sandbox_kernel.lifecycle.ownership import (
    OWNER_FILE,
    PINNED_WORKSPACE,
    RUNTIME_DIR_PREFIX,
    remove_tree,
    server_identity,
    stray_runtime_dirs,
)

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root (CI runs as root)")


def test_mounts_under_a_folder_are_found_whatever_their_names_bytes(tmp_path: Path) -> None:
    """mountinfo is bytes: a source folder not in UTF-8, a mount point with a carriage return
    (written as it is) or a newline (written as an escape) are read as they are."""
    info = tmp_path / "mountinfo"
    info.write_bytes(
        b"27 1 254:0 / / rw - ext4 /dev/vda rw\n"
        b"80 27 254:0 /home/ana/caf\xe9\\012x /tmp/sk-a/workspace rw - ext4 /dev/vda rw\n"
        b"81 27 254:0 /srv /tmp/sk-a/odd\rname\\040\\134 rw - ext4 /dev/vda rw\n"
        b"82 27 254:0 /srv /tmp/sk-a/caf\xe9 rw - ext4 /dev/vda rw\n"
        b"83 27 254:0 /srv /tmp/sk-ab rw - ext4 /dev/vda rw\n"
    )
    found = mounts_under(Path("/tmp/sk-a"), info)
    assert sorted(map(os.fsencode, found)) == [
        b"/tmp/sk-a/caf\xe9",
        b"/tmp/sk-a/odd\rname \\",
        b"/tmp/sk-a/workspace",
    ]


@pytest.fixture
def staging(tmp_path: Path) -> Iterator[Path]:
    """A root-only folder to pin on, detached afterwards whatever the test did."""
    private = tmp_path / "runtime"
    private.mkdir(mode=0o700)
    yield private / "workspace"
    assert detach_mounts(private) == []


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """``home/project`` with a file, this process's: its root is ``home``."""
    folder = tmp_path / "home" / "project"
    folder.mkdir(parents=True)
    (folder / "mine.txt").write_text("mine")
    return folder


@as_root
def test_a_pinned_folder_stays_the_folder_checked_whatever_its_path_becomes(
    project: Path, staging: Path, tmp_path: Path
) -> None:
    identity = pin_folder(project, staging, os.getuid(), project.parent)
    assert staging.stat().st_ino == identity[1] == project.stat().st_ino
    assert mounts_under(staging) == [staging]
    # Renamed, swapped for a link to another folder: the pin shows what was checked.
    project.rename(tmp_path / "moved")
    other = tmp_path / "other"
    other.mkdir()
    (other / "secret.txt").write_text("not hers")
    project.symlink_to(other)
    assert sorted(os.listdir(staging)) == ["mine.txt"]
    (staging / "written.txt").write_text("x")
    assert (tmp_path / "moved" / "written.txt").exists()
    assert detach_mounts(staging) == []
    assert os.listdir(staging) == [], "the staging folder itself holds nothing"


@as_root
def test_a_folder_that_is_not_what_was_checked_is_not_pinned_and_nothing_stays_mounted(
    project: Path, staging: Path, tmp_path: Path
) -> None:
    project.rename(tmp_path / "aside")
    project.symlink_to(tmp_path / "aside")
    with pytest.raises(NotADirectoryError):
        pin_folder(project, staging, os.getuid(), project.parent)
    assert mounts_under(staging) == []
    project.unlink()
    (tmp_path / "aside").rename(project)
    with pytest.raises(ForeignFolderError):
        pin_folder(project, staging, os.getuid() + 1, project.parent)
    assert mounts_under(staging) == []


@as_root
def test_pinning_again_replaces_what_was_pinned(project: Path, staging: Path, tmp_path: Path) -> None:
    """A restart pins again on the same staging folder: one mount there, the new one."""
    pin_folder(project, staging, os.getuid(), project.parent)
    second = project.parent / "second"
    second.mkdir()
    pin_folder(second, staging, os.getuid(), project.parent)
    assert mounts_under(staging) == [staging]
    assert staging.stat().st_ino == second.stat().st_ino


@as_root
@pytest.mark.parametrize("name", ["with spaces\nand a newline", os.fsdecode(b"caf\xe9"), "n" * 255])
def test_a_folder_of_any_name_is_pinned_and_detached(staging: Path, tmp_path: Path, name: str) -> None:
    folder = tmp_path / "home" / name
    folder.mkdir(parents=True)
    pin_folder(folder, staging, os.getuid(), folder.parent)
    assert staging.stat().st_ino == folder.stat().st_ino
    assert detach_mounts(staging.parent) == []


@as_root
def test_a_crashed_starts_runtime_folder_is_swept_with_its_pin_detached_and_her_files_kept(
    project: Path, tmp_path: Path
) -> None:
    """A gateway killed between the pin and its container leaves a runtime folder no sandbox
    uses, its owner gone: the sweep (``prune``, the next start, the reaper) finds it, and its
    removal detaches the pin before deleting anything, never through it."""
    parent = tmp_path / "runtime-parent"
    parent.mkdir()
    runtime = Path(tempfile.mkdtemp(prefix=RUNTIME_DIR_PREFIX, dir=parent))
    dead = subprocess.Popen(["true"])  # its pid, once it has ended, is no one's
    dead.wait()
    (runtime / OWNER_FILE).write_text(server_identity(dead.pid))
    pin_folder(project, runtime / PINNED_WORKSPACE, os.getuid(), project.parent)
    assert stray_runtime_dirs(str(parent), set()) == [runtime]
    remove_tree(runtime)
    assert not runtime.exists()
    assert mounts_under(parent) == []
    assert sorted(os.listdir(project)) == ["mine.txt"], "her files are where they were"
