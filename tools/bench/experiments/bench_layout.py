"""Where the cores go with the three models at once and no IPC at all: the executors in one
process behind the compute gate (the supervisor's layout), in one process with the gate opened
to one token per model, and in one process per model (the layout of ``per-model-tuned`` and the
peers). Every instance runs one intra-op thread in a closed loop on its model's first image of
the bench workload (``configs/bench/mixed.yaml``).

Per layout and round: each model's answers/s, the **work** (Σ answers/s ÷ that model's
answers/s alone, measured in the same round, one model at a time on one thread), and the whole
machine's cores busy and stolen by the hypervisor over the window (``/proc/stat``). Layouts
interleave (A B C, then C B A, …) so drift cancels; each round starts with the alone weights.
A rate is the calls that ended inside the window over the time from its start to the last one's
end, alone and together alike, so a model at one answer per second is not counted in whole
answers per window.

    python -m tools.bench.experiments.bench_layout --rounds 3 --seconds 20 [--out FILE.json]

A research tool of ``duomo bench``'s analysis (docs/benchmarks.md); not run by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
WORKLOAD = ROOT / "configs" / "bench" / "mixed.yaml"
CORES = len(os.sched_getaffinity(0))
SETTLE_S = 2.0  # the machine's counters start this long into the window, end this long before


def layouts(names: list[str]) -> dict[str, list[tuple[list[str], int]]]:
    """Layout → the processes it runs: (models, gate tokens; 0 = no gate)."""
    return {
        "one process, gate of the cores": [(names, CORES)],
        "one process, a token per model": [(names, len(names))],
        "a process per model": [([name], 0) for name in names],
    }


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the spec's models, wait for the window, and drive them: ``alone`` one after the
    other (the window split between them), ``together`` one thread each at once. Per model: the
    calls that ended inside its window and the seconds from its start to the last one's end."""
    from duomo.supervisor.config import load_config
    from duomo.supervisor.core.memory import tune_heap
    from duomo.supervisor.operators.image_files import read_image
    from duomo.worker.thread_budget import ComputeGate
    from tools.bench.inprocess import await_window, open_executor, run_one

    tune_heap()  # as the supervisor process does
    loaded = load_config(spec["config"])
    gate = ComputeGate(spec["tokens"]) if spec["tokens"] else None
    models: dict[str, str] = spec["models"]
    executors = {name: open_executor(loaded, name, 1, gate) for name in models}
    images = {name: read_image(path) for name, path in models.items()}
    start_at, end_at = await_window()
    figures: dict[str, Any] = {}

    def drive(name: str, begin: float, end: float) -> None:
        while time.time() < begin:
            time.sleep(0.001)
        calls, last = 0, begin
        while True:
            run_one(executors[name], images[name])
            now = time.time()
            if now > end:
                break
            calls, last = calls + 1, now
        figures[name] = {"calls": calls, "span_s": last - begin}

    if spec["mode"] == "alone":
        share = (end_at - start_at) / len(models)
        for i, name in enumerate(models):
            drive(name, start_at + i * share, start_at + (i + 1) * share)
    else:
        threads = [threading.Thread(target=drive, args=(n, start_at, end_at)) for n in models]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return figures


def _rate(figures: dict[str, Any]) -> float:
    return figures["calls"] / figures["span_s"] if figures["calls"] else 0.0


def _run(
    config: Path,
    images: dict[str, str],
    processes: list[tuple[list[str], int]],
    mode: str,
    seconds: float,
) -> dict[str, Any]:
    """Start ``processes``, give them one window of ``seconds``, read the machine's CPU across
    it (``together`` only): each model's answers/s and the machine's cores."""
    from tools.bench.children import Child, open_window
    from tools.bench.sampler import machine_cores, machine_cpu

    children: list[Child] = []
    try:
        for models, tokens in processes:
            spec = {"config": str(config), "models": {n: images[n] for n in models},
                    "tokens": tokens, "mode": mode}  # fmt: skip
            children.append(Child("tools.bench.experiments.bench_layout", ["--child"], spec))
        start_at, end_at = open_window(children, 1.0, seconds)
        machine: dict[str, float] = {}
        if mode == "together":
            settle = min(SETTLE_S, seconds / 4)
            time.sleep(max(0.0, start_at + settle - time.time()))
            before = machine_cpu()
            time.sleep(max(0.0, end_at - settle - time.time()))
            machine = machine_cores(before, machine_cpu())
        rates: dict[str, float] = {}
        for child in children:
            rates.update({name: _rate(f) for name, f in child.result().items()})
    finally:
        for child in children:
            if child.process.poll() is None:
                child.process.kill()
    return {"rps": rates, **machine}


def measure(rounds: int, seconds: float) -> dict[str, Any]:
    from tools.bench.workload import load_workload

    workload = load_workload(WORKLOAD)
    images = {m.name: str(m.images[0]) for m in workload.models}
    names = list(images)
    plan = layouts(names)
    results: dict[str, list[dict[str, Any]]] = {layout: [] for layout in plan}
    alone_rounds = []
    for r in range(rounds):
        weights = _run(workload.config, images, [(names, 0)], "alone", seconds / 2 * len(names))
        if not all(weights["rps"].values()):
            raise RuntimeError(f"a model ran no call alone in {seconds / 2:g} s: {weights}")
        alone_rounds.append(weights["rps"])
        for layout in list(plan) if r % 2 == 0 else list(reversed(plan)):
            got = _run(workload.config, images, plan[layout], "together", seconds)
            work = sum(got["rps"][n] / weights["rps"][n] for n in names)
            results[layout].append({**got, "work": work})
            print(
                f"round {r + 1}: {layout:32s} work {work:.3f}  cores busy "
                f"{got['machine_busy_cores']:.2f} (stolen {got['machine_steal_cores']:.2f})  "
                + "  ".join(f"{n} {v:.2f}/s" for n, v in got["rps"].items()),
                file=sys.stderr,
                flush=True,
            )
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cores": CORES,
        "seconds": seconds,
        "alone_rounds": alone_rounds,
        "layouts": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="each layout's window")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # tools.bench.children.Child's protocol: spec on stdin, one JSON line back
        print(json.dumps(_child(json.loads(sys.stdin.readline()))), flush=True)
        return 0
    result = measure(args.rounds, args.seconds)
    for layout, rows in result["layouts"].items():
        works = " / ".join(f"{row['work']:.3f}" for row in rows)
        busy = " / ".join(f"{row['machine_busy_cores']:.2f}" for row in rows)
        print(f"{layout}: work {works}; machine cores busy {busy}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
