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


def test_a_lost_reply_does_not_pin_the_kernel_to_a_finished_execution() -> None:
    """A cell sent a message over the bridge's size cap on shell: the bridge cut the kernel
    off, its reply to that cell was lost with it, and the host took that cell as running
    for ever, charging every later cell's output to its spent output budget (the next
    ``print('alive')`` showed nothing; CI). The kernel runs one shell's requests in order:
    once it begins a later one, the earlier ones are over, and their clients are told."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    lost: list[str] = []
    auditor.on_lost = lambda pending: lost.append(pending.code)
    cut = session.msg("execute_request", {"code": "send_40_mib()"})
    after = session.msg("execute_request", {"code": "print('alive')"})
    auditor("shell", True, list(session.serialize(cut, ident=[b"c"])))
    auditor("shell", True, list(session.serialize(after, ident=[b"c"])))
    auditor("iopub", False, _message(session, "execute_input", {"code": "send_40_mib()"}, cut))
    assert _current_code(auditor) == "send_40_mib()"
    auditor("iopub", False, _message(session, "execute_input", {"code": "print('alive')"}, after))
    assert lost == ["send_40_mib()"]
    assert _current_code(auditor) == "print('alive')"
    # Its reply, should it come after all, is no reply to a pending request.
    auditor("shell", False, _message(session, "execute_reply", {"status": "ok"}, cut))
    assert lost == ["send_40_mib()"]
    assert _current_code(auditor) == "print('alive')"


def test_a_later_reply_ends_earlier_executions_even_without_execute_input() -> None:
    """The kernel's execute_input is its word (code can withhold it); its reply to a later
    request says the same."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    lost: list[str] = []
    auditor.on_lost = lambda pending: lost.append(pending.code)
    requests = [session.msg("execute_request", {"code": str(i)}) for i in range(3)]
    for request in requests:
        auditor("shell", True, list(session.serialize(request, ident=[b"c"])))
    auditor("shell", False, _message(session, "execute_reply", {"status": "ok"}, requests[1]))
    assert lost == ["0"]
    assert _current_code(auditor) == "2"


def test_a_subshell_runs_beside_the_main_shell_and_ends_none_of_its_executions() -> None:
    """ipykernel 7 runs a subshell's requests (JupyterLab's comms, header subshell_id)
    beside the main shell's: its replies say nothing of the main shell's queue."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    lost: list[str] = []
    auditor.on_lost = lambda pending: lost.append(pending.code)
    main = session.msg("execute_request", {"code": "long()"})
    side = session.msg("execute_request", {"code": "widget()"})
    side["header"]["subshell_id"] = "s1"
    auditor("shell", True, list(session.serialize(main, ident=[b"c"])))
    auditor("shell", True, list(session.serialize(side, ident=[b"c"])))
    auditor("iopub", False, _message(session, "execute_input", {"code": "widget()"}, side))
    auditor("shell", False, _message(session, "execute_reply", {"status": "ok"}, side))
    assert lost == []
    assert _current_code(auditor) == "long()"


def _current_code(auditor: ExecutionAuditor) -> str | None:
    current = auditor.current()
    return None if current is None else current.code
