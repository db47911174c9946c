"""Every message of an execution, in Jupyter's order, from a real sandboxed kernel: the
kernel's start-up code shortens ipykernel's output path (sandbox_kernel/inside/fast_io.py)
and the kernel holds its IOPub socket itself; what a client sees must be what a local kernel
sends: busy, the input, the outputs (main thread, other threads, file descriptor 1, a
forked child), the result, then idle last, all with the request as parent, and one reply.
Each test runs on a kernel with subshells (the default) and on one without (the kernelspec
key ``subshells: false``: the main thread reads the requests and sends the replies)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from .conftest import KernelStarter, printing, run_ok, shell_reply

#: Output from the main thread, another thread and file descriptor 1, then a value. The
#: pipe behind fd 1 is read by ipykernel's own thread: the pause lets it catch up, as it
#: would in any local kernel (ipykernel does not wait for it before the result).
MIXED_CELL = """\
import os, threading, time
print("main")
worker = threading.Thread(target=print, args=("thread",))
worker.start(); worker.join()
os.write(1, b"fd\\n")
time.sleep(0.5)
6 * 7"""


@pytest.fixture(params=[True, False], ids=["subshells", "no-subshells"])
def start_kernel(
    request: pytest.FixtureRequest, start_kernel: KernelStarter, make_kernelspec: Callable[..., str]
) -> KernelStarter:
    """conftest's ``start_kernel``, of the shipped kernelspec or of a variant without subshells."""
    if request.param:
        return start_kernel
    name = make_kernelspec("no-subshells", config={"subshells": False})
    return lambda **kwargs: start_kernel(name, **kwargs)


def messages_of(kc: BlockingKernelClient, code: str, timeout: float = 60) -> tuple[list[dict[str, Any]], Any]:
    """(the IOPub messages whose parent is the request for ``code``, up to and with its
    idle status; the shell reply), and that no other IOPub message of it follows."""
    msg_id = kc.execute(code)
    seen: list[dict[str, Any]] = []
    while not seen or seen[-1]["msg_type"] != "status" or seen[-1]["content"]["execution_state"] != "idle":
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") == msg_id:
            seen.append(msg)
    reply = shell_reply(kc, timeout)
    assert reply["parent_header"]["msg_id"] == msg_id
    late = []
    while True:
        try:
            late.append(kc.get_iopub_msg(timeout=0.3))
        except Exception:  # noqa: BLE001 (queue.Empty: nothing more)
            break
    assert [m for m in late if m["parent_header"].get("msg_id") == msg_id] == [], "output after idle"
    return seen, reply


def kinds(messages: list[dict[str, Any]]) -> list[str]:
    return [
        m["msg_type"] + (f":{m['content']['execution_state']}" if m["msg_type"] == "status" else "")
        for m in messages
    ]


def test_output_from_every_source_comes_in_order_then_the_result_then_idle(
    start_kernel: KernelStarter,
) -> None:
    _, kc = start_kernel()
    for _ in range(5):  # the order must hold every time, not by luck once
        messages, reply = messages_of(kc, MIXED_CELL)
        order = kinds(messages)
        streams = [i for i, kind in enumerate(order) if kind == "stream"]
        assert order[:2] == ["status:busy", "execute_input"], order
        assert order[-2:] == ["execute_result", "status:idle"], order
        assert streams, order
        assert streams == list(range(2, 2 + len(streams))), order
        assert "".join(messages[i]["content"]["text"] for i in streams) == "main\nthread\nfd\n"
        assert {messages[i]["content"]["name"] for i in streams} == {"stdout"}
        result = messages[-2]["content"]
        assert result["data"]["text/plain"] == "42"
        assert reply["content"]["status"] == "ok"
        assert reply["content"]["execution_count"] == result["execution_count"]


def test_a_quick_cell_sends_exactly_busy_input_result_idle(start_kernel: KernelStarter) -> None:
    _, kc = start_kernel()
    for _ in range(30):
        messages, reply = messages_of(kc, "1+1")
        assert kinds(messages) == ["status:busy", "execute_input", "execute_result", "status:idle"]
        assert messages[2]["content"]["data"]["text/plain"] == "2"
        assert reply["content"]["status"] == "ok"


def test_a_cell_ending_in_a_print_sends_it_before_idle_every_time(start_kernel: KernelStarter) -> None:
    """The last print is still in the stream's buffer when the cell ends: the flush before
    the reply hands it to the IOPub thread, and the flush before idle, with nothing left
    to take, is where fast_io's shortcut returns at once if nothing is in flight: idle
    must never overtake the print."""
    _, kc = start_kernel()
    shortcut = "import sys; print(sys.modules['sandbox_kernel_fast_io'].SKIP_EMPTY_FLUSHES)"
    assert run_ok(kc, shortcut) == "True\n"
    for i in range(30):
        text = "x" * 100_000 + f"{i}\n"
        messages, reply = messages_of(kc, f"print({text!r}, end='')")
        assert kinds(messages) == ["status:busy", "execute_input", "stream", "status:idle"]
        assert messages[2]["content"]["text"] == text
        assert reply["content"]["status"] == "ok"


def test_a_forked_child_s_output_reaches_the_client(start_kernel: KernelStarter) -> None:
    """A child forked by the cell writes through the kernel's pipe for subprocess output,
    as ipykernel does for a forked child (which the start-up code recognises without a
    system call per write)."""
    _, kc = start_kernel()
    code = (
        "import os, sys\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    print('child'); sys.stdout.flush(); os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "import time; time.sleep(0.5)\n"
        "print('parent')"
    )
    messages, reply = messages_of(kc, code)
    assert reply["content"]["status"] == "ok", reply["content"]
    text = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")
    assert text == "child\nparent\n"


def test_an_interrupted_flood_of_prints_ends_cleanly_and_the_kernel_goes_on(
    start_kernel: KernelStarter,
) -> None:
    """SIGINT lands while the cell prints as fast as it can: the reply is the interrupt's,
    idle follows, and the next cell's messages are whole and in order. Its print may come
    as two stream messages, as from a local ipykernel: the flood's last flush timer (0.2 s)
    can fire between ``after`` and its newline when the next cell comes that soon (a local
    kernel split 19 of 20 such cells; Jupyter's front ends join a stream's messages)."""
    km, kc = start_kernel()
    msg_id = kc.execute("i = 0\nwhile True:\n    print(i)\n    i += 1")
    printing(kc, msg_id)
    km.interrupt_kernel()
    reply = shell_reply(kc, 60)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    messages, reply = messages_of(kc, "print('after'); 1+1")
    order = [kind for kind, _ in itertools.groupby(kinds(messages))]  # (a stream's run as one)
    assert order == ["status:busy", "execute_input", "stream", "execute_result", "status:idle"]
    assert "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream") == "after\n"
    assert run_ok(kc, "print(i > 0)") == "True\n"


#: Output sent from the main thread while a timer's handler raises in it every 0.2 ms (as
#: a user's timeout decorator, the wall clock's limit or an interrupt would): each
#: message either goes whole or not at all, never cut between its frames.
INTERRUPTED_SENDS = """\
import signal, time
kernel = get_ipython().kernel
class Tick(Exception):
    pass
sending = False
def tick(signum, frame):  # raises only inside a send, once each
    global sending
    if sending:
        sending = False
        raise Tick
before = signal.signal(signal.SIGALRM, tick)
sent, ticks = [], 0
signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)
for i in range(3000):
    try:
        sending = True
        kernel.session.send(kernel.iopub_socket, "stream", {"name": "stderr", "text": "%d," % i},
                            parent=kernel.get_parent("shell"))
        sending = False
        sent.append(i)
    except Tick:
        ticks += 1
    time.sleep(0.003)  # well under the IOPub socket's high-water mark (past it ZeroMQ drops)
signal.setitimer(signal.ITIMER_REAL, 0)
signal.signal(signal.SIGALRM, before)
print(" sent", *sent, "ticks", ticks)"""


def test_a_signal_raising_in_the_main_thread_never_cuts_a_message_in_two(start_kernel: KernelStarter) -> None:
    """A message is several ZeroMQ frames; one cut after some of them takes the next
    message's frames as its own, and the client loses both (and a local ipykernel on
    Python 3.11 does: a handler raising inside Thread.is_alive(), which ipykernel asks
    of its IOPub thread for every message, marks that thread stopped for good, and from
    then on the main thread sends alongside it). The main thread also sends IOPub
    messages itself here (fast_io), where signal handlers run: thousands of interrupts
    land during sends, and every message the cell counted as sent arrives, in order."""
    _, kc = start_kernel()
    messages, reply = messages_of(kc, INTERRUPTED_SENDS, timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]

    def text(name: str) -> str:
        return "".join(m["content"]["text"] for m in messages if m["content"].get("name") == name)

    *sent, _, ticks = (int(n) for n in text("stdout").replace("sent", "").replace("ticks", "0").split())
    got = [int(n) for n in text("stderr").split(",") if n]
    lost = sorted(set(sent) - set(got))
    assert ticks > 100, f"the timer hardly interrupted anything ({ticks} ticks)"
    assert got == sorted(set(got)), "messages came out of order or twice"
    assert not lost, f"{len(lost)} of {len(sent)} messages sent were lost ({ticks} interrupts): {lost[:10]}"
    for _ in range(3):
        quick, _ = messages_of(kc, "1+1")
        assert kinds(quick) == ["status:busy", "execute_input", "execute_result", "status:idle"]


#: Work the IOPub thread hands itself, as each print and flush of a finalizer the garbage
#: collector runs there does (a progress bar's ``__del__``, say): here with no output of its
#: own, so that ZeroMQ's high-water mark on the IOPub socket drops nothing on a loaded
#: machine, then a line.
HANDED_TO_ITSELF = """\
import sys, threading
iopub = sys.stdout.pub_thread
done = threading.Event()
def chatty():
    for i in range(2500):
        iopub.schedule(lambda: None)
    print("said on the IOPub thread", flush=True)
iopub.schedule(chatty)
iopub.schedule(done.set)
print("the IOPub thread went on" if done.wait(30) else "the IOPub thread is stuck")"""


def test_work_the_iopub_thread_hands_itself_leaves_the_kernels_output_flowing(
    start_kernel: KernelStarter,
) -> None:
    """ipykernel wakes its IOPub thread through a pipe only that thread reads, for work that
    thread makes too: 2000 unread stopped it in a send for good, and with it every output
    of the kernel (this cell's last line never came; nor did idle). fast_io hands such work
    to the IOPub thread's own loop."""
    _, kc = start_kernel()
    messages, reply = messages_of(kc, HANDED_TO_ITSELF, timeout=90)
    assert reply["content"]["status"] == "ok", reply["content"]
    text = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")
    assert "the IOPub thread went on" in text
    quick, _ = messages_of(kc, "1+1")
    assert kinds(quick) == ["status:busy", "execute_input", "execute_result", "status:idle"]
