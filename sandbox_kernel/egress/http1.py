"""HTTP/1.x message framing for the egress proxy: where a body ends, nothing more.

Pure logic, no I/O. The proxy carries one request per connection: it must know exactly
where the request's body ends (everything after it is another request, never
forwarded), refuse requests whose end two parsers could disagree on (request
smuggling), and know where the upstream's response ends so that it can close then.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from sandbox_kernel.egress.rules import shown

#: A header field as the proxy keeps it: (name as sent, value without surrounding blanks).
Header = tuple[str, str]

_LENGTH = re.compile(r"[0-9]{1,15}")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: [^\r\n]*)?")
#: Response headers about the upstream connection, replaced by ``Connection: close``.
_CONNECTION_HEADERS = frozenset({b"connection", b"keep-alive", b"proxy-connection"})


class FramingError(ValueError):
    """The message's framing is ambiguous or malformed; the text says why."""


@dataclass(frozen=True)
class Framing:
    """How a body is delimited: ``length`` bytes, ``chunked``, by the connection's
    end (``close``), or there is none (``none``)."""

    kind: str
    length: int = 0


NO_BODY = Framing("none")
UNTIL_CLOSE = Framing("close")
CHUNKED = Framing("chunked")


def _values(headers: Sequence[Header], name: str) -> list[str]:
    return [value for field, value in headers if field.lower() == name]


def request_framing(version: str, headers: Sequence[Header]) -> Framing:
    """The framing of a request's body, refusing every form two parsers may read apart.

    Accepted: one ``Content-Length`` of digits, or (HTTP/1.1) one ``Transfer-Encoding:
    chunked``, or neither (no body).

    Raises:
        FramingError: both headers, either repeated, a coding other than chunked,
            Transfer-Encoding in HTTP/1.0, or a length that is not plain digits.
    """
    encodings = _values(headers, "transfer-encoding")
    lengths = _values(headers, "content-length")
    if encodings and lengths:
        msg = "a request with both Content-Length and Transfer-Encoding has ambiguous framing"
        raise FramingError(msg)
    if encodings:
        if version == "1.0":
            msg = "Transfer-Encoding in an HTTP/1.0 request"
            raise FramingError(msg)
        if len(encodings) > 1:
            msg = "more than one Transfer-Encoding header"
            raise FramingError(msg)
        if encodings[0].lower() != "chunked":
            msg = f"Transfer-Encoding '{shown(encodings[0], 40)}' is not supported; only 'chunked' is"
            raise FramingError(msg)
        return CHUNKED
    if lengths:
        if len(lengths) > 1:
            msg = "more than one Content-Length header"
            raise FramingError(msg)
        if not _LENGTH.fullmatch(lengths[0]):
            msg = f"Content-Length '{shown(lengths[0], 40)}' is not a number of bytes"
            raise FramingError(msg)
        return Framing("length", int(lengths[0]))
    return NO_BODY


def chunk_size(line: bytes) -> int:
    """The size on a chunk's size line (without its line end); extensions are ignored.

    Raises:
        FramingError: the line does not start with a hexadecimal size.
    """
    size = line.split(b";", 1)[0].strip(b" \t")
    if not _CHUNK_SIZE.fullmatch(size):
        msg = f"malformed chunk size line '{shown(line.decode('latin-1'), 40)}'"
        raise FramingError(msg)
    return int(size, 16)


def response_status(head: bytes) -> int:
    """The status code of a response head.

    Raises:
        FramingError: the head does not start with an HTTP/1.x status line.
    """
    status = _STATUS_LINE.fullmatch(head.split(b"\r\n", 1)[0])
    if status is None:
        msg = "the upstream's answer is not an HTTP/1.x response"
        raise FramingError(msg)
    return int(status.group(1))


def _response_headers(head: bytes) -> list[Header]:
    headers: list[Header] = []
    for line in head.split(b"\r\n")[1:]:
        name, colon, value = line.decode("latin-1").partition(":")
        if colon:
            headers.append((name.strip(), value.strip(" \t")))
    return headers


def response_framing(method: str, status: int, head: bytes) -> Framing:
    """How the body of a final response to a ``method`` request is delimited; when in
    doubt, by the connection's end."""
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return UNTIL_CLOSE if status == 101 else NO_BODY
    headers = _response_headers(head)
    encodings = [
        coding.strip().lower()
        for value in _values(headers, "transfer-encoding")
        for coding in value.split(",")
    ]
    if encodings:
        return CHUNKED if encodings[-1] == "chunked" else UNTIL_CLOSE
    lengths = {part.strip() for value in _values(headers, "content-length") for part in value.split(",")}
    if len(lengths) == 1:
        (length,) = lengths
        if _LENGTH.fullmatch(length):
            return Framing("length", int(length))
    return UNTIL_CLOSE


def connection_tokens(headers: Sequence[Header]) -> set[str]:
    """The lowercase options of a message's ``Connection`` headers ("close", and the
    names of headers meant for this hop only)."""
    tokens = {token.strip().lower() for value in _values(headers, "connection") for token in value.split(",")}
    return tokens - {""}


def response_keeps_connection(head: bytes) -> bool:
    """Whether the upstream keeps the connection open after this response: an HTTP/1.1
    response without ``Connection: close``."""
    return head.startswith(b"HTTP/1.1 ") and "close" not in connection_tokens(_response_headers(head))


def closing_response_head(head: bytes) -> bytes:
    """A final response head telling the client that the connection closes after it."""
    lines = head[:-4].split(b"\r\n")
    kept = [lines[0]]
    dropping = False
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):  # a folded continuation of the previous field
            if not dropping:
                kept.append(line)
            continue
        dropping = line.split(b":", 1)[0].strip().lower() in _CONNECTION_HEADERS
        if not dropping:
            kept.append(line)
    return b"\r\n".join([*kept, b"Connection: close", b"", b""])
