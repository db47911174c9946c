"""Limits against the administrator's ceilings, and their path into the container."""

from __future__ import annotations

import pytest

from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.limits import Limits, check_within_ceilings, size_bytes

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
