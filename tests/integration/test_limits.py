"""Limits from the kernelspec, bounded by the server's ceilings, hit by real code."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import docker
import pytest
from jupyter_client import KernelManager

from sandbox_kernel.errors import ConfigurationError

from .conftest import HostState, KernelStarter, run, run_ok


def test_fork_bomb_gets_a_clean_error_and_the_kernel_survives(
    make_kernelspec: Callable[..., str], start_kernel: KernelStarter
) -> None:
    name = make_kernelspec("small-pids", config={"pids": 64})
    _, kc = start_kernel(kernel_name=name)
    result = run(
        kc,
        "import os\n"
        "children = []\n"
        "try:\n"
        "    while True:\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            import time; time.sleep(60); os._exit(0)\n"
        "        children.append(pid)\n"
        "finally:\n"
        "    for pid in children:\n"
        "        os.kill(pid, 9); os.waitpid(pid, 0)\n"
        "    print('forked', len(children))",
        timeout=120,
    )
    assert result.status == "error"
    assert result.reply["content"]["ename"] == "BlockingIOError"  # EAGAIN: RLIMIT_NPROC
    assert 0 < int(result.stdout.split()[-1]) < 64
    assert run_ok(kc, "print('still here')").strip() == "still here"


def test_thread_bomb_gets_a_clean_error(
    make_kernelspec: Callable[..., str], start_kernel: KernelStarter
) -> None:
    name = make_kernelspec("small-threads", config={"pids": 64})
    _, kc = start_kernel(kernel_name=name)
    result = run(
        kc,
        "import threading, time\n"
        "stop = threading.Event()\n"
        "threads = []\n"
        "try:\n"
        "    for _ in range(10_000):\n"
        "        t = threading.Thread(target=stop.wait, daemon=True); t.start(); threads.append(t)\n"
        "finally:\n"
        "    stop.set()\n"
        "    print('started', len(threads))",
        timeout=120,
    )
    assert result.status == "error"
    assert result.reply["content"]["ename"] == "RuntimeError"  # can't start new thread
    assert int(result.stdout.split()[-1]) < 64
    assert run_ok(kc, "print(1 + 1)").strip() == "2"


def test_policy_is_visible_inside_without_host_details(
    make_kernelspec: Callable[..., str], start_kernel: KernelStarter
) -> None:
    name = make_kernelspec("narrow", config={"memory": "1g", "cpus": 0.5, "pids": 128, "tmp_size": "64m"})
    _, kc = start_kernel(kernel_name=name)
    policy = json.loads(run_ok(kc, "import os; print(os.environ['SANDBOX_KERNEL_POLICY'])"))
    assert policy == {
        "cpus": 0.5,
        "memory": "1g",
        "pids": 128,
        "tmp_size": "64m",
        "network": "none",
        "image": "sandbox-kernel/python:latest",
    }
    out = run_ok(kc, "import shutil; print(shutil.disk_usage('/tmp').total)")
    assert int(out) == 64 * 1024**2


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"memory": "64g"}, r"memory='64g' exceeds the server's ceiling of '4g'"),
        ({"cpus": 16}, r"cpus=16.0 exceeds the server's ceiling of 2.0"),
        ({"pids": 100000}, r"pids=100000 exceeds"),
        ({"max_memory": "64g"}, r"'max_memory' .* not a setting a kernelspec may choose"),
        ({"docker_runtime": "runc"}, r"'docker_runtime' .* not a setting a kernelspec may choose"),
    ],
)
@pytest.mark.filterwarnings("ignore:Passing unrecognized arguments:DeprecationWarning")
def test_a_kernelspec_cannot_exceed_the_ceilings(
    config: dict[str, object],
    message: str,
    make_kernelspec: Callable[..., str],
    workspace: Path,
    docker_client: docker.DockerClient,
) -> None:
    name = make_kernelspec("greedy", config=config)
    before = HostState(docker_client)
    with pytest.raises(ConfigurationError, match=message):
        KernelManager(kernel_name=name).start_kernel(cwd=str(workspace))
    assert before.new_leftovers() == []
