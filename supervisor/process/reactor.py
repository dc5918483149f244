"""The reactor: one thread that multiplexes the listening socket and every client connection.

Owned by ``Supervisor``. It accepts connections, authenticates them (challenge–response, see
``ipc.framing``), decodes frames, answers control messages through ``ControlHandlers.handle``
(``supervisor.process.control_handlers``) and turns "slot ready" notices into queued requests
through its ``Intake`` (``supervisor.process.intake``, which hands each to
``Attachment.submit``). It never runs a model: the only slow thing it does is create a
shared-memory segment on ``attach``. It waits in ``epoll`` itself (not through ``selectors``): a
notice's way from the socket to its model's queue is every request's path, and each Python call
on it costs about a microsecond when it runs cold after an inference.

**Lending.** A connection whose rings all attach one model (the usual producer) is lent to
that model's idle worker, which reads it itself with the same intake
(``supervisor.process.lending``; ``Lending.read_when_idle`` is its entry, handed to the engine's
idle spin by the supervisor). The reactor holds a connection's ``owner`` lock while it reads it, and
reads none that is lent (``Connection.loan``).

Workers send "slot done" notices from their own threads through ``Connection.send``, which
never blocks (its send rule: ``supervisor.process.connection``). A connection that breaks the
protocol gets an error event and is closed; one that goes away has its attachments closed (queued
work dropped, segments unmapped once nothing reads them). Nothing a client sends can stop the loop.

**Admission** (``limits``): at most ``max_connections`` connections, authenticated or not, of
which at most ``max_unauthenticated`` have not answered their challenge yet. A peer that
arrives when either bound is reached takes the place of the *oldest* peer still
authenticating, which is told RESOURCE_EXHAUSTED and closed — so a flood of peers that never
authenticate can delay a good client by one round trip but never lock it out; only when every
place is held by an authenticated client is the newcomer itself refused. When the process runs
out of file descriptors (``EMFILE``/``ENFILE``) the reactor closes a spare one it keeps for
this, accepts the waiting peer, tells it so and closes it; with no spare left it stops
accepting for ``ACCEPT_BACKOFF_S``. Either way a level-triggered listener never spins, and
refusals are logged at most once per ``REFUSAL_LOG_S``. A peer must authenticate within
``auth_timeout_s``; an authenticated one that holds no ring and sends nothing for
``idle_timeout_s`` is closed.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import os
import secrets
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

from duomo.ipc.errors import ErrorCode
from duomo.ipc.framing import ProtocolError, parse_json, verify
from duomo.ipc.wire import CHALLENGE_BYTES, NOTICE, FrameKind, frame
from duomo.supervisor.dataflow.streams import StreamRegistry
from duomo.supervisor.process.attachment import Attachment
from duomo.supervisor.process.connection import (
    CHALLENGED,
    CLOSING,
    DROPPED,
    Connection,
    fitted_json,
)
from duomo.supervisor.process.intake import Intake
from duomo.supervisor.process.lending import Lending
from duomo.supervisor.process.limits import Limits
from duomo.supervisor.process.loan import LENT, Loan

log = structlog.get_logger("duomo.reactor")
HOUSEKEEPING_S = 0.1  # deadlines, timeouts and unmap retries are checked this often
ACCEPT_BATCH = 64  # connections accepted per turn of the loop
ACCEPT_BACKOFF_S = 0.1  # out of file descriptors with no spare: accept nothing for this long
REFUSAL_LOG_S = 10.0  # refused connections are logged at most this often
MAX_ID_CHARS = 64  # a control message's "id", echoed in its reply: an int or a short string
# accept() failing for want of a descriptor (or of kernel memory): refuse or back off
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


# the reply to a control message, or None when the handler has it sent later (``reply``)
Handler = Callable[[Connection, dict[str, Any]], dict[str, Any] | None]


class Reactor:
    """The thread that multiplexes the listening socket and every client connection: it accepts
    and authenticates them, answers control messages and queues the requests of ready slots."""

    def __init__(
        self,
        listener: socket.socket,
        key: bytes,
        handle: Handler,
        limits: Limits,
        wake_idle: Callable[[str], None] | None = None,
        streams: StreamRegistry | None = None,
    ) -> None:
        """``wake_idle``: wakes a model's idle workers (``Engine.wake_idle``), to borrow a
        connection or give one back (``supervisor.process.lending``); None where there are none.
        ``streams``: where a connection's streams end when it goes away, and whose liveness
        the housekeeping checks."""
        self._listener: socket.socket | None = listener
        self._key = key
        self._handle = handle
        self.limits = limits
        self.streams = streams
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = socket.socketpair()
        self._connections: dict[int, Connection] = {}
        self._challenged: dict[int, Connection] = {}  # not authenticated yet, oldest first
        self._by_fd: dict[int, Connection] = {}  # the registered client sockets
        self._intake = Intake()  # notices -> queued requests, shared with the lending
        self.lending = Lending(self._epoll, self._intake, self.read_soon, wake_idle)
        self._ids = itertools.count(1)
        self._lingering: list[Attachment] = []
        self._thread: threading.Thread | None = None
        self._thread_id = 0
        self._running = False
        self._stop_accepting = False
        self._next_housekeeping = 0.0
        self._soon: deque[Callable[[], None]] = deque()
        # admission: a spare descriptor to accept (and refuse) with when the process has none
        # left, accepting paused until then, and refusals not logged yet
        self._spare_fd: int | None = None
        self._accept_paused_until: float | None = None
        self._refused: dict[str, int] = {}
        self._refusals_logged_s = 0.0
        self.refused_total = 0
        self.cut_off_total = 0

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the reactor thread (from any thread): what touches the connections'
        state does so there only."""
        self._soon.append(fn)
        self._wake()

    def read_soon(self, conn: Connection) -> None:
        """Read ``conn`` on the reactor thread (from any thread), whether or not an event
        comes for it: its idle worker gave it back with data only the reactor handles."""
        self.call_soon(functools.partial(self._readable, conn))

    @property
    def connections(self) -> list[Connection]:
        return list(self._connections.values())

    @property
    def mapped_rings(self) -> int:
        """Segments still mapped: attached ones, and detached ones whose last reader is busy."""
        attached = sum(len(c.attachments) for c in list(self._connections.values()))
        return attached + sum(1 for a in self._lingering if not a.closed)

    def set_limits(self, limits: Limits) -> None:
        """A reload's limits: new connections and every connection's next check use them."""
        self.limits = limits
        for conn in self.connections:
            conn.limits = limits
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.listen(limits.listen_backlog)

    def start(self) -> None:
        assert self._listener is not None
        self._listener.setblocking(False)
        self._epoll.register(self._listener, select.EPOLLIN)
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # a byte already waiting wakes the loop as well
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._spare_fd = _open_spare()
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="duomo-reactor", daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        self._stop_accepting = True
        self._wake()

    def stop(self) -> None:
        """End the loop and close every connection (clients see EOF), after sending what
        their sockets still take."""
        self._running = False
        self._wake()
        if self._thread is not None:
            self._thread.join(10)
        for conn in list(self._connections.values()):
            conn.flush()
            self._drop(conn)
        for attachment in self._lingering:
            attachment.retry_unmap()
        self._epoll.close()
        self._wake_r.close()
        self._wake_w.close()
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _loop(self) -> None:
        self._thread_id = threading.get_ident()
        listener_fd = self._listener.fileno() if self._listener is not None else -1
        wake_fd = self._wake_r.fileno()
        by_fd = self._by_fd
        while self._running:
            if self._stop_accepting and self._listener is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._epoll.unregister(self._listener)
                self._listener.close()
                self._listener = None
                listener_fd = -1
            try:
                events = self._epoll.poll(0.5)
            except OSError:
                break
            for fd, mask in events:
                conn = by_fd.get(fd)
                try:
                    if conn is not None:
                        if mask & select.EPOLLOUT:
                            self._writable(conn)
                        if mask & ~select.EPOLLOUT:
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
                    self._housekeeping(now)
                except Exception:
                    log.exception("reactor housekeeping error")

    # -- admission ----------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            if self._listener is None or self._accept_paused_until is not None:
                return
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                if err.errno not in _OUT_OF_FDS:
                    raise
                self._out_of_fds(err)
                continue
            limits = self.limits
            full = len(self._connections) >= limits.max_connections
            if full or len(self._challenged) >= limits.max_unauthenticated:
                oldest = next(iter(self._challenged.values()), None)
                if oldest is None:  # every place is an authenticated client's
                    self._refuse(
                        sock, "connection limit",
                        f"the supervisor serves at most {limits.max_connections} connections "
                        "(limits.max_connections); close one or retry later",
                    )  # fmt: skip
                    continue
                oldest.send_error(
                    ErrorCode.RESOURCE_EXHAUSTED,
                    "not authenticated yet, and a newer peer needs the place "
                    f"({limits.max_unauthenticated} may be authenticating at once: "
                    "limits.max_unauthenticated; limits.max_connections in all)",
                )
                self._drop(oldest)
                self._note_refusal("dropped before authenticating")
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        sock.setblocking(False)  # the reactor reads only when epoll says so; sends never wait
        conn = Connection(
            sock, next(self._ids), secrets.token_bytes(CHALLENGE_BYTES), self.limits,
            self._blocked, Loan(),
        )  # fmt: skip
        self._connections[conn.id] = conn
        self._challenged[conn.id] = conn
        self._by_fd[conn.fd] = conn
        self._epoll.register(conn.fd, select.EPOLLIN)
        conn.send(frame(FrameKind.CHALLENGE, conn.challenge))

    def _out_of_fds(self, err: OSError) -> None:
        """``accept`` failed for want of a file descriptor (or kernel memory): refuse the
        waiting peer with the spare descriptor, or stop accepting for a while (never spin on
        the level-triggered listener)."""
        assert self._listener is not None
        why = f"the supervisor cannot take a connection now ({os.strerror(err.errno or 0)})"
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None
            sock = None
            with contextlib.suppress(OSError):
                sock, _ = self._listener.accept()
            if sock is not None:
                self._refuse(sock, "out of file descriptors", f"{why}; retry later")
            self._spare_fd = _open_spare()  # (the refused peer's descriptor is free again)
            if sock is not None:
                return
        self._note_refusal("out of file descriptors")
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(self._listener)
        self._accept_paused_until = time.monotonic() + ACCEPT_BACKOFF_S

    def _refuse(self, sock: socket.socket, why: str, message: str) -> None:
        """Tell a peer it is not admitted (RESOURCE_EXHAUSTED, before any challenge) and close."""
        with contextlib.suppress(OSError):
            sock.send(
                fitted_json({
                    "event": "error", "code": int(ErrorCode.RESOURCE_EXHAUSTED),
                    "message": message,
                }),
                socket.MSG_DONTWAIT,
            )  # fmt: skip
        sock.close()
        self._note_refusal(why)

    def _note_refusal(self, why: str) -> None:
        self.refused_total += 1
        self._refused[why] = self._refused.get(why, 0) + 1
        self._log_refusals(time.monotonic())

    def _log_refusals(self, now: float) -> None:
        """The refusals since the last warning, at most once per ``REFUSAL_LOG_S``."""
        if self._refused and now - self._refusals_logged_s >= REFUSAL_LOG_S:
            log.warning(
                "connections refused", refused=dict(self._refused),
                connections=len(self._connections), limit=self.limits.max_connections,
            )  # fmt: skip
            self._refused.clear()
            self._refusals_logged_s = now

    # -- reading ------------------------------------------------------------------------------

    def _readable(self, conn: Connection) -> None:
        with conn.owner:
            if self.lending.reactor_reads(conn):  # (not while its idle worker reads it)
                self._read(conn)
                self.lending.settled(conn)

    def _read(self, conn: Connection) -> None:
        loan = conn.loan
        data: bytes | None = loan.carried  # what its idle worker read and left to it, first
        if data:
            loan.carried = b""
        else:
            data = self._intake.receive(conn)  # (a lone notice is queued there)
            if data is None:
                return
        if not data:
            self._drop(conn)
            return
        conn.last_received_s = time.monotonic()
        conn.cork()  # the replies to everything in this read go out in one write
        try:
            for kind, payload in conn.reader.feed(data):
                self._dispatch(conn, kind, payload)
                if conn.stage >= CLOSING:
                    break
        except ProtocolError as err:
            what = "authentication failed" if conn.stage is CHALLENGED else "protocol error"
            conn.send_error(ErrorCode.INVALID_ARGUMENT, f"{what}: {err}")
            conn.close_after_read()
        finally:
            conn.uncork()
        if conn.stage >= CLOSING:
            self._drop(conn)

    def _dispatch(self, conn: Connection, kind: FrameKind, payload: bytes) -> None:
        if conn.stage is CHALLENGED:  # (the reader accepts nothing but the response yet)
            if verify(self._key, conn.challenge, payload):
                conn.authenticate()
                self._challenged.pop(conn.id, None)
                conn.send(fitted_json({"event": "hello", "version": 1, "pid": os.getpid()}))
                return
            conn.send_error(ErrorCode.INVALID_ARGUMENT, "authentication failed")
            conn.close_after_read()
            return
        if kind is FrameKind.NOTICE:
            self._intake.notice(conn, *NOTICE.unpack(payload))
        elif kind is FrameKind.JSON:
            message = parse_json(payload)
            message_id = message.get("id")
            if message_id is not None and not _valid_id(message_id):
                conn.send_error(
                    ErrorCode.INVALID_ARGUMENT,
                    f"a control message's 'id' must be an integer or a string of at most "
                    f"{MAX_ID_CHARS} characters",
                )
                return
            reply = self._handle(conn, message)
            if reply is not None:
                conn.reply(message, reply)
        else:
            raise ProtocolError(f"unexpected {kind.name} frame")

    # -- writing ------------------------------------------------------------------------------

    def _blocked(self, conn: Connection) -> None:
        """``conn`` has answers waiting in its outbox (any thread): watch it for room."""
        if threading.get_ident() == self._thread_id:
            self._want_write(conn)
        else:
            self.call_soon(functools.partial(self._want_write, conn))

    def _want_write(self, conn: Connection) -> None:
        with conn.owner:
            if conn.stage is DROPPED or not conn.wants_write:
                return
            if conn.loan.reading is LENT:  # its worker gives it back, armed for room
                self.lending.call_workers(conn)
                return
            with contextlib.suppress(OSError, ValueError):
                self._epoll.modify(conn.fd, select.EPOLLIN | select.EPOLLOUT)

    def _writable(self, conn: Connection) -> None:
        if not conn.flush():
            return
        with conn.owner:  # the outbox is empty: stop watching for room
            if conn.loan.reading is LENT or conn.stage is DROPPED:
                return
            with contextlib.suppress(OSError, ValueError):
                self._epoll.modify(conn.fd, select.EPOLLIN)
            self.lending.settled(conn)

    def attach(self, conn: Connection, ring: int, attachment: Attachment) -> None:
        """Record a ring attached by ``conn`` (on the reactor thread)."""
        with conn.owner:
            conn.attachments[ring] = attachment
            self.lending.dedicate(conn)

    def detach(self, conn: Connection, ring: int) -> None:
        with conn.owner:
            attachment = conn.attachments.pop(ring, None)
            if attachment is not None:
                attachment.close()
                if not attachment.closed:
                    self._lingering.append(attachment)
            self.lending.dedicate(conn)

    def _drop(self, conn: Connection) -> None:
        with conn.owner:  # not while an idle worker queues one of its notices
            if self._by_fd.get(conn.fd) is conn:  # before the close: fds are reused
                del self._by_fd[conn.fd]
                with contextlib.suppress(OSError):
                    self._epoll.unregister(conn.fd)
            self._challenged.pop(conn.id, None)
            if self._connections.pop(conn.id, None) is not None and conn.cut_reason is not None:
                self.cut_off_total += 1
            conn.drop()  # (a lent one's worker wakes up and closes it as it gives it back)
            for ring in list(conn.attachments):
                self.detach(conn, ring)
            if conn.streams and self.streams is not None:
                self.streams.close(conn.streams.values(), why="its producer went away")
                conn.streams.clear()
            if conn.loan.reading is not LENT:
                conn.sock.close()

    def _housekeeping(self, now: float) -> None:
        limits = self.limits
        if self.streams is not None:
            self.streams.tick(now)
        for conn in list(self._connections.values()):
            if conn.stage is CHALLENGED:
                if now > conn.auth_deadline:
                    conn.send_error(ErrorCode.DEADLINE_EXCEEDED, "authentication timed out")
                    self._drop(conn)
            elif conn.stalled(now):
                conn.cut_off(
                    f"it has read none of its answers for {limits.stall_timeout_s:g} s "
                    "(limits.stall_timeout_s)"
                )
                self._drop(conn)
            elif (
                limits.idle_timeout_s
                and not conn.attachments
                and now - conn.last_received_s > limits.idle_timeout_s
            ):
                conn.send_error(
                    ErrorCode.UNAVAILABLE,
                    f"closed after {limits.idle_timeout_s:g} s without a message while holding "
                    "no ring (limits.idle_timeout_s)",
                )
                self._drop(conn)
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            if self._listener is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._epoll.register(self._listener, select.EPOLLIN)
        if self._spare_fd is None:
            self._spare_fd = _open_spare()
        self._log_refusals(now)
        if self._lingering:
            self._lingering = [a for a in self._lingering if not a.retry_unmap()]


def _open_spare() -> int | None:
    """A descriptor held in reserve, to accept (and refuse) a peer with when there is none
    left; None when none can be had now (the next housekeeping tries again)."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _valid_id(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return -(1 << 63) <= value < (1 << 63)
    return isinstance(value, str) and len(value) <= MAX_ID_CHARS
