"""A session's kernel on a sandbox gateway: the real gateway app served in this process on
loopback (plain HTTP, the fake backend, so no kernel answers), driven by the session's gateway
parts: the start with its narrowing, the owner's routes (pause, resume, usage, files), a
reattach the gateway refuses, and what a session refuses to send rather than drop."""

from __future__ import annotations

import asyncio
import json
import queue
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_server.gateway.gateway_client import GatewayClient
from tornado import web, websocket
from tornado.httpserver import HTTPServer
from tornado.ioloop import IOLoop

from sandbox_kernel.agents import gateway_session
from sandbox_kernel.agents.gateway_session import (
    GatewayKernel,
    SessionGatewayKernelClient,
    SessionGatewayKernelManager,
    release_gateway,
    use_gateway,
)
from sandbox_kernel.agents.gateway_settings import GatewaySettings
from sandbox_kernel.agents.session import AsyncSandboxSession
from sandbox_kernel.cli.app import McpApp, RunApp, _GatewayOptions
from sandbox_kernel.errors import (
    ConfigurationError,
    FolderNotEmptyError,
    KernelNotFoundError,
    KernelStartupError,
    MissingFileError,
    PauseError,
    SandboxKernelError,
    WorkspaceError,
)

from . import test_gateway as served
from .test_gateway import Gateway, free_port

# The real gateway app with the fake backend, as test_gateway.py serves it.
short_tmp, gateway_args, serve = served.short_tmp, served.gateway_args, served.serve

UIDS = {"alice": 15001, "bob": 15002}


@pytest.fixture(autouse=True)
def fresh_gateway_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No gateway named by this process's environment; GatewayClient and the session's
    bookkeeping of it fresh for each test."""
    for name in ("JUPYTER_GATEWAY_URL", "JUPYTER_GATEWAY_AUTH_TOKEN", "JUPYTER_GATEWAY_CA_CERTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KERNEL_LAUNCH_TIMEOUT", "40")  # GatewayClient writes it into os.environ
    monkeypatch.setattr(gateway_session, "_in_use", [None, 0])
    GatewayClient.clear_instance()
    yield
    GatewayClient.clear_instance()


@pytest.fixture
async def on_gateway(serve: Callable[..., Awaitable[Gateway]]) -> Gateway:
    return await serve()


def as_user(gateway: Gateway, user: str) -> GatewaySettings:
    """This process on ``gateway`` as ``user`` (GatewayClient apart from the gateway app's own)."""
    GatewayClient.clear_instance()
    settings = GatewaySettings(gateway.url, gateway.tokens[user])
    use_gateway(settings)
    return settings


# -- which gateway, and what is refused rather than dropped -------------------------------


def test_the_gateway_is_the_arguments_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert GatewaySettings.given() is None, "no gateway named: a local session"
    monkeypatch.setenv("JUPYTER_GATEWAY_URL", "https://gw.example:8870/")
    monkeypatch.setenv("JUPYTER_GATEWAY_AUTH_TOKEN", "from-env")
    monkeypatch.setenv("JUPYTER_GATEWAY_CA_CERTS", "/etc/ca.pem")
    assert GatewaySettings.given() == GatewaySettings("https://gw.example:8870", "from-env", "/etc/ca.pem")
    assert GatewaySettings.given("https://other:1", "given").token == "given"
    assert GatewaySettings.given("https://other:1").ws_url == "wss://other:1"
    with pytest.raises(ConfigurationError, match="https://"):
        GatewaySettings.given("gw.example:8870")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"env": {"A": "1"}}, "env= is not sent"),
        ({"image": "evil:1"}, "narrowed only by"),
        ({"output_limit": 10}, "narrowed only by"),
    ],
)
def test_a_session_on_a_gateway_refuses_what_the_gateway_would_not_apply(
    kwargs: dict[str, object], words: str
) -> None:
    with pytest.raises(ConfigurationError, match=words):
        AsyncSandboxSession(cwd="/home/alice/proj", gateway_url="http://127.0.0.1:1", **kwargs)  # type: ignore[arg-type]


def test_a_session_on_a_gateway_takes_a_folder_there_as_it_is() -> None:
    session = AsyncSandboxSession(cwd="/home/alice/proj", gateway_url="http://127.0.0.1:1", memory="1g")
    assert (session.cwd, session.fresh_workspace, session._narrowing) == (
        Path("/home/alice/proj"),
        False,
        {"memory": "1g"},
    ), "no fresh workspace here for a kernel there"
    assert AsyncSandboxSession(gateway_url="http://127.0.0.1:1").cwd is None, "the user's root there"
    with pytest.raises(ConfigurationError, match="absolute"):
        AsyncSandboxSession(cwd="proj", gateway_url="http://127.0.0.1:1")


def test_one_process_uses_one_gateway_as_one_user_at_a_time() -> None:
    use_gateway(GatewaySettings("http://127.0.0.1:1", "alice"))
    use_gateway(GatewaySettings("http://127.0.0.1:1", "alice"))
    with pytest.raises(ConfigurationError, match="one process uses one gateway"):
        use_gateway(GatewaySettings("http://127.0.0.1:1", "bob"))
    release_gateway()
    release_gateway()
    use_gateway(GatewaySettings("http://127.0.0.1:2", "bob"))
    client = GatewayClient.instance()
    assert (client.url, client.ws_url, client.auth_token) == ("http://127.0.0.1:2", "ws://127.0.0.1:2", "bob")


# -- against the real gateway app ----------------------------------------------------------


async def test_a_start_sends_the_folder_and_the_narrowing_and_nothing_of_this_processs_env(
    on_gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNEL_SECRET", "not for the gateway")
    as_user(on_gateway, "alice")
    km = SessionGatewayKernelManager(kernel_name="sandboxed-python")
    await km.start_kernel(
        cwd=str(on_gateway.roots["alice"] / "proj"), sandbox={"memory": "1g", "network": "none"}
    )
    policy = on_gateway.km.get_kernel(km.kernel_id).provisioner.policy
    assert (policy.memory, policy.network) == ("1g", "none")
    assert "KERNEL_SECRET" not in str(on_gateway.km.get_kernel(km.kernel_id)._launch_args)

    wider = SessionGatewayKernelManager(kernel_name="sandboxed-python")
    with pytest.raises(ConfigurationError, match="refused the kernel"):
        await wider.start_kernel(sandbox={"image": "evil:1"})
    with pytest.raises(ConfigurationError, match="no sandboxed kernelspec"):
        await SessionGatewayKernelManager(kernel_name="python3").start_kernel()
    with pytest.raises(KernelStartupError, match="outside your sandbox workspace"):
        await SessionGatewayKernelManager(kernel_name="sandboxed-python").start_kernel(
            cwd=str(on_gateway.roots["bob"] / "proj")
        )


async def test_another_users_token_cannot_reattach_to_a_kernel(on_gateway: Gateway) -> None:
    kernel_id = await on_gateway.start("alice")
    as_user(on_gateway, "alice")
    mine = SessionGatewayKernelManager(kernel_name="sandboxed-python")
    await mine.start_kernel(kernel_id=kernel_id)
    assert mine.kernel_id == kernel_id
    release_gateway()

    as_user(on_gateway, "bob")
    with pytest.raises(KernelNotFoundError, match=f"no kernel {kernel_id} of yours"):
        await SessionGatewayKernelManager().start_kernel(kernel_id=kernel_id)
    with pytest.raises(KernelNotFoundError):
        await AsyncSandboxSession.connect(
            kernel_id, gateway_url=on_gateway.url, gateway_token=on_gateway.tokens["bob"]
        )
    assert gateway_session._in_use[1] == 1, "the failed connect let go of the gateway"
    for call in (GatewayKernel(kernel_id).usage(), GatewayKernel(kernel_id).pause()):
        with pytest.raises(SandboxKernelError, match="HTTP 403"):
            await call
    assert on_gateway.km.get_kernel(kernel_id).provisioner.paused is None


async def test_its_owner_pauses_resumes_and_reads_usage_through_the_routes(on_gateway: Gateway) -> None:
    kernel_id = await on_gateway.start("alice", sandbox={"memory": "1g"})
    as_user(on_gateway, "alice")
    kernel = GatewayKernel(kernel_id)
    provisioner = on_gateway.km.get_kernel(kernel_id).provisioner
    assert await kernel.usage() == {
        "state": "running",
        "cpu_seconds": None,  # the fake backend's sandboxes have no host process
        "memory": {"used": None, "peak": None, "limit": 1024**3},
    }
    paused = await kernel.pause()
    assert paused.checkpoint == provisioner.paused.checkpoint
    assert (await kernel.status())["state"] == "paused"
    await kernel.resume()
    assert provisioner.paused is None
    provisioner.backend.can_checkpoint = False
    with pytest.raises(PauseError, match=kernel_id):
        await kernel.pause()


async def test_its_owner_uses_the_workspace_through_the_files_routes(on_gateway: Gateway) -> None:
    kernel_id = await on_gateway.start("alice")
    as_user(on_gateway, "alice")
    files = GatewayKernel(kernel_id)
    proj = on_gateway.roots["alice"] / "proj"
    assert await files.upload("notes/a.txt", b"\x00bytes") == "/workspace/proj/notes/a.txt"
    assert ((proj / "notes" / "a.txt").stat().st_uid, await files.download("notes/a.txt")) == (
        UIDS["alice"],
        b"\x00bytes",
    )
    listed = await files.list("notes")
    assert [(f.name, f.path, f.size, f.is_dir) for f in listed] == [("a.txt", "notes/a.txt", 6, False)]
    with pytest.raises(WorkspaceError, match="over the 3"):
        await files.download("notes/a.txt", max_bytes=3)
    with pytest.raises(MissingFileError, match=r"missing\.txt"):
        await files.download("missing.txt")
    with pytest.raises(WorkspaceError, match="outside"):
        await files.download("/etc/passwd")
    with pytest.raises(FolderNotEmptyError):
        await files.delete("notes")
    await files.delete("notes", recursive=True)
    assert not (proj / "notes").exists()


async def test_a_gateway_without_the_files_routes_is_named_as_such() -> None:
    class Kernels(web.RequestHandler):
        def get(self) -> None:
            self.finish(json.dumps([]))

    port = free_port()
    server = HTTPServer(web.Application([(r"/api/kernels", Kernels)]))
    server.listen(port, "127.0.0.1")
    try:
        use_gateway(GatewaySettings(f"http://127.0.0.1:{port}", "t"))
        with pytest.raises(SandboxKernelError, match="serves no files routes"):
            await GatewayKernel("k1").list()
    finally:
        server.stop()


# -- the commands' gateway options -------------------------------------------------------


def launch(app: _GatewayOptions, argv: list[str]) -> None:
    app.initialize(argv)
    app.start()


def command(app_class: type[_GatewayOptions], *argv: str) -> None:
    """Run ``app_class`` with ``argv``, which must fail (its error is on stderr)."""
    app_class.clear_instance()
    try:
        with pytest.raises(SystemExit) as ended:
            launch(app_class(), list(argv))
        assert ended.value.code == 1
    finally:
        app_class.clear_instance()


#: A gateway the commands take (they fail before asking it anything).
URL, TOKEN = "--gateway-url=http://127.0.0.1:1", "--gateway-token-file={token}"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ([URL], "needs your token: --gateway-token-file FILE"),
        (["--gateway-url=127.0.0.1:1", TOKEN], "https://"),
        ([URL, "--gateway-token-file={missing}"], "No such file"),
        ([URL, "--gateway-token-file={empty}"], "is empty"),
        (
            [URL, TOKEN, "--ca-certs={missing}"],
            "is not a file",
        ),
        ([URL, TOKEN, "--cwd=proj"], "absolute path"),
        (["--gateway-token=secret"], "gateway-token"),
    ],
)
@pytest.mark.parametrize("app_class", [McpApp, RunApp])
def test_the_commands_take_a_gateway_and_its_token_only_from_a_file_or_the_environment(
    app_class: type[_GatewayOptions],
    argv: list[str],
    said: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "token").write_text("t0ken\n")
    (tmp_path / "empty").write_text("\n")
    names = {name: tmp_path / name for name in ("token", "missing", "empty")}
    notebook = tmp_path / "nb.ipynb"
    notebook.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    extra = [str(notebook)] if app_class is RunApp else []
    command(app_class, *[arg.format(**names) for arg in argv], *extra)
    assert said in capsys.readouterr().err


def test_a_token_from_the_environment_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUPYTER_GATEWAY_URL", "https://gw.example:8870")
    monkeypatch.setenv("JUPYTER_GATEWAY_AUTH_TOKEN", "from-env")
    McpApp.clear_instance()
    app = McpApp()
    app.initialize([])
    try:
        assert app.gateway() == GatewaySettings("https://gw.example:8870", "from-env")
    finally:
        McpApp.clear_instance()


def test_cwd_of_run_is_for_a_gateway_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    notebook = tmp_path / "nb.ipynb"
    notebook.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    command(RunApp, "--cwd=/home/alice", str(notebook))
    assert "--cwd is for --gateway-url" in capsys.readouterr().err


# -- the session's kernel client -----------------------------------------------------------


async def test_the_sessions_client_names_each_channel_and_waits_for_quiet_kernels_without_spinning() -> None:
    received: list[dict[str, Any]] = []

    class Kernels(web.RequestHandler):
        def post(self) -> None:
            self.finish(
                {"id": "k1", "name": "sandboxed-python", "last_activity": "", "execution_state": "idle"}
            )

    class Channels(websocket.WebSocketHandler):
        def on_message(self, message: str | bytes) -> None:
            received.append(json.loads(message))
            reply = {"header": {"msg_id": "r1", "msg_type": "status"}, "parent_header": {}, "metadata": {}}
            reply.update(content={"execution_state": "idle"}, channel="iopub", msg_id="r1", msg_type="status")
            IOLoop.current().call_later(1.5, self.write_message, json.dumps(reply))

    port = free_port()
    server = HTTPServer(
        web.Application([(r"/api/kernels", Kernels), (r"/api/kernels/k1/channels", Channels)])
    )
    server.listen(port, "127.0.0.1")
    try:
        use_gateway(GatewaySettings(f"http://127.0.0.1:{port}", "t"))
        km = SessionGatewayKernelManager(kernel_name="sandboxed-python")
        await km.start_kernel()
        kc = km.client()
        assert isinstance(kc, SessionGatewayKernelClient)
        await kc.start_channels()
        try:
            kc.stdin_channel.send(kc.session.msg("input_reply", {"value": "x"}))
            cpu = time.process_time()
            message = await kc.get_iopub_msg()
            cpu = time.process_time() - cpu
            assert message["msg_type"] == "status", "1.5 s of silence is waited through"
            assert cpu < 0.5, f"{cpu:.2f} s of CPU to wait 1.5 s: spinning"
            assert [m["channel"] for m in received] == ["stdin"]
            with pytest.raises(queue.Empty):
                await kc.get_shell_msg(timeout=0.2)
        finally:
            await asyncio.to_thread(kc.stop_channels)  # it waits for the close: the server is on this loop
    finally:
        server.stop()
