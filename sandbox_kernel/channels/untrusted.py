"""Text that came out of the sandbox, made safe to show where the host's own text is.

A kernel's output reaches the server's log and error messages (its last lines when it
dies, say). Verbatim, it could forge log lines or, through terminal control sequences
(OSC 52 sets the clipboard of whoever tails the log), act on the reader's terminal.
"""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, and C1 controls (ESC starts every sequence).
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
#: What starts each line of kernel output where the host shows it.
MARGIN = "  | "


def visible(text: str) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``), never acted on."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def quoted(text: str) -> str:
    """Kernel output for a log or a message: visible, each line behind :data:`MARGIN`, so
    that no line of it reads as the host's own."""
    return "\n".join(MARGIN + line for line in visible(text).splitlines())
