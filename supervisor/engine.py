"""The engine: one backend init and the registry of served models, with their lifecycle.

Used by ``duomo infer`` and the benchmark in-process, and by the supervisor process as its core.
It owns the desired state (the config) and every lifecycle step across models, one at a time
(``_lifecycle``): ``start`` loads the ``preload`` models; ``load`` / ``unload`` act on one model;
``reload`` applies a new config's difference; loads on demand (``preload: false`` or evicted
models a request is waiting for), and with ``preload_policy: predictive`` loads ahead of the
request its ``TransitionModel`` expects next (``supervisor.preload``), run on a short-lived
thread. Every load is measured (``supervisor.memory``) and held to the model's
``memory_budget_mb`` and its devices' budgets, evicting least-recently-used idle ``evictable``
models on a device when it does not fit there.

Two jobs live beside it: where models compute (``supervisor.placement``: a thread plan and
compute gate per pool of cores, a gate per accelerator, each instance's device) and what memory
they are charged and which idle models make room (``supervisor.memory.MemoryLedger``, per
device).

Concurrency:

=====================  ==========================================  ==========================
thread                 runs                                         hands off through
=====================  ==========================================  ==========================
caller (any thread)    ``submit``/``infer``: validates the name,     ``Batcher.put`` (bounded,
                       queues a ``Request``                         priority heap, condition)
model instance thread  load + warm-up, then batches: prepare →      ``Request.complete`` →
(one per instance)     execute (holds the ``ComputeGate``) → post   the caller's callback /
                                                                   ``Future``
lifecycle caller       ``start``/``load``/``unload``/``reload``,    ``_lifecycle`` lock; models'
(control, on-demand)   measured, budgeted, one at a time            ``lifecycle`` locks
=====================  ==========================================  ==========================
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import structlog

from ipc.errors import (
    DuomoError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    echoed,
)
from supervisor.config import LoadedConfig, ResolvedModel
from supervisor.device_telemetry import DeviceTelemetry
from supervisor.lending import IdleSpin
from supervisor.memory import Footprint, MemoryLedger, MemoryUse, mb, resident_bytes, trim_heap
from supervisor.placement import HOST, Placements
from supervisor.preload import TransitionModel
from worker.backends import Backend, create_backend
from worker.executors.image_ops import limit_opencv_threads
from worker.model_worker import Activity
from worker.request import Outcome
from worker.served_model import SERVING, DeviceMemoryError, ModelSpec, ModelState, ServedModel
from worker.thread_budget import ComputeGate, ThreadPlan

log = structlog.get_logger("duomo.engine")
LOAD_TIMEOUT_S = 300.0


class Engine:
    def __init__(self, loaded: LoadedConfig, only: Iterable[str] | None = None) -> None:
        self.models: dict[str, ServedModel] = {}
        self.placements = Placements(loaded)  # thread plans and compute gates
        self.memory = MemoryLedger(self.models, loaded, self._release_memory)
        self.loaded = loaded
        self._wanted = list(only) if only is not None else list(loaded.models)
        self._only = only is not None  # ``duomo infer -c``: these models, loaded at once
        self._backends: dict[str, Backend] = {}
        self._lifecycle = threading.RLock()
        self._signatures: dict[str, tuple[Any, ...]] = {}  # name -> what its model was built from
        self._demand_lock = threading.Lock()
        self._demanded: set[str] = set()  # loading for a waiting request, or ahead of one
        self.predictor = TransitionModel()  # preload_policy: predictive
        self._closed = False
        self.activity = Activity()  # instances at work: an idle worker spins only while none is
        # every batcher's idle reader; its ``lending`` is the reactor's once the supervisor runs
        self.idle_spin = IdleSpin(self.activity.idle, lambda: self.loaded.config.idle_spin_us)
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
                self.models[name] = self._build(name, self.loaded)
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

    def load(self, name: str) -> dict[str, Any]:
        """Load one declared model (from UNLOADED or FAILED); its status once it is READY.

        UnavailableError with the reason if it cannot load, ResourceExhaustedError if it does
        not fit its memory budgets.
        """
        with self._lifecycle:
            self._refuse_if_closed()
            model = self.model(name)
            try:
                self._load(model)
            except (RuntimeError, ValueError) as err:
                raise UnavailableError(str(err)) from None
            return self._model_status(name, model)

    def unload(self, name: str) -> dict[str, Any]:
        """Unload one model and free its memory; it stays unloaded until ``load``."""
        with self._lifecycle:
            model = self.model(name)
            cut = model.unload()
            self._release_memory()
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
            if _device_layout(new) != _device_layout(self.loaded):
                raise InvalidArgumentError(
                    "the devices changed (ids, kinds, cores, runs_at_once or overdraft): they are "
                    "set at start; restart the supervisor to change them (a memory_budget_mb "
                    "change reloads)"
                )
            if only is not None and only not in new.models and only not in self.models:
                raise NotFoundError(f"no model named {echoed(only)} in {new.path} or being served")
            added = [n for n in names if n not in self.models]
            removed = [n for n in self.models if n not in new.models]
            changed = [
                n
                for n in names
                if n in self.models
                and (n == only or self._signature(new.models[n]) != self._signatures[n])
            ]
            if only is not None:
                added, removed, changed = (
                    [n for n in group if n == only] for group in (added, removed, changed)
                )
            plans = self.placements.replan(new, names)
            previous_plans, self.placements.plans = self.placements.plans, plans
            fresh: dict[str, ServedModel] = {}
            try:
                for name in added + changed:
                    fresh[name] = model = self._build(name, new)
                    old = self.models.get(name)
                    if old is not None and not old.auto_load:
                        model.auto_load = False  # an operator's unload still holds
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
            self.models.update(fresh)
            for name in removed:
                del self.models[name]
                self._signatures.pop(name, None)
            if only is None:
                self.loaded = new
            else:  # the rest of the running config stays as it was
                models = {n: r for n, r in self.loaded.models.items() if n != only}
                if only in new.models:
                    models[only] = new.models[only]
                self.loaded = LoadedConfig(self.loaded.path, self.loaded.config, models)
            self._wanted = list(self.models)
        for old in old_models:
            replacement = self.models.get(old.spec.name)
            if replacement is not None and old.state not in SERVING and old.pending:
                _hand_over_queue(old, replacement)  # it has no workers to finish them itself
            old.stop()  # finishes what it accepted (outside the lock: others may load)
        self._release_memory()
        summary = {"added": added, "removed": removed, "replaced": changed}
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
        for device in devices:
            memory.make_room(model, device, memory.expected(name, device, budget), exclude)
        self._release_memory()
        before = resident_bytes()
        try:
            self._load_within_room(model, budget)
        except DeviceMemoryError as short:
            try:
                if budget is not None and short.needed > budget:
                    raise ResourceExhaustedError(
                        f"model {name!r} needs {mb(short.needed)} of device memory "
                        f"(query_size), above its memory_budget_mb of {mb(budget)}"
                    ) from None
                # evict on the device that was short, then once more
                memory.make_room(model, short.device, short.needed, exclude)
                self._load_within_room(model, budget)
            except BaseException as final:  # the requests waiting for it had waited for this
                model.fail_queued(f"model {name!r} could not be loaded: {final}")
                raise
        footprint = memory.record(model, max(0, resident_bytes() - before))
        charged = {d: memory.charged(name, d) for d in devices}
        worst = max(charged, key=charged.__getitem__)
        if budget is not None and charged[worst] > budget:
            on = f" on device {worst}" if len(devices) > 1 else ""
            why = (
                f"uses {mb(charged[worst])}{on} after warm-up, above its memory_budget_mb of "
                f"{mb(budget)}"
            )
            model.fail(why)  # it would not fit on the next try either: an operator decides
            self._release_memory()
            raise ResourceExhaustedError(f"model {name!r} {why}")
        try:
            for device in devices:
                memory.make_room(model, device, charged[device], exclude)
        except ResourceExhaustedError:
            model.unload("does not fit its device's memory budget", by_operator=False)
            self._release_memory()
            raise
        log.info(
            "model loaded", model=name, host_mb=round(footprint.host_bytes / 2**20, 1),
            device_mb={d: round(b / 2**20, 1) for d, b in footprint.device_bytes.items()},
        )  # fmt: skip

    def _load_within_room(self, model: ServedModel, budget: int | None) -> None:
        """Load, telling an accelerator's sessions how much device memory the budgets leave
        them on their device (``MemoryLedger.rooms``)."""
        model.device_room_bytes = self.memory.rooms(model, budget)
        model.load(LOAD_TIMEOUT_S)

    def _on_demand(self, model: ServedModel) -> None:
        """A request waits for an unloaded model: load it on a short-lived thread (once)."""
        name = model.spec.name

        def failed(err: Exception) -> None:  # the waiting requests are answered with the reason
            log.error("load on demand failed", model=name, error=str(err))
            if model.state is ModelState.UNLOADED:
                model.fail_queued(f"model {name!r} could not be loaded: {err}")

        self._in_background(
            model, "load", lambda: self._load_keeping_what_comes_next(model), failed
        )

    def _in_background(
        self,
        model: ServedModel,
        label: str,
        load: Callable[[], None],
        failed: Callable[[Exception], None],
    ) -> None:
        """Run ``load`` under the lifecycle lock on a short-lived thread, one at a time per
        model (``_demanded``), unless the model was replaced or unloaded by an operator
        meanwhile; ``failed`` takes what it raised. Afterwards a request still waiting for the
        model, unloaded, gets a load on demand."""
        name = model.spec.name
        with self._demand_lock:
            if name in self._demanded or self._closed:
                return
            self._demanded.add(name)

        def run() -> None:
            try:
                with self._lifecycle:
                    if self.models.get(name) is model and not self._closed and model.auto_load:
                        load()
            except Exception as err:
                failed(err)
            finally:
                with self._demand_lock:
                    self._demanded.discard(name)
                if model.pending and model.state is ModelState.UNLOADED and model.auto_load:
                    self._on_demand(model)  # more arrived after a failure: try again

        threading.Thread(target=run, name=f"duomo-{label}-{name}", daemon=True).start()

    def _load_keeping_what_comes_next(self, model: ServedModel) -> None:
        """A load on demand. With ``preload_policy: predictive`` it first tries to make room
        without evicting the models likely to be asked for next, then as LRU would."""
        name = model.spec.name
        if self.loaded.config.preload_policy != "predictive":
            self._load(model)
            return
        keep = set(self._likely_next(name))
        try:
            self._load(model, keep=keep)
        except ResourceExhaustedError:
            if not keep or model.state is not ModelState.UNLOADED:
                raise
            self._load(model)

    def _predict_after(self, model: ServedModel) -> None:
        """``preload_policy: predictive``, on every request's path: learn the transition, and
        when the model changed, load in the background each unloaded model likely enough to
        come next (``predictive_threshold``)."""
        name = model.spec.name
        if self.predictor.observe(name) is None:
            return  # the same model again, or the first request
        likely = self._likely_next(name)
        for other, chance in likely.items():
            candidate = self.models.get(other)
            if (
                candidate is not None
                and candidate.state is ModelState.UNLOADED
                and candidate.auto_load
            ):
                keep = {after for after, p in likely.items() if p >= chance and after != other}
                self._preload(candidate, after=name, keep=keep | {name})

    def _likely_next(self, name: str) -> dict[str, float]:
        """The models at least ``predictive_threshold`` likely to be asked for next after
        ``name``, with their probabilities."""
        threshold = self.loaded.config.predictive_threshold
        return {n: p for n, p in self.predictor.likely_after(name).items() if p >= threshold}

    def _preload(self, model: ServedModel, after: str, keep: set[str]) -> None:
        """Load ``model`` ahead of its request on a short-lived thread (once at a time, like a
        load on demand), evicting no model in ``keep`` (``after`` and those at least as likely
        to come after it), no busy one, and never past a budget."""

        def load() -> None:
            if model.state is ModelState.UNLOADED:
                model.predicted = True  # (a request from now on is a hit)
                self._load(model, keep=keep)
                model.predicted_loads += 1

        def failed(err: Exception) -> None:  # no room (or it failed): the request will load it
            model.predicted = False
            log.info("predictive preload skipped", model=model.spec.name, after=after, why=str(err))

        self._in_background(model, "preload", load, failed)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise UnavailableError("the supervisor is shutting down")

    def _release_memory(self) -> None:
        """After models went away: backends hand back what their shared pools no longer use,
        then the C heap is trimmed."""
        for backend in list(self._backends.values()):
            backend.release_free_memory()
        trim_heap()

    # -- building ---------------------------------------------------------------------------

    def _build(self, name: str, loaded: LoadedConfig) -> ServedModel:
        resolved = loaded.models[name]
        cfg = resolved.config
        backend = self._backends.get(cfg.backend)
        if backend is None:
            backend = create_backend(cfg.backend, getattr(loaded.config.backends, cfg.backend))
            self._backends[cfg.backend] = backend
        spec = ModelSpec(
            name=name,
            task=cfg.task,
            executor=resolved.executor,
            params=resolved.params,
            files=resolved.files,
            instances=cfg.instances,
            max_batch=cfg.max_batch,
            max_delay_s=0.0 if cfg.max_delay_ms == "auto" else cfg.max_delay_ms / 1e3,
            adaptive_delay=cfg.max_delay_ms == "auto",
            queue_size=cfg.queue_size,
            priority=cfg.priority,
            priority_aging_per_s=cfg.priority_aging_per_s,
            compute_weight=cfg.compute_weight,
            health=cfg.health,
            placements=tuple(self.placements.placement(name, cfg, i) for i in range(cfg.instances)),
        )
        self._signatures[name] = self._signature(resolved)
        on_demand = None if self._only else self._on_demand
        predictive = loaded.config.preload_policy == "predictive" and not self._only
        return ServedModel(
            spec,
            backend,
            {d: self.placements.gate_for(cfg.backend, d) for d in cfg.device_ids},
            on_demand=on_demand,
            idle_reader=self.idle_spin,
            activity=self.activity,
            on_request=self._predict_after if predictive else None,
        )

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

    @staticmethod
    def _signature(resolved: ResolvedModel) -> tuple[Any, ...]:
        """What a model was built from: its entry, its executor class and its files' sizes and
        times. A user's executor module whose file changed is imported again by the config
        loader (``resolve_executor``), so its class is a new object and the model a changed one."""

        def stamp(path: Path) -> tuple[int, int]:
            try:
                st = path.stat()
            except OSError:
                return (0, 0)
            return (st.st_size, st.st_mtime_ns)

        files = tuple(sorted((role, str(p), stamp(p)) for role, p in resolved.files.items()))
        return (resolved.config, resolved.executor, files)

    def _resolved(self, name: str) -> ResolvedModel:
        return self.loaded.models[name]

    # -- requests ---------------------------------------------------------------------------

    def model(self, name: str) -> ServedModel:
        try:
            return self.models[name]
        except KeyError:
            raise NotFoundError(
                f"no model named {echoed(name)} (serving: {sorted(self.models)})"
            ) from None

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
            self.model(name).submit(payload, done, priority=priority, deadline_s=deadline_s)
        except DuomoError as err:
            if name in self.models:
                self.models[name].stats.record_refusal(err.code)
            future.set_exception(err)
        return future

    def infer(self, name: str, payload: Any, timeout_s: float | None = None) -> Any:
        return self.submit(name, payload).result(timeout_s)

    def model_memory(self, name: str, model: ServedModel) -> dict[int, MemoryUse]:
        """By device: what ``model`` is charged there against its budget (``/metrics``)."""
        return self.memory.model_memory(name, model)

    def _model_status(self, name: str, model: ServedModel) -> dict[str, Any]:
        """The model's own status with its memory against its budget and its config flags."""
        shown = model.status()
        resolved = self.loaded.models.get(name)
        last = self.memory.measured.get(name)
        use = self.memory.model_memory(name, model)
        charged = [u.used_bytes for u in use.values() if u.used_bytes is not None]
        shown["memory"] = {
            "loaded": model.holds_memory,
            "measured": last.to_dict() if last else None,
            "charged_bytes": sum(charged) if charged else None,
            "charged_bytes_by_device": {str(d): u.used_bytes for d, u in use.items()},
            "budget_bytes": next(iter(use.values())).budget_bytes,
        }
        shown["idle_spin"] = self.idle_spin.counts(name)
        shown["preload"] = resolved.config.preload if resolved else None
        shown["evictable"] = resolved.config.evictable if resolved else None
        return shown

    def device_memory(self) -> dict[int, MemoryUse]:
        """Per device: what its loaded models are charged against its budget (``/metrics``)."""
        return self.memory.device_memory()

    def devices(self) -> list[dict[str, Any]]:
        """``status``'s devices: memory charged against the budget, and what each device
        reports of itself (its total memory, ``telemetry``)."""
        shown = []
        for id_, use in self.device_memory().items():
            reading = self.telemetry.read(id_)
            device = self.loaded.config.device(id_)
            shown.append(
                {
                    "id": id_,
                    "kind": device.kind,
                    "cores": device.cores,
                    "thread_budget": self.placements.thread_budget_of(device),
                    "used_bytes": use.used_bytes,
                    "budget_bytes": use.budget_bytes,
                    "total_bytes": reading.total_bytes,
                    "telemetry": reading.to_dict(),
                }
            )
        return shown

    def status(self) -> dict[str, Any]:
        served = list(self.models.items())  # (once: a reload may change the registry meanwhile)
        models = {name: self._model_status(name, m) for name, m in served}
        shares = {id(gate): gate.shares() for gate in self.placements.gates()}
        for name, model in served:  # its share of each of its gates' compute time
            shown = models[name]
            mine = {
                d: shares.get(id(member.gate), {}).get(name, {}).get("share", 0.0)
                for d, member in model.gates.items()
            }
            shown["compute"] = {
                "weight": model.spec.compute_weight,
                "share": next(iter(mine.values()), 0.0),
                "share_by_device": {str(d): share for d, share in mine.items()},
            }
        return {
            "thread_budget": self.placements.total_budget,
            "devices": self.devices(),
            "models": models,
        }

    def close(self, grace_s: float = 30.0) -> int:
        """Stop every model (finishing queued work within ``grace_s`` in all), release the
        backends; returns how many requests were cut (answered UNAVAILABLE). A lifecycle step
        in progress (a reload's load) finishes first; later ones are refused."""
        deadline = time.monotonic() + grace_s
        with self._lifecycle:
            self._closed = True
            models = list(self.models.values())
        cut = 0
        for model in models:
            cut += model.stop(max(0.0, deadline - time.monotonic()))
        for backend in self._backends.values():
            backend.close()
        self._backends.clear()
        self.telemetry.close()
        return cut

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device_layout(loaded: LoadedConfig) -> list[dict[str, Any]]:
    """What of the devices is fixed at start: all but their memory budgets."""
    return [d.model_dump(exclude={"memory_budget_mb"}) for d in loaded.config.devices]


def _hand_over_queue(old: ServedModel, new: ServedModel) -> None:
    """Requests waiting for an unloaded model that a reload replaced go to its replacement when
    their payloads fit it (same slot layout); otherwise ``stop`` answers them UNAVAILABLE."""
    if not (old.layout_known and new.layout_known and old.slot_spec() == new.slot_spec()):
        return
    for request in old.batcher.drain():
        try:  # answered through the old request: its client's callback, its bookkeeping
            new.submit(request.payload, request.deliver, request.priority, request.deadline_s)
        except DuomoError as err:
            request.complete(error=err)
