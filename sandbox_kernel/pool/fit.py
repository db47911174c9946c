"""Which starts a pooled sandbox can serve: its own plan, or one narrower in ways a running,
never-used sandbox can be narrowed to (pure: a comparison of two plans).

A start's plan is made as for a cold start (:func:`~.plan.plan_sandbox`: the same filter
of its environment, the same ceilings), then compared with the plan the pool's sandboxes
were made from. What may differ, and how a claim applies it before any user code runs:

- **memory, cpus**: lower limits are written to the sandbox's host cgroup (``docker
  update`` is refused by runsc 20240729, which has no ``update`` command);
- **pids, file_size**: lower ``RLIMIT_NPROC`` / ``RLIMIT_FSIZE`` are set on every process
  of the sandbox by its kernel as it takes the claim (limits a process can only lower);
- **exec_timeout, idle_timeout**: the host's watchdog holds the kernel to the start's
  policy, and the kernel reads the start's policy (``SANDBOX_KERNEL_POLICY``) at its claim;
- **network**: fewer allowed domains, or ``none``, of an ``allowlist`` pool: the host's
  egress proxy enforces the kernel's own rules (with ``none`` it never dials the
  sandbox's relay, so nothing leaves it);
- **environment**: the variables the start's plan sets or drops, given to the kernel at
  its claim, except those read as the sandbox's processes start (:data:`STARTUP_ENV`).

Anything else (a wider limit, another image, uid, runtime, command or labels, a
``tmp_size`` other than the pool's: gVisor's /tmp keeps its size through a remount, as
measured) is a reason to start cold, which :func:`narrowing` returns as text for the log.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sandbox_kernel.egress.relay import CA_VARIABLES
from sandbox_kernel.egress.rules import EgressRules
from sandbox_kernel.plan.limits import size_bytes
from sandbox_kernel.plan.sandbox_spec import (
    LABEL_OWNER,
    PER_KERNEL_ENV,
    POLICY_ENV,
    SandboxSpec,
    egress_command,
)

#: Variables read as the sandbox's processes start (the interpreter, the dynamic loader,
#: the C library's locale and allocator, which python runs the kernel): setting one at a
#: claim would not make the kernel what a cold start makes it, so such a start starts cold.
STARTUP_ENV = frozenset({"PATH", "LANG", "LANGUAGE", "TZ", "NODE_OPTIONS"})
STARTUP_ENV_PREFIXES = ("PYTHON", "LD_", "LC_", "MALLOC_", "GLIBC_")

#: What a claim may lower, as :class:`~.plan.sandbox_spec.SandboxSpec` names it, and how
#: it is applied: on the sandbox's host cgroup, or as a resource limit inside.
HOST_LIMITS = ("memory", "cpus")
RLIMITS = {"pids": "nproc", "file_size": "fsize"}
#: Spec fields the claim binds (the kernel's own), or applies (above), or compares on
#: their own (the command, the environment).
_NOT_COMPARED = (
    "kernel_id", "workspace", "workdir", "workspace_path", "volume", "runtime_dir", "slot",
    "owned_from", "staging", "memory", "cpus", "pids", "file_size", "tmp_size", "command", "env",
)  # fmt: skip
#: Policy keys (``SANDBOX_KERNEL_POLICY``) held by the host, for which narrower is enough.
_TIMEOUTS = ("exec_timeout", "idle_timeout")
#: Policy keys that mirror spec fields, compared there.
_SPEC_KEYS = ("memory", "cpus", "pids", "tmp_size", "file_size", "image")
#: Set in the kernel by the egress relay (trusting its CA): gone with the network.
_EGRESS_RELAY_ENV = (*CA_VARIABLES, "NODE_EXTRA_CA_CERTS")


@dataclass(frozen=True)
class Narrowing:
    """What a claim applies to a pooled sandbox to make it one start's (nothing: its plan is the pool's)."""

    #: Lower limits for the sandbox's host cgroup (None: the pool's).
    memory: str | None = None
    cpus: float | None = None
    #: Lower resource limits for every process of the sandbox ("nproc", "fsize").
    rlimits: dict[str, int] = field(default_factory=dict)
    #: Variables the kernel sets at its claim (its policy among them when that differs).
    env: dict[str, str] = field(default_factory=dict)
    #: Variables the kernel drops at its claim.
    unset: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return self == Narrowing()

    def describe(self) -> str:
        """What it narrows, for the log: names only (never a variable's value)."""
        parts = [f"memory {self.memory}"] if self.memory else []
        parts += [f"cpus {self.cpus:g}"] if self.cpus is not None else []
        parts += [f"{name} {value}" for name, value in sorted(self.rlimits.items())]
        names = sorted({*self.env, *self.unset} - {POLICY_ENV})
        parts += [f"env {', '.join(names)}"] if names else []
        parts += ["policy"] if POLICY_ENV in self.env else []
        return "; ".join(parts) or "nothing"


def startup_variable(name: str) -> bool:
    """Whether ``name`` is read as the sandbox's processes start (see :data:`STARTUP_ENV`)."""
    return name in STARTUP_ENV or name.startswith(STARTUP_ENV_PREFIXES)


def _fixed(spec: SandboxSpec) -> dict[str, Any]:
    """The spec's fields a claim can change nothing of (the owner label is the process's)."""
    fixed = asdict(replace(spec, env={}, command=[], workspace=Path(), runtime_dir=Path()))
    for name in _NOT_COMPARED:
        fixed.pop(name, None)
    fixed["extra_labels"] = {k: v for k, v in spec.extra_labels.items() if k != LABEL_OWNER}
    return fixed


def _policy_reason(pool: Mapping[str, Any], start: Mapping[str, Any]) -> str | None:
    """Why the start's policy (``SANDBOX_KERNEL_POLICY``) is not the pool's narrowed, or None."""
    for key in sorted(set(pool) | set(start), key=lambda key: (key != "network", key)):
        before, after = pool.get(key), start.get(key)
        if before == after or key in _SPEC_KEYS or key == "credentials":
            continue  # credentials: the host's proxy adds the start's own, within its domains
        if key in _TIMEOUTS:
            if float(before or 0) > 0 and not 0 < float(after or 0) <= float(before or 0):
                return f"{key} {after} is wider than the pool's {before}"
        elif key == "network":
            if not (before == "allowlist" and after == "none"):
                return f"network {after} differs from the pool's {before}"
        elif key == "allowed_domains":
            uncovered = EgressRules.parse(after or [], key).uncovered_by(EgressRules.parse(before or [], key))
            if uncovered:
                return f"allowed_domains {sorted(uncovered)} are not the pool's"
        else:
            return f"{key} differs from the pool's"
    return None


def _limits(pool: SandboxSpec, start: SandboxSpec) -> tuple[dict[str, Any], str | None]:
    """The lower limits the start asks for (spec field -> value), or why it cannot be narrowed."""
    lower: dict[str, Any] = {}
    for name in (*HOST_LIMITS, *RLIMITS):
        before, after = getattr(pool, name), getattr(start, name)
        if name in ("memory", "file_size"):
            before, after = size_bytes(name, before), size_bytes(name, after)
        if after > before:
            return {}, f"{name} {getattr(start, name)} is more than the pool's {getattr(pool, name)}"
        if after < before:
            lower[name] = getattr(start, name)
    if pool.tmp_size != start.tmp_size:
        why = "a running sandbox's /tmp keeps its size"
        return {}, f"tmp_size {start.tmp_size} differs from the pool's {pool.tmp_size} ({why})"
    return lower, None


def _env(pool: Mapping[str, str], start: Mapping[str, str]) -> tuple[dict[str, str], list[str], str | None]:
    """(variables to set, to drop) at the claim, or why the start must start cold."""
    changed, dropped = {}, []
    for name in sorted(set(pool) | set(start)):
        if name in PER_KERNEL_ENV or name == POLICY_ENV or pool.get(name) == start.get(name):
            continue
        if startup_variable(name):
            return {}, [], f"env {name} differs from the pool's, and is read as the sandbox starts"
        if name in start:
            changed[name] = start[name]
        else:
            dropped.append(name)
    return changed, dropped, None


def narrowing(pool: SandboxSpec, start: SandboxSpec) -> Narrowing | str:
    """What makes a sandbox of the plan ``pool`` (running, never used) the sandbox of the
    plan ``start``, or why none can be (which field differed, and how; never a value of
    the environment). Both are plans as :func:`~.plan.plan_sandbox` makes them."""
    fixed_pool, fixed_start = _fixed(pool), _fixed(start)
    for name in fixed_pool:
        if fixed_pool[name] != fixed_start.get(name):
            if name == "extra_labels":
                pool_labels, start_labels = fixed_pool[name], fixed_start[name]
                differ = sorted(
                    k for k in {*pool_labels, *start_labels} if pool_labels.get(k) != start_labels.get(k)
                )
                return f"the sandbox's labels {', '.join(differ)} differ from the pool's"
            return f"{name} {fixed_start.get(name)!r} differs from the pool's {fixed_pool[name]!r}"
    pool_policy = json.loads(pool.env.get(POLICY_ENV) or "{}")
    start_policy = json.loads(start.env.get(POLICY_ENV) or "{}")
    reason = _policy_reason(pool_policy, start_policy)
    if reason is not None:
        return reason
    offline = pool.command != start.command and pool.command == egress_command(start.command)
    if pool.command != start.command and not offline:
        return "the kernel's command differs from the pool's"
    lower, reason = _limits(pool, start)
    if reason is not None:
        return reason
    env, unset, reason = _env(pool.env, start.env)
    if reason is not None:
        return reason
    if offline:  # no network of an allow-list pool: what its relay set goes too
        unset = sorted({*unset, *_EGRESS_RELAY_ENV})
    if pool_policy != start_policy:
        env[POLICY_ENV] = start.env[POLICY_ENV]
    return Narrowing(
        memory=lower.get("memory"),
        cpus=lower.get("cpus"),
        rlimits={RLIMITS[name]: _rlimit(name, value) for name, value in lower.items() if name in RLIMITS},
        env=env,
        unset=tuple(unset),
    )


def _rlimit(name: str, value: Any) -> int:
    return size_bytes(name, value) if name == "file_size" else int(value)
