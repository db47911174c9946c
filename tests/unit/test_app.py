"""``jupyter sandbox-kernel``, run in-process: ``app.initialize([...]); app.start()``."""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import pytest
from docker.errors import ImageNotFound
from jupyter_core.application import JupyterApp

from sandbox_kernel.cli.app import (
    DEBIAN_BASE,
    KERNEL_NAME,
    RECIPE_LABEL,
    BuildImageApp,
    CheckApp,
    InstallApp,
    ListApp,
    McpApp,
    RunApp,
    SandboxKernelApp,
    _recipe_digest,
)
from sandbox_kernel.cli.resources import data_path
from sandbox_kernel.plan.settings import DATASCIENCE_IMAGE, DEFAULT_IMAGE
from sandbox_kernel.provisioner import SandboxProvisioner

from .conftest import FakeDockerClient

APPS = (SandboxKernelApp, InstallApp, BuildImageApp, CheckApp, RunApp, ListApp, McpApp)


@pytest.fixture(autouse=True)
def _fresh_app_singletons() -> Iterator[None]:
    """Subcommands are singletons (``instance()``); none may carry config between tests."""
    for app in APPS:
        app.clear_instance()
    yield
    for app in APPS:
        app.clear_instance()


def run(app_class: type[JupyterApp], *argv: str) -> None:
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
    # Run directly (front ends that ignore provisioners): the launcher, for this kernelspec.
    assert spec["argv"] == [
        sys.executable,
        "-m",
        "sandbox_kernel.launch",
        "--kernel",
        "x",
        "-f",
        "{connection_file}",
    ]
    assert spec["metadata"] == {
        "debugger": False,
        "supported_encryption": "curve",
        "kernel_provisioner": {"provisioner_name": "sandbox-provisioner", "config": {"image": "img:1"}},
    }
    assert (tmp_path / "share/jupyter/kernels/x/logo-64x64.png").is_file()
    assert "Installed kernelspec 'x' (X)" in capsys.readouterr().out


def test_install_says_once_where_it_installed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """#23 item 14: jupyter_client's own log line said it a second time."""
    run(InstallApp, "--prefix", str(tmp_path), "--name", "once")
    captured = capsys.readouterr()
    said = captured.out + captured.err
    assert said.count("Installed kernelspec") == 1, said
    assert "which is not in" in captured.err, (
        "jupyter_client's warning of a folder Jupyter does not search stays"
    )


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


@pytest.mark.parametrize(("value", "written"), [("false", False), ("False", False), ("true", True)])
def test_install_writes_subshells_as_a_boolean(tmp_path: Path, value: str, written: bool) -> None:
    run(InstallApp, "--prefix", str(tmp_path), "--name", "quick", f"--subshells={value}")
    config = installed_spec(tmp_path, "quick")["metadata"]["kernel_provisioner"]["config"]  # type: ignore[index]
    assert config == {"subshells": written}


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
        ("--idle-timeout", "-5", "idle_timeout='-5' is not a duration"),
        ("--idle-timeout=-5s", None, "idle_timeout='-5s' is not a duration"),
        (
            "--exec-timeout",
            "5 minutes",
            "exec_timeout='5 minutes' is not a duration; use a number of seconds",
        ),
        ("--exec-timeout", "8d", "exec_timeout=691200.0 is out of range; use at most a week"),
        ("--persistent-ttl", "1w", "persistent_ttl='1w' is not a duration"),
        ("--pids", "0", "pids=0 is too low"),
        ("--pids", "lots", "expected an int, not the str 'lots'"),
        ("--cpus", "0", "cpus=0.0 is out of range"),
        ("--memory", "0", "memory='0' is not a size"),
        ("--memory", "1.5", "memory='1.5' is not a size"),
        ("--memory", "64m", "memory='64m' is too little memory"),
        ("--tmp-size", "1.5gb", "tmp_size='1.5gb' is not a size"),
        ("--image", "", "--image is empty"),
        ("--subshells", "maybe", "expected a boolean"),
    ],
)
def test_install_refuses_an_invalid_policy_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str | None, message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        run(
            InstallApp,
            "--prefix",
            str(tmp_path),
            "--name",
            "bad",
            option,
            *([] if value is None else [value]),
        )
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert message in err
    assert "Traceback" not in err
    assert not (tmp_path / "share/jupyter/kernels/bad").exists()


def test_install_takes_durations_and_decimal_sizes_and_writes_seconds(tmp_path: Path) -> None:
    run(
        InstallApp,
        "--prefix",
        str(tmp_path),
        "--name",
        "units",
        "--exec-timeout",
        "5m",
        "--idle-timeout",
        "1.5h",
        "--persistent-ttl",
        "7d",
        "--memory",
        "1.5G",
        "--tmp-size",
        "0.5g",
        "--file-size",
        "1073741824",
    )
    assert installed_spec(tmp_path, "units")["metadata"]["kernel_provisioner"]["config"] == {  # type: ignore[index]
        "exec_timeout": 300.0,
        "idle_timeout": 5400.0,
        "persistent_ttl": 604800.0,
        "memory": "1.5g",
        "tmp_size": "0.5g",
        "file_size": "1073741824",
    }


def test_install_writes_an_explicit_zero_instead_of_dropping_it(tmp_path: Path) -> None:
    """``--exec-timeout 0`` asks for no limit, even where the server's default has one."""
    run(InstallApp, "--prefix", str(tmp_path), "--name", "nolimit", "--exec-timeout", "0", "--pool-size", "0")
    config = installed_spec(tmp_path, "nolimit")["metadata"]["kernel_provisioner"]["config"]  # type: ignore[index]
    assert config == {"exec_timeout": 0.0, "pool_size": 0}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus", "3"], "error: unknown option --bogus; see `jupyter sandbox-kernel install --help`"),
        (["--bogus"], "error: unknown option --bogus;"),
        (["--bogus=3"], "error: unknown option --bogus;"),
        (["--memroy", "1g"], "error: unknown option --memroy;"),
        (["--InstallApp.memroy=1g"], "error: InstallApp has no option memroy;"),
        (
            ["extra"],
            "error: unexpected argument 'extra': `jupyter sandbox-kernel install` takes options only",
        ),
        (["--exec-timeout", "-1s"], "write --option=value"),
    ],
)
def test_install_refuses_unknown_options_and_arguments_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        run(InstallApp, "--prefix", str(tmp_path), *argv)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert message in err
    assert "usage:" not in err
    assert not (tmp_path / "share").exists()


def test_unknown_options_are_refused_through_the_main_command_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        run(SandboxKernelApp, "install", "--prefix", str(tmp_path), "--bogus", "3")
    assert info.value.code == 1
    assert "unknown option --bogus" in capsys.readouterr().err
    assert not (tmp_path / "share").exists()


@pytest.mark.parametrize("name", ["bad/name", "a b", "../up", "naïve", "", "..", ".", ".hidden"])
def test_install_refuses_a_bad_name_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    with pytest.raises(SystemExit) as info:
        run(InstallApp, "--prefix", str(tmp_path), "--name", name)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err == (
        f"error: --name {name!r} is not a kernel name: use only ASCII letters, digits, '-', '.' and '_', "
        "not starting with '.' (it names the kernelspec's folder), e.g. --name py-small\n"
    )
    assert not (tmp_path / "share").exists()


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


def test_install_recipe_datascience_installs_the_data_science_spec(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(InstallApp, "--prefix", str(tmp_path), "--recipe", "datascience")

    spec = installed_spec(tmp_path, "sandboxed-python-datascience")
    assert spec["display_name"] == "Sandboxed Python (data science)"
    assert spec["metadata"]["kernel_provisioner"] == {  # type: ignore[index]
        "provisioner_name": "sandbox-provisioner",
        "config": {"image": DATASCIENCE_IMAGE},
    }
    assert (tmp_path / "share/jupyter/kernels/sandboxed-python-datascience/logo-64x64.png").is_file()
    out = capsys.readouterr().out
    assert "Installed kernelspec 'sandboxed-python-datascience' (Sandboxed Python (data science))" in out
    assert not (tmp_path / "share/jupyter/kernels" / KERNEL_NAME).exists()


def test_install_recipe_datascience_takes_the_usual_options(tmp_path: Path) -> None:
    run(
        InstallApp,
        "--prefix",
        str(tmp_path),
        "--recipe",
        "DataScience",
        "--name",
        "ds-big",
        "--display-name",
        "Data science (big)",
        "--memory",
        "3g",
    )
    spec = installed_spec(tmp_path, "ds-big")
    assert spec["display_name"] == "Data science (big)"
    config = spec["metadata"]["kernel_provisioner"]["config"]  # type: ignore[index]
    assert config == {"image": DATASCIENCE_IMAGE, "memory": "3g"}

    InstallApp.clear_instance()
    run(InstallApp, "--prefix", str(tmp_path), "--recipe", "datascience", "--image", "ds:2", "--name", "ds2")
    config = installed_spec(tmp_path, "ds2")["metadata"]["kernel_provisioner"]["config"]  # type: ignore[index]
    assert config == {"image": "ds:2"}


def test_install_refuses_an_unknown_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run(InstallApp, "--prefix", str(tmp_path), "--recipe", "rust")
    assert info.value.code == 1
    assert "expected any of ['python', 'datascience']" in capsys.readouterr().err
    assert not (tmp_path / "share").exists()


# ---------------------------------------------------------------- build-image


@dataclass
class FakeImage:
    id: str
    labels: dict[str, str] = field(default_factory=dict)


class FakeBuildDocker:
    """The part of docker-py that build-image uses: ``images.get`` and ``api.build``.

    A build "succeeds" at once: the tag then names a new image with the build's labels.
    """

    def __init__(self, *present: str) -> None:
        self.present = {tag: FakeImage(f"sha256:{tag}") for tag in present}
        self.builds: list[dict[str, Any]] = []
        self.images = self
        self.api = self

    def get(self, tag: str) -> FakeImage:
        if tag not in self.present:
            raise ImageNotFound(f"No such image: {tag}")
        return self.present[tag]

    def build(self, **kwargs: Any) -> Iterator[dict[str, str]]:
        self.builds.append(kwargs)
        self.present[kwargs["tag"]] = FakeImage(f"sha256:build{len(self.builds)}", dict(kwargs["labels"]))
        yield {"stream": f"Step 1/1 : FROM {kwargs['buildargs'].get('BASE', 'the default BASE')}\n"}

    def built_tags(self) -> list[str]:
        return [build["tag"] for build in self.builds]


@pytest.fixture
def build_docker(monkeypatch: pytest.MonkeyPatch) -> FakeBuildDocker:
    """What ``docker.from_env()`` returns to build-image: a fake holding the Debian base."""
    fake = FakeBuildDocker(DEBIAN_BASE)
    monkeypatch.setattr(docker, "from_env", lambda: fake)
    return fake


IMAGES = data_path("images")


def test_build_image_builds_the_default_recipe_with_progress(
    build_docker: FakeBuildDocker, capsys: pytest.CaptureFixture[str]
) -> None:
    run(BuildImageApp, "--debian-base")

    (build,) = build_docker.builds
    assert build["path"] == str(IMAGES)
    assert build["tag"] == DEFAULT_IMAGE
    assert build["buildargs"] == {"BASE": DEBIAN_BASE}
    assert build["labels"] == {RECIPE_LABEL: _recipe_digest(IMAGES, "python")}
    out = capsys.readouterr().out
    assert f"==> building {DEFAULT_IMAGE} from {IMAGES / 'Dockerfile'} on {DEBIAN_BASE}" in out
    assert f"Step 1/1 : FROM {DEBIAN_BASE}" in out
    assert f"==> built {DEFAULT_IMAGE}" in out


def test_build_image_datascience_builds_the_default_image_first(
    build_docker: FakeBuildDocker, capsys: pytest.CaptureFixture[str]
) -> None:
    run(BuildImageApp, "--recipe", "datascience", "--debian-base")

    assert build_docker.built_tags() == [DEFAULT_IMAGE, DATASCIENCE_IMAGE]
    default, datascience = build_docker.builds
    assert default["buildargs"] == {"BASE": DEBIAN_BASE}
    assert datascience["path"] == str(IMAGES / "datascience")
    assert datascience["buildargs"] == {"BASE": DEFAULT_IMAGE}
    default_id = build_docker.present[DEFAULT_IMAGE].id
    assert datascience["labels"] == {RECIPE_LABEL: _recipe_digest(IMAGES, "datascience", default_id)}
    out = capsys.readouterr().out
    assert f"==> the datascience image builds on {DEFAULT_IMAGE}" in out
    assert f"==> built {DATASCIENCE_IMAGE}" in out


def test_build_image_if_missing_builds_nothing_when_both_images_are_current(
    build_docker: FakeBuildDocker, capsys: pytest.CaptureFixture[str]
) -> None:
    run(BuildImageApp, "--recipe", "datascience", "--debian-base")
    BuildImageApp.clear_instance()
    capsys.readouterr()

    run(BuildImageApp, "--recipe", "datascience", "--debian-base", "--if-missing")
    BuildImageApp.clear_instance()
    run(BuildImageApp, "--debian-base", "--if-missing")

    assert build_docker.built_tags() == [DEFAULT_IMAGE, DATASCIENCE_IMAGE]
    out = capsys.readouterr().out
    assert f"==> image {DATASCIENCE_IMAGE} already present, built from the current recipe" in out
    assert out.count(f"==> image {DEFAULT_IMAGE} already present, built from the current recipe") == 2


def test_build_image_rebuilds_the_datascience_image_on_a_new_default_image(
    build_docker: FakeBuildDocker, capsys: pytest.CaptureFixture[str]
) -> None:
    run(BuildImageApp, "--recipe", "datascience", "--debian-base")
    BuildImageApp.clear_instance()
    # The default image rebuilt from the same recipe (say with --no-cache): a new id.
    build_docker.present[DEFAULT_IMAGE].id = "sha256:rebuilt"
    capsys.readouterr()

    run(BuildImageApp, "--recipe", "datascience", "--debian-base", "--if-missing")

    assert build_docker.built_tags() == [DEFAULT_IMAGE, DATASCIENCE_IMAGE, DATASCIENCE_IMAGE]
    label = build_docker.builds[-1]["labels"][RECIPE_LABEL]
    assert label == _recipe_digest(IMAGES, "datascience", "sha256:rebuilt")
    assert (
        f"==> image {DATASCIENCE_IMAGE} was built from another recipe; rebuilding" in capsys.readouterr().out
    )


def test_build_image_refreshes_a_stale_default_image_before_the_datascience_one(
    build_docker: FakeBuildDocker,
) -> None:
    build_docker.present[DEFAULT_IMAGE] = FakeImage("sha256:old", {RECIPE_LABEL: "an-older-recipe"})
    run(BuildImageApp, "--recipe", "datascience", "--debian-base")
    assert build_docker.built_tags() == [DEFAULT_IMAGE, DATASCIENCE_IMAGE]
    assert build_docker.builds[1]["buildargs"] == {"BASE": DEFAULT_IMAGE}


def test_build_image_datascience_on_a_given_base_and_tag(build_docker: FakeBuildDocker) -> None:
    build_docker.present["my/py:3.12"] = FakeImage("sha256:mine")
    run(BuildImageApp, "--recipe", "datascience", "--base", "my/py:3.12", "--tag", "my/ds:3.12")

    (build,) = build_docker.builds
    assert (build["tag"], build["buildargs"]) == ("my/ds:3.12", {"BASE": "my/py:3.12"})
    assert build["labels"] == {RECIPE_LABEL: _recipe_digest(IMAGES, "datascience", "sha256:mine")}


def test_build_image_datascience_on_a_missing_base_names_it(
    build_docker: FakeBuildDocker, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        run(BuildImageApp, "--recipe", "datascience", "--base", "my/py:3.12")
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "the base image my/py:3.12 is not on this Docker host" in err
    assert "--base" in err
    assert build_docker.builds == []


def test_build_image_refuses_an_unknown_recipe(
    build_docker: FakeBuildDocker, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        run(BuildImageApp, "--recipe", "rust")
    assert info.value.code == 1
    assert "expected any of ['python', 'datascience']" in capsys.readouterr().err
    assert build_docker.builds == []


def test_recipe_digests_cover_each_recipe_s_own_files(tmp_path: Path) -> None:
    images = tmp_path / "images"
    shutil.copytree(IMAGES, images)
    python, datascience = _recipe_digest(images, "python"), _recipe_digest(images, "datascience", "sha256:a")
    assert python == _recipe_digest(IMAGES)
    assert datascience != _recipe_digest(images, "datascience", "sha256:b")

    # A change to the data-science recipe leaves the default image's digest alone.
    with (images / "datascience" / "Dockerfile").open("a") as dockerfile:
        dockerfile.write("# changed\n")
    assert _recipe_digest(images, "python") == python
    assert _recipe_digest(images, "datascience", "sha256:a") != datascience

    # The default recipe reaches the data-science image through its base's id, not its files.
    datascience = _recipe_digest(images, "datascience", "sha256:a")
    with (images / "Dockerfile").open("a") as dockerfile:
        dockerfile.write("# changed\n")
    assert _recipe_digest(images, "python") != python
    assert _recipe_digest(images, "datascience", "sha256:a") == datascience


def test_check_names_the_datascience_recipe_for_its_missing_image(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeDockerClient(images_present={DEFAULT_IMAGE})
    monkeypatch.setattr(docker, "from_env", lambda: fake)
    with pytest.raises(SystemExit) as info:
        run(CheckApp, "--image", DATASCIENCE_IMAGE)
    assert info.value.code == 1
    out = capsys.readouterr().out
    assert f"FAIL  kernel image {DATASCIENCE_IMAGE!r} present" in out
    assert "Build it with: jupyter sandbox-kernel build-image --recipe datascience" in out


def test_install_has_a_flag_for_every_kernelspec_setting() -> None:
    """Declared once, on the setting: adding a kernelspec key adds its install flag."""
    from sandbox_kernel.cli.app import InstallApp
    from sandbox_kernel.plan.settings import kernelspec_keys

    flagged = {target.removeprefix("InstallApp.") for target in InstallApp.aliases.values()}
    assert kernelspec_keys() <= flagged
    assert InstallApp.aliases["allow-domain"] == "InstallApp.allowed_domains"
    assert InstallApp.aliases["pool-size"] == "InstallApp.pool_size"


# ---------------------------------------------------------------- options of the other subcommands


def test_build_image_refuses_an_unknown_option_and_builds_nothing(
    build_docker: FakeBuildDocker, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        run(BuildImageApp, "--debian-base", "--no-cahce")
    assert info.value.code == 1
    assert "error: unknown option --no-cahce; see `jupyter sandbox-kernel build-image --help`" in (
        capsys.readouterr().err
    )
    assert build_docker.builds == []


def test_a_subcommand_without_arguments_refuses_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run(ListApp, "3f2a9c1e")
    assert info.value.code == 1
    assert "unexpected argument '3f2a9c1e': `jupyter sandbox-kernel list` takes options only" in (
        capsys.readouterr().err
    )


def test_run_takes_its_cell_timeout_as_a_duration() -> None:
    app = RunApp()
    app.initialize(["--timeout", "10m", "notebook.ipynb"])
    assert app.timeout == 600.0
    assert app.extra_args == ["notebook.ipynb"]


# ---------------------------------------------------------------- mcp


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What ``serve_stdio`` was called with, instead of serving on this test's stdin."""
    calls: list[dict[str, Any]] = []
    fake = types.ModuleType("sandbox_kernel.agents.mcp_server")
    fake.serve_stdio = lambda **kwargs: calls.append(kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sandbox_kernel.agents.mcp_server", fake)
    return calls


def test_mcp_without_cwd_serves_the_default_kernelspec_in_a_fresh_workspace_not_the_current_folder(
    served: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#23 item 3: the folder the client started the server in is not the workspace
    (serve_stdio makes a fresh one, see test_workspaces), unless given with --cwd."""
    run(InstallApp, "--user")
    monkeypatch.chdir(tmp_path)
    run(SandboxKernelApp, "mcp")
    run(McpApp, "--keep-workspace")
    assert [(call["kernel_name"], call["cwd"], call["keep_workspace"]) for call in served] == [
        (KERNEL_NAME, None, False),
        (KERNEL_NAME, None, True),
    ]


def test_mcp_takes_a_kernelspec_and_a_workspace(served: list[dict[str, Any]], tmp_path: Path) -> None:
    run(InstallApp, "--user", "--name", "py-small", "--memory", "512m")
    workspace = tmp_path / "analysis"
    workspace.mkdir()
    run(McpApp, "--kernel", "py-small", "--cwd", str(workspace))
    assert [(call["kernel_name"], call["cwd"]) for call in served] == [("py-small", str(workspace.resolve()))]


def test_mcp_passes_the_server_config_and_its_command_line_to_the_kernels(
    served: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The administrator's settings reach MCP's kernels: the server's config files (here
    in JUPYTER_CONFIG_DIR), then --config and --SandboxProvisioner.NAME= options."""
    run(InstallApp, "--user")
    config_dir = Path(os.environ["JUPYTER_CONFIG_DIR"])
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "jupyter_server_config.json").write_text(
        json.dumps({"SandboxProvisioner": {"max_memory": "1g", "audit_log": "/var/log/central.log"}})
    )
    extra = tmp_path / "extra_config.py"
    extra.write_text("c.SandboxProvisioner.max_exec_timeout = 60\n")
    run(McpApp, f"--config={extra}", "--SandboxProvisioner.memory=768m")
    (call,) = served
    # What the kernels' provisioner makes of it (it adds the server's config files itself).
    settings = SandboxProvisioner(config=call["config"])
    assert (settings.max_memory, settings.audit_log) == ("1g", "/var/log/central.log")
    assert (settings.max_exec_timeout, settings.memory) == (60, "768m")


@pytest.mark.parametrize("command", ["mcp", "run"])
def test_a_kernelspec_that_runs_on_the_host_is_refused_naming_it(
    served: list[dict[str, Any]], capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    """`--kernel python3` (ipykernel's own kernelspec) ran the assistant's code on the host as root."""
    notebook = tmp_path / "n.ipynb"
    notebook.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    with pytest.raises(SystemExit) as info:
        run(SandboxKernelApp, command, *([str(notebook)] if command == "run" else []), "--kernel", "python3")
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "Kernelspec 'python3' (Python 3 (ipykernel)) does not run its kernels in the sandbox" in err
    assert "would run on this host" in err
    assert served == []
    assert not (tmp_path / "n.executed.ipynb").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--kernel", "nope"],
            "error: No kernelspec named 'nope': install it with `jupyter sandbox-kernel install`",
        ),
        (["--cwd", "/no/such/folder"], "error: --cwd '/no/such/folder' is not a folder"),
        (["--kernal", "x"], "error: unknown option --kernal"),
    ],
)
def test_mcp_refuses_what_it_cannot_serve(
    served: list[dict[str, Any]], capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    run(InstallApp, "--user")
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        run(McpApp, *argv)
    assert info.value.code == 1
    assert message in capsys.readouterr().err
    assert served == []


@pytest.mark.parametrize(("missing", "detail"), [("mcp", ""), ("anyio", " (no module 'anyio')")])
def test_mcp_without_the_mcp_package_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], missing: str, detail: str
) -> None:
    monkeypatch.delitem(sys.modules, "sandbox_kernel.agents.mcp_server", raising=False)
    for name in [name for name in sys.modules if name == missing or name.startswith(f"{missing}.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)  # what an environment without it imports
    with pytest.raises(SystemExit) as info:
        run(SandboxKernelApp, "mcp")
    assert info.value.code == 1
    assert capsys.readouterr().err == (
        f"error: the MCP server needs the mcp package, which is not installed{detail}: "
        "pip install 'sandbox-kernel[mcp]'\n"
    )


def test_the_main_command_lists_mcp(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run(SandboxKernelApp)
    out = capsys.readouterr().out
    assert "mcp" in out
    assert "Serve sandboxed kernels to an AI assistant over MCP (stdio)." in out


def test_mcp_help_says_what_it_serves(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run(McpApp, "--help")
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "Serve sandboxed kernels to an AI assistant over MCP (stdio)" in out
    assert "--kernel" in out
    assert "--cwd" in out
    assert "pip install 'sandbox-kernel[mcp]'" in out


def test_docker_access_is_called_root_equivalent_for_a_server_that_is_not_root() -> None:
    """A docker-group user read root's home folder and entered a root kernel's container:
    `check` says so plainly to a non-root server."""
    from sandbox_kernel.cli.app import docker_access_warning

    assert docker_access_warning(uid=0) is None
    warning = docker_access_warning(uid=1000)
    assert warning is not None
    assert "uid 1000" in warning
    assert "root-equivalent" in warning
