"""Test servers shared by the egress proxy's unit tests and the integration tests."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from typing import Any


class KeepAliveUpstream:
    """A plain HTTP/1.1 server that keeps every connection open and parses request after
    request on it, whatever ``Connection: close`` says, as some servers and most virtual
    hosting fronts do: what a proxy forwards past the first request reaches it.

    It records every request it parses, answers each with it as JSON (Content-Length,
    no Connection header), reads chunked bodies, answers ``Expect: 100-continue``, and on
    ``/early`` answers 417 at once without reading the body (then parses on).
    """

    def __init__(self, timeout: float = 5) -> None:
        self.timeout = timeout
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.timeout)
        stream = conn.makefile("rb")
        with conn, stream, contextlib.suppress(OSError, ValueError):
            while True:
                line = stream.readline()
                if not line:
                    return
                if not line.strip():
                    continue
                method, path, _ = line.decode("latin-1").split(" ", 2)
                headers: list[list[str]] = []
                while (header := stream.readline().decode("latin-1").strip()) != "":
                    name, _, value = header.partition(":")
                    headers.append([name.strip().lower(), value.strip()])
                fields = {name: value for name, value in headers}
                request = {"method": method, "path": path, "host": fields.get("host"), "headers": headers}
                self.seen.append(request)
                if fields.get("expect", "").lower() == "100-continue":
                    if path == "/early":
                        conn.sendall(b"HTTP/1.1 417 Expectation Failed\r\nContent-Length: 0\r\n\r\n")
                        continue
                    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = b""
                if fields.get("transfer-encoding", "").lower() == "chunked":
                    while size := int(stream.readline().split(b";")[0], 16):
                        body += stream.read(size)
                        stream.readline()
                    while stream.readline().strip():
                        pass
                elif "content-length" in fields:
                    body = stream.read(int(fields["content-length"]))
                request["body"] = body.decode("latin-1")
                data = json.dumps(request).encode()
                head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                if path == "/chunked":
                    head = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                    data = b"".join(b"%x;x=y\r\n%s\r\n" % (len(part), part) for part in (data[:7], data[7:]))
                    data += b"0\r\nX-Trailer: t\r\n\r\n"
                conn.sendall(head.encode() + b"\r\n" + (b"" if method == "HEAD" else data))

    def paths(self) -> list[str]:
        return [request["path"] for request in self.seen]

    def stop(self) -> None:
        self.listener.close()
