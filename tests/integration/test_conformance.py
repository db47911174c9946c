"""Jupyter's own kernel conformance suite (``jupyter_kernel_test``, the checks kernel authors
run) against a sandboxed kernel: every message validated against the messaging spec, the
replies and outputs of execution, errors, completion, code completeness, the pager,
history, inspection, rich display and ``clear_output``, as a local IPython kernel gives
them. What runs differently in the sandbox (the relay, the host's bridge, the kernel's
start-up code, IPython's history kept in memory) must not show here; nor may a kernelspec
that turns subshells off (``subshells: false``), nor the hand-over of the shell channel
when a client first asks for a subshell."""

from __future__ import annotations

import queue
import time
import unittest
from collections.abc import Callable
from typing import Any

import jupyter_kernel_test as jkt
import pytest
from jupyter_client.blocking import BlockingKernelClient
from jupyter_kernel_test.msgspec_v5 import validate_message

from .conftest import KernelStarter, create_subshell, run_ok, send, shell_reply

pytestmark = pytest.mark.integration

#: Seconds each of execute_helper's reads may wait (upstream: 15 for the reply, 1 for busy, 0.1
#: for each message after it).
WAIT = 30


class IPythonKernelTests(jkt.KernelTests):
    """jupyter_kernel_test's samples for IPython (its own ``test_ipykernel.py``); the kernel
    is the test's (see below), not one of setUpClass. History's "range" is left out as
    upstream leaves it out: IPython numbers the current session 0 in a range's reply, a
    local kernel as well."""

    __test__ = False  # run by the test below, on its kernel

    language_name = "python"
    file_extension = ".py"
    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    completion_samples = [{"text": "zi", "matches": {"zip"}}]
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n"]
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2"]
    invalid_code_samples = ["import = 7q"]
    code_page_something = "zip?"
    code_generate_error = "raise"
    code_execute_result = [
        {"code": "1+2+3", "result": "6"},
        {"code": "[n*n for n in range(1, 4)]", "result": "[1, 4, 9]"},
    ]
    code_display_data = [
        {
            "code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))",
            "mime": "text/html",
        },
        {
            "code": "from IPython.display import Math, display; display(Math('\\\\frac{1}{2}'))",
            "mime": "text/latex",
        },
    ]
    code_history_pattern = "1?2*"
    supported_history_operations = ("tail", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"

    def execute_helper(
        self,
        code: str,
        timeout: int = WAIT,
        silent: bool = False,
        store_history: bool = True,
        stop_on_error: bool = True,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Upstream's, with the same checks and answer, but time to wait: its idle status
        had 0.1 s to come after the reply (through the relay and the bridge beside it, not
        behind it: a busy machine is slower than that), and another request's late status
        could pass for this one's busy. Another request's messages are validated and passed
        over; each read waits up to ``WAIT`` s."""
        msg_id = self.kc.execute(
            code=code, silent=silent, store_history=store_history, stop_on_error=stop_on_error
        )

        reply = self.get_non_kernel_info_reply(timeout=timeout)
        assert reply is not None
        validate_message(reply, "execute_reply", msg_id)

        busy_msg = self.next_iopub_of(msg_id)
        validate_message(busy_msg, "status", msg_id)
        assert busy_msg["content"]["execution_state"] == "busy", busy_msg["content"]

        output_msgs = []
        while True:
            msg = self.next_iopub_of(msg_id)
            validate_message(msg, msg["msg_type"], msg_id)
            if msg["msg_type"] == "status":
                assert msg["content"]["execution_state"] == "idle", msg["content"]
                break
            if msg["msg_type"] == "execute_input":
                assert msg["content"]["code"] == code, msg["content"]
                continue
            output_msgs.append(msg)

        return reply, output_msgs

    def next_iopub_of(self, msg_id: str) -> dict[str, Any]:
        """The next IOPub message of the request ``msg_id``, within ``WAIT`` s (``queue.Empty``
        if none); the others' before it are validated as upstream's flush_channels does."""
        deadline = time.monotonic() + WAIT
        while True:
            msg: dict[str, Any] = self.kc.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.01))
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg
            validate_message(msg)

    @classmethod
    def setUpClass(cls) -> None:
        """The kernel comes from the test (``start_kernel``: shut down and proven gone after)."""

    @classmethod
    def tearDownClass(cls) -> None:
        """(See setUpClass.)"""


CHECKS = sorted(name for name in dir(jkt.KernelTests) if name.startswith("test_"))


def run_checks(km: object, kc: BlockingKernelClient, checks: list[str]) -> list[str]:
    """What fails of jupyter_kernel_test's ``checks`` on the kernel ``km``/``kc``, in words;
    a check that skips part of itself fails too."""
    problems = []
    for check in checks:
        case = IPythonKernelTests(check)
        case.km, case.kc = km, kc
        result = unittest.TestResult()
        case.run(result)
        problems += [f"{test}: {trace}" for test, trace in (*result.failures, *result.errors)]
        skipped = {reason for _, reason in result.skipped} - {"History range not supported"}
        problems += [f"{check} did not run all of itself: {skipped}"] if skipped else []
    return problems


@pytest.mark.parametrize("check", CHECKS)
def test_a_sandboxed_kernel_passes_jupyters_kernel_conformance_suite(
    start_kernel: KernelStarter, check: str
) -> None:
    km, kc = start_kernel()
    problems = run_checks(km, kc, [check])
    assert not problems, "\n".join(problems)


def iopub_of(kc: BlockingKernelClient, msg_id: str, until: str = "status:idle") -> list[str]:
    """The IOPub messages of the request ``msg_id`` (types, with states), to the first of
    the kind ``until``: its idle status unless told."""
    seen: list[str] = []
    while until not in seen:
        msg = kc.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") == msg_id:
            state = msg["content"].get("execution_state")
            seen.append(f"{msg['msg_type']}:{state}" if state else msg["msg_type"])
    return seen


def test_a_kernel_without_subshells_passes_the_suite_says_so_and_still_interrupts(
    start_kernel: KernelStarter, make_kernelspec: Callable[..., str]
) -> None:
    """``subshells: false``: the main thread reads the shell channel. The kernel tells
    clients it has no subshells (JupyterLab then keeps widgets' messages on the main
    shell) and is otherwise the same kernel: the whole suite on it, an interrupt of a
    running cell (the signal reaches the main thread, which now also reads the requests),
    and of a cell with a top-level ``await`` (ipykernel 7.4 alone lost those cells)."""
    km, kc = start_kernel(make_kernelspec("no-subshells", config={"subshells": False}))
    features = kc.kernel_info(reply=True, timeout=30)["content"].get("supported_features", [])
    assert "kernel subshells" not in features

    problems = run_checks(km, kc, CHECKS)
    assert not problems, "\n".join(problems)

    reply = kc.execute_interactive("import asyncio\nawait asyncio.sleep(0.1)\n'awaited'", timeout=30)
    assert reply["content"]["status"] == "ok", reply["content"]
    # (An awaiting cell, interrupted, ends in CancelledError only once its sleep is over,
    # in a local ipykernel 7 as here: 18 s after the interrupt of a 20 s sleep, both.)
    for cell in ("import time; time.sleep(60)", "await asyncio.sleep(8)"):
        msg_id = kc.execute(f"print('started', flush=True); {cell}")
        iopub_of(kc, msg_id, until="stream")  # it runs: ipykernel ignores SIGINT while idle
        km.interrupt_kernel()
        reply = shell_reply(kc, 30)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["status"] == "error", (cell, reply["content"])
        assert iopub_of(kc, msg_id)[-1] == "status:idle"
    assert kc.execute_interactive("1+1", timeout=30)["content"]["status"] == "ok"


def test_a_kernel_without_subshells_answers_a_client_that_asks_for_one(
    start_kernel: KernelStarter, make_kernelspec: Callable[..., str]
) -> None:
    """A client that ignores ``supported_features`` gets an error reply, never silence: to
    a subshell request on control, and to a request naming a subshell on shell (busy, the
    error, idle, as a kernel with subshells answers one it does not know), whose code does
    not run; the kernel goes on."""
    _, kc = start_kernel(make_kernelspec("no-subshells", config={"subshells": False}))
    for msg_type, content in (
        ("create_subshell_request", {}),
        ("list_subshell_request", {}),
        ("delete_subshell_request", {"subshell_id": "s1"}),
    ):
        request = kc.session.msg(msg_type, content)
        kc.control_channel.send(request)
        reply = kc.control_channel.get_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == request["header"]["msg_id"]
        assert reply["msg_type"] == msg_type.replace("_request", "_reply")
        assert (reply["content"]["status"], reply["content"]["ename"]) == ("error", "NoSubshells")

    assert_refused_on_a_subshell(kc, "NoSubshells")


def assert_refused_on_a_subshell(kc: BlockingKernelClient, ename: str) -> None:
    """Code sent on the subshell ``s1`` gets busy, the error ``ename``, idle; it did not run."""
    named = send(kc, "ran_in_a_subshell = True", "s1")
    reply = shell_reply(kc, 30)
    assert reply["parent_header"]["msg_id"] == named
    assert (reply["content"]["status"], reply["content"]["ename"]) == ("error", ename)
    assert iopub_of(kc, named) == ["status:busy", "status:idle"]
    assert run_ok(kc, "print('ran_in_a_subshell' in dir())").strip() == "False"


def thread_names(kc: BlockingKernelClient) -> list[str]:
    return sorted(eval(run_ok(kc, "import threading; print(sorted(t.name for t in threading.enumerate()))")))  # noqa: S307


def test_a_sandboxed_kernel_offers_subshells_and_starts_them_at_the_first_request_mid_cell(
    start_kernel: KernelStarter,
) -> None:
    """As a local ipykernel 7 does (JupyterLab 4.4 runs widgets' messages on them), with the
    main thread reading the shell channel until a client asks for a subshell: a request
    naming one before then gets ipykernel's answer to an unknown subshell; a subshell
    created while a cell runs is created at once and answers beside it; the cell's output
    and reply, begun before the hand-over, arrive whole and in order; and the kernel, now
    ipykernel's own, passes the whole suite and still interrupts."""
    km, kc = start_kernel()
    features = kc.kernel_info(reply=True, timeout=30)["content"].get("supported_features", [])
    assert "kernel subshells" in features
    assert "Shell channel" not in thread_names(kc)
    assert_refused_on_a_subshell(kc, "UnknownSubshellError")
    assert "Shell channel" not in thread_names(kc)

    busy = kc.execute("import time; print('before'); time.sleep(8); print('after'); 'main done'")
    begun = iopub_of(kc, busy, until="stream")  # the cell runs
    asked = time.monotonic()
    subshell_id = create_subshell(kc)
    assert time.monotonic() - asked < 4, "the subshell waited for the cell"
    beside = send(kc, "6 * 7", subshell_id)
    first = shell_reply(kc, 30)
    assert first["parent_header"]["msg_id"] == beside, "the subshell waited for the cell"
    assert first["content"]["status"] == "ok"
    last = shell_reply(kc, 30)
    assert (last["parent_header"]["msg_id"], last["content"]["status"]) == (busy, "ok")
    assert begun + iopub_of(kc, busy) == [
        "status:busy",
        "execute_input",
        "stream",
        "stream",
        "execute_result",
        "status:idle",
    ]
    assert "Shell channel" in thread_names(kc)

    problems = run_checks(km, kc, CHECKS)
    assert not problems, "\n".join(problems)
    msg_id = kc.execute("print('started', flush=True); import time; time.sleep(60)")
    iopub_of(kc, msg_id, until="stream")  # it runs: ipykernel ignores SIGINT while idle
    km.interrupt_kernel()
    reply = shell_reply(kc, 30)
    assert (reply["parent_header"]["msg_id"], reply["content"]["status"]) == (msg_id, "error")
    kc.control_channel.send(kc.session.msg("delete_subshell_request", {"subshell_id": subshell_id}))
    assert kc.control_channel.get_msg(timeout=30)["content"]["status"] == "ok"


@pytest.mark.parametrize("failing", ["1/0", "import asyncio; await asyncio.sleep(0.5); 1/0"])
def test_run_all_stops_at_a_failing_cell_sync_or_async(start_kernel: KernelStarter, failing: str) -> None:
    """JupyterLab's "Run All" sends every cell at once (stop_on_error): those behind one
    that fails are aborted, behind an async cell too (ipykernel 7.4's path without the
    shell-channel thread, the kernel's until a subshell is asked for, ran them)."""
    _, kc = start_kernel()
    sent = [kc.execute(failing)] + [kc.execute(f"ran_{i} = {i}") for i in range(6)]
    statuses = {}
    for _ in sent:
        reply = shell_reply(kc, 30)
        statuses[reply["parent_header"]["msg_id"]] = reply["content"]["status"]
    assert [statuses[msg_id] for msg_id in sent] == ["error"] + ["aborted"] * 6
    assert run_ok(kc, "print(sorted(n for n in dir() if n.startswith('ran_')))").strip() == "[]"


def test_a_cell_sent_once_a_failed_one_has_its_reply_runs(start_kernel: KernelStarter) -> None:
    """A client that runs its next cell once a failed one's reply is in (nbclient with
    ``allow_errors``, an assistant) must see it run. The kernel's abort behind the failed
    cell sent that reply while it still read the requests that had arrived, and one sent
    in that moment was read before the abort's end and came back "aborted" (about once in
    100 with the kernel run on the host, tests/unit/test_kernel_app.py; not seen in 60
    here before the fix: a guard on the sandboxed kernel, not a reproduction)."""
    _, kc = start_kernel()
    for _ in range(30):
        kc.execute("1/0")
        assert shell_reply(kc, 30)["content"]["status"] == "error"
        msg_id = kc.execute("1+1")
        reply = shell_reply(kc, 30)
        answered = (reply["parent_header"]["msg_id"], reply["content"]["status"])
        assert answered == (msg_id, "ok"), reply["content"]


def test_a_cell_sent_while_another_runs_runs_after_it(start_kernel: KernelStarter) -> None:
    """The kernel sends an ``ok`` reply as it makes it, past its shell stream's queue; a
    request that arrived while the cell ran was signalled once, on ZeroMQ's edge-triggered
    descriptor, and that send took the signal: the request was never read, and the next
    cell waited for ever (JupyterLab sends a cell run while another runs at once)."""
    _, kc = start_kernel()
    for _ in range(5):
        first = kc.execute("import time; time.sleep(0.5)")
        time.sleep(0.2)
        second = kc.execute("1+1")
        replies = [shell_reply(kc, 30) for _ in range(2)]
        assert [(reply["parent_header"]["msg_id"], reply["content"]["status"]) for reply in replies] == [
            (first, "ok"),
            (second, "ok"),
        ]


def test_run_all_after_the_hand_over_gets_every_reply_once(start_kernel: KernelStarter) -> None:
    """Asked by a review: once the shell-channel thread has the shell socket, a reply goes
    out through that thread while the next cell's execute_input goes out at once from the
    main thread. The host, seeing a later cell begin before an earlier one's reply, takes
    that reply for lost and answers ``ReplyLost`` itself."""
    _, kc = start_kernel()
    kc.control_channel.send(kc.session.msg("list_subshell_request", {}))  # the hand-over
    assert kc.control_channel.get_msg(timeout=60)["content"]["status"] == "ok"
    sent = [kc.execute(f"print({i})") for i in range(60)]
    replies = [shell_reply(kc, 30) for _ in sent]
    assert [(reply["parent_header"]["msg_id"], reply["content"]["status"]) for reply in replies] == [
        (msg_id, "ok") for msg_id in sent
    ], [reply["content"] for reply in replies if reply["content"]["status"] != "ok"]
    with pytest.raises(queue.Empty):
        kc.get_shell_msg(timeout=2)


def test_deleting_a_subshell_answers_the_requests_the_kernel_drops(start_kernel: KernelStarter) -> None:
    """ipykernel 7.4 deletes a subshell once its running cell ends, and answers neither
    that cell nor those queued behind it (measured with a local kernel as with this one).
    The host ended them only at the kernel's next reply on that subshell, which never
    came: the kernel stayed busy for good, and was killed at its wall-clock limit. Their
    clients now get a reply saying why."""
    _, kc = start_kernel()
    subshell_id = create_subshell(kc)
    sent = [send(kc, code, subshell_id) for code in ("import time; time.sleep(2)", "print(1)")]
    time.sleep(0.5)
    kc.control_channel.send(kc.session.msg("delete_subshell_request", {"subshell_id": subshell_id}))
    assert kc.control_channel.get_msg(timeout=30)["content"]["status"] == "ok"
    replies = {}
    for _ in sent:
        reply = shell_reply(kc, 10)
        replies[reply["parent_header"]["msg_id"]] = reply["content"]
    assert [(replies[msg_id]["status"], replies[msg_id]["ename"]) for msg_id in sent] == [
        ("error", "SubshellDeleted")
    ] * 2
    assert "subshell was deleted" in replies[sent[1]]["evalue"]
    assert run_ok(kc, "print(6 * 7)").strip() == "42"
