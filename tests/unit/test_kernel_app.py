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
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.manager import KernelManager, start_new_kernel

from sandbox_kernel.inside import kernel_app
from tests.executions import run_ok


@pytest.fixture
def kernel_app_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernelspec that runs kernel_app.py with this Python, as the sandbox runs it."""
    folder = tmp_path / "kernels" / "kernel-app"
    folder.mkdir(parents=True)
    argv = [sys.executable, kernel_app.__file__, "-f", "{connection_file}"]
    (folder / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "k", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return "kernel-app"


#: How a kernel is before a client asks for a subshell, after, and with ``subshells: false``.
WAYS = ("on demand", "subshells started", "subshells off")


@contextmanager
def started(kernel_name: str, way: str = "on demand") -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    extra = ["--SandboxedKernelApp.subshells=False"] if way == "subshells off" else []
    km, kc = start_new_kernel(kernel_name=kernel_name, startup_timeout=60, extra_arguments=extra)
    try:
        if way == "subshells started":
            assert control(kc, "list_subshell_request")["content"]["status"] == "ok"
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.fixture
def kernel(kernel_app_spec: str) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    with started(kernel_app_spec) as kernel:
        yield kernel


@pytest.fixture(params=WAYS)
def kernel_each_way(
    request: pytest.FixtureRequest, kernel_app_spec: str
) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    with started(kernel_app_spec, request.param) as kernel:
        yield kernel


def control(kc: BlockingKernelClient, msg_type: str, **content: Any) -> dict[str, Any]:
    request = kc.session.msg(msg_type, content)
    kc.control_channel.send(request)
    reply: dict[str, Any] = kc.control_channel.get_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == request["header"]["msg_id"]
    return reply


def thread_names(kc: BlockingKernelClient) -> list[str]:
    printed = run_ok(kc, "import threading; print(sorted(t.name for t in threading.enumerate()))", timeout=30)
    names: list[str] = eval(printed)  # noqa: S307 (the kernel's own print of a list)
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
    idle: set[str] = set()
    deadline = time.monotonic() + 30
    while not idle.issuperset(sent) and time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=30)
        parent = msg["parent_header"].get("msg_id", "")
        if msg["msg_type"] == "stream":  # (a print may come in more than one message)
            printed[parent] = printed.get(parent, "") + msg["content"]["text"]
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            idle.add(parent)
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


def test_context_variables_a_cell_set_live_on_after_the_hand_over(
    kernel: tuple[KernelManager, BlockingKernelClient],
) -> None:
    """ipykernel runs every main-shell cell in one context: what a cell set in a context
    variable (decimal's precision, a tracing library's span) the next cell sees, before and
    after the first subshell request alike."""
    _, kc = kernel
    setup = "import contextvars, decimal; v = contextvars.ContextVar('v', default='lost'); v.set('kept')"
    run_ok(kc, setup + "; decimal.getcontext().prec = 5", timeout=30)
    assert control(kc, "list_subshell_request")["content"]["status"] == "ok"
    assert run_ok(kc, "print(v.get(), decimal.getcontext().prec)", timeout=30) == "kept 5\n"


@pytest.mark.parametrize("failing", ["1/0", "import asyncio; await asyncio.sleep(0.5); 1/0"])
def test_a_failing_cell_aborts_the_requests_queued_behind_it(
    kernel_each_way: tuple[KernelManager, BlockingKernelClient], failing: str
) -> None:
    """What "Run All" relies on (stop_on_error): the cells sent behind one that fails are
    aborted, not run, an async cell's as a sync one's (ipykernel 7.4's own path without
    the shell-channel thread let an async cell's run on); the next cell runs."""
    _, kc = kernel_each_way
    sent = [kc.execute(failing)] + [kc.execute(f"ran_{i} = {i}") for i in range(6)]
    statuses = {}
    for _ in sent:
        reply = kc.get_shell_msg(timeout=30)
        statuses[reply["parent_header"]["msg_id"]] = reply["content"]["status"]
    assert [statuses[msg_id] for msg_id in sent] == ["error"] + ["aborted"] * 6
    assert run_ok(kc, "print(sorted(n for n in dir() if n.startswith('ran_')))", timeout=30) == "[]\n"


def test_the_subshell_magic_answers_as_ipykernel_s_before_any_request(
    kernel: tuple[KernelManager, BlockingKernelClient],
) -> None:
    """``%subshell`` (ipykernel's) lists the subshells: the kernel offers them from the
    start, so the magic does not say it has none."""
    _, kc = kernel
    printed = run_ok(kc, "%subshell", timeout=30)
    assert "subshell id: None" in printed, printed
    assert "subshell list: []" in printed, printed
