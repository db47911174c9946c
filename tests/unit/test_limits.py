"""Limits against the administrator's ceilings, and their path into the container."""

from __future__ import annotations

import pytest

from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.limits import size_bytes
from sandbox_kernel.plan import check_ceilings
from sandbox_kernel.settings import SandboxSettings


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


def settings(**values: object) -> SandboxSettings:
    """Settings with the default ceilings (cpus 2, memory 4g, pids 1024, tmp 1g, pool 4)."""
    return SandboxSettings(**values)


def test_limits_at_the_ceilings_pass() -> None:
    check_ceilings(settings(cpus=2.0, memory="4g", pids=1024, tmp_size="1g", pool_size=4), {})
    check_ceilings(settings(cpus=0.5, memory="4096m", pids=16, tmp_size="64m"), {})


@pytest.mark.parametrize(
    ("values", "name", "ceiling"),
    [
        ({"cpus": 2.5}, "cpus", "2.0"),
        ({"memory": "4097m"}, "memory", "'4g'"),
        ({"pids": 1025}, "pids", "1024"),
        ({"tmp_size": "2g"}, "tmp_size", "'1g'"),
        ({"file_size": "17g"}, "file_size", "'16g'"),
        ({"pool_size": 5}, "pool_size", "4"),
    ],
)
def test_a_limit_above_its_ceiling_is_refused_with_the_fix(
    values: dict[str, object], name: str, ceiling: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        check_ceilings(settings(**values), {})
    message = str(info.value)
    assert message.startswith(f"{name}=")
    assert f"ceiling of {ceiling}" in message
    assert f"SandboxProvisioner.max_{name}" in message
    assert "administrator" in message


@pytest.mark.parametrize(("asked", "ceiling"), [(0.0, 60.0), (61.0, 60.0)])
def test_an_exec_timeout_above_its_ceiling_or_none_under_one_is_refused(asked: float, ceiling: float) -> None:
    with pytest.raises(ConfigurationError, match=r"SandboxProvisioner\.max_exec_timeout"):
        check_ceilings(settings(exec_timeout=asked, max_exec_timeout=ceiling), {})


def test_without_an_exec_timeout_ceiling_any_limit_passes() -> None:
    for asked in (0.0, 5.0, 86400.0):
        check_ceilings(settings(exec_timeout=asked), {})


def test_only_the_pass_env_a_kernelspec_asks_for_is_bounded() -> None:
    server = settings(pass_env=["LANG", "HOME"], max_pass_env=["LANG"])
    check_ceilings(server, {})  # the server's own choice
    with pytest.raises(ConfigurationError, match=r"pass the server's HOME into the sandbox.*max_pass_env"):
        check_ceilings(server, {"pass_env": ["LANG", "HOME"]})


def test_every_ceiling_is_declared_on_the_setting_it_bounds() -> None:
    """Each max_* trait bounds a setting that names it, with a bound check_ceilings knows."""
    traits = SandboxSettings.class_traits()
    bounded = {trait.metadata["ceiling"] for trait in traits.values() if "ceiling" in trait.metadata}
    ceilings = {name for name in traits if name.startswith("max_") and name != "max_pool_memory"}
    assert bounded == ceilings
    for name, trait in traits.items():
        if "ceiling" in trait.metadata:
            assert trait.metadata["bound"] in ("amount", "size", "timeout", "lifetime", "names", "domains"), (
                name
            )
            assert trait.metadata.get("kernelspec"), (
                f"{name}: only what a kernelspec may choose needs a ceiling"
            )
    assert "ceiling" not in traits["max_pool_memory"].metadata  # a budget for the whole server
