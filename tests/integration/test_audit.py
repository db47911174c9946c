"""Every execution, from any client, lands in the host's audit log, out of the sandbox's reach."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import KernelManager
from jupyter_client.session import Session

from sandbox_kernel.errors import WorkspaceError

from .conftest import KERNEL, KernelStarter, run, run_ok, shell_reply


def audit_lines(path: Path, count: int, timeout: float = 10) -> list[dict[str, Any]]:
    """The "finished" records, once there are ``count`` of them."""
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        records = [json.loads(line) for line in lines]
        finished = [r for r in records if r["event"] == "finished"]
        if len(finished) >= count or time.monotonic() > deadline:
            return finished
        time.sleep(0.1)


def test_every_execution_from_every_client_is_audited(start_kernel: KernelStarter, tmp_path: Path) -> None:
    km, kc = start_kernel()
    audit = tmp_path / "data" / "sandbox-kernel" / "audit.jsonl"
    run_ok(kc, "x = 6 * 7")
    assert run(kc, "1 / 0").status == "error"
    # A second client, as an AI assistant would attach: its own session and user name.
    other = km.client(session=Session(key=km.session.key, username="assistant-bot"))
    other.start_channels()
    try:
        other.wait_for_ready(timeout=30)
        run_ok(other, "print(x)")
    finally:
        other.stop_channels()

    records = audit_lines(audit, 3)
    codes = [r["code"] for r in records]
    assert codes[-3:] == ["x = 6 * 7", "1 / 0", "print(x)"]
    first, failed, third = records[-3:]
    assert first["status"] == "ok"
    assert failed["status"] == "error"
    # The header's user name is the client's claim; the host says who it knows.
    assert third["username_claimed"] == "assistant-bot"
    assert third["session"] == other.session.session
    for record in (first, failed, third):
        assert (record["client_uid"], record["client_pid"]) == (os.getuid(), os.getpid())
        assert record["server_uid"] == os.getuid()
        assert record["kernel_id"] == km.kernel_id
        assert record["kernelspec"] == KERNEL
        assert 0 <= record["duration"] < 30
        assert record["time"].endswith("+00:00")
    assert audit.stat().st_mode & 0o077 == 0, "the audit log must be private to the server's user"

    # The sandbox can neither see nor touch the log.
    out = run_ok(
        kc,
        f"import os\nprint(os.path.exists({str(audit)!r}), os.path.exists({str(audit.parent)!r}))",
    )
    assert out.strip() == "False False"


def test_an_execution_cut_short_by_a_dead_kernel_is_still_audited(
    start_kernel: KernelStarter, tmp_path: Path
) -> None:
    km, kc = start_kernel()
    audit = tmp_path / "data" / "sandbox-kernel" / "audit.jsonl"
    # Deaf to the interrupt a restart sends first, so the kernel never replies itself.
    code = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"
    msg_id = kc.execute(code)
    time.sleep(1)
    km.restart_kernel(now=True)
    records = audit_lines(audit, 1)
    assert records[-1]["code"] == code
    assert records[-1]["status"].startswith("no reply")
    # The waiting client is answered too, instead of waiting forever.
    reply = shell_reply(kc, timeout=10)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["ename"] == "KernelDied"
    # The request was on record before anything went wrong.
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [e["event"] for e in events if e.get("msg_id") == records[-1]["msg_id"]] == ["started", "finished"]


def test_an_audit_log_inside_the_workspace_is_refused(
    jupyter_dirs: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDBOX_KERNEL_AUDIT_LOG", str(workspace / "audit.jsonl"))
    with pytest.raises(WorkspaceError, match=r"SandboxProvisioner\.audit_log"):
        KernelManager(kernel_name=KERNEL).start_kernel(cwd=str(workspace))


def all_records(path: Path, event: str, count: int, timeout: float = 10) -> list[dict[str, Any]]:
    """The records of ``event``, once there are ``count`` of them."""
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        records = [r for r in map(json.loads, lines) if r["event"] == event]
        if len(records) >= count or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def test_code_in_user_expressions_is_audited(
    start_kernel: KernelStarter, workspace: Path, tmp_path: Path
) -> None:
    """An execute_request with empty code (silent, too) wrote a file from its user_expressions,
    and the log said "code": ""."""
    _, kc = start_kernel()
    audit = tmp_path / "data" / "sandbox-kernel" / "audit.jsonl"
    write = "open('pwned.txt', 'w').write('from a user expression')"
    for silent in (False, True):
        msg_id = kc.execute("", silent=silent, user_expressions={"w": write})
        reply = shell_reply(kc, timeout=30)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["user_expressions"]["w"]["status"] == "ok"
    assert (workspace / "pwned.txt").read_text() == "from a user expression"  # it ran
    records = audit_lines(audit, 2)
    assert [(r["code"], r["user_expressions"]) for r in records[-2:]] == [("", {"w": write})] * 2
    assert [r.get("silent", False) for r in records[-2:]] == [False, True]


def test_debug_requests_never_reach_the_kernel(
    start_kernel: KernelStarter, workspace: Path, tmp_path: Path
) -> None:
    """The image ships debugpy and ipykernel answers debug_request on control whatever the
    kernelspec says; JupyterLab's sequence (initialize, attach, evaluate) ran code with no
    audit line. Every shipped kernelspec says "debugger": false: the bridge refuses them."""
    _, kc = start_kernel()
    audit = tmp_path / "data" / "sandbox-kernel" / "audit.jsonl"
    write = "open('debugged.txt', 'w').write('from the debugger')"
    steps = [
        ("initialize", {"clientID": "attacker", "adapterID": "python", "pathFormat": "path"}),
        ("attach", {}),
        ("evaluate", {"expression": write, "context": "repl"}),
    ]
    for seq, (command, arguments) in enumerate(steps, 1):
        msg = kc.session.msg(
            "debug_request", {"seq": seq, "type": "request", "command": command, "arguments": arguments}
        )
        kc.control_channel.send(msg)
        reply = kc.get_control_msg(timeout=10)
        assert reply["parent_header"]["msg_id"] == msg["header"]["msg_id"]
        assert reply["msg_type"] == "debug_reply"
        assert reply["content"]["status"] == "error", reply["content"]
        assert reply["content"]["success"] is False
        assert "debugger" in reply["content"]["message"]
    # Code on the control channel, which ipykernel would run beside the shell: refused too.
    execute = kc.session.msg("execute_request", {"code": write.replace("debugged", "controlled")})
    kc.control_channel.send(execute)
    assert kc.get_control_msg(timeout=10)["content"]["status"] == "error"
    assert run_ok(kc, "import os; print(sorted(os.listdir('.')))").strip() == "[]"
    assert not (workspace / "debugged.txt").exists()
    refused = all_records(audit, "refused", 4)
    assert [r.get("command") for r in refused] == ["initialize", "attach", "evaluate", None]
    assert refused[2]["code"] == write
    assert refused[3]["msg_type"] == "execute_request"
    assert refused[3]["channel"] == "control"


def test_a_kernels_life_and_the_hosts_file_operations_are_audited(
    jupyter_dirs: Path, workspace: Path, tmp_path: Path
) -> None:
    """Start, restart, shutdown and the files API's uploads, downloads and deletes each
    leave a line saying which process did it (they left none)."""
    from sandbox_kernel import SandboxSession
    from sandbox_kernel.lifecycle.ownership import server_identity

    log = tmp_path / "audit.jsonl"
    with SandboxSession(
        KERNEL, cwd=workspace, config={"SandboxProvisioner": {"audit_log": str(log)}}
    ) as sandbox:
        sandbox.files.upload("in.csv", b"a,b\n1,2\n")
        assert sandbox.files.download("in.csv") == b"a,b\n1,2\n"
        sandbox.files.delete("in.csv")
        sandbox.restart()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    events = [(line["event"], line.get("action")) for line in lines if line["event"] != "execute"]
    assert events[:6] == [
        ("start", None),
        ("files", "upload"),
        ("files", "download"),
        ("files", "delete"),
        ("exit", None),  # the first container, stopped for the restart
        ("restart", None),
    ], events
    # The shutdown's request and the kernel's end, in whichever order they meet.
    assert sorted(events[6:]) == [("exit", None), ("shutdown", None)], events
    for line in lines:
        if line["event"] in ("start", "files", "restart", "shutdown"):
            assert line["owner"] == server_identity()
            assert line["server_uid"] == os.getuid()
    start = lines[0]
    assert start["image"] == "sandbox-kernel/python:latest"
    assert start["workspace"] == str(workspace)
    upload = next(line for line in lines if line.get("action") == "upload")
    assert (upload["path"], upload["bytes"]) == ("/workspace/in.csv", 8)
