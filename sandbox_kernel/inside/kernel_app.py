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

The image does not have this package: the host copies this file into the kernel's launch
folder and runs it with the image's Python (PYTHONSAFEPATH keeps its folder off
``sys.path``). It uses ipykernel, pyzmq and the standard library only.
"""

from __future__ import annotations

import asyncio
import selectors

from ipykernel.kernelapp import IPKernelApp


class PollingEventLoopPolicy(asyncio.DefaultEventLoopPolicy):
    """Every new event loop of the kernel (its threads', and ``asyncio.run`` in a cell)
    waits with poll(2)."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.SelectorEventLoop(selectors.PollSelector())


class SandboxedKernelApp(IPKernelApp):
    """``python -m ipykernel_launcher``, with shell and stdin taking a reconnecting peer's identity over."""

    def init_sockets(self) -> None:
        super().init_sockets()  # type: ignore[no-untyped-call]
        for sock in (self.shell_socket, self.stdin_socket):
            sock.router_handover = 1


if __name__ == "__main__":
    asyncio.set_event_loop_policy(PollingEventLoopPolicy())
    SandboxedKernelApp.launch_instance()
