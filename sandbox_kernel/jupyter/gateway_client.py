"""What a user's Jupyter server needs to use a sandbox gateway: the client part.

A user's server started with ``--gateway-url`` (no Docker, no root) runs its kernels on a
sandbox gateway (``jupyter sandbox-kernel gateway``) through jupyter_server's gateway
classes. Those (jupyter_server 2.21.1, ``jupyter_server/gateway/``) get in the way of
sandboxed kernels in several places, and this module puts each right:

- :class:`SandboxGatewayWebSocketConnection`: a kernel message with binary buffers (what
  ipywidgets, ipympl and FileUpload send) passes in both directions as a binary frame; the
  stock class decodes the gateway's binary frames as UTF-8, which kills the relay, and sends
  the browser's as text, which the gateway drops (ipywidgets#3798). When the gateway is lost
  for good (``GatewayClient.gateway_retry_max`` redials failed) or refuses the connection
  (401/403/404), the browser's socket is closed with code 1011 and a one-line reason, where the
  stock class leaves it open and silent (see :mod:`~.gateway_link`). What the browser sends
  while the gateway is being redialled is held, and sent once it answers.
- :func:`honour_ca_certs`: ``GatewayClient.ca_certs`` is used without a client certificate
  too (the stock ``init_connection_args`` uses it only with ``client_cert``).
- :class:`GatewayKernelStatusHandler`: ``GET /api/sandbox-kernel/kernels/<kernel_id>`` asks the
  gateway (the kernel and its sandbox are there); a gateway that does not answer gives
  ``{"sandboxed": true, "gateway": {"reachable": false, "url": ..., "reason": ...}}``.
- :class:`SandboxGatewayMappingKernelManager`: a restarted server takes back the kernels the
  gateway lists (a sandbox gateway lists only the caller's), and a stopping one lets go of
  persistent kernels and does not hang while the gateway is down.
- :class:`SandboxGatewayKernelManager` and :class:`SandboxGatewayKernelClient`, for programs
  (nbclient, papermill): the kernel's websocket carries the auth header and verifies the
  gateway's certificate, and a kernel message with buffers no longer ends the client's reads,
  so ``NotebookClient(nb, km=SandboxGatewayKernelManager(kernel_name=...))`` runs against an
  authenticated gateway.

The package's server extension (:mod:`~.lab`) puts the connection class, the CA fix and the
status route in place when gateway mode is on. The kernel manager is configured::

    c.ServerApp.kernel_manager_class = (
        "sandbox_kernel.jupyter.gateway_client.SandboxGatewayMappingKernelManager"
    )
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from threading import Thread
from typing import Any, cast

import websocket
from jupyter_core.utils import ensure_async
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.gateway.connections import GatewayWebSocketConnection
from jupyter_server.gateway.gateway_client import GatewayClient, gateway_request
from jupyter_server.gateway.managers import (
    GatewayKernelClient,
    GatewayKernelManager,
    GatewayMappingKernelManager,
)
from jupyter_server.serverapp import ServerApp
from jupyter_server.services.kernels.connection.base import deserialize_binary_message
from jupyter_server.utils import url_path_join
from tornado import web
from tornado import websocket as tornado_websocket
from tornado.concurrent import Future
from tornado.escape import json_decode, url_escape
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.ioloop import IOLoop
from traitlets import Bool, DottedObjectName, Float, Type, default

from sandbox_kernel.jupyter.gateway_link import CLOSE_CODE, GatewayLink, GiveUp, Redial
from sandbox_kernel.jupyter.server import SandboxMappingKernelManager, before_serving

#: The key of a gateway's kernel model that says how the gateway keeps the kernel:
#: ``{"sandbox": {"lifecycle": "persistent"}}`` for a kernel that outlives its clients
#: (the user's server lets go of it when stopping); anything else, or none, is ephemeral.
SANDBOX_MODEL_KEY = "sandbox"
#: The gateway's kernel status route, under its base URL (``jupyter/lab.py``'s ``KERNEL_STATUS_PATH``).
STATUS_ENDPOINT = "api/sandbox-kernel/kernels"
#: HTTP answers (``gateway_request``'s, 599 being tornado's for no answer) that mean the gateway
#: cannot be reached, rather than that it refused.
UNREACHABLE = frozenset({502, 503, 504, 599})
#: Seconds the status route waits for the gateway (GatewayClient's own request timeout, 42 s by
#: default, is sized for starting kernels): JupyterLab's status bar asks again soon.
STATUS_WAIT = 10.0
#: Browser messages a kernel's relay holds at most while it dials the gateway (then the oldest go).
MAX_HELD = 1000


def lifecycle(model: dict[str, Any] | None) -> str | None:
    """How the gateway keeps the kernel of ``model`` ("persistent", "ephemeral"), if it says."""
    sandbox = (model or {}).get(SANDBOX_MODEL_KEY)
    value = sandbox.get("lifecycle") if isinstance(sandbox, dict) else None
    return str(value) if value is not None else None


def honour_ca_certs(client: GatewayClient) -> bool:
    """Verify the gateway against ``client.ca_certs`` even without a client certificate; True if
    that took a change.

    jupyter_server 2.21.1 ``gateway/gateway_client.py`` ``init_connection_args`` puts ``ca_certs``
    into the request arguments only inside ``if self.client_cert:``, so a CA-only setup (the
    usual one: TLS to a gateway on another machine) fails with CERTIFICATE_VERIFY_FAILED.
    ``_connection_args`` is private, hence the unit test pinning it.
    """
    if not client.gateway_enabled or not client.ca_certs or client.client_cert:
        return False
    if not client._connection_args:
        client.init_connection_args()  # type: ignore[no-untyped-call]  # untyped upstream
    if client._connection_args.get("ca_certs") == client.ca_certs:
        return False
    client._connection_args["ca_certs"] = client.ca_certs
    return True


def _reason(exc: BaseException) -> str:
    """One line on why a gateway request failed (the cause ``gateway_request`` wrapped, if any)."""
    cause = exc.__cause__ or exc
    if isinstance(cause, web.HTTPError) and cause.log_message:
        text = str(cause.log_message % cause.args if cause.args else cause.log_message)
    else:
        text = str(cause)
    return text.strip().splitlines()[0] if text.strip() else type(cause).__name__


class SandboxGatewayWebSocketConnection(GatewayWebSocketConnection):
    """A kernel websocket relayed to the gateway: binary frames stay binary both ways, and the
    browser's socket is closed (1011, with a reason) once the gateway is lost for good."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        client = GatewayClient.instance()
        self._held: deque[str | bytes] = deque(maxlen=MAX_HELD)
        self._link = GatewayLink(
            client.gateway_retry_max, client.gateway_retry_interval, client.gateway_retry_interval_max
        )

    async def connect(self) -> None:
        """Dial the gateway's websocket of this kernel; what follows runs on the loop."""
        client = GatewayClient.instance()
        url = url_path_join(
            client.ws_url or "", client.kernels_endpoint, url_escape(self.kernel_id), "channels"
        )
        if self.session_id:
            url += f"?session_id={url_escape(self.session_id)}"
        self.ws = None
        self.log.info("Connecting to %s", url)
        request = HTTPRequest(url, **client.load_connection_args())  # type: ignore[no-untyped-call]
        dialling = cast("Future[Any]", tornado_websocket.websocket_connect(request))
        self.ws_future = dialling
        IOLoop.current().add_future(dialling, self._dialled)

    def _dialled(self, future: Future[Any]) -> None:
        if future.cancelled():  # (nothing here cancels a dial: see disconnect)
            return
        exc = future.exception()
        if self.disconnected:
            if exc is None:
                future.result().close()
            return
        if exc is None:
            self.ws = future.result()
            self.retry = 0
            self._link.dialled()
            held = list(self._held)
            self._held.clear()
            for message in held:
                self._write_message(message)
            IOLoop.current().spawn_callback(self._relay)
            return
        status = exc.code if isinstance(exc, HTTPClientError) else None
        self.log.warning("Cannot connect to the sandbox gateway for kernel %s: %s", self.kernel_id, exc)
        IOLoop.current().spawn_callback(self._lost, status)

    async def _relay(self) -> None:
        """Pass the gateway's frames on to the browser until the connection drops."""
        ws = self.ws
        while ws is not None and not self.disconnected:
            try:
                message = await ws.read_message()
            except Exception as exc:  # noqa: BLE001  # whatever broke the read, the connection is lost
                self.log.error("Reading from the sandbox gateway for kernel %s: %s", self.kernel_id, exc)
                message = None
            if message is None:
                break
            self.handle_outgoing_message(message)
        self.ws = None
        if not self.disconnected:
            self.log.warning("Lost the connection to the sandbox gateway for kernel %s", self.kernel_id)
            await self._lost(None)

    async def _lost(self, status: int | None) -> None:
        step = self._link.lost(status)
        if isinstance(step, Redial):
            self.retry = step.attempt
            self.log.info(
                "Reconnecting to the sandbox gateway in %.1f s (%d/%d): %s",
                step.delay,
                step.attempt,
                self._link.retry_max,
                self.kernel_id,
            )
            await asyncio.sleep(step.delay)
            if self._link.wait_over() and not self.disconnected:
                await self.connect()
        elif isinstance(step, GiveUp):
            self._held.clear()
            self.log.warning(
                "Closing the browser's socket of kernel %s: %s (%s)",
                self.kernel_id,
                step.reason,
                GatewayClient.instance().url,
            )
            self.websocket_handler.close(CLOSE_CODE, step.reason)

    def disconnect(self) -> None:  # type: ignore[override]  # sync upstream, as here
        """The browser's socket closed: close the gateway's, and never dial again.

        A dial under way is left to finish, and :meth:`_dialled` closes what it brings. The
        stock ``disconnect`` cancels it instead, which does not stop it: tornado's
        ``websocket_connect`` completes the handshake all the same, does not hand over the
        connection of a cancelled future, and keeps it open for ever (its frame loop answers
        the gateway's pings), so the gateway would keep a second client of this session.
        """
        self.disconnected = True
        self._link.close()
        if self.ws is not None:
            self.ws.close()

    def handle_outgoing_message(self, incoming_msg: str | bytes, *args: Any) -> None:
        """Send the gateway's frame to the browser, binary if it came binary."""
        try:
            self.websocket_handler.write_message(incoming_msg, binary=isinstance(incoming_msg, bytes))
        except tornado_websocket.WebSocketClosedError:
            self.log.debug("The browser closed the socket of kernel %s: a message is dropped", self.kernel_id)

    def handle_incoming_message(self, message: str | bytes) -> None:
        """Send the browser's frame to the gateway, binary if it came binary; while the gateway is
        being dialled, hold it (as JupyterLab holds messages while its own socket reconnects)."""
        if self.ws is not None:
            self._write_message(message)
        elif self._link.state in ("dialling", "waiting"):
            self._hold(message)
        else:
            self.log.warning(
                "No connection to the sandbox gateway: dropped a message to kernel %s", self.kernel_id
            )

    def _hold(self, message: str | bytes) -> None:
        if len(self._held) == self._held.maxlen:
            self.log.warning("Holding too many messages for kernel %s: dropped the oldest", self.kernel_id)
        self._held.append(message)

    def _write_message(self, message: str | bytes) -> None:
        if self.disconnected or self.ws is None:
            return
        try:
            self.ws.write_message(message, binary=isinstance(message, bytes))
        except tornado_websocket.WebSocketClosedError:  # lost: the relay redials, then sends it
            self._hold(message)


async def gateway_status(kernel_id: str) -> dict[str, Any]:
    """The gateway's answer to ``GET /api/sandbox-kernel/kernels/<kernel_id>``, or, when the gateway
    cannot be reached, ``{"sandboxed": true, "gateway": {"reachable": false, "url", "reason"}}``.

    Raises:
        HTTPError: what the gateway answered otherwise (404 for a kernel it does not have or
            that is not the caller's, 403 ...).
    """
    client = GatewayClient.instance()
    url = url_path_join(client.url or "", STATUS_ENDPOINT, url_escape(kernel_id))
    try:
        response = await asyncio.wait_for(gateway_request(url, method="GET"), STATUS_WAIT)
    except web.HTTPError as exc:
        if exc.status_code not in UNREACHABLE:
            raise
        reason = _reason(exc)
    except asyncio.TimeoutError:
        reason = f"no answer within {STATUS_WAIT:g} s"
    except OSError as exc:  # TLS (a certificate it cannot verify), name resolution ...
        reason = _reason(exc)
    else:
        answer: dict[str, Any] = json_decode(response.body)
        return answer
    return {"sandboxed": True, "gateway": {"reachable": False, "url": client.url, "reason": reason}}


class GatewayKernelStatusHandler(APIHandler):
    """``GET /api/sandbox-kernel/kernels/<kernel_id>`` on a server whose kernels run on a sandbox
    gateway: the gateway's answer (see :func:`gateway_status`)."""

    auth_resource = "kernels"

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        """Answer with the sandbox of kernel ``kernel_id``, as the gateway describes it."""
        self.finish(await gateway_status(kernel_id))


class SandboxGatewayMappingKernelManager(GatewayMappingKernelManager):
    """jupyter_server's gateway kernel manager, for a user's server on a sandbox gateway: a
    restarted server finds its kernels again, and a stopping one lets go of persistent kernels
    and stops even while the gateway is down."""

    relist_kernels = Bool(
        True,
        config=True,
        help="""At start, take back the kernels the sandbox gateway lists (it lists only this
        user's), so notebooks find their kernels after a restart of this server.""",
    )
    keep_sessions = Bool(
        True,
        config=True,
        help="""Keep the server's sessions in a file (unless SessionManager.database_filepath
        is set), so a notebook's session still names its kernel after a restart.""",
    )
    gateway_wait = Float(
        10.0,
        config=True,
        help="""Seconds to wait for the sandbox gateway when this server starts (listing its
        kernels) and stops (shutting kernels down) before going on without it.""",
    )

    @default("kernel_manager_class")
    def _default_kernel_manager_class(self) -> str:
        return "sandbox_kernel.jupyter.gateway_client.SandboxGatewayKernelManager"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]  # untyped upstream
        # GatewayMappingKernelManager (jupyter_server 2.21.1 gateway/managers.py) keeps its
        # kernels in a dict on the class, shared by every instance: give this one its own.
        self._kernels = {}
        honour_ca_certs(GatewayClient.instance())  # the listing below is the first request
        if self.keep_sessions:
            SandboxMappingKernelManager._keep_sessions_in_a_file(self)  # type: ignore[arg-type]  # reads parent, root_dir
        if self.relist_kernels:
            self._before_serving()

    def _before_serving(self) -> None:
        """List the gateway's kernels before the server serves a request (the first session
        listing would drop the sessions of kernels not yet known), on the loop it will serve
        on: ServerApp creates that loop before this manager and runs it after ``initialize``."""
        self._relisting = before_serving(self, self.take_back_kernels)

    async def take_back_kernels(self) -> list[str]:
        """Manage every kernel the gateway lists that this server does not know yet; their ids.

        Only kernels whose model has :data:`SANDBOX_MODEL_KEY` are taken: a sandbox gateway lists
        only the caller's kernels, while another gateway (Enterprise Gateway, Kernel Gateway) lists
        everyone's, which this server would then shut down when it stops. A gateway that does not
        answer within ``gateway_wait`` is logged: the server starts anyway."""
        try:
            response = await asyncio.wait_for(
                gateway_request(self.kernels_url, method="GET"), self.gateway_wait
            )
        except (web.HTTPError, OSError, asyncio.TimeoutError) as exc:
            self.log.warning(
                "sandbox-kernel: cannot list the kernels on the sandbox gateway at %s: %s",
                GatewayClient.instance().url,
                _reason(exc),
            )
            return []
        taken = []
        for model in json_decode(response.body):
            kernel_id = str(model.get("id", ""))
            if not kernel_id or kernel_id in self._kernels or SANDBOX_MODEL_KEY not in model:
                continue
            km = self.kernel_manager_factory(parent=self, log=self.log)
            km.kernel_id = kernel_id
            km.kernel_url = url_path_join(self.kernels_url, url_escape(kernel_id))
            await km.refresh_model(model)
            self._kernels[kernel_id] = km
            taken.append(kernel_id)
        if taken:
            self.log.info(
                "sandbox-kernel: took back %d kernel(s) on the sandbox gateway: %s",
                len(taken),
                ", ".join(taken),
            )
            if not self._initialized_culler:
                self.initialize_culler()  # type: ignore[no-untyped-call]  # untyped upstream
        return taken

    async def shutdown_all(self, now: bool = False) -> None:  # type: ignore[override]  # async upstream too
        """The server is stopping: let go of the kernels the gateway keeps (persistent), shut the
        others down. A gateway that fails or does not answer within ``gateway_wait`` is given up
        on (logged), so the server still stops."""
        for kernel_id, km in list(self._kernels.items()):
            if lifecycle(km.kernel) == "persistent":
                self.remove_kernel(kernel_id)  # type: ignore[no-untyped-call]  # untyped upstream
                self.log.info(
                    "sandbox-kernel: leaving persistent kernel %s running on the sandbox gateway", kernel_id
                )
        kernel_ids = list(self._kernels)

        async def shut_down(kernel_id: str) -> None:
            try:
                await self.shutdown_kernel(kernel_id, now=now)  # type: ignore[no-untyped-call]
            except (web.HTTPError, OSError) as exc:
                self.log.warning(
                    "sandbox-kernel: cannot shut kernel %s down on the sandbox gateway: %s",
                    kernel_id,
                    _reason(exc),
                )

        try:
            await asyncio.wait_for(asyncio.gather(*(shut_down(k) for k in kernel_ids)), self.gateway_wait)
        except asyncio.TimeoutError:
            self.log.warning(
                "sandbox-kernel: the sandbox gateway at %s did not answer within %s s: stopping without it",
                GatewayClient.instance().url,
                self.gateway_wait,
            )
        for kernel_id in kernel_ids:
            self.remove_kernel(kernel_id)  # type: ignore[no-untyped-call]  # untyped upstream


class SandboxGatewayKernelClient(GatewayKernelClient):
    """jupyter_server's gateway kernel client, whose websocket an authenticated gateway accepts:
    it sends the auth header (and other headers of ``GatewayClient``) and verifies the gateway's
    certificate. jupyter_server 2.21.1 ``gateway/managers.py`` ``GatewayKernelClient.start_channels``
    sends no header (the gateway answers 403) and verifies no certificate (``sslopt`` without
    ``cert_reqs``)."""

    async def start_channels(  # type: ignore[override]  # async upstream too
        self,
        shell: bool = True,
        iopub: bool = True,
        stdin: bool = True,
        hb: bool = True,
        control: bool = True,
    ) -> None:
        """Connect the kernel's websocket on the gateway and start its channels."""
        client = GatewayClient.instance()
        url = url_path_join(
            client.ws_url or "", client.kernels_endpoint, url_escape(self.kernel_id), "channels"
        )
        headers = dict(client.load_connection_args().get("headers") or {})  # type: ignore[no-untyped-call]
        if client.auth_token:
            headers.setdefault(
                client.auth_header_key, f"{client.auth_scheme or ''} {client.auth_token}".strip()
            )
        self.channel_socket = await asyncio.to_thread(
            websocket.create_connection,
            url,
            timeout=client.KERNEL_LAUNCH_TIMEOUT,
            enable_multithread=True,
            header=[f"{key}: {value}" for key, value in headers.items()],
            sslopt=channel_sslopt(client),
        )
        # The timeout is for connecting: a cell quiet longer must not end the router's reads.
        self.channel_socket.settimeout(None)
        # What GatewayKernelClient.start_channels does after connecting.
        await ensure_async(
            super(GatewayKernelClient, self).start_channels(
                shell=shell, iopub=iopub, stdin=stdin, hb=hb, control=control
            )
        )
        self.response_router = Thread(target=self._route_responses, daemon=True)
        self.response_router.start()

    def _route_responses(self) -> None:
        """Put each message from the gateway on its channel's queue until the channels stop.

        GatewayKernelClient's router (jupyter_server 2.21.1 ``gateway/managers.py``) decodes every
        frame as JSON text, so the first binary one (a message with buffers: a widget's image,
        say) ends it and the client waits for replies that never come.
        """
        queues, ws = self._channel_queues, self.channel_socket
        if queues is None or ws is None:
            return
        try:
            while not self._channels_stopped:
                frame = ws.recv()
                if not frame:
                    break
                if isinstance(frame, bytes):
                    message = deserialize_binary_message(frame)  # type: ignore[no-untyped-call]
                else:
                    message = json_decode(frame)
                queues[message["channel"]].put_nowait(message)
        except websocket.WebSocketConnectionClosedException:
            pass  # the channels stopped
        except Exception as exc:  # noqa: BLE001  # the thread must end telling the queues
            if not self._channels_stopped:
                self.log.warning("Reading the sandbox gateway's kernel messages stopped: %s", exc)
        for queue in queues.values():
            queue.response_router_finished = True


def channel_sslopt(client: GatewayClient) -> dict[str, Any]:
    """websocket-client's ``sslopt`` for ``client``'s TLS settings: verify the gateway's certificate
    (against ``ca_certs`` if set) unless ``validate_cert`` is off; a client certificate if set."""
    if not client.validate_cert:
        return {"cert_reqs": ssl.CERT_NONE, "check_hostname": False}
    options: dict[str, Any] = {"cert_reqs": ssl.CERT_REQUIRED}
    if client.ca_certs:
        options["ca_certs"] = client.ca_certs
    if client.client_cert:
        options["certfile"] = client.client_cert
        options["keyfile"] = client.client_key
    return options


class SandboxGatewayKernelManager(GatewayKernelManager):
    """One kernel on a sandbox gateway, for programs (nbclient, papermill)::

        NotebookClient(nb, km=SandboxGatewayKernelManager(kernel_name="sandboxed-python")).execute()

    with the gateway in ``GatewayClient`` (``JUPYTER_GATEWAY_URL``, ``JUPYTER_GATEWAY_AUTH_TOKEN``,
    ``JUPYTER_GATEWAY_CA_CERTS``). Its client is a :class:`SandboxGatewayKernelClient`.
    """

    client_class = DottedObjectName("sandbox_kernel.jupyter.gateway_client.SandboxGatewayKernelClient")
    client_factory = Type(klass="sandbox_kernel.jupyter.gateway_client.SandboxGatewayKernelClient")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]  # untyped upstream
        honour_ca_certs(GatewayClient.instance())

    async def start_kernel(self, **kwargs: Any) -> None:  # type: ignore[override]  # async upstream too
        """Start a kernel of ``kernel_name`` on the gateway (or take ``kernel_id``'s)."""
        # GatewayKernelManager.start_kernel (jupyter_server 2.21.1 gateway/managers.py) takes the
        # name from its arguments only, "python3" otherwise: nbclient passes none.
        kwargs.setdefault("kernel_name", self.kernel_name)
        await super().start_kernel(**kwargs)


def use_gateway_client(serverapp: ServerApp) -> None:
    """Put the client part in place on ``serverapp``, whose kernels run on a gateway: the CA fix
    and, unless another class was configured, the relaying connection class. The kernel status
    route is :mod:`~.lab`'s to register."""
    log = serverapp.log
    if honour_ca_certs(serverapp.gateway_config):
        log.info(
            "sandbox-kernel: the sandbox gateway's certificate is verified against %s",
            serverapp.gateway_config.ca_certs,
        )
    settings = serverapp.web_app.settings
    if settings.get("kernel_websocket_connection_class") is GatewayWebSocketConnection:
        settings["kernel_websocket_connection_class"] = SandboxGatewayWebSocketConnection
        log.info("sandbox-kernel: kernel websockets are relayed to the sandbox gateway binary-safe")
    manager = serverapp.kernel_manager
    if not isinstance(manager, GatewayMappingKernelManager):
        log.error(
            "sandbox-kernel: gateway mode is on but the kernel manager is %s, which runs kernels here: "
            "set c.ServerApp.kernel_manager_class = %r",
            type(manager).__name__,
            f"{__name__}.SandboxGatewayMappingKernelManager",
        )
    elif not isinstance(manager, SandboxGatewayMappingKernelManager):
        log.info(
            "sandbox-kernel: set c.ServerApp.kernel_manager_class = %r so this server finds its "
            "kernels on the sandbox gateway again after a restart",
            f"{__name__}.SandboxGatewayMappingKernelManager",
        )
