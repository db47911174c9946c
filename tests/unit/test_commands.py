"""The shell-command cell, run here in a plain interpreter (the kernel runs the same
cell in the sandbox), and the reading of its result."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from IPython import display

from sandbox_kernel.agents.commands import (
    RESULT_KEY,
    CommandResult,
    command_cell,
    command_result,
    env_cell,
    restore_cell,
    saved_env,
)


@dataclass
class Shown:
    data: dict[str, Any] = field(default_factory=dict)


def run_cell(monkeypatch: pytest.MonkeyPatch, command: str, **options: Any) -> CommandResult:
    """Run the cell as the kernel would, catching what it displays."""
    shown: list[Shown] = []
    monkeypatch.setattr(display, "publish_display_data", lambda data, **_: shown.append(Shown(data)))
    arguments = {"timeout": 10.0, "cwd": None, "env": None, "max_output": 1000, **options}
    namespace: dict[str, Any] = {"kept": "as it was"}
    exec(command_cell(command, **arguments), namespace)  # noqa: S102 (what the kernel runs)
    assert set(namespace) == {"kept", "__builtins__"}, "the cell leaves no name behind"
    return command_result(shown, None)


def test_a_command_gives_its_exit_code_stdout_and_stderr(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    done = run_cell(
        monkeypatch, "echo out; echo err >&2; echo $NAME; pwd; exit 3", cwd=str(tmp_path), env={"NAME": "v"}
    )
    assert (done.exit_code, done.stdout, done.stderr, done.ok) == (3, f"out\nv\n{tmp_path}\n", "err\n", False)
    assert done.duration > 0
    assert run_cell(monkeypatch, "true").ok


def test_a_command_past_its_timeout_is_killed_with_its_children(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = run_cell(monkeypatch, "sleep 30 & sleep 30", timeout=0.5)
    assert (slow.timed_out, slow.exit_code) == (True, None)
    assert slow.error is not None
    assert "timeout of 0.5 s" in slow.error


def test_output_keeps_its_head_and_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    loud = run_cell(monkeypatch, "echo HEAD; yes | head -c 100000; echo TAIL", max_output=200)
    assert loud.truncated
    assert loud.stdout.startswith("HEAD\n")
    assert loud.stdout.endswith("TAIL\n")
    assert "bytes of output dropped: over max_output=200" in loud.stdout


def test_a_command_that_cannot_start_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    failed = run_cell(monkeypatch, "ls", cwd=str(tmp_path / "missing"))
    assert failed.exit_code is None
    assert failed.error is not None
    assert failed.error.startswith("the command could not start: FileNotFoundError")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"command": " "}, "non-empty"),
        ({"command": "ls", "timeout": 0}, "positive number of seconds"),
        ({"command": "ls", "max_output": -1}, "0 or more"),
        ({"command": "ls", "env": {"A=B": "x"}}, "not an environment variable's name"),
        ({"command": "ls", "env": {"A": "x\0y"}}, "without NUL"),
    ],
)
def test_bad_arguments_are_refused(arguments: dict[str, Any], message: str) -> None:
    given = {"timeout": 1.0, "cwd": None, "env": None, "max_output": 10, **arguments}
    with pytest.raises(ValueError, match=message):
        command_cell(given.pop("command"), **given)


def test_a_result_is_read_for_its_shape_only() -> None:
    forged = Shown({"application/json": {RESULT_KEY: {"exit_code": True, "stdout": 5, "duration": "x"}}})
    result = command_result([forged], None)
    assert (result.exit_code, result.stdout, result.duration) == (None, "5", 0.0)
    missing = command_result([], "KernelDied: the kernel stopped")
    assert missing.error == "KernelDied: the kernel stopped"
    assert command_result([], None).error == "the sandbox returned no result for the command"


def test_env_cells_set_variables_and_put_them_back(monkeypatch: pytest.MonkeyPatch) -> None:
    shown: list[Shown] = []
    monkeypatch.setattr(display, "publish_display_data", lambda data, **_: shown.append(Shown(data)))
    monkeypatch.setenv("KEPT", "before")
    monkeypatch.delenv("FRESH", raising=False)
    wanted = {"KEPT": "during", "FRESH": "new"}
    namespace: dict[str, Any] = {}
    exec(env_cell(wanted), namespace)  # noqa: S102 (what the kernel runs)
    assert (os.environ["KEPT"], os.environ["FRESH"]) == ("during", "new")
    saved = saved_env(shown, wanted)
    assert saved == {"KEPT": "before", "FRESH": None}
    exec(restore_cell(saved), namespace)  # noqa: S102
    assert os.environ["KEPT"] == "before"
    assert "FRESH" not in os.environ
    assert set(namespace) == {"__builtins__"}
    assert saved_env([], wanted) == {}, "nothing shown: nothing is put back (nor unset)"
