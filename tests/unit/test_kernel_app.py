"""The sandboxed kernel's command (``inside/kernel_app.py``) run here, on the host's ipykernel
(the image's version): the hand-over of the shell socket to ipykernel's shell-channel
thread at the first subshell request, raced against requests in flight, many times over
(a sandboxed kernel's start costs seconds; the same checks on one run in
tests/integration/test_conformance.py)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq
from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.manager import KernelManager, start_new_kernel
from jupyter_client.session import Session
from tornado.ioloop import IOLoop
from zmq.eventloop.zmqstream import ZMQStream

from sandbox_kernel.inside import fast_io, kernel_app
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


#: Kernel code: fast_io loaded as in_kernel_startup.py loads it in the sandbox (the
#: whole-message sender that replies sent at once go by), and from then on the kernel
#: waits 1 s after each request's handler (its reply made) before it publishes ``idle``.
SLOW_AFTER_REPLIES = f"""\
import importlib.util, sys, time
_spec = importlib.util.spec_from_file_location({kernel_app.FAST_IO_MODULE!r}, {fast_io.__file__!r})
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
sys.modules[_spec.name] = _module
_kernel = get_ipython().kernel
_after = _kernel.post_handler_hook
_kernel.post_handler_hook = lambda: (time.sleep(1), _after())
"""


def reply_and_idle(kc: BlockingKernelClient, code: str) -> tuple[dict[str, Any], float, float]:
    """Run ``code``: its reply, and the seconds from the request to the reply and to ``idle``."""
    sent = time.monotonic()
    msg_id = kc.execute(code)
    reply = kc.get_shell_msg(timeout=30)
    replied = time.monotonic() - sent
    assert reply["parent_header"]["msg_id"] == msg_id
    while True:
        msg = kc.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") == msg_id and msg["content"].get("execution_state") == "idle":
            return reply, replied, time.monotonic() - sent


@pytest.mark.parametrize("way", ["on demand", "subshells off"])
def test_a_successful_reply_goes_out_as_it_is_made_not_after_idle(kernel_app_spec: str, way: str) -> None:
    """The main thread's ``ok`` reply leaves when the kernel makes it: a client has it while
    the kernel still works before ``idle`` (ipykernel's stream queued it for its loop's next
    turn, or for the flush after ``idle``)."""
    with started(kernel_app_spec, way) as (_, kc):
        run_ok(kc, SLOW_AFTER_REPLIES, timeout=30)
        reply, replied, idle = reply_and_idle(kc, "1+1")
        assert reply["content"]["status"] == "ok"
        assert replied < 0.8, f"the reply came {replied:.2f} s after the request, behind the kernel's wait"
        assert idle >= 1


def test_a_request_that_arrives_while_a_cell_runs_is_read_after_its_reply(kernel_app_spec: str) -> None:
    """A request arriving while a cell runs waits in the socket, and ZeroMQ signals it once
    (its descriptor is edge-triggered). A send past the stream takes that signal: the
    stream must look at the socket again, or the request is never read and the notebook's
    next cell waits for ever (as after an interrupt a cell caught, or any cell run while
    another runs)."""
    with started(kernel_app_spec) as (_, kc):
        run_ok(kc, SLOW_AFTER_REPLIES.rsplit("_kernel = ", 1)[0], timeout=30)  # fast_io only
        for _ in range(3):
            first = kc.execute("import time; time.sleep(0.5)")
            time.sleep(0.2)
            second = kc.execute("1+1")
            replies = [kc.get_shell_msg(timeout=10) for _ in range(2)]
            assert [reply["parent_header"]["msg_id"] for reply in replies] == [first, second]
            assert [reply["content"]["status"] for reply in replies] == ["ok", "ok"]


def test_a_request_sent_as_a_failed_reply_arrives_is_not_aborted(kernel_app_spec: str) -> None:
    """A failed cell aborts what was read behind it, up to a marker queued then. A client
    that sends its next request once it has the failed reply (as the session API does after
    interrupting a run it gave up on) must see that request run, not "aborted"."""
    with started(kernel_app_spec) as (_, kc):
        run_ok(kc, SLOW_AFTER_REPLIES.rsplit("_kernel = ", 1)[0], timeout=30)  # fast_io only
        for _ in range(40):  # (a race: the old way lost it about once in 20 to 100)
            kc.execute("1/0")
            assert kc.get_shell_msg(timeout=30)["content"]["status"] == "error"
            msg_id = kc.execute("1+1")
            reply = kc.get_shell_msg(timeout=30)
            assert reply["parent_header"]["msg_id"] == msg_id
            assert reply["content"]["status"] == "ok", reply["content"]


@pytest.fixture
def reply_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[kernel_app.ReplyStream, zmq.Socket[bytes], bytes, IOLoop]]:
    """A ReplyStream on a ROUTER of a loop of this thread's, the DEALER it answers and that
    DEALER's identity, and the loop (not running); fast_io loaded, as in a sandbox."""
    monkeypatch.setitem(sys.modules, kernel_app.FAST_IO_MODULE, fast_io)
    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    router.bind("inproc://replies")
    dealer.connect("inproc://replies")
    loop = IOLoop(make_current=False)
    stream = kernel_app.ReplyStream.adopt(ZMQStream(router, loop))
    try:
        dealer.send(b"request")
        assert router.poll(5000)
        identity, _ = router.recv_multipart()
        yield stream, dealer, identity, loop
    finally:
        stream.close(linger=0)
        dealer.close(linger=0)
        loop.close()
        context.term()


def reply(identity: bytes, status: str, note: str = "") -> list[bytes]:
    """A reply's frames as ipykernel's session makes them, routed to ``identity``."""
    session = Session(key=b"")
    msg = session.msg("execute_reply", {"status": status, "note": note, "execution_count": 1})
    return [identity, *session.serialize(msg)]


def answers(dealer: zmq.Socket[bytes], wait: float = 0.2) -> list[str]:
    """The notes of the replies ``dealer`` has received within ``wait`` seconds (and then at once)."""
    got = []
    session = Session(key=b"")
    while dealer.poll(int(wait * 1000)):
        frames = dealer.recv_multipart()
        got.append(session.deserialize(frames[1:])["content"]["note"])
        wait = 0
    return got


def test_a_reply_stream_sends_a_successful_reply_at_once_on_its_loop_s_thread(
    reply_stream: tuple[kernel_app.ReplyStream, zmq.Socket[bytes], bytes, IOLoop],
) -> None:
    stream, dealer, identity, _ = reply_stream
    stream.send_multipart(reply(identity, "ok", "now"))
    assert answers(dealer) == ["now"]


@pytest.mark.parametrize("status", ["error", "aborted"])
def test_a_reply_stream_queues_a_reply_that_did_not_succeed_and_what_follows_it(
    reply_stream: tuple[kernel_app.ReplyStream, zmq.Socket[bytes], bytes, IOLoop], status: str
) -> None:
    stream, dealer, identity, loop = reply_stream
    stream.send_multipart(reply(identity, status, "failed"))
    stream.send_multipart(reply(identity, "ok", "after it"))
    assert answers(dealer) == []
    loop.run_sync(lambda: asyncio.sleep(0.1))
    assert answers(dealer) == ["failed", "after it"]


def test_a_reply_stream_queues_another_thread_s_reply_and_what_follows_it(
    reply_stream: tuple[kernel_app.ReplyStream, zmq.Socket[bytes], bytes, IOLoop],
) -> None:
    """The socket is its loop's thread's alone: another thread's reply waits for the loop,
    and a reply made while one waits goes after it."""
    stream, dealer, identity, loop = reply_stream
    other = threading.Thread(target=stream.send_multipart, args=(reply(identity, "ok", "other thread's"),))
    other.start()
    other.join()
    stream.send_multipart(reply(identity, "ok", "after it"))
    assert answers(dealer) == []
    loop.run_sync(lambda: asyncio.sleep(0.1))
    assert answers(dealer) == ["other thread's", "after it"]


@pytest.mark.parametrize("switch", ["at_once off", "no fast_io"])
def test_with_the_switch_off_or_without_fast_io_a_reply_stream_is_ipykernel_s_own(
    reply_stream: tuple[kernel_app.ReplyStream, zmq.Socket[bytes], bytes, IOLoop],
    monkeypatch: pytest.MonkeyPatch,
    switch: str,
) -> None:
    stream, dealer, identity, loop = reply_stream
    if switch == "at_once off":
        monkeypatch.setattr(kernel_app.ReplyStream, "at_once", False)
    else:
        monkeypatch.delitem(sys.modules, kernel_app.FAST_IO_MODULE)
    stream.send_multipart(reply(identity, "ok", "queued"))
    assert answers(dealer) == []
    loop.run_sync(lambda: asyncio.sleep(0.1))
    assert answers(dealer) == ["queued"]


@pytest.mark.parametrize(
    "frames",
    [
        [b"id", b"<IDS|MSG>", b"sig", b"{}", b"{}", b"{}"],  # no content
        [b"id", b"<IDS|MSG>", b"sig", b"{}", b"{}", b"{}", b"not json"],
        [b"id", b"<IDS|MSG>", b"sig", b"{}", b"{}", b"{}", b'["status", "ok"]'],
        [b"id", b"sig", b"{}", b"{}", b"{}", b'{"status": "ok"}'],  # no delimiter
        [b"id", b"<IDS|MSG>", b"sig", b"{}", b"{}", b"{}", memoryview(b'{"status": "ok"}')],
        [b"id", b"<IDS|MSG>", b"sig", b"{}", b"{}", b"{}", b'{"status": "ok", "x": "%s"}' % (b"y" * 2**16)],
    ],
)
def test_only_a_whole_small_ok_reply_counts_as_succeeded(frames: list[Any]) -> None:
    assert not kernel_app.succeeded(frames)
    assert kernel_app.succeeded([b"id", b"<IDS|MSG>", b"sig", b"{}", b"{}", b"{}", b'{"status": "ok"}'])
