"""The mixed load of ``duomo bench`` (its parts 1–3, drawn in ``tools.bench.run``'s docstring):
every model alone in-process (``run_alone``), then the rounds — the per-request overheads of
every served mode against the floor servers (``run_overheads``), and each mode under every
model's producers at once (``run_engine``, ``run_served``) — and the report
(``tools.bench.report``).

``bench_mixed_load`` runs it all; ``tools.bench.sharing`` reuses its alone phase and its
producers (``run_alone``, ``model_specs``, ``producer_children``). Called by
``tools.bench.run``.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.bench.children import Child, open_window
from tools.bench.report import write_report
from tools.bench.sampler import TreeSampler
from tools.bench.scraper import MetricsScraper
from tools.bench.servers import DuomoServers, FloorServer, ModeServers, servers_for
from tools.bench.tally import merge
from tools.bench.workload import Workload


def _sample(pids: list[int], start_at: float, end_at: float) -> dict[str, Any]:
    time.sleep(max(0.0, start_at - time.time()))
    sampler = TreeSampler(pids).start()
    time.sleep(max(0.0, end_at - time.time()))
    return sampler.stop()


def model_specs(workload: Workload, alone: dict[str, Any]) -> list[dict[str, Any]]:
    """What producers need of each model: its name, images and their expected answers (also
    ``tools.bench.sharing``'s)."""
    return [
        {
            "name": m.name,
            "images": [str(p) for p in m.images],
            "expected": alone[m.name]["expected"],
        }
        for m in workload.models
    ]


def run_alone(workload: Workload) -> dict[str, Any]:
    spec = {
        "config": str(workload.config),
        "models": model_specs(workload, {m.name: {"expected": []} for m in workload.models}),
        "alone_s": workload.alone_s,
    }
    child = Child("tools.bench.inprocess", ["alone"], spec)
    open_window([child], 0.0, 0.0)
    return child.result()


def producer_children(
    workload: Workload,
    servers: ModeServers,
    models: list[dict[str, Any]],
    producers: dict[str, int],
) -> list[Child]:
    """The mixed load's producers against ``servers``: ``producers[name]`` per model, each with
    its images and expected answers (also ``tools.bench.sharing``'s)."""
    loads = {m.name: m for m in workload.models}
    children: list[Child] = []
    for model in models:
        load = loads[model["name"]]
        n = producers[model["name"]]
        rate = load.rate_per_s / n if workload.loop == "open" and load.rate_per_s else None
        spec = {
            "target": servers.target(model["name"]),
            "model": model["name"],
            "images": model["images"],
            "expected": model["expected"],
            "rate_per_s": rate,
            "max_requests": workload.max_requests,
        }
        children.extend(Child("tools.bench.producer", [], spec) for _ in range(n))
    return children


def run_engine(workload: Workload, models: list[dict[str, Any]]) -> dict[str, Any]:
    spec = {"config": str(workload.config), "models": models, "max_requests": workload.max_requests}
    child = Child("tools.bench.inprocess", ["engine"], spec)
    start_at, end_at = open_window([child], workload.warmup_s, workload.duration_s)
    resources = _sample([child.process.pid], start_at, end_at)
    figures = child.result()
    return {
        "models": figures["models"],
        "resources": resources,
        "client_cpu_cores": 0.0,
        "duration_s": workload.duration_s,
        "threads": figures["threads"],
    }


def run_overheads(
    workload: Workload, models: list[dict[str, Any]], workdir: Path
) -> dict[str, dict[str, dict[str, Any]]]:
    """One round's per-request overheads: per served mode ``{"overhead": {model: probe}}``,
    and for duomo also ``"floor"`` and ``"design_floor"``. Every mode's servers run at once (each
    serving every model of the workload, as in its own phase), and per probed model one client
    sends blocks in turn in-process and to each of them; each server gets ``overhead_s`` of the
    probe's time."""
    served: list[str] = [mode for mode in workload.modes if mode != "engine"]
    probed = [m for m in models if m["name"] in workload.overhead_models]
    labels: dict[str, dict[str, dict[str, Any]]] = {mode: {"overhead": {}} for mode in served}
    if "duomo" in labels:
        labels["duomo"].update(floor={}, design_floor={})
    if not probed or workload.overhead_s <= 0:
        return labels
    names = [m["name"] for m in models]
    servers: dict[str, ModeServers] = {}
    try:
        for mode in served:
            (workdir / mode).mkdir(parents=True)
            servers[mode] = servers_for(mode, workload.config, names, workdir / mode)
            servers[mode].start()
        for model in probed:
            name = model["name"]
            floors = (
                {"floor": FloorServer(workload.config, [name], workdir),
                 "design_floor": FloorServer(workload.config, [name], workdir, handoff=True)}
                if "duomo" in servers else {}
            )  # fmt: skip
            try:
                for floor in floors.values():
                    floor.start()
                targets = {
                    **{mode: s.target(name) for mode, s in servers.items()},
                    **{label: floor.target(name) for label, floor in floors.items()},
                }
                probe = {"config": str(workload.config), "targets": targets}
                spec = {"model": name, "images": model["images"], "expected": model["expected"],
                        "target": None, "rate_per_s": None, "probe": probe,
                        "max_requests": workload.max_requests}  # fmt: skip
                child = Child("tools.bench.producer", [], spec)
                open_window([child], 1.0, workload.overhead_s * len(targets))
                result = child.result()
            finally:
                for floor in floors.values():
                    floor.stop()
            for label, figures in result.items():
                mode, key = ("duomo", label) if label in floors else (label, "overhead")
                labels[mode][key][name] = figures
    finally:
        for s in servers.values():
            s.stop()
    return labels


def run_served(
    mode: str, workload: Workload, models: list[dict[str, Any]], workdir: Path, idle: bool
) -> dict[str, Any]:
    names = [m["name"] for m in models]
    servers = servers_for(mode, workload.config, names, workdir)
    figures: dict[str, Any] = {"duration_s": workload.duration_s}
    started = time.monotonic()
    servers.start()
    ports = servers.metrics_ports if isinstance(servers, DuomoServers) else []
    scraper = MetricsScraper(ports, workload.scrape_every_s) if ports else None
    try:
        if scraper is not None:
            scraper.start()
        figures["start_s"] = time.monotonic() - started
        if idle and workload.idle_s > 0:
            now = time.time() + 1.0  # let start-up settle
            figures["idle"] = _sample(servers.pids(), now, now + workload.idle_s)
        producers = {m.name: m.producers for m in workload.models}
        children = producer_children(workload, servers, models, producers)
        start_at, end_at = open_window(children, workload.warmup_s, workload.duration_s)
        figures["resources"] = _sample(servers.pids(), start_at, end_at)
        tallies = [child.result() for child in children]
    finally:
        if scraper is not None:
            figures["scrapes"] = scraper.stop()
        servers.stop()
    figures["client_cpu_cores"] = sum(t["cpu_s"] for t in tallies) / workload.duration_s
    figures["models"] = {name: merge([t for t in tallies if t["model"] == name]) for name in names}
    return figures


def bench_mixed_load(workload: Workload, out: Path, workload_path: Path) -> dict[str, Any]:
    """Parts 1–3 into ``out``: the alone phase, ``workload.rounds`` rounds, the report
    (``write_report``'s record, its Markdown under ``"markdown"``)."""
    out.mkdir(parents=True, exist_ok=True)
    log = sys.stderr
    print(f"duomo bench: alone, in-process, one thread ({workload.alone_s:g} s each)", file=log)
    alone = run_alone(workload)
    models = model_specs(workload, alone)
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in workload.modes}
    with tempfile.TemporaryDirectory(prefix="duomo-bench-") as tmp:
        for r in range(workload.rounds):
            print(f"duomo bench: round {r + 1}/{workload.rounds}: overhead", file=log, flush=True)
            overheads = run_overheads(workload, models, Path(tmp) / f"overhead-{r}")
            order = workload.modes if r % 2 == 0 else list(reversed(workload.modes))
            for mode in order:
                print(f"duomo bench: round {r + 1}/{workload.rounds}: {mode}", file=log, flush=True)
                workdir = Path(tmp) / f"{mode}-{r}"
                workdir.mkdir()
                if mode == "engine":
                    rounds[mode].append(run_engine(workload, models))
                else:
                    idle = mode == "duomo" and r == 0
                    figures = run_served(mode, workload, models, workdir, idle)
                    rounds[mode].append({**figures, **overheads[mode]})
    raw = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "workload_file": str(workload_path),
        "workload": json.loads(workload.model_dump_json()),
        "alone": alone,
        "rounds": rounds,
    }
    return write_report(raw, out)
