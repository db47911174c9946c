"""Approval prompts on a sandbox gateway: a kernel of kernelspec ``approval: "egress"`` asks
before it leaves its allow-list, through the gateway, for real.

The gateway runs as an administrator runs it (test_gateway.py's users and TLS), with a
kernelspec that allows ``files.pythonhosted.org`` and asks about the rest of the gateway's
``max_allowed_domains`` (``pypi.org``): the one site this machine reaches, through the
gateway's egress proxy. In JupyterLab (the user's own ``jupyter lab`` with the package's
gateway client, in Chromium) the question is a prompt in the notebook.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import pwd
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client import stdio as mcp_stdio
from mcp.types import ElicitRequestParams, ElicitResult
from playwright.sync_api import Browser, expect

from sandbox_kernel.agents.session import AsyncSandboxSession
from sandbox_kernel.channels.approval import NO_STDIN
from sandbox_kernel.egress import ApprovalRequest
from sandbox_kernel.gateway.approvals import GONE, LEASE

from .conftest import HostState
from .test_gateway import Served, local_users, serve_gateway
from .test_gateway_netns import CLIENT_MANAGER, USER_VENV, UserServer
from .test_lab_browser import ARTIFACTS, LAB_CONFIG, Lab
from .test_lab_browser import browser as browser  # Debian's chromium, headless

pytestmark = pytest.mark.integration
#: Users of their own (test_gateway.py's may be made and removed by a run beside this one).
USERS = ("sk-ap-alice", "sk-ap-bob")

ASKING = "py-asking"
#: The same, for programs: its questions wait 5 s.
ASKING_SOON = "py-asking-soon"
#: What the kernel may reach without asking, and what it must ask about (the gateway's ceiling).
ALLOWED, ASKED = "files.pythonhosted.org", "pypi.org"
URL = f"https://{ASKED}/simple/sampleproject/"


def reached_at() -> list[str]:
    """The addresses this machine's network gives the two sites that are not global (its
    network answers them at 203.0.113.80, a proxy): the gateway's egress proxy must be
    told it may dial them (``egress_private_networks``), where a real host needs nothing."""
    found = {info[4][0] for name in (ALLOWED, ASKED) for info in socket.getaddrinfo(name, 443)}
    return sorted(a for a in found if not ipaddress.ip_address(a).is_global)


def fetch(url: str = URL) -> str:
    """Cell code: fetch ``url`` through the kernel's proxy; print OK and the status, or why not."""
    return (
        "import urllib.request, urllib.error\n"
        "try:\n"
        f"    print('OK', urllib.request.urlopen({url!r}, timeout=30).status)\n"
        "except (urllib.error.URLError, OSError) as e:\n"
        "    print('FAILED', e)\n"
    )


def approvals(audit_log: Path) -> list[dict[str, Any]]:
    """The gateway's audit lines of approval answers."""
    lines = [json.loads(line) for line in audit_log.read_text().splitlines()] if audit_log.exists() else []
    return [line for line in lines if line["event"] == "approval"]


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, pwd.struct_passwd]]:
    """Two real local users (homes 0700, a project folder each), in no privileged group;
    removed afterwards."""
    with local_users(dict.fromkeys(USERS, "proj")) as made:
        yield made


@pytest.fixture
def asking_gateway(
    users: dict[str, pwd.struct_passwd], tmp_path: Path, make_kernelspec: Callable[..., str]
) -> Iterator[Served]:
    """The gateway (test_gateway.py's, TLS on loopback) with an audit log, the kernelspecs
    "Asking Python" and py-asking-soon, and a ceiling of pypi.org and files.pythonhosted.org."""
    make_kernelspec(
        ASKING,
        config={
            "network": "allowlist",
            "allowed_domains": [ALLOWED],
            "approval": "egress",
            "approval_timeout": "20s",
        },
        display_name="Asking Python",
    )
    make_kernelspec(
        ASKING_SOON,
        config={
            "network": "allowlist",
            "allowed_domains": [ALLOWED],
            "approval": "egress",
            "approval_timeout": "5s",
        },
    )
    private = tmp_path / "gw"
    config = [
        f"c.SandboxProvisioner.max_allowed_domains = [{ALLOWED!r}, {ASKED!r}]",
        f"c.SandboxProvisioner.egress_private_networks = {[f'{a}/32' for a in reached_at()]!r}",
        f'c.SandboxProvisioner.audit_log = "{private / "audit.jsonl"}"',
    ]
    with serve_gateway(users, private, {**os.environ}, config) as served:
        yield served


def audit_log_of(served: Served) -> Path:
    return served.log.parent / "audit.jsonl"


@pytest.fixture
def user_lab(asking_gateway: Served, users: dict[str, pwd.struct_passwd]) -> Iterator[UserServer]:
    """Alice's own ``jupyter lab`` on loopback, taking its kernels from the gateway (its CA
    only, her token); as alice when the user venv exists (.ci/setup), else as root."""
    account = users[USERS[0]]
    home = Path(account.pw_dir)
    jupyter = home / ".jupyter"
    (jupyter / "data").mkdir(parents=True, exist_ok=True)
    ca = jupyter / "sandbox-gateway-ca.pem"
    shutil.copy(asking_gateway.log.parent / "pki" / "ca.pem", ca)
    (jupyter / "jupyter_server_config.py").write_text(
        LAB_CONFIG
        + "\n".join(
            [
                f'c.ServerApp.kernel_manager_class = "{CLIENT_MANAGER}"',
                f'c.GatewayClient.url = "{asking_gateway.url}"',
                f'c.GatewayClient.ca_certs = "{ca}"',
                "c.GatewayClient.request_timeout = 120.0",
                "",
            ]
        )
    )
    for path in [jupyter, *jupyter.rglob("*")]:
        os.lchown(path, account.pw_uid, account.pw_gid)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "USER": account.pw_name,
        "JUPYTER_CONFIG_DIR": str(jupyter),
        "JUPYTER_DATA_DIR": str(jupyter / "data"),
        "JUPYTER_PATH": str(jupyter / "data"),
        "JUPYTER_RUNTIME_DIR": str(jupyter / "runtime"),
        "JUPYTER_TOKEN": secrets.token_hex(16),
        "JUPYTER_GATEWAY_AUTH_TOKEN": asking_gateway.tokens[account.pw_name],
    }
    if USER_VENV.is_dir():
        as_user = ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--init-groups"]
        command = [*as_user, str(USER_VENV / "bin" / "jupyter"), "lab"]
    else:  # no venv users may run: .venv's Python is under /root
        command = [str(Path(sys.executable).with_name("jupyter")), "lab", "--allow-root"]
    lab = UserServer(command, env, home, asking_gateway.log.with_name("user-lab.log"))
    lab.start()
    try:
        yield lab
    finally:
        lab.stop()
        shutil.rmtree(jupyter, ignore_errors=True)
        print(lab.log.read_text())


def test_jupyterlab_on_the_gateway_asks_in_the_notebook_and_the_gateways_audit_names_the_user(
    request: pytest.FixtureRequest,
    browser: Browser,
    asking_gateway: Served,
    user_lab: UserServer,
    docker_client: docker.DockerClient,
) -> None:
    """Alice's notebook on the gateway asks before pypi.org: "once" lets the request through,
    "deny" in another cell refuses it with the clear error; the gateway's audit lines of
    both answers name her."""
    before = HostState(docker_client)
    alice = USERS[0]
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    analyst = Lab(page, user_lab.server)
    try:
        analyst.open()
        analyst.new_notebook("Asking Python")
        cell = analyst.type_cell(fetch())
        prompt = cell.locator(".jp-Stdin-prompt")
        expect(prompt).to_contain_text(
            f"Sandbox: allow a connection to {ASKED}:443? It is not among this kernel's allowed domains. "
            "Type once (this time), kernel (from now on, in this kernel) or deny; "
            "no answer within 20 s denies:",
            timeout=60_000,
        )
        box = cell.locator(".jp-Stdin-input")
        box.fill("once")
        box.press("Enter")
        expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"), timeout=60_000)
        expect(cell.locator(".jp-Stdin-input")).to_have_count(0)
        shown = cell.locator(".jp-OutputArea").inner_text().strip()
        assert shown.endswith("\nOK 200"), shown
        assert "denies:  once\n" in shown, "the question, and her answer, stay in the output"

        cell = analyst.type_cell(fetch())
        box = cell.locator(".jp-Stdin-input")
        expect(box).to_be_visible(timeout=60_000)
        box.fill("deny")
        box.press("Enter")
        expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"), timeout=60_000)
        expect(cell.locator(".jp-Stdin-input")).to_have_count(0)
        shown = cell.locator(".jp-OutputArea").inner_text().strip().splitlines()[-1]
        assert shown.startswith("FAILED"), shown
        assert f"a connection to {ASKED}:443 needed approval and was denied at the prompt" in shown, shown

        answered = approvals(audit_log_of(asking_gateway))
        assert [(line["answer"], line["by"], line.get("user")) for line in answered] == [
            ("once", "at the prompt", alice),
            ("deny", "at the prompt", alice),
        ]
    except BaseException:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
        raise
    finally:
        page.close()
    user_lab.stop()  # her server shuts its kernels down on the gateway
    with ThreadPoolExecutor(1) as thread:  # in a thread: Playwright's loop runs in this one
        assert thread.submit(before.new_leftovers).result() == []


# -- programs: a session's approval_handler, through the gateway -------------------------------


def on_gateway(served: Served, user: str) -> dict[str, Any]:
    """A session's arguments for ``served`` as ``user``."""
    return {
        "gateway_url": served.url,
        "gateway_token": served.tokens[user],
        "ca_certs": str(served.log.parent / "pki" / "ca.pem"),
    }


def project(users: dict[str, pwd.struct_passwd], user: str) -> Path:
    return Path(users[user].pw_dir) / "proj"


@pytest.fixture(autouse=True)
def _no_gateway_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("JUPYTER_GATEWAY_URL", "JUPYTER_GATEWAY_AUTH_TOKEN", "JUPYTER_GATEWAY_CA_CERTS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.timeout(600)
async def test_a_sessions_handler_on_the_gateway_is_asked_and_its_answers_obeyed(
    asking_gateway: Served, users: dict[str, pwd.struct_passwd], docker_client: docker.DockerClient
) -> None:
    """once lets one request through, deny refuses one, a handler slower than the kernel's
    approval_timeout denies, kernel allows the domain from then on (no more questions); the
    gateway's audit lines say who answered, for alice."""
    before = HostState(docker_client)
    alice = USERS[0]
    asked: list[str] = []
    behaviours = ["once", "deny", "slow", "kernel"]

    def handler(request: ApprovalRequest) -> str:
        asked.append(f"{request.method} {request.host}:{request.port} {request.timeout:g}")
        behaviour = behaviours.pop(0)
        if behaviour == "slow":
            time.sleep(20)  # well past the kernel's approval_timeout (5 s)
            return "once"
        return behaviour

    session = AsyncSandboxSession(
        ASKING_SOON, project(users, alice), approval_handler=handler, **on_gateway(asking_gateway, alice)
    )
    await session.start()
    try:
        assert (await session.run(fetch())).stdout.strip() == "OK 200"
        assert asked == [f"CONNECT {ASKED}:443 5"]
        denied = (await session.run(fetch())).stdout
        assert denied.startswith("FAILED"), denied
        assert f"{ASKED}:443 needed approval and was denied by the approval_handler" in denied
        started = time.monotonic()
        slow = (await session.run(fetch())).stdout
        assert "no answer within 5 s (approval_timeout)" in slow, slow
        assert time.monotonic() - started < 15, "denied at the kernel's timeout, not the handler's answer"
        assert (await session.run(fetch())).stdout.strip() == "OK 200"
        assert (await session.run(fetch())).stdout.strip() == "OK 200"
        assert len(asked) == 4, "allowed for the kernel: not asked again"
        assert (await session.run(fetch(f"https://{ALLOWED}/"))).stdout.split()[0] == "OK", "its own list"
        assert len(asked) == 4
    finally:
        await session.shutdown()
    answered = approvals(audit_log_of(asking_gateway))
    assert [(line["answer"], line["by"], line.get("user")) for line in answered] == [
        ("once", "by the approval_handler", alice),
        ("deny", "by the approval_handler", alice),
        ("deny", "timeout", alice),
        ("kernel", "by the approval_handler", alice),
    ]
    assert await asyncio.to_thread(before.new_leftovers, 15) == []


@pytest.mark.timeout(600)
async def test_another_user_neither_sees_nor_answers_her_kernels_questions(
    asking_gateway: Served, users: dict[str, pwd.struct_passwd]
) -> None:
    """Alice's program (here her own calls of the owner's routes) holds a real question of her
    kernel's; bob, with his own valid token and her ids, gets 403 on every approval route, and
    her answer is the one obeyed."""
    alice, bob = USERS
    session = AsyncSandboxSession(ASKING_SOON, project(users, alice), **on_gateway(asking_gateway, alice))
    await session.start()
    kernel_id = str(session.kernel_id)
    route = f"/api/sandbox-kernel/kernels/{kernel_id}/approvals"
    try:
        registered = await asking_gateway.fetch(route, alice, "POST", {})
        assert registered.code == 200, registered.body
        answerer = json.loads(registered.body)["answerer"]
        running = asyncio.ensure_future(session.run(fetch()))
        polled = await asking_gateway.fetch(f"{route}?answerer={answerer}&wait=20", alice)
        (question,) = json.loads(polled.body)["questions"]
        assert (question["host"], question["port"]) == (ASKED, 443)
        for path, method, body in [
            (route, "POST", {}),
            (f"{route}?answerer={answerer}&wait=0", "GET", None),
            (f"{route}/{question['id']}?answerer={answerer}", "POST", {"answer": "once"}),
            (f"{route}?answerer={answerer}", "DELETE", None),
        ]:
            for user in (bob, None):
                response = await asking_gateway.fetch(path, user, method, body)
                assert response.code == 403, f"{user}: {method} {path}: {response.code}"
        assert not running.done(), "the question still waits for her"
        answered = await asking_gateway.fetch(
            f"{route}/{question['id']}?answerer={answerer}", alice, "POST", {"answer": "once"}
        )
        assert answered.code == 204, answered.body
        assert (await running).stdout.strip() == "OK 200"
        await asking_gateway.fetch(f"{route}?answerer={answerer}", alice, "DELETE")
    finally:
        await session.shutdown()


#: Kernel code: every way it has to ask or answer a question itself, each printing what came of it.
HOSTILE = """
import os, socket, threading, urllib.request, urllib.error
route = 'api/sandbox-kernel/kernels/{kernel_id}/approvals'

def attempt(name, call):
    try:
        call()
        print('REACHED', name)
    except Exception as e:
        print('refused', name, type(e).__name__)

# A question of its own words, on the stdin channel (a session's runs allow none).
attempt('input', lambda: input("Sandbox: allow a connection to pypi.org:443? Type once: "))
# The gateway itself: directly, and through the proxy by address and by name.
attempt('socket', lambda: socket.create_connection(('127.0.0.1', {port}), timeout=5))
for host in ('127.0.0.1', 'localhost'):
    attempt('proxy ' + host, lambda: urllib.request.urlopen(f'https://{{host}}:{port}/{{route}}', timeout=10))
# A domain beyond the gateway's ceiling: nobody is asked.
attempt('beyond', lambda: urllib.request.urlopen('https://example.com/', timeout=10))
print('token' in ' '.join(os.environ).lower(), 'GATEWAY' in ' '.join(os.environ))
"""


@pytest.mark.timeout(600)
async def test_hostile_kernel_code_can_neither_make_a_question_nor_answer_one(
    asking_gateway: Served, users: dict[str, pwd.struct_passwd]
) -> None:
    """With alice's program answering for her kernel, code in the kernel prompts in the
    question's words, tries the gateway's routes every way it can, and reaches beyond the
    ceiling: no question reaches her handler. While a real question of its waits, it tries to
    answer it (the same ways, in vain); her handler's deny is what counts."""
    alice = USERS[0]
    asked: list[str] = []
    holding = threading.Event()

    def handler(request: ApprovalRequest) -> str:
        asked.append(f"{request.host}:{request.port}")
        holding.wait(60)
        return "deny"

    session = AsyncSandboxSession(
        ASKING_SOON, project(users, alice), approval_handler=handler, **on_gateway(asking_gateway, alice)
    )
    await session.start()
    port = int(asking_gateway.url.rpartition(":")[2])
    hostile = HOSTILE.format(kernel_id=session.kernel_id, port=port)
    try:
        result = await session.run(hostile)
        lines = result.stdout.splitlines()
        assert lines[0] == "refused input StdinNotImplementedError", result.stdout
        assert [line.split()[:2] for line in lines[1:5]] == [
            ["refused", "socket"],
            ["refused", "proxy"],
            ["refused", "proxy"],
            ["refused", "beyond"],
        ], result.stdout
        assert lines[5] == "False False", "no token, no gateway variable in the kernel"
        assert asked == [], "nothing of the kernel's reached her handler"

        # A real question waits (a request of a thread of the kernel's); the kernel tries to answer.
        await session.run(
            "import threading, urllib.request\n"
            "out = []\n"
            "def fetch():\n"
            "    try:\n"
            f"        out.append(urllib.request.urlopen({URL!r}, timeout=30).status)\n"
            "    except Exception as e:\n"
            "        out.append(str(e))\n"
            "asking = threading.Thread(target=fetch); asking.start()"
        )
        deadline = time.monotonic() + 30
        while not asked:
            assert time.monotonic() < deadline, "the kernel's request was not asked about"
            await asyncio.sleep(0.1)
        tried = await session.run(hostile.replace("input(", "print("))
        assert "REACHED" not in tried.stdout.replace("REACHED input", ""), tried.stdout
        holding.set()
        outcome = await session.run("asking.join(); print(out[0])")
        assert f"{ASKED}:443 needed approval and was denied by the approval_handler" in outcome.stdout
        assert asked == [f"{ASKED}:443"]
    finally:
        holding.set()
        await session.shutdown()


#: A program that answers "once" for its kernel on the gateway, and dies without a word.
DYING_PROGRAM = """
import sys, time
from sandbox_kernel import SandboxSession
session = SandboxSession(sys.argv[1], sys.argv[2], approval_handler=lambda request: "once")
session.start()
print(session.kernel_id, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(600)
async def test_a_program_that_dies_leaves_its_kernels_requests_denied(
    asking_gateway: Served, users: dict[str, pwd.struct_passwd], docker_client: docker.DockerClient
) -> None:
    """A program whose handler would say once is killed outright: the kernel it left on the
    gateway is denied what it asks. The question asked then waits until the gateway finds
    the program gone (its poll's connection closed, and no new poll within the lease), and
    is denied, well before the kernel's approval_timeout (20 s); the next is asked as for
    any session without a handler, which cannot answer."""
    before = HostState(docker_client)
    alice = USERS[0]
    settings = on_gateway(asking_gateway, alice)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER_GATEWAY_")}
    env.update(
        JUPYTER_GATEWAY_URL=settings["gateway_url"],
        JUPYTER_GATEWAY_AUTH_TOKEN=settings["gateway_token"],
        JUPYTER_GATEWAY_CA_CERTS=settings["ca_certs"],
    )
    program = subprocess.Popen(  # our own test program
        [sys.executable, "-c", DYING_PROGRAM, ASKING, str(project(users, alice))],
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert program.stdout is not None
        kernel_id = (await asyncio.to_thread(program.stdout.readline)).decode().strip()
        assert kernel_id, "the program started its kernel"
    finally:
        program.kill()
        program.wait()
    killed = time.monotonic()
    session = await AsyncSandboxSession.connect(kernel_id, **settings)
    try:
        out = (await session.run(fetch())).stdout
        assert out.startswith("FAILED"), out
        assert "needed approval and was denied by sandbox-kernel: the program that answered approvals" in out
        # (The message says which: the approval_timeout's would name it. The time is what a
        # busy machine's connect and run may add.)
        assert time.monotonic() - killed < LEASE + 15, "once the lease ran out"
        out = (await session.run(fetch())).stdout
        assert out.startswith("FAILED"), out
        assert "no approval_handler is set" in out, "asked as without a program: its runs cannot answer"
    finally:
        await session.shutdown()
    answered = [(line["answer"], line["by"]) for line in approvals(audit_log_of(asking_gateway))]
    assert answered == [("deny", GONE), ("deny", NO_STDIN)]
    assert await asyncio.to_thread(before.new_leftovers, 15) == []


@pytest.mark.timeout(600)
async def test_the_mcp_server_on_the_gateway_asks_its_client(
    asking_gateway: Served,
    users: dict[str, pwd.struct_passwd],
    tmp_path: Path,
    docker_client: docker.DockerClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``jupyter sandbox-kernel mcp --gateway-url`` with the kernelspec that asks, driven by the
    mcp package's stdio client: its elicitation is the question, and the choice is obeyed."""
    before = HostState(docker_client)
    alice = USERS[0]
    monkeypatch.setattr(mcp_stdio, "PROCESS_TERMINATION_TIMEOUT", 60.0)  # a busy two-core host
    settings = on_gateway(asking_gateway, alice)
    token_file = tmp_path / "token"
    token_file.write_text(settings["gateway_token"] + "\n")
    token_file.chmod(0o600)
    params = StdioServerParameters(
        command=str(Path(sys.executable).with_name("jupyter-sandbox-kernel")),
        args=[
            "mcp",
            f"--kernel={ASKING_SOON}",
            f"--gateway-url={settings['gateway_url']}",
            f"--gateway-token-file={token_file}",
            f"--ca-certs={settings['ca_certs']}",
            f"--cwd={project(users, alice)}",
        ],
        env={k: v for k, v in os.environ.items() if not k.startswith("JUPYTER_GATEWAY_")},
    )
    asked: list[str] = []
    choices = ["once", "deny"]

    async def choose(context: Any, params: ElicitRequestParams) -> ElicitResult:
        asked.append(params.message)
        return ElicitResult(action="accept", content={"answer": choices.pop(0)})

    async with (
        stdio_client(params) as (read, write),
        ClientSession(read, write, elicitation_callback=choose) as client,
    ):
        await client.initialize()
        first = await client.call_tool("run_code", {"code": fetch()}, read_timeout_seconds=180)
        out = first.structured_content
        assert out is not None, first.content
        assert out["stdout"].strip() == "OK 200"
        assert out["notes"] == [f"a connection to {ASKED}:443 needed approval: the client answered once"]
        assert asked[0].startswith(f"Sandbox: allow a connection to {ASKED}:443?")
        second = await client.call_tool("run_code", {"code": fetch()}, read_timeout_seconds=180)
        out = second.structured_content
        assert out is not None
        assert out["stdout"].startswith("FAILED")
        assert "needed approval and was denied by the approval_handler" in out["stdout"]
        assert len(asked) == 2
    answered = approvals(audit_log_of(asking_gateway))
    assert [(line["answer"], line["by"], line.get("user")) for line in answered] == [
        ("once", "by the approval_handler", alice),
        ("deny", "by the approval_handler", alice),
    ]
    assert await asyncio.to_thread(before.new_leftovers, 15) == []
