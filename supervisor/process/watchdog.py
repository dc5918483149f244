"""The health watchdog: one thread that looks at every model once a period and acts on it.

Owned by the ``Supervisor`` (started after the engine, stopped before it closes). Each period it
builds an ``Observation`` per serving model (failures in a row, the oldest batch in progress,
queue depth, recent p99) and applies ``worker.health.assess``:

- HUNG or FAILING: the model goes DEGRADED at once (so it shows within one period) and a
  short-lived thread runs ``ServedModel.reinitialize`` (backoff, REINITIALIZING, new workers,
  READY — or FAILED after ``max_restarts``). One model's restart never delays the checks of
  the others, and the checks never wait for a model that is busy with a lifecycle step.
- OVERLOADED: DEGRADED while it lasts, READY again once it clears.

A model with no instance to run its queue (loading on demand, re-initializing) has its queued
requests' deadlines enforced here: those past theirs are answered DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import threading
import time

import structlog

from duomo.supervisor.core.engine import Engine
from duomo.worker.health import Observation, Verdict, assess
from duomo.worker.model_spec import SERVING, ModelState
from duomo.worker.served_model import ServedModel

log = structlog.get_logger("duomo.watchdog")


class Watchdog:
    """The thread that looks at every serving model once a period and acts on its verdict
    (``worker.health.assess``): DEGRADED, a restart on its own thread, or READY again."""

    def __init__(self, engine: Engine, period_s: float) -> None:
        self.engine = engine
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._restarting: dict[int, threading.Thread] = {}  # id(model) -> its restart thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="duomo-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the checks; restarts in progress give up at their next backoff wait."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.check(time.monotonic())
            except Exception:  # the watchdog must outlive any one model's oddity
                log.exception("watchdog check failed")

    def check(self, now: float) -> None:
        self._restarting = {k: t for k, t in self._restarting.items() if t.is_alive()}
        for model in list(self.engine.models.values()):
            if model.state in SERVING and id(model) not in self._restarting:
                self._check_model(model, now)
            elif model.state is not ModelState.STOPPED and model.batcher.depth:
                model.expire_waiting(now)  # no instance runs them now: deadlines still hold

    def _check_model(self, model: ServedModel, now: float) -> None:
        policy = model.spec.health
        seen = Observation(
            consecutive_failures=model.consecutive_failures,
            longest_batch_s=model.instances.longest_batch_s(now),
            queue_depth=model.batcher.depth,
            p99_ms=model.stats.recent_p99_ms() if policy.slo_p99_ms is not None else None,
        )
        verdict, reason = assess(policy, seen)
        if not model.lifecycle.acquire(blocking=False):
            return  # a load, unload or reload is running on it: look again next period
        try:
            if model.state not in SERVING:
                return
            if verdict.needs_restart:
                model.set_state(ModelState.DEGRADED, reason)
            elif verdict is Verdict.OVERLOADED:
                model.set_state(ModelState.DEGRADED, reason)
                return
            else:
                model.set_state(ModelState.READY, "healthy again")
                return
        finally:
            model.lifecycle.release()
        restart = threading.Thread(
            target=model.reinitialize,
            args=(reason, self._stop, verdict),
            name=f"duomo-restart-{model.spec.name}",
            daemon=True,
        )
        self._restarting[id(model)] = restart
        restart.start()
