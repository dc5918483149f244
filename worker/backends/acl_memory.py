"""The device memory ACL models run in: their weight and work buffers, shared and counted.

The ACL backend loads every model with ``load_from_file_with_mem`` into buffers allocated here at
``query_size``'s sizes (so what a model takes is known before it loads). ``DeviceMemory`` decides
which buffers a load uses:

- weights: with ``share_weights`` (the default), one buffer per device and file (``file_identity``:
  its resolved path, size and mtime) for every session that loads that file there — the
  instances of a model, a replica under another name, a pipeline step (ACL: weight memory is
  read-only during inference, and models loaded from one file may share it). ``share_weights:
  false``: a buffer of the session's own.
- work: a buffer of the session's own, unless its device's compute gate starts one run at a time
  (``runs_alone``: ``runs_at_once: 1``, ``overdraft: 0``): then the device's models share one
  work buffer (ACL: models that run one after another may), sized to the largest of them. A
  model that needs more than the current one gets a new, larger buffer that later loads share;
  the old one stays with its users.

Invariants: a shared buffer in the registry has at least one user, and is freed only by the
release that takes its users to zero, which the session makes after unloading its model (the
runtime must not read freed memory). The room a load's budgets leave is checked before anything
is allocated, counting the weights only when that file's are not on the device already, and the
work only when it gets a buffer of its own or a new shared one. The memory ledger charges a
device each shared buffer once, at its size (the sessions' ``weights`` and ``shared_work``).

Called by ``worker.backends.acl_backend``: ``AclBackend`` owns one ``DeviceMemory`` per process
(and asks it at close what is still held); each ``AclSession`` calls ``claim`` while loading and
``release`` after unloading, on its worker thread with its own context current. ``check_release``
is the backend's rule for teardown calls: a failure is logged, not raised.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from duomo.worker.backends.acl_runtime import ACL_MEM_MALLOC_HUGE_FIRST, ACL_SUCCESS, AclRuntime
from duomo.worker.backends.base import NotEnoughDeviceMemoryError, SessionSettings

log = structlog.get_logger("duomo.acl")
_SERIALS = itertools.count(1)


def check_release(rt: AclRuntime, ret: int, call: str) -> None:
    """Teardown goes on after a failed release; the failure is logged, not raised."""
    if ret != ACL_SUCCESS:
        log.error("acl release failed", call=call, code=ret, detail=rt.get_recent_err_msg())


@dataclass(eq=False)
class DeviceBuffer:
    """A device allocation and the sessions using it; freed when the last one lets go.

    ``shared``: others may use it (``DeviceMemory`` lists it); else a session's own. ``pointer``
    0 with ``nbytes`` 0: the model needs none, nothing was allocated. ``serial`` tells buffers
    apart for the memory ledger (a pointer is reused once freed)."""

    pointer: int
    nbytes: int
    shared: bool = False
    users: int = field(default=1)
    serial: int = field(default_factory=lambda: next(_SERIALS))


class DeviceMemory:
    """The weight and work buffers of every session in the process, counted by user.

    Sessions call ``claim`` while loading and ``release`` after unloading, each on its own
    thread with its own context current (device memory belongs to the device, so the last user
    frees a buffer another session allocated). ``claim`` decides what a load needs, compares it
    with the room its budgets leave and allocates under one lock, so two instances loading at
    once agree on one weight buffer. Invariant: a buffer in the registry has at least one user,
    and is freed only by the release that takes its users to zero.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._weights: dict[tuple[object, ...], DeviceBuffer] = {}  # (device, file identity)
        self._work: dict[int, DeviceBuffer] = {}  # device -> the work buffer its models share

    def claim(
        self,
        rt: AclRuntime,
        path: Path,
        settings: SessionSettings,
        sizes: tuple[int, int],
        identity: tuple[str, int, int] | None,
    ) -> tuple[DeviceBuffer, DeviceBuffer]:
        """The (work, weights) buffers a load of ``path`` uses, found or allocated: ``sizes``
        are ``query_size``'s (work, weight); ``identity`` the file's (``file_identity``) when
        its weights are shared, else None.

        Compares with ``settings.room`` (I/O buffers are sized only after the load): with the
        model's budget what it is charged alone, its ``query_size`` work and weights; with the
        device's room what the load adds to the device's charge, its work unless it joins a
        shared work buffer already there, plus its weights unless that file's weights are on
        the device already. Raises
        ``NotEnoughDeviceMemoryError`` before allocating anything, ``AclError`` for a failed
        malloc (after giving back what it took)."""
        device = settings.device
        work, weight = sizes
        weight_key = (device, *identity) if identity is not None else None
        with self._lock:
            weights = self._weights.get(weight_key) if weight_key is not None else None
            shared = self._work.get(device) if settings.runs_alone else None
            if shared is not None and shared.nbytes < work:
                shared = None  # a new, larger one for it and later loads
            room = settings.room
            if room.model_bytes is not None and work + weight > room.model_bytes:
                raise NotEnoughDeviceMemoryError(path, work + weight, room.model_bytes, device)
            added = (0 if shared else work) + (0 if weights else weight)
            if room.device_bytes is not None and added > room.device_bytes:
                raise _short(path, added, room.device_bytes, device, weights, shared)
            if weights is None:
                weights = _allocate(rt, weight, shared=weight_key is not None)
                if weight_key is not None:
                    self._weights[weight_key] = weights
            else:
                weights.users += 1
            try:
                if shared is None:
                    shared = _allocate(rt, work, shared=settings.runs_alone)
                    if settings.runs_alone:
                        self._work[device] = shared
                else:
                    shared.users += 1
            except BaseException:
                self._let_go(rt, weights)
                raise
            return shared, weights

    def release(self, rt: AclRuntime, buffer: DeviceBuffer) -> None:
        """One user fewer; the last frees the buffer (its model must be unloaded by then)."""
        with self._lock:
            self._let_go(rt, buffer)

    def _let_go(self, rt: AclRuntime, buffer: DeviceBuffer) -> None:
        buffer.users -= 1
        if buffer.users > 0:
            return
        self._weights = {k: b for k, b in self._weights.items() if b is not buffer}
        self._work = {d: b for d, b in self._work.items() if b is not buffer}
        if buffer.pointer:
            check_release(rt, rt.free(buffer.pointer), f"rt.free({buffer.nbytes} B)")

    def held(self) -> dict[str, int]:
        """Shared buffers still in use: how many, and their bytes (both 0 when all let go)."""
        with self._lock:
            buffers = [*self._weights.values(), *self._work.values()]
            return {"buffers": len(buffers), "bytes": sum(b.nbytes for b in buffers)}


def file_identity(path: Path) -> tuple[str, int, int]:
    """What makes two loads "the same file": its resolved path, size and mtime (a file
    rewritten in place is another file)."""
    resolved = path.resolve()
    stat = resolved.stat()
    return str(resolved), stat.st_size, stat.st_mtime_ns


def _allocate(rt: AclRuntime, nbytes: int, shared: bool) -> DeviceBuffer:
    """A device buffer of ``nbytes`` on the current context's device (none for 0 bytes), with
    the policy of the I/O buffers."""
    pointer = 0
    if nbytes:
        pointer, ret = rt.malloc(nbytes, ACL_MEM_MALLOC_HUGE_FIRST)
        rt.check(ret, f"rt.malloc({nbytes})")
    return DeviceBuffer(pointer, nbytes, shared)


def _short(
    path: Path,
    needed: int,
    room: int,
    device: int,
    weights: DeviceBuffer | None,
    work: DeviceBuffer | None,
) -> NotEnoughDeviceMemoryError:
    """The refusal of a load that does not fit: ``weights`` and ``work`` are the shared buffers
    already on the device that it would join (not counted in ``needed``)."""
    short = NotEnoughDeviceMemoryError(path, needed, room, device)
    resident = {
        (True, False): "weights are",
        (False, True): "work buffer is",
        (True, True): "weights and work buffer are",
    }.get((weights is not None, work is not None))
    if resident:  # the base message says work + weights
        counted = "query_size's weights" if work is not None else "query_size's work"
        short.args = (
            f"{path.name} needs {needed / 2**20:.2f} MB of device memory ({counted}; its "
            f"{resident} on device {device} already), and its budgets leave "
            f"{room / 2**20:.2f} MB there",
        )
    return short
