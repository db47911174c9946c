"""One start of a kernel, read from what jupyter_client hands the provisioner.

:func:`read_start` checks the kernelspec's settings against the ceilings, takes the user
a sandbox gateway starts it for (``sandbox_user``, see :mod:`~.plan.users`), the policy
the start narrows (``start_kernel(memory=..., network="none")``, see :mod:`~.plan`) and
the variables it sets in the sandbox out of the start's arguments, and says what of its
launch environment does not reach the sandbox. jupyter_client keeps the arguments for
restarts (its own restarter's too), so a restart is read the same way: for the same user.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox_kernel.channels.bridge import CurveKeys
from sandbox_kernel.kernel.manager import ManagerLink
from sandbox_kernel.lifecycle.ownership import server_identity
from sandbox_kernel.plan.plan import (
    Launch,
    Plan,
    check_sandbox_env,
    check_settings,
    kernelspec_config,
    plan_sandbox,
    start_policy,
    unpassed_env,
    visible_env,
)
from sandbox_kernel.plan.policy import SandboxPolicy, policy_for
from sandbox_kernel.plan.settings import SandboxSettings
from sandbox_kernel.plan.users import START_ARGUMENT, KernelUser, check_user

#: Launch variables a kernel needs again when a reattached manager restarts it.
RELAUNCH_ENV = ("JPY_SESSION_NAME", "JUPYTERHUB_USER")


@dataclass(frozen=True)
class Start:
    """One start: the launch, its policy (and what it narrowed), what it sets in the sandbox."""

    launch: Launch
    policy: SandboxPolicy
    narrowed: dict[str, Any]
    sandbox_env: dict[str, str]
    #: The environment the kernelspec's ``env`` templates are filled from: what the
    #: kernel may see of the launch environment, and the start's own variables.
    env: dict[str, str]
    curve: CurveKeys | None

    @property
    def launch_env(self) -> dict[str, str]:
        """Of the launch environment, what a relaunch after reattaching needs again."""
        return {k: v for k, v in self.launch.env.items() if k in RELAUNCH_ENV}

    def plan(self, env: Mapping[str, str], kernelspec_env: Iterable[str]) -> Plan:
        """The sandbox of this start (see :func:`~.plan.plan_sandbox`): ``env`` is
        :attr:`env` with the kernelspec's ``env`` templates filled, ``kernelspec_env`` the
        names the kernelspec's ``env`` sets."""
        return plan_sandbox(self.policy, self.launch, env, [*kernelspec_env, *self.sandbox_env])

    @property
    def user(self) -> KernelUser | None:
        """The user a sandbox gateway starts the kernel for, if any."""
        return self.launch.user

    @property
    def own(self) -> bool:
        """The start has a policy, environment or user of its own: a pooled sandbox is
        narrowed to it as it is claimed, when it can be (see :mod:`~sandbox_kernel.pool.fit`),
        and its plan never becomes the pool's."""
        return bool(self.narrowed or self.sandbox_env or self.launch.user is not None)


def read_start(
    settings: SandboxSettings, kernel_spec: Any, kernel_name: str, kwargs: dict[str, Any], link: ManagerLink
) -> Start:
    """The start that jupyter_client's ``kwargs`` ask for (the arguments a sandboxed kernel
    takes are taken out of them), with its policy: ``settings`` narrowed to it (they
    themselves are left as they are).

    Raises:
        ConfigurationError, WorkspaceError: the kernelspec, a setting or an argument is invalid.
    """
    config = kernelspec_config(kernel_spec)
    check_settings(settings, config, kernel_name)
    user = kwargs.pop(START_ARGUMENT, None)
    user = None if user is None else check_user(user)
    narrowed = start_policy(kwargs)
    policy = policy_for(settings, narrowed, kernel_name, user, config)
    curve = link.curve_keys(kwargs.pop("transport_encryption", None))
    env = kwargs.get("env")
    launch = Launch(
        kernel_id=str(settings.kernel_id),  # type: ignore[attr-defined]
        kernel_name=kernel_name,
        argv=kernel_spec.argv,
        cwd=Path(kwargs.get("cwd") or os.getcwd()),
        # As jupyter_client's: without an env, the launch environment is the process's.
        env=dict(os.environ) if env is None else env,
        extra_arguments=kwargs.pop("extra_arguments", []),
        owner=server_identity(),
        scope=link.adoption_scope(),
        server_root=link.server_root(),
        user=user,
    )
    sandbox_env = check_sandbox_env(kwargs.pop("sandbox_env", None))
    dropped = unpassed_env(policy, launch.env)
    if dropped:
        warnings.warn(
            f"start_kernel(env=...) sets {', '.join(dropped)}, which do not reach the sandboxed "
            f"kernel: only the kernelspec's pass_env names ({', '.join(settings.pass_env)}) pass from "
            "the launch environment, so that no secret comes along. Set variables in the sandbox "
            "with start_kernel(sandbox_env={...}) (the session API's env=) or the kernelspec's env.",
            stacklevel=4,
        )
    env = {**visible_env(policy, launch.env), **sandbox_env}
    return Start(launch, policy, narrowed, sandbox_env, env, curve)


async def plan_start(
    settings: SandboxSettings,
    kernel_spec: Any,
    kernel_name: str,
    kwargs: dict[str, Any],
    link: ManagerLink,
    fill_env: Callable[..., Awaitable[dict[str, Any]]],
) -> tuple[Start, Plan, dict[str, Any]]:
    """The start ``kwargs`` ask for (see :func:`read_start`) and its sandbox's plan; the
    arguments left for jupyter_client, their ``env`` filled by ``fill_env`` (jupyter_client's
    ``pre_launch``, which fills the kernelspec's ``env`` templates). Nothing runs: a kernel
    start and the warm pool plan with this same call.

    Raises:
        ConfigurationError, WorkspaceError: the kernelspec, a setting or an argument is invalid.
    """
    start = read_start(settings, kernel_spec, kernel_name, kwargs, link)
    kwargs["env"] = start.env
    kwargs = await fill_env(**kwargs)
    return start, start.plan(kwargs["env"], kernel_spec.env), kwargs
