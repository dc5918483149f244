"""The engine: one backend init, the thread budgets, and the registry of served models.

Used by ``duomo infer`` and the benchmark in-process, and by the supervisor process as its core.
It owns the desired state (the config) and every lifecycle step across models, one at a time
(``_lifecycle``): ``start`` loads the ``preload`` models; ``load`` / ``unload`` act on one model;
``reload`` applies a new config's difference; loads on demand (``preload: false`` or evicted
models a request is waiting for), and with ``preload_policy: predictive`` loads ahead of the
request its ``TransitionModel`` expects next (``supervisor.preload``), run on a short-lived
thread. Every load is measured (``supervisor.memory``) and held to the model's
``memory_budget_mb`` and its devices' budgets, evicting least-recently-used idle ``evictable``
models on a device when it does not fit there.

Several devices: a model's instances are placed on its devices in turn (``Placement``); each
pool of CPU cores (the host's, and each cpu device with ``cores`` of its own) has its own thread
plan and compute gate, each accelerator its own gate; memory is charged and budgeted per device.

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
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
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
from supervisor.config import (
    DeviceConfig,
    LoadedConfig,
    ModelConfig,
    ResolvedModel,
    pool_cores,
    thread_budget,
)
from supervisor.device_telemetry import DeviceTelemetry
from supervisor.lending import IdleSpin, LentReader
from supervisor.memory import (
    Footprint,
    MemoryUse,
    Resident,
    choose_victims,
    mb,
    resident_bytes,
    trim_heap,
)
from supervisor.preload import TransitionModel
from worker.backends import Backend, create_backend
from worker.backends.base import NotEnoughDeviceMemory
from worker.executors.image_ops import limit_opencv_threads
from worker.model_worker import Activity
from worker.request import Outcome
from worker.served_model import SERVING, ModelSpec, ModelState, Placement, ServedModel
from worker.thread_budget import ComputeGate, InstanceDemand, ThreadPlan, plan_threads

log = structlog.get_logger("duomo.engine")
LOAD_TIMEOUT_S = 300.0
Pool = int | None  # a pool of cores: a cpu device's own (its id), or the host's shared one
HOST: Pool = None


class Engine:
    def __init__(self, loaded: LoadedConfig, only: Iterable[str] | None = None) -> None:
        self.loaded = loaded
        self._wanted = list(only) if only is not None else list(loaded.models)
        self._only = only is not None  # ``duomo infer -c``: these models, loaded at once
        self.models: dict[str, ServedModel] = {}
        self._backends: dict[str, Backend] = {}
        # per pool of cores (the host's, and each cpu device with cores of its own): its thread
        # plan, and its gate, which every ONNX Runtime run on those cores holds
        self.plans: dict[Pool, ThreadPlan] = {HOST: ThreadPlan(1, {}, {})}
        self.cpu_gates: dict[Pool, ComputeGate] = {HOST: ComputeGate(1)}
        self._device_gates: dict[int, ComputeGate] = {}  # an accelerator's, for the ACL backend
        self._lifecycle = threading.RLock()
        self._signatures: dict[str, tuple[Any, ...]] = {}  # name -> what its model was built from
        self.footprints: dict[str, Footprint] = {}  # the largest measured, kept across unloads
        self._measured: dict[str, Footprint] = {}  # the last measurement
        self._demand_lock = threading.Lock()
        self._demanded: set[str] = set()  # loading for a waiting request, or ahead of one
        self.predictor = TransitionModel()  # preload_policy: predictive
        self._closed = False
        self.activity = Activity()  # instances at work: an idle worker spins only while none is
        # every batcher's idle reader: the reactor's lending once it runs (``idle_reader``)
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
            self.plans = plan_for(self.loaded, self._wanted)
            self.cpu_gates = {
                pool: ComputeGate(plan.budget, self._cpu_overdraft(pool))
                for pool, plan in self.plans.items()
            }
            self._device_gates = {
                d.id: ComputeGate(d.runs_at_once or 1, d.overdraft)
                for d in self.loaded.config.devices
                if d.kind != "cpu"
            }
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
            thread_budgets={str(p): plan.budget for p, plan in self.plans.items()},
            threads={str(p): plan.threads_per_instance for p, plan in self.plans.items()},
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
            plans = plan_for(new, names, {p: plan.budget for p, plan in self.plans.items()})
            previous_plans, self.plans = self.plans, plans
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
                self.plans = previous_plans
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
        resolved = resolved or self._resolved(name)
        devices = model.spec.devices
        kind = self._device_kind(devices[0])  # (one model's devices are of one kind)
        budget = self._model_budget(resolved)
        expected = self.footprints.get(name)
        for device in devices:
            need = expected.charged_on(device, kind) if expected else (budget or 0)
            self._make_room(model, device, need, exclude=exclude)
        self._release_memory()
        before = resident_bytes()
        try:
            self._load_within_room(model, kind, budget)
        except RuntimeError as err:
            short = err.__cause__
            if not isinstance(short, NotEnoughDeviceMemory):
                raise
            try:
                if budget is not None and short.needed > budget:
                    raise ResourceExhaustedError(
                        f"model {name!r} needs {mb(short.needed)} of device memory "
                        f"(query_size), above its memory_budget_mb of {mb(budget)}"
                    ) from None
                # evict on the device that was short, then once more
                self._make_room(model, short.device, short.needed, exclude=exclude)
                self._load_within_room(model, kind, budget)
            except BaseException as final:  # the requests waiting for it had waited for this
                model.fail_queued(f"model {name!r} could not be loaded: {final}")
                raise
        host = max(0, resident_bytes() - before)
        footprint = Footprint(
            host,
            {d: sum(s.device_bytes for s in on) for d, on in model.sessions_by_device().items()},
            Counter(model.spec.placement(i).device for i in range(model.spec.instances)),
        )
        self._measured[name] = footprint
        self.footprints[name] = footprint.largest(self.footprints.get(name))
        charged = {d: footprint.charged_on(d, kind) for d in devices}
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
                self._make_room(model, device, charged[device], exclude=exclude)
        except ResourceExhaustedError:
            model.unload("does not fit its device's memory budget", by_operator=False)
            self._release_memory()
            raise
        log.info(
            "model loaded", model=name, host_mb=round(host / 2**20, 1),
            device_mb={d: round(b / 2**20, 1) for d, b in footprint.device_bytes.items()},
        )  # fmt: skip

    def _load_within_room(self, model: ServedModel, kind: str, budget: int | None) -> None:
        """Load, telling an accelerator's sessions how much device memory the budgets leave
        them on their device (the ACL backend compares it with ``query_size`` before it
        allocates anything)."""
        rooms: dict[int, int | None] = {}
        for device in model.spec.devices if kind not in ("cpu", "cuda") else ():
            limits = [budget] if budget is not None else []
            device_budget = self._device_budget(device)
            if device_budget is not None:
                limits.append(device_budget - sum(self._loaded_on(model, device).values()))
            rooms[device] = max(0, min(limits)) if limits else None
        model.device_room_bytes = rooms
        model.load(LOAD_TIMEOUT_S)

    def _loaded_on(self, model: ServedModel, device: int) -> dict[str, int]:
        """Bytes charged on ``device`` to each other model loaded there (a model being replaced
        is still here, under its name)."""
        kind = self._device_kind(device)
        return {
            n: self._charged(n, device, kind)
            for n, m in self.models.items()
            if device in m.spec.devices and m is not model and m.holds_memory
        }

    def _make_room(self, model: ServedModel, device: int, need: int, exclude: set[str]) -> None:
        """Evict idle evictable models on ``device`` until ``model``'s ``need`` bytes there fit
        the device's budget next to the others; ResourceExhaustedError if they cannot."""
        budget = self._device_budget(device)
        if budget is None:
            return
        for _attempt in range(3):  # a candidate may turn busy between the choice and the evict
            charged = self._loaded_on(model, device)
            loaded = {n: self.models[n] for n in charged}
            used = sum(charged.values())
            over = used + need - budget
            if over <= 0:
                return
            candidates = [
                Resident(
                    n,
                    charged[n],
                    m.last_used_s,
                    self._resolved(n).config.evictable,
                    m.pending == 0,
                )
                for n, m in loaded.items()
                if n not in exclude and m.state in SERVING
            ]
            victims = choose_victims(candidates, over)
            if victims is None:
                break
            evicted = [v.name for v in victims if self.models[v.name].evict()]
            self._release_memory()
            log.info("evicted to make room", model=model.spec.name, device=device, evicted=evicted)
            if len(evicted) == len(victims):
                return
        busy = [c.name for c in candidates if c.evictable and not c.idle]
        raise ResourceExhaustedError(
            f"model {model.spec.name!r} needs {mb(need)} on device {device}, whose budget is "
            f"{mb(budget)}: {sorted(loaded)} use {mb(used)}, and evicting idle evictable models "
            f"cannot free the {mb(over)} missing" + (f" (busy now: {sorted(busy)})" if busy else "")
        )

    def _charged(self, name: str, device: int, kind: str) -> int:
        """What ``name`` is charged on ``device``: its largest measured load there, or before
        it was ever measured its ``memory_budget_mb``."""
        found = self.footprints.get(name)
        if found is not None:
            return found.charged_on(device, kind)
        resolved = self.loaded.models.get(name)
        return (self._model_budget(resolved) if resolved else None) or 0

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
            placements=tuple(self._placement(name, cfg, i) for i in range(cfg.instances)),
        )
        self._signatures[name] = self._signature(resolved)
        on_demand = None if self._only else self._on_demand
        predictive = loaded.config.preload_policy == "predictive" and not self._only
        return ServedModel(
            spec,
            backend,
            {device: self._gate_for(cfg.backend, device) for device in cfg.device_ids},
            on_demand=on_demand,
            idle_reader=self.idle_spin,
            activity=self.activity,
            on_request=self._predict_after if predictive else None,
        )

    def _placement(self, name: str, cfg: ModelConfig, index: int) -> Placement:
        """Instance ``index``'s device (round-robin over the model's), the intra-op threads its
        pool's plan gives it, and the cores its threads are pinned to (``pool_cores``)."""
        device = self._device(cfg.instance_device(index))
        pool = pool_of(device)
        threads = self.plans.get(pool, self.plans[HOST]).threads_per_instance.get(name, 1)
        cores = pool_cores(self.loaded.config, device if pool is not HOST else None)
        return Placement(device.id, threads, cores)

    def _gate_for(self, backend: str, device: int) -> ComputeGate:
        """ONNX Runtime's runs share their pool of cores' gate (its thread budget); the ACL
        backend's share their device's."""
        if backend == "acl" and device in self._device_gates:
            return self._device_gates[device]
        return self.cpu_gates.get(pool_of(self._device(device)), self.cpu_gates[HOST])

    def _cpu_overdraft(self, pool: Pool) -> int:
        devices = self.loaded.config.devices
        return next((d.overdraft for d in devices if d.kind == "cpu" and pool_of(d) == pool), 1)

    @property
    def plan(self) -> ThreadPlan:
        """The thread plan of the process's shared pool of cores."""
        return self.plans[HOST]

    @property
    def gate(self) -> ComputeGate:
        """The gate of the process's shared pool of cores."""
        return self.cpu_gates[HOST]

    def wake_idle(self, name: str) -> None:
        """Wake ``name``'s idle workers: a connection has become theirs to read, or the one
        borrowed has answers waiting to be sent (``Batcher.wake_idle``)."""
        model = self.models.get(name)
        if model is not None:
            model.batcher.wake_idle()

    @property
    def idle_reader(self) -> LentReader | None:
        """The reactor's lending (``Lending.read_when_idle``), set by the supervisor while its
        reactor runs: the models' idle workers then read their producers themselves."""
        return self.idle_spin.lending

    @idle_reader.setter
    def idle_reader(self, lending: LentReader | None) -> None:
        self.idle_spin.lending = lending

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

    def _device(self, device: int) -> DeviceConfig:
        found = next((d for d in self.loaded.config.devices if d.id == device), None)
        return found if found is not None else DeviceConfig(id=device)

    def _device_kind(self, device: int) -> str:
        return self._device(device).kind

    def _device_budget(self, device: int) -> int | None:
        budget_mb = self._device(device).memory_budget_mb
        return None if budget_mb is None else budget_mb * 2**20

    @staticmethod
    def _model_budget(resolved: ResolvedModel) -> int | None:
        mb_ = resolved.config.memory_budget_mb
        return None if mb_ is None else mb_ * 2**20

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
        """By device: the bytes charged to ``model`` there (its largest measured load, on the
        device's terms, whether loaded now or not) against its ``memory_budget_mb``."""
        largest = self.footprints.get(name)
        resolved = self.loaded.models.get(name)
        budget = self._model_budget(resolved) if resolved else None
        return {
            d: MemoryUse(largest.charged_on(d, self._device_kind(d)) if largest else None, budget)
            for d in model.spec.devices
        }

    def _model_status(self, name: str, model: ServedModel) -> dict[str, Any]:
        """The model's own status with its memory against its budget and its config flags."""
        shown = model.status()
        resolved = self.loaded.models.get(name)
        last = self._measured.get(name)
        use = self.model_memory(name, model)
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
        """Per configured device id: the bytes charged to its loaded models against its budget."""
        shown = {}
        for device in self.loaded.config.devices:
            used = sum(
                self._charged(n, device.id, device.kind)
                for n, m in list(self.models.items())
                if device.id in m.spec.devices and m.holds_memory
            )
            shown[device.id] = MemoryUse(used, self._device_budget(device.id))
        return shown

    def devices(self) -> list[dict[str, Any]]:
        """``status``'s devices: memory charged against the budget, and what each device
        reports of itself (its total memory, ``telemetry``)."""
        shown = []
        for id_, use in self.device_memory().items():
            reading = self.telemetry.read(id_)
            device = self._device(id_)
            pool = self.plans.get(pool_of(device)) if device.kind == "cpu" else None
            shown.append(
                {
                    "id": id_,
                    "kind": device.kind,
                    "cores": device.cores,
                    "thread_budget": pool.budget if pool is not None else None,
                    "used_bytes": use.used_bytes,
                    "budget_bytes": use.budget_bytes,
                    "total_bytes": reading.total_bytes,
                    "telemetry": reading.to_dict(),
                }
            )
        return shown

    def status(self) -> dict[str, Any]:
        models = {name: self._model_status(name, m) for name, m in list(self.models.items())}
        gates = {id(g): g for g in (*self.cpu_gates.values(), *self._device_gates.values())}
        shares = {key: gate.shares() for key, gate in gates.items()}
        for name, shown in models.items():  # its share of each of its gates' compute time
            model = self.models[name]
            mine = {
                d: shares.get(id(member.gate), {}).get(name, {}).get("share", 0.0)
                for d, member in model.gates.items()
            }
            shown["compute"] = {
                "weight": model.spec.compute_weight,
                "share": next(iter(mine.values()), 0.0),
                "share_by_device": {str(d): share for d, share in mine.items()},
            }
        budget = sum(plan.budget for plan in self.plans.values())
        return {"thread_budget": budget, "devices": self.devices(), "models": models}

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


def pool_of(device: DeviceConfig) -> Pool:
    """The pool of cores a device's ONNX Runtime threads come from: its own if it has cores,
    else the host's."""
    return device.id if device.kind == "cpu" and device.cores is not None else HOST


def plan_for(
    loaded: LoadedConfig, names: list[str], budgets: Mapping[Pool, int] | None = None
) -> dict[Pool, ThreadPlan]:
    """The thread plan of each pool of cores for ``names`` of ``loaded``: a pool's budget
    (``budgets``, else ``supervisor.config.thread_budget``) split over the instances placed
    there of the models that compute on the CPU. Used by the engine at start and on reload,
    and by the benchmark's in-process modes."""
    for name in names:
        if name not in loaded.models:
            raise NotFoundError(
                f"no model named {name!r} in {loaded.path} (have: {sorted(loaded.models)})"
            )
    config = loaded.config
    devices = {d.id: d for d in config.devices}
    pools: dict[Pool, list[InstanceDemand]] = {HOST: []}
    pools.update((d.id, []) for d in config.devices if pool_of(d) is not HOST)
    for name in names:
        cfg = loaded.models[name].config
        if cfg.backend != "onnxruntime":  # CPU threads for the models computing on the CPU
            continue
        placed = Counter(pool_of(devices[cfg.instance_device(i)]) for i in range(cfg.instances))
        for pool, instances in placed.items():
            pools[pool].append(InstanceDemand(name, instances, cfg.intra_op_threads))
    budgets = budgets or {}

    def budget(pool: Pool) -> int:
        return budgets.get(pool) or thread_budget(config, None if pool is None else devices[pool])

    return {pool: plan_threads(demands, budget(pool)) for pool, demands in pools.items()}
