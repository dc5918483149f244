"""The engine: the budgeted load, eviction and the in-process API over the served models.

Used by ``duomo infer`` and the benchmark in-process, and by the supervisor process as its core.
It owns the running config and every lifecycle step across models, one at a time
(``_lifecycle``): ``start`` loads the ``preload`` models; ``load`` / ``unload`` act on one model;
``reload`` applies a new config's difference. Every load (``_load``) is measured
(``supervisor.core.memory``) and held to the model's ``memory_budget_mb`` and its devices' budgets,
evicting least-recently-used idle ``evictable`` models on a device when it does not fit there;
the model is told the device memory the budgets leave it as an argument of its ``load``.

The rooms of a model's life, each its own module:

- ``supervisor.core.registry.ModelRegistry``: names → ``ServedModel``, built from the config (one
  backend per kind), a reload's difference and swap, the retired models' hand-over;
- ``supervisor.core.background_loads.BackgroundLoads``: loads on demand (a request waits for an
  unloaded model) and, with ``preload_policy: predictive``, ahead of the request its
  ``TransitionModel`` expects next, on short-lived threads; it is handed ``_load`` as a callable;
- ``worker.served_model.ServedModel``: one model's state machine, worker generations and
  admission (its instance threads: ``worker.instances``; what ``status`` shows of it:
  ``worker.model_status``);
- ``supervisor.dataflow.pipelines.ServedPipeline``: a pipeline (the config's ``pipelines:``), served
  under its name beside the models (``servable``), its steps' requests queued on them;
- ``supervisor.core.engine_status``: what ``status`` shows of the engine, its models and devices;
- ``supervisor.core.placement`` (where models compute: a thread plan and compute gate per pool of
  cores, a gate per accelerator, each instance's device) and ``supervisor.core.memory.MemoryLedger``
  (what memory models are charged, per device, and which idle ones make room).

Threads, what each owns and how they hand off: docs/architecture.md#concurrency (the one table).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import structlog

from duomo.ipc.errors import (
    DuomoError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    echoed,
)
from duomo.ipc.host_memory import resident_bytes
from duomo.ipc.model_records import ModelStatus
from duomo.supervisor.config import LoadedConfig, ResolvedModel
from duomo.supervisor.core import engine_status
from duomo.supervisor.core.background_loads import BackgroundLoads
from duomo.supervisor.core.device_telemetry import DeviceTelemetry
from duomo.supervisor.core.engine_status import EngineStatus
from duomo.supervisor.core.idle_spin import IdleSpin
from duomo.supervisor.core.memory import Footprint, MemoryLedger, MemoryUse, mb
from duomo.supervisor.core.placement import HOST, Placements
from duomo.supervisor.core.registry import ModelRegistry
from duomo.supervisor.dataflow.pipelines import ServedPipeline
from duomo.worker.executors.image_ops import limit_opencv_threads
from duomo.worker.model_spec import SERVING, DeviceMemoryError, ModelState
from duomo.worker.model_worker import Activity
from duomo.worker.request import Outcome
from duomo.worker.served_model import ServedModel
from duomo.worker.thread_budget import ComputeGate, ThreadPlan

log = structlog.get_logger("duomo.engine")
LOAD_TIMEOUT_S = 300.0


class Engine:
    """The served models and every lifecycle step across them, one at a time: the budgeted load,
    eviction, load, unload and reload, and the in-process API over them."""

    def __init__(self, loaded: LoadedConfig, only: Iterable[str] | None = None) -> None:
        self.placements = Placements(loaded)  # thread plans and compute gates
        self.activity = Activity()  # instances at work: an idle worker spins only while none is
        # every batcher's idle reader; its ``lending`` is the reactor's once the supervisor runs
        self.idle_spin = IdleSpin(self.activity.idle, lambda: self.loaded.config.idle_spin_us)
        self.registry = ModelRegistry(self.placements, self.idle_spin, self.activity)
        self.models = self.registry.models  # (the same dict, for its readers)
        self.memory = MemoryLedger(self.models, loaded, self.registry.release_memory)
        self.loaded = loaded
        # the pipelines served under their names, over the models
        # (``supervisor.dataflow.pipelines``)
        self.pipelines: dict[str, ServedPipeline] = {}
        self._wanted = _models_of(loaded, only) if only is not None else list(loaded.models)
        self._only = only is not None  # ``duomo infer -c``: these models, loaded at once
        self._lifecycle = threading.RLock()
        self.background = BackgroundLoads(
            lambda model, keep: self._load(model, keep=keep),
            self._lifecycle,
            self.models,
            lambda: self.loaded.config,
        )
        self._closed = False
        self.telemetry = DeviceTelemetry(())  # the devices' self-reports, once started

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Build every model and load the ones to preload; return once those are ready.

        Raises NotFoundError for a model name the config does not have, ValueError for a thread
        plan that cannot hold, RuntimeError (naming the model) for a model that fails to load,
        ResourceExhaustedError for a load that does not fit its memory budget.
        """
        with self._lifecycle:
            self.placements.start(self._wanted)
            limit_opencv_threads()
            for name in self._wanted:
                self.registry.add(self._build(name, self.loaded))
            self._build_pipelines(self.loaded)
            self.telemetry = DeviceTelemetry((d.id, d.kind) for d in self.loaded.config.devices)
            try:
                for name in self._wanted:
                    if self._only or self.loaded.models[name].config.preload:
                        self._load(self.models[name])
            except BaseException:
                self.close(0.0)
                raise
        log.info(
            "engine ready",
            models={n: m.state.value for n, m in self.models.items()},
            thread_budgets={str(p): plan.budget for p, plan in self.placements.plans.items()},
            threads={
                str(p): plan.threads_per_instance for p, plan in self.placements.plans.items()
            },
        )

    def load(self, name: str) -> ModelStatus:
        """Load one declared model (from UNLOADED or FAILED); its status once it is READY (with
        no compute share: the ``load`` reply's). A pipeline's name loads each of its models; the
        status is its first step's model's.

        UnavailableError with the reason if it cannot load, ResourceExhaustedError if it does
        not fit its memory budgets.
        """
        with self._lifecycle:
            self._refuse_if_closed()
            pipeline = self.pipelines.get(name)
            names = pipeline.model_names() if pipeline is not None else [name]
            models = [self.model(n) for n in names]
            try:
                for model in models:
                    self._load(model, keep=names)
            except (RuntimeError, ValueError) as err:
                raise UnavailableError(str(err)) from None
            return engine_status.model_status(self, names[0], models[0], shares=None)

    def unload(self, name: str) -> dict[str, Any]:
        """Unload one model and free its memory; it stays unloaded until ``load``."""
        with self._lifecycle:
            pipeline = self.pipelines.get(name)
            if pipeline is not None:
                raise InvalidArgumentError(
                    f"{name!r} is a pipeline; unload its models instead: {pipeline.model_names()}"
                )
            model = self.model(name)
            cut = model.unload()
            self.registry.release_memory()
            return {"model": name, "answered_unavailable": cut}

    def reload(self, new: LoadedConfig, only: str | None = None) -> dict[str, list[str]]:
        """Apply a new config: load added and changed models, swap them in, then stop the old.

        A replaced model keeps serving until its replacement is loaded and warmed up; the old
        one then finishes what it had accepted. A removed model finishes its queue and answers
        later requests NOT_FOUND. With ``only``, just that model is rebuilt (even if its entry
        did not change: its file may have). On any failure nothing changes and the error is
        raised. The thread budget and the gate stay as they were at start.
        """
        with self._lifecycle:
            self._refuse_if_closed()
            names = list(new.models)
            diff = self.registry.diff(self.loaded, new, only)
            added, removed, changed = diff.added, diff.removed, diff.changed
            plans = self.placements.replan(new, names)
            previous_plans, self.placements.plans = self.placements.plans, plans
            fresh: dict[str, ServedModel] = {}
            try:
                for name in added + changed:
                    old = self.models.get(name)
                    # an operator's unload still holds
                    held = old is not None and not old.auto_load
                    fresh[name] = model = self._build(name, new, unloaded_by_operator=held)
                    # load what serves now or has requests waiting, and what should have
                    # loaded but has not (a fixed model)
                    fresh_start = old is None or old.state is ModelState.FAILED
                    if (old is not None and (old.state in SERVING or old.pending)) or (
                        fresh_start and new.models[name].config.preload
                    ):
                        self._load(model, new.models[name])
            except BaseException:
                self.placements.plans = previous_plans
                for model in fresh.values():
                    model.stop(0.0)
                raise
            old_models = [self.models[n] for n in changed + removed]
            self.registry.swap(fresh, removed)
            if only is None:
                self.loaded = new
            else:  # the rest of the running config stays as it was
                models = {n: r for n, r in self.loaded.models.items() if n != only}
                if only in new.models:
                    models[only] = new.models[only]
                self.loaded = LoadedConfig(self.loaded.path, self.loaded.config, models)
            self._wanted = list(self.models)
            before = dict(self.pipelines)
            self._build_pipelines(self.loaded)
        self.registry.retire(old_models)  # they finish what they accepted (others may load)
        self.registry.release_memory()
        summary: dict[str, list[str]] = {"added": added, "removed": removed, "replaced": changed}
        summary["pipelines_added"] = [n for n in self.pipelines if n not in before]
        summary["pipelines_removed"] = [n for n in before if n not in self.pipelines]
        summary["pipelines_replaced"] = [
            n for n, p in self.pipelines.items() if n in before and before[n] is not p
        ]
        log.info("engine reloaded", **summary)
        return summary

    def _load(
        self,
        model: ServedModel,
        resolved: ResolvedModel | None = None,
        keep: Iterable[str] = (),
    ) -> None:
        """Load ``model`` measured and within budget, evicting idle models if needed (on each
        of its devices, only there), never those in ``keep`` (``resolved``: its config entry,
        when it is not the running config's yet)."""
        name = model.spec.name
        exclude = {name, *keep}
        if model.state in SERVING:
            return
        memory = self.memory
        budget = memory.model_budget(resolved or self._resolved(name))
        devices = model.spec.devices
        held = {d: memory.shares_held(d, without=model) for d in devices}  # by other models
        for device in devices:
            need = memory.expected(name, device, budget, held[device])
            memory.make_room(model, device, need, exclude)
        self.registry.release_memory()
        held = {d: memory.shares_held(d, without=model) for d in devices}  # evictions freed some
        before = resident_bytes()
        loaded: list[int] = []

        def measure() -> None:  # warmed up; the requests waiting for the load not run yet
            # what the load and warm-up freed (activations in the shared arena, the C heap's
            # free pages) goes back first: a model is charged what it holds while loaded,
            # which is what its unload gives back
            self.registry.release_memory()
            loaded.append(resident_bytes())

        try:
            self._load_within_room(model, budget, measure)
        except DeviceMemoryError as short:
            try:
                if budget is not None and short.needed > budget:
                    raise ResourceExhaustedError(
                        f"model {name!r} needs {mb(short.needed)} of device memory "
                        f"(query_size), above its memory_budget_mb of {mb(budget)}"
                    ) from None
                # evict on the device that was short, then once more
                memory.make_room(model, short.device, short.needed, exclude)
                self._load_within_room(model, budget, measure)
            except BaseException as final:  # the requests waiting for it had waited for this
                model.fail_queued(f"model {name!r} could not be loaded: {final}")
                raise
        held_keys = {key for on in held.values() for key in on}
        after = loaded[-1] if loaded else resident_bytes()
        footprint = memory.record(model, max(0, after - before), held_keys)
        charged = {d: memory.charged(name, d) for d in devices}
        worst = max(charged, key=charged.__getitem__)
        if budget is not None and charged[worst] > budget:
            on = f" on device {worst}" if len(devices) > 1 else ""
            why = (
                f"uses {mb(charged[worst])}{on} after warm-up, above its memory_budget_mb of "
                f"{mb(budget)}"
            )
            model.fail(why)  # it would not fit on the next try either: an operator decides
            self.registry.release_memory()
            raise ResourceExhaustedError(f"model {name!r} {why}")
        try:
            for device in devices:
                need = memory.expected(name, device, budget, held[device])
                memory.make_room(model, device, need, exclude)
        except ResourceExhaustedError:
            model.unload("does not fit its device's memory budget", by_operator=False)
            self.registry.release_memory()
            raise
        log.info(
            "model loaded", model=name, host_mb=round(footprint.host_bytes / 2**20, 1),
            device_mb={d: round(b / 2**20, 1) for d, b in footprint.device_bytes.items()},
        )  # fmt: skip

    def _load_within_room(
        self, model: ServedModel, budget: int | None, measure: Callable[[], None]
    ) -> None:
        """Load, telling an accelerator's sessions how much device memory the budgets leave
        them on their device (``MemoryLedger.rooms``); ``measure`` runs once it is warmed up,
        before it serves."""
        model.load(LOAD_TIMEOUT_S, self.memory.rooms(model, budget), measure)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise UnavailableError("the supervisor is shutting down")

    # -- building ---------------------------------------------------------------------------

    def _build(
        self, name: str, loaded: LoadedConfig, unloaded_by_operator: bool = False
    ) -> ServedModel:
        """The registry's new model for ``name``, its loads on demand and predictions ours
        (``background``), unless only named models are served (``duomo infer -c``)."""
        on_demand = None if self._only else self.background.demand
        predictive = loaded.config.preload_policy == "predictive" and not self._only
        return self.registry.build(
            name,
            loaded,
            on_demand=on_demand,
            on_request=self.background.observe if predictive else None,
            unloaded_by_operator=unloaded_by_operator,
        )

    def _build_pipelines(self, loaded: LoadedConfig) -> None:
        """Serve ``loaded``'s pipelines whose models are all served: one whose entry and whose
        models' kinds of objects did not change is kept as it is (its counts and trackers), the
        others built anew."""
        keys = {n: getattr(r.executor, "objects", None) for n, r in loaded.models.items()}
        fresh: dict[str, ServedPipeline] = {}
        for config in loaded.config.pipelines:
            if not all(step.model in self.models for step in config.steps):
                continue  # (``duomo infer -c`` of other models)
            old = self.pipelines.get(config.name)
            mine = {s.model: keys.get(s.model) for s in config.steps}
            if old is not None and old.config == config and old.objects_keys == mine:
                fresh[config.name] = old
            else:
                fresh[config.name] = ServedPipeline(config, self.models, keys)
        self.pipelines.update(fresh)  # (never empty between: a scrape may read it meanwhile)
        for name in [n for n in self.pipelines if n not in fresh]:
            del self.pipelines[name]

    @property
    def plan(self) -> ThreadPlan:
        """The thread plan of the process's shared pool of cores."""
        return self.placements.plans[HOST]

    @property
    def gate(self) -> ComputeGate:
        """The gate of the process's shared pool of cores."""
        return self.placements.cpu_gates[HOST]

    @property
    def loaded(self) -> LoadedConfig:
        """The running config (a reload replaces it; the ledger and placements follow)."""
        return self._loaded

    @loaded.setter
    def loaded(self, loaded: LoadedConfig) -> None:
        self._loaded = self.memory.loaded = self.placements.loaded = loaded

    @property
    def footprints(self) -> dict[str, Footprint]:
        """Each model's largest measured footprint (``MemoryLedger``)."""
        return self.memory.footprints

    def wake_idle(self, name: str) -> None:
        """Wake ``name``'s idle workers: a connection has become theirs to read, or the one
        borrowed has answers waiting to be sent (``Batcher.wake_idle``)."""
        model = self.models.get(name)
        if model is not None:
            model.batcher.wake_idle()

    def _resolved(self, name: str) -> ResolvedModel:
        return self.loaded.models[name]

    # -- requests ---------------------------------------------------------------------------

    def model(self, name: str) -> ServedModel:
        """The model served under ``name``; NotFoundError naming those served if none is."""
        return self.registry.model(name)

    def servable(self, name: str) -> ServedModel | ServedPipeline:
        """The model or the pipeline served under ``name``; NotFoundError naming both if none
        is."""
        pipeline = self.pipelines.get(name)
        if pipeline is not None:
            return pipeline
        if name in self.models or not self.pipelines:
            return self.registry.model(name)
        raise NotFoundError(
            f"no model or pipeline named {echoed(name)} (models: {sorted(self.models)}, "
            f"pipelines: {sorted(self.pipelines)})"
        )

    def submit(
        self, name: str, payload: Any, priority: int | None = None, deadline_s: float | None = None
    ) -> Future[Any]:
        """Queue one request; the future resolves to the result dict or raises a DuomoError."""
        future: Future[Any] = Future()

        def done(outcome: Outcome) -> None:
            if not future.set_running_or_notify_cancel():
                return  # the caller cancelled; nobody is waiting for this outcome
            if outcome.error is not None:
                future.set_exception(outcome.error)
            else:
                future.set_result(outcome.result)

        try:
            target = self.servable(name)
            target.submit(payload, done, priority=priority, deadline_s=deadline_s)
        except DuomoError as err:
            served = self.pipelines.get(name) or self.models.get(name)
            if served is not None:
                served.stats.record_refusal(err.code)
            future.set_exception(err)
        return future

    def infer(self, name: str, payload: Any, timeout_s: float | None = None) -> Any:
        return self.submit(name, payload).result(timeout_s)

    def model_memory(self, name: str, model: ServedModel) -> dict[int, MemoryUse]:
        """By device: what ``model`` is charged there against its budget (``/metrics``)."""
        return self.memory.model_memory(name, model)

    def model_status(self, name: str) -> ModelStatus:
        """``name``'s status record alone (NotFoundError when it is not served)."""
        return engine_status.model_status(
            self, name, self.model(name), engine_status.gate_shares(self)
        )

    def device_memory(self) -> dict[int, MemoryUse]:
        """Per device: what its loaded models are charged against its budget (``/metrics``)."""
        return self.memory.device_memory()

    def status(self) -> EngineStatus:
        """Its part of ``status`` (``supervisor.core.engine_status``): the thread budget, and
        each device's, model's and pipeline's record, as each owner makes it."""
        return engine_status.engine_status(self)

    def close(self, grace_s: float = 30.0) -> int:
        """Stop every model (finishing queued work within ``grace_s`` in all), release the
        backends; returns how many requests were cut (answered UNAVAILABLE). A lifecycle step
        in progress (a reload's load) finishes first; later ones are refused."""
        deadline = time.monotonic() + grace_s
        with self._lifecycle:
            self._closed = True
            self.background.close()
            models = list(self.models.values())
        cut = 0
        for model in models:
            cut += model.stop(max(0.0, deadline - time.monotonic()))
        self.registry.close_backends()
        self.telemetry.close()
        return cut

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _models_of(loaded: LoadedConfig, names: Iterable[str]) -> list[str]:
    """``names`` with each pipeline's name replaced by its models' (``duomo infer -c``)."""
    pipelines = {p.name: p for p in loaded.config.pipelines}
    wanted: list[str] = []
    for name in names:
        pipeline = pipelines.get(name)
        wanted.extend(s.model for s in pipeline.steps) if pipeline else wanted.append(name)
    return list(dict.fromkeys(wanted))
