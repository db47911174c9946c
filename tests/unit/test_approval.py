"""Asking the kernel's holder on stdin: the prompt goes to the client running the cell,
its answer is taken before the kernel sees it, and the kernel's own input() is left alone."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
from jupyter_client.session import Session

from sandbox_kernel.channels.approval import AMBIGUOUS, ApprovalBroker, DeferredHandler, question
from sandbox_kernel.channels.audit import ExecutionAuditor
from sandbox_kernel.channels.wire import find_delimiter
from sandbox_kernel.egress import ApprovalRequest

CLIENT = [b"client-session"]
REQUEST = ApprovalRequest("k1", "other.test", 443, "CONNECT", 20.0)


class Setup:
    def __init__(self, allow_stdin: bool = True, handler: Any = None) -> None:
        self.session = Session(key=b"secret")
        self.auditor = ExecutionAuditor(None, "k1", "ks")
        self.sent: list[list[bytes]] = []
        self.broker = ApprovalBroker("k1", self.auditor, self.session, self.sent.append, lambda: handler)
        self.auditor.on_stdin = self.broker.on_stdin
        execute = self.session.msg("execute_request", {"code": "fetch()", "allow_stdin": allow_stdin})
        self.execute = execute
        assert self.auditor("shell", True, self.session.serialize(execute, ident=CLIENT))

    def reply(self, value: str, parent: dict[str, Any] | None) -> bool:
        msg = self.session.msg("input_reply", {"value": value}, parent=parent or {})
        return self.auditor("stdin", True, self.session.serialize(msg, ident=CLIENT))

    def prompt(self) -> dict[str, Any]:
        frames = self.sent[0]
        index = find_delimiter(frames)
        assert index is not None
        assert frames[:index] == CLIENT, "to the client that runs the cell"
        msg = self.session.deserialize(frames[index + 1 :])
        return msg


def answer(future: concurrent.futures.Future[tuple[str, str]]) -> tuple[str, str]:
    return future.result(timeout=5)


def test_the_prompt_is_the_host_s_signed_stdin_request_for_the_running_cell() -> None:
    setup = Setup()
    future = setup.broker.ask(REQUEST)
    msg = setup.prompt()  # deserialize checks the signature
    assert msg["msg_type"] == "input_request"
    assert msg["parent_header"]["msg_id"] == setup.execute["header"]["msg_id"]
    assert msg["content"]["prompt"] == question(REQUEST)
    assert not future.done()
    assert setup.reply("once", msg["header"]) is False, "the answer never reaches the kernel"
    assert answer(future) == ("once", "at the prompt")


def test_the_question_is_in_plain_words_and_says_how_long_it_waits() -> None:
    assert question(REQUEST) == (
        "Sandbox: allow a connection to other.test:443? It is not among this kernel's allowed "
        "domains. Type once (this time), kernel (from now on, in this kernel) or deny; "
        "no answer within 20 s denies: "
    )


@pytest.mark.parametrize(
    ("typed", "meaning"),
    [
        ("once", "once"),
        (" Kernel\n", "kernel"),
        ("deny", "deny"),
        # The README: anything else denies.
        ("yes", "deny"),
        ("y", "deny"),
        ("always", "deny"),
        ("k", "deny"),
        ("", "deny"),
    ],
)
def test_jupyter_client_s_input_answers_without_a_parent(typed: str, meaning: str) -> None:
    setup = Setup()
    future = setup.broker.ask(REQUEST)
    assert setup.reply(typed, None) is False
    assert answer(future)[0] == meaning


def kernel_asks(setup: Setup, idents: list[bytes], prompt: str = "name? ") -> None:
    own = setup.session.msg("input_request", {"prompt": prompt, "password": False})
    assert setup.auditor("stdin", False, setup.session.serialize(own, ident=idents))


def test_the_kernel_s_own_input_is_left_to_the_kernel() -> None:
    setup = Setup()
    kernel_asks(setup, CLIENT)
    future = setup.broker.ask(REQUEST)
    assert setup.reply("Ada", None) is True, "a parentless answer while the kernel asks is the kernel's"
    assert answer(future) == ("deny", AMBIGUOUS), "and ours cannot be told apart: denied"
    assert setup.reply("once", setup.prompt()["header"]) is False, "a late answer is still taken off"
    assert answer(future)[0] == "deny"


def test_the_kernel_cannot_word_a_prompt_to_get_our_yes() -> None:
    """Our prompt, then the kernel's "type yes to continue": the user's deny for ours must
    not count as the kernel's, nor the user's yes for the kernel's as ours."""
    setup = Setup()
    future = setup.broker.ask(REQUEST)
    kernel_asks(setup, CLIENT, "Type yes to continue: ")
    assert setup.reply("deny", None) is True
    assert setup.reply("yes", None) is True
    assert answer(future) == ("deny", AMBIGUOUS)


def test_the_kernel_cannot_hide_its_prompt_behind_another_route() -> None:
    setup = Setup()
    future = setup.broker.ask(REQUEST)
    kernel_asks(setup, [*CLIENT, b"decoy"], "Type yes to continue: ")  # the client sees it all the same
    assert setup.reply("yes", None) is True
    assert answer(future) == ("deny", AMBIGUOUS)


def test_prompts_to_clients_that_run_no_cell_are_not_counted() -> None:
    setup = Setup()
    for i in range(1000):
        kernel_asks(setup, [f"nobody-{i}".encode()])
    assert setup.broker._kernel_asking == {}, "the kernel cannot grow the host's memory"


def test_our_prompt_ids_cannot_be_guessed() -> None:
    setup = Setup()
    setup.broker.ask(REQUEST)
    setup.broker.ask(REQUEST)
    ids = [
        setup.session.deserialize(frames[frames.index(b"<IDS|MSG>") + 1 :])["header"]["msg_id"]
        for frames in setup.sent
    ]
    assert all(len(msg_id) == 32 for msg_id in ids)
    assert not ids[0].startswith(setup.session.session), "not jupyter_client's session_pid_counter"


def test_a_client_that_cannot_answer_is_not_asked() -> None:
    setup = Setup(allow_stdin=False)
    verdict, why = answer(setup.broker.ask(REQUEST))
    assert verdict == "deny"
    assert "cannot answer prompts (allow_stdin is false) and no approval_handler is set" in why
    assert "SandboxSession(approval_handler=...)" in why
    assert setup.sent == []


def test_a_program_s_handler_answers_instead() -> None:
    asked: list[ApprovalRequest] = []
    setup = Setup(handler=lambda request: asked.append(request) or "kernel")
    assert answer(setup.broker.ask(REQUEST)) == ("kernel", "by the approval_handler")
    assert asked == [REQUEST]
    assert setup.sent == []
    assert answer(Setup(handler=lambda request: "yes").broker.ask(REQUEST))[0] == "deny"
    failing = Setup(handler=lambda request: 1 / 0)
    assert answer(failing.broker.ask(REQUEST)) == (
        "deny",
        "because the approval_handler raised an exception (see the log)",
    )


def test_a_deferred_holder_is_handed_the_question_and_no_thread_waits_for_it() -> None:
    """A holder elsewhere (a session on a sandbox gateway) gets the request and answers the
    future it returned, later; nobody is prompted on stdin."""

    class Later(DeferredHandler):
        def __init__(self) -> None:
            self.asked: list[tuple[ApprovalRequest, concurrent.futures.Future[tuple[str, str]]]] = []

        def ask(self, request: ApprovalRequest) -> concurrent.futures.Future[tuple[str, str]]:
            future: concurrent.futures.Future[tuple[str, str]] = concurrent.futures.Future()
            self.asked.append((request, future))
            return future

    later = Later()
    setup = Setup(handler=later)
    future = setup.broker.ask(REQUEST)
    ((request, given),) = later.asked
    assert (request, given) == (REQUEST, future)
    assert setup.sent == []
    given.set_result(("once", "by the approval_handler"))
    assert answer(future) == ("once", "by the approval_handler")
