"""CPU thread budgets: how many intra-op threads each model instance gets, and the gate that
keeps the threads computing at once within the cores.

One budget and one gate per pool of cores: the process's shared pool, and each cpu device that
has cores of its own (``devices[].cores``; its threads are pinned there with ``pin_thread``).

Called by the engine when it plans its models (``plan_threads``, per pool) and makes a gate per
device, and by every backend session around each execution (its model's ``GateMember``).

Invariants:
- every instance gets at least one intra-op thread and never more than the budget;
- with the gate, the intra-op threads computing at the same moment never exceed the budget, so
  three single-threaded models on two cores run two at a time instead of three time-slicing;
- the gate shares compute time by weighted fair share (the rule: ``ComputeGate``), so a light
  model is not starved by a heavy one, and no token idles while a model waits.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from duomo.worker.cgroup_limits import cpu_quota


def usable_cores() -> list[int]:
    """The ids of the cores this process may run on (its main thread's affinity mask, not the
    machine's, nor a pinned thread's)."""
    try:
        return sorted(os.sched_getaffinity(os.getpid()))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


def available_cores() -> int:
    """How many cores this process may keep busy: the cores it may run on, fewer under a
    cgroup CPU quota (a container's or a Kubernetes pod's CPU limit, which does not shrink the
    affinity mask)."""
    cores = max(1, len(usable_cores()))
    quota = cpu_quota()
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def pin_thread(cores: Sequence[int]) -> None:
    """Run the calling thread (and the threads it starts from now on) only on ``cores``."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)  # 0: the calling thread, on Linux


@dataclass(frozen=True)
class InstanceDemand:
    """One model's ask: how many instances, and an explicit thread count if the config has one."""

    model: str
    instances: int
    intra_op_threads: int | Literal["all"] | None = None  # "all": the whole budget


@dataclass(frozen=True)
class ThreadPlan:
    """How a pool's thread budget is split: intra-op threads per instance and instances per
    model."""

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
    the instances in config order. An explicit ask above the budget is an error. An ask for
    "all" gets the whole budget and reserves none of it: the compute gate lets its runs take
    turns with the others' (two stages of a pipeline, each as fast alone as one model would be).
    """
    if budget < 1:
        raise ValueError(f"thread budget must be at least 1, got {budget}")
    threads: dict[str, int] = {}
    instances = {d.model: d.instances for d in demands}
    free = [d for d in demands if d.intra_op_threads is None]
    reserved = 0
    for d in demands:
        if d.intra_op_threads == "all":
            threads[d.model] = budget
        elif d.intra_op_threads is not None:
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


@dataclass
class GateMember:
    """One model's place at a ``ComputeGate``: its weight and priority, and the compute time its
    turns took (decayed). Sessions hold it as their gate: ``acquire(n)`` / ``release(n)``."""

    gate: ComputeGate
    name: str
    weight: float = 1.0
    priority: int = 0
    aging_per_s: float = 0.0
    usage: float = 0.0  # token-seconds of finished turns, decayed to ``stamp``
    stamp: float = 0.0
    running: int = 0  # tokens held now
    running_since: float = 0.0  # Σ tokens × start over the turns in progress
    waiting: int = 0  # turns asked for and not started yet
    idle_since: float = 0.0  # when it last had no turn asked for or running

    def acquire(self, n: int) -> None:
        self.gate.acquire(self, n)

    def release(self, n: int) -> None:
        self.gate.release(self, n)

    def rejoin(self) -> None:
        """A re-initialized model's next turns start at the current average (``FairShare``)."""
        self.gate.rejoin(self)

    @contextmanager
    def hold(self, n: int) -> Iterator[None]:
        self.acquire(n)
        try:
            yield
        finally:
            self.release(n)


@dataclass
class Turn:
    """A turn asked for: whose, how many tokens, in which order, since when; ``started`` once
    the gate has given it its tokens."""

    member: GateMember
    n: int
    seq: int
    since: float
    started: bool = False


class FairShare:
    """The rule by which a ``ComputeGate`` shares its ``tokens`` (cores; on an accelerator,
    runs at once): weighted fair share of compute time. Bookkeeping only, no threads: the gate
    consults it under its lock, and tests drive it with a fake clock.

    - *Measured*: what each model's turns actually took, in token-seconds (tokens held × the
      time they were held), counted as the turn goes: a turn in progress counts up to now.
    - *Window*: a sliding one, with exponential decay: a token-second spent ``t`` seconds ago
      counts ``2^(-t / HALF_LIFE_S)`` (``HALF_LIFE_S`` = 2 s: the last few seconds decide).
    - *Standing*: a model's decayed usage ÷ its ``compute_weight`` (default 1: equal shares).
    - *Who goes next*: of the turns asked for, the one whose model has the lowest standing;
      standings within ``EQUAL_STANDING_S`` are equal, and among equals the higher effective
      priority goes first (``priority`` plus ``priority_aging_per_s`` for every second the turn
      has waited, as requests age in the batcher), then the earlier ask.
    - *Beyond the budget*: an ORT run cannot be preempted, so a light model that asks while
      heavy ones hold every token would wait out one of their long runs each time. The turn
      that goes next may therefore start beyond the budget, with at most ``overdraft`` extra
      tokens in use, when its model's standing is below that of every model running: the
      cores are then time-sliced among them by the operating system, which is what lets the
      under-served model catch up. A model at or above the others' standing never overdraws.
    - *Work-conserving*: only models that ask compete, so one with nothing queued lends its
      share to the others, and no token stays free while a turn that fits waits for it (the
      turn that goes next but needs more tokens than are free holds the line: a run that
      needs the whole budget is never starved by one-token runs).
    - *A late arrival* (a model that has asked for nothing for ``RETURN_GAP_S`` or longer)
      starts at least at the lowest standing among the models active now: idle time earns no
      credit beyond that, so it catches up to parity with the least-served and no further. (A
      model that asks again within the gap — between one run and the next of a closed loop —
      keeps what it is owed.) A model built again (``join``, as a reload does) or
      re-initialized (``rejoin``) starts at the active models' average: a restart neither
      starves nor floods.
    """

    HALF_LIFE_S = 2.0
    EQUAL_STANDING_S = 0.002
    RETURN_GAP_S = 0.25

    def __init__(self, tokens: int, overdraft: int, clock: Callable[[], float]) -> None:
        self.tokens = tokens
        self.overdraft = overdraft
        self.clock = clock
        self.held = 0  # tokens in use (above ``tokens`` while overdrawn)
        self.members: dict[str, GateMember] = {}
        self.turns: list[Turn] = []
        self._seq = itertools.count()

    def join(self, member: GateMember) -> None:
        self.rejoin(member)
        self.members[member.name] = member  # (turns of a replaced one end on the old object)

    def rejoin(self, member: GateMember) -> None:
        now = self.clock()
        member.stamp = member.idle_since = now
        member.usage = self._average_standing(now, exclude=member.name) * member.weight

    def ask(self, member: GateMember, n: int) -> Turn:
        now = self.clock()
        idle = not member.waiting and not member.running
        if idle and now - member.idle_since >= self.RETURN_GAP_S:  # a late arrival: no credit
            floor = self._lowest_active_standing(now, exclude=member)
            if floor is not None:
                self._decay(member, now)
                member.usage = max(member.usage, floor * member.weight)
        turn = Turn(member, n, next(self._seq), now)
        self.turns.append(turn)
        member.waiting += 1
        return turn

    def withdraw(self, turn: Turn) -> None:
        self.turns.remove(turn)
        turn.member.waiting -= 1

    def next_turn(self) -> Turn | None:
        """The turn that may start now, or None (the rule above)."""
        if not self.turns:
            return None
        now = self.clock()
        quantum = self.EQUAL_STANDING_S

        def key(turn: Turn) -> tuple[float, float, int]:
            standing = self.used(turn.member, now) / turn.member.weight
            effective = turn.member.priority + turn.member.aging_per_s * (now - turn.since)
            return (round(standing / quantum), -effective, turn.seq)

        best = min(self.turns, key=key)
        if self.held + best.n <= self.tokens:
            return best
        if self.held + best.n <= self.tokens + self.overdraft and self._under_served(best, now):
            return best
        return None

    def start(self, turn: Turn) -> None:
        self.withdraw(turn)
        turn.started = True
        now = self.clock()
        self.held += turn.n
        turn.member.running += turn.n
        turn.member.running_since += turn.n * now

    def finish(self, member: GateMember, n: int) -> None:
        now = self.clock()
        self._decay(member, now)
        started = member.running_since / member.running if member.running else now
        member.usage += n * max(0.0, now - started)
        member.running_since -= n * started
        member.running -= n
        self.held -= n
        if not member.running and not member.waiting:
            member.idle_since = now

    def used(self, member: GateMember, now: float) -> float:
        """Decayed token-seconds, with the turns in progress counted up to ``now``."""
        decayed = member.usage * 2.0 ** (-max(0.0, now - member.stamp) / self.HALF_LIFE_S)
        return decayed + member.running * now - member.running_since

    def shares(self) -> dict[str, dict[str, float]]:
        """Per model: its weight and its share of the compute time in the window (0..1)."""
        now = self.clock()
        used = {name: self.used(m, now) for name, m in self.members.items()}
        total = sum(used.values())
        return {
            name: {"weight": m.weight, "share": used[name] / total if total else 0.0}
            for name, m in self.members.items()
        }

    def _under_served(self, turn: Turn, now: float) -> bool:
        mine = self.used(turn.member, now) / turn.member.weight
        running = [
            self.used(m, now) / m.weight
            for m in self.members.values()
            if m.running and m is not turn.member
        ]
        return bool(running) and mine < min(running)

    def _decay(self, member: GateMember, now: float) -> None:
        if now > member.stamp:
            member.usage *= 2.0 ** (-(now - member.stamp) / self.HALF_LIFE_S)
            member.stamp = now

    def _lowest_active_standing(self, now: float, exclude: GateMember) -> float | None:
        standings = [
            self.used(m, now) / m.weight
            for m in self.members.values()
            if m is not exclude and (m.waiting or m.running)
        ]
        return min(standings, default=None)

    def _average_standing(self, now: float, exclude: str) -> float:
        standings = [
            self.used(m, now) / m.weight
            for name, m in self.members.items()
            if name != exclude and (m.waiting or m.running)
        ]
        return sum(standings) / len(standings) if standings else 0.0


class ComputeGate:
    """The gate every backend session holds around each run: its ``FairShare`` under a lock.
    Turns are handed out, not raced for: whenever a turn is asked for or tokens are given back,
    the gate starts every turn the rule lets start (``_dispatch``), and a waiting thread only
    waits for its own turn to be started. (Letting each waiter judge for itself whether it is
    next would lose a turn: the rule's order moves with time — usage decays, runs count up,
    waits age — so the one that is next may have looked, found another next, and slept.)
    ``high_water`` is the most tokens ever held at once: the observable proof that the budget
    held (``tokens`` + ``overdraft`` at most)."""

    def __init__(
        self, tokens: int, overdraft: int = 0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.tokens = tokens
        self.overdraft = overdraft
        self.policy = FairShare(tokens, overdraft, clock)
        self._lock = threading.Lock()  # entered directly: cheaper than the condition's wrapper
        self._cond = threading.Condition(self._lock)
        self.high_water = 0

    @property
    def runs_alone(self) -> bool:
        """Whether it starts one run at a time, never two together (one token, no overdraft)."""
        return self.tokens == 1 and self.overdraft == 0

    def member(
        self, name: str, weight: float = 1.0, priority: int = 0, aging_per_s: float = 0.0
    ) -> GateMember:
        """``name``'s place at the gate (made, or made again for a model built again)."""
        member = GateMember(self, name, weight, priority, aging_per_s)
        with self._lock:
            self.policy.join(member)
        return member

    def rejoin(self, member: GateMember) -> None:
        with self._lock:
            self.policy.rejoin(member)

    def acquire(self, member: GateMember, n: int) -> None:
        n = max(1, min(n, self.tokens))
        policy = self.policy
        with self._lock:
            turn = policy.ask(member, n)
            self._dispatch()
            try:
                while not turn.started:
                    self._cond.wait()
            except BaseException:  # (interrupted: give back what it was or would be given)
                if turn.started:
                    policy.finish(member, n)
                    self._dispatch()
                else:
                    policy.withdraw(turn)
                raise

    def release(self, member: GateMember, n: int) -> None:
        n = max(1, min(n, self.tokens))
        with self._lock:
            self.policy.finish(member, n)
            self._dispatch()

    def _dispatch(self) -> None:
        """With the lock held: start every turn the rule lets start now, and wake them."""
        started = False
        while (turn := self.policy.next_turn()) is not None:
            self.policy.start(turn)
            started = True
        if started:
            self.high_water = max(self.high_water, self.policy.held)
            self._cond.notify_all()

    def shares(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return self.policy.shares()
