"""A user's Jupyter server on a kernel gateway, with the client part (no Docker).

The "gateway" is a stock ``jupyter server`` with a token (optionally TLS, with a CA made
here), running plain ipykernel kernels; its kernel models say how it keeps each kernel, as a
sandbox gateway's do (``SANDBOX_MODEL_KEY``). The user's server is a second ``jupyter server``
with ``--gateway-url`` and the package's client classes. Each test drives them the way
JupyterLab and nbclient do.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from jupyter_core.utils import run_sync
from jupyter_server.gateway.gateway_client import GatewayClient
from jupyter_server.services.kernels.connection.base import (
    deserialize_binary_message,
    serialize_binary_message,
)
from nbclient import NotebookClient
from tornado.httpclient import HTTPRequest
from tornado.websocket import WebSocketClientConnection, websocket_connect

from sandbox_kernel.jupyter.gateway_client import SANDBOX_MODEL_KEY, SandboxGatewayKernelManager
from sandbox_kernel.jupyter.gateway_link import CLOSE_CODE

from .test_jupyter_server import free_port

PLAIN = "plain-python"
PERSISTENT = "plain-python-persistent"
CLIENT_MANAGER = "sandbox_kernel.jupyter.gateway_client.SandboxGatewayMappingKernelManager"

#: The gateway's kernel manager: stock, plus the model key a sandbox gateway adds.
MARKING_MANAGER = f"""
from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager


class MarkingKernelManager(AsyncMappingKernelManager):
    def kernel_model(self, kernel_id):
        model = super().kernel_model(kernel_id)
        persistent = self.get_kernel(kernel_id).kernel_name == {PERSISTENT!r}
        model[{SANDBOX_MODEL_KEY!r}] = {{"lifecycle": "persistent" if persistent else "ephemeral"}}
        return model
"""

#: Kernel code: a comm target that says which buffers its comm_open brought, and echoes
#: every comm message's buffers back.
ECHO_TARGET = """
import comm

def _echo_target(c, open_msg):
    c.send({"opened_with": [bytes(b).hex() for b in open_msg["buffers"]]})

    @c.on_msg
    def _echo(msg):
        c.send({"echo": True}, buffers=msg["buffers"])

comm.get_comm_manager().register_target("echo", _echo_target)
"""


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    """Poll ``condition`` until it returns something true; that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


class Server:
    """A ``jupyter server`` subprocess on loopback."""

    def __init__(
        self,
        name: str,
        tmp: Path,
        args: list[str],
        scheme: str = "http",
        ca: Path | None = None,
        like: Server | None = None,
    ) -> None:
        self.token = like.token if like else secrets.token_hex(16)
        self.port = like.port if like else free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.verify: str | bool = str(ca) if ca else True
        self.log = tmp / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER_")}
        env.update(
            JUPYTER_PATH=str(tmp / "share"),
            JUPYTER_CONFIG_DIR=str(tmp / f"config-{name}"),
            JUPYTER_DATA_DIR=str(tmp / f"data-{name}"),
            JUPYTER_RUNTIME_DIR=str(tmp / f"runtime-{name}"),
            PYTHONPATH=str(tmp / "modules"),
        )
        (tmp / f"root-{name}").mkdir(exist_ok=True)
        command = [
            str(Path(sys.executable).with_name("jupyter")),
            "server",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={tmp / f'root-{name}'}",
            *args,
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._answers, f"{name} to answer at {self.url}")

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"the server exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
        try:
            self.api("GET", "/api/status")
        except requests.RequestException:
            return False
        return True

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        response = requests.request(
            method,
            self.url + path,
            headers={"Authorization": f"token {self.token}"},
            timeout=60,
            verify=self.verify,
            **kwargs,
        )
        response.raise_for_status()
        return response.json() if response.content else None

    def kernel_pids(self) -> set[int]:
        return {child.pid for child in psutil.Process(self.proc.pid).children(recursive=True)}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> float:
        """Signal the server; seconds it took to exit (SIGKILL after ``timeout``)."""
        if self.proc.poll() is not None:
            return 0.0
        kernels = self.kernel_pids()
        start = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        took = time.monotonic() - start
        # Kernels of a server killed outright exit when they see their parent gone.
        wait_for(
            lambda: not any(psutil.pid_exists(pid) for pid in kernels), "the server's kernels to exit", 30
        )
        return took


def make_tls(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (ca.pem, cert.pem, key.pem)."""
    folder.mkdir()
    now = datetime.datetime.now(datetime.timezone.utc)
    window = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test gateway CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(window[0])
        .not_valid_after(window[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(*[False] * 5, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(window[0])
        .not_valid_after(window[1])
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    paths[0].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


class Proxy:
    """A TCP relay on loopback to ``port`` whose connections can be cut: a network blip between
    the user's server and the gateway."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.lock = threading.Lock()
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """End every connection relayed now (new ones still get through)."""
        with self.lock:
            cut, self.open = self.open, []
        for end in cut:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.cut()


class Setup:
    """Kernelspecs, the gateway's manager module, and the servers started (all stopped at the end)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.servers: list[Server] = []
        for name in (PLAIN, PERSISTENT):
            folder = tmp / "share" / "kernels" / name
            folder.mkdir(parents=True)
            argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
            (folder / "kernel.json").write_text(
                json.dumps({"argv": argv, "display_name": name, "language": "python"})
            )
        (tmp / "modules").mkdir()
        (tmp / "modules" / "marking.py").write_text(MARKING_MANAGER)
        self.tls: tuple[Path, Path, Path] | None = None

    def gateway(self, tls: bool = False, like: Server | None = None) -> Server:
        """A gateway (``like`` an earlier one: its port and token, its kernels gone)."""
        args = ["--ServerApp.kernel_manager_class=marking.MarkingKernelManager"]
        if tls:
            self.tls = self.tls or make_tls(self.tmp / "pki")
            args += [f"--ServerApp.certfile={self.tls[1]}", f"--ServerApp.keyfile={self.tls[2]}"]
        ca = self.tls[0] if tls and self.tls else None
        server = Server("gateway", self.tmp, args, "https" if tls else "http", ca, like)
        self.servers.append(server)
        return server

    def user_server(
        self,
        gateway: Server,
        name: str = "user",
        retry_max: int = 2,
        via: Proxy | None = None,
        like: Server | None = None,
    ) -> Server:
        """A user's server on ``gateway`` (``like`` an earlier one: its port, token and folders)."""
        url = f"http://127.0.0.1:{via.port}" if via else gateway.url
        args = [
            f"--gateway-url={url}",
            f"--GatewayClient.auth_token={gateway.token}",
            f"--ServerApp.kernel_manager_class={CLIENT_MANAGER}",
            f"--GatewayClient.gateway_retry_max={retry_max}",
            "--GatewayClient.gateway_retry_interval=0.2",
            "--GatewayClient.gateway_retry_interval_max=1",
            "--SandboxGatewayMappingKernelManager.gateway_wait=3",
        ]
        if gateway.url.startswith("https") and self.tls:
            args.append(f"--GatewayClient.ca_certs={self.tls[0]}")
        server = Server(name, self.tmp, args, like=like)
        self.servers.append(server)
        return server

    def close(self) -> None:
        for server in reversed(self.servers):
            server.stop()


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    made = Setup(tmp_path)
    try:
        yield made
    finally:
        made.close()


def ws_message(msg_type: str, content: dict[str, Any], buffers: list[bytes] | None = None) -> str | bytes:
    """A shell message as JupyterLab's legacy websocket protocol sends it: JSON text, or, with
    buffers, jupyter_server's binary serialization."""
    msg = {
        "header": {
            "msg_id": uuid.uuid4().hex,
            "msg_type": msg_type,
            "username": "analyst",
            "session": uuid.uuid4().hex,
            "version": "5.3",
            "date": "",
        },
        "parent_header": {},
        "metadata": {},
        "channel": "shell",
        "content": content,
    }
    if buffers:
        return serialize_binary_message({**msg, "buffers": buffers})  # type: ignore[no-any-return]
    return json.dumps(msg)


async def open_kernel_socket(server: Server, kernel_id: str) -> WebSocketClientConnection:
    url = (
        server.url.replace("http", "ws", 1)
        + f"/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}"
    )
    return await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {server.token}"}))


async def read_until(
    conn: WebSocketClientConnection, wanted: Callable[[dict[str, Any], bool], bool], timeout: float = 60
) -> dict[str, Any]:
    """Read frames until one, decoded, is ``wanted(msg, came_binary)``; that message."""
    deadline = time.monotonic() + timeout
    while True:
        frame = await asyncio.wait_for(conn.read_message(), max(0.1, deadline - time.monotonic()))
        assert frame is not None, f"the kernel socket closed ({conn.close_code}: {conn.close_reason})"
        binary = isinstance(frame, bytes)
        msg = deserialize_binary_message(frame) if binary else json.loads(frame)
        if wanted(msg, binary):
            return msg  # type: ignore[no-any-return]


async def execute(conn: WebSocketClientConnection, code: str) -> None:
    request = ws_message("execute_request", {"code": code, "silent": False, "store_history": False})
    msg_id = json.loads(request)["header"]["msg_id"]
    conn.write_message(request)
    reply = await read_until(
        conn, lambda m, _: m["msg_type"] == "execute_reply" and m["parent_header"]["msg_id"] == msg_id
    )
    assert reply["content"]["status"] == "ok", reply["content"]


async def test_comm_buffers_pass_both_ways_through_the_users_server(setup: Setup) -> None:
    gateway = setup.gateway()
    user = setup.user_server(gateway)
    kernel = user.api("POST", "/api/kernels", json={"name": PLAIN})
    conn = await open_kernel_socket(user, kernel["id"])
    try:
        await execute(conn, ECHO_TARGET)
        comm_id = uuid.uuid4().hex
        opening = b"\x00\xff\xfe\x80client-binary"  # not UTF-8: it must travel as bytes
        conn.write_message(
            ws_message("comm_open", {"comm_id": comm_id, "target_name": "echo", "data": {}}, [opening]),
            binary=True,
        )
        opened = await read_until(
            conn, lambda m, _: m["msg_type"] == "comm_msg" and "opened_with" in m["content"]["data"]
        )
        assert opened["content"]["data"]["opened_with"] == [opening.hex()], (
            "the browser's buffer reached the kernel"
        )

        payload = bytes(range(256))
        conn.write_message(ws_message("comm_msg", {"comm_id": comm_id, "data": {}}, [payload]), binary=True)
        echoed = await read_until(
            conn, lambda m, _: m["msg_type"] == "comm_msg" and m["content"]["data"].get("echo")
        )
        assert [bytes(b) for b in echoed["buffers"]] == [payload], "the kernel's buffer reached the browser"
        await execute(conn, "1 + 1")  # the relay still works after binary frames
    finally:
        conn.close()
    assert user.api("GET", f"/api/sandbox-kernel/kernels/{kernel['id']}") == {"sandboxed": False}, (
        "the status route asks the gateway (where this plain kernel is not sandboxed)"
    )


def test_nbclient_runs_a_notebook_against_the_token_protected_gateway(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway = setup.gateway(tls=True)  # CA-only TLS for programs, too
    assert setup.tls is not None
    monkeypatch.setenv("KERNEL_LAUNCH_TIMEOUT", "40")  # GatewayClient writes it into os.environ
    GatewayClient.clear_instance()
    GatewayClient.instance(url=gateway.url, auth_token=gateway.token, ca_certs=str(setup.tls[0]))
    km = SandboxGatewayKernelManager(kernel_name=PLAIN)
    cells = [
        # A message with buffers (a widget's image, say) comes as a binary frame.
        "import comm; c = comm.create_comm(target_name='nobody', data={}, buffers=[b'\\x00\\xff'])",
        "print('ran', 6 * 7)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code) for code in cells])
    client = NotebookClient(nb, km=km, timeout=60)
    try:
        client.execute()
        assert nb.cells[1].outputs[0]["text"] == "ran 42\n"
        assert [k["name"] for k in gateway.api("GET", "/api/kernels")] == [PLAIN]
    finally:
        if client.kc is not None:
            client.kc.stop_channels()
        run_sync(km.shutdown_kernel)()
        GatewayClient.clear_instance()
    assert gateway.api("GET", "/api/kernels") == []


async def test_a_user_server_reaches_a_tls_gateway_with_a_ca_and_no_client_certificate(setup: Setup) -> None:
    gateway = setup.gateway(tls=True)
    user = setup.user_server(gateway)
    assert PLAIN in user.api("GET", "/api/kernelspecs")["kernelspecs"]
    kernel = user.api("POST", "/api/kernels", json={"name": PLAIN})
    conn = await open_kernel_socket(user, kernel["id"])
    try:
        await execute(conn, "x = 1")
    finally:
        conn.close()


async def test_a_lost_gateway_closes_the_browsers_socket_with_a_reason(setup: Setup) -> None:
    gateway = setup.gateway()
    user = setup.user_server(gateway)
    kernel = user.api("POST", "/api/kernels", json={"name": PLAIN})
    conn = await open_kernel_socket(user, kernel["id"])
    await execute(conn, "x = 1")
    gateway.stop(signal.SIGKILL)
    # Two redials of at most 0.2 * 2 + 1 s each, plus the refused dials: well within 20 s.
    deadline = time.monotonic() + 20
    while await asyncio.wait_for(conn.read_message(), deadline - time.monotonic()) is not None:
        pass  # what the kernel sent before the gateway died
    assert conn.close_code == CLOSE_CODE
    assert conn.close_reason == "sandbox gateway unreachable (gave up after 2 retries)"
    status = user.api("GET", f"/api/sandbox-kernel/kernels/{kernel['id']}")
    assert status["sandboxed"] is True
    assert status["gateway"]["reachable"] is False
    assert status["gateway"]["url"] == gateway.url
    assert "refused" in status["gateway"]["reason"].lower(), status


async def test_a_dropped_gateway_connection_is_redialled_and_what_the_browser_sent_meanwhile_arrives(
    setup: Setup,
) -> None:
    gateway = setup.gateway()
    proxy = Proxy(gateway.port)
    try:
        user = setup.user_server(gateway, via=proxy)
        kernel = user.api("POST", "/api/kernels", json={"name": PLAIN})
        conn = await open_kernel_socket(user, kernel["id"])
        await execute(conn, "x = 41")
        proxy.cut()
        wait_for(lambda: "Lost the connection to the sandbox gateway" in user.log.read_text(), "the loss")
        await execute(conn, "x += 1; assert x == 42")  # sent before the redial, held until it
        assert conn.close_code is None
        conn.close()
    finally:
        proxy.close()


async def test_a_gateway_back_without_the_kernel_refuses_it_and_the_browser_is_told(setup: Setup) -> None:
    gateway = setup.gateway()
    user = setup.user_server(gateway, retry_max=60)  # about a minute: time for the gateway to restart
    kernel = user.api("POST", "/api/kernels", json={"name": PLAIN})
    conn = await open_kernel_socket(user, kernel["id"])
    await execute(conn, "x = 1")
    gateway.stop(signal.SIGKILL)
    setup.gateway(like=gateway)  # same port and token, no kernels
    deadline = time.monotonic() + 30
    while await asyncio.wait_for(conn.read_message(), deadline - time.monotonic()) is not None:
        pass
    assert (conn.close_code, conn.close_reason) == (
        CLOSE_CODE,
        "the sandbox gateway refused the kernel's connection (HTTP 404)",
    )


def test_a_user_server_stops_at_once_while_its_gateway_is_down(setup: Setup) -> None:
    gateway = setup.gateway()
    user = setup.user_server(gateway)
    user.api("POST", "/api/kernels", json={"name": PLAIN})
    gateway.stop(signal.SIGKILL)
    took = user.stop(timeout=30)
    assert user.proc.returncode == 0, user.log.read_text()[-2000:]
    assert took < 15, f"the user's server took {took:.1f} s to stop"


def test_a_restarted_user_server_finds_its_kernels_and_sessions_again(setup: Setup) -> None:
    gateway = setup.gateway()
    user = setup.user_server(gateway)
    notebook = {"path": "analysis.ipynb", "name": "analysis.ipynb", "type": "notebook"}
    session = user.api("POST", "/api/sessions", json={**notebook, "kernel": {"name": PERSISTENT}})
    persistent = session["kernel"]["id"]
    ephemeral = user.api("POST", "/api/kernels", json={"name": PLAIN})["id"]
    assert {k["id"] for k in user.api("GET", "/api/kernels")} == {persistent, ephemeral}
    user.stop()
    assert [k["id"] for k in gateway.api("GET", "/api/kernels")] == [persistent], (
        "a stopping server shuts its ephemeral kernels down and lets go of persistent ones"
    )
    again = setup.user_server(gateway, like=user)
    assert [k["id"] for k in again.api("GET", "/api/kernels")] == [persistent]
    sessions = again.api("GET", "/api/sessions")
    assert [(s["path"], s["kernel"]["id"]) for s in sessions] == [("analysis.ipynb", persistent)], (
        "the notebook's session still names its kernel"
    )
    status = again.api("GET", f"/api/sandbox-kernel/kernels/{persistent}")
    assert status == {"sandboxed": False}
