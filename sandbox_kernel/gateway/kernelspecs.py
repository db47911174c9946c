"""The gateway's kernelspecs: only sandboxed ones exist for it.

The gateway runs as root. A kernelspec that the sandbox provisioner does not start (a
plain ``python3``) would run the client's code on the sandbox host as root, so for the
gateway it is not there at all: not listed, not startable, its resources not served.
"""

from __future__ import annotations

from typing import Any

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel
from traitlets import default

from sandbox_kernel.plan.admission import PROVISIONER_NAME, uses_sandbox


def _is_sandboxed(entry: dict[str, Any]) -> bool:
    provisioner = (entry.get("spec", {}).get("metadata") or {}).get("kernel_provisioner") or {}
    return isinstance(provisioner, dict) and provisioner.get("provisioner_name") == PROVISIONER_NAME


class SandboxedOnlyKernelSpecManager(KernelSpecManager):
    """A KernelSpecManager that knows only kernelspecs whose kernels run in the sandbox."""

    @default("ensure_native_kernel")
    def _ensure_native_kernel_default(self) -> bool:
        return False  # ipykernel's own spec runs on the host

    def get_all_specs(self) -> dict[str, Any]:
        """As jupyter_client's, with the kernelspecs that do not run in the sandbox left out."""
        return {name: entry for name, entry in super().get_all_specs().items() if _is_sandboxed(entry)}

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        """The sandboxed kernelspec ``kernel_name``.

        Raises:
            NoSuchKernel: there is none of that name, or it does not run in the sandbox.
        """
        spec = super().get_kernel_spec(kernel_name)
        if not uses_sandbox(spec):
            raise NoSuchKernel(kernel_name)
        return spec
