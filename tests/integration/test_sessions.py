"""Sessions that last: workspaces that outlive containers and dockerd, persistent kernels
that outlive the process that started them, reattached through the documented API."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import docker
import pytest
from jupyter_client import KernelManager
from jupyter_client.blocking.client import BlockingKernelClient

from sandbox_kernel.errors import WorkspaceError
from sandbox_kernel.lifecycle.ownership import OWNER_FILE
from sandbox_kernel.plan.sandbox_spec import LABEL_KERNEL_ID
from sandbox_kernel.reattach import reattach_kernel_blocking

from .conftest import KernelStarter, make_workspace, run, run_ok

ROOT = Path(__file__).resolve().parents[2]
SK = Path(sys.executable).with_name("jupyter-sandbox-kernel")

#: Cell code: write 1 MiB of random bytes as results, print their digest.
WRITE_RESULTS = (
    "import hashlib, os\n"
    "data = os.urandom(2**20)\n"
    "open('results.bin', 'wb').write(data)\n"
    "print(hashlib.sha256(data).hexdigest())"
)
READ_RESULTS = "import hashlib\nprint(hashlib.sha256(open('results.bin', 'rb').read()).hexdigest())"


def _kernelspec(make_kernelspec: Callable[..., str], kind: str, prefix: str, **config: object) -> str:
    if kind == "volume":
        config["workspace_volume"] = prefix + "-{project}"
    return make_kernelspec(f"py-{kind}-{secrets.token_hex(2)}", config=config)


def _container(docker_client: docker.DockerClient, kernel_id: str) -> docker.models.containers.Container:
    (container,) = docker_client.containers.list(
        all=True, ignore_removed=True, filters={"label": f"{LABEL_KERNEL_ID}={kernel_id}"}
    )
    return container


@pytest.mark.parametrize("kind", ["folder", "volume"])
def test_results_survive_the_container_being_destroyed_from_outside(
    kind: str,
    volume_prefix: str,
    make_kernelspec: Callable[..., str],
    start_kernel: KernelStarter,
    workspace: Path,
    docker_client: docker.DockerClient,
) -> None:
    name = _kernelspec(make_kernelspec, kind, volume_prefix)
    km, kc = start_kernel(name)
    digest = run_ok(kc, WRITE_RESULTS).strip()
    _container(docker_client, km.kernel_id).remove(force=True)

    _, fresh = start_kernel(name)
    assert run_ok(fresh, READ_RESULTS).strip() == digest
    if kind == "volume":
        volume = docker_client.volumes.get(f"{volume_prefix}-{workspace.name}")
        assert volume.attrs["Labels"].get("io.sandbox-kernel.workspace-volume") == "true"
        assert not (workspace / "results.bin").exists(), "a volume workspace is not the host folder"


@pytest.mark.skipif(os.getuid() != 0, reason="restarting dockerd needs root (CI runs as root)")
def test_results_survive_a_docker_daemon_restart(
    volume_prefix: str,
    make_kernelspec: Callable[..., str],
    start_kernel: KernelStarter,
    workspace: Path,
) -> None:
    kernels = {kind: _kernelspec(make_kernelspec, kind, volume_prefix) for kind in ("folder", "volume")}
    digests = {}
    for kind, name in kernels.items():
        _, kc = start_kernel(name)
        digests[kind] = run_ok(kc, WRITE_RESULTS).strip()

    subprocess.run(["bash", str(ROOT / ".ci/dockerd"), "restart"], check=True, timeout=180)

    for kind, name in kernels.items():
        _, kc = start_kernel(name)
        assert run_ok(kc, READ_RESULTS).strip() == digests[kind], kind


def test_the_volume_name_follows_the_template_per_user_and_notebook(
    volume_prefix: str,
    make_kernelspec: Callable[..., str],
    start_kernel: KernelStarter,
    tmp_path: Path,
    docker_client: docker.DockerClient,
) -> None:
    name = make_kernelspec(
        "py-per-notebook", config={"workspace_volume": volume_prefix + "-{user}-{notebook}"}
    )
    folder = make_workspace(tmp_path / "team")
    env = {**os.environ, "JPY_SESSION_NAME": "team/Sales Q3.ipynb"}
    _, kc = start_kernel(name, cwd=folder, env=env)
    run_ok(kc, "open('note.txt', 'w').write('mine')")
    user = os.environ.get("USER") or "root"
    volume = docker_client.volumes.get(f"{volume_prefix}-{user}-team-Sales-Q3")
    assert volume.name.startswith(volume_prefix)


_OWNER_SCRIPT = """
import os, sys
from jupyter_client import KernelManager
km = KernelManager(kernel_name=sys.argv[1])
km.start_kernel(cwd=sys.argv[2])
kc = km.client()
kc.start_channels()
kc.wait_for_ready(timeout=60)
reply = kc.execute_interactive("x = 42", timeout=60)
assert reply["content"]["status"] == "ok", reply
print(km.kernel_id, flush=True)
os._exit(0)  # gone without a word: no shutdown, no cleanup
"""


def _start_and_abandon(name: str, workspace: Path, tmp_path: Path) -> str:
    """A separate program starts a kernel, sets x = 42 and exits; returns the kernel id."""
    script = tmp_path / "owner.py"
    script.write_text(_OWNER_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), name, str(workspace)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _cli(*args: str) -> str:
    done = subprocess.run([str(SK), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_persistent_kernel_outlives_its_program_and_is_reattached(
    make_kernelspec: Callable[..., str],
    workspace: Path,
    tmp_path: Path,
    docker_client: docker.DockerClient,
) -> None:
    name = make_kernelspec("py-persistent", config={"lifecycle": "persistent"})
    kernel_id = _start_and_abandon(name, workspace, tmp_path)
    container = _container(docker_client, kernel_id)
    try:
        _cli("prune")  # its program is gone, but it is persistent: it stays
        container.reload()
        assert container.status == "running"
        (listed,) = [k for k in json.loads(_cli("list", "--json")) if k["kernel_id"] == kernel_id]
        assert listed["status"] == "running, detached"
        assert listed["lifecycle"] == "persistent"
        assert listed["memory_usage"] > 10 * 2**20

        km = reattach_kernel_blocking(kernel_id[:8])
        kc: BlockingKernelClient = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        assert run_ok(kc, "print(x)").strip() == "42"
        (listed,) = [k for k in json.loads(_cli("list", "--json")) if k["kernel_id"] == kernel_id]
        assert listed["status"] == "running", "the reattaching process owns it now"
        # The reattached manager answers for a dead kernel, signed with the kernel's key.
        died = run(kc, "import os; os.kill(1, 9)")
        assert died.reply["content"]["ename"] == "KernelDied"
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        assert (
            docker_client.containers.list(
                all=True, ignore_removed=True, filters={"label": f"{LABEL_KERNEL_ID}={kernel_id}"}
            )
            == []
        )
    finally:
        if _exists(container):
            container.remove(force=True)


def _exists(container: docker.models.containers.Container) -> bool:
    try:
        container.reload()
    except docker.errors.NotFound:
        return False
    return True


def test_a_persistent_kernel_nobody_holds_expires_after_its_ttl(
    make_kernelspec: Callable[..., str],
    workspace: Path,
    tmp_path: Path,
    docker_client: docker.DockerClient,
) -> None:
    name = make_kernelspec("py-ttl", config={"lifecycle": "persistent", "persistent_ttl": 600})
    kernel_id = _start_and_abandon(name, workspace, tmp_path)
    container = _container(docker_client, kernel_id)
    runtime_dir = Path(container.labels["io.sandbox-kernel.runtime-dir"]).parent
    try:
        assert "0 kernel(s) removed" in _cli("prune")
        # Ten minutes pass: the owner last touched it 601 s ago.
        then = time.time() - 601
        os.utime(runtime_dir / OWNER_FILE, (then, then))
        (listed,) = [k for k in json.loads(_cli("list", "--json")) if k["kernel_id"] == kernel_id]
        assert listed["status"] == "expired"
        pruned = _cli("prune")
        assert (
            f"Removed kernel {kernel_id} (container {container.id[:12]}): its time-to-live ran out" in pruned
        )
        assert not _exists(container)
        assert not runtime_dir.exists()
    finally:
        if _exists(container):
            container.remove(force=True)


def test_a_kernelspec_cannot_mount_a_volume_it_did_not_make(
    volume_prefix: str,
    make_kernelspec: Callable[..., str],
    workspace: Path,
    docker_client: docker.DockerClient,
) -> None:
    """A user's kernelspec naming another service's volume (a database's, say) gets an error."""
    foreign = docker_client.volumes.create(f"{volume_prefix}-database", labels={"app": "postgres"})
    name = make_kernelspec("py-thief", config={"workspace_volume": foreign.name})
    km = KernelManager(kernel_name=name)
    with pytest.raises(WorkspaceError, match="was not made for sandbox-kernel workspaces"):
        km.start_kernel(cwd=str(workspace))
    foreign.reload()
    assert foreign.attrs["Labels"] == {"app": "postgres"}
