"""The one gate every way of starting a sandboxed kernel passes: the server's config files
apply to every provisioner, and a kernelspec that would run on the host is refused."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from jupyter_client.manager import AsyncKernelManager
from traitlets.config import Config

from sandbox_kernel.cli.resources import data_path
from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.plan.admission import require_sandboxed, sandboxed_manager, server_config
from sandbox_kernel.plan.sandbox_spec import (
    CONTAINER_CONNECTION_FILE,
    CONTAINER_KERNEL_APP_FILE,
    NO_SUBSHELLS_ARG,
    is_launcher,
    kernel_command,
    launcher_argv,
)
from sandbox_kernel.provisioner import SandboxProvisioner


@pytest.fixture
def config_dir() -> Path:
    folder = Path(os.environ["JUPYTER_CONFIG_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_a_provisioner_reads_the_server_config_files_whatever_started_it(config_dir: Path) -> None:
    """A plain KernelManager (no server, no config given) still gets the administrator's
    ceilings and central audit log."""
    (config_dir / "jupyter_server_config.json").write_text(
        json.dumps({"SandboxProvisioner": {"max_memory": "1g", "audit_log": "/var/log/central.log"}})
    )
    (config_dir / "jupyter_server_config.py").write_text("c.SandboxProvisioner.max_exec_timeout = 60\n")
    provisioner = SandboxProvisioner(parent=AsyncKernelManager())
    assert provisioner.max_memory == "1g"
    assert provisioner.audit_log == "/var/log/central.log"
    assert provisioner.max_exec_timeout == 60


def test_config_given_to_the_manager_goes_over_the_files(config_dir: Path) -> None:
    (config_dir / "jupyter_server_config.json").write_text(
        json.dumps({"SandboxProvisioner": {"max_memory": "1g", "memory": "512m"}})
    )
    given = Config({"SandboxProvisioner": {"memory": "768m"}})
    provisioner = SandboxProvisioner(parent=AsyncKernelManager(config=given))
    assert (provisioner.max_memory, provisioner.memory) == ("1g", "768m")


def test_a_changed_config_file_is_read_again(config_dir: Path) -> None:
    path = config_dir / "jupyter_server_config.json"
    path.write_text(json.dumps({"SandboxProvisioner": {"max_memory": "1g"}}))
    assert server_config().SandboxProvisioner.max_memory == "1g"
    path.write_text(json.dumps({"SandboxProvisioner": {"max_memory": "3g"}}))
    os.utime(path, (1, 1))  # a new modification time, however fast the test runs
    assert server_config().SandboxProvisioner.max_memory == "3g"


def test_a_broken_config_file_stops_the_start_naming_it(config_dir: Path) -> None:
    """Kernels must not start without the ceilings the administrator meant to set."""
    (config_dir / "jupyter_server_config.py").write_text("c.SandboxProvisioner.max_memory = \n")
    with pytest.raises(ConfigurationError, match=r"jupyter_server_config\.py.*could not be read"):
        SandboxProvisioner(parent=AsyncKernelManager())


def test_the_host_kernelspec_is_refused_by_name() -> None:
    """`SandboxSession("python3")` ran the assistant's code on the host as root."""
    with pytest.raises(
        ConfigurationError, match=r"Kernelspec 'python3' .* does not run its kernels in the sandbox"
    ):
        sandboxed_manager("python3")


def test_a_missing_kernelspec_is_refused_saying_how_to_install_one() -> None:
    with pytest.raises(
        ConfigurationError, match=r"No kernelspec named 'nope'.*jupyter sandbox-kernel install"
    ):
        require_sandboxed("nope")


def test_every_shipped_kernelspec_runs_the_launcher_and_the_sandbox() -> None:
    """Run directly (what VS Code does), a shipped argv starts the sandboxed kernel of that
    very kernelspec, never ipykernel on the host."""
    specs = sorted((data_path("kernelspecs")).glob("*/kernel.json"))
    assert len(specs) >= 2
    for path in specs:
        spec = json.loads(path.read_text())
        name = path.parent.name
        assert spec["argv"] == [
            "python",
            "-m",
            "sandbox_kernel.launch",
            "--kernel",
            name,
            "-f",
            "{connection_file}",
        ]
        assert spec["metadata"]["kernel_provisioner"]["provisioner_name"] == "sandbox-provisioner"


def test_in_the_sandbox_the_launcher_argv_is_the_kernel_itself() -> None:
    argv = launcher_argv("x", python=sys.executable)
    assert is_launcher(argv)
    assert kernel_command(argv) == [
        "python",
        CONTAINER_KERNEL_APP_FILE,
        "-f",
        CONTAINER_CONNECTION_FILE,
        "--HistoryManager.hist_file=:memory:",
    ]
    # Without subshells: the kernel application's option, last.
    assert kernel_command(argv, subshells=False) == [*kernel_command(argv), NO_SUBSHELLS_ARG]
    # A kernelspec's own argv (another kernel in the sandbox) is run as it is.
    own = ["python", "-m", "mykernel", "-f", "{connection_file}"]
    assert not is_launcher(own)
    assert kernel_command(own, ["--debug"]) == [
        "python",
        "-m",
        "mykernel",
        "-f",
        CONTAINER_CONNECTION_FILE,
        "--debug",
    ]
    # ... and has no option of ours to turn subshells off: the start fails, saying why.
    with pytest.raises(
        ConfigurationError, match=r"subshells is false .*, which only a kernelspec whose argv runs"
    ):
        kernel_command(own, subshells=False)


def test_a_kernelspec_whose_provisioner_config_is_not_an_object_is_refused_clearly() -> None:
    """A list as the provisioner's config made jupyter_client raise a raw TypeError."""
    folder = Path(os.environ["JUPYTER_DATA_DIR"]) / "kernels" / "listy"
    folder.mkdir(parents=True)
    spec = json.loads((data_path("kernelspecs") / "sandboxed-python" / "kernel.json").read_text())
    spec["metadata"]["kernel_provisioner"]["config"] = ["memory", "1g"]
    (folder / "kernel.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigurationError, match=r"'listy'.*config must be an object of settings"):
        sandboxed_manager("listy")
