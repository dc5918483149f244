"""A ring of request slots in one shared-memory segment, as both sides see it.

The supervisor creates one ring per attached (client, model) with ``SlotRing.create``: a
**sealed memfd** (``memfd_create`` with ``MFD_ALLOW_SEALING``, then ``F_SEAL_SHRINK |
F_SEAL_GROW | F_SEAL_SEAL``), which it passes to its client over the control socket
(``SCM_RIGHTS``, see ``supervisor.process.connection``); the client maps it with
``SlotRing.attach``. The segment has no name: nothing is left anywhere after a crash on either side,
nothing can be guessed or opened by a third process, and containers share only the socket directory.
The seals are why it is a memfd at all: a client that could shrink a segment the supervisor reads
would kill the supervisor with SIGBUS at its next read of a vanished page; a sealed memfd
cannot shrink (``ftruncate`` fails with EPERM), so every page the supervisor mapped stays.
Each slot is::

    [ header: 256 bytes | input areas (one per input, 64-byte aligned) | output area ]

The output area holds either a JSON result (``result == "json"``) or tensor records
(``result == "tensors"``: per output a ``TENSOR_RECORD`` then its data at the next 64-byte
boundary); on an error it holds the UTF-8 message. The header's ``result_len`` says how much.
An input area's capacity is the model's default unless the client asked for more when it
attached (``attach``'s ``inputs``: a producer's handle grows its ring for a larger frame).

A ring owns its ``mmap`` directly: ``close`` unmaps it once no numpy view points into it, and a
process that exits without closing simply takes the mapping with it. The creator holds the
memfd's descriptor only until ``share`` hands it over (to the reply that carries it). Python's
``mmap`` keeps a duplicate of it while mapped, except from Python 3.13 on (``trackfd=False``),
so before 3.13 a mapped ring costs each side one descriptor.
"""

from __future__ import annotations

import fcntl
import functools
import math
import mmap
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from duomo.ipc.errors import InvalidArgumentError
from duomo.ipc.wire import ALIGN, DTYPES, HEADER_BYTES, MAX_RANK, TENSOR_RECORD, align, dtype_code

RESERVE_OUTPUT_LIMIT = 8 << 20  # output areas up to this size are committed at attach


@dataclass(frozen=True)
class InputArea:
    """Where one input lives in every slot: its name, dtype and shape, its offset from the slot's
    start and its capacity in bytes; and, where the model bounds it, the largest each
    dimension may be (an image task's frame: 16384 pixels a side)."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]  # None: any size in that dimension
    offset: int  # from the start of the slot
    capacity: int  # bytes
    bound: tuple[int, ...] | None = None  # the largest shape the model takes

    def check(self, shape: tuple[int, ...]) -> None:
        """INVALID_ARGUMENT, naming the bound, for a ``shape`` past it: a request that can never
        be served is refused before anything (a larger ring) is reserved for it."""
        bound = self.bound
        if bound is not None and (
            len(shape) != len(bound) or any(d > most for d, most in zip(shape, bound))
        ):
            raise InvalidArgumentError(
                f"input {self.name!r} of shape {list(shape)} is past its bound: at most "
                f"{list(bound)}"
            )


@dataclass(frozen=True)
class RingLayout:
    """How a ring's slots are laid out, as ``attach`` tells the client: their number, the input
    areas, the output area and the form of the result."""

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
        """What creating the ring commits: every header, and the output areas up
        to ``RESERVE_OUTPUT_LIMIT`` each (what the supervisor itself writes)."""
        output = self.output_capacity if self.reserves_output else 0
        return self.slots * (HEADER_BYTES + output)

    @classmethod
    def build(
        cls,
        slots: int,
        inputs: list[tuple[str, np.dtype, tuple[int | None, ...], int, tuple[int, ...] | None]],
        output_capacity: int,
        result: str,
        outputs: tuple[str, ...] = (),
    ) -> RingLayout:
        """Lay out ``inputs`` (name, dtype, shape pattern, capacity, bound) after the header."""
        at = HEADER_BYTES
        areas = []
        for name, dtype, shape, capacity, bound in inputs:
            areas.append(InputArea(name, np.dtype(dtype).name, shape, at, capacity, bound))
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
                    **({"bound": list(a.bound)} if a.bound is not None else {}),
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
            InputArea(
                a["name"],
                a["dtype"],
                tuple(a["shape"]),
                a["offset"],
                a["capacity"],
                tuple(a["bound"]) if a.get("bound") is not None else None,
            )
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


MEMFD_NAME = "duomo-ring"  # what /proc/PID/maps shows: "/memfd:duomo-ring (deleted)"
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# no duplicate descriptor kept by the mapping, where Python offers that (3.13)
_MMAP_OPTIONS: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}


def _reserve(fd: int, layout: RingLayout) -> None:
    """Commit the pages the supervisor writes (headers, and output areas up to a size).

    Memory that cannot be had (a memory cgroup at its limit) then fails here, as an error for
    this attach, instead of on the supervisor's first write into a page the kernel cannot
    provide.
    """
    slot_bytes = layout.slot_bytes
    for slot in range(layout.slots):
        start = slot * slot_bytes
        os.posix_fallocate(fd, start, HEADER_BYTES)
        if layout.reserves_output:
            os.posix_fallocate(fd, start + layout.output_offset, layout.output_capacity)


class SlotRing:
    """One mapped segment and its layout. It owns its ``mmap`` directly: ``close`` unmaps when
    nothing points into the mapping any more, and a process that never calls it simply exits
    with the mapping still valid under whatever still views it."""

    def __init__(self, mapping: mmap.mmap, layout: RingLayout, fd: int = -1) -> None:
        self._mmap = mapping
        self.layout = layout
        self._fd = fd  # the creator's descriptor until ``share`` hands it over
        self._closed = False
        self._view = memoryview(mapping)  # the hot paths slice this directly
        self._slot_bytes = layout.slot_bytes

    @classmethod
    def create(cls, layout: RingLayout) -> SlotRing:
        """A new sealed memfd sized for ``layout`` and mapped; its descriptor is kept for
        ``share`` (OSError when memory or descriptors run out: nothing is left behind)."""
        size = layout.slots * layout.slot_bytes
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            _reserve(fd, layout)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            mapping = mmap.mmap(fd, size, **_MMAP_OPTIONS)
        except BaseException:
            os.close(fd)
            raise
        return cls(mapping, layout, fd)

    @classmethod
    def attach(cls, fd: int, layout: RingLayout) -> SlotRing:
        """Map the segment behind ``fd`` (received from the supervisor) and close ``fd``.
        ValueError for a descriptor that is not a sealed segment of the layout's size."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            size = os.fstat(fd).st_size
            if seals & SEALS != SEALS:
                raise ValueError("the ring's segment is not sealed against resizing")
            if size < layout.slots * layout.slot_bytes:
                raise ValueError("the ring's segment is smaller than its layout")
            mapping = mmap.mmap(fd, size, **_MMAP_OPTIONS)
        except OSError as err:
            raise ValueError(f"cannot map the ring's segment: {err}") from None
        finally:
            os.close(fd)
        return cls(mapping, layout)

    def share(self) -> int:
        """Hand over the creator's descriptor (once): the caller sends and then closes it."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            raise RuntimeError("the ring's descriptor was handed over already")
        return fd

    def close(self) -> bool:
        """Unmap; False while numpy views into the segment are still alive elsewhere (then
        call it again later: nothing is lost meanwhile)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
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

    def discard_inputs(self, slot: int) -> int:
        """Give the whole pages of ``slot``'s input areas back to the system (``MADV_REMOVE``: the
        memfd's pages are freed for every process that maps it, and read as zeros until
        written again); the bytes discarded. Only for a slot nobody holds and nothing reads: a
        free one. The seals allow it: they forbid resizing, not freeing pages."""
        page = mmap.PAGESIZE
        discarded = 0
        for area in self.layout.inputs:
            start = slot * self._slot_bytes + area.offset
            first = -(-start // page) * page
            last = (start + area.capacity) // page * page
            if last > first:
                self._mmap.madvise(mmap.MADV_REMOVE, first, last - first)
                discarded += last - first
        return discarded


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
