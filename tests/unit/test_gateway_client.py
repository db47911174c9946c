"""The client part for a user's server on a sandbox gateway: the redial bookkeeping, the CA fix
pinned on jupyter_server's private arguments, and the managers against a small real HTTP gateway."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import jupyter_server
import pytest
from jupyter_server.gateway.connections import GatewayWebSocketConnection
from jupyter_server.gateway.gateway_client import GatewayClient
from tornado import web
from tornado import websocket as tornado_websocket
from tornado.httpserver import HTTPServer
from traitlets import Unicode
from traitlets.config import LoggingConfigurable

from sandbox_kernel.jupyter import gateway_client as gateway_client_module
from sandbox_kernel.jupyter.gateway_client import (
    SANDBOX_MODEL_KEY,
    SandboxGatewayKernelManager,
    SandboxGatewayMappingKernelManager,
    SandboxGatewayWebSocketConnection,
    channel_sslopt,
    gateway_status,
    honour_ca_certs,
    lifecycle,
    use_gateway_client,
)
from sandbox_kernel.jupyter.gateway_link import CLOSE_CODE, GatewayLink, GiveUp, Redial

# -- the redial bookkeeping ---------------------------------------------------------------


def link(retry_max: int = 3) -> GatewayLink:
    return GatewayLink(retry_max, interval=1.0, interval_max=3.0, jitter=lambda: 0.5)


def test_a_lost_connection_is_redialled_with_growing_delays_then_given_up() -> None:
    machine = link()
    steps = []
    for _ in range(3):
        step = machine.lost()
        steps.append(step)
        assert machine.wait_over()
    assert steps == [Redial(1, 1.5), Redial(2, 2.5), Redial(3, 3.5)], (
        "doubling, capped at interval_max, plus jitter"
    )
    assert machine.lost() == GiveUp("sandbox gateway unreachable (gave up after 3 retries)")
    assert machine.state == "closed"


def test_a_connection_that_comes_back_counts_its_retries_from_zero_again() -> None:
    machine = link(retry_max=1)
    assert machine.lost() == Redial(1, 1.5)
    assert machine.wait_over()
    machine.dialled()
    assert machine.lost() == Redial(1, 1.5), "a fresh count after a good connection"


def test_one_loss_reported_twice_dials_once() -> None:
    machine = link()
    assert isinstance(machine.lost(), Redial)
    assert machine.lost() is None, "a redial is already pending: no second dial"
    assert machine.wait_over()
    assert not machine.wait_over()


def test_a_refusal_gives_up_at_once() -> None:
    for status in (401, 403, 404):
        machine = link()
        step = machine.lost(status)
        assert step == GiveUp(f"the sandbox gateway refused the kernel's connection (HTTP {status})")
    assert isinstance(link().lost(502), Redial), "a proxy's 502 is worth another try"


def test_nothing_dials_after_the_browser_is_gone() -> None:
    machine = link()
    assert isinstance(machine.lost(), Redial)
    machine.close()
    assert not machine.wait_over(), "the pending redial is called off"
    assert machine.lost() is None
    machine.dialled()
    assert machine.state == "closed"
    given_up = link(retry_max=0)
    assert isinstance(given_up.lost(), GiveUp)
    assert given_up.lost() is None, "the browser's socket is closed once"


def test_the_close_reasons_fit_a_websocket_close_frame() -> None:
    exhausted = link(retry_max=10**12)
    exhausted.retries = exhausted.retry_max
    for step in (link().lost(403), exhausted.lost()):
        assert isinstance(step, GiveUp)
        assert len(step.reason.encode()) <= 123  # RFC 6455: 125 bytes of payload, 2 for the code
        assert "\n" not in step.reason
    assert CLOSE_CODE == 1011


# -- the CA fix, pinned on jupyter_server's private connection arguments -------------------


@pytest.fixture
def launch_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """GatewayClient.init_connection_args writes KERNEL_LAUNCH_TIMEOUT into os.environ."""
    monkeypatch.setenv("KERNEL_LAUNCH_TIMEOUT", "40")


@pytest.mark.usefixtures("launch_timeout")
def test_stock_jupyter_server_still_ignores_ca_certs_without_a_client_certificate() -> None:
    """If this fails, jupyter_server fixed its bug: drop honour_ca_certs."""
    client = GatewayClient(url="https://gateway.example:8870", ca_certs="/etc/ca.pem")
    assert "ca_certs" not in client.load_connection_args(), jupyter_server.__version__


@pytest.mark.usefixtures("launch_timeout")
def test_ca_certs_are_honoured_without_a_client_certificate() -> None:
    client = GatewayClient(url="https://gateway.example:8870", ca_certs="/etc/ca.pem", auth_token="t0k")
    assert honour_ca_certs(client)
    args = client.load_connection_args()
    assert args["ca_certs"] == "/etc/ca.pem"
    assert args["headers"]["Authorization"] == "token t0k", "the rest of the arguments are upstream's"
    assert not honour_ca_certs(client), "once is enough"


@pytest.mark.usefixtures("launch_timeout")
def test_ca_certs_with_a_client_certificate_are_left_to_jupyter_server() -> None:
    client = GatewayClient(
        url="https://gw:8870", ca_certs="/etc/ca.pem", client_cert="/c.pem", client_key="/k.pem"
    )
    assert not honour_ca_certs(client)
    assert client.load_connection_args()["ca_certs"] == "/etc/ca.pem"
    assert not honour_ca_certs(GatewayClient(url="https://gw:8870")), "no CA configured: nothing to do"


def test_the_kernel_clients_websocket_verifies_the_gateway() -> None:
    with_ca = channel_sslopt(GatewayClient(url="https://gw:8870", ca_certs="/etc/ca.pem"))
    assert with_ca == {"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": "/etc/ca.pem"}
    assert channel_sslopt(GatewayClient(url="https://gw:8870")) == {"cert_reqs": ssl.CERT_REQUIRED}
    unverified = channel_sslopt(GatewayClient(url="https://gw:8870", validate_cert=False))
    assert unverified["cert_reqs"] == ssl.CERT_NONE
    mutual = channel_sslopt(GatewayClient(url="https://gw:8870", client_cert="/c.pem", client_key="/k.pem"))
    assert (mutual["certfile"], mutual["keyfile"]) == ("/c.pem", "/k.pem")


def test_the_lifecycle_key_of_a_gateways_kernel_model() -> None:
    assert lifecycle({"id": "k", SANDBOX_MODEL_KEY: {"lifecycle": "persistent"}}) == "persistent"
    assert lifecycle({"id": "k", SANDBOX_MODEL_KEY: {"lifecycle": "ephemeral"}}) == "ephemeral"
    assert lifecycle({"id": "k"}) is None
    assert lifecycle({"id": "k", SANDBOX_MODEL_KEY: "persistent"}) is None
    assert lifecycle(None) is None


# -- the extension's choice of connection class -------------------------------------------


def fake_serverapp(connection_class: type[Any]) -> SimpleNamespace:
    return SimpleNamespace(
        log=logging.getLogger("test"),
        gateway_config=GatewayClient(url="http://gw:8870"),
        web_app=SimpleNamespace(settings={"kernel_websocket_connection_class": connection_class}),
        kernel_manager=None,
    )


def test_the_relaying_connection_replaces_only_the_stock_one() -> None:
    stock = fake_serverapp(GatewayWebSocketConnection)
    use_gateway_client(stock)  # type: ignore[arg-type]
    assert stock.web_app.settings["kernel_websocket_connection_class"] is SandboxGatewayWebSocketConnection

    class Configured(GatewayWebSocketConnection):
        pass

    configured = fake_serverapp(Configured)
    use_gateway_client(configured)  # type: ignore[arg-type]
    assert configured.web_app.settings["kernel_websocket_connection_class"] is Configured


# -- the managers and the status route against a small real HTTP gateway -----------------


def kernel_model(kernel_id: str, kept: str | None) -> dict[str, Any]:
    model: dict[str, Any] = {
        "id": kernel_id,
        "name": "sandboxed-python",
        "last_activity": "2026-12-02T10:00:00.000000Z",
        "execution_state": "idle",
        "connections": 0,
    }
    if kept:
        model[SANDBOX_MODEL_KEY] = {"lifecycle": kept}
    return model


class FakeGateway:
    """The routes of a gateway the client part uses, recording what it was asked."""

    def __init__(self) -> None:
        self.kernels = {
            "kept": kernel_model("kept", "persistent"),
            "gone": kernel_model("gone", "ephemeral"),
            "old": kernel_model("old", None),
        }
        self.deleted: list[str] = []
        self.authorization: list[str | None] = []
        gateway = self

        class Kernels(web.RequestHandler):
            def get(self) -> None:
                gateway.authorization.append(self.request.headers.get("Authorization"))
                self.finish(json.dumps(list(gateway.kernels.values())))

            def post(self) -> None:
                gateway.kernels["started"] = kernel_model("started", None)
                self.finish(gateway.kernels["started"])

        class Kernel(web.RequestHandler):
            def delete(self, kernel_id: str) -> None:
                gateway.deleted.append(kernel_id)
                gateway.kernels.pop(kernel_id, None)
                self.set_status(204)

        class Status(web.RequestHandler):
            def get(self, kernel_id: str) -> None:
                if kernel_id not in gateway.kernels:
                    raise web.HTTPError(404)
                self.finish({"sandboxed": True, "runtime": "gVisor", "state": "running"})

        self.app = web.Application(
            [
                (r"/api/kernels", Kernels),
                (r"/api/kernels/([^/]+)", Kernel),
                (r"/api/sandbox-kernel/kernels/([^/]+)", Status),
            ]
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def gateway_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KERNEL_LAUNCH_TIMEOUT", "40")
    GatewayClient.clear_instance()
    yield
    GatewayClient.clear_instance()


@pytest.fixture
async def gateway(gateway_client: None) -> AsyncIterator[FakeGateway]:
    fake = FakeGateway()
    port = free_port()
    server = HTTPServer(fake.app)
    server.listen(port, "127.0.0.1")
    GatewayClient.instance(url=f"http://127.0.0.1:{port}", auth_token="user-token")
    try:
        yield fake
    finally:
        server.stop()
        await server.close_all_connections()


def manager(**config: Any) -> SandboxGatewayMappingKernelManager:
    return SandboxGatewayMappingKernelManager(relist_kernels=False, keep_sessions=False, **config)


async def test_a_starting_server_takes_back_the_kernels_the_gateway_lists(gateway: FakeGateway) -> None:
    km = manager()
    assert sorted(await km.take_back_kernels()) == ["gone", "kept"], (
        "not a kernel whose model lacks the sandbox key: another gateway's, maybe another user's"
    )
    assert gateway.authorization == ["token user-token"]
    assert isinstance(km.get_kernel("kept"), SandboxGatewayKernelManager)
    assert km.get_kernel("kept").kernel == gateway.kernels["kept"]
    assert await km.take_back_kernels() == [], "known kernels are not taken twice"
    assert manager().list_kernel_ids() == [], "each manager has its own kernels"


async def test_a_stopping_server_lets_go_of_persistent_kernels_and_stops_the_others(
    gateway: FakeGateway,
) -> None:
    km = manager()
    await km.take_back_kernels()
    await km.start_kernel(kernel_name="sandboxed-python")  # its model says nothing: ephemeral
    await km.shutdown_all()
    assert sorted(gateway.deleted) == ["gone", "started"], "what is not marked persistent is stopped"
    assert km.list_kernel_ids() == []


async def test_a_stopping_server_does_not_wait_for_a_gateway_that_is_down(gateway: FakeGateway) -> None:
    km = manager()
    await km.take_back_kernels()
    GatewayClient.instance().url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for kid in km.list_kernel_ids():
        km.get_kernel(kid).kernel_url = f"{GatewayClient.instance().url}/api/kernels/{kid}"
    start = time.monotonic()
    await km.shutdown_all()
    assert time.monotonic() - start < 3
    assert km.list_kernel_ids() == []
    assert gateway.deleted == []


async def test_a_stopping_server_gives_up_on_a_gateway_that_does_not_answer(gateway: FakeGateway) -> None:
    km = manager(gateway_wait=0.5)
    await km.take_back_kernels()
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        for kid in km.list_kernel_ids():
            km.get_kernel(kid).kernel_url = f"http://127.0.0.1:{silent.getsockname()[1]}/api/kernels/{kid}"
        start = time.monotonic()
        await km.shutdown_all()
        took = time.monotonic() - start
    assert 0.4 < took < 3, took
    assert km.list_kernel_ids() == []


async def test_a_server_starts_without_its_gateway(gateway_client: None) -> None:
    GatewayClient.instance(url=f"http://127.0.0.1:{free_port()}")
    km = manager()
    assert await km.take_back_kernels() == []


async def test_the_kernel_status_comes_from_the_gateway(gateway: FakeGateway) -> None:
    assert await gateway_status("kept") == {"sandboxed": True, "runtime": "gVisor", "state": "running"}
    with pytest.raises(web.HTTPError) as refused:
        await gateway_status("someone-elses")
    assert refused.value.status_code == 404


async def test_an_unreachable_gateway_is_a_status_too(gateway_client: None) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    GatewayClient.instance(url=url)
    status = await gateway_status("k1")
    assert status == {
        "sandboxed": True,
        "gateway": {"reachable": False, "url": url, "reason": status["gateway"]["reason"]},
    }
    assert "refused" in status["gateway"]["reason"].lower()
    assert "\n" not in status["gateway"]["reason"]


async def test_a_kernel_manager_for_programs_starts_the_kernel_it_names(gateway_client: None) -> None:
    started: list[dict[str, Any]] = []

    class Kernels(web.RequestHandler):
        def post(self) -> None:
            started.append(json.loads(self.request.body))
            self.finish(kernel_model("new", None))

    port = free_port()
    server = HTTPServer(web.Application([(r"/api/kernels", Kernels)]))
    server.listen(port, "127.0.0.1")
    try:
        GatewayClient.instance(url=f"http://127.0.0.1:{port}")
        km = SandboxGatewayKernelManager(kernel_name="sandboxed-python")
        await km.start_kernel()
    finally:
        server.stop()
    assert started[0]["name"] == "sandboxed-python", "stock GatewayKernelManager asks for python3"
    assert km.kernel_id == "new"
    assert asyncio.iscoroutinefunction(km.client().start_channels)


async def test_a_gateway_that_does_not_answer_is_unreachable_too(
    gateway_client: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gateway_client_module, "STATUS_WAIT", 0.3)
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        GatewayClient.instance(url=f"http://127.0.0.1:{silent.getsockname()[1]}")
        status = await gateway_status("k1")
    assert status["gateway"]["reachable"] is False
    assert status["gateway"]["reason"] == "no answer within 0.3 s"


# -- the relay to the gateway's kernel websocket ------------------------------------------


class FakeKernelManager(LoggingConfigurable):
    """What a kernel websocket connection reads of its kernel manager (its parent)."""

    kernel_id = Unicode("k1")


async def test_a_browser_gone_while_the_gateway_is_dialled_leaves_no_connection_to_it(
    gateway_client: None,
) -> None:
    """The browser's socket closes while the gateway's is still being dialled (JupyterLab opens
    a kernel's socket twice, 0.1 s apart, and drops one). Cancelling tornado's
    ``websocket_connect`` future does not stop the dial: the handshake completes, and tornado
    keeps the websocket open for ever, answering the gateway's pings, so the gateway would keep
    a second client of the session. The connection must be closed once the dial completes."""
    arrived, let_on, closed = asyncio.Event(), asyncio.Event(), asyncio.Event()
    opened: list[tornado_websocket.WebSocketHandler] = []

    class Channels(tornado_websocket.WebSocketHandler):
        async def prepare(self) -> None:
            arrived.set()
            await let_on.wait()  # a slow handshake: the gateway asking the kernel for its info

        def open(self, *args: str, **kwargs: str) -> None:
            opened.append(self)

        def on_close(self) -> None:
            closed.set()

    port = free_port()
    server = HTTPServer(web.Application([(r"/api/kernels/([^/]+)/channels", Channels)]))
    server.listen(port, "127.0.0.1")
    GatewayClient.instance(url=f"http://127.0.0.1:{port}")
    connection = SandboxGatewayWebSocketConnection(parent=FakeKernelManager())
    try:
        await connection.connect()
        await asyncio.wait_for(arrived.wait(), 10)
        connection.disconnect()
        let_on.set()
        await asyncio.wait_for(closed.wait(), 5)
    finally:
        for handler in opened:
            handler.close()
        server.stop()
        await asyncio.wait_for(server.close_all_connections(), 5)


async def test_a_handshake_the_gateway_refused_for_a_newer_one_is_dialled_again_keeping_messages(
    gateway_client: None,
) -> None:
    """A gateway refuses (409) the handshake of a connection a newer one of its session replaced
    while it was in it: when that is the connection the browser kept, what the browser sent
    meanwhile is still held, and reaches the kernel once the gateway is dialled again."""
    received: list[str | bytes] = []
    arrived = asyncio.Event()
    refused: list[str] = []
    opened: list[tornado_websocket.WebSocketHandler] = []

    class Channels(tornado_websocket.WebSocketHandler):
        def prepare(self) -> None:
            if not refused:
                refused.append(self.request.uri or "")
                raise web.HTTPError(409)

        def open(self, *args: str, **kwargs: str) -> None:
            opened.append(self)

        def on_message(self, message: str | bytes) -> None:
            received.append(message)
            arrived.set()

    port = free_port()
    server = HTTPServer(web.Application([(r"/api/kernels/([^/]+)/channels", Channels)]))
    server.listen(port, "127.0.0.1")
    GatewayClient.instance(url=f"http://127.0.0.1:{port}", gateway_retry_interval=0.1)
    connection = SandboxGatewayWebSocketConnection(parent=FakeKernelManager())
    try:
        await connection.connect()
        connection.handle_incoming_message('{"said": "while dialling"}')
        await asyncio.wait_for(arrived.wait(), 10)
        assert len(refused) == 1
        assert received == ['{"said": "while dialling"}']
    finally:
        connection.disconnect()
        for handler in opened:
            handler.close()
        server.stop()
        await asyncio.wait_for(server.close_all_connections(), 5)
