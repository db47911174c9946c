"""``python -m sandbox_kernel.launch --kernel NAME -f CONNECTION_FILE``: the sandboxed kernel
for front ends that run a kernelspec's ``argv`` themselves.

VS Code's Jupyter extension, Zed, nteract, Emacs' jupyter and others ignore kernel
provisioners: they write a connection file, run the kernelspec's argv and connect to the
ports in the file. A sandboxed kernelspec's argv is this launcher, so what they get is the
sandboxed kernel the provisioner would start (same kernelspec, server config, policy,
limits, egress and audit log), its bridge serving the connection file's ports with its
key. Never a kernel on the host: anything that keeps the sandbox from starting ends the
launcher with one line saying why, and a non-zero status.

Two processes, so that nothing outlives the front end's interest:

- the *launcher* (the process the front end started and signals): SIGINT interrupts the
  kernel, SIGTERM or SIGHUP shut it down; it exits with the kernel's end;
- its *worker*, in a session of its own (a signal to the front end's process group does
  not reach it), drives the kernel with a jupyter_client manager. It shuts the kernel down
  when the launcher goes, however it goes (SIGKILL included): it holds the read end of a
  pipe whose write end only the launcher has. Should the worker itself be killed, the
  launcher removes what it left (see :func:`~.ownership.prune_orphans`).

A restart is a new launch, as front ends do it for kernels they start themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from sandbox_kernel.plan.sandbox_spec import LAUNCHER_MODULE

#: How long the launcher waits for its worker to shut the kernel down after a signal.
SHUTDOWN_GRACE = 30.0


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {LAUNCHER_MODULE}",
        description="Start a sandboxed kernel (gVisor) serving a connection file's ports: what a "
        "sandboxed kernelspec's argv runs when a front end starts kernels itself.",
    )
    parser.add_argument("--kernel", default="sandboxed-python", help="the kernelspec (default: %(default)s)")
    parser.add_argument("-f", dest="connection_file", required=True, help="the connection file to serve")
    parser.add_argument("--worker-pipe", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if args.worker_pipe is not None:
        return asyncio.run(_serve(args.kernel, Path(args.connection_file), args.worker_pipe))
    return _launch(sys.argv[1:] if argv is None else argv)


# ---------------------------------------------------------------------- the launcher


def _launch(argv: list[str]) -> int:
    """Start the worker, pass signals on, outlive it; its exit status is ours."""
    read_end, write_end = os.pipe()
    worker = subprocess.Popen(  # noqa: S603  # our own module, with our own arguments
        [sys.executable, "-m", LAUNCHER_MODULE, *argv, "--worker-pipe", str(read_end)],
        pass_fds=(read_end,),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    os.close(read_end)
    stopping = False

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stopping
        if signum != signal.SIGINT:
            stopping = True
        with contextlib.suppress(ProcessLookupError):
            worker.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    while True:
        try:
            code = worker.wait(timeout=SHUTDOWN_GRACE if stopping else None)
            break
        except subprocess.TimeoutExpired:
            worker.kill()  # the reap below removes what it left
            stopping = False
    os.close(write_end)
    if code < 0:  # killed: its kernel has nobody left to shut it down
        _reap()
    return code if code >= 0 else 128 - code


def _reap() -> None:
    """Remove the kernels of processes that died (the worker's among them)."""
    from sandbox_kernel.errors import SandboxKernelError
    from sandbox_kernel.lifecycle.ownership import prune_orphans
    from sandbox_kernel.provisioner import SandboxProvisioner

    settings = SandboxProvisioner()
    try:
        asyncio.run(prune_orphans(settings.backend, settings.runtime_parent))
    except SandboxKernelError as exc:
        print(f"sandbox-kernel: could not remove the kernel its worker left: {exc}", file=sys.stderr)


# ---------------------------------------------------------------------- the worker


def _connection(path: Path) -> dict[str, Any]:
    """The connection file's contents, if this launcher can serve them.

    Raises:
        ConfigurationError: it cannot be read, or asks for what the bridge cannot serve.
    """
    from sandbox_kernel.errors import ConfigurationError

    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        msg = f"cannot read the connection file {path}: {exc}"
        raise ConfigurationError(msg) from exc
    if not isinstance(info, dict) or info.get("transport", "tcp") != "tcp":
        msg = (
            f"the connection file {path} asks for transport {info.get('transport')!r}; a front end "
            "that starts sandboxed kernels itself must use tcp (Jupyter's default)"
        )
        raise ConfigurationError(msg)
    if info.get("ip", "127.0.0.1") not in ("127.0.0.1", "localhost"):
        msg = (
            f"the connection file {path} asks for ip {info.get('ip')!r}: a sandboxed kernel's channels "
            "listen on 127.0.0.1 only"
        )
        raise ConfigurationError(msg)
    return info


async def _serve(kernel_name: str, connection_file: Path, pipe: int) -> int:
    """Start the kernel on the connection file's ports; shut it down when it ends, when
    told to, or when the launcher is gone."""
    import zmq
    from traitlets.config import Config

    from sandbox_kernel.errors import SandboxKernelError
    from sandbox_kernel.plan.admission import sandboxed_manager

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_reader(pipe, stop.set)  # readable only at EOF: the launcher is gone
    for signum in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(signum, stop.set)
    km = None
    try:
        info = _connection(connection_file)
        config = Config()
        config.SandboxProvisioner.client_transport = "tcp"
        km = sandboxed_manager(kernel_name, config=config, connection_file=str(connection_file))
        km.load_connection_info(info)  # type: ignore[arg-type]  # checked by _connection
        started = asyncio.ensure_future(km.start_kernel(cwd=os.getcwd()))
        waiting = asyncio.ensure_future(stop.wait())
        await asyncio.wait({started, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if not started.done():
            started.cancel()
            with contextlib.suppress(asyncio.CancelledError, SandboxKernelError):
                await started
            return 0
        started.result()
        interrupt = km.interrupt_kernel
        loop.add_signal_handler(signal.SIGINT, lambda: asyncio.ensure_future(interrupt()))
        print(f"sandbox-kernel: kernel {km.kernel_id} ({kernel_name}) is running in gVisor", file=sys.stderr)
        while not stop.is_set() and await km.is_alive():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        return 0
    except (SandboxKernelError, zmq.ZMQError) as exc:
        print(f"sandbox-kernel: the sandboxed kernel {kernel_name!r} did not start: {exc}", file=sys.stderr)
        return 1
    finally:
        if km is not None and km.provisioner is not None:
            with contextlib.suppress(SandboxKernelError):
                await km.shutdown_kernel(now=True)


if __name__ == "__main__":
    sys.exit(main())
