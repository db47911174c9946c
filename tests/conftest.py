"""Shared test setup: isolate Jupyter's folders and strip settings leaking in from the host."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _isolated_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SANDBOX_KERNEL_") or name == "DOCKER_HOST":
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _fresh_cli_singletons() -> Iterator[None]:
    """The CLI's subcommands are traitlets singletons: none may leak between tests."""
    from sandbox_kernel.cli.app import SandboxKernelApp

    SandboxKernelApp.clear_instances()
    yield
    SandboxKernelApp.clear_instances()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    integration_dir = Path(__file__).parent / "integration"
    for item in items:
        if integration_dir in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)
