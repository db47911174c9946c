"""The audit log file itself: JSON lines, rotation, private files."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path
from typing import Any

from sandbox_kernel.audit import AuditLog, ExecutionAuditor


def test_rotation_keeps_every_file_private_and_each_line_json(tmp_path: Path) -> None:
    path = tmp_path / "audit" / "audit.jsonl"
    log = AuditLog.open(path, max_bytes=300, backups=3)
    for i in range(20):
        log.write({"event": "finished", "code": f"print({i})", "note": "\udc80 stays ascii"})
    files = sorted(path.parent.iterdir())
    assert [f.name for f in files] == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2", "audit.jsonl.3"]
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        for line in f.read_text().splitlines():
            assert json.loads(line)["event"] == "finished"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert AuditLog.open(path, max_bytes=300, backups=3) is log  # one writer per file


def test_a_kernel_cannot_flood_the_log_with_egress_lines(tmp_path: Path) -> None:
    path = tmp_path / "flood.jsonl"
    auditor = ExecutionAuditor(AuditLog.open(path, max_bytes=10**8, backups=1), "k1", "py-web")
    decision = {"method": "CONNECT", "host": "evil.example", "port": 443, "verdict": "denied", "reason": "r"}
    logged = [auditor.egress(decision) for _ in range(5000)]
    assert 150 <= sum(logged) <= 260  # the burst, plus what the rate refills meanwhile
    time.sleep(0.2)
    assert auditor.egress(decision)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    (summary,) = [r for r in records if r["event"] == "egress_suppressed"]
    assert summary["count"] == 5000 - sum(logged)
    assert summary["kernel_id"] == "k1"


def test_idle_refusal_is_atomic_with_new_requests() -> None:
    auditor = ExecutionAuditor(None, "k1", "py")
    assert not auditor.refuse_if_idle(60, "idle")  # just started
    assert auditor.refuse_if_idle(0.0, "idle")
    assert not auditor.refuse_if_idle(0.0, "idle"), "refused once, not twice"
    auditor.refuse(None)
    assert auditor.idle_for() is not None


def _message(
    session: Any, msg_type: str, content: dict[str, Any], parent: dict[str, Any] | None = None
) -> list[bytes]:
    msg = session.msg(msg_type, content, parent=parent)
    return list(session.serialize(msg, ident=[b"client"]))


def test_replies_the_host_did_not_ask_for_are_not_activity() -> None:
    """A thread in the kernel answering the last request again and again kept it past its
    idle limit: only the first reply to a request a client sent counts."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    request = session.msg("execute_request", {"code": "1"})
    auditor("shell", True, list(session.serialize(request, ident=[b"client"])))
    reply = _message(session, "execute_reply", {"status": "ok"}, request)
    auditor("shell", False, reply)
    time.sleep(0.05)
    for _ in range(10):
        auditor("shell", False, reply)
        auditor("shell", False, _message(session, "execute_reply", {"status": "ok"}, {"msg_id": "made-up"}))
    assert auditor.refuse_if_idle(0.04, "idle")


def test_the_running_execution_is_timed_without_the_kernels_word() -> None:
    """The wall clock starts when a request reaches the head of the queue, whether or not
    the kernel announces it (execute_input can be withheld)."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    first = session.msg("execute_request", {"code": "spin()"})
    second = session.msg("execute_request", {"code": "queued()"})
    auditor("shell", True, list(session.serialize(first, ident=[b"c"])))
    auditor("shell", True, list(session.serialize(second, ident=[b"c"])))
    time.sleep(0.1)
    running = auditor.running()
    assert running is not None
    assert running[0] == first["header"]["msg_id"]
    assert running[1] >= 0.1
    auditor("shell", False, _message(session, "execute_reply", {"status": "ok"}, first))
    running = auditor.running()
    assert running is not None
    assert running[0] == second["header"]["msg_id"]
    assert running[1] < 0.1  # the queued one's clock starts now, not when it was sent


def test_a_refused_request_is_answered_here_and_never_passed_on() -> None:
    """A request to a kernel that is not running got an error reply and was still passed
    on: the next kernel ran it (the audit log said "refused")."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    answered: list[str] = []
    auditor.on_refused = lambda pending: answered.append(pending.code)
    assert auditor("shell", True, _message(session, "execute_request", {"code": "1"})) is True
    auditor.refuse("KernelDied: the kernel is not running")
    assert auditor("shell", True, _message(session, "execute_request", {"code": "2"})) is False
    assert answered == ["2"]
    assert auditor("shell", True, _message(session, "kernel_info_request", {})) is True
    auditor.refuse(None)
    assert auditor("shell", True, _message(session, "execute_request", {"code": "3"})) is True
