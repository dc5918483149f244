"""The camera part of ``duomo bench --sinks`` (issue 46): N managed sources (the fleet
benchmark's 1280×720, 25 fps RTSP clip from ``duomo camera-sim``, a face in every frame) into
the ``faces`` pipeline with its tracker, with sinks on (every source to a local mosquitto and a
local redis-server, ``emit: both``) and off, in turn (on, off, off, on, …), so drift hits both
alike. Per trial, over the window:

- the cameras' answered frames per second (``duomo source list``): sinks must not slow the frame
  path (the issue's target: with sinks on, within 3 % of off);
- with sinks on, per sink: the events acknowledged per second, and the delay from an event's
  append (the answer's arrival at its source) to the broker's acknowledgement, p50 and p99
  (the sink's own figures in ``duomo status --json``); events pending at the end.

Called by ``tools.bench.sinks`` (its section joins that part's).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tools.bench.brokers import running_broker
from tools.bench.camera_clip import make_clip
from tools.bench.fleet import CLIPS, FPS, CameraSim, duomo, serving, source_list
from tools.bench.servers import supervisor_config

ROOT = Path(__file__).resolve().parents[2]
FACES_MODELS = ["face", "face_embedding", "face_attributes"]


@dataclass(frozen=True)
class SinkCameraSettings:
    """What the camera part runs (``duomo bench --sink-cameras``, ``--sink-window``)."""

    cameras: int = 4
    rounds: int = 2
    warmup_s: float = 8.0
    window_s: float = 15.0


def _sinks(socket: Path) -> dict[str, dict[str, Any]]:
    done = duomo("status", "--json", "--socket", str(socket))
    if done.returncode != 0:
        raise RuntimeError(f"duomo status: {done.stderr}")
    return {s["name"]: s for s in json.loads(done.stdout).get("sinks", [])}


def trial(
    url: str, brokers: dict[str, str], on: bool, settings: SinkCameraSettings, workdir: Path
) -> dict[str, Any]:
    """N sources into ``faces``, to both brokers (``on``) or to none."""
    workdir.mkdir(parents=True)
    config = supervisor_config(ROOT / "configs" / "default.yaml", FACES_MODELS, workdir / "d.yaml")
    raw = yaml.safe_load(config.read_text())
    names = [f"cam-{i + 1}" for i in range(settings.cameras)]
    raw["sources"] = [{"name": n, "url": url, "pipeline": "faces"} for n in names]
    if on:
        raw["sinks"] = [{"name": kind, "kind": kind, "url": u} for kind, u in brokers.items()]
        for source in raw["sources"]:
            source.update(sinks=list(brokers), emit="both")
    config.write_text(yaml.safe_dump(raw))
    socket = workdir / "d.sock"
    with serving(config, socket):
        time.sleep(settings.warmup_s)
        before = {s["name"]: s for s in source_list(socket)}
        sinks_before = _sinks(socket) if on else {}
        time.sleep(settings.window_s)
        after = {s["name"]: s for s in source_list(socket)}
        sinks_after = _sinks(socket) if on else {}
    window = settings.window_s
    answered = sum(after[n]["answered"] - before[n]["answered"] for n in names)
    sinks = {
        name: {
            "acked_per_s": (s["published"] - sinks_before[name]["published"]) / window,
            "delay_p50_ms": s["delay_p50_ms"],
            "delay_p99_ms": s["delay_p99_ms"],
            "pending_events": s["pending_events"],
            "dropped": s["dropped"],
            "errors": s["errors"],
            "state": s["state"],
        }
        for name, s in sinks_after.items()
    }
    return {"sinks_on": on, "answered_fps": answered / window, "sinks": sinks}


def run_sink_cameras(settings: SinkCameraSettings, folder: Path) -> dict[str, Any]:
    """Every trial, sinks on and off in turn."""
    clip = make_clip(CLIPS, FPS)
    sim = CameraSim(clip)
    trials = []
    try:
        with (
            tempfile.TemporaryDirectory(prefix="duomo-bench-sink-cameras-") as tmp,
            running_broker("mqtt", folder / "mqtt-broker") as mqtt,
            running_broker("redis", folder / "redis-broker") as redis,
        ):
            brokers = {"mqtt": mqtt.url, "redis": redis.url}
            for r in range(settings.rounds):
                for on in (True, False) if r % 2 == 0 else (False, True):
                    state = "on" if on else "off"
                    print(f"duomo bench: sinks: {settings.cameras} cameras into faces, "
                          f"sinks {state}", file=sys.stderr, flush=True)  # fmt: skip
                    work = Path(tmp) / f"{r}-{state}"
                    trials.append(trial(sim.url, brokers, on, settings, work))
    finally:
        sim.stop()
    with_sinks = [t["answered_fps"] for t in trials if t["sinks_on"]]
    without = [t["answered_fps"] for t in trials if not t["sinks_on"]]
    return {
        "cameras": settings.cameras,
        "window_s": settings.window_s,
        "trials": trials,
        "answered_on_over_off": (
            statistics.fmean(with_sinks) / statistics.fmean(without) if without else None
        ),
    }


def markdown(raw: dict[str, Any]) -> str:
    lines = [
        f"### {raw['cameras']} cameras into faces, sinks on against off",
        "",
        f"{raw['cameras']} × {FPS} fps 1280×720 RTSP cameras (`duomo camera-sim`) as managed "
        "sources into `faces` (tracker on); sinks on: every source to a local mosquitto and a "
        "local redis-server, `emit: both`. Delay: an event's append to its acknowledgement "
        "(the sink's figures).",
        "",
        "| sinks | answered/s | sink | acked/s | delay p50 ms | delay p99 ms | pending at end |",
        "|---|--:|---|--:|--:|--:|--:|",
    ]
    for t in raw["trials"]:
        if not t["sinks"]:
            lines.append(f"| off | {t['answered_fps']:.2f} | — | — | — | — | — |")
        for name, s in t["sinks"].items():
            p50, p99 = (
                "—" if s[k] is None else f"{s[k]:.0f}" for k in ("delay_p50_ms", "delay_p99_ms")
            )
            lines.append(
                f"| on | {t['answered_fps']:.2f} | {name} | {s['acked_per_s']:.1f} | {p50} | "
                f"{p99} | {s['pending_events']} |"
            )
    ratio = raw["answered_on_over_off"]
    if ratio is not None:
        lines += ["", f"Answered with sinks on ÷ off: **{ratio:.3f}** (target: within 3 %)."]
    return "\n".join(lines) + "\n"
