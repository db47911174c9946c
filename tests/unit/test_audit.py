"""The audit log file itself: JSON lines, rotation, private files."""

from __future__ import annotations

import json
import logging
import os
import random
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sandbox_kernel.channels import audit
from sandbox_kernel.channels.audit import NO_CELL, NO_STDIN, AuditLog, ExecutionAuditor


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


def test_a_log_that_is_not_a_file_is_never_rotated_and_one_that_fails_is_said_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An audit log set to a device (``/dev/null``: an administrator who wants none) takes
    its lines without a rotation, which would rename the device; a log the disk refuses
    (``/dev/full``) is an error in the server's log, and the kernel goes on."""
    log = AuditLog.open("/dev/null", max_bytes=10, backups=2)
    for _ in range(3):
        log.write({"event": "finished", "code": "x" * 100})
    assert not Path("/dev/null.1").exists()
    auditor = ExecutionAuditor(AuditLog.open("/dev/full", max_bytes=10, backups=2), "k1", "py")
    with caplog.at_level(logging.ERROR, logger="sandbox_kernel.channels.audit"):
        auditor.lifecycle("start")
    assert "Cannot write the audit log /dev/full: [Errno 28] No space left on device" in caplog.text
    assert not Path("/dev/full.1").exists()


def test_a_line_the_disk_cuts_short_is_taken_back(tmp_path: Path) -> None:
    """A disk that fills up in the middle of a line (the write takes part of it, then
    fails) leaves no half line for the next one to be glued to: the log stays one JSON
    object a line. The file size limit stands in for the full disk, in a process of its own."""
    path = tmp_path / "audit.jsonl"
    script = f"""
import json, resource, sys
from sandbox_kernel.channels.audit import AuditLog
log = AuditLog.open({str(path)!r}, max_bytes=0, backups=0)
log.write({{"event": "start"}})
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]  # (Python ignores SIGXFSZ: EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (100, hard))
try:
    log.write({{"event": "finished", "code": "x" * 500}})
except OSError as exc:
    print("failed:", exc.strerror)
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
log.write({{"event": "shutdown"}})
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "failed: File too large"
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["start", "shutdown"]


def test_a_line_taken_back_never_cuts_another_process_s(tmp_path: Path) -> None:
    """Two processes may append to one log (a user's server and their ``sandbox-kernel
    mcp``): what the other wrote after the part of a line is never cut off with it."""
    path = tmp_path / "audit.jsonl"
    ours = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    theirs = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(ours, b'{"event": "start"}\n')
        os.write(ours, b'{"event": "fin')
        audit._take_back(ours, 19, 33)
        assert path.read_bytes() == b'{"event": "start"}\n'
        os.write(ours, b'{"event": "fin')
        os.write(theirs, b'{"event": "exit"}\n')
        audit._take_back(ours, 19, 33)
        assert path.read_bytes() == b'{"event": "start"}\n{"event": "fin{"event": "exit"}\n'
    finally:
        os.close(ours)
        os.close(theirs)


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


def test_a_lost_reply_does_not_pin_the_kernel_to_a_finished_execution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
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
    assert _current_code(auditor) == "print('alive')"
    running = auditor.running()
    assert running is not None
    assert running[0] == after["header"]["msg_id"]
    assert lost == [], "its reply may still be on its way"
    monkeypatch.setattr(audit, "OVERTAKEN_GRACE", 0.05)
    time.sleep(0.05)
    auditor.running()  # (the watchdog's look)
    assert lost == ["send_40_mib()"]
    # Its reply, should it come after all, is no reply to a pending request.
    auditor("shell", False, _message(session, "execute_reply", {"status": "ok"}, cut))
    assert lost == ["send_40_mib()"]
    assert _current_code(auditor) == "print('alive')"


def test_a_reply_that_comes_after_the_next_cell_began_is_no_lost_one(tmp_path: Path) -> None:
    """Once ipykernel's shell-channel thread has the shell socket (a client asked for a
    subshell), a reply takes a hop through it that the next cell's execute_input does not:
    the host took the reply for lost and answered ReplyLost itself (Run All in a notebook
    whose widgets asked for a subshell; test_conformance)."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor, path = _auditor(tmp_path)
    lost: list[str] = []
    auditor.on_lost = lambda pending: lost.append(pending.code)
    first, second = (session.msg("execute_request", {"code": code}) for code in ("1", "2"))
    for request in (first, second):
        auditor("shell", True, list(session.serialize(request, ident=[b"c"])))
    auditor("iopub", False, _message(session, "execute_input", {"code": "2"}, second))
    auditor("shell", False, _message(session, "execute_reply", {"status": "ok"}, first))
    auditor("shell", False, _message(session, "execute_reply", {"status": "ok"}, second))
    assert lost == []
    finished = [r for r in _records(path) if r["event"] == "finished"]
    assert [(r["code"], r["status"]) for r in finished] == [("1", "ok"), ("2", "ok")]
    assert auditor.idle_for() is not None


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


def _sent(auditor: ExecutionAuditor, session: Any, code: str, subshell_id: str = "") -> dict[str, Any]:
    """An execute_request of ``code`` (on the subshell ``subshell_id``, if one), as the
    auditor sees it on its way to the kernel."""
    request: dict[str, Any] = session.msg("execute_request", {"code": code})
    if subshell_id:
        request["header"]["subshell_id"] = subshell_id
    auditor("shell", True, list(session.serialize(request, ident=[b"c"])))
    return request


def _answered(auditor: ExecutionAuditor, session: Any, request: dict[str, Any]) -> None:
    auditor("shell", False, _message(session, "execute_reply", {"status": "ok"}, request))


def test_a_subshells_replies_do_not_restart_the_main_shells_wall_clock() -> None:
    """Found by a review, the way an attacker would do it: a silent cell (no execute_input,
    no pre_run_cell) spins on the main shell while cells come and go on a subshell. Each
    subshell reply restarted the clock of the oldest pending execution: the spinning one
    never reached its wall-clock limit. Each shell runs its own queue and has its own clock."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    spin = session.msg("execute_request", {"code": "while True: pass", "silent": True})
    auditor("shell", True, list(session.serialize(spin, ident=[b"c"])))
    for _ in range(4):
        time.sleep(0.05)
        _answered(auditor, session, _sent(auditor, session, "1", "s1"))
    running = auditor.running()
    assert running is not None
    assert running[0] == spin["header"]["msg_id"]
    assert running[1] >= 0.2


def test_a_silent_cell_spinning_on_a_subshell_is_timed_while_the_main_shell_is_idle() -> None:
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    _answered(auditor, session, _sent(auditor, session, "1"))
    spin = _sent(auditor, session, "while True: pass", "s1")
    _sent(auditor, session, "2", "s1")  # queued behind it
    time.sleep(0.1)
    for _ in range(3):  # the main shell answers meanwhile
        _answered(auditor, session, _sent(auditor, session, "3"))
    running = auditor.running()
    assert running is not None
    assert running[0] == spin["header"]["msg_id"]
    assert running[1] >= 0.1


def test_executing_names_one_running_request_per_shell_the_first_begun_first() -> None:
    """What the output cap charges to: queued requests are not running; a subshell's cell
    runs beside the main shell's until answered."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    assert auditor.executing() == []
    main = _sent(auditor, session, "long()")
    _sent(auditor, session, "queued()")
    time.sleep(0.01)  # (the clocks say which began first)
    side = _sent(auditor, session, "widget()", "s1")
    _sent(auditor, session, "queued_too()", "s1")
    ids = [msg_id for msg_id, _ in auditor.executing()]
    assert ids == [main["header"]["msg_id"], side["header"]["msg_id"]]
    assert auditor.executing()[1][1]["subshell_id"] == "s1"
    _answered(auditor, session, main)
    _answered(auditor, session, side)
    assert len(auditor.executing()) == 2  # each shell's next
    for request in list(auditor._pending.values()):
        _answered(auditor, session, {"header": request.header})
    assert auditor.executing() == []
    only = _sent(auditor, session, "1")
    assert [msg_id for msg_id, _ in auditor.executing()] == [only["header"]["msg_id"]]


def test_executing_stays_what_the_pending_executions_say_through_every_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """executing() keeps its answer until the pending executions change (the output cap
    asks for each message; a review measured 66 µs a message with 1000 queued). After each
    of a few hundred random changes on three shells, the kept answer is the fresh one."""
    from jupyter_client.session import Session

    monkeypatch.setattr(audit, "OVERTAKEN_GRACE", 1e-9)  # running() ends overtaken ones
    rng = random.Random(25)  # noqa: S311 (the same changes each run)
    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    sent: list[dict[str, Any]] = []
    for step in range(800):
        roll = rng.random()
        if roll < 0.35 or not sent:
            sent.append(_sent(auditor, session, f"cell({step})", rng.choice(["", "s1", "s2"])))
        elif roll < 0.55:
            request = rng.choice(sent)
            auditor("iopub", False, _message(session, "execute_input", {"code": ""}, request))
        elif roll < 0.8:
            _answered(auditor, session, sent.pop(rng.randrange(len(sent))))
        elif roll < 0.85:
            delete = session.msg("delete_subshell_request", {"subshell_id": "s2"})
            auditor("control", True, list(session.serialize(delete, ident=[b"c"])))
            auditor("control", False, _message(session, "delete_subshell_reply", {"status": "ok"}, delete))
        elif roll < 0.95:
            auditor.running()
        else:
            auditor.abandon_pending("gone")
        kept = auditor.executing()
        with auditor._lock:
            assert kept == auditor._executing_locked(), step


def test_a_kernel_repeating_its_execute_input_changes_nothing_executing_keeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a review: each execute_input counted as a change, so a kernel repeating
    the running cell's made executing() walk 900 queued requests again per message."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    first = _sent(auditor, session, "spin()")
    for i in range(900):
        _sent(auditor, session, f"queued({i})")
    _sent(auditor, session, "beside()", "s1")
    echo = _message(session, "execute_input", {"code": ""}, first)
    auditor("iopub", False, echo)
    auditor.executing()
    walks: list[int] = []
    fresh = auditor._executing_locked
    monkeypatch.setattr(auditor, "_executing_locked", lambda: walks.append(1) or fresh())
    for _ in range(50):
        auditor("iopub", False, echo)
        assert auditor.executing() == fresh()
    assert walks == []


def test_deleting_a_subshell_ends_its_queued_executions() -> None:
    """Found by a review: ipykernel stops a deleted subshell's thread and drops the requests
    queued on it, unanswered. Left pending, they kept the kernel busy for good (no idle
    stop, pause or freeze) and, once the oldest, past its wall-clock limit: interrupted,
    then killed. Their clients are told, and the audit says why."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    lost: list[tuple[str, str]] = []
    auditor.on_lost = lambda pending: lost.append((pending.code, pending.lost[0]))
    running, queued = (session.msg("execute_request", {"code": code}) for code in ("sleep(20)", "print(1)"))
    main = session.msg("execute_request", {"code": "main()"})
    for request in (running, queued):
        request["header"]["subshell_id"] = "s1"
    for request in (running, queued, main):
        auditor("shell", True, list(session.serialize(request, ident=[b"c"])))
    other = session.msg("delete_subshell_request", {"subshell_id": "s2"})
    auditor("control", True, list(session.serialize(other, ident=[b"c"])))
    auditor("control", False, _message(session, "delete_subshell_reply", {"status": "ok"}, other))
    delete = session.msg("delete_subshell_request", {"subshell_id": "s1"})
    auditor("control", True, list(session.serialize(delete, ident=[b"c"])))
    assert lost == [], "not before the kernel says it is deleted"
    auditor("control", False, _message(session, "delete_subshell_reply", {"status": "ok"}, delete))
    assert lost == [("sleep(20)", "SubshellDeleted"), ("print(1)", "SubshellDeleted")]
    assert _current_code(auditor) == "main()"
    auditor("shell", False, _message(session, "execute_reply", {"status": "ok"}, main))
    assert auditor.idle_for() is not None


def test_a_refused_deletion_ends_nothing() -> None:
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    queued = session.msg("execute_request", {"code": "print(1)"})
    queued["header"]["subshell_id"] = "s1"
    auditor("shell", True, list(session.serialize(queued, ident=[b"c"])))
    delete = session.msg("delete_subshell_request", {"subshell_id": "s1"})
    auditor("control", True, list(session.serialize(delete, ident=[b"c"])))
    error = {"status": "error", "ename": "UnknownSubshellError", "evalue": "", "traceback": []}
    auditor("control", False, _message(session, "delete_subshell_reply", error, delete))
    assert _current_code(auditor) == "print(1)"


def _current_code(auditor: ExecutionAuditor) -> str | None:
    current = auditor.current()
    return None if current is None else current.code


# ---------------------------------------------------------------- what the log shows (issue 21)


def _records(path: Path) -> list[dict[str, Any]]:
    """Every line of the log and its rotated files, oldest first."""
    files = sorted(
        path.parent.glob(f"{path.name}*"), key=lambda f: -int(f.suffix[1:] or 0) if f != path else 0
    )
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def _auditor(tmp_path: Path, max_bytes: int = 10**8, backups: int = 1) -> tuple[ExecutionAuditor, Path]:
    path = tmp_path / "audit.jsonl"
    return ExecutionAuditor(AuditLog.open(path, max_bytes=max_bytes, backups=backups), "k1", "py"), path


def test_code_in_user_expressions_is_audited(tmp_path: Path) -> None:
    """An execute_request with empty code wrote files from its user_expressions, and the log
    said "code": "": ipykernel evaluates each user expression after the code, silent or not."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor, path = _auditor(tmp_path)
    expressions = {"x": "open('/workspace/pwned', 'w').write('1')"}
    request = session.msg("execute_request", {"code": "", "silent": True, "user_expressions": expressions})
    auditor("shell", True, list(session.serialize(request, ident=[b"c"])))
    auditor("shell", False, _message(session, "execute_reply", {"status": "ok"}, request))
    started, finished = _records(path)
    for record in (started, finished):
        assert record["code"] == ""
        assert record["user_expressions"] == expressions
        assert record["silent"] is True
    plain = session.msg("execute_request", {"code": "1", "user_expressions": {}})
    auditor("shell", True, list(session.serialize(plain, ident=[b"c"])))
    assert "user_expressions" not in _records(path)[-1]  # only when there are some
    assert "silent" not in _records(path)[-1]


def test_six_huge_cells_cannot_push_the_first_cell_out_of_the_log(tmp_path: Path) -> None:
    """Six MCP run_code calls with 48 MiB comments pushed the first cell out of the log and
    all its backups. Long code is logged as its head, its tail and the whole code's hash."""
    import hashlib

    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor, path = _auditor(tmp_path, max_bytes=2**20, backups=2)
    first = session.msg("execute_request", {"code": "steal_the_data()"})
    auditor("shell", True, list(session.serialize(first, ident=[b"c"])))
    auditor("shell", False, _message(session, "execute_reply", {"status": "ok"}, first))
    codes = []
    for i in range(6):
        code = f"# {'x' * 4 * 2**20}\nprint({i})  # the tail"
        codes.append(code)
        huge = session.msg("execute_request", {"code": code})
        auditor("shell", True, list(session.serialize(huge, ident=[b"c"])))
        auditor("shell", False, _message(session, "execute_reply", {"status": "ok"}, huge))
    records = _records(path)
    assert [r["code"] for r in records[:2]] == ["steal_the_data()"] * 2
    for code, record in zip(codes, records[2::2], strict=True):
        assert record["code_sha256"] == hashlib.sha256(code.encode()).hexdigest()
        assert record["code_bytes"] == len(code.encode())
        assert record["code"].startswith(code[:4096])
        assert record["code"].endswith(code[-4096:])
        assert "[sandbox-kernel: " in record["code"]
        assert len(json.dumps(record)) < 20_000
    short = [r for r in records if r["code"] == "steal_the_data()"]
    assert all("code_sha256" not in r for r in short), "short code is logged as it is"


def test_header_fields_are_bounded_too(tmp_path: Path) -> None:
    """The client writes the header as well: a 1 MiB user name or msg_id must not fill the log."""
    from jupyter_client.session import Session

    session = Session(key=b"k", username="u" * 2**20)
    auditor, path = _auditor(tmp_path)
    expressions = {f"e{i}": "1" * 2**16 for i in range(64)}
    request = session.msg("execute_request", {"code": "1", "user_expressions": expressions})
    request["header"]["msg_id"] = "m" * 2**20
    auditor("shell", True, list(session.serialize(request, ident=[b"c"])))
    (record,) = _records(path)
    assert len(json.dumps(record)) < 40_000
    assert record["username_claimed"].startswith("uuu")
    assert "user_expressions_sha256" in record


def test_the_log_names_the_server_and_labels_the_clients_user_name_a_claim(tmp_path: Path) -> None:
    """``username`` is whatever the client wrote in its header ("ceo@corp.example" was logged
    as given): the log says it is a claim, beside what the host knows."""
    import os

    from jupyter_client.session import Session

    session = Session(key=b"k", username="ceo@corp.example")
    auditor, path = _auditor(tmp_path)
    auditor("shell", True, _message(session, "execute_request", {"code": "1"}))
    (record,) = _records(path)
    assert "username" not in record
    assert record["username_claimed"] == "ceo@corp.example"
    assert record["server_uid"] == os.getuid()
    assert record["client_uid"] is None  # not a unix-socket peer: unknown, never guessed


def test_an_allowed_request_after_a_flood_of_denials_is_logged_and_the_flood_counted(tmp_path: Path) -> None:
    """After 260 denied egress requests from a background thread, an allowed request reached
    the upstream with no audit line, and the suppressed count waited for a later line."""
    import threading

    auditor, path = _auditor(tmp_path)
    denied = {"method": "CONNECT", "host": "evil.example", "port": 443, "verdict": "denied", "reason": "r"}
    allowed = {"method": "CONNECT", "host": "pypi.org", "port": 443, "verdict": "allowed", "reason": "listed"}
    flood = threading.Thread(target=lambda: [auditor.egress(denied) for _ in range(260)])
    flood.start()
    flood.join()
    assert auditor.egress(allowed)
    assert auditor.egress(allowed)
    egress = [r for r in _records(path) if r["event"] == "egress"]
    assert [r["host"] for r in egress].count("pypi.org") == 2
    # No later line comes: the count is written on a timer all the same.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        records = _records(path)
        counted = sum(r["count"] for r in records if r["event"] == "egress_suppressed")
        logged = sum(1 for r in records if r["event"] == "egress" and r["host"] == "evil.example")
        if counted + logged == 260:
            break
        time.sleep(0.1)
    assert counted + logged == 260
    assert counted > 0


def test_denials_suppressed_at_the_kernels_end_are_counted_then(tmp_path: Path) -> None:
    auditor, path = _auditor(tmp_path)
    denied = {"method": "GET", "host": "evil.example", "port": 80, "verdict": "denied", "reason": "r"}
    logged = sum(auditor.egress(denied) for _ in range(300))
    auditor.abandon_pending("no reply: the kernel stopped")  # the kernel's end
    records = _records(path)
    assert sum(r["count"] for r in records if r["event"] == "egress_suppressed") == 300 - logged


def test_refused_prompts_get_one_line_per_execution_and_a_count_in_its_finished_line(
    tmp_path: Path,
) -> None:
    """The kernel decides how many stdin messages it sends: refusing them must not let it
    write a line for each (a flood would rotate the log away)."""
    from jupyter_client.session import Session

    path = tmp_path / "prompts.jsonl"
    session = Session(key=b"k")
    auditor = ExecutionAuditor(AuditLog.open(path, max_bytes=10**8, backups=1), "k1", "py")
    execute = session.msg("execute_request", {"code": "flood()", "allow_stdin": False})
    auditor("shell", True, list(session.serialize(execute, ident=[b"client"])))
    ask = _message(session, "input_request", {"prompt": "A" * 2**20, "password": False}, execute)
    assert [auditor("stdin", False, ask) for _ in range(1000)] == [NO_STDIN] * 1000
    auditor("shell", False, _message(session, "execute_reply", {"status": "ok"}, execute))
    assert [auditor("stdin", False, ask) for _ in range(1000)] == [NO_CELL] * 1000
    records = [json.loads(line) for line in path.read_text().splitlines()]
    refused = [r for r in records if r["event"] == "prompt_refused"]
    assert [(r["msg_id"], r["reason"]) for r in refused] == [
        (execute["header"]["msg_id"], NO_STDIN),
        (None, NO_CELL),
    ]
    assert refused[0]["bytes"] > 2**20
    (finished,) = [r for r in records if r["event"] == "finished"]
    assert finished["prompts_refused"] == 1000


def test_a_gateway_users_kernel_names_her_on_its_egress_and_approval_lines(tmp_path: Path) -> None:
    auditor, path = _auditor(tmp_path)
    allowed = {"method": "CONNECT", "host": "pypi.org", "port": 443, "verdict": "allowed", "reason": "r"}
    auditor.egress(allowed)
    auditor.approval("pypi.org", 443, "deny", "at the prompt", 1.5)
    auditor.user = "alice"  # as the provisioner sets it for a kernel a gateway started for her
    auditor.egress(allowed)
    auditor.approval("pypi.org", 443, "once", "at the prompt", 0.5)
    auditor.lifecycle("pause", took=0.2)
    users = [(r["event"], r.get("user")) for r in _records(path)]
    assert users == [
        ("egress", None),
        ("approval", None),
        ("egress", "alice"),
        ("approval", "alice"),
        ("pause", None),
    ]


def test_a_prompt_of_a_subshells_cell_goes_to_its_client_while_the_main_shell_runs() -> None:
    """input() in a cell on a subshell (a JupyterLab subshell console) while a cell of
    another client runs on the main shell: the prompt was checked against the main cell,
    whose request did not allow stdin, and refused; the subshell's cell waited for good.
    A prompt goes to a running execution's client, on whichever shell it runs."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    main = session.msg("execute_request", {"code": "long()", "allow_stdin": False})
    auditor("shell", True, list(session.serialize(main, ident=[b"main-client"])))
    side = session.msg("execute_request", {"code": "input()", "allow_stdin": True})
    side["header"]["subshell_id"] = "s1"
    queued = session.msg("execute_request", {"code": "input()", "allow_stdin": True})
    for request in (side, queued):
        auditor("shell", True, list(session.serialize(request, ident=[b"console"])))
    ask = list(
        session.serialize(session.msg("input_request", {"prompt": "?"}, parent=side), ident=[b"console"])
    )
    assert auditor("stdin", False, ask) is True
    # A parent that is not running (queued on the main shell) gets the main cell's checks.
    early = list(
        session.serialize(session.msg("input_request", {"prompt": "?"}, parent=queued), ident=[b"console"])
    )
    assert auditor("stdin", False, early) == NO_STDIN


def test_the_clocks_of_answered_shells_are_not_kept() -> None:
    """A client names whatever subshells it likes: the host keeps no clock for a shell
    with nothing pending (found by a review)."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    auditor = ExecutionAuditor(None, "k1", "py")
    for i in range(100):
        _answered(auditor, session, _sent(auditor, session, "1", f"made-up-{i}" * 100))
    assert auditor._head_since == {}
