"""A kernel a sandbox gateway starts for a host user (``start_kernel(sandbox_user=...)``),
under gVisor: it runs as them, what it writes is theirs, it starts only in a folder of
theirs, and a restart keeps it theirs. The same paths on the in-memory backend:
tests/unit/test_kernel_user.py."""

from __future__ import annotations

import os
import pwd
import secrets
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import docker
import pytest
from jupyter_client.manager import AsyncKernelManager

from sandbox_kernel.errors import WorkspaceError
from sandbox_kernel.plan.sandbox_spec import LABEL_KERNEL_ID, LABEL_USER
from sandbox_kernel.plan.users import KernelUser

from .conftest import KERNEL

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
