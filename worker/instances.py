"""One served model's instance threads, a generation at a time: start a generation and wait
until every instance is warmed up, retire it (idle ones at once, busy ones after their batch),
abandon a worker whose batch hangs, and what the instances hold (their sessions).

Owned by its ``ServedModel`` (``worker.served_model``), which decides when a generation starts
and ends (load, unload, eviction, re-initialization, stop) and calls these under its
``lifecycle`` lock; the watchdog reads ``longest_batch_s``, ``status`` the workers. Invariants:
``workers`` is the current generation, all warmed up, or empty; a generation is started only
after the batcher has retired the one before (``Batcher.retire_workers``), so two never take
the same requests; an abandoned worker's batch has been answered, and it ends on its own (a
thread cannot be killed).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping

import structlog

from duomo.ipc.errors import UnavailableError
from duomo.worker.backends.base import (
    Backend,
    DeviceRoom,
    ModelSession,
    NotEnoughDeviceMemoryError,
    SessionSettings,
)
from duomo.worker.batcher import Batcher
from duomo.worker.executors.base import Executor
from duomo.worker.model_spec import DeviceMemoryError, ModelLoadError, ModelSpec
from duomo.worker.model_worker import Activity, ModelWorker
from duomo.worker.thread_budget import GateMember, pin_thread

log = structlog.get_logger("duomo.model")

BatchDone = Callable[[ModelWorker, int, bool, float], None]


class Instances:
    """One served model's instance threads, a generation at a time: started and warmed up,
    retired, a hung one abandoned."""

    def __init__(
        self,
        spec: ModelSpec,
        backend: Backend,
        gates: Mapping[int, GateMember],
        batcher: Batcher,
        batch_done: BatchDone,
        activity: Activity | None,
    ) -> None:
        self._spec = spec
        self._backend = backend
        self._gates = gates  # its model's place at each device's compute gate
        self._batcher = batcher
        self._batch_done = batch_done  # the model's (its thread): stats, window, failures
        self._activity = activity  # the process's count of instances at work
        self.workers: list[ModelWorker] = []
        self.abandoned: list[ModelWorker] = []  # hung workers let go of; they end on their own

    def _open(self, index: int, device_room: Mapping[int, DeviceRoom]) -> Executor:
        """Instance ``index``'s executor, opened on its own thread, on its device."""
        spec = self._spec
        place = spec.placement(index)
        pin_thread(place.cores)  # its thread, and the intra-op threads its sessions start
        gate = self._gates.get(place.device)
        settings = SessionSettings(
            intra_op_threads=place.intra_op_threads,
            gate=gate,
            device=place.device,
            room=device_room.get(place.device, DeviceRoom()),
            cores=place.cores,
            share_weights=spec.share_weights,
            runs_alone=gate is not None and gate.gate.runs_alone,
        )
        return spec.executor.open(spec.params, spec.files, spec.max_batch, self._backend, settings)

    def start(
        self,
        timeout_s: float,
        device_room: Mapping[int, DeviceRoom],
        before_serving: Callable[[], None] | None = None,
    ) -> Executor:
        """Start a new generation of instances, one after another, each warmed up before the
        next opens its sessions; one of their executors. ``device_room``: the device memory
        the budgets leave the model on each device; ``before_serving``: called once all are
        warmed up and before any takes a request (the engine measures the load then: a
        request waiting for the load would add its buffers to the measure). Raises
        ``ModelLoadError`` (``DeviceMemoryError`` when an instance's estimate did not fit that
        room) after retiring the generation."""
        spec = self._spec
        generation = self._batcher.retire_workers()
        serving = threading.Event()
        workers = [
            ModelWorker(
                spec.name,
                i,
                functools.partial(self._open, i, device_room),
                self._batcher,
                self._batch_done,
                generation,
                self._activity,
                serving,
            )
            for i in range(spec.instances)
        ]
        deadline = time.monotonic() + timeout_s
        error: str | None = None
        for worker in workers:  # one after another: each session's weights are measured while
            worker.start()  # no other instance of the model is warming up beside it
            if not worker.wait_ready(max(0.0, deadline - time.monotonic())):
                error = f"load timed out after {timeout_s:.0f}s"
            elif worker.load_error is not None:
                error = f"failed to load: {worker.load_error}"
            if error is not None:
                self._batcher.retire_workers()  # the loaded ones close their sessions and end
                serving.set()
                cause = worker.load_error
                if isinstance(cause, NotEnoughDeviceMemoryError):
                    raise DeviceMemoryError(spec.name, error, cause) from cause
                raise ModelLoadError(spec.name, error) from cause
        self.workers = workers
        try:
            if before_serving is not None:
                before_serving()
        finally:
            serving.set()
        return next(w.executor for w in workers if w.executor is not None)

    def retire(self) -> int:
        """End this generation of workers: idle ones at once, busy ones after their batch. One
        whose batch has run past ``exec_timeout_ms`` is abandoned (a thread cannot be killed)
        and its batch answered UNAVAILABLE. Returns how many requests that cut."""
        timeout_s = self._spec.health.exec_timeout_ms / 1e3
        self._batcher.retire_workers()
        workers, self.workers = self.workers, []
        cut = 0
        for worker in workers:
            started = worker.busy_since  # an idle worker ends at once; a hung one gets no wait
            patience = 1.0 if started is None else timeout_s - (time.monotonic() - started)
            if worker.join(max(patience, 0.0)):
                continue
            cut += self._abandon(worker, f"ran past exec_timeout_ms {timeout_s * 1e3:.0f}")
        return cut

    def finish(self, timeout_s: float) -> int:
        """Let this generation finish the queue (the batcher closed) within ``timeout_s`` in
        all, abandoning a worker still busy then; returns how many requests that cut."""
        deadline = time.monotonic() + timeout_s
        cut = 0
        for worker in self.workers:
            if not worker.join(max(0.0, deadline - time.monotonic())):
                cut += self._abandon(worker, f"cut by the {timeout_s:.0f}s stop grace period")
        self.workers = []
        return cut

    def _abandon(self, worker: ModelWorker, why: str) -> int:
        """Answer a stuck worker's batch now; its slots stay reserved until the batch ends."""
        error = UnavailableError(f"model {self._spec.name!r}: batch {why}")
        worker.abandoned = True  # first: from now on the worker reports its batch's end
        batch = worker.current
        for request in batch:
            request.abandoned = True
        cut = sum(1 for request in batch if request.complete(error=error))
        self.abandoned = [w for w in self.abandoned if w.alive] + [worker]
        log.warning("worker abandoned", model=self._spec.name, instance=worker.index, why=why)
        return cut

    def longest_batch_s(self, now: float) -> float:
        """How long the oldest batch in progress has run (the watchdog's hang check)."""
        started = [w.busy_since for w in self.workers if w.busy_since is not None]
        return now - min(started) if started else 0.0

    def sessions(self) -> list[ModelSession]:
        """Its instances' sessions, all of them."""
        return [
            s for w in self.workers if w.executor is not None for s in w.executor.sessions.values()
        ]

    def sessions_by_device(self) -> dict[int, list[ModelSession]]:
        """Its instances' sessions, by the device each instance runs on."""
        found: dict[int, list[ModelSession]] = {d: [] for d in self._spec.devices}
        for w in self.workers:
            if w.executor is not None:
                found[self._spec.placement(w.index).device].extend(w.executor.sessions.values())
        return found
