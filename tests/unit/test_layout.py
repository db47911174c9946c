"""The package's folders show its architecture, and the code keeps to it: each part
imports only from the parts below it (docs/design/index.md lists them), what runs inside
the sandbox imports nothing of the host's, and the paths configs and users name still work."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sandbox_kernel"

#: From the top down: a part may import from its own and every later row.
LAYERS = [
    {"__init__", "server", "lab", "launch"},  # the package's face and the paths configs name
    {"cli"},
    {"gateway"},  # the sandbox gateway: kernels served to other users' servers
    {"agents", "jupyter"},
    {"warming", "reattach"},
    {"provisioner"},
    {"kernel"},
    {"services"},
    {"pool"},
    {"backend"},  # the interface's public path
    {"lifecycle"},
    {"backends"},
    {"channels", "plan"},
    {"egress"},
    {"host", "inside", "errors", "_version"},
]


def part_of(module: str) -> str:
    """``sandbox_kernel.kernel.pauser`` -> ``kernel``; ``sandbox_kernel`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer(part: str) -> int:
    for index, parts in enumerate(LAYERS):
        if part in parts:
            return index
    raise AssertionError(f"sandbox_kernel.{part} is in no layer of this test (and of docs/design/index.md)")


def modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "labextension" in path.parts:
            continue
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        found.append((name, path))
    return found


def imports(path: Path) -> list[str]:
    """The sandbox_kernel modules ``path`` imports (the package's own, absolute)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                pytest.fail(f"{path}: relative import; the package imports itself absolutely")
            if node.module and node.module.split(".")[0] == "sandbox_kernel":
                found += (
                    [f"{node.module}.{alias.name}" for alias in node.names]
                    if node.module == "sandbox_kernel"
                    else [node.module]
                )
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "sandbox_kernel"]
    return found


def test_every_part_imports_only_from_the_parts_below_it() -> None:
    wrong = []
    for name, path in modules():
        here = layer(part_of(name))
        for target in imports(path):
            there = layer(part_of(target))
            if there < here:
                wrong.append(f"{name} -> {target}")
    assert wrong == [], "imports that run back up:\n" + "\n".join(wrong)


def test_what_runs_in_the_sandbox_imports_nothing_of_the_host() -> None:
    for name, path in modules():
        if part_of(name) == "inside" and not name.endswith("inside"):
            assert imports(path) == [], f"{name} is copied into the sandbox, where sandbox_kernel is not"


def test_the_paths_configs_and_users_name_still_work() -> None:
    from sandbox_kernel.backend import SandboxBackend
    from sandbox_kernel.backends.base import SandboxBackend as Base
    from sandbox_kernel.jupyter import lab as new_lab
    from sandbox_kernel.jupyter.server import SandboxMappingKernelManager as New
    from sandbox_kernel.lab import _jupyter_server_extension_points, _load_jupyter_server_extension
    from sandbox_kernel.server import SandboxMappingKernelManager

    assert SandboxMappingKernelManager is New
    assert SandboxBackend is Base
    assert _load_jupyter_server_extension is new_lab._load_jupyter_server_extension
    assert _jupyter_server_extension_points() == new_lab._jupyter_server_extension_points()
    launched = subprocess.run(
        [sys.executable, "-m", "sandbox_kernel.launch", "--help"], capture_output=True, text=True, timeout=60
    )
    assert launched.returncode == 0, launched.stderr
    assert "--kernel" in launched.stdout, "what installed kernelspecs' argv runs"


@pytest.mark.parametrize(
    "module",
    [
        "sandbox_kernel.provisioner",  # what a provisioner's entry point loads
        "sandbox_kernel.launch",  # a kernelspec's argv, run by VS Code and the like
        "sandbox_kernel.cli.app",  # every `jupyter sandbox-kernel` command
        "sandbox_kernel.agents.mcp_server",
    ],
)
def test_starting_a_kernel_or_a_command_does_not_load_jupyter_server(module: str) -> None:
    """jupyter_server's gateway client loads jupyter_events, jsonschema's format checks and
    their grammars: 1.2 s of every start, which tripled `jupyter sandbox-kernel list` (2.26
    against 0.63 s) and, with the package's eager imports, made a kernelspec argv's start
    to its first reply 5.1 s against 2.0 s. Only the gateway's own paths load it, when
    they are taken. IPython and ipykernel run in the sandbox: the host copies the files
    that import them, and imports neither."""
    code = (
        f"import sys, {module}\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in "
        "('jupyter_server', 'jupyter_events', 'jsonschema', 'IPython', 'ipykernel')))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_the_launcher_imports_only_what_it_needs() -> None:
    """The launcher a front end runs per kernel starts its worker and waits: importing the
    package must not import the session API, the provisioner or jupyter_client (PEP 562
    names in sandbox_kernel/__init__.py), while ``from sandbox_kernel import ...`` works."""
    code = (
        "import sys, sandbox_kernel.launch\n"
        "print(sorted(n for n in ('sandbox_kernel.agents.session', 'sandbox_kernel.provisioner', "
        "'jupyter_client') if n in sys.modules))\n"
        "from sandbox_kernel import SandboxSession, SandboxProvisioner, warm_pool, KernelHeldError\n"
        "print(SandboxSession.__name__, SandboxProvisioner.__name__, warm_pool.__name__)"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.splitlines() == ["[]", "SandboxSession SandboxProvisioner warm_pool"]
