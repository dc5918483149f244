"""What ``status`` shows of one served model: its state, instances, queue, counters and recent
history, as the plain dict the control protocol sends (its shape is the wire's: keep it).

A read-only view over a ``ServedModel`` (``worker.served_model``), taken on the caller's thread
without the model's locks: each field is read whole, and a count read mid-change is at most one
behind. Called by the engine (``Engine.status`` adds memory, compute share and config flags).
"""

from __future__ import annotations

import time
from typing import Any

from duomo.worker.served_model import ServedModel


def instance_placements(model: ServedModel) -> list[dict[str, Any]]:
    """Each instance's device, threads, pinned cores and batches served."""
    batches = {w.index: w.batches for w in model.instances.workers}
    return [
        {
            "device": place.device,
            "intra_op_threads": place.intra_op_threads,
            "cores": list(place.cores),
            "batches": batches.get(i, 0),
        }
        for i in range(model.spec.instances)
        for place in (model.spec.placement(i),)
    ]


def model_status(model: ServedModel) -> dict[str, Any]:
    sessions = [s for on in model.instances.sessions_by_device().values() for s in on]
    depth = model.batcher.depth
    now = time.monotonic()
    return {
        "state": model.state.value,
        "instances": model.spec.instances,
        "max_batch": model.spec.max_batch,
        "batch_window_ms": (
            round(model.window.window_s * 1e3, 3) if model.window is not None else None
        ),
        "devices": list(model.spec.devices),
        "intra_op_threads": model.spec.placement(0).intra_op_threads,
        "placement": instance_placements(model),
        "queue_depth": depth,
        "in_flight": max(0, model.pending - depth),
        "io_buffer_bytes": sum(s.buffer_bytes for s in sessions),
        "io_buffer_growths": sum(s.buffer_growths for s in sessions),
        "consecutive_failures": model.consecutive_failures,
        "restarts_in_window": model.restarts.count(now),
        "loads": model.loads,
        "evictions": model.evictions,
        "reinitializations": model.reinitializations,
        "restart_attempts": dict(model.restart_attempts),
        "predictive": model.predictions.to_dict(),
        "abandoned_workers": sum(1 for w in model.instances.abandoned if w.alive),
        "last_error": model.last_error,
        "idle_s": round(now - model.last_used_s, 1) if model.last_used_s else None,
        "history": list(model.history),
        **model.stats.snapshot(),
    }
