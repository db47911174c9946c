"""The sandbox gateway as an administrator runs it: ``jupyter sandbox-kernel gateway`` as root
over TLS (``init-tls``), two real local users with tokens (``add-token``), a real gVisor
kernel started through its REST API and run over its websocket, and the other user refused."""

from __future__ import annotations

import asyncio
import grp
import json
import os
import pwd
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import docker
import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest, HTTPResponse
from tornado.websocket import websocket_connect

from sandbox_kernel.host.cgroups import memory_limit
from sandbox_kernel.jupyter.gateway_client import SANDBOX_MODEL_KEY
from sandbox_kernel.lifecycle.ownership import SandboxedKernel
from sandbox_kernel.plan.sandbox_spec import LABEL_KERNEL_ID, LABEL_KERNELSPEC, LABEL_POOL, LABEL_USER

from .conftest import KERNEL, HostState, stop_process

pytestmark = pytest.mark.integration

USERS = ("sk-gw-alice", "sk-gw-bob")
COMMAND = str(Path(sys.executable).with_name("jupyter-sandbox-kernel"))


@contextmanager
def local_users(folders: Mapping[str, str]) -> Iterator[dict[str, pwd.struct_passwd]]:
    """Real local users (homes 0700, one folder of theirs each: ``{name: folder}``), made
    afresh (a crashed run's removed first) and removed afterwards."""
    made = {}
    try:
        for name, folder in folders.items():
            subprocess.run(["userdel", "-r", name], check=False, capture_output=True)  # a crashed run's
            subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True)
            account = pwd.getpwnam(name)
            Path(account.pw_dir).chmod(0o700)
            project = Path(account.pw_dir) / folder
            project.mkdir()
            os.chown(project, account.pw_uid, account.pw_gid)
            made[name] = account
        yield made
    finally:
        for name in made:
            subprocess.run(["userdel", "-r", name], check=False, capture_output=True)


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, pwd.struct_passwd]]:
    """Two real local users (homes 0700, a project folder each), in no privileged group;
    removed afterwards."""
    with local_users(dict.fromkeys(USERS, "proj")) as made:
        docker_group = grp.getgrnam("docker")
        assert not set(USERS) & set(docker_group.gr_mem), "a docker-group user is root-equivalent"
        yield made


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str, env: dict[str, str]) -> str:
    done = subprocess.run([COMMAND, *args], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


@dataclass
class Served:
    url: str
    tokens: dict[str, str]
    tls: ssl.SSLContext
    log: Path
    command: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the gateway; return once it listens."""
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(  # our own command
                self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )
        port = int(self.url.rpartition(":")[2])
        deadline = time.monotonic() + 60
        while True:
            assert self.process.poll() is None, self.log.read_text()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return
            except OSError:
                assert time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.2)

    def kill(self) -> None:
        """``kill -9`` the gateway: it lets go of nothing."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        """Stop the gateway as its service manager would (SIGTERM)."""
        if self.process is not None:
            stop_process(self.process)

    def twin(self, root_dir: Path) -> Served:
        """Another gateway on this Docker host, with the same config and users but its own
        root folder (so its own persistent kernels) and port; not started."""
        port = free_port()
        command = [*self.command, f"--port={port}", f"--ServerApp.root_dir={root_dir}"]
        log = root_dir / "gateway.log"
        return Served(f"https://127.0.0.1:{port}", self.tokens, self.tls, log, command, self.env)

    async def fetch(self, path: str, user: str | None, method: str = "GET", body: Any = None) -> HTTPResponse:
        headers = {"Authorization": f"token {self.tokens[user]}"} if user else {}
        request = HTTPRequest(
            self.url + path,
            method=method,
            headers=headers,
            body=body if body is None or isinstance(body, bytes) else json.dumps(body),
            ssl_options=self.tls,
            request_timeout=120,
        )
        return await AsyncHTTPClient().fetch(request, raise_error=False)

    async def channels(self, kernel_id: str, user: str | None) -> Any:
        """The kernel's websocket, as ``user``."""
        headers = {"Authorization": f"token {self.tokens[user]}"} if user else {}
        url = self.url.replace("https", "wss", 1) + f"/api/kernels/{kernel_id}/channels"
        return await websocket_connect(HTTPRequest(url, headers=headers, ssl_options=self.tls))


@contextmanager
def serve_gateway(
    names: Iterable[str], folder: Path, env: dict[str, str], config: Sequence[str] = ()
) -> Iterator[Served]:
    """A gateway started as the docs say, as a process of its own on loopback with TLS
    (``init-tls``), a token for each of ``names`` (``add-token``), its files in ``folder``
    (made 0700) and ``config``'s lines added to its config file; stopped afterwards."""
    folder.mkdir(mode=0o700)
    cli("gateway", "init-tls", f"--dir={folder / 'pki'}", "--hostname=localhost", "--ip=127.0.0.1", env=env)
    tokens_file = folder / "tokens.json"
    tokens = {
        name: cli("gateway", "add-token", name, f"--tokens-file={tokens_file}", env=env).strip()
        for name in names
    }
    port = free_port()
    config_file = folder / "jupyter_sandbox_gateway_config.py"
    config_file.write_text(
        "\n".join(
            [
                'c.ServerApp.ip = "127.0.0.1"',
                f"c.ServerApp.port = {port}",
                f'c.ServerApp.certfile = "{folder / "pki" / "server.pem"}"',
                f'c.ServerApp.keyfile = "{folder / "pki" / "server-key.pem"}"',
                f'c.ServerApp.root_dir = "{folder}"',
                f'c.TokensFileIdentityProvider.path = "{tokens_file}"',
                'c.UserPolicy.workspace_root = "/home/{username}"',
                *config,
                "",
            ]
        )
    )
    tls = ssl.create_default_context(cafile=str(folder / "pki" / "ca.pem"))
    command = [COMMAND, "gateway", f"--config={config_file}"]
    served = Served(f"https://127.0.0.1:{port}", tokens, tls, folder / "gateway.log", command, env)
    try:
        served.start()
        yield served
    finally:
        served.stop()
        if served.log.exists():
            print(served.log.read_text())  # shown when a test fails


@pytest.fixture
def gateway(users: dict[str, pwd.struct_passwd], tmp_path: Path, jupyter_dirs: Path) -> Iterator[Served]:
    """The gateway, started as the docs say, as a process of its own on loopback with TLS."""
    env = {**os.environ, "JUPYTER_PATH": str(jupyter_dirs)}
    with serve_gateway(users, tmp_path / "gw", env, ["c.UserPolicy.max_kernels_per_user = 2"]) as served:
        yield served


async def run_code(ws: Any, code: str, timeout: float = 60) -> str:
    """Run ``code`` over a kernel websocket (jupyter_server's JSON protocol); its stdout."""
    msg_id = uuid.uuid4().hex
    header = {
        "msg_id": msg_id,
        "msg_type": "execute_request",
        "username": "test",
        "session": uuid.uuid4().hex,
    }
    request = {
        "header": {**header, "version": "5.3", "date": ""},
        "parent_header": {},
        "metadata": {},
        "content": {"code": code, "silent": False, "store_history": False, "allow_stdin": False},
        "channel": "shell",
        "buffers": [],
    }
    await ws.write_message(json.dumps(request))
    out = []
    async with asyncio.timeout(timeout):
        while True:
            raw = await ws.read_message()
            assert raw is not None, "the gateway closed the websocket"
            message = json.loads(raw)
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = message["msg_type"]
            if kind == "stream":
                out.append(message["content"]["text"])
            elif kind == "error":
                pytest.fail("\n".join(message["content"]["traceback"]))
            elif kind == "status" and message["content"]["execution_state"] == "idle":
                return "".join(out)


def containers_of(kernel_id: str) -> list[Any]:
    client = docker.from_env()
    try:
        return list(client.containers.list(all=True, filters={"label": f"{LABEL_KERNEL_ID}={kernel_id}"}))
    finally:
        client.close()


async def test_a_user_runs_code_in_their_kernel_through_the_gateway_and_no_one_else_can(
    gateway: Served, users: dict[str, pwd.struct_passwd], docker_client: docker.DockerClient
) -> None:
    before = HostState(docker_client)
    alice, bob = USERS
    home = Path(users[alice].pw_dir)
    started = await gateway.fetch(
        "/api/kernels", alice, "POST", {"name": KERNEL, "env": {"KERNEL_WORKING_DIR": str(home / "proj")}}
    )
    assert started.code == 201, started.body
    kernel_id = json.loads(started.body)["id"]
    try:
        ws = await gateway.channels(kernel_id, alice)
        out = await run_code(
            ws, "import os; open('made-here.txt', 'w').write('x'); print(1 + 1, os.getuid())"
        )
        ws.close()
        assert out.split() == ["2", str(users[alice].pw_uid)], "1+1, as alice's uid"
        assert (home / "proj" / "made-here.txt").stat().st_uid == users[alice].pw_uid, "her file is hers"

        # Bob, with his own valid token: nothing of alice's.
        assert json.loads((await gateway.fetch("/api/kernels", bob)).body) == []
        for path, method in [
            (f"/api/kernels/{kernel_id}", "GET"),
            (f"/api/kernels/{kernel_id}", "DELETE"),
            (f"/api/sandbox-kernel/kernels/{kernel_id}", "GET"),
        ]:
            assert (await gateway.fetch(path, bob, method)).code == 403, path
        assert (await gateway.fetch(f"/api/kernels/{kernel_id}/interrupt", bob, "POST", {})).code == 403
        taken = await gateway.fetch("/api/kernels", bob, "POST", {"kernel_id": kernel_id})
        assert taken.code == 403
        with pytest.raises(HTTPClientError) as refused:
            await gateway.channels(kernel_id, bob)
        assert refused.value.code == 403
        into_hers = await gateway.fetch(
            "/api/kernels", bob, "POST", {"name": KERNEL, "env": {"KERNEL_WORKING_DIR": str(home / "proj")}}
        )
        assert into_hers.code == 403
        assert "outside your sandbox workspace" in json.loads(into_hers.body)["message"]
        assert (await gateway.fetch("/api/kernels", None)).code == 403, "no token"
        assert (await gateway.fetch(f"/api/kernels?token={gateway.tokens[alice]}", None)).code == 403

        labels = containers_of(kernel_id)[0].labels
        assert labels.get("io.sandbox-kernel.user") == alice

        # Her restart starts the kernel for her again.
        assert (await gateway.fetch(f"/api/kernels/{kernel_id}/restart", alice, "POST", {})).code == 200
        ws = await gateway.channels(kernel_id, alice)
        assert (await run_code(ws, "import os; print(os.getuid())")).split() == [str(users[alice].pw_uid)]
        ws.close()
    finally:
        deleted = await gateway.fetch(f"/api/kernels/{kernel_id}", alice, "DELETE")
    assert deleted.code == 204
    assert containers_of(kernel_id) == []
    assert await asyncio.to_thread(before.new_leftovers) == []


async def test_each_new_connection_to_a_kernel_first_hears_whether_it_is_idle_or_busy(
    gateway: Served, users: dict[str, pwd.struct_passwd], docker_client: docker.DockerClient
) -> None:
    """JupyterLab takes a kernel's status only from the ``status`` of a request it tracks,
    never from its own ``kernel_info``'s: a notebook reconnected through the gateway read
    "Unknown" until a cell ran (test_gateway_netns.py shows it in a browser). The gateway's
    first message on each connection is the kernel's state, as its model has it."""
    before = HostState(docker_client)
    alice = USERS[0]
    home = Path(users[alice].pw_dir)
    started = await gateway.fetch(
        "/api/kernels", alice, "POST", {"name": KERNEL, "env": {"KERNEL_WORKING_DIR": str(home / "proj")}}
    )
    assert started.code == 201, started.body
    kernel_id = json.loads(started.body)["id"]

    async def first_message() -> tuple[str, str, dict[str, Any], dict[str, Any]]:
        ws = await gateway.channels(kernel_id, alice)
        async with asyncio.timeout(60):
            message = json.loads(await ws.read_message())
        ws.close()
        return message["channel"], message["msg_type"], message["content"], message["parent_header"]

    async def state() -> str:
        model = json.loads((await gateway.fetch(f"/api/kernels/{kernel_id}", alice)).body)
        return str(model["execution_state"])

    try:
        assert await first_message() == ("iopub", "status", {"execution_state": "idle"}, {})
        ws = await gateway.channels(kernel_id, alice)
        running = asyncio.ensure_future(run_code(ws, "import time; time.sleep(4); print('slept')"))
        async with asyncio.timeout(30):
            while await state() != "busy":
                await asyncio.sleep(0.1)
        assert await first_message() == ("iopub", "status", {"execution_state": "busy"}, {})
        assert await running == "slept\n"
        ws.close()
        async with asyncio.timeout(30):
            while await state() != "idle":
                await asyncio.sleep(0.1)
        assert await first_message() == ("iopub", "status", {"execution_state": "idle"}, {})
    finally:
        deleted = await gateway.fetch(f"/api/kernels/{kernel_id}", alice, "DELETE")
    assert deleted.code == 204
    assert await asyncio.to_thread(before.new_leftovers) == []


async def test_a_persistent_kernel_outlives_the_gateway_killed_and_pauses_for_its_owner(
    gateway: Served,
    users: dict[str, pwd.struct_passwd],
    docker_client: docker.DockerClient,
    make_kernelspec: Callable[..., str],
) -> None:
    before = HostState(docker_client)
    alice, bob = USERS
    uid = users[alice].pw_uid
    name = make_kernelspec("sandboxed-python-gw-persistent", config={"lifecycle": "persistent"})
    home = Path(users[alice].pw_dir)
    started = await gateway.fetch(
        "/api/kernels", alice, "POST", {"name": name, "env": {"KERNEL_WORKING_DIR": str(home / "proj")}}
    )
    assert started.code == 201, started.body
    model = json.loads(started.body)
    kernel_id = model["id"]
    assert model[SANDBOX_MODEL_KEY] == {"lifecycle": "persistent"}
    try:
        ws = await gateway.channels(kernel_id, alice)
        assert (await run_code(ws, "x = 41; print('set')")).split() == ["set"]
        ws.close()

        gateway.kill()  # kill -9: nothing let go of, nothing saved on the way out
        assert containers_of(kernel_id)[0].status == "running"
        gateway.start()
        listed = json.loads((await gateway.fetch("/api/kernels", alice)).body)
        assert [(k["id"], k[SANDBOX_MODEL_KEY]["lifecycle"]) for k in listed] == [(kernel_id, "persistent")]
        assert json.loads((await gateway.fetch("/api/kernels", bob)).body) == [], "hers only"
        for path, method in [
            (f"/api/kernels/{kernel_id}", "GET"),
            (f"/api/sandbox-kernel/kernels/{kernel_id}/usage", "GET"),
            (f"/api/sandbox-kernel/kernels/{kernel_id}/pause", "POST"),
        ]:
            response = await gateway.fetch(path, bob, method, {} if method == "POST" else None)
            assert response.code == 403, path
        ws = await gateway.channels(kernel_id, alice)
        assert (await run_code(ws, "print(x + 1, __import__('os').getuid())")).split() == ["42", str(uid)]

        # Her kernel's files, through the gateway: what it writes is hers, and the kernel's to read.
        files = f"/api/sandbox-kernel/kernels/{kernel_id}/files"
        put = await gateway.fetch(f"{files}?path=sent/in.txt", alice, "PUT", b"from the API")
        assert put.code == 200, put.body
        assert (home / "proj" / "sent" / "in.txt").stat().st_uid == uid
        code = "print(open('sent/in.txt').read()); open('out.txt', 'w').write('from the kernel')"
        assert (await run_code(ws, code)).strip() == "from the API"
        assert (await gateway.fetch(f"{files}?path=out.txt", alice)).body == b"from the kernel"
        listed = json.loads((await gateway.fetch(f"{files}/list", alice)).body)["files"]
        assert {"sent", "out.txt"} <= {f["name"] for f in listed}
        assert (await gateway.fetch(f"{files}?path=out.txt", bob)).code == 403
        assert (await gateway.fetch(f"{files}?path=sent&recursive=true", alice, "DELETE")).code == 204

        # Paused through the gateway; her next message resumes it, x and all.
        route = f"/api/sandbox-kernel/kernels/{kernel_id}"
        paused = await gateway.fetch(f"{route}/pause", alice, "POST", {})
        assert paused.code == 200, paused.body
        assert json.loads(paused.body)["state"] == "paused"
        assert containers_of(kernel_id)[0].status == "exited", "its sandbox stopped, saved to disk"
        assert json.loads((await gateway.fetch(route, alice)).body)["state"] == "paused"
        assert (await run_code(ws, "print(x)", timeout=120)).split() == ["41"]
        ws.close()
        # And paused again, resumed by her asking.
        assert (await gateway.fetch(f"{route}/pause", alice, "POST", {})).code == 200
        resumed = await gateway.fetch(f"{route}/resume", alice, "POST", {})
        assert (resumed.code, json.loads(resumed.body)["state"]) == (200, "running")
        usage = json.loads((await gateway.fetch(f"{route}/usage", alice)).body)
        assert usage["cpu_seconds"] > 0
        assert 0 < usage["memory"]["used"] <= usage["memory"]["peak"]
        audit = json.loads((await gateway.fetch(f"{route}/audit", alice)).body)
        events = [line["event"] for line in audit["lines"]]
        assert {"start", "pause", "resume", "finished"} <= set(events), events
        assert {line["kernel_id"] for line in audit["lines"]} == {kernel_id}

        # The adopted kernel restarts as her.
        assert (await gateway.fetch(f"/api/kernels/{kernel_id}/restart", alice, "POST", {})).code == 200
        ws = await gateway.channels(kernel_id, alice)
        assert (await run_code(ws, "import os; print(os.getuid())")).split() == [str(uid)]
        ws.close()
    finally:
        deleted = await gateway.fetch(f"/api/kernels/{kernel_id}", alice, "DELETE")
    assert deleted.code == 204
    assert containers_of(kernel_id) == []
    assert await asyncio.to_thread(before.new_leftovers) == []


async def test_two_gateways_on_one_docker_host_neither_adopts_nor_prunes_the_others_kernels(
    gateway: Served,
    users: dict[str, pwd.struct_passwd],
    docker_client: docker.DockerClient,
    make_kernelspec: Callable[..., str],
    tmp_path: Path,
) -> None:
    before = HostState(docker_client)
    alice = USERS[0]
    name = make_kernelspec("sandboxed-python-gw-persistent", config={"lifecycle": "persistent"})
    folder = str(Path(users[alice].pw_dir) / "proj")
    started = await gateway.fetch(
        "/api/kernels", alice, "POST", {"name": name, "env": {"KERNEL_WORKING_DIR": folder}}
    )
    assert started.code == 201, started.body
    kernel_id = json.loads(started.body)["id"]
    other_root = tmp_path / "gw2"
    other_root.mkdir(mode=0o700)
    other = gateway.twin(other_root)
    try:
        ws = await gateway.channels(kernel_id, alice)
        await run_code(ws, "x = 7")
        ws.close()
        other.start()  # its start prunes what nobody will use again: not a live gateway's kernel
        assert json.loads((await other.fetch("/api/kernels", alice)).body) == []
        assert containers_of(kernel_id)[0].status == "running"

        gateway.kill()
        other.stop()
        other.start()  # gateway 1 is gone: its kernel is detached, but of another root folder
        assert json.loads((await other.fetch("/api/kernels", alice)).body) == []
        assert (await other.fetch(f"/api/kernels/{kernel_id}", alice)).code == 403
        assert containers_of(kernel_id)[0].status == "running", "kept for the gateway it belongs to"

        gateway.start()
        assert [k["id"] for k in json.loads((await gateway.fetch("/api/kernels", alice)).body)] == [kernel_id]
        ws = await gateway.channels(kernel_id, alice)
        assert (await run_code(ws, "print(x)")).split() == ["7"]
        ws.close()
    finally:
        other.stop()
        if other.log.exists():
            print(other.log.read_text())
        deleted = await gateway.fetch(f"/api/kernels/{kernel_id}", alice, "DELETE")
    assert deleted.code == 204
    assert containers_of(kernel_id) == []
    assert await asyncio.to_thread(before.new_leftovers) == []


def created_at(container: Any) -> float:
    """When Docker created ``container`` (its ``Created``, nanoseconds and all), in epoch seconds."""
    stamp = container.attrs["Created"].rstrip("Z")
    whole, _, fraction = stamp.partition(".")
    return datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp() + float(f"0.{fraction or 0}")


def pooled_for(client: docker.DockerClient, user: str, kernelspec: str) -> list[SandboxedKernel]:
    """The pooled sandboxes waiting, ready, for ``user``'s kernels of ``kernelspec``."""
    labels = [f"{LABEL_POOL}=true", f"{LABEL_USER}={user}", f"{LABEL_KERNELSPEC}={kernelspec}"]
    found = [SandboxedKernel.from_inspect(c.attrs) for c in client.containers.list(filters={"label": labels})]
    return [kernel for kernel in found if kernel.pooled and kernel.pool_ready]


async def test_a_listed_users_kernel_starts_warm_from_their_own_pool_and_another_users_cold(
    gateway: Served,
    users: dict[str, pwd.struct_passwd],
    docker_client: docker.DockerClient,
    make_kernelspec: Callable[..., str],
) -> None:
    before = HostState(docker_client)
    alice, bob = USERS
    name = make_kernelspec("sandboxed-python-gw-pooled", config={"pool_size": 1})
    gateway.stop()
    gateway.command.append(f"--GatewayKernelManagerForUsers.pool_users={alice}")
    gateway.start()
    kernels: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 120
        while not pooled_for(docker_client, alice, name):
            assert time.monotonic() < deadline, "alice's pool was never filled"
            await asyncio.sleep(0.5)
        await asyncio.sleep(1)  # (ready, then frozen and listed)
        assert pooled_for(docker_client, bob, name) == [], "a pool for listed users only"

        # Bob's start: cold (his own container, made after his request), his pool-less reason logged.
        asked = time.time()
        home = Path(users[bob].pw_dir)
        started = await gateway.fetch(
            "/api/kernels", bob, "POST", {"name": name, "env": {"KERNEL_WORKING_DIR": str(home / "proj")}}
        )
        cold = time.time() - asked
        assert started.code == 201, started.body
        kernels[bob] = json.loads(started.body)["id"]
        assert created_at(containers_of(kernels[bob])[0]) > asked
        assert f"no pool planned for user {bob}" in gateway.log.read_text()
        assert len(pooled_for(docker_client, alice, name)) == 1, "alice's sandbox still waits"
        assert (await gateway.fetch(f"/api/kernels/{kernels[bob]}", bob, "DELETE")).code == 204
        del kernels[bob]

        # Alice's start: the sandbox made before she asked, fast, as her uid, her file hers.
        home = Path(users[alice].pw_dir)
        asked = time.time()
        started = await gateway.fetch(
            "/api/kernels", alice, "POST", {"name": name, "env": {"KERNEL_WORKING_DIR": str(home / "proj")}}
        )
        took = time.time() - asked
        assert started.code == 201, started.body
        kernels[alice] = json.loads(started.body)["id"]
        deadline = time.monotonic() + 10  # renamed after its kernel in the background
        while True:
            try:
                container = docker_client.containers.get(f"sandbox-kernel-{kernels[alice]}")
                break
            except docker.errors.NotFound:
                assert time.monotonic() < deadline, "alice's kernel has no container of its name"
                await asyncio.sleep(0.2)
        assert container.labels[LABEL_POOL] == "true"
        assert container.labels[LABEL_USER] == alice
        assert created_at(container) < asked, "her sandbox was started before she asked"
        # (Against bob's cold start of the same run: a busy machine slows both.)
        assert took < cold / 2, f"a warm start took {took:.2f} s (bob's cold one {cold:.2f} s)"
        ws = await gateway.channels(kernels[alice], alice)
        out = await run_code(ws, "import os; open('warm.txt', 'w').write('x'); print(os.getuid())")
        ws.close()
        assert out.split() == [str(users[alice].pw_uid)]
        assert (home / "proj" / "warm.txt").stat().st_uid == users[alice].pw_uid, "her file is hers"
        print(f"through the gateway: alice's warm start {took:.2f} s, bob's cold start {cold:.2f} s")
    finally:
        for user, kernel_id in kernels.items():
            await gateway.fetch(f"/api/kernels/{kernel_id}", user, "DELETE")
        gateway.stop()  # and its pool's sandboxes with it
    assert await asyncio.to_thread(before.new_leftovers) == []


async def test_a_users_pool_is_planned_within_their_groups_ceiling_and_their_start_claims_it_whole(
    gateway: Served,
    users: dict[str, pwd.struct_passwd],
    docker_client: docker.DockerClient,
    make_kernelspec: Callable[..., str],
) -> None:
    """Alice is in the tokens file's group "interns", whose ceiling is 1g of memory and one
    CPU (the kernelspec's are 2g and 2). Her pool waits with her group's limits before she
    asks (a pool used to be planned without them, and narrowed at the claim); her start
    claims it whole: the sandbox made before her request, narrowed by nothing, 1g."""
    before = HostState(docker_client)
    alice = USERS[0]
    name = make_kernelspec("sandboxed-python-gw-interns", config={"pool_size": 1})
    config = Path(gateway.command[-1].partition("=")[2])
    gateway.stop()
    cli(
        "gateway",
        "add-token",
        alice,
        "--group=interns",
        f"--tokens-file={config.parent / 'tokens.json'}",
        env=gateway.env,
    )
    with config.open("a") as out:
        out.write('c.UserPolicy.ceilings = {"group:interns": {"max_memory": "1g", "max_cpus": 1}}\n')
        out.write(f'c.GatewayKernelManagerForUsers.pool_users = ["{alice}"]\n')
    gateway.start()
    kernel_id = None
    try:
        deadline = time.monotonic() + 120
        while not (waiting := pooled_for(docker_client, alice, name)):
            assert time.monotonic() < deadline, "alice's pool was never filled"
            await asyncio.sleep(0.5)
        (pooled,) = waiting
        limits = docker_client.containers.get(pooled.container_id).attrs["HostConfig"]
        assert (limits["Memory"], limits["NanoCpus"]) == (2**30, 10**9), "her group's, before she asked"

        home = Path(users[alice].pw_dir)
        asked = time.time()
        started = await gateway.fetch(
            "/api/kernels", alice, "POST", {"name": name, "env": {"KERNEL_WORKING_DIR": str(home / "proj")}}
        )
        assert started.code == 201, started.body
        kernel_id = json.loads(started.body)["id"]
        renamed, deadline = f"sandbox-kernel-{kernel_id}", time.monotonic() + 10  # in the background
        while (container := docker_client.containers.get(pooled.container_id)).name != renamed:
            assert time.monotonic() < deadline, "her kernel is not in the sandbox that waited"
            await asyncio.sleep(0.2)
        assert created_at(container) < asked, "made before she asked: a warm start"
        claimed = f"Sandboxed kernel {kernel_id}: pooled sandbox {container.id[:12]}"
        (line,) = [line for line in gateway.log.read_text().splitlines() if claimed in line]
        assert line.endswith("narrowed: nothing)"), line
        assert "starting cold" not in gateway.log.read_text()
        container.reload()
        assert memory_limit(container.attrs["State"]["Pid"]) == 2**30, "her group's, in the sandbox's cgroup"
        ws = await gateway.channels(kernel_id, alice)
        assert (await run_code(ws, "import os; print(os.getuid())")).split() == [str(users[alice].pw_uid)]
        ws.close()
    finally:
        if kernel_id is not None:
            await gateway.fetch(f"/api/kernels/{kernel_id}", alice, "DELETE")
        gateway.stop()  # and its pool's sandboxes with it
    assert await asyncio.to_thread(before.new_leftovers) == []
