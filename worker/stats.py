"""Per-model statistics: outcomes by code, stage latency percentiles, batch-size histogram,
cumulative counts and times since the model was built, and the load its streams put on it
(``streams``: ``worker.stream_load``).

Written by the model's workers (and the batcher's expiry path), read by ``status`` (``snapshot``:
its ``RequestFigures`` record, which ``worker.model_status`` puts in the model's), the
benchmark and, through ``status``, the gateway's statistics endpoints; ``counters`` is the
metrics scrape's view (``supervisor.operators.metrics``). Latencies are kept in a bounded window of
recent requests, so percentiles describe current behaviour and memory stays flat however long the
server runs; the cumulative ``totals`` (Triton's statistics: counts and nanoseconds per stage)
and the ``Buckets`` of request durations and batch sizes only ever grow.

A SUPERSEDED answer (a ``latest`` stream's frame replaced by a newer one) is an outcome, never a
failure: it is counted by outcome (``superseded``) and in no failure total.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from duomo.ipc.errors import ErrorCode
from duomo.ipc.model_records import TimedCount, Totals
from duomo.worker.request import Outcome
from duomo.worker.stream_load import StreamLoad

STAGES = ("queue", "preprocess", "infer", "postprocess", "total")
# the cumulative kinds, as Triton's statistics name them: answered requests, successful and
# failed (end to end), and the successful ones' queue and compute stages
TOTALS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
_OUTCOME_KEYS = {code: code.name.lower() for code in ErrorCode}
_WINDOW = 4096
# histogram bounds: end-to-end seconds of a successful request, and items per batch
REQUEST_BOUNDS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Buckets:
    """A Prometheus histogram's state: how many observations fell at or below each bound (and
    above the last), and their sum. Written under its owner's lock; ``read`` takes none (a copy
    of a list is atomic under the GIL), so a scrape never makes a writer wait."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._sum += value

    def read(self) -> HistogramState:
        counts, total = list(self._counts), self._sum
        return HistogramState(list(itertools.accumulate(counts)), total)


@dataclass(frozen=True)
class HistogramState:
    """``Buckets`` at one moment: cumulative counts per bound (the last one +Inf: the count of
    every observation) and the sum of the observations."""

    cumulative: list[int]
    total: float


@dataclass(frozen=True)
class Counters:
    """The cumulative numbers of one model at one moment (the metrics scrape's view)."""

    outcomes: dict[str, int]  # answered requests by outcome key ("ok", "internal", ...)
    refused: dict[str, int]  # requests refused before they were queued, by error key
    totals: dict[str, tuple[int, int]]  # TOTALS kind -> (count, nanoseconds)
    items: int
    executions: int
    request_seconds: HistogramState
    batch_sizes: HistogramState


@dataclass(frozen=True)
class RequestFigures:
    """A model's (or a pipeline's) request figures, ``ModelStatus``'s fields of the same names:
    requests answered after being queued, those by outcome, refusals at admission, latency
    percentiles per stage in ms ({} before the first success), batch sizes and the totals."""

    requests: int
    outcomes: dict[str, int]
    refused: dict[str, int]
    latency: dict[str, dict[str, float]]
    batch_sizes: dict[str, int]
    totals: Totals


class ModelStats:
    """One model's statistics, thread-safe: outcomes by code, recent stage latencies, batch
    sizes, and cumulative totals."""

    def __init__(self, window: int = _WINDOW) -> None:
        self._lock = threading.Lock()
        self._outcomes: Counter[str] = Counter()
        self._refused: Counter[str] = Counter()  # never queued: bad input, full, not serving
        self._batches: Counter[int] = Counter()
        # one tuple per answered request (queue, preprocess, infer, postprocess, total seconds)
        self._samples: deque[tuple[float, float, float, float, float]] = deque(maxlen=window)
        # cumulative [count, nanoseconds] per kind (TOTALS), items and batches run, and the
        # wall-clock time of the last answer in ms
        self._totals = {kind: [0, 0] for kind in TOTALS}
        self._items = 0
        self._executions = 0
        self._last_ms = 0
        self.request_seconds = Buckets(REQUEST_BOUNDS_S)  # successful requests, end to end
        self.batch_size = Buckets(BATCH_BOUNDS)
        self.streams = StreamLoad()  # what its streams offer it and what it serves them

    def record(self, outcome: Outcome, total_s: float) -> None:
        t = outcome.timings
        with self._lock:
            self._outcomes[_OUTCOME_KEYS[outcome.code]] += 1
            self._last_ms = int(time.time() * 1e3)
            if outcome.error is None:
                self._samples.append(
                    (t.queue_s, t.preprocess_s, t.infer_s, t.postprocess_s, total_s)
                )
                self.request_seconds.observe(total_s)
                spent: tuple[tuple[str, float], ...] = (
                    ("success", total_s),
                    ("queue", t.queue_s),
                    ("compute_input", t.preprocess_s),
                    ("compute_infer", t.infer_s),
                    ("compute_output", t.postprocess_s),
                )
            elif outcome.error.code is ErrorCode.SUPERSEDED:  # an outcome, not a failure
                return
            else:
                spent = (("fail", total_s),)
            for kind, seconds in spent:
                entry = self._totals[kind]
                entry[0] += 1
                entry[1] += int(seconds * 1e9)

    def record_refusal(self, code: ErrorCode) -> None:
        """A request refused before it was queued (its error answered at once)."""
        with self._lock:
            self._refused[_OUTCOME_KEYS[code]] += 1

    def record_batch(self, size: int) -> None:
        with self._lock:
            self._batches[size] += 1
            self._items += size
            self._executions += 1
            self.batch_size.observe(size)

    def counters(self) -> Counters:
        """Every cumulative number, read without the lock: a worker never waits for a scrape.
        Each value is read atomically; two of them may be one request apart."""
        return Counters(
            outcomes=dict(self._outcomes),
            refused=dict(self._refused),
            totals={kind: (entry[0], entry[1]) for kind, entry in self._totals.items()},
            items=self._items,
            executions=self._executions,
            request_seconds=self.request_seconds.read(),
            batch_sizes=self.batch_size.read(),
        )

    def recent_p99_ms(self, last: int = 256) -> float | None:
        """End-to-end p99 of the last ``last`` successful requests (the watchdog's SLO check)."""
        with self._lock:
            start = max(0, len(self._samples) - last)
            totals = [sample[4] for sample in itertools.islice(self._samples, start, None)]
        return float(np.percentile(totals, 99)) * 1e3 if totals else None

    def recent_service_s(self, last: int = 256) -> float | None:
        """The median time a batch took to serve the last ``last`` successful requests, their
        queueing left out (end to end minus queue: preprocess, run, postprocess and answer);
        None before any. The unit of a stream's age bound (``worker.model_status``)."""
        with self._lock:
            start = max(0, len(self._samples) - last)
            served = [s[4] - s[0] for s in itertools.islice(self._samples, start, None)]
        return float(np.median(served)) if served else None

    def recent_p99_s(self) -> float | None:
        """``recent_p99_ms`` in seconds (what ``max_delay_ms: auto`` holds to the SLO)."""
        p99_ms = self.recent_p99_ms()
        return None if p99_ms is None else p99_ms / 1e3

    def snapshot(self) -> RequestFigures:
        """Its request figures as ``status`` shows them: counts, p50/p90/p99 per stage in ms,
        batch sizes and the cumulative totals."""
        with self._lock:
            outcomes = dict(self._outcomes)
            refused = dict(self._refused)
            batches = {str(k): v for k, v in sorted(self._batches.items())}
            samples = np.array(self._samples, dtype=np.float64).reshape(-1, len(STAGES))
            totals = Totals(
                timed={kind: TimedCount(count, ns) for kind, (count, ns) in self._totals.items()},
                inference_count=self._items,
                execution_count=self._executions,
                last_inference_ms=self._last_ms,
            )
        latency: dict[str, dict[str, float]] = {}
        if len(samples):
            table = np.percentile(samples, [50, 90, 99], axis=0) * 1e3
            for i, stage in enumerate(STAGES):
                p50, p90, p99 = (float(v) for v in table[:, i])
                latency[stage] = {"p50_ms": p50, "p90_ms": p90, "p99_ms": p99}
        return RequestFigures(
            requests=sum(outcomes.values()),
            outcomes=outcomes,
            refused=refused,
            latency=latency,
            batch_sizes=batches,
            totals=totals,
        )
