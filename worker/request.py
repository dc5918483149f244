"""The messages that flow through a model: a ``Request`` in, an ``Outcome`` out.

Created by whoever accepts work (the engine's in-process API, through ``submit_to``; the
supervisor's attachments), queued by its ``ServedModel`` and the ``Batcher``, completed exactly
once by a ``ModelWorker`` (with DEADLINE_EXCEEDED when the batcher found it expired): its model
counts the outcome (``on_counted``), the request's ``on_done`` callback answers, then its
model's ``on_finished`` bookkeeping runs. The count comes first so that a metrics scrape made
the moment a caller has its answer already counts it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import structlog

from duomo.ipc.errors import DuomoError, ErrorCode

log = structlog.get_logger("duomo.request")

_sequence = itertools.count()
_COMPLETION_LOCK = threading.Lock()


@dataclass(slots=True)
class StageTimings:
    """Seconds a request spent in each stage; batch stages are shared by the batch's members."""

    queue_s: float = 0.0
    preprocess_s: float = 0.0
    infer_s: float = 0.0
    postprocess_s: float = 0.0


@dataclass(slots=True)
class Outcome:
    """How one request ended: a result, or an error with its code."""

    result: Any = None
    error: DuomoError | None = None
    timings: StageTimings = field(default_factory=StageTimings)
    batch_size: int = 0
    abandoned: bool = False  # answered while its batch still runs on an abandoned worker

    @property
    def code(self) -> ErrorCode:
        return ErrorCode.OK if self.error is None else self.error.code


@dataclass(eq=False, slots=True)
class Request:
    """One unit of work for one model. ``deadline_s`` is on the ``time.monotonic`` clock.

    ``flow`` is whose request it is, for the batcher's round-robin between flows
    (``worker.flows``): a stream's (its ``StreamState``), or a connection's own for its plain
    requests; ``weight`` is the flow's share. ``supersedes``: queueing it answers the flow's
    queued requests SUPERSEDED (a stream of policy ``latest``)."""

    payload: Any
    on_done: Callable[[Outcome], object]
    priority: int = 0
    deadline_s: float | None = None
    enqueued_s: float = field(default_factory=time.monotonic)
    seq: int = field(default_factory=_sequence.__next__)
    flow: Hashable = None
    weight: float = 1.0
    supersedes: bool = False
    timings: StageTimings = field(default_factory=StageTimings)
    cancelled: bool = False  # set when nobody will read the answer (the client went away)
    abandoned: bool = False  # answered by the watchdog while its batch still runs
    # the model's bookkeeping, set when it queues the request: its counters before ``on_done``,
    # the rest (what it has pending) after
    on_counted: Callable[[Request, Outcome], None] | None = field(default=None, repr=False)
    on_finished: Callable[[Request, Outcome], None] | None = field(default=None, repr=False)
    _done: bool = field(default=False, repr=False)
    _batch_over: bool = field(default=False, repr=False)
    _on_batch_over: Callable[[], None] | None = field(default=None, repr=False)

    def expired(self, now_s: float) -> bool:
        return self.deadline_s is not None and now_s >= self.deadline_s

    def complete(
        self, result: Any = None, error: DuomoError | None = None, batch_size: int = 0
    ) -> bool:
        """Deliver the outcome once; a second completion is ignored and returns False."""
        return self.deliver(Outcome(result, error, self.timings, batch_size, self.abandoned))

    def deliver(self, outcome: Outcome) -> bool:
        """``complete`` with an outcome made elsewhere (a request handed to another model is
        answered through the one that replaced it)."""
        with _COMPLETION_LOCK:  # held for a flag test: one lock for all requests is enough
            if self._done:
                return False
            self._done = True
        if self.on_counted is not None:
            self.on_counted(self, outcome)
        try:
            self.on_done(outcome)  # the answer before the rest of the bookkeeping
        except Exception:
            # One caller's broken callback must not stop the worker from answering the others.
            log.exception("request callback failed", seq=self.seq)
        # Let go of the input at once: for a slot request it is a view into shared memory,
        # and the segment can only be unmapped when no view is left.
        self.payload = None
        if self.on_finished is not None:
            self.on_finished(self, outcome)
        return True

    def hold_until_batch_over(self, release: Callable[[], None]) -> bool:
        """For an abandoned request: call ``release`` once its batch has really ended (its
        thread may still read the input and write outputs in place); False if it already has."""
        with _COMPLETION_LOCK:
            if self._batch_over:
                return False
            self._on_batch_over = release
            return True

    def batch_over(self) -> None:
        """The abandoned batch this request was in has ended: release what was held for it."""
        with _COMPLETION_LOCK:
            self._batch_over = True
            release, self._on_batch_over = self._on_batch_over, None
        if release is not None:
            release()


def submit_to(
    enqueue: Callable[[Request], None],
    payload: Any,
    on_done: Callable[[Outcome], object],
    priority: int,
    deadline_s: float | None = None,
) -> Request:
    """The in-process API's request (``ServedModel.submit``, ``ServedPipeline.submit``): made
    from ``payload`` with ``priority`` and ``deadline_s``, queued by ``enqueue`` (which raises
    at once, nothing queued, when it is refused) and returned; ``on_done`` gets its outcome,
    perhaps before this returns."""
    request = Request(payload, on_done, priority, deadline_s)
    enqueue(request)
    return request
