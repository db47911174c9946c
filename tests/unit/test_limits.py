"""Limits against the administrator's ceilings, and their path into the container."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.limits import Limits, check_within_ceilings, kernel_startup, size_bytes

CEILINGS = Limits(cpus=2.0, memory="4g", pids=1024, tmp_size="1g")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", 1), ("512k", 512 * 1024), ("512m", 512 * 1024**2), ("2G", 2 * 1024**3)],
)
def test_size_bytes(value: str, expected: int) -> None:
    assert size_bytes("memory", value) == expected


@pytest.mark.parametrize("value", ["", "0", "-1g", "1.5g", "2gb", "lots", "1t"])
def test_size_bytes_rejects_non_sizes(value: str) -> None:
    with pytest.raises(ConfigurationError, match=r"memory=.* is not a size"):
        size_bytes("memory", value)


def test_limits_at_the_ceilings_pass() -> None:
    check_within_ceilings(CEILINGS, CEILINGS)
    check_within_ceilings(Limits(cpus=0.5, memory="4096m", pids=16, tmp_size="64m"), CEILINGS)


@pytest.mark.parametrize(
    ("limits", "name", "ceiling"),
    [
        (Limits(cpus=2.5, memory="1g", pids=64, tmp_size="64m"), "cpus", "2.0"),
        (Limits(cpus=1.0, memory="4097m", pids=64, tmp_size="64m"), "memory", "'4g'"),
        (Limits(cpus=1.0, memory="1g", pids=1025, tmp_size="64m"), "pids", "1024"),
        (Limits(cpus=1.0, memory="1g", pids=64, tmp_size="2g"), "tmp_size", "'1g'"),
    ],
)
def test_a_limit_above_its_ceiling_is_refused_with_the_fix(limits: Limits, name: str, ceiling: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        check_within_ceilings(limits, CEILINGS)
    message = str(info.value)
    assert message.startswith(f"{name}=")
    assert f"ceiling of {ceiling}" in message
    assert f"SandboxProvisioner.max_{name}" in message
    assert "administrator" in message


@pytest.mark.parametrize(("asked", "ceiling"), [(0.0, 60.0), (61.0, 60.0)])
def test_an_exec_timeout_above_its_ceiling_or_none_under_one_is_refused(asked: float, ceiling: float) -> None:
    limits = Limits(cpus=1.0, memory="1g", pids=64, tmp_size="64m", exec_timeout=asked)
    ceilings = Limits(cpus=2.0, memory="4g", pids=1024, tmp_size="1g", exec_timeout=ceiling)
    with pytest.raises(ConfigurationError, match=r"SandboxProvisioner\.max_exec_timeout"):
        check_within_ceilings(limits, ceilings)


def test_without_an_exec_timeout_ceiling_any_limit_passes() -> None:
    for asked in (0.0, 5.0, 86400.0):
        check_within_ceilings(Limits(1.0, "1g", 64, "64m", asked), CEILINGS)


@pytest.fixture(autouse=True)
def _interpreter_state_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up code edits sys.path and os.environ: each test gets them back."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONSAFEPATH", "1")


def _run_startup(limits: Limits) -> tuple[dict[str, object], dict[str, object], dict[str, object]]:
    registered: dict[str, object] = {}
    custom: dict[str, object] = {}

    class Events:
        def register(self, event: str, callback: object) -> None:
            registered[event] = callback

    class Shell:
        events = Events()

        def set_custom_exc(self, types: tuple[type, ...], handler: object) -> None:
            custom["types"], custom["handler"] = types, handler

        def showtraceback(self, exc_tuple: tuple[Any, ...], tb_offset: int | None = None) -> None:
            custom["shown"] = exc_tuple[1]

    shell = Shell()
    namespace: dict[str, object] = {"get_ipython": lambda: shell}
    exec(compile(kernel_startup(limits), "startup.py", "exec"), namespace)  # noqa: S102
    assert "_sandbox_kernel_startup" not in namespace, "start-up code must not litter the user's names"
    return registered, custom, {"shell": shell}


def test_the_startup_code_puts_the_working_folder_back_where_ipython_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel starts with PYTHONSAFEPATH (nothing from the workspace runs before it is
    up); once up, the notebook's folder imports as in a local kernel, and child processes
    do not inherit PYTHONSAFEPATH."""
    stdlib = ["/usr/lib/python311.zip", "/usr/lib/python3.11", "/usr/lib/python3.11/lib-dynload"]
    monkeypatch.setattr(sys, "path", [*stdlib, "/opt/kernel/lib/python3.11/site-packages"])
    _run_startup(Limits(1.0, "1g", 64, "64m"))
    assert sys.path == [*stdlib, "", "/opt/kernel/lib/python3.11/site-packages"]
    assert "PYTHONSAFEPATH" not in os.environ


def test_the_startup_code_leaves_a_path_that_has_the_working_folder_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "path", ["", "/usr/lib/python3.11", "/x/site-packages"])
    _run_startup(Limits(1.0, "1g", 64, "64m"))
    assert sys.path == ["", "/usr/lib/python3.11", "/x/site-packages"]


def test_the_startup_code_arms_the_wall_clock_limit_only_when_set() -> None:
    registered, _, _ = _run_startup(Limits(1.0, "1g", 64, "64m", exec_timeout=2.5))
    assert set(registered) == {"pre_run_cell", "post_run_cell"}
    registered, _, _ = _run_startup(Limits(1.0, "1g", 64, "64m"))
    assert registered == {}


def test_a_memory_error_names_the_memory_limit() -> None:
    _, custom, ns = _run_startup(Limits(1.0, "512m", 64, "64m"))
    assert custom["types"] == (MemoryError,)
    error = MemoryError("Unable to allocate 8.00 GiB")
    handler: Any = custom["handler"]
    handler(ns["shell"], MemoryError, error, None)
    assert custom["shown"] is error
    assert str(error).startswith("memory limit 512m of this sandboxed kernel reached (Unable to allocate")
