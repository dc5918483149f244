"""Memory accounting: what a model costs once loaded, and which idle models to evict for room.

Used by the engine around every load. On the CPU a model's footprint is the growth of this
process's resident memory across its load and warm-up (sessions, ONNX Runtime's arena, I/O
buffers); on an accelerator it is the device memory its sessions took (ACL: the ``get_mem_info``
drop), device by device: a model spread over several devices is charged on each. The engine
charges each model the largest footprint measured for it, so a reload that happens to reuse
freed heap does not make it look free. After an unload the C heap is trimmed
(``malloc_trim``), so freed model memory goes back to the system instead of staying resident.
``tune_heap`` (called once by the supervisor process, and by the benchmark's in-process mode,
before any thread starts) bounds glibc's heap so freed request buffers do not stay resident.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil

MB = 1 << 20


@dataclass(frozen=True)
class MemoryUse:
    """Bytes charged to a model or a device against its budget (``None``: no budget; used
    ``None``: a model never measured)."""

    used_bytes: int | None
    budget_bytes: int | None


@dataclass(frozen=True)
class Footprint:
    """What a model took when it loaded, on all its devices."""

    host_bytes: int  # resident-memory growth across load + warm-up, all instances
    device_bytes: Mapping[int, int]  # accelerator memory its sessions took, by device
    instances: Mapping[int, int]  # its instances by device

    def charged_on(self, device: int, kind: str) -> int:
        """What counts against ``device``'s budget: the device memory its sessions took there
        on an accelerator; on the host, its resident growth in proportion to the instances
        there (a model on two devices is charged on each)."""
        if kind not in ("cpu", "cuda"):
            return self.device_bytes.get(device, 0)
        total = sum(self.instances.values())
        return self.host_bytes * self.instances.get(device, 0) // total if total else 0

    def largest(self, other: Footprint | None) -> Footprint:
        """The larger of the two on every count (the engine charges the largest measured)."""
        if other is None:
            return self
        devices = self.device_bytes.keys() | other.device_bytes.keys()
        return Footprint(
            max(self.host_bytes, other.host_bytes),
            {d: max(self.device_bytes.get(d, 0), other.device_bytes.get(d, 0)) for d in devices},
            self.instances,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "host_bytes": self.host_bytes,
            "device_bytes": sum(self.device_bytes.values()),
            "device_bytes_by_device": {str(d): b for d, b in sorted(self.device_bytes.items())},
        }


@dataclass(frozen=True)
class Resident:
    """A loaded model as eviction sees it."""

    name: str
    bytes: int
    last_used_s: float  # monotonic
    evictable: bool
    idle: bool  # nothing queued or in flight


def resident_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def trim_heap() -> None:
    """Return freed C-heap memory to the system (glibc ``malloc_trim``; a no-op elsewhere)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


# glibc mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
HEAP_ARENAS = 2
HEAP_MMAP_THRESHOLD = 1 << 20


def tune_heap() -> None:
    """Bound glibc's heap for a serving process (a no-op elsewhere): at most ``HEAP_ARENAS``
    malloc arenas instead of eight per core (each worker thread would keep its own, holding
    the buffers it freed), and a fixed ``HEAP_MMAP_THRESHOLD``: a block that large is mapped on
    its own and returned to the system when freed (glibc otherwise raises the threshold after
    such a free, and the next large request buffers then stay resident in the heap). Measured on
    the mixed three-model load: about 30 MiB less resident memory, the same speed
    (docs/design-notes.md, "Memory")."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, HEAP_ARENAS)
        mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)


def choose_victims(residents: Iterable[Resident], need_bytes: int) -> list[Resident] | None:
    """The least recently used idle evictable models whose bytes together cover
    ``need_bytes``, or None if all of them together do not."""
    if need_bytes <= 0:
        return []
    victims: list[Resident] = []
    freed = 0
    for resident in sorted(residents, key=lambda r: r.last_used_s):
        if not (resident.evictable and resident.idle):
            continue
        victims.append(resident)
        freed += resident.bytes
        if freed >= need_bytes:
            return victims
    return None


def mb(nbytes: int) -> str:
    """Megabytes for a message: one decimal below 10 MB, where rounding would hide the gap."""
    return f"{nbytes / MB:.1f} MB" if abs(nbytes) < 10 * MB else f"{nbytes / MB:.0f} MB"
