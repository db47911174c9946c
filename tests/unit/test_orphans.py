"""Who owns a sandboxed kernel, and what may be removed when the owner is gone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox_kernel.orphans import owner_is_gone, remove_runtime_dir, server_identity, write_owner


def test_this_process_owns_its_kernels_and_is_alive() -> None:
    identity = server_identity()
    namespace = os.stat("/proc/self/ns/pid").st_ino
    assert identity.startswith(f"{socket.gethostname()}/{namespace}/{os.getpid()}/")
    assert not owner_is_gone(identity)


def test_a_dead_process_or_a_recycled_pid_is_gone() -> None:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(child.stdout)
    host, namespace, pid, _ = server_identity().split("/")
    assert owner_is_gone(f"{host}/{namespace}/{dead_pid}/12345")
    assert owner_is_gone(f"{host}/{namespace}/{pid}/1")  # same pid, other start time: a recycled pid


def test_owners_on_other_hosts_or_namespaces_or_unreadable_labels_are_never_judged_gone() -> None:
    host, _, _, _ = server_identity().split("/")
    assert not owner_is_gone("some-other-host/4026531836/1/1")
    assert not owner_is_gone(f"{host}/1/999999/1")  # another PID namespace: cannot tell
    assert not owner_is_gone(f"{host}/1/1")  # the old three-part form
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


def test_an_unreadable_proc_entry_is_not_taken_for_a_dead_owner(monkeypatch: pytest.MonkeyPatch) -> None:
    host, namespace, pid, ticks = server_identity().split("/")

    def hidden(self: Path) -> str:
        raise PermissionError(13, "hidepid")

    monkeypatch.setattr(Path, "read_text", hidden)
    assert not owner_is_gone(f"{host}/{namespace}/{pid}/{ticks}")


def test_the_owner_file_names_the_current_owner(tmp_path: Path) -> None:
    write_owner(tmp_path)
    assert (tmp_path / "owner").read_text() == server_identity()
