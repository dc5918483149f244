"""The producer-side client: attach to models served by a supervisor and run requests through
shared-memory slots.

    client = Client()                          # $DUOMO_SOCKET or the standard runtime dir
    ocr = client.model("ocr", slots=4)         # maps a ring of 4 slots
    result = ocr.infer(frame)                  # the same dict `duomo infer --json` prints
    future = ocr.infer_async(frame)            # concurrent.futures.Future
    with ocr.slot() as s:                      # zero-copy: decode straight into the slot
        s.input("image", frame.shape)[...] = frame
        s.submit()
        result = s.wait()

``from ipc import Client`` is the same class. A frame larger than the model's default slot
area grows the handle's ring by itself (``ipc.slots``), within the supervisor's limits on ring
memory. A ring is a sealed memfd whose descriptor arrives with the ``attach`` reply
(``SCM_RIGHTS``; every read of the socket is a ``recvmsg`` that keeps what came with it); it has
no name anywhere. A process may exit without ``close()``: the supervisor frees its rings when
the connection ends, and nothing is printed here (``ipc.ring``).

Threads: no thread of its own for synchronous use. A thread that waits (``wait``, ``infer``,
a control request) reads the socket itself while nobody else does ("leader"); other waiters
sleep on a condition and are woken when the leader has dispatched their answer or stepped down
— so a synchronous round trip costs no extra thread hop. While ``infer_async`` requests are
outstanding, one background thread leads, so their futures complete and callbacks run without
anybody waiting. Nothing spins: a reader waiting for a slot's answer blocks in ``recv`` alone
(one system call on the way back), waking every ``READ_SLICE_S`` to check its deadline; other
waits also watch a wake pipe. If the supervisor goes away, whoever reads sees it at once and
every waiting call raises ``UnavailableError``. An event loop can instead be the client's one
reader for good (``read_in_loop``, then ``read_available`` whenever the socket is readable: the
gateway does this), and threads that wait follow it.
Errors are the typed exceptions of ``ipc.errors``, carrying the supervisor's message.
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
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from duomo.ipc.errors import (
    DeadlineExceededError,
    DuomoError,
    ErrorCode,
    UnavailableError,
    error_for,
)
from duomo.ipc.framing import FrameReader, answer, json_frame, parse_json, recv_frame
from duomo.ipc.ring import RingLayout, SlotRing
from duomo.ipc.runtime_dir import default_socket_path, read_key
from duomo.ipc.slots import ModelHandle, Slot
from duomo.ipc.stream import DEFAULT_BACKLOG, Stream
from duomo.ipc.stream import DEFAULT_SLOTS as DEFAULT_STREAM_SLOTS
from duomo.ipc.wire import (
    FRAME,
    NOTICE,
    FrameKind,
    frame,
)

__all__ = ["Client", "ModelHandle", "Slot"]
_NOTICE_FRAME_BYTES = FRAME.size + NOTICE.size
_NOTICE_PREFIX = FRAME.pack(NOTICE.size, FrameKind.NOTICE)
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


class Client:
    """A producer's connection to one supervisor: control requests, and the models it attaches.

    One Unix socket carries framed JSON control messages and the 8-byte "slot ready" / "slot
    done" notices; tensors travel through the shared-memory rings that ``model`` attaches.
    A client may be shared by threads. It starts no thread for synchronous use: a thread that
    waits reads the socket itself while no other does, and the others wait for it (see the
    module docstring); one background thread reads while ``infer_async`` requests are
    outstanding. Every error is a typed ``ipc.errors.DuomoError``; once the supervisor goes
    away, every waiting and later call raises ``UnavailableError``.

    Its handles reach it only through ``ipc.slots.HandleClient``, which a private link
    object implements with the client's private members (``_HandleLink``).

    Example:
        from duomo import Client

        with Client() as client:  # $DUOMO_SOCKET, or the standard runtime directory
            classify = client.model("classify", slots=4)
            result = classify.infer(image)  # a uint8 H×W×C array
            names = [m["name"] for m in client.models()]

    Attributes:
        socket_path: The supervisor's control socket.
        timeout_s: The default bound on a control round trip (``request``, ``models``,
            ``status``); ``model`` waits at least ``ATTACH_TIMEOUT_S`` for a model to load.
        events: Errors the supervisor reported without a slot to pin them on
            (``next_event``).
    """

    def __init__(self, socket_path: str | Path | None = None, timeout_s: float = 10.0) -> None:
        """Connect and authenticate (with the key file beside the socket).

        Args:
            socket_path: The supervisor's socket; None: ``$DUOMO_SOCKET``, else the standard
                runtime directory's.
            timeout_s: Bounds connecting and authenticating, and is the default bound on each
                control round trip afterwards.

        Raises:
            UnavailableError: No key file at the socket's directory (no supervisor there), or
                the supervisor cannot be reached or did not authenticate within ``timeout_s``.
            ResourceExhaustedError: The supervisor refused the connection (its
                ``limits.max_connections``, or it is out of file descriptors).
        """
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._handles: dict[int, ModelHandle] = {}
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
        # errors the supervisor reported without a slot to attribute them to (protocol misuse)
        self.events: queue.SimpleQueue[DuomoError] = queue.SimpleQueue()
        self._link = _HandleLink(self)  # what its handles use of it (``ipc.slots.HandleClient``)
        try:
            key = read_key(self.socket_path)
        except FileNotFoundError:
            raise UnavailableError(f"no supervisor at {self.socket_path} (no key file)") from None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._connect(time.monotonic() + timeout_s)
            self._handshake(key)
        except DuomoError:  # refused: too many connections, or out of file descriptors
            self._sock.close()
            raise
        except (OSError, ConnectionError) as err:
            self._sock.close()
            raise UnavailableError(
                f"cannot reach the supervisor at {self.socket_path}: {err}"
            ) from None
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _READ_SLICE)
        # The reading thread waits in poll on the socket and on a wake pipe: a slot released by
        # another thread (no frame arrives for that) must reach a reader waiting for one.
        self._sock_fd = self._sock.fileno()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)

    def _connect(self, deadline: float) -> None:
        """Connect, retrying with back-off while the listen backlog is full (a burst of
        connections: EAGAIN) until ``deadline``."""
        delay_s = CONNECT_RETRY_FIRST_S
        while True:
            try:
                self._sock.connect(str(self.socket_path))
                return
            except BlockingIOError:
                if time.monotonic() + delay_s > deadline:
                    raise ConnectionError(
                        "the supervisor's listen backlog stayed full "
                        f"for {self.timeout_s}s (connection attempts in a burst)"
                    ) from None
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, CONNECT_RETRY_MAX_S)

    def _handshake(self, key: bytes) -> None:
        reader = FrameReader()
        kind, challenge = recv_frame(self._sock, reader)
        if kind is FrameKind.JSON:  # not admitted: the supervisor says why
            refusal = parse_json(challenge)
            raise error_for(
                refusal.get("code", ErrorCode.UNAVAILABLE),
                str(refusal.get("message", "the supervisor refused the connection")),
            )
        if kind is not FrameKind.CHALLENGE:
            raise ConnectionError("the supervisor did not send a challenge")
        self._sock.sendall(frame(FrameKind.RESPONSE, answer(key, challenge)))
        kind, payload = recv_frame(self._sock, reader)
        hello = parse_json(payload) if kind is FrameKind.JSON else {}
        if hello.get("event") != "hello":
            raise ConnectionError(hello.get("message", "authentication failed"))
        self._frames = reader

    # -- control --------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        """(``HandleClient.send_frame``) Send one whole frame; ``UnavailableError`` once the
        connection is closed or lost."""
        with self._send_lock:
            if self._closed is not None:
                raise UnavailableError(f"connection to the supervisor is closed ({self._closed})")
            try:
                self._sock.sendall(data)
            except OSError as err:
                raise UnavailableError(f"lost the supervisor: {err}") from None

    def request(self, op: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one control message and wait for its reply.

        The calling thread blocks until the reply arrives, for at most ``timeout_s`` (reading
        the socket itself while no other thread does).

        Args:
            op: The operation (``"status"``, ``"models"``, ``"load"``, ``"reload"``, …).
            timeout_s: How long to wait for the reply; None: the client's ``timeout_s``.
            **fields: The message's other fields.

        Returns:
            The reply, whose ``"ok"`` is true.

        Raises:
            DeadlineExceededError: No reply within ``timeout_s``.
            UnavailableError: The connection is closed or was lost.
            DuomoError: The supervisor's refusal, as its typed subclass
                (``NotFoundError``, ``InvalidArgumentError``, ``ResourceExhaustedError``, …).
        """
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        request_id = next(self._ids)
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            if self._closed is not None:
                raise UnavailableError(f"connection to the supervisor is closed ({self._closed})")
            self._pending[request_id] = future
        try:
            self._send(json_frame({"id": request_id, "op": op, **fields}))
            self._wait_until(future.done, time.monotonic() + wait_s)
            if not future.done():
                raise DeadlineExceededError(f"no reply to {op!r} within {wait_s}s")
            reply = future.result()
        finally:
            with self._lock:
                self._pending.pop(request_id, None)
        if not reply.get("ok"):
            raise error_for(reply.get("code", ErrorCode.INTERNAL), reply.get("message", "failed"))
        return reply

    def next_event(self, timeout_s: float) -> DuomoError | None:
        """The next error the supervisor reported without a slot to pin it on (for example a
        notice for a slot index that does not exist).

        Blocks (reading the socket while no other thread does) until there is one, for at
        most ``timeout_s``, or until the connection is lost.

        Args:
            timeout_s: The longest wait, in seconds.

        Returns:
            The error (not raised), or None if none came in time.
        """
        self._wait_until(lambda: not self.events.empty(), time.monotonic() + timeout_s)
        try:
            return self.events.get_nowait()
        except queue.Empty:
            return None

    @property
    def connected(self) -> bool:
        """Whether the connection to the supervisor is open (False once closed or lost)."""
        return self._closed is None

    def _lost(self) -> BaseException | None:
        """(``HandleClient.lost``) Why the connection ended (None while it is open)."""
        return self._closed

    def models(self) -> list[dict[str, Any]]:
        """The models the supervisor serves, one dict each (its name, task, state, …): one
        ``request`` round trip, with its errors."""
        return list(self.request("models")["models"])

    def status(self) -> dict[str, Any]:
        """The supervisor's status, as ``duomo status --json`` prints it: one ``request``
        round trip, with its errors."""
        return dict(self.request("status")["status"])

    def model(self, name: str, slots: int = 4) -> ModelHandle:
        """Attach to model ``name`` with a ring of ``slots`` slots: up to that many requests
        in flight at once.

        Blocks for one control round trip, for at most the larger of the client's
        ``timeout_s`` and ``ATTACH_TIMEOUT_S`` (300 s): a model declared ``preload: false``
        is loaded by this call, which waits for the load.

        Args:
            name: The model's name in the supervisor's configuration.
            slots: The ring's slots.

        Returns:
            The handle; close it (``ModelHandle.close``) or the client to detach.

        Raises:
            NotFoundError: The supervisor serves no model ``name``.
            InvalidArgumentError: ``slots`` is out of range.
            ResourceExhaustedError: The client's or the supervisor's limits on rings, slots
                or ring memory leave no room for the ring.
            DeadlineExceededError: No reply in time (the model is still loading).
            UnavailableError: The connection is closed or lost, or the ring could not be
                mapped.
            DuomoError: Any other refusal of the supervisor's, as its typed subclass (a
                model that failed to load, say).
        """
        ring_id, ring = self._attach(name, slots)
        return ModelHandle(self, self._link, name, ring_id, ring)

    def stream(
        self,
        name: str,
        models: Sequence[str],
        policy: str = "latest",
        weight: float = 1.0,
        fps: float | None = None,
        max_fps: float | None = None,
        every: int | None = None,
        stall_after_s: float = 5.0,
        slots: int = DEFAULT_STREAM_SLOTS,
        backlog: int = DEFAULT_BACKLOG,
        timeout_s: float | None = None,
    ) -> Stream:
        """Open stream ``name`` into ``models``: a camera's frames, answered freshest first
        (``ipc.stream``). Blocks for the ``stream_open`` round trip and one ``attach`` per
        model.

        Args:
            name: 1..64 printable characters, unique among the supervisor's live streams.
            models: The models each frame goes to.
            policy: ``latest`` (a frame waiting for a model is superseded by the next) or
                ``fifo`` (every frame answered).
            weight: Its share, against the other streams and clients of each model, in
                [0.001, 1000].
            fps: Its nominal frame rate, if known (the status shows it; liveness uses it).
            max_fps: Drop frames at the source above this rate.
            every: Keep one frame in ``every`` at the source.
            stall_after_s: No frame for this long: the supervisor shows it ``stalled``.
            slots: Slots per model (at least 3 keeps ``latest``'s age bound).
            backlog: ``fifo``: frames that may wait at the source per model.
            timeout_s: Each frame's deadline in the supervisor; None: none.

        Returns:
            The stream; close it (``Stream.close``) or the client to end it.

        Raises:
            InvalidArgumentError: A bad name, policy, weight, rate or count, or the name is
                another live stream's.
            NotFoundError: A model that is not served.
            ResourceExhaustedError: ``limits.max_streams`` streams exist, or no room for a
                ring.
            UnavailableError: The connection is closed or lost.
        """
        return Stream(
            self, name, models, policy, weight, fps, max_fps, every, stall_after_s, slots,
            backlog, timeout_s,
        )  # fmt: skip

    def open_stream(
        self,
        name: str,
        models: Sequence[str],
        policy: str = "latest",
        weight: float = 1.0,
        fps: float | None = None,
        stall_after_s: float = 5.0,
    ) -> int:
        """Open stream ``name`` in the supervisor only, for a producer that writes its slots
        itself (``Slot.set_stream``): its id. ``stream`` does this and the rest for you.

        Raises:
            As ``stream``.
        """
        reply = self.request(
            "stream_open",
            name=name,
            models=list(models),
            policy=policy,
            weight=weight,
            fps=fps,
            stall_after_s=stall_after_s,
        )
        return int(reply["stream"])

    def close_stream(self, stream_id: int) -> None:
        """Close a stream opened by ``open_stream`` (it turns ``ended``)."""
        self.request("stream_close", stream=stream_id)

    def _attach(
        self, name: str, slots: int, inputs: dict[str, int] | None = None
    ) -> tuple[int, SlotRing]:
        """(``HandleClient.attach_ring``) Attach a new ring for ``name`` and map the segment whose
        descriptor came with the reply; ``inputs``: input -> the bytes its area must hold,
        past the model's default."""
        fields: dict[str, Any] = {"inputs": inputs} if inputs else {}
        # attaching a model that is not loaded yet waits for its load
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
            self._detach_later(ring_id)
            raise UnavailableError(f"cannot map the ring for {name!r}: {err}") from None
        return ring_id, ring

    def _register(self, handle: ModelHandle, ring_id: int, old_ring: int | None = None) -> None:
        """(``HandleClient.route_ring``) Route ring ``ring_id``'s notices to ``handle``
        (before any slot of it is submitted), and ring ``old_ring``'s no more."""
        with self._lock:
            if old_ring is not None:
                self._handles.pop(old_ring, None)
            self._handles[ring_id] = handle

    def _unregister(self, ring_ids: Iterable[int]) -> None:
        """(``HandleClient.unroute_rings``) Route nothing more from these rings (their
        handle closes)."""
        with self._lock:
            for ring_id in ring_ids:
                self._handles.pop(ring_id, None)

    def _detach_later(self, ring_id: int) -> None:
        """(``HandleClient.detach_ring_later``) Detach ring ``ring_id`` without waiting for
        the reply (the caller may be the thread that reads the socket, or an event loop):
        nothing routes to it any more."""
        with self._lock:
            self._handles.pop(ring_id, None)
        with contextlib.suppress(DuomoError):  # gone: the supervisor freed it already
            self._send(json_frame({"id": next(self._ids), "op": "detach", "ring": ring_id}))

    def close(self) -> None:
        """Disconnect: the supervisor frees this client's rings, and they are unmapped here.

        Requests still in flight fail with ``UnavailableError`` (waiting callers, futures).
        Waits up to 5 s for the background reader thread, if ``infer_async`` started one, to
        end. Closing twice is harmless."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._connection_lost(ConnectionError("closed by this client"))
        if self._background is not None:
            self._background.join(5)
        self._sock.close()
        with self._lock:
            handles = list(dict.fromkeys(self._handles.values()))  # (one per ring it maps)
            self._handles.clear()
        with self._read_cond:
            wake_fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in wake_fds:
            if fd >= 0:
                os.close(fd)
        while self._descriptors:
            os.close(self._descriptors.popleft())
        for handle in handles:
            handle._unmap()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading: leader/follower -----------------------------------------------------------

    def _wait_until(
        self, done: Callable[[], bool], deadline: float | None, by_frame: bool = False
    ) -> None:
        """(``HandleClient.wait_for``) Return once ``done()`` holds, the monotonic
        ``deadline`` passes (None: no deadline), or the connection is lost.

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
                self._wake_waiters()
            return
        try:
            for kind, payload in self._frames.feed(data):
                self._on_frame(kind, payload)
        except Exception as err:  # a protocol error: the connection cannot continue
            self._connection_lost(err)
            return
        self._wake_waiters()

    # -- reading from an event loop ---------------------------------------------------------

    def read_in_loop(self) -> int:
        """Make the calling thread this client's one reader for good: an event loop that calls
        ``read_available`` whenever the returned file descriptor is readable (and may use slots
        and their ``on_done`` callbacks, which then run on it). Other threads that wait
        (``request``, ``model``, ``Slot.wait``) follow it instead of reading themselves.

        Returns:
            The socket's file descriptor, to watch for readability.

        Raises:
            RuntimeError: Another thread is reading the socket right now.
        """
        with self._read_lock:
            if self._leading and self._leader != threading.get_ident():
                raise RuntimeError("another thread is reading this client's socket")
            self._leading = True
            self._leader = threading.get_ident()
            self._reads_in_loop = True
        return self._sock_fd

    def read_available(self) -> None:
        """(The loop's reader, after ``read_in_loop``) Read what has arrived, without
        blocking, and dispatch it: answered slots' ``on_done`` callbacks run here. Raises
        nothing: a lost connection fails what waits with ``UnavailableError``."""
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

    def _wake_waiters(self) -> None:
        """(``HandleClient.wake_waiters``) Let every waiter re-check what it waits for: the
        followers (they count themselves under the condition's lock, so none can be missed)
        and a reader in another thread."""
        with self._read_lock:
            if self._followers:
                self._read_cond.notify_all()
            if self._wake_w >= 0 and self._leading and self._leader != threading.get_ident():
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_w, b"\0")

    def _connection_lost(self, reason: BaseException) -> None:
        with self._lock:
            if self._closed is not None:
                return
            self._closed = reason
            pending = list(self._pending.values())
            handles = list(dict.fromkeys(self._handles.values()))
        lost = UnavailableError(f"lost the supervisor at {self.socket_path}: {reason}")
        for future in pending:
            if not future.done():
                future.set_exception(lost)
        for handle in handles:
            handle._fail_all(lost)
        with self._read_cond:
            self._read_cond.notify_all()

    def _async_started(self) -> None:
        """(``HandleClient.async_started``) An async request is outstanding: make sure someone
        reads while nobody waits."""
        with self._read_cond:
            self._async_pending += 1
            self._read_cond.notify_all()
            if self._background is None and not self._reads_in_loop:
                self._background = threading.Thread(
                    target=self._background_reader, name="duomo-client", daemon=True
                )
                self._background.start()

    def _async_finished(self) -> None:
        """(``HandleClient.async_finished``) An async request was answered."""
        with self._read_cond:
            self._async_pending -= 1

    def _background_reader(self) -> None:
        while self._closed is None:
            with self._read_cond:
                while self._async_pending == 0 and self._closed is None:
                    self._read_cond.wait()
            self._wait_until(lambda: self._async_pending == 0, None)

    def _on_notice(
        self, ring: int, slot: int, seq: int | None, error: DuomoError | None = None
    ) -> None:
        """A slot's answer (``seq``, or None with the error the supervisor gave for it)."""
        handle = self._handles.get(ring)
        if handle is None:
            return
        slots = handle._slots if ring == handle.ring_id else handle._slots_of(ring)
        if 0 <= slot < len(slots) and slots[slot].ring_id == ring:  # (not one moved on)
            slots[slot]._done(seq, error)

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
            handle = self._handles.get(ring)
            if handle is not None and isinstance(slot, int) and 0 <= slot < handle.layout.slots:
                self._on_notice(ring, slot, None, err)
            else:
                self.events.put(err)


class _HandleLink:
    """``ipc.slots.HandleClient`` for one client: the client's private members, bound once
    under the protocol's names, so a handle's call through it (a slot's notice, its wait) costs
    what a direct call of the member does."""

    __slots__ = (
        "async_finished",
        "async_started",
        "attach_ring",
        "detach_ring_later",
        "lost",
        "request",
        "route_ring",
        "send_frame",
        "unroute_rings",
        "wait_for",
        "wake_waiters",
    )

    def __init__(self, client: Client) -> None:
        self.lost = client._lost
        self.send_frame = client._send
        self.wait_for = client._wait_until
        self.request = client.request
        self.attach_ring = client._attach
        self.route_ring = client._register
        self.unroute_rings = client._unregister
        self.detach_ring_later = client._detach_later
        self.wake_waiters = client._wake_waiters
        self.async_started = client._async_started
        self.async_finished = client._async_finished
