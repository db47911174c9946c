"""SandboxProvisioner with a fake Docker client: settings, host checks, launch and cleanup."""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path
from typing import Any

import pytest
import zmq
from jupyter_client.kernelspec import KernelSpec
from jupyter_client.provisioning.factory import KernelProvisionerFactory
from traitlets import TraitError
from traitlets.config import Config

from sandbox_kernel.backends.docker import DockerBackend
from sandbox_kernel.errors import (
    ConfigurationError,
    DockerUnavailableError,
    ImageNotFoundError,
    KernelStartupError,
    RuntimeMissingError,
    WorkspaceError,
)
from sandbox_kernel.lifecycle.startup_mark import STARTED_MARK
from sandbox_kernel.plan.sandbox_spec import (
    CONTAINER_CONNECTION_FILE,
    CONTAINER_RUNTIME_DIR,
    CONTAINER_WORKSPACE,
    IPC_PORTS,
    IPC_PREFIX,
    relay_command,
)
from sandbox_kernel.plan.settings import DEFAULT_IMAGE, DEFAULT_RUNTIME
from sandbox_kernel.provisioner import SandboxProvisioner

from .conftest import CountingFactory, FakeContainer, FakeDockerClient

ARGV = ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"]
SERVER_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "JUPYTER_TOKEN": "server-token",
    "JPY_PARENT_PID": "4242",
}


def kernel_spec(config: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> KernelSpec:
    return KernelSpec(
        argv=ARGV,
        name="sandboxed-python",
        display_name="Sandboxed Python",
        language="python",
        env=env or {},
        metadata={
            "kernel_provisioner": {"provisioner_name": "sandbox-provisioner", "config": config or {}},
        },
    )


@pytest.fixture
def runtime_parent(tmp_path: Path) -> Path:
    path = tmp_path / "rt"
    path.mkdir()
    return path


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "ws"
    (path / "notebooks").mkdir(parents=True)
    return path


@pytest.fixture
def make_provisioner(runtime_parent: Path, client_factory: CountingFactory) -> Any:
    made: list[SandboxProvisioner] = []

    def make(spec: KernelSpec | None = None, **traits: Any) -> SandboxProvisioner:
        prov = SandboxProvisioner(
            kernel_id="k1",
            kernel_spec=spec or kernel_spec(),
            parent=None,
            runtime_parent=str(runtime_parent),
            backend=DockerBackend(client_factory=client_factory),
            **traits,
        )
        made.append(prov)
        return prov

    yield make
    for prov in made:  # never leave a bridge thread behind, whatever the test did
        if prov.bridge is not None:
            prov.bridge.stop()


def kernel_binds_its_sockets(container: FakeContainer) -> None:
    """A well-behaved kernel: running, with its five ipc sockets in the runtime dir, and
    the mark of its start-up code."""
    container.client.run_container(container)
    for port in IPC_PORTS.values():
        make_socket_file(container.runtime_dir / f"{Path(IPC_PREFIX).name}-{port}")
    (container.runtime_dir / STARTED_MARK).write_text("ok\n")


def make_socket_file(path: Path) -> None:
    """A socket's entry, as binding one leaves it (the seal checks the kernel's are sockets)."""
    os.mknod(path, stat.S_IFSOCK | 0o600)


def kernel_crashes(container: FakeContainer) -> None:
    container.client.states[container.id] = {"Status": "exited", "ExitCode": 3}
    container.client.logs[container.id] = b"boom"


async def launch(prov: SandboxProvisioner, workspace: Path, **kwargs: Any) -> dict[str, Any]:
    kw = await prov.pre_launch(cwd=str(workspace), env=dict(SERVER_ENV), **kwargs)
    return dict(await prov.launch_kernel(**kw))


# ---------------------------------------------------------------- settings


class TestSettings:
    def test_defaults(self) -> None:
        prov = SandboxProvisioner()
        assert prov.image == DEFAULT_IMAGE
        assert prov.docker_runtime == DEFAULT_RUNTIME
        assert prov.workspace_root is None
        assert prov.memory == "2g"
        assert prov.kernel_uid is None

    def test_image_defaults_to_the_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("SANDBOX_KERNEL_IMAGE", "env/image:3")
        assert SandboxProvisioner().image == "env/image:3"
        monkeypatch.delenv("SANDBOX_KERNEL_IMAGE")
        assert SandboxProvisioner().image == DEFAULT_IMAGE

    def test_an_empty_image_variable_means_the_default(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("SANDBOX_KERNEL_IMAGE", "")
        assert SandboxProvisioner().image == DEFAULT_IMAGE

    def test_runtime_and_workspace_root_default_to_the_environment(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        monkeypatch.setenv("SANDBOX_KERNEL_RUNTIME", "runsc-other")
        monkeypatch.setenv("SANDBOX_KERNEL_WORKSPACE_ROOT", str(tmp_path))
        prov = SandboxProvisioner()
        assert prov.docker_runtime == "runsc-other"
        assert prov.workspace_root == str(tmp_path)

    def test_config_and_kernelspec_values_beat_the_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("SANDBOX_KERNEL_IMAGE", "env/image:3")
        config = Config({"SandboxProvisioner": {"image": "config/image:1"}})
        assert SandboxProvisioner(config=config).image == "config/image:1"
        assert SandboxProvisioner(config=config, image="spec/image:2").image == "spec/image:2"

    @pytest.mark.parametrize(("trait", "value"), [("memory", "lots"), ("tmp_size", "1.5"), ("memory", "0")])
    def test_a_bad_size_is_a_trait_error_naming_the_setting(self, trait: str, value: str) -> None:
        with pytest.raises(TraitError, match=f"{trait}={value!r} is not a size"):
            SandboxProvisioner(**{trait: value})

    def test_sizes_are_normalised(self) -> None:
        assert SandboxProvisioner(memory="512M", tmp_size="1G").memory == "512m"

    @pytest.mark.parametrize("cpus", [0, -1, 65])
    def test_cpus_out_of_range_is_a_trait_error(self, cpus: float) -> None:
        with pytest.raises(TraitError, match=r"cpus=.* is out of range"):
            SandboxProvisioner(cpus=cpus)

    def test_fractional_cpus_are_fine(self) -> None:
        assert SandboxProvisioner(cpus=0.5).cpus == 0.5

    @pytest.mark.parametrize("uid", [0, -5])
    def test_kernel_uid_root_is_a_trait_error(self, uid: int) -> None:
        with pytest.raises(TraitError, match="never runs as root"):
            SandboxProvisioner(kernel_uid=uid)

    def test_the_kernelspec_config_reaches_the_traits_through_jupyter_client(self) -> None:
        """jupyter_client passes metadata.kernel_provisioner.config as constructor kwargs."""
        factory = KernelProvisionerFactory.instance()
        prov = factory.create_provisioner_instance("k1", kernel_spec({"memory": "1g", "cpus": 2}), None)
        assert isinstance(prov, SandboxProvisioner)
        assert (prov.memory, prov.cpus) == ("1g", 2.0)
        with pytest.raises(TraitError, match="memory='lots'"):
            factory.create_provisioner_instance("k1", kernel_spec({"memory": "lots"}), None)

    def test_each_provisioner_has_its_own_connection_info(self) -> None:
        first, second = SandboxProvisioner(), SandboxProvisioner()
        first.connection_info["shell_port"] = 1
        assert second.connection_info == {}


# ---------------------------------------------------------------- pre_launch refusals


def assert_nothing_created(fake_client: FakeDockerClient, runtime_parent: Path) -> None:
    assert fake_client.called("containers.create") == []
    assert list(runtime_parent.iterdir()) == []


async def test_an_unknown_kernelspec_key_fails_before_docker_is_contacted(
    make_provisioner: Any, client_factory: CountingFactory, runtime_parent: Path, workspace: Path
) -> None:
    prov = make_provisioner(kernel_spec({"image": "img:1", "memroy": "1g"}))
    with pytest.raises(ConfigurationError, match="'memroy'") as info:
        await prov.pre_launch(cwd=str(workspace), env=dict(SERVER_ENV))
    assert "'sandboxed-python'" in str(info.value)
    assert client_factory.calls == 0
    assert list(runtime_parent.iterdir()) == []


async def test_a_missing_image_fails_before_anything_is_created(
    make_provisioner: Any, fake_client: FakeDockerClient, runtime_parent: Path, workspace: Path
) -> None:
    prov = make_provisioner(image="not/built:1")
    with pytest.raises(ImageNotFoundError, match="jupyter sandbox-kernel build-image --tag not/built:1"):
        await prov.pre_launch(cwd=str(workspace), env=dict(SERVER_ENV))
    assert fake_client.called("images.pull") == []
    assert_nothing_created(fake_client, runtime_parent)


async def test_a_missing_runtime_fails_before_anything_is_created(
    make_provisioner: Any, fake_client: FakeDockerClient, runtime_parent: Path, workspace: Path
) -> None:
    prov = make_provisioner(image="img:1", docker_runtime="runsc-missing")
    with pytest.raises(RuntimeMissingError, match="no 'runsc-missing' runtime"):
        await prov.pre_launch(cwd=str(workspace), env=dict(SERVER_ENV))
    assert_nothing_created(fake_client, runtime_parent)


async def test_an_unreachable_daemon_fails_pre_launch(
    runtime_parent: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from docker.errors import DockerException

    def unreachable() -> None:
        raise DockerException("connection refused")

    backend = DockerBackend(client_factory=unreachable)
    prov = SandboxProvisioner(
        kernel_id="k1",
        kernel_spec=kernel_spec(),
        parent=None,
        runtime_parent=str(runtime_parent),
        backend=backend,
    )
    with pytest.raises(DockerUnavailableError):
        await prov.pre_launch(cwd=str(workspace), env=dict(SERVER_ENV))
    assert list(runtime_parent.iterdir()) == []


async def test_a_notebook_outside_the_workspace_root_fails_pre_launch(
    make_provisioner: Any,
    fake_client: FakeDockerClient,
    runtime_parent: Path,
    tmp_path: Path,
    workspace: Path,
) -> None:
    prov = make_provisioner(image="img:1", workspace_root=str(workspace))
    with pytest.raises(WorkspaceError, match="outside the workspace root"):
        await prov.pre_launch(cwd=str(tmp_path), env=dict(SERVER_ENV))
    assert_nothing_created(fake_client, runtime_parent)


async def test_a_non_root_server_may_not_choose_another_uid(
    make_provisioner: Any,
    fake_client: FakeDockerClient,
    runtime_parent: Path,
    workspace: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prov = make_provisioner(image="img:1", kernel_uid=2000)
    monkeypatch.setattr(os, "getuid", lambda: 1500)
    with pytest.raises(ConfigurationError, match="only a server running as root"):
        await prov.pre_launch(cwd=str(workspace), env=dict(SERVER_ENV))
    assert_nothing_created(fake_client, runtime_parent)


async def test_launch_before_pre_launch_is_an_error(make_provisioner: Any) -> None:
    with pytest.raises(RuntimeError, match="before pre_launch"):
        await make_provisioner().launch_kernel(cmd=["python"])


# ---------------------------------------------------------------- launch


async def test_a_kernel_that_exits_at_once_fails_with_its_logs_and_leaves_nothing(
    make_provisioner: Any, fake_client: FakeDockerClient, runtime_parent: Path, workspace: Path
) -> None:
    fake_client.on_start = kernel_crashes
    prov = make_provisioner(image="img:1")
    with pytest.raises(KernelStartupError, match="exit code 3") as info:
        await launch(prov, workspace)
    assert "boom" in str(info.value)
    assert info.value.logs == "  | boom"  # quoted: the kernel's text
    (container,) = fake_client.containers_created
    assert fake_client.called("api.remove_container") == [((container.id,), {"force": True, "v": True})]
    assert fake_client.states == {}
    assert list(runtime_parent.iterdir()) == []
    assert prov.has_process is False
    assert prov.bridge is None


async def test_a_kernel_that_never_opens_its_channels_times_out(
    make_provisioner: Any, fake_client: FakeDockerClient, runtime_parent: Path, workspace: Path
) -> None:
    prov = make_provisioner(image="img:1", startup_timeout=0.2)
    with pytest.raises(KernelStartupError, match=r"did not open its channels within 0\.2 s"):
        await launch(prov, workspace)
    assert fake_client.states == {}
    assert list(runtime_parent.iterdir()) == []


async def test_a_launched_kernel_is_hardened_and_reachable_on_localhost(
    make_provisioner: Any, fake_client: FakeDockerClient, runtime_parent: Path, workspace: Path
) -> None:
    fake_client.on_start = kernel_binds_its_sockets
    prov = make_provisioner(
        kernel_spec(env={"MY_SETTING": "on"}),
        image="img:1",
        memory="1g",
        cpus=0.5,
        workspace_root=str(workspace),
    )
    info = await launch(prov, workspace / "notebooks", extra_arguments=["--debug"])

    (container,) = fake_client.containers_created
    create = container.create_kwargs
    runtime_dir = container.runtime_dir
    assert runtime_dir.parent.parent == runtime_parent
    assert prov.has_process is True
    assert prov.container_id == container.id

    # What Docker is asked for.
    assert create["image"] == "img:1"
    assert create["runtime"] == DEFAULT_RUNTIME
    # The kernel, as the child of the relay that lends its channels to the host.
    assert create["command"] == relay_command(
        ["python", "-m", "ipykernel_launcher", "-f", CONTAINER_CONNECTION_FILE, "--debug"]
    )
    assert create["network_mode"] == "none"
    assert create["mem_limit"] == "1g"
    assert create["nano_cpus"] == 500_000_000
    assert not create["user"].startswith("0:")
    assert create["working_dir"] == f"{CONTAINER_WORKSPACE}/notebooks"
    assert {m["Target"]: m["Source"] for m in create["mounts"]} == {
        CONTAINER_WORKSPACE: str(workspace.resolve()),
        CONTAINER_RUNTIME_DIR: str(runtime_dir),
    }
    env = create["environment"]
    assert env["LANG"] == "C.UTF-8"
    assert env["MY_SETTING"] == "on"
    for secret in ("AWS_SECRET_ACCESS_KEY", "JUPYTER_TOKEN", "JPY_PARENT_PID", "PATH"):
        assert secret not in env

    # What the kernel reads inside the sandbox.
    conn_file = runtime_dir / "connection.json"
    assert stat.S_IMODE(conn_file.stat().st_mode) == 0o600
    # (its channels on the sandbox's loopback; the relay binds them as host sockets)
    assert json.loads(conn_file.read_text())["transport"] == "tcp"
    assert json.loads(conn_file.read_text())["ip"] == "127.0.0.1"
    assert (runtime_dir / "kernel_relay.py").is_file()

    # What clients get: unix sockets in the server's private runtime folder.
    assert info["transport"] == "ipc"
    assert info["ip"] == str(runtime_dir.parent / "client")
    assert stat.S_IMODE(runtime_dir.parent.stat().st_mode) == 0o700
    ports = [info[f"{c}_port"] for c in ("shell", "iopub", "stdin", "control", "hb")]
    assert all(isinstance(p, int) and p > 0 for p in ports)
    assert len(set(ports)) == 5
    assert info["key"] == b""
    assert info["kernel_name"] == "sandboxed-python"
    assert "curve_publickey" not in info

    # The manager's view of the running kernel.
    assert await prov.poll() is None
    await prov.send_signal(signal.SIGINT)
    assert fake_client.called("api.kill") == [((container.id,), {"signal": int(signal.SIGINT)})]
    assert (
        prov.resolve_path(f"{CONTAINER_WORKSPACE}/notebooks")
        == (workspace / "notebooks").resolve().as_posix()
    )
    assert prov.resolve_path("/etc/passwd") is None
    assert prov.resolve_path(f"{CONTAINER_WORKSPACE}/../etc/passwd") is None

    await prov.cleanup(restart=False)
    assert fake_client.states == {}
    assert prov.has_process is False
    assert prov.bridge is None
    assert not runtime_dir.exists()
    assert await prov.poll() == 0


async def test_poll_reports_the_exit_code_once_the_container_stops(
    make_provisioner: Any, fake_client: FakeDockerClient, workspace: Path
) -> None:
    fake_client.on_start = kernel_binds_its_sockets
    prov = make_provisioner(image="img:1")
    await launch(prov, workspace)
    fake_client.states[prov.container_id] = {"Status": "exited", "ExitCode": 137, "OOMKilled": True}
    assert await prov.poll() == 137
    assert await prov.wait() == 137
    await prov.cleanup()


async def test_an_end_the_watchdog_noted_is_believed_over_an_event_stream_that_missed_it(
    make_provisioner: Any, fake_client: FakeDockerClient, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """poll() trusts the backend's event stream to say a kernel still runs; once the
    watchdog has seen it end (its periodic check), Jupyter's restarter must see it too."""
    fake_client.on_start = kernel_binds_its_sockets
    prov = make_provisioner(image="img:1")
    await launch(prov, workspace)
    monkeypatch.setattr(prov.backend, "surely_running", lambda container_id: True)  # a stream that missed it
    assert await prov.poll() is None
    fake_client.states[prov.container_id] = {"Status": "exited", "ExitCode": 1}
    await prov.exits.note(prov.container_id, 1)
    assert await prov.poll() == 1
    await prov.cleanup()


async def test_a_restart_keeps_the_client_ports_with_a_fresh_launch_dir(
    make_provisioner: Any, fake_client: FakeDockerClient, workspace: Path
) -> None:
    fake_client.on_start = kernel_binds_its_sockets
    prov = make_provisioner(image="img:1")
    first = await launch(prov, workspace)
    first_container = prov.container_id
    first_dir = fake_client.containers_created[0].runtime_dir
    outer = first_dir.parent
    assert outer.stat().st_mode & 0o777 == 0o700
    assert outer.stat().st_uid == os.getuid()

    await prov.cleanup(restart=True)
    assert first_container not in fake_client.states
    assert not first_dir.exists()  # nothing the old kernel left can reach the next one
    assert outer.is_dir()
    assert prov.bridge is not None

    second = await launch(prov, workspace)
    assert prov.container_id != first_container
    second_dir = fake_client.containers_created[1].runtime_dir
    assert second_dir.parent == outer
    assert second_dir != first_dir
    assert {k: v for k, v in second.items() if k.endswith("_port")} == {
        k: v for k, v in first.items() if k.endswith("_port")
    }
    await prov.cleanup()
    assert not outer.exists()


async def test_kernelspec_env_templates_read_only_what_pass_env_allows(
    make_provisioner: Any, fake_client: FakeDockerClient, workspace: Path
) -> None:
    """jupyter_client fills ${VAR} in a kernelspec's env from the server's environment: a
    kernelspec printed the server's JUPYTERHUB_API_TOKEN that way."""
    fake_client.on_start = kernel_binds_its_sockets
    spec = kernel_spec(env={"STOLEN": "${JUPYTER_TOKEN}", "AWS": "x-$AWS_SECRET_ACCESS_KEY", "L": "${LANG}"})
    prov = make_provisioner(spec, image="img:1")
    await launch(prov, workspace)
    (container,) = fake_client.containers_created
    env = container.create_kwargs["environment"]
    assert env["STOLEN"] == "${JUPYTER_TOKEN}"
    assert env["AWS"] == "x-$AWS_SECRET_ACCESS_KEY"
    assert env["L"] == SERVER_ENV["LANG"]  # pass_env names it
    assert SERVER_ENV["JUPYTER_TOKEN"] not in json.dumps(env)


async def test_the_client_sockets_are_gone_after_cleanup(
    make_provisioner: Any, fake_client: FakeDockerClient, workspace: Path
) -> None:
    fake_client.on_start = kernel_binds_its_sockets
    prov = make_provisioner(image="img:1")
    info = await launch(prov, workspace)
    sockets = [
        Path(f"{info['ip']}-{info[f'{c}_port']}") for c in ("shell", "iopub", "stdin", "control", "hb")
    ]
    assert all(stat.S_ISSOCK(p.stat().st_mode) for p in sockets)
    await prov.cleanup()
    assert not any(p.exists() for p in sockets)
    assert not Path(info["ip"]).parent.exists()


async def test_a_bridge_port_is_freed_after_cleanup(
    make_provisioner: Any, fake_client: FakeDockerClient, workspace: Path
) -> None:
    fake_client.on_start = kernel_binds_its_sockets
    prov = make_provisioner(image="img:1", client_transport="tcp")
    info = await launch(prov, workspace)
    await prov.cleanup()
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.bind(f"tcp://127.0.0.1:{info['shell_port']}")
        sock.close()
    finally:
        ctx.term()


# ---------------------------------------------------------------- network and policy


@pytest.mark.parametrize(
    ("config", "traits", "message"),
    [
        ({"network": "allowlist"}, {}, r"network='allowlist' needs allowed_domains"),
        ({"allowed_domains": ["docs.python.org"]}, {}, r"is set but network is 'none'"),
        (
            {"network": "allowlist", "allowed_domains": ["docs.python.org"]},
            {},
            r"exceed the server's ceiling \(SandboxProvisioner.max_allowed_domains=\[\]\)",
        ),
        (
            {"network": "allowlist", "allowed_domains": ["*.python.org"]},
            {"max_allowed_domains": ["docs.python.org"]},
            r"\['\*.python.org'\] exceed the server's ceiling",
        ),
        (
            {"network": "allowlist", "allowed_domains": ["10.0.0.1"]},
            {"max_allowed_domains": ["*.org"]},
            r"allowed_domains.*'10.0.0.1'",
        ),
        (
            {"pass_env": ["AWS_SECRET_ACCESS_KEY"]},
            {},
            r"pass the server's AWS_SECRET_ACCESS_KEY.*max_pass_env",
        ),
        ({"idle_timeout": 0}, {"max_idle_timeout": 600}, r"idle_timeout=0.0 \(no limit\) exceeds.*600 s"),
        ({"file_size": "20g"}, {}, r"file_size='20g' exceeds the server's ceiling of '16g'"),
    ],
)
async def test_a_kernelspec_cannot_widen_its_policy(
    make_provisioner: Any,
    client_factory: CountingFactory,
    runtime_parent: Path,
    workspace: Path,
    config: dict[str, Any],
    traits: dict[str, Any],
    message: str,
) -> None:
    spec = kernel_spec(config)
    prov = make_provisioner(spec, **config, **traits)
    with pytest.raises(ConfigurationError, match=message):
        await prov.pre_launch(cwd=str(workspace), env=dict(SERVER_ENV))
    assert client_factory.calls == 0
    assert list(runtime_parent.iterdir()) == []


@pytest.mark.parametrize(
    ("trait", "value"),
    [
        ("network", "bridge"),
        ("allowed_domains", [443]),
        ("egress_private_networks", ["10.0.0.0/33"]),
        ("egress_host_map", {"a.test": "not-an-ip"}),
        ("idle_timeout", -1),
    ],
)
def test_a_malformed_policy_value_is_a_trait_error_naming_it(trait: str, value: Any) -> None:
    with pytest.raises(TraitError, match=trait):
        SandboxProvisioner(**{trait: value})


async def test_an_allowlist_kernel_gets_the_relay_and_proxy_settings(
    make_provisioner: Any, fake_client: FakeDockerClient, workspace: Path
) -> None:
    def kernel_and_relay_bind(container: FakeContainer) -> None:
        kernel_binds_its_sockets(container)
        make_socket_file(container.runtime_dir / "egress.sock")

    fake_client.on_start = kernel_and_relay_bind
    config = {"network": "allowlist", "allowed_domains": ["docs.python.org", "*.readthedocs.io:443"]}
    prov = make_provisioner(
        kernel_spec(config), image="img:1", max_allowed_domains=["*.python.org", "*.readthedocs.io"], **config
    )
    await launch(prov, workspace)
    (container,) = fake_client.containers_created
    create = container.create_kwargs
    assert create["command"][1:7] == [
        f"{CONTAINER_RUNTIME_DIR}/egress_relay.py",
        f"{CONTAINER_RUNTIME_DIR}/egress.sock",
        "3128",
        "--ca",
        f"{CONTAINER_RUNTIME_DIR}/egress-ca.pem",
        "--",
    ]
    assert create["command"][7:] == relay_command(
        ["python", "-m", "ipykernel_launcher", "-f", CONTAINER_CONNECTION_FILE]
    )
    # The sandbox gets the CA's certificate; its key stays in the server-only folder.
    launch_dir = container.runtime_dir
    assert b"PRIVATE KEY" not in (launch_dir / "egress-ca.pem").read_bytes()
    assert b"PRIVATE KEY" in (launch_dir.parent / "egress-ca-and-key.pem").read_bytes()
    assert create["network_mode"] == "none"
    env = create["environment"]
    assert env["HTTPS_PROXY"] == env["http_proxy"] == "http://127.0.0.1:3128"
    policy = json.loads(env["SANDBOX_KERNEL_POLICY"])
    assert policy["network"] == "allowlist"
    assert policy["allowed_domains"] == ["docs.python.org", "*.readthedocs.io:443"]
    assert (container.runtime_dir / "egress_relay.py").read_text().startswith('"""')
    ulimits = {u["Name"]: u["Soft"] for u in create["ulimits"]}
    assert ulimits == {"nproc": 256, "fsize": 4 * 1024**3}
    await prov.cleanup(restart=False)


def test_the_backend_is_chosen_by_configuration_and_must_be_a_sandbox_backend() -> None:
    """As jupyter_client's client_factory: another backend (or a test's) plugs in by config."""
    from traitlets import TraitError
    from traitlets.config import Config

    from sandbox_kernel.backends.base import SandboxBackend

    class Recording(DockerBackend):
        pass

    config = Config()
    config.SandboxProvisioner.backend_class = Recording
    prov = SandboxProvisioner(kernel_id="k1", kernel_spec=kernel_spec(), parent=None, config=config)
    assert isinstance(prov.backend, Recording)
    assert isinstance(SandboxProvisioner(kernel_id="k2", kernel_spec=kernel_spec()).backend, SandboxBackend)
    with pytest.raises(TraitError):
        SandboxProvisioner(kernel_id="k3", kernel_spec=kernel_spec(), backend_class=dict)


async def test_a_start_narrows_a_policy_of_its_own_and_leaves_the_settings_as_they_are(
    make_provisioner: Any, workspace: Path
) -> None:
    """One source of truth per start: what ``start_kernel(memory=...)`` narrows is the
    running kernel's policy (its plan, its watchdog, what a front end shows), never written
    back onto the provisioner's traits, so the next start begins from the kernelspec's."""
    prov = make_provisioner(image="img:1", memory="2g", exec_timeout=60)
    await prov.pre_launch(cwd=str(workspace), env=dict(SERVER_ENV), memory="1g", exec_timeout=30)
    assert (prov.policy.memory, prov.policy.exec_timeout) == ("1g", 30.0)
    assert (prov.memory, prov.exec_timeout) == ("2g", 60.0), "the settings are as configured"
    assert prov.site.spec is not None
    assert prov.site.spec.memory == "1g"
    with pytest.raises(ConfigurationError, match="read only"):
        prov.policy.memory = "4g"
    with pytest.raises(ConfigurationError, match="would widen"):
        await prov.pre_launch(cwd=str(workspace), env=dict(SERVER_ENV), memory="3g")
    await prov.pre_launch(cwd=str(workspace), env=dict(SERVER_ENV))
    assert (prov.policy.memory, prov.policy.exec_timeout) == ("2g", 60.0), "a start asking nothing"
