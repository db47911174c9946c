"""Sealing a kernel's launch folder: only its sockets and the host's own files stay."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sandbox_kernel.errors import KernelStartupError
from sandbox_kernel.lifecycle.launch_folder import seal_launch_dir
from sandbox_kernel.plan.sandbox_spec import kernel_sockets

from .conftest import deep_tree

#: The server's own uid and gid, so that these tests run as any user.
ME = (os.getuid(), os.getgid())


def make_socket_file(path: Path) -> None:
    """A socket's entry, as binding one leaves it."""
    os.mknod(path, stat.S_IFSOCK | 0o600)


@pytest.fixture
def launch_dir(tmp_path: Path) -> Path:
    """A launch folder as a kernel leaves it once up: its five sockets and the host's files."""
    folder = tmp_path / "run1"
    folder.mkdir(mode=0o700)
    for path in kernel_sockets(folder).values():
        make_socket_file(path)
    (folder / "connection.json").write_text("{}")
    (folder / "startup.py").write_text("pass\n")
    return folder


def expected(folder: Path) -> set[str]:
    return {path.name for path in kernel_sockets(folder).values()} | {"connection.json", "startup.py"}


def test_a_clean_folder_is_only_handed_over(launch_dir: Path) -> None:
    assert seal_launch_dir(launch_dir, ME) == []
    assert set(os.listdir(launch_dir)) == expected(launch_dir)
    st = launch_dir.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*ME, 0o755)
    assert (launch_dir / "connection.json").read_text() == "{}"


def test_whatever_the_kernel_made_before_the_seal_is_removed(launch_dir: Path) -> None:
    """A world-writable folder (nested, one level read-only), a file, and a folder under a
    host file's name: none survives, so nothing in the folder stays writable to the kernel."""
    early = launch_dir / "early"
    (early / "deeper" / "deepest").mkdir(parents=True)
    (early / "deeper" / "deepest" / "file").write_text("x")
    (early / "deeper").chmod(0o555)
    early.chmod(0o777)
    (launch_dir / "junk").write_text("x")
    (launch_dir / "startup.py").unlink()
    (launch_dir / "startup.py").mkdir(mode=0o777)
    (launch_dir / "startup.py" / "x").write_text("x")
    make_socket_file(launch_dir / "kernel-9")

    removed = seal_launch_dir(launch_dir, ME)

    assert removed == ["early", "junk", "kernel-9", "startup.py"]
    assert set(os.listdir(launch_dir)) == expected(launch_dir) - {"startup.py"}


def test_the_egress_relay_socket_and_file_stay(launch_dir: Path) -> None:
    make_socket_file(launch_dir / "egress.sock")
    (launch_dir / "egress_relay.py").write_text("pass\n")
    assert seal_launch_dir(launch_dir, ME) == []
    assert {"egress.sock", "egress_relay.py"} <= set(os.listdir(launch_dir))


@pytest.mark.parametrize("name", ["kernel-1", "kernel-5", "egress.sock"])
@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_socket_name_taken_by_something_else_fails_the_start(
    launch_dir: Path, name: str, kind: str
) -> None:
    path = launch_dir / name
    path.unlink(missing_ok=True)
    if kind == "file":
        path.write_text("x")
    else:
        path.mkdir(mode=0o777)
    with pytest.raises(KernelStartupError, match=rf"{name} in .* not the socket the kernel binds"):
        seal_launch_dir(launch_dir, ME)
    assert stat.S_IMODE(launch_dir.stat().st_mode) == 0o755, "sealed all the same"


def test_a_tree_deeper_than_the_recursion_limit_is_removed(launch_dir: Path) -> None:
    """A kernelspec's argv (or code racing a pause) planted 3000 levels; the seal once
    raised RecursionError, failing the start (or the pause) with a raw error."""
    owner = (1000, 1000) if os.geteuid() == 0 else None  # the sandbox's uid made it
    deep_tree(launch_dir / "deep", owner=owner)
    if owner is not None:
        os.chown(launch_dir / "deep", *owner)
    assert seal_launch_dir(launch_dir, ME) == ["deep"]
    assert set(os.listdir(launch_dir)) == expected(launch_dir)
