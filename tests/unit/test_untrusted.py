"""Kernel output shown in the host's log and messages cannot pass for the host's text."""

from __future__ import annotations

from sandbox_kernel.channels.untrusted import MARGIN, quoted, visible


def test_terminal_controls_are_shown_never_acted_on() -> None:
    osc52 = "\x1b]52;c;ZWNobyBwd25lZA==\x07"
    assert visible(f"a{osc52}b\x9b2J\tc") == "a\\x1b]52;c;ZWNobyBwd25lZA==\\x07b\\x9b2J\tc"


def test_a_forged_server_line_stays_behind_the_margin() -> None:
    forged = "boom\n[W 2026-12-02 06:40:27.752 ServerApp] all kernels stopped\r[I fake]"
    lines = quoted(forged).split("\n")
    assert lines == [
        MARGIN + "boom",
        MARGIN + "[W 2026-12-02 06:40:27.752 ServerApp] all kernels stopped\\x0d[I fake]",
    ]
    assert all(line.startswith(MARGIN) for line in lines)
