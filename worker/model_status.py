"""What ``status`` shows of one served model: its state, instances, queue, counters, recent
history and its streams' load, as its ``ModelStatus`` record (``ipc.model_records``), which
travels as a record up to the wire.

A read-only view over a ``ServedModel`` (``worker.served_model``), taken on the caller's thread
without the model's locks: each field is read whole, and a count read mid-change is at most one
behind. Called by the engine (``Engine.model_status`` hands it what the engine keeps: memory,
idle spin, config flags and compute share); ``stream_capacity`` also by the metrics scrape
(``supervisor.operators.metrics``).
"""

from __future__ import annotations

import math
import time

from duomo.ipc.model_records import (
    ComputeShare,
    ModelCapacity,
    ModelMemory,
    ModelStatus,
    Placement,
)
from duomo.worker.galleries.session import GallerySession
from duomo.worker.served_model import ServedModel


def stream_capacity(model: ServedModel, now: float) -> ModelCapacity:
    """What its streams offer it against what it serves them (``worker.stream_load``'s
    reading, in the state last checked), the median time a batch takes (S), and the age bound
    that follows for a ``latest`` stream's answers: the frame the model takes at the stream's
    turn is its newest, so it waited at most one frame period P, or, for a camera slower than
    the turns come round, the streams ahead of it in the round-robin: ⌈N ÷ (instances ×
    max_batch)⌉ batches, the one running among them; then its own batch and at most one batch
    window. That is S + min(P, ⌈N ÷ lanes⌉ × S) + window; shown at its worst over the frame
    rates, (⌈N ÷ lanes⌉ + 1) × S + window (``ipc.model_records.ModelCapacity``'s fields;
    docs/streams.md has the measured ages)."""
    reading = model.stats.streams.read(now)
    service_s = model.stats.recent_service_s()
    bound_ms = None
    if reading.streams and service_s is not None:
        lanes = model.spec.instances * model.spec.max_batch
        window_s = model.window.window_s if model.window is not None else model.spec.max_delay_s
        turns = math.ceil(len(reading.streams) / lanes) + 1
        bound_ms = round((turns * service_s + window_s) * 1e3, 3)
    return ModelCapacity(
        state=reading.state,
        offered_fps=reading.offered_fps,
        served_fps=reading.served_fps,
        lost_fps=reading.lost_fps,
        service_ms=None if service_s is None else round(service_s * 1e3, 3),
        age_bound_ms=bound_ms,
        streams=reading.streams,
    )


def instance_placements(model: ServedModel) -> tuple[Placement, ...]:
    """Each instance's device, threads, pinned cores and batches served."""
    batches = {w.index: w.batches for w in model.instances.workers}
    return tuple(
        Placement(
            device=place.device,
            intra_op_threads=place.intra_op_threads,
            cores=tuple(place.cores),
            batches=batches.get(i, 0),
        )
        for i in range(model.spec.instances)
        for place in (model.spec.placement(i),)
    )


def model_status(
    model: ServedModel,
    *,
    memory: ModelMemory,
    idle_spin: dict[str, int],
    preload: bool | None,
    evictable: bool | None,
    compute: ComputeShare | None = None,
) -> ModelStatus:
    """The model's status record. What the engine keeps of it comes in as arguments: its
    ``memory`` against its budget (the memory ledger's), its idle workers' ``idle_spin`` counts,
    its config flags (None: no longer in the config) and its share of its compute gates'
    time (None: the ``load`` reply's, which has none)."""
    sessions = model.instances.sessions()
    depth = model.batcher.depth
    now = time.monotonic()
    figures = model.stats.snapshot()
    return ModelStatus(
        state=model.state.value,
        instances=model.spec.instances,
        max_batch=model.spec.max_batch,
        batch_window_ms=(
            round(model.window.window_s * 1e3, 3) if model.window is not None else None
        ),
        devices=tuple(model.spec.devices),
        intra_op_threads=model.spec.placement(0).intra_op_threads,
        placement=instance_placements(model),
        queue_depth=depth,
        in_flight=max(0, model.pending - depth),
        io_buffer_bytes=sum(s.memory.buffer_bytes for s in sessions),
        io_buffer_growths=sum(s.memory.buffer_growths for s in sessions),
        consecutive_failures=model.consecutive_failures,
        restarts_in_window=model.restarts.count(now),
        loads=model.loads,
        evictions=model.evictions,
        reinitializations=model.reinitializations,
        restart_attempts=dict(model.restart_attempts),
        predictive=model.predictions.to_dict(),
        abandoned_workers=sum(1 for w in model.instances.abandoned if w.alive),
        last_error=model.last_error,
        idle_s=round(now - model.last_used_s, 1) if model.last_used_s else None,
        history=model.history,
        requests=figures.requests,
        outcomes=figures.outcomes,
        refused=figures.refused,
        latency=figures.latency,
        batch_sizes=figures.batch_sizes,
        totals=figures.totals,
        memory=memory,
        idle_spin=idle_spin,
        preload=preload,
        evictable=evictable,
        capacity=stream_capacity(model, now),
        compute=compute,
        gallery=GallerySession.served(sessions),
    )
