"""The JupyterLab server extension's logic: what the status bar is told, with a fake Docker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sandbox_kernel.backends.docker import DockerBackend
from sandbox_kernel.jupyter import lab
from sandbox_kernel.lifecycle.pausing import Paused
from sandbox_kernel.provisioner import SandboxProvisioner

from .conftest import RUNNING, CountingFactory, FakeDockerClient

CONTAINER = "c0ffee"
NOW = 1_800_000_000.0


@pytest.fixture
def provisioner(client_factory: CountingFactory) -> SandboxProvisioner:
    backend = DockerBackend(client_factory=client_factory)
    return SandboxProvisioner(
        kernel_id="k1", parent=None, memory="512m", cpus=0.5, exec_timeout=30, backend=backend
    )


def test_a_sandboxed_kernel_is_described_by_its_policy_and_memory(provisioner: SandboxProvisioner) -> None:
    assert lab.describe(provisioner, 100 * 1024**2, NOW) == {
        "sandboxed": True,
        "runtime": "gVisor",
        "docker_runtime": "runsc-sandbox-kernel",
        "image": "sandbox-kernel/python:latest",
        "network": "none",
        "allowed_domains": [],
        "approved_domains": [],
        "approval": None,
        "limits": {
            "memory": "512m",
            "cpus": 0.5,
            "pids": 256,
            "tmp_size": "256m",
            "exec_timeout": 30.0,
            "idle_timeout": 0.0,
            "file_size": "4g",
            "output_limit": "10m",
        },
        "memory": {"used": 100 * 1024**2, "limit": 512 * 1024**2},
        "state": "running",
        "frozen": False,
        "stopped": None,
    }


def test_an_allow_list_names_its_domains(provisioner: SandboxProvisioner) -> None:
    provisioner.network = "allowlist"
    provisioner.allowed_domains = ["docs.python.org", "*.pythonhosted.org"]
    described = lab.describe(provisioner, None, NOW)
    assert described["network"] == "allowlist"
    assert described["allowed_domains"] == ["docs.python.org", "*.pythonhosted.org"]
    assert described["approval"] is None


def test_a_kernel_that_asks_says_how_long_and_what_was_allowed_at_its_questions(
    provisioner: SandboxProvisioner,
) -> None:
    provisioner.network = "allowlist"
    provisioner.approval = "egress"
    provisioner.approval_timeout = 20
    described = lab.describe(provisioner, None, NOW, ("other.test:443",))
    assert described["approval"] == {"timeout": 20.0}
    assert described["approved_domains"] == ["other.test:443"]
    assert lab.approved_domains(provisioner) == (), "a kernel the egress proxy does not serve"


@pytest.mark.parametrize(
    ("paused", "switching", "woken", "state"),
    [
        (False, False, False, "running"),
        (False, True, False, "pausing"),
        (False, True, True, "pausing"),  # a message came during the pause: it resumes next
        (True, False, False, "paused"),
        (True, False, True, "resuming"),  # a client's message is waking it
        (True, True, False, "resuming"),
    ],
)
def test_a_kernel_says_whether_it_is_paused_or_on_its_way(
    provisioner: SandboxProvisioner, paused: bool, switching: bool, woken: bool, state: str
) -> None:
    provisioner.pauser.paused = Paused("checkpoint", None, NOW) if paused else None
    provisioner.pauser.pausing = switching
    provisioner.pauser.wake_due = "shell execute_request" if woken else None
    assert provisioner.sleep_state == state
    assert lab.describe(provisioner, None, NOW)["state"] == state


async def test_a_limit_stop_stays_on_record_across_a_restart(
    provisioner: SandboxProvisioner, fake_client: FakeDockerClient
) -> None:
    fake_client.states[CONTAINER] = {"Status": "exited", "ExitCode": 137, "OOMKilled": True}
    provisioner.site.container_id = CONTAINER
    assert await provisioner.poll() == 137  # noticed: Docker's OOM killer stopped it
    stop = provisioner.limit_stop
    assert stop is not None
    assert (stop.ename, stop.container_id) == ("MemoryLimitExceeded", CONTAINER)

    stopped = lab.describe(provisioner, None, stop.time + 2)["stopped"]
    assert stopped["limit"] == "memory"
    assert stopped["reason"].startswith("memory limit 512m exceeded")
    assert (stopped["current"], stopped["age"]) == (True, 2.0)
    assert stopped["time"].endswith("+00:00")

    provisioner.site.container_id = "restarted"  # what a restart leaves
    later = lab.describe(provisioner, 1, stop.time + 5)["stopped"]
    assert (later["ename"], later["current"]) == ("MemoryLimitExceeded", False)


async def test_a_kernel_that_dies_by_itself_is_no_limit_stop(
    provisioner: SandboxProvisioner, fake_client: FakeDockerClient
) -> None:
    fake_client.states[CONTAINER] = {"Status": "exited", "ExitCode": 1, "OOMKilled": False}
    provisioner.site.container_id = CONTAINER
    assert await provisioner.poll() == 1
    assert provisioner.limit_stop is None
    assert lab.describe(provisioner, None, NOW)["stopped"] is None


async def test_memory_is_read_from_the_cgroup_of_the_containers_process(
    provisioner: SandboxProvisioner, fake_client: FakeDockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[int] = []

    def memory_usage(pid: int) -> int:
        read.append(pid)
        return 4096

    monkeypatch.setattr(lab, "memory_usage", memory_usage)
    fake_client.states[CONTAINER] = {**RUNNING, "Pid": 4242}
    provisioner.site.container_id = CONTAINER
    gauge = lab.MemoryGauge()
    assert [await gauge.used(provisioner) for _ in range(3)] == [4096] * 3
    assert read == [4242] * 3
    assert len(fake_client.called("api.inspect_container")) == 1, "one Docker call per container"

    provisioner.exits.code = 137  # stopped: its pid may belong to someone else by now
    assert await gauge.used(provisioner) is None
    provisioner.site.container_id = None
    assert await gauge.used(provisioner) is None
    assert read == [4242] * 3


async def test_a_paused_kernel_uses_no_memory_and_once_resumed_its_new_process_is_read(
    provisioner: SandboxProvisioner, fake_client: FakeDockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    alive = {4242: 4096}
    monkeypatch.setattr(lab, "memory_usage", alive.get)
    fake_client.states[CONTAINER] = {**RUNNING, "Pid": 4242}
    provisioner.site.container_id = CONTAINER
    gauge = lab.MemoryGauge()
    assert await gauge.used(provisioner) == 4096
    provisioner.pauser.paused = Paused("sk-1", None, NOW)
    assert await gauge.used(provisioner) is None
    provisioner.pauser.paused = None
    alive = {4343: 8192}  # restored from its checkpoint: another process
    monkeypatch.setattr(lab, "memory_usage", alive.get)
    fake_client.states[CONTAINER] = {**RUNNING, "Pid": 4343}
    assert await gauge.used(provisioner) == 8192
    alive[4444] = alive.pop(4343)  # gone without the gauge seeing a pause: asked again
    fake_client.states[CONTAINER] = {**RUNNING, "Pid": 4444}
    assert await gauge.used(provisioner) == 8192


async def test_memory_of_a_container_docker_cannot_tell_about_is_unknown(
    provisioner: SandboxProvisioner, fake_client: FakeDockerClient
) -> None:
    provisioner.site.container_id = "gone"  # no such container: NotFound
    assert await lab.MemoryGauge().used(provisioner) is None
    fake_client.states["created"] = {"Status": "created", "ExitCode": 0, "Pid": 0}
    provisioner.site.container_id = "created"
    assert await lab.MemoryGauge().used(provisioner) is None


def test_installing_the_package_enables_the_server_extension() -> None:
    config = Path(__file__).parents[2] / "jupyter-config" / "jupyter_server_config.d" / "sandbox_kernel.json"
    enabled: dict[str, Any] = json.loads(config.read_text())["ServerApp"]["jpserver_extensions"]
    assert enabled == {"sandbox_kernel.jupyter.lab": True}
    assert lab._jupyter_server_extension_points() == [{"module": "sandbox_kernel.jupyter.lab"}]
