"""``preload_policy: predictive`` against ``lru`` on a trace of four evictable models under a
device budget that holds two: how many requests waited for their model to load, and the
latency that added.

The models are four copies of the demo's classifier (``classify`` of ``configs/default.yaml``,
each its own sessions). The budget is 2.5 × one model's measured footprint. The trace follows a
cycle (m1 → m2 → m3 → m4 → m1 …) with probability ``--follow``, else jumps to another model at
random (seeded: both policies get the same trace), one request every ``--gap`` seconds. A
request *waited* when its model was not READY as it was sent; its added latency is its round
trip minus the median round trip of the requests that did not wait.

Run as ``python -m tools.bench.preload [--requests N] [--gap S] [--follow P] [--rounds R]``;
prints a Markdown table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cv2
import yaml

from duomo.ipc.client import Client
from tools.bench.report import per_round

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("m1", "m2", "m3", "m4")
IMAGE = ROOT / "tests/fixtures/images/coffee.png"


def write_config(folder: Path, policy: str, budget_mb: int | None) -> Path:
    base = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    classify = next(m for m in base["models"] if m["name"] == "classify")
    raw = {
        "version": 1,
        "model_root": str(ROOT / "models"),
        "devices": [{"id": 0, "kind": "cpu", "memory_budget_mb": budget_mb}],
        "preload_policy": policy,
        "models": [
            {**classify, "name": name, "evictable": True, "preload": name in NAMES[:2]}
            for name in (NAMES if budget_mb is not None else NAMES[:1])
        ],
    }
    path = folder / f"{policy}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "duomo.supervisor", *args], check=True,
                   capture_output=True)  # fmt: skip


def footprint_mb(folder: Path) -> float:
    sock = folder / "f.sock"
    cli("start", "-c", str(write_config(folder, "lru", None)), "--socket", str(sock))
    try:
        with Client(sock) as client:
            return float(client.status().models["m1"].memory.charged_bytes or 0) / 2**20
    finally:
        cli("stop", "--socket", str(sock))


def trace(count: int, follow: float, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    names, at = [NAMES[0]], 0
    for _ in range(count - 1):
        if rng.random() < follow:
            at = (at + 1) % len(NAMES)
        else:
            at = rng.choice([i for i in range(len(NAMES)) if i != at])
        names.append(NAMES[at])
    return names


def run(config: Path, sock: Path, names: list[str], gap_s: float) -> dict[str, Any]:
    decoded = cv2.imread(str(IMAGE))
    assert decoded is not None, IMAGE
    image = cv2.cvtColor(decoded, cv2.COLOR_BGR2RGB)
    cli("start", "-c", str(config), "--socket", str(sock))
    try:
        with Client(sock, timeout_s=120) as client:
            handles = {name: client.model(name, slots=1) for name in NAMES}
            samples: list[tuple[bool, float]] = []
            for name in names:
                time.sleep(gap_s)
                waited = client.status().models[name].state != "READY"
                started = time.perf_counter()
                handles[name].infer(image)
                samples.append((waited, time.perf_counter() - started))
            predictive = {n: m.predictive for n, m in client.status().models.items()}
    finally:
        cli("stop", "--socket", str(sock))
    ready = [s for waited, s in samples if not waited]
    base = statistics.median(ready) if ready else 0.0
    added = [s - base for waited, s in samples if waited]
    return {
        "waited": len(added),
        "added_mean_ms": statistics.fmean(added) * 1e3 if added else 0.0,
        "added_total_s": sum(added),
        "ready_p50_ms": base * 1e3,
        "loads": sum(p["loads"] for p in predictive.values()),
        "hits": sum(p["hits"] for p in predictive.values()),
        "wasted": sum(p["wasted"] for p in predictive.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.preload")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between requests")
    parser.add_argument("--follow", type=float, default=0.8, help="chance the cycle is followed")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    names = trace(args.requests, args.follow)
    results: dict[str, list[dict[str, Any]]] = {"lru": [], "predictive": []}
    with tempfile.TemporaryDirectory(prefix="duomo-preload-") as tmp:
        folder = Path(tmp)
        one_mb = footprint_mb(folder)
        budget_mb = int(one_mb * 2.5)
        for r in range(args.rounds):
            for policy in ("lru", "predictive") if r % 2 == 0 else ("predictive", "lru"):
                config = write_config(folder, policy, budget_mb)
                results[policy].append(run(config, folder / "d.sock", names, args.gap))
                print(f"round {r + 1} {policy}: {results[policy][-1]}", file=sys.stderr)
    print(
        f"{args.requests} requests, one every {args.gap:g} s, the cycle followed with "
        f"probability {args.follow:g}; four copies of classify ({one_mb:.0f} MiB each), "
        f"budget {budget_mb} MiB\n"
    )
    print("| policy | requests that waited for a load | added latency, mean ms | added, total s "
          "| p50 of the others ms | predicted loads | hits | wasted |")  # fmt: skip
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for policy, runs in results.items():
        columns = [
            ("waited", "d"), ("added_mean_ms", ".0f"), ("added_total_s", ".1f"),
            ("ready_p50_ms", ".1f"), ("loads", "d"), ("hits", "d"), ("wasted", "d"),
        ]  # fmt: skip
        cells = [per_round(runs, key, spec) for key, spec in columns]
        print("| " + " | ".join([policy, *cells]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
