"""Approval prompts on a sandbox gateway: a kernel of kernelspec ``approval: "egress"`` asks
before it leaves its allow-list, through the gateway, for real.

The gateway runs as an administrator runs it (test_gateway.py's users and TLS), with a
kernelspec that allows ``files.pythonhosted.org`` and asks about the rest of the gateway's
``max_allowed_domains`` (``pypi.org``): the one site this machine reaches, through the
gateway's egress proxy. In JupyterLab (the user's own ``jupyter lab`` with the package's
gateway client, in Chromium) the question is a prompt in the notebook.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pwd
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker
import pytest
from playwright.sync_api import Browser, expect

from .conftest import HostState
from .test_gateway import Served, cli, free_port
from .test_gateway_netns import CLIENT_MANAGER, USER_VENV, UserServer
from .test_lab_browser import ARTIFACTS, LAB_CONFIG, Lab
from .test_lab_browser import browser as browser  # Debian's chromium, headless

pytestmark = pytest.mark.integration
#: Users of their own (test_gateway.py's may be made and removed by a run beside this one).
USERS = ("sk-ap-alice", "sk-ap-bob")

ASKING = "py-asking"
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
    made = {}
    try:
        for name in USERS:
            subprocess.run(["userdel", "-r", name], check=False, capture_output=True)  # a crashed run's
            subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True)
            account = pwd.getpwnam(name)
            Path(account.pw_dir).chmod(0o700)
            project = Path(account.pw_dir) / "proj"
            project.mkdir()
            os.chown(project, account.pw_uid, account.pw_gid)
            made[name] = account
        yield made
    finally:
        for name in made:
            subprocess.run(["userdel", "-r", name], check=False, capture_output=True)


@pytest.fixture
def asking_gateway(
    users: dict[str, pwd.struct_passwd], tmp_path: Path, make_kernelspec: Callable[..., str]
) -> Iterator[Served]:
    """The gateway (test_gateway.py's, TLS on loopback) with an audit log, the kernelspec
    "Asking Python" and a ceiling of pypi.org and files.pythonhosted.org."""
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
    private = tmp_path / "gw"
    private.mkdir(mode=0o700)
    env = {**os.environ}
    cli("gateway", "init-tls", f"--dir={private / 'pki'}", "--hostname=localhost", "--ip=127.0.0.1", env=env)
    tokens_file = private / "tokens.json"
    tokens = {
        name: cli("gateway", "add-token", name, f"--tokens-file={tokens_file}", env=env).strip()
        for name in users
    }
    port = free_port()
    config = private / "jupyter_sandbox_gateway_config.py"
    config.write_text(
        "\n".join(
            [
                'c.ServerApp.ip = "127.0.0.1"',
                f"c.ServerApp.port = {port}",
                f'c.ServerApp.certfile = "{private / "pki" / "server.pem"}"',
                f'c.ServerApp.keyfile = "{private / "pki" / "server-key.pem"}"',
                f'c.ServerApp.root_dir = "{private}"',
                f'c.TokensFileIdentityProvider.path = "{tokens_file}"',
                'c.UserPolicy.workspace_root = "/home/{username}"',
                f"c.SandboxProvisioner.max_allowed_domains = [{ALLOWED!r}, {ASKED!r}]",
                f"c.SandboxProvisioner.egress_private_networks = {[f'{a}/32' for a in reached_at()]!r}",
                f'c.SandboxProvisioner.audit_log = "{private / "audit.jsonl"}"',
                "",
            ]
        )
    )
    tls = ssl.create_default_context(cafile=str(private / "pki" / "ca.pem"))
    command = [str(Path(sys.executable).with_name("jupyter-sandbox-kernel")), "gateway", f"--config={config}"]
    served = Served(f"https://127.0.0.1:{port}", tokens, tls, private / "gateway.log", command, env)
    try:
        served.start()
        yield served
    finally:
        served.stop()
        if served.log.exists():
            print(served.log.read_text())  # shown when a test fails


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
