"""The watchdog's rules (verdicts, restart backoff) and the eviction choice, without threads."""

from __future__ import annotations

from duomo.supervisor.core.memory import Resident, choose_victims
from duomo.worker.health import HealthPolicy, Observation, RestartHistory, Verdict, assess

POLICY = HealthPolicy(
    exec_timeout_ms=500, max_consecutive_failures=3, slo_queue_depth=10, slo_p99_ms=50
)


def seen(
    failures: int = 0, batch_s: float = 0.0, depth: int = 0, p99: float | None = None
) -> Observation:
    return Observation(failures, batch_s, depth, p99)


def test_verdicts_in_order_of_severity() -> None:
    assert assess(POLICY, seen())[0] is Verdict.HEALTHY
    assert assess(POLICY, seen(failures=2, batch_s=0.4, depth=9, p99=49))[0] is Verdict.HEALTHY
    verdict, reason = assess(POLICY, seen(batch_s=0.6, failures=5))
    assert verdict is Verdict.HUNG and "exec_timeout_ms 500" in reason
    assert assess(POLICY, seen(failures=3, depth=99))[0] is Verdict.FAILING
    assert assess(POLICY, seen(depth=10))[0] is Verdict.OVERLOADED
    assert assess(POLICY, seen(p99=51))[0] is Verdict.OVERLOADED
    assert not Verdict.OVERLOADED.needs_restart and Verdict.HUNG.needs_restart


def test_restart_backoff_doubles_and_the_window_forgets() -> None:
    policy = HealthPolicy(backoff_ms=100, backoff_max_ms=350, max_restarts=3, restart_window_s=10)
    history = RestartHistory(policy)
    delays = []
    for t in range(3):
        delays.append(history.next_delay_s(float(t)))
        history.record(float(t))
    assert delays == [0.1, 0.2, 0.35]  # doubling, capped
    assert history.exhausted(3.0)
    assert not history.exhausted(11.5)  # the first two fell out of the window
    assert history.count(11.5) == 1


def resident(
    name: str, mb: int, used: float, evictable: bool = True, idle: bool = True
) -> Resident:
    return Resident(name, mb << 20, used, evictable, idle)


def test_victims_are_least_recently_used_idle_evictable_models_by_bytes() -> None:
    models = [
        resident("old-busy", 100, used=1.0, idle=False),
        resident("pinned", 100, used=2.0, evictable=False),
        resident("older", 30, used=3.0),
        resident("newer", 80, used=4.0),
        resident("newest", 80, used=5.0),
    ]
    assert [v.name for v in choose_victims(models, 20 << 20) or []] == ["older"]
    assert [v.name for v in choose_victims(models, 100 << 20) or []] == ["older", "newer"]
    assert choose_victims(models, 200 << 20) is None  # even all idle evictable ones are too few
    assert choose_victims(models, 0) == []
