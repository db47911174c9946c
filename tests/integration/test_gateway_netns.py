"""A separate sandbox machine, for real: the gateway in a network namespace of its own.

The sandbox host is the namespace ``sk-sbx`` (10.77.0.2/30, across a veth pair from the root
namespace's 10.77.0.1/30); ``jupyter sandbox-kernel gateway`` runs there as root over TLS
(``init-tls --ip 10.77.0.2``), with a tokens-file user. The user's JupyterLab runs in the root
namespace, as that user when ``/opt/sk-user-venv`` exists (``.ci/setup`` makes it; else as
root from the project's venv), and reaches ``https://10.77.0.2:8870`` verifying only the CA.
Chromium opens a notebook on the gateway's persistent "Sandboxed Python"; the gateway is
killed outright (the status bar says the sandbox host is unreachable) and started again (it
adopts the kernel): the reconnected notebook says its kernel is idle, and the same page runs
the next cell with the kernel's variables, without a reload. Both namespaces share the host's
Docker (a unix socket), as "the gateway host has Docker" needs; only the network between them
is what a second machine would have.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
from playwright.sync_api import Browser, WebSocketRoute, expect

from sandbox_kernel.backends.docker import DockerBackend
from sandbox_kernel.lifecycle.ownership import list_kernels, remove_kernel

from .conftest import stop_process
from .test_gateway import cli
from .test_jupyter_server import Server, free_port
from .test_lab_browser import ARTIFACTS, LAB_CONFIG, Lab
from .test_lab_browser import browser as browser  # Debian's chromium, headless

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.getuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"),
]

NETNS = "sk-sbx"
VETH_HOST, VETH_SANDBOX = "sk-sbx-host", "sk-sbx-gw"
HOST_IP, GATEWAY_IP, PORT = "10.77.0.1", "10.77.0.2", 8870
USER = "sk-net-alice"
USER_VENV = Path("/opt/sk-user-venv")
CLIENT_MANAGER = "sandbox_kernel.jupyter.gateway_client.SandboxGatewayMappingKernelManager"
GATEWAY_COMMAND = str(Path(sys.executable).with_name("jupyter-sandbox-kernel"))
#: The status item's text while the gateway does not answer (labextension/src/index.ts).
LOST_TEXT = "sandbox host unreachable: retrying"
#: One status poll (3 s, labextension/src/index.ts), plus the route's answer and some slack.
ONE_POLL_MS = 8_000
#: The status item with the kernel's figures ("gVisor · no network · 0.1/2.0 GiB").
FIGURES = re.compile(r"^gVisor · no network · [\d.\u2013]+/")
#: The notebook toolbar's kernel status (JupyterLab's execution indicator: data-status="idle").
TOOLBAR_STATUS = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _remove_network() -> None:
    """What this test (or a crashed run of it) made: the namespace and the veth pair."""
    subprocess.run(["ip", "link", "del", VETH_HOST], check=False, capture_output=True)
    subprocess.run(["ip", "netns", "del", NETNS], check=False, capture_output=True)


def _not_in_use() -> None:
    """Fail at once if another run of this test is under way: its namespace, veth and user
    are this one's (removing them would break it)."""
    busy = subprocess.run(["ip", "netns", "pids", NETNS], check=False, capture_output=True, text=True)
    running = subprocess.run(["pgrep", "-u", USER], check=False, capture_output=True, text=True)
    if busy.stdout.split() or running.stdout.split():
        pids = " ".join([*busy.stdout.split(), *running.stdout.split()])
        pytest.fail(f"another run of this test holds {NETNS} or {USER} (pids {pids}): run one at a time")


@pytest.fixture
def sandbox_host() -> Iterator[str]:
    """The network namespace standing in for the sandbox machine, 10.77.0.2 across a veth."""
    _not_in_use()
    _remove_network()
    try:
        ip("netns", "add", NETNS)
        ip("link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_SANDBOX)
        ip("link", "set", VETH_SANDBOX, "netns", NETNS)
        ip("addr", "add", f"{HOST_IP}/30", "dev", VETH_HOST)
        ip("link", "set", VETH_HOST, "up")
        ip("-n", NETNS, "addr", "add", f"{GATEWAY_IP}/30", "dev", VETH_SANDBOX)
        ip("-n", NETNS, "link", "set", VETH_SANDBOX, "up")
        ip("-n", NETNS, "link", "set", "lo", "up")
        yield NETNS
    finally:
        _remove_network()


@pytest.fixture
def user() -> Iterator[pwd.struct_passwd]:
    """A real local user with a project folder (home 0700), in no privileged group."""
    subprocess.run(["userdel", "-r", USER], check=False, capture_output=True)  # a crashed run's
    subprocess.run(["useradd", "-m", "-s", "/bin/bash", USER], check=True)
    try:
        account = pwd.getpwnam(USER)
        Path(account.pw_dir).chmod(0o700)
        project = Path(account.pw_dir) / "proj"
        project.mkdir()
        os.chown(project, account.pw_uid, account.pw_gid)
        yield account
    finally:
        subprocess.run(["userdel", "-r", USER], check=False, capture_output=True)


@dataclass
class Gateway:
    """The gateway on the sandbox host: started, killed and started again with one config."""

    netns: str
    config: Path
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    ca: Path = field(init=False)

    def __post_init__(self) -> None:
        self.ca = self.config.parent / "pki" / "ca.pem"

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(  # our own command, in the sandbox host's namespace
                ["ip", "netns", "exec", self.netns, GATEWAY_COMMAND, "gateway", f"--config={self.config}"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        deadline = time.monotonic() + 60
        while True:  # from the root namespace, across the veth: as the users' servers reach it
            assert self.process.poll() is None, self.log.read_text()
            try:
                with socket.create_connection((GATEWAY_IP, PORT), timeout=1):
                    return
            except OSError:
                assert time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: the machine's gateway dies with no chance to tidy up."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)


@pytest.fixture
def gateway(sandbox_host: str, user: pwd.struct_passwd, tmp_path: Path) -> Iterator[tuple[Gateway, str]]:
    """The gateway's files as on the sandbox host (TLS for 10.77.0.2, a token for the user,
    the persistent variant of the shipped kernelspec), the gateway started; and the token."""
    private = tmp_path / "gw"
    private.mkdir(mode=0o700)
    env = {
        **os.environ,
        "JUPYTER_PATH": str(private / "prefix" / "share" / "jupyter"),
        "JUPYTER_CONFIG_DIR": str(private / "config"),
        "JUPYTER_DATA_DIR": str(private / "data-home"),
        "JUPYTER_RUNTIME_DIR": str(private / "runtime"),
    }
    # The persistent variant of the shipped kernelspec, as the docs install it (into a prefix).
    cli("install", f"--prefix={private / 'prefix'}", "--lifecycle=persistent", env=env)
    cli(
        "gateway",
        "init-tls",
        f"--dir={private / 'pki'}",
        "--hostname=sandbox-host",
        f"--ip={GATEWAY_IP}",
        env=env,
    )
    tokens_file = private / "tokens.json"
    token = cli("gateway", "add-token", user.pw_name, f"--tokens-file={tokens_file}", env=env).strip()
    config = private / "jupyter_sandbox_gateway_config.py"
    config.write_text(
        "\n".join(
            [
                f'c.ServerApp.ip = "{GATEWAY_IP}"',
                f"c.ServerApp.port = {PORT}",
                f'c.ServerApp.certfile = "{private / "pki" / "server.pem"}"',
                f'c.ServerApp.keyfile = "{private / "pki" / "server-key.pem"}"',
                f'c.ServerApp.root_dir = "{private}"',
                f'c.TokensFileIdentityProvider.path = "{tokens_file}"',
                'c.UserPolicy.workspace_root = "/home/{username}"',
                "",
            ]
        )
    )
    served = Gateway(sandbox_host, config, env, private / "gateway.log")
    try:
        served.start()
        yield served, token
    finally:
        served.stop()
        print(served.log.read_text())  # shown when a test fails


class UserServer:
    """The user's JupyterLab in the root namespace, on the gateway across the veth: started,
    killed and started again on one port, with one token."""

    def __init__(self, command: list[str], env: dict[str, str], home: Path, log: Path) -> None:
        self.command = command
        self.env = env
        self.home = home
        self.log = log
        self.server = Server(f"http://127.0.0.1:{free_port()}", env["JUPYTER_TOKEN"])
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        port = self.server.url.rsplit(":", 1)[1]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(  # the user's own server
                [
                    *self.command,
                    "--no-browser",
                    f"--port={port}",
                    "--ip=127.0.0.1",
                    f"--ServerApp.root_dir={self.home / 'proj'}",
                    "--ServerApp.port_retries=0",
                ],
                env=self.env,
                cwd=self.home,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 90
        while True:
            assert self.process.poll() is None, self.log.read_text()
            try:
                self.server.api("GET", "/api/status")
                return
            except requests.RequestException:
                assert time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.3)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, timeout=30)


@pytest.fixture
def user_server(gateway: tuple[Gateway, str], user: pwd.struct_passwd) -> Iterator[UserServer]:
    """The user's JupyterLab, trusting only the gateway's CA; as the user when their venv
    exists, else as root."""
    served, token = gateway
    home = Path(user.pw_dir)
    jupyter = home / ".jupyter"
    # The Lab extension is the one installed with the package in the server's own Python
    # (bash .ci/setup keeps it the checkout's), as a user's server has it: not a link into
    # the checkout, which other users may not be able to read.
    (jupyter / "data").mkdir(parents=True)
    ca = jupyter / "sandbox-gateway-ca.pem"
    shutil.copy(served.ca, ca)
    (jupyter / "jupyter_server_config.py").write_text(
        LAB_CONFIG
        + "\n".join(
            [
                f'c.ServerApp.kernel_manager_class = "{CLIENT_MANAGER}"',
                f'c.GatewayClient.url = "https://{GATEWAY_IP}:{PORT}"',
                f'c.GatewayClient.ca_certs = "{ca}"',
                "c.GatewayClient.request_timeout = 120.0",
                # The relay gives the gateway up sooner than the default's ~31 s: the test's wait.
                "c.GatewayClient.gateway_retry_max = 2",
                "",
            ]
        )
    )
    for path in [jupyter, *jupyter.rglob("*")]:
        os.lchown(path, user.pw_uid, user.pw_gid)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "USER": user.pw_name,
        "JUPYTER_CONFIG_DIR": str(jupyter),
        "JUPYTER_DATA_DIR": str(jupyter / "data"),
        "JUPYTER_PATH": str(jupyter / "data"),
        "JUPYTER_RUNTIME_DIR": str(jupyter / "runtime"),
        "JUPYTER_TOKEN": secrets.token_hex(16),
        "JUPYTER_GATEWAY_AUTH_TOKEN": token,
    }
    if USER_VENV.is_dir():
        as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups"]
        command = [*as_user, str(USER_VENV / "bin" / "jupyter"), "lab"]
    else:  # no venv users may run: .venv's Python is under /root
        command = [str(Path(sys.executable).with_name("jupyter")), "lab", "--allow-root"]
    lab = UserServer(command, env, home, served.log.with_name("user-server.log"))
    try:
        lab.start()  # one that does not answer is stopped all the same
        yield lab
    finally:
        lab.stop()
        print(lab.log.read_text())


def test_a_notebook_on_a_separate_sandbox_host_comes_back_after_its_gateway_is_killed(
    request: pytest.FixtureRequest,
    browser: Browser,
    gateway: tuple[Gateway, str],
    user_server: UserServer,
    user: pwd.struct_passwd,
) -> None:
    """x = 41 on the sandbox host's persistent kernel. The gateway is killed outright: the
    status bar says the host is unreachable, and once the gateway is back (it adopts the
    kernel) the same page runs x + 1. Killed again while JupyterLab gives the kernel up
    ("Disconnected"): back, the status-bar item reconnects the kernel and the page runs
    x + 2. No reload. Each time the notebook is back, before a cell runs, its status bar and
    toolbar say the kernel is idle (they read "Unknown" until the next cell ran)."""
    served, _ = gateway
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    console: list[str] = []
    page.on("console", lambda message: console.append(message.text))
    going_away: list[bool] = []  # armed: the next kernel socket is closed as going away

    def route(socket: WebSocketRoute) -> None:
        if going_away:
            going_away.clear()
            socket.close(code=1001, reason="going away")
        else:
            socket.connect_to_server()

    # Before the page loads: JupyterLab keeps the WebSocket class it found at its start.
    page.route_web_socket(re.compile(r"/api/kernels/[^/]+/channels"), route)
    analyst = Lab(page, user_server.server)
    kernel_ids: set[str] = set()
    try:
        analyst.open()
        analyst.new_notebook("Sandboxed Python")
        status = page.locator("#sandbox-kernel-status")
        expect(status).to_have_text(FIGURES, timeout=30_000)
        kernel_ids |= {s["kernel"]["id"] for s in user_server.server.api("GET", "/api/sessions").json()}
        assert analyst.run("import os\nx = 41\nprint(os.getuid())") == str(user.pw_uid), "the user's uid"

        served.kill()
        expect(status).to_have_text(LOST_TEXT, timeout=ONE_POLL_MS)
        assert f"https://{GATEWAY_IP}:{PORT}" in (status.get_attribute("title") or "")
        # The user's server gives the gateway up and closes the browser's socket (1011):
        # JupyterLab reconnects at once, and the server dials the gateway again.
        wait_for(lambda: "Closing the browser's socket of kernel" in user_server.log.read_text(), 60)
        served.start()
        expect(status).to_have_text(FIGURES, timeout=60_000)
        expect_idle(analyst)
        assert analyst.run("print(x + 1)", timeout=120) == "42"

        # JupyterLab gives a kernel up ("Disconnected") on a socket closed with 1001 (a proxy
        # going away), where it retries any other loss: the page's next socket gets that.
        going_away.append(True)
        served.kill()
        expect(status).to_have_text(LOST_TEXT, timeout=ONE_POLL_MS)
        analyst.wait_for_kernel("Sandboxed Python", "Disconnected", timeout=90)
        expect(status).to_have_text(LOST_TEXT)  # no reconnecting to a host that does not answer
        assert not any(line.startswith("sandbox-kernel: reconnecting") for line in console)
        served.start()
        expect(status).to_have_text(FIGURES, timeout=60_000)
        disconnected = page.locator(".jp-StatusBar-TextItem", has_text="Sandboxed Python | Disconnected")
        expect(disconnected).to_have_count(0, timeout=60_000)
        expect_idle(analyst)
        assert analyst.run("print(x + 2)", timeout=120) == "43"
        assert any(line.startswith("sandbox-kernel: reconnecting kernel") for line in console), console
        assert kernel_ids == {
            s["kernel"]["id"] for s in user_server.server.api("GET", "/api/sessions").json()
        }
    except BaseException:
        print("The page's console:", *console, sep="\n  ")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
        raise
    finally:
        page.close()
        served.stop()
        # A persistent kernel outlives its gateway, never the test (in a thread: Playwright's
        # loop runs in this one).
        with ThreadPoolExecutor(1) as thread:
            thread.submit(asyncio.run, _remove_kernels(kernel_ids)).result()


def expect_idle(analyst: Lab) -> None:
    """The notebook's kernel reads "Idle" in the status bar and the toolbar, before any cell
    runs: JupyterLab has its state from the kernel's websocket, reconnected (30 s: JupyterLab
    waits up to 1, 3, 7 ... s between tries)."""
    analyst.wait_for_kernel("Sandboxed Python", "Idle", timeout=30)
    toolbar = analyst.page.locator(TOOLBAR_STATUS)
    expect(toolbar).to_have_attribute("data-status", "idle", timeout=5_000)


def wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


async def _remove_kernels(kernel_ids: set[str]) -> None:
    docker = DockerBackend()
    for kernel in await list_kernels(docker):
        if kernel.kernel_id in kernel_ids:
            await remove_kernel(docker, kernel, None)
