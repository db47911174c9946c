"""Unit-tier fixtures: a fake docker-py client, a guard that no test reaches a daemon, a
ZeroMQ context for the tests with real sockets (the bridge's, the meter's), and the
benchmark scripts loaded as they run.

The fake mimics the small part of docker-py that ``DockerBackend`` uses
(``info``, ``images.get``, ``containers.create``, ``api.inspect_container/kill/logs/
remove_container``) and raises docker-py's real error classes, built the way
``docker.errors.create_api_error_from_http_exception`` builds them. Every call is
recorded in ``FakeDockerClient.calls`` so a test can assert what was (not) done.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import docker
import pytest
import zmq
from docker.errors import APIError, ImageNotFound, NotFound

from sandbox_kernel.backends.docker import REQUIRED_RUNTIME_ARGS, DockerBackend
from sandbox_kernel.plan.sandbox_spec import (
    CONTAINER_CONNECTION_FILE,
    CONTAINER_RUNTIME_DIR,
    CONTAINER_WORKSPACE,
    SandboxSpec,
)
from sandbox_kernel.plan.settings import DEFAULT_RUNTIME

RUNNING = {"Status": "running", "ExitCode": 0, "OOMKilled": False}

Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    """A ZeroMQ context of the test's own, destroyed with whatever sockets are left open."""
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(scope="session")
def bench_script() -> Callable[[str], ModuleType]:
    """Loads ``bench/NAME.py`` as it runs: with ``bench/`` on the path while it imports its
    neighbours, and in ``sys.modules`` (its dataclasses look their module up)."""
    folder = Path(__file__).resolve().parents[2] / "bench"

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", folder / f"{name}.py")
        assert spec
        assert spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        sys.path.insert(0, str(folder))
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(folder))
        return module

    return load


@dataclass
class FakeResponse:
    """What docker-py's errors read from a ``requests.Response``."""

    status_code: int
    reason: str = ""
    url: str = "http+docker://localhost/v1.41/fake"


def api_error(cls: type[APIError], status_code: int, explanation: str) -> APIError:
    """A docker-py error as the SDK raises it for an HTTP error from the daemon."""
    response = FakeResponse(status_code, reason=explanation)
    return cls(f"{status_code} error", response=response, explanation=explanation)


def good_runtimes() -> dict[str, Any]:
    return {
        "runc": {"path": "runc"},
        DEFAULT_RUNTIME: {"path": "/usr/bin/runsc", "runtimeArgs": list(REQUIRED_RUNTIME_ARGS)},
    }


@dataclass
class FakeContainer:
    client: FakeDockerClient
    id: str
    create_kwargs: dict[str, Any]

    @property
    def runtime_dir(self) -> Path:
        """The host folder the container would see at CONTAINER_RUNTIME_DIR."""
        for mount in self.create_kwargs.get("mounts", []):
            if mount["Target"] == CONTAINER_RUNTIME_DIR:
                return Path(mount["Source"])
        raise AssertionError("the container has no runtime dir mount")

    def start(self) -> None:
        self.client.record("start", self.id)
        if self.client.start_error is not None:
            raise self.client.start_error
        self.client.on_start(self)


@dataclass
class FakeImages:
    client: FakeDockerClient

    def get(self, name: str) -> dict[str, str]:
        self.client.record("images.get", name)
        if name not in self.client.images_present:
            raise api_error(ImageNotFound, 404, f"No such image: {name}")
        return {"Id": f"sha256:{name}"}

    def pull(self, *args: Any, **kwargs: Any) -> None:
        self.client.record("images.pull", *args, **kwargs)
        raise AssertionError("sandbox-kernel must never pull images")


@dataclass
class FakeContainers:
    client: FakeDockerClient

    def create(self, **kwargs: Any) -> FakeContainer:
        self.client.record("containers.create", **kwargs)
        container = FakeContainer(self.client, f"{next(self.client.ids):064x}", kwargs)
        self.client.containers_created.append(container)
        self.client.states[container.id] = {"Status": "created", "ExitCode": 0}
        return container

    def run(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("DockerBackend must create and start, not run")


@dataclass
class FakeLowLevelAPI:
    """The ``client.api`` (docker.APIClient) methods DockerBackend calls."""

    client: FakeDockerClient

    def _state(self, container_id: str) -> dict[str, Any]:
        try:
            return self.client.states[container_id]
        except KeyError:
            raise api_error(NotFound, 404, f"No such container: {container_id}") from None

    def inspect_container(self, container_id: str) -> dict[str, Any]:
        self.client.record("api.inspect_container", container_id)
        if self.client.inspect_error is not None:
            raise self.client.inspect_error
        return {"Id": container_id, "State": dict(self._state(container_id))}

    def containers(self, all: bool = False, filters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.client.record("api.containers", all=all, filters=filters)
        return [{"Id": container_id} for container_id in self.client.states]

    def kill(self, container_id: str, signal: int | None = None) -> None:
        self.client.record("api.kill", container_id, signal=signal)
        if self._state(container_id)["Status"] != "running":
            raise api_error(APIError, 409, f"Container {container_id} is not running")

    def logs(self, container_id: str, **kwargs: Any) -> bytes:
        self.client.record("api.logs", container_id, **kwargs)
        self._state(container_id)
        return self.client.logs.get(container_id, b"")

    def remove_container(self, container_id: str, force: bool = False, v: bool = False) -> None:
        self.client.record("api.remove_container", container_id, force=force, v=v)
        self._state(container_id)
        del self.client.states[container_id]


@dataclass
class FakeDockerClient:
    """A stand-in for ``docker.DockerClient`` holding its containers' states in memory."""

    runtimes: dict[str, Any] = field(default_factory=good_runtimes)
    images_present: set[str] = field(default_factory=set)
    states: dict[str, dict[str, Any]] = field(default_factory=dict)
    logs: dict[str, bytes] = field(default_factory=dict)
    start_error: BaseException | None = None
    inspect_error: BaseException | None = None
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    containers_created: list[FakeContainer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ids = itertools.count(0xC0FFEE)
        self.images = FakeImages(self)
        self.containers = FakeContainers(self)
        self.api = FakeLowLevelAPI(self)
        #: What starting a container does; tests replace it to script the "kernel".
        self.on_start: Callable[[FakeContainer], None] = self.run_container

    def record(self, call: str, /, *args: Any, **kwargs: Any) -> None:
        self.calls.append((call, args, kwargs))

    def called(self, name: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        return [(args, kwargs) for n, args, kwargs in self.calls if n == name]

    def info(self) -> dict[str, Any]:
        self.record("info")
        return {"ServerVersion": "20.10.24", "Runtimes": self.runtimes}

    def run_container(self, container: FakeContainer) -> None:
        self.states[container.id] = dict(RUNNING)


@pytest.fixture(autouse=True)
def _no_docker_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests never reach a daemon: stray DOCKER_*/SANDBOX_KERNEL_* settings are
    removed and ``docker.from_env`` fails loudly."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a unit test tried to contact the Docker daemon (docker.from_env)")

    monkeypatch.setattr(docker, "from_env", refuse)
    monkeypatch.setattr(docker.client, "from_env", refuse)
    monkeypatch.setattr(docker.DockerClient, "from_env", classmethod(refuse))
    for name in ("DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH", "DOCKER_CONTEXT"):
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith("SANDBOX_KERNEL_")]:
        monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def jupyter_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Per-test Jupyter and home folders, like pytest-jupyter's ``jp_environ``."""
    root = tmp_path / "jupyter-env"
    dirs = {
        "HOME": root / "home",
        "JUPYTER_DATA_DIR": root / "data",
        "JUPYTER_CONFIG_DIR": root / "config",
        "JUPYTER_RUNTIME_DIR": root / "runtime",
        "IPYTHONDIR": root / "ipython",
    }
    for name, path in dirs.items():
        path.mkdir(parents=True)
        monkeypatch.setenv(name, str(path))
    for name in ("JUPYTER_PATH", "JUPYTER_CONFIG_PATH", "JUPYTER_PLATFORM_DIRS"):
        monkeypatch.delenv(name, raising=False)
    return dirs


@pytest.fixture
def fake_client() -> FakeDockerClient:
    return FakeDockerClient(images_present={"img:1"})


@dataclass
class CountingFactory:
    client: Any
    calls: int = 0

    def __call__(self) -> Any:
        self.calls += 1
        return self.client


@pytest.fixture
def client_factory(fake_client: FakeDockerClient) -> CountingFactory:
    return CountingFactory(fake_client)


@pytest.fixture
def sandbox_docker(client_factory: CountingFactory) -> DockerBackend:
    return DockerBackend(client_factory=client_factory)


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


@pytest.fixture
def real_workspace_modes() -> None:
    """Ask for it to have the plan judge the workspace's real owner and mode."""


@pytest.fixture(autouse=True)
def _writable_workspaces(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests' workspaces are root's temporary folders: the plan takes them as
    writable to the kernel, unless the test asks for ``real_workspace_modes``."""
    if "real_workspace_modes" not in request.fixturenames:
        monkeypatch.setattr("sandbox_kernel.plan.plan.can_write", lambda path, uid, gid: True)


#: How deep the trees kernel code planted were: deeper than Python's recursion limit.
DEEP = 3000


def deep_tree(top: Path, levels: int = DEEP, owner: tuple[int, int] | None = None) -> None:
    """Make ``top/d/d/.../d/f`` (``levels`` folders below ``top``, a file and a link to
    /etc/passwd at the bottom, the bottom folder read-only) as kernel code does: one
    ``mkdir`` at a time relative to the last folder, so no path ever gets long; owned by
    ``owner`` (root only) if given."""
    top.mkdir(exist_ok=True)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir("d", dir_fd=fd)
            if owner is not None:
                os.chown("d", *owner, dir_fd=fd, follow_symlinks=False)
            below = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
        file = os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(file, b"deep")
        os.close(file)
        os.symlink("/etc/passwd", "link", dir_fd=fd)
        os.fchmod(fd, 0o555)
    finally:
        os.close(fd)
