"""The producer's side of one attached model: its ring of slots and each slot's life.

``ModelHandle`` (what ``Client.model`` returns) hands out free slots, runs ``infer`` and
``infer_async``; a ``Slot`` is written in place, submitted, waited for and released. Every wait
goes through the owning ``Client``'s reading (``Client.wait_until``), so nothing here reads the
socket or spins. Imported by ``ipc.client``; producers use both through ``ipc.client``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from ipc.errors import (
    DeadlineExceededError,
    DuomoError,
    InvalidArgumentError,
    ModelChangedError,
    UnavailableError,
    error_for,
)
from ipc.framing import notice_packer
from ipc.ring import SlotRing, TensorPlacement, read_tensors
from ipc.wire import (
    DESCRIPTORS,
    SlotState,
    TensorDesc,
    dtype_code,
    pack_descriptors,
    request_packer,
    unpack_done,
)

if TYPE_CHECKING:
    from ipc.client import Client

_DONE = int(SlotState.DONE)
STAGES = ("queue", "preprocess", "infer", "postprocess")  # an answer's stage timings, in order
NOTICE_GRACE_S = 5.0  # how long past its own deadline a request waits for the supervisor
log = logging.getLogger("duomo.client")


class ModelHandle:
    """One attached model: a ring of slots in shared memory.

    When a reload changes the model's inputs or outputs, requests answer MODEL_CHANGED
    (``ModelChangedError``); the handle then re-attaches by itself as soon as all its slots are
    back (the next ``slot()`` does it), and ``infer`` retries its request once on the new ring.
    """

    def __init__(self, client: Client, name: str, ring_id: int, ring: SlotRing) -> None:
        self.client = client
        self.name = name
        self._free_lock = threading.Lock()
        self._reattach_lock = threading.Lock()
        self._stale = False  # set by a MODEL_CHANGED answer: re-attach once the slots are back
        self._seq = itertools.count(1)
        client._register(self, ring_id)
        self._bind(ring_id, ring)

    def _bind(self, ring_id: int, ring: SlotRing) -> None:
        self.ring_id = ring_id
        self.ring = ring
        self.layout = ring.layout
        # name -> (index, area, dtype, wire code): looked up on every request
        self._inputs = {
            a.name: (i, a, np.dtype(a.dtype), dtype_code(np.dtype(a.dtype)))
            for i, a in enumerate(self.layout.inputs)
        }
        self._slots = [Slot(self, i) for i in range(self.layout.slots)]
        self._free = list(range(self.layout.slots))

    def slot(self, timeout_s: float | None = None) -> Slot:
        """A free slot (blocks until one is free); release it with ``with`` or ``release()``.

        While every slot is in flight the caller reads the socket like any waiter, so answers
        that free a slot arrive even when nobody else is waiting.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        client = self.client
        while True:
            with self._free_lock:
                if self._free and not self._stale:
                    slot = self._slots[self._free.pop()]
                    slot._take()
                    return slot
                all_back = len(self._free) == len(self._slots)
            if self._stale and all_back:
                self._reattach()
                continue
            if client._closed is not None:
                raise UnavailableError("connection to the supervisor is closed")
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(f"no free slot for {self.name!r} in {timeout_s}s")
            client.wait_until(self._slot_or_reattach, deadline)

    def _slot_or_reattach(self) -> bool:
        if self.client._closed is not None:
            return True
        if self._stale:
            return len(self._free) == len(self._slots)
        return bool(self._free)

    def _reattach(self) -> None:
        """Swap the ring for one with the model's new layout (no slot of the old is held)."""
        with self._reattach_lock:
            if not self._stale:
                return  # another thread did it
            old_id, old_ring, old_slots = self.ring_id, self.ring, self._slots
            with contextlib.suppress(DuomoError):
                self.client.request("detach", ring=old_id)
            ring_id, ring = self.client._attach(self.name, self.layout.slots)
            for slot in old_slots:
                slot._forget_views()
            old_ring.close()
            self.client._register(self, ring_id, old_ring=old_id)  # before a slot can be taken
            with self._free_lock:
                self._bind(ring_id, ring)
                self._stale = False
            log.info("re-attached %r after its layout changed (ring %d)", self.name, ring_id)

    def _release(self, index: int) -> None:
        with self._free_lock:
            self._free.append(index)
        self.client._wake_waiters()

    def infer(self, data: Any, timeout_s: float | None = None, priority: int = 0) -> Any:
        """Run one request; the result dict (tensors are copied out of the slot). A request
        answered MODEL_CHANGED is sent again once, after the handle re-attached."""
        return self._infer(data, timeout_s, priority)[0]

    def infer_timed(
        self, data: Any, timeout_s: float | None = None, priority: int = 0
    ) -> tuple[Any, dict[str, int]]:
        """``infer``, and the supervisor's stage times for its answer in µs (queue, then
        preprocess, infer and postprocess, which add up to its time in the executor)."""
        result, timings = self._infer(data, timeout_s, priority)
        return result, dict(zip(STAGES, timings))

    def _infer(self, data: Any, timeout_s: float | None, priority: int) -> tuple[Any, list[int]]:
        for retry in (False, True):
            slot = self.slot()
            try:  # (not ``with``: two calls fewer on every request)
                slot.write(data)
                slot.submit(timeout_s=timeout_s, priority=priority)
                return slot.wait(copy=True), slot._timings  # (read before the release)
            except ModelChangedError:
                if retry:
                    raise
            finally:
                slot.release()
        raise AssertionError("unreachable")

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
        self._unmap()

    def _unmap(self) -> None:
        for slot in self._slots:
            slot._forget_views()
        self.ring.close()

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
        self._inputs: dict[str, TensorDesc] = {}  # written since the slot was taken
        # name -> (shape asked for, view, descriptor) of the last input() call: a producer that
        # sends the same shapes again gets the same view back, and the same header block
        self._views: dict[str, tuple[Any, np.ndarray, TensorDesc]] = {}
        self._descriptors: tuple[int, bytes] | None = None  # packed for the cached views
        self._header = handle.ring.header(index)
        self._output = handle.ring.output(index)
        self._notice = notice_packer(handle.ring_id, index)
        self._pack_request = request_packer(self._header)
        self._json = handle.layout.result == "json"  # else raw output tensors
        self._result: TensorPlacement | None = None  # the last answer's records and views
        self._seq = 0
        self._error: DuomoError | None = None
        self._in_flight = False
        self._release_when_done = False
        self._deadline_s: float | None = None
        self._timings: list[int] = [0, 0, 0, 0]
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
        cached = self._views.get(name)
        if cached is not None and cached[0] == shape:
            self._inputs[name] = cached[2]
            return cached[1]
        try:
            index, area, dtype, code = self.handle._inputs[name]
        except KeyError:
            raise InvalidArgumentError(f"{self.handle.name!r} has no input {name!r}") from None
        asked = shape
        shape = tuple(map(int, shape))
        gray = len(shape) == 2 and name == "image" and len(area.shape) == 3
        if gray:  # a grayscale frame travels as H×W×1
            shape = (*shape, 1)
        view = self.handle.ring.input_view(self.index, index, dtype, shape)
        if gray:
            view = view[:, :, 0]
        desc = TensorDesc(code, shape)
        self._inputs[name] = desc
        self._views[name] = (tuple(asked), view, desc)
        self._descriptors = None
        return view

    def _forget_views(self) -> None:
        """Drop the cached views (before the ring is unmapped: they would pin the mapping)."""
        self._views.clear()
        self._descriptors = None
        self._result = None
        with contextlib.suppress(BufferError):  # the caller still holds result arrays
            self._header.release()
            self._output.release()

    def write(self, data: Any) -> None:
        """Copy an image (uint8 H×W×C or H×W) or a dict of arrays into the slot's inputs."""
        areas = self.handle.layout.inputs
        items: Iterable[tuple[str, Any]]
        if isinstance(data, np.ndarray):
            if len(areas) != 1:
                raise InvalidArgumentError(f"{self.handle.name!r} takes {len(areas)} inputs")
            items = ((areas[0].name, data),)
        elif isinstance(data, dict):
            items = data.items()
        else:
            raise InvalidArgumentError("expected a numpy array or a dict of arrays")
        for name, array in items:
            array = np.asarray(array)
            known = self.handle._inputs.get(name)
            if known is None:
                raise InvalidArgumentError(f"{self.handle.name!r} has no input {name!r}")
            _, area, dtype, _ = known
            if array.dtype != dtype:
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
        written = self._inputs
        if len(written) != len(self.handle._inputs):
            missing = [name for name in self.handle._inputs if name not in written]
            raise InvalidArgumentError(f"inputs not written: {missing}")
        descriptors = self._descriptors
        if descriptors is None:
            descriptors = pack_descriptors(written[n] for n in self.handle._inputs)
            self._descriptors = descriptors
        self._seq = next(self.handle._seq) & 0xFFFFFFFF
        timeout_us = int(timeout_s * 1e6) if timeout_s else 0
        count, block = descriptors
        self._header[DESCRIPTORS] = block
        self._pack_request(self._seq, priority, count, timeout_us)
        self._deadline_s = time.monotonic() + timeout_s + NOTICE_GRACE_S if timeout_s else None
        with self._lock:
            self._answered = False
            self._error = None
            self._in_flight = True
        try:
            self.handle.client._send(self._notice(self._seq))
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
        if release:  # released while in flight: it comes back now
            self.handle._release(self.index)

    def answered(self) -> bool:
        return self._answered

    @property
    def timings_us(self) -> dict[str, int]:
        """The supervisor's stage times for the last answer, in µs."""
        return dict(zip(STAGES, self._timings))

    def wait(self, timeout_s: float | None = None, copy: bool = False) -> Any:
        """The result: a dict for structured tasks, ``{output: array}`` for raw models.

        Raw arrays are views into the slot, valid until it is released, unless ``copy``.
        """
        if not self._answered:
            # without a timeout here, the request's own deadline (with its grace), if it has one
            deadline = self._deadline_s if timeout_s is None else time.monotonic() + timeout_s
            self.handle.client.wait_until(self.answered, deadline, by_frame=True)
        if not self._answered:
            if self.handle.client._closed is not None:
                raise UnavailableError(f"lost the supervisor: {self.handle.client._closed}")
            raise DeadlineExceededError(f"no answer from {self.handle.name!r} in time")
        if self._error is not None:
            raise self._failed(self._error)
        state, seq, status, result_len, *timings = unpack_done(self._header)
        area = self._output
        if seq != self._seq or state != _DONE:
            raise UnavailableError("the slot was not answered (stale or corrupt header)")
        if status:  # (ErrorCode.OK is 0)
            message = bytes(area[: min(result_len, len(area))]).decode("utf-8", "replace")
            raise self._failed(error_for(status, message))
        self._timings = timings
        if self._json:
            return orjson.loads(area[:result_len])
        used = min(result_len, len(area))
        names = self.handle.layout.outputs
        result = self._result
        if result is None or not result.describes(area, used):
            result = self._result = read_tensors(area, len(names), used)
        return {n: (a.copy() if copy else a) for n, a in zip(names, result.views)}

    def _failed(self, error: DuomoError) -> DuomoError:
        if isinstance(error, ModelChangedError):
            self.handle._stale = True  # the handle re-attaches once its slots are back
        return error

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
