"""Does a change in the supervisor's process add work under the mixed load, or only move it
between models? The workload of ``duomo bench`` (``configs/bench/mixed.yaml``: its models,
images and closed-loop producers) against one supervisor per *variant*, the variants in turn and
then in reverse (A B … B A), so drift hits them alike:

- ``base``: the workload's config as ``duomo bench`` serves it;
- ``overdraft=N``: the cpu device's ``overdraft`` set to N (``0``: never more runs at once than
  the thread budget; the default ``1`` lets an under-served model's run start beyond it);
- ``switch=MS``: the supervisor's interpreter switch interval set to MS milliseconds (CPython's
  default is 5), through a ``sitecustomize`` module on the supervisor's ``PYTHONPATH``: no line
  of Duomo changes for it.

For each: every model's correct answers/s, the *work* (Σ answers/s ÷ that model's answers/s
alone in-process on one thread, measured first, as ``duomo bench`` weighs it), and per thread of
the supervisor the involuntary context switches per second and the CPU seconds (from
``/proc/PID/task``: a thread taken off its core by the scheduler, not waiting for anything).

    python -m tools.bench.experiments.bench_share_shift [--variants base,overdraft=0,switch=0.5]
        [--seconds 20] [--rounds 2] [--out DIR]

What it measured, and what issue 45 took from it: docs/benchmarks.md ("What was tried").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from tools.bench.children import open_window
from tools.bench.mixed_load import model_specs, producer_children, run_alone
from tools.bench.servers import DuomoServers
from tools.bench.tally import merge
from tools.bench.workload import load_workload

ROOT = Path(__file__).resolve().parents[3]
SITECUSTOMIZE = (
    "import os, sys\nsys.setswitchinterval(float(os.environ['DUOMO_XP_SWITCH_MS']) / 1e3)\n"
)


def _threads(pid: int) -> dict[int, tuple[int, float]]:
    """Per thread of ``pid``: (involuntary switches, CPU seconds) so far."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            sched = (task / "sched").read_text()
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        switches = next(
            int(line.split(":")[1]) for line in sched.splitlines() if "nr_involuntary" in line
        )
        ticks = os.sysconf("SC_CLK_TCK")
        out[int(task.name)] = (switches, (int(stat[11]) + int(stat[12])) / ticks)
    return out


def _serve(variant: str, workload: Any, models: list[dict[str, Any]], work: Path) -> dict[str, Any]:
    """One window of the mixed load against a supervisor of ``variant``."""
    names = [m["name"] for m in models]
    servers = DuomoServers(workload.config, [names], work)
    config_path = servers.configs[0][0]
    env_before = dict(os.environ)
    kind, _, value = variant.partition("=")
    if kind == "overdraft":
        config = yaml.safe_load(config_path.read_text())
        for device in config.setdefault("devices", [{"id": 0, "kind": "cpu"}]):
            device["overdraft"] = int(value)
        config_path.write_text(yaml.safe_dump(config))
    elif kind == "switch":
        (work / "sitecustomize.py").write_text(SITECUSTOMIZE)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(work), os.environ.get("PYTHONPATH")) if p
        )
        os.environ["DUOMO_XP_SWITCH_MS"] = value
    elif kind != "base":
        raise SystemExit(f"unknown variant {variant!r}: base, overdraft=N or switch=MS")
    try:
        servers.start()
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    try:
        pid = servers.pids()[0]
        children = producer_children(
            workload, servers, models, {m.name: m.producers for m in workload.models}
        )
        start_at, end_at = open_window(children, workload.warmup_s, workload.duration_s)
        time.sleep(max(0.0, start_at - time.time()))
        before = _threads(pid)
        time.sleep(max(0.0, end_at - time.time()))
        after = _threads(pid)
        tallies = [child.result() for child in children]
    finally:
        servers.stop()
    seconds = end_at - start_at
    threads = sorted(
        ((after[t][0] - before[t][0]) / seconds, after[t][1] - before[t][1])
        for t in after
        if t in before and after[t][1] - before[t][1] > 0.1 * seconds
    )
    figures = {name: merge([t for t in tallies if t["model"] == name]) for name in names}
    return {
        "rps": {name: f["ok"] / workload.duration_s for name, f in figures.items()},
        "wrong": sum(f["wrong"] for f in figures.values()),
        "busy_threads": [{"switches_per_s": s, "cpu_s": c} for s, c in reversed(threads)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, default=ROOT / "configs/bench/mixed.yaml")
    parser.add_argument("--variants", default="base,overdraft=0,switch=0.5")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args(argv)
    workload = load_workload(args.workload)
    workload = workload.model_copy(update={"duration_s": args.seconds})
    variants = args.variants.split(",")
    print("bench_share_shift: alone, in-process, one thread", file=sys.stderr, flush=True)
    alone = run_alone(workload)
    models = model_specs(workload, alone)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="duomo-share-shift-") as tmp:
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else list(reversed(variants)):
                print(f"bench_share_shift: round {r + 1}: {v}", file=sys.stderr, flush=True)
                work = Path(tmp) / f"{v.replace('=', '-')}-{r}"
                work.mkdir()
                runs[v].append(_serve(v, workload, models, work))
    names = [m["name"] for m in models]
    print("| variant | " + " | ".join(f"{n} answers/s" for n in names)
          + " | work | wrong | busiest threads: involuntary switches/s (CPU s) |")  # fmt: skip
    print("|---|" + "--:|" * (len(names) + 2) + "---|")
    for v, rounds in runs.items():
        cells = [" / ".join(f"{r['rps'][n]:.2f}" for r in rounds) for n in names]
        works = [sum(r["rps"][n] / alone[n]["rps"] for n in names) for r in rounds]
        busy = "; ".join(
            ", ".join(
                f"{t['switches_per_s']:.0f} ({t['cpu_s']:.1f})" for t in r["busy_threads"][:3]
            )
            for r in rounds
        )
        wrong = sum(r["wrong"] for r in rounds)
        print(f"| {v} | " + " | ".join(cells)
              + f" | {' / '.join(f'{w:.3f}' for w in works)} (mean {statistics.fmean(works):.3f})"
              + f" | {wrong} | {busy} |")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"alone": alone, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
