"""Folder trees deeper than Python's recursion limit, made by kernel code where the host
removes them (issues #21 and #22): the host's removals once raised ``RecursionError``.

Each tree is built as the attackers built theirs: one ``mkdir`` at a time relative to the
last folder, 3000 levels, a file in a read-only folder at the bottom (the sandbox makes
no links).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from sandbox_kernel.cli.app import SandboxKernelApp
from sandbox_kernel.kernel import launching

from .conftest import KernelStarter, run_ok
from .test_files import files_of

pytestmark = pytest.mark.integration

#: Kernel-side code: ``deep(top)`` makes the tree.
DEEP_TREE = """
import os
def deep(top, levels=3000):
    os.mkdir(top)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(levels):
        os.mkdir('d', dir_fd=fd)
        below = os.open('d', os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = below
    os.close(os.open('f', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.fchmod(fd, 0o555)
    os.close(fd)
"""

#: A kernelspec's argv (any user may write one) that plants a tree in the launch folder
#: before the kernel starts, then runs the kernel as the shipped argv does.
PLANT_THEN_RUN_THE_KERNEL = (
    DEEP_TREE
    + "import runpy, sys\n"
    + "deep('/run/sandbox-kernel/deep')\n"
    + "os.environ.pop('PYTHONSTARTUP', None)\n"
    + "sys.argv[0] = 'ipykernel_launcher'\n"
    + "runpy.run_module('ipykernel_launcher', run_name='__main__', alter_sys=True)\n"
)


def prune() -> None:
    """``jupyter sandbox-kernel prune``, in-process (subcommands are singletons: reset them)."""
    SandboxKernelApp.clear_instances()
    app = SandboxKernelApp()
    app.initialize(["prune"])
    app.start()


@pytest.mark.skipif(os.getuid() != 0, reason="only a root server can seal the runtime folder")
@pytest.mark.timeout(600)
def test_a_deep_tree_planted_in_the_runtime_folder_fails_no_start_and_no_prune(
    make_kernelspec: Callable[..., str],
    start_kernel: KernelStarter,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The seal at the start and at each restart removes it; the kernel's own removal,
    the next start's orphan sweep and ``prune`` then have nothing to trip on."""
    name = make_kernelspec(
        "py-deep-tree", argv=["python", "-c", PLANT_THEN_RUN_THE_KERNEL, "-f", "{connection_file}"]
    )
    km, kc = start_kernel(name)
    listing = "import json, os; print(json.dumps(os.listdir('/run/sandbox-kernel')))"
    assert "deep" not in json.loads(run_ok(kc, listing))
    km.restart_kernel(now=True)
    kc.wait_for_ready(timeout=60)
    assert "deep" not in json.loads(run_ok(kc, listing)), "sealed again after the restart"
    runtime_dir = km.provisioner.runtime_dir  # type: ignore[attr-defined]
    assert isinstance(runtime_dir, Path)
    kc.stop_channels()
    km.shutdown_kernel(now=True)
    assert not runtime_dir.exists()

    monkeypatch.setattr(launching, "_swept_orphans", False)  # as in a fresh server process
    _, after = start_kernel()
    assert run_ok(after, "print('started')") == "started\n"
    prune()
    assert "kernel(s) removed." in capsys.readouterr().out


@pytest.mark.timeout(600)
def test_a_recursive_delete_of_a_deep_tree_kernel_code_made_in_its_workspace(
    start_kernel: KernelStarter, workspace: Path
) -> None:
    km, kc = start_kernel()
    run_ok(kc, DEEP_TREE + "deep('deep')\nopen('kept.txt', 'w').write('kept')")
    files = files_of(km)
    files.delete("deep", recursive=True)
    assert sorted(os.listdir(workspace)) == ["kept.txt"]
    assert run_ok(kc, "import os; print(sorted(os.listdir('.')))") == "['kept.txt']\n"
