"""``max_delay_ms: auto`` on a fake clock: the window the rule chooses for a batch cost of
``a + b·n`` as the load and the p99 change, and a discrete-event run of one instance serving a
steady stream under it (no wall-clock sleeps anywhere)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from duomo.worker.batch_window import PROBE_S, UPDATE_S, BatchWindow, CostCurve, fit_cost

pytestmark = pytest.mark.unit
SLO_S = 0.100
MAX_BATCH = 8


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def costs(fixed_s: float, per_item_s: float) -> dict[int, float]:
    return {n: fixed_s + per_item_s * n for n in range(1, MAX_BATCH + 1)}


def streamed(
    fixed_s: float, per_item_s: float, gap_s: float, p99_s: Callable[[], float | None]
) -> tuple[FakeClock, BatchWindow]:
    """A window seeded with ``a + b·n`` after 50 requests, one every ``gap_s``."""
    clock = FakeClock()
    window = BatchWindow(MAX_BATCH, 1, SLO_S, p99_s, clock)
    window.seed(costs(fixed_s, per_item_s))
    for _ in range(50):
        clock.now += gap_s
        window.record_arrival()
    return clock, window


def window_for(
    fixed_s: float, per_item_s: float, gap_s: float, p99_s: float | None = None, polls: int = 1
) -> float:
    """The window after a steady stream, one request every ``gap_s``."""
    clock, window = streamed(fixed_s, per_item_s, gap_s, lambda: p99_s)
    chosen = 0.0
    for _ in range(polls):
        clock.now += UPDATE_S
        chosen = window.delay_s()
    return chosen


def test_the_cost_curve_is_fitted_from_the_sizes_seen() -> None:
    curve = fit_cost(costs(0.010, 0.0005))
    assert curve is not None
    assert curve.fixed_s == pytest.approx(0.010) and curve.per_item_s == pytest.approx(0.0005)
    assert fit_cost({1: 0.01}) is None  # one size: no curve
    assert fit_cost({1: 0.02, 2: 0.01}) == CostCurve(pytest.approx(0.015), 0.0)  # type: ignore[arg-type]


def test_a_fixed_cost_under_load_gets_a_window_that_fits_the_slo() -> None:
    # a = 10 ms, b = 0.1 ms; 500 requests/s keep one instance busy: wait for a batch of 8
    chosen = window_for(0.010, 0.0001, gap_s=0.002)
    assert chosen == pytest.approx(7 * 0.002, rel=0.01)  # the time 7 more requests take
    assert chosen + 2 * (0.010 + 8 * 0.0001) <= SLO_S


def test_the_window_grows_with_the_load_and_is_bounded_by_the_slo() -> None:
    light = window_for(0.010, 0.0001, gap_s=0.050)  # 20/s: the instance keeps up one by one
    busy = window_for(0.010, 0.0001, gap_s=0.004)
    assert light == 0.0 < busy
    slow = window_for(0.030, 0.0001, gap_s=0.010)  # 7 × 10 ms to fill, 30.8 ms to run
    assert slow == pytest.approx(SLO_S - 2 * (0.030 + 8 * 0.0001))


def test_a_p99_over_the_slo_shrinks_the_window_and_it_recovers() -> None:
    p99: list[float | None] = [None]
    clock, window = streamed(0.010, 0.0001, 0.002, lambda: p99[0])
    clock.now += UPDATE_S
    full = window.delay_s()
    p99[0] = 0.085  # over 0.8 × the SLO
    shrunk = []
    for _ in range(3):
        clock.now += UPDATE_S
        shrunk.append(window.delay_s())
    assert full > shrunk[0] > shrunk[1] > shrunk[2] > 0
    assert window.delay_s() == shrunk[2]  # not recomputed within UPDATE_S
    p99[0] = 0.030
    for _ in range(20):
        clock.now += UPDATE_S
        window.delay_s()
    assert window.delay_s() == pytest.approx(full)


def test_a_linear_cost_never_waits_whatever_the_load() -> None:
    for gap_s in (0.050, 0.004, 0.0005):
        assert window_for(0.0, 0.002, gap_s=gap_s, polls=5) == 0.0
    assert window_for(0.0001, 0.002, gap_s=0.0005) == 0.0  # a fixed part too small to pay


def serve(
    fixed_s: float, per_item_s: float, gap_s: float, auto: bool, count: int = 2000
) -> tuple[float, float]:
    """One instance serving a steady stream on a fake clock, batches formed by the batcher's
    rule (fill until ``max_batch`` or the window from the first request's arrival; a backlog
    never waits): the p99 latency and the device time per request."""
    clock = FakeClock()
    latencies: list[float] = []
    window = BatchWindow(MAX_BATCH, 1, SLO_S, lambda: p99(latencies), clock)
    window.seed(costs(fixed_s, per_item_s))
    arrivals = [i * gap_s for i in range(count)]
    next_arrival, free_at, busy_s = 0, 0.0, 0.0
    queue: list[float] = []
    while len(latencies) < count:
        if not queue:  # idle until the next request
            clock.now = max(free_at, arrivals[next_arrival])
        while next_arrival < count and arrivals[next_arrival] <= clock.now:
            queue.append(arrivals[next_arrival])
            window.record_arrival()  # (recorded when the clock reaches it: close enough)
            next_arrival += 1
        delay = window.delay_s() if auto else 0.0
        fill_until = queue[0] + delay
        late = False
        while len(queue) < MAX_BATCH and next_arrival < count:
            if arrivals[next_arrival] > fill_until:
                break
            clock.now = max(clock.now, arrivals[next_arrival])
            late = late or clock.now >= fill_until - delay / 2
            queue.append(arrivals[next_arrival])
            window.record_arrival()
            next_arrival += 1
        if len(queue) < MAX_BATCH and next_arrival < count:
            clock.now = max(clock.now, fill_until)
        if auto and delay > 0:
            window.record_fill(late or len(queue) >= MAX_BATCH)
        batch, queue = queue[:MAX_BATCH], queue[MAX_BATCH:]
        run_s = fixed_s + per_item_s * len(batch)
        clock.now += run_s
        free_at, busy_s = clock.now, busy_s + run_s
        window.record_run(len(batch), run_s)
        latencies += [clock.now - arrived for arrived in batch]
    return p99(latencies) or 0.0, busy_s / count


def p99(latencies: list[float]) -> float | None:
    recent = sorted(latencies[-256:])
    return recent[int(0.99 * (len(recent) - 1))] if recent else None


def test_under_load_the_window_saves_device_time_and_keeps_the_p99_under_the_slo() -> None:
    p99_auto, device_auto = serve(0.010, 0.0001, gap_s=0.004, auto=True)
    p99_none, device_none = serve(0.010, 0.0001, gap_s=0.004, auto=False)
    assert p99_auto <= SLO_S
    assert device_auto < 0.5 * device_none  # fuller batches: the device is free for others
    assert p99_none < p99_auto  # what it costs: latency, within the SLO


def test_with_a_linear_cost_auto_is_the_same_as_no_window() -> None:
    assert serve(0.0, 0.002, gap_s=0.003, auto=True) == serve(0.0, 0.002, gap_s=0.003, auto=False)


def serve_closed(
    clients: int, fixed_s: float, per_item_s: float, auto: bool
) -> tuple[float, float]:
    """A closed loop: ``clients`` callers, each sending its next request 0.5 ms after its last
    answer (fewer than ``max_batch``: a batch can never fill by waiting). The mean latency
    over the last half of 2000 requests, and the window in force at the end."""
    clock = FakeClock()
    latencies: list[float] = []
    window = BatchWindow(MAX_BATCH, 1, SLO_S, lambda: p99(latencies), clock)
    window.seed(costs(fixed_s, per_item_s))
    due = [i * 0.0001 for i in range(clients)]  # when each caller sends next
    while len(latencies) < 2000:
        first = min(due)
        clock.now = max(clock.now, first)
        queued = [d for d in due if d <= clock.now]
        for _ in queued:
            window.record_arrival()
        delay = window.delay_s() if auto else 0.0
        fill_until = first + delay
        waiting = sorted(d for d in due if d > clock.now)
        late = False
        for arrival in waiting:  # the callers not queued yet may arrive while it fills
            if len(queued) >= MAX_BATCH or arrival > fill_until:
                break
            late = late or arrival >= fill_until - delay / 2
            queued.append(arrival)
            window.record_arrival()
        if len(queued) < MAX_BATCH:
            clock.now = max(clock.now, fill_until)
        if auto and delay > 0:
            window.record_fill(late or len(queued) >= MAX_BATCH)
        run_s = fixed_s + per_item_s * len(queued)
        clock.now += run_s
        window.record_run(len(queued), run_s)
        for arrived in queued:
            latencies.append(clock.now - arrived)
            due[due.index(arrived)] = clock.now + 0.0005
    return sum(latencies[1000:]) / 1000, window.window_s


def test_a_closed_loop_that_cannot_fill_a_batch_switches_the_window_off() -> None:
    auto_mean, auto_window = serve_closed(6, 0.010, 0.0001, auto=True)
    none_mean, _ = serve_closed(6, 0.010, 0.0001, auto=False)
    assert auto_window < 0.0005  # a few fills that gained nothing: (nearly) off
    assert auto_mean <= 1.1 * none_mean  # and the callers do not pay for it
    lone_mean, _ = serve_closed(1, 0.010, 0.0001, auto=True)
    lone_none, _ = serve_closed(1, 0.010, 0.0001, auto=False)
    assert lone_mean <= 1.1 * lone_none


def test_fills_that_gain_nothing_switch_it_off_and_a_probe_turns_it_back_on() -> None:
    clock, window = streamed(0.010, 0.0001, 0.002, lambda: None)
    clock.now += UPDATE_S
    full = window.delay_s()
    assert full > 0
    for _ in range(6):  # a closed loop: nothing arrives while the batch waits
        window.record_fill(False)
    assert window.delay_s() == 0.0
    clock.now += PROBE_S / 2
    assert window.delay_s() == 0.0  # still off
    clock.now += PROBE_S
    assert window.delay_s() == pytest.approx(full)  # the probe: the whole window once
    window.record_fill(True)  # the load is open loop again: the probe paid
    for _ in range(10):
        clock.now += UPDATE_S
        window.record_fill(True)
    assert window.delay_s() == pytest.approx(full)
