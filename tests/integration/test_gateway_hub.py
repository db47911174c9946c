"""The sandbox gateway behind a real JupyterHub, on one host, as docs/administrators/gateway-hub.md
sets it up: the hub as root (LocalProcessSpawner, configurable-http-proxy from
``/opt/sk-chp``), two real local users whose servers run as their own uids from
``/opt/sk-user-venv`` (both from ``bash .ci/setup``), and the gateway as root over TLS on
loopback with :class:`~sandbox_kernel.gateway.hub.HubIdentityProvider`. The hub's and the
gateway's configs and the setup commands are the page's own, with this test's paths and ports.

A user logs in at the hub in a real browser and plots in a sandboxed notebook; then the
other user's real server token is tried on everything of the first user's. Then the page's
several sandbox machines: a gateway per team (hub group), each in a network namespace of
its own, and users' servers sent to their team's gateway only."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import hashlib
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest
import requests
from playwright.sync_api import Page, expect, sync_playwright
from tornado.httpclient import HTTPClientError

from .conftest import KERNEL, REPORTS, HostState, stop_process
from .test_gateway import Served, cli, containers_of, run_code
from .test_jupyter_server import free_port
from .test_lab_browser import ARTIFACTS, CHROMIUM

pytestmark = pytest.mark.integration

USERS = ("sk-hub-alice", "sk-hub-bob")
PASSWORD = secrets.token_urlsafe(12)
CHP = Path("/opt/sk-chp/node_modules/.bin/configurable-http-proxy")
USER_VENV = Path("/opt/sk-user-venv")
BIN = Path(sys.executable).parent
PAGE = Path(__file__).parents[2] / "docs" / "administrators" / "gateway-hub.md"
SERVICE = "sandbox-gateway"
ADMIN_SERVICE = "sk-test-admin"
#: The gateway's cache of the hub's answers here (60 s by default): a revoked token's time to fail.
CACHE_MAX_AGE = 2


def documented_blocks() -> dict[str, str]:
    """The page's setup commands, hub config and gateway config."""
    text = PAGE.read_text()
    blocks = re.findall(r"^```(bash|python)\n(.*?)^```", text, re.M | re.S)
    found = {}
    for lang, code in blocks:
        if lang == "bash" and "init-tls" in code:
            found["commands"] = code
        elif "group_overrides" in code:
            found["teams_hub"] = code
        elif "sandbox-gw-1" in code:
            found["teams_gateway"] = code
        elif "jupyterhub_config.py" in code:
            found["hub"] = code
        elif "jupyter_sandbox_gateway_config.py" in code:
            found["gateway"] = code
    expected = {"commands", "hub", "gateway", "teams_hub", "teams_gateway"}
    assert set(found) == expected, f"{PAGE} changed its examples: {sorted(found)}"
    return found


def substituted(blocks: dict[str, str], replacements: list[tuple[str, str]]) -> dict[str, str]:
    """The blocks with the page's paths and ports made this test's; each must occur."""
    for old, new in replacements:
        assert any(old in code for code in blocks.values()), f"{PAGE} no longer says {old!r}"
        blocks = {name: code.replace(old, new) for name, code in blocks.items()}
    return blocks


@contextlib.contextmanager
def local_users(names: Iterable[str]) -> Iterator[dict[str, pwd.struct_passwd]]:
    """Real local users (homes 0700, a project folder each), in no privileged group;
    removed afterwards, with their homes."""
    made = {}
    try:
        for name in names:
            subprocess.run(["userdel", "-r", name], check=False, capture_output=True)  # a crashed run's
            subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True)
            account = pwd.getpwnam(name)
            Path(account.pw_dir).chmod(0o700)
            project = Path(account.pw_dir) / "proj"
            project.mkdir(mode=0o700)
            os.chown(project, account.pw_uid, account.pw_gid)
            made[name] = account
        assert not set(made) & set(grp.getgrnam("docker").gr_mem), "a docker-group user is root-equivalent"
        assert all(grp.getgrgid(a.pw_gid).gr_name != "docker" for a in made.values())
        yield made
    finally:
        for name in made:
            subprocess.run(["userdel", "-r", name], check=False, capture_output=True)
            assert not Path(made[name].pw_dir).exists()


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, pwd.struct_passwd]]:
    """The one-host tests' two users."""
    with local_users(USERS) as made:
        yield made


class HubServed(Served):
    """The gateway, asked with any token."""

    async def fetch_as(self, path: str, token: str, method: str = "GET") -> Any:
        self.tokens["_"] = token
        return await self.fetch(path, "_", method)


@dataclass
class Hub:
    url: str
    api: str
    admin_token: str
    gateway: HubServed
    shared: Path
    private: Path
    audit: Path

    def call(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """The hub's REST API, as the test's admin service."""
        headers = {"Authorization": f"token {self.admin_token}"}
        return requests.request(method, self.api + path, headers=headers, timeout=60, **kwargs)

    def ask_gateway(self, method: str, path: str, token: str) -> requests.Response:
        """The gateway's answer to a request with ``token`` (blocking: for the browser's test)."""
        return requests.request(
            method,
            self.gateway.url + path,
            headers={"Authorization": f"token {token}"},
            verify=str(self.shared / "pki" / "ca.pem"),
            timeout=120,
        )

    def start_server(self, name: str) -> None:
        """Start ``name``'s server (if it is not running) and wait until it is ready."""
        self.call("POST", f"/users/{name}")  # 409 if the hub has them already
        self.call("POST", f"/users/{name}/server")
        deadline = time.monotonic() + 120
        while not self.call("GET", f"/users/{name}").json().get("servers", {}).get("", {}).get("ready"):
            assert time.monotonic() < deadline, f"{name}'s server did not start"
            time.sleep(0.5)

    def stop_server(self, name: str) -> None:
        """Stop ``name``'s server and wait until the hub says it stopped."""
        self.call("DELETE", f"/users/{name}/server")
        deadline = time.monotonic() + 60
        while self.call("GET", f"/users/{name}").json().get("servers"):
            assert time.monotonic() < deadline, f"{name}'s server did not stop"
            time.sleep(0.5)

    def server_token(self, name: str) -> str:
        """The token the hub gave ``name``'s server, read from its process's environment."""
        env = server_environ(name)
        assert env["JUPYTER_GATEWAY_AUTH_TOKEN"] == env["JUPYTERHUB_API_TOKEN"]
        return env["JUPYTER_GATEWAY_AUTH_TOKEN"]


def server_environ(name: str) -> dict[str, str]:
    """The environment the hub gave ``name``'s server (its process's, read as root)."""
    for pid in server_pids(pwd.getpwnam(name).pw_uid):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().partition("=")[::2] for item in environ if b"=" in item)
        if "JUPYTER_GATEWAY_AUTH_TOKEN" in env:
            return env
    pytest.fail(f"no server of {name} runs")


def server_pids(uid: int) -> list[int]:
    """The pids of the single-user servers running as ``uid``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if proc.stat().st_uid == uid and b"jupyterhub-singleuser" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def processes_of(uid: int) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and proc.stat().st_uid == uid:
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def wait_until(answers: Any, process: subprocess.Popen[bytes], log: Path, timeout: float = 90) -> None:
    """Wait until ``answers()`` is true, while ``process`` lives."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, log.read_text()
        try:
            if answers():
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.3)


stop = stop_process


@pytest.fixture(scope="module")
def hub(users: dict[str, pwd.struct_passwd], kernelspec_root: Path) -> Iterator[Hub]:
    """JupyterHub, its proxy and the gateway, as the page sets them up; afterwards every
    process, server, kernel and file of theirs is gone."""
    for needed in (CHP, USER_VENV / "bin" / "jupyterhub-singleuser"):
        if not needed.exists():
            pytest.fail(f"{needed} is missing: run `bash .ci/setup` (as root)", pytrace=False)
    shared = Path(tempfile.mkdtemp(prefix="sk-hub-", dir="/tmp"))
    shared.chmod(0o755)  # the users' servers read the CA in it (pki/, as init-tls makes it)
    private = shared / "private"
    private.mkdir(mode=0o700)
    hub_port, proxy_port, gw_port, chp_api_port = (free_port() for _ in range(4))
    one_host = {
        name: code for name, code in documented_blocks().items() if name in ("commands", "hub", "gateway")
    }
    blocks = substituted(
        one_host,
        [
            ("/etc/sandbox-kernel/gateway", str(shared / "pki")),
            ("/opt/jupyterhub-user", str(USER_VENV)),
            ("8870", str(gw_port)),
            (":8081", f":{hub_port}"),
            ("/etc/jupyter/jupyter_sandbox_gateway_config.py", str(private / "gateway_config.py")),
            ("/etc/jupyterhub/jupyterhub_config.py", str(private / "jupyterhub_config.py")),
        ],
    )
    env = {**os.environ, "JUPYTER_PATH": str(kernelspec_root), "PATH": f"{BIN}:{os.environ['PATH']}"}
    commands = blocks["commands"].strip().splitlines()
    starts = [
        line for line in commands if line.startswith(("jupyter sandbox-kernel gateway --", "jupyterhub "))
    ]
    for line in commands:
        if line not in starts:
            subprocess.run(["bash", "-c", line], check=True, env=env, timeout=120)
    assert len(starts) == 2
    audit = private / "audit.jsonl"
    (private / "gateway_config.py").write_text(
        blocks["gateway"]
        + f'c.ServerApp.root_dir = "{private}"\n'
        + "c.UserPolicy.max_kernels_per_user = 2\n"
        + f"c.HubIdentityProvider.cache_max_age = {CACHE_MAX_AGE}\n"
        + f'c.SandboxProvisioner.audit_log = "{audit}"\n'
    )
    admin_token = secrets.token_hex(32)
    (private / "jupyterhub_config.py").write_text(
        blocks["hub"]
        + hub_config_of_the_test(private, hub_port, proxy_port, chp_api_port, users, admin_token)
    )
    gateway_line, hub_line = starts  # the page's own command lines
    tls = ssl.create_default_context(cafile=str(shared / "pki" / "ca.pem"))
    served = HubServed(
        f"https://127.0.0.1:{gw_port}",
        {},
        tls,
        private / "gateway.log",
        ["bash", "-c", f"exec {gateway_line}"],
        env,
    )
    try:
        served.start()
        with running_hub(["bash", "-c", f"exec {hub_line}"], private, proxy_port, admin_token, users, env):
            yield Hub(
                f"http://127.0.0.1:{proxy_port}",
                f"http://127.0.0.1:{proxy_port}/hub/api",
                admin_token,
                served,
                shared,
                private,
                audit,
            )
    finally:
        served.stop()
        if served.log.exists():
            print(f"--- gateway log\n{served.log.read_text()[-20000:]}")  # shown when a test fails
        shutil.rmtree(shared, ignore_errors=True)


def hub_config_of_the_test(
    private: Path,
    hub_port: int,
    proxy_port: int,
    chp_api_port: int,
    users: Iterable[str],
    admin_token: str,
    hub_ip: str = "127.0.0.1",
) -> str:
    """What the test adds to the page's hub config."""
    return f"""
# The test's own: ports, state files, a password login, an admin service for the test.
c.JupyterHub.bind_url = "http://127.0.0.1:{proxy_port}"
c.JupyterHub.hub_ip = "{hub_ip}"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{chp_api_port}"
c.ConfigurableHTTPProxy.command = [{str(CHP)!r}]
c.ConfigurableHTTPProxy.pid_file = {str(private / "chp.pid")!r}
c.JupyterHub.db_url = "sqlite:///{private / "jupyterhub.sqlite"}"
c.JupyterHub.cookie_secret_file = {str(private / "cookie_secret")!r}
c.JupyterHub.pid_file = {str(private / "hub.pid")!r}
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = {PASSWORD!r}
c.Authenticator.allowed_users = {set(users)!r}
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.Spawner.args.append("--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate")
c.JupyterHub.services.append({{"name": {ADMIN_SERVICE!r}, "api_token": {admin_token!r}}})
c.JupyterHub.load_roles.append(
    {{
        "name": {ADMIN_SERVICE!r},
        "scopes": ["admin:users", "admin:servers", "tokens", "groups"],
        "services": [{ADMIN_SERVICE!r}],
    }}
)
"""


@contextlib.contextmanager
def running_hub(
    command: list[str],
    private: Path,
    proxy_port: int,
    admin_token: str,
    users: Iterable[str],
    env: dict[str, str],
) -> Iterator[subprocess.Popen[bytes]]:
    """The hub (and its proxy) from ``command``, once its API answers; afterwards the users'
    servers, the hub and the proxy are gone."""
    hub_log = private / "hub.log"
    process: subprocess.Popen[bytes] | None = None
    try:
        with hub_log.open("wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=private)
        wait_until(
            lambda: requests.get(f"http://127.0.0.1:{proxy_port}/hub/api/", timeout=2).ok, process, hub_log
        )
        yield process
    finally:
        if process is not None:
            for name in users:
                requests.delete(
                    f"http://127.0.0.1:{proxy_port}/hub/api/users/{name}/server",
                    headers={"Authorization": f"token {admin_token}"},
                    timeout=60,
                )
            stop(process)
        chp_pid = private / "chp.pid"
        if chp_pid.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(chp_pid.read_text()), signal.SIGKILL)
        for name in users:
            for pid in processes_of(pwd.getpwnam(name).pw_uid):  # a server the hub did not stop
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if hub_log.exists():
            print(f"--- hub log\n{hub_log.read_text()[-20000:]}")  # shown when a test fails


NOTEBOOK = {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
PLOT = """\
import matplotlib.pyplot as plt
import pandas as pd
sales = pd.DataFrame({"region": ["north", "south", "east"], "revenue": [3, 5, 2]})
sales.plot.bar(x="region", y="revenue", title="revenue by region")
plt.savefig("revenue.png")
plt.show()
print(int(sales.revenue.sum()))"""


@pytest.fixture
def page(request: pytest.FixtureRequest, hub: Hub) -> Iterator[Page]:
    """A browser page; if the test fails, its screenshot is kept and the servers' logs are
    shown with the test's report (the fixture's own teardown prints them after the module's
    last test, whose report pytest shows only if that one fails)."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        console: list[str] = []
        page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
        try:
            yield page
        finally:
            report = request.node.stash.get(REPORTS, {}).get("call")
            if report is not None and report.failed:
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
                print(in_short(hub, console))  # first: CI's report may show only a log's ends
                for name, log in (
                    ("hub and users' servers", hub.private / "hub.log"),
                    ("gateway", hub.gateway.log),
                    ("audit", hub.audit),
                ):
                    if log.exists():
                        print(f"--- {name} log, as the test failed\n{log.read_text()[-20000:]}")
            browser.close()


#: A log line that says nothing about a failure: a request answered as usual.
ROUTINE = re.compile(r"^\[I [^]]*\] (200|201|204|301|302) (GET|PUT|POST|PATCH|HEAD) ")


def in_short(hub: Hub, console: list[str]) -> str:
    """Where a browser's message stopped, in a few lines: each execution the bridge saw
    (the audit's started and finished), the servers' lines other than routine answers, and
    the browser's console warnings and errors."""
    out = ["--- in short, as the test failed"]
    if hub.audit.exists():
        for line in hub.audit.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:  # a line still being written
                continue
            keys = ("event", "time", "kernel_id", "msg_type", "status", "duration", "reason")
            out.append("audit: " + " ".join(f"{k}={event[k]}" for k in keys if k in event))
    for name, log in (("hub", hub.private / "hub.log"), ("gateway", hub.gateway.log)):
        if log.exists():
            lines = [line for line in log.read_text().splitlines() if not ROUTINE.match(line)]
            out += [f"{name}: {line[:300]}" for line in lines[-60:]]
    out += [f"browser: {line[:300]}" for line in console if not line.startswith(("log:", "debug:"))][-40:]
    return "\n".join(out)


def test_a_hub_user_plots_in_a_sandboxed_notebook_as_themselves(
    hub: Hub, page: Page, users: dict[str, pwd.struct_passwd], docker_client: docker.DockerClient
) -> None:
    before = HostState(docker_client)
    alice = USERS[0]
    account = users[alice]
    project = Path(account.pw_dir) / "proj"
    notebook = project / "analysis.ipynb"
    notebook.write_text(json.dumps(NOTEBOOK))
    os.chown(notebook, account.pw_uid, account.pw_gid)

    page.goto(f"{hub.url}/hub/login")
    page.locator("#username_input").fill(alice)
    page.locator("#password_input").fill(PASSWORD)
    page.locator("#login_submit").click()
    page.wait_for_url(re.compile(rf"/user/{alice}/lab"), timeout=120_000)
    assert server_pids(account.pw_uid), "her server runs as her own uid"

    page.goto(f"{hub.url}/user/{alice}/lab/tree/proj/analysis.ipynb?reset")
    dialog = page.locator(".jp-Dialog")
    expect(dialog).to_contain_text("Select Kernel", timeout=60_000)
    dialog.locator("select").select_option(label="Sandboxed Python")
    dialog.locator(".jp-mod-accept").click()
    status = page.locator(".jp-StatusBar-TextItem", has_text="Sandboxed Python | Idle")
    expect(status).to_be_visible(timeout=120_000)
    kernels = hub.ask_gateway("GET", "/api/kernels", hub.server_token(alice)).json()
    assert len(kernels) == 1, kernels
    kernel_id = kernels[0]["id"]

    cell = page.locator(
        ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-CodeCell"
    ).first  # the empty notebook's one
    cell.locator(".cm-content").click()
    page.keyboard.insert_text(PLOT)
    page.keyboard.press("Shift+Enter")
    expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"), timeout=120_000)
    expect(cell.locator(".jp-OutputArea img")).to_have_attribute(
        "src", re.compile(r"^data:image/png;base64,")
    )
    assert cell.locator(".jp-OutputArea-output pre").last.inner_text().strip() == "10"
    result = project / "revenue.png"
    assert result.read_bytes().startswith(b"\x89PNG")
    assert (result.stat().st_uid, result.stat().st_gid) == (account.pw_uid, account.pw_gid), "hers"

    # In gVisor: the status bar says so (through the gateway), and so does Docker.
    expect(page.locator("#sandbox-kernel-status")).to_have_text(re.compile(r"^gVisor · "), timeout=30_000)
    (container,) = containers_of(kernel_id)
    assert container.attrs["HostConfig"]["Runtime"].startswith("runsc")
    assert container.labels.get("io.sandbox-kernel.user") == alice

    token = hub.server_token(alice)
    assert hub.ask_gateway("DELETE", f"/api/kernels/{kernel_id}", token).status_code == 204
    assert containers_of(kernel_id) == []
    with ThreadPoolExecutor(1) as thread:  # out of Playwright's event loop
        assert thread.submit(before.new_leftovers).result() == []


async def test_another_hub_user_and_other_tokens_get_nothing_of_a_users_kernel(
    hub: Hub, users: dict[str, pwd.struct_passwd], docker_client: docker.DockerClient
) -> None:
    before = HostState(docker_client)
    alice, bob = USERS
    for name in USERS:
        await asyncio.to_thread(hub.start_server, name)
    tokens = {name: await asyncio.to_thread(hub.server_token, name) for name in USERS}
    hub.gateway.tokens = tokens
    gw = hub.gateway
    project = Path(users[alice].pw_dir) / "proj"
    started = await gw.fetch(
        "/api/kernels", alice, "POST", {"name": KERNEL, "env": {"KERNEL_WORKING_DIR": str(project)}}
    )
    assert started.code == 201, started.body
    kernel_id = json.loads(started.body)["id"]
    try:
        ws = await gw.channels(kernel_id, alice)
        out = await run_code(ws, "import os; print(os.getuid())")
        ws.close()
        assert out.split() == [str(users[alice].pw_uid)]

        # bob, with his own real server token
        assert json.loads((await gw.fetch("/api/kernels", bob)).body) == []
        for path, method, body in [
            (f"/api/kernels/{kernel_id}", "GET", None),
            (f"/api/kernels/{kernel_id}", "DELETE", None),
            (f"/api/kernels/{kernel_id}/interrupt", "POST", {}),
            (f"/api/kernels/{kernel_id}/restart", "POST", {}),
            (f"/api/sandbox-kernel/kernels/{kernel_id}", "GET", None),
            ("/api/kernels", "POST", {"kernel_id": kernel_id}),
        ]:
            assert (await gw.fetch(path, bob, method, body)).code == 403, f"{method} {path}"
        with pytest.raises(HTTPClientError) as refused:
            await gw.channels(kernel_id, bob)
        assert refused.value.code == 403
        into_hers = await gw.fetch(
            "/api/kernels", bob, "POST", {"name": KERNEL, "env": {"KERNEL_WORKING_DIR": str(project)}}
        )
        assert into_hers.code == 403
        assert "outside your sandbox workspace" in json.loads(into_hers.body)["message"]

        # other tokens: one of hers without the gateway's scope, a service's, none, one in the URL
        minted = await asyncio.to_thread(
            hub.call, "POST", f"/users/{alice}/tokens", json={"scopes": [f"read:users:name!user={alice}"]}
        )
        assert minted.status_code == 201, minted.text
        for token, why in [
            (minted.json()["token"], "lacks the scope"),
            (hub.admin_token, "not a service's"),
        ]:
            refused_token = await gw.fetch_as("/api/kernels", token)
            assert refused_token.code == 403
            assert why in json.loads(refused_token.body)["message"]
        assert (await gw.fetch("/api/kernels", None)).code == 403
        assert (await gw.fetch(f"/api/kernels?token={tokens[alice]}", None)).code == 403
        assert (await gw.fetch(f"/api/kernels/{kernel_id}", alice)).code == 200, "hers, still"

        # A stopped server's token is revoked by the hub: the gateway refuses it once its cache expires.
        await asyncio.to_thread(hub.stop_server, bob)
        await asyncio.sleep(CACHE_MAX_AGE + 1)
        assert (await gw.fetch("/api/kernels", bob)).code == 403
    finally:
        deleted = await gw.fetch(f"/api/kernels/{kernel_id}", alice, "DELETE")
    assert deleted.code == 204
    lines = [json.loads(line) for line in hub.audit.read_text().splitlines()]
    ran = [line for line in lines if line.get("kernel_id") == kernel_id and line["event"] == "finished"]
    assert ran, lines[-5:]
    assert {line.get("user_authenticated") for line in ran} == {alice}
    assert containers_of(kernel_id) == []
    assert await asyncio.to_thread(before.new_leftovers) == []


TEAM_USERS = ("sk-team1-alice", "sk-team2-bob")
TEAM_SERVICES = ("sandbox-gw-1", "sandbox-gw-2")
#: The hub's address for the sandbox machines (on this host's loopback device) and the
#: machines': a network namespace each, behind a veth pair (not the page's 10.77.0.1,
#: 10.77.1.2, 10.77.2.2, so as not to meet test_gateway_netns.py's machine).
HUB_IP = "10.77.10.1"
MACHINES = (("sk-team1", "10.77.11"), ("sk-team2", "10.77.12"))


def ip(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def sandbox_machines() -> Iterator[None]:
    """:data:`MACHINES` as network namespaces, each ``<net>.2/30`` behind a veth pair to
    ``<net>.1/30`` here, routed to :data:`HUB_IP`; gone afterwards."""
    try:
        for name, _ in MACHINES:  # a crashed run's
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        subprocess.run(["ip", "addr", "del", f"{HUB_IP}/32", "dev", "lo"], check=False, capture_output=True)
        ip("addr", "add", f"{HUB_IP}/32", "dev", "lo")
        for name, net in MACHINES:
            ip("netns", "add", name)
            ip("link", "add", f"{name}-0", "type", "veth", "peer", "name", f"{name}-1")
            ip("link", "set", f"{name}-1", "netns", name)
            ip("addr", "add", f"{net}.1/30", "dev", f"{name}-0")
            ip("link", "set", f"{name}-0", "up")
            ip("-n", name, "addr", "add", f"{net}.2/30", "dev", f"{name}-1")
            ip("-n", name, "link", "set", f"{name}-1", "up")
            ip("-n", name, "link", "set", "lo", "up")
            ip("-n", name, "route", "add", "default", "via", f"{net}.1")
        yield
    finally:
        for name, _ in MACHINES:
            subprocess.run(
                ["ip", "netns", "del", name], check=False, capture_output=True
            )  # and its veth pair
        subprocess.run(["ip", "addr", "del", f"{HUB_IP}/32", "dev", "lo"], check=False, capture_output=True)


class MachineServed(HubServed):
    """A gateway on a sandbox machine of :func:`sandbox_machines`."""

    def start(self) -> None:
        """Start the gateway; return once it listens on its machine's address."""
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(  # our own command
                self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )
        address = self.url.removeprefix("https://").rpartition(":")
        deadline = time.monotonic() + 60
        while True:
            assert self.process.poll() is None, self.log.read_text()
            try:
                with socket.create_connection((address[0], int(address[2])), timeout=1):
                    return
            except OSError:
                assert time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.2)


@dataclass
class Teams:
    """A hub whose two groups each have a gateway of their own."""

    hub: Hub
    gateways: tuple[MachineServed, MachineServed]
    roots: tuple[Path, Path]


@pytest.fixture(scope="module")
def teams(kernelspec_root: Path) -> Iterator[Teams]:
    """The page's "Several sandbox machines": a hub with the groups team1 (the first user)
    and team2 (the second), and a gateway each (``sandbox-gw-1``, ``sandbox-gw-2``), each
    with its own service token, TLS CA and root folder (its adoption scope), on a machine
    of its own: a network namespace of this host (:func:`sandbox_machines`), reached over
    TLS on a veth pair, with the host's Docker and file system."""
    for needed in (CHP, USER_VENV / "bin" / "jupyterhub-singleuser"):
        if not needed.exists():
            pytest.fail(f"{needed} is missing: run `bash .ci/setup` (as root)", pytrace=False)
    blocks = documented_blocks()
    env = {**os.environ, "JUPYTER_PATH": str(kernelspec_root), "PATH": f"{BIN}:{os.environ['PATH']}"}
    with local_users(TEAM_USERS), sandbox_machines():
        shared = Path(tempfile.mkdtemp(prefix="sk-teams-", dir="/tmp"))
        shared.chmod(0o755)  # the users' servers read the CAs here
        private = shared / "private"
        private.mkdir(mode=0o700)
        hub_port, proxy_port, chp_api_port = (free_port() for _ in range(3))
        hub_config = substituted(
            {"hub": blocks["teams_hub"]},
            [
                ('["alice"]', f'["{TEAM_USERS[0]}"]'),
                ('["bob"]', f'["{TEAM_USERS[1]}"]'),
                ("10.77.1.2", f"{MACHINES[0][1]}.2"),
                ("10.77.2.2", f"{MACHINES[1][1]}.2"),
                ("10.77.0.1", HUB_IP),
                ("/etc/jupyterhub/{service}-ca.pem", f"{shared}/{{service}}-ca.pem"),
                ("/etc/jupyterhub/{service}.token", f"{private}/{{service}}.token"),
                ("/opt/jupyterhub-user", str(USER_VENV)),
            ],
        )["hub"]
        admin_token = secrets.token_hex(32)
        (private / "jupyterhub_config.py").write_text(
            hub_config
            + hub_config_of_the_test(
                private, hub_port, proxy_port, chp_api_port, TEAM_USERS, admin_token, HUB_IP
            )
        )
        gateways, roots = [], []
        for n, (service, (machine, net)) in enumerate(zip(TEAM_SERVICES, MACHINES, strict=True), 1):
            root = private / f"gw{n}"
            root.mkdir(mode=0o700)
            pki = root / "pki"
            cli("gateway", "init-tls", f"--dir={pki}", f"--hostname={machine}", f"--ip={net}.2", env=env)
            shutil.copyfile(pki / "ca.pem", shared / f"{service}-ca.pem")
            (shared / f"{service}-ca.pem").chmod(0o644)
            service_token = secrets.token_hex(32)
            for path in (pki / "hub-service.token", private / f"{service}.token"):
                path.write_text(service_token + "\n")
                path.chmod(0o600)
            config = substituted(
                {"gateway": blocks["teams_gateway"]},
                [
                    ('"sandbox-gw-1"', f'"{service}"'),
                    ('"10.77.1.2"', f'"{net}.2"'),
                    ("http://10.77.0.1:8081", f"http://{HUB_IP}:{hub_port}"),
                    ("/etc/sandbox-kernel/gateway", str(pki)),
                ],
            )["gateway"]
            (root / "gateway_config.py").write_text(
                config
                + f'c.ServerApp.root_dir = "{root}"\n'
                + "c.UserPolicy.max_kernels_per_user = 1\n"
                + f"c.HubIdentityProvider.cache_max_age = {CACHE_MAX_AGE}\n"
                + f'c.SandboxProvisioner.audit_log = "{root / "audit.jsonl"}"\n'
            )
            tls = ssl.create_default_context(cafile=str(shared / f"{service}-ca.pem"))
            command = ["ip", "netns", "exec", machine, "jupyter", "sandbox-kernel", "gateway"]
            command.append(f"--config={root / 'gateway_config.py'}")
            gateways.append(
                MachineServed(f"https://{net}.2:8870", {}, tls, root / "gateway.log", command, env)
            )
            roots.append(root)
        try:
            for gateway in gateways:
                gateway.start()
            hub_command = ["jupyterhub", "-f", str(private / "jupyterhub_config.py")]
            with running_hub(hub_command, private, proxy_port, admin_token, TEAM_USERS, env):
                hub = Hub(
                    f"http://127.0.0.1:{proxy_port}",
                    f"http://127.0.0.1:{proxy_port}/hub/api",
                    admin_token,
                    gateways[0],
                    shared,
                    private,
                    roots[0] / "audit.jsonl",
                )
                yield Teams(hub, (gateways[0], gateways[1]), (roots[0], roots[1]))
        finally:
            for gateway in gateways:
                gateway.stop()
                if gateway.log.exists():
                    print(f"--- {gateway.log}\n{gateway.log.read_text()[-20000:]}")  # shown when a test fails
            shutil.rmtree(shared, ignore_errors=True)


def adoption_scope(root_dir: Path) -> str:
    """The scope label of the kernels a gateway with ``root_dir`` starts (as
    :meth:`sandbox_kernel.jupyter.server.SandboxMappingKernelManager.adoption_scope`)."""
    return hashlib.sha256(str(root_dir).encode()).hexdigest()[:16]


async def test_each_team_gets_kernels_on_its_own_gateway_and_a_stopped_gateway_takes_only_its_own(
    teams: Teams, docker_client: docker.DockerClient
) -> None:
    before = HostState(docker_client)
    hub, (gw1, gw2) = teams.hub, teams.gateways
    alice, bob = TEAM_USERS
    for name in TEAM_USERS:
        await asyncio.to_thread(hub.start_server, name)
    for name, gateway, service in zip(TEAM_USERS, teams.gateways, TEAM_SERVICES, strict=True):
        env = await asyncio.to_thread(server_environ, name)
        assert env["JUPYTER_GATEWAY_URL"] == gateway.url, "the hub sent the server to its team's gateway"
        assert env["JUPYTER_GATEWAY_CA_CERTS"] == str(hub.shared / f"{service}-ca.pem")
    tokens = {name: await asyncio.to_thread(hub.server_token, name) for name in TEAM_USERS}
    gw1.tokens, gw2.tokens = dict(tokens), dict(tokens)

    # Each user's real server token is good on their own team's gateway only.
    assert (await gw1.fetch("/api/kernels", alice)).code == 200
    assert (await gw2.fetch("/api/kernels", bob)).code == 200
    for gateway, name, service in [(gw2, alice, TEAM_SERVICES[1]), (gw1, bob, TEAM_SERVICES[0])]:
        refused = await gateway.fetch("/api/kernels", name)
        assert refused.code == 403, name
        assert f"lacks the scope access:services!service={service}" in json.loads(refused.body)["message"]

    kernels: dict[str, str] = {}
    try:
        for name, gateway in zip(TEAM_USERS, teams.gateways, strict=True):
            project = Path(pwd.getpwnam(name).pw_dir) / "proj"
            body = {"name": KERNEL, "env": {"KERNEL_WORKING_DIR": str(project)}}
            started = await gateway.fetch("/api/kernels", name, "POST", body)
            assert started.code == 201, started.body
            kernels[name] = json.loads(started.body)["id"]
        for name, gateway, root in zip(TEAM_USERS, teams.gateways, teams.roots, strict=True):
            (container,) = containers_of(kernels[name])
            assert container.labels["io.sandbox-kernel.user"] == name
            assert container.labels["io.sandbox-kernel.scope"] == adoption_scope(root), "its team's gateway's"
            listed = json.loads((await gateway.fetch("/api/kernels", name)).body)
            assert [kernel["id"] for kernel in listed] == [kernels[name]]
        ws = await gw1.channels(kernels[alice], alice)
        assert (await run_code(ws, "x = 41; print(x + 1)")).strip() == "42"

        # Gateway 2 stops: its own user's kernel goes with it; the other team's carries on.
        await asyncio.to_thread(gw2.stop)
        assert containers_of(kernels.pop(bob)) == []
        assert (await run_code(ws, "print(x)")).strip() == "41", "the same kernel, undisturbed"
        ws.close()
        listed = json.loads((await gw1.fetch("/api/kernels", alice)).body)
        assert [kernel["id"] for kernel in listed] == [kernels[alice]]
    finally:
        for name, gateway in zip(TEAM_USERS, teams.gateways, strict=True):
            if name in kernels and gateway.process is not None and gateway.process.poll() is None:
                deleted = await gateway.fetch(f"/api/kernels/{kernels[name]}", name, "DELETE")
                assert deleted.code == 204, name
    for kernel_id in kernels.values():
        assert containers_of(kernel_id) == []
    assert await asyncio.to_thread(before.new_leftovers) == []


def move(hub: Hub, name: str, old: str, new: str) -> None:
    """Move ``name`` from the hub group ``old`` to ``new``, as an admin would."""
    assert hub.call("POST", f"/groups/{new}/users", json={"users": [name]}).status_code == 200
    assert hub.call("DELETE", f"/groups/{old}/users", json={"users": [name]}).status_code == 200


async def test_a_user_moved_to_another_team_leaves_her_persistent_kernel_on_the_old_gateway(
    teams: Teams, make_kernelspec: Callable[..., str], docker_client: docker.DockerClient
) -> None:
    before = HostState(docker_client)
    hub, (gw1, gw2) = teams.hub, teams.gateways
    alice = TEAM_USERS[0]
    if gw2.process is None or gw2.process.poll() is not None:
        await asyncio.to_thread(gw2.start)  # the test before stopped it
    name = make_kernelspec("sandboxed-python-team-persistent", config={"lifecycle": "persistent"})
    project = Path(pwd.getpwnam(alice).pw_dir) / "proj"
    await asyncio.to_thread(hub.start_server, alice)
    gw1.tokens[alice] = await asyncio.to_thread(hub.server_token, alice)
    started = await gw1.fetch(
        "/api/kernels", alice, "POST", {"name": name, "env": {"KERNEL_WORKING_DIR": str(project)}}
    )
    assert started.code == 201, started.body
    kernel_id = json.loads(started.body)["id"]
    moved = False
    try:
        await asyncio.to_thread(move, hub, alice, "team1", "team2")
        moved = True
        await asyncio.to_thread(hub.stop_server, alice)
        await asyncio.to_thread(hub.start_server, alice)
        env = await asyncio.to_thread(server_environ, alice)
        assert env["JUPYTER_GATEWAY_URL"] == gw2.url, "her new server is sent to her new team's gateway"
        gw1.tokens[alice] = gw2.tokens[alice] = env["JUPYTER_GATEWAY_AUTH_TOKEN"]
        assert json.loads((await gw2.fetch("/api/kernels", alice)).body) == [], "her kernel did not move"
        refused = await gw1.fetch(f"/api/kernels/{kernel_id}", alice)
        assert refused.code == 403, "her old team's gateway is not hers any more"
        assert "lacks the scope access:services!service=sandbox-gw-1" in json.loads(refused.body)["message"]
        (container,) = containers_of(kernel_id)
        assert container.status == "running", "it stays on the old machine until stopped"
        assert container.labels["io.sandbox-kernel.scope"] == adoption_scope(teams.roots[0])
    finally:
        if moved:  # back, so that she may stop it
            await asyncio.to_thread(move, hub, alice, "team2", "team1")
            await asyncio.to_thread(hub.stop_server, alice)
            await asyncio.to_thread(hub.start_server, alice)
            gw1.tokens[alice] = await asyncio.to_thread(hub.server_token, alice)
        deleted = await gw1.fetch(f"/api/kernels/{kernel_id}", alice, "DELETE")
    assert deleted.code == 204, deleted.body
    assert containers_of(kernel_id) == []
    assert await asyncio.to_thread(before.new_leftovers) == []
