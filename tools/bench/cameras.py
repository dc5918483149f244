"""The camera benchmark of ``duomo bench --cameras`` (issue 34): cameras as producers.

Two parts, in one run on one machine:

1. **freshness** — one 1280×720 camera into ``face`` through Duomo's video source, a fresh
   supervisor per trial: ``fifo``
   then ``latest`` at 30 fps, then both again at 3× what ``face`` answered under ``fifo`` (its
   capacity here: the model never idles under ``fifo``). Per trial: answered frames/s, the
   answers' age p50/p99/max, superseded and refused counts over the window, against the bound
   ``latest`` promises: two service times (the frame running, then its own) + one frame period
   (the batch window is 0 on the CPU), the service time being 1 ÷ the answered rate;
2. **scaling** — N 720p cameras at 10 fps each, all playing the same file, into ``face`` and
   ``classify``, for three producers: Duomo's video source (``source``: one process, one
   ``VideoSource`` per camera, policy ``latest``), the hand-written loop (``naive``: a process
   per camera, ``cv2.VideoCapture`` + ``client.model(m).infer``) and Triton fed by the same
   loop (``triton``: ``tritonclient.http`` to the Triton server of ``tools.bench.servers``, the
   same executors). N goes up from 1, the producers taking turns at each N (``scaling``), each
   until its first failed trial: a trial passes when every camera kept ≥ ``kept_at_least`` of
   its rate for every model (OK answers ÷ frames offered, the camera's rate × the window).
   Decode's CPU is the frames decoded in the window × what one frame's decode costs alone
   (``calibrate``, per decode path).

The clips are made once (``tools.bench.camera_clip``, cached under ``.bench/clips``). Called by
``tools.bench.run`` (``--cameras``); the report's section is ``tools.bench.camera_report``'s.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tools.bench.camera_clip import make_clip
from tools.bench.children import Child, open_window
from tools.bench.sampler import TreeSampler
from tools.bench.servers import DuomoServers, ModeServers, TritonServer

ROOT = Path(__file__).resolve().parents[2]
CLIPS = ROOT / ".bench" / "clips"
PRODUCERS = ("source", "naive", "triton")
MODULE = "tools.bench.camera_producer"


@dataclass(frozen=True)
class CameraSettings:
    """What the camera benchmark runs (``duomo bench --camera-*`` options)."""

    warmup_s: float = 5.0
    freshness_s: float = 20.0  # part 1's window
    window_s: float = 15.0  # each scaling trial's window
    one_fps: int = 30  # part 1's camera
    many_fps: int = 10  # part 2's cameras
    overload: float = 3.0  # part 1's second rate: this × face's capacity
    kept_at_least: float = 0.95
    max_cameras: int = 12
    producers: tuple[str, ...] = PRODUCERS
    calibrate_frames: int = 100


def _log(message: str) -> None:
    print(f"duomo bench: cameras: {message}", file=sys.stderr, flush=True)


def _measure(
    children: list[Child], servers: ModeServers, warmup_s: float, window_s: float
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Open the window for ``children``; their results, the servers' and the producers'
    resources over the window."""
    start_at, end_at = open_window(children, warmup_s, window_s)
    time.sleep(max(0.0, start_at - time.time()))
    server = TreeSampler(servers.pids()).start()
    producers = TreeSampler([c.process.pid for c in children]).start()
    time.sleep(max(0.0, end_at - time.time()))
    resources = server.stop()
    producer_resources = producers.stop()
    return [c.result() for c in children], resources, producer_resources


def calibrate(clip: Path, frames: int) -> dict[str, Any]:
    """CPU ms per decoded 720p frame, per decode path (``camera_producer calibrate``)."""
    child = Child(MODULE, ["calibrate"], {"clip": str(clip), "frames": frames})
    open_window([child], 0.0, 0.0)
    return child.result()


# -- part 1: one camera, latest against fifo --------------------------------------------------


def _one_camera(
    config: Path, clip: Path, fps: int, policy: str, settings: CameraSettings, workdir: Path
) -> dict[str, Any]:
    workdir.mkdir(parents=True)
    servers = DuomoServers(config, [["face"]], workdir)
    servers.start()
    try:
        spec = {"socket": str(servers.sockets["face"]), "clip": str(clip), "cameras": ["cam-1"],
                "models": ["face"], "policy": policy}  # fmt: skip
        child = Child(MODULE, ["source"], spec)
        results, server, producers = _measure(
            [child], servers, settings.warmup_s, settings.freshness_s
        )
    finally:
        servers.stop()
    result = results[0]
    camera = result["cameras"]["cam-1"]
    face = camera["models"]["face"]
    answered_fps = face["ok"] / settings.freshness_s
    service_ms = 1e3 / answered_fps if answered_fps else math.inf
    return {
        "policy": policy,
        "fps": fps,
        "answered_fps": answered_fps,
        "sent_fps": camera["sent"] / settings.freshness_s,
        "superseded": face["outcomes"].get("SUPERSEDED", 0),
        "refused": sum(n for o, n in face["outcomes"].items() if o != "SUPERSEDED"),
        "outcomes": face["outcomes"],
        **{k: face[k] for k in ("age_ms_p50", "age_ms_p90", "age_ms_p99", "age_ms_max")},
        "service_ms": service_ms,
        "bound_ms": 2 * service_ms + 1e3 / fps,
        "server": server,
        "producer": producers,
        "errors": result["errors"],
    }


def freshness(config: Path, settings: CameraSettings, workdir: Path) -> dict[str, Any]:
    """Part 1: fifo and latest at ``one_fps``, then at ``overload`` × face's capacity."""
    clip = make_clip(CLIPS, settings.one_fps)
    trials = []
    for policy in ("fifo", "latest"):
        _log(f"one camera, {settings.one_fps} fps, {policy}")
        trials.append(_trial(config, clip, settings.one_fps, policy, settings, workdir / policy))
    capacity = trials[0].get("answered_fps", 0.0)
    fast = max(settings.one_fps, round(settings.overload * capacity))
    fast_clip = make_clip(CLIPS, fast)
    for policy in ("latest", "fifo"):
        _log(f"one camera, {fast} fps ({settings.overload:g}× face's {capacity:.1f}/s), {policy}")
        trials.append(
            _trial(config, fast_clip, fast, policy, settings, workdir / f"{policy}-{fast}")
        )
    return {"capacity_fps": capacity, "overload_fps": fast, "trials": trials}


def _trial(
    config: Path, clip: Path, fps: int, policy: str, settings: CameraSettings, workdir: Path
) -> dict[str, Any]:
    """``_one_camera``, or what went wrong (the run goes on; the report says it)."""
    try:
        return _one_camera(config, clip, fps, policy, settings, workdir)
    except RuntimeError as err:
        _log(f"{fps} fps, {policy}: {err}")
        return {"policy": policy, "fps": fps, "error": str(err)}


# -- part 2: N cameras, three producers -------------------------------------------------------


def _children(kind: str, n: int, servers: ModeServers, clip: Path, fps: int) -> list[Child]:
    models = ["face", "classify"]
    cameras = [f"cam-{i + 1}" for i in range(n)]
    if kind == "source":
        socket = str(servers.target("face")["socket"])
        spec = {"socket": socket, "clip": str(clip), "cameras": cameras, "models": models,
                "policy": "latest"}  # fmt: skip
        return [Child(MODULE, ["source"], spec)]
    where = servers.target("face")
    specs = [
        {**where, "clip": str(clip), "fps": fps, "models": models, "camera": camera}
        for camera in cameras
    ]
    return [Child(MODULE, [kind], spec) for spec in specs]


def trial_figures(
    results: list[dict[str, Any]],
    offered: float,
    decode_ms: float,
    window_s: float,
    kept_at_least: float,
) -> dict[str, Any]:
    """Per camera and model the share kept (OK answers ÷ ``offered`` frames); whether every
    camera kept ``kept_at_least``; per model the least and most kept; decode's cores."""
    cameras: dict[str, Any] = {}
    errors: list[str] = []
    for result in results:
        cameras.update(result["cameras"])
        errors += result["errors"]
    shares = {
        cam: {m: f["ok"] / offered for m, f in figures["models"].items()}
        for cam, figures in cameras.items()
    }
    models = sorted({m for per in shares.values() for m in per})
    least = {m: min(per[m] for per in shares.values()) for m in models}
    most = {m: max(per[m] for per in shares.values()) for m in models}
    decoded = sum(f["decoded"] for f in cameras.values())
    p50s = [f["age_ms_p50"] for c in cameras.values() for f in c["models"].values()]
    p99s = [f["age_ms_p99"] for c in cameras.values() for f in c["models"].values()]
    return {
        "shares": shares,
        "least": least,
        "most": most,
        "evenness": min((least[m] / most[m] if most[m] else 0.0) for m in models),
        "passed": all(s >= kept_at_least for per in shares.values() for s in per.values()),
        "age_ms_p50_median": _median([v for v in p50s if v is not None]),
        "age_ms_p99_worst": max((v for v in p99s if v is not None), default=None),
        "outcomes": _outcomes(cameras),
        "decoded": decoded,
        "decode_cores": decoded * decode_ms / 1e3 / window_s,
        "errors": errors[:10],
    }


def _median(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def _outcomes(cameras: dict[str, Any]) -> dict[str, int]:
    total: dict[str, int] = {}
    for figures in cameras.values():
        for model in figures["models"].values():
            for outcome, n in model["outcomes"].items():
                total[outcome] = total.get(outcome, 0) + n
    return total


def _start_servers(kinds: tuple[str, ...], config: Path, workdir: Path) -> dict[str, Any]:
    """Per producer its servers: one supervisor for ``source`` and ``naive`` (their trials
    take turns), one Triton for ``triton``; or the reason it could not start."""
    started: dict[str, Any] = {}
    duomo: ModeServers | None = None
    for kind in kinds:
        if kind == "triton":
            (workdir / "triton").mkdir(parents=True)
            servers: ModeServers = TritonServer(config, ["face", "classify"], workdir / "triton")
        elif duomo is not None:
            started[kind] = duomo
            continue
        else:
            (workdir / "duomo").mkdir(parents=True)
            servers = duomo = DuomoServers(config, [["face", "classify"]], workdir / "duomo")
        try:
            servers.start()
            started[kind] = servers
        except RuntimeError as err:  # a server that cannot start here: said in the report
            _log(f"{kind}: {err}")
            started[kind] = str(err)
    return started


def _scaling_trial(
    kind: str, n: int, servers: ModeServers, settings: CameraSettings, decode_ms: float
) -> dict[str, Any]:
    _log(f"{kind}: {n} camera(s) × {settings.many_fps} fps into face + classify")
    clip = make_clip(CLIPS, settings.many_fps)
    children = _children(kind, n, servers, clip, settings.many_fps)
    results, server, producers = _measure(children, servers, settings.warmup_s, settings.window_s)
    offered = settings.many_fps * settings.window_s
    figures = trial_figures(results, offered, decode_ms, settings.window_s, settings.kept_at_least)
    time.sleep(2.0)  # what the trial left queued drains before the next
    return {"cameras": n, **figures, "server": server, "producers": producers,
            "producer_cpu_s": sum(r["cpu_s"] for r in results)}  # fmt: skip


def scaling(
    config: Path, settings: CameraSettings, calibration: dict[str, Any], workdir: Path
) -> dict[str, Any]:
    """Part 2: N = 1, 2, … (up to ``max_cameras``); at each N every producer that has not
    failed yet takes its turn, in order at odd N and reversed at even N (A B C C B A …), so the
    machine's drift hits them alike; a producer stops at its first failed trial."""
    kinds = settings.producers
    parts: dict[str, dict[str, Any]] = {
        kind: {"producer": kind, "trials": [], "largest_n": 0} for kind in kinds
    }
    started = _start_servers(kinds, config, workdir)
    try:
        running = [k for k in kinds if not isinstance(started[k], str)]
        for kind in kinds:
            if isinstance(started[kind], str):
                parts[kind].update(error=started[kind], largest_n=None)
        for n in range(1, settings.max_cameras + 1):
            if not running:
                break
            for kind in list(running) if n % 2 else list(reversed(running)):
                path = "source" if kind == "source" else "opencv"
                decode_ms = calibration[path]["cpu_ms_per_frame"]
                try:
                    trial = _scaling_trial(kind, n, started[kind], settings, decode_ms)
                except RuntimeError as err:  # a producer that failed: said in the report
                    _log(f"{kind}, {n} camera(s): {err}")
                    parts[kind]["error"] = str(err)
                    trial = None
                if trial is not None:
                    parts[kind]["trials"].append(trial)
                if trial is None or not trial["passed"]:
                    running.remove(kind)
                else:
                    parts[kind]["largest_n"] = n
    finally:
        for servers in {id(s): s for s in started.values() if not isinstance(s, str)}.values():
            servers.stop()
    return parts


def run_cameras(config: Path, settings: CameraSettings, workdir: Path) -> dict[str, Any]:
    """Both parts; the raw figures ``tools.bench.camera_report`` reports."""
    started = time.monotonic()
    _log("clips and decode's cost")
    clip = make_clip(CLIPS, settings.many_fps)
    calibration = calibrate(clip, settings.calibrate_frames)
    raw: dict[str, Any] = {
        "settings": asdict(settings),
        "cpus": os.cpu_count(),
        "calibration": calibration,
        "freshness": freshness(config, settings, workdir / "freshness"),
        "scaling": scaling(config, settings, calibration, workdir / "scaling"),
    }
    raw["elapsed_s"] = time.monotonic() - started
    return raw


def bench_cameras(config: Path, out: Path, window_s: float, producers: list[str]) -> str:
    """``duomo bench --cameras``: run both parts and add them to the report in ``out``; the
    report's Markdown section. ``producers``: some of ``PRODUCERS``."""
    import tempfile

    from tools.bench.camera_report import add_to_report

    settings = CameraSettings(window_s=window_s, producers=tuple(producers))
    with tempfile.TemporaryDirectory(prefix="duomo-bench-cameras-") as tmp:
        raw = run_cameras(config, settings, Path(tmp))
    return add_to_report(raw, out)
