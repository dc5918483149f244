"""The executors driven in-process, with no IPC and no queue: the ``alone`` weights (each model
by itself on one thread, which also gives every image's expected answer and the in-process p50)
and the ``engine`` mode (all models at once, one thread per instance, the same thread plan and
compute gate as the supervisor: the limit Duomo is measured against).

Run by ``tools.bench.mixed_load`` as a child process, ``python -m tools.bench.inprocess
alone|engine`` with a JSON spec on stdin, so its memory and CPU are measured like any server's.
Protocol: the child loads, prints ``ready``, reads the window (``{"start_at": …, "end_at": …}``,
wall-clock seconds) from stdin, and prints one JSON object with its figures when done. The
peers' apps (``tools.bench.peer_apps``) build their executors with ``open_executor`` too.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from duomo.supervisor.config import LoadedConfig, load_config
from duomo.supervisor.core.memory import tune_heap
from duomo.supervisor.core.placement import HOST, plan_for
from duomo.supervisor.operators.image_files import read_image
from duomo.worker.backends.base import SessionSettings
from duomo.worker.backends.ort_backend import OrtBackend
from duomo.worker.executors.base import Executor, StageTimer
from duomo.worker.executors.image_ops import limit_opencv_threads
from duomo.worker.thread_budget import ComputeGate
from tools.bench.answers import summary
from tools.bench.tally import Tally


def open_executor(
    config: str | Path | LoadedConfig, name: str, threads: int, gate: ComputeGate | None = None
) -> Executor:
    """``name``'s executor from ``config`` (a path, or one already loaded) over ONNX Runtime
    sessions with ``threads`` intra-op threads each, as a model worker opens it (warmed up at
    every batch size it runs), in a process whose OpenCV runs on one thread, as the supervisor's
    does: every mode pre-processes with the same threads, and the in-process reference of the
    overhead probe (one thread) is not given a second core the server does not use."""
    limit_opencv_threads()
    loaded = config if isinstance(config, LoadedConfig) else load_config(config)
    resolved = loaded.models[name]
    if resolved.config.backend != "onnxruntime":
        raise ValueError(
            f"{name}: duomo bench runs ONNX Runtime models, not {resolved.config.backend}"
        )
    backend = OrtBackend(loaded.config.backends.onnxruntime)
    cfg = resolved.config  # (its place at the gate as the supervisor gives it)
    member = (
        gate.member(name, cfg.compute_weight, cfg.priority, cfg.priority_aging_per_s)
        if gate is not None
        else None
    )
    settings = SessionSettings(intra_op_threads=threads, gate=member)
    task: type[Executor] = resolved.executor
    executor = task.open(
        resolved.params, resolved.files, resolved.config.max_batch, backend, settings
    )
    executor.warmup()  # every batch size it will run, as a model worker does at load
    return executor


def run_one(executor: Executor, image: Any) -> Any:
    """One request as a worker runs it: prepare, then execute a batch of one."""
    result = executor.execute([executor.prepare(image)], StageTimer())[0]
    if isinstance(result, Exception):
        raise result
    return result


def run_timed(executor: Executor, image: Any) -> tuple[Any, int]:
    """``run_one`` as the bench's servers answer it (the floors, the peers' apps): the result and
    the µs spent in the executor, which the server reports with it."""
    start = time.perf_counter()
    result = run_one(executor, image)
    return result, int((time.perf_counter() - start) * 1e6)


def await_window() -> tuple[float, float]:
    """The child's side of the window protocol (``tools.bench.children.Child``): say ``ready``, read
    the window's start and end (wall-clock seconds)."""
    print("ready", flush=True)
    window = json.loads(sys.stdin.readline())
    return float(window["start_at"]), float(window["end_at"])


def print_figures(figures: dict[str, Any], cpu_started: float) -> int:
    """A producer's last word in the window protocol: its ``figures`` with the CPU seconds it
    spent since ``cpu_started`` (``time.process_time``) as ``cpu_s``, one JSON line; the exit
    status. Called by ``tools.bench.camera_producer`` and ``tools.bench.pipeline_producer``."""
    figures["cpu_s"] = time.process_time() - cpu_started
    print(json.dumps(figures), flush=True)
    return 0


def alone(spec: dict[str, Any]) -> dict[str, Any]:
    """Each model by itself, one thread, closed loop for ``alone_s``: its answers/s (the weight
    of its work), p50, and the expected summary of each of its images."""
    loaded = load_config(spec["config"])
    executors = {m["name"]: open_executor(loaded, m["name"], threads=1) for m in spec["models"]}
    images = {m["name"]: [read_image(p) for p in m["images"]] for m in spec["models"]}
    await_window()
    figures: dict[str, Any] = {}
    for name, executor in executors.items():
        expected = [summary(run_one(executor, image)) for image in images[name]]
        latencies: list[float] = []
        stop_at = time.perf_counter() + float(spec["alone_s"])
        while time.perf_counter() < stop_at or len(latencies) < 3:
            image = images[name][len(latencies) % len(images[name])]
            t0 = time.perf_counter()
            run_one(executor, image)
            latencies.append(time.perf_counter() - t0)
        figures[name] = {
            "rps": len(latencies) / sum(latencies),
            "p50_ms": sorted(latencies)[len(latencies) // 2] * 1e3,
            "calls": len(latencies),
            "expected": expected,
        }
        executor.close()
    return figures


def engine(spec: dict[str, Any]) -> dict[str, Any]:
    """All models at once, one closed-loop thread per instance calling its executor directly,
    with the supervisor's thread plan and compute gate."""
    loaded = load_config(spec["config"])
    names = [m["name"] for m in spec["models"]]
    plan = plan_for(loaded, names)[HOST]  # (the demo config has one unpinned cpu device)
    cpu = next((d for d in loaded.config.devices if d.kind == "cpu"), None)
    gate = ComputeGate(plan.budget, cpu.overdraft if cpu is not None else 1)
    workers: list[tuple[str, Executor]] = [
        (name, open_executor(loaded, name, plan.threads_per_instance[name], gate))
        for name in names
        for _ in range(plan.instances[name])
    ]
    images = {m["name"]: [read_image(p) for p in m["images"]] for m in spec["models"]}
    expected = {m["name"]: m["expected"] for m in spec["models"]}
    tallies = {name: Tally() for name in names}
    start_at, end_at = await_window()

    def drive(name: str, executor: Executor) -> None:
        i = 0
        while time.time() < end_at and tallies[name].counted < spec["max_requests"]:
            k = i % len(images[name])
            sent = time.time()
            try:
                result = run_one(executor, images[name][k])
            except Exception as err:  # a failing request is counted, never fatal
                tallies[name].add(
                    sent, time.time(), start_at, end_at, error=type(err).__name__, message=str(err)
                )
            else:
                tallies[name].add(sent, time.time(), start_at, end_at, result, expected[name][k])
            i += 1

    threads = [threading.Thread(target=drive, args=w, daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _, executor in workers:
        executor.close()
    return {
        "threads": plan.threads_per_instance,
        "budget": plan.budget,
        "models": {name: tally.as_dict() for name, tally in tallies.items()},
    }


def main() -> int:
    kind = sys.argv[1]
    tune_heap()  # as the supervisor process does
    spec = json.loads(sys.stdin.readline())
    result = alone(spec) if kind == "alone" else engine(spec)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
