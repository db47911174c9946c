"""A kernel a sandbox gateway starts for a host user (``start_kernel(sandbox_user=...)``),
under gVisor: it runs as them, what it writes is theirs, it starts only in a folder of
theirs, and a restart keeps it theirs. Its workspace is the very folder checked to be theirs,
however they swap their folders between the check and the mount (a hook there makes the race
certain), through a pause, a resume and a restart, cold or claimed from a pool, whatever its
name; and no mount stays behind. The same paths on the in-memory backend:
tests/unit/test_kernel_user.py."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import secrets
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from jupyter_client.manager import AsyncKernelManager

from sandbox_kernel.errors import KernelStartupError, WorkspaceError
from sandbox_kernel.plan.sandbox_spec import LABEL_KERNEL_ID, LABEL_USER
from sandbox_kernel.plan.users import KernelUser
from sandbox_kernel.pool.sandboxes import SandboxPool
from sandbox_kernel.provisioner import SandboxProvisioner
from sandbox_kernel.warming import plan_pool

from .conftest import KERNEL, HostState
from .test_gateway_attacks import as_user, pins_of

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.getuid() != 0, reason="a gateway's concern: needs root and useradd"),
]


@pytest.fixture
def host_user() -> Iterator[KernelUser]:
    """A new host account ``sk-test-*`` with its home (mode 0700) holding ``project``, as
    the gateway's user; removed with its home afterwards."""
    name = f"sk-test-{secrets.token_hex(3)}"
    subprocess.run(
        ["useradd", "--create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )
    try:
        account = pwd.getpwnam(name)
        home = Path(account.pw_dir)
        home.chmod(0o700)
        (home / "project").mkdir()
        os.chown(home / "project", account.pw_uid, account.pw_gid)
        yield KernelUser(name, account.pw_uid, account.pw_gid, home)
    finally:
        subprocess.run(["userdel", "--remove", name], check=False, capture_output=True)
        subprocess.run(["groupdel", name], check=False, capture_output=True)


@pytest.fixture
async def manager(jupyter_dirs: Path) -> AsyncIterator[AsyncKernelManager]:
    """A manager of the sandboxed kernelspec, its kernel shut down afterwards."""
    km = AsyncKernelManager(kernel_name=KERNEL)
    yield km
    if km.has_kernel:
        await km.shutdown_kernel(now=True)


async def run_in(km: AsyncKernelManager, code: str) -> str:
    """Run ``code`` in the kernel; its stdout (the cell must succeed)."""
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=60)
        out: list[str] = []

        def hook(msg: dict[str, object]) -> None:
            content = msg["content"]
            assert isinstance(content, dict)
            if msg["msg_type"] == "stream":
                out.append(str(content["text"]))

        reply = await kc.execute_interactive(code, timeout=60, output_hook=hook)
        assert reply["content"]["status"] == "ok", reply["content"]
        return "".join(out)
    finally:
        kc.stop_channels()


async def test_a_kernel_for_a_host_user_runs_as_them_in_their_folder_and_restarts_so(
    manager: AsyncKernelManager, host_user: KernelUser, docker_client: docker.DockerClient
) -> None:
    await manager.start_kernel(cwd=str(host_user.root / "project"), sandbox_user=host_user)
    code = "import os\nopen('made.txt', 'w').write('x')\nprint(os.getuid(), os.getgid(), os.getcwd())"
    ids = f"{host_user.uid} {host_user.gid}"
    assert (await run_in(manager, code)).split() == [*ids.split(), "/workspace"]
    made = (host_user.root / "project" / "made.txt").stat()
    assert (made.st_uid, made.st_gid) == (host_user.uid, host_user.gid), "what it writes is theirs"
    (container,) = docker_client.containers.list(filters={"label": f"{LABEL_KERNEL_ID}={manager.kernel_id}"})
    assert container.labels[LABEL_USER] == host_user.name

    await manager.restart_kernel(now=True)
    assert (await run_in(manager, "import os\nprint(os.getuid(), os.getgid())")).split() == ids.split()


async def test_a_folder_that_is_not_the_users_is_refused_in_one_line(
    manager: AsyncKernelManager, host_user: KernelUser, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    (host_user.root / "admin").symlink_to("/root")
    for folder, reason in [
        (tmp_path, f"is outside your sandbox workspace '{host_user.root}'"),
        (host_user.root / "admin", f"'/root' is outside your sandbox workspace '{host_user.root}'"),
    ]:
        with pytest.raises(WorkspaceError, match=reason) as refused:
            await manager.start_kernel(cwd=str(folder), sandbox_user=host_user)
        assert "\n" not in str(refused.value)
    assert not manager.has_kernel
    assert (
        docker_client.containers.list(all=True, filters={"label": f"{LABEL_KERNEL_ID}={manager.kernel_id}"})
        == []
    )


# ---------------------------------------------------------------------- the check/mount race


@pytest.fixture
def not_hers(tmp_path: Path) -> Path:
    """A folder anyone may read once inside it (0755), with a secret, that the user cannot
    reach on the host (it lies in root's private pytest folder): only a mount would show it."""
    folder = tmp_path / "not-hers"
    folder.mkdir(mode=0o755)
    (folder / "secret.txt").write_text("root's")
    return folder


@pytest.fixture
def her_folder(host_user: KernelUser) -> Path:
    """Her project, with a file of hers in it."""
    folder = host_user.root / "project"
    (folder / "mine.txt").write_text("hers")
    os.chown(folder / "mine.txt", host_user.uid, host_user.gid)
    return folder


def swap(user: KernelUser, folder: Path, target: Path) -> None:
    """As ``user``: ``folder`` set aside (``.aside``), a link to ``target`` in its place."""

    def swapping() -> bool:
        folder.rename(folder.with_name(".aside"))
        folder.symlink_to(target)
        return True

    as_user(pwd.getpwnam(user.name), swapping)


def swap_back(user: KernelUser, folder: Path) -> None:
    def back() -> bool:
        if folder.is_symlink():
            folder.unlink()
        folder.with_name(".aside").rename(folder)
        return True

    as_user(pwd.getpwnam(user.name), back)


WHERE = "import os, json; print(json.dumps({'ls': sorted(os.listdir('.')), 'uid': os.getuid()}))"


@pytest.fixture
def swapped_at_launch(monkeypatch: pytest.MonkeyPatch) -> Callable[[KernelUser, Path, Path], None]:
    """Arm a swap of the user's folder for a link at the next launch: after every check of
    the start (the gateway's, the plan's), before anything is mounted."""

    def arm(user: KernelUser, folder: Path, target: Path) -> None:
        launch = SandboxProvisioner.launch_kernel

        async def swapped_first(self: SandboxProvisioner, cmd: list[str], **kwargs: Any) -> Any:
            monkeypatch.setattr(SandboxProvisioner, "launch_kernel", launch)
            await asyncio.to_thread(swap, user, folder, target)
            return await launch(self, cmd, **kwargs)

        monkeypatch.setattr(SandboxProvisioner, "launch_kernel", swapped_first)

    return arm


@pytest.mark.parametrize("flavour", ["cold", "pooled"])
async def test_her_folder_swapped_for_a_link_between_the_check_and_the_mount_is_never_mounted(
    manager: AsyncKernelManager,
    host_user: KernelUser,
    her_folder: Path,
    not_hers: Path,
    swapped_at_launch: Callable[[KernelUser, Path, Path], None],
    make_kernelspec: Callable[..., str],
    docker_client: docker.DockerClient,
    flavour: str,
) -> None:
    before = HostState(docker_client)
    pooled = make_kernelspec("sandboxed-python-user-pool", config={"pool_size": 1})
    if flavour == "pooled":
        await fill_her_pool(manager, host_user, pooled)
    try:
        swapped_at_launch(host_user, her_folder, not_hers)
        with pytest.raises(WorkspaceError, match="is a link or no folder now") as refused:
            await manager.start_kernel(cwd=str(her_folder), sandbox_user=host_user)
        assert "\n" not in str(refused.value)
        assert not manager.has_kernel
        assert pins_of(host_user.root) == []
        if flavour == "pooled":
            assert SandboxPool.instance().ready(manager.kernel_name, host_user.name) == 0, (
                "claimed, and removed"
            )
        swap_back(host_user, her_folder)

        await start_for(manager, host_user, her_folder, flavour, pooled)
        assert json.loads(await run_in(manager, WHERE)) == {"ls": ["mine.txt"], "uid": host_user.uid}
        assert len(pins_of(host_user.root)) == 1
        await manager.shutdown_kernel(now=True)
    finally:
        await asyncio.to_thread(SandboxPool.instance().drain)
    assert pins_of(host_user.root) == []
    assert await asyncio.to_thread(before.new_leftovers) == []


async def fill_her_pool(manager: AsyncKernelManager, user: KernelUser, kernelspec: str) -> None:
    """Have ``manager`` start ``kernelspec`` (``pool_size`` 1), and a sandbox of ``user``'s pool of
    it wait, planned in an empty folder of theirs as a gateway plans it."""
    manager.kernel_name = kernelspec
    waiting = user.root / "waiting"
    waiting.mkdir(exist_ok=True)
    os.chown(waiting, user.uid, user.gid)
    assert await plan_pool(kernelspec, cwd=waiting, user=user)
    assert await asyncio.to_thread(SandboxPool.instance().wait_ready, kernelspec, 1, 120, user.name) == 1


async def start_for(
    manager: AsyncKernelManager, user: KernelUser, folder: Path, flavour: str, kernelspec: str
) -> None:
    """Start ``manager``'s kernel for ``user`` in ``folder``: cold, or claimed from the user's pool
    of ``kernelspec`` (see :func:`fill_her_pool`)."""
    if flavour == "pooled":
        await fill_her_pool(manager, user, kernelspec)
    await manager.start_kernel(cwd=str(folder), sandbox_user=user)
    assert manager.provisioner.from_pool == (flavour == "pooled")


@pytest.mark.parametrize("flavour", ["cold", "pooled"])
async def test_her_swaps_once_it_runs_change_nothing_through_a_pause_a_resume_and_a_restart(
    manager: AsyncKernelManager,
    host_user: KernelUser,
    her_folder: Path,
    not_hers: Path,
    swapped_at_launch: Callable[[KernelUser, Path, Path], None],
    make_kernelspec: Callable[..., str],
    docker_client: docker.DockerClient,
    flavour: str,
) -> None:
    """A paused sandbox is mounted again as it resumes, from its staging folder: still the folder
    pinned when it started, not what her path leads to now. A restart pins again, checked again."""
    before = HostState(docker_client)
    pooled = make_kernelspec("sandboxed-python-user-pool", config={"pool_size": 1})
    aside = her_folder.with_name(".aside")
    try:
        await start_for(manager, host_user, her_folder, flavour, pooled)
        (pin,) = pins_of(host_user.root)
        provisioner = manager.provisioner
        assert isinstance(provisioner, SandboxProvisioner)
        await provisioner.pause()
        await asyncio.to_thread(swap, host_user, her_folder, not_hers)
        await provisioner.resume()
        code = WHERE.replace("print(", "open('resumed.txt', 'w').write('x'); print(")
        assert json.loads(await run_in(manager, code)) == {
            "ls": ["mine.txt", "resumed.txt"],
            "uid": host_user.uid,
        }
        assert (aside / "resumed.txt").exists(), "in her folder, wherever she moved it"
        assert not (not_hers / "resumed.txt").exists()
        assert pins_of(host_user.root) == [pin]
        await asyncio.to_thread(swap_back, host_user, her_folder)

        swapped_at_launch(host_user, her_folder, not_hers)
        with pytest.raises(WorkspaceError, match="is a link or no folder now"):
            await manager.restart_kernel(now=True)
        assert pins_of(host_user.root) == [], "the refused restart left no mount"
        await asyncio.to_thread(swap_back, host_user, her_folder)
        if manager.has_kernel:
            await manager.shutdown_kernel(now=True)

        await start_for(manager, host_user, her_folder, flavour, pooled)
        await manager.restart_kernel(now=True)
        assert json.loads(await run_in(manager, WHERE))["ls"] == ["mine.txt", "resumed.txt"]
        assert len(pins_of(host_user.root)) == 1, "the restart's pin, the last one detached"
        await manager.shutdown_kernel(now=True)
    finally:
        await asyncio.to_thread(SandboxPool.instance().drain)
    assert pins_of(host_user.root) == []
    assert await asyncio.to_thread(before.new_leftovers) == []


@pytest.mark.parametrize(
    "name",
    ["with spaces\nand a newline", os.fsdecode(b"caf\xe9 (latin-1)"), "n" * 255],
    ids=["newline", "latin-1", "255-bytes"],
)
async def test_a_folder_of_any_name_is_her_workspace_and_leaves_no_mount(
    manager: AsyncKernelManager, host_user: KernelUser, docker_client: docker.DockerClient, name: str
) -> None:
    before = HostState(docker_client)
    folder = host_user.root / name
    folder.mkdir()
    (folder / "mine.txt").write_text("hers")
    for path in (folder, folder / "mine.txt"):
        os.chown(path, host_user.uid, host_user.gid)
    await manager.start_kernel(cwd=str(folder), sandbox_user=host_user)
    assert json.loads(await run_in(manager, WHERE)) == {"ls": ["mine.txt"], "uid": host_user.uid}
    assert len(pins_of(host_user.root)) == 1
    await manager.shutdown_kernel(now=True)
    assert pins_of(host_user.root) == []
    assert await asyncio.to_thread(before.new_leftovers) == []


async def test_a_start_that_fails_once_her_folder_is_pinned_leaves_no_mount(
    manager: AsyncKernelManager,
    host_user: KernelUser,
    her_folder: Path,
    make_kernelspec: Callable[..., str],
    docker_client: docker.DockerClient,
) -> None:
    before = HostState(docker_client)
    manager.kernel_name = make_kernelspec(
        "sandboxed-python-exits", argv=["python3", "-c", "raise SystemExit(3)"]
    )
    with pytest.raises(KernelStartupError, match="exit code 3"):
        await manager.start_kernel(cwd=str(her_folder), sandbox_user=host_user)
    assert pins_of(host_user.root) == []
    assert await asyncio.to_thread(before.new_leftovers) == []
