"""The audit log file itself: JSON lines, rotation, private files."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from sandbox_kernel.audit import AuditLog


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
