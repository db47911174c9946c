"""A kernel a sandbox gateway starts for a user (``start_kernel(sandbox_user=KernelUser(...))``):
it runs as them, only in a folder of theirs, within their ceilings too, labelled and
audited as theirs, and restarts (the restarter's restarts too, and an adopted kernel's)
for them again. Without a user nothing of this applies. The provisioner runs on the
in-memory backend; the same under gVisor: tests/integration/test_kernel_user.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
from traitlets.config import Config

from sandbox_kernel.backends.docker_args import container_create_kwargs
from sandbox_kernel.backends.fake import FakeBackend
from sandbox_kernel.errors import ConfigurationError, WorkspaceError
from sandbox_kernel.kernel.channels import KernelChannels
from sandbox_kernel.kernel.launching import PoolClaim
from sandbox_kernel.kernel.site import KernelSite
from sandbox_kernel.kernel.state import ReattachState
from sandbox_kernel.lifecycle.ownership import PINNED_WORKSPACE, OrphanReaper, SandboxedKernel
from sandbox_kernel.plan.plan import narrower_ceiling
from sandbox_kernel.plan.sandbox_spec import LABEL_USER, SandboxSpec
from sandbox_kernel.plan.users import START_ARGUMENT, KernelUser
from sandbox_kernel.pool.sandboxes import PooledSandbox, PoolPlan, SandboxPool
from sandbox_kernel.provisioner import SandboxProvisioner
from sandbox_kernel.services import Services

from .test_provisioner import SERVER_ENV, kernel_spec

#: The user's uid: another's than the server's where the server is root (as a gateway is).
UID = 4242 if os.getuid() == 0 else os.getuid()
as_root = pytest.mark.skipif(os.getuid() != 0, reason="making another user's folders needs root")


class NoReaper:
    """No orphans here: the fake backend's sandboxes are the test's."""

    def watch(self, runtime_parent: Path) -> None:
        pass


class RecordingPool:
    """A warm pool that records what it is asked for and has the plans it is given."""

    def __init__(self) -> None:
        self.wanted: list[PoolPlan] = []

    def want(self, plan: PoolPlan) -> None:
        self.wanted.append(plan)

    def plan_of(self, kernelspec: str, user: str = "") -> PoolPlan | None:
        return next((p for p in reversed(self.wanted) if p.key == (kernelspec, user)), None)

    def ready_for(self, fingerprint: str) -> int:
        return 1

    def claim(self, fingerprint: str) -> PooledSandbox | None:
        raise AssertionError("a start whose plan does not fit claims nothing")


@pytest.fixture
def short_runtime() -> Iterator[Path]:
    """A runtime parent folder short enough for unix socket paths (pytest's are not)."""
    folder = Path(tempfile.mkdtemp(prefix="sk-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def owned(folder: Path, uid: int = UID) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if os.getuid() == 0:
        os.chown(folder, uid, uid)
    return folder


@pytest.fixture
def alice(tmp_path: Path) -> KernelUser:
    """A user whose root (their own, mode 0700) holds project/nb."""
    home = owned(tmp_path / "home" / "alice")
    home.chmod(0o700)
    owned(owned(home / "project") / "nb")
    return KernelUser("alice", UID, UID, home)


@pytest.fixture
def provisioners(short_runtime: Path) -> Iterator[Callable[..., SandboxProvisioner]]:
    """Provisioners of one kernel, on one FakeBackend (what a later process sees too); a
    kernelspec's ``config`` is their traits, as jupyter_client makes them."""
    backend, made = FakeBackend(), []

    def make(config: dict[str, Any] | None = None, services: Services | None = None, **traits: Any) -> Any:
        provisioner = SandboxProvisioner(
            kernel_id="k-user",
            kernel_spec=kernel_spec(config),
            parent=None,
            runtime_parent=str(short_runtime),
            backend=backend,
            services=services or Services(reaper=cast(OrphanReaper, NoReaper())),
            **{**(config or {}), **traits},
        )
        made.append(provisioner)
        return provisioner

    yield make
    for provisioner in made:
        provisioner.watchdog.stop()
        if provisioner.bridge is not None:
            provisioner.bridge.stop()


async def planned(provisioner: SandboxProvisioner, cwd: Path, **kwargs: Any) -> SandboxSpec:
    await provisioner.pre_launch(cwd=str(cwd), env=dict(SERVER_ENV), **kwargs)
    assert provisioner.site.spec is not None
    return provisioner.site.spec


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------------- the start argument


async def test_a_start_without_a_user_is_as_it_was(
    provisioners: Callable[..., Any], alice: KernelUser
) -> None:
    provisioner = provisioners()
    spec = await planned(provisioner, alice.root / "project")
    assert provisioner.user is None
    assert LABEL_USER not in spec.labels
    assert (spec.uid, spec.workspace) != (UID, alice.root), "the server's own choice, not a user's"


@pytest.mark.parametrize(
    ("user", "message"),
    [
        ("alice", r"must be a sandbox_kernel\.plan\.users\.KernelUser"),
        ({"name": "alice", "uid": 4242}, r"must be a sandbox_kernel\.plan\.users\.KernelUser"),
        (KernelUser("alice", 0, 0, Path("/home/alice")), "must be above 0: a kernel never runs as root"),
        (KernelUser("alice", 4242, 0, Path("/home/alice")), "must be above 0"),
        (KernelUser("", 4242, 4242, Path("/home/x")), "has no name"),
        (KernelUser("alice", 4242, 4242, Path("home/alice")), "not an absolute path"),
        (
            KernelUser("alice", 4242, 4242, Path("/home/alice"), ceilings={"max_network": "none"}),
            r"'max_network', which are not ceilings \(they are allowed_images, ",
        ),
    ],
)
async def test_the_user_must_be_a_kernel_user_of_a_real_uid(
    provisioners: Callable[..., Any], tmp_path: Path, user: Any, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message) as refused:
        await planned(provisioners(), tmp_path, sandbox_user=user)
    assert f"start_kernel({START_ARGUMENT}=" in one_line(refused)


async def test_a_kernel_for_a_user_runs_as_them_labelled_theirs(
    provisioners: Callable[..., Any], alice: KernelUser
) -> None:
    provisioner = provisioners(kernel_uid=1234)  # the server's choice gives way to the user's uid
    spec = await planned(provisioner, alice.root / "project" / "nb", sandbox_user=alice)
    assert provisioner.user == alice
    assert (spec.uid, spec.gid) == (UID, UID)
    assert spec.workspace == alice.root, "their root (no home of an account here) down to the notebook"
    assert spec.workdir == "/workspace/project/nb"
    assert spec.owned_from == alice.root.resolve(), "pinned at the mount, checked from their root down"
    with pytest.raises(WorkspaceError, match="is not pinned, so it is not mounted"):
        container_create_kwargs(spec)  # never by its path
    staging = Path("/tmp/sandbox-kernel-x/workspace")
    create = container_create_kwargs(replace(spec, staging=staging))
    assert create["user"] == f"{UID}:{UID}"
    assert create["labels"][LABEL_USER] == "alice"
    assert (create["mounts"][0]["Target"], create["mounts"][0]["Source"]) == ("/workspace", str(staging))


async def test_a_users_volume_is_named_after_them_never_after_what_the_client_claims(
    provisioners: Callable[..., Any], alice: KernelUser
) -> None:
    provisioner = provisioners(workspace_volume="sk-{user}-{project}")
    env = {**SERVER_ENV, "JUPYTERHUB_USER": "mallory"}
    await provisioner.pre_launch(cwd=str(alice.root / "project"), env=env, sandbox_user=alice)
    assert provisioner.site.spec is not None
    assert (provisioner.site.spec.volume, provisioner.site.spec.uid) == ("sk-alice-project", UID)
    await provisioner.pre_launch(cwd=str(alice.root / "project"), env=env)
    assert provisioner.site.spec.volume == "sk-mallory-project", "without a user: as before"


async def test_on_a_gateway_a_volume_template_without_the_user_is_refused(
    provisioners: Callable[..., Any], alice: KernelUser
) -> None:
    """'team-{project}' would give every user of the gateway one volume to share."""
    provisioner = provisioners(workspace_volume="team-{project}")
    cwd = str(alice.root / "project")
    with pytest.raises(ConfigurationError, match=r"names no \{user\}: on a sandbox gateway") as refused:
        await provisioner.pre_launch(cwd=cwd, env=dict(SERVER_ENV), sandbox_user=alice)
    assert "'{user}-{project}'" in one_line(refused)
    await provisioner.pre_launch(cwd=cwd, env=dict(SERVER_ENV))  # no user: as before


# ---------------------------------------------------------------------- the user's folder


def test_a_folder_outside_the_users_root_is_refused(alice: KernelUser, tmp_path: Path) -> None:
    from sandbox_kernel.plan.plan import check_user_folder

    assert (
        check_user_folder(alice.root / "project" / "nb", alice) == (alice.root / "project" / "nb").resolve()
    )
    elsewhere = owned(tmp_path / "elsewhere")
    with pytest.raises(WorkspaceError, match="is outside your sandbox workspace") as refused:
        check_user_folder(elsewhere, alice)
    assert str(alice.root) in one_line(refused)
    with pytest.raises(WorkspaceError, match="outside your sandbox workspace"):
        check_user_folder(alice.root / ".." / "..", alice)
    with pytest.raises(WorkspaceError, match="does not exist"):
        check_user_folder(alice.root / "missing", alice)


def test_a_link_in_the_users_root_leads_nowhere_else(alice: KernelUser) -> None:
    """A link of root's to /root resolves outside the user's root; one of the user's own to a
    folder of root's is a foreign link, refused as such on the way."""
    from sandbox_kernel.plan.plan import check_user_folder

    (alice.root / "admin").symlink_to("/root")
    with pytest.raises(WorkspaceError, match="'/root' is outside your sandbox workspace") as refused:
        check_user_folder(alice.root / "admin", alice)
    one_line(refused)
    if os.getuid() == 0:
        os.lchown(alice.root / "admin", UID, UID)
        with pytest.raises(
            WorkspaceError, match=r"goes through the link .*admin', owned by uid 4242"
        ) as refused:
            check_user_folder(alice.root / "admin", alice)
        one_line(refused)


@as_root
def test_a_folder_of_someone_else_in_the_users_root_is_refused(alice: KernelUser) -> None:
    from sandbox_kernel.plan.plan import check_user_folder

    theirs = owned(alice.root / "shared", uid=4343)
    owned(theirs / "mine")
    for folder in (theirs, theirs / "mine"):
        with pytest.raises(
            WorkspaceError, match=r"shared' belongs to uid 4343, not to alice \(uid 4242\)"
        ) as refused:
            check_user_folder(folder, alice)
        one_line(refused)


async def test_a_start_in_a_folder_that_is_not_the_users_never_falls_back(
    provisioners: Callable[..., Any], alice: KernelUser, tmp_path: Path
) -> None:
    provisioner = provisioners(workspace_root=str(tmp_path))  # a configured root changes nothing
    with pytest.raises(WorkspaceError, match="outside your sandbox workspace"):
        await planned(provisioner, owned(tmp_path / "elsewhere"), sandbox_user=alice)
    assert provisioner.site.spec is None, "no sandbox planned anywhere else"


# ---------------------------------------------------------------------- the user's ceilings


async def test_a_users_ceilings_narrow_the_servers_defaults_to_them(
    provisioners: Callable[..., Any], alice: KernelUser
) -> None:
    user = KernelUser(
        **{**vars(alice), "ceilings": {"max_memory": "1g", "max_exec_timeout": "1m", "max_pids": 64}}
    )
    provisioner = provisioners()
    spec = await planned(provisioner, alice.root / "project", sandbox_user=user)
    policy = provisioner.policy
    assert (policy.memory, policy.exec_timeout, policy.pids) == ("1g", 60.0, 64)
    assert (policy.max_memory, policy.max_exec_timeout, policy.max_pids) == ("1g", 60.0, 64)
    assert (spec.memory, spec.pids) == ("1g", 64)
    assert (provisioner.memory, provisioner.max_memory) == ("2g", "4g"), "the settings are as configured"
    spec = await planned(provisioner, alice.root / "project", sandbox_user=user, memory="512m")
    assert spec.memory == "512m", "a start narrows further"


async def test_asking_for_more_than_the_users_ceiling_is_refused_naming_it(
    provisioners: Callable[..., Any], alice: KernelUser
) -> None:
    user = KernelUser(**{**vars(alice), "ceilings": {"max_memory": "1g"}})
    with pytest.raises(ConfigurationError) as refused:
        await planned(provisioners({"memory": "1.5g"}), alice.root / "project", sandbox_user=user)
    assert one_line(refused).startswith(
        "memory='1.5g' exceeds alice's ceiling of '1g' (max_memory of the gateway's ceilings for alice)"
    )
    with pytest.raises(ConfigurationError, match=r"start_kernel\(memory='1.5g'\) would widen"):
        await planned(provisioners(), alice.root / "project", sandbox_user=user, memory="1.5g")
    await planned(provisioners({"memory": "1g"}), alice.root / "project", sandbox_user=user)


async def test_a_users_ceiling_wider_than_the_servers_is_ignored(
    provisioners: Callable[..., Any], alice: KernelUser
) -> None:
    user = KernelUser(**{**vars(alice), "ceilings": {"max_memory": "64g", "max_cpus": 8}})
    provisioner = provisioners()
    await planned(provisioner, alice.root / "project", sandbox_user=user)
    assert (provisioner.policy.max_memory, provisioner.policy.max_cpus) == ("4g", 2.0)
    with pytest.raises(ConfigurationError, match=r"memory='8g' exceeds the server's ceiling of '4g'"):
        await planned(provisioners({"memory": "8g"}), alice.root / "project", sandbox_user=user)


async def test_a_users_domains_ceiling_narrows_the_network_and_what_approval_may_ask(
    provisioners: Callable[..., Any], alice: KernelUser
) -> None:
    server = {
        "network": "allowlist",
        "allowed_domains": ["pypi.org", "docs.python.org"],
        "max_allowed_domains": ["pypi.org", "docs.python.org", "*.example.com"],
        "approval": "egress",
    }
    narrow = KernelUser(
        **{**vars(alice), "ceilings": {"max_allowed_domains": ["pypi.org", "api.example.com"]}}
    )
    provisioner = provisioners(**server)
    await planned(provisioner, alice.root / "project", sandbox_user=narrow)
    assert provisioner.policy.allowed_domains == ["pypi.org"]
    egress = provisioner.policy.egress_policy()
    assert egress is not None
    assert egress.approvable.patterns == ("pypi.org", "api.example.com")
    none = KernelUser(**{**vars(alice), "ceilings": {"max_allowed_domains": []}})
    await planned(provisioner, alice.root / "project", sandbox_user=none)
    assert (provisioner.policy.network, provisioner.egress.policy) == ("none", None)
    asking = provisioners({"network": "allowlist", "allowed_domains": ["docs.python.org"]}, **server)
    with pytest.raises(ConfigurationError, match=r"\['docs\.python\.org'\] exceed alice's ceiling"):
        await planned(asking, alice.root / "project", sandbox_user=narrow)


async def test_an_invalid_ceiling_of_a_user_is_refused_naming_it(
    provisioners: Callable[..., Any], alice: KernelUser
) -> None:
    user = KernelUser(**{**vars(alice), "ceilings": {"max_memory": "lots"}})
    with pytest.raises(
        ConfigurationError, match=r"The gateway's ceiling max_memory='lots' for alice is not valid"
    ):
        await planned(provisioners(), alice.root / "project", sandbox_user=user)


def test_the_narrower_of_two_ceilings_lies_within_both(tmp_path: Path) -> None:
    assert narrower_ceiling("size", "max_memory", "4g", "1g") == "1g"
    assert narrower_ceiling("size", "max_memory", "4g", "8g") == "4g"
    assert narrower_ceiling("timeout", "max_exec_timeout", 0.0, 60.0) == 60.0, "none is the widest"
    assert narrower_ceiling("timeout", "max_exec_timeout", 60.0, 0.0) == 60.0
    assert narrower_ceiling("names", "max_pass_env", ["LANG", "TZ"], ["TZ", "HOME"]) == ["TZ"]
    images = ["sandbox-kernel/*", "registry.example/team/py:2"]
    assert narrower_ceiling(
        "images", "allowed_images", images, ["sandbox-kernel/python*", "alpine:3", "*"]
    ) == [
        "sandbox-kernel/*",
        "registry.example/team/py:2",
        "sandbox-kernel/python*",
    ]
    assert narrower_ceiling("images", "allowed_images", images, ["sandbox-kernel/python:latest", "a?"]) == [
        "sandbox-kernel/python:latest"
    ]
    team, other = owned(tmp_path / "team"), owned(tmp_path / "other")
    owned(team / "alice")
    assert narrower_ceiling(
        "roots", "allowed_workspace_roots", [str(team), str(other)], [str(team / "alice")]
    ) == [str(team / "alice")]


# ---------------------------------------------------------------------- restarts, adoption, audit


async def test_a_restart_and_the_restarters_start_for_the_same_user(
    alice: KernelUser, short_runtime: Path
) -> None:
    """jupyter_client keeps the start's arguments (``_launch_args``, taken before the
    provisioner's ``pre_launch`` pops ours) and starts again with them."""
    from jupyter_client.ioloop import AsyncIOLoopKernelManager

    config = Config({"AsyncIOLoopKernelRestarter": {"time_to_dead": 0.2}})
    km = AsyncIOLoopKernelManager(kernel_name="sandboxed-python", config=config)
    km.kernel_id, km._kernel_spec = "k-user", kernel_spec()
    backend = FakeBackend()
    km.provisioner = SandboxProvisioner(
        kernel_id="k-user",
        kernel_spec=km.kernel_spec,
        parent=km,
        runtime_parent=str(short_runtime),
        backend=backend,
        services=Services(reaper=cast(OrphanReaper, NoReaper())),
    )
    provisioner = km.provisioner
    restarts: list[str] = []
    try:
        await km.start_kernel(cwd=str(alice.root / "project"), env=dict(SERVER_ENV), sandbox_user=alice)
        km.add_restart_callback(lambda: restarts.append("restart"), "restart")  # (its restarter's now)
        assert km._launch_args is not None
        assert km._launch_args[START_ARGUMENT] is alice
        first = provisioner.container_id
        await km.restart_kernel(now=True)
        assert provisioner.container_id != first
        assert (provisioner.user, backend.sandbox(provisioner.container_id).spec.uid) == (alice, UID)
        second = provisioner.container_id
        backend.exit(second, 1)  # the kernel dies: jupyter_client's restarter starts it again
        for _ in range(600):
            if restarts and provisioner.container_id not in (None, second):
                break
            await asyncio.sleep(0.05)
        assert restarts, "the restarter restarted the kernel"
        # The restarter's restart_kernel is still finishing (it connects to the new kernel):
        # a shutdown that overlapped it would find jupyter_client's ready future already set.
        await asyncio.wait_for(asyncio.shield(km.ready), 30)
        box = backend.sandbox(provisioner.container_id)
        assert (box.spec.uid, box.spec.labels[LABEL_USER]) == (UID, "alice")
    finally:
        km.stop_restarter()
        await km.shutdown_kernel(now=True)
        provisioner.watchdog.stop()


async def test_an_adopted_kernel_keeps_its_user_for_its_next_restart(
    provisioners: Callable[..., Any], alice: KernelUser
) -> None:
    user = KernelUser(**{**vars(alice), "groups": ("team",), "ceilings": {"max_memory": "1g"}})
    first = provisioners()
    kwargs = await first.pre_launch(cwd=str(alice.root / "project"), env=dict(SERVER_ENV), sandbox_user=user)
    await first.launch_kernel(**kwargs)
    saved = await first.get_provisioner_info()
    assert saved["user"] == {
        "name": "alice",
        "uid": UID,
        "gid": UID,
        "root": str(alice.root),
        "groups": ["team"],
        "ceilings": {"max_memory": "1g"},
    }
    assert ReattachState.from_dict(json.loads(json.dumps(saved))).user == user
    await first.detach()

    second = provisioners()
    await second.load_provisioner_info(saved)
    assert (second.user, second.policy.memory) == (user, "1g")
    await second.cleanup()
    assert ReattachState.from_dict({**saved, "user": None}).user is None, "a kernel of no gateway's"
    with pytest.raises(ConfigurationError, match="saved user"):
        ReattachState.from_dict({**saved, "user": {"name": "alice"}})


async def test_a_kernel_adopted_by_a_new_manager_restarts_for_its_user(
    alice: KernelUser, short_runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a server (a gateway) that adopts the kernel does: ``attach_manager`` from the
    kernel's saved state; the manager's next restart is for the same user."""
    from jupyter_client.manager import AsyncKernelManager

    from sandbox_kernel.reattach import attach_manager

    shared = FakeBackend()

    class SharedFakeBackend(FakeBackend):
        """The one backend's sandboxes, for the provisioner the adopting manager makes."""

        def __init__(self) -> None:
            super().__init__()
            self.sandboxes, self.calls, self._ids = shared.sandboxes, shared.calls, shared._ids

    monkeypatch.setattr("sandbox_kernel.provisioner.PROCESS", Services(reaper=cast(OrphanReaper, NoReaper())))
    first = SandboxProvisioner(
        kernel_id="k-user",
        kernel_spec=kernel_spec(),
        parent=None,
        runtime_parent=str(short_runtime),
        backend=shared,
    )
    kwargs = await first.pre_launch(cwd=str(alice.root / "project"), env=dict(SERVER_ENV), sandbox_user=alice)
    await first.launch_kernel(**kwargs)
    state = {
        "kernel_id": "k-user",
        "kernel_name": "sandboxed-python",
        "provisioner_info": await first.get_provisioner_info(),
        "kernelspec": kernel_spec().to_dict(),
    }
    await first.detach()

    config = Config(
        {"SandboxProvisioner": {"backend_class": SharedFakeBackend, "runtime_parent": str(short_runtime)}}
    )
    km = AsyncKernelManager(kernel_name="sandboxed-python", config=config)
    await attach_manager(km, state)
    adopted = km.provisioner
    assert isinstance(adopted, SandboxProvisioner)
    try:
        assert km._launch_args is not None
        assert km._launch_args[START_ARGUMENT] == alice
        await km.restart_kernel(now=True)
        box = shared.sandbox(str(adopted.container_id))
        assert (adopted.user, box.spec.uid, box.spec.labels[LABEL_USER]) == (alice, UID, "alice")
    finally:
        await km.shutdown_kernel(now=True)
        adopted.watchdog.stop()
        first.watchdog.stop()


def test_a_kernels_listing_names_its_user() -> None:
    attrs = {"Id": "c1", "Config": {"Labels": {LABEL_USER: "alice"}}, "State": {"Status": "exited"}}
    assert SandboxedKernel.from_inspect(attrs).user == "alice"
    assert SandboxedKernel.from_inspect({**attrs, "Config": {"Labels": {}}}).user == ""


async def test_the_audit_lines_of_a_users_start_and_end_name_them(
    provisioners: Callable[..., Any], alice: KernelUser, tmp_path: Path
) -> None:
    audit = tmp_path / "audit" / "audit.jsonl"
    for user in (alice, None):
        provisioner = provisioners(audit_log=str(audit))
        kwargs = await provisioner.pre_launch(
            cwd=str(alice.root / "project"), env=dict(SERVER_ENV), **({START_ARGUMENT: user} if user else {})
        )
        await provisioner.launch_kernel(**kwargs)
        await provisioner.cleanup()
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    users = [(line["event"], line.get("user")) for line in lines if line["event"] in ("start", "shutdown")]
    assert users == [("start", "alice"), ("shutdown", "alice"), ("start", None), ("shutdown", None)]


# ---------------------------------------------------------------------- the warm pool


async def test_a_users_start_claims_no_pooled_sandbox_that_does_not_fit_and_says_why(
    provisioners: Callable[..., Any],
    alice: KernelUser,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pooled sandbox's uid and labels are fixed as it starts: one made for another uid,
    or for no user, never serves a user's kernel."""
    monkeypatch.setattr("sandbox_kernel.kernel.launching.can_mount", lambda: True)
    pool = RecordingPool()
    services = Services(reaper=cast(OrphanReaper, NoReaper()), pool=cast(SandboxPool, pool))
    reasons = {"labels": f"the sandbox's labels {LABEL_USER} differ from the pool's"}
    folders = {"labels": alice.root / "project"}  # a pool of alice's uid, no user's
    if os.getuid() == 0:
        reasons["uid"] = f"uid {UID} differs from the pool's 4343"
        folders["uid"] = owned(alice.root.parent / "team", uid=4343)
    for case, folder in folders.items():
        await planned(provisioners({"pool_size": 1}, services), folder)
        wanted = len(pool.wanted)
        provisioner = provisioners({"pool_size": 1}, services)
        await planned(provisioner, alice.root / "project", sandbox_user=alice)
        assert len(pool.wanted) == wanted, "a user's plan never becomes the pool's"
        assert provisioner.pool.misfit == reasons[case]
        with caplog.at_level(logging.INFO):
            assert provisioner.pool.claim() is None
        assert f"starting cold, not from the pool of sandboxed-python: {reasons[case]}" in caplog.text


# ---------------------------------------------------------------------- pinning their folder


async def test_a_users_folder_is_pinned_in_the_kernels_runtime_folder_and_no_one_elses_is(
    provisioners: Callable[..., Any], alice: KernelUser
) -> None:
    """A user's start has the backend pin their workspace on ``workspace`` in the kernel's
    runtime folder, mounted from there (the files API compares what the pin shows); a start
    without a user mounts its folder as before, pinned nowhere."""
    provisioner = provisioners()
    kwargs = await provisioner.pre_launch(
        cwd=str(alice.root / "project"), env=dict(SERVER_ENV), sandbox_user=alice
    )
    await provisioner.launch_kernel(**kwargs)
    staging = provisioner.runtime_dir / PINNED_WORKSPACE
    assert provisioner.site.spec.staging == staging
    assert ("pin_workspace", str(staging)) in provisioner.backend.calls
    st = alice.root.stat()  # the workspace: their root (no account's home here)
    assert provisioner.site.identity == [st.st_dev, st.st_ino]
    await provisioner.cleanup()
    assert not staging.parent.exists(), "gone with the runtime folder"

    pins = provisioner.backend.calls.count(("pin_workspace", str(staging)))
    nobodys = provisioners()
    kwargs = await nobodys.pre_launch(cwd=str(alice.root / "project"), env=dict(SERVER_ENV))
    await nobodys.launch_kernel(**kwargs)
    assert (nobodys.site.spec.owned_from, nobodys.site.spec.staging) == (None, None)
    assert [call for call in nobodys.backend.calls if call[0] == "pin_workspace"] == [
        ("pin_workspace", str(staging))
    ] * pins
    await nobodys.cleanup()


class RefusingBackend(FakeBackend):
    """A host where the user's folder is a link by the time it is pinned."""

    async def prepare_workspace(self, spec: SandboxSpec) -> Path | None:
        msg = f"Refusing the kernel's folder {str(spec.workspace)!r}: it is a link or no folder now"
        raise WorkspaceError(msg)


class DiscardingPool:
    def __init__(self) -> None:
        self.discarded: list[PooledSandbox] = []

    async def discard(self, sandbox: PooledSandbox) -> None:
        self.discarded.append(sandbox)


async def test_a_claim_whose_folder_cannot_be_pinned_starts_no_kernel_cold_or_warm(
    alice: KernelUser, short_runtime: Path
) -> None:
    """A pooled sandbox that could not be bound otherwise falls back to a cold start; one whose
    user's folder is not theirs now is removed, and the start refused as a cold one would be."""
    backend, pool = RefusingBackend(), DiscardingPool()
    site = KernelSite("k-user")
    services = Services(reaper=cast(OrphanReaper, NoReaper()), pool=cast(SandboxPool, pool))
    claim = PoolClaim(site, backend, cast(KernelChannels, None), logging.getLogger("test"), services)
    runtime = short_runtime / "sandbox-kernel-pooled"
    sandbox = PooledSandbox(
        "c1", runtime, runtime / "run1", runtime / "slot", b"key", "hmac-sha256", 0, backend
    )
    spec = SandboxSpec(
        kernel_id="k-user", kernelspec="sandboxed-python", image="i", runtime="runsc", command=[], env={},
        workspace=alice.root / "project", workdir="/workspace/project", runtime_dir=Path(), uid=UID, gid=UID,
        owned_from=alice.root,
    )  # fmt: skip
    with pytest.raises(WorkspaceError, match="is a link or no folder now"):
        await claim.bind(spec, sandbox)
    assert pool.discarded == [sandbox]
    assert (site.container_id, site.runtime_dir, site.launch_dir) == (None, None, None)
    assert not claim.from_pool
