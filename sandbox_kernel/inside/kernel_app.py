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
sends widgets' messages on the main shell, where they wait for a running cell. ipykernel
7.4 gets its own case without the thread wrong twice (:class:`KernelWithoutSubshells`
puts both right): a cell with a top-level ``await`` raised AttributeError after it had
started, ran on detached and never got its reply; and a request naming a subshell (from
a client that did not read ``supported_features``) failed an assertion after ``busy``:
no reply, no ``idle``, and the subshell requests on control got no reply either.

The image does not have this package: the host copies this file into the kernel's launch
folder and runs it with the image's Python (PYTHONSAFEPATH keeps its folder off
``sys.path``). It uses ipykernel, pyzmq and the standard library only.
"""

from __future__ import annotations

import asyncio
import selectors
import threading
from typing import Any

from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelapp import IPKernelApp
from traitlets import Bool

#: What a kernel without subshells answers a request that names one, or asks for one.
NO_SUBSHELLS = (
    "this kernel has no subshells (subshells: false in its kernelspec or its server's "
    "config; its kernel_info_reply lists no 'kernel subshells' among supported_features)"
)
#: Messages ipykernel takes on any shell, whatever subshell their header names.
_ANY_SHELL = ("comm_msg", "comm_close")


class PollingEventLoopPolicy(asyncio.DefaultEventLoopPolicy):
    """Every new event loop of the kernel (its threads', and ``asyncio.run`` in a cell)
    waits with poll(2)."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.SelectorEventLoop(selectors.PollSelector())


class NoShellChannelThread:
    """Where ipykernel looks for its shell-channel thread in a kernel without one: false, as
    its ``if self.shell_channel_thread`` checks expect of none, and with the thread the main
    shell runs in, which ipykernel 7.4 reads for every cell with a top-level ``await``
    whether the thread exists or not."""

    def __init__(self) -> None:
        self.parent_thread = threading.current_thread()

    def __bool__(self) -> bool:
        return False


class KernelWithoutSubshells(IPythonKernel):
    """ipykernel's kernel for a :class:`NoShellChannelThread`: it says it has no subshells,
    and answers a request naming one, or asking for one, with an error reply (a kernel with
    subshells answers a subshell it does not know so: busy, the error, idle)."""

    #: The msg_id of the shell request being handled that named a subshell.
    _named_a_subshell: str | None = None

    @property
    def _supports_kernel_subshells(self) -> bool:
        return False

    def set_parent(self, ident: Any, parent: Any, channel: str = "shell") -> None:
        header = parent.get("header") if channel == "shell" and isinstance(parent, dict) else None
        if isinstance(header, dict) and header.get("subshell_id") is not None:
            if header.get("msg_type") not in _ANY_SHELL:
                # Past ipykernel's check that the request names the shell handling it (an
                # AssertionError after busy); should_handle then answers it.
                self._named_a_subshell = header.get("msg_id")
                header["subshell_id"] = None
        super().set_parent(ident, parent, channel)  # type: ignore[no-untyped-call]

    def should_handle(self, stream: Any, msg: dict[str, Any], idents: Any) -> Any:
        msg_id = msg["header"].get("msg_id")
        if self._named_a_subshell is None or msg_id != self._named_a_subshell:
            return super().should_handle(stream, msg, idents)  # type: ignore[no-untyped-call]
        self._named_a_subshell = None
        self._refuse(stream, idents, msg)
        return False  # (ipykernel then publishes idle)

    async def create_subshell_request(self, socket: Any, ident: Any, parent: dict[str, Any]) -> None:
        self._refuse(socket, ident, parent)

    async def delete_subshell_request(self, socket: Any, ident: Any, parent: dict[str, Any]) -> None:
        self._refuse(socket, ident, parent)

    async def list_subshell_request(self, socket: Any, ident: Any, parent: dict[str, Any]) -> None:
        self._refuse(socket, ident, parent)

    def _refuse(self, stream: Any, idents: Any, request: dict[str, Any]) -> None:
        msg_type = str(request["header"].get("msg_type", ""))
        content: dict[str, Any] = {
            "status": "error",
            "ename": "NoSubshells",
            "evalue": NO_SUBSHELLS,
            "traceback": [],
        }
        if msg_type == "execute_request":
            content["execution_count"] = None
        if self.session is not None:
            reply_type = msg_type.removesuffix("_request") + "_reply"
            self.session.send(stream, reply_type, content, parent=request, ident=idents)


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
        made = getattr(self, "shell_channel_thread", None)  # (ipykernel 6 has none to drop)
        if not self.subshells and made is not None:
            # ipykernel's own path for a kernel without the thread (init_kernel and the
            # kernel's checks), with the corrections of KernelWithoutSubshells.
            made.io_loop.close()  # made, never to run
            self.shell_channel_thread = NoShellChannelThread()
            self.kernel_class = KernelWithoutSubshells


if __name__ == "__main__":
    asyncio.set_event_loop_policy(PollingEventLoopPolicy())
    SandboxedKernelApp.launch_instance()
