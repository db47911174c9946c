"""The pure policy: Docker create arguments, the sandbox's environment, the workspace."""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
from pathlib import Path
from typing import Any

import pytest
from docker.models.containers import _create_container_args

from sandbox_kernel.docker_args import SECCOMP_PROFILE, container_create_kwargs, volume_setup_kwargs
from sandbox_kernel.errors import ConfigurationError, WorkspaceError
from sandbox_kernel.limits import validate_size
from sandbox_kernel.plan import (
    DEFAULT_KERNEL_UID,
    KERNELSPEC_KEYS,
    check_default_uid_unused,
    check_lifetime,
    kernel_user,
    resolve_workspace,
    validate_kernelspec_config,
    volume_name,
    volume_user,
)
from sandbox_kernel.sandbox_spec import (
    CONTAINER_CONNECTION_FILE,
    CONTAINER_RUNTIME_DIR,
    CONTAINER_WORKSPACE,
    DEFAULT_ENV,
    FIXED_ENV,
    IPC_PREFIX,
    LABEL_KERNEL_ID,
    LABEL_KERNELSPEC,
    LABEL_MANAGED,
    LABEL_RUNTIME_DIR,
    LABEL_WORKSPACE,
    SandboxSpec,
    container_connection_info,
    kernel_command,
    sandbox_env,
)


def make_spec(tmp_path: Path, **overrides: object) -> SandboxSpec:
    values: dict[str, object] = {
        "kernel_id": "k1",
        "kernelspec": "sandboxed-python",
        "image": "img:1",
        "runtime": "runsc-sandbox-kernel",
        "command": ["python", "-m", "ipykernel_launcher", "-f", CONTAINER_CONNECTION_FILE],
        "env": {"HOME": "/tmp"},
        "workspace": tmp_path / "work",
        "workdir": f"{CONTAINER_WORKSPACE}/sub",
        "runtime_dir": tmp_path / "rt",
        "uid": 1234,
        "gid": 1235,
        "memory": "512m",
        "cpus": 0.5,
        "tmp_size": "64m",
    }
    values.update(overrides)
    return SandboxSpec(**values)  # type: ignore[arg-type]


def no_accounts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose passwd and group know no uid or gid, whatever this one's hold."""

    def unknown(number: int) -> Any:
        raise KeyError(number)

    monkeypatch.setattr(pwd, "getpwuid", unknown)
    monkeypatch.setattr(grp, "getgrgid", unknown)


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


class TestResolveWorkspace:
    def test_without_a_root_the_start_folder_is_the_workspace(self, tmp_path: Path) -> None:
        project = tmp_path / "project"
        project.mkdir()
        assert resolve_workspace(project, None) == (project.resolve(), CONTAINER_WORKSPACE)

    def test_with_a_root_the_start_folder_maps_below_the_mount(self, tmp_path: Path) -> None:
        root = tmp_path / "root"
        (root / "a" / "b").mkdir(parents=True)
        assert resolve_workspace(root / "a" / "b", root) == (root.resolve(), f"{CONTAINER_WORKSPACE}/a/b")

    def test_the_root_itself_maps_to_the_workspace(self, tmp_path: Path) -> None:
        assert resolve_workspace(tmp_path, tmp_path) == (tmp_path.resolve(), CONTAINER_WORKSPACE)

    def test_a_folder_outside_the_root_is_refused_with_a_fix(self, tmp_path: Path) -> None:
        root = tmp_path / "root"
        elsewhere = tmp_path / "elsewhere"
        root.mkdir()
        elsewhere.mkdir()
        with pytest.raises(WorkspaceError, match="outside the workspace root") as info:
            resolve_workspace(elsewhere, root)
        message = str(info.value)
        assert str(elsewhere) in message
        assert str(root) in message
        assert "Move the notebook under the workspace root" in message

    def test_a_symlink_escaping_the_root_is_resolved_and_refused(self, tmp_path: Path) -> None:
        root = tmp_path / "root"
        outside = tmp_path / "outside"
        root.mkdir()
        outside.mkdir()
        (root / "link").symlink_to(outside)
        with pytest.raises(WorkspaceError, match="outside the workspace root"):
            resolve_workspace(root / "link", root)

    def test_a_symlink_within_the_root_maps_to_its_target(self, tmp_path: Path) -> None:
        root = tmp_path / "root"
        (root / "real").mkdir(parents=True)
        (root / "link").symlink_to(root / "real")
        assert resolve_workspace(root / "link", root)[1] == f"{CONTAINER_WORKSPACE}/real"

    @pytest.mark.parametrize("root", [None, "/"])
    def test_the_filesystem_root_is_refused(self, tmp_path: Path, root: str | None) -> None:
        cwd = "/" if root is None else tmp_path
        with pytest.raises(WorkspaceError, match="system or home folder"):
            resolve_workspace(cwd, root)

    @pytest.mark.parametrize("folder", ["/etc", "/usr", "/var/lib/docker"])
    def test_system_folders_are_refused(self, folder: str) -> None:
        if not Path(folder).is_dir():
            pytest.skip(f"{folder} does not exist on this machine")
        with pytest.raises(WorkspaceError, match="Refusing to mount"):
            resolve_workspace(folder, None)

    def test_the_home_folder_is_refused(self, jupyter_dirs: dict[str, Path]) -> None:
        home = jupyter_dirs["HOME"]
        with pytest.raises(WorkspaceError, match="system or home folder"):
            resolve_workspace(home, None)
        with pytest.raises(WorkspaceError, match="system or home folder"):
            resolve_workspace(home / ".", home)

    def test_a_folder_below_home_is_fine(self, jupyter_dirs: dict[str, Path]) -> None:
        project = jupyter_dirs["HOME"] / "project"
        project.mkdir()
        assert resolve_workspace(project, None) == (project.resolve(), CONTAINER_WORKSPACE)

    def test_a_missing_start_folder_is_refused(self, tmp_path: Path) -> None:
        with pytest.raises(WorkspaceError, match="does not exist") as info:
            resolve_workspace(tmp_path / "gone", None)
        assert str(tmp_path / "gone") in str(info.value)

    def test_a_file_is_not_a_start_folder(self, tmp_path: Path) -> None:
        (tmp_path / "f").write_text("")
        with pytest.raises(WorkspaceError, match="not a folder"):
            resolve_workspace(tmp_path / "f", None)

    def test_a_missing_root_is_refused_with_the_setting_to_fix(self, tmp_path: Path) -> None:
        with pytest.raises(WorkspaceError, match=r"SandboxProvisioner\.workspace_root"):
            resolve_workspace(tmp_path, tmp_path / "no-root")

    def test_workspace_error_is_a_configuration_error(self) -> None:
        assert issubclass(WorkspaceError, ConfigurationError)
        assert issubclass(WorkspaceError, ValueError)


# ---------------------------------------------------------------- kernel_command


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


class TestValidateKernelspecConfig:
    def test_allowed_keys_pass(self) -> None:
        validate_kernelspec_config(dict.fromkeys(KERNELSPEC_KEYS, "x"), "ks")

    @pytest.mark.parametrize(
        "key",
        ["memroy", "kernel_uid", "docker_runtime", "runtime_parent", "max_memory", "max_cpus", "max_pids"],
    )
    def test_an_unknown_key_is_named_in_the_error(self, key: str) -> None:
        with pytest.raises(ConfigurationError) as info:
            validate_kernelspec_config({"image": "img:1", key: "x"}, "my-spec")
        message = str(info.value)
        assert repr(key) in message
        assert "'my-spec'" in message
        assert f"Allowed: {', '.join(sorted(KERNELSPEC_KEYS))}." in message


class TestValidateSize:
    @pytest.mark.parametrize(("value", "expected"), [("512m", "512m"), ("2G", "2g"), ("1024", "1024")])
    def test_sizes_are_accepted_and_lowercased(self, value: str, expected: str) -> None:
        assert validate_size("memory", value) == expected

    @pytest.mark.parametrize("value", ["lots", "", "0", "1.5g", "-1m", "2gb", "512 m"])
    def test_non_sizes_are_refused_naming_the_setting(self, value: str) -> None:
        with pytest.raises(ConfigurationError) as info:
            validate_size("tmp_size", value)
        assert f"tmp_size={value!r}" in str(info.value)


# ---------------------------------------------------------------- kernel_user


class TestKernelUser:
    def test_a_configured_uid_is_used_for_uid_and_gid(self, tmp_path: Path) -> None:
        assert kernel_user(tmp_path, 2000) == (2000, 2000)

    def test_a_non_root_server_runs_kernels_as_itself(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(os, "getuid", lambda: 1500)
        monkeypatch.setattr(os, "getgid", lambda: 1501)
        assert kernel_user(tmp_path) == (1500, 1501)

    def test_a_root_server_uses_the_workspace_owner(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        workspace = tmp_path / "ws"
        workspace.mkdir()
        if os.stat(workspace).st_uid == 0:
            os.chown(workspace, 4242, 4343)
        owner = os.stat(workspace)
        monkeypatch.setattr(os, "getuid", lambda: 0)
        assert kernel_user(workspace) == (owner.st_uid, owner.st_gid)
        assert owner.st_uid != 0

    def test_a_root_server_with_a_root_owned_workspace_uses_the_default(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        root_owned = Path("/")
        assert root_owned.stat().st_uid == 0
        monkeypatch.setattr(os, "getuid", lambda: 0)
        no_accounts(monkeypatch)
        assert kernel_user(root_owned) == (DEFAULT_KERNEL_UID, DEFAULT_KERNEL_UID)
        assert volume_user() == (DEFAULT_KERNEL_UID, DEFAULT_KERNEL_UID)
        assert DEFAULT_KERNEL_UID != 0

    def test_the_default_uid_is_reserved_for_no_one(self) -> None:
        """Not 1000 (the first human account on most hosts, ``cloudsdk`` on ours), not
        65534 (nobody): 65533, which Debian policy reserves and never allocates."""
        assert DEFAULT_KERNEL_UID == 65533

    @pytest.mark.parametrize("taken", ["account", "group"])
    def test_a_default_uid_that_is_a_host_account_is_refused(
        self, taken: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(os, "getuid", lambda: 0)
        no_accounts(monkeypatch)
        if taken == "account":
            entry = pwd.struct_passwd(("someone", "x", DEFAULT_KERNEL_UID, 100, "", "/home/x", "/bin/sh"))
            monkeypatch.setattr(pwd, "getpwuid", lambda uid: entry)
        else:
            monkeypatch.setattr(grp, "getgrgid", lambda gid: grp.struct_group(("staff2", "x", gid, [])))
        for choose in (lambda: kernel_user(Path("/")), volume_user, check_default_uid_unused):
            with pytest.raises(
                ConfigurationError, match=r"uid and gid 65533.*SandboxProvisioner\.kernel_uid"
            ):
                choose()
        # A configured uid, or a workspace owner, needs no default.
        assert kernel_user(Path("/"), 4321) == (4321, 4321)
        assert volume_user(4321) == (4321, 4321)

    def test_a_configured_uid_of_zero_is_never_used(self, tmp_path: Path) -> None:
        try:
            uid, _ = kernel_user(tmp_path, 0)
        except ConfigurationError:
            return
        assert uid != 0


# ---------------------------------------------------------------- container_connection_info


def test_container_connection_info_uses_ipc_in_the_runtime_dir() -> None:
    info = container_connection_info(b"s3cret", "hmac-sha256", "sandboxed-python")
    assert info == {
        "transport": "ipc",
        "ip": IPC_PREFIX,
        "shell_port": 1,
        "iopub_port": 2,
        "stdin_port": 3,
        "control_port": 4,
        "hb_port": 5,
        "key": "s3cret",
        "signature_scheme": "hmac-sha256",
        "kernel_name": "sandboxed-python",
    }
    assert IPC_PREFIX.startswith(f"{CONTAINER_RUNTIME_DIR}/")
    assert isinstance(info["key"], str)


class TestWorkspaceVolumes:
    def test_the_template_is_filled_with_docker_safe_names(self) -> None:
        name = volume_name(
            "sk-{user}-{notebook}", user="Ann Lee", kernelspec="py", notebook="team/Sales Q3", project="team"
        )
        assert name == "sk-Ann-Lee-team-Sales-Q3"
        assert volume_name("team-{project}", project="analysis") == "team-analysis"
        assert volume_name("{kernelspec}-{notebook}", kernelspec="py") == "py-untitled"

    @pytest.mark.parametrize(
        ("template", "message"),
        [
            ("ws-{owner}", "placeholders"),
            ("{project", "not a valid template"),
            ("-{user}", "not a Docker volume"),
        ],
    )
    def test_a_bad_template_is_an_error_naming_it(self, template: str, message: str) -> None:
        with pytest.raises(ConfigurationError, match=message):
            volume_name(template, user="-", project="p")

    def test_the_kernel_gets_a_volume_mount_that_never_copies_the_image_over_it(self, tmp_path: Path) -> None:
        spec = make_spec(tmp_path, volume="team-analysis")
        (workspace, _) = container_create_kwargs(spec)["mounts"]
        assert workspace["Type"] == "volume"
        assert workspace["Source"] == "team-analysis"
        assert workspace["VolumeOptions"]["NoCopy"] is True
        assert spec.labels[LABEL_WORKSPACE] == "volume:team-analysis"
        setup = volume_setup_kwargs(spec)
        assert setup["command"] == ["chown", f"{spec.uid}:{spec.gid}", "/workspace"]
        assert setup["cap_add"] == ["CHOWN"]
        assert setup["security_opt"] == ["no-new-privileges:true", f"seccomp={SECCOMP_PROFILE}"]
        assert setup["network_mode"] == "none"
        assert setup["runtime"] == spec.runtime


def test_a_persistent_kernel_beyond_the_ttl_ceiling_is_refused() -> None:
    check_lifetime("persistent", 3600, 86400)
    check_lifetime("ephemeral", 0, 60)
    with pytest.raises(
        ConfigurationError, match=r"persistent_ttl=0 \(no limit\) exceeds.*max_persistent_ttl"
    ):
        check_lifetime("persistent", 0, 86400)
