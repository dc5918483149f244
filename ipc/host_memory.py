"""The process's host memory as loads, unloads and a quiet gateway see it: its anonymous resident
bytes, the C heap's free pages handed back to the system, and glibc's malloc parameters
(``set_malloc_options``: the supervisor's ``tune_heap``, the gateway's ``keep_request_buffers``).

Used by the engine (a load's footprint), the model registry (the trim after unloads and
evictions), ``supervisor.core.memory``'s heap tuning (``libc``), the ONNX Runtime backend, which
measures the weights a session holds the same way, and a gateway worker's ``MemoryKeeper``
(what a burst of large requests left behind). Anonymous memory is what loads and requests
allocate and frees give back: library code first run by a load (ONNX Runtime's kernels,
OpenCV) stays mapped for the process's life and is no model's. Linux only, as Duomo is (its rings
are memfds): read from ``/proc/self/statm``, with no dependency a producer would not have.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Mapping

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


def resident_bytes() -> int:
    """This process's anonymous resident memory: its RSS less its file-backed and shared pages
    (mapped libraries, the clients' rings)."""
    with open("/proc/self/statm", "rb") as statm:
        _, resident, shared = statm.read().split()[:3]
    return (int(resident) - int(shared)) * _PAGE_BYTES


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library (None where it cannot be loaded)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def trim_heap() -> None:
    """Return freed C-heap memory to the system (glibc ``malloc_trim``: the free pages of every
    arena, not only the heap's top; a no-op elsewhere)."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def set_malloc_options(options: Mapping[int, int]) -> None:
    """Set glibc's malloc parameters, in order (``mallopt``: ``{M_ARENA_MAX: 2, …}``; a no-op
    elsewhere). Once, before the process starts its threads."""
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is not None:
        for parameter, value in options.items():
            mallopt(parameter, value)
