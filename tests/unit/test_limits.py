"""Limits against the administrator's ceilings, and their path into the container."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from traitlets import Float, TraitError
from traitlets.config import Config

from sandbox_kernel.backends.docker_args import container_create_kwargs
from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.plan.limits import docker_size, duration_seconds, size_bytes
from sandbox_kernel.plan.plan import check_ceilings
from sandbox_kernel.plan.settings import Duration, SandboxSettings, Size

from .conftest import make_spec

GIB = 1024**3


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", 1),
        ("1073741824", GIB),
        (1073741824, GIB),
        ("512k", 512 * 1024),
        ("512m", 512 * 1024**2),
        ("2G", 2 * GIB),
        ("1.5g", 3 * GIB // 2),
        ("0.5g", GIB // 2),
        ("1.25M", 1310720),
        (" 64m ", 64 * 1024**2),
    ],
)
def test_size_bytes(value: str | int, expected: int) -> None:
    assert size_bytes("memory", value) == expected


@pytest.mark.parametrize(
    "value", ["", "0", "0.0g", "-1g", "1.5", "0.0001k", "2gb", "lots", "1t", "1.5.5g", "512 m", ".5g"]
)
def test_size_bytes_rejects_non_sizes_naming_the_accepted_forms(value: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        size_bytes("memory", value)
    message = str(info.value)
    assert message.startswith(f"memory={value!r} is not a size; ")
    assert "'512m', '1.5g' or '1073741824'" in message


@pytest.mark.parametrize(
    ("value", "expected"), [("512m", "512m"), ("2G", "2g"), ("1024", "1024"), ("1.5g", str(3 * GIB // 2))]
)
def test_docker_gets_whole_numbers_only(value: str, expected: str) -> None:
    """gVisor's tmpfs (like Linux's) reads no fraction: a fractional size becomes bytes."""
    assert docker_size("tmp_size", value) == expected


def test_a_fractional_size_reaches_docker_in_bytes(tmp_path: Path) -> None:
    kwargs = container_create_kwargs(make_spec(tmp_path, memory="1.5g", tmp_size="0.5g"))
    assert kwargs["mem_limit"] == kwargs["memswap_limit"] == str(3 * GIB // 2)
    assert f"size={GIB // 2}" in kwargs["tmpfs"]["/tmp"].split(",")


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (300, 300.0),
        (2.5, 2.5),
        (0, 0.0),
        ("300", 300.0),
        ("0", 0.0),
        ("90s", 90.0),
        ("5m", 300.0),
        ("5M", 300.0),
        ("2h", 7200.0),
        ("1.5h", 5400.0),
        ("0.5s", 0.5),
        ("7d", 604800.0),
        (" 5m ", 300.0),
    ],
)
def test_duration_seconds(value: float | str, seconds: float) -> None:
    assert duration_seconds("exec_timeout", value) == seconds


@pytest.mark.parametrize(
    "value",
    [
        "5 minutes",
        "-1s",
        -1,
        -0.5,
        "",
        "5 m",
        "5mins",
        "1w",
        "1e3",
        "1:30",
        "m",
        True,
        None,
        math.inf,
        math.nan,
    ],
)
def test_duration_seconds_rejects_non_durations_naming_key_value_and_forms(value: object) -> None:
    with pytest.raises(ConfigurationError) as info:
        duration_seconds("exec_timeout", value)
    message = str(info.value)
    assert message.startswith(f"exec_timeout={value!r} is not a duration; ")
    assert "'90s', '5m', '1.5h' or '1d'" in message


# ---------------------------------------------------------------- the settings' traits

SECONDS = (
    "exec_timeout",
    "approval_timeout",
    "max_exec_timeout",
    "exec_kill_grace",
    "idle_timeout",
    "max_idle_timeout",
    "pause_after",
    "max_pause_after",
    "freeze_idle_after",
    "max_freeze_idle_after",
    "persistent_ttl",
    "max_persistent_ttl",
    "startup_timeout",
)
SIZES = (
    "memory",
    "max_memory",
    "tmp_size",
    "max_tmp_size",
    "file_size",
    "max_file_size",
    "output_limit",
    "max_pool_memory",
    "checkpoint_budget",
)


def test_every_duration_and_size_setting_is_declared_as_one() -> None:
    """A new seconds-valued setting must be a Duration: only the CPU amounts are floats."""
    traits = SandboxSettings.class_traits()
    assert {name for name, trait in traits.items() if isinstance(trait, Duration)} == set(SECONDS)
    assert {name for name, trait in traits.items() if isinstance(trait, Size)} == set(SIZES)
    assert {name for name, trait in traits.items() if isinstance(trait, Float)} == {"cpus", "max_cpus"}


@pytest.mark.parametrize("name", SECONDS)
@pytest.mark.parametrize(("value", "seconds"), [("5m", 300.0), ("1.5h", 5400.0), (90, 90.0), ("120", 120.0)])
def test_every_duration_takes_seconds_or_a_unit_and_reads_as_float_seconds(
    name: str, value: float | str, seconds: float
) -> None:
    assert getattr(SandboxSettings(**{name: value}), name) == seconds  # as a kernelspec sets it
    config = Config({"SandboxSettings": {name: value}})  # as the server's config sets it
    read = getattr(SandboxSettings(config=config), name)
    assert read == seconds
    assert isinstance(read, float)


def test_a_duration_from_the_command_line_is_parsed_too() -> None:
    trait = SandboxSettings.class_traits()["exec_timeout"]
    assert SandboxSettings(exec_timeout=trait.from_string("5m")).exec_timeout == 300.0


@pytest.mark.parametrize("name", SECONDS)
@pytest.mark.parametrize("value", ["5 minutes", "-1s", -1])
def test_a_bad_duration_is_a_trait_error_naming_key_value_and_forms(name: str, value: object) -> None:
    with pytest.raises(TraitError) as info:
        SandboxSettings(**{name: value})
    assert str(info.value).startswith(f"{name}={value!r} is not a duration; use a number of seconds")


@pytest.mark.parametrize("name", SECONDS)
def test_a_duration_over_a_week_is_refused(name: str) -> None:
    with pytest.raises(TraitError, match=rf"{name}=691200.0 is out of range; .*at most a week"):
        SandboxSettings(**{name: "8d"})


@pytest.mark.parametrize("name", SIZES)
@pytest.mark.parametrize(
    ("value", "kept"), [("1.5g", "1.5g"), ("0.5G", "0.5g"), ("2G", "2g"), (2 * GIB, str(2 * GIB))]
)
def test_every_size_takes_decimals_and_bytes_and_keeps_the_form_given(
    name: str, value: str | int, kept: str
) -> None:
    assert getattr(SandboxSettings(**{name: value}), name) == kept


@pytest.mark.parametrize("name", SIZES)
def test_a_bad_size_is_a_trait_error_naming_the_setting(name: str) -> None:
    with pytest.raises(TraitError, match=rf"{name}='5 gigs' is not a size; use a whole number of bytes"):
        SandboxSettings(**{name: "5 gigs"})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"pids": 0}, "pids=0 is too low"),
        ({"max_pids": 0}, "max_pids=0 is too low"),
        ({"cpus": 0}, "cpus=0.0 is out of range"),
        ({"max_cpus": 0}, "max_cpus=0.0 is out of range"),
        ({"max_cpus": -1}, "max_cpus=-1.0 is out of range"),
        ({"memory": "64m"}, "memory='64m' is too little memory"),
        ({"max_memory": "100m"}, "max_memory='100m' is too little memory"),
        ({"startup_timeout": 0}, "startup_timeout=0.0 is out of range"),
        ({"audit_log_max_bytes": 0}, "audit_log_max_bytes=0 would stop the audit log from rotating"),
        ({"audit_log_backups": 0}, "audit_log_backups=0 would stop the audit log from rotating"),
    ],
)
def test_a_zero_that_would_mean_something_else_is_refused(values: dict[str, object], message: str) -> None:
    with pytest.raises(TraitError, match=message):
        SandboxSettings(**values)


def test_the_smallest_memory_is_allowed() -> None:
    assert SandboxSettings(memory="128m").memory == "128m"


def test_ceilings_compare_durations_and_sizes_in_their_units() -> None:
    check_ceilings(settings(exec_timeout="1m", max_exec_timeout="60", memory="1.5g", max_memory="1536m"), {})
    with pytest.raises(
        ConfigurationError, match=r"exec_timeout=120.0 \(120 s\) exceeds the server's ceiling of 60 s"
    ):
        check_ceilings(settings(exec_timeout="2m", max_exec_timeout="1m"), {})
    with pytest.raises(ConfigurationError, match=r"memory='1.5g' exceeds the server's ceiling of '1g'"):
        check_ceilings(settings(memory="1.5g", max_memory="1g"), {})


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
    ceilings |= {"allowed_images", "allowed_workspace_roots"}
    assert bounded == ceilings
    for name, trait in traits.items():
        if "ceiling" in trait.metadata:
            assert trait.metadata["bound"] in (
                "amount",
                "size",
                "timeout",
                "lifetime",
                "names",
                "domains",
                "credentials",
                "images",
                "roots",
            ), name
            assert trait.metadata.get("kernelspec"), (
                f"{name}: only what a kernelspec may choose needs a ceiling"
            )
    assert "ceiling" not in traits["max_pool_memory"].metadata  # a budget for the whole server
