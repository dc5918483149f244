"""Engine overhead benchmark: per-model throughput of the Engine vs calling onnxruntime directly.

For each model this builds two sides and measures one request at a time, closed loop, from one
caller thread:

- ``direct``: the model's own executor class with the same params and the same pre- and
  post-processing (``prepare`` + ``execute``), but over plain ``onnxruntime.InferenceSession.run``
  sessions (fresh numpy inputs, no IOBinding, no gate) in the caller's thread — what a user
  calling onnxruntime with the same code would get;
- ``engine``: the real ``Engine`` with only that model loaded, driven by ``engine.infer`` (queue
  hop, batcher, worker thread, IOBinding, compute gate, stats).

Both sides get the intra-op thread count the engine's thread plan gives the model, no inter-op
pool, sequential execution and no spinning. After a warm-up the sides are measured interleaved
for ``--rounds`` rounds of ``--seconds`` each (and at least ``--min-calls`` calls), the order
flipping every round, so machine drift hits both alike. Overhead is ``1 - engine/direct`` req/s.
The engine's result for the image must equal the direct one (top-1 label, face count, OCR texts).

Run by whoever changes the request path (batcher, worker, backend) on an otherwise idle machine:
``python -m tools.bench.experiments.bench_engine [-c configs/default.yaml]
[--models classify,face,ocr] [--seconds S] [--rounds R] [--json OUT]``. Prints a Markdown
table; exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from duomo.ipc.logs import configure_logging
from duomo.supervisor.config import load_config
from duomo.supervisor.core.engine import Engine
from duomo.supervisor.operators.image_files import read_image
from duomo.worker.backends.base import ModelSession
from duomo.worker.backends.ort_backend import _spec
from duomo.worker.executors.base import Executor, StageTimer

ROOT = Path(__file__).resolve().parents[3]
IMAGES = {"classify": "coffee.png", "face": "astronaut.png", "ocr": "page.png"}
WARMUP_CALLS = 3


class DirectOrtSession(ModelSession):
    """A plain ``InferenceSession``: fresh numpy inputs, ``sess.run(None, feeds)``."""

    def __init__(self, path: Path, threads: int) -> None:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 3
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.path = path
        self.sess = ort.InferenceSession(
            str(path), sess_options=so, providers=["CPUExecutionProvider"]
        )
        self.inputs = tuple(_spec(a) for a in self.sess.get_inputs())
        self.outputs = tuple(_spec(a) for a in self.sess.get_outputs())
        self.metadata = dict(self.sess.get_modelmeta().custom_metadata_map)
        self.output_names = [o.name for o in self.outputs]

    def input_buffer(self, name: str, shape: Sequence[int]) -> np.ndarray:
        return np.empty(shape, dtype=self.spec(name).dtype)

    def run(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.sess.run(None, dict(inputs))))

    def close(self) -> None:
        self.sess = None


def summary(result: dict[str, Any]) -> Any:
    """What must agree between the sides: top-1 label, face count, or the OCR texts."""
    if "top" in result:
        return result["top"][0]["label"]
    if "faces" in result:
        return len(result["faces"])
    if "lines" in result:
        return [line["text"] for line in result["lines"]]
    return sorted(result)


def measure(call: Callable[[], Any], seconds: float, min_calls: int) -> tuple[float, list[float]]:
    """Call until both ``seconds`` and ``min_calls`` are reached; (req/s, latencies in s)."""
    latencies: list[float] = []
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and len(latencies) >= min_calls:
            return len(latencies) / elapsed, latencies


def bench_model(config: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    image = read_image(ROOT / "tests/fixtures/images" / IMAGES.get(name, "chelsea.png"))
    engine = Engine(load_config(config), only=[name])
    engine.start()
    try:
        spec = engine.models[name].spec
        threads = engine.plan.threads_per_instance[name]
        sessions = {role: DirectOrtSession(spec.files[role], threads) for role in spec.files}
        executor: Executor = spec.executor(spec.params, sessions, spec.max_batch)

        def direct() -> Any:
            return executor.execute([executor.prepare(image)], StageTimer())[0]

        def via_engine() -> Any:
            return engine.infer(name, image)

        sides = {"direct": direct, "engine": via_engine}
        outputs = {side: [call() for _ in range(WARMUP_CALLS)][-1] for side, call in sides.items()}
        rates: dict[str, list[float]] = {side: [] for side in sides}
        latencies: dict[str, list[float]] = {side: [] for side in sides}
        for r in range(args.rounds):
            for side in sorted(sides, reverse=r % 2 == 1):
                rate, lat = measure(sides[side], args.seconds, args.min_calls)
                rates[side].append(rate)
                latencies[side].extend(lat)
        executor.close()
    finally:
        engine.close()
    want, got = summary(outputs["direct"]), summary(outputs["engine"])
    figures: dict[str, Any] = {"image": IMAGES.get(name, "chelsea.png"), "threads": threads}
    for side in sides:
        figures[side] = {
            "rps_mean": statistics.fmean(rates[side]),
            "rps_rounds": rates[side],
            "p50_ms": statistics.median(latencies[side]) * 1e3,
            "calls": len(latencies[side]),
        }
    figures["overhead_pct"] = 100 * (
        1 - figures["engine"]["rps_mean"] / figures["direct"]["rps_mean"]
    )
    figures["overhead_pct_rounds"] = [
        100 * (1 - e / d) for d, e in zip(rates["direct"], rates["engine"])
    ]
    figures["match"] = want == got
    figures["direct_result"], figures["engine_result"] = want, got
    return figures


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [
        "| model | threads | direct req/s | engine req/s | direct p50 ms | engine p50 ms "
        "| overhead | direct per round | engine per round | result |",
        "|---|--:|--:|--:|--:|--:|--:|---|---|---|",
    ]
    for name, f in results.items():
        d, e = f["direct"], f["engine"]
        rounds = [" / ".join(f"{x:.2f}" for x in s["rps_rounds"]) for s in (d, e)]
        check = (
            "same"
            if f["match"]
            else f"**MISMATCH** {f['direct_result']!r} vs {f['engine_result']!r}"
        )
        rows.append(
            f"| {name} | {f['threads']} | {d['rps_mean']:.2f} | {e['rps_mean']:.2f} "
            f"| {d['p50_ms']:.1f} | {e['p50_ms']:.1f} | {f['overhead_pct']:+.1f}% "
            f"| {rounds[0]} | {rounds[1]} | {check} |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, default=ROOT / "configs/default.yaml")
    parser.add_argument("--models", default="classify,face,ocr", help="comma-separated names")
    parser.add_argument("--seconds", type=float, default=3.0, help="per side per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-calls", type=int, default=3, help="per side per round")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    configure_logging("warning")
    load_before = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        print(f"benchmarking {name} ...", file=sys.stderr, flush=True)
        results[name] = bench_model(args.config, name, args)
        if not results[name]["match"]:
            print(f"MISMATCH on {name}: {results[name]}", file=sys.stderr)
    print(table(results))
    if args.json is not None:
        report = {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "hostname": socket.gethostname(),
            "cpu_count": os.cpu_count(),
            "load_avg_before": load_before,
            "onnxruntime": ort.__version__,
            "python": platform.python_version(),
            "config": str(args.config),
            "rounds": args.rounds,
            "seconds": args.seconds,
            "models": results,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if all(f["match"] for f in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
