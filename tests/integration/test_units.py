"""Durations and sizes written the way people write them, as a real kernel gets them."""

from __future__ import annotations

import json
from collections.abc import Callable

import docker

from .conftest import KernelStarter, run_ok

GIB = 1024**3


def test_decimal_sizes_and_durations_with_units_reach_docker_and_the_kernel(
    make_kernelspec: Callable[..., str], start_kernel: KernelStarter, docker_client: docker.DockerClient
) -> None:
    name = make_kernelspec(
        "units",
        config={
            "memory": "1.5g",
            "tmp_size": "0.5g",
            "file_size": "1.5m",
            "exec_timeout": "5m",
            "idle_timeout": "2h",
        },
    )
    km, kc = start_kernel(kernel_name=name)
    host_config = docker_client.containers.get(km.provisioner.container_id).attrs["HostConfig"]  # type: ignore[union-attr]
    assert host_config["Memory"] == 3 * GIB // 2
    assert run_ok(kc, "import shutil; print(shutil.disk_usage('/tmp').total)").strip() == str(GIB // 2)
    assert run_ok(kc, "import resource; print(resource.getrlimit(resource.RLIMIT_FSIZE)[0])").strip() == str(
        3 * 1024**2 // 2
    )
    policy = json.loads(run_ok(kc, "import os; print(os.environ['SANDBOX_KERNEL_POLICY'])"))
    # The kernel sees the sizes as written, and durations in seconds.
    assert (policy["memory"], policy["tmp_size"], policy["file_size"]) == ("1.5g", "0.5g", "1.5m")
    assert (policy["exec_timeout"], policy["idle_timeout"]) == (300.0, 7200.0)


def test_a_kernel_runs_with_the_least_memory_allowed(
    make_kernelspec: Callable[..., str], start_kernel: KernelStarter
) -> None:
    _, kc = start_kernel(kernel_name=make_kernelspec("least-memory", config={"memory": "128m"}))
    assert run_ok(kc, "print(sum(range(10)))").strip() == "45"
    assert run_ok(kc, "x = [0] * 1_000_000; print(len(x))").strip() == "1000000"
