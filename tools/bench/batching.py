"""``max_delay_ms: auto`` against fixed fill windows, on a raw model whose batch cost is
sublinear: what each setting gives in answers/s, latency, batch size and supervisor CPU per
answer, under an open-loop stream.

The model is a two-layer MLP (``x [n, 4096] → 4096×4096 → ReLU → 4096×16``): a run reads its
64 MiB of weights whatever ``n``, so on the CPU a batch of 8 costs far less than 8 single runs
(here 3.2 ms for one, 5.2 ms for eight) — the kind of model a fill window is for. Each
setting runs in its own supervisor (``duomo start``), one intra-op thread, ``max_batch`` 8;
the settings run in turn, ``--rounds`` times, so drift hits them alike. Requests arrive at
``--rate`` per second from one client process (a scheduler thread, ``infer_async``; latency
counts from when a request was due).

Run as ``python -m tools.bench.batching [--rate R] [--seconds S] [--rounds N]
[--settings 0,2,5,10,auto] [--slo-ms MS]``; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import yaml

from duomo.ipc.client import Client
from duomo.ipc.runtime_dir import pid_path
from tools.bench.report import per_round

WIDTH, HIDDEN, OUT, MAX_BATCH = 4096, 4096, 16, 8


def mlp_model(path: Path) -> Path:
    """The benchmark's model, made with ``onnx`` (the ``prepare`` extra)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((WIDTH, HIDDEN), np.float32) * 0.05, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((HIDDEN, OUT), np.float32) * 0.05, "w2")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "w2"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", OUT])],
        initializer=[w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def config_for(folder: Path, model: Path, setting: str, slo_ms: float) -> Path:
    delay: float | str = "auto" if setting == "auto" else float(setting)
    raw = {
        "version": 1,
        "devices": [{"id": 0, "kind": "cpu"}],
        "backends": {"onnxruntime": {"thread_budget": 1}},
        "models": [
            {
                "name": "mlp", "task": "raw", "file": str(model), "max_batch": MAX_BATCH,
                "max_delay_ms": delay, "queue_size": 4096, "intra_op_threads": 1,
                "health": {"slo_p99_ms": slo_ms},
            }
        ],
    }  # fmt: skip
    path = folder / f"mlp-{setting}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@contextmanager
def supervisor(config: Path, sock: Path) -> Iterator[psutil.Process]:
    cli = [sys.executable, "-m", "duomo.supervisor"]
    subprocess.run([*cli, "start", "-c", str(config), "--socket", str(sock)], check=True)
    try:
        yield psutil.Process(int(pid_path(sock).read_text()))
    finally:
        subprocess.run([*cli, "stop", "--socket", str(sock)], capture_output=True)


def open_loop(sock: Path, rate: float, seconds: float) -> dict[str, Any]:
    """Requests due every 1/rate s for ``seconds``; latencies from when each was due."""
    x = np.random.default_rng(1).standard_normal((1, WIDTH)).astype(np.float32)
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()
    with Client(sock, timeout_s=30) as client:
        handle = client.model("mlp", slots=64)
        for _ in range(50):  # warm: the first answers size the client's buffers
            handle.infer(x)
        started = time.perf_counter()
        count = int(rate * seconds)
        outstanding: list[Any] = []
        for i in range(count):
            due = started + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            future = handle.infer_async(x)

            def done(f: Any, due: float = due) -> None:
                nonlocal errors
                with lock:
                    if f.exception() is None:
                        latencies.append(time.perf_counter() - due)
                    else:
                        errors += 1

            future.add_done_callback(done)
            outstanding.append(future)
        for future in outstanding:
            future.exception(60)
        elapsed = time.perf_counter() - started
        status = client.status().models["mlp"]
    totals = status.totals
    ordered = sorted(latencies)
    return {
        "answers_per_s": len(latencies) / elapsed,
        "p50_ms": ordered[len(ordered) // 2] * 1e3 if ordered else None,
        "p99_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1e3 if ordered else None,
        "errors": errors,
        "mean_batch": totals.inference_count / max(1, totals.execution_count),
        "window_ms": status.batch_window_ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.batching")
    parser.add_argument("--rate", type=float, default=400.0, help="requests per second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settings", default="0,2,5,10,auto", help="max_delay_ms values")
    parser.add_argument("--slo-ms", type=float, default=50.0, help="health.slo_p99_ms")
    args = parser.parse_args(argv)
    settings = args.settings.split(",")
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory(prefix="duomo-batching-") as tmp:
        folder = Path(tmp)
        model = mlp_model(folder / "mlp.onnx")
        for r in range(args.rounds):
            order = settings if r % 2 == 0 else list(reversed(settings))
            for setting in order:
                sock = folder / "d.sock"
                with supervisor(config_for(folder, model, setting, args.slo_ms), sock) as proc:
                    cpu_before = sum(proc.cpu_times()[:2])
                    figures = open_loop(sock, args.rate, args.seconds)
                    cpu = sum(proc.cpu_times()[:2]) - cpu_before
                answered = figures["answers_per_s"] * args.seconds
                figures["cpu_ms_per_answer"] = cpu / max(1.0, answered) * 1e3
                results[setting].append(figures)
                print(f"round {r + 1} max_delay_ms {setting}: {figures}", file=sys.stderr)
    print(f"{args.rate:g} requests/s, open loop, {args.seconds:g} s × {args.rounds} rounds, "
          f"slo_p99_ms {args.slo_ms:g}, max_batch {MAX_BATCH}, one intra-op thread\n")  # fmt: skip
    print("| max_delay_ms | answers/s | p50 ms | p99 ms | mean batch | supervisor CPU ms per "
          "answer | window ms (auto) | errors |")  # fmt: skip
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for setting, runs in results.items():
        windows = " / ".join(
            "-" if run["window_ms"] is None else f"{run['window_ms']:.2f}" for run in runs
        )
        columns = [("answers_per_s", ".0f"), ("p50_ms", ".2f"), ("p99_ms", ".2f"),
                   ("mean_batch", ".2f"), ("cpu_ms_per_answer", ".3f")]  # fmt: skip
        cells = [per_round(runs, key, spec) for key, spec in columns]
        errors = str(sum(run["errors"] for run in runs))
        print("| " + " | ".join([setting, *cells, windows, errors]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
