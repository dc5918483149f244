"""A producer's link to one supervisor: the socket, who reads it, and where what arrives goes.

``ClientLink.connect`` connects (retrying while the listen backlog is full) and authenticates
(the key file beside the socket); from then on the link sends frames (``send_frame``), runs
control round trips (``request``), attaches rings (``attach_ring``) and routes each ring's
"slot done" notices to the one ``RingOwner`` that maps it (``route_ring``: a model handle's
``ipc.slots.SlotPool``). It is what a handle and its slots need of the connection (the
``ipc.slots.HandleLink`` protocol) and what a stream needs (``ipc.stream.StreamLink``), with
public methods of its own; ``ipc.client.Client`` is the producer's facade over it and the only
one that makes it. It imports neither the client, the handles nor the streams.

A ring is a sealed memfd whose descriptor arrives with the ``attach`` reply (``SCM_RIGHTS``):
every read of the socket is a ``recvmsg`` that keeps what came with it, in order, until the
reply that says ``"descriptor": true``.

Reading, leader/follower: there is no thread of its own for synchronous use. A thread that
waits (``wait_for``: a slot's answer, a control reply, a free slot) reads the socket itself
while nobody else does (the "leader"); other waiters sleep on a condition and are woken when
the leader has dispatched what they wait for or stepped down — so a synchronous round trip
costs no extra thread hop. While requests answered on the reading thread are outstanding
(``async_started``: ``infer_async``, a stream's frames), one background thread
(``duomo-client``) leads, so their callbacks run without anybody waiting. Nothing spins: a
reader waiting only for a frame blocks in ``recv`` alone (its ``SO_RCVTIMEO`` wakes it every
``READ_SLICE_S`` to check its deadline); other waits ``poll`` the socket and a wake pipe, so a
slot released by another thread (no frame arrives for that) reaches them. An event loop can
instead be the one reader for good (``read_in_loop``, then ``read_available`` whenever the
socket is readable: the gateway does this), and threads that wait follow it.

Invariants: at most one thread reads the socket at a time; every frame is dispatched on the
thread that read it; once the connection is lost (``lost()`` is not None) it never comes back,
every pending reply fails with ``UnavailableError``, every routed ring's owner is failed once
(``RingOwner.fail_all``), and every waiter returns.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import select
import socket
import struct
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from duomo.ipc.errors import (
    DeadlineExceededError,
    DuomoError,
    ErrorCode,
    UnavailableError,
    error_for,
)
from duomo.ipc.framing import FrameReader, answer, json_frame, parse_json, recv_frame
from duomo.ipc.ring import RingLayout, SlotRing
from duomo.ipc.runtime_dir import read_key
from duomo.ipc.wire import FRAME, NOTICE, FrameKind, frame

ATTACH_TIMEOUT_S = 300.0  # the supervisor's own bound on loading a model
# connecting while the supervisor's listen backlog is full: retry after this, doubling up to
# the most, within the client's timeout
CONNECT_RETRY_FIRST_S = 0.001
CONNECT_RETRY_MAX_S = 0.1
# A reader waiting for a frame blocks in ``recv`` for at most this long at a time (the socket's
# SO_RCVTIMEO), then checks its deadline and whether it was closed meanwhile.
READ_SLICE_S = 0.25
_READ_SLICE = struct.pack("ll", int(READ_SLICE_S), int(READ_SLICE_S % 1 * 1e6))
READ_BYTES = 1 << 16
# room for the descriptors one read may bring: the kernel ends a read after the frame that
# carried one, and the supervisor sends one per frame (room for a few, to spare)
_ANCILLARY_BYTES = socket.CMSG_SPACE(4 * array("i").itemsize)
_NOTICE_FRAME_BYTES = FRAME.size + NOTICE.size
_NOTICE_PREFIX = FRAME.pack(NOTICE.size, FrameKind.NOTICE)


class RingOwner(Protocol):
    """What the link routes a ring's answers to (``ipc.slots.SlotPool``: a handle's slots)."""

    def answer(
        self, ring_id: int, index: int, seq: int | None, error: DuomoError | None = None
    ) -> bool:
        """Slot ``index`` of ring ``ring_id`` is answered (``seq``, or None with the error the
        supervisor gave for it); whether ``index`` names a slot of the owner's rings."""
        ...

    def fail_all(self, error: DuomoError) -> None:
        """The connection is lost: every slot, in flight or not, is answered ``error``."""
        ...

    def unmap(self) -> None:
        """The link closes: unmap every ring (the supervisor frees them with the connection)."""
        ...


class ClientLink:
    """One authenticated connection to a supervisor, shared by threads (see the module
    docstring for who reads it). Made by ``connect``.

    Attributes:
        socket_path: The supervisor's control socket.
        timeout_s: The default bound on a control round trip (``request``).
        events: Errors the supervisor reported without a slot to pin them on.
    """

    def __init__(
        self, socket_path: Path, timeout_s: float, sock: socket.socket, frames: FrameReader
    ) -> None:
        """Made by ``connect``: ``sock`` is connected and authenticated, and ``frames`` holds
        what was read past the handshake."""
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.events: queue.SimpleQueue[DuomoError] = queue.SimpleQueue()
        self._sock = sock
        self._sock_fd = sock.fileno()
        self._frames = frames
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._routes: dict[int, RingOwner] = {}  # ring id -> who maps it
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._closed: BaseException | None = None
        # reading the socket: one leader at a time; followers wait on the condition, whose lock
        # is entered directly where nobody waits (cheaper than the condition's wrapper)
        self._read_lock = threading.Lock()
        self._read_cond = threading.Condition(self._read_lock)
        self._leading = False
        self._leader: int | None = None  # thread id of the thread reading the socket
        self._reads_in_loop = False  # the leader is an event loop's, for good (``read_in_loop``)
        self._followers = 0  # threads sleeping until the leader dispatches or steps down
        self._async_pending = 0
        self._background: threading.Thread | None = None
        # descriptors received (rings' memfds), in order, until the reply they came with
        self._descriptors: deque[int] = deque()
        # The reading thread waits in poll on the socket and on a wake pipe: a slot released by
        # another thread (no frame arrives for that) must reach a reader waiting for one.
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)

    @classmethod
    def connect(cls, socket_path: Path, timeout_s: float) -> ClientLink:
        """Connect to the supervisor at ``socket_path`` and authenticate, within
        ``timeout_s`` (see ``ipc.client.Client`` for the errors)."""
        try:
            key = read_key(socket_path)
        except FileNotFoundError:
            raise UnavailableError(f"no supervisor at {socket_path} (no key file)") from None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            _connect(sock, socket_path, timeout_s)
            frames = _handshake(sock, key)
        except DuomoError:  # refused: too many connections, or out of file descriptors
            sock.close()
            raise
        except (OSError, ConnectionError) as err:
            sock.close()
            raise UnavailableError(f"cannot reach the supervisor at {socket_path}: {err}") from None
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _READ_SLICE)
        return cls(socket_path, timeout_s, sock, frames)

    # -- sending and control ----------------------------------------------------------------

    def lost(self) -> BaseException | None:
        """Why the connection ended (None while it is open)."""
        return self._closed

    @property
    def connected(self) -> bool:
        """Whether the connection is open (False once closed or lost)."""
        return self._closed is None

    @property
    def reading_thread(self) -> int | None:
        """The id of the thread reading the socket now (None: nobody is)."""
        return self._leader

    def send_frame(self, data: bytes) -> None:
        """Send one whole frame; ``UnavailableError`` once the connection is closed or lost."""
        with self._send_lock:
            if self._closed is not None:
                raise UnavailableError(f"connection to the supervisor is closed ({self._closed})")
            try:
                self._sock.sendall(data)
            except OSError as err:
                raise UnavailableError(f"lost the supervisor: {err}") from None

    def request(self, op: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """One control round trip, as ``ipc.client.Client.request`` documents it (None:
        ``timeout_s``, the link's)."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        request_id = next(self._ids)
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            if self._closed is not None:
                raise UnavailableError(f"connection to the supervisor is closed ({self._closed})")
            self._pending[request_id] = future
        try:
            self.send_frame(json_frame({"id": request_id, "op": op, **fields}))
            self.wait_for(future.done, time.monotonic() + wait_s)
            if not future.done():
                raise DeadlineExceededError(f"no reply to {op!r} within {wait_s}s")
            reply = future.result()
        finally:
            with self._lock:
                self._pending.pop(request_id, None)
        if not reply.get("ok"):
            raise error_for(reply.get("code", ErrorCode.INTERNAL), reply.get("message", "failed"))
        return reply

    # -- rings ------------------------------------------------------------------------------

    def attach_ring(
        self, name: str, slots: int, inputs: dict[str, int] | None = None
    ) -> tuple[int, SlotRing]:
        """Attach a new ring of ``slots`` slots for model ``name`` and map the segment whose
        descriptor came with the reply: its id and mapping. ``inputs``: input -> the bytes its
        area must hold, past the model's default. Waits at least ``ATTACH_TIMEOUT_S`` (a model
        not loaded yet is loaded first); the errors are ``Client.model``'s."""
        fields: dict[str, Any] = {"inputs": inputs} if inputs else {}
        reply = self.request(
            "attach",
            timeout_s=max(self.timeout_s, ATTACH_TIMEOUT_S),
            model=name,
            slots=slots,
            **fields,
        )
        ring_id = int(reply["ring"])
        fd = reply.get("descriptor")
        try:
            if not isinstance(fd, int) or fd < 0:
                raise ValueError("its descriptor did not arrive with the reply")
            ring = SlotRing.attach(fd, RingLayout.from_dict(reply["layout"]))
        except ValueError as err:
            self.detach_ring_later(ring_id)
            raise UnavailableError(f"cannot map the ring for {name!r}: {err}") from None
        return ring_id, ring

    def route_ring(self, owner: RingOwner, ring_id: int, old_ring: int | None = None) -> None:
        """Route ring ``ring_id``'s answers to ``owner`` (before any slot of it is submitted),
        and ring ``old_ring``'s no more."""
        with self._lock:
            if old_ring is not None:
                self._routes.pop(old_ring, None)
            self._routes[ring_id] = owner

    def unroute_rings(self, ring_ids: Iterable[int]) -> None:
        """Route nothing more from these rings (their owner closes)."""
        with self._lock:
            for ring_id in ring_ids:
                self._routes.pop(ring_id, None)

    def detach_ring_later(self, ring_id: int) -> None:
        """Detach ring ``ring_id`` without waiting for the reply (the caller may be the thread
        that reads the socket, or an event loop): nothing routes to it any more."""
        with self._lock:
            self._routes.pop(ring_id, None)
        with contextlib.suppress(DuomoError):  # gone: the supervisor freed it already
            self.send_frame(json_frame({"id": next(self._ids), "op": "detach", "ring": ring_id}))

    def close(self) -> None:
        """Disconnect, as ``ipc.client.Client.close`` documents it; closing twice is harmless."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._connection_lost(ConnectionError("closed by this client"))
        if self._background is not None and self._background is not threading.current_thread():
            self._background.join(5)  # (closed from its own callback: it ends once this returns)
        self._sock.close()
        with self._lock:
            owners = list(dict.fromkeys(self._routes.values()))  # (one per ring it maps)
            self._routes.clear()
        with self._read_cond:
            wake_fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in wake_fds:
            if fd >= 0:
                os.close(fd)
        while self._descriptors:
            os.close(self._descriptors.popleft())
        for owner in owners:
            owner.unmap()

    # -- reading: leader/follower -----------------------------------------------------------

    def wait_for(
        self, done: Callable[[], bool], deadline: float | None, by_frame: bool = False
    ) -> None:
        """Return once ``done()`` holds, the monotonic ``deadline`` passes (None: no deadline),
        or the connection is lost.

        The caller reads and dispatches frames itself while no other thread does; otherwise it
        sleeps until the reading thread dispatches something or steps down. ``by_frame``: only
        a frame from the supervisor makes ``done()`` hold (a slot's answer), so the reader
        blocks in ``recv`` alone, without the ``poll`` that also watches the wake pipe; what
        another thread does meanwhile (a handle closed) it sees within ``READ_SLICE_S``.
        """
        me = threading.get_ident()
        if self._leader == me:
            # A callback running on the reading thread waits for something else: it keeps
            # reading itself (waiting for the leader would wait for itself).
            if not done():
                self._read_until(done, deadline, by_frame)
            return
        with self._read_lock:
            while not done():
                if self._closed is not None:
                    return
                if not self._leading:
                    self._leading = True
                    self._leader = me
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return
                self._followers += 1
                try:
                    self._read_cond.wait(remaining)
                finally:
                    self._followers -= 1
            else:
                return
        try:
            self._read_until(done, deadline, by_frame)
        finally:
            with self._read_lock:
                self._leading = False
                self._leader = None
                if self._followers:  # one of them reads next
                    self._read_cond.notify_all()

    def wake_waiters(self) -> None:
        """Let every waiter re-check what it waits for: the followers (they count themselves
        under the condition's lock, so none can be missed) and a reader in another thread."""
        with self._read_lock:
            if self._followers:
                self._read_cond.notify_all()
            if self._wake_w >= 0 and self._leading and self._leader != threading.get_ident():
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_w, b"\0")

    def _read_until(
        self, done: Callable[[], bool], deadline: float | None, by_frame: bool = False
    ) -> None:
        """As the reading thread, once ``done()`` was found false: read and dispatch until it
        holds, the deadline passes, or the connection is lost."""
        while self._closed is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            self._read_once(remaining, by_frame and (remaining is None or remaining > READ_SLICE_S))
            if done():
                return

    def _read_once(self, timeout_s: float | None, blocking: bool = False) -> None:
        """One read (bounded by ``timeout_s``, or by ``READ_SLICE_S`` if ``blocking``) and the
        dispatch of whatever arrived.

        The socket itself stays blocking, with no timeout of Python's (which would make it
        non-blocking inside), so a sender in another thread can never be cut off in the middle
        of a frame: a read is bounded by ``poll`` on the socket and the wake pipe or, when
        only a frame is waited for, by the socket's receive timeout (SO_RCVTIMEO).
        """
        try:
            if not blocking:
                wait_ms = None if timeout_s is None else max(0, int(timeout_s * 1000) + 1)
                ready = self._poll.poll(wait_ms)
                if len(ready) != 1 or ready[0][0] != self._sock_fd:
                    if any(fd == self._wake_r for fd, _ in ready):
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                    return  # woken or timed out: the caller checks what it waits for
            data = self._recv(0)
        except BlockingIOError:  # the receive timeout: nothing arrived in READ_SLICE_S
            return
        except OSError as err:
            self._connection_lost(err)
            return
        self._dispatch(data)

    def _recv(self, flags: int) -> bytes:
        """One read of the socket, keeping the descriptors that came with it (in order: each
        belongs to the next reply that says ``"descriptor": true``)."""
        data, ancillary, _, _ = self._sock.recvmsg(READ_BYTES, _ANCILLARY_BYTES, flags)
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self._descriptors.extend(fds)
        return data

    # -- reading from an event loop ---------------------------------------------------------

    def read_in_loop(self) -> int:
        """Make the calling thread the one reader for good, as ``Client.read_in_loop``
        documents it; the socket's file descriptor."""
        with self._read_lock:
            if self._leading and self._leader != threading.get_ident():
                raise RuntimeError("another thread is reading this client's socket")
            self._leading = True
            self._leader = threading.get_ident()
            self._reads_in_loop = True
        return self._sock_fd

    def read_available(self) -> None:
        """(The loop's reader) Read what has arrived, without blocking, and dispatch it."""
        if self._closed is not None:
            return
        try:
            data = self._recv(socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            self._connection_lost(err)
            return
        self._dispatch(data)

    # -- requests answered on the reading thread --------------------------------------------

    def async_started(self) -> None:
        """A request answered on the reading thread is outstanding: make sure someone reads
        while nobody waits (the background thread, unless an event loop reads)."""
        with self._read_cond:
            self._async_pending += 1
            self._read_cond.notify_all()
            if self._background is None and not self._reads_in_loop:
                self._background = threading.Thread(
                    target=self._background_reader, name="duomo-client", daemon=True
                )
                self._background.start()

    def async_finished(self) -> None:
        """A request counted by ``async_started`` was answered."""
        with self._read_cond:
            self._async_pending -= 1

    def _background_reader(self) -> None:
        while self._closed is None:
            with self._read_cond:
                while self._async_pending == 0 and self._closed is None:
                    self._read_cond.wait()
            self.wait_for(lambda: self._async_pending == 0, None)

    # -- dispatch ---------------------------------------------------------------------------

    def _dispatch(self, data: bytes) -> None:
        """Hand what one read brought to whoever waits for it (b"": the supervisor is gone)."""
        if not data:
            self._connection_lost(ConnectionError("connection closed by the supervisor"))
            return
        if (
            len(data) == _NOTICE_FRAME_BYTES
            and data.startswith(_NOTICE_PREFIX)
            and self._frames.empty
        ):
            self._on_notice(*NOTICE.unpack_from(data, FRAME.size))  # the hot path: one answer
            if self._followers:
                self.wake_waiters()
            return
        try:
            for kind, payload in self._frames.feed(data):
                self._on_frame(kind, payload)
        except Exception as err:  # a protocol error: the connection cannot continue
            self._connection_lost(err)
            return
        self.wake_waiters()

    def _on_notice(self, ring: int, slot: int, seq: int) -> None:
        """A slot's answer, for the owner of its ring (nobody's: dropped)."""
        owner = self._routes.get(ring)
        if owner is not None:
            owner.answer(ring, slot, seq)

    def _on_frame(self, kind: FrameKind, payload: bytes) -> None:
        if kind is FrameKind.NOTICE:
            self._on_notice(*NOTICE.unpack(payload))
            return
        if kind is not FrameKind.JSON:
            return
        message = parse_json(payload)
        if message.get("descriptor") is True:  # it came with this frame's first byte
            message["descriptor"] = self._descriptors.popleft() if self._descriptors else -1
        if "id" in message:
            with self._lock:
                future = self._pending.get(message["id"])
            if future is not None and not future.done():
                future.set_result(message)
            elif isinstance(message.get("descriptor"), int) and message["descriptor"] >= 0:
                os.close(message["descriptor"])  # nobody waits for it any more
        elif message.get("event") == "error":
            err = error_for(message.get("code", ErrorCode.INTERNAL), message.get("message", ""))
            ring, slot = message.get("ring", -1), message.get("slot")
            owner = self._routes.get(ring)
            if (
                owner is None
                or not isinstance(slot, int)
                or not owner.answer(ring, slot, None, err)
            ):
                self.events.put(err)

    def _connection_lost(self, reason: BaseException) -> None:
        with self._lock:
            if self._closed is not None:
                return
            self._closed = reason
            pending = list(self._pending.values())
            owners = list(dict.fromkeys(self._routes.values()))
        lost = UnavailableError(f"lost the supervisor at {self.socket_path}: {reason}")
        for future in pending:
            if not future.done():
                future.set_exception(lost)
        for owner in owners:
            owner.fail_all(lost)
        with self._read_cond:
            self._read_cond.notify_all()


def _connect(sock: socket.socket, socket_path: Path, timeout_s: float) -> None:
    """Connect, retrying with back-off while the listen backlog is full (a burst of
    connections: EAGAIN), for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    delay_s = CONNECT_RETRY_FIRST_S
    while True:
        try:
            sock.connect(str(socket_path))
            return
        except BlockingIOError:
            if time.monotonic() + delay_s > deadline:
                raise ConnectionError(
                    "the supervisor's listen backlog stayed full "
                    f"for {timeout_s}s (connection attempts in a burst)"
                ) from None
        time.sleep(delay_s)
        delay_s = min(delay_s * 2, CONNECT_RETRY_MAX_S)


def _handshake(sock: socket.socket, key: bytes) -> FrameReader:
    """Answer the supervisor's challenge with ``key``; the reader, holding what was read past
    its ``hello``."""
    reader = FrameReader()
    kind, challenge = recv_frame(sock, reader)
    if kind is FrameKind.JSON:  # not admitted: the supervisor says why
        refusal = parse_json(challenge)
        raise error_for(
            refusal.get("code", ErrorCode.UNAVAILABLE),
            str(refusal.get("message", "the supervisor refused the connection")),
        )
    if kind is not FrameKind.CHALLENGE:
        raise ConnectionError("the supervisor did not send a challenge")
    sock.sendall(frame(FrameKind.RESPONSE, answer(key, challenge)))
    kind, payload = recv_frame(sock, reader)
    hello = parse_json(payload) if kind is FrameKind.JSON else {}
    if hello.get("event") != "hello":
        raise ConnectionError(hello.get("message", "authentication failed"))
    return reader
