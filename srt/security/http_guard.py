"""HTTP admission, checked before a request body is read: API keys and the body size.

A pure ASGI middleware (no body buffering): a missing or wrong key is a 401 and an
announced body over ``--max-request-bytes`` a 413, both in OpenAI's error shape, before
the server spends anything on the request. Keys are compared in constant time. A body
without Content-Length (chunked) is counted while it is read (``read_body_limited``).
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Optional

from srt import environ

# Endpoints that act on other users' requests or on server state (and expose its config).
ADMIN_PATHS = frozenset({"/abort_request", "/flush_cache", "/get_server_info"})
# No key: liveness probes, and Prometheus scrapes (SGLang exempts /metrics too; it exists
# only with --enable-metrics and shows counts, never prompts, outputs or keys).
OPEN_PATHS = frozenset({"/health", "/metrics"})


class RequestTooLarge(Exception):
    """The body exceeds --max-request-bytes (HTTP 413)."""


@dataclass(frozen=True)
class HttpGuardConfig:
    api_key: Optional[str]
    admin_api_key: Optional[str]
    max_request_bytes: int

    @classmethod
    def from_server_args(cls, server_args) -> "HttpGuardConfig":
        return cls(server_args.api_key or environ.GRAMSYNC_API_KEY.get() or None,
                   server_args.admin_api_key or environ.GRAMSYNC_ADMIN_API_KEY.get() or None,
                   server_args.max_request_bytes)

    def keys_for(self, path: str) -> tuple[str, ...]:
        """The keys any one of which admits a request to ``path`` (empty: open)."""
        if path in OPEN_PATHS:
            return ()
        if path in ADMIN_PATHS:
            return tuple(k for k in (self.admin_api_key or self.api_key,) if k)
        return tuple(k for k in (self.api_key, self.admin_api_key if self.api_key else None) if k)


class HttpGuard:
    def __init__(self, app, config: HttpGuardConfig):
        self.app = app
        self.config = config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        keys = self.config.keys_for(scope.get("path", ""))
        if keys and not _authorized(headers.get(b"authorization", b""), keys):
            return await _reply(send, 401, "Missing or invalid API key: send 'Authorization: "
                                "Bearer <key>'.", code="invalid_api_key",
                                extra_headers=[(b"www-authenticate", b"Bearer")])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.config.max_request_bytes:
            return await _reply(send, 413, f"The request body ({int(length)} bytes) exceeds the "
                                f"server's limit of {self.config.max_request_bytes} bytes "
                                "(--max-request-bytes).")
        return await self.app(scope, receive, send)


def _authorized(header: bytes, keys: tuple[str, ...]) -> bool:
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    token = token.strip()
    ok = False
    for key in keys:  # every key is compared: the time does not tell which one matched
        ok |= hmac.compare_digest(token, key.encode())
    return ok


async def read_body_limited(request, limit: int) -> bytes:
    """The whole body, or RequestTooLarge as soon as it passes ``limit`` bytes."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"The request body exceeds the server's limit of {limit} "
                                  "bytes (--max-request-bytes).")
        chunks.append(chunk)
    return b"".join(chunks)


async def _reply(send, status: int, message: str, code=None, extra_headers=()) -> None:
    from srt.entrypoints.openai_protocol import error_body

    body = error_body(message, status)
    if code is not None:
        body["error"]["code"] = code
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *extra_headers]})
    await send({"type": "http.response.body", "body": data})
