"""One configured model being served: its batcher, its instance threads and its statistics.

Created by the engine from a ``ModelSpec``; ``start`` loads every instance on its own thread (in
parallel) and returns once all are ready, or raises with the first load error. ``submit`` queues a
request and returns at once; the outcome arrives through the request's callback.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from ipc.errors import UnavailableError
from worker.backends.base import Backend, ModelSession, SessionSettings
from worker.batcher import Batcher
from worker.config_model import StrictModel
from worker.executors.base import Executor, SlotSpec
from worker.model_worker import ModelWorker
from worker.request import Outcome, Request
from worker.stats import ModelStats
from worker.thread_budget import ComputeGate


class ModelState(str, Enum):
    NEW = "NEW"
    LOADING = "LOADING"
    READY = "READY"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"


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
    queue_size: int = 64
    priority: int = 0
    priority_aging_per_s: float = 0.0
    intra_op_threads: int = 1
    device: int = 0


class ServedModel:
    def __init__(self, spec: ModelSpec, backend: Backend, gate: ComputeGate | None) -> None:
        self.spec = spec
        self._backend = backend
        self._gate = gate
        self.stats = ModelStats()
        self.batcher = Batcher(
            spec.name,
            spec.max_batch,
            spec.max_delay_s,
            spec.queue_size,
            aging_per_s=spec.priority_aging_per_s,
        )
        self.workers: list[ModelWorker] = []
        self.state = ModelState.NEW
        self._pending = 0  # accepted and not yet answered: queued + being processed
        self._pending_lock = threading.Lock()

    def _load_executor(self) -> Executor:
        settings = SessionSettings(
            intra_op_threads=self.spec.intra_op_threads, gate=self._gate, device=self.spec.device
        )
        sessions: dict[str, ModelSession] = {}
        try:
            for role in self.spec.executor.roles:
                session = sessions[role] = self._backend.open(self.spec.files[role], settings)
                if session.max_rows is not None and self.spec.max_batch > session.max_rows:
                    raise RuntimeError(
                        f"max_batch {self.spec.max_batch} is above the {session.max_rows} rows "
                        f"{session.path.name} takes per run; lower max_batch or rebuild the model"
                    )
            return self.spec.executor(self.spec.params, sessions, self.spec.max_batch)
        except BaseException:
            for session in sessions.values():
                session.close()
            raise

    def start(self, timeout_s: float = 300.0) -> None:
        self.state = ModelState.LOADING
        self.workers = [
            ModelWorker(
                self.spec.name, i, self._load_executor, self.batcher, self.stats.record_batch
            )
            for i in range(self.spec.instances)
        ]
        for worker in self.workers:
            worker.start()
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            if not worker.wait_ready(max(0.0, deadline - time.monotonic())):
                self.stop()
                raise RuntimeError(f"model {self.spec.name!r}: load timed out after {timeout_s}s")
            if worker.load_error is not None:
                self.stop()
                err = worker.load_error
                raise RuntimeError(f"model {self.spec.name!r} failed to load: {err}") from err
        self.state = ModelState.READY

    def submit(
        self,
        payload: Any,
        on_done: Callable[[Outcome], None],
        priority: int | None = None,
        deadline_s: float | None = None,
        accepted: Callable[[Request], None] | None = None,
    ) -> Request:
        """Queue one request; raises at once if the model is not ready or its queue is full.

        ``accepted`` sees the request before it is queued (a worker may answer it at once).
        """
        if self.state is not ModelState.READY:
            raise UnavailableError(f"model {self.spec.name!r} is {self.state.value.lower()}")
        start = time.monotonic()

        def done(outcome: Outcome) -> None:
            on_done(outcome)  # the caller first: bookkeeping is off the answer's path
            with self._pending_lock:
                self._pending -= 1
            self.stats.record(outcome, time.monotonic() - start)

        request = Request(
            payload=payload,
            on_done=done,
            priority=self.spec.priority if priority is None else priority,
            deadline_s=deadline_s,
            enqueued_s=start,
        )
        with self._pending_lock:
            self._pending += 1
        if accepted is not None:
            accepted(request)
        try:
            self.batcher.put(request)  # wakes a worker: nothing after this on the caller's path
        except BaseException:
            with self._pending_lock:
                self._pending -= 1
            raise
        return request

    @property
    def pending(self) -> int:
        """Requests accepted and not yet answered (queued or in a batch being processed)."""
        with self._pending_lock:
            return self._pending

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop accepting, let the instances finish what is queued, then fail what is left."""
        if self.state in (ModelState.STOPPED, ModelState.NEW):
            self.state = ModelState.STOPPED
            return
        self.state = ModelState.STOPPING
        self.batcher.close()
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for request in self.batcher.drain():
            request.complete(error=UnavailableError(f"model {self.spec.name!r} stopped"))
        self.state = ModelState.STOPPED

    def _any_executor(self) -> Executor:
        ready = next((w.executor for w in self.workers if w.executor is not None), None)
        if ready is None:
            raise UnavailableError(f"model {self.spec.name!r} has no loaded instance")
        return ready

    def slot_spec(self) -> SlotSpec:
        """How a request of this model is laid out in a shared-memory slot."""
        return self._any_executor().slot_spec()

    def payload_builder(self) -> Callable[[dict[str, np.ndarray], memoryview], Any]:
        """The executor's ``payload_from_slot`` (pure; any instance's will do)."""
        return self._any_executor().payload_from_slot

    def status(self) -> dict[str, Any]:
        sessions = [
            s for w in self.workers if w.executor is not None for s in w.executor.sessions.values()
        ]
        depth = self.batcher.depth
        return {
            "state": self.state.value,
            "instances": self.spec.instances,
            "max_batch": self.spec.max_batch,
            "intra_op_threads": self.spec.intra_op_threads,
            "queue_depth": depth,
            "in_flight": max(0, self.pending - depth),
            "io_buffer_bytes": sum(s.buffer_bytes for s in sessions),
            "io_buffer_growths": sum(s.buffer_growths for s in sessions),
            **self.stats.snapshot(),
        }
