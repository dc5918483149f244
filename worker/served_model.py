"""One configured model being served: its state machine, worker generations and admission.

Built by the registry (``supervisor.core.registry``) from a ``ModelSpec`` (``worker.model_spec``)
and kept for as long as the config declares the model; its workers come and go. What it needs comes
in as arguments: the hooks it calls on a request (``on_demand``, ``on_request``) at construction,
the device memory its budgets leave it with each ``load``. The engine calls the lifecycle methods
(one at a time per model, under ``lifecycle``): ``load`` starts every instance on its own thread (a
generation of ``worker.instances``) and returns once all are warmed up; ``unload`` lets them go;
``reinitialize`` (from the watchdog) replaces them after failures or a hang; ``stop`` ends the model
for good. ``submit`` (or ``enqueue``, for a request built by the caller) queues a request from any
thread and returns at once; the outcome arrives through the request's callback.

States::

    UNLOADED ─load→ LOADING ─→ READY ⇄ DEGRADED ─→ REINITIALIZING ─→ READY
       ↑                         │                      └─(max_restarts)→ FAILED
       └──────── UNLOADING ←─────┘ (unload, eviction)           stop → STOPPED

What ``submit`` does in each state: READY, DEGRADED, LOADING queue the request. UNLOADED
(``preload: false`` or evicted) queues it and asks for a load (``on_demand``: the background loads);
the request waits, bounded by its deadline — unless an operator unloaded the model, then it is
UNAVAILABLE. REINITIALIZING queues or refuses by ``health.while_reinitializing``. FAILED,
UNLOADING by an operator and STOPPED refuse with UNAVAILABLE and the reason. No accepted request
is ever dropped: each is answered by a worker, by expiry, or with UNAVAILABLE when it is cut.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import structlog

from duomo.ipc.errors import DeadlineExceededError, UnavailableError
from duomo.ipc.model_records import StateChange
from duomo.worker.backends.base import Backend, DeviceRoom
from duomo.worker.batch_window import BatchWindow
from duomo.worker.batcher import Batcher, IdleReader
from duomo.worker.executors.base import SlotSpec
from duomo.worker.health import RestartHistory, Verdict
from duomo.worker.instances import Instances
from duomo.worker.model_spec import (
    SERVING,
    DeviceMemoryError,
    ModelSpec,
    ModelState,
    PredictedLoads,
)
from duomo.worker.model_worker import Activity, ModelWorker
from duomo.worker.request import Outcome, Request, submit_to
from duomo.worker.stats import Buckets, ModelStats
from duomo.worker.thread_budget import ComputeGate, GateMember

log = structlog.get_logger("duomo.model")
HISTORY = 16  # state changes kept for ``status``
LOAD_BOUNDS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)  # a load, warm-up included
# the watchdog's verdicts that restart a model, as ``restart_attempts`` counts them
RESTART_CAUSES = tuple(v.value.lower() for v in Verdict if v.needs_restart)


class ServedModel:
    """One configured model being served: its state machine, its generations of instances, and
    admission of its requests."""

    def __init__(
        self,
        spec: ModelSpec,
        backend: Backend,
        gates: Mapping[int, ComputeGate] | None,
        on_demand: Callable[[ServedModel], None] | None = None,
        idle_reader: IdleReader | None = None,
        activity: Activity | None = None,
        on_request: Callable[[ServedModel], None] | None = None,
        unloaded_by_operator: bool = False,
    ) -> None:
        """``on_demand`` loads it for a waiting request (``supervisor.core.background_loads``; none:
        only an operator loads it), ``on_request`` hears of every request (the predictor), and
        ``unloaded_by_operator`` carries an operator's unload over to a model built again."""
        self.spec = spec
        # its place at each of its devices' compute gates, by device (a model built again
        # starts at the average)
        self.gates: dict[int, GateMember] = {
            device: gate.member(
                spec.name, spec.compute_weight, spec.priority, spec.priority_aging_per_s
            )
            for device, gate in (gates or {}).items()
        }
        self._on_demand = on_demand  # asks for a load of this model for a waiting request
        self._on_request = on_request  # tells the predictor (preload_policy)
        self.stats = ModelStats()
        self.window: BatchWindow | None = None  # ``max_delay_ms: auto``
        slo_ms = spec.health.slo_p99_ms
        if spec.adaptive_delay and slo_ms is not None:
            self.window = BatchWindow(
                spec.max_batch, spec.instances, slo_ms / 1e3, self.stats.recent_p99_s
            )
        self.batcher = Batcher(
            spec.name,
            spec.max_batch,
            spec.max_delay_s,
            spec.queue_size,
            aging_per_s=spec.priority_aging_per_s,
            idle_reader=idle_reader,
            window=self.window,
        )
        # its instance threads, a generation at a time
        self.instances = Instances(
            spec, backend, self.gates, self.batcher, self._batch_done, activity
        )
        self.state = ModelState.UNLOADED
        self.lifecycle = threading.RLock()  # load / unload / reinitialize / stop: one at a time
        # False once an operator unloads the model (``auto_load``)
        self._auto_load = on_demand is not None and not unloaded_by_operator
        self.last_error: str | None = None
        self.last_used_s = 0.0  # monotonic time of the last submit (LRU eviction)
        self.consecutive_failures = 0
        self.loads = 0  # successful loads (first, on demand, by an operator)
        self.evictions = 0
        self.reinitializations = 0  # since start (``restarts`` only keeps the window)
        self.load_seconds = Buckets(LOAD_BOUNDS_S)  # successful loads: the model switch latency
        self.predictions = PredictedLoads()  # preload_policy: predictive
        self.restart_attempts = dict.fromkeys(RESTART_CAUSES, 0)  # by cause, since built
        self.restarts = RestartHistory(spec.health)
        # replaced whole, never changed in place: a status reads it on another thread
        self.history: tuple[StateChange, ...] = ()
        self._pending = 0  # accepted and not yet answered: queued + being processed
        self._pending_lock = threading.Lock()
        # device memory its budgets leave it on each device, as of its last ``load``
        self._device_room: dict[int, DeviceRoom] = {}
        self._slot_spec: SlotSpec | None = None  # kept across unloads: attached clients stay
        self._payload_builder: Callable[[dict[str, np.ndarray], memoryview], Any] | None = None

    # -- state ----------------------------------------------------------------------------

    def set_state(self, state: ModelState, reason: str = "") -> None:
        if state is self.state:
            return
        previous, self.state = self.state, state
        change = StateChange(round(time.time(), 3), state.value, reason)
        self.history = (*self.history, change)[-HISTORY:]
        level = "warning" if state in (ModelState.DEGRADED, ModelState.FAILED) else "info"
        getattr(log, level)(
            "model state", model=self.spec.name, state=state.value, was=previous.value,
            reason=reason or None,
        )  # fmt: skip

    # -- loading ----------------------------------------------------------------------------

    def _start_workers(
        self, timeout_s: float, before_serving: Callable[[], None] | None = None
    ) -> None:
        """Start a new generation of instances and wait until all are warmed up (or raise);
        ``before_serving`` runs then, before any of them takes a request."""
        executor = self.instances.start(timeout_s, self._device_room, before_serving)
        if self.window is not None:
            self.window.seed(executor.warmup_costs)
        self._slot_spec = executor.slot_spec()
        self._payload_builder = executor.payload_from_slot
        self.consecutive_failures = 0
        self.last_error = None

    def load(
        self,
        timeout_s: float = 300.0,
        device_room: Mapping[int, DeviceRoom] | None = None,
        before_serving: Callable[[], None] | None = None,
    ) -> None:
        """Load and warm up every instance; a model already serving is left as it is.
        ``device_room``: on an accelerator, the device memory its budgets leave it on each of
        its devices (``MemoryLedger.rooms``; a re-initialization keeps what the load had).
        ``before_serving``: called once every instance is warmed up, before the requests
        waiting for the load run (the engine's measure of the load).

        On failure the model returns to UNLOADED (FAILED if it had failed before), requests
        that were waiting for it are answered UNAVAILABLE with the reason, and
        ``ModelLoadError`` is raised. (``DeviceMemoryError``, short of device memory for its
        budgets: they keep waiting, for the engine makes room and loads once more, and answers
        them if that fails too.)
        """
        with self.lifecycle:
            if self.state in SERVING:
                return
            if self.state is ModelState.STOPPED:
                raise UnavailableError(f"model {self.spec.name!r} is stopped")
            self._device_room = dict(device_room or {})
            before = self.state
            self.set_state(ModelState.LOADING)
            self.batcher.reopen()
            started = time.monotonic()
            try:
                self._start_workers(timeout_s, before_serving)
            except BaseException as err:
                self.last_error = str(err)
                after = ModelState.FAILED if before is ModelState.FAILED else ModelState.UNLOADED
                self.set_state(after, self.last_error)
                if after is ModelState.FAILED or not self._auto_load:
                    self.batcher.close()  # refused from now on, atomically with ``put``
                if not isinstance(err, DeviceMemoryError) or not self._auto_load:
                    self.fail_queued(f"model {self.spec.name!r} could not be loaded: {err}")
                raise
            self.restarts.clear()
            self._auto_load = self._on_demand is not None
            self.load_seconds.observe(time.monotonic() - started)
            self.loads += 1
            self.set_state(ModelState.READY)

    def unload(self, reason: str = "unloaded by the operator", by_operator: bool = True) -> int:
        """Let go of every instance and its memory and answer the queue UNAVAILABLE. Waits for
        batches in progress (a hung one is abandoned after ``exec_timeout_ms``). Unloaded by an
        operator, it stays unloaded until ``load``; otherwise (a load undone for its budget)
        the next request may load it again. Returns how many requests were answered."""
        with self.lifecycle:
            if self.state is ModelState.STOPPED:
                return 0
            if by_operator:
                self._auto_load = False
                self.batcher.close()  # refused from now on, atomically with ``put``
            cut = 0
            if self.state is not ModelState.UNLOADED:
                self.set_state(ModelState.UNLOADING, reason)
                cut = self.instances.retire()
            self.predictions.unused()
            cut += self.fail_queued(f"model {self.spec.name!r} was unloaded")
            self.set_state(ModelState.UNLOADED, reason)
            return cut

    def fail(self, reason: str) -> None:
        """FAILED until an operator loads or reloads it: instances retired, queue answered."""
        with self.lifecycle:
            self.instances.retire()
            self.last_error = reason
            self.set_state(ModelState.FAILED, reason)
            self.batcher.close()
            self.fail_queued(f"model {self.spec.name!r} failed: {reason}")

    def evict(self) -> bool:
        """Unload to make room, only if nothing is queued or in flight (atomically with
        ``submit``) and no other lifecycle step is running; True if it was unloaded. A request
        that arrives meanwhile waits and loads the model again."""
        if not self.lifecycle.acquire(blocking=False):
            return False
        try:
            with self._pending_lock:
                if self._pending or self.state not in SERVING:
                    return False
                self.set_state(ModelState.UNLOADING, "evicted to make room")
            self.instances.retire()
            self.evictions += 1
            self.predictions.unused()
            self.set_state(ModelState.UNLOADED, "evicted to make room")
            if self.pending and self._auto_load and self._on_demand is not None:
                self._on_demand(self)  # requests arrived while it unloaded: load it again
            return True
        finally:
            self.lifecycle.release()

    def fail_queued(self, why: str) -> int:
        error = UnavailableError(why)
        return sum(1 for request in self.batcher.drain() if request.complete(error=error))

    def expire_waiting(self, now: float) -> int:
        """Answer DEADLINE_EXCEEDED the queued requests whose deadline passed while the model
        had no instance to run them (loading, unloaded, re-initializing); the watchdog calls
        this, so a request waiting for a load is bounded by its deadline."""
        error = DeadlineExceededError(f"model {self.spec.name!r} was not ready before the deadline")
        return sum(1 for r in self.batcher.take_expired(now) if r.complete(error=error))

    # -- failures (watchdog) ------------------------------------------------------------------

    def _batch_done(self, worker: ModelWorker, size: int, failed: bool, seconds: float) -> None:
        """A worker finished a batch (its thread) in ``seconds`` of ``execute``; a retired
        worker's batches no longer count."""
        self.stats.record_batch(size)
        if self.window is not None and not failed:
            self.window.record_run(size, seconds)
        if worker.generation != self.batcher.generation:
            return
        self.consecutive_failures = self.consecutive_failures + 1 if failed else 0

    def reinitialize(
        self, reason: str, stop: threading.Event, cause: Verdict = Verdict.FAILING
    ) -> None:
        """Replace every instance after failures or a hang (on a watchdog thread); each attempt
        is counted in ``restart_attempts`` under its ``cause``.

        Backs off exponentially between attempts; FAILED once ``max_restarts`` restarts fall
        within ``restart_window_s``. Queued requests wait or are answered UNAVAILABLE, as
        ``health.while_reinitializing`` says; a hung worker's batch is answered at once. The
        lifecycle lock is not held during the backoff: an operator's unload, load or reload
        meanwhile takes over, and this restart then steps aside.
        """
        policy = self.spec.health
        with self.lifecycle:
            if self.state not in SERVING:
                return
            self.set_state(ModelState.DEGRADED, reason)
            self.instances.retire()  # a hung worker's batch is answered now
        while True:
            with self.lifecycle:
                if self.state not in (ModelState.DEGRADED, ModelState.REINITIALIZING):
                    return  # an operator (or shutdown) took over
                now = time.monotonic()
                if self.restarts.exhausted(now):
                    self.fail(
                        f"{reason}; gave up after {policy.max_restarts} restarts within "
                        f"{policy.restart_window_s:.0f}s"
                    )
                    return
                delay = self.restarts.next_delay_s(now)
                self.restarts.record(now)
                key = cause.value.lower()
                self.restart_attempts[key] = self.restart_attempts.get(key, 0) + 1
                self.set_state(ModelState.REINITIALIZING, reason)
                if policy.while_reinitializing == "fail":
                    self.fail_queued(f"model {self.spec.name!r} is re-initializing: {reason}")
            if stop.wait(delay):
                return  # shutting down: ``stop`` answers the queue
            with self.lifecycle:
                if self.state is not ModelState.REINITIALIZING or stop.is_set():
                    return
                try:
                    self._start_workers(timeout_s=300.0)
                except Exception as err:
                    reason = f"re-initialization failed: {err}"
                    self.last_error = reason
                    continue
                self.reinitializations += 1
                for member in self.gates.values():  # its turns start at the average standing
                    member.rejoin()
                self.set_state(ModelState.READY, "re-initialized")
                return

    # -- requests -----------------------------------------------------------------------------

    def submit(
        self,
        payload: Any,
        on_done: Callable[[Outcome], object],
        priority: int | None = None,
        deadline_s: float | None = None,
    ) -> Request:
        """Queue one request (``submit_to``); raises at once if the model refuses it or its
        queue is full. Without a ``priority``, the model's."""
        priority = self.spec.priority if priority is None else priority
        return submit_to(self.enqueue, payload, on_done, priority, deadline_s)

    def enqueue(self, request: Request) -> None:
        """Queue ``request`` (its ``enqueued_s`` is when it arrived); raises at once if the model
        refuses it or its queue is full. A worker may answer it before this returns, so the
        caller keeps whatever it needs to cancel the request before calling."""
        state = self.state
        if state not in SERVING and state is not ModelState.LOADING:
            waits = (
                self._auto_load
                if state in (ModelState.UNLOADED, ModelState.UNLOADING)
                else state is ModelState.REINITIALIZING
                and self.spec.health.while_reinitializing == "wait"
            )
            if not waits:
                raise UnavailableError(self._refusal(state))
        self.last_used_s = request.enqueued_s
        if self.predictions.awaiting:  # (one attribute read on the request's path)
            self.predictions.used()
        request.on_counted = self._count
        request.on_finished = self._finished
        with self._pending_lock:
            self._pending += 1
        try:
            displaced = self.batcher.put(request)  # wakes a worker
        except BaseException:
            request.on_counted = request.on_finished = None
            with self._pending_lock:
                self._pending -= 1
            raise
        for old, error in displaced:  # superseded by it, or made room for it
            old.complete(error=error)
        if self.state is ModelState.UNLOADED and self._auto_load and self._on_demand is not None:
            self._on_demand(self)  # read after queueing: an eviction cannot slip in between
        if self._on_request is not None:
            self._on_request(self)

    def _count(self, request: Request, outcome: Outcome) -> None:
        """A request this model queued is about to be answered (on whichever thread answers
        it): counted first, so whoever reads the metrics after the answer sees it."""
        self.stats.record(outcome, time.monotonic() - request.enqueued_s)

    def _finished(self, request: Request, outcome: Outcome) -> None:
        """A request this model queued was answered (after its callback)."""
        with self._pending_lock:
            self._pending -= 1

    def _refusal(self, state: ModelState) -> str:
        name = self.spec.name
        if state is ModelState.FAILED:
            return f"model {name!r} failed ({self.last_error}); fix it, then: duomo load {name}"
        if state in (ModelState.UNLOADED, ModelState.UNLOADING):
            return f"model {name!r} is unloaded; load it with: duomo load {name}"
        if state is ModelState.REINITIALIZING:
            return f"model {name!r} is re-initializing ({self.last_error or 'after failures'})"
        return f"model {name!r} is {state.value.lower()}"

    @property
    def reader(self) -> str:
        """The model whose idle workers may read its producers' connections: its own."""
        return self.spec.name

    @property
    def auto_load(self) -> bool:
        """Whether a request may load it (``on_demand``): not once an operator unloaded it,
        until it is loaded again."""
        return self._auto_load

    @property
    def pending(self) -> int:
        """Requests accepted and not yet answered (queued or in a batch being processed). Read
        without the lock its writers take (an int is read whole): a scrape never waits."""
        return self._pending

    def stop(self, timeout_s: float = 30.0) -> int:
        """Stop for good: refuse new requests, let the instances finish the queue within
        ``timeout_s``, then answer whatever is left UNAVAILABLE. Returns how many were cut."""
        with self.lifecycle:
            if self.state is ModelState.STOPPED:
                return 0
            self.set_state(ModelState.STOPPED)
            self.batcher.close()
            cut = self.instances.finish(timeout_s)
            return cut + self.fail_queued(f"model {self.spec.name!r} stopped")

    # -- what clients and status see ---------------------------------------------------------

    @property
    def holds_memory(self) -> bool:
        """Whether instances are (being) loaded, so budgets charge this model's footprint."""
        return self.state in SERVING or self.state in (
            ModelState.LOADING,
            ModelState.REINITIALIZING,
            ModelState.UNLOADING,
        )

    @property
    def layout_known(self) -> bool:
        """Whether clients can attach without a load: the model has been loaded once."""
        return self._slot_spec is not None

    def slot_spec(self) -> SlotSpec:
        """How a request of this model is laid out in a shared-memory slot (known once the
        model has been loaded; kept while it is unloaded)."""
        if self._slot_spec is None:
            raise UnavailableError(f"model {self.spec.name!r} has not been loaded yet")
        return self._slot_spec

    def payload_builder(self) -> Callable[[dict[str, np.ndarray], memoryview], Any]:
        """The executor's ``payload_from_slot`` (pure; any instance's will do)."""
        if self._payload_builder is None:
            raise UnavailableError(f"model {self.spec.name!r} has not been loaded yet")
        return self._payload_builder
