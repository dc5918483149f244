"""Loads that no operator asked for, run on short-lived threads: on demand (a request waits for
an unloaded model) and ahead of a request (``preload_policy: predictive``), with the predictor
that chooses the latter and its counts.

Owned by the ``Engine``, which hands it the budgeted load as a callable (``load(model, keep)``:
measured, within budget, evicting no model named in ``keep``), its lifecycle lock, the
registry's models and the running config. The registry gives each ``ServedModel`` it builds
``demand`` (its ``on_demand``) and, under the predictive policy, ``observe`` (its
``on_request``); the model calls them on the request's path, so both only do dict operations
and start a thread when there is a load to run.

Invariants: at most one background load per model at a time (``_demanded``); each runs under
the engine's lifecycle lock, only if the model is still the registry's, not unloaded by an
operator, and the engine not closed; a load on demand that fails answers the requests waiting
for it with the reason, and one that leaves requests waiting on an unloaded model is tried
again. A predicted load counts in the model's ``PredictedLoads`` (``worker.model_spec``).

The predictor (``TransitionModel``): which model tends to be asked for after which, a decayed
first-order transition table over the *changes* of model: after a request for A, the next
request for another model B adds 1 to ``A → B``, once every count of A's row is multiplied by
``DECAY``, so the table follows a shifting access pattern. Repeated requests for the same model
are not transitions. Each model's recent inter-arrival time is kept beside it for ``status``.
When the requested model changes, the models that ``likely_after`` it with at least
``predictive_threshold`` load in the background — when they fit without evicting a model that
is at least as likely.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

import structlog

from duomo.ipc.errors import ResourceExhaustedError
from duomo.supervisor.config import DuomoConfig
from duomo.worker.model_spec import ModelState
from duomo.worker.served_model import ServedModel

log = structlog.get_logger("duomo.engine")
DECAY = 0.8  # the weight an old transition keeps each time its row gains a new one
SMOOTHING = 0.2  # of the inter-arrival running mean

BudgetedLoad = Callable[[ServedModel, set[str]], None]


class BackgroundLoads:
    """The loads no operator asked for, each on its own short-lived thread: on demand for a
    waiting request (``demand``) and ahead of one under ``preload_policy: predictive``
    (``observe``)."""

    def __init__(
        self,
        load: BudgetedLoad,
        lifecycle: threading.RLock,
        models: Mapping[str, ServedModel],
        config: Callable[[], DuomoConfig],
    ) -> None:
        self._load = load  # the engine's budgeted load, evicting none of the names given
        self._lifecycle = lifecycle  # the engine's: one lifecycle step at a time
        self._models = models  # the registry's (the same dict)
        self._config = config  # the running config's ``preload_policy`` and threshold
        self._demand_lock = threading.Lock()
        self._demanded: set[str] = set()  # loading for a waiting request, or ahead of one
        self._closed = False
        self.predictor = TransitionModel()  # preload_policy: predictive

    def close(self) -> None:
        """No background load starts from now on (the engine calls it under its lifecycle
        lock, so none that has not begun will)."""
        self._closed = True

    def demand(self, model: ServedModel) -> None:
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
                    if self._models.get(name) is model and not self._closed and model.auto_load:
                        load()
            except Exception as err:
                failed(err)
            finally:
                with self._demand_lock:
                    self._demanded.discard(name)
                if model.pending and model.state is ModelState.UNLOADED and model.auto_load:
                    self.demand(model)  # more arrived after a failure: try again

        threading.Thread(target=run, name=f"duomo-{label}-{name}", daemon=True).start()

    def _load_keeping_what_comes_next(self, model: ServedModel) -> None:
        """A load on demand. With ``preload_policy: predictive`` it first tries to make room
        without evicting the models likely to be asked for next, then as LRU would."""
        name = model.spec.name
        if self._config().preload_policy != "predictive":
            self._load(model, set())
            return
        keep = set(self._likely_next(name))
        try:
            self._load(model, keep)
        except ResourceExhaustedError:
            if not keep or model.state is not ModelState.UNLOADED:
                raise
            self._load(model, set())

    def observe(self, model: ServedModel) -> None:
        """``preload_policy: predictive``, on every request's path: learn the transition, and
        when the model changed, load in the background each unloaded model likely enough to
        come next (``predictive_threshold``)."""
        name = model.spec.name
        if self.predictor.observe(name) is None:
            return  # the same model again, or the first request
        likely = self._likely_next(name)
        for other, chance in likely.items():
            candidate = self._models.get(other)
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
        threshold = self._config().predictive_threshold
        return {n: p for n, p in self.predictor.likely_after(name).items() if p >= threshold}

    def _preload(self, model: ServedModel, after: str, keep: set[str]) -> None:
        """Load ``model`` ahead of its request on a short-lived thread (once at a time, like a
        load on demand), evicting no model in ``keep`` (``after`` and those at least as likely
        to come after it), no busy one, and never past a budget."""

        def load() -> None:
            if model.state is ModelState.UNLOADED:
                model.predictions.expect()  # (a request from now on is a hit)
                self._load(model, keep)
                model.predictions.loaded()

        def failed(err: Exception) -> None:  # no room (or it failed): the request will load it
            model.predictions.skipped()
            log.info("predictive preload skipped", model=model.spec.name, after=after, why=str(err))

        self._in_background(model, "preload", load, failed)


class TransitionModel:
    """Which model tends to be asked for after which, learned from the stream of requests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._rows: dict[str, dict[str, float]] = {}  # from -> to -> decayed count
        self._last: str | None = None
        self._seen: dict[str, float] = {}  # model -> when it was last asked for
        self.gap_s: dict[str, float] = {}  # model -> running mean seconds between its requests

    def observe(self, name: str) -> str | None:
        """A request for ``name``; the model asked for before it, when that was another one
        (a transition), else None."""
        now = self._clock()
        with self._lock:
            seen = self._seen.get(name)
            if seen is not None:
                gap, old = now - seen, self.gap_s.get(name)
                self.gap_s[name] = gap if old is None else old + SMOOTHING * (gap - old)
            self._seen[name] = now
            previous, self._last = self._last, name
            if previous is None or previous == name:
                return None
            row = self._rows.setdefault(previous, {})
            for other in row:
                row[other] *= DECAY
            row[name] = row.get(name, 0.0) + 1.0
            return previous

    def likely_after(self, name: str) -> dict[str, float]:
        """The probability of each model being the next other model asked for after
        ``name`` (from the decayed counts; empty before any transition from it)."""
        with self._lock:
            row = dict(self._rows.get(name, {}))
        total = sum(row.values())
        return {other: count / total for other, count in row.items()} if total else {}
