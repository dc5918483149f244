"""Memory accounting: what a model costs once loaded, what each device's models are charged
against its budget, and which idle models to evict for room (``MemoryLedger``).

Used by the engine around every load. On the CPU a model's footprint is the growth of this
process's anonymous resident memory (``ipc.host_memory``) across its load and warm-up
(sessions, ONNX Runtime's arena, I/O buffers), measured once what the warm-up freed has gone back
and before its instances serve: what its unload returns. On an accelerator it is the device
memory its sessions took (ACL: the ``get_mem_info`` drop), device by device: a model spread over
several devices is charged on each. The engine
charges each model the largest footprint measured for it, so a reload that happens to reuse
freed heap does not make it look free.

Shared memory is charged apart from the rest: every session names the copy of weights it uses
(a ``MemoryShare``, made by the first session that opened its file alike and shared by the
others: instances, replicas under other names), and on an ACL device that runs one model at a
time the work buffer it shares with the device's other models. A device is charged each share
once, at its size, whatever the number of models using it; a model alone is charged its own
memory (activations, buffers) plus its part of every share it uses (``charged_alone``: a copy
of weights whole, of a shared work buffer its own work), and evicting it frees its own memory
and the shares no other loaded model uses. A share is charged at its size now while its model is
loaded (read from its sessions, not frozen at the load): a gallery's matrix is its weights, and it
grows and shrinks as identities are enrolled and removed while it serves.
After an unload the C heap is trimmed (``malloc_trim``), so freed model memory goes back to the
system instead of staying resident. ``tune_heap`` (called once by the supervisor process, and by
the benchmark's in-process mode, before any thread starts) bounds glibc's heap so freed request
buffers do not stay resident.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import structlog

from duomo.ipc.errors import ResourceExhaustedError
from duomo.ipc.host_memory import M_ARENA_MAX, M_MMAP_THRESHOLD, set_malloc_options
from duomo.ipc.model_records import WeightCopy
from duomo.supervisor.config import LoadedConfig, ResolvedModel
from duomo.worker.backends.base import DeviceRoom, MemoryShare
from duomo.worker.model_spec import SERVING
from duomo.worker.served_model import ServedModel

log = structlog.get_logger("duomo.memory")
MB = 1 << 20
HOST_KINDS = ("cpu", "cuda")  # devices whose models are charged host memory (see Footprint)


@dataclass(frozen=True)
class MemoryUse:
    """Bytes charged to a model or a device against its budget (``None``: no budget; used
    ``None``: a model never measured)."""

    used_bytes: int | None
    budget_bytes: int | None


@dataclass(frozen=True)
class Footprint:
    """What a model took when it loaded, on all its devices: its own memory, and the shared
    memory its sessions use (copies of weights, ACL work buffers: charged once per device,
    whoever else uses them)."""

    host_bytes: int  # its resident growth across load + warm-up, weights it made not counted
    device_bytes: Mapping[int, int]  # accelerator memory its sessions took, shared buffers not
    instances: Mapping[int, int]  # its instances by device
    shares: tuple[MemoryShare, ...] = ()  # the shared memory its sessions use, each once

    def charged_on(self, device: int, kind: str) -> int:
        """Its own memory on ``device``'s terms: the device memory its sessions took there on
        an accelerator; on the host, its resident growth in proportion to the instances there
        (a model on two devices is charged on each). Shared memory: ``shares_on``."""
        if kind not in HOST_KINDS:
            return self.device_bytes.get(device, 0)
        total = sum(self.instances.values())
        return self.host_bytes * self.instances.get(device, 0) // total if total else 0

    @property
    def weights(self) -> tuple[MemoryShare, ...]:
        """Its shares that are copies of weights (what ``status`` lists)."""
        return tuple(w for w in self.shares if w.kind == "weights")

    def shares_on(self, device: int, kind: str) -> list[MemoryShare]:
        """The shared memory it uses that counts against ``device``'s budget (host memory on a
        host device, device memory on an accelerator)."""
        on_device = kind not in HOST_KINDS
        return [w for w in self.shares if w.device == device and w.on_device == on_device]

    def largest(self, other: Footprint | None) -> Footprint:
        """The larger of the two on every count (the engine charges the largest measured);
        the shares of the latest."""
        if other is None:
            return self
        devices = self.device_bytes.keys() | other.device_bytes.keys()
        return Footprint(
            max(self.host_bytes, other.host_bytes),
            {d: max(self.device_bytes.get(d, 0), other.device_bytes.get(d, 0)) for d in devices},
            self.instances,
            self.shares,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "host_bytes": self.host_bytes,
            "device_bytes": sum(self.device_bytes.values()),
            "device_bytes_by_device": {str(d): b for d, b in sorted(self.device_bytes.items())},
            "weights_bytes": sum(w.nbytes for w in self.weights),
            "shared_work_bytes": sum(w.charged_alone for w in self.shares if w.kind == "work"),
        }


@dataclass(frozen=True)
class Resident:
    """A loaded model as eviction sees it."""

    name: str
    bytes: int
    last_used_s: float  # monotonic
    evictable: bool
    idle: bool  # nothing queued or in flight


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
    set_malloc_options({M_ARENA_MAX: HEAP_ARENAS, M_MMAP_THRESHOLD: HEAP_MMAP_THRESHOLD})


def _shares_of(model: ServedModel) -> list[MemoryShare]:
    """The shared memory its loaded sessions use (copies of weights, work buffers), as they
    say now."""
    return [
        share
        for session in model.instances.sessions()
        for share in (session.memory.weights, session.memory.shared_work)
        if share is not None
    ]


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


class MemoryLedger:
    """What each model is charged on each device against the budgets, and eviction for room.

    Owned by the ``Engine``, which calls it around every load (``make_room`` before, ``rooms``
    for an accelerator's sessions, ``record`` after) and for ``status`` and ``/metrics``
    (``model_memory``, ``device_memory``). ``models`` is the engine's registry (the same dict);
    ``loaded`` the running config, set again by a reload; ``release`` hands freed memory back
    (the backends' pools, then the C heap), called after every eviction.
    """

    def __init__(
        self,
        models: Mapping[str, ServedModel],
        loaded: LoadedConfig,
        release: Callable[[], None],
    ) -> None:
        self.models = models
        self.loaded = loaded
        self._release = release
        self.footprints: dict[str, Footprint] = {}  # the largest measured, kept across unloads
        self.measured: dict[str, Footprint] = {}  # the last measurement

    # -- the config's terms ---------------------------------------------------------------

    def device_budget(self, device: int) -> int | None:
        budget_mb = self.loaded.config.device(device).memory_budget_mb
        return None if budget_mb is None else budget_mb * MB

    @staticmethod
    def model_budget(resolved: ResolvedModel | None) -> int | None:
        budget_mb = resolved.config.memory_budget_mb if resolved else None
        return None if budget_mb is None else budget_mb * MB

    # -- charges --------------------------------------------------------------------------

    def charged(self, name: str, device: int) -> int:
        """What ``name`` is charged on ``device`` alone: its own memory and its part of the
        shared memory it uses there (its largest measured load), or before it was ever measured
        its ``memory_budget_mb``."""
        return self.expected(name, device, self.model_budget(self.loaded.models.get(name)))

    def expected(
        self,
        name: str,
        device: int,
        budget: int | None,
        held: Mapping[str, tuple[MemoryShare, list[str]]] | None = None,
    ) -> int:
        """What a load of ``name`` will need on ``device``: its own memory and its part of
        the shared memory it uses (``charged_alone``: a copy of weights whole, a shared work
        buffer its own work), as its largest measured load had them, but what it will find
        ``held`` there (``shares_held``): its copy of weights, or a shared work buffer large
        enough to join (the buffer its last load used may be gone, another in its place); its
        ``budget`` before its first."""
        found = self._found(name)
        if found is None:
            return budget or 0
        held = held or {}
        kind = self._kind(device)
        work_held = max((s.nbytes for s, _ in held.values() if s.kind == "work"), default=0)

        def found_there(share: MemoryShare) -> bool:
            if share.kind == "work":
                return share.charged_alone <= work_held
            return share.key in held

        shares = found.shares_on(device, kind)
        return found.charged_on(device, kind) + sum(
            w.charged_alone for w in shares if not found_there(w)
        )

    def own(self, name: str, device: int) -> int:
        """``name``'s own memory on ``device``, shared memory not counted (its budget before it
        was ever measured)."""
        found = self.footprints.get(name)
        if found is None:
            return self.model_budget(self.loaded.models.get(name)) or 0
        return found.charged_on(device, self._kind(device))

    def _found(self, name: str) -> Footprint | None:
        """``name``'s largest measured footprint, with the shares it uses at their size now
        while it is loaded: a share may grow or shrink as the model serves (a gallery's matrix,
        ``worker.galleries.session``), and the model is charged what it holds. Not stored:
        ``record`` alone writes the footprints."""
        found = self.footprints.get(name)
        model = self.models.get(name)
        if found is None or model is None or not model.holds_memory:
            return found
        live = {share.key: share for share in _shares_of(model)}
        shares = tuple(live.get(share.key, share) for share in found.shares)
        return found if shares == found.shares else replace(found, shares=shares)

    def _kind(self, device: int) -> str:
        return self.loaded.config.device(device).kind

    def _loaded_on(self, device: int, without: ServedModel | None = None) -> list[str]:
        """The models holding memory on ``device`` but ``without`` (a model being replaced is
        still here, under its name)."""
        return [
            n
            for n, m in list(self.models.items())
            if device in m.spec.devices and m is not without and m.holds_memory
        ]

    def shares_held(
        self, device: int, without: ServedModel | None = None
    ) -> dict[str, tuple[MemoryShare, list[str]]]:
        """By key, the shared memory (copies of weights, work buffers) the models loaded on
        ``device`` (but ``without``) use there, each once, with the names of the models using
        it."""
        held: dict[str, tuple[MemoryShare, list[str]]] = {}
        kind = self._kind(device)
        for name in self._loaded_on(device, without):
            found = self._found(name)
            for share in found.shares_on(device, kind) if found else ():
                held.setdefault(share.key, (share, []))[1].append(name)
        return held

    def weights_held(self, device: int) -> dict[str, tuple[MemoryShare, list[str]]]:
        """``shares_held``'s copies of weights (what ``/metrics`` shows of them)."""
        return {k: v for k, v in self.shares_held(device).items() if v[0].kind == "weights"}

    def used(self, device: int, without: ServedModel | None = None) -> int:
        """Bytes charged on ``device`` to the models loaded there but ``without``: each one's
        own memory, and each share once."""
        own = sum(self.own(n, device) for n in self._loaded_on(device, without))
        return own + sum(w.nbytes for w, _ in self.shares_held(device, without).values())

    def rooms(self, model: ServedModel, budget: int | None) -> dict[int, DeviceRoom]:
        """On an accelerator, what the budgets leave ``model`` on each of its devices: its own
        ``budget``, and what the device's budget has left beside the others (the ACL backend
        compares them with ``query_size`` before it allocates anything); nothing on the
        host."""
        rooms: dict[int, DeviceRoom] = {}
        for device in model.spec.devices:
            if self._kind(device) in HOST_KINDS:
                continue
            device_budget = self.device_budget(device)
            left = None
            if device_budget is not None:
                left = max(0, device_budget - self.used(device, without=model))
            rooms[device] = DeviceRoom(budget, left)
        return rooms

    def record(self, model: ServedModel, host_bytes: int, held: Iterable[str] = ()) -> Footprint:
        """A load measured: ``host_bytes`` of resident growth, the device memory its sessions
        took on each device and the shared memory they use (``held``: the keys of the shares
        loaded before it, which its growth does not include); the model is charged the largest
        measured from now on."""
        name = model.spec.name
        sessions = model.instances.sessions_by_device()
        shares = {share.key: share for share in _shares_of(model)}
        before = set(held)
        made = sum(w.nbytes for k, w in shares.items() if k not in before and not w.on_device)
        footprint = Footprint(
            max(0, host_bytes - made),
            {d: sum(s.memory.device_bytes for s in on) for d, on in sessions.items()},
            Counter(model.spec.placement(i).device for i in range(model.spec.instances)),
            tuple(shares.values()),
        )
        self.measured[name] = footprint
        self.footprints[name] = footprint.largest(self.footprints.get(name))
        return footprint

    # -- eviction -------------------------------------------------------------------------

    def make_room(self, model: ServedModel, device: int, need: int, exclude: set[str]) -> None:
        """Evict idle evictable models on ``device`` until ``model``'s ``need`` bytes there fit
        the device's budget next to the others; ResourceExhaustedError if they cannot."""
        budget = self.device_budget(device)
        if budget is None:
            return
        for _attempt in range(3):  # a candidate may turn busy between the choice and the evict
            loaded = {n: self.models[n] for n in self._loaded_on(device, without=model)}
            held = self.shares_held(device, without=model)
            used = self.used(device, without=model)
            over = used + need - budget
            if over <= 0:
                return
            candidates = [
                Resident(
                    n,
                    self._frees(n, device, held),
                    m.last_used_s,
                    self._evictable(n),
                    idle=m.pending == 0,
                )
                for n, m in loaded.items()
                if n not in exclude and m.state in SERVING
            ]
            victims = choose_victims(candidates, over)
            if victims is None:
                break
            evicted = [v.name for v in victims if self.models[v.name].evict()]
            self._release()
            log.info("evicted to make room", model=model.spec.name, device=device, evicted=evicted)
            if len(evicted) == len(victims):
                return
        busy = [c.name for c in candidates if c.evictable and not c.idle]
        raise ResourceExhaustedError(
            f"model {model.spec.name!r} needs {mb(need)} on device {device}, whose budget is "
            f"{mb(budget)}: {sorted(loaded)} use {mb(used)}, and evicting idle evictable models "
            f"cannot free the {mb(over)} missing" + (f" (busy now: {sorted(busy)})" if busy else "")
        )

    def _frees(
        self, name: str, device: int, held: Mapping[str, tuple[MemoryShare, list[str]]]
    ) -> int:
        """What evicting ``name`` frees on ``device``: its own memory and the shared memory
        only it uses."""
        alone = sum(w.nbytes for w, users in held.values() if users == [name])
        return self.own(name, device) + alone

    def _evictable(self, name: str) -> bool:
        resolved = self.loaded.models.get(name)
        return resolved is not None and resolved.config.evictable

    # -- what status and /metrics show ----------------------------------------------------

    def model_memory(self, name: str, model: ServedModel) -> dict[int, MemoryUse]:
        """By device: the bytes charged to ``model`` there alone (its own memory and its part
        of the shared memory it uses, weights in full; its largest measured load, on the
        device's terms, whether loaded now or not) against its ``memory_budget_mb``."""
        measured = name in self.footprints
        budget = self.model_budget(self.loaded.models.get(name))
        return {
            d: MemoryUse(self.charged(name, d) if measured else None, budget)
            for d in model.spec.devices
        }

    def weights_bytes(self, name: str, device: int) -> int:
        """The copies of weights ``name`` uses on ``device``, in full (the part of its charge
        that is weights)."""
        found = self._found(name)
        shares = found.shares_on(device, self._kind(device)) if found else ()
        return sum(w.nbytes for w in shares if w.kind == "weights")

    def weights_of(self, name: str) -> tuple[WeightCopy, ...]:
        """The copies of weights ``name`` uses, as ``status`` shows them: file, device, bytes,
        and the other loaded models that use the same copy."""
        found = self._found(name)
        shown = []
        for share in found.weights if found else ():
            held = self.weights_held(share.device).get(share.key)
            users = tuple(n for n in held[1] if n != name) if held else ()
            shown.append(
                WeightCopy(
                    file=share.file, device=share.device, bytes=share.nbytes,
                    on_device=share.on_device, shared_with=users,
                )
            )  # fmt: skip
        return tuple(shown)

    def device_memory(self) -> dict[int, MemoryUse]:
        """Per configured device id: the bytes charged to its loaded models against its budget
        (each share once)."""
        return {
            device.id: MemoryUse(self.used(device.id), self.device_budget(device.id))
            for device in self.loaded.config.devices
        }
