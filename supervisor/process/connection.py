"""One client connection as the supervisor holds it: its socket, its stage, who reads it, and
what is waiting to be sent to it.

Created by the reactor on ``accept``; written to from any thread (the reactor's replies, the
model workers' "slot done" notices, control jobs' replies) through ``send``, which never blocks.

**Its state** is in two parts, because two different things change it. ``Stage`` is its life,
which only moves forward (the reactor authenticates it and drops it; any thread that sends may
cut it off); its members are also module names (``OPEN``, ``DROPPED``, …): every request's
path reads them, and an enum's attribute costs about 0.1 µs on Python 3.11. Who reads its
socket, the reactor or its model's idle worker, is its ``loan``: lending's state, defined and
changed by ``supervisor.process.lending`` (``Loan``), under the connection's ``owner`` lock.

**The send rule.** A frame goes straight to the socket while nothing is waiting before it.
What the socket does not take (its buffer is full: the client has not read yet) waits in the
connection's *outbox*, in order, and later frames queue behind it; the reactor watches the
socket for room and sends the whole outbox as one write (``flush``), so a burst of answers
costs a few large writes instead of one ~770-byte kernel buffer per 13-byte frame. A client
that reads late gets every answer. A client is cut off only when

- its outbox passes ``limits.max_unread_bytes`` or ``limits.max_unread_frames`` (what waits
  beyond what its socket buffer holds), or
- its outbox has waited ``limits.stall_timeout_s`` without the socket taking a byte: it has
  stopped reading (``stalled``, checked by the reactor's housekeeping).

While the reactor handles one read's frames the connection is *corked*: replies join the
outbox and go out in one write when the batch is done (``uncork``).

Every frame sent fits the protocol: a reply too large for a JSON frame (or that cannot be
encoded) is replaced by an error reply carrying the same id (``fitted_json``).

**Descriptors.** An ``attach`` reply carries its ring's memfd (``SCM_RIGHTS``) on the frame's
first byte. Such a frame waits in the outbox as a ``FrameWithDescriptor`` (bytes that own a
descriptor) and is always written by a ``sendmsg`` of its own, so the descriptor rides with
exactly that frame; the connection closes its copy once the kernel has taken the frame (or when
the client is cut off before it was sent). The client pairs descriptors with the replies that
say ``"descriptor": true``, in the order they arrive.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import structlog

from duomo.ipc.errors import ErrorCode
from duomo.ipc.framing import FrameReader, FrameTooLargeError, json_frame
from duomo.ipc.wire import CHALLENGE_BYTES, MAX_JSON_BYTES, FrameKind
from duomo.supervisor.dataflow.streams import StreamState
from duomo.supervisor.process.attachment import Attachment
from duomo.supervisor.process.limits import Limits

if TYPE_CHECKING:
    from duomo.supervisor.process.loan import Loan

log = structlog.get_logger("duomo.connection")
_PEERCRED = struct.Struct("3i")
FLUSH_CHUNK_BYTES = 256 << 10  # the most one flush joins into one write
_DESCRIPTOR = struct.Struct("i")


class FrameWithDescriptor(bytes):
    """A frame that owns a descriptor to send with its first byte (``SCM_RIGHTS``). A slice of
    it is plain bytes: what is left of a frame whose first part went out carries nothing."""

    fd: int

    def __new__(cls, data: bytes, fd: int) -> FrameWithDescriptor:
        frame = super().__new__(cls, data)
        frame.fd = fd
        return frame


class Stage(IntEnum):
    """Where a connection is in its life. It only moves forward, one method a step (a step
    may be skipped: a peer that fails to authenticate goes from CHALLENGED to CLOSING).

    The steps::

        CHALLENGED ─authenticate→ OPEN ─close_after_read→ CLOSING ─cut_off→ CUT ─drop→ DROPPED
    """

    CHALLENGED = 0  # accepted: nothing but the answer to its challenge is read
    OPEN = 1  # authenticated
    CLOSING = 2  # it broke the protocol: dropped once the frames of the current read are handled
    CUT = 3  # nothing more is sent to it (cut off, or its socket failed); dropped at its EOF
    DROPPED = 4  # the reactor let go of it; its socket closes once no idle worker reads it


CHALLENGED, OPEN, CLOSING, CUT, DROPPED = Stage


class Connection:
    """One client: its socket, its framing state, its outbox and the rings it attached."""

    def __init__(
        self,
        sock: socket.socket,
        conn_id: int,
        challenge: bytes,
        limits: Limits,
        on_blocked: Callable[[Connection], None],
        loan: Loan,
    ) -> None:
        """``on_blocked``: answers wait in its outbox (the reactor watches it for room);
        ``loan``: its lending state, a fresh ``supervisor.process.loan.Loan``."""
        self.sock = sock
        self.fd = sock.fileno()
        self.id = conn_id
        # before authentication only the challenge response is accepted (``FrameReader.only``)
        self.reader = FrameReader(only=FrameKind.RESPONSE)
        assert len(challenge) == CHALLENGE_BYTES
        self.challenge = challenge
        self.stage = CHALLENGED  # (changed under _send_lock: any thread may cut it off)
        now = time.monotonic()
        self.auth_deadline = now + limits.auth_timeout_s
        self.last_received_s = now  # the last frame from the client (the idle timeout)
        self.attachments: dict[int, Attachment] = {}
        self.streams: dict[int, StreamState] = {}  # by id: the streams it opened
        self.flow = ("client", conn_id)  # its plain requests' flow in the batchers
        # -- who reads it (``loan``: ``supervisor.process.lending``), under ``owner`` --
        # held while reading the socket and while lending it or giving it back, so one thread
        # reads it at a time; reentrant, since a read may end in ``Reactor._drop``
        self.owner = threading.RLock()
        self.loan = loan
        self.pid = _peer_pid(sock)
        self._ring_ids = itertools.count(1)
        # -- sending (under _send_lock) --
        self.limits = limits  # (replaced on reload)
        self._on_blocked = on_blocked
        self._send_lock = threading.Lock()
        self._outbox: deque[bytes] = deque()
        self._outbox_bytes = 0
        self._corked = False
        # the reactor has been asked to watch for room (set with a non-empty outbox; cleared
        # only by ``flush`` when it empties it)
        self.wants_write = False
        self._waiting_since = 0.0  # when the outbox last made progress (or began)
        self.unread_peak_bytes = 0  # the largest outbox it has had (status)
        self.cut_reason: str | None = None  # why it was cut off, if it was

    # -- its stage ----------------------------------------------------------------------------

    @property
    def authenticated(self) -> bool:
        """It answered its challenge and is served (neither closing nor cut off)."""
        return self.stage is OPEN

    @property
    def closed(self) -> bool:
        """Nothing more is sent to it."""
        return self.stage >= CUT

    @property
    def lent(self) -> bool:
        """Its model's idle worker reads it (``status``)."""
        return self.loan.lent

    def authenticate(self) -> None:
        """It answered its challenge (the reactor): every kind of frame is read from now on."""
        with self._send_lock:
            if self.stage is CHALLENGED:
                self.stage = OPEN
                self.reader.only = None

    def close_after_read(self) -> None:
        """It broke the protocol (the reactor): drop it once this read's frames are handled."""
        with self._send_lock:
            self.stage = max(self.stage, CLOSING)

    def drop(self) -> None:
        """The reactor lets go of it: nothing more is sent to it, and it is DROPPED."""
        with self._send_lock:
            self._cut(None)
            self.stage = DROPPED

    def next_ring_id(self) -> int:
        """Ring ids are per connection: 16 bits on the wire, never reused while attached."""
        while True:
            ring = next(self._ring_ids) & 0xFFFF
            if ring and ring not in self.attachments:
                return ring

    @property
    def slots(self) -> int:
        return sum(a.layout.slots for a in list(self.attachments.values()))

    # -- sending ------------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Send one whole frame, or queue it behind what waits (any thread; never blocks). A
        ``FrameWithDescriptor``'s descriptor is the connection's from here on: sent with the
        frame, or closed if the frame never goes out."""
        with self._send_lock:
            if self.stage >= CUT:
                _close_descriptor(data)
                return
            if not self._outbox and not self._corked:
                try:
                    sent = self._write(data)  # whole, nearly always
                except BlockingIOError:
                    sent = 0
                except OSError:
                    _close_descriptor(data)
                    self._cut(None)
                    return
                if sent == len(data):
                    return
                self._queue(data[sent:] if sent else data)
            else:
                self._queue(data)
                if self._corked and self._outbox_bytes < FLUSH_CHUNK_BYTES:
                    return  # (a corked batch is written once it is this large, or at uncork)
                self._write_outbox()
            self._check_backlog()
            if not self._outbox or self.wants_write or self.closed or self._corked:
                return
            self.wants_write = True
        self._on_blocked(self)

    def reply(self, message: dict[str, Any], reply: dict[str, Any], fd: int = -1) -> None:
        """Answer one control message (any thread): the reply carries the message's id, and
        ``fd`` (if given; the connection owns it from here on) rides with it."""
        if "id" in message:
            reply["id"] = message["id"]
        if fd < 0:
            self.send(fitted_json(reply))
            return
        reply["descriptor"] = True
        try:
            data = json_frame(reply)
        except (TypeError, ValueError):  # answered by an error in its place: nothing to carry
            os.close(fd)
            self.send(fitted_json(reply))
            return
        self.send(FrameWithDescriptor(data, fd))

    def send_error(self, code: int, message: str, **where: Any) -> None:
        self.send(fitted_json({"event": "error", "code": int(code), "message": message, **where}))

    def cork(self) -> None:
        """Hold what is sent from now on until ``uncork`` (the reactor, around one read)."""
        with self._send_lock:
            self._corked = True

    def uncork(self) -> None:
        """Send what was held, in one write."""
        with self._send_lock:
            self._corked = False
            if not self._outbox or self.closed:
                return
            self._write_outbox()
            self._check_backlog()
            if not self._outbox or self.wants_write or self.closed:
                return
            self.wants_write = True
        self._on_blocked(self)

    def flush(self) -> bool:
        """Send what the outbox holds, as far as the socket takes it (the reactor, when the
        socket has room); True once it is empty (then the reactor stops watching for room)."""
        with self._send_lock:
            if self._outbox and not self.closed and not self._corked:
                self._write_outbox()
            if self._outbox and not self.closed:
                return False
            self.wants_write = False
            return True

    def stalled(self, now: float) -> bool:
        """Answers have waited ``stall_timeout_s`` without the client taking a byte of them."""
        return bool(self._outbox) and now - self._waiting_since > self.limits.stall_timeout_s

    def cut_off(self, reason: str | None) -> None:
        """Stop talking to the client (any thread); the reactor then drops the connection
        (``reason``, logged: why the client was cut off; None: it is being dropped anyway)."""
        with self._send_lock:
            self._cut(reason)

    @property
    def unread_bytes(self) -> int:
        """What waits in the outbox (beyond what the socket's buffer holds)."""
        return self._outbox_bytes

    def _queue(self, data: bytes) -> None:
        if not self._outbox:
            self._waiting_since = time.monotonic()
        self._outbox.append(data)
        self._outbox_bytes += len(data)

    def _check_backlog(self) -> None:
        """With the send lock held: cut the client off if what waits passes a bound."""
        self.unread_peak_bytes = max(self.unread_peak_bytes, self._outbox_bytes)
        limits = self.limits
        if self._outbox_bytes > limits.max_unread_bytes:
            self._cut(
                f"its unread backlog passed limits.max_unread_bytes ({limits.max_unread_bytes})"
            )
        elif len(self._outbox) > limits.max_unread_frames:
            self._cut(
                f"its unread backlog passed limits.max_unread_frames ({limits.max_unread_frames})"
            )

    def _write(self, chunk: bytes) -> int:
        """With the send lock held: one non-blocking write of ``chunk``; a
        ``FrameWithDescriptor`` goes by ``sendmsg`` with its descriptor, which is closed here
        once the kernel has taken the frame's first byte (the client's copy is its own)."""
        if type(chunk) is not FrameWithDescriptor:
            return self.sock.send(chunk, socket.MSG_DONTWAIT)
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _DESCRIPTOR.pack(chunk.fd))]
        sent = self.sock.sendmsg([chunk], rights, socket.MSG_DONTWAIT)
        if sent:
            _close_descriptor(chunk)
        return sent

    def _write_outbox(self) -> None:
        """With the send lock held: write the outbox until the socket takes no more. Plain
        frames are joined into writes of up to ``FLUSH_CHUNK_BYTES``; a frame with a descriptor
        is written alone."""
        outbox = self._outbox
        while outbox:
            chunk = outbox[0]
            if len(outbox) > 1 and type(chunk) is not FrameWithDescriptor:
                parts, size = [], 0
                for part in outbox:
                    if type(part) is FrameWithDescriptor:
                        break
                    parts.append(part)
                    size += len(part)
                    if size >= FLUSH_CHUNK_BYTES:
                        break
                chunk = parts[0] if len(parts) == 1 else b"".join(parts)
            try:
                sent = self._write(chunk)
            except BlockingIOError:
                return
            except OSError:
                self._cut(None)
                return
            self._waiting_since = time.monotonic()
            self._outbox_bytes -= sent
            left = sent
            while left:
                head = outbox[0]
                if len(head) <= left:
                    outbox.popleft()
                    left -= len(head)
                else:
                    outbox[0] = head[left:]  # (plain bytes: a descriptor went with the start)
                    left = 0
            if sent < len(chunk):
                return  # the socket's buffer is full again

    def _cut(self, reason: str | None) -> None:
        """With the send lock held: close for writing and let the reactor see EOF and drop the
        connection (``reason``: why it was cut off; None: the socket itself failed)."""
        if self.stage >= CUT:
            return
        self.stage = CUT
        self.cut_reason = reason
        dropped_bytes = self._outbox_bytes
        for data in self._outbox:
            _close_descriptor(data)
        self._outbox.clear()
        self._outbox_bytes = 0
        if reason is not None:
            log.warning(
                "client cut off", client=self.id, pid=self.pid, reason=reason,
                unsent_bytes=dropped_bytes,
            )  # fmt: skip
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # the reader sees EOF and drops it


def fitted_json(message: dict[str, Any]) -> bytes:
    """``message`` as a JSON frame or, when it cannot be one (too large for a frame, or not
    JSON), an error in its place that keeps its id: every reply reaches its caller."""
    try:
        return json_frame(message)
    except (TypeError, ValueError) as err:
        too_large = isinstance(err, FrameTooLargeError)
        log.error("reply replaced by an error", error=str(err), op_id=message.get("id"))
        fallback: dict[str, Any] = {
            "ok": False,
            "code": int(ErrorCode.RESOURCE_EXHAUSTED if too_large else ErrorCode.INTERNAL),
            "message": (
                f"the reply is larger than a control frame may be ({MAX_JSON_BYTES} bytes)"
                if too_large
                else "internal error: the reply could not be encoded"
            ),
        }
        if "event" in message:
            fallback = {"event": message["event"], **fallback}
        if "id" in message:
            fallback["id"] = message["id"]
        return json_frame(fallback)


def _close_descriptor(data: bytes) -> None:
    """Close the descriptor a frame owns, if it owns one (once: it then owns none)."""
    if type(data) is FrameWithDescriptor and data.fd >= 0:
        fd, data.fd = data.fd, -1
        with contextlib.suppress(OSError):
            os.close(fd)


def _peer_pid(sock: socket.socket) -> int | None:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        return int(_PEERCRED.unpack(raw)[0])
    except (OSError, AttributeError):
        return None
