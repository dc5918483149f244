"""An attached model's slots: the pool that hands them out across the rings it maps, and each
slot's life.

``SlotPool`` (one behind each ``ipc.handle.ModelHandle``) owns the handle's rings — the
current one and any being retired — and their free slots: it hands a free slot out
(``take``), takes it back (``give_back``), re-attaches once a reload changed the model's
layout, grows the ring for a larger frame, and answers its slots when the link routes a
ring's notice to it (``answer``: the pool is the link's ``ipc.link.RingOwner``). A ``Slot`` is
written in place, submitted, waited for and released; it uses only the pool's public methods,
and the pool, in this module, is the one that sets a slot's private state (taken, moved,
answered). What both need of the connection is ``HandleLink``, which ``ipc.link.ClientLink``
implements with its own public methods: sending a frame, waiting through the link's reading
(``HandleLink.wait_for``, so nothing here reads the socket or spins), attaching and routing
rings. This module imports neither the link, the handle nor the client.

A frame larger than the ring's area for it grows the ring, make-before-break: the pool asks
the supervisor for a new ring whose area holds the frame (``attach`` with ``inputs``: input
name -> bytes), moves the slot being written (and what it already holds) into it, and hands out
only the new ring's slots from then on; the old ring is detached once its last slot in flight
has been answered and released. Nothing waits for other slots, so this works the same under
``infer_async`` and on an event loop that is the client's reader (the gateway's). The larger
ring is kept (and charged against the client's limits on ring memory) until the handle closes.

Invariants: a slot is held by at most one caller, and in flight at most once; a ring is routed
to its pool before any of its slots can be taken, and unmapped only once none of its slots is
held or in flight (or the connection is gone); one ring change (re-attach, growth, trim) at a
time.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple, Protocol

import numpy as np
import orjson

from duomo.ipc.errors import (
    DeadlineExceededError,
    DuomoError,
    InvalidArgumentError,
    ModelChangedError,
    UnavailableError,
    error_for,
)
from duomo.ipc.framing import notice_packer
from duomo.ipc.ring import InputArea, RingLayout, SlotRing, TensorPlacement, read_tensors
from duomo.ipc.wire import (
    DESCRIPTORS,
    MAX_SOURCE_COUNT,
    MAX_TIMEOUT_US,
    SlotState,
    TensorDesc,
    dtype_code,
    pack_descriptors,
    request_packer,
    stream_packer,
    unpack_done,
)

_DONE = int(SlotState.DONE)
PLAIN = (0, 0, 0, 0, 0, 0)  # the stream block of a plain request
STAGES = ("queue", "preprocess", "infer", "postprocess")  # an answer's stage timings, in order
PRIORITY_MIN, PRIORITY_MAX = -(1 << 15), (1 << 15) - 1  # the header's field (the supervisor
# clamps to the range a config may use)
NOTICE_GRACE_S = 5.0  # how long past its own deadline a request waits for the supervisor
log = logging.getLogger("duomo.client")


class HandleLink(Protocol):
    """What a model handle, its pool and its slots need of the connection they were attached
    through (``ipc.link.ClientLink`` is one); none of this is the producer's API."""

    def lost(self) -> BaseException | None:
        """Why the connection ended (None while it is open)."""
        ...

    def send_frame(self, data: bytes) -> None:
        """Send one whole frame (a notice); ``UnavailableError`` once the connection is lost."""
        ...

    def wait_for(
        self, done: Callable[[], bool], deadline: float | None, by_frame: bool = False
    ) -> None:
        """Return once ``done()`` holds, the monotonic ``deadline`` passes (None: never) or the
        connection is lost, reading the socket meanwhile if no other thread does; ``by_frame``:
        only a frame from the supervisor can make ``done()`` hold."""
        ...

    def request(self, op: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """One control round trip (``Client.request``)."""
        ...

    def attach_ring(
        self, name: str, slots: int, inputs: dict[str, int] | None = None
    ) -> tuple[int, SlotRing]:
        """Attach a new ring of ``slots`` slots for model ``name`` and map it; ``inputs``:
        input -> the bytes its area must hold, past the model's default."""
        ...

    def route_ring(self, owner: SlotPool, ring_id: int, old_ring: int | None = None) -> None:
        """Route ring ``ring_id``'s answers to ``owner`` (instead of ring ``old_ring``'s)."""
        ...

    def unroute_rings(self, ring_ids: Iterable[int]) -> None:
        """Route nothing more from these rings (their handle closes)."""
        ...

    def detach_ring_later(self, ring_id: int) -> None:
        """Detach ring ``ring_id`` without waiting for the reply (any thread)."""
        ...

    def wake_waiters(self) -> None:
        """Let every thread waiting in ``wait_for`` check again what it waits for."""
        ...

    def async_started(self) -> None:
        """A request answered on the reading thread (``infer_async``) is outstanding: someone
        must read while nobody waits."""
        ...

    def async_finished(self) -> None:
        """A request counted by ``async_started`` was answered."""
        ...


class RingInput(NamedTuple):
    """One input of the current ring as a slot writes it (looked up on every request)."""

    position: int  # in the layout's inputs
    area: InputArea
    dtype: np.dtype[Any]
    code: int  # the dtype's wire code


@dataclass
class _Retiring:
    """A ring replaced by a larger one, mapped until the last of its slots is back."""

    ring_id: int
    ring: SlotRing
    slots: list[Slot]
    out: int  # its slots still in flight or held


class SlotPool:
    """The slots of one attached model, across the rings it maps (see the module docstring).

    Made by ``ipc.handle.ModelHandle`` around the ring its client attached; shared by the
    handle's threads and the link's reading thread (``answer``, ``fail_all``).

    Attributes:
        handle: The ``ipc.handle.ModelHandle`` it serves (each slot's ``handle``).
        link: The connection (``HandleLink``).
        name: The model's name.
        ring_id: The current ring's id on the connection.
        ring: The current ring's mapping.
        layout: The current ring's layout.
        inputs: The current ring's inputs by name, in the model's order.
    """

    def __init__(
        self, handle: Any, link: HandleLink, name: str, ring_id: int, ring: SlotRing
    ) -> None:
        self.handle = handle  # (``ipc.handle`` imports this module, not the other way)
        self.link = link
        self.name = name
        self._free_lock = threading.Lock()
        self._reattach_lock = threading.Lock()  # one ring change (re-attach, growth) at a time
        self._stale = False  # set by a MODEL_CHANGED answer: re-attach once the slots are back
        self._seq = itertools.count(1)
        self._grown: dict[str, int] = {}  # input -> bytes the ring was last grown to hold
        self._retiring: dict[int, _Retiring] = {}  # by ring id; read by the link's reader
        link.route_ring(self, ring_id)  # (before a slot of it can be taken)
        self._bind(ring_id, ring)

    def _bind(self, ring_id: int, ring: SlotRing) -> None:
        self.ring_id = ring_id
        self.ring = ring
        self.layout: RingLayout = ring.layout
        self.inputs = {
            a.name: RingInput(i, a, np.dtype(a.dtype), dtype_code(np.dtype(a.dtype)))
            for i, a in enumerate(self.layout.inputs)
        }
        self._slots = [Slot(self, i) for i in range(self.layout.slots)]
        self._free = list(range(self.layout.slots))

    # -- what the link routes here ----------------------------------------------------------

    def answer(
        self, ring_id: int, index: int, seq: int | None, error: DuomoError | None = None
    ) -> bool:
        """Slot ``index`` of ring ``ring_id`` (the current one or one retiring) is answered:
        ``seq``, or None with the error the supervisor gave for it. Whether ``index`` names a
        slot of a ring of this model's (else the answer is no slot's)."""
        if ring_id == self.ring_id:
            slots = self._slots
        else:
            retiring = self._retiring.get(ring_id)
            slots = retiring.slots if retiring is not None else []
        if 0 <= index < len(slots) and slots[index].ring_id == ring_id:  # (not one moved on)
            slots[index]._done(seq, error)
        return 0 <= index < self.layout.slots

    def fail_all(self, error: DuomoError) -> None:
        """Answer every slot ``error``, in flight or not (the connection is lost, or the handle
        closes), and wake its waiters."""
        with self._free_lock:
            slots = [*self._slots, *(s for r in self._retiring.values() for s in r.slots)]
        for slot in slots:
            slot._done(None, error, force=True)
        self.link.wake_waiters()

    def unmap(self) -> None:
        """Unmap every ring (a view still held keeps its ring mapped until it goes)."""
        with self._free_lock:
            retiring = list(self._retiring.values())
            self._retiring.clear()
        for old in retiring:
            for slot in old.slots:
                if slot.ring_id == old.ring_id:
                    slot._forget_views()
            old.ring.close()
        for slot in self._slots:
            slot._forget_views()
        self.ring.close()

    # -- handing slots out and taking them back ---------------------------------------------

    def take(self, timeout_s: float | None) -> Slot:
        """A free slot, as ``ModelHandle.slot`` documents it (re-attaching first once the
        model's layout changed and every slot is back)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        link = self.link
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
            if link.lost() is not None:
                raise UnavailableError("connection to the supervisor is closed")
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(f"no free slot for {self.name!r} in {timeout_s}s")
            link.wait_for(self._slot_or_reattach, deadline)

    def _slot_or_reattach(self) -> bool:
        if self.link.lost() is not None:
            return True
        if self._stale:
            return len(self._free) == len(self._slots)
        return bool(self._free)

    def give_back(self, slot: Slot) -> None:
        """``slot`` is free again (released, and answered if it was in flight); the last of a
        retiring ring's slots retires it."""
        retired = None
        with self._free_lock:
            if slot.ring_id == self.ring_id:
                self._free.append(slot.index)
            else:
                retired = self._back(slot.ring_id)
        if retired is not None:
            self._retire(retired)
        self.link.wake_waiters()

    def next_seq(self) -> int:
        """The sequence number of the next request submitted (32 bits, wrapping)."""
        return next(self._seq) & 0xFFFFFFFF

    def mark_stale(self) -> None:
        """A request answered MODEL_CHANGED: re-attach once every slot is back."""
        self._stale = True

    def _reattach(self) -> None:
        """Swap the ring for one with the model's new layout (no slot of the old is held)."""
        with self._reattach_lock:
            if not self._stale:
                return  # another thread did it
            old_id, old_ring, old_slots = self.ring_id, self.ring, self._slots
            with contextlib.suppress(DuomoError):
                self.link.request("detach", ring=old_id)
            ring_id, ring = self.link.attach_ring(self.name, self.layout.slots)  # (not grown)
            self._grown = {}
            for slot in old_slots:
                slot._forget_views()
            old_ring.close()
            self.link.route_ring(self, ring_id, old_ring=old_id)  # before a slot can be taken
            with self._free_lock:
                self._bind(ring_id, ring)
                self._stale = False
            log.info("re-attached %r after its layout changed (ring %d)", self.name, ring_id)

    # -- growth: a larger ring for a larger frame -------------------------------------------

    def grow(self, slot: Slot, needs: Mapping[str, int]) -> None:
        """Move ``slot`` (held, not in flight) to a ring whose input areas hold ``needs``
        (input -> bytes), attaching a larger one first unless the current ring holds them.
        INVALID_ARGUMENT for an area of fixed size, RESOURCE_EXHAUSTED with no room."""
        with self._reattach_lock:
            capacity = {a.name: a.capacity for a in self.layout.inputs}
            larger = {n: b for n, b in needs.items() if b > capacity.get(n, 0)}
            if larger:
                ring_id = self._swap_ring({**self._grown, **larger})
                log.info("grew the ring of %r for %s bytes (ring %d)", self.name, larger, ring_id)
        if slot.ring_id != self.ring_id:
            self._move(slot, skip=needs.keys())

    def _swap_ring(self, grown: dict[str, int]) -> int:
        """(Under ``_reattach_lock``) Attach a ring whose input areas hold ``grown`` (input ->
        bytes; none: the model's default) and make it the current one; the old ring retires
        once its slots in flight are back. The new ring's id."""
        ring_id, ring = self.link.attach_ring(self.name, self.layout.slots, grown)
        old = _Retiring(self.ring_id, self.ring, self._slots, 0)
        with self._free_lock:
            old.out = len(old.slots) - len(self._free)
            self._retiring[old.ring_id] = old  # first: its answers still find its slots
            self.link.route_ring(self, ring_id)
            self._bind(ring_id, ring)
            self._grown = grown
            retired = self._back(old.ring_id, count=0)
        if retired is not None:
            self._retire(retired)
        return ring_id

    def trim(self) -> int:
        """Give back what a burst of large frames left behind, as ``ModelHandle.trim``
        documents it: the bytes of input area released."""
        with self._reattach_lock:
            if self._grown and not self._stale:
                ring_id = self._swap_ring({})
                log.info("gave back the grown ring of %r (ring %d)", self.name, ring_id)
            with self._free_lock:
                return sum(self.ring.discard_inputs(index) for index in self._free)

    def _move(self, slot: Slot, skip: Iterable[str]) -> None:
        """Move held ``slot`` to a free slot of the current ring, with the inputs written into
        it so far (but those in ``skip``, about to be written again)."""
        link = self.link
        while True:
            with self._free_lock:
                index = self._free.pop() if self._free else None
            if index is not None:
                break
            if link.lost() is not None:
                raise UnavailableError("connection to the supervisor is closed")
            link.wait_for(lambda: bool(self._free) or link.lost() is not None, None)
        old_ring, skipped = slot.ring_id, set(skip)
        carried = [(n, *slot._views[n][:2]) for n in slot._inputs if n not in skipped]
        slot._forget_views()
        slot._bind_ring(index)
        for name, shape, data in carried:
            slot.input(name, shape)[...] = data
        del carried
        with self._free_lock:
            self._slots[index] = slot
            retired = self._back(old_ring)
        if retired is not None:
            self._retire(retired)

    def _back(self, ring_id: int, count: int = 1) -> _Retiring | None:
        """(Under ``_free_lock``) ``count`` more slots of retiring ring ``ring_id`` are back;
        the ring, taken off the list, once all are."""
        retiring = self._retiring.get(ring_id)
        if retiring is None:
            return None
        retiring.out -= count
        if retiring.out > 0:
            return None
        del self._retiring[ring_id]
        return retiring

    def _retire(self, retiring: _Retiring) -> None:
        """Detach and unmap a replaced ring whose slots are all back (any thread: nothing
        waits for the supervisor's reply)."""
        self.link.detach_ring_later(retiring.ring_id)
        for slot in retiring.slots:
            if slot.ring_id == retiring.ring_id:  # (not one moved to a later ring)
                slot._forget_views()
        retiring.ring.close()

    def close(self) -> None:
        """Detach every ring and unmap it, as ``ModelHandle.close`` documents it."""
        rings = [self.ring_id, *list(self._retiring)]
        for ring_id in rings:
            with contextlib.suppress(DuomoError):
                self.link.request("detach", ring=ring_id)
        self.link.unroute_rings(rings)
        self.fail_all(UnavailableError(f"{self.name!r} was detached"))
        self.unmap()


class Slot:
    """One request slot of a ring: write the inputs in place, submit, wait, read the result.

    Taken from ``ModelHandle.slot`` and held until ``release`` (or the end of its ``with``).
    Its inputs are numpy views into shared memory, so a producer that decodes into them
    copies nothing; a raw model's result arrays are views into the slot as well, valid until
    it is released. A slot is used by one thread at a time; its answer may arrive on another
    (``on_done``).

    Example:
        with model.slot() as s:
            s.input("image", frame.shape)[...] = frame  # or s.write(frame)
            s.submit(timeout_s=0.2)
            result = s.wait()  # views into the slot, valid inside the ``with``

    Attributes:
        handle: The model handle it belongs to.
        index: Its index in the handle's current ring.
        on_done: Called with the slot, on the client's reading thread, once it is answered
            (``infer_async`` uses it); set after taking the slot, before ``submit``.
    """

    def __init__(self, pool: SlotPool, index: int) -> None:
        self.handle = pool.handle
        self._pool = pool
        self._link = pool.link
        self._answered = False  # set under _lock by whoever reads the answer
        self._json = pool.layout.result == "json"  # else raw output tensors
        self._seq = 0
        self._error: DuomoError | None = None
        self._in_flight = False
        self._release_when_done = False
        self._deadline_s: float | None = None
        self._timings: list[int] = [0, 0, 0, 0]
        self._lock = threading.Lock()  # in-flight state: the caller's thread vs the reader's
        self._held = False
        self.on_done: Callable[[Slot], None] | None = None
        self._stream_block = PLAIN
        self._bind_ring(index)

    def _bind_ring(self, index: int) -> None:
        """Be slot ``index`` of the handle's current ring (a slot moves when its ring grows)."""
        ring = self._pool.ring
        self.index = index
        self.ring_id = self._pool.ring_id
        self._ring = ring
        self._inputs: dict[str, TensorDesc] = {}  # written since the slot was taken
        # name -> (shape asked for, view, descriptor) of the last input() call: a producer that
        # sends the same shapes again gets the same view back, and the same header block
        self._views: dict[str, tuple[Any, np.ndarray, TensorDesc]] = {}
        self._descriptors: tuple[int, bytes] | None = None  # packed for the cached views
        self._header = ring.header(index)
        self._output = ring.output(index)
        self._notice = notice_packer(self.ring_id, index)
        self._pack_request = request_packer(self._header)
        self._pack_stream = stream_packer(self._header)
        self._result: TensorPlacement | None = None  # the last answer's records and views

    def _take(self) -> None:
        self._held = True
        self._stream_block = PLAIN
        self._inputs = {}
        self._error = None
        self._answered = False
        self.on_done = None
        self._release_when_done = False

    def input(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A writable view of input ``name`` at ``shape``, inside the shared-memory slot.

        The same shape again gives the same view back. If the slot's area is too small for
        ``shape`` the ring grows first (one ``attach`` round trip, and this slot moves to the
        new ring with what it holds).

        Args:
            name: One of the model's inputs.
            shape: The tensor's shape; for an ``image`` input of rank 3, an H×W shape is a
                grayscale frame (stored H×W×1).

        Returns:
            The view, of the input's dtype, to write into.

        Raises:
            InvalidArgumentError: The model has no input ``name``, its area has a fixed
                size that ``shape`` exceeds, or ``shape`` is past the bound the model states
                (an image task's frame: 16384 pixels a side).
            ResourceExhaustedError: The supervisor's limits on ring memory leave no room to
                grow the ring.
        """
        cached = self._views.get(name)
        if cached is not None and cached[0] == shape:
            self._inputs[name] = cached[2]
            return cached[1]
        try:
            index, area, dtype, code = self._pool.inputs[name]
        except KeyError:
            raise InvalidArgumentError(f"{self._pool.name!r} has no input {name!r}") from None
        asked = shape
        shape = tuple(map(int, shape))
        gray = len(shape) == 2 and name == "image" and len(area.shape) == 3
        if gray:  # a grayscale frame travels as H×W×1
            shape = (*shape, 1)
        if area.bound is not None:  # (before the ring grows for a frame it can never serve)
            area.check(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self._ring.layout.inputs[index].capacity:
            self._pool.grow(self, {name: nbytes})
            index = self._pool.inputs[name].position
        view = self._ring.input_view(self.index, index, dtype, shape)
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
        """Copy an image or a dict of arrays into the slot's inputs (the ring grows first,
        once, if they do not fit: see ``input``).

        Args:
            data: A numpy array for a one-input model (an image: uint8 H×W×C or H×W), or a
                dict of arrays by input name.

        Raises:
            InvalidArgumentError: Not an array or a dict, an unknown input, a wrong dtype,
                or an array for a model of several inputs.
            ResourceExhaustedError: No room to grow the ring.
        """
        areas = self._pool.layout.inputs
        items: Iterable[tuple[str, Any]]
        if isinstance(data, np.ndarray):
            if len(areas) != 1:
                raise InvalidArgumentError(f"{self._pool.name!r} takes {len(areas)} inputs")
            items = ((areas[0].name, data),)
        elif isinstance(data, dict):
            items = data.items()
        else:
            raise InvalidArgumentError("expected a numpy array or a dict of arrays")
        arrays = []
        needs = {}
        capacities = self._ring.layout.inputs
        for name, array in items:
            array = np.asarray(array)
            known = self._pool.inputs.get(name)
            if known is None:
                raise InvalidArgumentError(f"{self._pool.name!r} has no input {name!r}")
            index, area, dtype, _ = known
            if array.dtype != dtype:
                raise InvalidArgumentError(
                    f"input {name!r} must be {area.dtype}, got {array.dtype}"
                )
            if array.nbytes > capacities[index].capacity:
                needs[name] = array.nbytes
            arrays.append((name, array))
        if needs:
            self._pool.grow(self, needs)
        for name, array in arrays:
            self.input(name, array.shape)[...] = array

    def set_stream(
        self,
        stream_id: int,
        frame: int,
        captured_us: int,
        superseded_before: int = 0,
        refused_before: int = 0,
        skipped_before: int = 0,
    ) -> None:
        """Make the next ``submit`` a frame of stream ``stream_id`` (``Client.open_stream``):
        its frame number, its capture time in µs on ``CLOCK_MONOTONIC`` (``time.monotonic``),
        and what the source did with the frames since its last one sent to this model: how
        many it superseded, refused and skipped (the supervisor counts them in the stream's
        figures). A slot taken afresh is a plain request until this is called; ``Stream``
        calls it for you.

        Args:
            stream_id: The id ``Client.open_stream`` returned (0: a plain request).
            frame: The frame number, 0..2**64-1.
            captured_us: When the frame was captured, µs on the monotonic clock.
            superseded_before: Frames a newer one replaced at the source (``latest``) since
                the last one sent, 0..2**32-1.
            refused_before: Frames the source refused (``fifo``'s backlog full) since the last
                one sent, 0..2**32-1.
            skipped_before: Frames the source's caps dropped (``max_fps``, ``every``) since
                the last one sent, 0..2**32-1.

        Raises:
            InvalidArgumentError: A value out of its field's range.
        """
        counts = (superseded_before, refused_before, skipped_before)
        if not (
            0 <= stream_id <= 0xFFFFFFFF
            and all(0 <= count <= MAX_SOURCE_COUNT for count in counts)
            and 0 <= frame < 1 << 64
            and 0 <= captured_us < 1 << 64
        ):
            raise InvalidArgumentError(
                f"stream block out of range: stream {stream_id}, frame {frame}, captured "
                f"{captured_us} µs, superseded {superseded_before}, refused {refused_before}, "
                f"skipped {skipped_before}"
            )
        self._stream_block = (stream_id, *counts, frame, captured_us)

    def submit(self, timeout_s: float | None = None, priority: int = 0) -> None:
        """Hand the slot to the supervisor ("slot ready"): writes its header and sends one
        8-byte notice; it does not wait for the answer (``wait``).

        Args:
            timeout_s: The request's deadline in the supervisor, in seconds, in (0, 86400];
                None or 0: none.
            priority: In -32768..32767 (the supervisor clamps it to -1000..1000).

        Raises:
            InvalidArgumentError: The slot is in flight already, an input is not written, or
                ``timeout_s`` or ``priority`` is out of range.
            UnavailableError: The connection is closed or lost.
        """
        if self._in_flight:
            raise InvalidArgumentError("slot already submitted")
        written = self._inputs
        inputs = self._pool.inputs
        if len(written) != len(inputs):
            missing = [name for name in inputs if name not in written]
            raise InvalidArgumentError(f"inputs not written: {missing}")
        descriptors = self._descriptors
        if descriptors is None:
            descriptors = pack_descriptors(written[n] for n in inputs)
            self._descriptors = descriptors
        if timeout_s and not 0 < timeout_s <= MAX_TIMEOUT_US / 1e6:  # (NaN fails too)
            raise InvalidArgumentError(
                f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_US // 10**6}], "
                f"not {timeout_s!r}"
            )
        if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise InvalidArgumentError(
                f"priority must be an integer in {PRIORITY_MIN}..{PRIORITY_MAX}, not {priority!r}"
            )
        self._seq = self._pool.next_seq()
        timeout_us = int(timeout_s * 1e6) if timeout_s else 0
        count, block = descriptors
        self._header[DESCRIPTORS] = block
        self._pack_stream(*self._stream_block)
        self._pack_request(self._seq, priority, count, timeout_us)
        self._deadline_s = time.monotonic() + timeout_s + NOTICE_GRACE_S if timeout_s else None
        with self._lock:
            self._answered = False
            self._error = None
            self._in_flight = True
        try:
            self._link.send_frame(self._notice(self._seq))
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
            self._pool.give_back(self)

    def answered(self) -> bool:
        """Whether the submitted request has its answer (then ``wait`` returns at once)."""
        return self._answered

    @property
    def timings_us(self) -> dict[str, int]:
        """The supervisor's stage times for the last answer ``wait`` returned, in µs by name
        (``queue``, ``preprocess``, ``infer``, ``postprocess``)."""
        return dict(zip(STAGES, self._timings))

    def wait(self, timeout_s: float | None = None, copy: bool = False) -> Any:
        """The submitted request's result, once it is answered.

        Blocks until the answer arrives (reading the socket while no other thread does): for
        at most ``timeout_s`` if given; else until the request's own deadline plus
        ``NOTICE_GRACE_S`` (5 s) when it was submitted with a ``timeout_s``, and without
        bound when it was not. ``timeout_s=0`` never waits.

        Args:
            timeout_s: The longest wait, in seconds; None: as above.
            copy: Copy a raw model's arrays out of the slot.

        Returns:
            A dict for structured tasks; ``{output: array}`` for raw models, whose arrays are
            views into the slot, valid until it is released, unless ``copy``.

        Raises:
            DeadlineExceededError: No answer in time, or the supervisor answered
                DEADLINE_EXCEEDED (the deadline passed while it was queued).
            UnavailableError: The connection was lost, or the slot's answer is stale or
                corrupt.
            DuomoError: The error the supervisor answered, as its typed subclass
                (``InvalidArgumentError``, ``ResourceExhaustedError``, ``ModelChangedError``,
                ``InternalError``, …).
        """
        if not self._answered:
            # without a timeout here, the request's own deadline (with its grace), if it has one
            deadline = self._deadline_s if timeout_s is None else time.monotonic() + timeout_s
            self._link.wait_for(self.answered, deadline, by_frame=True)
        if not self._answered:
            lost = self._link.lost()
            if lost is not None:
                raise UnavailableError(f"lost the supervisor: {lost}")
            raise DeadlineExceededError(f"no answer from {self._pool.name!r} in time")
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
        names = self._pool.layout.outputs
        result = self._result
        if result is None or not result.describes(area, used):
            result = self._result = read_tensors(area, len(names), used)
        return {n: (a.copy() if copy else a) for n, a in zip(names, result.views)}

    def _failed(self, error: DuomoError) -> DuomoError:
        if isinstance(error, ModelChangedError):
            self._pool.mark_stale()  # the pool re-attaches once its slots are back
        return error

    def release(self) -> None:
        """Give the slot back to its handle (a second call does nothing); a slot still in
        flight returns once it is answered. Never blocks."""
        with self._lock:
            if not self._held:
                return
            self._held = False
            if self._in_flight:
                self._release_when_done = True
                return
        self._pool.give_back(self)

    def __enter__(self) -> Slot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
