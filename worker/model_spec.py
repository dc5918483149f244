"""What a served model is made of and reports in: its spec, its instances' places, its states,
its load errors, and the count of loads made ahead of its requests.

Plain values, no threads: the registry builds a ``ModelSpec`` from the config and hands it to
``ServedModel`` (``worker.served_model``), which moves through the ``ModelState`` machine drawn
in its docstring and raises ``ModelLoadError`` / ``DeviceMemoryError`` from a load. Importers:
the served model, the supervisor's registry, engine, memory ledger and placements, and
``supervisor.core.background_loads``, which counts predicted loads in ``PredictedLoads``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from duomo.worker.backends.base import NotEnoughDeviceMemoryError
from duomo.worker.config_model import StrictModel
from duomo.worker.executors.base import Executor
from duomo.worker.health import HealthPolicy


class ModelState(str, Enum):
    """A served model's state (the machine in ``worker.served_model``); READY and DEGRADED serve
    (``SERVING``)."""

    UNLOADED = "UNLOADED"
    LOADING = "LOADING"
    READY = "READY"
    DEGRADED = "DEGRADED"
    REINITIALIZING = "REINITIALIZING"
    FAILED = "FAILED"
    UNLOADING = "UNLOADING"
    STOPPED = "STOPPED"


SERVING = (ModelState.READY, ModelState.DEGRADED)


class ModelLoadError(RuntimeError):
    """A model's instances could not be loaded (or timed out); the message names the model and
    ``__cause__`` is the instance's own error."""

    def __init__(self, model: str, why: str) -> None:
        super().__init__(f"model {model!r} {why}")
        self.model = model


class DeviceMemoryError(ModelLoadError):
    """An instance's own estimate (ACL ``query_size``) did not fit the device memory its budgets
    leave on ``device``; nothing was allocated, so the engine may make room and load again."""

    def __init__(self, model: str, why: str, short: NotEnoughDeviceMemoryError) -> None:
        super().__init__(model, why)
        self.needed = short.needed
        self.room = short.room
        self.device = short.device


@dataclass(frozen=True)
class Placement:
    """Where one instance runs: its device, its intra-op threads, and the cores its threads are
    pinned to (a cpu device's own; none: any of the process's)."""

    device: int = 0
    intra_op_threads: int = 1
    cores: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    """Everything the worker layer needs to serve one model (resolved from the config)."""

    name: str
    task: str
    executor: type[Executor]
    params: StrictModel
    files: Mapping[str, Path]
    instances: int = 1
    max_batch: int = 1
    max_delay_s: float = 0.0
    adaptive_delay: bool = False  # ``max_delay_ms: auto``: the window follows health.slo_p99_ms
    queue_size: int = 64
    priority: int = 0
    priority_aging_per_s: float = 0.0
    intra_op_threads: int = 1
    health: HealthPolicy = field(default_factory=HealthPolicy)
    compute_weight: float = 1.0  # its share of the device's compute time, relative to others'
    share_weights: bool = True  # its sessions use the process's one copy of a file's weights
    # instance i's place (``models[].device``, round-robin); none given: all on device 0
    placements: tuple[Placement, ...] = ()

    def placement(self, index: int) -> Placement:
        if self.placements:
            return self.placements[index]
        return Placement(0, self.intra_op_threads)

    @property
    def devices(self) -> tuple[int, ...]:
        """The devices its instances run on, in the order of their first instance."""
        return tuple(dict.fromkeys(self.placement(i).device for i in range(self.instances)))


class PredictedLoads:
    """``preload_policy: predictive``: one model's loads made ahead of a request, those a
    request then used (hits), and those unloaded again unused (wasted).

    The background loads (``supervisor.core.background_loads``) start and finish a predicted load
    (``expect``, then ``loaded`` or ``skipped``); the model reports the request that uses it
    (``used``, on the request's path, before it is queued, so a reader after the answer sees
    it) and the unload that wastes it (``unused``). ``awaiting`` while a predicted load awaits
    its request. Plain fields: each is written under the model's lifecycle lock or by the one
    request that finds ``awaiting`` set, as the model's own counters are.
    """

    def __init__(self) -> None:
        self.loads = 0
        self.hits = 0
        self.wasted = 0
        self.awaiting = False

    def expect(self) -> None:
        """A load ahead of a request begins (a request from now on is a hit)."""
        self.awaiting = True

    def loaded(self) -> None:
        self.loads += 1

    def skipped(self) -> None:
        """The load ahead did not happen (no room, or it failed): nothing awaits a request."""
        self.awaiting = False

    def used(self) -> None:
        """A request arrived: if a predicted load awaited it, that was a hit."""
        if self.awaiting:
            self.awaiting = False
            self.hits += 1

    def unused(self) -> None:
        """Unloaded: a predicted load that no request used was wasted."""
        if self.awaiting:
            self.awaiting = False
            self.wasted += 1

    def to_dict(self) -> dict[str, Any]:
        return {"loads": self.loads, "hits": self.hits, "wasted": self.wasted}
