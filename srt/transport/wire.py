"""The wire format of every ZMQ message: typed msgpack, never pickle.

``recv_pyobj`` is ``pickle.loads`` on bytes from the network: anyone who can reach the
socket runs code in the receiving process (vLLM's CVE-2025-30165 is this bug). Here a
message is the msgpack array ``[type name, fields]`` and each socket decodes only the
frozen dataclasses it expects (msgspec checks every field's type while decoding). Bytes
that are not such a message raise ``WireError``; receivers drop them with a warning and
count them, and carry on.
"""
from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

import msgspec

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The largest message a socket accepts (a prompt at the longest contexts is far below).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class WireError(ValueError):
    """The bytes are not one of the message types this socket accepts."""


_ENVELOPE = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])


class MessageCodec(Generic[T]):
    """Encodes any of ``types`` (frozen dataclasses); decodes exactly those, or raises."""

    def __init__(self, *types: type):
        self._decoders = {t.__name__: msgspec.msgpack.Decoder(t) for t in types}
        self._names = {t: t.__name__ for t in types}
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, msg: Any) -> bytes:
        name = self._names.get(type(msg))
        if name is None:
            raise TypeError(f"{type(msg).__name__} is not a message this codec sends")
        return self._encoder.encode((name, msg))

    def decode(self, data: bytes) -> T:
        if len(data) > MAX_MESSAGE_BYTES:
            raise WireError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        try:
            name, raw = _ENVELOPE.decode(data)
            decoder = self._decoders.get(name)
            if decoder is None:
                raise WireError(f"unexpected message type {name[:64]!r}")
            return decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError,
                RecursionError, MemoryError) as e:  # deep nesting, absurd lengths
            if isinstance(e, WireError):
                raise
            raise WireError(f"malformed message: {str(e)[:200]}") from None


class DropCounter:
    """Counts (and logs, rate-limited) messages a receiver dropped as malformed."""

    def __init__(self, where: str):
        self.where = where
        self.count = 0

    def dropped(self, err: Exception, nbytes: int) -> None:
        self.count += 1
        if self.count <= 10 or self.count % 1000 == 0:
            logger.warning("%s: dropped a %d-byte message that is not a valid gramsync message "
                           "(%s); %d dropped so far", self.where, nbytes, err, self.count)


def recv_message(sock, codec: MessageCodec, drops: DropCounter, flags: int = 0):
    """Receive one frame and decode it; None (after counting it) when it is not valid."""
    data = sock.recv(flags, copy=True)
    try:
        return codec.decode(data)
    except WireError as e:
        drops.dropped(e, len(data))
        return None
