"""The thread plan and the compute gate."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from duomo.worker.thread_budget import ComputeGate, InstanceDemand, plan_threads
from tests.conftest import poll


def test_even_split_never_exceeds_the_budget_when_it_can() -> None:
    plan = plan_threads([InstanceDemand("a", 1), InstanceDemand("b", 1), InstanceDemand("c", 1)], 8)
    assert plan.threads_per_instance == {"a": 3, "b": 3, "c": 2}
    assert plan.total_threads == 8


def test_one_model_gets_every_core() -> None:
    assert plan_threads([InstanceDemand("a", 1)], 4).threads_per_instance == {"a": 4}


def test_more_instances_than_cores_get_one_thread_each_and_the_gate_caps_them() -> None:
    plan = plan_threads([InstanceDemand("a", 2), InstanceDemand("b", 1)], 2)
    assert plan.threads_per_instance == {"a": 1, "b": 1}
    assert plan.total_threads == 3
    assert plan.max_concurrent_threads == 2


def test_explicit_threads_are_kept_and_bounded() -> None:
    plan = plan_threads([InstanceDemand("a", 1, 2), InstanceDemand("b", 1)], 4)
    assert plan.threads_per_instance == {"a": 2, "b": 2}
    with pytest.raises(ValueError, match=r"outside 1\.\.4"):
        plan_threads([InstanceDemand("a", 1, 5)], 4)


def test_all_takes_the_whole_budget_and_reserves_none_of_it() -> None:
    plan = plan_threads(
        [InstanceDemand("det", 1, "all"), InstanceDemand("read", 1, "all"), InstanceDemand("c", 1)],
        budget=4,
    )
    assert plan.threads_per_instance == {"det": 4, "read": 4, "c": 4}
    assert plan.max_concurrent_threads == 4  # the gate has them take turns


def test_gate_never_lets_more_than_its_tokens_run() -> None:
    gate = ComputeGate(2)
    running = 0
    peak = 0
    lock = threading.Lock()

    def work(n: int, name: str) -> None:
        nonlocal running, peak
        member = gate.member(name)
        for _ in range(20):
            with member.hold(n):
                with lock:
                    running += n
                    peak = max(peak, running)
                time.sleep(0.001)  # the work done holding the tokens
                with lock:
                    running -= n

    threads = [threading.Thread(target=work, args=(n, f"m{i}")) for i, n in enumerate((1, 1, 1, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert peak <= 2
    assert gate.high_water == 2


def test_a_wide_turn_holds_the_line_once_it_is_next() -> None:
    """A waiter for two tokens is not overtaken by a later one-token waiter of equal standing."""
    gate = ComputeGate(2)
    order: list[str] = []
    holding = threading.Event()
    release = threading.Event()

    def hold_one() -> None:
        with gate.member("first").hold(1):
            holding.set()
            release.wait(10)

    def take(name: str, n: int) -> None:
        with gate.member(name).hold(n):
            order.append(name)

    first = threading.Thread(target=hold_one)
    first.start()
    assert holding.wait(10)
    wide = threading.Thread(target=take, args=("wide", 2))
    wide.start()
    poll(lambda: len(gate.policy.turns) == 1)  # "wide" is queued (one token is still free)
    narrow = threading.Thread(target=take, args=("narrow", 1))
    narrow.start()
    poll(lambda: len(gate.policy.turns) == 2 or bool(order))  # queued behind it, or run
    assert order == []  # "narrow" could run on the free token, but "wide" came first
    release.set()
    for t in (first, wide, narrow):
        t.join(10)
    assert order == ["wide", "narrow"]


def test_a_cgroup_cpu_quota_bounds_the_cores_a_process_keeps_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container's or pod's CPU limit (cgroup v2 ``cpu.max``, v1 cfs quota) does not shrink
    the affinity mask: the budget must follow the quota, the smallest along the path."""
    from duomo.worker import thread_budget

    quota = thread_budget.cpu_quota
    proc = tmp_path / "cgroup"  # what /proc/self/cgroup says
    monkeypatch.setattr(thread_budget, "usable_cores", lambda: list(range(16)))
    root = tmp_path / "fs"
    (root / "kubepods" / "pod1").mkdir(parents=True)
    proc.write_text("0::/kubepods/pod1\n")
    (root / "cpu.max").write_text("max 100000\n")
    (root / "kubepods" / "cpu.max").write_text("800000 100000\n")
    (root / "kubepods" / "pod1" / "cpu.max").write_text("250000 100000\n")
    assert quota(root, proc) == 2.5
    monkeypatch.setattr(thread_budget, "cpu_quota", lambda: 2.5)
    assert thread_budget.available_cores() == 3
    monkeypatch.setattr(thread_budget, "cpu_quota", lambda: None)
    assert thread_budget.available_cores() == 16
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "docker" / "abc").mkdir(parents=True)
    proc.write_text("4:cpu,cpuacct:/docker/abc\n0::/\n")
    (v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    assert quota(v1, proc) == 1.5
