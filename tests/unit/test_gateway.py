"""The sandbox gateway served for real (in this process, over HTTP and websockets), with the
fake backend for its kernels: the routes it serves, who it lets in, and whose kernels
each user may touch."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
from tornado.escape import url_escape
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest, HTTPResponse
from tornado.websocket import websocket_connect
from traitlets.config import Config

from sandbox_kernel.agents.files import DEFAULT_MAX_BYTES
from sandbox_kernel.backends.fake import FakeBackend, FakeSandbox
from sandbox_kernel.errors import WorkspaceError
from sandbox_kernel.gateway.app import SandboxGatewayApp
from sandbox_kernel.gateway.identity import add_token
from sandbox_kernel.gateway.manager import GatewayKernelManagerForUsers
from sandbox_kernel.gateway.readings import audit_lines, parse_since
from sandbox_kernel.jupyter.gateway_client import SANDBOX_MODEL_KEY, lifecycle
from sandbox_kernel.jupyter.server import SandboxMappingKernelManager
from sandbox_kernel.lifecycle.ownership import SandboxedKernel, server_identity
from sandbox_kernel.lifecycle.startup_mark import STARTED_MARK
from sandbox_kernel.plan.sandbox_spec import CONTAINER_CLAIM_SOCKET, LABEL_USER, SandboxSpec
from sandbox_kernel.plan.users import KernelUser
from sandbox_kernel.pool.sandboxes import SandboxPool

from .test_provisioner import ARGV

UIDS = {"alice": 15001, "bob": 15002}


class StartingBackend(FakeBackend):
    """The fake backend, whose sandboxes take a moment to start and whose start-up code
    says it ran (as a kernel's does)."""

    async def create(self, spec: SandboxSpec) -> str:
        await asyncio.sleep(0.1)
        sandbox_id = await super().create(spec)
        (spec.runtime_dir / STARTED_MARK).write_text("ok\n")
        return sandbox_id


class PoolingBackend(StartingBackend):
    """One Docker host's sandboxes (every provisioner's backend sees them all, as Docker's
    are), whose pooled sandboxes take their claim as a kernel's start-up code does: each
    claim is kept in :attr:`claims` (sandbox id -> the claim)."""

    shared: ClassVar[dict[str, FakeSandbox]] = {}
    ids: ClassVar[Iterator[int]] = itertools.count(1)
    claims: ClassVar[dict[str, dict[str, Any]]] = {}
    listeners: ClassVar[dict[str, socket.socket]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.sandboxes, self._ids = self.shared, self.ids

    async def create(self, spec: SandboxSpec) -> str:
        sandbox_id = await super().create(spec)
        if spec.slot is not None:
            listener = self.listeners[sandbox_id] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(spec.runtime_dir / Path(CONTAINER_CLAIM_SOCKET).name))
            listener.listen(1)
            threading.Thread(target=self._take_claim, args=(sandbox_id, listener), daemon=True).start()
        return sandbox_id

    def _take_claim(self, sandbox_id: str, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:  # removed unclaimed
            return
        with conn:
            claim = b""
            while chunk := conn.recv(65536):
                claim += chunk
            self.claims[sandbox_id] = json.loads(claim)
            conn.sendall(b"ok\n")

    def remove_blocking(self, sandbox_id: str) -> None:
        listener = self.listeners.pop(sandbox_id, None)
        if listener is not None:
            listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        super().remove_blocking(sandbox_id)


def write_kernelspec(kernels: Path, name: str, sandboxed: bool) -> None:
    folder = kernels / name
    folder.mkdir(parents=True)
    metadata = (
        {"kernel_provisioner": {"provisioner_name": "sandbox-provisioner", "config": {}}} if sandboxed else {}
    )
    spec = {"argv": ARGV, "display_name": name, "language": "python", "metadata": metadata}
    (folder / "kernel.json").write_text(json.dumps(spec))
    (folder / "logo-64x64.png").write_bytes(b"\x89PNG fake")


@dataclass
class Gateway:
    app: SandboxGatewayApp
    url: str
    tokens: dict[str, str]
    roots: dict[str, Path]

    @property
    def km(self) -> GatewayKernelManagerForUsers:
        km = self.app.kernel_manager
        assert isinstance(km, GatewayKernelManagerForUsers)
        return km

    async def fetch(self, path: str, user: str | None = None, **kwargs: Any) -> HTTPResponse:
        """The gateway's answer (errors too) to a request as ``user`` (None: no token)."""
        headers = dict(kwargs.pop("headers", {}))
        if user is not None:
            headers["Authorization"] = f"token {self.tokens[user]}"
        if kwargs.get("body") is not None and not isinstance(kwargs["body"], str | bytes):
            kwargs["body"] = json.dumps(kwargs["body"])
        return await AsyncHTTPClient().fetch(
            self.url + path, headers=headers, raise_error=False, follow_redirects=False, **kwargs
        )

    async def start(self, user: str, **body: Any) -> str:
        body.setdefault("env", {"KERNEL_WORKING_DIR": str(self.roots[user] / "proj")})
        response = await self.fetch("/api/kernels", user, method="POST", body=body)
        assert response.code == 201, response.body
        return str(json.loads(response.body)["id"])


def message(response: HTTPResponse) -> str:
    return str(json.loads(response.body)["message"])


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder short enough for the kernels' unix socket paths (pytest's are not)."""
    folder = Path(tempfile.mkdtemp(prefix="sk-gw-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def gateway_args(short_tmp: Path, jupyter_dirs: dict[str, Path]) -> list[str]:
    """The command line of a gateway serving alice and bob (a tokens file, their folders,
    the kernelspecs), on plain HTTP on loopback, with the fake backend."""
    kernels = jupyter_dirs["JUPYTER_DATA_DIR"] / "kernels"
    write_kernelspec(kernels, "sandboxed-python", sandboxed=True)
    write_kernelspec(kernels, "python3", sandboxed=False)
    for name, uid in UIDS.items():
        root = short_tmp / "home" / name
        (root / "proj").mkdir(parents=True)
        for folder in (root, root / "proj"):
            os.chown(folder, uid, uid)
    (short_tmp / "rt").mkdir()
    return [
        "--ip=127.0.0.1",  # the first: a test may take it out
        "--SandboxGatewayApp.allow_plain_http=True",
        f"--ServerApp.root_dir={short_tmp}",
        f"--TokensFileIdentityProvider.path={short_tmp / 'tokens.json'}",
        "--UserPolicy.uid_source=map",
        f"--UserPolicy.workspace_root={short_tmp}/home/{{username}}",
        "--UserPolicy.max_kernels_per_user=2",
        f"--SandboxProvisioner.backend_class={__name__}.StartingBackend",
        f"--SandboxProvisioner.runtime_parent={short_tmp}/rt",
        "--SandboxProvisioner.image=img:1",
    ]


def new_app(args: list[str]) -> SandboxGatewayApp:
    """A gateway app initialized with ``args`` (its port bound, not yet serving)."""
    SandboxGatewayApp.clear_instance()
    app = SandboxGatewayApp(config=Config({"UserPolicy": {"uids": UIDS}}))
    app.initialize(args)
    return app


@pytest.fixture
async def serve(
    short_tmp: Path, gateway_args: list[str], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Callable[..., Awaitable[Gateway]]]:
    """Serve a gateway with the given extra arguments."""
    monkeypatch.setattr(SandboxGatewayApp, "init_signal", lambda self: None)
    tokens = {name: add_token(short_tmp / "tokens.json", name) for name in UIDS}
    served: list[Gateway] = []

    async def start(*extra: str) -> Gateway:
        port = free_port()
        app = new_app([*gateway_args, f"--port={port}", *extra])
        roots = {name: short_tmp / "home" / name for name in UIDS}
        served.append(Gateway(app, f"http://127.0.0.1:{port}", tokens, roots))
        return served[-1]

    yield start
    for made in served:
        made.app.http_server.stop()
        await made.km.shutdown_all(now=True)
    SandboxGatewayApp.clear_instance()


@pytest.fixture
async def gateway(serve: Callable[..., Awaitable[Gateway]]) -> Gateway:
    return await serve()


async def connect(gateway: Gateway, kernel_id: str, user: str | None, query: str = "") -> int:
    """The status of the websocket handshake to kernel ``kernel_id``'s channels as ``user``
    (101 when it connects)."""
    headers = {"Authorization": f"token {gateway.tokens[user]}"} if user else {}
    url = gateway.url.replace("http", "ws", 1) + f"/api/kernels/{kernel_id}/channels{query}"
    try:
        ws = await websocket_connect(HTTPRequest(url, headers=headers))
    except HTTPClientError as exc:
        return exc.code
    ws.close()
    return 101


#: Every other route a jupyter_server has (and the gateway must not).
NOT_SERVED = [
    "/api/contents",
    "/api/contents/tokens.json",
    "/files/tokens.json",
    "/api/sessions",
    "/api/terminals",
    "/terminals/1",
    "/api/status",
    "/api/me",
    "/api/config/notebook",
    "/api/security/csp-report",
    "/api/events/subscribe",
    "/api/nbconvert",
    "/nbconvert/html/x.ipynb",
    "/view/x.html",
    "/api/shutdown",
    "/lab",
    "/tree",
    "/login",
    "/logout",
    "/metrics",
    "/static/style/index.css",
    "/robots.txt",
    "/favicon.ico",
    "/api/kernels/",
    "/",
]


async def test_the_gateway_serves_the_kernel_api_and_nothing_else(gateway: Gateway) -> None:
    (Path(gateway.app.root_dir) / "x.ipynb").write_text("{}")
    for path in NOT_SERVED:
        for user in (None, "alice"):
            response = await gateway.fetch(path, user)
            assert response.code == 404, f"{path} as {user}: {response.code}"
    served = {
        "/api": 200,
        "/api/kernels": 200,
        "/api/kernelspecs": 200,
        "/api/kernelspecs/sandboxed-python": 200,
        "/kernelspecs/sandboxed-python/logo-64x64.png": 200,
    }
    for path, code in served.items():
        assert (await gateway.fetch(path, "alice")).code == code, path
    assert (await gateway.fetch("/api/kernels", "alice", method="POST", body="{}")).code == 201


async def test_metrics_are_served_only_when_asked(serve: Callable[..., Awaitable[Gateway]]) -> None:
    plain = await serve()
    assert (await plain.fetch("/metrics", "alice")).code == 404
    metered = await serve("--SandboxGatewayApp.metrics=True")
    assert (await metered.fetch("/metrics", "alice")).code == 200
    assert (await metered.fetch("/metrics")).code == 403, "with a token only"


async def test_the_handlers_check_the_owner_whatever_authorizer_is_configured(
    serve: Callable[..., Awaitable[Gateway]],
) -> None:
    gateway = await serve("--ServerApp.authorizer_class=jupyter_server.auth.authorizer.AllowAllAuthorizer")
    mine = await gateway.start("alice")
    for path, method in [
        (f"/api/kernels/{mine}", "GET"),
        (f"/api/kernels/{mine}", "DELETE"),
        (f"/api/sandbox-kernel/kernels/{mine}", "GET"),
        (f"/api/sandbox-kernel/kernels/{mine}/usage", "GET"),
        (f"/api/sandbox-kernel/kernels/{mine}/audit", "GET"),
        (f"/api/sandbox-kernel/kernels/{mine}/files?path=a.txt", "GET"),
        (f"/api/sandbox-kernel/kernels/{mine}/files?path=a.txt", "DELETE"),
        (f"/api/sandbox-kernel/kernels/{mine}/files/list", "GET"),
    ]:
        assert (await gateway.fetch(path, "bob", method=method)).code == 403, path
    put = await gateway.fetch(
        f"/api/sandbox-kernel/kernels/{mine}/files?path=a.txt", "bob", method="PUT", body="x"
    )
    assert put.code == 403
    assert not (gateway.roots["alice"] / "proj" / "a.txt").exists()
    assert (await gateway.fetch(f"/api/kernels/{mine}/restart", "bob", method="POST", body="")).code == 403
    for action in ("pause", "resume"):
        path = f"/api/sandbox-kernel/kernels/{mine}/{action}"
        assert (await gateway.fetch(path, "bob", method="POST", body="")).code == 403, path
    assert gateway.km.get_kernel(mine).provisioner.paused is None
    assert await connect(gateway, mine, "bob") == 403
    taken = await gateway.fetch("/api/kernels", "bob", method="POST", body={"kernel_id": mine})
    assert taken.code == 403
    assert json.loads((await gateway.fetch("/api/kernels", "bob")).body) == []


def test_the_gateway_does_not_start_as_another_user_than_root(
    gateway_args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    add_token(Path(gateway_args[3].partition("=")[2]), "alice")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit):
        new_app([*gateway_args, f"--port={free_port()}"])
    assert "must run as root (it runs as uid 1000)" in capsys.readouterr().err


@pytest.mark.parametrize("ip", ["0.0.0.0", "10.77.0.2", ""])
def test_the_gateway_does_not_serve_plain_http_off_loopback(
    gateway_args: list[str], ip: str, capsys: pytest.CaptureFixture[str]
) -> None:
    add_token(Path(gateway_args[3].partition("=")[2]), "alice")
    with pytest.raises(SystemExit):
        new_app([*gateway_args[1:], f"--ip={ip}", f"--port={free_port()}"])
    err = capsys.readouterr().err
    assert "serves TLS only" in err
    assert "Traceback" not in err


def test_the_gateway_does_not_start_with_a_tokens_file_others_may_read(
    gateway_args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    path = Path(gateway_args[3].partition("=")[2])
    add_token(path, "alice")
    path.chmod(0o640)
    with pytest.raises(SystemExit):
        new_app([*gateway_args, f"--port={free_port()}"])
    err = capsys.readouterr().err
    assert "must be a file of root's with mode 0600 (it is uid 0, mode 0640)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "token not-a-token"},
        {"Authorization": "Basic YWxpY2U6eA=="},
        {"Cookie": "username-127-0-0-1=alice"},
        {"X-Forwarded-User": "alice", "KERNEL_USERNAME": "alice"},
    ],
    ids=["none", "wrong", "basic", "cookie", "claimed"],
)
async def test_a_request_without_a_users_token_in_its_header_is_refused(
    gateway: Gateway, headers: dict[str, str]
) -> None:
    kernel_id = await gateway.start("alice")
    for path, method, body in [
        ("/api/kernels", "GET", None),
        ("/api/kernels", "POST", "{}"),
        ("/api/kernelspecs", "GET", None),
        ("/api/kernelspecs/sandboxed-python", "GET", None),
        ("/kernelspecs/sandboxed-python/logo-64x64.png", "GET", None),
        (f"/api/kernels/{kernel_id}", "GET", None),
        (f"/api/kernels/{kernel_id}", "DELETE", None),
        (f"/api/kernels/{kernel_id}/interrupt", "POST", ""),
        (f"/api/sandbox-kernel/kernels/{kernel_id}", "GET", None),
        (f"/api/sandbox-kernel/kernels/{kernel_id}/pause", "POST", ""),
        (f"/api/sandbox-kernel/kernels/{kernel_id}/resume", "POST", ""),
        (f"/api/sandbox-kernel/kernels/{kernel_id}/usage", "GET", None),
        (f"/api/sandbox-kernel/kernels/{kernel_id}/audit", "GET", None),
    ]:
        response = await gateway.fetch(path, headers=headers, method=method, body=body)
        assert response.code == 403, f"{method} {path}: {response.code}"
    assert await connect(gateway, kernel_id, None) == 403
    assert gateway.km.owner(kernel_id) == "alice", "still there"


async def test_a_token_counts_only_in_the_authorization_header(gateway: Gateway) -> None:
    token = gateway.tokens["alice"]
    assert (await gateway.fetch(f"/api/kernels?token={token}")).code == 403
    kernel_id = await gateway.start("alice")
    assert await connect(gateway, kernel_id, None, f"?token={token}") == 403
    bearer = await gateway.fetch("/api/kernels", headers={"Authorization": f"Bearer {token}"})
    assert bearer.code == 200
    assert "Set-Cookie" not in bearer.headers, "no login cookie: the next request needs its token again"


async def test_the_tokens_file_is_read_again_when_it_changes(gateway: Gateway) -> None:
    provider = gateway.app.identity_provider
    path = Path(provider.path)  # type: ignore[attr-defined]
    new = add_token(path, "bob")
    assert (await gateway.fetch("/api/kernels", headers={"Authorization": f"token {new}"})).code == 200
    path.chmod(0o644)  # anyone may read it now: nobody gets in
    assert (await gateway.fetch("/api/kernels", "alice")).code == 403
    path.chmod(0o600)
    assert (await gateway.fetch("/api/kernels", "alice")).code == 200
    os.utime(path, ns=(1, 1))
    path.write_text(json.dumps({"users": {}}))  # tokens revoked
    assert (await gateway.fetch("/api/kernels", "alice")).code == 403


async def test_a_user_the_policy_refuses_gets_a_reason(gateway: Gateway) -> None:
    path = Path(gateway.app.identity_provider.path)  # type: ignore[attr-defined]
    token = add_token(path, "daemon", uid=2)
    response = await gateway.fetch("/api/kernels", headers={"Authorization": f"token {token}"})
    assert response.code == 403
    assert "system accounts" in message(response)


async def test_only_sandboxed_kernelspecs_exist(gateway: Gateway) -> None:
    listed = json.loads((await gateway.fetch("/api/kernelspecs", "alice")).body)
    assert "sandboxed-python" in listed["kernelspecs"]
    assert "python3" not in listed["kernelspecs"], "this test's, and the environment's ipykernel spec"
    for spec in listed["kernelspecs"].values():
        assert spec["spec"]["metadata"]["kernel_provisioner"]["provisioner_name"] == "sandbox-provisioner"
    assert listed["default"] == "sandboxed-python"
    assert (await gateway.fetch("/api/kernelspecs/python3", "alice")).code == 404
    assert (await gateway.fetch("/kernelspecs/python3/logo-64x64.png", "alice")).code == 404
    started = await gateway.fetch("/api/kernels", "alice", method="POST", body={"name": "python3"})
    assert (started.code, message(started)) == (404, "no sandboxed kernelspec 'python3' on this gateway")
    assert gateway.km.list_kernel_ids() == []


async def test_another_users_kernel_is_refused_on_every_route(gateway: Gateway) -> None:
    mine = await gateway.start("alice")
    unknown = "00000000-0000-4000-8000-000000000000"
    for kernel_id in (mine, unknown):
        for path, method, body in [
            (f"/api/kernels/{kernel_id}", "GET", None),
            (f"/api/kernels/{kernel_id}", "DELETE", None),
            (f"/api/kernels/{kernel_id}/interrupt", "POST", ""),
            (f"/api/kernels/{kernel_id}/restart", "POST", ""),
            (f"/api/sandbox-kernel/kernels/{kernel_id}", "GET", None),
            (f"/api/sandbox-kernel/kernels/{kernel_id}/pause", "POST", ""),
            (f"/api/sandbox-kernel/kernels/{kernel_id}/resume", "POST", ""),
            (f"/api/sandbox-kernel/kernels/{kernel_id}/usage", "GET", None),
            (f"/api/sandbox-kernel/kernels/{kernel_id}/audit", "GET", None),
            (f"/api/sandbox-kernel/kernels/{kernel_id}/audit?since=2026-01-01T00:00:00%2B00:00", "GET", None),
            (f"/api/sandbox-kernel/kernels/{kernel_id}/files?path=a.txt", "GET", None),
            (f"/api/sandbox-kernel/kernels/{kernel_id}/files?path=a.txt", "PUT", "bob's"),
            (f"/api/sandbox-kernel/kernels/{kernel_id}/files?path=a.txt", "DELETE", None),
            (f"/api/sandbox-kernel/kernels/{kernel_id}/files/list", "GET", None),
            (f"/api/sandbox-kernel/kernels/{kernel_id}/files/list?path=.", "GET", None),
        ]:
            response = await gateway.fetch(path, "bob", method=method, body=body)
            assert response.code == 403, f"bob: {method} {path}: {response.code}"
        assert await connect(gateway, kernel_id, "bob") == 403
        taken = await gateway.fetch("/api/kernels", "bob", method="POST", body={"kernel_id": kernel_id})
        assert taken.code == 403, "jupyter_server itself would hand over anyone's kernel by its id"
    assert json.loads((await gateway.fetch("/api/kernels", "bob")).body) == []
    assert gateway.km.list_kernel_ids() == [mine], "bob started nothing, stopped nothing"
    assert (await gateway.fetch(f"/api/kernels/{unknown}", "alice")).code == 403, "no existence oracle"

    # Its owner may do all of it.
    assert (await gateway.fetch(f"/api/kernels/{mine}", "alice")).code == 200
    status = await gateway.fetch(f"/api/sandbox-kernel/kernels/{mine}", "alice")
    assert json.loads(status.body)["sandboxed"] is True
    assert (
        await gateway.fetch(f"/api/kernels/{mine}/interrupt", "alice", method="POST", body="")
    ).code == 204
    again = await gateway.fetch("/api/kernels", "alice", method="POST", body={"kernel_id": mine})
    assert (again.code, json.loads(again.body)["id"]) == (201, mine)
    assert (await gateway.fetch(f"/api/kernels/{mine}/restart", "alice", method="POST", body="")).code == 200
    assert gateway.km.owner(mine) == "alice", "a restart keeps the owner"
    assert gateway.km.get_kernel(mine)._launch_args["sandbox_user"].name == "alice", "and the user"
    assert (await gateway.fetch(f"/api/kernels/{mine}", "alice", method="DELETE")).code == 204
    assert gateway.km.list_kernel_ids() == []
    assert gateway.km.owner(mine) is None


async def test_each_user_lists_only_their_own_kernels(gateway: Gateway) -> None:
    alices = {await gateway.start("alice"), await gateway.start("alice")}
    bobs = await gateway.start("bob")
    assert {k["id"] for k in json.loads((await gateway.fetch("/api/kernels", "alice")).body)} == alices
    assert [k["id"] for k in json.loads((await gateway.fetch("/api/kernels", "bob")).body)] == [bobs]
    assert gateway.km.list_kernels() == [], "outside a request: nobody's"


async def test_a_user_has_at_most_max_kernels_per_user(gateway: Gateway) -> None:
    here = {"env": {"KERNEL_WORKING_DIR": str(gateway.roots["alice"])}}
    at_once = [gateway.fetch("/api/kernels", "alice", method="POST", body=here) for _ in range(3)]
    codes = sorted(response.code for response in await asyncio.gather(*at_once))
    assert codes == [201, 201, 403], "starts still under way count"
    assert len(gateway.km.list_kernel_ids()) == 2
    third = await gateway.fetch("/api/kernels", "alice", method="POST", body=here)
    assert third.code == 403
    assert "max_kernels_per_user" in message(third)
    await gateway.start("bob")  # another user's count


async def test_a_kernel_starts_in_the_folder_asked_for_as_its_user(gateway: Gateway) -> None:
    kernel_id = await gateway.start("alice")
    launch = gateway.km.get_kernel(kernel_id)._launch_args
    assert launch["cwd"] == str((gateway.roots["alice"] / "proj").resolve())
    user = launch["sandbox_user"]
    assert (user.name, user.uid, user.root) == ("alice", UIDS["alice"], gateway.roots["alice"])
    assert "KERNEL_WORKING_DIR" not in (launch.get("env") or {}), "nothing of the client's env"


async def test_a_folder_outside_the_users_own_is_refused(gateway: Gateway, short_tmp: Path) -> None:
    bob = gateway.roots["bob"]
    (bob / "to-alice").symlink_to(gateway.roots["alice"] / "proj")
    os.chown(bob / "to-alice", UIDS["bob"], UIDS["bob"], follow_symlinks=False)
    elsewhere = short_tmp / "elsewhere"
    elsewhere.mkdir()
    os.chown(elsewhere, UIDS["bob"], UIDS["bob"])
    (bob / "out").symlink_to(elsewhere)
    os.chown(bob / "out", UIDS["bob"], UIDS["bob"], follow_symlinks=False)
    (bob / "roots").mkdir()  # root's, in bob's home
    cases = {
        str(gateway.roots["alice"] / "proj"): "is outside your sandbox workspace",
        str(bob / "to-alice"): "Refusing the kernel's folder",
        str(bob / "out"): "is outside your sandbox workspace",
        str(bob / "roots"): "is owned by uid 0, not by you",
        str(bob / "missing"): "does not exist",
        "proj": "is not an absolute path",
    }
    for folder, reason in cases.items():
        response = await gateway.fetch(
            "/api/kernels", "bob", method="POST", body={"env": {"KERNEL_WORKING_DIR": folder}}
        )
        assert response.code == 403, folder
        assert reason in message(response), message(response)
        assert "\n" not in message(response)
    assert gateway.km.list_kernel_ids() == []


async def test_a_start_may_narrow_the_kernels_policy_and_nothing_else(gateway: Gateway) -> None:
    kernel_id = await gateway.start("alice", sandbox={"memory": "1g"})
    assert gateway.km.get_kernel(kernel_id).provisioner.policy.memory == "1g"
    for body, reason in [
        ({"sandbox": {"image": "evil:1"}}, '"sandbox" may narrow only'),
        ({"env": "x"}, "must be JSON objects"),
        ({"name": 3}, "must be strings"),
        ([1], "must be a JSON object"),
    ]:
        response = await gateway.fetch("/api/kernels", "alice", method="POST", body=body)
        assert (response.code, reason in message(response)) == (400, True), message(response)


async def test_the_manager_starts_kernels_only_for_a_user_and_hands_over_only_their_own(
    gateway: Gateway,
) -> None:
    from sandbox_kernel.gateway.users import UserRefused
    from sandbox_kernel.plan.users import KernelUser

    km = gateway.km
    with pytest.raises(UserRefused, match="only for an authenticated user"):
        await km.start_kernel(kernel_name="sandboxed-python")
    alices = await gateway.start("alice")
    bob = KernelUser("bob", UIDS["bob"], UIDS["bob"], gateway.roots["bob"])
    with pytest.raises(UserRefused, match="you have no kernel"):
        await km.start_kernel(kernel_id=alices, sandbox_user=bob)
    with pytest.raises(UserRefused, match="you have no kernel"):
        await km.start_kernel(kernel_id="a-new-id-of-bobs-choosing", sandbox_user=bob)
    alice = KernelUser("alice", UIDS["alice"], UIDS["alice"], gateway.roots["alice"])
    assert await km.start_kernel(kernel_id=alices, sandbox_user=alice) == alices
    assert km.list_kernel_ids() == [alices]


async def test_jupyter_servers_own_gateway_client_drives_it(gateway: Gateway) -> None:
    """What a user's ``jupyter lab --gateway-url`` does: start (the notebook's folder as
    KERNEL_WORKING_DIR), list, interrupt, restart, shut down, with the user's token."""
    from jupyter_server.gateway.gateway_client import GatewayClient
    from jupyter_server.gateway.managers import GatewayMappingKernelManager

    GatewayClient.clear_instance()
    GatewayClient.instance(url=gateway.url, auth_token=gateway.tokens["alice"]).init_connection_args()
    try:
        km = GatewayMappingKernelManager(root_dir=str(gateway.roots["alice"]))
        kernel_id = await km.start_kernel(kernel_name="sandboxed-python", path="proj")
        launch = gateway.km.get_kernel(kernel_id)._launch_args
        assert (launch["sandbox_user"].name, launch["cwd"]) == ("alice", str(gateway.roots["alice"] / "proj"))
        assert [k["id"] for k in await km.list_kernels()] == [kernel_id]
        await km.interrupt_kernel(kernel_id)
        await km.restart_kernel(kernel_id)
        await km.shutdown_kernel(kernel_id)
        assert gateway.km.list_kernel_ids() == []
    finally:
        GatewayClient.clear_instance()


async def test_each_kernel_model_says_how_the_gateway_keeps_the_kernel(
    serve: Callable[..., Awaitable[Gateway]], make_persistent_spec: str
) -> None:
    gateway = await serve()
    started = await gateway.fetch(
        "/api/kernels",
        "alice",
        method="POST",
        body={"name": make_persistent_spec, "env": {"KERNEL_WORKING_DIR": str(gateway.roots["alice"])}},
    )
    assert started.code == 201, started.body
    persistent = json.loads(started.body)
    assert persistent[SANDBOX_MODEL_KEY] == {"lifecycle": "persistent"}
    ephemeral = await gateway.start("alice")
    one = json.loads((await gateway.fetch(f"/api/kernels/{ephemeral}", "alice")).body)
    assert one[SANDBOX_MODEL_KEY] == {"lifecycle": "ephemeral"}
    listed = json.loads((await gateway.fetch("/api/kernels", "alice")).body)
    assert {k["id"]: lifecycle(k) for k in listed} == {persistent["id"]: "persistent", ephemeral: "ephemeral"}
    for kernel_id in (persistent["id"], ephemeral):  # persistent ones would outlive the test
        assert (await gateway.fetch(f"/api/kernels/{kernel_id}", "alice", method="DELETE")).code == 204


@pytest.fixture
def make_persistent_spec(jupyter_dirs: dict[str, Path]) -> str:
    """A sandboxed kernelspec whose kernels are persistent."""
    folder = jupyter_dirs["JUPYTER_DATA_DIR"] / "kernels" / "sandboxed-python-persistent"
    folder.mkdir(parents=True)
    spec = {
        "argv": ARGV,
        "display_name": "persistent",
        "language": "python",
        "metadata": {
            "kernel_provisioner": {
                "provisioner_name": "sandbox-provisioner",
                "config": {"lifecycle": "persistent"},
            }
        },
    }
    (folder / "kernel.json").write_text(json.dumps(spec))
    return folder.name


async def test_its_owner_pauses_and_resumes_a_kernel(gateway: Gateway) -> None:
    kernel_id = await gateway.start("alice")
    provisioner = gateway.km.get_kernel(kernel_id).provisioner
    route = f"/api/sandbox-kernel/kernels/{kernel_id}"
    paused = await gateway.fetch(f"{route}/pause", "alice", method="POST", body="")
    assert paused.code == 200, paused.body
    answer = json.loads(paused.body)
    assert answer["state"] == "paused"
    assert answer["paused"]["checkpoint"] == provisioner.paused.checkpoint
    status = json.loads((await gateway.fetch(route, "alice")).body)
    assert status["state"] == "paused"
    assert json.loads((await gateway.fetch(f"{route}/usage", "alice")).body)["cpu_seconds"] is None
    resumed = await gateway.fetch(f"{route}/resume", "alice", method="POST", body="")
    assert (resumed.code, json.loads(resumed.body)) == (200, {"state": "running", "paused": None})
    assert provisioner.paused is None
    gateway.km.get_kernel(kernel_id).provisioner.backend.can_checkpoint = False
    refused = await gateway.fetch(f"{route}/pause", "alice", method="POST", body="")
    assert refused.code == 409, "the host cannot checkpoint: it keeps running"
    assert provisioner.paused is None


async def test_its_owner_reads_a_kernels_usage(gateway: Gateway) -> None:
    kernel_id = await gateway.start("alice", sandbox={"memory": "1g"})
    usage = json.loads((await gateway.fetch(f"/api/sandbox-kernel/kernels/{kernel_id}/usage", "alice")).body)
    # The fake backend's sandboxes have no host process: nothing to read, and it says so.
    assert usage == {
        "state": "running",
        "cpu_seconds": None,
        "memory": {"used": None, "peak": None, "limit": 1024**3},
    }


async def test_its_owner_reads_only_their_kernels_audit_lines(gateway: Gateway, short_tmp: Path) -> None:
    mine, other = await gateway.start("alice"), await gateway.start("bob")
    log = Path(gateway.km.get_kernel(mine).provisioner.policy.audit_log)
    assert log.is_file()
    route = f"/api/sandbox-kernel/kernels/{mine}/audit"
    lines = json.loads((await gateway.fetch(route, "alice")).body)
    assert lines["more"] is False
    assert {line["kernel_id"] for line in lines["lines"]} == {mine}, "none of bob's"
    assert any(line["event"] == "start" and line.get("user") == "alice" for line in lines["lines"])
    assert other in log.read_text(), "his are in the same log"
    last = lines["lines"][-1]["time"]
    later = await gateway.fetch(f"{route}?since={url_escape(last)}", "alice")
    assert json.loads(later.body) == {"lines": [], "more": False}
    unescaped = await gateway.fetch(f"{route}?since={last}", "alice")  # its "+" arrives as a space
    assert json.loads(unescaped.body) == {"lines": [], "more": False}
    for since in ("yesterday", "2026-01-01T00:00:00"):
        bad = await gateway.fetch(f"{route}?since={since}", "alice")
        assert bad.code == 400, since
        assert "since" in message(bad)


def test_audit_lines_are_paged_without_splitting_a_time(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    times = ["2026-01-01T00:00:00.001+00:00"] * 2 + ["2026-01-01T00:00:00.002+00:00"] * 2
    records = [{"event": "x", "time": t, "kernel_id": "k", "n": n} for n, t in enumerate(times)]
    records.insert(1, {"event": "x", "time": times[0], "kernel_id": "other"})
    (tmp_path / "audit.jsonl.1").write_text(json.dumps(records[0]) + "\n" + "not json\n")
    log.write_text("".join(json.dumps(r) + "\n" for r in records[1:]))
    page, more = audit_lines(str(log), 2, "k", None, limit=3)
    assert ([r["n"] for r in page], more) == ([0, 1], True), "the third shares the fourth's time"
    rest, more = audit_lines(str(log), 2, "k", parse_since(page[-1]["time"]), limit=3)
    assert ([r["n"] for r in rest], more) == ([2, 3], False)


async def test_a_gateway_adopts_only_its_users_kernels_no_live_gateway_holds(gateway: Gateway) -> None:
    """What a gateway starting again adopts, and prunes, of what a Docker host runs."""
    km = gateway.km
    gone = server_identity().rsplit("/", 1)[0] + "/1"  # this pid, started at another time: gone
    alive = server_identity(os.getppid())  # another live process: a gateway still serving

    def kernel(**fields: Any) -> SandboxedKernel:
        found: dict[str, Any] = {
            "container_id": "c1",
            "kernel_id": "00000000-0000-4000-8000-000000000001",
            "kernelspec": "sandboxed-python",
            "owner": gone,
            "workspace": "/home/alice",
            "runtime_dir": "/nonexistent/rt",
            "state": "running",
            "created": "",
            "memory_limit": 0,
            "lifecycle": "persistent",
            "server_uid": os.getuid(),
            "owner_seen": time.time(),
            "scope": km.adoption_scope,
            "user": "alice",
        }
        return SandboxedKernel(**{**found, **fields})

    assert km.adoptable(kernel())
    assert km.adoptable(kernel(state="exited", paused=True))
    assert not km.adoptable(kernel(user="")), "a kernel started for no user is no gateway's"
    assert not km.adoptable(kernel(scope="0123456789abcdef")), "another gateway's (its root_dir)"
    assert not km.adoptable(kernel(lifecycle="ephemeral"))
    assert kernel(lifecycle="ephemeral").removable, "an ephemeral kernel of a gateway that is gone"
    for lifecycle_ in ("persistent", "ephemeral"):
        held = kernel(owner=alive, lifecycle=lifecycle_)
        assert not km.adoptable(held), "held by a live gateway"
        assert not held.removable, "nor pruned while that gateway lives"
    server = SandboxMappingKernelManager(
        adopt_persistent_kernels=False, warm_pools=False, keep_sessions=False, root_dir=km.root_dir
    )
    assert not server.adoptable(kernel()), "a notebook server never adopts a user's kernel of a gateway"
    assert server.adoptable(kernel(user=""))


async def test_its_owner_reads_and_writes_the_kernels_workspace_through_the_files_api(
    gateway: Gateway,
) -> None:
    kernel_id = await gateway.start("alice")
    proj = gateway.roots["alice"] / "proj"
    files = f"/api/sandbox-kernel/kernels/{kernel_id}/files"

    put = await gateway.fetch(f"{files}?path=notes/a.txt", "alice", method="PUT", body=b"\x00bytes")
    assert (put.code, json.loads(put.body)) == (200, {"path": "/workspace/proj/notes/a.txt"})
    made = proj / "notes" / "a.txt"
    assert (made.read_bytes(), made.stat().st_uid, (proj / "notes").stat().st_uid) == (
        b"\x00bytes",
        UIDS["alice"],
        UIDS["alice"],
    ), "what the host writes is the kernel's uid's"
    got = await gateway.fetch(f"{files}?path=/workspace/proj/notes/a.txt", "alice")
    assert (got.code, got.body, got.headers["Content-Type"]) == (
        200,
        b"\x00bytes",
        "application/octet-stream",
    )
    listed = json.loads((await gateway.fetch(f"{files}/list?path=notes", "alice")).body)["files"]
    assert [(f["name"], f["path"], f["size"], f["is_dir"]) for f in listed] == [
        ("a.txt", "notes/a.txt", 6, False)
    ]

    # Names kernel code may choose: not UTF-8, listed escaped and taken back as listed.
    (proj / "notes").joinpath(os.fsdecode(b"caf\xe9")).write_bytes(b"latin")
    listed = json.loads((await gateway.fetch(f"{files}/list?path=notes", "alice")).body)["files"]
    odd = next(f for f in listed if f["undecodable"])
    assert odd["path"] == "notes/caf\\xe9"
    assert (await gateway.fetch(f"{files}?path={url_escape(odd['path'])}", "alice")).body == b"latin"

    # What the files API refuses, as it words it.
    (proj / "link").symlink_to("/etc/passwd")
    (proj / "fifo").parent.mkdir(exist_ok=True)
    os.mkfifo(proj / "fifo")
    for path, code, words in [
        ("link", 400, "link"),
        ("fifo", 400, "fifo"),
        ("../../bob/proj/x", 400, ".."),
        ("/etc/passwd", 400, "outside"),
        ("missing.txt", 404, "missing.txt"),
        ("notes", 400, "folder"),
    ]:
        response = await gateway.fetch(f"{files}?path={url_escape(path)}", "alice")
        assert (response.code, words in message(response)) == (code, True), (path, message(response))
        assert "\n" not in message(response)
    assert (await gateway.fetch(f"{files}?path=link", "alice", method="PUT", body=b"x")).code == 400
    assert (proj / "link").is_symlink(), "not replaced"
    assert gateway.app.max_body_size == DEFAULT_MAX_BYTES, "no upload larger than a download may be"
    deep = "/".join(["d"] * 2100)  # over the 4095 bytes of a path the kernel could open
    assert (await gateway.fetch(f"{files}?path={deep}/x", "alice", method="PUT", body=b"x")).code == 400

    tree = "notes/" + "/".join(["d"] * 1000) + "/x"
    assert (await gateway.fetch(f"{files}?path={tree}", "alice", method="PUT", body=b"x")).code == 200
    full = await gateway.fetch(f"{files}?path=notes", "alice", method="DELETE")
    assert full.code == 409
    gone = await gateway.fetch(f"{files}?path=notes&recursive=true", "alice", method="DELETE")
    assert gone.code == 204
    assert not (proj / "notes").exists()


async def test_a_restart_starts_the_kernel_for_its_user_as_the_policy_has_them_now(gateway: Gateway) -> None:
    from dataclasses import replace

    kernel_id = await gateway.start("alice")
    km = gateway.km.get_kernel(kernel_id)
    now = km._launch_args["sandbox_user"]
    km._launch_args["sandbox_user"] = replace(now, groups=("since-removed",), ceilings={"max_memory": "64g"})
    assert (
        await gateway.fetch(f"/api/kernels/{kernel_id}/interrupt", "alice", method="POST", body="")
    ).code == 204
    assert km._launch_args["sandbox_user"] != now, "an interrupt starts nothing"
    assert (
        await gateway.fetch(f"/api/kernels/{kernel_id}/restart", "alice", method="POST", body="")
    ).code == 200
    assert km._launch_args["sandbox_user"] == now
    assert km.provisioner.user == now


# ---------------------------------------------------------------------- per-user warm pools

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a pool attaches workspaces with mounts (root)")


@pytest.fixture
def serve_pooled(
    serve: Callable[..., Awaitable[Gateway]], gateway_args: list[str]
) -> Callable[..., Awaitable[Gateway]]:
    """Serve a gateway whose kernelspec keeps a pool of 1 (on the PoolingBackend)."""
    gateway_args[:] = [
        arg for arg in gateway_args if not arg.startswith("--SandboxProvisioner.backend_class")
    ]
    gateway_args += [
        f"--SandboxProvisioner.backend_class={__name__}.PoolingBackend",
        "--SandboxProvisioner.pool_size=1",
    ]
    return serve


async def pools_filled(gateway: Gateway, *users: str) -> dict[str, int]:
    """Once the gateway has planned its pools (before it serves) and filled them, how many
    sandboxes of sandboxed-python wait for each user."""
    await gateway.km._adopting  # type: ignore[attr-defined]
    pool, waiting = SandboxPool.instance(), {}
    for kernelspec in gateway.km.kernel_spec_manager.find_kernel_specs():
        for user in users:
            ready = await asyncio.to_thread(pool.wait_ready, kernelspec, 1, 10.0, user)
            if kernelspec == "sandboxed-python":
                waiting[user] = ready
    return waiting


def pooled_sandboxes() -> list[FakeSandbox]:
    """The pooled sandboxes waiting on the PoolingBackend's host."""
    return [box for box in PoolingBackend.shared.values() if box.status == "running" and box.spec.slot]


@needs_root
async def test_a_listed_users_start_claims_a_ready_sandbox_of_their_own_and_nobody_elses(
    serve_pooled: Callable[..., Awaitable[Gateway]], capfd: pytest.CaptureFixture[str]
) -> None:
    users = (
        "--GatewayKernelManagerForUsers.pool_users=alice",
        "--GatewayKernelManagerForUsers.pool_users=carol",
    )
    gateway = await serve_pooled(*users)
    assert await pools_filled(gateway, "alice", "bob") == {"alice": 1, "bob": 0}
    assert "No sandbox pool for user 'carol'" in capfd.readouterr().err, (
        "a name the policy refuses is skipped"
    )
    km, pool = gateway.km, SandboxPool.instance()
    waiting = next(box for box in pooled_sandboxes() if box.spec.kernelspec == "sandboxed-python")
    assert (waiting.spec.uid, waiting.spec.labels[LABEL_USER]) == (UIDS["alice"], "alice")

    bobs = await gateway.start("bob")
    assert not km.get_kernel(bobs).provisioner.from_pool
    why = "starting cold, not from the pool of sandboxed-python: no pool planned for user bob"
    assert why in capfd.readouterr().err
    assert pool.ready("sandboxed-python", "alice") == 1, "bob's start took nothing of alice's"

    # A start of hers checks its folder as a cold one does (here past the handler's check).
    alice = KernelUser("alice", UIDS["alice"], UIDS["alice"], gateway.roots["alice"])
    one = km.kernel_manager_factory(parent=km, kernel_name="sandboxed-python")
    with pytest.raises(WorkspaceError, match="is outside your sandbox workspace"):
        await one.start_kernel(cwd=str(gateway.roots["bob"] / "proj"), sandbox_user=alice)
    assert pool.ready("sandboxed-python", "alice") == 1, "a refused folder is refused, warm or not"

    alices = await gateway.start("alice")
    provisioner = km.get_kernel(alices).provisioner
    assert provisioner.from_pool
    assert provisioner.site.container_id == waiting.id
    spec = provisioner.site.spec
    assert (spec.uid, spec.workspace) == (UIDS["alice"], gateway.roots["alice"].resolve())
    assert PoolingBackend.claims[waiting.id]["cwd"] == spec.workdir == "/workspace/alice/proj"


@needs_root
@pytest.mark.parametrize(
    "bound", ["--SandboxProvisioner.max_pool_size=1", "--SandboxProvisioner.max_pool_memory=3g"]
)
async def test_all_users_pools_together_keep_to_the_pool_ceilings(
    serve_pooled: Callable[..., Awaitable[Gateway]], caplog: pytest.LogCaptureFixture, bound: str
) -> None:
    users = (
        "--GatewayKernelManagerForUsers.pool_users=alice",
        "--GatewayKernelManagerForUsers.pool_users=bob",
    )
    with caplog.at_level(logging.INFO):
        gateway = await serve_pooled(*users, bound)
        filled = await pools_filled(gateway, "alice", "bob")
    kernelspecs = [box.spec.kernelspec for box in pooled_sandboxes()]
    if "max_pool_size" in bound:  # one sandbox per kernelspec, for one of the two users
        assert sorted(filled.values()) == [0, 1]
        assert sorted(kernelspecs) == sorted(set(kernelspecs))
    else:  # one sandbox (of 2g) in all
        assert len(kernelspecs) == 1
    assert "not starting more" in caplog.text


def _nudged(self: Any) -> asyncio.Future[None]:
    """jupyter_server's nudge of a new connection, answered at once (the fake backend's
    kernels answer nothing)."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done


def _alices_socket(gateway: Gateway, kernel_id: str) -> HTTPRequest:
    """The request of a websocket of alice's to the kernel's channels, session ``S``."""
    url = gateway.url.replace("http", "ws", 1) + f"/api/kernels/{kernel_id}/channels?session_id=S"
    return HTTPRequest(url, headers={"Authorization": f"token {gateway.tokens['alice']}"})


async def test_a_connection_replaced_before_it_opened_gives_the_kernel_no_second_client(
    serve: Callable[..., Awaitable[Gateway]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """JupyterLab opens a kernel's socket twice, 0.1 s apart, with one session id. Each
    becomes a connection to the gateway. When the first is still in its handshake as the
    second arrives, jupyter_server's "Replacing stale connection" closes nothing (a socket
    not yet open cannot be closed), and both go on to open. The kernel's channels then have
    two clients with the same identity, and the bridge's ROUTER gives that identity to the
    last one that connected: if that was the stale one, the live socket's requests are never
    answered, and its cell shows [*] for ever. The stale connection must close instead.

    (Its handshake is refused before that, as the next test has it: jupyter_server 2.21 goes from
    the handshake to opening the socket without letting another connection in between. This is
    the check at opening, for a jupyter_server that does, with the handshake's own taken away.)"""
    from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

    from sandbox_kernel.jupyter.connection_state import StateOnConnectWebsocketConnection
    from sandbox_kernel.jupyter.server_audit import AuditedWebsocketConnection

    monkeypatch.setattr(AuditedWebsocketConnection, "prepare", ZMQChannelsWebsocketConnection.prepare)

    # (The fake backend's kernels answer no kernel_info: the handshake waits this long for it.)
    gateway = await serve("--MappingKernelManager.kernel_info_timeout=0.5")
    kernel_id = await gateway.start("alice")
    first_registered, let_first_on = asyncio.Event(), asyncio.Event()
    register = StateOnConnectWebsocketConnection._register_session

    async def slow_first(self: StateOnConnectWebsocketConnection) -> None:
        await register(self)
        if not first_registered.is_set():
            first_registered.set()
            await let_first_on.wait()  # e.g. its user's token still being asked about

    monkeypatch.setattr(StateOnConnectWebsocketConnection, "_register_session", slow_first)
    monkeypatch.setattr(ZMQChannelsWebsocketConnection, "nudge", _nudged)
    socket = _alices_socket(gateway, kernel_id)
    first = asyncio.ensure_future(websocket_connect(socket))
    await asyncio.wait_for(first_registered.wait(), 30)
    second = await websocket_connect(socket)
    let_first_on.set()
    stale = await asyncio.wait_for(first, 30)
    assert await asyncio.wait_for(stale.read_message(), 10) is None, "the stale connection is closed"
    assert gateway.km._kernel_connections[kernel_id] == 1, "the live one is the kernel's only client"
    second.close()


async def test_a_connection_replaced_in_its_handshake_is_refused_before_it_opens(
    serve: Callable[..., Awaitable[Gateway]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of JupyterLab's two sockets of one session, the one it keeps may be the one the gateway
    registered first, when both come through the user's server. Opened, then closed for its
    newer twin, it would lose what the user's server sent into it at once (what the browser said
    while the gateway was being dialled). Its handshake is refused instead (409), before the
    upgrade: the user's server keeps holding those messages and dials again. The request for the
    kernel's kernel_info it made is let go of too, or later handshakes would wait on it."""
    from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

    from sandbox_kernel.jupyter.connection_state import StateOnConnectWebsocketConnection

    # (The fake backend's kernels answer no kernel_info: the handshake waits this long for it.)
    gateway = await serve("--MappingKernelManager.kernel_info_timeout=0.5")
    kernel_id = await gateway.start("alice")
    first_asked, let_first_on = asyncio.Event(), asyncio.Event()
    asking: list[StateOnConnectWebsocketConnection] = []
    request = StateOnConnectWebsocketConnection.request_kernel_info

    def slow_first(self: StateOnConnectWebsocketConnection) -> Any:
        if first_asked.is_set():
            return request(self)
        self.kernel_info_timeout = 60  # (its handshake waits for let_first_on, not for this)
        request(self)  # the kernel's request, which the second connection waits on
        asking.append(self)
        first_asked.set()
        return asyncio.ensure_future(let_first_on.wait())  # e.g. a kernel slow to answer

    monkeypatch.setattr(StateOnConnectWebsocketConnection, "request_kernel_info", slow_first)
    monkeypatch.setattr(ZMQChannelsWebsocketConnection, "nudge", _nudged)
    socket = _alices_socket(gateway, kernel_id)
    first = asyncio.ensure_future(websocket_connect(socket))
    await asyncio.wait_for(first_asked.wait(), 30)
    asked = asking[0]._kernel_info_future
    second = await websocket_connect(socket)
    let_first_on.set()
    with pytest.raises(HTTPClientError) as refused:
        await asyncio.wait_for(first, 30)
    assert refused.value.code == 409
    assert gateway.km._kernel_connections[kernel_id] == 1, "the live one is the kernel's only client"
    assert asked.done(), "nothing is left waiting on the request it made"
    assert not hasattr(gateway.km.get_kernel(kernel_id), "_kernel_info_future"), "the next one asks anew"
    second.close()


async def test_a_replaced_connection_leaves_no_kernel_info_request_pending(
    serve: Callable[..., Awaitable[Gateway]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection that asked the kernel for its kernel_info, then gave way to a newer one of
    its session, closes the request's channel: its future, which later handshakes of the kernel
    wait on, must then be resolved, as jupyter_server resolves it for a connection that closes
    before the kernel answered, or they wait on a reply that cannot come."""
    from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

    from sandbox_kernel.jupyter.connection_state import StateOnConnectWebsocketConnection

    # (The fake backend's kernels answer no kernel_info: the handshake waits this long for it.)
    gateway = await serve("--MappingKernelManager.kernel_info_timeout=0.5")
    kernel_id = await gateway.start("alice")
    first_asked, let_first_on = asyncio.Event(), asyncio.Event()
    prepared: list[StateOnConnectWebsocketConnection] = []
    prepare = StateOnConnectWebsocketConnection.prepare

    async def slow_first(self: StateOnConnectWebsocketConnection) -> None:
        await prepare(self)  # registered, asked for the kernel_info, gave up waiting
        prepared.append(self)
        if not first_asked.is_set():
            first_asked.set()
            await let_first_on.wait()

    monkeypatch.setattr(StateOnConnectWebsocketConnection, "prepare", slow_first)
    monkeypatch.setattr(ZMQChannelsWebsocketConnection, "nudge", _nudged)
    socket = _alices_socket(gateway, kernel_id)
    first = asyncio.ensure_future(websocket_connect(socket))
    await asyncio.wait_for(first_asked.wait(), 30)
    asked = prepared[0]._kernel_info_future
    assert gateway.km.get_kernel(kernel_id)._kernel_info_future is asked, "the kernel's pending request"
    second = await websocket_connect(socket)
    let_first_on.set()
    stale = await asyncio.wait_for(first, 30)
    assert await asyncio.wait_for(stale.read_message(), 10) is None, "the stale connection is closed"
    for _ in range(100):  # (the gateway's side closes once the client's close frame is in)
        if asked.done():
            break
        await asyncio.sleep(0.05)
    assert asked.done(), "nothing is left waiting on the request it closed"
    assert not hasattr(gateway.km.get_kernel(kernel_id), "_kernel_info_future"), "the next one asks anew"
    second.close()
