"""The session API's pure parts: output as a terminal shows it, and a cut run's notices."""

from __future__ import annotations

import io
import time

import pytest

from sandbox_kernel.agents.session import MESSAGE_ALLOWANCE, Execution, _as_asked, rendered
from sandbox_kernel.channels.output import amount


@pytest.mark.parametrize(
    ("printed", "shown"),
    [
        ("plain\ntext\n", "plain\ntext\n"),
        ("\x1b[31mred\x1b[0m\n", "red\n"),
        ("step 0/2\rstep 1/2\rstep 2/2\n", "step 2/2\n"),
        ("downloading 10%\x1b[2K\rdownloaded\n", "downloaded\n"),
        ("abc\rX", "Xbc"),
        ("a\r\nb\r\n", "a\nb\n"),
        ("one\ntwo\n\x1b[1A\x1b[2Kdone\n", "one\ndone\n"),
        ("50%\x1b[K\r100%\x1b[0K\n", "100%\n"),
        ("ab\x08c\n", "ac\n"),
        ("\x1b[?25l 1/3\r 3/3\x1b[?25h\n", " 3/3\n"),
    ],
)
def test_rendered_is_what_a_terminal_shows_in_the_end(printed: str, shown: str) -> None:
    assert rendered(printed) == shown


@pytest.mark.parametrize(
    "hostile",
    [
        "x" * 2_000_000 + "\rX" * 1_000_000,
        "x" * 500_000 + "\x1b[2Ky" * 200_000,
        ("x" * 1000 + "\n") * 1000 + "\x1b[1000A\x1b[2K" * 50_000,
    ],
)
def test_rendering_costs_no_more_than_the_texts_length(hostile: str) -> None:
    started = time.monotonic()
    shown = rendered(hostile)
    assert time.monotonic() - started < 5
    assert "\r" not in shown
    assert "\x1b" not in shown


def limit_of(size: int) -> str:
    """How the host's marker names a run's own limit."""
    return f"the output limit of {amount(size)} set for this execution"


def test_a_cut_run_names_the_limit_asked_and_keeps_whole_lines() -> None:
    """#23 item 14: 64 KiB asked was "72 KiB" (the allowance for message headers), and
    the cut fell mid-line."""
    asked = 64 * 1024
    sent = asked + MESSAGE_ALLOWANCE
    lines = [f"line {i:05} " + "x" * 30 for i in range(2000)]
    head = "\n".join(lines[:1000])[:-7]  # cut inside a line
    tail = "\n".join(lines[1500:])[5:] + "\n"
    marker = f"\n[... 20 KiB of output dropped: over {limit_of(sent)} ...]\n"
    notice = (
        f"[sandbox-kernel] Output truncated: this execution produced more than {amount(sent)} of output; ..."
    )
    execution = Execution(stdout=head + marker + tail, stderr=notice)
    _as_asked(execution, asked)
    assert "more than 64 KiB of output" in execution.stderr
    assert "output limit of 64 KiB set" in execution.stdout
    assert "72 KiB" not in execution.stdout + execution.stderr
    before, _, after = execution.stdout.partition("\n[... ")
    assert before.splitlines() == lines[:999]
    assert after.splitlines()[1:] == lines[1501:]


def test_one_long_line_cut_keeps_its_head_and_tail() -> None:
    """No line break near the cut: nothing more is dropped."""
    sent, asked = 20_000 + MESSAGE_ALLOWANCE, 20_000
    marker = f"\n[... 180 KiB of output dropped: over {limit_of(sent)} ...]\n"
    execution = Execution(stdout="HEAD" + "x" * 10_000 + marker + "x" * 5000 + "TAIL\n")
    _as_asked(execution, asked)
    assert execution.stdout.startswith("HEAD")
    assert execution.stdout.endswith("TAIL\n")


def test_a_rich_progress_bar_as_pip_draws_it_is_its_last_state() -> None:
    """pip draws its download bars with rich: each redraw erases the line and starts over."""
    rich = pytest.importorskip("pip._vendor.rich.console")
    progress = pytest.importorskip("pip._vendor.rich.progress")
    drawn = io.StringIO()
    console = rich.Console(file=drawn, force_terminal=True, width=80)
    with progress.Progress(progress.BarColumn(), progress.DownloadColumn(), console=console) as bar:
        task = bar.add_task("download", total=1000)
        for _ in range(10):
            bar.update(task, advance=100)
            bar.refresh()
    assert drawn.getvalue().count("\r") > 5
    assert rendered(drawn.getvalue()) == "━" * 40 + " 1.0/1.0 kB\n"


def test_a_run_cut_at_the_servers_limit_keeps_whole_lines_too() -> None:
    lines = [f"line {i:05} " + "x" * 30 for i in range(2000)]
    marker = "\n[... 2 MiB of output dropped: over this kernel's output limit of 10 MiB per execution ...]\n"
    execution = Execution(stdout="\n".join(lines[:1000])[:-7] + marker + "\n".join(lines[1500:])[5:] + "\n")
    _as_asked(execution, None)
    before, _, after = execution.stdout.partition("\n[... ")
    assert before.splitlines() == lines[:999]
    assert after.splitlines()[1:] == lines[1501:]
    assert "of 10 MiB per execution" in execution.stdout
