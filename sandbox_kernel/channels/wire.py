"""Reading Jupyter wire-protocol messages defensively, and checking their signatures.

A message is ``[routing identities..., b"<IDS|MSG>", signature, header, parent_header,
metadata, content, buffers...]``. Frames from the kernel are untrusted, and so is
everything a local client sends until its signature is checked: nothing here raises on
malformed input, and oversized JSON is not parsed at all.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from typing import Any

import zmq
from jupyter_client.session import Session

DELIMITER = b"<IDS|MSG>"
#: Largest frame parsed as JSON where a small one is expected (headers, replies).
MAX_SMALL_FRAME = 64 * 1024
#: Most bytes read of a header or parent header the kernel wrote: a real one is a few
#: hundred bytes; one padded past this is read as empty, not parsed (a kernel's padding
#: must not cost the bridge more per message than checking its signature).
MAX_HEADER_FRAME = 2048


def frame_bytes(frame: zmq.Frame | bytes) -> bytes:
    return frame.bytes if isinstance(frame, zmq.Frame) else frame


def find_delimiter(frames: Sequence[zmq.Frame | bytes]) -> int | None:
    """Index of the delimiter frame, if the message is complete enough to read."""
    for index, frame in enumerate(frames):
        if len(frame) == len(DELIMITER) and frame_bytes(frame) == DELIMITER:
            return index if len(frames) >= index + 6 else None
    return None


def load_dict(frame: zmq.Frame | bytes, limit: int | None = MAX_SMALL_FRAME) -> dict[str, Any]:
    """A JSON object frame as a dict; {} if it is too big, not JSON, or not an object."""
    raw = frame_bytes(frame)
    if limit is not None and len(raw) > limit:
        return {}
    try:
        # ipykernel decodes with errors="replace" and runs what it gets; so must we, or
        # a stray invalid byte would hide a request from the audit log.
        value = json.loads(raw.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        # RecursionError: b"[" * 1005 nests deeper than the parser goes.
        return {}
    return value if isinstance(value, dict) else {}


class Signatures:
    """Checks the HMAC of Jupyter messages with the kernel's session key.

    As in jupyter_client, an empty key means messages are not signed (and all pass).
    """

    def __init__(self, key: bytes, scheme: str = "hmac-sha256") -> None:
        algorithm = scheme.removeprefix("hmac-")
        if not scheme.startswith("hmac-") or algorithm not in hashlib.algorithms_available:
            msg = f"signature_scheme={scheme!r} is not supported; use e.g. 'hmac-sha256'"
            raise ValueError(msg)
        #: Keyed once, copied for each message (as jupyter_client's Session does).
        self._keyed = hmac.new(key, digestmod=algorithm) if key else None

    def valid(self, frames: Sequence[zmq.Frame | bytes], index: int) -> bool:
        """Whether the message whose delimiter is at ``index`` carries a valid signature."""
        if self._keyed is None:
            return True
        mac = self._keyed.copy()
        for frame in frames[index + 2 : index + 6]:
            mac.update(frame.buffer if isinstance(frame, zmq.Frame) else frame)
        return hmac.compare_digest(frame_bytes(frames[index + 1]), mac.hexdigest().encode())


def stream_message(session: Session, name: str, text: str, parent: dict[str, Any] | None) -> list[bytes]:
    """A signed IOPub stream message (``name`` "stdout" or "stderr") written on the host,
    as part of ``parent``'s output."""
    msg = session.msg("stream", {"name": name, "text": text}, parent=parent)
    return list(session.serialize(msg, ident=[f"stream.{name}".encode()]))


def stderr_notice(session: Session, text: str, parent: dict[str, Any] | None) -> list[bytes]:
    """A signed IOPub stderr message from sandbox-kernel itself, as part of ``parent``'s output."""
    return stream_message(session, "stderr", f"\n[sandbox-kernel] {text}\n", parent)
