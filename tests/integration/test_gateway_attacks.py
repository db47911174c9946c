"""Attacks on the sandbox gateway as run for real (root, TLS, real users, gVisor kernels), each
written the way the attacker tried it: hostile code in a user's kernel, and another local user
of the sandbox host who has no token. A test that passes is an attack that failed."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import pytest

from sandbox_kernel.lifecycle.ownership import PINNED_WORKSPACE
from sandbox_kernel.plan.sandbox_spec import LABEL_RUNTIME_DIR

from .conftest import KERNEL, HostState
from .test_gateway import USERS, Served, cli, containers_of, gateway, pooled_for, run_code, users

pytestmark = pytest.mark.integration
__all__ = ["gateway", "users"]  # the fixtures, as test_gateway.py makes them


def host_addresses() -> list[str]:
    """Every IPv4 address of this host (loopback, the Docker bridge's, the others)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True)
    return [line.split()[3].partition("/")[0] for line in out.stdout.splitlines()]


def as_user(account: pwd.struct_passwd, attempt: Callable[[], Any]) -> Any:
    """What ``attempt()`` returns (JSON) when run by a child process with ``account``'s uid,
    gid and no other groups: a local user of the sandbox host, with no token."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the user, try, report, and never return to pytest
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(account.pw_gid)
            os.setuid(account.pw_uid)
            os.write(write, json.dumps(attempt()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def what_opens(paths: list[str]) -> dict[str, list[str]]:
    """Of ``paths``: which the caller could read (files), list (folders), or connect to
    (unix sockets)."""
    found: dict[str, list[str]] = {"read": [], "listed": [], "connected": []}
    for path in paths:
        try:
            if os.path.isdir(path):
                os.listdir(path)
                found["listed"].append(path)
                continue
            with open(path, "rb") as f:
                f.read(1)
            found["read"].append(path)
        except OSError:
            pass
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(2)
                s.connect(path)
            found["connected"].append(path)
        except OSError:
            pass
    return found


async def test_hostile_code_in_a_users_kernel_finds_no_secret_and_reaches_no_gateway_docker_or_files(
    gateway: Served, users: dict[str, pwd.struct_passwd], docker_client: docker.DockerClient
) -> None:
    before = HostState(docker_client)
    alice, bob = USERS
    home = Path(users[alice].pw_dir)
    token = gateway.tokens[alice]
    # Her server sends its own env, with her token and secrets in it, hoping they get through.
    env = {
        "KERNEL_WORKING_DIR": str(home / "proj"),
        "JUPYTER_GATEWAY_AUTH_TOKEN": token,
        "KERNEL_SECRET": "s3cret-kernel-var",
        "LD_PRELOAD": "/tmp/evil.so",
    }
    started = await gateway.fetch("/api/kernels", alice, "POST", {"name": KERNEL, "env": env})
    assert started.code == 201, started.body
    kernel_id = json.loads(started.body)["id"]
    port = int(gateway.url.rpartition(":")[2])
    private = gateway.log.parent
    guesses = [
        str(private / "tokens.json"),
        str(private / "pki" / "server-key.pem"),
        str(private / "pki" / "ca-key.pem"),
        "/etc/sandbox-kernel/gateway/tokens.json",
        "/etc/sandbox-kernel/gateway/server-key.pem",
        "/etc/shadow",
        str(Path(users[bob].pw_dir)),
        "/var/run/docker.sock",
        "/run/docker.sock",
        "/run/containerd/containerd.sock",
    ]
    code = f"""
import json, os, socket
found = {{"env": sorted(k for k in os.environ if k.startswith(("KERNEL_", "JUPYTER_GATEWAY", "LD_")))}}
leaked = []
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    for name in ("environ", "cmdline"):
        try:
            if {token!r}.encode() in open(f"/proc/{{pid}}/{{name}}", "rb").read():
                leaked.append(f"{{pid}}/{{name}}")
        except OSError:
            pass
found["token_in"] = leaked + [k for k, v in os.environ.items() if {token!r} in v or "s3cret" in v]
reached = []
for ip in {host_addresses()!r}:
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((ip, {port}))
        reached.append(ip)
    except OSError:
        pass
    finally:
        s.close()
found["reached"] = reached
found["exists"] = [p for p in {guesses!r} if os.path.exists(p) and not p.startswith("/etc/shadow")]
opened = []
for p in {guesses!r}:
    try:
        open(p, "rb").read(1)
        opened.append(p)
    except OSError:
        pass
found["opened"] = opened
print(json.dumps(found))
"""
    try:
        ws = await gateway.channels(kernel_id, alice)
        found = json.loads(await run_code(ws, code, timeout=120))
        ws.close()
        assert found["env"] == [], "nothing of her server's env reaches the kernel"
        assert found["token_in"] == [], "her token is nowhere in the sandbox"
        assert found["reached"] == [], "no address of the host serves the gateway to the sandbox"
        assert found["exists"] == [], "the gateway's files, bob's home, the Docker socket: not in the sandbox"
        assert found["opened"] == []
    finally:
        deleted = await gateway.fetch(f"/api/kernels/{kernel_id}", alice, "DELETE")
    assert deleted.code == 204
    assert await asyncio.to_thread(before.new_leftovers) == []


async def test_a_local_user_without_a_token_reads_no_secret_of_the_gateway_nor_a_kernels_sockets(
    gateway: Served, users: dict[str, pwd.struct_passwd], docker_client: docker.DockerClient
) -> None:
    before = HostState(docker_client)
    alice = USERS[0]
    folder = str(Path(users[alice].pw_dir) / "proj")
    started = await gateway.fetch("/api/kernels", alice, "POST", {"env": {"KERNEL_WORKING_DIR": folder}})
    assert started.code == 201, started.body
    kernel_id = json.loads(started.body)["id"]
    try:
        container = containers_of(kernel_id)[0]
        runtime = Path(container.labels[LABEL_RUNTIME_DIR])
        targets = [str(path) for path in [runtime, *runtime.rglob("*")]]
        targets += [m["Source"] for m in container.attrs["Mounts"] if m["Source"] != folder]
        private = gateway.log.parent
        secrets = [
            private / "tokens.json",
            private / "pki" / "server-key.pem",
            private / "pki" / "ca-key.pem",
        ]
        audit = Path(os.environ["JUPYTER_DATA_DIR"]) / "sandbox-kernel" / "audit.jsonl"
        assert audit.exists()
        for path in [*secrets, audit]:
            # Private by their own mode, wherever an administrator puts them.
            assert path.stat().st_mode & 0o077 == 0, f"{path}: {oct(path.stat().st_mode)}"
        targets += [str(p) for p in [*secrets, audit]]
        assert gateway.process is not None
        targets += [f"/proc/{gateway.process.pid}/{name}" for name in ("environ", "mem", "fd/0", "cwd")]
        for name in USERS:  # bob, and alice herself: her kernel's uid is hers
            found = as_user(users[name], lambda: what_opens(targets))
            assert found == {"read": [], "listed": [], "connected": []}, name
        assert (await gateway.fetch("/api/kernels", None)).code == 403, "the port asks for a token"
    finally:
        deleted = await gateway.fetch(f"/api/kernels/{kernel_id}", alice, "DELETE")
    assert deleted.code == 204
    assert await asyncio.to_thread(before.new_leftovers) == []


def readable_folder_of(account: pwd.struct_passwd, name: str, secret: str) -> Path:
    """A folder of ``account``'s that anyone may read (0755) once they reach it, holding a
    file of ``secret``, inside their home (0700): no one else reaches it but by a mount."""
    folder = Path(account.pw_dir) / name
    shutil.rmtree(folder, ignore_errors=True)  # a failed test's, in a home the module keeps
    folder.mkdir(mode=0o755)
    (folder / "secret.txt").write_text(secret)
    for path in (folder, folder / "secret.txt"):
        os.chown(path, account.pw_uid, account.pw_gid)
    return folder


class FolderSwapper:
    """Alice, as her uid, swapping her folder ``race`` for a link (her folder set aside as
    ``.race-aside``) and back."""

    def __init__(self, account: pwd.struct_passwd, race: Path) -> None:
        self.account, self.race, self.aside = account, race, race.with_name(".race-aside")

    def to(self, target: str | Path) -> None:
        race, aside = self.race, self.aside

        def swap() -> bool:
            os.rename(race, aside)
            os.symlink(target, race)
            return True

        as_user(self.account, swap)

    def back(self) -> None:
        race, aside = self.race, self.aside

        def back() -> bool:
            if race.is_symlink():
                os.unlink(race)
            if aside.exists():
                os.rename(aside, race)
            return True

        as_user(self.account, back)

    def remove(self) -> None:
        self.back()
        shutil.rmtree(self.race, ignore_errors=True)


#: What a kernel of hers reports of its working folder: its uid, its entries, what it can read
#: of the others' secrets, and the file it writes there (found on the host afterwards).
WHERE_AM_I = """import os, json
out = {'uid': os.getuid()}
try: out['cwd'] = sorted(os.listdir('.'))[:20]
except OSError as e: out['cwd'] = e.errno
for p in ('secret.txt', 'sk-gw-attack-secret.txt', 'shadow'):
    try: out[p] = open(p).read()
    except OSError as e: out[p] = e.errno
try: open(%r, 'w').write('x'); out['wrote'] = True
except OSError as e: out['wrote'] = e.errno
print(json.dumps(out))
"""


async def test_swapping_her_folder_for_a_link_while_kernels_start_never_mounts_another_folder(
    gateway: Served, users: dict[str, pwd.struct_passwd], docker_client: docker.DockerClient
) -> None:
    """The check/mount race: alice swaps the folder she asks for with a link (to a folder of
    bob's that anyone may read once inside his private home, to /etc, to /root) while the
    gateway checks and mounts it, at a later moment each try. A kernel of hers that starts
    has her folder as its workspace, the one checked, and nothing else; any other outcome is
    a refusal."""
    before = HostState(docker_client)
    alice, bob = USERS
    account = users[alice]
    bobs = readable_folder_of(users[bob], "shared", "bob's")
    Path("/root/sk-gw-attack-secret.txt").write_text("root's")
    race = Path(account.pw_dir) / "race"
    race.mkdir()
    (race / "mine.txt").write_text("alice's")
    for path in (race, race / "mine.txt"):
        os.chown(path, account.pw_uid, account.pw_gid)
    swapper = FolderSwapper(account, race)
    targets = [str(bobs), "/etc", "/root"]
    owners = {path: (path.stat().st_uid, path.stat().st_mode) for path in (Path("/root"), bobs, Path("/etc"))}
    seen: list[Any] = []
    try:
        # Her folder is real when the gateway checks it; it becomes a link a moment later, at
        # a later moment each time, to hit the window between the checks and the mount (here
        # 0.05-0.15 s after her request; before the pin, Docker's mount came up to 1 s later).
        for attempt in range(9):
            body = {"env": {"KERNEL_WORKING_DIR": str(race)}}
            starting = asyncio.ensure_future(gateway.fetch("/api/kernels", alice, "POST", body))
            await asyncio.sleep(0.04 + 0.04 * attempt)
            swapper.to(targets[attempt % 3])
            started = await starting
            swapper.back()
            if started.code != 201:
                assert started.code == 403, started.body
                message = json.loads(started.body)["message"]
                assert "\n" not in message
                seen.append(message)
                continue
            kernel_id = json.loads(started.body)["id"]
            planted = f"planted-by-alice-{attempt}"
            try:
                ws = await gateway.channels(kernel_id, alice)
                out = json.loads(await run_code(ws, WHERE_AM_I % planted, timeout=120))
                ws.close()
                seen.append(out)
                assert out["uid"] == account.pw_uid
                assert out["cwd"] == ["mine.txt"], f"try {attempt}: the workspace is not her folder: {out}"
                assert out["wrote"] is True, out
                assert (race / planted).exists(), "what it writes is in her folder"
            finally:
                assert (await gateway.fetch(f"/api/kernels/{kernel_id}", alice, "DELETE")).code == 204
            (race / planted).unlink()
    finally:
        swapper.remove()
        Path("/root/sk-gw-attack-secret.txt").unlink(missing_ok=True)
    print(seen)
    assert {path: (path.stat().st_uid, path.stat().st_mode) for path in owners} == owners, (
        "nothing handed to her"
    )
    for target in targets:
        assert not list(Path(target).glob("planted-by-alice-*"))
    shutil.rmtree(bobs)
    assert await asyncio.to_thread(before.new_leftovers) == []


def pins_of(folder: Path) -> list[Path]:
    """The pinned workspaces (``<runtime folder>/workspace``) that show ``folder`` or a folder
    in it, as /proc/self/mountinfo has them (a mount's root field: the folder it shows)."""
    found = []
    top = os.fsencode(folder)
    for line in Path("/proc/self/mountinfo").read_bytes().split(b"\n"):
        fields = [
            re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), f) for f in line.split(b" ")
        ]
        if len(fields) < 5 or not (fields[3] == top or fields[3].startswith(top + b"/")):
            continue
        point = Path(os.fsdecode(fields[4]))
        if point.name == PINNED_WORKSPACE and point.parent.name.startswith("sandbox-kernel-"):
            found.append(point)
    return found


def her_race_folder(account: pwd.struct_passwd) -> Path:
    """``~/race`` of hers, holding ``mine.txt``."""
    race = Path(account.pw_dir) / "race"
    race.mkdir()
    (race / "mine.txt").write_text("alice's")
    for path in (race, race / "mine.txt"):
        os.chown(path, account.pw_uid, account.pw_gid)
    return race


async def where_am_i(gateway: Served, kernel_id: str, user: str, planted: str) -> dict[str, Any]:
    ws = await gateway.channels(kernel_id, user)
    try:
        return dict(json.loads(await run_code(ws, WHERE_AM_I % planted, timeout=120)))
    finally:
        ws.close()


async def test_her_pooled_kernel_is_the_folder_checked_and_her_swaps_once_it_runs_change_nothing(
    gateway: Served,
    users: dict[str, pwd.struct_passwd],
    docker_client: docker.DockerClient,
    make_kernelspec: Callable[..., str],
) -> None:
    """A sandbox of her pool, claimed: its workspace is pinned on the sandbox's staging folder
    (the slot shows it), and stays her folder when she swaps it for a link to bob's, through a
    pause and a resume (Docker mounts the slot again). Nothing stays mounted once it is gone."""
    before = HostState(docker_client)
    alice, bob = USERS
    account = users[alice]
    home = Path(account.pw_dir)
    name = make_kernelspec("sandboxed-python-gw-pooled-pin", config={"pool_size": 1})
    bobs = readable_folder_of(users[bob], "shared", "bob's")
    swapper = FolderSwapper(account, her_race_folder(account))
    gateway.stop()
    gateway.command.append(f"--GatewayKernelManagerForUsers.pool_users={alice}")
    gateway.start()
    kernel_id = None
    try:
        deadline = time.monotonic() + 120
        while not pooled_for(docker_client, alice, name):
            assert time.monotonic() < deadline, "her pool was never filled"
            await asyncio.sleep(0.5)
        body = {"name": name, "env": {"KERNEL_WORKING_DIR": str(swapper.race)}}
        started = await gateway.fetch("/api/kernels", alice, "POST", body)
        assert started.code == 201, started.body
        kernel_id = json.loads(started.body)["id"]
        assert "pooled sandbox" in gateway.log.read_text(), "claimed from her pool"
        (pin,) = pins_of(home)
        assert os.stat(pin).st_ino == swapper.race.stat().st_ino

        swapper.to(bobs)
        out = await where_am_i(gateway, kernel_id, alice, "planted-1")
        assert (out["cwd"], out["secret.txt"]) == (["mine.txt"], errno.ENOENT), out
        route = f"/api/sandbox-kernel/kernels/{kernel_id}"
        assert (await gateway.fetch(f"{route}/pause", alice, "POST", {})).code == 200
        assert (await gateway.fetch(f"{route}/resume", alice, "POST", {})).code == 200
        out = await where_am_i(gateway, kernel_id, alice, "planted-2")
        assert out["cwd"] == ["mine.txt", "planted-1"], out
        assert not list(bobs.glob("planted-*"))
        swapper.back()
        assert sorted(p.name for p in swapper.race.iterdir()) == ["mine.txt", "planted-1", "planted-2"]
    finally:
        if kernel_id is not None:
            assert (await gateway.fetch(f"/api/kernels/{kernel_id}", alice, "DELETE")).code == 204
        gateway.stop()  # and its pool's sandboxes with it
        swapper.remove()
        shutil.rmtree(bobs, ignore_errors=True)
    assert pins_of(home) == []
    assert await asyncio.to_thread(before.new_leftovers) == []


async def test_her_pinned_folder_outlives_a_gateway_killed_and_goes_with_the_kernel_adopted_or_pruned(
    gateway: Served,
    users: dict[str, pwd.struct_passwd],
    docker_client: docker.DockerClient,
    make_kernelspec: Callable[..., str],
) -> None:
    """kill -9: her persistent kernel runs on, its workspace pinned still (a resume mounts it
    again); she swaps her folder for a link to bob's meanwhile. The gateway adopts the kernel: a
    pause and a resume give it her folder, not bob's; its removal detaches the pin. Her ephemeral
    kernel, an orphan now, is pruned with its pin."""
    before = HostState(docker_client)
    alice, bob = USERS
    account = users[alice]
    home = Path(account.pw_dir)
    persistent = make_kernelspec("sandboxed-python-gw-persistent-pin", config={"lifecycle": "persistent"})
    bobs = readable_folder_of(users[bob], "shared", "bob's")
    swapper = FolderSwapper(account, her_race_folder(account))
    kernels: dict[str, str] = {}
    try:
        for kind, name in (("persistent", persistent), ("ephemeral", KERNEL)):
            body = {"name": name, "env": {"KERNEL_WORKING_DIR": str(swapper.race)}}
            started = await gateway.fetch("/api/kernels", alice, "POST", body)
            assert started.code == 201, started.body
            kernels[kind] = json.loads(started.body)["id"]
        assert len(pins_of(home)) == 2

        gateway.kill()
        assert len(pins_of(home)) == 2, "a sandbox that outlives its gateway keeps its workspace"
        swapper.to(bobs)
        gateway.start()
        listed = [k["id"] for k in json.loads((await gateway.fetch("/api/kernels", alice)).body)]
        assert listed == [kernels["persistent"]]
        route = f"/api/sandbox-kernel/kernels/{kernels['persistent']}"
        assert (await gateway.fetch(f"{route}/pause", alice, "POST", {})).code == 200
        assert (await gateway.fetch(f"{route}/resume", alice, "POST", {})).code == 200
        out = await where_am_i(gateway, kernels["persistent"], alice, "planted-after-adoption")
        assert (out["cwd"], out["secret.txt"]) == (["mine.txt"], errno.ENOENT), out
        assert not list(bobs.glob("planted-*"))

        await asyncio.to_thread(cli, "prune", env=gateway.env)  # unless the gateway's own sweep was first
        assert containers_of(kernels.pop("ephemeral")) == []
        assert len(pins_of(home)) == 1, "the orphan's pin went with it"
        deleted = await gateway.fetch(f"/api/kernels/{kernels.pop('persistent')}", alice, "DELETE")
        assert deleted.code == 204
        assert pins_of(home) == []
    finally:
        for kernel_id in kernels.values():
            await gateway.fetch(f"/api/kernels/{kernel_id}", alice, "DELETE")
            for container in containers_of(kernel_id):
                container.remove(force=True)
        swapper.remove()
        shutil.rmtree(bobs, ignore_errors=True)
    assert await asyncio.to_thread(before.new_leftovers) == []


async def test_no_local_user_reaches_or_replaces_the_folder_her_workspace_is_pinned_on(
    gateway: Served, users: dict[str, pwd.struct_passwd], docker_client: docker.DockerClient
) -> None:
    """The staging folder Docker mounts is root's, in a root-only runtime folder: neither she nor
    bob can list it, rename it, put a link in its place, unmount it, or reach the descriptors
    the gateway pinned it from."""
    before = HostState(docker_client)
    alice = USERS[0]
    home = Path(users[alice].pw_dir)
    folder = str(home / "proj")
    started = await gateway.fetch("/api/kernels", alice, "POST", {"env": {"KERNEL_WORKING_DIR": folder}})
    assert started.code == 201, started.body
    kernel_id = json.loads(started.body)["id"]
    try:
        (pin,) = pins_of(home)
        (mount,) = [
            m for m in containers_of(kernel_id)[0].attrs["Mounts"] if m["Destination"] == "/workspace"
        ]
        assert mount["Source"] == str(pin), "Docker mounts the pin, never her folder's path"
        runtime = pin.parent
        assert (runtime.stat().st_uid, runtime.stat().st_mode & 0o777) == (0, 0o700)
        assert gateway.process is not None
        gateway_fds = f"/proc/{gateway.process.pid}/fd"

        def attempts() -> dict[str, int | str]:
            tried: dict[str, Callable[[], Any]] = {
                "list": lambda: os.listdir(pin),
                "stat": lambda: os.stat(pin),
                "rename": lambda: os.rename(pin, runtime / "elsewhere"),
                "rename-runtime": lambda: os.rename(runtime, runtime.with_name(runtime.name + "-x")),
                "link": lambda: os.symlink("/etc", runtime / "workspace-new"),
                "umount": lambda: subprocess.run(["umount", "-l", str(pin)], check=True, capture_output=True),
                "gateway-fds": lambda: os.listdir(gateway_fds),
            }
            found: dict[str, int | str] = {}
            for what, attempt in tried.items():
                try:
                    attempt()
                    found[what] = "done"
                except OSError as exc:
                    found[what] = exc.errno or 0
                except subprocess.CalledProcessError as exc:
                    found[what] = f"exit {exc.returncode}"
            return found

        for name in USERS:
            found = as_user(users[name], attempts)
            assert "done" not in found.values(), (name, found)
        assert os.stat(pin).st_ino == os.stat(folder).st_ino, "still her folder, pinned"
    finally:
        deleted = await gateway.fetch(f"/api/kernels/{kernel_id}", alice, "DELETE")
    assert deleted.code == 204
    assert pins_of(home) == []
    assert await asyncio.to_thread(before.new_leftovers) == []
