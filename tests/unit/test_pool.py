"""The pool's pure parts: which sandbox may serve which kernel, and where mounts are."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from sandbox_kernel.backends.docker_args import container_create_kwargs
from sandbox_kernel.backends.fake import FakeBackend
from sandbox_kernel.host.mounts import mounts_under
from sandbox_kernel.lifecycle.ownership import SandboxedKernel
from sandbox_kernel.plan.plan import pooled_workspace_path
from sandbox_kernel.plan.sandbox_spec import LABEL_OWNER, LABEL_USER, SandboxSpec
from sandbox_kernel.pool.sandboxes import PoolPlan, SandboxPool, plan_fingerprint

SPEC = SandboxSpec(
    kernel_id="k1",
    kernelspec="sandboxed-python",
    image="img",
    runtime="runsc",
    command=["python", "-m", "ipykernel_launcher"],
    env={"LANG": "C.UTF-8", "JPY_SESSION_NAME": "a.ipynb"},
    workspace=Path("/srv/a"),
    workdir="/workspace/a",
    runtime_dir=Path("/tmp/x/run1"),
    uid=1000,
    gid=1000,
    workspace_path="/workspace/a",
    extra_labels={LABEL_OWNER: "host/1/2/3"},
)


def test_kernels_of_one_plan_share_a_fingerprint_whatever_their_folder_or_session() -> None:
    other = replace(
        SPEC,
        kernel_id="k2",
        env={**SPEC.env, "JPY_SESSION_NAME": "b.ipynb"},
        workspace=Path("/srv/b"),
        workdir="/workspace/b/sub",
        workspace_path="/workspace/b",
        runtime_dir=Path("/tmp/y/run1"),
        extra_labels={LABEL_OWNER: "host/1/2/4"},
    )
    assert plan_fingerprint(SPEC, "hmac-sha256") == plan_fingerprint(other, "hmac-sha256")


def test_what_is_fixed_when_a_sandbox_starts_must_match() -> None:
    base = plan_fingerprint(SPEC, "hmac-sha256")
    for changed in (
        replace(SPEC, uid=1001),
        replace(SPEC, memory="4g"),
        replace(SPEC, image="other"),
        replace(SPEC, env={**SPEC.env, "LANG": "de_DE.UTF-8"}),
        replace(SPEC, command=["python3", "-m", "ipykernel_launcher"]),
    ):
        assert plan_fingerprint(changed, "hmac-sha256") != base
    assert plan_fingerprint(SPEC, "hmac-sha512") != base


def test_a_pooled_sandbox_mounts_only_its_empty_slot_and_says_so() -> None:
    slot = Path("/tmp/x/slot")
    pooled = replace(SPEC, slot=slot, workspace=slot, workdir="/workspace", workspace_path="/workspace")
    kwargs = container_create_kwargs(pooled)
    workspace_mount = kwargs["mounts"][0]
    assert (workspace_mount["Target"], workspace_mount["Source"]) == ("/workspace", str(slot))
    assert workspace_mount["BindOptions"] == {"Propagation": "rslave"}
    assert kwargs["name"].startswith("sandbox-kernel-pool-")
    assert kwargs["labels"]["io.sandbox-kernel.pool"] == "true"
    # A cold kernel of a pooled kernelspec: its folder straight at /workspace/<name>.
    cold = container_create_kwargs(SPEC)["mounts"][0]
    assert (cold["Target"], cold["Source"]) == ("/workspace/a", "/srv/a")


def test_the_workspace_appears_under_its_own_name() -> None:
    assert pooled_workspace_path(Path("/home/ana/Sales 2026"), None) == "/workspace/Sales-2026"
    assert pooled_workspace_path(Path("/srv/x"), "team-data") == "/workspace/team-data"
    assert pooled_workspace_path(Path("/srv/..."), None) == "/workspace/work"


def test_mounts_under_a_folder_come_deepest_first(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "27 1 254:0 / / rw - ext4 /dev/vda rw\n"
        "50 27 254:0 /tmp/sk-a /tmp/sk-a rw shared:3 - ext4 /dev/vda rw\n"
        "68 50 254:0 /srv/a /tmp/sk-a/slot/my\\040project rw shared:7 - ext4 /dev/vda rw\n"
        "70 27 254:0 /tmp/sk-ab /tmp/sk-ab rw - ext4 /dev/vda rw\n"
    )
    assert mounts_under(Path("/tmp/sk-a"), info) == [Path("/tmp/sk-a/slot/my project"), Path("/tmp/sk-a")]


def test_a_waiting_pooled_sandbox_is_listed_as_pooled_and_orphaned_with_its_owner() -> None:
    attrs = {
        "Id": "c1",
        "Name": "/sandbox-kernel-pool-abc",
        "Config": {
            "Labels": {
                "io.sandbox-kernel.pool": "true",
                "io.sandbox-kernel.lifecycle": "persistent",
                "io.sandbox-kernel.owner": "elsewhere/1/2/3",
            }
        },
        "State": {"Status": "running"},
    }
    kernel = SandboxedKernel.from_inspect(attrs)
    assert kernel.pooled
    assert kernel.kernel_id == ""
    assert kernel.status == "pooled, starting"  # its ready mark cannot be read here
    claimed = SandboxedKernel.from_inspect({**attrs, "Name": "/sandbox-kernel-1234-5678"})
    assert not claimed.pooled
    assert claimed.kernel_id == "1234-5678"


def test_a_binding_holds_only_what_differs_from_one_kernel_to_the_next() -> None:
    from sandbox_kernel.pool.binding import KernelBinding

    binding = KernelBinding.of(SPEC)
    assert binding.kernel_id == "k1"
    assert binding.name == "sandbox-kernel-k1"
    assert (binding.workdir, binding.workspace_path) == ("/workspace/a", "/workspace/a")
    assert binding.env == {"JPY_SESSION_NAME": "a.ipynb"}  # LANG was fixed when the sandbox started


def test_a_pooled_sandbox_carries_nothing_of_the_kernel_whose_start_made_the_plan(tmp_path: Path) -> None:
    """The plan is made from one kernel's start: its notebook's name, folder and volume
    must not reach the next user's kernel through the pooled sandbox."""
    from sandbox_kernel.pool.sandboxes import pooled_spec

    planned = replace(SPEC, volume="alice-sales")
    pooled = pooled_spec(planned, tmp_path / "slot", tmp_path / "run1")
    assert "JPY_SESSION_NAME" not in pooled.env
    assert pooled.env["SANDBOX_KERNEL_CLAIM"] == "/run/sandbox-kernel/claim.sock"
    assert pooled.env["LANG"] == "C.UTF-8"
    assert (pooled.workspace, pooled.volume, pooled.workdir) == (tmp_path / "slot", None, "/workspace")
    assert pooled.kernel_id != SPEC.kernel_id
    kwargs = container_create_kwargs(pooled)
    assert kwargs["working_dir"] == "/workspace"
    assert "alice" not in json.dumps(kwargs["labels"]) + json.dumps(kwargs["environment"])


def test_each_users_pool_of_a_kernelspec_is_its_own() -> None:
    """On a gateway, one kernelspec has a pool per user: planning one user's leaves the
    others' (and the pool of no user's) as they were."""

    def of(spec: SandboxSpec) -> PoolPlan:
        return PoolPlan(spec, 0, "hmac-sha256", None, 60.0, True, "/tmp", 0, FakeBackend())

    alice = replace(SPEC, uid=1001, extra_labels={**SPEC.extra_labels, LABEL_USER: "alice"})
    bob = replace(SPEC, uid=1002, extra_labels={**SPEC.extra_labels, LABEL_USER: "bob"})
    pool = SandboxPool()
    for spec in (SPEC, alice, bob):
        pool.want(of(spec))  # size 0: nothing starts
    assert [p.key for p in (of(SPEC), of(alice), of(bob))] == [
        ("sandboxed-python", ""),
        ("sandboxed-python", "alice"),
        ("sandboxed-python", "bob"),
    ]
    assert pool.plan_of("sandboxed-python", "alice") == of(alice)
    assert pool.plan_of("sandboxed-python", "bob") == of(bob)
    assert pool.plan_of("sandboxed-python") == of(SPEC)
    assert pool.plan_of("sandboxed-python", "carol") is None
    assert len({of(s).fingerprint for s in (SPEC, alice, bob)}) == 3
