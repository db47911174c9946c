"""A session's kernel on a sandbox gateway (``jupyter sandbox-kernel gateway``), for programs
on a machine without Docker: the session API, ``jupyter sandbox-kernel mcp --gateway-url`` and
``jupyter sandbox-kernel run --gateway-url``.

The gateway is named by :class:`GatewaySettings`: ``gateway_url=``, ``gateway_token=`` and
``ca_certs=`` where given, else the environment variables jupyter_server's ``GatewayClient``
reads (``JUPYTER_GATEWAY_URL``, ``JUPYTER_GATEWAY_AUTH_TOKEN``, ``JUPYTER_GATEWAY_CA_CERTS``).
``GatewayClient`` is one per process, so the kernels of one process are on one gateway, as
one user (a second gateway or token is refused while the first has kernels here).

The kernel is started by :class:`SessionGatewayKernelManager` (its client is the client part's
:class:`~sandbox_kernel.jupyter.gateway_client.SandboxGatewayKernelClient`, which carries the
token and verifies the gateway's certificate); what a local session asks of its provisioner
goes to the owner's REST routes of the gateway (``/api/sandbox-kernel/kernels/<id>/...``, see
:mod:`sandbox_kernel.gateway.handlers`) through :class:`GatewayKernel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import time
from typing import Any
from urllib.parse import urlencode

from jupyter_server.gateway.gateway_client import GatewayClient, gateway_request
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.escape import json_decode, json_encode, url_escape
from tornado.httpclient import HTTPClientError
from traitlets import DottedObjectName, Type

from sandbox_kernel.agents.files import DEFAULT_MAX_BYTES, FileInfo
from sandbox_kernel.agents.gateway_settings import GatewaySettings
from sandbox_kernel.errors import (
    ConfigurationError,
    FileTooLargeError,
    FolderNotEmptyError,
    KernelNotFoundError,
    KernelStartupError,
    MissingFileError,
    PauseError,
    SandboxKernelError,
    WorkspaceError,
)
from sandbox_kernel.jupyter.gateway_client import (
    SandboxGatewayKernelClient,
    SandboxGatewayKernelManager,
    honour_ca_certs,
)
from sandbox_kernel.lifecycle.pausing import Paused

#: The owner's routes on a kernel, under the gateway's base URL.
SANDBOX_KERNELS = "api/sandbox-kernel/kernels"
#: Seconds a REST call to the gateway may take (a pause saves the kernel's memory to disk).
REQUEST_TIMEOUT = 120.0
#: Seconds between a waiting read's checks that the connection to the gateway still runs.
ROUTER_CHECK = 1.0


#: The settings GatewayClient was given for this process's gateway sessions, and how many hold it.
_in_use: list[Any] = [None, 0]


def use_gateway(settings: GatewaySettings) -> None:
    """Point this process's ``GatewayClient`` at ``settings``' gateway, for one more session
    (:func:`release_gateway` when it ends).

    Raises:
        ConfigurationError: sessions of this process use another gateway or token now.
    """
    held, count = _in_use
    if count and held != settings:
        msg = (
            f"this process's kernels are on the gateway {held.url} (with its token) now: one process "
            "uses one gateway as one user; shut those sessions down first, or use another process"
        )
        raise ConfigurationError(msg)
    client = GatewayClient.instance()
    client.url, client.ws_url = settings.url, settings.ws_url
    client.auth_token = settings.token or ""
    client.ca_certs = settings.ca_certs
    client.init_connection_args()  # type: ignore[no-untyped-call]  # untyped upstream
    honour_ca_certs(client)
    _in_use[:] = [settings, count + 1]


def release_gateway() -> None:
    """One session less on this process's gateway; after the last, the process is in
    gateway mode no more (jupyter_server's ``GatewayClient`` is process-wide: a Jupyter
    server this process started later would take its kernels from the gateway)."""
    _in_use[1] = max(0, _in_use[1] - 1)
    if _in_use[1] == 0:
        GatewayClient.clear_instance()


class SessionGatewayKernelClient(SandboxGatewayKernelClient):
    """The client part's kernel client, whose reads wait for the gateway's messages rather than
    poll for them, and whose messages name their channel.

    jupyter_server 2.21.1 ``gateway/managers.py`` ``ChannelQueue._async_get`` loops on
    ``asyncio.sleep(0)`` until a message comes (a core kept busy the whole time a cell runs,
    which on a small host slows the very kernel it waits for), and ``get_msg`` without a
    timeout gives up after 1 s (``queue.Empty``), where jupyter_client's clients wait; and
    ``ChannelQueue.send`` sends no ``channel``, so the gateway's server puts every message on
    shell (an ``input_reply``, a control request too)."""

    async def start_channels(  # type: ignore[override]  # async upstream too
        self,
        shell: bool = True,
        iopub: bool = True,
        stdin: bool = True,
        hb: bool = True,
        control: bool = True,
    ) -> None:
        """Connect as the client part does, then have each channel's arrivals wake its readers."""
        await super().start_channels(shell=shell, iopub=iopub, stdin=stdin, hb=hb, control=control)
        loop = asyncio.get_running_loop()
        self._arrived: dict[str, asyncio.Event] = {}
        for name, channel in (self._channel_queues or {}).items():
            arrived = asyncio.Event()
            self._arrived[name] = arrived
            put, send = channel.put_nowait, channel.send

            def put_and_wake(message: Any, put: Any = put, arrived: asyncio.Event = arrived) -> None:
                put(message)  # in the router's thread
                loop.call_soon_threadsafe(arrived.set)

            def send_on(message: dict[str, Any], send: Any = send, name: str = name) -> None:
                send({**message, "channel": name})

            channel.put_nowait = put_and_wake  # type: ignore[method-assign,assignment]
            channel.send = send_on  # type: ignore[method-assign,assignment]

    async def _next(self, name: str, timeout: float | None) -> dict[str, Any]:
        """The next message on channel ``name``, waited for ``timeout`` s at most (None: no limit).

        Raises:
            queue.Empty: none came within ``timeout``.
            RuntimeError: the connection to the gateway ended.
        """
        channel = getattr(self, f"{name}_channel")
        arrived = self._arrived[name]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                message: dict[str, Any] = channel.get(block=False)
            except queue.Empty:
                pass
            else:
                channel.task_done()
                return message
            if channel.response_router_finished:
                msg = "the connection to the sandbox gateway ended"
                raise RuntimeError(msg)
            arrived.clear()
            if not channel.empty():
                continue
            left = ROUTER_CHECK if deadline is None else min(ROUTER_CHECK, deadline - time.monotonic())
            if left <= 0:
                raise queue.Empty
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(arrived.wait(), left)

    async def get_shell_msg(self, timeout: float | None = None) -> dict[str, Any]:
        return await self._next("shell", timeout)

    async def get_iopub_msg(self, timeout: float | None = None) -> dict[str, Any]:
        return await self._next("iopub", timeout)

    async def get_stdin_msg(self, timeout: float | None = None) -> dict[str, Any]:
        return await self._next("stdin", timeout)

    async def get_control_msg(self, timeout: float | None = None) -> dict[str, Any]:
        return await self._next("control", timeout)


class SessionGatewayKernelManager(SandboxGatewayKernelManager):
    """The client part's kernel manager for programs, whose start also narrows the kernel's
    policy: the POST's ``"sandbox"`` object, which the gateway reads as ``start_kernel(memory=...)``
    does (``memory``, ``network``...; a wider value is its 400). None of this program's
    environment is sent (the stock manager sends every ``KERNEL_*`` variable; the gateway uses
    none of them but the folder). Its client is a :class:`SessionGatewayKernelClient`."""

    client_class = DottedObjectName(f"{__name__}.SessionGatewayKernelClient")
    client_factory = Type(klass=f"{__name__}.SessionGatewayKernelClient")

    async def start_kernel(self, **kwargs: Any) -> None:  # type: ignore[override]  # async upstream too
        """Start a kernel of ``kernel_name`` in ``cwd`` on the gateway, narrowed by ``sandbox``;
        or, with ``kernel_id``, take that kernel of this user's.

        Raises:
            KernelNotFoundError: the gateway has no kernel ``kernel_id`` of this user's.
            ConfigurationError: the gateway refused the kernelspec or the narrowing.
            KernelStartupError: the gateway refused the start (the folder, the user's
                number of kernels) or the kernel did not start.
        """
        kernel_id = kwargs.get("kernel_id")
        if kernel_id is not None:
            try:
                await super().start_kernel(kernel_id=kernel_id)
            except web.HTTPError as exc:
                if exc.status_code in (403, 404):
                    msg = f"the sandbox gateway has no kernel {kernel_id} of yours ({_said(exc)})"
                    raise KernelNotFoundError(msg) from None
                raise _gateway_error(exc, "reattaching to the kernel") from None
            if self.kernel is None:
                msg = f"the sandbox gateway has no kernel {kernel_id} of yours"
                raise KernelNotFoundError(msg)
            return
        body: dict[str, Any] = {"name": kwargs.get("kernel_name", self.kernel_name), "env": {}}
        if kwargs.get("cwd"):
            body["env"]["KERNEL_WORKING_DIR"] = str(kwargs["cwd"])
        narrowing = dict(kwargs.get("sandbox") or {})
        if narrowing:
            body["sandbox"] = narrowing
        try:
            response = await gateway_request(
                self.kernels_url,
                method="POST",
                headers={"Content-Type": "application/json"},
                body=json_encode(body),
                request_timeout=GatewayClient.instance().request_timeout,
            )
        except web.HTTPError as exc:
            said = _said(exc)
            msg = f"the sandbox gateway refused the kernel: {said}"
            if exc.status_code in (400, 404):
                raise ConfigurationError(msg) from None
            if exc.status_code == 403:
                raise KernelStartupError(msg) from None
            raise _gateway_error(exc, "starting the kernel") from None
        self.kernel = json_decode(response.body)
        self.kernel_id = self.kernel["id"]
        self.kernel_url = url_path_join(self.kernels_url, url_escape(str(self.kernel_id)))


class GatewayKernel:
    """The owner's REST routes on one kernel of the gateway (see :mod:`sandbox_kernel.gateway.handlers`)."""

    def __init__(self, kernel_id: str) -> None:
        self.kernel_id = kernel_id

    async def _call(self, route: str, method: str = "GET", body: bytes | None = None, **query: str) -> Any:
        """The body of the gateway's answer to ``method`` on the kernel's ``route``.

        Raises:
            HTTPError: as ``gateway_request`` raises it (its cause has the gateway's answer).
        """
        client = GatewayClient.instance()
        url = url_path_join(client.url or "", SANDBOX_KERNELS, url_escape(self.kernel_id))
        url = url_path_join(url, route) if route else url
        if query:
            url = f"{url}?{urlencode(query)}"
        if body is None and method in ("POST", "PUT"):
            body = b"{}"
        response = await gateway_request(url, method=method, body=body, request_timeout=REQUEST_TIMEOUT)
        return response.body

    async def status(self) -> dict[str, Any]:
        """The kernel status route's answer (the status bar's: policy, memory, state)."""
        try:
            return dict(json.loads(await self._call("")))
        except web.HTTPError as exc:
            raise _gateway_error(exc, "reading the kernel's status") from None

    async def usage(self) -> dict[str, Any]:
        """``{"state", "cpu_seconds", "memory": {"used", "peak", "limit"}}`` of the sandbox."""
        try:
            return dict(json.loads(await self._call("usage")))
        except web.HTTPError as exc:
            raise _gateway_error(exc, "reading the kernel's usage") from None

    async def pause(self) -> Paused:
        """Pause the kernel on the gateway.

        Raises:
            PauseError: it could not be paused now (it runs on).
        """
        answer = await self._sleep("pause")
        paused = Paused.from_dict(answer.get("paused"))
        if paused is None:
            msg = f"the sandbox gateway did not pause kernel {self.kernel_id} (state {answer.get('state')!r})"
            raise PauseError(msg)
        return paused

    async def resume(self) -> None:
        await self._sleep("resume")

    async def _sleep(self, action: str) -> dict[str, Any]:
        try:
            return dict(json.loads(await self._call(action, "POST")))
        except web.HTTPError as exc:
            if exc.status_code == 409:
                msg = f"Kernel {self.kernel_id}: {_said(exc)}"
                raise PauseError(msg) from None
            raise _gateway_error(exc, f"{action.rstrip('e')}ing the kernel") from None

    # -- the workspace's files

    async def upload(self, path: str, data: bytes | str) -> str:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        answer = await self._files("files", "PUT", raw, path=path)
        return str(json.loads(answer)["path"])

    async def download(self, path: str, max_bytes: int | None = None) -> bytes:
        data: bytes = await self._files("files", "GET", None, path=path)
        limit = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
        if len(data) > limit:
            msg = f"{path} is {len(data)} bytes, over the {limit} asked for at most"
            raise FileTooLargeError(msg, len(data), limit)
        return data

    async def list(self, path: str = ".") -> list[FileInfo]:
        answer = json.loads(await self._files("files/list", "GET", None, path=path))
        return [
            FileInfo(
                name=entry["name"],
                path=entry["path"],
                size=int(entry["size"]),
                is_dir=bool(entry["is_dir"]),
                modified=float(entry["modified"]),
                undecodable=bool(entry.get("undecodable")),
            )
            for entry in answer["files"]
        ]

    async def delete(self, path: str, recursive: bool = False) -> None:
        await self._files("files", "DELETE", None, path=path, recursive=str(recursive).lower())

    async def _files(self, route: str, method: str, body: bytes | None, **query: str) -> Any:
        """A files route's answer, its refusals as the local files API raises them.

        Raises:
            WorkspaceError: the path was refused (MissingFileError, FolderNotEmptyError,
                FileTooLargeError, as their kinds).
            SandboxKernelError: the gateway has no files routes (an older one), or failed.
        """
        try:
            return await self._call(route, method, body, **query)
        except web.HTTPError as exc:
            said = _said(exc)
            if exc.status_code == 404 and _plain_404(exc):
                msg = (
                    "the sandbox gateway serves no files routes (api/sandbox-kernel/kernels/<id>/files): "
                    "it is older than this client; upgrade sandbox-kernel on the gateway"
                )
                raise SandboxKernelError(msg) from None
            if exc.status_code == 413:
                raise FileTooLargeError(said, DEFAULT_MAX_BYTES + 1, DEFAULT_MAX_BYTES) from None
            kind = {404: MissingFileError, 409: FolderNotEmptyError, 400: WorkspaceError}
            if exc.status_code in kind:
                raise kind[exc.status_code](said) from None
            raise _gateway_error(exc, "reaching the kernel's files") from None


def _said(exc: web.HTTPError) -> str:
    """What the gateway said in refusing (its JSON ``message``), else the HTTP reason."""
    cause = exc.__cause__
    if isinstance(cause, HTTPClientError) and cause.response is not None:
        try:
            payload = json.loads(cause.response.body)
        except (ValueError, TypeError):
            payload = None
        if isinstance(payload, dict) and payload.get("message"):
            return str(payload["message"])
        return str(cause.message or f"HTTP {cause.code}")
    if exc.args:
        return str(exc.log_message % exc.args) if exc.log_message else str(exc)
    return str(exc.log_message or exc.reason or f"HTTP {exc.status_code}")


def _plain_404(exc: web.HTTPError) -> bool:
    """Whether a 404 is the server's for a route it does not serve (not a handler's refusal)."""
    cause = exc.__cause__
    if not isinstance(cause, HTTPClientError) or cause.response is None:
        return False
    try:
        payload = json.loads(cause.response.body)
    except (ValueError, TypeError):
        return True
    return not (isinstance(payload, dict) and payload.get("message"))


def _gateway_error(exc: web.HTTPError, doing: str) -> SandboxKernelError:
    """One line on a gateway call that failed (unreachable: 503/599; refused; failed)."""
    return SandboxKernelError(f"the sandbox gateway failed {doing} (HTTP {exc.status_code}): {_said(exc)}")
