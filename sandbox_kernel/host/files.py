"""Small files of the host's own (a kernel's owner and state, the gateway's keys and
tokens): each written whole, in place at once, never through a link planted in its folder."""

from __future__ import annotations

import os
from pathlib import Path


def replace_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` with ``mode`` (exactly: whatever the umask), replacing it
    atomically; a link planted at the temporary name is refused (``O_EXCL | O_NOFOLLOW``),
    not followed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode & 0o600)
    os.fchmod(fd, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)
