"""``duomo bench``: its command line, and the parts of a benchmark run that it runs in turn, each
a module of its own that this one imports (none of them imports this one). Parts 1–3 are the
mixed load, ``tools.bench.mixed_load``:

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
8. **sinks** (``--sinks``, or ``--sinks-only`` without 1–3) — ``tools.bench.sinks``: what one
   MQTT and one Redis sink sustain (events per second, CPU per thousand events, appending and
   publishing) to a local mosquitto and redis-server; then ``tools.bench.sink_cameras``: N
   cameras into ``faces`` with sinks on against off (answered/s, the delay to acknowledgement).
9. **galleries** (``--galleries``, or ``--galleries-only`` without 1–3) —
   ``tools.bench.galleries``: a gallery model at 1 000, 100 000 and 1 000 000 identities: search
   time per query at batch 1 and 8, memory per identity, load time, enrolment rate; then
   ``tools.bench.gallery_pipeline``: ``faces`` frames/s with and without its ``identity`` step on
   4-face frames, and enrolment through the producer API (images/s).

Run as ``python -m tools.bench.run`` from the checkout, which is what ``duomo bench`` does
(``supervisor.operators.cli.run_bench``), with ``BENCH_CALLER_DIR_ENV`` set to the directory it
was called from: the relative paths of the command line are read from there.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path
from typing import Any

from duomo.supervisor.operators.cli import BENCH_CALLER_DIR_ENV
from tools.bench.mixed_load import bench_mixed_load
from tools.bench.workload import ALL_MODES, load_workload

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="duomo bench", description="Duomo vs the engine limit, per-model, Triton and Mosec"
    )
    add_arguments(parser)
    return parser.parse_args(argv)


def _caller_path(text: str) -> Path:
    """A path of the command line: relative to the caller's directory (``BENCH_CALLER_DIR_ENV``,
    or this process's own)."""
    return Path(os.environ.get(BENCH_CALLER_DIR_ENV, ".")) / text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-w", "--workload", type=_caller_path, default=ROOT / "configs/bench/mixed.yaml",
        help="workload file (default: configs/bench/mixed.yaml)",
    )  # fmt: skip
    parser.add_argument(
        "--modes", help=f"comma-separated subset of the workload's modes ({', '.join(ALL_MODES)})"
    )
    parser.add_argument("--rounds", type=int, help="override the workload's rounds")
    parser.add_argument("--duration", type=float, help="override duration_s (seconds)")
    parser.add_argument(
        "--out", type=_caller_path, default=None,
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
        "--pipeline-config", type=_caller_path, default=ROOT / "configs/pipelines-bench.yaml",
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
    # the sinks benchmark (issue 46: tools.bench.sinks), after the rest or alone
    _part_flags(
        parser, "sinks",
        "then the sinks benchmark: what one MQTT and one Redis sink sustain, and its CPU",
        "only the sinks benchmark",
    )  # fmt: skip
    parser.add_argument(
        "--sink-events", type=int, default=20_000,
        help="events appended and published per sink trial (default 20000)",
    )  # fmt: skip
    parser.add_argument(
        "--sink-cameras", type=int, default=4,
        help="cameras into faces, sinks on against off (default 4; 0: that part not run)",
    )  # fmt: skip
    parser.add_argument(
        "--sink-window", type=float, default=15.0,
        help="seconds measured in each camera trial of the sinks part (default 15)",
    )  # fmt: skip
    # the galleries benchmark (issue 47: tools.bench.galleries), after the rest or alone
    _part_flags(
        parser, "galleries",
        "then the galleries benchmark: search time, memory and enrolment at 1k, 100k, 1M",
        "only the galleries benchmark",
    )  # fmt: skip
    parser.add_argument(
        "--gallery-sizes", default="1000,100000,1000000",
        help="comma-separated gallery sizes, identities (default 1000,100000,1000000)",
    )  # fmt: skip
    parser.add_argument(
        "--gallery-seconds", type=float, default=3.0,
        help="seconds of searches at each batch size (default 3)",
    )  # fmt: skip
    parser.add_argument(
        "--gallery-pipeline-seconds", type=float, default=10.0,
        help="seconds per round of faces with and without identity on 4-face frames "
        "(default 10; 0: the pipeline part not run)",
    )  # fmt: skip
    parser.add_argument(
        "--gallery-pipeline-rounds", type=int, default=2,
        help="rounds of the pipeline part, each with and without, interleaved (default 2)",
    )  # fmt: skip
    parser.add_argument(
        "--gallery-enrol-images", type=int, default=30,
        help="single-face images enrolled through the producer API, timed (default 30)",
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
        from tools.bench.cameras import PRODUCERS

        if not cameras or not set(cameras) <= set(PRODUCERS):
            print(f"duomo bench: --camera-producers: one or more of {PRODUCERS}", file=sys.stderr)
            return 2
    pipelines = args.pipeline_variants.split(",") if args.pipelines or args.pipelines_only else []
    if pipelines:
        from tools.bench.pipelines import VARIANTS

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
    sinks = args.sinks or args.sinks_only
    if sinks and (args.sink_events < 1 or args.sink_cameras < 0 or args.sink_window <= 0):
        print("duomo bench: --sink-events ≥ 1, --sink-cameras ≥ 0, --sink-window > 0",
              file=sys.stderr)  # fmt: skip
        return 2
    galleries = args.galleries or args.galleries_only
    try:
        gallery_sizes = tuple(int(n) for n in args.gallery_sizes.split(","))
    except ValueError:
        gallery_sizes = ()
    if galleries and (not gallery_sizes or min(gallery_sizes) < 8 or args.gallery_seconds <= 0
                      or args.gallery_pipeline_seconds < 0 or args.gallery_pipeline_rounds < 1
                      or args.gallery_enrol_images < 1):  # fmt: skip
        print("duomo bench: --gallery-sizes: numbers of at least 8; --gallery-seconds > 0; "
              "--gallery-pipeline-seconds ≥ 0; --gallery-pipeline-rounds and "
              "--gallery-enrol-images ≥ 1", file=sys.stderr)  # fmt: skip
        return 2
    only = (args.cameras_only, args.pipelines_only, args.sharing_only, args.fleet_only,
            args.sinks_only, args.galleries_only)  # fmt: skip
    if not any(only):
        report = bench_mixed_load(workload, out, args.workload)
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
    if sinks:
        from tools.bench.sinks import bench_sinks

        print(bench_sinks(out, args.sink_events, args.sink_cameras, args.sink_window))
    if galleries:
        from tools.bench.galleries import bench_galleries
        from tools.bench.gallery_pipeline import GalleryPipelineSettings

        pipeline = None
        if args.gallery_pipeline_seconds > 0:
            pipeline = GalleryPipelineSettings(
                seconds=args.gallery_pipeline_seconds, rounds=args.gallery_pipeline_rounds,
                enrol_images=args.gallery_enrol_images,
            )  # fmt: skip
        print(bench_galleries(out, gallery_sizes, args.gallery_seconds, pipeline))
    print(f"duomo bench: report in {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.bench.run ARGS``, which ``duomo bench ARGS`` runs."""
    return bench(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
