"""Which starts a pooled sandbox can serve: narrowed onto its plan, or cold with a reason."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sandbox_kernel.plan.sandbox_spec import (
    LABEL_LIFECYCLE,
    LABEL_OWNER,
    LABEL_USER,
    POLICY_ENV,
    SandboxSpec,
    egress_command,
    proxy_env,
    relay_command,
    sandbox_env,
)
from sandbox_kernel.pool.fit import Narrowing, narrowing, startup_variable

COMMAND = relay_command(["python", "-m", "ipykernel_launcher", "-f", "/run/sandbox-kernel/connection.json"])
POLICY: dict[str, Any] = {
    "cpus": 1.0,
    "memory": "2g",
    "pids": 256,
    "tmp_size": "256m",
    "exec_timeout": 0.0,
    "idle_timeout": 0.0,
    "file_size": "4g",
    "network": "allowlist",
    "image": "img",
    "allowed_domains": ["pypi.org", "*.pythonhosted.org"],
    "credentials": {},
}


def plan(
    policy: dict[str, Any] | None = None, env: dict[str, str] | None = None, **fields: Any
) -> SandboxSpec:
    """A plan as plan_sandbox makes one: its limits in its fields and in its policy."""
    policy = {**POLICY, **(policy or {})}
    online = policy["network"] == "allowlist"
    spec = SandboxSpec(
        kernel_id="k1",
        kernelspec="py",
        image="img",
        runtime="runsc",
        command=egress_command(COMMAND) if online else COMMAND,
        env={
            **sandbox_env(env or {}, ["LANG"], env or {}),
            POLICY_ENV: json.dumps(policy),
            **(proxy_env() if online else {}),
        },
        workspace=Path("/srv/a"),
        workdir="/workspace/a",
        runtime_dir=Path(),
        uid=1000,
        gid=1000,
        memory=policy["memory"],
        cpus=policy["cpus"],
        pids=policy["pids"],
        tmp_size=policy["tmp_size"],
        file_size=policy["file_size"],
        extra_labels={LABEL_OWNER: "me", LABEL_LIFECYCLE: "ephemeral"},
    )
    return replace(spec, **fields)


POOL = plan(env={"LANG": "C.UTF-8"})


def test_the_pools_own_plan_needs_nothing_whatever_the_folder_or_owner() -> None:
    other = replace(
        POOL, kernel_id="k2", workspace=Path("/srv/b"), workdir="/workspace/b", extra_labels={
            LABEL_OWNER: "another process", LABEL_LIFECYCLE: "ephemeral"
        }
    )  # fmt: skip
    found = narrowing(POOL, other)
    assert isinstance(found, Narrowing)
    assert found.empty


def test_lower_limits_are_applied_on_the_host_and_inside() -> None:
    start = plan({"memory": "512m", "cpus": 0.5, "pids": 64, "file_size": "1g"}, env={"LANG": "C.UTF-8"})
    found = narrowing(POOL, start)
    assert isinstance(found, Narrowing)
    assert (found.memory, found.cpus) == ("512m", 0.5)
    assert found.rlimits == {"nproc": 64, "fsize": 2**30}
    assert json.loads(found.env[POLICY_ENV])["memory"] == "512m", "the kernel learns its narrowed policy"
    assert found.describe() == "memory 512m; cpus 0.5; fsize 1073741824; nproc 64; policy"


def test_the_same_size_written_otherwise_is_no_narrowing() -> None:
    found = narrowing(POOL, plan({"memory": "2048m"}, env={"LANG": "C.UTF-8"}))
    assert isinstance(found, Narrowing)
    assert found.memory is None


@pytest.mark.parametrize(
    ("policy", "why"),
    [
        ({"memory": "4g"}, "memory 4g is more than the pool's 2g"),
        ({"cpus": 2.0}, "cpus 2.0 is more than the pool's 1.0"),
        ({"pids": 512}, "pids 512 is more than the pool's 256"),
        ({"file_size": "8g"}, "file_size 8g is more than the pool's 4g"),
        ({"tmp_size": "128m"}, "tmp_size 128m differs from the pool's 256m"),
        ({"allowed_domains": ["example.com"]}, "allowed_domains ['example.com'] are not the pool's"),
    ],
)
def test_a_wider_or_unchangeable_limit_starts_cold_saying_which(policy: dict[str, Any], why: str) -> None:
    found = narrowing(POOL, plan(policy, env={"LANG": "C.UTF-8"}))
    assert isinstance(found, str)
    assert found.startswith(why)


def test_timeouts_only_narrow_and_no_timeout_is_the_widest() -> None:
    limited = plan({"exec_timeout": 60.0}, env={"LANG": "C.UTF-8"})
    assert isinstance(narrowing(POOL, limited), Narrowing), "a clock where the pool has none"
    assert narrowing(limited, POOL) == "exec_timeout 0.0 is wider than the pool's 60.0"
    shorter = plan({"exec_timeout": 30.0}, env={"LANG": "C.UTF-8"})
    assert isinstance(narrowing(limited, shorter), Narrowing)


def test_no_network_of_an_allowlist_pool_drops_its_proxy_and_trust() -> None:
    offline = plan({"network": "none", "allowed_domains": []}, env={"LANG": "C.UTF-8"})
    found = narrowing(POOL, offline)
    assert isinstance(found, Narrowing)
    assert {"HTTP_PROXY", "https_proxy", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"} <= set(found.unset)
    assert json.loads(found.env[POLICY_ENV])["network"] == "none"
    # The other way is wider: an allow-list start never claims a pool without network.
    assert narrowing(offline, POOL) == "network allowlist differs from the pool's none"
    fewer = plan({"allowed_domains": ["pypi.org"]}, env={"LANG": "C.UTF-8"})
    assert isinstance(narrowing(POOL, fewer), Narrowing)


def test_variables_set_by_a_start_are_given_at_the_claim_and_dropped_ones_unset() -> None:
    pool = plan(env={"LANG": "C.UTF-8", "TEAM": "a"})
    start = plan(env={"LANG": "C.UTF-8", "OPENAI_BASE_URL": "http://x", "MY_FLAG": "1"})
    found = narrowing(pool, start)
    assert isinstance(found, Narrowing)
    assert found.env == {"OPENAI_BASE_URL": "http://x", "MY_FLAG": "1"}
    assert found.unset == ("TEAM",)
    assert found.describe() == "env MY_FLAG, OPENAI_BASE_URL, TEAM", "names, never values"


@pytest.mark.parametrize("name", ["PATH", "PYTHONPATH", "LD_PRELOAD", "LC_ALL", "LANG", "TZ"])
def test_a_variable_read_as_the_sandbox_starts_starts_cold(name: str) -> None:
    assert startup_variable(name)
    found = narrowing(POOL, plan(env={"LANG": "C.UTF-8", name: "x"} if name != "LANG" else {"LANG": "x"}))
    assert found == f"env {name} differs from the pool's, and is read as the sandbox starts"


def test_what_the_sandbox_fixes_or_reserves_a_start_cannot_set_as_a_cold_start_cannot() -> None:
    """The claim's variables come out of the same filter as a cold start's (sandbox_env):
    HOME, the policy and sandbox-kernel's own variables are the host's, whatever is asked."""
    asked = {"LANG": "C.UTF-8", "HOME": "/workspace", POLICY_ENV: "{}", "SANDBOX_KERNEL_CLAIM": "/x"}
    start = plan(env=asked)
    assert start.env["HOME"] == "/tmp"
    assert "SANDBOX_KERNEL_CLAIM" not in start.env
    assert json.loads(start.env[POLICY_ENV]) == POLICY
    found = narrowing(POOL, start)
    assert isinstance(found, Narrowing)
    assert found.empty


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"image": "other"}, "image 'other' differs from the pool's 'img'"),
        ({"uid": 1001}, "uid 1001 differs from the pool's 1000"),
        ({"runtime": "runc"}, "runtime 'runc' differs from the pool's 'runsc'"),
        ({"extra_labels": {LABEL_OWNER: "me", LABEL_LIFECYCLE: "persistent"}}, "the sandbox's labels"),
        ({"command": [*COMMAND, "--debug"]}, "the kernel's command differs from the pool's"),
    ],
)
def test_what_a_running_sandbox_cannot_change_starts_cold(fields: dict[str, Any], why: str) -> None:
    found = narrowing(POOL, replace(POOL, **fields))
    assert isinstance(found, str)
    assert found.startswith(why)


def test_a_users_pool_serves_their_starts_in_any_folder_and_no_other_users() -> None:
    """A gateway's pool of alice's: her uid and her label, fixed as its sandboxes start."""
    labels = {LABEL_OWNER: "me", LABEL_LIFECYCLE: "ephemeral"}
    alices = replace(POOL, uid=1001, gid=1001, extra_labels={**labels, LABEL_USER: "alice"})
    hers = replace(alices, kernel_id="k2", workspace=Path("/home/alice/b"), workdir="/workspace/b")
    found = narrowing(alices, hers)
    assert isinstance(found, Narrowing)
    assert found.empty
    bobs = replace(POOL, uid=1002, gid=1002, extra_labels={**labels, LABEL_USER: "bob"})
    assert narrowing(alices, bobs) == "uid 1002 differs from the pool's 1001"
    same_uid = replace(alices, extra_labels={**labels, LABEL_USER: "alice2"})  # a uid mapped twice
    assert narrowing(alices, same_uid) == f"the sandbox's labels {LABEL_USER} differ from the pool's"
    assert narrowing(POOL, replace(POOL, extra_labels={**labels, LABEL_USER: "alice"})) == (
        f"the sandbox's labels {LABEL_USER} differ from the pool's"
    ), "a pool of no user's serves no user"
