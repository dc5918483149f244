"""Where the cores go with the three models at once and no IPC at all: the executors in one
process behind the compute gate (the supervisor's layout), in one process with the gate opened
to one token per model, and in one process per model (the layout of ``per-model-tuned`` and the
peers). Every instance runs one intra-op thread in a closed loop on its fixture image.

Per layout and round: each model's answers/s, the **work** (Σ answers/s ÷ that model's
answers/s alone, measured in the same round, one model at a time on one thread), and the whole
machine's cores busy and stolen by the hypervisor over the window (``/proc/stat``). Layouts
interleave (A B C, then C B A, …) so drift cancels; each round starts with the alone weights.

    python tools/bench_layout.py --rounds 3 --seconds 20 [--out FILE.json]

A research tool of ``duomo bench``'s analysis (README "Benchmarks"); not run by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "default.yaml"
IMAGES = {
    "ocr": ROOT / "tests/fixtures/images/page.png",
    "face": ROOT / "tests/fixtures/images/astronaut.png",
    "classify": ROOT / "tests/fixtures/images/coffee.png",
}
CORES = len(os.sched_getaffinity(0))
# layout → the processes it runs: (models, gate tokens; 0 = no gate)
LAYOUTS: dict[str, list[tuple[list[str], int]]] = {
    "one process, gate of the cores": [(list(IMAGES), CORES)],
    "one process, a token per model": [(list(IMAGES), len(IMAGES))],
    "a process per model": [([name], 0) for name in IMAGES],
}
SETTLE_S = 2.0  # the machine's counters start this long into the window


def _child(models: list[str], tokens: int, mode: str) -> None:
    """Load ``models``, say ``ready``, read the window's start and length, and drive: ``alone``
    runs the models one after the other, ``together`` one thread each at once. Prints, per
    model, the calls that ended inside the window, the seconds they took, and the seconds from
    the window's start to the last one's end (so a model at one answer per second is not
    counted in whole answers per window)."""
    from supervisor.config import load_config
    from supervisor.image_files import read_image
    from supervisor.memory import tune_heap
    from tools.bench.inprocess import open_executor, run_one
    from worker.thread_budget import ComputeGate

    tune_heap()
    loaded = load_config(CONFIG)
    gate = ComputeGate(tokens) if tokens else None
    executors = {name: open_executor(loaded, name, 1, gate) for name in models}
    images = {name: read_image(IMAGES[name]) for name in models}
    print("ready", flush=True)
    start_at, seconds = (float(x) for x in sys.stdin.readline().split())
    figures: dict[str, dict[str, float]] = {}

    def drive(name: str, begin: float, end: float) -> None:
        while time.time() < begin:
            time.sleep(0.001)
        calls, busy, last = 0, 0.0, begin
        while True:
            t0 = time.time()
            run_one(executors[name], images[name])
            t1 = time.time()
            if t1 > end:
                break
            calls, busy, last = calls + 1, busy + (t1 - t0), t1
        figures[name] = {"calls": calls, "busy_s": busy, "span_s": last - begin}

    if mode == "alone":
        for i, name in enumerate(models):
            begin = start_at + i * seconds
            drive(name, begin, begin + seconds)
    else:
        threads = [
            threading.Thread(target=drive, args=(n, start_at, start_at + seconds)) for n in models
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    print(json.dumps(figures), flush=True)


def _run(processes: list[tuple[list[str], int]], mode: str, seconds: float) -> dict[str, Any]:
    """Start ``processes``, give them one window, read the machine's CPU across it."""
    from tools.bench.sampler import machine_cores, machine_cpu

    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps([models, tokens, mode])],
            cwd=ROOT,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for models, tokens in processes
    ]
    for child in children:
        assert child.stdout is not None and child.stdin is not None
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{child.args!r} did not start")
    start_at = time.time() + 1.0
    for child in children:
        assert child.stdin is not None
        child.stdin.write(f"{start_at} {seconds}\n")
        child.stdin.flush()
    machine: dict[str, float] = {}
    if mode == "together":
        time.sleep(max(0.0, start_at + SETTLE_S - time.time()))
        before = machine_cpu()
        time.sleep(max(0.0, start_at + seconds - SETTLE_S - time.time()))
        machine = machine_cores(before, machine_cpu())
    figures: dict[str, Any] = {}
    for child in children:
        out, _ = child.communicate(timeout=600)
        if child.returncode != 0:
            raise RuntimeError(f"{child.args!r} exited {child.returncode}")
        figures.update(json.loads(out.strip().splitlines()[-1]))
    return {"models": figures, **machine}


def measure(rounds: int, seconds: float) -> dict[str, Any]:
    names = list(IMAGES)
    results: dict[str, list[dict[str, Any]]] = {layout: [] for layout in LAYOUTS}
    alone_rounds = []
    for r in range(rounds):
        alone = _run([(names, 0)], "alone", seconds / 2)["models"]
        weights = {n: alone[n]["calls"] / alone[n]["busy_s"] for n in names}
        alone_rounds.append(weights)
        order = list(LAYOUTS) if r % 2 == 0 else list(reversed(LAYOUTS))
        for layout in order:
            got = _run(LAYOUTS[layout], "together", seconds)
            rps = {n: got["models"][n]["calls"] / got["models"][n]["span_s"] for n in names}
            work = sum(rps[n] / weights[n] for n in names)
            row = {"rps": rps, "work": work, **{k: v for k, v in got.items() if k != "models"}}
            results[layout].append(row)
            print(
                f"round {r + 1}: {layout:32s} work {work:.3f}  cores busy "
                f"{row['machine_busy_cores']:.2f} (stolen {row['machine_steal_cores']:.2f})  "
                + "  ".join(f"{n} {v:.2f}/s" for n, v in rps.items()),
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
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        models, tokens, mode = json.loads(args.child)
        _child(models, tokens, mode)
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
