"""``max_delay_ms: auto``: how long a forming batch waits for more requests, chosen from what
the model's batches cost, how fast its requests arrive and its latency SLO.

Owned by one model's ``Batcher`` (which asks ``delay_s`` each time a batch starts to fill and
reports arrivals); its ``ServedModel`` reports each batch's size and run time, and its
executor's warm-up seeds the cost of every batch size (``Executor.warmup_costs``).

The rule, recomputed at most every ``UPDATE_S``:

1. **Cost curve.** A batch of *n* costs ``c(n) = a + b·n``, fitted (least squares) to the
   recent mean run time of each batch size seen (an executor without a warm-up has its curve
   only once live batches of two sizes have run; until then the window is 0). When the fixed
   part is small (``a ≤ FIXED_SHARE · c(1)``: on the CPU a batch of *n* costs about *n*
   single runs), waiting buys nothing: the window is 0.
2. **Load.** With ``λ`` the arrival rate and ``instances`` instances, a window only pays while
   the model keeps its instances busy: ``λ · c(1) / instances ≥ BUSY``. Below that, requests
   are served one by one at once (waiting would only add latency; throughput is the arrival
   rate either way).
3. **Target.** Per item a batch of *n* costs ``a/n + b``; the batch worth waiting for is the
   smallest *n* within ``EFFICIENCY`` of the best per-item cost (``n ≥ a / (EFFICIENCY·b)``,
   at most ``max_batch``), and the window is the time its requests take to arrive,
   ``(n − 1)/λ``, bounded so that the worst case fits the SLO: a request that waits the whole
   window, then for the batch running before its own, then for its own: ``≤ slo − 2·c(n)``.
4. **Feedback.** The window is scaled by a factor that halves while the recent end-to-end p99
   is over ``HIGH · slo`` and grows back by ``STEP`` while it is under ``LOW · slo``.
5. **Fills that gain nothing.** Each fill reports whether it paid (``record_fill``): it reached
   ``max_batch``, or a request still arrived in the second half of its wait. One that did not
   halves a second factor, one that did grows it back by ``STEP``. A client that keeps fewer
   requests outstanding than ``max_batch`` (a closed loop: nothing arrives while they all wait)
   thus switches the window off within a few fills (below ``OFF``), instead of every request
   paying for a batch that cannot fill — and the slower arrivals that waiting causes cannot
   feed back into a longer window. Every ``PROBE_S`` while off, one fill tries the whole
   window again, so a change of load turns it back on.

The window buys device time: fuller batches cost less per request, which the model's own
backlog and the other models at its device's compute gate use. It is paid in latency, which
the SLO bounds; a model with no SLO keeps a fixed ``max_delay_ms``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

UPDATE_S = 0.25  # the window is recomputed at most this often
SMOOTHING = 0.2  # weight of a new observation in the running means
FIXED_SHARE = 0.1  # below this share of c(1) fixed cost, batching does not pay
BUSY = 0.5  # below this utilisation of the instances, no request waits
EFFICIENCY = 0.1  # the target batch is within this of the best per-item cost
HIGH, LOW, STEP = 0.8, 0.6, 0.1  # the feedback's bounds on p99 ÷ slo, and its step back up
OFF = 0.05  # a fill factor below this: the window is off
PROBE_S = 2.0  # while off, the window is tried again this often


@dataclass(frozen=True)
class CostCurve:
    """``c(n) = fixed_s + per_item_s · n``."""

    fixed_s: float
    per_item_s: float

    def cost_s(self, n: int) -> float:
        return self.fixed_s + self.per_item_s * n


def fit_cost(costs: dict[int, float]) -> CostCurve | None:
    """The least-squares line through (batch size, mean seconds); None with fewer than two
    sizes. A negative slope (noise) is read as no per-item cost."""
    if len(costs) < 2:
        return None
    sizes, seconds = list(costs), list(costs.values())
    mean_n, mean_s = sum(sizes) / len(sizes), sum(seconds) / len(seconds)
    spread = sum((n - mean_n) ** 2 for n in sizes)
    slope = sum((n - mean_n) * (s - mean_s) for n, s in zip(sizes, seconds)) / spread
    slope = max(0.0, slope)
    return CostCurve(mean_s - slope * mean_n, slope)


class BatchWindow:
    """One model's fill window under ``max_delay_ms: auto``: ``delay_s`` from the fitted batch
    costs, the arrival rate and the SLO (the rule in the module docstring)."""

    def __init__(
        self,
        max_batch: int,
        instances: int,
        slo_s: float,
        p99_s: Callable[[], float | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_batch = max_batch
        self.instances = instances
        self.slo_s = slo_s
        self._p99_s = p99_s  # the model's recent end-to-end p99 (None before any answer)
        self._clock = clock
        self.costs: dict[int, float] = {}  # batch size -> running mean run seconds
        self._gap_s: float | None = None  # running mean seconds between arrivals
        self._last_arrival: float | None = None
        self._scale = 1.0  # the p99 feedback
        self._fill_scale = 1.0  # the fills' feedback
        self._off_since: float | None = None  # when the fills switched the window off
        self._window_s = 0.0
        self._updated = -math.inf

    def seed(self, costs: dict[int, float]) -> None:
        """Warm-up run times by batch size (the first measurement of each)."""
        for size, seconds in costs.items():
            self.costs.setdefault(size, seconds)

    def record_run(self, size: int, seconds: float) -> None:
        old = self.costs.get(size)
        self.costs[size] = seconds if old is None else old + SMOOTHING * (seconds - old)

    def record_arrival(self) -> None:
        now = self._clock()
        if self._last_arrival is not None:
            gap = now - self._last_arrival
            old = self._gap_s
            self._gap_s = gap if old is None else old + SMOOTHING * (gap - old)
        self._last_arrival = now

    def delay_s(self) -> float:
        """The window for the batch that starts to fill now."""
        now = self._clock()
        if now - self._updated >= UPDATE_S:
            self._updated = now
            self._window_s = self._choose()
            if self._off_since is not None and now - self._off_since >= PROBE_S:
                self._fill_scale, self._off_since = 1.0, None  # try the whole window again
        return self.window_s

    def record_fill(self, paid: bool) -> None:
        """A fill ended: ``paid`` when it reached ``max_batch`` or a request arrived in the
        second half of its wait."""
        if paid:
            self._fill_scale = min(1.0, self._fill_scale + STEP)
            self._off_since = None
        else:
            self._fill_scale *= 0.5
            if self._fill_scale < OFF and self._off_since is None:
                self._off_since = self._clock()

    def _choose(self) -> float:
        p99 = self._p99_s()
        if p99 is not None and p99 > HIGH * self.slo_s:
            self._scale *= 0.5
        elif p99 is None or p99 < LOW * self.slo_s:
            self._scale = min(1.0, self._scale + STEP)
        curve = fit_cost(dict(self.costs))
        gap = self._gap_s
        if curve is None or gap is None or gap <= 0:
            return 0.0
        single = curve.cost_s(1)
        if curve.fixed_s <= FIXED_SHARE * single:
            return 0.0  # about linear: a batch of n costs n single runs
        rate = 1.0 / gap
        if rate * single / self.instances < BUSY:
            return 0.0  # the instances keep up one request at a time
        if curve.per_item_s > 0:
            target = min(self.max_batch, math.ceil(curve.fixed_s / (EFFICIENCY * curve.per_item_s)))
        else:
            target = self.max_batch
        window = (target - 1) / rate
        window = min(window, max(0.0, self.slo_s - 2 * curve.cost_s(target)))
        return window * self._scale

    @property
    def window_s(self) -> float:
        """The window in force (``status``): 0 while the fills have switched it off."""
        return 0.0 if self._fill_scale < OFF else self._window_s * self._fill_scale
