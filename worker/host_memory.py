"""The process's host memory as loads and unloads see it: its anonymous resident bytes and the C
heap's free pages handed back to the system.

Used by the engine (a load's footprint), the model registry (the trim after unloads and
evictions), ``supervisor.memory``'s heap tuning (``libc``) and the ONNX Runtime backend, which
measures the weights a session holds the same way. Anonymous memory is what loads allocate and
unloads free: library code first run by a load (ONNX Runtime's kernels, OpenCV) stays mapped for
the process's life and is no model's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import psutil


def resident_bytes() -> int:
    """This process's anonymous resident memory: its RSS less its file-backed and shared pages
    (mapped libraries, the clients' rings)."""
    info = psutil.Process().memory_info()
    return int(info.rss - getattr(info, "shared", 0))


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library (None where it cannot be loaded)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def trim_heap() -> None:
    """Return freed C-heap memory to the system (glibc ``malloc_trim``; a no-op elsewhere)."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
