"""Soak test: all three demo models under load for minutes, a reload every 30 s, one model that
keeps failing, then 100 load/unload cycles of one model; accounts for every request and for the
supervisor's memory, shared-memory segments and file descriptors.

    python tools/soak.py [--minutes 5] [--reload-every 30] [--cycles 100] [--out soak.json]

A benchmark, not a test (timings vary with the machine). It starts its own supervisor (in the
background, like ``duomo start``) on a temporary config: the demo's ocr, face and classify plus
``flaky`` (``tools/soak_executor.py``): each instance raises from its 40th batch on, so the
watchdog re-initializes it again and again. Producer processes (one per model, two for
classify) check every answer against the fixture's known result. Every ``--reload-every``
seconds the config flips classify's ``max_batch`` between 8 and 4 and ``duomo reload`` replaces it
under load. Reported: requests sent, correct, wrong, typed errors by code, lost (sent and never
answered: must be 0); resident memory after the warm-up and at the end (growth, must stay under
5%); shared-memory segments and the supervisor's open fds before the producers attached and after
they left (must be equal); then resident memory before and after ``--cycles`` load/unload cycles of
``--cycle-model``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import yaml

from duomo.ipc.client import Client
from duomo.ipc.errors import DuomoError

ROOT = Path(__file__).resolve().parent.parent

IMAGES = ROOT / "tests" / "fixtures" / "images"
FLAKY_X = np.array([[1, 2, 3, 4]], dtype=np.float32)
PRODUCERS = [("ocr", 1), ("face", 1), ("classify", 2), ("flaky", 1)]  # (model, processes)


def expected(model: str, result: dict[str, Any]) -> bool:
    if model == "classify":
        return bool(result["top"][0]["label"] == "espresso")
    if model == "face":
        return len(result["faces"]) == 1 and result["faces"][0]["score"] > 0.8
    if model == "ocr":
        return bool(result["lines"][0]["text"] == "Region-based segmentation")
    return bool(np.array_equal(result["y"], 2 * FLAKY_X + 1))


def produce(socket: str, model: str, seconds: float, out: Any) -> None:
    """One producer process: closed loop (two in flight), every answer checked and counted."""
    from duomo.supervisor.operators.image_files import read_image

    image = {"classify": "coffee.png", "face": "astronaut.png", "ocr": "page.png"}.get(model)
    payload = read_image(IMAGES / image) if image else FLAKY_X
    counts: Counter[str] = Counter()
    with Client(socket, timeout_s=120) as client:
        handle = client.model(model, slots=2)
        stop_at = time.monotonic() + seconds
        in_flight: list[Future[Any]] = []

        def settle(future: Future[Any]) -> None:
            try:
                result = future.result(300)
            except DuomoError as err:
                counts[f"error:{err.code.name}"] += 1
            except TimeoutError:
                counts["lost"] += 1
            else:
                counts["ok" if expected(model, result) else "wrong"] += 1

        while time.monotonic() < stop_at:
            counts["sent"] += 1
            try:
                in_flight.append(handle.infer_async(payload, timeout_s=120))
            except DuomoError as err:
                counts[f"error:{err.code.name}"] += 1
            if len(in_flight) >= 2:
                settle(in_flight.pop(0))
            if model == "flaky":
                time.sleep(0.05)  # a steady trickle into the failing model
        for future in in_flight:
            settle(future)
    out.put((model, dict(counts)))


def write_config(folder: Path, classify_batch: int) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    raw["model_root"] = str(ROOT / "models")
    raw["watchdog"] = {"period_ms": 250}
    raw.pop("gateway", None)  # a client of its own (the soak counts clients), on fixed ports
    raw.pop("metrics", None)  # (fixed ports too)
    for model in raw["models"]:
        if model["name"] == "classify":
            model["max_batch"] = classify_batch
    raw["models"].append(
        {
            "name": "flaky",
            "task": "tools.soak_executor:FlakyExecutor",
            "files": {},
            "max_batch": 4,
            "params": {"fail_from": 40},  # until re-initialized
            "health": {
                "max_consecutive_failures": 3,
                "backoff_ms": 200,
                "backoff_max_ms": 3000,
                "max_restarts": 1000,
                "restart_window_s": 30,
            },
        }
    )
    path = folder / "soak.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def quiet_snapshot(socket: str) -> dict[str, Any]:
    """RSS, fds and segments while the asking connection is the supervisor's only client."""
    deadline = time.monotonic() + 60
    while True:
        with Client(socket) as client:
            status = client.status()
        if len(status.clients) == 0 and status.mapped_rings == 0:
            break
        if time.monotonic() > deadline:
            raise RuntimeError("producers did not detach within 60 s")
        time.sleep(0.2)
    # rings the supervisor still maps (memfd segments have no name: its own maps show them)
    maps = Path(f"/proc/{status.pid}/maps").read_text().splitlines()
    segments = sorted({line.split()[4] for line in maps if "/memfd:duomo-ring" in line})
    return {"rss_bytes": status.rss_bytes, "open_fds": status.open_fds, "shm": segments}


def rss_of(socket: str) -> int:
    with Client(socket) as client:
        return client.status().rss_bytes


def soak(socket: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    before = quiet_snapshot(socket)
    seconds = args.minutes * 60
    results: Any = multiprocessing.get_context("spawn").Queue()
    spawn = multiprocessing.get_context("spawn")
    processes = [
        spawn.Process(target=produce, args=(socket, model, seconds, results))
        for model, count in PRODUCERS
        for _ in range(count)
    ]
    for process in processes:
        process.start()
    started = time.monotonic()
    time.sleep(min(args.warmup, seconds / 4))
    rss_warm = rss_of(socket)
    reloads: list[dict[str, Any]] = []
    batch = 8
    next_reload = started + args.reload_every
    while time.monotonic() < started + seconds - 1:
        time.sleep(max(0.0, min(next_reload, started + seconds - 1) - time.monotonic()))
        if time.monotonic() >= next_reload:
            batch = 4 if batch == 8 else 8
            write_config(folder, batch)
            t0 = time.monotonic()
            try:
                with Client(socket, timeout_s=30) as client:
                    reply = client.request("reload", timeout_s=600)
                outcome = {k: reply[k] for k in ("added", "removed", "replaced")}
            except DuomoError as err:
                outcome = {"error": str(err)}
            reloads.append({"s": round(t0 - started, 1), "took_s": round(time.monotonic() - t0, 2)})
            reloads[-1].update(outcome)
            next_reload += args.reload_every
    rss_end = rss_of(socket)
    totals: dict[str, Counter[str]] = {}
    for _ in processes:
        model, counts = results.get(timeout=600)
        totals.setdefault(model, Counter()).update(counts)
    for process in processes:
        process.join(60)
    with Client(socket) as client:
        status = client.status()
    after = quiet_snapshot(socket)
    per_model = {}
    for model, counts in totals.items():
        errors = {k[6:]: v for k, v in counts.items() if k.startswith("error:")}
        answered = counts["ok"] + counts["wrong"] + sum(errors.values())
        per_model[model] = {
            "sent": counts["sent"],
            "ok": counts["ok"],
            "wrong": counts["wrong"],
            "errors": errors,
            "lost": counts["sent"] - answered,
        }
    flaky = status.models["flaky"]
    return {
        "seconds": seconds,
        "models": per_model,
        "total": {
            k: sum(m[k] for m in per_model.values()) for k in ("sent", "ok", "wrong", "lost")
        },
        "reloads": reloads,
        "flaky": {
            "reinitializations": flaky.reinitializations,
            "state": flaky.state,
            "outcomes": flaky.outcomes,
        },
        "rss_after_warmup_bytes": rss_warm,
        "rss_end_bytes": rss_end,
        "rss_growth_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2),
        "before_producers": before,
        "after_producers": after,
    }


def cycles(socket: str, model: str, count: int) -> dict[str, Any]:
    """Unload and load ``model`` ``count`` times; resident memory before and after."""
    with Client(socket, timeout_s=30) as client:
        client.request("load", model=model, timeout_s=600)  # it may have been evicted
        start = client.status().rss_bytes
        t0 = time.monotonic()
        for _ in range(count):
            client.request("unload", model=model, timeout_s=600)
            client.request("load", model=model, timeout_s=600)
        took = time.monotonic() - t0
        end = client.status().rss_bytes
    return {
        "model": model,
        "cycles": count,
        "seconds": round(took, 1),
        "rss_start_bytes": start,
        "rss_end_bytes": end,
        "rss_change_pct": round(100 * (end - start) / start, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--reload-every", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds before the first RSS")
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--cycle-model", default="face")
    parser.add_argument("--out", type=Path, default=Path("soak-report.json"))
    args = parser.parse_args()
    from duomo.supervisor.process.daemon import start_background, wait_for_exit

    os.chdir(ROOT)  # the supervisor runs as ``python -m``: tools.soak_executor is found from here
    folder = Path(tempfile.mkdtemp(prefix="duomo-soak-"))
    socket = folder / "duomo.sock"
    config = write_config(folder, 8)
    if start_background(config, socket, "warning") != 0:
        return 1
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "cpus": psutil.cpu_count(),
    }
    try:
        report["soak"] = soak(str(socket), folder, args)
        if args.cycles:
            report["load_unload"] = cycles(str(socket), args.cycle_model, args.cycles)
    finally:
        with Client(socket, timeout_s=30) as client:
            report["stop_cut"] = client.request("stop", timeout_s=300, wait=True).get("cut")
        report["supervisor_exited"] = wait_for_exit(socket, 120)
        args.out.write_text(json.dumps(report, indent=2))
    s = report["soak"]
    print(json.dumps({k: s[k] for k in ("models", "total", "rss_growth_pct")}, indent=2))
    print(f"reloads: {len(s['reloads'])}; the failing model: {s['flaky']}")
    print(
        f"fds {s['before_producers']['open_fds']} -> {s['after_producers']['open_fds']}, "
        f"shm {len(s['before_producers']['shm'])} -> {len(s['after_producers']['shm'])}"
    )
    if "load_unload" in report:
        print(f"load/unload: {report['load_unload']}")
    print(f"report: {args.out}")
    ok = s["total"]["lost"] == 0 and s["total"]["wrong"] == 0 and s["rss_growth_pct"] < 5
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
