"""Two cpu devices of one core each against one device of two cores, on the mixed load of
``duomo bench`` (``configs/bench/mixed.yaml``: the demo's three models at once, closed loop):
*work* and p99 per model for each layout.

The layouts (each the demo config, ``configs/default.yaml``, with only its devices and its
models' placement changed):

- ``one-2core``: one cpu device with both cores (the demo config as it is): one gate of two
  tokens, each model one instance of one intra-op thread;
- ``two-1core-both``: two devices of one core each (``devices[].cores``), every model on both
  (``device: [0, 1]``, ``instances: 2``): each device's gate has one token, each instance's
  threads are pinned to its core;
- ``two-1core-split``: the same two devices, OCR (the heavy model) alone on device 0, face and
  classify on device 1.

Each layout is one ``duomo bench --modes duomo --rounds 1`` run (its own alone phase, so *work*
is weighed on the same minutes); the layouts run in turn, then in reverse (``--rounds`` times
each), so drift hits them alike. Needs two usable cores (their ids are taken from the
process's affinity).

Run as ``python -m tools.bench.devices [--rounds N] [--duration S] [--out DIR]``; prints a
Markdown table and keeps each run's report under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from duomo.supervisor.dataflow.pipeline_config import entries_over
from duomo.worker.thread_budget import usable_cores
from tools.bench.report import per_round

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = ("one-2core", "two-1core-both", "two-1core-split")
MODELS = ("ocr", "face", "classify")


def layout_config(layout: str, cores: list[int]) -> dict[str, Any]:
    """The demo config with ``layout``'s devices and placement."""
    raw: dict[str, Any] = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    raw["model_root"] = str(ROOT / "models")
    for key in ("gateway", "metrics"):  # (fixed ports; the duomo mode uses neither)
        raw.pop(key, None)
    # the mixed workload's models (not the demo's second stage, which it sends nothing)
    raw["models"] = [m for m in raw["models"] if m["name"] in MODELS]
    raw["pipelines"] = entries_over(raw.get("pipelines"), MODELS)
    if layout == "one-2core":
        return raw
    raw["devices"] = [{"id": i, "kind": "cpu", "cores": [core]} for i, core in enumerate(cores)]
    for model in raw["models"]:
        if layout == "two-1core-both":
            model.update(device=[0, 1], instances=2)
        else:
            model["device"] = 0 if model["name"] == "ocr" else 1
    return raw


def write_workload(folder: Path, layout: str, cores: list[int], duration_s: float) -> Path:
    config = folder / f"{layout}.yaml"
    config.write_text(yaml.safe_dump(layout_config(layout, cores)))
    workload = yaml.safe_load((ROOT / "configs/bench/mixed.yaml").read_text())
    images = ROOT / "configs" / "bench"  # the workload's paths are relative to its file
    for model in workload["models"]:
        model["images"] = [str((images / p).resolve()) for p in model["images"]]
    workload.update(config=str(config), modes=["duomo"], rounds=1, duration_s=duration_s)
    workload.update(overhead_models=[], idle_s=0)  # (the layouts differ in neither)
    path = folder / f"{layout}.workload.yaml"
    path.write_text(yaml.safe_dump(workload))
    return path


def bench_once(workload: Path, out: Path) -> dict[str, Any]:
    subprocess.run(
        [sys.executable, "-m", "tools.bench.run", "-w", str(workload), "--out", str(out)],
        cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    duomo = report["modes"]["duomo"]
    return {
        "work": duomo["work"],
        "rps": {m: duomo["models"][m]["rps"] for m in MODELS},
        "p99": {m: duomo["models"][m]["p99_ms"] for m in MODELS},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.devices")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each layout")
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds a run")
    parser.add_argument("--out", type=Path, default=None, help="keep each run's report here")
    args = parser.parse_args(argv)
    cores = usable_cores()[:2]
    if len(cores) < 2:
        print("needs two usable cores", file=sys.stderr)
        return 2
    results: dict[str, list[dict[str, Any]]] = {layout: [] for layout in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        out = args.out or folder / "reports"
        workloads = {lay: write_workload(folder, lay, cores, args.duration) for lay in LAYOUTS}
        order = [
            lay for r in range(args.rounds) for lay in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1])
        ]
        for i, layout in enumerate(order):
            result = bench_once(workloads[layout], out / f"{i:02d}-{layout}")
            results[layout].append(result)
            print(f"{layout}: work {result['work']:.3f}", file=sys.stderr)
    print(table(results))
    return 0


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "| layout | work (median) | work per run | answers/s ocr/face/classify | "
        "p99 ms ocr/face/classify |",
        "|---|--:|---|---|---|",
    ]
    for layout, runs in results.items():
        if not runs:
            continue

        rps = "/".join(f"{_median(runs, 'rps', m):.1f}" for m in MODELS)
        p99 = "/".join(f"{_median(runs, 'p99', m):.0f}" for m in MODELS)
        work = statistics.median(r["work"] for r in runs)
        cells = per_round(runs, "work", ".3f")
        lines.append(f"| {layout} | **{work:.3f}** | {cells} | {rps} | {p99} |")
    return "\n".join(lines)


def _median(runs: list[dict[str, Any]], key: str, model: str) -> float:
    return statistics.median(r[key][model] for r in runs)


if __name__ == "__main__":
    sys.exit(main())
