"""Reading the server name (SNI) from the start of a TLS connection, without TLS.

A CONNECT tunnel must carry TLS for the very name it was opened for; the proxy checks the
ClientHello's SNI before anything reaches the upstream. Input is untrusted: every length
is checked, and anything that is not a well-formed ClientHello is a ``ValueError``.
"""

from __future__ import annotations

#: The largest ClientHello accepted (post-quantum key shares make them grow).
MAX_CLIENT_HELLO = 64 * 1024


class IncompleteHello(Exception):
    """The ClientHello is not complete yet."""


def client_hello_sni(data: bytes) -> str | None:
    """The server name of the TLS ClientHello at the start of ``data``, or None without one.

    Raises:
        IncompleteHello: the ClientHello is incomplete.
        ValueError: ``data`` does not start with a TLS ClientHello.
    """
    handshake = bytearray()
    position = 0
    while True:
        if len(data) < position + 5:
            raise IncompleteHello
        content_type, major, length = (
            data[position],
            data[position + 1],
            int.from_bytes(data[position + 3 : position + 5], "big"),
        )
        if content_type != 22 or major != 3 or not 0 < length <= 16384 + 2048:
            msg = "not a TLS handshake record"
            raise ValueError(msg)
        if len(data) < position + 5 + length:
            raise IncompleteHello
        handshake += data[position + 5 : position + 5 + length]
        position += 5 + length
        if len(handshake) >= 4:
            if handshake[0] != 1:
                msg = "not a ClientHello"
                raise ValueError(msg)
            size = int.from_bytes(handshake[1:4], "big")
            if size > MAX_CLIENT_HELLO:
                msg = "ClientHello too large"
                raise ValueError(msg)
            if len(handshake) >= 4 + size:
                return _sni_from_hello(bytes(handshake[4 : 4 + size]))


def _sni_from_hello(hello: bytes) -> str | None:
    """Raises ValueError when the ClientHello body is malformed."""

    def take(position: int, size: int) -> int:
        if position + size > len(hello):
            msg = "truncated ClientHello"
            raise ValueError(msg)
        return int.from_bytes(hello[position : position + size], "big")

    position = 2 + 32  # version, random
    position += 1 + take(position, 1)  # session id
    position += 2 + take(position, 2)  # cipher suites
    position += 1 + take(position, 1)  # compression methods
    if position == len(hello):
        return None
    end = position + 2 + take(position, 2)
    position += 2
    if end > len(hello):
        msg = "truncated extensions"
        raise ValueError(msg)
    while position + 4 <= end:
        kind, size = take(position, 2), take(position + 2, 2)
        position += 4
        if kind == 0:  # server_name: a list of (type, name); type 0 is a host name
            names_end = position + 2 + take(position, 2)
            position += 2
            while position + 3 <= min(names_end, end):
                name_type, name_size = take(position, 1), take(position + 1, 2)
                position += 3
                if name_type == 0:
                    return hello[position : position + name_size].decode("ascii", "replace")
                position += name_size
            return None
        position += size
    return None
