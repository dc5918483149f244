"""The pipeline benchmark of ``duomo bench --pipelines`` (issue 35): the chain face → per face
embedding + attributes, as a pipeline, from the client and in Triton, and what the tracker's
reuse saves.

In one run on one machine, on ``configs/pipelines-bench.yaml`` (the demo's ``face``, the
second-stage ``face_embedding`` and ``face_attributes`` with ``max_batch`` 8 and a 2 ms window,
and the pipeline ``faces`` over them):

1. **chain** — frames with 1 face (astronaut.png at 640×640) and with 4 faces (a 2×2 mosaic of
   it, each tile 320×320, two of them mirrored; the detector's 4 faces are checked before
   anything runs), ``producers`` producer processes closed loop, a ``warmup_s`` warm-up and a
   ``window_s`` window per trial, for the variants (``tools.bench.pipeline_producer``):
   ``pipeline`` (``client.model("faces").infer(frame)``, a fresh supervisor per trial),
   ``client`` (the same chain driven from the producer: detect, then one request per face to
   each second-stage model, all in flight at once; a fresh supervisor per trial, the same
   config), ``client-seq`` (the same, one request after another, as the simplest loop does) and
   ``triton`` (Triton 2.51 from the peers' setup, ``tools.bench.peers``: a Python-backend BLS
   model ``faces`` calling Python-backend models that run the same Duomo executors on the same
   ONNX files, the second stage over Triton's dynamic batcher with the same ``max_batch`` and
   window; one Triton for the whole part). The trials take turns (1 face then 4, each variant
   in order), ``rounds`` times, the order reversed every other time; before each, the run
   waits (``quiet_wait_s`` at most) for the shared machine's other work to fall below
   ``quiet_below`` cores, and a variant whose every trial still ran beside others' work is
   tried again (``retries`` at most); the report's ratios use each variant's least disturbed
   trial. Per trial: frames/s (frames answered in the
   window with every face's two sub-results ÷ the window), latency p50/p99 per frame (send →
   the frame's last answer), the server's and producers' cores, and for Duomo the models'
   requests and batch sizes over the window (from ``status``);
2. **tracker** — ``producers`` streams (``client.stream(…, models=["faces"])``, ``fifo``, one
   frame in flight each) of a clip of 4-face frames where the faces persist and move
   (``pipeline_producer.moving_frame``: the mosaic shifted a pixel a frame, looped), the
   pipeline with ``reinfer_every: 1`` and then ``10`` on both sub-steps (tracker on in both):
   frames/s, p99, and over the window the sub-steps' runs and reuses per frame (the pipeline's
   status: ``duomo_pipeline_step_runs_total`` / ``_reused_total``) and the second-stage models'
   requests.

The report's section is ``tools.bench.pipeline_report``'s. Called by ``tools.bench.run``
(``--pipelines``, ``--pipelines-only``).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tools.bench import peers
from tools.bench.children import Child, open_window
from tools.bench.report import percentile
from tools.bench.sampler import TreeSampler, wait_quiet
from tools.bench.servers import DuomoServers, ModeServers, TritonServer

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "pipelines-bench.yaml"
FACE_IMAGE = ROOT / "tests" / "fixtures" / "images" / "astronaut.png"
MODULE = "tools.bench.pipeline_producer"
MODELS = ["face", "face_embedding", "face_attributes"]
SECOND_STAGE = ["face_embedding", "face_attributes"]
VARIANTS = ("pipeline", "client", "client-seq", "triton")
DEFAULT_VARIANTS = VARIANTS
PIPELINE = "faces"
FRAME_SIDE = 640


@dataclass(frozen=True)
class PipelineSettings:
    """What the pipeline benchmark runs (``duomo bench --pipeline-*`` options)."""

    warmup_s: float = 3.0
    window_s: float = 10.0
    producers: int = 4
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    faces: tuple[int, ...] = (1, 4)
    reinfer_every: tuple[int, ...] = (1, 10)
    clip_frames: int = 300
    tracker: bool = True
    rounds: int = 2  # each trial this many times, the order reversed every other time
    quiet_below: float = 0.3  # before a trial, wait (≤ quiet_wait_s) for others' cores below this
    quiet_wait_s: float = 30.0
    retries: int = 2  # more trials of a variant whose every trial ran beside others' work


def _log(message: str) -> None:
    print(f"duomo bench: pipelines: {message}", file=sys.stderr, flush=True)


# -- frames and configs ---------------------------------------------------------------------


def make_frames(face: np.ndarray, side: int = FRAME_SIDE) -> dict[int, np.ndarray]:
    """The 1-face frame (``face`` resized to ``side``²) and the 4-face one (a 2×2 mosaic of it,
    each tile ``side``/2, the second and third mirrored), uint8 RGB."""
    import cv2

    one = cv2.resize(face, (side, side), interpolation=cv2.INTER_AREA)
    tile = cv2.resize(face, (side // 2, side // 2), interpolation=cv2.INTER_AREA)
    mirrored = tile[:, ::-1]
    mosaic = np.concatenate(
        [np.concatenate([tile, mirrored], axis=1), np.concatenate([mirrored, tile], axis=1)],
        axis=0,
    )
    return {1: np.ascontiguousarray(one), 4: np.ascontiguousarray(mosaic)}


def detected_faces(config: Path, frames: dict[int, np.ndarray]) -> dict[int, int]:
    """Faces the config's detector finds in each frame, in-process (the frames are checked
    before anything is measured)."""
    from tools.bench.inprocess import open_executor, run_one

    executor = open_executor(config, "face", threads=1)
    try:
        return {n: len(run_one(executor, frame)["faces"]) for n, frame in frames.items()}
    finally:
        executor.close()


def derived_config(
    base: Path, out: Path, pipelines: bool = True, reinfer_every: int | None = None
) -> Path:
    """``base`` with an absolute ``model_root``; without its ``pipelines`` unless ``pipelines``;
    with ``reinfer_every`` on every ``for_each`` step when given."""
    raw = yaml.safe_load(base.read_text(encoding="utf-8"))
    root = raw.get("model_root")
    raw["model_root"] = str((base.parent / root).resolve()) if root else str(base.parent)
    if not pipelines:
        raw.pop("pipelines", None)
    elif reinfer_every is not None:
        for pipeline in raw.get("pipelines", []):
            for step in pipeline["steps"]:
                if step.get("for_each"):
                    step["reinfer_every"] = reinfer_every
    out.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return out


def pipelines_served() -> bool:
    """Whether this checkout's supervisor serves pipelines
    (``supervisor/dataflow/pipelines.py``)."""
    try:
        import duomo.supervisor.dataflow.pipelines  # noqa: F401
    except ImportError:
        return False
    return True


# -- Triton: the BLS model over the same executors ------------------------------------------


def triton_faces_repository(repository: Path, config: Path, bls_instances: int) -> None:
    """``face`` (``peers.triton_repository``'s one-image model), ``face_embedding`` and
    ``face_attributes`` (``triton_faces_chip.py``, dynamically batched as the config batches
    them) and the BLS model ``faces`` (``triton_faces_bls.py``, ``bls_instances`` instances)."""
    peers.triton_repository(repository, config, ["face"])
    models = {m["name"]: m for m in yaml.safe_load(config.read_text(encoding="utf-8"))["models"]}
    for name in SECOND_STAGE:
        max_batch = int(models[name].get("max_batch", 1))
        delay_us = int(float(models[name].get("max_delay_ms") or 0) * 1000)
        peers.python_model(
            repository,
            name,
            "triton_faces_chip.py",
            f"max_batch_size: {max_batch}\n"
            f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n"
            "input [\n"
            '  { name: "IMAGE", data_type: TYPE_UINT8, dims: [-1, -1, 3] },\n'
            '  { name: "LANDMARKS", data_type: TYPE_FP32, dims: [5, 2] }\n'
            "]\n"
            'output [{ name: "RESULT", data_type: TYPE_STRING, dims: [1] }]\n'
            "instance_group [{ kind: KIND_CPU, count: 1 }]\n",
            duomo_config=config,
        )
    peers.python_model(
        repository,
        PIPELINE,
        "triton_faces_bls.py",
        "max_batch_size: 0\n"
        'input [{ name: "IMAGE", data_type: TYPE_UINT8, dims: [-1, -1, 3] }]\n'
        'output [{ name: "RESULT", data_type: TYPE_STRING, dims: [1] }]\n'
        f"instance_group [{{ kind: KIND_CPU, count: {bls_instances} }}]\n",
    )


class TritonFacesServer(TritonServer):
    """Triton 2.51 (``tools.bench.servers.TritonServer``'s binary and environment) serving
    ``triton_faces_repository``."""

    bls_instances = 4

    def command(self) -> tuple[list[str], dict[str, str]]:
        env = peers.ensure_env("triton")
        repository = self.workdir / "triton-models"
        triton_faces_repository(repository, self.config, self.bls_instances)
        return peers.triton_command(
            env, repository, self.workdir / "triton-backends", self.port, self.grpc_port
        )


# -- one trial ------------------------------------------------------------------------------


def _status(socket: Path) -> dict[str, Any]:
    from duomo.ipc.client import Client

    with Client(socket, timeout_s=30) as client:
        return client.status().to_dict()  # (the JSON ``duomo status --json`` prints)


def _counts(status: dict[str, Any]) -> dict[str, Any]:
    """What a trial reads of the supervisor's status: per model its requests and batch sizes,
    and the pipeline's requests and per step runs, reuses and skips."""
    models = {
        name: {"requests": int(m.get("requests", 0)),
               "batch_sizes": {str(k): int(v) for k, v in (m.get("batch_sizes") or {}).items()}}
        for name, m in status.get("models", {}).items()
    }  # fmt: skip
    pipeline = (status.get("pipelines") or {}).get(PIPELINE) or {}
    steps = {
        s["name"]: {k: int(s.get(k, 0)) for k in ("runs", "skipped", "reused", "errors")}
        for s in pipeline.get("steps", [])
    }
    return {"models": models, "pipeline": {"requests": int(pipeline.get("requests", 0)),
                                           "errors": int(pipeline.get("errors", 0)),
                                           "steps": steps}}  # fmt: skip


STEP_SERIES = {
    "duomo_pipeline_step_runs_total": "runs",
    "duomo_pipeline_step_skipped_total": "skipped",
    "duomo_pipeline_step_reused_total": "reused",
    "duomo_pipeline_step_errors_total": "errors",
}


def step_counts_from_metrics(text: str, pipeline: str = PIPELINE) -> dict[str, dict[str, int]]:
    """Per step of ``pipeline`` its runs, skips, reuses and errors, from a ``/metrics`` page
    (``duomo_pipeline_step_*_total``); empty when the page has none."""
    from prometheus_client.parser import text_string_to_metric_families

    steps: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = STEP_SERIES.get(sample.name)
            if key is None or sample.labels.get("pipeline") != pipeline:
                continue
            step = steps.setdefault(sample.labels["step"], {k: 0 for k in STEP_SERIES.values()})
            step[key] += int(sample.value)
    return steps


def _scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return str(response.read().decode())


def count_delta(before: Any, after: Any) -> Any:
    """``after − before``, key by key through nested dicts of counts (a key only in ``after``
    counts from 0)."""
    if isinstance(after, dict):
        return {k: count_delta(before.get(k, {} if isinstance(v, dict) else 0), v)
                for k, v in after.items()}  # fmt: skip
    return after - before


def mean_batch(batch_sizes: dict[str, int]) -> float | None:
    """The mean batch size of a histogram ``{size: batches}``."""
    batches = sum(batch_sizes.values())
    return sum(int(k) * n for k, n in batch_sizes.items()) / batches if batches else None


def _read_counts(servers: ModeServers) -> dict[str, Any] | None:
    """A supervisor's counts (``_counts``), the pipeline's steps from ``/metrics`` where its
    status has none; None for Triton."""
    if not isinstance(servers, DuomoServers):
        return None
    counts = _counts(_status(servers.sockets["face"]))
    if not counts["pipeline"]["steps"] and servers.metrics_ports:
        counts["pipeline"]["steps"] = step_counts_from_metrics(_scrape(servers.metrics_ports[0]))
    return counts


def _measure(
    children: list[Child], servers: ModeServers, settings: PipelineSettings
) -> dict[str, Any]:
    """Open the window for ``children``; their merged figures, the servers' and producers'
    resources over the window, and (a supervisor) its counts over the window."""
    start_at, end_at = open_window(children, settings.warmup_s, settings.window_s)
    time.sleep(max(0.0, start_at - time.time()))
    before = _read_counts(servers)
    server = TreeSampler(servers.pids()).start()
    producers = TreeSampler([c.process.pid for c in children]).start()
    time.sleep(max(0.0, end_at - time.time()))
    after = _read_counts(servers)
    resources = server.stop()
    producer_resources = producers.stop()
    results = [c.result() for c in children]
    latencies = sorted(x for r in results for x in r["latencies_ms"])
    errors: dict[str, int] = {}
    for r in results:
        for e, n in r["errors"].items():
            errors[e] = errors.get(e, 0) + n
    ok = sum(r["ok"] for r in results)
    figures: dict[str, Any] = {
        "frames": ok,
        "fps": ok / settings.window_s,
        "wrong": sum(r["wrong"] for r in results),
        "errors": errors,
        "latency_ms_p50": percentile(latencies, 0.50),
        "latency_ms_p90": percentile(latencies, 0.90),
        "latency_ms_p99": percentile(latencies, 0.99),
        "latency_ms_max": latencies[-1] if latencies else None,
        "server": resources,
        "producers": producer_resources,
        "producer_cpu_s": sum(r["cpu_s"] for r in results),
    }
    for key in ("reused_sub_results", "tracked_faces"):
        if any(key in r for r in results):
            figures[key] = sum(r.get(key, 0) for r in results)
    if before is not None and after is not None:
        counts = count_delta(before, after)
        for model in counts["models"].values():
            model["mean_batch"] = mean_batch(model["batch_sizes"])
        figures["counts"] = counts
    return figures


def _chain_children(
    kind: str, servers: ModeServers, frame: Path, faces: int, producers: int
) -> list[Child]:
    where = servers.target("face")
    spec = {**where, "frame": str(frame), "faces": faces}
    if kind == "triton":
        spec = {"port": where["port"], "frame": str(frame), "faces": faces}
    return [Child(MODULE, [kind], spec) for _ in range(producers)]


def _duomo(config: Path, workdir: Path) -> DuomoServers:
    """A fresh supervisor on ``config``, its ``/metrics`` on (read at the window's ends only)."""
    workdir.mkdir(parents=True, exist_ok=True)
    servers = DuomoServers(config, [MODELS], workdir, metrics=True)
    servers.start()
    return servers


def chain_trial(
    kind: str,
    faces: int,
    frame: Path,
    configs: dict[str, Path],
    triton: ModeServers | None,
    settings: PipelineSettings,
    workdir: Path,
) -> dict[str, Any]:
    """One variant at one face count: a fresh supervisor (Duomo), or the one Triton."""
    _log(f"{kind}, {faces} face(s) a frame, {settings.producers} producers")
    if kind == "triton":
        assert triton is not None
        figures = _measure(
            _chain_children(kind, triton, frame, faces, settings.producers), triton, settings
        )
        time.sleep(1.0)  # what the trial left queued drains before the next
        return {"variant": kind, "faces": faces, **figures}
    config = configs["pipeline" if kind == "pipeline" else "chain"]
    servers = _duomo(config, workdir / f"{kind}-{faces}")
    try:
        children = _chain_children(kind, servers, frame, faces, settings.producers)
        figures = _measure(children, servers, settings)
    finally:
        servers.stop()
    return {"variant": kind, "faces": faces, **figures}


AGAIN = ", again (others' work ran beside it)"  # the label of a trial run again (``disturbed``)


def _attempt(label: str, run: Any, **fields: Any) -> dict[str, Any]:
    """``run()`` once the machine is quiet enough (``wait_quiet``), or what went wrong (the run
    goes on; the report says it)."""
    settings = fields.pop("settings")
    quiet = wait_quiet(settings.quiet_below, settings.quiet_wait_s)
    try:
        return {**dict(run()), "quiet": quiet, "round": fields.get("round")}
    except (RuntimeError, OSError) as err:
        _log(f"{label}: {err}")
        return {**fields, "error": str(err)[:2000]}


def chain(
    frames: dict[int, Path], configs: dict[str, Path], settings: PipelineSettings, workdir: Path
) -> dict[str, Any]:
    """Part 1: every variant at every face count, taking turns (A B C, then C B A)."""
    variants = list(settings.variants)
    triton: ModeServers | None = None
    triton_error: str | None = None
    if "triton" in variants:
        _log("starting Triton (BLS model faces over the same executors)")
        (workdir / "triton").mkdir(parents=True)
        triton = TritonFacesServer(configs["triton"], MODELS, workdir / "triton")
        try:
            triton.start()
        except RuntimeError as err:
            _log(f"triton: {err}")
            triton_error, triton = str(err), None
    trials: list[dict[str, Any]] = []

    def attempt(kind: str, faces: int, r: int, again: str = "") -> dict[str, Any]:
        """One trial of round ``r`` (``again``: the label's note on a retry)."""
        return _attempt(
            f"{kind}, {faces} face(s){again}",
            lambda: chain_trial(
                kind, faces, frames[faces], configs, triton, settings, workdir / f"round-{r}"
            ),
            variant=kind,
            faces=faces,
            round=r,
            settings=settings,
        )

    turns = [(faces, kind) for faces in settings.faces for kind in variants]
    try:
        for r in range(settings.rounds):
            for faces, kind in turns if r % 2 == 0 else list(reversed(turns)):
                if kind == "triton" and triton is None:
                    trials.append({"variant": kind, "faces": faces, "error": triton_error})
                    continue
                trials.append(attempt(kind, faces, r))
        for faces, kind in turns:  # a variant never measured on a quiet machine: again
            for extra in range(settings.retries):
                if kind == "triton" and triton is None:
                    break
                ran = [t for t in trials if t["variant"] == kind and t["faces"] == faces]
                if not disturbed(ran, settings.quiet_below):
                    break
                trials.append(attempt(kind, faces, settings.rounds + extra, AGAIN))
    finally:
        if triton is not None:
            triton.stop()
    return {"trials": trials}


def disturbed(trials: list[dict[str, Any]], quiet_below: float) -> bool:
    """Whether every one of ``trials`` that ran had others' work of ``quiet_below`` cores or
    more beside it (``pipeline_report.others``)."""
    from tools.bench.pipeline_report import others

    ran = [t for t in trials if "error" not in t]
    return bool(ran) and min(others(t) for t in ran) >= quiet_below


# -- part 2: the tracker's reuse ------------------------------------------------------------


def tracker_trial(
    every: int, frame: Path, base: Path, settings: PipelineSettings, workdir: Path
) -> dict[str, Any]:
    _log(f"tracker: {settings.producers} streams of moving faces, reinfer_every {every}")
    workdir.mkdir(parents=True, exist_ok=True)
    config = derived_config(base, workdir / f"pipelines-every-{every}.yaml", reinfer_every=every)
    servers = _duomo(config, workdir / "duomo")
    try:
        children = [
            Child(
                MODULE,
                ["stream"],
                {
                    "socket": str(servers.sockets["face"]),
                    "frame": str(frame),
                    "faces": 4,
                    "stream": f"cam-{i + 1}",
                    "in_flight": 1,
                    "clip_frames": settings.clip_frames,
                },
            )
            for i in range(settings.producers)
        ]
        figures = _measure(children, servers, settings)
    finally:
        servers.stop()
    return {"reinfer_every": every, **figures}


def tracker(frame: Path, base: Path, settings: PipelineSettings, workdir: Path) -> dict[str, Any]:
    """Part 2: the same streams with each ``reinfer_every``."""
    trials: list[dict[str, Any]] = []

    def attempt(every: int, r: int, again: str = "") -> dict[str, Any]:
        """One trial of round ``r`` (``again``: the label's note on a retry)."""
        return _attempt(
            f"tracker, reinfer_every {every}{again}",
            lambda: tracker_trial(every, frame, base, settings, workdir / f"every-{every}-{r}"),
            reinfer_every=every,
            round=r,
            settings=settings,
        )

    for r in range(settings.rounds):
        order = settings.reinfer_every if r % 2 == 0 else settings.reinfer_every[::-1]
        for every in order:
            trials.append(attempt(every, r))
    for every in settings.reinfer_every:
        for extra in range(settings.retries):
            ran = [t for t in trials if t["reinfer_every"] == every]
            if not disturbed(ran, settings.quiet_below):
                break
            trials.append(attempt(every, settings.rounds + extra, AGAIN))
    return {"trials": trials}


# -- the whole part -------------------------------------------------------------------------


def run_pipelines(config: Path, settings: PipelineSettings, workdir: Path) -> dict[str, Any]:
    """Both parts; the raw figures ``tools.bench.pipeline_report`` reports."""
    from duomo.supervisor.operators.image_files import read_image

    started = time.monotonic()
    served = pipelines_served()
    variants = tuple(v for v in settings.variants if served or v != "pipeline")
    if not served:
        _log("this checkout serves no pipelines: the variant pipeline and the tracker skipped")
    settings = PipelineSettings(**{**asdict(settings), "variants": variants,
                                   "tracker": settings.tracker and served})  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    configs = {
        "chain": derived_config(config, workdir / "chain.yaml", pipelines=served),
        "triton": derived_config(config, workdir / "triton.yaml", pipelines=False),
    }
    configs["pipeline"] = configs["chain"]
    images = make_frames(read_image(FACE_IMAGE))
    found = detected_faces(configs["triton"], images)
    _log(f"frames: {', '.join(f'{n} face(s) → {found[n]} found' for n in images)}")
    for n, count in found.items():
        if count != n:
            raise RuntimeError(f"the {n}-face frame gives {count} face(s) to the detector")
    frames: dict[int, Path] = {}
    for n, image in images.items():
        frames[n] = workdir / f"frame-{n}.npy"
        np.save(frames[n], image)
    raw: dict[str, Any] = {
        "settings": asdict(settings),
        "config": str(config),
        "cpus": os.cpu_count(),
        "frames": {str(n): {"shape": list(images[n].shape), "faces": found[n]} for n in images},
        "pipelines_served": served,
        "chain": chain({n: frames[n] for n in settings.faces}, configs, settings, workdir),
    }
    if settings.tracker:
        raw["tracker"] = tracker(frames[4], config, settings, workdir / "tracker")
    raw["elapsed_s"] = time.monotonic() - started
    return raw


def bench_pipelines(
    config: Path, out: Path, window_s: float, variants: list[str], producers: int, rounds: int = 2
) -> str:
    """``duomo bench --pipelines``: run both parts and add them to the report in ``out``; the
    report's Markdown section. ``variants``: some of ``VARIANTS``."""
    import tempfile

    from tools.bench.pipeline_report import add_to_report

    settings = PipelineSettings(
        window_s=window_s, variants=tuple(variants), producers=producers, rounds=rounds
    )
    with tempfile.TemporaryDirectory(prefix="duomo-bench-pipelines-") as tmp:
        raw = run_pipelines(config, settings, Path(tmp))
    return add_to_report(raw, out)
