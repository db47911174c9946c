"""Reading Jupyter wire-protocol messages that come from the sandbox, defensively.

A message is ``[routing identities..., b"<IDS|MSG>", signature, header, parent_header,
metadata, content, buffers...]``. Frames from the kernel are untrusted: nothing here
raises on malformed input, and oversized JSON is not parsed at all.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import zmq
from jupyter_client.session import Session

DELIMITER = b"<IDS|MSG>"
#: Largest frame parsed as JSON where a small one is expected (headers, replies).
MAX_SMALL_FRAME = 64 * 1024


def find_delimiter(frames: Sequence[zmq.Frame | bytes]) -> int | None:
    """Index of the delimiter frame, if the message is complete enough to read."""
    for index, frame in enumerate(frames):
        raw = frame.bytes if isinstance(frame, zmq.Frame) else frame
        if raw == DELIMITER:
            return index if len(frames) >= index + 6 else None
    return None


def load_dict(frame: zmq.Frame | bytes, limit: int | None = MAX_SMALL_FRAME) -> dict[str, Any]:
    """A JSON object frame as a dict; {} if it is too big, not JSON, or not an object."""
    raw = frame.bytes if isinstance(frame, zmq.Frame) else frame
    if limit is not None and len(raw) > limit:
        return {}
    try:
        # ipykernel decodes with errors="replace" and runs what it gets; so must we, or
        # a stray invalid byte would hide a request from the audit log.
        value = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stderr_notice(session: Session, text: str, parent: dict[str, Any] | None) -> list[bytes]:
    """A signed IOPub stderr message from sandbox-kernel itself, as part of ``parent``'s output."""
    msg = session.msg("stream", {"name": "stderr", "text": f"\n[sandbox-kernel] {text}\n"}, parent=parent)
    return list(session.serialize(msg, ident=[b"stream.stderr"]))
