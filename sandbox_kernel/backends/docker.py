"""The one place that talks to Docker (kernels and images): async for kernels, never
blocking a server's loop, with errors translated.

docker-py is synchronous, so every call runs in a worker thread; a provisioner lives in
the server's event loop and must never block it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import docker
from docker.errors import APIError, BuildError, DockerException, ImageNotFound, NotFound
from requests.exceptions import RequestException

from sandbox_kernel.backends import gvisor_checkpoint
from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.backends.docker_args import container_create_kwargs, volume_setup_kwargs, zmq_probe_kwargs
from sandbox_kernel.backends.gvisor_checkpoint import IMAGES_FOLDER
from sandbox_kernel.channels.untrusted import MARGIN, quoted
from sandbox_kernel.errors import (
    DockerOperationError,
    DockerUnavailableError,
    ImageBuildError,
    ImageNotFoundError,
    KernelStartupError,
    PauseError,
    RuntimeMissingError,
    WorkspaceError,
)
from sandbox_kernel.host import mounts
from sandbox_kernel.host.background import poll_until
from sandbox_kernel.host.cgroups import (
    CgroupFreezer,
    held_host_sockets,
    memory_usage,
    process_ended,
    thaw_container,
)
from sandbox_kernel.host.trees import ForeignFolderError, delete_tree, tree_size
from sandbox_kernel.plan.sandbox_spec import (
    LABEL_MANAGED,
    LABEL_USER,
    LABEL_VOLUME,
    LABEL_VOLUME_UID,
    LABEL_VOLUME_USER,
    SandboxSpec,
)
from sandbox_kernel.plan.settings import DATASCIENCE_IMAGE

T = TypeVar("T")

log = logging.getLogger(__name__)

#: What docker-py raises when the daemon is gone: its own errors, or requests' ones
#: once a connection had been made.
_TRANSPORT_ERRORS = (DockerException, RequestException)

#: Runtime flags the gVisor runtime must carry: no network stack; the kernel may create
#: (not open) host unix sockets, its ipc endpoints; and the container's seccomp profile
#: is enforced (runsc ignores it otherwise).
REQUIRED_RUNTIME_ARGS = ("--network=none", "--host-uds=create", "--oci-seccomp")
#: How long Docker may take to save a kernel's sandbox to disk, or start it from there.
CHECKPOINT_TIMEOUT = 900
#: Added by :meth:`DockerBackend.managed_containers` to a stopped container's inspect
#: output: its checkpoints (name: image bytes, None where this process may not measure
#: them), or None where Docker would not list them.
CHECKPOINTS_KEY = "SandboxKernelCheckpoints"
#: Docker's states of a container that does not run (a paused kernel's is one of them).
STOPPED = ("exited", "dead")
#: How to let Docker checkpoint containers, for errors and ``check``.
CHECKPOINT_SETUP_HINT = (
    'Pausing a kernel needs Docker\'s experimental mode: add "experimental": true to '
    "/etc/docker/daemon.json and restart dockerd (running containers stop), or run `bash .ci/setup` "
    "from the sandbox-kernel checkout, which does it when no kernel runs."
)


@contextmanager
def _translated(what: str) -> Iterator[None]:
    """Docker's errors as ours (NotFound passes through, for callers to decide)."""
    try:
        yield
    except NotFound:
        raise
    except APIError as exc:
        msg = f"Docker failed to {what}: {exc.explanation or exc}"
        raise DockerOperationError(msg) from exc
    except _TRANSPORT_ERRORS as exc:
        msg = f"Lost the Docker daemon while trying to {what}: {exc}. Is dockerd running?"
        raise DockerUnavailableError(msg) from exc


def runtime_setup_hint(runtime: str) -> str:
    """How to register the gVisor runtime, for error messages and ``check``."""
    args = ", ".join(f'"{a}"' for a in REQUIRED_RUNTIME_ARGS)
    return (
        f'Add to /etc/docker/daemon.json: {{"runtimes": {{"{runtime}": {{"path": "/usr/bin/runsc", '
        f'"runtimeArgs": [{args}]}}}}}} and reload dockerd (kill -HUP its pid), or run '
        "`bash .ci/setup` from the sandbox-kernel checkout, which installs gVisor and does this."
    )


def build_command(image: str) -> str:
    """The command that builds ``image``: its own recipe for a shipped tag, else the default recipe."""
    if image == DATASCIENCE_IMAGE:
        return "jupyter sandbox-kernel build-image --recipe datascience"
    return f"jupyter sandbox-kernel build-image --tag {image}"


def _workspace_volume_labels() -> dict[str, str]:
    """The labels of a volume made for sandbox-kernel workspaces by this server's user."""
    return {LABEL_VOLUME: "true", LABEL_VOLUME_UID: str(os.getuid())}


def _is_workspace_volume(labels: Mapping[str, str]) -> bool:
    """Only such volumes are mounted or have their files handed out: never another
    service's or another user's, which a kernelspec could name."""
    mine = _workspace_volume_labels()
    return {key: labels.get(key) for key in mine} == mine


def _pin(spec: SandboxSpec) -> Path:
    """Mount ``spec``'s workspace on its staging folder from a descriptor, every folder from
    the user's root down to it checked to be the kernel's uid's on the descriptors opened
    (see :func:`sandbox_kernel.host.mounts.pin_folder`); the staging folder. Never its path instead.

    Raises:
        WorkspaceError: in one line, why it is not pinned.
    """
    folder, root = str(spec.workspace), spec.owned_from
    if spec.staging is None or root is None:
        msg = f"The kernel's folder {folder!r} has no staging folder to be pinned on; not mounting it."
        raise WorkspaceError(msg)
    try:
        mounts.pin_folder(spec.workspace, spec.staging, spec.uid, root)
    except ForeignFolderError as exc:
        msg = (
            f"Refusing the kernel's folder {folder!r}: {exc.filename!r} belongs to uid {exc.owner} now, "
            f"not to the kernel's uid {spec.uid}; it changed since it was checked. Start the kernel again."
        )
        raise WorkspaceError(msg) from None
    except NotADirectoryError as exc:
        msg = (
            f"Refusing the kernel's folder {folder!r}: {exc.filename!r} is a link or no folder now; "
            "it changed since it was checked, and no link is followed. Start the kernel again in a "
            "folder of yours."
        )
        raise WorkspaceError(msg) from None
    except FileNotFoundError as exc:
        msg = f"The kernel's folder {folder!r} is gone ({exc.filename!r} is missing) since it was checked."
        raise WorkspaceError(msg) from None
    except (OSError, ValueError) as exc:
        msg = (
            f"Could not mount the kernel's folder {folder!r} from the descriptor it was checked on ({exc}); "
            "it is not mounted by its path instead. A gateway's kernels start only where it runs as root."
        )
        raise WorkspaceError(msg) from None
    return spec.staging


class DockerBackend(SandboxBackend):
    """Sandboxes as Docker containers under the gVisor runtime: the one place that talks
    to Docker about kernels. An async facade over a docker-py client, made on first use."""

    def __init__(self, client_factory: Callable[[], Any] | None = None) -> None:
        self._client_factory = client_factory or docker.from_env
        self._client: Any = None

    @property
    def exits(self) -> ContainerExits:
        """The event stream of this backend's Docker daemon (one per process and daemon)."""
        return ContainerExits.of(self._client_factory)

    def watch_exits(self, sandbox_id: str) -> None:
        self.exits.watch(sandbox_id)

    def unwatch_exits(self, sandbox_id: str) -> None:
        self.exits.unwatch(sandbox_id)

    def surely_running(self, sandbox_id: str) -> bool:
        return bool(self.exits.running(sandbox_id))

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def client(self) -> Any:
        """The docker-py client, connecting on first use.

        Raises:
            DockerUnavailableError: the daemon cannot be reached.
        """
        if self._client is None:
            try:
                self._client = await self._call(self._client_factory)
            except DockerException as exc:
                msg = (
                    f"Cannot reach the Docker daemon ({exc}). Start it (`dockerd &`, or "
                    "`systemctl start docker`), or point DOCKER_HOST at a running one."
                )
                raise DockerUnavailableError(msg) from exc
        return self._client

    async def _api(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one Docker call, mapping transport failures to our errors."""
        with _translated(what):
            return await self._call(fn, *args, **kwargs)

    async def check_runtime(self, runtime: str) -> None:
        """Make sure ``runtime`` is registered, is gVisor, and carries our flags.

        Raises:
            RuntimeMissingError: with the daemon.json snippet that fixes it.
        """
        info = await self._info()
        runtimes = info.get("Runtimes") or {}
        entry = runtimes.get(runtime)
        if entry is None:
            msg = (
                f"The Docker daemon has no {runtime!r} runtime, so the kernel cannot run under "
                f"gVisor (sandbox-kernel never falls back to runc). Registered runtimes: "
                f"{', '.join(sorted(runtimes)) or 'none'}. {runtime_setup_hint(runtime)}"
            )
            raise RuntimeMissingError(msg)
        path = str(entry.get("path", ""))
        if "runsc" not in path.rsplit("/", 1)[-1]:
            msg = (
                f"The Docker runtime {runtime!r} runs {path!r}, which is not gVisor's runsc; "
                f"refusing to start a sandboxed kernel with it. {runtime_setup_hint(runtime)}"
            )
            raise RuntimeMissingError(msg)
        args = list(entry.get("runtimeArgs") or [])
        missing = [a for a in REQUIRED_RUNTIME_ARGS if a not in args]
        if missing:
            msg = (
                f"The gVisor runtime {runtime!r} lacks the flags {', '.join(missing)} "
                f"(it has {args or 'none'}). {runtime_setup_hint(runtime)}"
            )
            raise RuntimeMissingError(msg)

    async def check_image(self, image: str) -> None:
        """Make sure ``image`` exists locally; it is never pulled.

        Raises:
            ImageNotFoundError: naming the command that builds it.
        """
        client = await self.client()
        try:
            await self._api(f"inspect image {image}", client.images.get, image)
        except (ImageNotFound, NotFound) as exc:
            msg = (
                f"The kernel image {image!r} is not on this Docker host, and sandbox-kernel "
                f"never pulls images. Build it with: {build_command(image)}"
            )
            raise ImageNotFoundError(msg) from exc

    async def resume_hazard(self, image: str, runtime: str) -> tuple[bool, str]:
        """Whether kernels of ``image`` come back from a pause on this host's runsc:
        (safe, why). runsc before :data:`~.gvisor_checkpoint.EPOLL_RESTORE_FIXED` can restore
        an epoll set with an entry deleted before the pause; a libzmq that waits with epoll
        (pyzmq's own wheel) then calls through a stale pointer and the kernel dies of
        SIGSEGV (about one resume in four, measured). The image's libzmq is probed in a
        throwaway sandbox, as the kernel would load it."""
        runtimes = (await self._info()).get("Runtimes") or {}
        path = str((runtimes.get(runtime) or {}).get("path") or "runsc")
        try:
            done = await asyncio.to_thread(
                subprocess.run, [path, "--version"], capture_output=True, text=True, timeout=30, check=False
            )
            version = done.stdout
        except (OSError, subprocess.TimeoutExpired):
            version = ""
        release = gvisor_checkpoint.runsc_release(version)
        if not gvisor_checkpoint.resurrects_epoll_entries(version):
            return True, f"runsc {release} restores epoll sets correctly"
        code, output = await self.run_once(zmq_probe_kwargs(image, runtime), timeout=60)
        # The output comes quoted (each line behind the margin): the last line is the answer.
        answer = output.rsplit("\n", 1)[-1].removeprefix(MARGIN).strip() if code == 0 else "?"
        if answer == "poll":
            return True, "its libzmq waits with poll(2), which this runsc restores correctly"
        runsc = f"runsc {release}" if release else f"this runsc ({path})"
        what = (
            "its libzmq waits with epoll"
            if answer == "epoll"
            else f"how its libzmq waits could not be told (exit code {code}):\n{output[-600:]}\n"
        )
        return False, (
            f"{what}: on {runsc}, older than gVisor's release-{gvisor_checkpoint.EPOLL_RESTORE_FIXED}.0, a "
            "paused kernel of it can die (SIGSEGV) as it resumes. Build the image from sandbox-kernel's "
            "images/Dockerfile, whose libzmq polls, or install a newer runsc (docs/administrators/pausing.md)"
        )

    async def create(self, spec: SandboxSpec) -> str:
        container = await self.create_and_start(container_create_kwargs(spec))
        return str(container.id)

    async def update_limits(
        self, sandbox_id: str, memory: str | None = None, cpus: float | None = None
    ) -> None:
        client = await self.client()
        changes: dict[str, Any] = {}
        if memory is not None:
            changes.update(mem_limit=memory, memswap_limit=memory)
        if cpus is not None:
            changes["nano_cpus"] = int(cpus * 1_000_000_000)
        await self._api(
            "update the kernel container's limits", client.api.update_container, sandbox_id, **changes
        )

    async def prepare_workspace(self, spec: SandboxSpec) -> Path | None:
        """Create the workspace volume on first use, owned by the kernel's uid; or pin a
        gateway user's workspace (``owned_from``) on its staging folder (see :func:`_pin`).

        A kernelspec names the volume, and users may write kernelspecs: only volumes
        made for sandbox-kernel workspaces by this server's uid are ever mounted, never
        another service's or another user's.

        Raises:
            WorkspaceError: the volume exists but is not such a volume; or the workspace to
                pin is not (any more) the user's, or could not be pinned.
            KernelStartupError: the volume could not be handed to the kernel's uid.
        """
        if spec.volume is None:
            return None if spec.owned_from is None else await asyncio.to_thread(_pin, spec)
        labels = await self.volume_labels(spec.volume)
        user = spec.labels.get(LABEL_USER)  # a sandbox gateway's user, the kernel's
        if labels is not None:
            if not _is_workspace_volume(labels):
                msg = (
                    f"The Docker volume {spec.volume!r} (the kernelspec's workspace_volume) exists but "
                    "was not made for sandbox-kernel workspaces by this server's user, so it is not "
                    "mounted. Choose another name in the kernelspec's workspace_volume."
                )
                raise WorkspaceError(msg)
            if labels.get(LABEL_VOLUME_USER) != user:
                # (Which user's it is stays unsaid: that is another user's business.)
                msg = (
                    f"The Docker volume {spec.volume!r} is another user's workspace, so it is not mounted "
                    f"for {user or 'a kernel of no gateway user'}: on a sandbox gateway each user's volumes "
                    "are their own. Start the kernel in a folder of another name."
                )
                raise WorkspaceError(msg)
        else:
            await self.create_volume(
                spec.volume, {**_workspace_volume_labels(), **({LABEL_VOLUME_USER: user} if user else {})}
            )
            log.info("Created workspace volume %s for uid %d", spec.volume, spec.uid)
            code, output = await self.run_once(volume_setup_kwargs(spec))
            if code != 0:
                msg = f"Could not prepare the workspace volume {spec.volume!r} (exit code {code}): {output}"
                raise KernelStartupError(msg, output)
        return await self.volume_path(spec.volume)

    async def volume_path(self, name: str) -> Path:
        """The host mountpoint of a sandbox-kernel workspace volume of this server's uid.

        Raises:
            WorkspaceError: no such volume, or not one made for sandbox-kernel workspaces
                by this server's user (another service's files are never handed out).
        """
        attrs = await self._inspect_volume(name)
        if attrs is None:
            msg = f"There is no Docker volume {name!r}: the kernel's workspace volume is gone."
            raise WorkspaceError(msg)
        if not _is_workspace_volume(attrs.get("Labels") or {}):
            msg = (
                f"The Docker volume {name!r} was not made for sandbox-kernel workspaces by this "
                "server's user, so its files are not handed out."
            )
            raise WorkspaceError(msg)
        mountpoint = attrs.get("Mountpoint")
        if not mountpoint:
            msg = f"Docker does not say where the files of the volume {name!r} are (no Mountpoint)."
            raise WorkspaceError(msg)
        return Path(mountpoint)

    async def attach_workspace(self, slot: Path, workspace_path: str, source: Path) -> None:
        """A bind mount under the slot, which the sandbox sees (rslave propagation)."""
        await asyncio.to_thread(mounts.attach_workspace, slot, workspace_path, source)

    async def create_and_start(self, create_kwargs: Mapping[str, Any]) -> Any:
        """Create and start a container; remove it again if starting fails."""
        client = await self.client()
        container = await self._api("create the kernel container", client.containers.create, **create_kwargs)
        try:
            await self._api("start the kernel container", container.start)
        except BaseException:
            await self.remove(container.id)
            raise
        return container

    async def volume_labels(self, name: str) -> dict[str, str] | None:
        """The labels of the named volume; None when there is no such volume."""
        attrs = await self._inspect_volume(name)
        return None if attrs is None else dict(attrs.get("Labels") or {})

    async def _inspect_volume(self, name: str) -> dict[str, Any] | None:
        """``docker volume inspect``; None when there is no such volume."""
        client = await self.client()
        try:
            volume = await self._api(f"inspect volume {name}", client.volumes.get, name)
        except NotFound:
            return None
        return dict(volume.attrs)

    async def rename(self, container_id: str, name: str) -> None:
        client = await self.client()
        await self._api("rename the kernel container", client.api.rename, container_id, name)

    async def create_volume(self, name: str, labels: Mapping[str, str]) -> None:
        client = await self.client()
        await self._api(f"create volume {name}", client.volumes.create, name=name, labels=dict(labels))

    async def run_once(self, create_kwargs: Mapping[str, Any], timeout: float = 120) -> tuple[int, str]:
        """Run a short-lived helper container to its end: (exit code, output). Always removed."""
        container = await self.create_and_start(create_kwargs)
        try:
            result = await self._api("wait for a helper container", container.wait, timeout=timeout)
            return int(result.get("StatusCode", 255)), await self.logs(container.id)
        finally:
            await self.remove(container.id)

    async def _container_state(self, container_id: str) -> dict[str, Any] | None:
        """The container's ``State`` from ``docker inspect``; None when it is gone."""
        client = await self.client()
        try:
            attrs = await self._api(
                "inspect the kernel container", client.api.inspect_container, container_id
            )
        except NotFound:
            return None
        return dict(attrs.get("State") or {})

    async def state(self, container_id: str) -> tuple[str, int | None]:
        """(status, exit code or None while running); ``("removed", 255)`` when gone."""
        state = await self._container_state(container_id)
        if state is None:
            return "removed", 255
        status = str(state.get("Status", "unknown"))
        if status in ("created", "running", "paused", "restarting"):
            return status, None
        return status, int(state.get("ExitCode", 255))

    async def main_pid(self, container_id: str) -> int | None:
        """The host pid of the container's main process (gVisor's sandbox), if running."""
        return _main_pid(await self._container_state(container_id) or {})

    async def freezer(self, container_id: str) -> CgroupFreezer | None:
        """The freezer cgroup of the container's sandbox (``docker pause`` does not stop a
        runsc sandbox; ``docker kill`` of a frozen one waits until it is thawed)."""
        pid = await self.main_pid(container_id)
        return await asyncio.to_thread(CgroupFreezer.of_pid, pid) if pid else None

    async def oom_killed(self, container_id: str) -> bool:
        return bool((await self._container_state(container_id) or {}).get("OOMKilled"))

    async def signal(self, container_id: str, signum: int) -> bool:
        """Send ``signum`` to the container's init; False if it is not running."""
        client = await self.client()
        try:
            await self._call(client.api.kill, container_id, signal=int(signum))
        except NotFound:
            return False
        except APIError as exc:
            if exc.status_code == 409:  # not running
                return False
            # A container that is dying answers 500 ("cannot connect to control server").
            _, code = await self.state(container_id)
            if code is not None:
                return False
            msg = f"Docker failed to signal the kernel container: {exc.explanation or exc}"
            raise DockerOperationError(msg) from exc
        except _TRANSPORT_ERRORS as exc:
            msg = f"Lost the Docker daemon while signalling the kernel: {exc}. Is dockerd running?"
            raise DockerUnavailableError(msg) from exc
        return True

    async def logs(self, container_id: str, tail: int = 30) -> str:
        """The container's last ``tail`` output lines, quoted (see :func:`~.untrusted.quoted`:
        it is the kernel's text), or "" if unavailable."""
        client = await self.client()
        try:
            raw = await self._call(client.api.logs, container_id, tail=tail)
        except _TRANSPORT_ERRORS:
            return ""
        return quoted(bytes(raw).decode("utf-8", "replace").strip())

    # Pausing. Docker 20.10 checkpoints containers only in experimental mode, and docker-py
    # has no call for it: the Engine API's own endpoints, through docker-py's session.

    async def check_checkpoints(self) -> None:
        client = await self.client()
        version: Mapping[str, Any] = await self._api("read the daemon's version", client.version)
        if not version.get("Experimental"):
            msg = f"The Docker daemon cannot checkpoint containers. {CHECKPOINT_SETUP_HINT}"
            raise PauseError(msg)

    async def checkpoint(self, container_id: str, name: str) -> int | None:
        api = (await self.client()).api
        attrs = await self._api("inspect the kernel container", api.inspect_container, container_id)
        pid = _main_pid(attrs.get("State") or {})
        held = await self.host_sockets(container_id, pid)
        if held:
            msg = (
                f"code in the kernel holds a unix socket bound at {', '.join(held)}, which gVisor cannot "
                "save (close it, e.g. the server or listener that made it, to let the kernel pause)"
            )
            raise PauseError(msg)
        info = await self._info()
        container_folder = _root_dir(info) / "containers" / container_id
        runsc = await self._runsc_checkpoint(attrs, info, pid, container_folder, name)
        if runsc is not None:
            try:
                await self._run_runsc_checkpoint(runsc, container_folder, name)
            except PauseError:
                if pid and await poll_until(  # the failure (or the save) ended it:
                    functools.partial(asyncio.to_thread, process_ended, pid), 3.0, 0.05
                ):
                    with contextlib.suppress(PauseError):  # let Docker see that, for the caller
                        await self._wait_stopped(container_id, timeout=10)
                raise
            await self._wait_stopped(container_id)
            folder = gvisor_checkpoint.image_folder(container_folder, name)
        else:

            def save() -> None:
                url = api._url("/containers/{0}/checkpoints", container_id)
                data = {"CheckpointID": name, "Exit": True}
                api._raise_for_status(api._post_json(url, data=data, timeout=CHECKPOINT_TIMEOUT))

            await self._api("save the kernel's sandbox to disk", save)
            folder = container_folder / "checkpoints" / name
        try:
            return await asyncio.to_thread(tree_size, folder)
        except OSError:
            return None  # not readable by this process

    async def host_sockets(self, container_id: str, pid: int | None = None) -> list[str] | None:
        pid = pid or await self.main_pid(container_id)
        return await asyncio.to_thread(held_host_sockets, pid) if pid else None

    async def _runsc_checkpoint(
        self,
        attrs: Mapping[str, Any],
        info: Mapping[str, Any],
        pid: int | None,
        container_folder: Path,
        name: str,
    ) -> list[str] | None:
        """The ``runsc checkpoint`` command that saves this container's sandbox, or None
        where this process cannot run it (not root, or the sandbox's state root unknown):
        then Docker's own, slower checkpoint does (see :mod:`.gvisor_checkpoint`)."""
        if not (gvisor_checkpoint.may_run_runsc() and pid):
            return None
        if not await asyncio.to_thread(container_folder.is_dir):
            return None
        try:
            cmdline = await asyncio.to_thread(Path(f"/proc/{pid}/cmdline").read_bytes)
        except OSError:
            return None
        container_id = str(attrs["Id"])
        root = gvisor_checkpoint.runsc_root(cmdline.partition(b"\0")[2])
        if root is None or not await asyncio.to_thread(gvisor_checkpoint.is_state_root, root, container_id):
            log.info("Container %s: gVisor's state root not found; Docker saves it (slower)", container_id)
            return None
        runtime = (info.get("Runtimes") or {}).get((attrs.get("HostConfig") or {}).get("Runtime"))
        if not isinstance(runtime, Mapping) or "runsc" not in str(runtime.get("path")):
            return None
        image = gvisor_checkpoint.image_folder(container_folder, name)
        await asyncio.to_thread(image.mkdir, mode=0o700, parents=True, exist_ok=True)
        in_use = await asyncio.to_thread(memory_usage, pid)
        cached = gvisor_checkpoint.writes_through_cache(
            in_use, await asyncio.to_thread(gvisor_checkpoint.dirty_room)
        )
        direct = not cached and await asyncio.to_thread(gvisor_checkpoint.supports_direct_io, image)
        args = [str(arg) for arg in runtime.get("runtimeArgs") or []]
        return gvisor_checkpoint.checkpoint_command(
            str(runtime["path"]), args, root, image, container_id, direct=direct
        )

    async def _wait_stopped(self, container_id: str, timeout: float = 60) -> None:
        """Wait until Docker has seen the sandbox that runsc saved (and ended) stop: only
        a stopped container starts from a checkpoint.

        Raises:
            PauseError: Docker still reports it running after ``timeout`` seconds.
        """

        async def stopped() -> bool:
            return (await self.state(container_id))[1] is not None

        if not await poll_until(stopped, timeout, 0.05):
            msg = f"the kernel's sandbox was saved, but Docker reports it running after {timeout:.0f} s"
            raise PauseError(msg)

    async def _run_runsc_checkpoint(self, command: list[str], container_folder: Path, name: str) -> None:
        """Run ``command`` (which saves the sandbox into its image folder), then link the
        image into Docker's checkpoint folder, for ``docker start --checkpoint``.

        Raises:
            PauseError: runsc failed (with its words) or the image could not be linked;
                nothing of it is left on disk.
        """
        image = gvisor_checkpoint.image_folder(container_folder, name)
        checkpoint = container_folder / "checkpoints" / name
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as exc:
            await asyncio.to_thread(_discard, image)
            msg = f"cannot run gVisor's runsc to save the kernel's sandbox ({exc})"
            raise PauseError(msg) from exc
        try:
            output, _ = await asyncio.wait_for(process.communicate(), CHECKPOINT_TIMEOUT)
        except asyncio.TimeoutError:
            output = f"no answer in {CHECKPOINT_TIMEOUT} s".encode()
        finally:
            if process.returncode is None:  # timed out, or cancelled
                process.kill()
        if process.returncode == 0:
            try:
                await asyncio.to_thread(gvisor_checkpoint.link_image, image, checkpoint)
                return
            except OSError as exc:
                output = f"its image could not be linked for Docker: {exc}".encode()
        else:
            await process.wait()
        for folder in (image, checkpoint):
            await asyncio.to_thread(_discard, folder)
        said = " / ".join(output.decode("utf-8", "replace").strip().splitlines()[-3:])
        msg = f"gVisor could not save the kernel's sandbox ({said or f'runsc exited {process.returncode}'})"
        raise PauseError(msg)

    async def restore(self, container_id: str, name: str) -> None:
        api = (await self.client()).api

        def start() -> None:
            url = api._url("/containers/{0}/start", container_id)
            api._raise_for_status(api._post(url, params={"checkpoint": name}, timeout=CHECKPOINT_TIMEOUT))

        try:
            await self._api("start the kernel's sandbox from its checkpoint", start)
        finally:
            await self._discard_restore_copies(container_id, name)

    async def _discard_restore_copies(self, container_id: str, name: str) -> None:
        """Remove the folder containerd unpacked the checkpoint into to start the container
        (it never does: each resume would leave one in its temp folder), and only that
        one. Only root may: containerd's temp folders are root's, private to it."""
        if os.geteuid() != 0:
            return
        try:
            checkpoint = _root_dir(await self._info()) / "containers" / container_id / "checkpoints" / name
        except (DockerOperationError, DockerUnavailableError):
            return

        def discard() -> None:
            temp_dirs = gvisor_checkpoint.containerd_temp_dirs()
            for folder in gvisor_checkpoint.restore_copies(temp_dirs, checkpoint):
                _discard(folder)

        await asyncio.to_thread(discard)

    async def remove_checkpoint(self, container_id: str, name: str) -> None:
        api = (await self.client()).api

        def delete() -> None:
            response = api._delete(api._url("/containers/{0}/checkpoints/{1}", container_id, name))
            if response.status_code != 404:
                api._raise_for_status(response)

        await self._api("remove the kernel's checkpoint", delete)
        container_folder = _root_dir(await self._info()) / "containers" / container_id
        image = gvisor_checkpoint.image_folder(container_folder, name)
        await asyncio.to_thread(_discard, image)

    async def checkpoint_usage(self) -> tuple[int, int | None]:
        return await asyncio.to_thread(_checkpoint_usage, _root_dir(await self._info()))

    async def _info(self) -> Mapping[str, Any]:
        client = await self.client()
        info: Mapping[str, Any] = await self._api("read the daemon's info", client.info)
        return info

    async def managed_containers(self) -> list[dict[str, Any]]:
        """``docker inspect`` of every sandbox-kernel container, running or not; a stopped
        one's with its checkpoints (under ``CHECKPOINTS_KEY``: what a judge of who may be
        removed needs to know a paused kernel, whoever it is)."""
        client = await self.client()
        found = await self._api(
            "list containers", client.api.containers, all=True, filters={"label": LABEL_MANAGED}
        )
        result = []
        root: Path | None = None
        for summary in found:
            try:
                attrs = await self._api("inspect a container", client.api.inspect_container, summary["Id"])
            except NotFound:
                continue  # removed meanwhile
            if (attrs.get("State") or {}).get("Status") in STOPPED:
                root = root or _root_dir(await self._info())
                attrs[CHECKPOINTS_KEY] = await self._checkpoints(str(attrs["Id"]), root)
            result.append(attrs)
        return result

    async def _checkpoints(self, container_id: str, root: Path | None = None) -> dict[str, int | None] | None:
        """The container's checkpoints, as Docker lists them (to any process that may use
        Docker) and, where this process may look, the images of them runsc saved in
        Docker's folder of it (``root``: Docker's data folder): name: the image's bytes,
        None if not measurable here. None where Docker would not say (not in experimental
        mode, say): the container may hold a paused kernel.

        Raises:
            DockerUnavailableError: the daemon cannot be reached.
        """
        api = (await self.client()).api

        def listed() -> Any:
            response = api._get(api._url("/containers/{0}/checkpoints", container_id))
            api._raise_for_status(response)
            return response.json()

        try:
            names = await self._api("list the kernel's checkpoints", listed)
        except (NotFound, DockerOperationError, ValueError):
            return None
        if not isinstance(names, list | None):
            return None
        found = {str(entry.get("Name")) for entry in names or [] if isinstance(entry, dict)}
        if root is None:
            return dict.fromkeys(found)
        return await asyncio.to_thread(_checkpoint_sizes, root / "containers" / container_id, found)

    def remove_blocking(self, container_id: str) -> None:
        """Force-remove a container from the calling thread (at the process's exit, when
        worker threads can no longer start); a missing one is fine.

        Raises:
            DockerOperationError, DockerUnavailableError: it may still exist.
        """
        thaw_container(container_id)
        try:
            with _translated("remove the kernel container"):
                client = self._client or self._client_factory()
                client.api.remove_container(container_id, force=True, v=True)
        except NotFound:
            return

    async def remove(self, container_id: str) -> None:
        """Force-remove a container; a missing one is fine.

        Raises:
            DockerOperationError, DockerUnavailableError: it may still exist.
        """
        client = await self.client()
        await asyncio.to_thread(thaw_container, container_id)
        try:
            await self._api(
                "remove the kernel container", client.api.remove_container, container_id, force=True, v=True
            )
        except NotFound:
            return
        except DockerOperationError as exc:
            cause = exc.__cause__
            if (
                isinstance(cause, APIError)
                and cause.status_code == 409
                and "in progress" in str(cause.explanation)
            ):
                return
            raise


def _main_pid(state: Mapping[str, Any]) -> int | None:
    """The host pid of a container's main process, from its ``State``; None if not running."""
    pid = state.get("Pid")
    return int(pid) if isinstance(pid, int) and pid > 0 else None


def _root_dir(info: Mapping[str, Any]) -> Path:
    """Where the daemon ``info`` keeps its data (containers, their checkpoints)."""
    return Path(str(info.get("DockerRootDir") or "/var/lib/docker"))


def _discard(folder: Path) -> None:
    """Remove a checkpoint's folder, if there is one; a failure is logged."""
    try:
        delete_tree(folder)
    except OSError as exc:
        log.warning("Could not remove %s (%s); remove it by hand", folder, exc)


def _checkpoint_sizes(container_folder: Path, names: set[str]) -> dict[str, int | None]:
    """``names`` and the images runsc saved in ``container_folder`` (one not linked for
    Docker yet still holds the kernel's memory; an empty folder holds none), each with
    its bytes: runsc's image, else Docker's own checkpoint folder; None where neither is
    readable."""
    images = container_folder / IMAGES_FOLDER
    try:
        for entry in images.iterdir():
            if not entry.is_symlink() and entry.is_dir() and any(entry.iterdir()):
                names = names | {entry.name}
    except OSError:
        pass  # none, or not this process's to read
    sizes: dict[str, int | None] = {}
    for name in names:
        sizes[name] = None
        for folder in (images / name, container_folder / "checkpoints" / name):
            try:
                if folder.is_dir() and not folder.is_symlink():
                    sizes[name] = tree_size(folder)
                    break
            except OSError:
                continue
    return sizes


def _checkpoint_usage(root: Path) -> tuple[int, int | None]:
    """(bytes of every container's checkpoints under Docker's ``root``, bytes free there);
    (0, None) where this process may not look (a server not run as root)."""
    try:
        containers = root / "containers"
        folders = [*containers.glob("*/checkpoints"), *containers.glob(f"*/{IMAGES_FOLDER}")]
        used = sum(tree_size(folder) for folder in folders)
        return used, shutil.disk_usage(root).free
    except OSError:
        return 0, None


class ContainerExits:
    """Which sandbox containers have ended, from Docker's event stream: one connection
    for the whole process, instead of every kernel's watchdog asking Docker each second.

    A thread follows ``die`` events of sandbox-kernel containers. While it is connected
    (:attr:`following`), a container it has seen no ``die`` event for since it began
    watching it is running; otherwise callers ask Docker as before. After a lost
    connection (dockerd restarting) it reconnects and asks for the events it missed.
    """

    #: By the client factory's id (each stream keeps its factory alive, so ids stay unique).
    _streams: ClassVar[dict[int, ContainerExits]] = {}
    _streams_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, client_factory: Callable[[], Any]) -> None:
        self._client_factory = client_factory
        self._lock = threading.Lock()
        self._watched: dict[str, threading.Event] = {}
        self._connected = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def of(cls, client_factory: Callable[[], Any]) -> ContainerExits:
        """The process's stream for the daemon ``client_factory`` connects to."""
        with cls._streams_lock:
            if id(client_factory) not in cls._streams:
                cls._streams[id(client_factory)] = cls(client_factory)
            return cls._streams[id(client_factory)]

    @property
    def following(self) -> bool:
        """Whether the event stream is connected now."""
        return self._connected.is_set()

    def watch(self, container_id: str) -> threading.Event:
        """The event that is set once ``container_id`` has ended (call before relying on
        :meth:`running`; check the container's state once after, for an end before)."""
        with self._lock:
            ended = self._watched.setdefault(container_id, threading.Event())
            if self._thread is None:
                self._thread = threading.Thread(target=self._follow, name="sandbox-kernel-exits", daemon=True)
                self._thread.start()
        return ended

    def unwatch(self, container_id: str) -> None:
        with self._lock:
            self._watched.pop(container_id, None)

    def running(self, container_id: str) -> bool | None:
        """True: surely still running (watched, no end seen, stream connected); None: ask Docker."""
        with self._lock:
            ended = self._watched.get(container_id)
        if ended is None or not self.following or ended.is_set():
            return None
        return True

    def _follow(self) -> None:
        # From a little before it connects: an end just before is not missed.
        since = int(time.time()) - 10
        while True:
            try:
                client = self._client_factory()
                stream = client.events(
                    decode=True,
                    since=since,
                    filters={"type": "container", "event": ["die"], "label": [LABEL_MANAGED]},
                )
                self._connected.set()
                for event in stream:
                    since = int(event.get("time") or 0) or since
                    with self._lock:
                        ended = self._watched.get(str(event.get("id", "")))
                    if ended is not None:
                        ended.set()
            except Exception as exc:  # noqa: BLE001  # the daemon went away: reconnect
                log.debug("Docker's event stream ended (%s); reconnecting", exc)
            self._connected.clear()
            with self._lock:
                if not self._watched:  # nothing to follow: the next watch starts again
                    self._thread = None
                    return
            time.sleep(1.0)


class ImageStore:
    """The kernel images on the Docker host, for ``jupyter sandbox-kernel build-image``
    (synchronous: a command-line tool, not a server's loop)."""

    def __init__(self, client_factory: Callable[[], Any] | None = None) -> None:
        """Raises:
        DockerUnavailableError: the daemon cannot be reached."""
        try:
            self._client = (client_factory or docker.from_env)()
        except DockerException as exc:
            msg = f"cannot reach the Docker daemon ({exc}); start dockerd first"
            raise DockerUnavailableError(msg) from exc

    def image_id(self, tag: str) -> str | None:
        """The id of ``tag``, or None if there is no such image."""
        try:
            return str(self._client.images.get(tag).id)
        except ImageNotFound:
            return None

    def label(self, tag: str, name: str) -> str | None:
        """The label ``name`` of ``tag``; "" if it has none; None if there is no such image."""
        try:
            image = self._client.images.get(tag)
        except ImageNotFound:
            return None
        return str((image.labels or {}).get(name, ""))

    def build(
        self, context: Path, tag: str, buildargs: Mapping[str, str], labels: Mapping[str, str], nocache: bool
    ) -> Iterator[str]:
        """Build ``context``'s Dockerfile as ``tag`` (never pulling), yielding its progress.

        Raises:
            ImageBuildError: with Docker's message.
        """
        try:
            for chunk in self._client.api.build(
                path=str(context),
                tag=tag,
                buildargs=dict(buildargs),
                labels=dict(labels),
                rm=True,
                forcerm=True,
                nocache=nocache,
                decode=True,
            ):
                if "stream" in chunk:
                    yield str(chunk["stream"])
                elif "status" in chunk:
                    yield f"{chunk['status']}\n"
                elif "error" in chunk:
                    raise ImageBuildError(str(chunk["error"]).strip())
        except (BuildError, DockerException) as exc:
            raise ImageBuildError(str(exc)) from exc
