"""OutputLimiter on real, signed Jupyter messages."""

from __future__ import annotations

import json

import zmq
from jupyter_client.session import Session

from sandbox_kernel.output import OutputLimiter

KEY = b"secret-key"


def kernel_message(
    session: Session, kind: str, content: dict[str, object], parent_id: str
) -> list[zmq.Frame]:
    msg = session.msg(kind, content, parent={"msg_id": parent_id, "msg_type": "execute_request"})
    return [zmq.Frame(part) for part in session.serialize(msg, ident=[kind.encode()])]


def test_output_past_the_budget_becomes_one_signed_notice_then_nothing() -> None:
    kernel = Session(key=KEY)
    limiter = OutputLimiter(1000, Session(key=KEY))
    small = kernel_message(kernel, "stream", {"name": "stdout", "text": "x" * 100}, "cell-1")
    big = kernel_message(kernel, "stream", {"name": "stdout", "text": "x" * 2000}, "cell-1")

    assert limiter.admit(small) == [small]
    (notice,) = limiter.admit(big)
    assert limiter.admit(big) == []
    assert limiter.admit(small) == []

    client = Session(key=KEY)
    idents, parts = client.feed_identities(notice, copy=True)
    assert idents == [b"stream.stderr"]
    msg = client.deserialize(parts)  # raises if the signature is wrong
    assert msg["msg_type"] == "stream"
    assert msg["content"]["name"] == "stderr"
    assert "Output truncated" in msg["content"]["text"]
    assert msg["parent_header"]["msg_id"] == "cell-1"


def test_the_budget_is_per_execution_and_resets_when_it_goes_idle() -> None:
    kernel = Session(key=KEY)
    limiter = OutputLimiter(1000, Session(key=KEY))
    big = kernel_message(kernel, "stream", {"name": "stdout", "text": "x" * 2000}, "cell-1")
    other = kernel_message(kernel, "stream", {"name": "stdout", "text": "y" * 100}, "cell-2")
    idle = kernel_message(kernel, "status", {"execution_state": "idle"}, "cell-1")

    assert len(limiter.admit(big)) == 1  # the notice
    assert limiter.admit(other) == [other]
    assert limiter.admit(idle) == [idle]
    assert limiter.admit(big)[0] is not big  # spent again from zero: notice again
    busy = kernel_message(kernel, "status", {"execution_state": "busy"}, "cell-3")
    assert limiter.admit(busy) == [busy]


def test_a_message_with_an_unreadable_header_counts_as_output() -> None:
    limiter = OutputLimiter(10, Session(key=KEY))
    junk = [zmq.Frame(b"<IDS|MSG>"), zmq.Frame(b"sig"), zmq.Frame(b"not json" * 10)]
    junk += [zmq.Frame(b"{}"), zmq.Frame(b"{}"), zmq.Frame(json.dumps({"x": 1}).encode())]
    assert len(limiter.admit(junk)) == 1  # the notice, not the junk
    assert limiter.admit([zmq.Frame(b"no delimiter")])[0][0].bytes == b"no delimiter"
