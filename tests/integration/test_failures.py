"""A broken setup fails at start with a clear error and leaves nothing behind."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import docker
import pytest
from jupyter_client import KernelManager

from sandbox_kernel.errors import (
    ConfigurationError,
    ImageNotFoundError,
    KernelStartupError,
    RuntimeMissingError,
    WorkspaceError,
)

from .conftest import KERNEL, HostState, KernelStarter, make_workspace, run_ok


def test_kernel_that_exits_at_once_reports_its_output(
    make_kernelspec: Callable[..., str], workspace: Path, docker_client: docker.DockerClient
) -> None:
    name = make_kernelspec(
        "broken-argv", argv=["python", "-c", "import sys; print('kernel cannot start: boom'); sys.exit(3)"]
    )
    before = HostState(docker_client)
    km = KernelManager(kernel_name=name)
    with pytest.raises(KernelStartupError, match="exit code 3") as info:
        km.start_kernel(cwd=str(workspace))
    assert "kernel cannot start: boom" in str(info.value)
    assert before.new_leftovers() == []


def test_missing_image_is_never_pulled(
    make_kernelspec: Callable[..., str], workspace: Path, docker_client: docker.DockerClient
) -> None:
    image = "sandbox-kernel/not-built:never"
    name = make_kernelspec("missing-image", config={"image": image})
    before = HostState(docker_client)
    km = KernelManager(kernel_name=name)
    with pytest.raises(ImageNotFoundError, match="jupyter sandbox-kernel build-image"):
        km.start_kernel(cwd=str(workspace))
    assert docker_client.images.list(name="sandbox-kernel/not-built") == []
    assert before.new_leftovers() == []


@pytest.mark.parametrize("runtime", ["no-such-runtime", "runc"])
def test_no_gvisor_runtime_no_fallback(
    runtime: str,
    jupyter_dirs: Path,
    workspace: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker_client: docker.DockerClient,
) -> None:
    monkeypatch.setenv("SANDBOX_KERNEL_RUNTIME", runtime)
    before = HostState(docker_client)
    km = KernelManager(kernel_name=KERNEL)
    with pytest.raises(RuntimeMissingError, match=r"daemon\.json"):
        km.start_kernel(cwd=str(workspace))
    assert before.new_leftovers() == []


# traitlets warns about the unknown keyword before the provisioner can refuse it.
@pytest.mark.filterwarnings("ignore:Passing unrecognized arguments:DeprecationWarning")
def test_unknown_kernelspec_setting_is_an_error(make_kernelspec: Callable[..., str], workspace: Path) -> None:
    name = make_kernelspec("typo", config={"memroy": "1g"})
    km = KernelManager(kernel_name=name)
    with pytest.raises(ConfigurationError, match="'memroy'"):
        km.start_kernel(cwd=str(workspace))


def test_workspace_root_maps_the_notebook_folder(
    start_kernel: KernelStarter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_workspace(tmp_path / "projects")
    notebook_dir = make_workspace(root / "team" / "analysis")
    (notebook_dir / "data.csv").write_text("x\n1\n")
    monkeypatch.setenv("SANDBOX_KERNEL_WORKSPACE_ROOT", str(root))
    _, kc = start_kernel(cwd=notebook_dir)
    out = run_ok(kc, "import os; print(os.getcwd()); print(open('data.csv').read().split()[1])")
    assert out.split() == ["/workspace/team/analysis", "1"]


def test_notebook_outside_workspace_root_is_refused(
    jupyter_dirs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker_client: docker.DockerClient
) -> None:
    root = make_workspace(tmp_path / "projects")
    elsewhere = make_workspace(tmp_path / "elsewhere")
    monkeypatch.setenv("SANDBOX_KERNEL_WORKSPACE_ROOT", str(root))
    before = HostState(docker_client)
    km = KernelManager(kernel_name=KERNEL)
    with pytest.raises(WorkspaceError, match="outside the workspace root"):
        km.start_kernel(cwd=str(elsewhere))
    assert before.new_leftovers() == []


def test_environment_is_not_inherited_by_default_start(start_kernel: KernelStarter) -> None:
    os.environ["SANDBOX_TEST_SECRET"] = "nope"
    try:
        _, kc = start_kernel(env=None)
        assert run_ok(kc, "import os; print('SANDBOX_TEST_SECRET' in os.environ)").strip() == "False"
    finally:
        del os.environ["SANDBOX_TEST_SECRET"]


def test_a_kernelspec_env_template_cannot_read_the_servers_secrets(
    start_kernel: KernelStarter, make_kernelspec: Callable[..., str]
) -> None:
    """A user's kernelspec with `"env": {"T": "${JUPYTERHUB_API_TOKEN}"}` once printed the
    server's token: templates read only what pass_env (bounded by max_pass_env) names."""
    name = make_kernelspec("templated", env={"T": "${JUPYTERHUB_API_TOKEN}", "L": "${LANG}"})
    env = {**os.environ, "JUPYTERHUB_API_TOKEN": "hub-secret-token", "LANG": "C.UTF-8"}
    _, kc = start_kernel(name, env=env)
    out = run_ok(kc, "import os; print(os.environ['T']); print(os.environ['L'])")
    assert out.split() == ["${JUPYTERHUB_API_TOKEN}", "C.UTF-8"]


def test_a_kernelspec_naming_an_image_the_server_does_not_allow_is_refused(
    make_kernelspec: Callable[..., str], workspace: Path, docker_client: docker.DockerClient
) -> None:
    """The attack: a user's kernelspec named any local image; now only allowed_images."""
    name = make_kernelspec("foreign-image", config={"image": "sandbox-kernel-base:bookworm"})
    before = HostState(docker_client)
    km = KernelManager(kernel_name=name)
    with pytest.raises(ConfigurationError, match=r"image='sandbox-kernel-base:bookworm' is not among"):
        km.start_kernel(cwd=str(workspace))
    assert before.new_leftovers() == []


@pytest.fixture
def image_with_entrypoint(docker_client: docker.DockerClient, tmp_path: Path) -> Iterator[str]:
    """An allowed image whose ENTRYPOINT marks the workspace and which declares a VOLUME."""
    tag = "sandbox-kernel/test-entrypoint:1"
    (tmp_path / "Dockerfile").write_text(
        "FROM sandbox-kernel/python:latest\n"
        'ENTRYPOINT ["sh", "-c", "touch /workspace/entrypoint-ran; exec \\"$@\\"", "--"]\n'
        "VOLUME /data\n"
    )
    docker_client.images.build(path=str(tmp_path), tag=tag, rm=True)
    yield tag
    docker_client.images.remove(tag, force=True)


def test_an_images_entrypoint_never_runs_and_its_volumes_go_with_the_kernel(
    make_kernelspec: Callable[..., str],
    image_with_entrypoint: str,
    start_kernel: KernelStarter,
    workspace: Path,
    docker_client: docker.DockerClient,
) -> None:
    """Each start of such an image used to run its ENTRYPOINT and leave an anonymous volume."""
    volumes = {v.name for v in docker_client.volumes.list()}
    km, kc = start_kernel(make_kernelspec("entrypoint-image", config={"image": image_with_entrypoint}))
    assert run_ok(kc, "import os; print(os.path.exists('/workspace/entrypoint-ran'))") == "False\n"
    km.restart_kernel(now=True)
    kc.wait_for_ready(timeout=60)
    km.shutdown_kernel(now=True)
    assert not (workspace / "entrypoint-ran").exists()
    assert {v.name for v in docker_client.volumes.list()} - volumes == set()
