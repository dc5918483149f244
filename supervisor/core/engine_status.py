"""What ``status`` shows of the engine: its ``EngineStatus`` record, each model's status with
what the engine keeps of it (memory against its budget, idle-spin counts, config flags, its share
of its compute gates), and each device's record.

Called by the engine (``Engine.status``, ``Engine.model_status``, the ``load`` reply), which the
supervisor's status and the control handlers call in turn; reads the engine's registry, memory
ledger, placements, telemetry and pipelines, and changes nothing. Each part is a record made by
its owner (``worker.model_status`` for a model, ``ServedPipeline.status`` for a pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from duomo.ipc.model_records import ComputeShare, ModelMemory, ModelStatus
from duomo.ipc.records import Record
from duomo.ipc.status_records import DeviceStatus, PipelineStatus
from duomo.supervisor.config import LoadedConfig
from duomo.supervisor.core.device_telemetry import DeviceTelemetry
from duomo.supervisor.core.idle_spin import IdleSpin
from duomo.supervisor.core.memory import MemoryLedger
from duomo.supervisor.core.placement import Placements
from duomo.supervisor.dataflow.pipelines import ServedPipeline
from duomo.worker.model_status import model_status as served_model_status
from duomo.worker.served_model import ServedModel

GateShares = dict[int, dict[str, dict[str, float]]]  # gate id -> model -> weight, share


@dataclass(frozen=True)
class EngineStatus(Record):
    """The engine's part of ``status`` (``Engine.status``), each record made by its owner: the
    thread budget in all, each device (``DeviceStatus``), each model (``ModelStatus``, by
    ``worker.model_status``) and each pipeline (``PipelineStatus``, by its ``ServedPipeline``).
    The supervisor puts them in its ``SupervisorStatus`` (``to_dict``: the same keys as there)."""

    thread_budget: int
    devices: tuple[DeviceStatus, ...]
    models: dict[str, ModelStatus]
    pipelines: dict[str, PipelineStatus]


class Engine(Protocol):
    """What status reads of the engine (``supervisor.core.engine.Engine`` is one): its models
    and pipelines, and the keepers of what the engine knows of them."""

    models: dict[str, ServedModel]
    pipelines: dict[str, ServedPipeline]
    placements: Placements
    memory: MemoryLedger
    telemetry: DeviceTelemetry
    idle_spin: IdleSpin

    @property
    def loaded(self) -> LoadedConfig: ...


def engine_status(engine: Engine) -> EngineStatus:
    """The engine's part of ``status``: the thread budget, and each device's, model's and
    pipeline's record, as each owner makes it."""
    served = list(engine.models.items())  # (once: a reload may change the registry meanwhile)
    shares = gate_shares(engine)
    return EngineStatus(
        thread_budget=engine.placements.total_budget,
        devices=devices(engine),
        models={name: model_status(engine, name, m, shares) for name, m in served},
        pipelines={name: p.status() for name, p in list(engine.pipelines.items())},
    )


def model_status(
    engine: Engine, name: str, model: ServedModel, shares: GateShares | None
) -> ModelStatus:
    """The model's own status (``worker.model_status``) with what the engine keeps of it:
    its memory against its budget, its idle workers' spin counts, its config flags and its
    share of its compute gates' time (``shares``: every gate's; None: none, the ``load``
    reply's)."""
    resolved = engine.loaded.models.get(name)
    last = engine.memory.measured.get(name)
    use = engine.memory.model_memory(name, model)
    charged = [u.used_bytes for u in use.values() if u.used_bytes is not None]
    memory = ModelMemory(
        loaded=model.holds_memory,
        measured=last.to_dict() if last else None,
        charged_bytes=sum(charged) if charged else None,
        charged_bytes_by_device={str(d): u.used_bytes for d, u in use.items()},
        budget_bytes=next(iter(use.values())).budget_bytes,
        weights=engine.memory.weights_of(name),
    )
    return served_model_status(
        model,
        memory=memory,
        idle_spin=engine.idle_spin.counts(name),
        preload=resolved.config.preload if resolved else None,
        evictable=resolved.config.evictable if resolved else None,
        compute=None if shares is None else _compute_share(name, model, shares),
    )


def gate_shares(engine: Engine) -> GateShares:
    """Every compute gate's shares by model, by the gate's id (read once per status)."""
    return {id(gate): gate.shares() for gate in engine.placements.gates()}


def devices(engine: Engine) -> tuple[DeviceStatus, ...]:
    """``status``'s devices: memory charged against the budget, and what each device
    reports of itself (its total memory, ``telemetry``)."""
    shown = []
    for id_, use in engine.memory.device_memory().items():
        reading = engine.telemetry.read(id_)
        device = engine.loaded.config.device(id_)
        shown.append(
            DeviceStatus(
                id=id_,
                kind=device.kind,
                cores=None if device.cores is None else tuple(device.cores),
                thread_budget=engine.placements.thread_budget_of(device),
                used_bytes=use.used_bytes or 0,  # (a device's: always counted)
                budget_bytes=use.budget_bytes,
                total_bytes=reading.total_bytes,
                telemetry=reading.to_dict(),
            )
        )
    return tuple(shown)


def _compute_share(name: str, model: ServedModel, shares: GateShares) -> ComputeShare:
    """``name``'s ``compute_weight`` and its share of each of its gates' compute time."""
    mine = {
        d: shares.get(id(member.gate), {}).get(name, {}).get("share", 0.0)
        for d, member in model.gates.items()
    }
    return ComputeShare(
        weight=model.spec.compute_weight,
        share=next(iter(mine.values()), 0.0),
        share_by_device={str(d): share for d, share in mine.items()},
    )
