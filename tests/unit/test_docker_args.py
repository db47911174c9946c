"""Docker create arguments (the hardening) and the sandbox's environment, from a spec."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from docker.models.containers import _create_container_args

from sandbox_kernel.backends.docker_args import SECCOMP_PROFILE, container_create_kwargs
from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.inside import kernel_relay
from sandbox_kernel.plan.limits import validate_size
from sandbox_kernel.plan.sandbox_spec import (
    CONTAINER_CONNECTION_FILE,
    CONTAINER_RUNTIME_DIR,
    CONTAINER_WORKSPACE,
    DEFAULT_ENV,
    FIXED_ENV,
    KERNEL_TCP_PORTS,
    LABEL_KERNEL_ID,
    LABEL_KERNELSPEC,
    LABEL_MANAGED,
    LABEL_RUNTIME_DIR,
    container_connection_info,
    kernel_command,
    kernel_sockets,
    relay_command,
    sandbox_env,
)

from .conftest import make_spec

# ---------------------------------------------------------------- the seccomp profile


def seccomp_verdict(name: str, *args: int) -> int | None:
    """The errno :data:`SECCOMP_PROFILE` returns for ``name(*args)``, None if allowed.

    Evaluated as runsc does: a rule applies when every one of its conditions holds
    (conditions on different arguments are ANDed).
    """
    for rule in json.loads(SECCOMP_PROFILE)["syscalls"]:
        if name not in rule["names"]:
            continue
        conditions = rule.get("args", [])
        assert len({c["index"] for c in conditions}) == len(conditions), "runsc ORs same-index conditions"
        for c in conditions:
            assert c["op"] == "SCMP_CMP_MASKED_EQ"
        if all(args[c["index"]] & c["value"] == c["valueTwo"] for c in conditions):
            assert rule["action"] == "SCMP_ACT_ERRNO"
            return int(rule["errnoRet"])
    return None


AT_FDCWD = -100
CREATE = os.O_CREAT | os.O_WRONLY | os.O_TRUNC


class TestSeccompProfile:
    @pytest.mark.parametrize("mode", [0o4755, 0o2755, 0o1777, 0o7777, 0o6000, 0o104755])
    def test_no_call_may_give_a_file_a_special_bit(self, mode: int) -> None:
        """setuid, setgid and sticky bits set by the kernel are honoured by the host."""
        assert seccomp_verdict("chmod", 0, mode) == errno.EPERM
        assert seccomp_verdict("fchmod", 3, mode) == errno.EPERM
        assert seccomp_verdict("fchmodat", AT_FDCWD, 0, mode, 0) == errno.EPERM
        assert seccomp_verdict("fchmodat2", AT_FDCWD, 0, mode, 0x100) == errno.EPERM
        assert seccomp_verdict("mkdir", 0, mode) == errno.EPERM
        assert seccomp_verdict("mkdirat", AT_FDCWD, 0, mode) == errno.EPERM
        assert seccomp_verdict("creat", 0, mode) == errno.EPERM
        assert seccomp_verdict("open", 0, CREATE, mode) == errno.EPERM
        assert seccomp_verdict("openat", AT_FDCWD, 0, CREATE, mode) == errno.EPERM

    @pytest.mark.parametrize("mode", [0o755, 0o644, 0o777, 0o700, 0o000, 0o600])
    def test_ordinary_modes_are_allowed(self, mode: int) -> None:
        for name, args in [
            ("chmod", (0, mode)),
            ("fchmod", (3, mode)),
            ("fchmodat", (AT_FDCWD, 0, mode, 0)),
            ("mkdir", (0, mode)),
            ("mkdirat", (AT_FDCWD, 0, mode)),
            ("creat", (0, mode)),
            ("open", (0, CREATE, mode)),
            ("openat", (AT_FDCWD, 0, CREATE, mode)),
        ]:
            assert seccomp_verdict(name, *args) is None, (name, oct(mode))

    def test_opening_without_creating_ignores_the_mode_argument(self) -> None:
        """Without O_CREAT the mode is unused, and some callers leave junk there."""
        assert seccomp_verdict("openat", AT_FDCWD, 0, os.O_RDONLY, 0o7777) is None
        assert seccomp_verdict("open", 0, os.O_RDWR | os.O_APPEND, 0o4755) is None

    def test_calls_whose_mode_seccomp_cannot_read_are_unimplemented(self) -> None:
        assert seccomp_verdict("openat2", AT_FDCWD, 0, 0, 24) == errno.ENOSYS
        assert seccomp_verdict("io_uring_setup", 8, 0) == errno.ENOSYS

    def test_links_device_nodes_and_escape_calls_stay_refused(self) -> None:
        for name in ("symlink", "linkat", "mknod", "mount", "unshare", "ptrace", "bpf"):
            assert seccomp_verdict(name, 0, 0, 0, 0, 0) == errno.EPERM
        assert seccomp_verdict("read", 0, 0, 0) is None


# ---------------------------------------------------------------- container_create_kwargs


class TestContainerCreateKwargs:
    def test_runs_under_the_configured_gvisor_runtime(self, tmp_path: Path) -> None:
        kwargs = container_create_kwargs(make_spec(tmp_path, runtime="my-runsc"))
        assert kwargs["runtime"] == "my-runsc"

    def test_runs_as_the_spec_uid_and_gid_not_root(self, tmp_path: Path) -> None:
        kwargs = container_create_kwargs(make_spec(tmp_path))
        assert kwargs["user"] == "1234:1235"
        assert not kwargs["user"].startswith("0:")

    def test_never_runs_the_images_entrypoint(self, tmp_path: Path) -> None:
        kwargs = container_create_kwargs(make_spec(tmp_path))
        assert kwargs["entrypoint"] == [""]  # as `docker run --entrypoint ""`: our command alone

    def test_drops_privileges(self, tmp_path: Path) -> None:
        kwargs = container_create_kwargs(make_spec(tmp_path))
        assert kwargs["cap_drop"] == ["ALL"]
        assert "cap_add" not in kwargs
        no_new_privileges, seccomp = kwargs["security_opt"]
        assert no_new_privileges == "no-new-privileges:true"
        profile = json.loads(seccomp.removeprefix("seccomp="))
        assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
        rule = profile["syscalls"][0]
        assert rule["action"] == "SCMP_ACT_ERRNO"
        assert "args" not in rule
        assert {"symlink", "symlinkat", "link", "linkat", "mknod", "mknodat", "mount", "ptrace"} <= set(
            rule["names"]
        )
        assert kwargs["privileged"] is False

    def test_root_filesystem_is_read_only_with_a_sized_tmp(self, tmp_path: Path) -> None:
        kwargs = container_create_kwargs(make_spec(tmp_path, tmp_size="64m"))
        assert kwargs["read_only"] is True
        assert list(kwargs["tmpfs"]) == ["/tmp"]
        options = kwargs["tmpfs"]["/tmp"].split(",")
        assert "size=64m" in options
        assert "nosuid" in options
        assert "nodev" in options

    def test_has_an_init_process_and_no_network(self, tmp_path: Path) -> None:
        kwargs = container_create_kwargs(make_spec(tmp_path))
        assert kwargs["init"] is True
        assert kwargs["network_mode"] == "none"
        assert "ports" not in kwargs
        assert "network" not in kwargs

    def test_mounts_exactly_the_workspace_and_the_runtime_dir(self, tmp_path: Path) -> None:
        kwargs = container_create_kwargs(make_spec(tmp_path))
        mounts = {m["Target"]: m for m in kwargs["mounts"]}
        assert len(kwargs["mounts"]) == 2
        assert mounts[CONTAINER_WORKSPACE]["Source"] == str(tmp_path / "work")
        assert mounts[CONTAINER_RUNTIME_DIR]["Source"] == str(tmp_path / "rt")
        assert {m["Type"] for m in kwargs["mounts"]} == {"bind"}
        assert "volumes" not in kwargs
        assert "devices" not in kwargs

    def test_never_mounts_the_docker_socket(self, tmp_path: Path) -> None:
        kwargs = container_create_kwargs(make_spec(tmp_path))
        sources = [m["Source"] for m in kwargs["mounts"]]
        assert not [s for s in sources if "docker.sock" in s or s in ("/run", "/var/run", "/")]

    def test_labels_identify_the_kernel(self, tmp_path: Path) -> None:
        spec = make_spec(tmp_path, extra_labels={"io.example.test": "yes"})
        labels = container_create_kwargs(spec)["labels"]
        assert labels == {
            LABEL_MANAGED: "true",
            LABEL_KERNEL_ID: "k1",
            LABEL_KERNELSPEC: "sandboxed-python",
            LABEL_RUNTIME_DIR: str(tmp_path / "rt"),
            "io.sandbox-kernel.workspace": str(spec.workspace),
            "io.example.test": "yes",
        }

    def test_limits_memory_swap_and_cpus(self, tmp_path: Path) -> None:
        kwargs = container_create_kwargs(make_spec(tmp_path, memory="512m", cpus=0.5))
        assert kwargs["mem_limit"] == "512m"
        assert kwargs["memswap_limit"] == "512m"
        assert kwargs["nano_cpus"] == 500_000_000

    def test_name_command_env_and_workdir_come_from_the_spec(self, tmp_path: Path) -> None:
        spec = make_spec(tmp_path)
        kwargs = container_create_kwargs(spec)
        assert kwargs["name"] == "sandbox-kernel-k1"
        assert kwargs["command"] == spec.command
        assert kwargs["environment"] == {"HOME": "/tmp"}
        assert kwargs["working_dir"] == f"{CONTAINER_WORKSPACE}/sub"
        assert kwargs["image"] == "img:1"

    def test_docker_py_accepts_the_arguments(self, tmp_path: Path) -> None:
        """What containers.create does with them before any HTTP call: no unknown
        argument, and the host config the daemon receives carries the hardening."""
        create = _create_container_args({**container_create_kwargs(make_spec(tmp_path)), "version": "1.41"})
        host = create["host_config"]
        assert host["Runtime"] == "runsc-sandbox-kernel"
        assert host["NetworkMode"] == "none"
        assert host["CapDrop"] == ["ALL"]
        assert host["ReadonlyRootfs"] is True
        assert host["Init"] is True
        assert host["NanoCpus"] == 500_000_000
        assert host["Memory"] == 512 * 1024 * 1024
        assert host.get("Privileged", False) is False
        assert "Binds" not in host
        assert create["user"] == "1234:1235"


# ---------------------------------------------------------------- sandbox_env

SERVER_ENV = {
    "PATH": "/usr/bin",
    "LANG": "C.UTF-8",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "JUPYTER_TOKEN": "server-token",
    "JPY_PARENT_PID": "4242",
    "HOME": "/root",
    "MY_SETTING": "on",
}


class TestSandboxEnv:
    def test_server_secrets_are_dropped(self) -> None:
        env = sandbox_env(SERVER_ENV, pass_env=["LANG"], kernelspec_env=[])
        assert "AWS_SECRET_ACCESS_KEY" not in env
        assert "JUPYTER_TOKEN" not in env
        assert "PATH" not in env
        assert "aws-secret" not in env.values()

    def test_only_allow_listed_and_kernelspec_names_pass(self) -> None:
        env = sandbox_env(SERVER_ENV, pass_env=["LANG", "TZ"], kernelspec_env=["MY_SETTING"])
        assert env == {**DEFAULT_ENV, "LANG": "C.UTF-8", "MY_SETTING": "on", **FIXED_ENV}

    @pytest.mark.parametrize(
        ("pass_env", "kernelspec_env"),
        [(["JPY_PARENT_PID"], []), ([], ["JPY_PARENT_PID"])],
        ids=["allow-listed", "kernelspec-env"],
    )
    def test_jpy_parent_pid_is_never_passed(self, pass_env: list[str], kernelspec_env: list[str]) -> None:
        env = sandbox_env(SERVER_ENV, pass_env=pass_env, kernelspec_env=kernelspec_env)
        assert "JPY_PARENT_PID" not in env

    def test_fixed_env_wins_over_the_server_and_the_kernelspec(self) -> None:
        env = sandbox_env(
            {**SERVER_ENV, "PYTHONUNBUFFERED": "0"},
            pass_env=["HOME"],
            kernelspec_env=["PYTHONUNBUFFERED"],
        )
        assert env["HOME"] == "/tmp"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["IPYTHONDIR"] == "/tmp/.ipython"

    def test_allowed_names_missing_from_the_env_are_not_invented(self) -> None:
        env = sandbox_env({"LANG": "C"}, pass_env=["LANG", "TZ"], kernelspec_env=["NOT_SET"])
        assert env == {**DEFAULT_ENV, "LANG": "C", **FIXED_ENV}

    def test_the_kernel_starts_with_a_safe_path_and_a_user_name(self) -> None:
        """PYTHONSAFEPATH: nothing in the workspace runs as the kernel starts; USER and
        LOGNAME: getpass.getuser() works for a uid the image's passwd does not know."""
        env = sandbox_env(
            {**SERVER_ENV, "PYTHONSAFEPATH": ""}, pass_env=["PYTHONSAFEPATH"], kernelspec_env=[]
        )
        assert env["PYTHONSAFEPATH"] == "1"
        assert env["USER"] == env["LOGNAME"] == "sandbox"

    def test_a_kernelspec_may_name_the_user(self) -> None:
        env = sandbox_env({"USER": "analyst", "LOGNAME": "root"}, pass_env=[], kernelspec_env=["USER"])
        assert env["USER"] == "analyst"
        assert env["LOGNAME"] == "sandbox", "the server's own is not passed unless allow-listed"


# ---------------------------------------------------------------- resolve_workspace


class TestKernelCommand:
    def test_connection_file_is_the_in_container_path(self) -> None:
        argv = ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        assert kernel_command(argv) == ["python", "-m", "ipykernel_launcher", "-f", CONTAINER_CONNECTION_FILE]

    def test_python_is_not_swapped_for_the_servers_interpreter(self) -> None:
        assert kernel_command(["python", "-V"])[0] == "python"

    def test_extra_arguments_are_appended(self) -> None:
        assert kernel_command(["python"], ["--debug"]) == ["python", "--debug"]

    def test_an_empty_argv_is_a_configuration_error(self) -> None:
        with pytest.raises(ConfigurationError, match="argv is empty"):
            kernel_command([])


# ---------------------------------------------------------------- validation


class TestValidateSize:
    @pytest.mark.parametrize(("value", "expected"), [("512m", "512m"), ("2G", "2g"), ("1024", "1024")])
    def test_sizes_are_accepted_and_lowercased(self, value: str, expected: str) -> None:
        assert validate_size("memory", value) == expected

    @pytest.mark.parametrize("value", ["lots", "", "0", "1.5", "-1m", "2gb", "512 m"])
    def test_non_sizes_are_refused_naming_the_setting(self, value: str) -> None:
        with pytest.raises(ConfigurationError) as info:
            validate_size("tmp_size", value)
        assert f"tmp_size={value!r}" in str(info.value)


# ---------------------------------------------------------------- kernel_user


def test_the_kernel_listens_on_the_sandboxs_loopback_only() -> None:
    """The kernel's own ports are on the sandbox's loopback, where the channel relay
    connects (its host sockets, shell's and IOPub's, are the relay's, lent)."""
    info = container_connection_info(b"s3cret", "hmac-sha256", "sandboxed-python")
    assert info == {
        "transport": "tcp",
        "ip": "127.0.0.1",
        "shell_port": 15001,
        "iopub_port": 15002,
        "stdin_port": 15003,
        "control_port": 15004,
        "hb_port": 15005,
        "key": "s3cret",
        "signature_scheme": "hmac-sha256",
        "kernel_name": "sandboxed-python",
    }
    assert isinstance(info["key"], str)
    # gVisor gives outgoing connections ports 16000-65535: one made while the kernel starts
    # (the relay's probe) once held a kernel port, and the kernel could not bind it.
    assert max(KERNEL_TCP_PORTS.values()) < 16000


def test_the_relay_binds_each_channel_where_the_host_connects(tmp_path: Path) -> None:
    """The relay's host sockets are the paths the bridge connects to and the launch
    folder's sealing keeps, each paired with the kernel's port for that channel."""
    command = relay_command(["python", "-m", "ipykernel_launcher", "-f", CONTAINER_CONNECTION_FILE])
    assert command[1] == f"{CONTAINER_RUNTIME_DIR}/kernel_relay.py"
    assert command[command.index("--") + 1 :] == [
        "python",
        "-m",
        "ipykernel_launcher",
        "-f",
        CONTAINER_CONNECTION_FILE,
    ]
    channels, kernel = kernel_relay.parse(command[2:])
    assert kernel[0] == "python"
    info = container_connection_info(b"k", "hmac-sha256", "k")
    host = kernel_sockets(tmp_path)
    for name, (path, port) in channels.items():
        assert port == info[f"{name}_port"]
        assert Path(path).name == host[name].name
        assert Path(path).parent == Path(CONTAINER_RUNTIME_DIR)
