"""``perf_analyzer`` 2.51 — Triton's own load generator, written by no one here — against Duomo's
gateway (HTTP and gRPC) and against Triton (the ``duomo bench`` peer: its Python backend running
the same executor), on one model, side by side.

    python -m tools.bench_perf_analyzer [--model classify] [--shape 400,600,3] [--interval-ms 5000]

It installs perf_analyzer once into ``.bench/envs/pa51`` (``tritonclient[all]==2.51.0``, the
last wheel whose binary runs on glibc 2.36, and the CUDA runtime it links; the binary also
needs Debian's ``libb64-0d``: installed with apt-get when missing and allowed), starts one
supervisor with its gateway and one Triton, then runs perf_analyzer at each concurrency on
each target in turn (``--measurement-interval``, 3 stable trials), with random UINT8 images of
``--shape``. Prints infer/s and p50/p99 latency per target and concurrency (and ``--out``
JSON). Never run by CI.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tools.bench.servers import DuomoServers, TritonServer, free_port

ROOT = Path(__file__).resolve().parent.parent
ENV = ROOT / ".bench" / "envs" / "pa51"
CONFIG = ROOT / "configs" / "default.yaml"


def perf_analyzer() -> tuple[Path, dict[str, str]]:
    """The perf_analyzer binary and the environment it runs in (installed on first use)."""
    binary = ENV / "bin" / "perf_analyzer"
    if not binary.exists():
        print("installing perf_analyzer 2.51 into .bench/envs/pa51 (once) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(ENV)], check=True)
        subprocess.run(
            [str(ENV / "bin" / "pip"), "install", "--quiet", "tritonclient[all]==2.51.0",
             "nvidia-cuda-runtime-cu12"],
            check=True,
        )  # fmt: skip
    if not Path("/usr/lib/x86_64-linux-gnu/libb64.so.0d").exists() and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "libb64-0d"], check=False,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    runtime = next(ENV.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib"))
    return binary, {**os.environ, "LD_LIBRARY_PATH": str(runtime)}


def measure(
    binary: Path, env: dict[str, str], protocol: str, url: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One perf_analyzer run: a row per concurrency (infer/s, p50 and p99 in ms)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pa.csv"
        command = [
            str(binary), "-m", args.model, "-i", protocol, "-u", url,
            "--shape", f"IMAGE:{args.shape}", "--concurrency-range", args.concurrency,
            "--measurement-interval", str(args.interval_ms), "--max-trials", "10",
            "--stability-percentage", "25", "-f", str(out),
        ]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"perf_analyzer failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        rows = list(csv.DictReader(out.open()))
    return [
        {
            "concurrency": int(row["Concurrency"]),
            "infer_per_s": float(row["Inferences/Second"]),
            "p50_ms": float(row["p50 latency"]) / 1e3,
            "p99_ms": float(row["p99 latency"]) / 1e3,
        }
        for row in rows
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="classify")
    parser.add_argument("--shape", default="400,600,3", help="H,W,C of the random images")
    parser.add_argument("--concurrency", default="1:4:3", help="perf_analyzer's range")
    parser.add_argument("--interval-ms", type=int, default=5000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    binary, env = perf_analyzer()
    work = Path(tempfile.mkdtemp(prefix="duomo-pa-", dir="/tmp"))
    (work / "duomo").mkdir()
    (work / "triton").mkdir()
    duomo = DuomoServers(CONFIG, [[args.model]], work / "duomo", transport="http")
    triton = TritonServer(CONFIG, [args.model], work / "triton")
    triton.grpc_port = free_port()
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        duomo.start()
        triton.start()
        targets = {
            "duomo-http": ("http", f"127.0.0.1:{duomo.ports['http']}"),
            "duomo-grpc": ("grpc", f"127.0.0.1:{duomo.ports['grpc']}"),
            "triton-http": ("http", f"127.0.0.1:{triton.port}"),
            "triton-grpc": ("grpc", f"127.0.0.1:{triton.grpc_port}"),
        }
        for label, (protocol, url) in targets.items():
            print(f"perf_analyzer -i {protocol} against {label} ...", flush=True)
            results[label] = measure(binary, env, protocol, url, args)
    finally:
        triton.stop()
        duomo.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nperf_analyzer 2.51, model {args.model}, random UINT8 images {args.shape}, "
          f"{args.interval_ms} ms windows")  # fmt: skip
    print(f"{'target':<12} {'concurrency':>11} {'infer/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for label, rows in results.items():
        for row in rows:
            print(f"{label:<12} {row['concurrency']:>11} {row['infer_per_s']:>9.1f} "
                  f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "shape": args.shape,
                                        "results": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
