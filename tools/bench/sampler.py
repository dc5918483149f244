"""Memory and CPU of a mode's server processes (the roots ``duomo bench`` started and all their
descendants), sampled on a thread while the load runs.

Used by every part of the benchmark around its measured windows: resident memory is the peak
of the sum over the tree (sampled every ``period_s``), plus the proportional set size at the end
of the window (shared pages split between the processes that map them); CPU is the tree's user +
system time over the window, in cores; and the whole machine's cores busy (every process and the
kernel) and stolen by the hypervisor over the same window, which show whether a layout left a
core idle and whether the host took one away meanwhile. Before a trial, ``wait_quiet`` waits for
the shared machine's other work to die down (``tools.bench.pipelines``, ``tools.bench.sharing``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psutil


def process_tree(roots: list[int]) -> list[psutil.Process]:
    procs: dict[int, psutil.Process] = {}
    for pid in roots:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                procs[proc.pid] = proc
        except psutil.NoSuchProcess:
            continue
    return list(procs.values())


def _tree_sum(roots: list[int], read: Callable[[psutil.Process], float]) -> float:
    """``read`` summed over the tree's processes (those that exit meanwhile count as 0)."""
    total = 0.0
    for proc in process_tree(roots):
        try:
            total += read(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def tree_rss(roots: list[int]) -> int:
    return int(_tree_sum(roots, lambda p: p.memory_info().rss))


def tree_pss(roots: list[int]) -> int:
    return int(_tree_sum(roots, lambda p: p.memory_full_info().pss))


def _cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system + t.children_user + t.children_system)


def tree_cpu_seconds(roots: list[int]) -> float:
    """User + system seconds of the tree's live processes and of their children already reaped."""
    return _tree_sum(roots, _cpu_seconds)


def machine_cpu() -> tuple[float, float, float]:
    """The machine's CPU seconds so far, summed over its CPUs: (busy, stolen, all)."""
    t = psutil.cpu_times()
    steal = float(getattr(t, "steal", 0.0))
    idle = float(t.idle) + float(getattr(t, "iowait", 0.0))
    busy = sum(float(getattr(t, f)) for f in ("user", "nice", "system", "irq", "softirq")
               if hasattr(t, f))  # fmt: skip
    return busy, steal, busy + idle + steal


def machine_cores(
    before: tuple[float, float, float], after: tuple[float, float, float]
) -> dict[str, float]:
    """Cores busy and stolen between two ``machine_cpu()`` readings."""
    cpus = psutil.cpu_count() or 1
    span = after[2] - before[2]
    if span <= 0:
        return {"machine_busy_cores": 0.0, "machine_steal_cores": 0.0}
    return {
        "machine_busy_cores": cpus * (after[0] - before[0]) / span,
        "machine_steal_cores": cpus * (after[1] - before[1]) / span,
    }


class TreeSampler:
    """``start()`` … ``stop()`` → peak RSS, PSS at stop, CPU cores used in between (the tree's,
    and the machine's busy and stolen)."""

    def __init__(self, roots: list[int], period_s: float = 0.25) -> None:
        self.roots = roots
        self.period_s = period_s
        self.peak_rss = 0
        self.processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._cpu0 = 0.0
        self._t0 = 0.0
        self._machine0 = (0.0, 0.0, 0.0)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak_rss = max(self.peak_rss, tree_rss(self.roots))

    def start(self) -> TreeSampler:
        self._cpu0 = tree_cpu_seconds(self.roots)
        self._machine0 = machine_cpu()
        self._t0 = time.monotonic()
        self.peak_rss = tree_rss(self.roots)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        cpu = tree_cpu_seconds(self.roots) - self._cpu0
        machine = machine_cores(self._machine0, machine_cpu())
        elapsed = time.monotonic() - self._t0
        self.peak_rss = max(self.peak_rss, tree_rss(self.roots))
        return {
            "rss_peak_mib": self.peak_rss / 2**20,
            "pss_end_mib": tree_pss(self.roots) / 2**20,
            "processes": len(process_tree(self.roots)),
            "cpu_cores": cpu / elapsed if elapsed > 0 else 0.0,
            **machine,
        }


def others_busy(seconds: float = 1.0) -> float:
    """Cores the machine kept busy over ``seconds`` (nothing of this run's is running)."""
    before = machine_cpu()
    time.sleep(seconds)
    return machine_cores(before, machine_cpu())["machine_busy_cores"]


def wait_quiet(below_cores: float, wait_s: float) -> dict[str, float]:
    """Before a trial, wait up to ``wait_s`` for the shared machine's other work to fall below
    ``below_cores`` cores: how long it waited and what it saw last."""
    started = time.monotonic()
    busy = others_busy()
    while busy >= below_cores and time.monotonic() - started < wait_s:
        busy = others_busy()
    return {"waited_s": round(time.monotonic() - started, 1), "busy_before": round(busy, 2)}
