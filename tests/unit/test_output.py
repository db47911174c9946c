"""OutputLimiter on real, signed Jupyter messages, including ones a hostile kernel forges."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import pytest
import zmq
from jupyter_client.session import Session

from sandbox_kernel.channels.output import (
    TAIL_BYTES,
    Message,
    OutputLimiter,
    _Tail,
    amount,
    requested_limit,
    tail_reserve,
)

KEY = b"secret-key"


class Running:
    """What the host knows is executing; tests move it along as clients would."""

    def __init__(self) -> None:
        self.msg_id: str | None = "cell-1"
        #: Cells running beside it on subshells, begun after it.
        self.beside: list[str] = []

    def __call__(self) -> list[tuple[str, dict[str, Any]]]:
        running = ([] if self.msg_id is None else [self.msg_id]) + self.beside
        return [(msg_id, {"msg_id": msg_id, "msg_type": "execute_request"}) for msg_id in running]


def kernel_message(
    session: Session, kind: str, content: dict[str, object], parent_id: str
) -> list[zmq.Frame]:
    msg = session.msg(kind, content, parent={"msg_id": parent_id, "msg_type": "execute_request"})
    return [zmq.Frame(part) for part in session.serialize(msg, ident=[kind.encode()])]


def stream(session: Session, size: int, parent_id: str = "cell-1") -> list[zmq.Frame]:
    return kernel_message(session, "stream", {"name": "stdout", "text": "x" * size}, parent_id)


def printed(session: Session, text: str, name: str = "stdout", parent_id: str = "cell-1") -> list[zmq.Frame]:
    return kernel_message(session, "stream", {"name": name, "text": text}, parent_id)


def status(session: Session, state: str = "busy", parent_id: str = "cell-1", **extra: Any) -> list[zmq.Frame]:
    return kernel_message(session, "status", {"execution_state": state, **extra}, parent_id)


def execute_request(session: Session, msg_id: str, metadata: dict[str, Any]) -> list[bytes]:
    msg = session.msg("execute_request", {"code": "print(1)"}, metadata=metadata)
    msg["header"]["msg_id"] = msg_id
    return list(session.serialize(msg, ident=[b"client"]))


def read(messages: Sequence[Sequence[zmq.Frame | bytes]]) -> list[dict[str, Any]]:
    """What a client makes of ``messages``: each must carry a valid signature."""
    client = Session(key=KEY)
    parsed = []
    for message in messages:
        _, parts = client.feed_identities([bytes(f) if isinstance(f, zmq.Frame) else f for f in message])
        parsed.append(client.deserialize(parts))  # raises if the signature is wrong
    return parsed


def streams(messages: list[dict[str, Any]], name: str = "stdout") -> str:
    return "".join(
        m["content"]["text"] for m in messages if m["msg_type"] == "stream" and m["content"]["name"] == name
    )


def test_a_huge_print_keeps_its_head_and_tail_with_a_marker_between() -> None:
    """One 60 kB print through a 20 000-byte budget: the client reads the start, a marker
    saying how much was dropped, and the end, all within the budget."""
    kernel = Session(key=KEY)
    limiter = OutputLimiter(20_000, Session(key=KEY), Running())
    assert limiter.admit(stream(kernel, 100)) != []
    during = read(limiter.admit(printed(kernel, "A" * 30_000 + "MIDDLE" + "Z" * 30_000)))
    idle = status(kernel, "idle")
    after = limiter.admit(idle)
    assert after[-1] == idle  # the tail comes before the kernel's idle
    received = during + read(after[:-1])
    assert all(m["parent_header"]["msg_id"] == "cell-1" for m in received)
    assert "Output truncated: this execution produced more than 19.5 KiB of output" in streams(
        received, "stderr"
    )

    out = streams(received)
    head, marker, tail = out.removeprefix("x" * 100).split("\n", 2)[0], *out.split("\n")[1:3]
    assert head == "A" * len(head)
    assert len(head) > 10_000
    assert tail == "Z" * tail_reserve(20_000)
    assert "MIDDLE" not in out
    dropped = 60_006 - len(head) - len(tail)
    limit = "this kernel's output limit of 19.5 KiB per execution"
    assert marker == f"[... {amount(dropped)} of output dropped: over {limit} ...]"
    assert sum(len(f) for m in during for f in m) + sum(len(f) for m in after for f in m) < 20_000 + 2_000
    assert limiter.release() == []  # nothing held any more


def test_output_past_the_budget_gets_one_signed_notice_and_only_the_tail_follows() -> None:
    kernel = Session(key=KEY)
    limiter = OutputLimiter(2000, Session(key=KEY), Running())
    small = stream(kernel, 100)
    big = stream(kernel, 3000)

    assert limiter.admit(small) == [small]
    head, notice = read(limiter.admit(big))
    assert head["content"]["name"] == "stdout"
    assert set(head["content"]["text"]) == {"x"}
    assert limiter.admit(big) == []
    assert limiter.admit(small) == []

    assert notice["msg_type"] == "stream"
    assert notice["content"]["name"] == "stderr"
    assert "Output truncated" in notice["content"]["text"]
    assert notice["parent_header"]["msg_id"] == "cell-1"
    marker, tail = read(limiter.release())
    assert "of output dropped" in marker["content"]["text"]
    assert tail["content"]["text"] == "x" * tail_reserve(2000)


def test_a_message_the_meter_dropped_over_the_cap_is_told_to_the_running_cells_client() -> None:
    """The meter drops an IOPub message over the channel's cap whole, unread: the cell
    running is charged as for output past its budget (one notice; its stdout after that
    held, and shown with a marker when it ends). Under a limit above the cap, one notice."""
    kernel = Session(key=KEY)
    running = Running()
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    (notice,) = read(limiter.refused(64 * 2**20))
    assert (notice["content"]["name"], notice["parent_header"]["msg_id"]) == ("stderr", "cell-1")
    assert "Output truncated" in notice["content"]["text"]
    assert limiter.refused(64 * 2**20) == []  # (told once)
    assert limiter.admit(printed(kernel, "after\n")) == []
    marker, tail = read(limiter.release())
    assert "[... 128 MiB of output dropped" in marker["content"]["text"]
    assert tail["content"]["text"] == "after\n"

    wide = OutputLimiter(2**30, Session(key=KEY), running)
    (notice,) = read(wide.refused(64 * 2**20))
    assert "] Output dropped: a message larger than the host takes" in notice["content"]["text"]
    assert wide.refused(64 * 2**20) == []  # (told once)
    after = printed(kernel, "after\n")
    assert wide.admit(after) == [after]  # (the budget is not spent)
    running.msg_id = None
    assert OutputLimiter(2000, Session(key=KEY), running).refused(64 * 2**20) == []  # (no cell, no client)


def test_a_new_request_from_a_client_gets_a_new_budget_after_the_last_ones_tail() -> None:
    kernel = Session(key=KEY)
    running = Running()
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    assert len(limiter.admit(stream(kernel, 3000))) == 2  # the head, the notice
    running.msg_id = "cell-2"
    fresh = stream(kernel, 100, "cell-2")
    *held, passed = limiter.admit(fresh)
    assert passed == fresh
    marker, tail = read(held)
    assert marker["parent_header"]["msg_id"] == tail["parent_header"]["msg_id"] == "cell-1"


def test_a_hostile_kernel_cannot_open_fresh_budgets() -> None:
    kernel = Session(key=KEY)
    limiter = OutputLimiter(2000, Session(key=KEY), Running())
    assert len(limiter.admit(stream(kernel, 3000))) == 2  # over budget: the head, the notice
    forged = [
        stream(kernel, 500, "invented-parent"),
        kernel_message(kernel, "comm_msg", {"data": "y" * 500}, "cell-1"),
        status(kernel, "idle", pad="z" * 2000),
        status(kernel, "idle", "invented-parent"),  # an idle for another request ends nothing
    ]
    for message in forged[:3]:
        assert limiter.admit(message) == [], message[1]
    assert limiter.admit(forged[3]) == [forged[3]]
    # Small status messages still pass, so clients see the kernel go idle; the tail first.
    idle = status(kernel, "idle")
    *tail, last = limiter.admit(idle)
    assert last == idle
    assert len(streams(read(tail))) < 600  # the reserve, and a marker
    assert limiter.admit(stream(kernel, 3000)) == []  # still no fresh budget
    assert len(streams(read(limiter.release()))) < 600


def test_cells_running_on_subshells_at_once_each_have_their_own_budget_and_tail() -> None:
    """Was: everything was charged to the cell begun first, so a subshell's small output,
    while the main cell was past its cap, was held in the main cell's tail or dropped."""
    kernel = Session(key=KEY)
    running = Running()
    running.beside = ["sub-1"]
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    assert len(limiter.admit(stream(kernel, 3000))) == 2  # cell-1 past its cap: the head, the notice
    small = printed(kernel, "progress 50%", parent_id="sub-1")
    assert limiter.admit(small) == [small]  # whole, and cell-1's tail stays held
    assert limiter.admit(stream(kernel, 3000, "sub-1"))[0] != small  # sub-1 past its own cap
    sub_idle = status(kernel, "idle", "sub-1")
    *sub_tail, last = limiter.admit(sub_idle)
    assert last == sub_idle
    marker, tail = read(sub_tail)
    assert marker["parent_header"]["msg_id"] == tail["parent_header"]["msg_id"] == "sub-1"
    assert tail["content"]["text"] == "x" * tail_reserve(2000)
    running.beside = []
    idle = status(kernel, "idle")
    *main_tail, last = limiter.admit(idle)
    assert last == idle
    assert {m["parent_header"]["msg_id"] for m in read(main_tail)} == {"cell-1"}
    assert limiter.release() == []


def test_a_subshells_held_tail_goes_out_once_its_cell_ends_without_its_idle() -> None:
    kernel = Session(key=KEY)
    running = Running()
    running.beside = ["sub-1"]
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    assert len(limiter.admit(stream(kernel, 3000, "sub-1"))) == 2
    own = stream(kernel, 10)
    assert limiter.admit(own) == [own]  # cell-1's, within its budget; sub-1's tail stays
    running.beside = []  # sub-1 answered; its idle withheld
    small = stream(kernel, 10)
    *held, passed = limiter.admit(small)
    assert passed == small
    assert {m["parent_header"]["msg_id"] for m in read(held)} == {"sub-1"}


def test_a_subshells_last_line_read_after_its_reply_is_still_its_own() -> None:
    """Found by the integration test: the bridge reads shell first, so a subshell cell's
    last print came after its reply, when the cell no longer ran, and went into the main
    cell's held tail."""
    kernel = Session(key=KEY)
    running = Running()
    running.beside = ["sub-1"]
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    assert len(limiter.admit(stream(kernel, 3000))) == 2  # cell-1 past its cap
    first = printed(kernel, "line 0\n", parent_id="sub-1")
    assert limiter.admit(first) == [first]
    running.beside = []  # sub-1's reply passed
    last = printed(kernel, "line 1\n", parent_id="sub-1")
    assert limiter.admit(last) == [last]
    marker, tail = read(limiter.release())
    assert marker["parent_header"]["msg_id"] == tail["parent_header"]["msg_id"] == "cell-1"


def test_a_hostile_kernel_beside_subshells_charges_only_cells_that_run() -> None:
    """Claiming a parent that does not run (invented, or a cell answered before) charges
    the cell begun first; a forged idle releases only the tail of the cell it names."""
    kernel = Session(key=KEY)
    running = Running()
    running.beside = ["sub-1"]
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    assert len(limiter.admit(stream(kernel, 3000, "invented-parent"))) == 2  # charged to cell-1
    assert limiter.admit(stream(kernel, 500, "cell-0")) == []  # cell-1's, past its cap
    small = stream(kernel, 100, "sub-1")
    assert limiter.admit(small) == [small]  # sub-1's budget is untouched
    forged_idle = status(kernel, "idle", "sub-1")
    assert limiter.admit(forged_idle) == [forged_idle]  # nothing of cell-1's released
    marker, tail = read(limiter.release())
    assert marker["parent_header"]["msg_id"] == "cell-1"
    assert tail["content"]["text"] == "x" * tail_reserve(2000)


def sent_bytes(messages: Sequence[Message], parent_id: str) -> int:
    """Bytes of ``messages`` that reach clients under ``parent_id``."""
    return sum(
        sum(len(frame) for frame in message)
        for message, parsed in zip(messages, read(messages), strict=True)
        if parsed["parent_header"].get("msg_id") == parent_id
    )


def test_a_tail_held_and_released_again_and_again_sends_no_more_markers() -> None:
    """Found by a review: once a cell's tail went out, each later print charged to it was
    held in a tail of 0 bytes, and each release sent a marker anyway: a kernel alternating
    prints that claim two cells that ended (during Run All) sent one of them 237 kB more
    under a 2000-byte cap; between requests, a print and a forged idle did the same."""
    kernel = Session(key=KEY)
    running = Running()
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    limiter.admit(stream(kernel, 10, "cell-1"))
    running.msg_id = "cell-0"
    limiter.admit(stream(kernel, 10, "cell-0"))
    running.msg_id = "cell-1"
    out = limiter.admit(stream(kernel, 3000))  # cell-1 past its cap
    running.msg_id = "cell-2"  # cell-1 answered; both it and cell-0 ended lately
    out += limiter.admit(stream(kernel, 10, "cell-2"))  # cell-1's tail goes out
    assert "of output dropped" in streams(read(out))
    cycles: list[Message] = []
    for _ in range(500):
        cycles += limiter.admit(stream(kernel, 10, "cell-1"))
        cycles += limiter.admit(stream(kernel, 10, "cell-0"))
    markers = [m for m in read(cycles) if m["parent_header"]["msg_id"] == "cell-1"]
    assert len(markers) <= 4  # a few markers without text, then nothing
    assert all("of output dropped" in m["content"]["text"] for m in markers)

    running.msg_id = None  # between requests: charged to the last one sent
    limiter.request(execute_request(kernel, "cell-3", {}))
    assert len(limiter.admit(stream(kernel, 3000, "cell-3"))) == 2
    after = limiter.admit(status(kernel, "idle", "cell-3"))
    for _ in range(500):
        after += limiter.admit(stream(kernel, 10, "cell-3"))
        after += limiter.admit(status(kernel, "idle", "cell-3"))
    assert [m["msg_type"] for m in read(after)].count("stream") <= 2 + 4  # the first marker and tail
    assert len(after) <= 2 + 4 + 16  # a few markers more, and the statuses that pass past the cap


def test_output_dropped_after_a_cells_tail_went_out_is_still_told() -> None:
    """Found by the review of the fix above: a thread the cell started printed 1 MB after
    the cell's tail had gone out, and no marker ever said so."""
    kernel = Session(key=KEY)
    running = Running()
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    limiter.request(execute_request(kernel, "cell-1", {}))
    limiter.admit(stream(kernel, 3000))
    running.msg_id = None  # cell-1 answered
    assert "of output dropped" in streams(read(limiter.admit(status(kernel, "idle"))))
    for _ in range(100):  # its thread prints on between requests
        assert limiter.admit(stream(kernel, 10_000)) == []
    running.msg_id = "cell-2"
    limiter.request(execute_request(kernel, "cell-2", {}))
    later = read(limiter.admit(stream(kernel, 10, "cell-2")))
    told = streams([m for m in later if m["parent_header"]["msg_id"] == "cell-1"])
    assert "of output dropped" in told
    assert "[... 97" in told  # (KiB: 1 MB, less what the tail held)


def test_a_running_cells_budget_is_never_forgotten() -> None:
    """Found by a review: budgets are forgotten oldest first, and a subshell cell's, still
    running, went during a Run All beside it and was opened afresh: a second budget."""
    kernel = Session(key=KEY)
    running = Running()
    running.beside = ["sub-1"]
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    sent = limiter.admit(stream(kernel, 900, "sub-1"))
    for i in range(300):  # Run All on the main shell meanwhile
        running.msg_id = f"cell-{i}"
        limiter.admit(printed(kernel, "z", parent_id=f"cell-{i}"))
    sent += limiter.admit(stream(kernel, 900, "sub-1"))
    assert sent_bytes(sent, "sub-1") <= 2000


def test_a_host_notice_about_one_cell_leaves_a_running_cells_tail_held() -> None:
    """Found by a review: the bridge releases held tails before each notice of its own;
    a notice about one cell sent the tail of a cell still running on a subshell, whose
    real end was then dropped."""
    kernel = Session(key=KEY)
    running = Running()
    running.beside = ["sub-1"]
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    limiter.admit(printed(kernel, "y" * 3000, parent_id="sub-1"))  # sub-1 holds its tail
    notice = printed(kernel, "the host's word on cell-1", "stderr", "cell-1")
    assert limiter.release(notice) == []
    limiter.admit(printed(kernel, "THE END", parent_id="sub-1"))
    out = read(limiter.admit(status(kernel, "idle", "sub-1")))
    assert streams(out).endswith("THE END")
    assert limiter.release() == []


def test_a_held_tail_outlives_the_budgets_of_a_long_run_all_beside_it() -> None:
    """Budgets are forgotten oldest first, but never one whose tail is held."""
    kernel = Session(key=KEY)
    running = Running()
    running.beside = ["sub-1"]
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    limiter.admit(printed(kernel, "y" * 3000 + "END", parent_id="sub-1"))
    for i in range(300):  # Run All on the main shell meanwhile
        running.msg_id = f"cell-{i}"
        limiter.admit(printed(kernel, "z", parent_id=f"cell-{i}"))
    running.beside = []
    out = read(limiter.admit(printed(kernel, "z", parent_id="cell-299")))
    assert any(m["parent_header"]["msg_id"] == "sub-1" and m["content"]["text"].endswith("END") for m in out)


def test_a_padded_parent_header_claims_no_cell() -> None:
    """Reading which cell a message claims must not cost the bridge more than its
    signature: a parent header of 64 KiB is not read, and the message goes to the cell
    begun first."""
    kernel = Session(key=KEY)
    running = Running()
    running.beside = ["sub-1"]
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    padded = kernel.msg(
        "stream", {"name": "stdout", "text": "x" * 3000}, parent={"msg_id": "sub-1", "pad": "p" * 65_000}
    )
    assert len(limiter.admit([zmq.Frame(part) for part in kernel.serialize(padded, ident=[b"stream"])])) == 2
    small = stream(kernel, 100, "sub-1")
    assert limiter.admit(small) == [small]  # sub-1's budget untouched: cell-1 was charged


def test_a_padded_header_past_the_cap_is_not_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review: past the cap, the header of a message that is not a stream was
    parsed whole to learn its type: a comm_msg with a header of 64 KiB cost 0.7 ms."""
    from sandbox_kernel.channels import output

    kernel = Session(key=KEY)
    limiter = OutputLimiter(2000, Session(key=KEY), Running())
    limiter.admit(stream(kernel, 3000))
    message = kernel.msg("comm_msg", {"data": {}}, parent={"msg_id": "cell-1"})
    message["header"]["pad"] = [0] * 21_000
    frames = [zmq.Frame(part) for part in kernel.serialize(message, ident=[b"comm"])]
    parsed: list[int] = []
    load_dict = output.load_dict

    def counted(frame: zmq.Frame | bytes, limit: int | None = 2**16) -> dict[str, Any]:
        if limit is None or len(bytes(frame)) <= limit:
            parsed.append(len(bytes(frame)))
        return load_dict(frame, limit)

    monkeypatch.setattr(output, "load_dict", counted)
    assert limiter.admit(frames) == []
    assert max(parsed, default=0) <= 2048, parsed


def test_non_jupyter_frames_from_the_kernel_are_dropped() -> None:
    limiter = OutputLimiter(10_000, Session(key=KEY), Running())
    assert limiter.admit([zmq.Frame(b"no delimiter")]) == []
    junk = [zmq.Frame(b"<IDS|MSG>"), zmq.Frame(b"sig"), zmq.Frame(b"not json" * 10)]
    junk += [zmq.Frame(b"{}"), zmq.Frame(b"{}"), zmq.Frame(b"{}")]
    assert limiter.admit(junk) == [junk]  # well-formed enough: charged, passed


def test_invalid_utf8_in_a_frame_is_read_as_ipykernel_reads_it() -> None:
    from sandbox_kernel.channels.wire import load_dict

    assert load_dict(b'{"code": "print(1) # \xff"}') == {"code": "print(1) # \ufffd"}
    assert load_dict(b"[1, 2]") == {}
    assert load_dict(b"x" * (65 * 1024)) == {}


def test_output_after_the_reply_still_counts_against_its_request() -> None:
    kernel = Session(key=KEY)
    running = Running()
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    assert limiter.admit(stream(kernel, 1000)) != []
    running.msg_id = None  # the reply overtook the tail of the output
    (notice,) = read(limiter.admit(stream(kernel, 1500)))  # no fresh budget: no room for a head
    assert notice["content"]["name"] == "stderr"


def test_a_run_answered_before_its_output_is_read_still_has_its_own_budget() -> None:
    """The bridge reads shell before iopub: the next cell's reply may pass before any of
    its output. Its output is its own, not the capped cell's before it."""
    kernel = Session(key=KEY)
    running = Running()
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    limiter.request(execute_request(kernel, "cell-1", {}))
    assert len(limiter.admit(stream(kernel, 3000))) == 2  # the head, the notice
    limiter.request(execute_request(kernel, "cell-2", {}))
    running.msg_id = None  # cell-2 was answered before the bridge read its output
    small = stream(kernel, 10, "cell-2")
    *held, passed = limiter.admit(small)
    assert passed == small
    assert {m["parent_header"]["msg_id"] for m in read(held)} == {"cell-1"}


def test_output_of_a_cell_begun_and_answered_between_two_messages_is_still_its_own() -> None:
    """The bridge reads shell and IOPub apart: a cell can be answered, and the next one
    begun, before the bridge has read any of the first one's output (in a CI run, a cell's
    40 MiB result was told as dropped under the next cell's ``print``). Output that claims
    it is charged to it, and the next cell's output stays its own."""
    kernel = Session(key=KEY)
    running = Running()
    limiter = OutputLimiter(2000, Session(key=KEY), running)
    limiter.request(execute_request(kernel, "cell-1", {}))
    limiter.request(execute_request(kernel, "cell-2", {}))
    running.msg_id = "cell-2"  # cell-1 ran and was answered; none of its output read yet
    told = read(limiter.admit(stream(kernel, 3000, "cell-1")))  # its head, the notice
    assert {m["parent_header"]["msg_id"] for m in told} == {"cell-1"}
    mine = printed(kernel, "alive\n", parent_id="cell-2")
    *tail, passed = limiter.admit(mine)
    assert passed == mine
    assert {m["parent_header"]["msg_id"] for m in read(tail)} <= {"cell-1"}


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
    assert limiter.admit(idle)[-1] == idle
    passed = [limiter.admit(idle) for _ in range(100)]
    assert sum(1 for p in passed if p) < 20


@pytest.mark.parametrize("limit", range(1200, 1260))
def test_text_is_cut_on_utf8_character_boundaries(limit: int) -> None:
    """Characters of 1 to 4 bytes, cut at every offset: never half a character."""
    kernel = Session(key=KEY)
    limiter = OutputLimiter(limit, Session(key=KEY), Running())
    text = "aé€😀" * 1000
    received = read(limiter.admit(printed(kernel, text)) + limiter.release())
    head, tail = streams(received).split("\n[... ")
    tail = tail.split("...]\n", 1)[1]
    assert head
    assert tail
    assert text.startswith(head)
    assert text.endswith(tail)
    assert len(tail.encode()) <= tail_reserve(limit)
    assert len(tail.encode()) > tail_reserve(limit) - 4


@pytest.mark.parametrize("line", ["{i}\n", '"{i}"\\', "{i}\x01"])
def test_a_head_that_json_writes_longer_leaves_the_tail_its_room(line: str) -> None:
    """Issue #25: the head was cut to the head room by its text's UTF-8 size, but JSON
    writes a newline, a quote or a backslash in two bytes and a control character in six.
    A head of many short lines passed the head room by more than the tail's reserve, and
    the cell's last lines were dropped whole: the client read the marker, then nothing."""
    kernel = Session(key=KEY)
    limiter = OutputLimiter(20_000, Session(key=KEY), Running())
    text = "".join(line.format(i=i) for i in range(10_000))
    head = limiter.admit(printed(kernel, text))
    assert sum(len(frame) for frame in head[0]) <= 20_000 - tail_reserve(20_000)
    out = streams(read(head + limiter.admit(status(kernel, "idle"))))
    assert text.startswith(out.split("\n[... ", 1)[0])
    assert out.endswith(" ...]\n" + text[-tail_reserve(20_000) :])


def test_a_lone_surrogate_in_the_text_does_not_break_the_cut() -> None:
    """JSON can carry one (``"\\ud800"``), UTF-8 cannot: it is shown as U+FFFD."""
    kernel = Session(key=KEY)
    limiter = OutputLimiter(2000, Session(key=KEY), Running())
    msg = kernel.msg("stream", {}, parent={"msg_id": "cell-1"})
    parts = [json.dumps(msg[part], default=str).encode() for part in ("header", "parent_header", "metadata")]
    parts.append(json.dumps({"name": "stdout", "text": "\ud800x" * 3000}).encode())
    frames = [b"stream", b"<IDS|MSG>", kernel.sign(parts), *parts]
    received = read(limiter.admit(frames) + limiter.release())
    assert "\ud800" not in streams(received)
    assert "\ufffd" in streams(received)


def test_a_client_narrows_the_limit_of_one_execution() -> None:
    kernel = Session(key=KEY)
    running = Running()
    limiter = OutputLimiter(100_000, Session(key=KEY), running)
    limiter.request(execute_request(kernel, "cell-1", {"sandbox_kernel": {"output_limit": 2000}}))
    _, notice = read(limiter.admit(stream(kernel, 3000)))
    assert "more than 2 KiB of output" in notice["content"]["text"]
    marker, _ = read(limiter.release())
    assert "over the output limit of 2 KiB set for this execution" in marker["content"]["text"]
    running.msg_id = "cell-2"  # the next execution has the server's limit again
    big = stream(kernel, 3000, "cell-2")
    assert limiter.admit(big) == [big]


@pytest.mark.parametrize(
    "metadata",
    [
        {"sandbox_kernel": {"output_limit": 10**9}},  # wider than the server's: no
        {"sandbox_kernel": {"output_limit": -1}},
        {"sandbox_kernel": {"output_limit": "1k"}},
        {"sandbox_kernel": {"output_limit": 1.5}},
        {"sandbox_kernel": {"output_limit": True}},
        {"sandbox_kernel": 1000},
        {"output_limit": 1000},
        {},
    ],
)
def test_a_wider_or_malformed_per_run_limit_is_ignored(metadata: dict[str, Any]) -> None:
    kernel = Session(key=KEY)
    limiter = OutputLimiter(10_000, Session(key=KEY), Running())
    limiter.request(execute_request(kernel, "cell-1", metadata))
    big = stream(kernel, 3000)
    assert limiter.admit(big) == [big]


def test_requested_limit_reads_only_whole_bytes() -> None:
    assert requested_limit({"sandbox_kernel": {"output_limit": 0}}) == 0
    assert requested_limit({"sandbox_kernel": {"output_limit": 4096}}) == 4096
    assert requested_limit({"sandbox_kernel": {"output_limit": 4096.0}}) is None


def test_only_execute_requests_narrow_a_limit() -> None:
    kernel = Session(key=KEY)
    limiter = OutputLimiter(10_000, Session(key=KEY), Running())
    msg = kernel.msg("inspect_request", {}, metadata={"sandbox_kernel": {"output_limit": 10}})
    msg["header"]["msg_id"] = "cell-1"
    limiter.request(list(kernel.serialize(msg)))
    big = stream(kernel, 3000)
    assert limiter.admit(big) == [big]


def test_a_limit_of_zero_lets_only_notices_through() -> None:
    kernel = Session(key=KEY)
    limiter = OutputLimiter(10_000, Session(key=KEY), Running())
    limiter.request(execute_request(kernel, "cell-1", {"sandbox_kernel": {"output_limit": 0}}))
    (notice,) = read(limiter.admit(stream(kernel, 10)))
    assert notice["content"]["name"] == "stderr"
    (marker,) = read(limiter.release())
    assert "10 bytes of output dropped" in marker["content"]["text"]


def test_output_just_past_the_head_room_is_held_and_then_passes_whole() -> None:
    """Nothing dropped: no marker, no notice; the text arrives whole, in order."""
    kernel = Session(key=KEY)
    limiter = OutputLimiter(20_000, Session(key=KEY), Running())
    lines = [f"{i}".rjust(2000, ".") + "\n" for i in range(7)]  # with their headers, 20 000 bytes or less
    messages = [m for line in lines for m in limiter.admit(printed(kernel, line))]
    sent = "".join(lines)
    assert streams(read(messages)) != sent  # the last one's end is held back
    messages += limiter.admit(status(kernel, "idle"))
    received = read(messages)
    assert streams(received) == sent
    assert streams(received, "stderr") == ""


def test_a_display_that_fits_passes_after_the_text_held_before_it() -> None:
    kernel = Session(key=KEY)
    limiter = OutputLimiter(20_000, Session(key=KEY), Running())
    limiter.admit(stream(kernel, 14_000))
    head = limiter.admit(stream(kernel, 1000))  # past the head room: the rest is held
    assert len(streams(read(head))) < 1000
    display = kernel_message(
        kernel, "display_data", {"data": {"text/plain": "plot"}, "metadata": {}}, "cell-1"
    )
    *held, passed = limiter.admit(display)
    assert passed == display
    assert streams(read(head + held)) == "x" * 1000


def test_a_display_over_the_budget_is_dropped_and_only_the_tail_follows() -> None:
    kernel = Session(key=KEY)
    limiter = OutputLimiter(10_000, Session(key=KEY), Running())
    display = kernel_message(kernel, "display_data", {"data": {"image/png": "A" * 20_000}}, "cell-1")
    (notice,) = read(limiter.admit(display))
    assert "the rest was dropped" in notice["content"]["text"]
    assert limiter.admit(printed(kernel, "after\n")) == []  # no head once something was dropped
    marker, tail = read(limiter.release())
    assert tail["content"]["text"] == "after\n"
    assert "of output dropped" in marker["content"]["text"]


def test_stdout_and_stderr_keep_their_order_in_the_tail() -> None:
    kernel = Session(key=KEY)
    limiter = OutputLimiter(8000, Session(key=KEY), Running())
    limiter.admit(stream(kernel, 20_000))
    for i in range(50):
        limiter.admit(printed(kernel, f"out {i}\n"))
        limiter.admit(printed(kernel, f"err {i}\n", "stderr"))
    marker, *tail = read(limiter.release())
    texts = [(m["content"]["name"], m["content"]["text"]) for m in tail]
    assert texts[-2:] == [("stdout", "out 49\n"), ("stderr", "err 49\n")]
    assert marker["content"]["name"] == texts[0][0]  # right before what follows the gap
    assert sum(len(text) for _, text in texts) <= tail_reserve(8000)


def test_the_tail_is_bounded_whatever_the_kernel_prints() -> None:
    tail = _Tail(TAIL_BYTES)
    for i in range(200_000):
        tail.add("stdout" if i % 2 else "stderr", "x")
    assert tail.held <= TAIL_BYTES
    assert len(tail._pieces) <= 1024
    tail.add("stdout", "y" * 10 * TAIL_BYTES)
    assert tail.take() == [("stdout", "y" * TAIL_BYTES)]
    assert tail.dropped == 200_000 + 9 * TAIL_BYTES


def test_a_million_tiny_prints_take_linear_time() -> None:
    """Past the head room every print goes to the tail: each costs the same, however
    many came before (a quadratic tail would take minutes here)."""
    kernel = Session(key=KEY)
    limiter = OutputLimiter(2**20, Session(key=KEY), Running())
    tiny = printed(kernel, "7\n")
    # This thread's CPU time: a loaded machine's pauses (other processes, other threads)
    # do not count, its work alone does.
    started = time.thread_time()
    for _ in range(50_000):
        limiter.admit(tiny)
    first = time.thread_time() - started
    started = time.thread_time()
    for _ in range(50_000):
        limiter.admit(tiny)
    assert time.thread_time() - started < 3 * first + 1
    assert len(streams(read(limiter.release()))) < tail_reserve(2**20) + 200


def test_a_kernel_that_never_goes_idle_still_gets_its_tail_delivered_on_release() -> None:
    """The kernel died mid-request: the bridge asks for the tail before the host's notice."""
    kernel = Session(key=KEY)
    limiter = OutputLimiter(2000, Session(key=KEY), Running())
    limiter.admit(printed(kernel, "A" * 5000 + "Z" * 500))
    _, tail = read(limiter.release())
    assert tail["content"]["text"] == "Z" * 500
    assert limiter.release() == []


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 bytes"),
        (512, "512 bytes"),
        (64 * 2**10, "64 KiB"),
        (int(29.8 * 2**20), "29.8 MiB"),
        (3 * 2**30, "3 GiB"),
    ],
)
def test_amounts_read_well(size: int, text: str) -> None:
    assert amount(size) == text


def test_the_kernel_s_prompts_are_charged_to_the_running_execution_s_budget() -> None:
    kernel = Session(key=KEY)
    running = Running()
    prompt = kernel_message(kernel, "input_request", {"prompt": "x" * 1000, "password": False}, "cell-1")
    size = sum(len(frame) for frame in prompt)
    limiter = OutputLimiter(3 * size + 10, Session(key=KEY), running)
    assert [limiter.charge(prompt) for _ in range(4)] == [True, True, True, False]
    (notice,) = read(limiter.admit(status(kernel, "busy", padding="x" * 100)))  # the budget is spent
    assert "Output truncated" in notice["content"]["text"]
    running.msg_id = "cell-2"
    assert limiter.charge(prompt), "a new execution, a new budget"
