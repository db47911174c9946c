"""The workspace file tools of the MCP server (:mod:`~.mcp_server`), behind the tools
themselves: what ``upload_file``, ``download_file``, ``delete_file`` and ``list_files``
do with a session's files, and the one-line errors they give.

:class:`~.mcp_server.KernelTools` keeps the tools (their parameters and descriptions)
and which kernel's workspace a call uses; this module the work on it, through the
session API's files (:class:`~sandbox_kernel.agents.files.WorkspaceFiles`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ContentBlock

from sandbox_kernel.agents.files import FileTooLargeError, FolderNotEmptyError, from_printable
from sandbox_kernel.agents.mcp_results import (
    DeleteOutput,
    DownloadOutput,
    ListFilesOutput,
    base64_size,
    encode_download,
    file_entry,
    one_line,
    page,
)
from sandbox_kernel.errors import SandboxKernelError

T = TypeVar("T")

#: The largest file ``download_file`` returns; bigger ones are read in parts with ``run_code``.
MAX_DOWNLOAD = 10 * 1024 * 1024


class Files(Protocol):
    """A session's files (:class:`~sandbox_kernel.agents.files.WorkspaceFiles`), as far as the
    server uses them."""

    async def upload(self, path: str, data: bytes | str) -> str: ...
    async def download(self, path: str, max_bytes: int | None = None) -> bytes: ...
    async def list(self, path: str = ".") -> list[Any]: ...
    async def delete(self, path: str, recursive: bool = False) -> None: ...


def upload_data(path: str, content: str, encoding: str, limit: int) -> bytes:
    """``upload_file``'s ``content`` for ``path`` as bytes, checked before any kernel is
    asked for: at most ``limit`` bytes.

    Raises:
        ToolError: too big, or content that does not decode.
    """
    # Refused before it is decoded where the size shows: no copy of what is refused.
    # A text's characters are fewer than its UTF-8 bytes, or as many.
    size, exact = (base64_size(content), True) if encoding == "base64" else (len(content), False)
    if size <= limit:
        data = decode_upload(content, encoding)
        size, exact = len(data), True
    if size > limit:
        msg = (
            f"{path!r} would be {'' if exact else 'at least '}{size:,} bytes: over the {limit:,} "
            "bytes upload_file takes in one call (McpLimits.max_upload). Upload it in parts under "
            "that size and join them with run_code (open(path, 'ab')), or have the kernel make "
            "or fetch it."
        )
        raise ToolError(msg)
    return data


async def download(files: Files, path: str) -> tuple[DownloadOutput, list[ContentBlock]]:
    """``download_file``: the file at ``path``, and image content if it is an image.

    Raises:
        ToolError: over :data:`MAX_DOWNLOAD`.
    """
    try:
        data = await in_workspace(lambda where: files.download(where, max_bytes=MAX_DOWNLOAD), path)
    except FileTooLargeError as exc:
        msg = (
            f"{path!r} is {exc.size:,} bytes{' or more' if exc.size == exc.limit + 1 else ''}: over "
            f"the {exc.limit:,} bytes download_file returns. Read what you need of it with run_code "
            "(e.g. pandas, or f.seek() and f.read(n)), or have the kernel summarise, split or "
            "compress it into smaller files."
        )
        raise ToolError(msg) from exc
    return encode_download(path, data)


async def delete(files: Files, path: str, recursive: bool) -> DeleteOutput:
    """``delete_file``: the file or folder at ``path`` removed.

    Raises:
        ToolError: a folder that is not empty, without ``recursive``.
    """
    try:
        await in_workspace(lambda where: files.delete(where, recursive), path)
    except FolderNotEmptyError as exc:
        msg = f"{path!r} is a folder that is not empty: call delete_file again with recursive=true"
        raise ToolError(msg) from exc
    return {"path": path, "status": "deleted"}


async def listing(files: Files, path: str, offset: int, limit: int) -> ListFilesOutput:
    """``list_files``: a page of the folder at ``path``."""
    infos = await in_workspace(files.list, path)
    shown, next_offset = page(infos, offset, limit)
    return {
        "path": path,
        "files": [file_entry(info) for info in shown],
        "total": len(infos),
        "offset": offset,
        "more": next_offset is not None,
        "next_offset": next_offset,
    }


def decode_upload(content: str, encoding: str) -> bytes:
    """``upload_file``'s content as bytes.

    Raises:
        ToolError: ``encoding`` is unknown or the content is not valid base64.
    """
    if encoding == "utf-8":
        try:
            return content.encode("utf-8")
        except UnicodeEncodeError as exc:
            msg = (
                f"content holds {content[exc.start : exc.end]!r} at {exc.start}, half a character "
                "(a lone surrogate) that UTF-8 cannot hold: send binary content as base64"
            )
            raise ToolError(one_line(msg)) from None
    if encoding == "base64":
        try:
            # Line breaks are allowed (base64 is often wrapped); anything else is an error.
            return base64.b64decode("".join(content.split()), validate=True)
        except (binascii.Error, ValueError) as exc:
            msg = f"content is not valid base64 ({exc}); send text with encoding 'utf-8'"
            raise ToolError(one_line(msg)) from exc
    msg = f"unknown encoding {encoding!r}: use 'utf-8' for text or 'base64' for bytes"
    raise ToolError(one_line(msg))


async def in_workspace(call: Callable[[str], Awaitable[T]], path: str) -> T:
    """``call(path)``; where that fails and ``path`` has ``\\xNN`` escapes (as
    list_files shows a name that is not UTF-8), ``call`` of the path they stand for.
    A name that exists as written comes first.

    Raises:
        SandboxKernelError: neither worked; the error of ``path`` as written.
    """
    try:
        return await call(path)
    except SandboxKernelError:
        raw = from_printable(path)
        if raw != path:
            with contextlib.suppress(SandboxKernelError):
                return await call(raw)
        raise
