"""Requests the policy leaves to the kernel's holder, at the proxy: who is asked, how
often, and what an answer (or none) does. The holder here is a test's approver."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import urllib.error
import uuid
from collections.abc import Iterator

import pytest

from sandbox_kernel.egress import ApprovalRequest, EgressProxy
from sandbox_kernel.egress.rules import EgressRules
from sandbox_kernel.plan.plan import narrow_settings
from sandbox_kernel.provisioner import SandboxProvisioner

from . import test_egress
from .test_egress import Relay, Sandbox, Upstreams, policy

# The relay and upstream fixtures of the egress tests.
relay, relay_dir, upstreams = test_egress.relay, test_egress.relay_dir, test_egress.upstreams


class Holder:
    """Answers when the test says so; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[ApprovalRequest] = []
        self.futures: list[concurrent.futures.Future[tuple[str, str]]] = []

    def __call__(self, request: ApprovalRequest) -> concurrent.futures.Future[tuple[str, str]]:
        self.asked.append(request)
        future: concurrent.futures.Future[tuple[str, str]] = concurrent.futures.Future()
        self.futures.append(future)
        return future

    def answer(self, answer: str, timeout: float = 5) -> None:
        deadline = time.monotonic() + timeout
        while not any(not f.done() for f in self.futures) and time.monotonic() < deadline:
            time.sleep(0.01)
        for future in self.futures:
            if not future.done():
                future.set_result((answer, "by the test"))


@pytest.fixture
def asking(
    relay: Relay, upstreams: Upstreams, request: pytest.FixtureRequest
) -> Iterator[tuple[Sandbox, Holder]]:
    """A kernel whose holder is asked, within approval_timeout 1 s (or the test's parameter)."""
    sandbox = Sandbox(f"test-{uuid.uuid4().hex[:8]}", relay.port, upstreams)
    holder = Holder()
    EgressProxy.instance().add_kernel(
        sandbox.kernel_id,
        relay.socket_path,
        policy(
            upstreams,
            approval="egress",
            approval_timeout=getattr(request, "param", 1.0),
            approvable=EgressRules.parse([f"other.test:{upstreams.http}"]),
        ),
        sandbox.decisions.append,
        approver=holder,
    )
    yield sandbox, holder
    EgressProxy.instance().remove_kernel(sandbox.kernel_id)


def fetch(sandbox: Sandbox, host: str = "other.test") -> str:
    try:
        sandbox.get(f"http://{host}:{sandbox.upstreams.http}/asked")
    except urllib.error.HTTPError as exc:
        return f"{exc.code} {exc.reason}"
    return "OK"


@pytest.mark.parametrize("asking", [30.0], indirect=True)  # (a loaded machine is slow to ask)
def test_concurrent_requests_for_one_destination_share_one_question(
    asking: tuple[Sandbox, Holder], monkeypatch: pytest.MonkeyPatch
) -> None:
    sandbox, holder = asking
    # The requests that came to the question: each waits on it from then on (nothing
    # between), so that the one answer below is for all three.
    kernel = EgressProxy.instance()._kernels[sandbox.kernel_id]
    came: list[str] = []
    ask = kernel.ask

    async def counted(host: str, port: int, method: str) -> str:
        came.append(host)
        return await ask(host, port, method)

    monkeypatch.setattr(kernel, "ask", counted)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(fetch(sandbox))) for _ in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(came) < 3:
        assert time.monotonic() < deadline, f"{len(came)} of 3 requests came to the question in 30 s"
        time.sleep(0.01)
    holder.answer("once")
    for thread in threads:
        thread.join(30)
    assert results == ["OK"] * 3
    assert len(holder.asked) == 1
    assert [d["reason"] for d in sandbox.take(3)] == ["approved by the test, once"] * 3
    assert holder.asked[0].timeout == 30.0, "the question can say how long it waits"


def test_once_asks_again_kernel_does_not_deny_says_who(asking: tuple[Sandbox, Holder]) -> None:
    sandbox, holder = asking
    threading.Timer(0.2, holder.answer, ["once"]).start()
    assert fetch(sandbox) == "OK"
    threading.Timer(0.2, holder.answer, ["deny"]).start()
    assert fetch(sandbox).startswith("403 sandbox-kernel egress denied: a connection to other.test")
    assert "needed approval and was denied by the test" in sandbox.take(2)[1]["reason"]
    threading.Timer(0.2, holder.answer, ["kernel"]).start()
    assert fetch(sandbox) == "OK"
    assert fetch(sandbox) == "OK"
    assert len(holder.asked) == 3, "approved for the kernel: not asked again"
    assert EgressProxy.instance().approved_domains(sandbox.kernel_id) == (
        f"other.test:{sandbox.upstreams.http}",
    ), "what the policy dialog shows"
    assert sandbox.take(2)[1]["reason"] == f"allowed by 'other.test:{sandbox.upstreams.http}'"


def test_no_answer_in_time_is_a_denial(asking: tuple[Sandbox, Holder]) -> None:
    sandbox, holder = asking
    started = time.monotonic()
    assert "no answer within 1 s (approval_timeout)" in fetch(sandbox)
    assert time.monotonic() - started < 3
    assert holder.futures[0].cancelled(), "the question is withdrawn"
    sandbox.take(1)


def test_beyond_the_approvable_domains_nobody_is_asked(asking: tuple[Sandbox, Holder]) -> None:
    sandbox, holder = asking
    assert fetch(sandbox, "private.test").startswith("403")
    assert holder.asked == []
    sandbox.take(1)


def test_a_domain_the_start_took_out_is_denied_not_asked_about(relay: Relay, upstreams: Upstreams) -> None:
    holder = Holder()
    sandbox = Sandbox(f"test-{uuid.uuid4().hex[:8]}", relay.port, upstreams)
    EgressProxy.instance().add_kernel(
        sandbox.kernel_id,
        relay.socket_path,
        policy(
            upstreams,
            approval="egress",
            approvable=EgressRules.parse([f"other.test:{upstreams.http}"]),
            withheld=EgressRules.parse([f"other.test:{upstreams.http}"]),
        ),
        sandbox.decisions.append,
        approver=holder,
    )
    try:
        assert fetch(sandbox).startswith("403")
        assert holder.asked == []
        assert "(its start removed it)" in str(sandbox.decision()["reason"])
    finally:
        EgressProxy.instance().remove_kernel(sandbox.kernel_id)


def test_without_approval_the_policy_alone_decides(relay: Relay, upstreams: Upstreams) -> None:
    sandbox = test_egress.register(
        relay, upstreams, approvable=EgressRules.parse([f"other.test:{upstreams.http}"])
    )
    try:
        assert fetch(sandbox).startswith("403")
        assert "is not in this kernel's allowed domains" in str(sandbox.decision()["reason"])
    finally:
        EgressProxy.instance().remove_kernel(sandbox.kernel_id)


def test_a_start_that_narrows_the_domains_withholds_what_it_took_out() -> None:
    prov = SandboxProvisioner(
        kernel_id="k1",
        parent=None,
        network="allowlist",
        allowed_domains=["a.x.test", "*.b.x.test"],
        max_allowed_domains=["*.x.test"],
        approval="egress",
    )
    narrow_settings(prov, {"allowed_domains": ["a.x.test"]})
    egress = prov.egress_policy()
    assert egress is not None
    assert egress.withheld.patterns == ("*.b.x.test",)
    assert egress.approvable.allows("c.x.test", 443), "the rest of the ceiling is still asked about"
    narrow_settings(prov, {})  # the next start, narrowing nothing
    assert prov.withheld_domains == []
