"""The camera-fleet benchmark of ``duomo bench --fleet`` (issue 43): N managed sources into
``face``, each a 1280×720, 25 fps RTSP camera from ``duomo camera-sim``.

For N in ``cameras`` (2, 4, 8) and for each ``slots`` setting (3, the default: the model's next
frame is always the newest; 1: a frame is converted and sent only once the one before is
answered, so nothing sent is superseded), a fresh supervisor with ``face`` and N sources (one
source worker, as a 2-core machine gets by default), ``warmup_s`` then a window of
``window_s``; the settings take turns at each N (1, 3, 3, 1, …) so that the machine's drift hits
both alike. Per trial, from ``duomo source list``'s figures and the source workers' own CPU
(``psutil``):

- decoded frames per second, and per core of the source workers (decode, conversion into the
  slots, and the rest of the worker's work);
- answered frames per second, the worker's CPU per answered frame (what item 6 lowers);
- the answer age: p50 (the median camera's) and p99 (the worst camera's), over each camera's
  last 256 answers;
- fairness: the least and the most answered camera's share of the answers (1 ÷ N each when
  even), and their ratio.

The clip is ``tools.bench.camera_clip``'s (cached under ``.bench/clips``). Called by
``tools.bench.run``; its report section is written here too (``add_part``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from tools.bench.camera_clip import make_clip
from tools.bench.report import add_part
from tools.bench.servers import supervisor_config

ROOT = Path(__file__).resolve().parents[2]
CLIPS = ROOT / ".bench" / "clips"
FPS = 25


@dataclass(frozen=True)
class FleetSettings:
    """What the fleet benchmark runs (``duomo bench --fleet-*`` options)."""

    cameras: tuple[int, ...] = (2, 4, 8)
    slots: tuple[int, ...] = (3, 1)
    warmup_s: float = 8.0
    window_s: float = 15.0
    max_batch: int | None = None  # face's (None: the config's, 1 on the CPU)


def _log(message: str) -> None:
    print(f"duomo bench: fleet: {message}", file=sys.stderr, flush=True)


def duomo(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``duomo ARGS`` from the checkout, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", *args],
        capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
    )  # fmt: skip


class CameraSim:
    """``duomo camera-sim CLIP`` on a port of its own, once it is READY."""

    def __init__(self, clip: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "duomo.supervisor", "camera-sim", str(clip), "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
        )  # fmt: skip
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("READY "):
                self.url = line.split()[1]  # /<stem>, played as every camera
                return
        raise RuntimeError("duomo camera-sim did not start")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def source_list(socket: Path) -> list[dict[str, Any]]:
    """``duomo source list --json`` of the supervisor on ``socket``."""
    done = duomo("source", "list", "--json", "--socket", str(socket))
    if done.returncode != 0:
        raise RuntimeError(f"duomo source list: {done.stderr}")
    return list(json.loads(done.stdout))


@contextlib.contextmanager
def serving(config: Path, socket: Path) -> Iterator[None]:
    """A supervisor started on ``config`` at ``socket`` (``duomo start``), stopped at the end
    (also ``tools.bench.sink_cameras``'s)."""
    started = duomo("start", "-c", str(config), "--socket", str(socket), timeout_s=300)
    if started.returncode != 0:
        raise RuntimeError(f"duomo start: {started.stdout}{started.stderr}")
    try:
        yield
    finally:
        duomo("stop", "--socket", str(socket), timeout_s=120)


def _worker_cpu_s(pids: set[int]) -> float:
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def trial(url: str, n: int, slots: int, settings: FleetSettings, workdir: Path) -> dict[str, Any]:
    """N sources with ``slots`` into face: the figures of the module docstring."""
    workdir.mkdir(parents=True)
    config = supervisor_config(ROOT / "configs" / "default.yaml", ["face"], workdir / "d.yaml")
    raw = yaml.safe_load(config.read_text())
    raw["sources"] = [
        {"name": f"cam-{i + 1}", "url": url, "models": ["face"], "slots": slots} for i in range(n)
    ]
    if settings.max_batch is not None:  # (frames of several cameras in one batch)
        raw["models"][0].update(max_batch=settings.max_batch, max_delay_ms=0)
    config.write_text(yaml.safe_dump(raw))
    socket = workdir / "d.sock"
    with serving(config, socket):
        time.sleep(settings.warmup_s)
        before = {s["name"]: s for s in source_list(socket)}
        pids = {s["worker"] for s in before.values() if s["worker"] is not None}
        cpu_before = _worker_cpu_s(pids)
        time.sleep(settings.window_s)
        cpu_s = _worker_cpu_s(pids) - cpu_before
        after = {s["name"]: s for s in source_list(socket)}
    decoded = sum(after[n]["decoded"] - before[n]["decoded"] for n in after)
    answers = {n: after[n]["answered"] - before[n]["answered"] for n in after}
    answered = sum(answers.values())
    shares = [a / answered for a in answers.values()] if answered else [0.0]
    p50s = sorted(s["age_p50_ms"] for s in after.values() if s["age_p50_ms"] is not None)
    p99s = [s["age_p99_ms"] for s in after.values() if s["age_p99_ms"] is not None]
    window = settings.window_s
    return {
        "cameras": n,
        "slots": slots,
        "max_batch": settings.max_batch or 1,
        "decoded_fps": decoded / window,
        "decoded_per_core_s": decoded / cpu_s if cpu_s else None,
        "answered_fps": answered / window,
        "worker_cpu_s": cpu_s,
        "cpu_ms_per_answered": 1e3 * cpu_s / answered if answered else None,
        "age_ms_p50": p50s[len(p50s) // 2] if p50s else None,
        "age_ms_p99": max(p99s) if p99s else None,
        "least_share": min(shares),
        "most_share": max(shares),
        "fairness": min(shares) / max(shares) if max(shares) else 0.0,
        "decode_errors": sum(s["decode_errors"] for s in after.values()),
    }


def run_fleet(settings: FleetSettings) -> dict[str, Any]:
    """Every trial (the settings taking turns at each N)."""
    clip = make_clip(CLIPS, FPS)
    sim = CameraSim(clip)
    trials = []
    try:
        with tempfile.TemporaryDirectory(prefix="duomo-bench-fleet-") as tmp:
            for k, n in enumerate(settings.cameras):
                order = settings.slots if k % 2 == 0 else tuple(reversed(settings.slots))
                for slots in order:
                    _log(f"{n} camera(s) × {FPS} fps 720p into face, slots {slots}")
                    trials.append(trial(sim.url, n, slots, settings, Path(tmp) / f"{n}-{slots}"))
    finally:
        sim.stop()
    return {"settings": asdict(settings), "cpus": os.cpu_count(), "trials": trials}


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(raw: dict[str, Any]) -> str:
    lines = [
        "## Camera fleet (managed sources into face)",
        "",
        f"N × {FPS} fps 1280×720 RTSP cameras (`duomo camera-sim`) as managed sources into "
        "`face`, one source worker; per N both `slots` settings in turn. Decoded/s per core: "
        "of the source workers' CPU; CPU per answer: theirs ÷ the answers.",
        "",
        "| cameras | face max_batch | slots | decoded/s | decoded/s per core | answered/s | "
        "worker CPU ms per answer | age p50 ms | age p99 ms | least / most share | fairness |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--|--:|",
    ]
    for t in raw["trials"]:
        lines.append(
            f"| {t['cameras']} | {t['max_batch']} | {t['slots']} | {t['decoded_fps']:.1f} | "
            f"{_fmt(t['decoded_per_core_s'], '.0f')} | {t['answered_fps']:.1f} | "
            f"{_fmt(t['cpu_ms_per_answered'], '.1f')} | {_fmt(t['age_ms_p50'], '.0f')} | "
            f"{_fmt(t['age_ms_p99'], '.0f')} | {t['least_share']:.2f} / {t['most_share']:.2f} | "
            f"{t['fairness']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def bench_fleet(
    out: Path, window_s: float, cameras: tuple[int, ...], max_batch: int | None = None
) -> str:
    """``duomo bench --fleet``: run it and add it to the report in ``out``; its section."""
    raw = run_fleet(FleetSettings(cameras=cameras, window_s=window_s, max_batch=max_batch))
    section = markdown(raw)
    add_part(out, "fleet", raw, section)
    return section
