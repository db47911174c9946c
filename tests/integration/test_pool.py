"""The warm pool: kernels claimed from sandboxes started ahead, as programs and servers use it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import docker
import pytest
from jupyter_client import KernelManager
from jupyter_client.blocking.client import BlockingKernelClient

from sandbox_kernel import SandboxPool, warm_pool
from sandbox_kernel.backends.docker import DockerBackend
from sandbox_kernel.host.cgroups import cpu_seconds
from sandbox_kernel.host.mounts import mounts_under
from sandbox_kernel.lifecycle.ownership import OrphanReaper
from sandbox_kernel.plan.sandbox_spec import LABEL_KERNELSPEC, LABEL_POOL

from .conftest import KERNEL, SANDBOX_UID, KernelStarter, make_workspace, run, run_ok
from .test_jupyter_server import execute_over_websocket, start_server, stop_server

POOLED = "sandboxed-python-pooled"
JUPYTER = str(Path(sys.executable).with_name("jupyter"))


@pytest.fixture
def pool() -> Iterator[SandboxPool]:
    """The process's pool, emptied after the test."""
    pool = SandboxPool.instance()
    yield pool
    pool.drain()


@pytest.fixture
def pooled(make_kernelspec: Callable[..., str]) -> str:
    return make_kernelspec(POOLED, config={"pool_size": 2}, display_name="Sandboxed Python (pooled)")


@pytest.fixture
def no_reaper_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test process's own orphan reaper (it runs while the process has kernels) would
    race the `list` and `prune` under test for the orphans of a program the test kills."""

    async def reap(self: OrphanReaper) -> list[object]:
        return []

    monkeypatch.setattr(OrphanReaper, "reap", reap)


def waiting(client: docker.DockerClient, kernelspec: str = POOLED) -> dict[str, str]:
    """Pooled sandboxes no kernel has claimed: id -> name."""
    found = client.containers.list(
        all=True, ignore_removed=True, filters={"label": [LABEL_POOL, f"{LABEL_KERNELSPEC}={kernelspec}"]}
    )
    return {c.id: c.name for c in found if c.name.startswith("sandbox-kernel-pool-")}


def ready_in_pool(kernelspec: str = POOLED) -> list[str]:
    """Container ids of pooled sandboxes ready to be claimed, as `list` shows them."""
    return [str(row["container_id"]) for row in listed(kernelspec) if row["status"] == "pooled"]


def listed(kernelspec: str = POOLED) -> list[dict[str, object]]:
    """``jupyter sandbox-kernel list --json`` rows of one kernelspec."""
    out = subprocess.run(
        [JUPYTER, "sandbox-kernel", "list", "--json"], capture_output=True, text=True, check=True, timeout=120
    )
    return [row for row in json.loads(out.stdout) if row["kernelspec"] == kernelspec]


def test_a_pooled_kernel_works_in_its_notebook_folder_and_restarts_there(
    start_kernel: KernelStarter,
    pooled: str,
    pool: SandboxPool,
    workspace: Path,
    docker_client: docker.DockerClient,
) -> None:
    assert warm_pool(pooled, cwd=workspace) == 2
    ready = waiting(docker_client)
    assert len(ready) == 2
    assert {row["status"] for row in listed()} == {"pooled"}
    # Waiting costs no CPU: the sandboxes are frozen (an idle gVisor sandbox is not idle).
    pids = [docker_client.containers.get(c).attrs["State"]["Pid"] for c in ready]
    before = [cpu_seconds(pid) for pid in pids]
    time.sleep(3)
    used = [(cpu_seconds(pid) or 0.0) - (then or 0.0) for pid, then in zip(pids, before, strict=True)]
    assert all(seconds < 0.005 for seconds in used), used

    km, kc = start_kernel(pooled)
    assert km.provisioner.from_pool
    assert km.provisioner.container_id in ready
    out = run_ok(
        kc,
        "import os; print(os.uname().release, os.getcwd(), os.getuid(), os.listdir('/workspace'))\n"
        "open('result.csv', 'w').write('x,1')",
    )
    assert out.split() == ["4.4.0", "/workspace/workspace", str(SANDBOX_UID), "['workspace']"]
    result = workspace / "result.csv"
    assert result.read_text() == "x,1"
    assert result.stat().st_uid == SANDBOX_UID, "owned as a cold start's files are"
    deadline = time.monotonic() + 10  # renamed in the background
    while docker_client.containers.get(km.provisioner.container_id).name != f"sandbox-kernel-{km.kernel_id}":
        assert time.monotonic() < deadline, "the claimed sandbox is named after its kernel"
        time.sleep(0.1)
    rows = {row["kernel_id"]: row for row in listed()}
    assert rows[km.kernel_id]["workspace"] == str(workspace)

    # A restart claims a pooled sandbox too: a fresh kernel in the same place, whose clients
    # keep their session key; the old sandbox and its folder go.
    first, folders = km.provisioner.container_id, [km.provisioner.runtime_dir]
    run_ok(kc, "before_restart = 1")
    shown = "import os; print(os.getcwd(), open('result.csv').read(), 'before_restart' in vars())"
    for _ in range(2):
        assert pool.wait_ready(pooled) == 2
        km.restart_kernel(now=True)
        kc.wait_for_ready(timeout=60)
        assert km.provisioner.from_pool
        folders.append(km.provisioner.runtime_dir)
        out = run_ok(kc, shown)
        assert out.split() == ["/workspace/workspace", "x,1", "False"]
    assert first not in {c.id for c in docker_client.containers.list(all=True)}
    assert [folder.exists() for folder in folders] == [True, False, True], "the bridge's, the claimed ones'"
    kc.stop_channels()
    km.shutdown_kernel(now=True)
    assert not any(folder.exists() for folder in folders)


def timed_restarts(km: KernelManager, kc: BlockingKernelClient, pool: SandboxPool, kernelspec: str) -> float:
    """Seconds of the slower of two restarts, each until the kernel answers again."""
    took = []
    for _ in range(2):
        pool.wait_ready(kernelspec)
        began = time.monotonic()
        km.restart_kernel()
        kc.wait_for_ready(timeout=60)
        took.append(time.monotonic() - began)
    return max(took)


def test_a_restart_takes_a_pooled_sandbox_in_a_fraction_of_a_cold_restart(
    start_kernel: KernelStarter, pooled: str, pool: SandboxPool, workspace: Path
) -> None:
    """A restart took 2.3 times a local kernel's (3.3 s against 1.4 s): all of a cold start again."""
    cold_km, cold_kc = start_kernel()
    cold = timed_restarts(cold_km, cold_kc, pool, KERNEL)
    assert not cold_km.provisioner.from_pool
    cold_kc.stop_channels()
    cold_km.shutdown_kernel(now=True)

    warm_pool(pooled, cwd=workspace)
    km, kc = start_kernel(pooled)
    pooled_restart = timed_restarts(km, kc, pool, pooled)
    assert km.provisioner.from_pool
    assert run_ok(kc, "print(6 * 7)") == "42\n"
    assert pooled_restart < cold / 2, f"pooled {pooled_restart:.2f} s, cold {cold:.2f} s"


def test_two_claims_never_share_a_sandbox_and_the_pool_refills(
    start_kernel: KernelStarter,
    pooled: str,
    pool: SandboxPool,
    workspace: Path,
    tmp_path: Path,
    docker_client: docker.DockerClient,
) -> None:
    other = make_workspace(tmp_path / "other")
    (workspace / "only-mine.txt").write_text("first notebook's file")
    warm_pool(pooled, cwd=workspace)
    first = set(waiting(docker_client))
    km1, kc1 = start_kernel(pooled)
    km2, kc2 = start_kernel(pooled, cwd=other)
    claimed = {km1.provisioner.container_id, km2.provisioner.container_id}
    assert km1.provisioner.from_pool
    assert km2.provisioner.from_pool, "another folder, same plan: also from the pool"
    assert len(claimed) == 2
    assert claimed <= first

    run_ok(kc1, "secret = 'kernel one'; open('/tmp/mine', 'w').write(secret)")
    out = run_ok(
        kc2,
        "import os; print(os.path.exists('/tmp/mine'), 'secret' in globals(), os.getcwd(), "
        "os.listdir('/workspace'), os.listdir('.'))",
    )
    assert out.strip().split(maxsplit=3) == ["False", "False", "/workspace/other", "['other'] []"]

    assert pool.wait_ready(pooled) == 2
    refilled = set(waiting(docker_client))
    assert len(refilled) == 2
    assert refilled.isdisjoint(claimed), "a claimed sandbox never returns to the pool"


def test_docker_stopping_a_waiting_frozen_sandbox_is_not_held_up(
    pooled: str, pool: SandboxPool, workspace: Path, docker_client: docker.DockerClient
) -> None:
    """A waiting sandbox is frozen; `docker stop` of it (what a daemon restart does to
    every container) would wait as long as it stays so: the pool sees the kill waiting,
    thaws it and lets it go."""
    assert warm_pool(pooled, cwd=workspace) == 2
    doomed, kept = waiting(docker_client)
    started = time.monotonic()
    subprocess.run(["docker", "stop", "-t", "1", doomed], check=True, timeout=60)
    took = time.monotonic() - started
    # Held up, it waits for the 60 s timeout above; a busy machine's stop is a few seconds.
    assert took < 45, f"docker stop of a waiting sandbox took {took:.1f} s"
    deadline = time.monotonic() + 30
    while pool.ready(pooled) > 1:
        assert time.monotonic() < deadline, "the stopped sandbox is still in the pool"
        time.sleep(0.1)
    assert kept in waiting(docker_client)


def test_a_kernelspec_without_a_pool_starts_cold_at_workspace(start_kernel: KernelStarter) -> None:
    km, kc = start_kernel()
    assert not km.provisioner.from_pool
    assert run_ok(kc, "import os; print(os.getcwd())").strip() == "/workspace"


PROGRAM = """
import os, sys, time
from jupyter_client.manager import KernelManager
import sandbox_kernel

workspace = sys.argv[1]
print(sandbox_kernel.warm_pool({kernelspec!r}, cwd=workspace), flush=True)
if sys.argv[2] == "claim":
    km = KernelManager(kernel_name={kernelspec!r})
    km.start_kernel(cwd=workspace)
    kc = km.client(); kc.start_channels(); kc.wait_for_ready(timeout=60)
    kc.execute_interactive("_ = open('kept.txt', 'w').write('mine')", timeout=60)
    print(km.kernel_id, km.provisioner.from_pool, flush=True)
if sys.argv[2] == "claim-and-end":  # as the README's example: claim, use, shut down, end
    km = KernelManager(kernel_name={kernelspec!r})
    km.start_kernel(cwd=workspace)
    print(km.provisioner.from_pool, flush=True)
    km.shutdown_kernel()
    sys.exit()  # while the pool refills
sys.stdin.read()  # until the test closes stdin (a clean exit) or kills us
"""


def run_program(workspace: Path, mode: str) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PROGRAM.format(kernelspec=POOLED)), str(workspace), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines = [proc.stdout.readline().strip() for _ in range(1 if mode == "warm" else 2)]
    return proc, lines


def test_a_program_that_ends_while_its_pool_refills_leaves_nothing(
    pooled: str, workspace: Path, docker_client: docker.DockerClient
) -> None:
    """The README's example ends right after its kernel: the sandbox the pool was starting
    to replace the claimed one is removed too, quietly."""
    proc, lines = run_program(workspace, "claim-and-end")
    assert lines == ["2", "True"]
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert "Traceback" not in stderr, stderr
    assert waiting(docker_client) == {}
    assert listed() == []


@pytest.mark.usefixtures("no_reaper_here")
def test_pooled_sandboxes_go_with_their_program_even_when_it_is_killed(
    pooled: str, workspace: Path, docker_client: docker.DockerClient
) -> None:
    # A clean exit removes the waiting sandboxes.
    proc, lines = run_program(workspace, "warm")
    assert lines == ["2"]
    assert len(waiting(docker_client)) == 2
    proc.communicate(timeout=60)
    assert waiting(docker_client) == {}

    # SIGKILL: a claimed kernel (its workspace mounted into its sandbox) and the
    # refilled pool are left; they are orphans, and pruning them keeps the user's files.
    proc, lines = run_program(workspace, "claim")
    kernel_id, from_pool = lines[1].split()
    assert from_pool == "True"
    deadline = time.monotonic() + 60
    while len(waiting(docker_client)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    orphans = listed()
    statuses = {row["kernel_id"] or "-": row["status"] for row in orphans}
    assert statuses == {kernel_id: "orphaned", "-": "orphaned"}
    folders = {Path(str(row["runtime_dir"])).parent for row in orphans}
    assert len(folders) == 3
    pruned = subprocess.run([JUPYTER, "sandbox-kernel", "prune"], capture_output=True, text=True, check=True)
    assert "3 kernel(s) removed" in pruned.stdout
    assert listed() == []
    assert (workspace / "kept.txt").read_text() == "mine", "the workspace survives its kernel's removal"
    assert [folder for folder in folders if folder.exists()] == [], pruned.stderr
    assert [p for folder in folders for p in mounts_under(folder)] == [], pruned.stderr


@pytest.mark.usefixtures("no_reaper_here")
def test_a_program_killed_while_its_pool_waits_leaves_sandboxes_prune_removes(
    pooled: str, workspace: Path, docker_client: docker.DockerClient
) -> None:
    """Waiting sandboxes are frozen; a SIGKILL leaves them so. `list` and `prune` must
    still answer (Docker hangs on a frozen gVisor sandbox) and remove them."""
    proc, lines = run_program(workspace, "warm")
    assert lines == ["2"]
    first, second = waiting(docker_client)
    folders = {Path(str(row["runtime_dir"])).parent for row in listed()}
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    rows = listed()
    assert sorted(str(row["container_id"]) for row in rows) == sorted([first, second])
    assert {row["status"] for row in rows} == {"orphaned"}
    # Removing one by its id alone, as any cleanup may (Docker's kill of a frozen gVisor
    # sandbox would wait for ever, and hold up every later Docker call on it).
    asyncio.run(asyncio.wait_for(DockerBackend().remove(first), 30))
    pruned = subprocess.run(
        [JUPYTER, "sandbox-kernel", "prune"], capture_output=True, text=True, check=True, timeout=120
    )
    assert "1 kernel(s) removed" in pruned.stdout
    assert waiting(docker_client) == {}
    assert [folder for folder in folders if folder.exists()] == [], pruned.stderr


async def test_pooled_kernels_under_jupyter_server(
    jupyter_dirs: Path,
    tmp_path: Path,
    make_kernelspec: Callable[..., str],
    docker_client: docker.DockerClient,
) -> None:
    make_kernelspec(POOLED, config={"pool_size": 1})
    root = make_workspace(tmp_path / "notebooks")
    folder = make_workspace(root / "project")
    config_dir = Path(os.environ["JUPYTER_CONFIG_DIR"])
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "jupyter_server_config.py").write_text(
        'c.ServerApp.kernel_manager_class = "sandbox_kernel.server.SandboxMappingKernelManager"\n'
    )
    server, proc = start_server(root, tmp_path / "server.log")
    try:
        deadline = time.monotonic() + 60
        while not ready_in_pool() and time.monotonic() < deadline:
            time.sleep(0.2)
        ready = ready_in_pool()
        assert len(ready) == 1, "the server fills the pool when it starts"
        session = server.api(
            "POST",
            "/api/sessions",
            json={"path": "project/analysis.ipynb", "type": "notebook", "kernel": {"name": POOLED}},
        ).json()
        kernel_id = session["kernel"]["id"]
        status, out = await execute_over_websocket(
            server, kernel_id, "import os; print(os.getcwd()); open('from-lab.txt', 'w').write('saved')"
        )
        # The server's root is the workspace (a pooled one under /workspace/<its name>).
        assert (status, out) == ("ok", f"/workspace/{root.name}/project\n")
        assert (folder / "from-lab.txt").read_text() == "saved"
        claimed = docker_client.containers.get(f"sandbox-kernel-{kernel_id}")
        assert claimed.id in ready
    finally:
        stop_server(proc)
    assert waiting(docker_client) == {}
    assert listed() == []


def test_the_ptrace_runtime_keeps_an_idle_kernel_idle(
    start_kernel: KernelStarter, monkeypatch: pytest.MonkeyPatch, docker_client: docker.DockerClient
) -> None:
    """The second runtime setup registers: the same sandbox, on gVisor's ptrace platform,
    whose idle sandbox has no polling loop (systrap's costs a container running only
    `sleep` 4-6 % of a core in runsc 20240729).

    An idle kernel on ptrace costs what its own wake-ups do: 0.5-0.7 % of a core with no
    client connected on a quiet day (1.1-1.4 % with one, whose heartbeat wakes it every
    second), and more on a slow day of the same machine kind. So it is measured beside the
    same kernel on systrap, over the same seconds: a polling loop like systrap's would
    cost as much (a runsc whose systrap parks its loop, release-20260622.0 on, costs
    both next to nothing)."""
    kernels = {}
    for runtime in ("runsc-sandbox-kernel-ptrace", "runsc-sandbox-kernel"):
        monkeypatch.setenv("SANDBOX_KERNEL_RUNTIME", runtime)
        km, kc = start_kernel()
        assert run_ok(kc, "import os; print(os.uname().release)").strip() == "4.4.0"
        container = docker_client.containers.get(km.provisioner.container_id)
        assert container.attrs["HostConfig"]["Runtime"] == runtime
        kernels[runtime] = (km, kc, container.attrs["State"]["Pid"])
    for _, kc, _ in kernels.values():
        run_ok(kc, "pass")  # (both quiet from now: neither freezes before 30 s)
        kc.stop_channels()  # (no heartbeats)
    time.sleep(2)
    before = {runtime: cpu_seconds(pid) for runtime, (_, _, pid) in kernels.items()}
    time.sleep(10)
    used = {runtime: cpu_seconds(pid) for runtime, (_, _, pid) in kernels.items()}
    assert not any(km.provisioner.watchdog.freezer.frozen for km, _, _ in kernels.values())
    ptrace, systrap = (
        ((used[runtime] or 0.0) - (before[runtime] or 0.0)) / 10
        for runtime in ("runsc-sandbox-kernel-ptrace", "runsc-sandbox-kernel")
    )
    assert None not in [*before.values(), *used.values()], "the sandboxes' host cgroups were not found"
    assert ptrace < 0.02 or ptrace < systrap / 2, (
        f"idle, a kernel used {ptrace:.2%} of a core on ptrace, {systrap:.2%} on systrap"
    )


@pytest.fixture
def start_narrowed(workspace: Path) -> Iterator[Callable[..., tuple[KernelManager, BlockingKernelClient]]]:
    """Start kernels with start_kernel(...) arguments of their own (a narrowed policy,
    sandbox_env), as the session API does; each shut down afterwards."""
    started: list[tuple[KernelManager, BlockingKernelClient]] = []

    def start(kernel_name: str, **start_kwargs: object) -> tuple[KernelManager, BlockingKernelClient]:
        km = KernelManager(kernel_name=kernel_name)
        km.start_kernel(cwd=str(workspace), env=dict(os.environ), **start_kwargs)
        kc = km.client()
        started.append((km, kc))
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        return km, kc

    yield start
    for km, kc in started:
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)


def host_cgroup(km: KernelManager, controller: str, name: str) -> str:
    container = docker.from_env().containers.get(km.provisioner.container_id)
    return Path(f"/sys/fs/cgroup/{controller}/docker/{container.id}/{name}").read_text().strip()


def test_a_narrowed_start_claims_from_the_pool_and_its_limits_hold(
    make_kernelspec: Callable[..., str],
    pool: SandboxPool,
    workspace: Path,
    start_narrowed: Callable[..., tuple[KernelManager, BlockingKernelClient]],
) -> None:
    """What an assistant asks per conversation (less memory, CPU and processes) comes
    from the pool: the sandbox's host cgroup and its processes' limits are the start's."""
    name = make_kernelspec(POOLED, config={"pool_size": 1})
    assert warm_pool(name, cwd=workspace) == 1
    km, kc = start_narrowed(name, memory="512m", cpus=0.5, pids=64, file_size="64m")
    assert km.provisioner.from_pool
    assert host_cgroup(km, "memory", "memory.limit_in_bytes") == str(512 * 2**20)
    assert host_cgroup(km, "memory", "memory.memsw.limit_in_bytes") == str(512 * 2**20)
    assert host_cgroup(km, "cpu", "cpu.cfs_quota_us") == "50000"
    sk = Path(sys.executable).with_name("jupyter-sandbox-kernel")
    listing = subprocess.run(
        [str(sk), "list", "--json"], capture_output=True, text=True, timeout=60, check=True
    )
    (row,) = [row for row in json.loads(listing.stdout) if row["kernel_id"] == km.kernel_id]
    assert row["memory_limit"] == 512 * 2**20, "list shows the narrowed limit, not the pool's"
    out = run_ok(
        kc,
        "import json, os, resource\n"
        "policy = json.loads(os.environ['SANDBOX_KERNEL_POLICY'])\n"
        "pids = [int(p) for p in os.listdir('/proc') if p.isdigit()]\n"
        "print(policy['memory'], policy['cpus'], policy['pids'],\n"
        "      {resource.prlimit(p, resource.RLIMIT_NPROC) for p in pids},\n"
        "      {resource.prlimit(p, resource.RLIMIT_FSIZE)[1] for p in pids})",
    )
    assert out.strip().split(maxsplit=3) == ["512m", "0.5", "64", f"{{(64, 64)}} {{{64 * 2**20}}}"]
    # A file above file_size fails as a cold start's would.
    assert "File too large" in run_ok(
        kc, "try:\n    open('/tmp/big', 'wb').write(b'x' * (65 << 20))\nexcept OSError as e:\n    print(e)"
    )
    # CPU: two spinning threads get half a core of the host, not two.
    pid = docker.from_env().containers.get(km.provisioner.container_id).attrs["State"]["Pid"]
    spin = (
        "import threading, time\ndef spin():\n    end = time.time() + 4\n    while time.time() < end: pass\n"
    )
    kc.execute(spin + "ts = [threading.Thread(target=spin) for _ in range(2)]\n[t.start() for t in ts]")
    time.sleep(1)
    before = cpu_seconds(pid) or 0.0
    time.sleep(2)
    used = ((cpu_seconds(pid) or 0.0) - before) / 2
    assert used < 0.6, f"a kernel narrowed to 0.5 CPUs used {used:.2f} of a core"
    run_ok(kc, "[t.join() for t in ts]")
    # Memory: 1 GiB is out of reach; the cell is stopped (MemoryError) or, for allocations
    # in large C calls, the sandbox at its narrowed limit, as a 512m kernel's (see docs).
    result = run(kc, "held = []\nfor _ in range(16):\n    held.append(bytearray(64 << 20))")
    assert result.status == "error"
    if result.reply["content"]["ename"] == "MemoryError":
        assert int(run_ok(kc, "print(len(held))")) < 8
    else:
        assert km.provisioner.limit_stop is not None
        assert "memory limit 512m exceeded" in km.provisioner.limit_stop.reason


def test_no_network_narrowed_onto_an_allowlist_pool_reaches_nothing(
    make_kernelspec: Callable[..., str],
    pool: SandboxPool,
    workspace: Path,
    start_narrowed: Callable[..., tuple[KernelManager, BlockingKernelClient]],
) -> None:
    config_dir = Path(os.environ["JUPYTER_CONFIG_DIR"])
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "jupyter_server_config.py").write_text(
        "c.SandboxProvisioner.max_allowed_domains = ['pypi.org']\n"
    )
    config = {"pool_size": 1, "network": "allowlist", "allowed_domains": ["pypi.org"]}
    name = make_kernelspec(POOLED, config=config)
    assert warm_pool(name, cwd=workspace) == 1
    km, kc = start_narrowed(name, network="none")
    assert km.provisioner.from_pool
    assert km.provisioner.egress.policy is None
    assert not km.provisioner.egress.registered
    out = run_ok(
        kc,
        "import json, os, socket, urllib.request\n"
        "print(json.loads(os.environ['SANDBOX_KERNEL_POLICY'])['network'],\n"
        "      sorted(k for k in os.environ if 'proxy' in k.lower() or k == 'SSL_CERT_FILE'))\n"
        "for attempt in (lambda: urllib.request.urlopen('https://pypi.org/simple/', timeout=5),\n"
        "                lambda: urllib.request.build_opener(urllib.request.ProxyHandler(\n"
        "                    {'https': 'http://127.0.0.1:3128'})\n"
        "                ).open('https://pypi.org/simple/', timeout=5),\n"
        "                lambda: socket.create_connection(('151.101.0.223', 443), timeout=5)):\n"
        "    try:\n"
        "        attempt(); print('REACHED')\n"
        "    except OSError as e:\n"
        "        print('refused')",
        timeout=120,
    )
    assert out.split("\n")[0] == "none []"
    assert "REACHED" not in out
    assert out.count("refused") == 3


def test_a_start_with_its_own_env_claims_and_its_variables_reach_the_kernel_and_children(
    pooled: str,
    pool: SandboxPool,
    workspace: Path,
    start_narrowed: Callable[..., tuple[KernelManager, BlockingKernelClient]],
) -> None:
    """Variables given at the claim, filtered as a cold start's are: what the sandbox fixes
    (HOME), its policy and sandbox-kernel's own stay the host's, JPY_PARENT_PID never passes."""
    warm_pool(pooled, cwd=workspace)
    km, kc = start_narrowed(
        pooled,
        sandbox_env={
            "ASSISTANT_RUN": "conversation-7",
            "HOME": "/workspace",
            "SANDBOX_KERNEL_POLICY": '{"memory": "64g"}',
            "SANDBOX_KERNEL_CLAIM": "/tmp/x",
            "JPY_PARENT_PID": "1",
        },
    )
    assert km.provisioner.from_pool
    out = run_ok(
        kc,
        "import json, os\n"
        "policy = json.loads(os.environ['SANDBOX_KERNEL_POLICY'])\n"
        "print(os.environ['ASSISTANT_RUN'], os.environ['HOME'], policy['memory'],\n"
        "      'SANDBOX_KERNEL_CLAIM' in os.environ, 'JPY_PARENT_PID' in os.environ)\n"
        "!env | grep -E '^(ASSISTANT_RUN|HOME)='",
    )
    lines = [line.strip() for line in out.splitlines()]
    assert lines[0] == "conversation-7 /tmp 2g False False"
    assert sorted(lines[1:3]) == ["ASSISTANT_RUN=conversation-7", "HOME=/tmp"]


def test_a_start_the_pool_cannot_serve_starts_cold_and_says_why(
    pooled: str,
    pool: SandboxPool,
    workspace: Path,
    start_narrowed: Callable[..., tuple[KernelManager, BlockingKernelClient]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A smaller /tmp (gVisor keeps a running sandbox's), or a variable read as the
    sandbox starts (PYTHONPATH): cold, with one line naming the field."""
    warm_pool(pooled, cwd=workspace)
    with caplog.at_level(logging.INFO):
        km, kc = start_narrowed(pooled, tmp_size="64m")
        km2, _ = start_narrowed(pooled, sandbox_env={"PYTHONPATH": "/workspace/lib"})
    assert not km.provisioner.from_pool
    assert not km2.provisioner.from_pool
    said = [r.getMessage() for r in caplog.records if "starting cold, not from the pool" in r.getMessage()]
    assert len(said) == 2, said
    assert "tmp_size 64m differs from the pool's 256m" in said[0]
    assert "env PYTHONPATH differs from the pool's, and is read as the sandbox starts" in said[1]
    assert (
        run_ok(kc, "import os; print(os.statvfs('/tmp').f_blocks * os.statvfs('/tmp').f_frsize >> 20)")
        == "64\n"
    )
    assert pool.ready(pooled) == 2, "neither took a sandbox"
