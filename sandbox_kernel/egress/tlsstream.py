"""The server end of a TLS connection over an asyncio stream pair, decrypted in memory.

The proxy ends the kernel's TLS for the domains whose credentials it adds (see ``ca.py``).
By then it has read the ClientHello off the connection (to check its server name), so
asyncio's own ``start_tls`` cannot take the connection over: an ``ssl.SSLObject`` over
memory buffers is given those bytes first, then whatever else arrives. The class has
the parts of ``StreamReader`` and ``StreamWriter`` the proxy uses, so its request and
response copying work on it unchanged.
"""

from __future__ import annotations

import asyncio
import ssl

_CHUNK = 64 * 1024


class TlsStream:
    """Reads and writes plaintext; the connection underneath carries TLS."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        context: ssl.SSLContext,
        received: bytes = b"",
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._incoming.write(received)

    @property
    def transport(self) -> asyncio.BaseTransport:
        return self._writer.transport

    async def handshake(self) -> None:
        """Complete the handshake.

        Raises:
            ssl.SSLError: the client's TLS failed (it does not trust the certificate, say).
            EOFError: the connection closed first.
        """
        while True:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise EOFError from None
                continue
            await self._flush()
            return

    async def _fill(self) -> bool:
        data = await self._reader.read(_CHUNK)
        if not data:
            self._incoming.write_eof()
            return False
        self._incoming.write(data)
        return True

    async def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            self._writer.write(data)
            await self._writer.drain()

    async def read(self, limit: int = _CHUNK) -> bytes:
        """Up to ``limit`` bytes of plaintext; b"" once the client closed (with or
        without a TLS close_notify)."""
        while True:
            try:
                data = self._tls.read(limit)
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    continue  # the SSLObject now reports the end
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            else:
                await self._flush()
                return data

    def write(self, data: bytes) -> None:
        self._tls.write(data)
        self._writer.write(self._outgoing.read())

    async def drain(self) -> None:
        await self._flush()
        await self._writer.drain()

    def can_write_eof(self) -> bool:
        return not self._writer.is_closing()

    def write_eof(self) -> None:
        """Send TLS's close_notify (the connection itself stays open to read)."""
        try:
            self._tls.unwrap()
        except (ssl.SSLWantReadError, ssl.SSLError):
            pass
        self._writer.write(self._outgoing.read())

    def is_closing(self) -> bool:
        return self._writer.is_closing()
