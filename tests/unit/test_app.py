"""``jupyter sandbox-kernel``, run in-process: ``app.initialize([...]); app.start()``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox_kernel.app import (
    KERNEL_NAME,
    BuildImageApp,
    CheckApp,
    InstallApp,
    RunApp,
    SandboxKernelApp,
)

APPS = (SandboxKernelApp, InstallApp, BuildImageApp, CheckApp, RunApp)


@pytest.fixture(autouse=True)
def _fresh_app_singletons() -> Iterator[None]:
    """Subcommands are singletons (``instance()``); none may carry config between tests."""
    for app in APPS:
        app.clear_instance()
    yield
    for app in APPS:
        app.clear_instance()


def run(app_class: type[InstallApp] | type[SandboxKernelApp], *argv: str) -> None:
    app = app_class()
    app.initialize(list(argv))
    app.start()


def installed_spec(prefix: Path, name: str) -> dict[str, object]:
    spec: dict[str, object] = json.loads(
        (prefix / "share/jupyter/kernels" / name / "kernel.json").read_text()
    )
    return spec


def test_install_writes_the_kernelspec_with_the_given_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(InstallApp, "--prefix", str(tmp_path), "--name", "x", "--display-name", "X", "--image", "img:1")

    spec = installed_spec(tmp_path, "x")
    assert spec["display_name"] == "X"
    assert spec["language"] == "python"
    assert spec["argv"] == ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    assert spec["metadata"] == {
        "debugger": False,
        "supported_encryption": "curve",
        "kernel_provisioner": {"provisioner_name": "sandbox-provisioner", "config": {"image": "img:1"}},
    }
    assert (tmp_path / "share/jupyter/kernels/x/logo-64x64.png").is_file()
    assert "Installed kernelspec 'x' (X)" in capsys.readouterr().out


def test_install_without_an_image_leaves_the_provisioner_default(tmp_path: Path) -> None:
    run(InstallApp, "--prefix", str(tmp_path))
    spec = installed_spec(tmp_path, KERNEL_NAME)
    assert spec["display_name"] == "Sandboxed Python"
    assert spec["metadata"]["kernel_provisioner"]["config"] == {}  # type: ignore[index]


def test_install_through_the_main_command(tmp_path: Path) -> None:
    run(SandboxKernelApp, "install", "--prefix", str(tmp_path), "--name", "via-main", "--image", "img:2")
    config = installed_spec(tmp_path, "via-main")["metadata"]["kernel_provisioner"]["config"]  # type: ignore[index]
    assert config == {"image": "img:2"}


def test_install_with_user_and_prefix_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run(InstallApp, "--user", "--prefix", str(tmp_path))
    assert info.value.code == 1
    assert "choose one of --user and --prefix" in capsys.readouterr().err
    assert not (tmp_path / "share").exists()


def test_install_with_replace_overwrites(tmp_path: Path) -> None:
    run(InstallApp, "--prefix", str(tmp_path), "--name", "x", "--image", "img:1")
    run(InstallApp, "--prefix", str(tmp_path), "--name", "x", "--image", "img:2", "--replace")
    config = installed_spec(tmp_path, "x")["metadata"]["kernel_provisioner"]["config"]  # type: ignore[index]
    assert config == {"image": "img:2"}


def test_installing_twice_without_replace_fails_with_a_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(InstallApp, "--prefix", str(tmp_path), "--name", "x", "--image", "img:1")
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        run(InstallApp, "--prefix", str(tmp_path), "--name", "x", "--image", "img:2")
    assert info.value.code != 0
    assert "--replace" in capsys.readouterr().err
    config = installed_spec(tmp_path, "x")["metadata"]["kernel_provisioner"]["config"]  # type: ignore[index]
    assert config == {"image": "img:1"}


def test_no_subcommand_exits_1_listing_the_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run(SandboxKernelApp)
    assert info.value.code == 1
    captured = capsys.readouterr()
    assert "No subcommand given; choose one of: install, build-image, check, run" in captured.err
    assert "install" in captured.out


def test_install_takes_the_policy_as_options_and_specs_coexist(tmp_path: Path) -> None:
    run(
        InstallApp,
        "--prefix",
        str(tmp_path),
        "--name",
        "small",
        "--display-name",
        "Python (small)",
        "--memory",
        "512m",
        "--cpus",
        "0.5",
        "--pids",
        "64",
        "--tmp-size",
        "32m",
        "--exec-timeout",
        "120",
    )
    run(InstallApp, "--prefix", str(tmp_path), "--name", "default")
    small = installed_spec(tmp_path, "small")
    assert small["display_name"] == "Python (small)"
    assert small["metadata"]["kernel_provisioner"]["config"] == {  # type: ignore[index]
        "memory": "512m",
        "cpus": 0.5,
        "pids": 64,
        "tmp_size": "32m",
        "exec_timeout": 120.0,
    }
    assert installed_spec(tmp_path, "default")["metadata"]["kernel_provisioner"]["config"] == {}  # type: ignore[index]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--memory", "lots", "memory='lots' is not a size"),
        ("--pids", "3", "pids=3 is too low"),
        ("--cpus", "-1", "cpus=-1.0 is out of range"),
        ("--network", "bridge", "expected any of ['none', 'allowlist']"),
        ("--network", "allowlist", "network='allowlist' needs allowed_domains"),
        ("--allow-domain", "https://docs.python.org/3/", "use 'docs.python.org'"),
        ("--allow-domain", "10.0.0.1", "IP"),
        ("--file-size", "huge", "file_size='huge' is not a size"),
        ("--idle-timeout", "-5", "idle_timeout=-5.0 is out of range"),
    ],
)
def test_install_refuses_an_invalid_policy_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        run(InstallApp, "--prefix", str(tmp_path), "--name", "bad", option, value)
    assert info.value.code == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "share/jupyter/kernels/bad").exists()


def test_install_above_the_default_ceiling_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(InstallApp, "--prefix", str(tmp_path), "--name", "big", "--memory", "64g")
    assert "exceeds the server's ceiling of '4g'" in capsys.readouterr().err
    assert installed_spec(tmp_path, "big")["metadata"]["kernel_provisioner"]["config"] == {"memory": "64g"}  # type: ignore[index]


def test_install_writes_an_allowlist_spec_and_checks_the_servers_ceiling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(config_dir))
    args = (
        "--prefix",
        str(tmp_path),
        "--name",
        "docs",
        "--display-name",
        "Sandboxed Python (web: docs sites)",
    )
    run(InstallApp, *args, "--allow-domain", "docs.python.org", "--allow-domain", "*.readthedocs.io")
    assert installed_spec(tmp_path, "docs")["metadata"]["kernel_provisioner"]["config"] == {  # type: ignore[index]
        "network": "allowlist",
        "allowed_domains": ["docs.python.org", "*.readthedocs.io"],
    }
    assert (
        "exceed the server's ceiling (SandboxProvisioner.max_allowed_domains=[])" in capsys.readouterr().err
    )

    InstallApp.clear_instance()
    (config_dir / "jupyter_server_config.py").write_text(
        "c.SandboxProvisioner.max_allowed_domains = ['docs.python.org', '*.readthedocs.io']\n"
    )
    run(InstallApp, *args, "--replace", "--allow-domain", "docs.python.org", "--pass-env", "TZ")
    assert "warning" not in capsys.readouterr().err
    InstallApp.clear_instance()
    run(InstallApp, *args, "--replace", "--pass-env", "AWS_SECRET_ACCESS_KEY")
    assert "beyond the server's ceiling (SandboxProvisioner.max_pass_env" in capsys.readouterr().err


def test_install_refuses_domains_with_network_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        run(
            InstallApp,
            "--prefix",
            str(tmp_path),
            "--name",
            "x",
            "--network",
            "none",
            "--allow-domain",
            "a.org",
        )
    assert "is set but network is 'none'" in capsys.readouterr().err
    assert not (tmp_path / "share/jupyter/kernels/x").exists()
