"""One start's policy: the kernel's settings narrowed by what its start asked for, read only.

A kernel's settings are the provisioner's traits: the server's config, the kernelspec's
(checked against the ceilings), never changed by a start. What one start narrows
(``start_kernel(memory="1g", network="none")``, see :func:`~.plan.narrow_settings`) goes
into a :class:`SandboxPolicy` of its own, made once per start by :func:`policy_for`,
bound first to the ceilings of the user a gateway starts it for (see
:func:`~.plan.bind_to_user`);
the sandbox's plan, its watchdog and what a front end shows read that, so a setting has
one source of truth for the running kernel, and a restart starts from the kernelspec's
settings again, not from the last start's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from traitlets.config import LoggingConfigurable

from sandbox_kernel.egress.credentials import CredentialSpec
from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.plan.plan import bind_to_user, narrow_settings
from sandbox_kernel.plan.settings import SandboxSettings
from sandbox_kernel.plan.users import KernelUser

#: The traits a policy holds: every setting (not the configurable's own: config, parent, log).
POLICY_TRAITS = tuple(
    sorted(set(SandboxSettings.class_trait_names()) - set(LoggingConfigurable.class_trait_names()))
)


class SandboxPolicy(SandboxSettings):
    """A read-only copy of ``source``'s settings (see the module's docstring)."""

    def __init__(self, source: SandboxSettings) -> None:
        super().__init__(log=source.log)
        self._source = source
        with self.hold_trait_notifications():
            for name in POLICY_TRAITS:
                setattr(self, name, getattr(source, name))
        self._frozen = False

    def freeze(self) -> None:
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False) and name in POLICY_TRAITS:
            msg = (
                f"{name}: a running kernel's policy is read only; set it in the server's config or "
                "the kernelspec, or narrow it in start_kernel(...)"
            )
            raise ConfigurationError(msg)
        super().__setattr__(name, value)

    def credential_catalog(self) -> dict[str, CredentialSpec]:
        """The server's credentials: its config's, as the source reads it."""
        return self._source.credential_catalog()


def policy_for(
    settings: SandboxSettings,
    narrowed: Mapping[str, Any],
    kernel_name: str,
    user: KernelUser | None = None,
    kernelspec_config: Mapping[str, Any] | None = None,
) -> SandboxPolicy:
    """``settings`` narrowed to what one start asked for (``narrowed``, as
    :func:`~.plan.start_policy` took it), in a policy of its own; ``settings`` unchanged.
    With a ``user``, bound to their ceilings first (``kernelspec_config``: what the
    kernelspec itself asks, see :func:`~.plan.bind_to_user`).

    Raises:
        ConfigurationError: a value is invalid, beyond the user's ceilings or would widen
            the policy, naming the key.
    """
    policy = SandboxPolicy(settings)
    if user is not None:
        bind_to_user(policy, kernelspec_config or {}, user)
    narrow_settings(policy, narrowed, kernel_name)
    policy.freeze()
    return policy
