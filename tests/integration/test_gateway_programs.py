"""Programs pointed at a sandbox gateway: the session API and ``jupyter sandbox-kernel mcp
--gateway-url``, as a real user with a token over TLS, against the gateway as an administrator
runs it (test_gateway.py's), with real gVisor kernels (one at a time)."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import subprocess
import sys
from pathlib import Path
from typing import Any

import docker
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client import stdio as mcp_stdio

from sandbox_kernel.agents.session import AsyncSandboxSession, SandboxSession
from sandbox_kernel.errors import KernelNotFoundError

from .conftest import KERNEL, HostState
from .test_gateway import USERS, Served, containers_of, gateway, users

pytestmark = pytest.mark.integration
__all__ = ["gateway", "users"]  # the fixtures, as test_gateway.py makes them

SK = Path(sys.executable).with_name("jupyter-sandbox-kernel")


def ca_file(served: Served) -> str:
    """The CA that signed the gateway's certificate (``gateway init-tls``)."""
    return str(served.log.parent / "pki" / "ca.pem")


def on_gateway(served: Served, user: str) -> dict[str, Any]:
    return {"gateway_url": served.url, "gateway_token": served.tokens[user], "ca_certs": ca_file(served)}


async def kernels_of(served: Served, user: str) -> list[str]:
    return [model["id"] for model in json.loads((await served.fetch("/api/kernels", user)).body)]


@pytest.fixture(autouse=True)
def _no_gateway_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("JUPYTER_GATEWAY_URL", "JUPYTER_GATEWAY_AUTH_TOKEN", "JUPYTER_GATEWAY_CA_CERTS"):
        monkeypatch.delenv(name, raising=False)
    # Stopping a gVisor kernel through the gateway on a busy two-core host takes a while.
    monkeypatch.setattr(mcp_stdio, "PROCESS_TERMINATION_TIMEOUT", 60.0)


@pytest.mark.timeout(600)
async def test_a_session_on_the_gateway_runs_reads_usage_detaches_and_only_its_user_reattaches(
    gateway: Served, users: dict[str, pwd.struct_passwd], docker_client: docker.DockerClient
) -> None:
    before = HostState(docker_client)
    alice, bob = USERS
    proj = Path(users[alice].pw_dir) / "proj"
    session = AsyncSandboxSession(KERNEL, proj, memory="1g", **on_gateway(gateway, alice))
    await session.start()
    kernel_id = str(session.kernel_id)
    try:
        assert (await session.current_policy())["memory"] == "1g", "the narrowing reached the gateway"
        result = await session.run("1+1")
        assert (result.status, result.text) == ("ok", "2")
        quiet = await session.run("import time; time.sleep(2); 'slept'")
        assert (quiet.status, quiet.text) == ("ok", "'slept'"), "a cell silent for seconds is waited for"
        printed = await session.run("import os; x = 42; print('hello', os.getuid())")
        assert printed.stdout.split() == ["hello", str(users[alice].pw_uid)], "as alice's uid"
        assert printed.cpu_time is not None, "from the gateway's usage route"
        assert printed.peak_memory is None, "the gateway reads no peak of one run"
        usage = await session.usage()
        assert usage["state"] == "running"
        assert usage["cpu_seconds"] > 0
        assert usage["memory"]["used"] > 0
        assert usage["memory"]["limit"] == 1024**3

        paused = await session.pause()
        assert paused.checkpoint
        assert (await session.usage())["state"] == "paused"
        await session.resume()
        assert (await session.run("x")).text == "42", "resumed, its variables intact"

        assert await session.files.upload("in.txt", b"data") == "/workspace/in.txt"
        assert (proj / "in.txt").stat().st_uid == users[alice].pw_uid
        await session.run("open('out.txt', 'w').write(open('in.txt').read().upper())")
        assert await session.files.download("out.txt") == b"DATA"
        assert "out.txt" in [info.name for info in await session.files.list()]

        await session.detach()
        assert await kernels_of(gateway, alice) == [kernel_id], "detached, not deleted"
        with pytest.raises(KernelNotFoundError, match="no kernel"):
            await AsyncSandboxSession.connect(kernel_id, **on_gateway(gateway, bob))

        session = await AsyncSandboxSession.connect(kernel_id, **on_gateway(gateway, alice))
        assert (await session.run("x")).text == "42", "the same kernel, its variables"
    finally:
        await session.shutdown()
    assert await kernels_of(gateway, alice) == []
    assert containers_of(kernel_id) == []

    # The docs' example: the same for code without asyncio.
    with SandboxSession(KERNEL, proj, memory="1g", **on_gateway(gateway, alice)) as sandbox:
        assert sandbox.run("1 + 1").text == "2"
        assert sandbox.usage()["cpu_seconds"] > 0
    assert await kernels_of(gateway, alice) == []
    assert await asyncio.to_thread(before.new_leftovers) == []


@pytest.mark.timeout(600)
async def test_the_mcp_server_runs_code_on_the_gateway(
    gateway: Served, users: dict[str, pwd.struct_passwd], tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    before = HostState(docker_client)
    alice = USERS[0]
    token_file = tmp_path / "token"
    token_file.write_text(gateway.tokens[alice] + "\n")
    token_file.chmod(0o600)
    env = {name: value for name, value in os.environ.items() if not name.startswith("JUPYTER_GATEWAY_")}
    params = StdioServerParameters(
        command=str(SK),
        args=[
            "mcp",
            f"--gateway-url={gateway.url}",
            f"--gateway-token-file={token_file}",
            f"--ca-certs={ca_file(gateway)}",
            f"--cwd={Path(users[alice].pw_dir) / 'proj'}",
        ],
        env=env,
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        result = await client.call_tool(
            "run_code", {"code": "import os; print(os.getuid()); 6 * 7"}, read_timeout_seconds=180
        )
        assert not result.is_error, result.content
        out = result.structured_content
        assert out is not None
        assert (out["status"], out["stdout"].split(), out["text"]) == (
            "ok",
            [str(users[alice].pw_uid)],
            "42",
        )
        assert len(await kernels_of(gateway, alice)) == 1
    assert await kernels_of(gateway, alice) == [], "the server shut its kernel down on the gateway"
    assert await asyncio.to_thread(before.new_leftovers) == []


@pytest.mark.timeout(600)
async def test_a_notebook_runs_on_the_gateway(
    gateway: Served, users: dict[str, pwd.struct_passwd], tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    before = HostState(docker_client)
    alice = USERS[0]
    notebook = tmp_path / "nb.ipynb"
    cell = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None}
    cell["source"] = "import os\nprint(1 + 1, os.getuid())"
    notebook.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    env = {name: value for name, value in os.environ.items() if not name.startswith("JUPYTER_GATEWAY_")}
    env["JUPYTER_GATEWAY_AUTH_TOKEN"] = gateway.tokens[alice]
    done = await asyncio.to_thread(
        subprocess.run,
        [
            str(SK),
            "run",
            str(notebook),
            f"--gateway-url={gateway.url}",
            f"--ca-certs={ca_file(gateway)}",
            f"--cwd={Path(users[alice].pw_dir) / 'proj'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"2 {users[alice].pw_uid}" in done.stdout
    executed = json.loads((tmp_path / "nb.executed.ipynb").read_text())
    assert "".join(executed["cells"][0]["outputs"][0]["text"]) == f"2 {users[alice].pw_uid}\n"
    assert await kernels_of(gateway, alice) == [], "the kernel was shut down on the gateway"
    assert await asyncio.to_thread(before.new_leftovers) == []
