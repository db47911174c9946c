"""Real kernels in real gVisor containers, driven through jupyter_client as users drive them.

These tests never skip: without Docker, the gVisor runtime or the image they fail with
the command that fixes it (`bash .ci/setup`). Deselect them explicitly with
``-m "not integration"`` on a machine that cannot run them.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import queue
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import docker
import pytest
from jupyter_client import KernelManager
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.ioloop import AsyncIOLoopKernelManager
from traitlets.config import Config

from sandbox_kernel.backends.docker import DockerBackend
from sandbox_kernel.cli.resources import data_path
from sandbox_kernel.errors import SandboxKernelError
from sandbox_kernel.host.mounts import mounts_under
from sandbox_kernel.lifecycle.ownership import list_kernels, server_identity
from sandbox_kernel.plan.sandbox_spec import LABEL_KERNEL_ID, LABEL_MANAGED
from sandbox_kernel.plan.settings import DEFAULT_IMAGE, DEFAULT_RUNTIME
from tests.executions import Execution as Execution
from tests.executions import printing as printing
from tests.executions import run as run
from tests.executions import run_ok as run_ok

KERNEL = "sandboxed-python"
SANDBOX_UID = 1000


def runsc_processes() -> set[str]:
    """``pid args`` of every runsc process (sandbox, gofer, shim) on the host."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return {line.strip() for line in out.splitlines() if "runsc" in line and "ps -eo" not in line}


def runtime_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("sandbox-kernel-*")}


def connection_files() -> set[Path]:
    """jupyter_client's temporary connection files (``tmpXXXXXXXX.json``, a kernel's key in
    each) in the temporary folder."""
    found = set()
    for path in Path(tempfile.gettempdir()).glob("tmp*.json"):
        with suppress(OSError, ValueError):
            if "signature_scheme" in json.loads(path.read_text(encoding="utf-8")):
                found.add(path)
    return found


def kernel_mounts() -> set[str]:
    """Mounts in kernels' runtime folders (a pooled kernel's workspace, its slot's parent)."""
    return {str(p) for p in mounts_under(Path(tempfile.gettempdir())) if "/sandbox-kernel-" in str(p)}


class HostState:
    """Sandbox containers, runtime folders and runsc processes at one moment.

    Comparing two snapshots (rather than expecting none at all) keeps the checks
    exact when something else on the host runs sandboxed kernels too.
    """

    def __init__(self, client: docker.DockerClient) -> None:
        self.client = client
        self.containers = self._containers()
        self.dirs = runtime_dirs()
        self.mounts = kernel_mounts()
        self.processes = runsc_processes()
        self.connection_files = connection_files()

    def _containers(self) -> set[str]:
        return {
            c.name
            for c in self.client.containers.list(
                all=True, ignore_removed=True, filters={"label": LABEL_MANAGED}
            )
        }

    def new_leftovers(self, settle: float = 10) -> list[str]:
        """What exists now but did not then; runsc processes get ``settle`` s to exit.

        What another live program holds (a second test run on this host) is not ours.
        """
        deadline = time.monotonic() + settle
        while runsc_processes() - self.processes and time.monotonic() < deadline:
            time.sleep(0.2)
        foreign = [
            kernel
            for kernel in asyncio.run(list_kernels(DockerBackend()))
            if kernel.owner != server_identity() and not kernel.owner_gone
        ]
        names = {f"sandbox-kernel-{k.kernel_id}" for k in foreign} | {k.container_id[:12] for k in foreign}
        marks = {k.container_id for k in foreign} | {Path(k.runtime_dir).parent.name for k in foreign}
        found = [f"container {c}" for c in sorted(self._containers() - self.containers - names)]
        found += [f"runtime folder {d}" for d in sorted(runtime_dirs() - self.dirs - marks)]
        found += [f"mount {m}" for m in sorted(kernel_mounts() - self.mounts) if not _marked(m, marks)]
        found += [f"process {p}" for p in sorted(runsc_processes() - self.processes) if not _marked(p, marks)]
        return found


def _marked(text: str, marks: set[str]) -> bool:
    return any(mark and mark in text for mark in marks)


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    async def check() -> None:
        api = DockerBackend()
        await api.check_runtime(DEFAULT_RUNTIME)
        await api.check_image(DEFAULT_IMAGE)

    try:
        asyncio.run(check())
    except SandboxKernelError as exc:
        pytest.fail(
            f"Integration tests need Docker with gVisor and the kernel image: {exc}\n"
            "Run `bash .ci/setup` (as root), or deselect them with -m 'not integration'.",
            pytrace=False,
        )
    client = docker.from_env()
    yield client
    client.close()


#: Which test module each container or runtime folder first outlived, to name a leak's source.
FIRST_OUTLIVED: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def _note_what_outlives_each_module(
    request: pytest.FixtureRequest, docker_client: docker.DockerClient
) -> Iterator[None]:
    """Remember the module after which a container or runtime folder still existed.

    A session-wide fixture's kernels outlive their module by design, so this only names
    suspects; the failure at the end of the run is what counts.
    """
    yield
    containers = {
        c.name
        for c in docker_client.containers.list(
            all=True, ignore_removed=True, filters={"label": LABEL_MANAGED}
        )
    }
    for thing in [f"container {c}" for c in containers] + [f"runtime folder {d}" for d in runtime_dirs()]:
        FIRST_OUTLIVED.setdefault(thing, request.node.name)


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind(docker_client: docker.DockerClient) -> Iterator[None]:
    """After the whole run: no sandbox container, runsc process or runtime folder remains."""
    before = HostState(docker_client)
    yield
    problems = [
        f"{problem} (first outlived {FIRST_OUTLIVED[problem]})" if problem in FIRST_OUTLIVED else problem
        for problem in before.new_leftovers()
    ]
    # Only what this run left: another program's live kernels (a second test run, say) stay.
    mine = {
        kernel.container_id
        for kernel in asyncio.run(list_kernels(DockerBackend()))
        if kernel.owner == server_identity() or kernel.owner_gone
    }
    for container in docker_client.containers.list(
        all=True, ignore_removed=True, filters={"label": LABEL_MANAGED}
    ):
        if container.name not in before.containers and container.id in mine:
            DockerBackend().remove_blocking(container.id)  # thawed first, if a pooled one
    # Programs the tests kill on purpose (a server SIGKILLed, a holder that os._exit()s)
    # leave jupyter_client's connection file, as any killed client does: remove this run's.
    for path in connection_files() - before.connection_files:
        path.unlink(missing_ok=True)
    if problems:
        pytest.fail("Left behind after the tests: " + "; ".join(problems), pytrace=False)


#: Each phase's report, for fixtures that keep evidence when a test fails.
REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    item.stash.setdefault(REPORTS, {})[report.when] = report
    return report


@pytest.fixture(scope="session")
def kernelspec_root(tmp_path_factory: pytest.TempPathFactory, docker_client: docker.DockerClient) -> Path:
    """A Jupyter data folder holding the shipped kernelspec and test variants of it."""
    root = tmp_path_factory.mktemp("jupyter-data")
    kernels = root / "kernels"
    kernels.mkdir()
    shutil.copytree(data_path("kernelspecs") / KERNEL, kernels / KERNEL)
    return root


@pytest.fixture
def jupyter_dirs(kernelspec_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("JUPYTER_PATH", str(kernelspec_root))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    return kernelspec_root


@pytest.fixture
def make_kernelspec(jupyter_dirs: Path) -> Callable[..., str]:
    """Write a variant of the shipped kernelspec: ``make_kernelspec("name", argv=, config=, env=)``."""
    created: list[Path] = []

    def make(
        name: str,
        argv: list[str] | None = None,
        config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        display_name: str | None = None,
    ) -> str:
        spec = json.loads((jupyter_dirs / "kernels" / KERNEL / "kernel.json").read_text())
        if display_name is not None:
            spec["display_name"] = display_name
        if argv is not None:
            spec["argv"] = argv
        if env is not None:
            spec["env"] = env
        if config is not None:
            spec["metadata"]["kernel_provisioner"]["config"] = config
        folder = jupyter_dirs / "kernels" / name
        folder.mkdir(exist_ok=True)
        (folder / "kernel.json").write_text(json.dumps(spec))
        created.append(folder)
        return name

    yield make
    for folder in created:
        shutil.rmtree(folder, ignore_errors=True)


def stop_process(process: subprocess.Popen[Any], timeout: float = 60) -> None:
    """Stop a server the test started as a service manager would (SIGTERM), and SIGKILL it
    if it has not ended within ``timeout`` seconds."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def make_workspace(path: Path) -> Path:
    """A folder the sandbox's uid can write to, as a notebook folder would be."""
    path.mkdir(parents=True, exist_ok=True)
    if os.getuid() == 0:
        os.chown(path, SANDBOX_UID, SANDBOX_UID)
    return path


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    return make_workspace(tmp_path / "workspace")


@pytest.fixture
def volume_prefix(docker_client: docker.DockerClient) -> Iterator[str]:
    """A unique prefix for this test's workspace volumes; they are removed afterwards."""
    prefix = f"sk-test-{secrets.token_hex(4)}"
    yield prefix
    for volume in docker_client.volumes.list():
        if volume.name.startswith(prefix):
            # Kernels still running on it (a failed test) go first.
            for container in docker_client.containers.list(
                all=True, ignore_removed=True, filters={"volume": volume.name}
            ):
                DockerBackend().remove_blocking(container.id)
            volume.remove(force=True)


KernelStarter = Callable[..., tuple[KernelManager, BlockingKernelClient]]


@pytest.fixture
def start_kernel(
    jupyter_dirs: Path, workspace: Path, docker_client: docker.DockerClient
) -> Iterator[KernelStarter]:
    """Start sandboxed kernels; each is shut down and proven gone afterwards."""
    started: list[tuple[KernelManager, BlockingKernelClient]] = []

    def start(
        kernel_name: str = KERNEL,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        **km_kwargs: Any,
    ) -> tuple[KernelManager, BlockingKernelClient]:
        km = KernelManager(kernel_name=kernel_name, **km_kwargs)
        km.start_kernel(cwd=str(cwd or workspace), env=env if env is not None else dict(os.environ))
        kc = km.client()
        started.append((km, kc))
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=60)
        except RuntimeError as exc:  # say why: the container's state and last output
            raise RuntimeError(f"{exc}; {container_report(docker_client, km)}") from exc
        return km, kc

    yield start
    for km, kc in started:
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)
        remaining = docker_client.containers.list(
            all=True, ignore_removed=True, filters={"label": f"{LABEL_KERNEL_ID}={km.kernel_id}"}
        ) + docker_client.containers.list(
            all=True, ignore_removed=True, filters={"name": f"sandbox-kernel-{km.kernel_id}"}
        )
        assert remaining == [], f"kernel {km.kernel_id} left containers behind: {remaining}"


def container_report(client: docker.DockerClient, km: KernelManager) -> str:
    """A sandboxed kernel's container state and last output, for a failure message."""
    container_id = getattr(km.provisioner, "container_id", None)
    if container_id is None:
        return "no container"
    try:
        container = client.containers.get(container_id)
    except docker.errors.NotFound:
        return f"container {container_id[:12]} is gone"
    state = container.attrs["State"]
    output = container.logs(tail=40).decode(errors="replace")
    return (
        f"container {container_id[:12]} {state['Status']}, exit code {state['ExitCode']}, "
        f"OOM-killed {state['OOMKilled']}, error {state['Error']!r}; its output:\n{output}"
    )


def shell_reply(kc: BlockingKernelClient, timeout: float) -> dict[str, Any]:
    """The next reply on the shell channel that is not a ``kernel_info_reply``: a slow
    start has ``wait_for_ready()`` send another ``kernel_info_request``, whose reply may
    come after it returned."""
    reply: dict[str, Any] = kc.get_shell_msg(timeout=timeout)
    while reply["msg_type"] == "kernel_info_reply":
        reply = kc.get_shell_msg(timeout=timeout)
    return reply


@asynccontextmanager
async def restarting_kernel(
    workspace: Path, kernel_name: str = KERNEL, config: Config | None = None
) -> AsyncIterator[tuple[AsyncIOLoopKernelManager, AsyncKernelClient, list[str]]]:
    """A kernel with jupyter_client's restarter, as a server runs it: (manager, ready
    client, the list :func:`count_restarts` grows). Shut down afterwards."""
    km = AsyncIOLoopKernelManager(kernel_name=kernel_name, config=config or Config())
    await km.start_kernel(cwd=str(workspace))
    restarts = count_restarts(km)  # needs the restarter, started with the kernel
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=60)
        yield km, kc, restarts
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)


def count_restarts(km: KernelManager) -> list[str]:
    """A list that grows by one each time jupyter_client's restarter restarts the kernel."""
    restarts: list[str] = []
    km.add_restart_callback(lambda: restarts.append("restart"), "restart")
    return restarts


async def wait_for_restart(
    km: AsyncIOLoopKernelManager, restarts: list[str], timeout: float, message: str
) -> None:
    """Until the restarter has restarted the kernel (see :func:`count_restarts`) and the
    new one is running, or fail. The restarter tells its callbacks before it restarts: a
    client's ``wait_for_ready`` in between finds no kernel and says it died."""
    deadline = time.monotonic() + timeout
    while not (restarts and await km.is_alive()) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert restarts, message
    assert await km.is_alive(), f"{message}: the restarted kernel is not running"
    # The restart is done only when jupyter_client's restart_kernel returns (its ready
    # future): a shutdown overlapping it finds that future set twice (InvalidStateError).
    await asyncio.wait_for(asyncio.shield(km.ready), max(deadline - time.monotonic(), 10))


def fill_file(path: str, chunk_mib: int = 1) -> str:
    """Cell code writing ``path`` until something stops it."""
    return (
        f"chunk = b'x' * ({chunk_mib} * 1024 * 1024)\n"
        f"with open({path!r}, 'wb') as f:\n"
        "    while True:\n"
        "        f.write(chunk); f.flush()"
    )


def create_subshell(kc: BlockingKernelClient) -> str:
    """A new subshell's id (ipykernel 7: a thread of its own that runs cells beside the
    main shell's, as JupyterLab's widgets and subshell consoles ask for)."""
    kc.control_channel.send(kc.session.msg("create_subshell_request", {}))
    created = kc.control_channel.get_msg(timeout=60)["content"]
    assert created["status"] == "ok", created
    return str(created["subshell_id"])


def send(kc: BlockingKernelClient, code: str, subshell_id: str = "") -> str:
    """Send ``code`` to run (on the subshell ``subshell_id``, if one); its request's id."""
    request = kc.session.msg("execute_request", {"code": code, "silent": False, "store_history": False})
    if subshell_id:
        request["header"]["subshell_id"] = subshell_id
    kc.shell_channel.send(request)
    return str(request["header"]["msg_id"])


def finished(kc: BlockingKernelClient, *msg_ids: str, timeout: float = 120) -> dict[str, Execution]:
    """Each request's reply and output, once it has both (its ``idle`` status): requests
    that run at the same time, on subshells, end in any order."""
    results = {msg_id: Execution() for msg_id in msg_ids}
    idle: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(idle) < len(results) or not all(result.reply for result in results.values()):
        assert time.monotonic() < deadline, {m: (r.reply, r.stdout, r.stderr) for m, r in results.items()}
        for channel in (kc.get_iopub_msg, kc.get_shell_msg):
            try:
                msg = channel(timeout=0.05)
            except queue.Empty:
                continue
            result = results.get(msg["parent_header"].get("msg_id"))
            if result is None:
                continue
            if channel == kc.get_shell_msg:
                result.reply = msg
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                idle.add(msg["parent_header"]["msg_id"])
            else:
                result.hook(msg)
    return results


def on_subshell(kc: BlockingKernelClient, subshell_id: str, code: str) -> dict[str, Any]:
    """The reply's content to ``code`` run on the subshell ``subshell_id``."""
    msg_id = send(kc, code, subshell_id)
    content: dict[str, Any] = finished(kc, msg_id)[msg_id].reply["content"]
    return content


#: Cell code printing how many of the sandbox's processes it could look into, and the
#: command lines of those holding an epoll set (one from an event loop a thread starts
#: included).
EPOLL_HOLDERS = (
    "import asyncio, os\n"
    "def epolls():\n"
    "    seen, found = 0, []\n"
    "    for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "        try:\n"
    "            fds = os.listdir(f'/proc/{pid}/fd')\n"
    "        except OSError:\n"
    "            continue\n"
    "        seen += 1\n"
    "        for fd in fds:\n"
    "            try:\n"
    "                if 'eventpoll' in os.readlink(f'/proc/{pid}/fd/{fd}'):\n"
    "                    found.append(open(f'/proc/{pid}/cmdline').read().replace(chr(0), ' '))\n"
    "            except OSError:\n"
    "                pass\n"
    "    return seen, found\n"
    "import threading\n"
    "async def in_a_loop():\n"
    "    return epolls()\n"
    "result = []\n"
    "thread = threading.Thread(target=lambda: result.append(asyncio.run(in_a_loop())))\n"
    "thread.start(); thread.join()\n"
    "print(result[0])"
)


def epoll_holders(kc: BlockingKernelClient) -> list[str]:
    """The command lines of the sandbox's processes that hold an epoll set (see
    test_pause.py's test_nothing_in_the_sandbox_waits_with_epoll for why none may)."""
    seen, holders = ast.literal_eval(run_ok(kc, EPOLL_HOLDERS))
    assert seen >= 2, "the kernel could not see its relay's descriptors"
    return list(holders)


def attempt_each(kc: BlockingKernelClient, attempts: dict[str, str], setup: str = "") -> set[str]:
    """Run each expression in the kernel; return the names that raised OSError.

    Any attempt that succeeds fails the test right here, naming it.
    """
    code = f"import os\n{setup}\nfor name, attempt in {{\n"
    code += "".join(f"    {name!r}: lambda: {expr},\n" for name, expr in attempts.items())
    code += "}.items():\n    try:\n        attempt(); print('ALLOWED', name)\n"
    code += "    except OSError as e:\n        print('denied', name)\n"
    out = run_ok(kc, code)
    assert "ALLOWED" not in out, out
    return {line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("denied ")}


#: The shipped kernelspec with a warm pool, for running suites against pooled kernels.
POOLED_KERNEL = "sandboxed-python-pooled-suite"


@pytest.fixture(params=["cold", "pooled"])
def flavour(request: pytest.FixtureRequest) -> str:
    """How the suite's kernels start: cold, or claimed from a warm pool."""
    return str(request.param)


@pytest.fixture
def inside(flavour: str, workspace: Path) -> str:
    """Where the kernel sees its workspace: /workspace, or /workspace/<folder> when pooled."""
    return "/workspace" if flavour == "cold" else f"/workspace/{workspace.name}"


@pytest.fixture
def start_sandboxed(
    flavour: str, start_kernel: KernelStarter, make_kernelspec: Callable[..., str], workspace: Path
) -> Iterator[KernelStarter]:
    """``start_kernel``, whose default kernelspec's kernels are, for the pooled flavour,
    claimed from a warm pool (same settings, ``pool_size`` 1): the hostile and isolation
    suites hold for both."""
    if flavour == "cold":
        yield start_kernel
        return
    from sandbox_kernel import SandboxPool, warm_pool

    pooled = make_kernelspec(POOLED_KERNEL, config={"pool_size": 1})

    def start(
        kernel_name: str = KERNEL, cwd: Path | None = None, **kwargs: Any
    ) -> tuple[KernelManager, BlockingKernelClient]:
        if kernel_name != KERNEL:
            return start_kernel(kernel_name, cwd, **kwargs)
        assert warm_pool(pooled, cwd=cwd or workspace, env=kwargs.get("env")) == 1
        km, kc = start_kernel(pooled, cwd, **kwargs)
        assert km.provisioner.from_pool, "the pooled flavour's kernel came from the pool"
        return km, kc

    yield start
    SandboxPool.instance().drain()
