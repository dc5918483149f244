"""The in-process engine: one backend init, one thread budget, one ``ServedModel`` per model.

Used by ``duomo infer`` and the benchmark today, and by the supervisor process as its core.
``start`` loads every model in parallel (each instance on its own thread) and returns when all
are ready; ``submit``/``infer`` reach a model by name; ``close`` stops models and backends.

Concurrency:

=====================  ==========================================  ==========================
thread                 runs                                         hands off through
=====================  ==========================================  ==========================
caller (any thread)    ``submit``/``infer``: validates the name,     ``Batcher.put`` (bounded,
                       queues a ``Request``                         priority heap, condition)
model instance thread  load + warm-up, then batches: prepare →      ``Request.complete`` →
(one per instance)     execute (holds the ``ComputeGate``) → post   the caller's callback /
                                                                   ``Future``
=====================  ==========================================  ==========================
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import structlog

from ipc.errors import DuomoError, NotFoundError
from supervisor.config import LoadedConfig
from worker.backends import Backend, create_backend
from worker.executors.image_ops import limit_opencv_threads
from worker.request import Outcome
from worker.served_model import ModelSpec, ServedModel
from worker.thread_budget import (
    ComputeGate,
    InstanceDemand,
    ThreadPlan,
    available_cores,
    plan_threads,
)

log = structlog.get_logger("duomo.engine")


class Engine:
    def __init__(self, loaded: LoadedConfig, only: Iterable[str] | None = None) -> None:
        self.loaded = loaded
        self._wanted = list(only) if only is not None else list(loaded.models)
        self.models: dict[str, ServedModel] = {}
        self._backends: dict[str, Backend] = {}
        self.plan = ThreadPlan(budget=1, threads_per_instance={}, instances={})
        self.gate = ComputeGate(1)

    def start(self) -> None:
        """Load every model in parallel; return once all are ready, raise the first failure.

        Raises NotFoundError for a model name the config does not have, ValueError for a thread
        plan that cannot hold, RuntimeError (naming the model) for a model that fails to load.
        """
        self.plan = self._plan(self.loaded, self._wanted)
        self.gate = ComputeGate(self.plan.budget)
        limit_opencv_threads()
        fresh = {name: self._build(name, self.loaded) for name in self._wanted}
        self._start_all(fresh)
        self.models.update(fresh)
        log.info(
            "engine ready",
            models=list(self.models),
            thread_budget=self.plan.budget,
            threads=self.plan.threads_per_instance,
        )

    def reload(self, new: LoadedConfig) -> dict[str, list[str]]:
        """Apply a new config: load added and changed models, swap them in, then stop the old.

        A replaced model keeps serving until its replacement is ready; the old one then drains
        its queue. On any load failure nothing changes and the error is raised. The thread budget
        and the gate stay as they were at start (sessions cannot change their thread pools).
        """
        names = list(new.models)
        added = [n for n in names if n not in self.models]
        removed = [n for n in self.models if n not in new.models]
        changed = [
            n
            for n in names
            if n in self.models
            and (
                new.models[n].config != self.loaded.models[n].config
                or new.models[n].files != self.loaded.models[n].files
            )
        ]
        plan = self._plan(new, names, budget=self.plan.budget)
        previous_plan, self.plan = self.plan, plan
        try:
            fresh = {n: self._build(n, new) for n in added + changed}
            self._start_all(fresh)
        except BaseException:
            self.plan = previous_plan
            raise
        old = [self.models[n] for n in changed + removed]
        self.models.update(fresh)
        for n in removed:
            del self.models[n]
        self.loaded, self._wanted = new, names
        for model in old:
            model.stop()
        summary = {"added": added, "removed": removed, "replaced": changed}
        log.info("engine reloaded", **summary)
        return summary

    def _plan(
        self, loaded: LoadedConfig, names: list[str], budget: int | None = None
    ) -> ThreadPlan:
        for name in names:
            if name not in loaded.models:
                raise NotFoundError(
                    f"no model named {name!r} in {loaded.path} (have: {sorted(loaded.models)})"
                )
        if budget is None:
            budget = loaded.config.backends.onnxruntime.thread_budget or available_cores()
        demands = [  # CPU threads are planned for the models that compute on the CPU's cores
            InstanceDemand(
                n, loaded.models[n].config.instances, loaded.models[n].config.intra_op_threads
            )
            for n in names
            if loaded.models[n].config.backend == "onnxruntime"
        ]
        return plan_threads(demands, budget)

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
            max_delay_s=cfg.max_delay_ms / 1e3,
            queue_size=cfg.queue_size,
            priority=cfg.priority,
            priority_aging_per_s=cfg.priority_aging_per_s,
            intra_op_threads=self.plan.threads_per_instance.get(name, 1),
            device=cfg.device,
        )
        return ServedModel(spec, backend, self.gate)

    @staticmethod
    def _start_all(models: dict[str, ServedModel]) -> None:
        """Start models in parallel; if any fails, stop all of them and raise the first error."""
        errors: list[BaseException] = []
        lock = threading.Lock()

        def load(model: ServedModel) -> None:
            try:
                model.start()
            except BaseException as err:
                with lock:
                    errors.append(err)

        loaders = [threading.Thread(target=load, args=(m,)) for m in models.values()]
        for t in loaders:
            t.start()
        for t in loaders:
            t.join()
        if errors:
            for model in models.values():
                model.stop()
            raise errors[0]

    def model(self, name: str) -> ServedModel:
        try:
            return self.models[name]
        except KeyError:
            raise NotFoundError(
                f"no model named {name!r} (serving: {sorted(self.models)})"
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
            future.set_exception(err)
        return future

    def infer(self, name: str, payload: Any, timeout_s: float | None = None) -> Any:
        return self.submit(name, payload).result(timeout_s)

    def status(self) -> dict[str, Any]:
        return {
            "thread_budget": self.plan.budget,
            "models": {name: m.status() for name, m in list(self.models.items())},
        }

    def close(self) -> None:
        for model in self.models.values():
            model.stop()
        for backend in self._backends.values():
            backend.close()
        self._backends.clear()

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
