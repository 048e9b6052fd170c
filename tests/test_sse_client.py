"""benchmark/sse_client.py, the per-token benchmarks' client, against a real socket server
sending what the measured servers send: events split across chunks and several events in
one chunk (chunked), a close-delimited body, CRLF line ends, and an error status."""
from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
from sse_client import HTTPStatusError, sse_events  # noqa: E402

EVENTS = ['{"text": "a"}', '{"text": "b\\n"}', '{"usage": 2}', "[DONE]"]


def _chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def _serve(response: bytes) -> tuple[str, threading.Thread]:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def run():
        with srv:
            conn, _ = srv.accept()
            with conn:
                req = b""
                while b"\r\n\r\n" not in req:
                    req += conn.recv(4096)
                head, body = req.split(b"\r\n\r\n", 1)
                length = int(next(v for k, v in (h.split(b": ", 1) for h in head.split(b"\r\n")[1:])
                                  if k.lower() == b"content-length"))
                while len(body) < length:
                    body += conn.recv(4096)
                assert head.startswith(b"POST /v1/completions HTTP/1.1")
                for i in range(0, len(response), 7):  # in small writes: reads see pieces
                    conn.sendall(response[i:i + 7])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return f"http://127.0.0.1:{port}/v1/completions", t


def _sse(events: list[str], eol: bytes = b"\n") -> bytes:
    return b"".join(b"data: " + e.encode() + eol + eol for e in events)


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"])
def test_chunked_events_across_and_within_chunks(eol):
    stream = _sse(EVENTS, eol)
    pieces = [stream[:10], stream[10:40], stream[40:]]  # split mid-event, and several in one
    url, t = _serve(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                    b"Content-Type: text/event-stream\r\n\r\n" + _chunked(pieces))
    assert list(sse_events(url, {"prompt": "x"}, timeout=10)) == EVENTS
    t.join(10)


def test_close_delimited_body():
    url, t = _serve(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + _sse(EVENTS))
    assert list(sse_events(url, {"prompt": "x"}, timeout=10)) == EVENTS
    t.join(10)


def test_error_status_raises_with_body():
    body = b'{"error": {"message": "bad schema"}}'
    url, t = _serve(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    with pytest.raises(HTTPStatusError, match="HTTP 400.*bad schema"):
        list(sse_events(url, {"prompt": "x"}, timeout=10))
    t.join(10)
