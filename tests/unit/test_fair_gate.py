"""The compute gate's weighted fair share (``worker.thread_budget.FairShare``), driven as a
discrete-event simulation on a fake clock: models of very different costs take turn after
turn, and which model ran when is exact — no thread, no wall-clock time in any assertion."""

from __future__ import annotations

import random
import threading
import time

import pytest

from duomo.worker.thread_budget import ComputeGate, FairShare, GateMember


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Simulation:
    """Models that each ask for a turn again the moment one ends (closed loop, one turn
    at a time each), while they are ``active``; turns last their model's cost."""

    def __init__(
        self,
        tokens: int,
        costs: dict[str, float],
        weights: dict[str, float] | None = None,
        overdraft: int = 0,
    ) -> None:
        self.clock = FakeClock()
        self.gate = ComputeGate(tokens, overdraft, clock=self.clock)
        self.policy: FairShare = self.gate.policy
        self.costs = costs
        self.members: dict[str, GateMember] = {
            name: self.gate.member(name, (weights or {}).get(name, 1.0)) for name in costs
        }
        self.active: set[str] = set()
        self.running: list[tuple[float, str]] = []  # (end, model)
        self.high_water = 0

    def activate(self, *names: str) -> None:
        for name in names:
            self.active.add(name)
            if not self.members[name].waiting and not self.members[name].running:
                self.policy.ask(self.members[name], 1)

    def run(self, seconds: float) -> dict[str, float]:
        """Compute seconds per model over the next ``seconds`` (turns that end in them)."""
        spent = dict.fromkeys(self.costs, 0.0)
        end = self.clock.now + seconds
        while True:
            while (turn := self.policy.next_turn()) is not None:
                self.policy.start(turn)
                name = turn.member.name
                self.running.append((self.clock.now + self.costs[name], name))
                self.high_water = max(self.high_water, self.policy.held)
            if not self.running:
                return spent
            self.running.sort()
            finish, name = self.running[0]
            if finish > end:
                self.clock.now = end
                return spent
            self.running.pop(0)
            self.clock.now = finish
            self.policy.finish(self.members[name], 1)
            spent[name] += self.costs[name]
            if name in self.active:
                self.policy.ask(self.members[name], 1)

    def busy_share(self, spent: dict[str, float]) -> dict[str, float]:
        total = sum(spent.values())
        return {name: value / total for name, value in spent.items()}


COSTS = {"light": 0.001, "middle": 0.010, "heavy": 0.100}


@pytest.mark.parametrize("weights", [{}, {"light": 1, "middle": 2, "heavy": 4}])
def test_compute_time_follows_the_weights_behind_a_gate_of_one(weights: dict[str, float]) -> None:
    sim = Simulation(1, COSTS, weights)
    sim.activate(*COSTS)
    sim.run(20.0)  # settle
    shares = sim.busy_share(sim.run(20.0))
    total_weight = sum(weights.get(n, 1) for n in COSTS)
    for name in COSTS:
        assert shares[name] == pytest.approx(weights.get(name, 1) / total_weight, rel=0.10), shares
    shown = sim.gate.shares()  # what status shows: the window's shares, next to the weights
    for name in COSTS:
        assert shown[name]["share"] == pytest.approx(shares[name], rel=0.15)
        assert shown[name]["weight"] == weights.get(name, 1)


def test_an_idle_model_lends_its_share_at_once_and_gets_it_back() -> None:
    sim = Simulation(1, COSTS)
    sim.activate("light", "middle")  # heavy has nothing queued
    spent = sim.run(10.0)
    assert spent["heavy"] == 0.0
    assert sum(spent.values()) == pytest.approx(10.0, abs=0.011)  # nothing idled
    assert spent["light"] / spent["middle"] == pytest.approx(1.0, rel=0.10)
    sim.activate("heavy")  # back: parity with the others, no flood to catch up
    assert sim.run(1.0)["heavy"] <= 0.5
    sim.run(8.0)
    shares = sim.busy_share(sim.run(20.0))
    for name in COSTS:
        assert shares[name] == pytest.approx(1 / 3, rel=0.10), shares


def test_no_token_idles_while_a_turn_waits() -> None:
    """Two tokens, three one-token models always asking: busy time is twice the time."""
    sim = Simulation(2, {"a": 0.003, "b": 0.007, "c": 0.011})
    sim.activate("a", "b", "c")
    spent = sim.run(10.0)
    assert sum(spent.values()) == pytest.approx(2 * 10.0, abs=0.03)
    assert sim.high_water == 2


def test_an_under_served_model_may_start_beyond_the_budget() -> None:
    """A long run holds the one token; a light model that has used less starts beside it
    (overdraft 1), one that has used as much does not, and the budget's bound holds."""
    sim = Simulation(1, {"heavy": 1.0, "light": 0.005, "twin": 1.0}, overdraft=1)
    sim.activate("heavy")
    sim.run(0.01)  # heavy's first turn runs (1 s)
    sim.activate("light")
    spent = sim.run(0.5)
    assert spent["light"] == pytest.approx(0.5, abs=0.01)  # every turn beside heavy's
    assert sim.high_water == 2
    strict = Simulation(1, {"heavy": 1.0, "light": 0.005}, overdraft=0)
    strict.activate("heavy")
    strict.run(0.01)
    strict.activate("light")
    assert strict.run(0.5)["light"] == 0.0  # without an overdraft: it waits out the run


def test_priority_decides_among_equals_and_aging_bounds_the_wait() -> None:
    clock = FakeClock()
    gate = ComputeGate(1, clock=clock)
    policy = gate.policy
    holder = gate.member("holder")
    low = gate.member("low", priority=0, aging_per_s=10.0)
    high = gate.member("high", priority=5)
    policy.start(policy.ask(holder, 1))
    clock.now += 0.5
    low_turn, high_turn = policy.ask(low, 1), policy.ask(high, 1)  # low asked first
    policy.finish(holder, 1)
    assert policy.next_turn() is high_turn  # equal standing: the higher priority
    policy.withdraw(high_turn)
    policy.withdraw(low_turn)
    # the low one, waited long enough (0 + 10/s × 1 s > 5), goes before a fresh high one
    low_turn = policy.ask(low, 1)
    clock.now += 1.0
    high_turn = policy.ask(high, 1)
    assert policy.next_turn() is low_turn


def test_a_model_built_again_or_re_initialized_starts_at_the_average() -> None:
    sim = Simulation(1, COSTS)
    sim.activate(*COSTS)
    sim.run(10.0)
    now = sim.clock.now
    used = [sim.policy.used(m, now) for m in sim.members.values()]
    average = sum(used) / len(used)
    fresh = sim.gate.member("reloaded")
    assert sim.policy.used(fresh, now) == pytest.approx(average, rel=0.05)
    middle = sim.members["middle"]
    middle.rejoin()
    others = [sim.policy.used(m, now) for n, m in sim.members.items() if n != "middle"]
    assert sim.policy.used(middle, now) == pytest.approx(sum(others) / len(others), rel=0.05)


def test_every_waiter_is_started_even_as_the_order_moves_with_time() -> None:
    """Real threads, a clock that jumps on every reading (so which turn is next changes
    between any two looks at it): every turn is still handed out, none is lost."""
    lock = threading.Lock()
    rng = random.Random(7)
    now = [0.0]

    def jumpy() -> float:
        with lock:
            now[0] += rng.uniform(0.0, 0.05)
            return now[0]

    gate = ComputeGate(1, overdraft=1, clock=jumpy)
    done: list[str] = []

    def work(name: str, weight: float) -> None:
        member = gate.member(name, weight)
        for _ in range(200):
            with member.hold(1):
                time.sleep(0.0002)  # the work done holding the token
        done.append(name)

    threads = [
        threading.Thread(target=work, args=(f"m{i}", w), daemon=True)
        for i, w in enumerate((1.0, 1.0, 2.0, 4.0, 0.5))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert sorted(done) == [f"m{i}" for i in range(5)], f"stuck waiters: {len(threads) - len(done)}"
    assert gate.policy.held == 0 and not gate.policy.turns
    assert gate.high_water <= 2
