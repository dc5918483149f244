"""``duomo bench``: the phases of a benchmark run, and its command line.

1. **alone** — each model by itself in-process on one thread (``tools.bench.inprocess``): the
   weight of its work, its in-process p50 and every image's expected answer;
2. **rounds** — first the per-request overhead: every mode's servers at once, and the two floor
   servers of ``tools.bench.floor``; one client per ``overhead_models`` model alone sends blocks
   of requests in turn in-process and through each of them, so that every server is measured
   against the same in-process reference in the same minutes (on a shared machine one model's
   compute drifts by several per cent between minutes and between processes); stop them. Then
   the modes in order, then in reverse, and so on (A B C … C B A …), so drift cancels. For each
   mode: start its servers; for ``duomo`` in the first round, the idle supervisor's CPU; every
   model at once with its producers, a warm-up and the measured window, while the servers'
   memory and CPU are sampled; stop;
3. **report** — ``tools.bench.report`` writes ``report.json``, ``report.md`` and the PNG charts;
4. **cameras** (``--cameras``, or ``--cameras-only`` without 1–3) — ``tools.bench.cameras``:
   one camera ``latest`` against ``fifo``, then N cameras per producer; its section joins the
   report (``tools.bench.camera_report``).
5. **pipelines** (``--pipelines``, or ``--pipelines-only`` without 1–3) —
   ``tools.bench.pipelines``: the chain face → embedding + attributes as a Duomo pipeline,
   driven from the client and as a Triton BLS model, and the tracker's reuse; its section joins
   the report (``tools.bench.pipeline_report``).
6. **sharing** (``--sharing``, or ``--sharing-only`` without 1–3) — ``tools.bench.sharing``:
   the workload's config with ``instances: 2`` on every model, weight sharing on and off in
   turn, under the mixed load: resident memory after load and at its peak, and the work; its
   section joins the report (``tools.bench.sharing_report``).
7. **fleet** (``--fleet``, or ``--fleet-only`` without 1–3) — ``tools.bench.fleet``: N
   managed sources (RTSP from ``duomo camera-sim``) into ``face``, ``slots`` 3 against 1:
   decoded/s per core, answered/s, the source workers' CPU per answer, ages and fairness.

Called by ``duomo bench`` (``supervisor.operators.cli``) and as ``python -m tools.bench.run``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.bench.report import write_report
from tools.bench.sampler import TreeSampler
from tools.bench.scraper import MetricsScraper
from tools.bench.servers import DuomoServers, FloorServer, ModeServers, servers_for
from tools.bench.tally import merge
from tools.bench.workload import ALL_MODES, Workload, load_workload

ROOT = Path(__file__).resolve().parents[2]
RESULT_TIMEOUT_S = 600.0


class Child:
    """A bench child process (``tools.bench.inprocess`` or ``tools.bench.producer``): spec in,
    ``ready``, window in, one JSON result out."""

    def __init__(self, module: str, args: list[str], spec: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        self._send(spec)

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(obj) + "\n")
        self.process.stdin.flush()

    def wait_ready(self) -> None:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if line != "ready":
            self.process.kill()
            raise RuntimeError(f"{self.process.args!r} did not start (said {line!r})")

    def go(self, start_at: float, end_at: float) -> None:
        self._send({"start_at": start_at, "end_at": end_at})

    def result(self) -> dict[str, Any]:
        try:
            out, _ = self.process.communicate(timeout=RESULT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        if self.process.returncode != 0:
            raise RuntimeError(f"{self.process.args!r} exited {self.process.returncode}")
        return dict(json.loads(out.strip().splitlines()[-1]))


def open_window(children: list[Child], warmup_s: float, duration_s: float) -> tuple[float, float]:
    """Wait until every child is ready, then send them all one window: ``warmup_s`` from now,
    ``duration_s`` long (wall-clock start and end)."""
    for child in children:
        child.wait_ready()
    start_at = time.time() + warmup_s
    end_at = start_at + duration_s
    for child in children:
        child.go(start_at, end_at)
    return start_at, end_at


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


def run(workload: Workload, out: Path, workload_path: Path) -> dict[str, Any]:
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="duomo bench", description="Duomo vs the engine limit, per-model, Triton and Mosec"
    )
    add_arguments(parser)
    return parser.parse_args(argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-w", "--workload", type=Path, default=ROOT / "configs/bench/mixed.yaml",
        help="workload file (default: configs/bench/mixed.yaml)",
    )  # fmt: skip
    parser.add_argument(
        "--modes", help=f"comma-separated subset of the workload's modes ({', '.join(ALL_MODES)})"
    )
    parser.add_argument("--rounds", type=int, help="override the workload's rounds")
    parser.add_argument("--duration", type=float, help="override duration_s (seconds)")
    parser.add_argument(
        "--out", type=Path, default=None,
        help="report folder (default: bench-results/<UTC date and time>)",
    )  # fmt: skip
    # the camera benchmark (issue 34: tools.bench.cameras), after the mixed load or alone
    _part_flags(
        parser, "cameras",
        "then the camera benchmark: one camera latest vs fifo, N cameras per producer",
        "only the camera benchmark (no mixed load)",
    )  # fmt: skip
    parser.add_argument(
        "--camera-window", type=float, default=15.0,
        help="seconds measured in each N-camera trial (default 15)",
    )  # fmt: skip
    parser.add_argument(
        "--camera-producers", default="source,naive,triton",
        help="comma-separated producers of the N-camera part (default source,naive,triton)",
    )  # fmt: skip
    # the pipeline benchmark (issue 35: tools.bench.pipelines), after the rest or alone
    _part_flags(
        parser, "pipelines",
        "then the pipeline benchmark: faces as a Duomo pipeline, client-driven, Triton BLS",
        "only the pipeline benchmark (no mixed load)",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline-window", type=float, default=10.0,
        help="seconds measured in each pipeline trial (default 10)",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline-variants", default="pipeline,client,client-seq,triton",
        help="comma-separated variants of the pipeline part (default: all four)",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline-producers", type=int, default=4,
        help="producer processes (streams, in the tracker part) of the pipeline part (default 4)",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline-rounds", type=int, default=2,
        help="times each pipeline trial runs, the order reversed every other time (default 2)",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline-config", type=Path, default=ROOT / "configs/pipelines-bench.yaml",
        help="supervisor config of the pipeline part (default: configs/pipelines-bench.yaml)",
    )  # fmt: skip
    # the camera-fleet benchmark (issue 43: tools.bench.fleet), after the rest or alone
    _part_flags(
        parser, "fleet",
        "then the camera-fleet benchmark: N managed sources into face, slots 3 vs 1",
        "only the camera-fleet benchmark",
    )  # fmt: skip
    parser.add_argument(
        "--fleet-window", type=float, default=15.0,
        help="seconds measured in each fleet trial (default 15)",
    )  # fmt: skip
    parser.add_argument(
        "--fleet-cameras", default="2,4,8",
        help="comma-separated camera counts of the fleet part (default 2,4,8)",
    )  # fmt: skip
    parser.add_argument(
        "--fleet-max-batch", type=int, default=None,
        help="face's max_batch in the fleet part (default: the config's)",
    )  # fmt: skip
    # the shared-weights benchmark (issue 36: tools.bench.sharing), after the rest or alone
    _part_flags(
        parser, "sharing",
        "then the shared-weights benchmark: instances: 2 on every model, sharing on vs off",
        "only the shared-weights benchmark",
    )  # fmt: skip
    parser.add_argument(
        "--sharing-window", type=float, default=20.0,
        help="seconds measured in each sharing trial (default 20)",
    )  # fmt: skip
    parser.add_argument(
        "--sharing-rounds", type=int, default=2,
        help="rounds of the sharing part, each on and off, the order reversed every other "
        "round (default 2: on, off, off, on)",
    )  # fmt: skip


def _part_flags(parser: argparse.ArgumentParser, part: str, then: str, only: str) -> None:
    """``--PART`` (after the mixed load) and ``--PART-only`` (instead of it), one or the
    other."""
    flags = parser.add_mutually_exclusive_group()
    flags.add_argument(f"--{part}", action="store_true", help=then)
    flags.add_argument(f"--{part}-only", action="store_true", help=only)


def bench(args: argparse.Namespace) -> int:
    """Run the benchmark ``args`` describe; prints the Markdown report; 0, or 2 for bad input."""
    try:
        workload = load_workload(
            args.workload,
            modes=args.modes.split(",") if args.modes else None,
            rounds=args.rounds,
            duration_s=args.duration,
        )
    except (OSError, ValueError) as err:
        print(f"duomo bench: {err}", file=sys.stderr)
        return 2
    cameras = args.camera_producers.split(",") if args.cameras or args.cameras_only else []
    if args.cameras or args.cameras_only:
        from tools.bench.cameras import PRODUCERS  # (it imports this module)

        if not cameras or not set(cameras) <= set(PRODUCERS):
            print(f"duomo bench: --camera-producers: one or more of {PRODUCERS}", file=sys.stderr)
            return 2
    pipelines = args.pipeline_variants.split(",") if args.pipelines or args.pipelines_only else []
    if pipelines:
        from tools.bench.pipelines import VARIANTS  # (it imports this module)

        if not set(pipelines) <= set(VARIANTS):
            print(f"duomo bench: --pipeline-variants: some of {VARIANTS}", file=sys.stderr)
            return 2
    sharing = args.sharing or args.sharing_only
    if sharing and (args.sharing_rounds < 1 or args.sharing_window <= 0):
        print("duomo bench: --sharing-rounds ≥ 1 and --sharing-window > 0", file=sys.stderr)
        return 2
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or ROOT / "bench-results" / stamp
    alone: dict[str, Any] | None = None  # the mixed load's alone phase, reused by --sharing
    fleet = args.fleet or args.fleet_only
    if not (args.cameras_only or args.pipelines_only or args.sharing_only or args.fleet_only):
        report = run(workload, out, args.workload)
        alone = report["alone"]
        print(report["markdown"])
    if cameras:
        from tools.bench.cameras import bench_cameras

        print(bench_cameras(workload.config, out, args.camera_window, cameras))
    if pipelines:
        from tools.bench.pipelines import bench_pipelines

        window, producers = args.pipeline_window, args.pipeline_producers
        config = args.pipeline_config
        rounds = args.pipeline_rounds
        print(bench_pipelines(config, out, window, pipelines, producers, rounds))
    if sharing:
        from tools.bench.sharing import bench_sharing

        print(bench_sharing(workload, out, args.sharing_window, args.sharing_rounds, alone))
    if fleet:
        from tools.bench.fleet import bench_fleet

        counts = tuple(int(n) for n in args.fleet_cameras.split(","))
        print(bench_fleet(out, args.fleet_window, counts, args.fleet_max_batch))
    print(f"duomo bench: report in {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``duomo bench`` (``supervisor.operators.cli.run_bench``) and ``python -m
    tools.bench.run``."""
    return bench(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
