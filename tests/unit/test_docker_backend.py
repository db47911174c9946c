"""DockerBackend against a fake docker-py client: host checks and error translation."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from docker.errors import APIError, DockerException, NotFound

from sandbox_kernel.backends import gvisor_checkpoint
from sandbox_kernel.backends.docker import CHECKPOINTS_KEY, DockerBackend
from sandbox_kernel.errors import (
    DockerOperationError,
    DockerUnavailableError,
    ImageNotFoundError,
    RuntimeMissingError,
    WorkspaceError,
)
from sandbox_kernel.plan.sandbox_spec import (
    LABEL_USER,
    LABEL_VOLUME,
    LABEL_VOLUME_UID,
    LABEL_VOLUME_USER,
    SandboxSpec,
)
from sandbox_kernel.plan.settings import DEFAULT_RUNTIME

from .conftest import RUNNING, CountingFactory, FakeDockerClient, api_error, make_spec

# ---------------------------------------------------------------- the client


async def test_the_client_is_created_lazily_and_once(client_factory: CountingFactory) -> None:
    docker_backend = DockerBackend(client_factory=client_factory)
    assert client_factory.calls == 0
    first = await docker_backend.client()
    second = await docker_backend.client()
    assert first is second is client_factory.client
    assert client_factory.calls == 1


async def test_an_unreachable_daemon_is_docker_unavailable() -> None:
    def factory() -> None:
        raise DockerException("Error while fetching server API version: connection refused")

    with pytest.raises(DockerUnavailableError, match="Cannot reach the Docker daemon") as info:
        await DockerBackend(client_factory=factory).client()
    assert "DOCKER_HOST" in str(info.value)
    assert "connection refused" in str(info.value)
    assert isinstance(info.value.__cause__, DockerException)


# ---------------------------------------------------------------- check_runtime


async def test_a_registered_gvisor_runtime_passes(sandbox_docker: DockerBackend) -> None:
    await sandbox_docker.check_runtime(DEFAULT_RUNTIME)


async def test_a_missing_runtime_names_it_and_gives_the_fix(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    del fake_client.runtimes[DEFAULT_RUNTIME]
    with pytest.raises(RuntimeMissingError) as info:
        await sandbox_docker.check_runtime(DEFAULT_RUNTIME)
    message = str(info.value)
    assert f"no {DEFAULT_RUNTIME!r} runtime" in message
    assert "Registered runtimes: runc." in message
    assert "never falls back to runc" in message
    assert "/etc/docker/daemon.json" in message
    assert f'"{DEFAULT_RUNTIME}": {{"path": "/usr/bin/runsc"' in message


async def test_no_runtimes_at_all_says_none(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    fake_client.runtimes = {}
    with pytest.raises(RuntimeMissingError, match="Registered runtimes: none"):
        await sandbox_docker.check_runtime(DEFAULT_RUNTIME)


@pytest.mark.parametrize("path", ["runc", "/usr/bin/runc", "/usr/bin/crun", ""])
async def test_a_runtime_that_is_not_runsc_is_refused(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient, path: str
) -> None:
    fake_client.runtimes[DEFAULT_RUNTIME] = {
        "path": path,
        "runtimeArgs": ["--network=none", "--host-uds=create"],
    }
    with pytest.raises(RuntimeMissingError, match="which is not gVisor's runsc") as info:
        await sandbox_docker.check_runtime(DEFAULT_RUNTIME)
    assert repr(path) in str(info.value)
    assert "/etc/docker/daemon.json" in str(info.value)


@pytest.mark.parametrize(
    ("args", "missing"),
    [
        (None, "--network=none, --host-uds=create, --oci-seccomp"),
        ([], "--network=none, --host-uds=create, --oci-seccomp"),
        (["--network=none", "--oci-seccomp"], "--host-uds=create"),
        (["--host-uds=create", "--network=host", "--oci-seccomp"], "--network=none"),
        (["--host-uds=create", "--network=none"], "--oci-seccomp"),
    ],
)
async def test_missing_runtime_args_are_named_with_the_fix(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient, args: list[str] | None, missing: str
) -> None:
    entry: dict[str, object] = {"path": "/usr/bin/runsc"}
    if args is not None:
        entry["runtimeArgs"] = args
    fake_client.runtimes[DEFAULT_RUNTIME] = entry
    with pytest.raises(RuntimeMissingError) as info:
        await sandbox_docker.check_runtime(DEFAULT_RUNTIME)
    message = str(info.value)
    assert f"lacks the flags {missing} " in message
    assert '"runtimeArgs": ["--network=none", "--host-uds=create", "--oci-seccomp"]' in message


# ---------------------------------------------------------------- check_image


async def test_a_present_image_passes(sandbox_docker: DockerBackend, fake_client: FakeDockerClient) -> None:
    await sandbox_docker.check_image("img:1")
    assert fake_client.called("images.get") == [(("img:1",), {})]


async def test_a_missing_image_names_the_build_command_and_is_never_pulled(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    with pytest.raises(ImageNotFoundError) as info:
        await sandbox_docker.check_image("registry.example/py:2")
    message = str(info.value)
    assert "'registry.example/py:2' is not on this Docker host" in message
    assert "jupyter sandbox-kernel build-image --tag registry.example/py:2" in message
    assert isinstance(info.value, LookupError)
    assert isinstance(info.value.__cause__, NotFound)
    assert fake_client.called("images.pull") == []
    assert [name for name, _, _ in fake_client.calls] == ["images.get"]


async def test_a_failing_image_lookup_is_not_reported_as_missing(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(name: str) -> None:
        raise api_error(APIError, 500, "storage driver exploded")

    monkeypatch.setattr(fake_client.images, "get", broken)
    with pytest.raises(DockerOperationError, match="storage driver exploded"):
        await sandbox_docker.check_image("img:1")


# ---------------------------------------------------------------- containers


async def test_create_and_start_passes_the_kwargs_through(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    container = await sandbox_docker.create_and_start({"image": "img:1", "runtime": DEFAULT_RUNTIME})
    assert fake_client.called("containers.create") == [((), {"image": "img:1", "runtime": DEFAULT_RUNTIME})]
    assert fake_client.states[container.id]["Status"] == "running"


async def test_a_container_that_fails_to_start_is_removed(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    fake_client.start_error = api_error(APIError, 500, "OCI runtime create failed: runsc did not start")
    with pytest.raises(DockerOperationError, match="start the kernel container: OCI runtime create failed"):
        await sandbox_docker.create_and_start({"image": "img:1"})
    (container,) = fake_client.containers_created
    assert fake_client.called("api.remove_container") == [((container.id,), {"force": True, "v": True})]
    assert fake_client.states == {}


async def test_state_of_a_running_container_has_no_exit_code(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    fake_client.states["c1"] = dict(RUNNING)
    assert await sandbox_docker.state("c1") == ("running", None)


async def test_state_of_an_exited_container_has_its_exit_code(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    fake_client.states["c1"] = {"Status": "exited", "ExitCode": 137, "OOMKilled": True}
    assert await sandbox_docker.state("c1") == ("exited", 137)
    assert await sandbox_docker.oom_killed("c1") is True


async def test_state_of_a_missing_container_is_removed(sandbox_docker: DockerBackend) -> None:
    assert await sandbox_docker.state("gone") == ("removed", 255)
    assert await sandbox_docker.oom_killed("gone") is False


async def test_an_inspect_failure_is_a_docker_operation_error(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    fake_client.inspect_error = api_error(APIError, 500, "daemon is shutting down")
    with pytest.raises(DockerOperationError, match="inspect the kernel container: daemon is shutting down"):
        await sandbox_docker.state("c1")


async def test_losing_the_daemon_is_docker_unavailable(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    # What docker.DockerClient(base_url="unix:///gone.sock", version="1.41").info() raises.
    fake_client.inspect_error = requests.exceptions.ConnectionError("Connection aborted: FileNotFoundError")
    with pytest.raises(DockerUnavailableError):
        await sandbox_docker.state("c1")


async def test_signal_reaches_a_running_container(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    fake_client.states["c1"] = dict(RUNNING)
    assert await sandbox_docker.signal("c1", signal.SIGINT) is True
    assert fake_client.called("api.kill") == [(("c1",), {"signal": int(signal.SIGINT)})]


async def test_signal_to_a_stopped_container_returns_false(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    fake_client.states["c1"] = {"Status": "exited", "ExitCode": 0}
    assert await sandbox_docker.signal("c1", signal.SIGTERM) is False


async def test_signal_to_a_missing_container_returns_false(sandbox_docker: DockerBackend) -> None:
    assert await sandbox_docker.signal("gone", signal.SIGKILL) is False


async def test_a_failing_signal_is_a_docker_operation_error(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(container_id: str, signal: int) -> None:
        raise api_error(APIError, 500, "cannot kill: permission denied")

    monkeypatch.setattr(fake_client.api, "kill", broken)
    fake_client.states["c1"] = dict(RUNNING)
    with pytest.raises(DockerOperationError, match="signal the kernel container: cannot kill"):
        await sandbox_docker.signal("c1", signal.SIGTERM)


async def test_a_signal_failing_on_a_dying_container_means_not_running(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def dying(container_id: str, signal: int) -> None:
        raise api_error(APIError, 500, "cannot connect to control server")

    monkeypatch.setattr(fake_client.api, "kill", dying)
    fake_client.states["c1"] = {"Status": "exited", "ExitCode": 137}
    assert await sandbox_docker.signal("c1", signal.SIGKILL) is False


async def test_logs_are_decoded_stripped_and_quoted(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    """The kernel's text: each line behind a margin, its terminal controls shown as escapes."""
    fake_client.states["c1"] = dict(RUNNING)
    fake_client.logs["c1"] = b"Traceback\n  bad \xff byte \x1b]52;c;eA==\x07\n\n"
    assert (
        await sandbox_docker.logs("c1", tail=5) == "  | Traceback\n  |   bad \ufffd byte \\x1b]52;c;eA==\\x07"
    )
    assert fake_client.called("api.logs") == [(("c1",), {"tail": 5})]


async def test_logs_of_a_missing_container_are_empty(sandbox_docker: DockerBackend) -> None:
    assert await sandbox_docker.logs("gone") == ""


async def test_remove_forces_and_tolerates_a_missing_container(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    fake_client.states["c1"] = dict(RUNNING)
    await sandbox_docker.remove("c1")
    assert fake_client.states == {}
    await sandbox_docker.remove("c1")
    assert fake_client.called("api.remove_container") == [(("c1",), {"force": True, "v": True})] * 2


async def test_a_removal_already_in_progress_is_fine(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(container_id: str, force: bool, v: bool) -> None:
        raise api_error(APIError, 409, "removal of container c1 is already in progress")

    monkeypatch.setattr(fake_client.api, "remove_container", failing)
    await sandbox_docker.remove("c1")


async def test_a_failed_removal_is_raised_not_forgotten(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(container_id: str, force: bool, v: bool) -> None:
        raise api_error(APIError, 500, "driver failed to remove root filesystem")

    monkeypatch.setattr(fake_client.api, "remove_container", failing)
    with pytest.raises(DockerOperationError, match="driver failed to remove root filesystem"):
        await sandbox_docker.remove("c1")


# ---------------------------------------------------------------- volume_path


@dataclass
class FakeVolume:
    attrs: dict[str, Any]


@dataclass
class FakeVolumes:
    """``client.volumes``: what ``docker volume inspect`` says of each volume."""

    client: FakeDockerClient
    attrs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def get(self, name: str) -> FakeVolume:
        self.client.record("volumes.get", name)
        if name not in self.attrs:
            raise api_error(NotFound, 404, f"get {name}: no such volume")
        return FakeVolume(self.attrs[name])


def workspace_volume(fake_client: FakeDockerClient, name: str, **labels: str) -> None:
    volumes = FakeVolumes(fake_client)
    volumes.attrs[name] = {
        "Name": name,
        "Mountpoint": f"/var/lib/docker/volumes/{name}/_data",
        "Labels": labels,
    }
    fake_client.volumes = volumes  # type: ignore[attr-defined]


async def test_a_workspace_volume_of_this_servers_user_has_a_host_path(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    workspace_volume(fake_client, "ws", **{LABEL_VOLUME: "true", LABEL_VOLUME_UID: str(os.getuid())})
    assert await sandbox_docker.volume_path("ws") == Path("/var/lib/docker/volumes/ws/_data")
    assert fake_client.called("volumes.get") == [(("ws",), {})]


@pytest.mark.parametrize(
    "labels",
    [
        {},  # another service's volume
        {LABEL_VOLUME: "true", LABEL_VOLUME_UID: str(os.getuid() + 1)},  # another user's
        {LABEL_VOLUME_UID: str(os.getuid())},
    ],
)
async def test_a_volume_not_made_for_this_servers_workspaces_is_not_handed_out(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient, labels: dict[str, str]
) -> None:
    workspace_volume(fake_client, "db-data", **labels)
    with pytest.raises(WorkspaceError, match="'db-data' was not made for sandbox-kernel workspaces"):
        await sandbox_docker.volume_path("db-data")


async def test_a_missing_volume_is_a_workspace_error(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient
) -> None:
    workspace_volume(fake_client, "other")
    with pytest.raises(WorkspaceError, match="no Docker volume 'gone'"):
        await sandbox_docker.volume_path("gone")


# ---------------------------------------------------------------- checkpoints every judge sees


class JSONResponse:
    def __init__(self, data: Any) -> None:
        self.data = data

    def json(self) -> Any:
        return self.data


def checkpoint_api(
    fake_client: FakeDockerClient, monkeypatch: pytest.MonkeyPatch, root: Path, listed: dict[str, Any]
) -> None:
    """The Engine API's checkpoint endpoints (docker-py has no call for them), Docker's
    data folder at ``root``; ``listed``: each container's list, or the error Docker gives."""
    api = fake_client.api
    monkeypatch.setattr(api, "_url", lambda path, *args: path.format(*args), raising=False)

    def get(url: str) -> Any:
        fake_client.record("api.checkpoints", url.split("/")[2])
        return listed[url.split("/")[2]]

    def raise_for_status(response: Any) -> None:
        if isinstance(response, Exception):
            raise response

    def post(url: str, params: dict[str, Any], timeout: float) -> JSONResponse:
        fake_client.record("api.start_from_checkpoint", url.split("/")[2], **params)
        return JSONResponse(None)

    monkeypatch.setattr(api, "_get", get, raising=False)
    monkeypatch.setattr(api, "_post", post, raising=False)
    monkeypatch.setattr(api, "_raise_for_status", raise_for_status, raising=False)
    monkeypatch.setattr(fake_client, "info", lambda: {"DockerRootDir": str(root), "Runtimes": {}})


async def test_every_stopped_container_comes_with_the_checkpoints_docker_keeps_of_it(
    sandbox_docker: DockerBackend,
    fake_client: FakeDockerClient,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """What a judge of who may be removed needs to know a paused kernel, whatever its uid:
    Docker's list of the stopped container's checkpoints, with their images' sizes where
    this process may read them (runsc's image, else Docker's own folder); an image runsc
    saved that Docker does not list yet counts too. None where Docker would not say."""
    fake_client.states.update(
        running=dict(RUNNING),
        paused={"Status": "exited", "ExitCode": 0},
        never={"Status": "exited", "ExitCode": 137},
        unsure={"Status": "dead", "ExitCode": 1},
    )
    images = tmp_path / "containers" / "paused" / "sandbox-kernel-checkpoints"
    (images / "sk-2").mkdir(parents=True)
    (images / "sk-2" / "pages.img").write_bytes(b"p" * 4096)
    (images / "sk-3").mkdir()  # saved, not yet handed to Docker
    (images / "sk-3" / "checkpoint.img").write_bytes(b"c")
    (images / "sk-4").mkdir()  # made for a save that never began: no memory in it
    own = tmp_path / "containers" / "paused" / "checkpoints" / "sk-1"  # Docker's own checkpoint
    own.mkdir(parents=True)
    (own / "pages.img").write_bytes(b"q" * 100)
    not_experimental = api_error(APIError, 400, "checkpoint is only supported in experimental mode")
    checkpoint_api(
        fake_client,
        monkeypatch,
        tmp_path,
        {
            "paused": JSONResponse([{"Name": "sk-1"}, {"Name": "sk-2"}]),
            "never": JSONResponse(None),
            "unsure": not_experimental,
        },
    )
    found = {attrs["Id"]: attrs for attrs in await sandbox_docker.managed_containers()}
    assert CHECKPOINTS_KEY not in found["running"]
    assert found["paused"][CHECKPOINTS_KEY] == {"sk-1": 100, "sk-2": 4096, "sk-3": 1}
    assert found["never"][CHECKPOINTS_KEY] == {}
    assert found["unsure"][CHECKPOINTS_KEY] is None
    assert sorted(args[0] for args, _ in fake_client.called("api.checkpoints")) == [
        "never",
        "paused",
        "unsure",
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="containerd's temp folders are root's (CI runs as root)")
async def test_a_resume_removes_the_folder_containerd_unpacked_its_checkpoint_into(
    sandbox_docker: DockerBackend,
    fake_client: FakeDockerClient,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Issue #21: each resume left a ctrd-checkpoint* folder in the host's temp folder
    (containerd never removes it). The one holding this checkpoint goes; another
    container's, and other programs' folders, stay."""
    containers = tmp_path / "containers"
    folders = {}
    for container in ("c1", "c2"):
        image = containers / container / "sandbox-kernel-checkpoints" / "sk-1"
        image.mkdir(parents=True)
        (image / "pages.img").write_bytes(b"p")
        checkpoint = containers / container / "checkpoints" / "sk-1"
        checkpoint.mkdir(parents=True)
        (checkpoint / "pages.img").symlink_to(image / "pages.img")
        folders[container] = tmp_path / "tmp" / f"ctrd-checkpoint-{container}"
        folders[container].mkdir(parents=True)
        (folders[container] / "pages.img").symlink_to(image / "pages.img")
    mine = tmp_path / "tmp" / "ctrd-checkpoint-mine"  # another program's, named alike
    mine.mkdir()
    checkpoint_api(fake_client, monkeypatch, tmp_path, {})
    monkeypatch.setattr(gvisor_checkpoint, "containerd_temp_dirs", lambda: [tmp_path / "tmp"])

    await sandbox_docker.restore("c1", "sk-1")

    assert fake_client.called("api.start_from_checkpoint") == [(("c1",), {"checkpoint": "sk-1"})]
    assert not folders["c1"].exists()
    assert folders["c2"].exists()
    assert mine.exists()
    assert (containers / "c1" / "sandbox-kernel-checkpoints" / "sk-1" / "pages.img").exists(), (
        "the image stays"
    )


# ---------------------------------------------------------------- a gateway user's volumes


def user_spec(tmp_path: Path, user: str | None, volume: str = "al-ice-x") -> SandboxSpec:
    return make_spec(tmp_path, volume=volume, extra_labels={LABEL_USER: user} if user else {})


@pytest.mark.parametrize(
    ("owner", "user"),
    [
        ("al-ice", "al"),  # "al" in a folder named "ice-x": "{user}-{project}" gives al-ice's volume
        ("al-ice", None),  # a kernel of no gateway user, naming a user's volume in its kernelspec
        (None, "al"),  # a volume made by a start of no gateway user
    ],
)
async def test_a_volume_is_mounted_only_for_the_gateway_user_it_was_made_for(
    sandbox_docker: DockerBackend,
    fake_client: FakeDockerClient,
    tmp_path: Path,
    owner: str | None,
    user: str | None,
) -> None:
    labels = {LABEL_VOLUME: "true", LABEL_VOLUME_UID: str(os.getuid())}
    workspace_volume(fake_client, "al-ice-x", **labels, **({LABEL_VOLUME_USER: owner} if owner else {}))
    with pytest.raises(WorkspaceError, match="'al-ice-x' is another user's workspace") as refused:
        await sandbox_docker.prepare_workspace(user_spec(tmp_path, user))
    assert str(refused.value).count("al-ice") == 1, "whose it is stays unsaid (the name is the volume's)"


async def test_a_gateway_users_own_volume_is_mounted_for_them(
    sandbox_docker: DockerBackend, fake_client: FakeDockerClient, tmp_path: Path
) -> None:
    labels = {LABEL_VOLUME: "true", LABEL_VOLUME_UID: str(os.getuid()), LABEL_VOLUME_USER: "al-ice"}
    workspace_volume(fake_client, "al-ice-x", **labels)
    path = await sandbox_docker.prepare_workspace(user_spec(tmp_path, "al-ice"))
    assert path == Path("/var/lib/docker/volumes/al-ice-x/_data")
