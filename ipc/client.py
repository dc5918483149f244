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

Threads: no thread of its own for synchronous use. A thread that waits (``wait``, ``infer``,
a control request) reads the socket itself while nobody else does ("leader"); other waiters
sleep on a condition and are woken when the leader has dispatched their answer or stepped down
— so a synchronous round trip costs no extra thread hop. While ``infer_async`` requests are
outstanding, one background thread leads, so their futures complete and callbacks run without
anybody waiting. Nothing spins. If the supervisor goes away, whoever reads sees it at once and
every waiting call raises ``UnavailableError``.
Errors are the typed exceptions of ``ipc.errors``, carrying the supervisor's message.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from ipc.errors import (
    DeadlineExceededError,
    DuomoError,
    ErrorCode,
    InvalidArgumentError,
    UnavailableError,
    error_for,
)
from ipc.framing import FrameReader, answer, json_frame, notice_frame, parse_json, recv_frame
from ipc.ring import RingLayout, SlotRing, read_tensors
from ipc.runtime_dir import default_socket_path, read_key
from ipc.wire import (
    NOTICE,
    FrameKind,
    SlotHeader,
    SlotState,
    TensorDesc,
    dtype_code,
    frame,
    unpack_done,
)

NOTICE_GRACE_S = 5.0  # how long past its own deadline a request waits for the supervisor
log = logging.getLogger("duomo.client")


class Client:
    def __init__(self, socket_path: str | Path | None = None, timeout_s: float = 10.0) -> None:
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._handles: dict[int, ModelHandle] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._closed: BaseException | None = None
        # reading the socket: one leader at a time; followers wait on the condition
        self._read_cond = threading.Condition()
        self._leading = False
        self._leader: int | None = None  # thread id of the thread reading the socket
        self._async_pending = 0
        self._background: threading.Thread | None = None
        # errors the supervisor reported without a slot to attribute them to (protocol misuse)
        self.events: queue.SimpleQueue[DuomoError] = queue.SimpleQueue()
        try:
            key = read_key(self.socket_path)
        except FileNotFoundError:
            raise UnavailableError(f"no supervisor at {self.socket_path} (no key file)") from None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(str(self.socket_path))
            self._handshake(key)
        except (OSError, ConnectionError) as err:
            self._sock.close()
            raise UnavailableError(
                f"cannot reach the supervisor at {self.socket_path}: {err}"
            ) from None
        self._sock.settimeout(None)
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN)

    def _handshake(self, key: bytes) -> None:
        reader = FrameReader()
        kind, challenge = recv_frame(self._sock, reader)
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
        with self._send_lock:
            if self._closed is not None:
                raise UnavailableError(f"connection to the supervisor is closed ({self._closed})")
            try:
                self._sock.sendall(data)
            except OSError as err:
                raise UnavailableError(f"lost the supervisor: {err}") from None

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one control message and wait for its reply; raises the typed error on failure."""
        request_id = next(self._ids)
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            if self._closed is not None:
                raise UnavailableError(f"connection to the supervisor is closed ({self._closed})")
            self._pending[request_id] = future
        try:
            self._send(json_frame({"id": request_id, "op": op, **fields}))
            self.wait_until(future.done, time.monotonic() + self.timeout_s)
            if not future.done():
                raise DeadlineExceededError(f"no reply to {op!r} within {self.timeout_s}s")
            reply = future.result()
        finally:
            with self._lock:
                self._pending.pop(request_id, None)
        if not reply.get("ok"):
            raise error_for(reply.get("code", ErrorCode.INTERNAL), reply.get("message", "failed"))
        return reply

    def next_event(self, timeout_s: float) -> DuomoError | None:
        """The next error the supervisor reported without a slot to pin it on (for example a
        notice for a slot index that does not exist), or None after ``timeout_s``."""
        self.wait_until(lambda: not self.events.empty(), time.monotonic() + timeout_s)
        try:
            return self.events.get_nowait()
        except queue.Empty:
            return None

    @property
    def connected(self) -> bool:
        return self._closed is None

    def models(self) -> list[dict[str, Any]]:
        return list(self.request("models")["models"])

    def status(self) -> dict[str, Any]:
        return dict(self.request("status")["status"])

    def model(self, name: str, slots: int = 4) -> ModelHandle:
        """Attach to ``name`` with ``slots`` slots: up to that many requests in flight."""
        reply = self.request("attach", model=name, slots=slots)
        layout = RingLayout.from_dict(reply["layout"])
        ring = SlotRing.attach(reply["shm"], layout)
        handle = ModelHandle(self, name, reply["ring"], ring)
        with self._lock:
            self._handles[handle.ring_id] = handle
        self.request("mapped", ring=handle.ring_id)
        return handle

    def close(self) -> None:
        """Disconnect; the supervisor frees this client's rings, and they are unmapped here."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._connection_lost(ConnectionError("closed by this client"))
        if self._background is not None:
            self._background.join(5)
        self._sock.close()
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
        for handle in handles:
            handle.ring.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading: leader/follower -----------------------------------------------------------

    def wait_until(self, done: Callable[[], bool], deadline: float | None) -> None:
        """Return once ``done()`` holds, the deadline passes, or the connection is lost.

        The caller reads and dispatches frames itself while no other thread does; otherwise it
        sleeps until the reading thread dispatches something or steps down.
        """
        cond = self._read_cond
        me = threading.get_ident()
        if self._leader == me:
            # A callback running on the reading thread waits for something else: it keeps
            # reading itself (waiting for the leader would wait for itself).
            while not done() and self._closed is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return
                self._read_once(remaining)
            return
        with cond:
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
                cond.wait(remaining)
            else:
                return
        try:
            while not done() and self._closed is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return
                self._read_once(remaining)
        finally:
            with cond:
                self._leading = False
                self._leader = None
                cond.notify_all()

    def _read_once(self, timeout_s: float | None) -> None:
        """One blocking read (bounded by ``timeout_s``) and the dispatch of whatever arrived."""
        try:
            # Wait with poll, never with a socket timeout: the socket stays blocking, so a
            # sender in another thread can never be cut off in the middle of a frame.
            if timeout_s is not None and not self._poll.poll(max(0, int(timeout_s * 1000) + 1)):
                return
            data = self._sock.recv(1 << 16)
        except OSError as err:
            self._connection_lost(err)
            return
        if not data:
            self._connection_lost(ConnectionError("connection closed by the supervisor"))
            return
        try:
            for kind, payload in self._frames.feed(data):
                self._on_frame(kind, payload)
        except Exception as err:  # a protocol error: the connection cannot continue
            self._connection_lost(err)
            return
        with self._read_cond:
            self._read_cond.notify_all()

    def _wake_waiters(self) -> None:
        with self._read_cond:
            self._read_cond.notify_all()

    def _connection_lost(self, reason: BaseException) -> None:
        with self._lock:
            if self._closed is not None:
                return
            self._closed = reason
            pending = list(self._pending.values())
            handles = list(self._handles.values())
        lost = UnavailableError(f"lost the supervisor at {self.socket_path}: {reason}")
        for future in pending:
            if not future.done():
                future.set_exception(lost)
        for handle in handles:
            handle._fail_all(lost)
        with self._read_cond:
            self._read_cond.notify_all()

    def _async_started(self) -> None:
        """An async request is outstanding: make sure someone reads while nobody waits."""
        with self._read_cond:
            self._async_pending += 1
            self._read_cond.notify_all()
            if self._background is None:
                self._background = threading.Thread(
                    target=self._background_reader, name="duomo-client", daemon=True
                )
                self._background.start()

    def _async_finished(self) -> None:
        with self._read_cond:
            self._async_pending -= 1

    def _background_reader(self) -> None:
        while self._closed is None:
            with self._read_cond:
                while self._async_pending == 0 and self._closed is None:
                    self._read_cond.wait()
            self.wait_until(lambda: self._async_pending == 0, None)

    def _on_frame(self, kind: FrameKind, payload: bytes) -> None:
        if kind is FrameKind.NOTICE:
            ring, slot, seq = NOTICE.unpack(payload)
            handle = self._handles.get(ring)
            if handle is not None:
                handle._on_notice(slot, seq, None)
            return
        if kind is not FrameKind.JSON:
            return
        message = parse_json(payload)
        if "id" in message:
            with self._lock:
                future = self._pending.get(message["id"])
            if future is not None and not future.done():
                future.set_result(message)
        elif message.get("event") == "error":
            err = error_for(message.get("code", ErrorCode.INTERNAL), message.get("message", ""))
            handle = self._handles.get(message.get("ring", -1))
            slot = message.get("slot")
            if handle is not None and isinstance(slot, int) and 0 <= slot < handle.layout.slots:
                handle._on_notice(slot, None, err)
            else:
                self.events.put(err)


class ModelHandle:
    """One attached model: a ring of slots in shared memory."""

    def __init__(self, client: Client, name: str, ring_id: int, ring: SlotRing) -> None:
        self.client = client
        self.name = name
        self.ring_id = ring_id
        self.ring = ring
        self.layout = ring.layout
        self._slots = [Slot(self, i) for i in range(self.layout.slots)]
        self._free = list(range(self.layout.slots))
        self._free_lock = threading.Lock()
        self._seq = itertools.count(1)

    def slot(self, timeout_s: float | None = None) -> Slot:
        """A free slot (blocks until one is free); release it with ``with`` or ``release()``.

        While every slot is in flight the caller reads the socket like any waiter, so answers
        that free a slot arrive even when nobody else is waiting.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        client = self.client
        while True:
            with self._free_lock:
                if self._free:
                    slot = self._slots[self._free.pop()]
                    slot._take()
                    return slot
            if client._closed is not None:
                raise UnavailableError("connection to the supervisor is closed")
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(f"no free slot for {self.name!r} in {timeout_s}s")
            client.wait_until(lambda: bool(self._free) or client._closed is not None, deadline)

    def _release(self, index: int) -> None:
        with self._free_lock:
            self._free.append(index)
        self.client._wake_waiters()

    def infer(self, data: Any, timeout_s: float | None = None, priority: int = 0) -> Any:
        """Run one request; the result dict (tensors are copied out of the slot)."""
        with self.slot() as slot:
            slot.write(data)
            slot.submit(timeout_s=timeout_s, priority=priority)
            return slot.wait(copy=True)

    def infer_async(
        self, data: Any, timeout_s: float | None = None, priority: int = 0
    ) -> Future[Any]:
        """Like ``infer`` but returns at once; waits for a free slot if all are in flight."""
        future: Future[Any] = Future()
        slot = self.slot()
        client = self.client
        try:
            slot.write(data)

            def done(s: Slot) -> None:
                client._async_finished()
                _resolve(future, s)

            slot.on_done = done
            client._async_started()
            try:
                slot.submit(timeout_s=timeout_s, priority=priority)
            except BaseException:
                slot.on_done = None
                client._async_finished()
                raise
        except BaseException:
            slot.release()
            raise
        return future

    def close(self) -> None:
        """Detach; requests still in flight on this handle fail with UnavailableError."""
        with contextlib.suppress(DuomoError):
            self.client.request("detach", ring=self.ring_id)
        with self.client._lock:
            self.client._handles.pop(self.ring_id, None)
        self._fail_all(UnavailableError(f"{self.name!r} was detached"))
        self.ring.close()

    def _on_notice(self, index: int, seq: int | None, error: DuomoError | None) -> None:
        if 0 <= index < len(self._slots):
            self._slots[index]._done(seq, error)

    def _fail_all(self, error: DuomoError) -> None:
        for slot in self._slots:
            slot._done(None, error, force=True)
        self.client._wake_waiters()


def _resolve(future: Future[Any], slot: Slot) -> None:
    """Complete an ``infer_async`` future from its answered slot (on the reading thread)."""
    try:
        result: Any = slot.wait(timeout_s=0, copy=True)
        failed = False
    except DuomoError as err:
        result, failed = err, True
    slot.release()  # before the callbacks run: one of them may want a slot of its own
    if not future.set_running_or_notify_cancel():
        return  # cancelled by the caller; nobody wants the answer
    if failed:
        future.set_exception(result)
    else:
        future.set_result(result)


class Slot:
    """One request slot: write inputs in place, submit, wait, read the result in place."""

    def __init__(self, handle: ModelHandle, index: int) -> None:
        self.handle = handle
        self.index = index
        self._answered = False  # set under _lock by whoever reads the answer
        self._inputs: dict[str, TensorDesc] = {}
        self._seq = 0
        self._error: DuomoError | None = None
        self._in_flight = False
        self._release_when_done = False
        self._deadline_s: float | None = None
        self._lock = threading.Lock()  # in-flight state: the caller's thread vs the reader's
        self._held = False
        self.on_done: Callable[[Slot], None] | None = None

    def _take(self) -> None:
        self._held = True
        self._inputs = {}
        self._error = None
        self._answered = False
        self.on_done = None
        self._release_when_done = False

    def input(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A writable view of input ``name`` at ``shape``, inside the shared-memory slot."""
        areas = self.handle.layout.inputs
        index = next((i for i, a in enumerate(areas) if a.name == name), None)
        if index is None:
            raise InvalidArgumentError(f"{self.handle.name!r} has no input {name!r}")
        area = areas[index]
        dtype = np.dtype(area.dtype)
        shape = tuple(int(d) for d in shape)
        gray = name == "image" and len(shape) == 2 and len(area.shape) == 3
        if gray:  # a grayscale frame travels as H×W×1
            shape = (*shape, 1)
        view = self.handle.ring.input_view(self.index, index, dtype, shape)
        self._inputs[name] = TensorDesc(dtype_code(dtype), shape)
        return view[:, :, 0] if gray else view

    def write(self, data: Any) -> None:
        """Copy an image (uint8 H×W×C or H×W) or a dict of arrays into the slot's inputs."""
        areas = self.handle.layout.inputs
        if isinstance(data, np.ndarray):
            if len(areas) != 1:
                raise InvalidArgumentError(f"{self.handle.name!r} takes {len(areas)} inputs")
            data = {areas[0].name: data}
        if not isinstance(data, dict):
            raise InvalidArgumentError("expected a numpy array or a dict of arrays")
        for name, array in data.items():
            array = np.asarray(array)
            area = next((a for a in areas if a.name == name), None)
            if area is None:
                raise InvalidArgumentError(f"{self.handle.name!r} has no input {name!r}")
            if array.dtype != np.dtype(area.dtype):
                raise InvalidArgumentError(
                    f"input {name!r} must be {area.dtype}, got {array.dtype}"
                )
            if array.nbytes > area.capacity:
                raise InvalidArgumentError(
                    f"input {name!r} of {array.nbytes} bytes exceeds the slot's {area.capacity}"
                )
            self.input(name, array.shape)[...] = array

    def submit(self, timeout_s: float | None = None, priority: int = 0) -> None:
        """Hand the slot to the supervisor ("slot ready")."""
        if self._in_flight:
            raise InvalidArgumentError("slot already submitted")
        descs = [self._inputs[a.name] for a in self.handle.layout.inputs if a.name in self._inputs]
        if len(descs) != len(self.handle.layout.inputs):
            missing = [a.name for a in self.handle.layout.inputs if a.name not in self._inputs]
            raise InvalidArgumentError(f"inputs not written: {missing}")
        self._seq = next(self.handle._seq) & 0xFFFFFFFF
        SlotHeader(
            seq=self._seq,
            state=SlotState.SUBMITTED,
            priority=priority,
            timeout_us=int(timeout_s * 1e6) if timeout_s else 0,
            inputs=descs,
        ).pack_into(self.handle.ring.header(self.index))
        self._deadline_s = time.monotonic() + timeout_s + NOTICE_GRACE_S if timeout_s else None
        with self._lock:
            self._answered = False
            self._error = None
            self._in_flight = True
        try:
            self.handle.client._send(notice_frame(self.handle.ring_id, self.index, self._seq))
        except BaseException:
            self._in_flight = False
            raise

    def _done(self, seq: int | None, error: DuomoError | None, force: bool = False) -> None:
        with self._lock:
            if not self._in_flight and not force:
                return
            if seq is not None and seq != self._seq:
                return  # a stale notice for an earlier use of this slot
            was_in_flight = self._in_flight
            self._error = error
            self._answered = True
            self._in_flight = False
            callback, self.on_done = self.on_done, None
            release = self._release_when_done and was_in_flight
        if callback is not None:
            try:
                callback(self)
            except Exception:  # a user's callback must not break the connection for everyone
                log.exception("slot callback failed")
        elif release:
            self.handle._release(self.index)

    def answered(self) -> bool:
        return self._answered

    def wait(self, timeout_s: float | None = None, copy: bool = False) -> Any:
        """The result: a dict for structured tasks, ``{output: array}`` for raw models.

        Raw arrays are views into the slot, valid until it is released, unless ``copy``.
        """
        if timeout_s is None and self._deadline_s is not None:
            timeout_s = max(0.0, self._deadline_s - time.monotonic())
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.handle.client.wait_until(self.answered, deadline)
        if not self._answered:
            if self.handle.client._closed is not None:
                raise UnavailableError(f"lost the supervisor: {self.handle.client._closed}")
            raise DeadlineExceededError(f"no answer from {self.handle.name!r} in time")
        if self._error is not None:
            raise self._error
        seq, state, status, result_len, timings = unpack_done(self.handle.ring.header(self.index))
        area = self.handle.ring.output(self.index)
        if seq != self._seq or state != SlotState.DONE:
            raise UnavailableError("the slot was not answered (stale or corrupt header)")
        used = min(result_len, len(area))
        if status != ErrorCode.OK:
            message = bytes(area[:used]).decode("utf-8", "replace")
            area.release()  # a traceback kept by the caller must not pin the mapping
            raise error_for(status, message)
        self.timings_us = dict(zip(("queue", "preprocess", "infer", "postprocess"), timings))
        if self.handle.layout.result == "json":
            blob = bytes(area[:used])
            area.release()
            return json.loads(blob)
        names = self.handle.layout.outputs
        arrays = read_tensors(area, len(names), used)
        return {n: (a.copy() if copy else a) for n, a in zip(names, arrays)}

    def release(self) -> None:
        """Give the slot back (once); if still in flight it returns when answered."""
        with self._lock:
            if not self._held:
                return
            self._held = False
            if self._in_flight:
                self._release_when_done = True
                return
        self.handle._release(self.index)

    def __enter__(self) -> Slot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
