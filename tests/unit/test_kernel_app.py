"""The sandboxed kernel's command (``inside/kernel_app.py``) run here, on the host's ipykernel
(the image's version): the hand-over of the shell socket to ipykernel's shell-channel
thread at the first subshell request, raced against requests in flight, many times over
(a sandboxed kernel's start costs seconds; the same checks on one run in
tests/integration/test_conformance.py)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.manager import KernelManager, start_new_kernel

from sandbox_kernel.inside import kernel_app


@pytest.fixture
def kernel_app_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernelspec that runs kernel_app.py with this Python, as the sandbox runs it."""
    folder = tmp_path / "kernels" / "kernel-app"
    folder.mkdir(parents=True)
    argv = [sys.executable, kernel_app.__file__, "-f", "{connection_file}"]
    (folder / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "k", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return "kernel-app"


@pytest.fixture
def kernel(kernel_app_spec: str) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    km, kc = start_new_kernel(kernel_name=kernel_app_spec, startup_timeout=60)
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def control(kc: BlockingKernelClient, msg_type: str, **content: Any) -> dict[str, Any]:
    request = kc.session.msg(msg_type, content)
    kc.control_channel.send(request)
    reply: dict[str, Any] = kc.control_channel.get_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == request["header"]["msg_id"]
    return reply


def thread_names(kc: BlockingKernelClient) -> list[str]:
    kc.execute("import threading; print(sorted(t.name for t in threading.enumerate()))")
    while True:
        msg = kc.get_iopub_msg(timeout=30)
        if msg["msg_type"] == "stream":
            names: list[str] = eval(msg["content"]["text"])  # noqa: S307 (the kernel's own print of a list)
            kc.get_shell_msg(timeout=30)
            return names


def test_the_main_thread_reads_the_shell_channel_until_a_subshell_is_asked_for(
    kernel: tuple[KernelManager, BlockingKernelClient],
) -> None:
    _, kc = kernel
    assert kernel_app.subshells_on_demand_fit(), "the host's ipykernel is not the one the image has"
    features = kc.kernel_info(reply=True, timeout=30)["content"]["supported_features"]
    assert "kernel subshells" in features
    assert "Shell channel" not in thread_names(kc)
    assert control(kc, "list_subshell_request")["content"] == {"status": "ok", "subshell_id": []}
    assert "Shell channel" in thread_names(kc)


@pytest.mark.parametrize("round_", range(8))
def test_requests_in_flight_as_the_shell_socket_is_handed_over_are_each_answered_once_in_order(
    kernel: tuple[KernelManager, BlockingKernelClient], round_: int
) -> None:
    """Requests sent back to back, the subshell request among them at a random point: some
    were read by the main thread before the hand-over (their replies go through the
    shell-channel thread), some after; every one is answered once, in order, with its
    output, and the subshell runs code."""
    _, kc = kernel
    count, at = 40, round_ * 5
    sent, created = [], None
    for i in range(count):
        sent.append(kc.execute(f"print({i}); {i}"))
        if i == at:
            created = kc.session.msg("create_subshell_request", {})
            kc.control_channel.send(created)
    replies = [kc.get_shell_msg(timeout=30) for _ in range(count)]
    assert [r["parent_header"]["msg_id"] for r in replies] == sent
    assert {r["content"]["status"] for r in replies} == {"ok"}
    counts = [r["content"]["execution_count"] for r in replies]
    assert counts == list(range(counts[0], counts[0] + count))
    printed: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while len(printed) < count and time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=30)
        if msg["msg_type"] == "stream":
            printed[msg["parent_header"]["msg_id"]] = msg["content"]["text"]
    assert [printed.get(msg_id) for msg_id in sent] == [f"{i}\n" for i in range(count)]

    assert created is not None
    reply = kc.control_channel.get_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == created["header"]["msg_id"]
    assert reply["content"]["status"] == "ok", reply["content"]
    on_it = kc.session.msg("execute_request", {"code": "6 * 7", "silent": False, "store_history": False})
    on_it["header"]["subshell_id"] = reply["content"]["subshell_id"]
    kc.shell_channel.send(on_it)
    answer = kc.get_shell_msg(timeout=30)
    assert answer["parent_header"]["msg_id"] == on_it["header"]["msg_id"]
    assert answer["content"]["status"] == "ok"
