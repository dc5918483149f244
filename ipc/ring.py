"""A ring of request slots in one shared-memory segment, as both sides see it.

The supervisor creates one ring per attached (client, model) with ``SlotRing.create``; the client
maps it with ``SlotRing.attach`` and the name is unlinked at once, so a crash on either side
leaves nothing in /dev/shm. Each slot is::

    [ header: 256 bytes | input areas (one per input, 64-byte aligned) | output area ]

The output area holds either a JSON result (``result == "json"``) or tensor records
(``result == "tensors"``: per output a ``TENSOR_RECORD`` then its data at the next 64-byte
boundary); on an error it holds the UTF-8 message. The header's ``result_len`` says how much.
An input area's capacity is the model's default unless the client asked for more when it
attached (``attach``'s ``inputs``: a producer's handle grows its ring for a larger frame).

A ring owns its ``mmap`` directly rather than through ``multiprocessing.shared_memory``:
``SharedMemory.__del__`` closes the mapping when the object is finalised, which raises (and
prints, at every producer's exit) ``BufferError: cannot close exported pointers exist`` while
numpy views into the slots are alive. Here the mapping is unmapped by ``close`` once nothing
views it, or simply outlives its views when a process exits without closing.

Only the creator registers a segment with the resource tracker (which unlinks what a dead
process left behind); the client maps and unlinks it without the tracker, so a producer starts
no tracker process at all.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from ipc.wire import ALIGN, DTYPES, HEADER_BYTES, MAX_RANK, TENSOR_RECORD, align, dtype_code

RESERVE_OUTPUT_LIMIT = 8 << 20  # output areas up to this size are committed at attach


@dataclass(frozen=True)
class InputArea:
    name: str
    dtype: str
    shape: tuple[int | None, ...]  # None: any size in that dimension
    offset: int  # from the start of the slot
    capacity: int  # bytes


@dataclass(frozen=True)
class RingLayout:
    slots: int
    inputs: tuple[InputArea, ...]
    output_offset: int
    output_capacity: int
    result: str  # "json" or "tensors"
    outputs: tuple[str, ...] = ()

    @functools.cached_property
    def slot_bytes(self) -> int:
        return align(self.output_offset + self.output_capacity)

    @property
    def reserves_output(self) -> bool:
        """Whether creating the ring commits the output areas (``_reserve``)."""
        return self.output_capacity <= RESERVE_OUTPUT_LIMIT

    @property
    def reserved_bytes(self) -> int:
        """What creating the ring commits in /dev/shm: every header, and the output areas up
        to ``RESERVE_OUTPUT_LIMIT`` each (what the supervisor itself writes)."""
        output = self.output_capacity if self.reserves_output else 0
        return self.slots * (HEADER_BYTES + output)

    @classmethod
    def build(
        cls,
        slots: int,
        inputs: list[tuple[str, np.dtype, tuple[int | None, ...], int]],
        output_capacity: int,
        result: str,
        outputs: tuple[str, ...] = (),
    ) -> RingLayout:
        """Lay out ``inputs`` (name, dtype, shape pattern, capacity) after the header."""
        at = HEADER_BYTES
        areas = []
        for name, dtype, shape, capacity in inputs:
            areas.append(InputArea(name, np.dtype(dtype).name, shape, at, capacity))
            at = align(at + capacity)
        return cls(slots, tuple(areas), at, output_capacity, result, outputs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "slots": self.slots,
            "slot_bytes": self.slot_bytes,
            "inputs": [
                {
                    "name": a.name,
                    "dtype": a.dtype,
                    "shape": list(a.shape),
                    "offset": a.offset,
                    "capacity": a.capacity,
                }
                for a in self.inputs
            ],
            "output_offset": self.output_offset,
            "output_capacity": self.output_capacity,
            "result": self.result,
            "outputs": list(self.outputs),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RingLayout:
        inputs = tuple(
            InputArea(a["name"], a["dtype"], tuple(a["shape"]), a["offset"], a["capacity"])
            for a in d["inputs"]
        )
        return cls(
            d["slots"],
            inputs,
            d["output_offset"],
            d["output_capacity"],
            d["result"],
            tuple(d["outputs"]),
        )


# The segments' names, opened and removed the way ``multiprocessing.shared_memory`` does it
# (POSIX shm_open/shm_unlink; the name the tracker records has the leading slash).
_posixshmem = shared_memory._posixshmem  # type: ignore[attr-defined]


def _reserve(fd: int, layout: RingLayout) -> None:
    """Commit the pages the supervisor writes (headers, and output areas up to a size).

    A full /dev/shm then fails here, as an error for this attach, instead of killing the
    supervisor with SIGBUS on its first write into a page the kernel cannot provide.
    """
    slot_bytes = layout.slot_bytes
    for slot in range(layout.slots):
        start = slot * slot_bytes
        os.posix_fallocate(fd, start, HEADER_BYTES)
        if layout.reserves_output:
            os.posix_fallocate(fd, start + layout.output_offset, layout.output_capacity)


def start_tracker() -> None:
    """Start the resource tracker now (a helper process and one pipe), not at the first
    segment, so a long-running process's set of open fds is the same before and after."""
    resource_tracker.ensure_running()


def _untrack(name: str) -> None:
    with contextlib.suppress(Exception):
        resource_tracker.unregister(f"/{name}", "shared_memory")


class SlotRing:
    """One mapped segment and its layout. It owns its ``mmap`` directly (no ``SharedMemory``,
    whose finaliser fails loudly while numpy views are alive): ``close`` unmaps when nothing
    points into the mapping any more, and a process that never calls it simply exits with the
    mapping still valid under whatever still views it."""

    def __init__(self, mapping: mmap.mmap, name: str, layout: RingLayout, tracked: bool) -> None:
        self._mmap = mapping
        self.name = name
        self.layout = layout
        self._tracked = tracked  # this process created it: the tracker unlinks it if we die
        self._unlinked = False
        self._closed = False
        self._view = memoryview(mapping)  # the hot paths slice this directly
        self._slot_bytes = layout.slot_bytes

    @classmethod
    def create(cls, layout: RingLayout) -> SlotRing:
        """A new segment (mode 0600, unguessable name) sized for ``layout``; the resource
        tracker unlinks it should this process die before ``unlink``."""
        name = f"duomo-{secrets.token_hex(16)}"
        size = layout.slots * layout.slot_bytes
        fd = _posixshmem.shm_open(f"/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            resource_tracker.register(f"/{name}", "shared_memory")
            try:
                os.ftruncate(fd, size)
                _reserve(fd, layout)
                mapping = mmap.mmap(fd, size)
            except BaseException:
                with contextlib.suppress(OSError):
                    _posixshmem.shm_unlink(f"/{name}")
                _untrack(name)
                raise
        finally:
            # The mapping stays valid without its file descriptor: a ring costs neither side a
            # descriptor (a supervisor's connections are what its fd limit is for).
            os.close(fd)
        return cls(mapping, name, layout, tracked=True)

    @classmethod
    def attach(cls, name: str, layout: RingLayout) -> SlotRing:
        """Map the supervisor's segment and unlink its name right away."""
        fd = _posixshmem.shm_open(f"/{name}", os.O_RDWR, mode=0o600)
        try:
            with contextlib.suppress(FileNotFoundError):
                _posixshmem.shm_unlink(f"/{name}")
            size = os.fstat(fd).st_size
            if size < layout.slots * layout.slot_bytes:
                raise ValueError(f"segment {name} is smaller than its layout")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        ring = cls(mapping, name, layout, tracked=False)
        ring._unlinked = True
        return ring

    def unlink(self) -> None:
        """Remove the name from /dev/shm (the mapping stays valid); safe to call twice."""
        if self._unlinked:
            return
        self._unlinked = True
        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink(f"/{self.name}")
        if self._tracked:
            _untrack(self.name)

    def close(self) -> bool:
        """Unmap; False while numpy views into the segment are still alive elsewhere (then
        call it again later: nothing is lost meanwhile, the name is already gone)."""
        self.unlink()
        if self._closed:
            return True
        try:
            self._view.release()
            self._mmap.close()
        except BufferError:
            return False
        self._closed = True
        return True

    def header(self, slot: int) -> memoryview:
        start = slot * self._slot_bytes
        return self._view[start : start + HEADER_BYTES]

    def input_view(
        self, slot: int, index: int, dtype: np.dtype, shape: tuple[int, ...]
    ) -> np.ndarray:
        area = self.layout.inputs[index]
        count = math.prod(shape)
        if count * np.dtype(dtype).itemsize > area.capacity:
            raise ValueError(f"input {area.name!r} of shape {shape} does not fit its slot area")
        start = slot * self._slot_bytes + area.offset
        return np.frombuffer(self._view, dtype=dtype, count=count, offset=start).reshape(shape)

    def output(self, slot: int) -> memoryview:
        start = slot * self._slot_bytes + self.layout.output_offset
        return self._view[start : start + self.layout.output_capacity]


@dataclass(frozen=True)
class TensorPlacement:
    """Where ``place_tensors`` put tensors in an output area: writable views of their data,
    their records (written again when the area is reused: an error message overwrites them),
    and the bytes used."""

    views: list[np.ndarray]
    records: list[tuple[int, bytes]]
    used: int

    def write_records(self, area: memoryview) -> None:
        for at, record in self.records:
            area[at : at + len(record)] = record

    def describes(self, area: memoryview, used: int) -> bool:
        """``area`` holds exactly these records and bytes (a reader can reuse the views)."""
        return used == self.used and all(
            area[at : at + len(record)] == record for at, record in self.records
        )


def place_tensors(
    area: memoryview, layout: list[tuple[np.dtype, tuple[int, ...]]]
) -> TensorPlacement:
    """Write the tensor records for ``layout`` (dtype, shape) into ``area``; where each tensor's
    data goes. ValueError if they do not fit."""
    views = []
    records = []
    at = 0
    for dtype, shape in layout:
        if len(shape) > MAX_RANK:
            raise ValueError(f"output of rank {len(shape)} is above {MAX_RANK}")
        count = math.prod(shape)
        data_at = align(at + TENSOR_RECORD.size)
        end = data_at + count * dtype.itemsize
        if end > len(area):
            raise ValueError(f"outputs need more than the slot's {len(area)} output bytes")
        dims = list(shape) + [0] * (MAX_RANK - len(shape))
        records.append((at, TENSOR_RECORD.pack(dtype_code(dtype), len(shape), *dims)))
        views.append(np.frombuffer(area, dtype=dtype, count=count, offset=data_at).reshape(shape))
        at = end
    placement = TensorPlacement(views, records, at)
    placement.write_records(area)
    return placement


def write_tensors(area: memoryview, tensors: list[np.ndarray]) -> int:
    """Copy ``tensors`` into ``area`` as tensor records; returns the bytes used."""
    placement = place_tensors(area, [(t.dtype, t.shape) for t in tensors])
    for view, tensor in zip(placement.views, tensors):
        view[...] = tensor
    return placement.used


def read_tensors(area: memoryview, count: int, used: int) -> TensorPlacement:
    """The ``count`` tensor records written by ``write_tensors`` (checked against ``used``):
    views of their data, the records, the bytes used."""
    views = []
    records = []
    at = 0
    for _ in range(count):
        code, rank, *dims = TENSOR_RECORD.unpack_from(area, at)
        if code >= len(DTYPES) or rank > MAX_RANK:
            raise ValueError("corrupt tensor record in the slot")
        shape = tuple(dims[:rank])
        dtype = DTYPES[code]
        data_at = align(at + TENSOR_RECORD.size)
        nbytes = math.prod(shape) * dtype.itemsize
        if data_at + nbytes > used:
            raise ValueError("tensor record runs past the result")
        records.append((at, bytes(area[at : at + TENSOR_RECORD.size])))
        views.append(
            np.frombuffer(
                area,
                dtype=dtype,
                count=nbytes // dtype.itemsize if dtype.itemsize else 0,
                offset=data_at,
            ).reshape(shape)
        )
        at = data_at + nbytes
    return TensorPlacement(views, records, used)


__all__ = [
    "ALIGN",
    "InputArea",
    "RingLayout",
    "SlotRing",
    "TensorPlacement",
    "place_tensors",
    "read_tensors",
    "write_tensors",
]
