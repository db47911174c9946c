"""The sandboxed kernel's command: ipykernel's own application, with one socket option more
and event loops that poll.

The channel relay (kernel_relay.py) passes the host's connections through to the kernel,
so the kernel's peer on shell and stdin is the host's bridge, which connects with one
identity of its own (the kernel routes a prompt on stdin to the identity its shell
request came from). When the bridge connects again (a paused kernel resumed, a server
that adopted the kernel, a connection the host cut off), its new connection may reach
ZeroMQ before the old one is gone: without ``ROUTER_HANDOVER`` a ROUTER ignores a peer
whose identity is taken, and reads its next message as its identity. ipykernel sets it
on the control socket only (ipykernel#270); here shell and stdin get it too: the new
connection takes the identity over, as a client reconnecting expects.

And its event loops wait with poll(2), not epoll. gVisor's runsc up to 2026-03 (Debian's
is 20240729) can save an epoll set's entry for a descriptor closed before a pause and
bring it back at the restore (gVisor commit 5d857245b, "vfs: clear temporary notReady
lists"): ready for ever, with the data of a registration long gone. ZeroMQ's I/O threads
took that data for a pointer and the kernel died of SIGSEGV after one resume in four;
Python's selectors would spin. The image's libzmq is built to poll too (images/Dockerfile),
and so are the channel and egress relays (the latter with this policy's twin: each file
runs alone in the sandbox): poll(2) keeps nothing between calls for a restore to spoil.

And it can run without subshells (``--SandboxedKernelApp.subshells=False``, what the
kernelspec key ``subshells: false`` asks): ipykernel 7 reads the shell channel in a thread
of its own and hands each request to the main thread (and each reply back) so that
subshells (JEP 91) can run beside the main shell. Without that thread, as in ipykernel 6,
the main thread reads the shell channel itself: two fewer thread wake-ups per request,
which gVisor makes dear (1.4 to 2 ms of a sandboxed ``1+1`` on a 2-core host, see
docs/benchmarks.md); the kernel then stops advertising ``kernel subshells``, so JupyterLab
sends widgets' messages on the main shell, where they wait for a running cell.

The image does not have this package: the host copies this file into the kernel's launch
folder and runs it with the image's Python (PYTHONSAFEPATH keeps its folder off
``sys.path``). It uses ipykernel, pyzmq and the standard library only.
"""

from __future__ import annotations

import asyncio
import selectors

from ipykernel.kernelapp import IPKernelApp
from traitlets import Bool


class PollingEventLoopPolicy(asyncio.DefaultEventLoopPolicy):
    """Every new event loop of the kernel (its threads', and ``asyncio.run`` in a cell)
    waits with poll(2)."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.SelectorEventLoop(selectors.PollSelector())


class SandboxedKernelApp(IPKernelApp):
    """``python -m ipykernel_launcher``, with shell and stdin taking a reconnecting peer's
    identity over, and subshells optional."""

    subshells = Bool(
        True,
        config=True,
        help="Read the shell channel in a thread of its own, so that subshells can run "
        "(ipykernel 7); False: in the main thread, as ipykernel 6 did, with no subshells.",
    )

    def init_sockets(self) -> None:
        super().init_sockets()  # type: ignore[no-untyped-call]
        for sock in (self.shell_socket, self.stdin_socket):
            sock.router_handover = 1
        if not self.subshells:
            # ipykernel's own path for a kernel without the thread (init_kernel, and
            # Kernel._supports_kernel_subshells, which kernel_info_reply's features follow).
            self.shell_channel_thread = None


if __name__ == "__main__":
    asyncio.set_event_loop_policy(PollingEventLoopPolicy())
    SandboxedKernelApp.launch_instance()
