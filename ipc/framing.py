"""Frames on the control socket: writing them, reading them incrementally, and authentication.

``FrameReader`` is fed whatever bytes arrived and yields complete frames; the supervisor's
reactor uses it on non-blocking reads, the client's reader thread on blocking ones. A frame larger
than its kind allows, or of an unknown kind, is a ``ProtocolError`` and the connection is closed:
there is no way to resynchronise a byte stream after a lie about a length. A reader told to
expect ``only`` one kind (the supervisor's, before a peer has authenticated: the challenge
response) refuses any other kind at its 5-byte prefix, so an unauthenticated peer never makes
it buffer more than that one small frame.

Authentication is a challenge–response over the first two frames: the server sends 32 random
bytes, the client answers HMAC-SHA256(key, challenge); ``hmac.compare_digest`` checks it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any

from duomo.ipc.wire import CHALLENGE_BYTES, FRAME, MAX_JSON_BYTES, NOTICE, FrameKind, frame

_LIMITS = {
    FrameKind.CHALLENGE: CHALLENGE_BYTES,
    FrameKind.RESPONSE: hashlib.sha256().digest_size,
    FrameKind.JSON: MAX_JSON_BYTES,
    FrameKind.NOTICE: NOTICE.size,
}


class ProtocolError(Exception):
    """The peer broke the framing; the connection cannot continue."""


class FrameTooLargeError(ValueError):
    """A message too large for one control frame (``MAX_JSON_BYTES``)."""


class FrameReader:
    """Splits a byte stream into frames: ``feed`` it what arrived and it yields each complete
    ``(kind, payload)``; a lying length or a kind not accepted is a ``ProtocolError``."""

    def __init__(self, only: FrameKind | None = None) -> None:
        self._buffer = bytearray()
        # no partial frame is waiting for more bytes (a plain attribute: both readers test it
        # on every notice)
        self.empty = True
        # the one kind accepted now, or None for any (read at every frame: may change between)
        self.only = only

    def feed(self, data: bytes) -> Iterator[tuple[FrameKind, bytes]]:
        self._buffer += data
        self.empty = not self._buffer
        while len(self._buffer) >= FRAME.size:
            length, kind_code = FRAME.unpack_from(self._buffer)
            try:
                kind = FrameKind(kind_code)
            except ValueError:
                raise ProtocolError(f"unknown frame kind {kind_code}") from None
            if self.only is not None and kind is not self.only:
                raise ProtocolError(f"expected a {self.only.name} frame, got {kind.name}")
            if length > _LIMITS[kind] or (kind is not FrameKind.JSON and length != _LIMITS[kind]):
                raise ProtocolError(f"{kind.name} frame of {length} bytes (limit {_LIMITS[kind]})")
            end = FRAME.size + length
            if len(self._buffer) < end:
                return
            payload = bytes(self._buffer[FRAME.size : end])
            del self._buffer[:end]
            self.empty = not self._buffer
            yield kind, payload


def json_frame(message: dict[str, Any]) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    if len(payload) > MAX_JSON_BYTES:
        raise FrameTooLargeError(f"control message of {len(payload)} bytes is too large")
    return frame(FrameKind.JSON, payload)


def parse_json(payload: bytes) -> dict[str, Any]:
    try:
        message = json.loads(payload)
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError("control frame is not valid JSON") from None
    except RecursionError:  # (the decoder recurses per level; Python's limit stops it)
        raise ProtocolError("control message is nested too deeply") from None
    if not isinstance(message, dict):
        raise ProtocolError("control message must be a JSON object")
    return message


_NOTICE_FRAME = struct.Struct(FRAME.format + NOTICE.format.lstrip("<"))


def notice_frame(ring: int, slot: int, seq: int) -> bytes:
    return _NOTICE_FRAME.pack(NOTICE.size, FrameKind.NOTICE, ring, slot, seq & 0xFFFFFFFF)


def notice_packer(ring: int, slot: int) -> Callable[[int], bytes]:
    """``notice_frame`` for one slot, as a call that runs no Python (every request's path);
    the sequence number given must fit 32 bits."""
    return functools.partial(_NOTICE_FRAME.pack, NOTICE.size, FrameKind.NOTICE, ring, slot)


def answer(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, challenge, hashlib.sha256).digest()


def verify(key: bytes, challenge: bytes, response: bytes) -> bool:
    return hmac.compare_digest(answer(key, challenge), response)


def recv_frame(sock: socket.socket, reader: FrameReader) -> tuple[FrameKind, bytes]:
    """Block until one whole frame arrives (client side, before its reader thread starts)."""
    while True:
        for item in reader.feed(b""):
            return item
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("connection closed by the supervisor")
        for item in reader.feed(data):
            return item
