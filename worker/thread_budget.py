"""The process's one CPU thread budget: how many intra-op threads each model instance gets, the
gate that keeps the threads computing at once within the cores, and the count of instances at
work right now.

Called by the engine when it plans its models (``plan_threads``), by every backend session
around each execution (``ComputeGate.hold``), and by every model instance around its warm-up and
each batch (``Activity``, which the engine's idle spin reads).

Invariants:
- every instance gets at least one intra-op thread and never more than the budget;
- with the gate, the intra-op threads computing at the same moment never exceed the budget, so
  three single-threaded models on two cores run two at a time instead of three time-slicing.
  Waiters are served first come, first served, so a model asking for two threads is not starved
  by a stream of one-thread runs.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class InstanceDemand:
    """One model's ask: how many instances, and an explicit thread count if the config has one."""

    model: str
    instances: int
    intra_op_threads: int | None = None


@dataclass(frozen=True)
class ThreadPlan:
    budget: int
    threads_per_instance: dict[str, int]
    instances: dict[str, int]

    @property
    def total_threads(self) -> int:
        """Intra-op threads over all instances if every one ran at once."""
        return sum(self.threads_per_instance[m] * self.instances[m] for m in self.instances)

    @property
    def max_concurrent_threads(self) -> int:
        """Intra-op threads the gate lets compute at the same moment."""
        return min(self.budget, self.total_threads)


def plan_threads(demands: Sequence[InstanceDemand], budget: int) -> ThreadPlan:
    """Split ``budget`` cores over the instances: explicit asks first, the rest evenly.

    The even share is ``budget // instances`` (at least one); cores left over go one at a time to
    the instances in config order. An explicit ask above the budget is an error.
    """
    if budget < 1:
        raise ValueError(f"thread budget must be at least 1, got {budget}")
    threads: dict[str, int] = {}
    instances = {d.model: d.instances for d in demands}
    free = [d for d in demands if d.intra_op_threads is None]
    reserved = 0
    for d in demands:
        if d.intra_op_threads is not None:
            if not 1 <= d.intra_op_threads <= budget:
                raise ValueError(
                    f"model {d.model!r}: intra_op_threads={d.intra_op_threads} is outside "
                    f"1..{budget} (the thread budget)"
                )
            threads[d.model] = d.intra_op_threads
            reserved += d.intra_op_threads * d.instances
    remaining = max(0, budget - reserved)
    free_instances = sum(d.instances for d in free)
    if free_instances:
        share = max(1, remaining // free_instances)
        spare = max(0, remaining - share * free_instances)
        for d in free:
            extra = 1 if spare >= d.instances else 0
            spare -= extra * d.instances
            threads[d.model] = min(budget, share + extra)
    return ThreadPlan(budget=budget, threads_per_instance=threads, instances=instances)


class ComputeGate:
    """A first-come-first-served counting gate over the budget's cores.

    ``hold(n)`` blocks until ``n`` tokens are free and no earlier waiter is still queued.
    ``high_water`` is the most tokens ever held at once: the observable proof that the budget held.
    """

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self._free = tokens
        self._lock = threading.Lock()  # entered directly: cheaper than the condition's wrapper
        self._cond = threading.Condition(self._lock)
        self._queue: deque[object] = deque()
        self.high_water = 0

    def acquire(self, n: int) -> None:
        n = max(1, min(n, self.tokens))
        ticket = object()
        with self._lock:
            if not self._queue and self._free >= n:  # uncontended: no queueing, no wakeups
                self._free -= n
                self.high_water = max(self.high_water, self.tokens - self._free)
                return
            self._queue.append(ticket)
            while self._queue[0] is not ticket or self._free < n:
                self._cond.wait()
            self._queue.popleft()
            self._free -= n
            self.high_water = max(self.high_water, self.tokens - self._free)
            self._cond.notify_all()

    def release(self, n: int) -> None:
        n = max(1, min(n, self.tokens))
        with self._lock:
            self._free += n
            if self._queue:
                self._cond.notify_all()

    @contextmanager
    def hold(self, n: int) -> Iterator[None]:
        self.acquire(n)
        try:
            yield
        finally:
            self.release(n)


class Activity:
    """How many model instances of the process are warming up or serving a batch right now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._working = 0

    def enter(self) -> None:
        with self._lock:
            self._working += 1

    def leave(self) -> None:
        with self._lock:
            self._working -= 1

    def idle(self) -> bool:
        """No instance is at work (a racy read: it is asked again and again while it matters)."""
        return self._working == 0
