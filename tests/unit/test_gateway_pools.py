"""Each listed user's warm pools on the gateway are planned with the ceilings their starts
get, their groups' included: from the tokens file as the gateway starts, and again when a
request shows other ones (groups changed in the tokens file; under JupyterHub, the groups
of a user's first request). Served for real in this process, with the fake backend."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from sandbox_kernel.gateway.identity import add_token
from sandbox_kernel.gateway.pools import PoolUsers, planned_as
from sandbox_kernel.plan.sandbox_spec import LABEL_USER
from sandbox_kernel.plan.users import KernelUser
from sandbox_kernel.pool.sandboxes import SandboxPool

from .test_gateway import UIDS, Gateway, needs_root, pooled_sandboxes, pools_filled
from .test_gateway import gateway_args as gateway_args
from .test_gateway import serve as serve
from .test_gateway import serve_pooled as serve_pooled
from .test_gateway import short_tmp as short_tmp
from .test_gateway_hub import FakeHub, hub_args
from .test_gateway_hub import hub as hub
from .test_gateway_hub import token_file as token_file

KERNELSPEC = "sandboxed-python"
#: The interns' ceiling, narrower than the kernelspec's memory (the provisioner's 2g).
CEILINGS = 'c.UserPolicy.ceilings = {"group:interns": {"max_memory": "1g", "max_cpus": 0.5}}\n'


def user(name: str = "alice", uid: int = 15001, **ceilings: object) -> KernelUser:
    return KernelUser(name, uid, uid, Path("/home") / name, ceilings=ceilings)


# ---------------------------------------------------------------------- the decision, pure


def test_a_listed_users_pools_are_planned_once_per_uid_and_ceilings() -> None:
    users = PoolUsers(["alice", "bob", "alice"])
    assert users.names == ("alice", "bob")
    assert users.update(user()), "not planned yet"
    assert not users.update(user()), "planned as she is"
    groups = KernelUser("alice", 15001, 15001, Path("/elsewhere"), groups=("analysts",))
    assert not users.update(groups), "a group without ceilings of its own, another root: the same sandbox"
    assert users.update(user(max_memory="1g")), "her group's ceiling now holds"
    assert not users.update(user(max_memory="1g"))
    assert users.update(user(uid=15009, max_memory="1g")), "another uid"
    assert users.update(user()), "back without the ceiling: planned again"
    assert not users.update(user("carol")), "an unlisted user gets no pool, ever"
    assert not users.update(user("carol", max_memory="1g"))


def test_a_plan_asked_for_later_supersedes_one_not_yet_made() -> None:
    users = PoolUsers(["alice"])
    first, second = user(max_memory="1g"), user(max_memory="512m")
    assert users.update(first)
    assert users.update(second)
    assert not users.current(first), "the later plan is the pools'"
    assert users.current(second)
    assert planned_as(user(max_cpus=1, max_memory="1g")) == planned_as(user(max_memory="1g", max_cpus=1))


# ---------------------------------------------------------------------- through a served gateway


def config_file(short_tmp: Path, text: str) -> str:
    path = short_tmp / "gateway_config.py"
    path.write_text(text)
    return f"--config={path}"


def waiting(user_name: str) -> list[str]:
    """The memory limits of the pooled sandboxes of sandboxed-python waiting for ``user_name``."""
    return [
        box.spec.memory
        for box in pooled_sandboxes()
        if box.spec.kernelspec == KERNELSPEC and box.spec.labels.get(LABEL_USER) == user_name
    ]


async def replanned(gateway: Gateway, user_name: str, memory: str, timeout: float = 30.0) -> None:
    """Until ``user_name``'s pool of sandboxed-python is planned with ``memory`` and one of
    its sandboxes waits (the older plan's removed): ready in the pool's own count, not only
    running on the backend (a start between the two went cold)."""
    pool = SandboxPool.instance()
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        plan = pool.plan_of(KERNELSPEC, user_name)
        if (
            plan is not None
            and plan.spec.memory == memory
            and waiting(user_name) == [memory]
            and await asyncio.to_thread(pool.wait_ready, KERNELSPEC, 1, 0.0, user_name) == 1
        ):
            return
        assert asyncio.get_running_loop().time() < deadline, (plan and plan.spec.memory, waiting(user_name))
        await asyncio.sleep(0.05)


async def claims_whole(gateway: Gateway, user_name: str, memory: str) -> str:
    """A start of ``user_name``'s claims their waiting sandbox, narrowing nothing: it was
    planned with the ceilings the start gets (``memory``); the start of the gateway's log
    line saying so."""
    (sandbox,) = [
        box
        for box in pooled_sandboxes()
        if box.spec.kernelspec == KERNELSPEC and box.spec.labels.get(LABEL_USER) == user_name
    ]
    kernel_id = await gateway.start(user_name)
    provisioner = gateway.km.get_kernel(kernel_id).provisioner
    assert provisioner.from_pool
    assert provisioner.site.container_id == sandbox.id
    assert provisioner.pool.narrowing is not None
    assert provisioner.pool.narrowing.empty
    assert provisioner.site.spec.memory == memory
    return f"pooled sandbox {sandbox.id[:12]} (image img:1, uid {UIDS[user_name]}"


@needs_root
async def test_a_pool_is_planned_with_the_ceilings_of_the_users_groups_in_the_tokens_file(
    serve_pooled: Callable[..., Awaitable[Gateway]], short_tmp: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    add_token(short_tmp / "tokens.json", "alice", ("interns",))
    gateway = await serve_pooled(
        config_file(short_tmp, CEILINGS),
        "--GatewayKernelManagerForUsers.pool_users=alice",
        "--GatewayKernelManagerForUsers.pool_users=bob",
    )
    assert await pools_filled(gateway, "alice", "bob") == {"alice": 1, "bob": 1}
    assert waiting("alice") == ["1g"], "planned within her group's ceiling from the start"
    assert waiting("bob") == ["2g"], "bob is in no group"
    claimed = await claims_whole(gateway, "alice", "1g")
    log = capfd.readouterr().err
    assert claimed in log
    assert "narrowed: nothing)" in log
    assert "Planning the sandbox pools of user" not in log, "planned right the first time"


@needs_root
async def test_a_users_pool_is_planned_again_when_a_request_shows_their_groups_changed(
    serve_pooled: Callable[..., Awaitable[Gateway]], short_tmp: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    gateway = await serve_pooled(
        config_file(short_tmp, CEILINGS), "--GatewayKernelManagerForUsers.pool_users=alice"
    )
    assert await pools_filled(gateway, "alice") == {"alice": 1}
    assert waiting("alice") == ["2g"]
    add_token(short_tmp / "tokens.json", "alice", ("interns",))  # the administrator adds her to a group
    assert (await gateway.fetch("/api/kernels", "alice")).code == 200  # her next request shows it
    await replanned(gateway, "alice", "1g")
    claimed = await claims_whole(gateway, "alice", "1g")
    log = capfd.readouterr().err
    assert "Planning the sandbox pools of user alice as their requests have them" in log
    assert claimed in log


@needs_root
async def test_under_a_hub_a_users_pool_is_planned_again_with_the_groups_of_their_first_request(
    serve_pooled: Callable[..., Awaitable[Gateway]],
    hub: FakeHub,
    token_file: Path,
    short_tmp: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    gateway = await serve_pooled(
        *hub_args(hub, token_file),
        config_file(short_tmp, CEILINGS),
        "--GatewayKernelManagerForUsers.pool_users=alice",
        "--GatewayKernelManagerForUsers.pool_users=bob",
    )
    gateway.tokens = {name: hub.token(f"hub-token-of-{name}", name) for name in UIDS}
    assert await pools_filled(gateway, "alice", "bob") == {"alice": 1, "bob": 1}
    assert waiting("alice") == waiting("bob") == ["2g"], "no groups known before a request"
    assert hub.asked["users/alice"] == 0
    for name in UIDS:  # their servers' first requests
        assert (await gateway.fetch("/api/kernels", name)).code == 200
    await replanned(gateway, "alice", "1g")
    assert waiting("bob") == ["2g"], "bob's groups bring no ceiling: his pool stays"
    claimed = await claims_whole(gateway, "alice", "1g")
    log = capfd.readouterr().err
    assert "Planning the sandbox pools of user alice" in log
    assert "Planning the sandbox pools of user bob" not in log
    assert claimed in log
    from jupyterhub.httpclient import JupyterHubHTTPClient

    await JupyterHubHTTPClient.loop_instance().close()  # the hub client's session, of this test's loop
