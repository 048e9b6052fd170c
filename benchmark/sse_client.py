"""A lean streaming HTTP/1.1 client for the per-token benchmarks: one POST on its own
connection (a blocking socket; run several in threads), the response's SSE ``data:``
events yielded as they arrive.

Why not httpx: on a 2-core machine the client shares the cores with the server it measures,
and the step then waits for it. Per streamed token (Xeon, 2 vCPUs, 2026-12-05, the same
server) httpx's async stream took 0.6-1.5 ms of the client's CPU, asyncio's streams with
our own parsing 0.30-0.37 (0.21-0.27 on uvloop), a blocking socket 0.08-0.12. It handles
what the servers measured here send (a status line, headers, a chunked, sized or
close-delimited body of ``data: ...`` events) and nothing more.
"""
from __future__ import annotations

import json
import socket
from typing import Iterator
from urllib.parse import urlsplit

RECV_BYTES = 1 << 16


class HTTPStatusError(RuntimeError):
    pass


class _Body:
    """The response body's bytes as they arrive, de-chunked."""

    def __init__(self, sock: socket.socket, buf: bytes, headers: dict[str, str]):
        self.sock, self.buf = sock, buf
        self.chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        self.left = int(headers["content-length"]) if "content-length" in headers else None

    def _recv(self) -> bool:
        data = self.sock.recv(RECV_BYTES)
        self.buf += data
        return bool(data)

    def pieces(self) -> Iterator[bytes]:
        if not self.chunked:
            while self.left is None or self.left > 0:
                if self.buf:
                    piece, self.buf = self.buf, b""
                    if self.left is not None:
                        self.left -= len(piece)
                    yield piece
                elif not self._recv():
                    return
            return
        while True:
            while b"\r\n" not in self.buf:
                if not self._recv():
                    raise ConnectionError("the connection closed inside a chunked body")
            line, rest = self.buf.split(b"\r\n", 1)
            size = int(line.split(b";", 1)[0], 16)
            while len(rest) < size + 2:
                data = self.sock.recv(RECV_BYTES)
                if not data:
                    raise ConnectionError("the connection closed inside a chunk")
                rest += data
            self.buf = rest[size + 2:]
            if size == 0:
                return
            yield rest[:size]


def _read_head(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(RECV_BYTES)
        if not data:
            raise ConnectionError("the server closed the connection before its response")
        buf += data
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(lines[0].split(" ", 2)[1]), headers, rest


def sse_events(url: str, body: dict, timeout: float = 300.0) -> Iterator[str]:
    """POST ``body`` as JSON to ``url`` and yield each SSE event's data (``[DONE]``
    included) as it arrives; ``timeout`` bounds each wait for bytes. A status other than
    200 raises with the response's start."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"only http:// URLs: {url}")
    payload = json.dumps(body).encode()
    with socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout) as sock:
        sock.sendall(f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                     f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        status, headers, rest = _read_head(sock)
        body_reader = _Body(sock, rest, headers)
        if status != 200:
            raise HTTPStatusError(f"HTTP {status}: {b''.join(body_reader.pieces())[:300]!r}")
        pending = b""
        for piece in body_reader.pieces():
            pending += piece.replace(b"\r\n", b"\n")
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:].decode()
