"""Where classification's in-process time goes: Duomo's executor against a plain pipeline on the
same images, the same ONNX Runtime session settings and the same OpenCV thread count, in one
process (issue 36, item 3).

Four ways to answer one image, timed in turns (A B C D, then B C D A, …) so that a noisy
machine slows each of them alike; every figure is a median over the rounds, and each ratio is
given both as the median of the ratios of calls made in the same turn and as the ratio of the
medians:

- ``executor``: ``ClassificationExecutor`` as a model worker calls it (``inprocess.run_one``:
  ``prepare``, then ``execute`` of a batch of one), opened by ``inprocess.open_executor`` with one
  intra-op thread, the way ``duomo bench``'s ``alone`` mode opens it;
- ``plain``: what one would write by hand with numpy and OpenCV and the same answer: gray made
  RGB, short side resized to the input size (area averaging when shrinking, bilinear when
  enlarging: the executor's rule), centre crop, ``x / 127.5 - 1`` (``normalization: tflite``)
  to N×C×H×W, ``InferenceSession.run``, softmax, top-k;
- ``plain-linear``: the same with ``cv2.resize``'s default interpolation (bilinear) whatever the
  scale: cheaper, and a different answer (its largest score difference is reported);
- ``plain-threads``: ``plain`` with OpenCV's own thread pool (its default thread count, set
  between calls, outside the time): what a script that never calls ``cv2.setNumThreads`` gets,
  and what a server whose thread plan gives each instance one core does not take.

The plain pipelines run on their own ``InferenceSession`` of the same file with the settings
``OrtBackend.open`` gives the executor's (one intra-op thread, no inter-op pool, no spinning, the
config's graph optimisation, the process's shared CPU arena). Each call of ``executor`` also
gives its ``StageTimer`` stages; each call of a plain pipeline gives its phases (four
``perf_counter`` reads inside it, well under a microsecond); and ``resize`` times the executor's
resize alone (``ResizeScratch.resize`` with the geometry ``prepare`` chose), to split its
pre-processing into resize and crop + normalise.

Run from the repository root (``nice``: the figures are medians, not a claim on the machine)::

    nice -n 19 python -m tools.bench.classify_overhead --rounds 300 --out DIR

It writes ``DIR/result.json`` (every median) and ``DIR/report.md`` (the tables) and prints the
tables. ``tools.bench.inprocess`` is the in-process reference it builds on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from duomo.supervisor.config import load_config
from duomo.supervisor.core.memory import tune_heap
from duomo.supervisor.operators.image_files import read_image
from duomo.worker.executors.base import Executor, StageTimer
from duomo.worker.executors.classification import ClassificationParams
from duomo.worker.executors.image_ops import ResizeScratch
from tools.bench.inprocess import open_executor
from tools.bench.report import machine, print_and_keep

ROOT = Path(__file__).resolve().parents[2]
MODES = ("executor", "plain", "plain-linear", "plain-threads")
_OPT_LEVELS = {"disable": 0, "basic": 1, "extended": 2, "all": 99}  # as OrtBackend's


class PlainPipeline:
    """A hand-written classifier around one ``InferenceSession``: resize the short side, centre
    crop, normalise, run, softmax, top-k. ``area``: area averaging when shrinking (the executor's
    rule); otherwise always bilinear (``cv2.resize``'s default)."""

    def __init__(self, session: Any, params: ClassificationParams, area: bool) -> None:
        self.session = session
        self.input = session.get_inputs()[0].name
        self.size = params.input_size
        self.top_k = params.top_k
        self.area = area
        if params.normalization != "tflite":
            raise ValueError("the plain pipeline normalises as tflite (x / 127.5 - 1)")

    def __call__(self, image: np.ndarray, phases: dict[str, float]) -> list[tuple[int, float]]:
        t0 = time.perf_counter()
        if image.ndim == 2:
            image = cv2.cvtColor(image, cv2.COLOR_GRAY2RGB)
        h, w = image.shape[:2]
        size = self.size
        scale = size / min(h, w)
        rw, rh = max(size, round(w * scale)), max(size, round(h * scale))
        shrink = rw * rh < w * h
        method = cv2.INTER_AREA if self.area and shrink else cv2.INTER_LINEAR
        resized = cv2.resize(image, (rw, rh), interpolation=method)
        t1 = time.perf_counter()
        top, left = (rh - size) // 2, (rw - size) // 2
        crop = resized[top : top + size, left : left + size]
        x = (crop.astype(np.float32) / 127.5 - 1.0).transpose(2, 0, 1)[None]
        x = np.ascontiguousarray(x)
        t2 = time.perf_counter()
        logits = self.session.run(None, {self.input: x})[0][0]
        t3 = time.perf_counter()
        exp = np.exp(logits - logits.max())
        probs = exp / exp.sum()
        best = np.argsort(-probs)[: self.top_k]
        answer = [(int(i), float(probs[i])) for i in best]
        t4 = time.perf_counter()
        phases.update(resize=t1 - t0, normalise=t2 - t1, run=t3 - t2, postprocess=t4 - t3)
        return answer


def plain_session(config: Any, path: Path) -> Any:
    """An ``InferenceSession`` of ``path`` with the settings ``OrtBackend.open`` gives a session
    of one intra-op thread (opened after the executor, so the shared CPU arena is registered)."""
    import onnxruntime as ort

    opts = config.backends.onnxruntime
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel(_OPT_LEVELS[opts.graph_optimization])
    so.enable_cpu_mem_arena = opts.enable_cpu_mem_arena
    so.enable_mem_pattern = opts.memory_pattern != "off"
    if opts.shared_cpu_arena and opts.enable_cpu_mem_arena:
        so.add_session_config_entry("session.use_env_allocators", "1")
    spinning = "1" if opts.allow_spinning else "0"
    so.add_session_config_entry("session.intra_op.allow_spinning", spinning)
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])


def executor_call(executor: Executor, image: np.ndarray, phases: dict[str, float]) -> Any:
    """``inprocess.run_one`` with its stages kept: prepare, then execute a batch of one."""
    timer = StageTimer()
    t0 = time.perf_counter()
    item = executor.prepare(image)
    t1 = time.perf_counter()
    result = executor.execute([item], timer)[0]
    phases.update(prepare=t1 - t0, **timer.seconds)
    if isinstance(result, Exception):
        raise result
    return [(int(c["index"]), float(c["score"])) for c in result["top"]]


def compare(reference: list[tuple[int, float]], other: list[tuple[int, float]]) -> dict[str, Any]:
    """Whether two top-k answers name the same classes in the same order, and how far apart
    their scores are."""
    return {
        "same_classes": [i for i, _ in reference] == [i for i, _ in other],
        "max_score_diff": max(abs(a - b) for (_, a), (_, b) in zip(reference, other)),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    tune_heap()  # as the supervisor (and the bench's in-process modes) do
    opencv_default = cv2.getNumThreads()  # before open_executor limits it to one
    loaded = load_config(args.config)
    resolved = loaded.models[args.model]
    params = resolved.params
    if not isinstance(params, ClassificationParams):
        raise SystemExit(f"{args.model} is not a classification model")
    executor = open_executor(loaded, args.model, threads=1)  # also: OpenCV on one thread
    session = plain_session(loaded.config, resolved.files["model"])
    modes: dict[str, Callable[[np.ndarray, dict[str, float]], list[tuple[int, float]]]] = {
        "executor": lambda image, phases: executor_call(executor, image, phases),
        "plain": PlainPipeline(session, params, area=True),
        "plain-linear": PlainPipeline(session, params, area=False),
        "plain-threads": PlainPipeline(session, params, area=True),
    }
    opencv_threads = {mode: 1 for mode in MODES} | {"plain-threads": opencv_default}
    paths = sorted(p for p in Path(args.images).iterdir() if p.suffix in (".png", ".jpg"))
    images = {p.name: read_image(p) for p in paths}
    scratch = ResizeScratch()  # as the executor's, timed alone
    answers: dict[str, dict[str, Any]] = {}
    for name, image in images.items():
        got = {mode: call(image, {}) for mode, call in modes.items()}
        answers[name] = {m: compare(got["executor"], got[m]) for m in MODES[1:]}
        answers[name]["executor_top"] = got["executor"]
    seconds: dict[str, dict[str, list[float]]] = {n: {} for n in images}
    for round_ in range(args.warmup_rounds + args.rounds):
        turn = round_ % len(MODES)
        order = MODES[turn:] + MODES[:turn]
        for name, image in images.items():
            kept = seconds[name] if round_ >= args.warmup_rounds else {}
            for mode in order:
                cv2.setNumThreads(opencv_threads[mode])
                phases: dict[str, float] = {}
                t0 = time.perf_counter()
                modes[mode](image, phases)
                elapsed = time.perf_counter() - t0
                kept.setdefault(mode, []).append(elapsed)
                for phase, s in phases.items():
                    kept.setdefault(f"{mode}.{phase}", []).append(s)
            cv2.setNumThreads(1)
            item = executor.prepare(image)
            t0 = time.perf_counter()
            scratch.resize(item.image, item.resized_width, item.resized_height)
            kept.setdefault("executor.resize", []).append(time.perf_counter() - t0)
    executor.close()
    pooled = {mode: [s for per in seconds.values() for s in per[mode]] for mode in MODES}
    return {
        "config": str(args.config),
        "model": args.model,
        "rounds": args.rounds,
        "warmup_rounds": args.warmup_rounds,
        "opencv_default_threads": opencv_default,
        "machine": machine(),
        "all_images": {"ratio": ratios(pooled)},
        "images": {
            name: {
                "shape": list(images[name].shape),
                "answers": answers[name],
                "median_ms": {k: statistics.median(v) * 1e3 for k, v in per.items()},
                "ratio": ratios(per),
            }
            for name, per in seconds.items()
        },
    }


def ratios(per: dict[str, list[float]]) -> dict[str, float]:
    """executor ÷ each plain pipeline: the median of the ratios of calls made in the same turn
    (back to back), and the ratio of the medians."""
    out = {}
    for other in MODES[1:]:
        pairs = [a / b for a, b in zip(per["executor"], per[other])]
        out[f"pairs_vs_{other}"] = statistics.median(pairs)
        out[f"medians_vs_{other}"] = statistics.median(per["executor"]) / statistics.median(
            per[other]
        )
    return out


def markdown(result: dict[str, Any]) -> str:
    others = MODES[1:]
    rows = [
        f"classification in-process, {result['rounds']} interleaved rounds "
        f"(+{result['warmup_rounds']} warm-up), medians in ms; plain-threads: OpenCV on "
        f"{result['opencv_default_threads']} threads",
        "",
        "| image | "
        + " | ".join(MODES)
        + " | "
        + " | ".join(f"executor ÷ {m} (pairs / medians)" for m in others)
        + " |",
        "|---" * (1 + len(MODES) + len(others)) + "|",
    ]

    def ratio_cells(r: dict[str, float]) -> str:
        return " | ".join(f"{r[f'pairs_vs_{m}']:.3f} / {r[f'medians_vs_{m}']:.3f}" for m in others)

    for name, fig in result["images"].items():
        ms = fig["median_ms"]
        rows.append(
            f"| {name} {'×'.join(map(str, fig['shape']))} | "
            + " | ".join(f"{ms[m]:.3f}" for m in MODES)
            + f" | {ratio_cells(fig['ratio'])} |"
        )
    rows.append(
        "| all images (pooled) | "
        + " | ".join("" for _ in MODES)
        + f" | {ratio_cells(result['all_images']['ratio'])} |"
    )
    rows += [
        "",
        "answers against the executor's: same top-k classes in the same order, largest score "
        "difference",
        "",
        "| image | " + " | ".join(others) + " |",
        "|---" * (1 + len(others)) + "|",
    ]
    for name, fig in result["images"].items():
        a = fig["answers"]
        rows.append(
            f"| {name} | "
            + " | ".join(f"{a[m]['same_classes']}, {a[m]['max_score_diff']:.1e}" for m in others)
            + " |"
        )
    plain = "resize normalise run postprocess"
    rows += [
        "",
        "phases, medians in ms (executor: prepare, its resize alone, its StageTimer stages; "
        f"plain pipelines: {plain.replace(' ', ' / ')})",
        "",
        "| image | executor prepare / resize / preprocess / infer / postprocess | "
        + " | ".join(others)
        + " |",
        "|---" * (2 + len(others)) + "|",
    ]

    def cells(ms: dict[str, float], mode: str, phases: str) -> str:
        return " / ".join(format(ms[f"{mode}.{p}"], ".3f") for p in phases.split())

    for name, fig in result["images"].items():
        ms = fig["median_ms"]
        rows.append(
            f"| {name} | {cells(ms, 'executor', 'prepare resize preprocess infer postprocess')} | "
            + " | ".join(cells(ms, m, plain) for m in others)
            + " |"
        )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs/default.yaml")
    parser.add_argument("--model", default="classify")
    parser.add_argument("--images", type=Path, default=ROOT / "tests/fixtures/images")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warmup-rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, help="folder for result.json and report.md")
    args = parser.parse_args(argv)
    result = measure(args)
    print_and_keep(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
