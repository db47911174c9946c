"""Approval questions of a gateway kernel, kept for its owner's program: the queue's logic
(with a clock of its own), its routes on the real gateway app served in this process (the
fake backend: the egress proxy's asking is the queue's ``ask``, called from a thread as the
proxy's is), and a session's client of them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from jupyter_server.gateway.gateway_client import GatewayClient
from tornado.simple_httpclient import HTTPTimeoutError

from sandbox_kernel.agents import gateway_approvals, gateway_session
from sandbox_kernel.agents.gateway_approvals import GatewayApprovals
from sandbox_kernel.agents.gateway_session import use_gateway
from sandbox_kernel.agents.gateway_settings import GatewaySettings
from sandbox_kernel.channels.approval import HANDLER
from sandbox_kernel.egress import ApprovalRequest
from sandbox_kernel.gateway.approvals import GONE, LEASE, RELEASED, ApprovalQueue, NotTheAnswerer

from . import test_gateway as served
from .test_gateway import Gateway

# The real gateway app with the fake backend, as test_gateway.py serves it.
short_tmp, gateway_args, serve, gateway = served.short_tmp, served.gateway_args, served.serve, served.gateway

REQUEST = ApprovalRequest("k1", "pypi.org", 443, "CONNECT", 20.0)
Future = concurrent.futures.Future[tuple[str, str]]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def queue_with_clock() -> tuple[ApprovalQueue, Clock, list[ApprovalQueue]]:
    clock, gone = Clock(), []
    return ApprovalQueue("k1", on_gone=gone.append, clock=clock), clock, gone


def answered(future: Future) -> tuple[str, str]:
    return future.result(timeout=5)


# -- the queue's logic ----------------------------------------------------------------------


def test_nobody_registered_denies_at_once() -> None:
    queue, _, _ = queue_with_clock()
    assert answered(queue.ask(REQUEST)) == ("deny", GONE)


def test_the_answerer_gets_each_question_once_and_its_answer_decides() -> None:
    queue, _, _ = queue_with_clock()
    answerer = queue.register()
    future = queue.ask(REQUEST)
    (question,) = queue.take(answerer)
    assert {k: question[k] for k in ("host", "port", "method", "timeout")} == {
        "host": "pypi.org",
        "port": 443,
        "method": "CONNECT",
        "timeout": 20.0,
    }
    assert len(question["id"]) == 32
    assert queue.take(answerer) == [], "handed out once"
    assert not queue.answer(answerer, "0" * 32, "once"), "no such question"
    assert queue.answer(answerer, question["id"], " Kernel\n")
    assert answered(future) == ("kernel", HANDLER)
    assert not queue.answer(answerer, question["id"], "once"), "answered already"
    other = queue.ask(REQUEST)
    (question,) = queue.take(answerer)
    assert queue.answer(answerer, question["id"], "yes")
    assert answered(other) == ("deny", HANDLER), "anything but once or kernel denies"


def test_a_question_the_proxy_gave_up_on_is_no_longer_handed_out_or_answered() -> None:
    queue, _, _ = queue_with_clock()
    answerer = queue.register()
    timed_out = queue.ask(REQUEST)
    assert timed_out.cancel()  # as the egress proxy does at approval_timeout
    assert queue.take(answerer) == []
    later = queue.ask(REQUEST)
    (question,) = queue.take(answerer)
    assert later.cancel()
    assert not queue.answer(answerer, question["id"], "once"), "too late"


def test_a_session_that_stops_polling_is_gone_and_its_questions_are_denied() -> None:
    queue, clock, gone = queue_with_clock()
    answerer = queue.register()
    waiting = queue.ask(REQUEST)
    clock.now += LEASE - 1
    assert not queue.expire_if_gone()
    clock.now += 2
    assert queue.expire_if_gone()
    assert answered(waiting) == ("deny", GONE)
    assert gone == [queue], "the kernel is told to ask as without a program"
    assert answered(queue.ask(REQUEST)) == ("deny", GONE), "and the next is denied at once"
    with pytest.raises(NotTheAnswerer) as lapsed:
        queue.take(answerer)
    assert not lapsed.value.replaced


def test_a_new_session_replaces_the_one_before_and_gets_its_unanswered_questions() -> None:
    queue, _, _ = queue_with_clock()
    first = queue.register()
    future = queue.ask(REQUEST)
    (handed,) = queue.take(first)
    second = queue.register()
    for call in (lambda: queue.take(first), lambda: queue.answer(first, handed["id"], "once")):
        with pytest.raises(NotTheAnswerer) as replaced:
            call()
        assert replaced.value.replaced
    assert [q["id"] for q in queue.take(second)] == [handed["id"]]
    assert queue.answer(second, handed["id"], "once")
    assert answered(future) == ("once", HANDLER)


def test_a_session_that_lets_go_denies_its_open_questions_and_another_id_changes_nothing() -> None:
    queue, _, gone = queue_with_clock()
    answerer = queue.register()
    future = queue.ask(REQUEST)
    queue.release("f" * 32)
    assert not future.done()
    queue.release(answerer)
    assert answered(future) == ("deny", RELEASED)
    assert gone == [queue]


async def test_a_poll_waits_for_a_question_asked_from_another_thread() -> None:
    queue = ApprovalQueue("k1")
    answerer = queue.register()
    started = time.monotonic()
    assert await queue.wait(answerer, 0.2) == []
    assert 0.15 < time.monotonic() - started < 2
    futures: list[Future] = []
    asker = threading.Timer(0.2, lambda: futures.append(queue.ask(REQUEST)))
    asker.start()
    (question,) = await queue.wait(answerer, 10)
    assert queue.answer(answerer, question["id"], "once")
    await asyncio.to_thread(asker.join, 10)  # ask() has returned its future to the asker
    assert answered(futures[0]) == ("once", HANDLER)
    closed = asyncio.Event()
    asyncio.get_running_loop().call_later(0.2, closed.set)
    started = time.monotonic()
    assert await queue.wait(answerer, 10, closed) == [], "its connection closed"
    assert time.monotonic() - started < 2


# -- the routes, on the gateway app ---------------------------------------------------------


def approvals_route(gateway: Gateway, kernel_id: str) -> str:
    return f"/api/sandbox-kernel/kernels/{kernel_id}/approvals"


def ask_from_the_proxys_thread(gateway: Gateway, kernel_id: str) -> Future:
    """What the egress proxy does: ask the kernel's provisioner's handler, in a thread of its own."""
    handler = gateway.km.get_kernel(kernel_id).provisioner.approval_handler
    assert isinstance(handler, ApprovalQueue)
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(handler.ask, REQUEST).result()


async def test_its_owner_registers_waits_for_and_answers_the_kernels_questions(gateway: Gateway) -> None:
    kernel_id = await gateway.start("alice")
    route = approvals_route(gateway, kernel_id)
    provisioner = gateway.km.get_kernel(kernel_id).provisioner
    assert (await gateway.fetch(f"{route}?answerer=x", "alice")).code == 410, "not registered"
    registered = await gateway.fetch(route, "alice", method="POST", body="{}")
    assert registered.code == 200, registered.body
    answerer = json.loads(registered.body)["answerer"]
    assert isinstance(provisioner.approval_handler, ApprovalQueue), "the kernel now asks the queue"

    future = ask_from_the_proxys_thread(gateway, kernel_id)
    polled = await gateway.fetch(f"{route}?answerer={answerer}&wait=5", "alice")
    (question,) = json.loads(polled.body)["questions"]
    assert (question["host"], question["port"]) == ("pypi.org", 443)
    answer_route = f"{route}/{question['id']}?answerer={answerer}"
    assert (await gateway.fetch(answer_route, "alice", method="POST", body="{}")).code == 400
    assert (await gateway.fetch(answer_route, "alice", method="POST", body={"answer": "once"})).code == 204
    assert answered(future) == ("once", HANDLER)
    late = await gateway.fetch(answer_route, "alice", method="POST", body={"answer": "once"})
    assert late.code == 404
    assert "no longer waits" in json.loads(late.body)["message"]

    again = json.loads((await gateway.fetch(route, "alice", method="POST", body="{}")).body)["answerer"]
    replaced = await gateway.fetch(f"{route}?answerer={answerer}", "alice")
    assert replaced.code == 409, "another session of hers answers now"
    future = ask_from_the_proxys_thread(gateway, kernel_id)
    assert (await gateway.fetch(f"{route}?answerer={again}", "alice", method="DELETE")).code == 204
    assert answered(future) == ("deny", RELEASED)
    assert provisioner.approval_handler is None, "asked as without a program again"


async def test_nobody_else_sees_registers_for_or_answers_a_kernels_questions(gateway: Gateway) -> None:
    kernel_id = await gateway.start("alice")
    route = approvals_route(gateway, kernel_id)
    answerer = json.loads((await gateway.fetch(route, "alice", method="POST", body="{}")).body)["answerer"]
    future = ask_from_the_proxys_thread(gateway, kernel_id)
    handed: list[dict[str, Any]] = []
    for user in ("bob", None):
        for path, method, body in [
            (route, "POST", "{}"),
            (f"{route}?answerer={answerer}&wait=0", "GET", None),
            (f"{route}?answerer={answerer}", "DELETE", None),
            (f"{route}/{'0' * 32}?answerer={answerer}", "POST", {"answer": "once"}),
        ]:
            response = await gateway.fetch(path, user, method=method, body=body)
            assert response.code == 403, f"{user}: {method} {path}: {response.code}"
    unknown = "00000000-0000-4000-8000-000000000000"
    unknown_route = approvals_route(gateway, unknown)
    assert (await gateway.fetch(unknown_route, "alice", method="POST", body="{}")).code == 403
    polled = await gateway.fetch(f"{route}?answerer={answerer}&wait=0", "alice")
    handed = json.loads(polled.body)["questions"]
    assert len(handed) == 1, "bob's tries took nothing from her"
    assert not future.done()
    taken = await gateway.fetch(
        f"{route}/{handed[0]['id']}?answerer={answerer}", "bob", method="POST", body={"answer": "once"}
    )
    assert taken.code == 403
    assert not future.done()
    await gateway.fetch(f"{route}?answerer={answerer}", "alice", method="DELETE")
    assert answered(future)[0] == "deny"


# -- a session's client of the routes --------------------------------------------------------


@pytest.fixture
def alice_here(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process on the gateway as alice (GatewayClient apart from the gateway app's own)."""
    monkeypatch.setenv("KERNEL_LAUNCH_TIMEOUT", "40")  # GatewayClient writes it into os.environ
    monkeypatch.setattr(gateway_session, "_in_use", [None, 0])
    GatewayClient.clear_instance()
    use_gateway(GatewaySettings(gateway.url, gateway.tokens["alice"]))
    yield
    GatewayClient.clear_instance()


async def until(condition: Callable[[], object], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_sessions_handler_is_asked_in_a_thread_and_its_answer_obeyed(
    gateway: Gateway, alice_here: None, caplog: pytest.LogCaptureFixture
) -> None:
    kernel_id = await gateway.start("alice")
    asked: list[tuple[ApprovalRequest, str]] = []
    answers = iter(["once", "kernel", "deny"])

    def handler(request: ApprovalRequest) -> str:
        asked.append((request, threading.current_thread().name))
        if request.method == "RAISE":
            raise RuntimeError("the program's bug")
        return next(answers)

    approvals = GatewayApprovals(kernel_id, handler)
    await approvals.start()
    try:
        queue = gateway.km.get_kernel(kernel_id).provisioner.approval_handler
        assert isinstance(queue, ApprovalQueue)
        for expected in ("once", "kernel", "deny"):
            assert await asyncio.wrap_future(queue.ask(REQUEST)) == (expected, HANDLER)
        assert [request for request, _ in asked] == [
            ApprovalRequest(kernel_id, "pypi.org", 443, "CONNECT", 20.0)
        ] * 3
        assert all(thread != threading.current_thread().name for _, thread in asked)
        with caplog.at_level(logging.ERROR, gateway_approvals.__name__):
            raising = ApprovalRequest(kernel_id, "pypi.org", 443, "RAISE", 20.0)
            assert await asyncio.wrap_future(queue.ask(raising)) == ("deny", HANDLER)
        assert "the approval handler failed" in caplog.text
    finally:
        await approvals.stop()
    assert gateway.km.get_kernel(kernel_id).provisioner.approval_handler is None


async def test_a_slow_handler_is_too_late_and_a_stopped_session_leaves_denials(
    gateway: Gateway, alice_here: None, caplog: pytest.LogCaptureFixture
) -> None:
    kernel_id = await gateway.start("alice")
    started: list[ApprovalRequest] = []
    gates = [threading.Event(), threading.Event()]

    def slow(request: ApprovalRequest) -> str:
        started.append(request)
        gates[len(started) - 1].wait(10)
        return "once"

    approvals = GatewayApprovals(kernel_id, slow)
    await approvals.start()
    queue = gateway.km.get_kernel(kernel_id).provisioner.approval_handler
    assert isinstance(queue, ApprovalQueue)
    try:
        future = queue.ask(REQUEST)
        await until(lambda: len(started) == 1)
        assert future.cancel(), "the egress proxy's approval_timeout: a denial"
        with caplog.at_level(logging.INFO, gateway_approvals.__name__):
            gates[0].set()
            await until(lambda: "came too late" in caplog.text)
        waiting = queue.ask(REQUEST)
        await until(lambda: len(started) == 2)
        await approvals.stop()
        assert answered(waiting) == ("deny", RELEASED), "the session's end denies what it left open"
    finally:
        for gate in gates:
            gate.set()


async def test_a_poll_whose_connection_closes_no_longer_counts_as_the_session_waiting(
    gateway: Gateway,
) -> None:
    """A program killed while it waits closes its connection: from then on its lease runs out."""
    kernel_id = await gateway.start("alice")
    route = approvals_route(gateway, kernel_id)
    answerer = json.loads((await gateway.fetch(route, "alice", method="POST", body="{}")).body)["answerer"]
    queue = gateway.km.get_kernel(kernel_id).provisioner.approval_handler
    assert isinstance(queue, ApprovalQueue)
    with pytest.raises(HTTPTimeoutError):  # the client gives up and closes its connection
        await gateway.fetch(f"{route}?answerer={answerer}&wait=20", "alice", request_timeout=0.5)
    await until(lambda: queue._polls == 0, timeout=5)
