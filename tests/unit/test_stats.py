"""Per-model statistics as the metrics scrape reads them: histogram buckets with Prometheus's
``le`` meaning, and counters read while a worker thread keeps recording."""

from __future__ import annotations

import threading

import pytest

from duomo.ipc.errors import InternalError
from duomo.worker.request import Outcome, StageTimings
from duomo.worker.stats import Buckets, ModelStats

pytestmark = pytest.mark.unit


def test_buckets_are_cumulative_with_le_semantics_and_a_sum() -> None:
    buckets = Buckets([0.1, 1.0])
    for value in (0.05, 0.1, 0.5, 1.0, 7.0):
        buckets.observe(value)
    state = buckets.read()
    assert state.cumulative == [2, 4, 5]  # ≤ 0.1 (0.1 itself included), ≤ 1, +Inf
    assert state.total == pytest.approx(8.65)


def test_counters_agree_with_what_was_recorded_even_while_a_worker_records() -> None:
    stats = ModelStats()
    timings = StageTimings(queue_s=0.001, preprocess_s=0.002, infer_s=0.003, postprocess_s=0.004)
    n = 20_000

    def worker() -> None:
        for i in range(n):
            failed = i % 10 == 0
            outcome = Outcome(error=InternalError("boom") if failed else None, timings=timings)
            stats.record_batch(1)
            stats.record(outcome, 0.01)

    thread = threading.Thread(target=worker)
    thread.start()
    last = (0, 0, 0)
    while thread.is_alive():  # reads without the lock never see a count go backwards
        seen = stats.counters()
        now = (seen.totals["success"][0], seen.request_seconds.cumulative[-1], seen.items)
        assert all(a >= b for a, b in zip(now, last, strict=True)), (now, last)
        last = now
    thread.join()
    final = stats.counters()
    assert final.totals["success"][0] == n * 9 // 10 == final.request_seconds.cumulative[-1]
    assert final.outcomes == {"ok": n * 9 // 10, "internal": n // 10}
    assert final.items == final.executions == n == final.batch_sizes.cumulative[0]
    assert final.totals["compute_infer"][1] == pytest.approx(n * 0.9 * 3e6, rel=1e-6)
