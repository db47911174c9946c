"""The sandboxed kernel's command: ipykernel's own application, with one socket option more.

The channel relay (kernel_relay.py) passes the host's connections through to the kernel,
so the kernel's peer on shell and stdin is the host's bridge, which connects with one
identity of its own (the kernel routes a prompt on stdin to the identity its shell
request came from). When the bridge connects again (a paused kernel resumed, a server
that adopted the kernel, a connection the host cut off), its new connection may reach
ZeroMQ before the old one is gone: without ``ROUTER_HANDOVER`` a ROUTER ignores a peer
whose identity is taken, and reads its next message as its identity. ipykernel sets it
on the control socket only (ipykernel#270); here shell and stdin get it too: the new
connection takes the identity over, as a client reconnecting expects.

The image does not have this package: the host copies this file into the kernel's launch
folder and runs it with the image's Python (PYTHONSAFEPATH keeps its folder off
``sys.path``). It uses ipykernel and pyzmq only.
"""

from __future__ import annotations

from ipykernel.kernelapp import IPKernelApp


class SandboxedKernelApp(IPKernelApp):
    """``python -m ipykernel_launcher``, with shell and stdin taking a reconnecting peer's identity over."""

    def init_sockets(self) -> None:
        super().init_sockets()  # type: ignore[no-untyped-call]
        for sock in (self.shell_socket, self.stdin_socket):
            sock.router_handover = 1


if __name__ == "__main__":
    SandboxedKernelApp.launch_instance()
