"""Who owns a sandboxed kernel, and what may be removed when the owner is gone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from sandbox_kernel.orphans import owner_is_gone, remove_runtime_dir, server_identity


def test_this_process_owns_its_kernels_and_is_alive() -> None:
    identity = server_identity()
    assert identity.startswith(f"{socket.gethostname()}/{os.getpid()}/")
    assert not owner_is_gone(identity)


def test_a_dead_process_or_a_recycled_pid_is_gone() -> None:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(child.stdout)
    assert owner_is_gone(f"{socket.gethostname()}/{dead_pid}/12345")
    host, pid, _ = server_identity().split("/")
    assert owner_is_gone(f"{host}/{pid}/1")  # same pid, other start time: a recycled pid


def test_owners_on_other_hosts_or_unreadable_labels_are_never_judged_gone() -> None:
    assert not owner_is_gone("some-other-host/1/1")
    assert not owner_is_gone("")
    assert not owner_is_gone("garbage")


def test_only_sandbox_kernel_runtime_folders_under_the_parent_are_removed(tmp_path: Path) -> None:
    ours = tmp_path / "sandbox-kernel-abc" / "run1"
    ours.mkdir(parents=True)
    elsewhere = tmp_path / "precious" / "run1"
    elsewhere.mkdir(parents=True)
    deeper = tmp_path / "x" / "sandbox-kernel-abc" / "run1"
    deeper.mkdir(parents=True)

    remove_runtime_dir(str(elsewhere), str(tmp_path))
    remove_runtime_dir(str(deeper), str(tmp_path))
    remove_runtime_dir("", str(tmp_path))
    assert elsewhere.exists()
    assert deeper.exists()

    remove_runtime_dir(str(ours), str(tmp_path))
    assert not ours.parent.exists()
