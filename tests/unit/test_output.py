"""OutputLimiter on real, signed Jupyter messages, including ones a hostile kernel forges."""

from __future__ import annotations

from typing import Any

import zmq
from jupyter_client.session import Session

from sandbox_kernel.output import OutputLimiter

KEY = b"secret-key"


class Running:
    """What the host knows is executing; tests move it along as clients would."""

    def __init__(self) -> None:
        self.msg_id: str | None = "cell-1"

    def __call__(self) -> tuple[str, dict[str, Any]] | None:
        if self.msg_id is None:
            return None
        return self.msg_id, {"msg_id": self.msg_id, "msg_type": "execute_request"}


def kernel_message(
    session: Session, kind: str, content: dict[str, object], parent_id: str
) -> list[zmq.Frame]:
    msg = session.msg(kind, content, parent={"msg_id": parent_id, "msg_type": "execute_request"})
    return [zmq.Frame(part) for part in session.serialize(msg, ident=[kind.encode()])]


def stream(session: Session, size: int, parent_id: str = "cell-1") -> list[zmq.Frame]:
    return kernel_message(session, "stream", {"name": "stdout", "text": "x" * size}, parent_id)


def test_output_past_the_budget_becomes_one_signed_notice_then_nothing() -> None:
    kernel = Session(key=KEY)
    limiter = OutputLimiter(2000, Session(key=KEY), Running())
    small = stream(kernel, 100)
    big = stream(kernel, 3000)

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


def test_a_new_request_from_a_client_gets_a_new_budget() -> None:
    kernel = Session(key=KEY)
    running = Running()
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    assert len(limiter.admit(stream(kernel, 3000))) == 1  # the notice
    running.msg_id = "cell-2"
    fresh = stream(kernel, 100, "cell-2")
    assert limiter.admit(fresh) == [fresh]


def test_a_hostile_kernel_cannot_open_fresh_budgets() -> None:
    kernel = Session(key=KEY)
    limiter = OutputLimiter(2000, Session(key=KEY), Running())
    assert len(limiter.admit(stream(kernel, 3000))) == 1  # over budget: the notice
    forged = [
        stream(kernel, 500, "invented-parent"),
        kernel_message(kernel, "comm_msg", {"data": "y" * 500}, "cell-1"),
        kernel_message(kernel, "status", {"execution_state": "idle", "pad": "z" * 2000}, "cell-1"),
    ]
    for message in forged:
        assert limiter.admit(message) == [], message[1]
    # Small status messages still pass, so clients see the kernel go idle.
    idle = kernel_message(kernel, "status", {"execution_state": "idle"}, "cell-1")
    assert limiter.admit(idle) == [idle]


def test_non_jupyter_frames_from_the_kernel_are_dropped() -> None:
    limiter = OutputLimiter(10_000, Session(key=KEY), Running())
    assert limiter.admit([zmq.Frame(b"no delimiter")]) == []
    junk = [zmq.Frame(b"<IDS|MSG>"), zmq.Frame(b"sig"), zmq.Frame(b"not json" * 10)]
    junk += [zmq.Frame(b"{}"), zmq.Frame(b"{}"), zmq.Frame(b"{}")]
    assert limiter.admit(junk) == [junk]  # well-formed enough: charged, passed


def test_invalid_utf8_in_a_frame_is_read_as_ipykernel_reads_it() -> None:
    from sandbox_kernel.wire import load_dict

    assert load_dict(b'{"code": "print(1) # \xff"}') == {"code": "print(1) # \ufffd"}
    assert load_dict(b"[1, 2]") == {}
    assert load_dict(b"x" * (65 * 1024)) == {}


def test_output_after_the_reply_still_counts_against_its_request() -> None:
    kernel = Session(key=KEY)
    running = Running()
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    assert limiter.admit(stream(kernel, 1500)) != []
    running.msg_id = None  # the reply overtook the tail of the output
    assert len(limiter.admit(stream(kernel, 1500))) == 1  # the notice, not a fresh budget


def status(session: Session, state: str = "busy", **extra: Any) -> list[zmq.Frame]:
    return kernel_message(session, "status", {"execution_state": state, **extra}, "cell-1")


def test_status_messages_are_charged_and_padded_ones_stop_at_the_cap() -> None:
    """The red team pushed 52.6 MB through a 1 MiB cap as small padded status messages."""
    kernel = Session(key=KEY)
    limiter = OutputLimiter(10_000, Session(key=KEY), Running())
    padded = status(kernel, p="A" * 560)
    passed = sum(sum(len(f) for f in m) for _ in range(2000) for m in limiter.admit(padded))
    assert passed < 10_000 + 2_000  # the budget, plus one notice


def test_past_the_cap_a_few_plain_status_messages_still_pass() -> None:
    """After a capped execution, clients must still see the kernel go idle."""
    kernel = Session(key=KEY)
    limiter = OutputLimiter(2000, Session(key=KEY), Running())
    limiter.admit(stream(kernel, 3000))
    idle = status(kernel, "idle")
    assert limiter.admit(idle) == [idle]
    passed = [limiter.admit(idle) for _ in range(100)]
    assert sum(1 for p in passed if p) < 20
