"""A model's health rules: the policy from its config, what counts as sick, and restart pacing.

Used by ``ServedModel`` (restart accounting, what happens to queued requests while it
re-initializes) and by the supervisor's watchdog, which calls ``assess`` for every model once a
period. Pure: no threads, no clocks of its own (callers pass ``now``), so the rules are tested
directly.

Signals and what they mean:

======================================  =========  =============================================
signal                                  verdict    consequence
======================================  =========  =============================================
a batch running past ``exec_timeout``   HUNG       DEGRADED, then REINITIALIZING: the hung
                                                   worker is abandoned, its batch answered
``max_consecutive_failures`` batches    FAILING    DEGRADED, then REINITIALIZING
failed in a row (exceptions, garbage)
queue depth ≥ ``slo_queue_depth`` or    OVERLOADED DEGRADED while it lasts; a restart would not
p99 above ``slo_p99_ms``                           help a model that is slow but answering
======================================  =========  =============================================

Restarts back off exponentially (``backoff_ms`` doubling up to ``backoff_max_ms``); more than
``max_restarts`` within ``restart_window_s`` makes the model FAILED until an operator loads or
reloads it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from pydantic import Field

from duomo.worker.config_model import StrictModel


class HealthPolicy(StrictModel):
    """The ``health:`` section of a model's config."""

    exec_timeout_ms: float = Field(default=60_000, gt=0, le=3_600_000)
    max_consecutive_failures: int = Field(default=3, ge=1, le=1_000_000)
    max_restarts: int = Field(default=5, ge=0, le=1_000_000)
    restart_window_s: float = Field(default=600, gt=0)
    backoff_ms: float = Field(default=500, ge=0, le=3_600_000)
    backoff_max_ms: float = Field(default=30_000, ge=0, le=3_600_000)
    slo_p99_ms: float | None = Field(default=None, gt=0)
    slo_queue_depth: int | None = Field(default=None, ge=1)
    while_reinitializing: Literal["fail", "wait"] = "fail"


class Verdict(str, Enum):
    """What ``assess`` makes of a model: HEALTHY, OVERLOADED (DEGRADED while it lasts), FAILING
    or HUNG (both restart it)."""

    HEALTHY = "HEALTHY"
    OVERLOADED = "OVERLOADED"
    FAILING = "FAILING"
    HUNG = "HUNG"

    @property
    def needs_restart(self) -> bool:
        return self in (Verdict.FAILING, Verdict.HUNG)


@dataclass(frozen=True)
class Observation:
    """What the watchdog sees of one model at one moment."""

    consecutive_failures: int
    longest_batch_s: float  # how long the oldest batch in progress has run (0 if none)
    queue_depth: int
    p99_ms: float | None  # recent end-to-end p99, when there are samples


def assess(policy: HealthPolicy, seen: Observation) -> tuple[Verdict, str]:
    """The verdict for one observation and a reason a person can read in the log."""
    if seen.longest_batch_s * 1e3 > policy.exec_timeout_ms:
        return Verdict.HUNG, (
            f"a batch has run {seen.longest_batch_s:.1f}s, "
            f"past exec_timeout_ms {policy.exec_timeout_ms:.0f}"
        )
    if seen.consecutive_failures >= policy.max_consecutive_failures:
        return Verdict.FAILING, f"{seen.consecutive_failures} batches failed in a row"
    if policy.slo_queue_depth is not None and seen.queue_depth >= policy.slo_queue_depth:
        return Verdict.OVERLOADED, (
            f"queue depth {seen.queue_depth} ≥ slo_queue_depth {policy.slo_queue_depth}"
        )
    slo = policy.slo_p99_ms
    if slo is not None and seen.p99_ms is not None and seen.p99_ms > slo:
        return Verdict.OVERLOADED, f"p99 {seen.p99_ms:.1f} ms > slo_p99_ms {policy.slo_p99_ms:.0f}"
    return Verdict.HEALTHY, ""


class RestartHistory:
    """Restarts within the policy's window, and the backoff before the next one."""

    def __init__(self, policy: HealthPolicy) -> None:
        self.policy = policy
        self._times: deque[float] = deque()

    def count(self, now: float) -> int:
        while self._times and now - self._times[0] > self.policy.restart_window_s:
            self._times.popleft()
        return len(self._times)

    def exhausted(self, now: float) -> bool:
        return self.count(now) >= self.policy.max_restarts

    def next_delay_s(self, now: float) -> float:
        """Backoff before the next restart: ``backoff_ms`` × 2^(restarts in the window)."""
        delay = self.policy.backoff_ms * 2 ** min(self.count(now), 30)
        return min(delay, self.policy.backoff_max_ms) / 1e3

    def record(self, now: float) -> None:
        self._times.append(now)

    def clear(self) -> None:
        self._times.clear()
