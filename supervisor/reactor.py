"""The reactor: one thread that multiplexes the listening socket and every client connection.

Owned by ``Supervisor``. It accepts connections, authenticates them (challenge–response, see
``ipc.framing``), decodes frames, answers control messages through the supervisor's handler and
turns "slot ready" notices into queued requests (``Attachment.submit``). It never runs a model:
the only slow thing it does is create a shared-memory segment on ``attach``. It waits in
``epoll`` itself (not through ``selectors``): a notice's way from the socket to its model's queue
is every request's path, and each Python call on it costs about a microsecond when it runs cold
after an inference.

**Lending.** A connection whose rings all attach one model (the usual producer) is *lent* to
that model's idle worker while it is idle (``read_when_idle``, called by the model's batcher on
the worker's thread): the worker disarms the socket in the reactor's epoll, waits on it itself
(first polling without sleeping for a while: ``Engine``'s idle spin), queues the notice that
arrives (so no thread hands the request to another, which on this kind of machine costs a
wake-up and a cold start more per request) and gives the socket back before it runs the batch.
The worker handles only a lone notice; anything else it read (a control message, several
frames, a partial one) it leaves to the reactor (``carried``), EOF it leaves
in the socket, and the connection is not lent again until the reactor has read it. A
connection's ``owner`` lock is held by whichever thread reads it or changes whether it is lent,
so exactly one thread reads a socket at a time (also held to attach and detach its rings).

Workers send "slot done" notices from their own threads through ``Connection.send``, which
serialises writers with a per-connection lock. A connection that breaks the protocol gets an
error event and is closed; one that goes away has its attachments closed (queued work dropped,
segments unmapped once nothing reads them). Nothing a client sends can stop the loop.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

from ipc.errors import DuomoError, ErrorCode, NotFoundError
from ipc.framing import FrameReader, ProtocolError, json_frame, parse_json, verify
from ipc.wire import CHALLENGE_BYTES, FRAME, NOTICE, FrameKind, frame
from supervisor.attachment import Attachment

log = structlog.get_logger("duomo.reactor")
AUTH_TIMEOUT_S = 5.0
HOUSEKEEPING_S = 0.1  # auth deadlines and unmap retries are checked this often
_PEERCRED = struct.Struct("3i")
NOTICE_FRAME_BYTES = FRAME.size + NOTICE.size
NOTICE_PREFIX = FRAME.pack(NOTICE.size, FrameKind.NOTICE)


class Connection:
    """One client: its socket, its framing state and the rings it attached."""

    def __init__(self, sock: socket.socket, conn_id: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.id = conn_id
        self.reader = FrameReader()
        self.challenge = secrets.token_bytes(CHALLENGE_BYTES)
        self.authenticated = False
        self.auth_deadline = time.monotonic() + AUTH_TIMEOUT_S
        self.attachments: dict[int, Attachment] = {}
        self.closed = False
        # who reads the socket (see the module's docstring): held while reading it and while
        # lending it or taking it back; reentrant, since a read may end in ``Reactor._drop``
        self.owner = threading.RLock()
        self.model: str | None = None  # the one model its rings attach (lendable), or None
        self.lent = False  # read by that model's idle worker, out of the reactor's epoll
        self.needs_reactor = False  # holds what only the reactor reads: not lent until read
        self.carried = b""  # data its idle worker read but only the reactor handles
        self.dropped = False  # the reactor let go of it; the socket closes once not lent
        self.refused = False  # an idle worker found it not lendable: tell it once it is
        self._send_lock = threading.Lock()
        self.pid = _peer_pid(sock)
        self._ring_ids = itertools.count(1)

    def next_ring_id(self) -> int:
        """Ring ids are per connection: 16 bits on the wire, never reused while attached."""
        while True:
            ring = next(self._ring_ids) & 0xFFFF
            if ring and ring not in self.attachments:
                return ring

    def send(self, data: bytes) -> None:
        """Write a whole frame without ever blocking (any thread).

        A well-behaved client has little unread at any time (answers are bounded by its slots
        and requests in flight); one whose socket buffer is full is not reading and is
        disconnected, so no thread of the supervisor ever waits on a client.
        """
        with self._send_lock:
            if self.closed:
                return
            try:
                sent = self.sock.send(data, socket.MSG_DONTWAIT)  # a whole notice, nearly always
                if sent < len(data):
                    view = memoryview(data)[sent:]
                    while view:
                        view = view[self.sock.send(view, socket.MSG_DONTWAIT) :]
            except OSError:  # BlockingIOError included: the peer does not read
                self.closed = True
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)  # the reactor sees EOF and drops it

    def reply(self, message: dict[str, Any], reply: dict[str, Any]) -> None:
        """Answer one control message (any thread): the reply carries the message's id."""
        if "id" in message:
            reply["id"] = message["id"]
        self.send(json_frame(reply))

    def send_error(self, code: int, message: str, **where: Any) -> None:
        self.send(json_frame({"event": "error", "code": int(code), "message": message, **where}))


def _peer_pid(sock: socket.socket) -> int | None:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        return int(_PEERCRED.unpack(raw)[0])
    except (OSError, AttributeError):
        return None


# the reply to a control message, or None when the handler has it sent later (``reply``)
Handler = Callable[[Connection, dict[str, Any]], dict[str, Any] | None]


class Reactor:
    def __init__(self, listener: socket.socket, key: bytes, handle: Handler) -> None:
        self._listener: socket.socket | None = listener
        self._key = key
        self._handle = handle
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = socket.socketpair()
        self._connections: dict[int, Connection] = {}
        self._by_fd: dict[int, Connection] = {}  # the registered client sockets
        # model -> the connections whose rings all attach it (replaced whole, never changed in
        # place: an idle worker reads it from its own thread)
        self._lendable: dict[str, tuple[Connection, ...]] = {}
        self._ids = itertools.count(1)
        self._lingering: list[Attachment] = []
        self._thread: threading.Thread | None = None
        self._running = False
        self._stop_accepting = False
        self._next_housekeeping = 0.0
        self._soon: deque[Callable[[], None]] = deque()
        # wakes a model's idle workers, to borrow a connection that has become lendable
        self.on_lendable: Callable[[str], None] | None = None

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the reactor thread (from any thread): what touches the connections'
        state does so there only."""
        self._soon.append(fn)
        self._wake()

    @property
    def connections(self) -> list[Connection]:
        return list(self._connections.values())

    @property
    def mapped_rings(self) -> int:
        """Segments still mapped: attached ones, and detached ones whose last reader is busy."""
        attached = sum(len(c.attachments) for c in list(self._connections.values()))
        return attached + sum(1 for a in self._lingering if not a.closed)

    def start(self) -> None:
        assert self._listener is not None
        self._listener.setblocking(False)
        self._epoll.register(self._listener, select.EPOLLIN)
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # a byte already waiting wakes the loop as well
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="duomo-reactor", daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        self._stop_accepting = True
        self._wake()

    def stop(self) -> None:
        """End the loop and close every connection (clients see EOF)."""
        self._running = False
        self._wake()
        if self._thread is not None:
            self._thread.join(10)
        for conn in list(self._connections.values()):
            self._drop(conn)
        for attachment in self._lingering:
            attachment.retry_unmap()
        self._epoll.close()
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _loop(self) -> None:
        listener_fd = self._listener.fileno() if self._listener is not None else -1
        wake_fd = self._wake_r.fileno()
        by_fd = self._by_fd
        while self._running:
            if self._stop_accepting and self._listener is not None:
                self._epoll.unregister(self._listener)
                self._listener.close()
                self._listener = None
                listener_fd = -1
            try:
                events = self._epoll.poll(0.5)
            except OSError:
                break
            for fd, _ in events:
                conn = by_fd.get(fd)
                try:
                    if conn is not None:
                        self._readable(conn)
                    elif fd == listener_fd:
                        self._accept()
                    elif fd == wake_fd:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                except Exception:  # the loop must survive anything one client causes
                    log.exception("reactor error")
                    if conn is not None:
                        self._drop(conn)
            while self._soon:
                try:
                    self._soon.popleft()()
                except Exception:
                    log.exception("reactor callback error")
            now = time.monotonic()
            if now >= self._next_housekeeping:  # off the per-notice path
                self._next_housekeeping = now + HOUSEKEEPING_S
                try:
                    self._housekeeping()
                except Exception:
                    log.exception("reactor housekeeping error")

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)  # the reactor reads only when select says so; sends never wait
        conn = Connection(sock, next(self._ids))
        self._connections[conn.id] = conn
        self._by_fd[conn.fd] = conn
        self._epoll.register(conn.fd, select.EPOLLIN)
        conn.send(frame(FrameKind.CHALLENGE, conn.challenge))

    def _readable(self, conn: Connection) -> None:
        with conn.owner:
            if not conn.lent and not conn.dropped:  # (lent: its idle worker reads it)
                conn.needs_reactor = False
                self._read(conn)
                if conn.refused and conn.reader.empty and not conn.closed:
                    conn.refused = False
                    self._lendable_again(conn)

    def _lendable_again(self, conn: Connection) -> None:
        if conn.model is not None and self.on_lendable is not None:
            self.on_lendable(conn.model)

    def _receive(self, conn: Connection) -> bytes | None:
        """One read of ``conn`` (the reactor's, or a lent connection's worker's); a lone notice,
        every request's way, is queued here. None when nothing is left to handle, else what
        arrived instead (b"": EOF, or the connection failed)."""
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError, TimeoutError):
            return None
        except OSError:
            return b""
        if (
            len(data) == NOTICE_FRAME_BYTES
            and data.startswith(NOTICE_PREFIX)
            and conn.authenticated
            and conn.reader.empty
        ):
            self._notice(conn, *NOTICE.unpack_from(data, FRAME.size))
            return None
        return data

    def _read(self, conn: Connection) -> None:
        data: bytes | None = conn.carried  # what its idle worker read and left to it, first
        if data:
            conn.carried = b""
        else:
            data = self._receive(conn)
            if data is None:
                return
        if not data:
            self._drop(conn)
            return
        try:
            for kind, payload in conn.reader.feed(data):
                self._dispatch(conn, kind, payload)
                if conn.closed:
                    break
        except ProtocolError as err:
            conn.send_error(ErrorCode.INVALID_ARGUMENT, f"protocol error: {err}")
            self._drop(conn)
            return
        if conn.closed:
            self._drop(conn)

    def _dispatch(self, conn: Connection, kind: FrameKind, payload: bytes) -> None:
        if not conn.authenticated:
            if kind is FrameKind.RESPONSE and verify(self._key, conn.challenge, payload):
                conn.authenticated = True
                conn.send(json_frame({"event": "hello", "version": 1, "pid": os.getpid()}))
                return
            conn.send_error(ErrorCode.INVALID_ARGUMENT, "authentication failed")
            conn.closed = True
            return
        if kind is FrameKind.NOTICE:
            self._notice(conn, *NOTICE.unpack(payload))
        elif kind is FrameKind.JSON:
            message = parse_json(payload)
            reply = self._handle(conn, message)
            if reply is not None:
                conn.reply(message, reply)
        else:
            raise ProtocolError(f"unexpected {kind.name} frame")

    def _notice(self, conn: Connection, ring: int, slot: int, seq: int) -> None:
        attachment = conn.attachments.get(ring)
        try:
            if attachment is None:
                raise NotFoundError(f"no attached ring {ring}")
            attachment.submit(slot, seq)  # an invalid request is answered in its slot
        except DuomoError as err:  # no slot to answer in
            conn.send_error(err.code, err.message, ring=ring, slot=slot)

    def attach(self, conn: Connection, ring: int, attachment: Attachment) -> None:
        """Record a ring attached by ``conn`` (on the reactor thread)."""
        with conn.owner:
            conn.attachments[ring] = attachment
            self._rededicate(conn)

    def detach(self, conn: Connection, ring: int) -> None:
        with conn.owner:
            attachment = conn.attachments.pop(ring, None)
            if attachment is not None:
                attachment.close()
                if not attachment.closed:
                    self._lingering.append(attachment)
            self._rededicate(conn)

    def _rededicate(self, conn: Connection) -> None:
        """Keep ``_lendable`` in step with the models ``conn`` attaches (reactor thread)."""
        models = {a.model_name for a in conn.attachments.values()}
        model = models.pop() if len(models) == 1 and not conn.closed else None
        if model == conn.model:
            return
        if conn.model is not None:
            rest = tuple(c for c in self._lendable.get(conn.model, ()) if c is not conn)
            if rest:
                self._lendable[conn.model] = rest
            else:
                self._lendable.pop(conn.model, None)
        if model is not None:
            self._lendable[model] = (*self._lendable.get(model, ()), conn)
        conn.model = model
        self._lendable_again(conn)

    def _drop(self, conn: Connection) -> None:
        with conn.owner:  # not while an idle worker queues one of its notices
            if self._by_fd.get(conn.fd) is conn:  # before the close: fds are reused
                del self._by_fd[conn.fd]
                with contextlib.suppress(OSError):
                    self._epoll.unregister(conn.fd)
            self._connections.pop(conn.id, None)
            with conn._send_lock:
                conn.closed = True
            conn.dropped = True
            for ring in list(conn.attachments):
                self.detach(conn, ring)
            with contextlib.suppress(OSError):
                if conn.lent:  # its worker wakes up and closes it as it gives it back
                    conn.sock.shutdown(socket.SHUT_RDWR)
                else:
                    conn.sock.close()

    def read_when_idle(
        self,
        model: str,
        wake_fd: int,
        spin_s: float,
        keep_spinning: Callable[[], bool],
    ) -> bool:
        """As ``model``'s idle worker, on its thread: borrow the connections lent to it, wait
        until one of them or ``wake_fd`` is readable, queue the notices that arrived, and give
        the connections back. False (at once) when there is none to borrow.

        The wait polls without sleeping for up to ``spin_s`` first, for as long as
        ``keep_spinning()`` is true, and only then sleeps (see ``Engine``: idle spin)."""
        lent: list[Connection] = []
        try:
            lent.extend(conn for conn in self._lendable.get(model, ()) if self._lend(conn))
            if not lent:
                return False
            poller = select.poll()
            poller.register(wake_fd, select.POLLIN)
            for conn in lent:
                poller.register(conn.fd, select.POLLIN)
            ready = {fd for fd, _ in _poll_spinning_first(poller, spin_s, keep_spinning)}
            for conn in lent:
                if conn.fd in ready:
                    self._read_lent(conn)
        finally:
            for conn in lent:
                self._take_back(conn)
        return True

    def _lend(self, conn: Connection) -> bool:
        with conn.owner:  # (waits while the reactor reads it: this worker is idle anyway)
            if conn.closed:
                return False
            if conn.lent or conn.needs_reactor or not conn.reader.empty:
                conn.refused = True  # another worker or the reactor has it: told when done
                return False
            try:  # (one-shot: a hang-up meanwhile is reported once, not until it is read)
                self._epoll.modify(conn.fd, select.EPOLLONESHOT)
            except (OSError, ValueError):  # (ValueError: the reactor has stopped)
                return False
            conn.lent = True
            return True

    def _read_lent(self, conn: Connection) -> None:
        """Queue the notice that arrived on a lent connection (its worker's thread); anything
        else is the reactor's to read (EOF stays in the socket, data is carried over)."""
        with conn.owner:
            if conn.dropped:
                return
            data = self._receive(conn)
            if data is not None:  # a control message, several frames, a part, or EOF
                conn.needs_reactor = True
                conn.carried = data  # (EOF stays in the socket for the reactor to read)

    def _take_back(self, conn: Connection) -> None:
        with conn.owner:
            conn.lent = False
            try:
                if conn.dropped:
                    conn.sock.close()
                else:  # (one the supervisor stopped writing to: the reactor now reads its EOF)
                    self._epoll.modify(conn.fd, select.EPOLLIN)
                    if conn.carried:  # no event may come for it: the reactor reads it anyway
                        self.call_soon(functools.partial(self._readable, conn))
                    elif conn.refused:  # another model's worker wanted it meanwhile
                        conn.refused = False
                        self._lendable_again(conn)
            except (OSError, ValueError):
                pass

    def _housekeeping(self) -> None:
        now = time.monotonic()
        for conn in list(self._connections.values()):
            if not conn.authenticated and now > conn.auth_deadline:
                conn.send_error(ErrorCode.DEADLINE_EXCEEDED, "authentication timed out")
                self._drop(conn)
        if self._lingering:
            self._lingering = [a for a in self._lingering if not a.retry_unmap()]


def _poll_spinning_first(
    poller: select.poll, spin_s: float, keep_spinning: Callable[[], bool]
) -> list[tuple[int, int]]:
    """``poller``'s events: polled without sleeping for up to ``spin_s`` while
    ``keep_spinning()``, then in one poll that sleeps until there are some. Each turn of the
    spin yields the core (and the GIL) to whatever else is ready to run."""
    events: list[tuple[int, int]] = []
    if spin_s > 0:  # (no spin: straight to the poll that sleeps, one call as before)
        end = time.perf_counter() + spin_s
        while not (events := poller.poll(0)) and time.perf_counter() < end and keep_spinning():
            os.sched_yield()
    return events or poller.poll()
