"""OCR as a pipeline against OCR as one executor (issue 35, item 6): keep it only if it holds
today's throughput within 5 %.

``python -m tools.bench.ocr_pipeline`` (or ``measure()``, for ``duomo bench``) runs, in one run
on one machine, trials that take turns — A B A B …:

- **A** ``executor``: the demo's ``ocr`` model (``task: ocr``, detection → angle → recognition
  of a frame's lines in one executor), its entry as configs/default.yaml has it;
- **B** ``pipeline``: the pipeline ``ocr`` of configs/ocr-pipeline.yaml as it is (``ocr_det``
  → for each line ``ocr_read``, whose batcher gathers the lines of many frames), each of its two
  models with ``intra_op_threads: all``, all the cores as A's one model has them (the compute
  gate runs them in turn);
- and alongside, ``pipeline-split``: the same config without ``intra_op_threads``, where the
  engine splits the cores between the two models (one thread each on two cores),

each in a fresh supervisor (the same backend settings, from configs/ocr-pipeline.yaml),
fed by ``producers`` producer processes that send the fixture images round robin (each starting
at another image), closed loop (``client.model("ocr").infer``: the next frame once the last one
is answered), for ``window_s`` after ``warmup_s``. A trial's figures: frames/s (answers inside
the window), p50/p99 latency, the servers' CPU cores, and from the supervisor's status at the
end each model's batch sizes and time per stage. A pair's ratio is B's frames/s ÷ A's; the
run-to-run noise is how far the A trials are apart (the last A ÷ the first). The verdict (A
and B only): keep when every pair's ratio is at least ``keep_ratio`` (0.95), or no further
below 1 than the A trials are apart. Every answer is checked against the first A trial's
answer for that image (the text of each line, its score within 1e-5, its box): a mismatch is
counted as ``wrong``.

The producer's side is ``python -m tools.bench.ocr_pipeline produce`` (the protocol of
``tools.bench.children.Child``). The result is one JSON file, ``--out`` (default:
tools/bench/results/<today>/ocr_pipeline/result.json).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "ocr-pipeline.yaml"
DEMO = ROOT / "configs" / "default.yaml"
IMAGES = ROOT / "tests" / "fixtures" / "images"
MODULE = "tools.bench.ocr_pipeline"
KINDS = ("executor", "pipeline", "pipeline-split")
MODELS = {"executor": ["ocr"], "pipeline": ["ocr_det", "ocr_read"],
          "pipeline-split": ["ocr_det", "ocr_read"]}  # fmt: skip
SCORE_TOLERANCE = 1e-5
TIMEOUT_S = 60.0
HANG_AFTER_S = 120.0  # past the window's end, a producer still running dumps its stacks and exits


@dataclass(frozen=True)
class OcrPipelineSettings:
    """What one run measures."""

    pairs: int = 2  # A B trials, taken in turns
    kinds: tuple[str, ...] = KINDS  # the first is A, the second B; a third is shown alongside
    window_s: float = 15.0
    warmup_s: float = 3.0
    producers: int = 2
    keep_ratio: float = 0.95


def _log(message: str) -> None:
    print(f"duomo bench: ocr pipeline: {message}", file=sys.stderr, flush=True)


def fixture_images() -> list[Path]:
    return sorted(IMAGES.glob("*.png"))


# -- the two configs --------------------------------------------------------------------------


def variant_configs(workdir: Path, base: Path = BASE, demo: Path = DEMO) -> dict[str, Path]:
    """The supervisor config of each kind, written to ``workdir``: ``pipeline`` is ``base``
    (model paths made absolute), each model with all the cores (``intra_op_threads: all``, as
    the executor's one model has them; the compute gate runs them in turn, never both at once
    beyond the budget); ``pipeline-split`` is the same without ``intra_op_threads``: the engine
    splits the cores between its two models, one intra-op thread each on two cores;
    ``executor`` is ``base`` with the demo's ``ocr`` entry in place of its models and no
    pipelines."""
    raw = yaml.safe_load(base.read_text(encoding="utf-8"))
    root = raw.get("model_root")
    raw["model_root"] = str((base.parent / root).resolve()) if root else str(base.parent)
    demo_models = yaml.safe_load(demo.read_text(encoding="utf-8"))["models"]
    executor = copy.deepcopy(raw)
    executor.pop("pipelines", None)
    executor["models"] = [m for m in demo_models if m["name"] == "ocr"]
    split = copy.deepcopy(raw)
    for model in split["models"]:
        model.pop("intra_op_threads", None)
    workdir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind, config in (("executor", executor), ("pipeline", raw), ("pipeline-split", split)):
        path = paths[kind] = workdir / f"{kind}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return paths


# -- the producer's side ----------------------------------------------------------------------


def _lines(answer: Any) -> list[dict[str, Any]]:
    lines = answer.get("lines") if isinstance(answer, dict) else None
    if not isinstance(lines, list):
        raise ValueError(f"no 'lines' in the answer: {str(answer)[:200]}")
    return lines


def same_answer(got: Any, want: list[dict[str, Any]]) -> bool:
    """Whether ``got`` answers ``want``'s lines: the same texts and boxes in the same order,
    each score within ``SCORE_TOLERANCE``, no other keys."""
    lines = _lines(got)
    return len(lines) == len(want) and all(
        set(a) == {"text", "score", "box"}
        and a["text"] == b["text"]
        and abs(float(a["score"]) - float(b["score"])) <= SCORE_TOLERANCE
        and a["box"] == b["box"]
        for a, b in zip(lines, want)
    )


def produce(spec: dict[str, Any]) -> dict[str, Any]:
    """One producer: frames closed loop into ``spec["model"]`` until the window ends."""
    import faulthandler

    from duomo.ipc.client import Client
    from duomo.supervisor.operators.image_files import read_image
    from tools.bench.inprocess import await_window

    names = spec["images"]
    images = [read_image(Path(path)) for path in names]  # as the tests and `duomo infer` read
    expected: dict[str, list[dict[str, Any]]] | None = spec.get("expected")
    client = Client(spec["socket"], timeout_s=TIMEOUT_S)
    handle = client.model(spec["model"], slots=2)
    start_at, end_at = await_window()
    faulthandler.dump_traceback_later(end_at - time.time() + HANG_AFTER_S, exit=True)
    latencies: list[float] = []
    answers: dict[str, Any] = {}
    wrong = 0
    errors: Counter[str] = Counter()
    n = int(spec.get("offset", 0))
    while time.time() < end_at:
        k = n % len(images)
        n += 1
        sent = time.time()
        try:
            answer: Any = handle.infer(images[k], timeout_s=TIMEOUT_S)
            error = None
        except Exception as err:  # counted by kind; the loop goes on
            answer, error = None, f"{type(err).__name__}: {err}"[:200]
        done = time.time()
        name = Path(names[k]).name
        if error is None and name not in answers:
            answers[name] = answer
        if not start_at <= done <= end_at:
            continue
        if error is not None:
            errors[error] += 1
        elif expected is not None and not same_answer(answer, expected[name]):
            wrong += 1
        else:
            latencies.append((done - sent) * 1e3)
    client.close()
    return {"ok": len(latencies), "wrong": wrong, "errors": dict(errors),
            "latencies_ms": [round(x, 3) for x in latencies], "answers": answers}  # fmt: skip


# -- a trial ----------------------------------------------------------------------------------


def _model_figures(status: dict[str, Any], frames: int) -> dict[str, Any]:
    """Per model of a supervisor's status: batch sizes, stage p50s, and the compute seconds per
    answered frame (``frames``: the pipeline or model requests answered in all)."""
    out: dict[str, Any] = {}
    for name, model in status.get("models", {}).items():
        totals = model.get("totals", {})
        infer_ns = totals.get("compute_infer", {}).get("ns", 0)
        sizes = {int(k): v for k, v in model.get("batch_sizes", {}).items()}
        batches = sum(sizes.values())
        items = sum(k * v for k, v in sizes.items())
        out[name] = {
            "requests": model.get("requests"),
            "batch_sizes": {str(k): v for k, v in sorted(sizes.items())},
            "mean_batch": items / batches if batches else None,
            "p50_ms": {s: v.get("p50_ms") for s, v in model.get("latency", {}).items()},
            "infer_ms_per_frame": infer_ns / 1e6 / frames if frames else None,
            "intra_op_threads": model.get("intra_op_threads"),
        }
    return out


def run_trial(
    kind: str,
    config: Path,
    settings: OcrPipelineSettings,
    workdir: Path,
    images: list[Path],
    expected: dict[str, Any] | None,
) -> dict[str, Any]:
    """One trial of ``kind`` in a fresh supervisor on ``config``."""
    from duomo.ipc.client import Client
    from tools.bench.children import Child, open_window
    from tools.bench.sampler import TreeSampler
    from tools.bench.servers import DuomoServers

    workdir.mkdir(parents=True, exist_ok=True)
    servers = DuomoServers(config, [MODELS[kind]], workdir)
    started = time.monotonic()
    servers.start()
    load_s = time.monotonic() - started
    try:
        socket = str(servers.sockets[MODELS[kind][0]])
        specs = [
            {
                "socket": socket,
                "model": "ocr",
                "images": [str(p) for p in images],
                "offset": i,
                "expected": expected,
            }
            for i in range(settings.producers)
        ]
        children = [Child(MODULE, ["produce"], spec) for spec in specs]
        start_at, end_at = open_window(children, settings.warmup_s, settings.window_s)
        time.sleep(max(0.0, start_at - time.time()))
        sampler = TreeSampler(servers.pids()).start()
        time.sleep(max(0.0, end_at - time.time()))
        resources = sampler.stop()
        results = [c.result() for c in children]
        client = Client(socket, timeout_s=TIMEOUT_S)
        try:
            status = client.status().to_dict()  # (the JSON ``duomo status --json`` prints)
        finally:
            client.close()
    finally:
        servers.stop()
    latencies = sorted(x for r in results for x in r["latencies_ms"])
    errors: Counter[str] = Counter()
    for r in results:
        errors.update(r["errors"])
    answers: dict[str, Any] = {}
    for r in results:
        for name, answer in r["answers"].items():
            answers.setdefault(name, answer)
    root = status.get("models", {}).get(MODELS[kind][0], {})
    frames = int(root.get("requests") or 0)  # (the first step's model's requests: frames)
    cores = float(resources.get("cpu_cores") or 0.0)
    return {
        "kind": kind,
        "frames_per_s": len(latencies) / settings.window_s,
        # the frames a core of the server's CPU time answered: what the load of other
        # processes on the machine (the share of the cores the server got) changes least
        "frames_per_core_s": len(latencies) / settings.window_s / cores if cores else None,
        "ok": len(latencies),
        "wrong": sum(r["wrong"] for r in results),
        "errors": dict(errors),
        "p50_ms": _percentile(latencies, 50),
        "p99_ms": _percentile(latencies, 99),
        "load_s": round(load_s, 2),
        "server": resources,
        "models": _model_figures(status, frames),
        "pipeline_steps": status.get("pipelines", {}).get("ocr", {}).get("steps"),
        "answers": answers,
    }


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


# -- the run ----------------------------------------------------------------------------------


def verdict(trials: list[dict[str, Any]], keep_ratio: float) -> dict[str, Any]:
    """Pairs (each A with the B after it), their ratios, the A-to-A noise, and whether B is
    kept; the same ratios for a third kind, if it ran (``others``)."""
    kinds = list(dict.fromkeys(t["kind"] for t in trials))
    a = [t for t in trials if t["kind"] == kinds[0]]
    b = [t for t in trials if len(kinds) > 1 and t["kind"] == kinds[1]]
    others = {
        kind: [
            y["frames_per_s"] / x["frames_per_s"] if x["frames_per_s"] else None
            for x, y in zip(a, [t for t in trials if t["kind"] == kind])
        ]
        for kind in kinds[2:]
    }
    pairs = []
    for x, y in zip(a, b):
        ratio = y["frames_per_s"] / x["frames_per_s"] if x["frames_per_s"] else None
        p99 = y["p99_ms"] / x["p99_ms"] if x["p99_ms"] and y["p99_ms"] else None
        a_eff, b_eff = x.get("frames_per_core_s"), y.get("frames_per_core_s")
        pairs.append({"a_fps": x["frames_per_s"], "b_fps": y["frames_per_s"],
                      "ratio": ratio, "a_p99_ms": x["p99_ms"], "b_p99_ms": y["p99_ms"],
                      "p99_ratio": p99, "a_frames_per_core_s": a_eff,
                      "b_frames_per_core_s": b_eff,
                      "per_core_ratio": b_eff / a_eff if a_eff and b_eff else None})  # fmt: skip
    spread = None
    if len(a) >= 2 and a[0]["frames_per_s"]:
        spread = a[-1]["frames_per_s"] / a[0]["frames_per_s"]
    a_rates = [t["frames_per_s"] for t in a if t["frames_per_s"]]
    per_core = [p["per_core_ratio"] for p in pairs if p["per_core_ratio"] is not None]
    ratios = [p["ratio"] for p in pairs if p["ratio"] is not None]
    noise = abs(1.0 - spread) if spread is not None else 0.0
    within = bool(ratios) and all(r >= keep_ratio or r >= 1.0 - noise for r in ratios)
    correct = all(t["wrong"] == 0 and not t["errors"] for t in trials)
    return {
        "pairs": pairs,
        "a_to_a": spread,
        "a_max_over_min": max(a_rates) / min(a_rates) if a_rates else None,
        "mean_ratio": statistics.fmean(ratios) if ratios else None,
        "mean_per_core_ratio": statistics.fmean(per_core) if per_core else None,
        "keep_ratio": keep_ratio,
        "keep": within and correct,
        "answers_equal": correct,
        "others": others,
    }


def measure(
    settings: OcrPipelineSettings = OcrPipelineSettings(),
    workdir: Path = ROOT / ".bench" / "ocr_pipeline",
    base: Path = BASE,
    demo: Path = DEMO,
) -> dict[str, Any]:
    """The whole run: A B A B … trials, their figures and the verdict (what ``duomo bench``
    can call)."""
    configs = variant_configs(workdir, base, demo)
    kinds = settings.kinds
    images = fixture_images()
    trials: list[dict[str, Any]] = []
    expected: dict[str, Any] | None = None
    for pair in range(settings.pairs):
        for kind in kinds:
            _log(f"pair {pair + 1}/{settings.pairs}: {kind}")
            trial = run_trial(kind, configs[kind], settings, workdir / f"{pair}-{kind}", images,
                              expected)  # fmt: skip
            if expected is None:  # the first A trial's answers are what every later one gives
                expected = {k: _lines(v) for k, v in trial["answers"].items()}
                missing = {p.name for p in images} - set(expected)
                if missing:
                    raise RuntimeError(f"no answer for {sorted(missing)} in the first trial")
            else:
                trial["wrong"] += sum(
                    not same_answer(v, expected[k]) for k, v in trial["answers"].items()
                )
            trial["answers"] = {k: len(_lines(v)) for k, v in trial["answers"].items()}
            ratio = ""
            if kind != kinds[0]:
                a_fps = [t for t in trials if t["kind"] == kinds[0]][-1]["frames_per_s"]
                ratio = f", /A {trial['frames_per_s'] / a_fps:.3f}" if a_fps else ""
            per_core = trial["frames_per_core_s"] or 0.0
            _log(f"{kind}: {trial['frames_per_s']:.2f} frames/s ({per_core:.2f} per core-second "
                 f"of the server), p99 {trial['p99_ms']} ms, wrong {trial['wrong']}, "
                 f"errors {trial['errors']}{ratio}")  # fmt: skip
            trials.append(trial)
    return {
        "settings": asdict(settings),
        "images": [p.name for p in images],
        "lines_per_image": trials[0]["answers"] if trials else {},
        "machine": _machine(),
        "trials": trials,
        "verdict": verdict(trials, settings.keep_ratio),
    }


def _machine() -> dict[str, Any]:
    import os
    import platform

    from duomo.worker.thread_budget import available_cores

    load = list(os.getloadavg())
    return {"cores": available_cores(), "cpu_count": os.cpu_count(), "loadavg_at_end": load,
            "python": platform.python_version()}  # fmt: skip


def main(argv: list[str]) -> int:
    """``python -m tools.bench.ocr_pipeline [--pairs N --window S --producers P --out F]``, or
    ``produce`` (a producer child)."""
    if argv[:1] == ["produce"]:
        spec = json.loads(sys.stdin.readline())
        print(json.dumps(produce(spec)), flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="python -m tools.bench.ocr_pipeline")
    parser.add_argument("--pairs", type=int, default=OcrPipelineSettings.pairs)
    parser.add_argument("--window", type=float, default=OcrPipelineSettings.window_s)
    parser.add_argument("--warmup", type=float, default=OcrPipelineSettings.warmup_s)
    parser.add_argument("--producers", type=int, default=OcrPipelineSettings.producers)
    parser.add_argument("--kinds", default=",".join(KINDS), help="A,B[,more]: " + ", ".join(KINDS))
    today = datetime.date.today().isoformat()
    default_out = ROOT / "tools" / "bench" / "results" / today / "ocr_pipeline" / "result.json"
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args(argv)
    settings = OcrPipelineSettings(
        pairs=args.pairs,
        window_s=args.window,
        warmup_s=args.warmup,
        producers=args.producers,
        kinds=tuple(args.kinds.split(",")),
    )
    result = measure(settings)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    v = result["verdict"]
    _log(f"B/A frames/s {[round(p['ratio'], 3) for p in v['pairs'] if p['ratio']]}, per "
         f"core-second {[round(p['per_core_ratio'], 3) for p in v['pairs'] if p['per_core_ratio']]}"
         f", A→A {v['a_to_a']}, keep: {v['keep']}; written to {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
