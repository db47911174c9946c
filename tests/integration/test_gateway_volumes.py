"""Per-user volumes on a sandbox machine (docs/administrators/gateway-separate-host.md): a
gateway whose ``workspace_volume`` is ``"{user}-{project}"`` keeps each user's work in a
Docker volume of theirs across kernels, and never mounts one user's volume for another,
even when their names and folders spell the same volume name."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from sandbox_kernel.plan.sandbox_spec import LABEL_VOLUME_USER

from .conftest import KERNEL, HostState
from .test_gateway import Served, containers_of, local_users, run_code, serve_gateway

pytestmark = pytest.mark.integration

#: "{user}-{project}": al in a folder "ice-x" and al-ice in a folder "x" both spell
#: "sk-vol-al-ice-x".
AL, AL_ICE = "sk-vol-al", "sk-vol-al-ice"


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, pwd.struct_passwd]]:
    with local_users({AL: "ice-x", AL_ICE: "x"}) as made:
        yield made


@pytest.fixture
def gateway(
    users: dict[str, pwd.struct_passwd],
    tmp_path: Path,
    jupyter_dirs: Path,
    docker_client: docker.DockerClient,
) -> Iterator[Served]:
    """A gateway configured as the separate-host page's per-user volumes say."""
    env = {**os.environ, "JUPYTER_PATH": str(jupyter_dirs)}
    try:
        with serve_gateway(
            users, tmp_path / "gw", env, ['c.SandboxProvisioner.workspace_volume = "{user}-{project}"']
        ) as served:
            yield served
    finally:
        for volume in docker_client.volumes.list():
            if volume.name.startswith("sk-vol-"):
                volume.remove(force=True)


async def start(gateway: Served, user: str, folder: Path) -> tuple[int, dict[str, object]]:
    started = await gateway.fetch(
        "/api/kernels", user, "POST", {"name": KERNEL, "env": {"KERNEL_WORKING_DIR": str(folder)}}
    )
    return started.code, json.loads(started.body)


async def test_a_users_volume_keeps_her_work_and_is_never_mounted_for_another_user(
    gateway: Served, users: dict[str, pwd.struct_passwd], docker_client: docker.DockerClient
) -> None:
    before = HostState(docker_client)
    her_folder = Path(users[AL_ICE].pw_dir) / "x"
    code, model = await start(gateway, AL_ICE, her_folder)
    assert code == 201, model
    kernel_id = str(model["id"])
    try:
        ws = await gateway.channels(kernel_id, AL_ICE)
        out = await run_code(
            ws, "import os; open('notes.txt', 'w').write('hers'); print(os.getcwd(), os.getuid())"
        )
        ws.close()
        assert out.split() == ["/workspace", str(users[AL_ICE].pw_uid)]
    finally:
        assert (await gateway.fetch(f"/api/kernels/{kernel_id}", AL_ICE, "DELETE")).code == 204
    volume = docker_client.volumes.get("sk-vol-al-ice-x")
    assert volume.attrs["Labels"][LABEL_VOLUME_USER] == AL_ICE
    assert not (her_folder / "notes.txt").exists(), "her work is in her volume, not her folder"

    # Her next kernel finds her work.
    code, model = await start(gateway, AL_ICE, her_folder)
    assert code == 201, model
    kernel_id = str(model["id"])
    try:
        ws = await gateway.channels(kernel_id, AL_ICE)
        assert await run_code(ws, "print(open('notes.txt').read())") == "hers\n"
        ws.close()
    finally:
        assert (await gateway.fetch(f"/api/kernels/{kernel_id}", AL_ICE, "DELETE")).code == 204

    # al, in his folder "ice-x": "{user}-{project}" spells her volume. Refused, naming no one.
    code, model = await start(gateway, AL, Path(users[AL].pw_dir) / "ice-x")
    assert code == 403, model
    assert "'sk-vol-al-ice-x' is another user's workspace" in str(model["message"])
    assert str(model["message"]).count("sk-vol-al-ice") == 1, "whose it is stays unsaid"
    assert json.loads((await gateway.fetch("/api/kernels", AL)).body) == []
    assert containers_of(kernel_id) == []
    assert await asyncio.to_thread(before.new_leftovers) == []
