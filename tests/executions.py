"""Executing a cell from a jupyter_client client and collecting what it produced: shared
by the unit tests that start kernels (on the host) and the integration tests (sandboxed)."""

from __future__ import annotations

from typing import Any

from jupyter_client.blocking.client import BlockingKernelClient


class Execution:
    """What one execute request produced, collected from iopub."""

    def __init__(self) -> None:
        self.stdout = ""
        self.stderr = ""
        self.outputs: list[dict[str, Any]] = []
        self.reply: dict[str, Any] = {}

    def hook(self, msg: dict[str, Any]) -> None:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            if content["name"] == "stdout":
                self.stdout += content["text"]
            else:
                self.stderr += content["text"]
        elif kind in ("display_data", "execute_result", "error"):
            self.outputs.append({"type": kind, **content})

    @property
    def status(self) -> str:
        return str(self.reply["content"]["status"])


def run(kc: BlockingKernelClient, code: str, timeout: float = 60, **kwargs: Any) -> Execution:
    """Execute ``code`` and wait for its reply and all its output."""
    result = Execution()
    result.reply = kc.execute_interactive(code, timeout=timeout, output_hook=result.hook, **kwargs)
    return result


def run_ok(kc: BlockingKernelClient, code: str, timeout: float = 60) -> str:
    """Execute ``code``, insist it succeeded, and return its stdout."""
    result = run(kc, code, timeout)
    assert result.status == "ok", f"cell failed: {result.outputs} {result.reply['content']}"
    return result.stdout


#: Kernel code that shuts down and closes the socket pair its channel keeper reads (an
#: attack; the keeper is the kernel's only socket of that type): prints "closed".
CLOSE_CHANNEL_KEEPER = """\
import os, socket
for fd in os.listdir('/proc/self/fd'):
    try:
        s = socket.socket(fileno=int(fd))
    except OSError:
        continue
    if s.type == socket.SOCK_SEQPACKET:
        s.shutdown(socket.SHUT_RDWR); s.close(); print('closed')
    else:
        s.detach()
"""


def printing(kc: BlockingKernelClient, msg_id: str, timeout: float = 60) -> None:
    """Until the request ``msg_id`` has printed (its cell runs): an interrupt sent sooner is
    lost, since an idle kernel ignores SIGINT. Its IOPub messages up to there are read."""
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            return


def until_idle(kc: BlockingKernelClient, msg_id: str, timeout: float = 30) -> None:
    """Until the kernel is idle after the request ``msg_id`` (its IOPub read up to there).
    After a failing one, ipykernel aborts what was sent before (stop_on_error): a cell sent
    as soon as the error's reply is in hand may be."""
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id or msg["msg_type"] != "status":
            continue
        if msg["content"]["execution_state"] == "idle":
            return
