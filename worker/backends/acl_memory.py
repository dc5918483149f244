"""The device memory ACL models run in: their weight and work buffers, shared and counted.

The ACL backend loads every model with ``load_from_file_with_mem`` into buffers allocated here at
``query_size``'s sizes (so what a model takes is known before it loads). ``DeviceMemory`` decides
which buffers a load uses:

- weights: with ``share_weights`` (the default), one buffer per device and file
  (``FileIdentity``: its resolved path, device, inode, size and mtime) for every session that
  loads that file there — the instances of a model, a replica under another name, a pipeline
  step (ACL: weight memory is read-only during inference, and models loaded from one file may
  share it). ``share_weights: false``: a buffer of the session's own.
- work: a buffer of the session's own, unless its device's compute gate starts one run at a time
  (``runs_alone``: ``runs_at_once: 1``, ``overdraft: 0``): then the device's models share one
  work buffer (ACL: models that run one after another may), sized to the largest of them. A
  model that needs more than the current one gets a new, larger buffer that later loads share;
  the old one stays with its users.

Invariants: a shared buffer in the registry (a ``ShareRegistry``: ``worker.backends.shares``) has
at least one user, and is freed only by the release that takes its users to zero, which the
session makes after unloading its model (the runtime must not read freed memory). The room a
load's budgets leave is checked before anything is allocated, counting the weights only when that
file's are not on the device already, and the work only when it gets a buffer of its own or a new
shared one. The memory ledger charges a device each shared buffer once, at its size
(``AclMemory``'s ``weights`` and ``shared_work``).

Called by ``worker.backends.acl_backend``: ``AclBackend`` owns one ``DeviceMemory`` per process
(and asks it at close what is still held); each ``AclSession`` calls ``claim`` while loading and
``release`` after unloading, on its worker thread with its own context current, and keeps what
it holds in its ``AclMemory`` (its ``memory``). ``check_release`` is the backend's rule for
teardown calls: a failure is logged, not raised.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from duomo.worker.backends.acl_runtime import ACL_MEM_MALLOC_HUGE_FIRST, ACL_SUCCESS, AclRuntime
from duomo.worker.backends.base import (
    HostMemory,
    MemoryShare,
    NotEnoughDeviceMemoryError,
    SessionSettings,
)
from duomo.worker.backends.shares import FileIdentity, Lease, ShareRegistry

log = structlog.get_logger("duomo.acl")
_SERIALS = itertools.count(1)


def check_release(rt: AclRuntime, ret: int, call: str) -> None:
    """Teardown goes on after a failed release; the failure is logged, not raised."""
    if ret != ACL_SUCCESS:
        log.error("acl release failed", call=call, code=ret, detail=rt.get_recent_err_msg())


@dataclass(eq=False)
class DeviceBuffer:
    """A device allocation, held through a ``Lease`` by the sessions using it; freed when the
    last one lets go.

    ``shared``: others may use it (``DeviceMemory`` lists it); else a session's own. ``pointer``
    0 with ``nbytes`` 0: the model needs none, nothing was allocated. ``serial`` tells buffers
    apart for the memory ledger (a pointer is reused once freed)."""

    pointer: int
    nbytes: int
    shared: bool = False
    serial: int = field(default_factory=lambda: next(_SERIALS))


# a shared buffer's key: ("weights", device, file) or ("work", device)
_ShareKey = tuple[object, ...]


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
        self._lock = threading.Lock()  # one claim or release at a time: they decide together
        self._shares: ShareRegistry[_ShareKey, DeviceBuffer] = ShareRegistry()

    def claim(
        self,
        rt: AclRuntime,
        path: Path,
        settings: SessionSettings,
        sizes: tuple[int, int],
        identity: FileIdentity | None,
    ) -> tuple[Lease[DeviceBuffer], Lease[DeviceBuffer]]:
        """Leases on the (work, weights) buffers a load of ``path`` uses, found or allocated:
        ``sizes`` are ``query_size``'s (work, weight); ``identity`` the file's when its weights
        are shared, else None. A buffer of the session's own comes as a lease nobody shares.

        Compares with ``settings.room`` (I/O buffers are sized only after the load): with the
        model's budget what it is charged alone, its ``query_size`` work and weights; with the
        device's room what the load adds to the device's charge, its work unless it joins a
        shared work buffer already there, plus its weights unless that file's weights are on
        the device already. Raises
        ``NotEnoughDeviceMemoryError`` before allocating anything, ``AclError`` for a failed
        malloc (after giving back what it took)."""
        device = settings.device
        work, weight = sizes
        weight_key = ("weights", device, identity) if identity is not None else None
        work_key = ("work", device)
        shares = self._shares
        with self._lock:
            weights = shares.get(weight_key) if weight_key is not None else None
            shared = shares.get(work_key) if settings.runs_alone else None
            outgrown = shared is not None and shared.nbytes < work
            if outgrown:
                shared = None  # a new, larger one for it and later loads
            room = settings.room
            if room.model_bytes is not None and work + weight > room.model_bytes:
                raise NotEnoughDeviceMemoryError(path, work + weight, room.model_bytes, device)
            added = (0 if shared else work) + (0 if weights else weight)
            if room.device_bytes is not None and added > room.device_bytes:
                raise _short(path, added, room.device_bytes, device, weights, shared)
            if weight_key is None:
                weights_lease = shares.alone(_allocate(rt, weight, shared=False))
            else:
                weights_lease = shares.acquire(
                    weight_key, lambda: _allocate(rt, weight, shared=True)
                )
            try:
                if settings.runs_alone:
                    work_lease = shares.acquire(
                        work_key, lambda: _allocate(rt, work, shared=True), fresh=outgrown
                    )
                else:
                    work_lease = shares.alone(_allocate(rt, work, shared=False))
            except BaseException:
                self._let_go(rt, weights_lease)
                raise
            return work_lease, weights_lease

    def release(self, rt: AclRuntime, lease: Lease[DeviceBuffer]) -> None:
        """One user fewer; the last frees the buffer (its model must be unloaded by then)."""
        with self._lock:
            self._let_go(rt, lease)

    def _let_go(self, rt: AclRuntime, lease: Lease[DeviceBuffer]) -> None:
        buffer = self._shares.release(lease)
        if buffer is not None and buffer.pointer:
            check_release(rt, rt.free(buffer.pointer), f"rt.free({buffer.nbytes} B)")

    def held(self) -> dict[str, int]:
        """Shared buffers still in use: how many, and their bytes (both 0 when all let go)."""
        with self._lock:
            buffers = self._shares.things()
            return {"buffers": len(buffers), "bytes": sum(b.nbytes for b in buffers)}


class AclMemory(HostMemory):
    """What an ``AclSession`` holds (its ``memory``): its host buffers (``HostMemory``), leases on
    the device buffers its model loaded into (``work``, ``weight``: from ``DeviceMemory``), the
    identity of its file when its weights are shared, and ``figures``: ``query_size``'s sizes,
    what it takes as its own and the ``get_mem_info`` drop across its load."""

    def __init__(self, path: Path, device: int) -> None:
        super().__init__()
        self.path = path
        self.device = device
        self.work: Lease[DeviceBuffer] | None = None
        self.weight: Lease[DeviceBuffer] | None = None
        self.identity: FileIdentity | None = None  # the file's, when weights are shared
        self.figures: dict[str, int] = {}

    @property
    def device_bytes(self) -> int:
        """Its I/O buffers, and its work and weights unless shared (those are ``shared_work``
        and ``weights``)."""
        return self.figures.get("own_bytes", 0)

    @property
    def weights(self) -> MemoryShare | None:
        """The weight buffer it shares with every session that loaded the same file on its
        device (``share_weights``), or None when the buffer is its own."""
        lease = self.weight
        if lease is None or not lease.thing.shared or self.identity is None:
            return None
        key = f"acl:{self.device}:{self.identity.key}"
        return MemoryShare(key, self.path.name, self.device, lease.thing.nbytes, on_device=True)

    @property
    def shared_work(self) -> MemoryShare | None:
        """The work buffer it shares with the other models of a device that runs one model at
        a time (``runs_alone``), at the buffer's size (its model is charged alone its own
        ``query_size`` work), or None when its work buffer is its own."""
        lease = self.work
        if lease is None or not lease.thing.shared:
            return None
        buffer = lease.thing
        key = f"acl-work:{self.device}:{buffer.serial}"
        own = self.figures["query_work_bytes"]
        return MemoryShare(key, "work buffer", self.device, buffer.nbytes, True, "work", own)


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
