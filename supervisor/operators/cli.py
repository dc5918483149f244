"""The ``duomo`` command line: thin commands that parse arguments and delegate.

``start`` / ``stop`` / ``status`` / ``reload`` / ``load`` / ``unload`` manage a supervisor;
``infer`` sends image files to a running supervisor (or, with ``-c CONFIG``, runs the model
in-process without one); ``check`` reports the environment (Ascend driver, CANN, pyACL, ORT
providers), validates a config and opens each model file with its backend's cheapest check
(``check_model_file`` in the backend's module); ``inspect`` describes one model file. Every
command that talks to a supervisor takes ``--socket`` (default: ``$DUOMO_SOCKET`` or the standard
runtime dir), so several can run side by side. ``stream`` decodes videos into the models as
streams and prints their answers as JSON lines (``video.command``); ``source`` adds, removes,
lists, shows and tails the cameras the supervisor runs itself
(``supervisor.operators.source_commands``); ``gallery`` enrols, removes, lists and searches
the people of a gallery model, through the supervisor or (``-c CONFIG``) on its file
(``supervisor.operators.gallery_commands``); ``camera-sim`` serves video files as RTSP cameras
to try them with (``video.camera_sim``). Exit codes: 0 success, 1 a request or the supervisor
failed, 2 invalid input (bad config, unknown model, bad arguments), 3 ``stop`` finished but its
grace period cut accepted requests (``stream``: every source failed).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import duomo
from duomo.ipc.client import Client
from duomo.ipc.command_line import (
    EXIT_FAILED,
    EXIT_INVALID,
    EXIT_OK,
    checked_number,
    exit_code,
)
from duomo.ipc.errors import DuomoError, ErrorCode, NotFoundError
from duomo.ipc.json_values import json_default
from duomo.ipc.logs import LEVELS, configure_logging
from duomo.ipc.runtime_dir import default_socket_path
from duomo.ipc.status_records import ModelStatus
from duomo.supervisor.config import ConfigError, LoadedConfig, ResolvedModel, load_config
from duomo.supervisor.operators.gallery_commands import add_parser as add_gallery_parser
from duomo.supervisor.operators.source_commands import add_parser as add_source_parser
from duomo.video import camera_sim

DEFAULT_CONFIG = Path("configs/default.yaml")
# ``duomo bench`` runs the benchmark from the checkout: where it was called, for relative paths
BENCH_CALLER_DIR_ENV = "DUOMO_BENCH_CALLER_DIR"


def _load(path: Path) -> LoadedConfig | None:
    try:
        return load_config(path)
    except ConfigError as err:
        print(err.render(), file=sys.stderr)
        return None


def cmd_check(args: argparse.Namespace) -> int:
    """The environment report, then (with ``-c``) the configuration's validation."""
    from duomo.supervisor.operators.environment import format_report, probe

    report = probe()
    if args.json and args.config is None:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    print("environment:")
    print(format_report(report))
    if args.config is None:
        return EXIT_OK
    try:
        loaded = load_config(args.config, unbuilt_om_ok=True)
    except ConfigError as err:
        print(err.render(), file=sys.stderr)
        print(f"{args.config}: invalid", file=sys.stderr)
        return EXIT_INVALID
    unloadable: list[tuple[str, str]] = []
    for name, model in loaded.models.items():
        files = ", ".join(f"{role}={path}" for role, path in model.files.items())
        print(
            f"  {name}: task={model.config.task} backend={model.config.backend} "
            f"instances={model.config.instances} max_batch={model.config.max_batch} "
            f"files: {files}"
        )
        for field, path, verdict, opened in _check_model_files(name, model):
            if opened:
                print(f"    {field.rsplit('.', 1)[-1]}: {verdict}")
            else:
                unloadable.append((field, f"{path}: {verdict}"))
    for pipeline in loaded.config.pipelines:
        steps = " → ".join(
            f"{s.name}({s.model}{' for each ' + s.for_each.step if s.for_each else ''})"
            for s in pipeline.steps
        )
        print(f"  {pipeline.name}: pipeline {steps}")
    for field, why in loaded.warnings:
        print(f"  warning: {field}: {why}")
    if unloadable:
        print(ConfigError(loaded.path, unloadable).render(), file=sys.stderr)
        print(f"{args.config}: invalid", file=sys.stderr)
        return EXIT_INVALID
    pipelines = len(loaded.config.pipelines)
    also = f", {pipelines} pipeline{'s' if pipelines > 1 else ''}" if pipelines else ""
    print(f"{loaded.path}: OK ({len(loaded.models)} models{also})")
    return EXIT_OK


def _check_model_files(name: str, model: ResolvedModel) -> list[tuple[str, Path, str, bool]]:
    """Each of the model's files opened by its backend's cheapest check (``check_model_file``
    in the backend's module): (field, path, what the check found, whether it passed). A file
    that is not there is left out: the config's check has already said so (an ``.om`` not
    built yet is a warning)."""
    from duomo.worker.backends import acl_backend, ort_backend

    checks = {"onnxruntime": ort_backend.check_model_file, "acl": acl_backend.check_model_file}
    check = checks[model.config.backend]
    if model.executor.data_file:  # no backend reads it: its task checks it (a gallery)
        check = functools.partial(model.executor.check_data_file, model.params)
    found = []
    for role, path in model.files.items():
        one = model.config.file is not None
        field = f"models[{name}].file" if one else f"models[{name}].files.{role}"
        if not path.is_file():
            if model.executor.data_file:
                found.append((field, path, "not there yet: made empty at the first load", True))
            continue
        try:
            found.append((field, path, check(path), True))
        except ValueError as err:
            found.append((field, path, str(err), False))
    return found


def cmd_inspect(args: argparse.Namespace) -> int:
    """Inputs, outputs, dtypes, formats and gears of one model file."""
    from duomo.supervisor.operators.inspect_model import inspect_model

    try:
        info = inspect_model(args.model_file)
    except (RuntimeError, ValueError, OSError) as err:
        print(f"{args.model_file}: {err}", file=sys.stderr)
        return EXIT_INVALID
    print(json.dumps(info, indent=2))
    return EXIT_OK


def cmd_start(args: argparse.Namespace) -> int:
    from duomo.supervisor.process import daemon

    loaded = _load(args.config)
    if loaded is None:
        return EXIT_INVALID
    if args.foreground:
        return daemon.run_foreground(loaded, args.socket, args.ready_fd)
    return daemon.start_background(loaded.path, args.socket, args.log_level)


def cmd_stop(args: argparse.Namespace) -> int:
    from duomo.supervisor.process.daemon import EXIT_CUT, wait_for_exit

    try:
        with Client(args.socket, timeout_s=10) as client:
            # answered once the queued work is finished or cut by the grace period
            cut = int(client.request("stop", timeout_s=args.timeout, wait=True).get("cut", 0))
    except DuomoError as err:
        print(f"duomo stop: {err.message}", file=sys.stderr)
        return EXIT_FAILED
    if not wait_for_exit(args.socket, args.timeout):
        print(f"duomo stop: still running after {args.timeout:.0f}s", file=sys.stderr)
        return EXIT_FAILED
    if cut:
        print(f"duomo stopped ({args.socket}); the grace period cut {cut} request(s)")
        return EXIT_CUT
    print(f"duomo stopped ({args.socket})")
    return EXIT_OK


def _control(
    args: argparse.Namespace, op: str, describe: Callable[[dict[str, Any]], str], **fields: Any
) -> int:
    """Send one lifecycle control message and print ``describe(reply)``; or print why it failed.
    The exit code either way."""
    try:
        with Client(args.socket, timeout_s=10) as client:
            reply = client.request(op, timeout_s=args.timeout, **fields)
    except DuomoError as err:
        print(f"duomo {op}: {err.message}", file=sys.stderr)
        return exit_code(err)
    print(describe(reply))
    return EXIT_OK


def _reloaded(reply: dict[str, Any]) -> str:
    changes = [f"{k}: {', '.join(reply[k])}" for k in ("added", "removed", "replaced") if reply[k]]
    changes += [  # pipelines, when the supervisor has them
        f"pipelines {k}: {', '.join(reply[f'pipelines_{k}'])}"
        for k in ("added", "removed", "replaced")
        if reply.get(f"pipelines_{k}")
    ]
    return f"duomo reloaded: {'; '.join(changes) or 'nothing changed'}"


def _loaded(model: str, reply: dict[str, Any]) -> str:
    shown = ModelStatus.from_dict(reply.get("load"))
    charged = shown.memory.charged_bytes
    size = f", {charged / 2**20:.0f} MiB charged to its budget" if charged is not None else ""
    return f"{model}: {shown.state}{size}"


def _unloaded(model: str, reply: dict[str, Any]) -> str:
    cut = reply["unload"]["answered_unavailable"]
    note = f" ({cut} queued request(s) answered UNAVAILABLE)" if cut else ""
    return f"{model}: UNLOADED{note}"


def cmd_reload(args: argparse.Namespace) -> int:
    return _control(args, "reload", _reloaded, model=args.model)


def cmd_load(args: argparse.Namespace) -> int:
    return _control(args, "load", lambda reply: _loaded(args.model, reply), model=args.model)


def cmd_unload(args: argparse.Namespace) -> int:
    return _control(args, "unload", lambda reply: _unloaded(args.model, reply), model=args.model)


def cmd_status(args: argparse.Namespace) -> int:
    if args.watch:
        from duomo.supervisor.operators.status_watch import watch

        return watch(args.socket, args.interval or 1.0)
    if args.interval is not None:
        print("duomo status: --interval goes with --watch", file=sys.stderr)
        return EXIT_INVALID
    from duomo.supervisor.operators.status_table import render_status

    try:
        with Client(args.socket, timeout_s=10) as client:
            status = client.status()  # (a key missing fails here, loudly)
    except DuomoError as err:
        print(f"duomo status: {err.message}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(status.to_dict(), indent=2))
    else:
        print(render_status(status))
    return EXIT_OK


def cmd_gateway(args: argparse.Namespace) -> int:
    """The KServe v2 gateway's workers in the foreground, until SIGINT or SIGTERM."""
    import signal
    import threading

    from duomo.supervisor.process.gateways import GatewayConfig, GatewayProcesses

    section: dict[str, Any] = {}
    if args.config is not None:
        loaded = _load(args.config)
        if loaded is None:
            return EXIT_INVALID
        if loaded.config.gateway is not None:
            section = loaded.config.gateway.model_dump()
    for key in ("http", "grpc", "workers"):
        if getattr(args, key) is not None:
            section[key] = getattr(args, key)
    try:
        config = GatewayConfig.model_validate(section)
    except ValueError as err:
        print(f"duomo gateway: {err}", file=sys.stderr)
        return EXIT_INVALID
    gateways = GatewayProcesses(config, args.socket)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        gateways.start()
    except RuntimeError as err:
        print(f"duomo gateway: {err}", file=sys.stderr)
        return EXIT_FAILED
    print(
        f"duomo gateway: {config.workers} worker(s), http {config.http}, grpc {config.grpc}, "
        f"supervisor {args.socket}",
        flush=True,
    )
    stop.wait()
    gateways.stop()
    return EXIT_OK


def cmd_infer(args: argparse.Namespace) -> int:
    if args.config is None:
        return _infer_via_supervisor(args)
    return _infer_in_process(args)


def _infer_via_supervisor(args: argparse.Namespace) -> int:
    from duomo.supervisor.operators.image_files import read_image

    try:
        client = Client(args.socket, timeout_s=30)
    except DuomoError as err:
        print(f"duomo infer: {err.message} (start one with: duomo start)", file=sys.stderr)
        return EXIT_FAILED
    status = EXIT_OK
    with client:
        try:
            model = client.model(args.model, slots=1)
        except DuomoError as err:
            print(f"duomo infer: {err.message}", file=sys.stderr)
            return EXIT_INVALID if err.code is ErrorCode.NOT_FOUND else EXIT_FAILED
        for path in args.images:
            try:
                result = model.infer(read_image(path), timeout_s=args.timeout)
            except DuomoError as err:
                print(f"duomo infer: {path}: {err}", file=sys.stderr)
                status = EXIT_FAILED
                continue
            _print_result(path, args.model, result, args.json)
    return status


def _infer_in_process(args: argparse.Namespace) -> int:
    from duomo.supervisor.core.engine import Engine
    from duomo.supervisor.operators.image_files import read_image

    loaded = _load(args.config)
    if loaded is None:
        return EXIT_INVALID
    engine = Engine(loaded, only=[args.model])
    status = EXIT_OK
    try:
        try:
            engine.start()
        except NotFoundError as err:
            print(f"duomo infer: {err.message}", file=sys.stderr)
            return EXIT_INVALID
        except (ValueError, RuntimeError) as err:  # a thread plan or a model that cannot load
            print(f"duomo infer: {err}", file=sys.stderr)
            return EXIT_INVALID
        for path in args.images:
            try:
                result = engine.infer(args.model, read_image(path))
            except DuomoError as err:
                print(f"duomo infer: {err}", file=sys.stderr)
                status = EXIT_FAILED
                continue
            _print_result(path, args.model, result, args.json)
    finally:
        engine.close()
    return status


def cmd_stream(args: argparse.Namespace) -> int:
    """``duomo stream``: video sources into the supervisor's models (``video.command``)."""
    from duomo.video.command import run

    return run(args)


def _print_result(path: str, model: str, result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        row = {"image": path, "model": model, "result": result}
        print(json.dumps(row, ensure_ascii=False, default=json_default))
        return
    print(f"{path} [{model}]")
    if "top" in result:
        for entry in result["top"]:
            print(f"  {entry['score']:.3f}  {entry['label']} ({entry['index']})")
    elif "faces" in result:
        for face in result["faces"]:
            box = ", ".join(f"{v:.0f}" for v in face["box"])
            track = f" (track {face['track_id']})" if "track_id" in face else ""
            print(f"  face {face['score']:.3f} at [{box}]{track}")
            for step, answer in face.items():  # a pipeline's steps run on this face
                if isinstance(answer, dict):
                    print(f"    {step}: {_sub_result(answer)}")
        if not result["faces"]:
            print("  no faces")
    elif "lines" in result:
        for line in result["lines"]:
            print(f"  {line['score']:.3f}  {line['text']}")
        if not result["lines"]:
            print("  no text")
    else:
        for name, value in result.items():
            print(f"  {name}: {getattr(value, 'shape', value)}")


def _sub_result(answer: dict[str, Any]) -> str:
    """One line for a pipeline step's answer on one object: its error, or its fields (a
    vector as its length, a number to 3 decimals)."""
    error = answer.get("error")
    if isinstance(error, dict):
        return f"error {error.get('code')}: {error.get('message')}"
    shown = []
    for key, value in answer.items():
        if isinstance(value, list):
            shown.append(f"{key} [{len(value)} values]")
        elif isinstance(value, float):
            shown.append(f"{key} {value:.3f}")
        else:
            shown.append(f"{key} {value}")
    return ", ".join(shown)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="duomo", description="Serve many models from one process."
    )
    parser.add_argument(
        "--log-level", choices=LEVELS, default=None, help="default: info for start, else warning"
    )
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of text")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser(
        "check", help="report the environment (Ascend, CANN, ORT) and validate a configuration"
    )
    check.add_argument("-c", "--config", type=Path, default=None, help="also validate this")
    check.add_argument("--json", action="store_true", help="the environment report as JSON")
    check.set_defaults(func=cmd_check)

    inspect = sub.add_parser("inspect", help="inputs, outputs, dtypes, formats, gears of a model")
    inspect.add_argument("model_file", type=Path, help=".onnx, or .om (needs CANN)")
    inspect.set_defaults(func=cmd_inspect)

    start = sub.add_parser("start", help="start a supervisor (in the background by default)")
    start.add_argument("-c", "--config", type=Path, default=DEFAULT_CONFIG)
    start.add_argument("--foreground", action="store_true", help="run in this process")
    start.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    _socket_arg(start)
    start.set_defaults(func=cmd_start)

    stop = sub.add_parser("stop", help="stop a supervisor gracefully (finishes queued work)")
    stop.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for exit")
    _socket_arg(stop)
    stop.set_defaults(func=cmd_stop)

    reload = sub.add_parser(
        "reload", help="re-read the config and apply the difference (or rebuild one model)"
    )
    reload.add_argument("model", nargs="?", default=None, help="only this model")
    _lifecycle_args(reload)
    reload.set_defaults(func=cmd_reload)

    load = sub.add_parser("load", help="load a declared model (measured, within its budgets)")
    load.add_argument("model")
    _lifecycle_args(load)
    load.set_defaults(func=cmd_load)

    unload = sub.add_parser("unload", help="unload a model and free its memory")
    unload.add_argument("model")
    _lifecycle_args(unload)
    unload.set_defaults(func=cmd_unload)

    status = sub.add_parser("status", help="models, queues, latencies and clients")
    shown = status.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true")
    shown.add_argument(
        "--watch", action="store_true", help="a live view, redrawn until q or Ctrl-C"
    )
    status.add_argument(
        "--interval", type=_seconds, default=None, metavar="S",
        help="seconds between redraws with --watch (default 1)",
    )  # fmt: skip
    _socket_arg(status)
    status.set_defaults(func=cmd_status)

    gateway = sub.add_parser(
        "gateway", help="serve the models over KServe v2 (HTTP and gRPC), in the foreground"
    )
    gateway.add_argument(
        "-c", "--config", type=Path, default=None, help="take the gateway section from here"
    )
    gateway.add_argument("--http", default=None, help="HOST:PORT (default 127.0.0.1:8000)")
    gateway.add_argument("--grpc", default=None, help="HOST:PORT (default 127.0.0.1:8001)")
    gateway.add_argument("--workers", type=int, default=None, help="processes sharing the ports")
    _socket_arg(gateway)
    gateway.set_defaults(func=cmd_gateway)

    infer = sub.add_parser("infer", help="run image files through one model")
    infer.add_argument(
        "-c", "--config", type=Path, default=None,
        help="run in-process with this config instead of through the running supervisor",
    )  # fmt: skip
    infer.add_argument("model")
    infer.add_argument("images", nargs="+", metavar="IMAGE")
    infer.add_argument("--json", action="store_true", help="one JSON object per image per line")
    infer.add_argument("--timeout", type=float, default=60.0, help="seconds per image")
    _socket_arg(infer)
    infer.set_defaults(func=cmd_infer)

    stream = sub.add_parser(
        "stream", help="decode videos (files, RTSP/RTMP/HTTP, V4L2) into models as streams"
    )
    stream.add_argument(
        "sources", nargs="*", metavar="SOURCE",
        help="a video file, an rtsp:// rtmp:// http(s):// URL, or a V4L2 device /dev/videoN",
    )  # fmt: skip
    stream.add_argument(
        "--sources", dest="sources_file", type=Path, default=None, metavar="FILE",
        help="more sources from a YAML list of {name, url, models, policy, max_fps}",
    )  # fmt: skip
    fed = stream.add_mutually_exclusive_group()
    fed.add_argument("--model", action="append", metavar="M", help="a model to feed (repeat)")
    fed.add_argument("--pipeline", metavar="P", help="a pipeline to feed (faces, say)")
    stream.add_argument("--policy", choices=("latest", "fifo"), default="latest")
    stream.add_argument(
        "--max-fps", type=float, default=None, metavar="F", help="drop frames above this rate"
    )
    stream.add_argument("--every", type=int, default=None, metavar="N", help="keep 1 frame in N")
    stream.add_argument(
        "--out", default="-", metavar="FILE.jsonl", help="one JSON line per answer (- : stdout)"
    )
    stream.add_argument("--preview", default=None, metavar="HOST:PORT", help="a live page")
    stream.add_argument("--duration", type=_seconds, default=None, metavar="S")
    stream.add_argument("--loop", action="store_true", help="restart files at their end")
    stream.add_argument(
        "--as-fast-as-possible", action="store_true", help="do not pace files at their frame rate"
    )
    stream.add_argument(
        "--name", nargs="+", default=[], metavar="NAME",
        help="stream names, in the order of the sources (default: the file's stem, the URL's "
        "host and path)",
    )  # fmt: skip
    stream.add_argument(
        "--stall-after", type=_seconds, default=5.0, metavar="S",
        help="seconds without a frame before the supervisor shows the stream stalled",
    )  # fmt: skip
    stream.add_argument(
        "--failed-after", type=_seconds, default=30.0, metavar="S",
        help="a camera failing this long (or 3 times with 401/403/404 or an unknown host) is "
        "failed; every source failed: exit 3",
    )  # fmt: skip
    stream.add_argument(
        "--wait-s", type=_seconds_or_zero, default=0.0, metavar="S",
        help="wait up to S seconds for the supervisor's socket at the start (0: do not wait; "
        "a supervisor lost later is always waited for and attached again)",
    )  # fmt: skip
    stream.add_argument(
        "--sink", action="append", metavar="NAME", dest="sinks",
        help="also send each source's events to the running supervisor's sink NAME (repeat)",
    )  # fmt: skip
    stream.add_argument(
        "--emit", choices=("answers", "objects", "both"), default=None,
        help="what goes to the sinks (both where the pipeline has a tracker, else answers)",
    )  # fmt: skip
    _socket_arg(stream)
    stream.set_defaults(func=cmd_stream)

    camera = sub.add_parser(
        "camera-sim", help="serve video files as looping RTSP cameras (and broken ones), to try "
        "streams without a camera",
        description="Serve each FILE at rtsp://HOST:PORT/<its stem>, looping in real time, and "
        "at /<its stem>/corrupt with damaged slices; print a line per URL, then READY and the "
        "URLs; serve until Ctrl-C or SIGTERM.",
    )  # fmt: skip
    camera.add_argument("files", nargs="+", type=Path, metavar="FILE", help="a video file")
    camera.add_argument("--host", default=camera_sim.DEFAULT_HOST, help="default 127.0.0.1")
    camera.add_argument(
        "--port", type=camera_sim.port_number, default=camera_sim.DEFAULT_PORT,
        help="default 8554; 0: any free port (the READY line says which)",
    )  # fmt: skip
    camera.add_argument(
        "--fps", type=camera_sim.frame_rate, default=None, metavar="F",
        help="play every frame at F frames a second (default: the file's rate)",
    )  # fmt: skip
    camera.add_argument(
        "--clock-offset-s", type=camera_sim.clock_offset, default=0.0, metavar="S",
        help="the RTCP sender reports' clock is the host's wall clock plus S seconds",
    )  # fmt: skip
    camera.add_argument(
        "--no-sender-reports", action="store_true",
        help="send no RTCP at all (a client gets no camera time)",
    )  # fmt: skip
    camera.set_defaults(func=camera_sim.run)

    add_source_parser(sub, _socket_arg)
    add_gallery_parser(sub, _socket_arg)

    # ``duomo bench`` has its own parser, the benchmark's, in its own process (``run_bench``):
    # the benchmark lives with the tools of a source checkout, which are not installed
    bench = sub.add_parser(
        "bench", add_help=False,
        help="Duomo vs the engine limit, one process per model, Triton and Mosec "
        "(a source checkout's tools/bench: duomo bench --help)",
    )  # fmt: skip
    bench.set_defaults(func=lambda args: run_bench([]))
    return parser


def _lifecycle_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait")
    _socket_arg(parser)


# ``duomo stream --wait-s``; ``--interval``, ``--duration``, ``--stall-after``, ``--failed-after``
_seconds_or_zero = checked_number(float, lambda s: 0 <= s < math.inf, "a number of seconds ≥ 0")
_seconds = checked_number(float, lambda s: 0 < s < math.inf, "a number of seconds > 0")


def _socket_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket", type=Path, default=None,
        help="supervisor socket (default: $DUOMO_SOCKET or the standard runtime dir)",
    )  # fmt: skip


def run_bench(argv: list[str]) -> int:
    """``duomo bench ARGS``: the benchmark, ``python -m tools.bench.run ARGS`` run from the
    source checkout this Duomo is installed from (``duomo/`` beside ``tools/``) with
    ``BENCH_CALLER_DIR_ENV`` naming the directory the relative paths of ARGS are read from; its
    exit status. A clear error, exit 2, where Duomo was installed without a checkout (``tools/``
    is never installed)."""
    checkout = Path(duomo.__file__).resolve().parents[1]  # (the checkout's duomo/, or a wheel's)
    if not (checkout / "tools" / "bench" / "run.py").is_file():
        print(
            "duomo bench: the benchmark runs from a source checkout of Duomo (make bench); "
            "tools/ is not installed",
            file=sys.stderr,
        )
        return EXIT_INVALID
    bench = subprocess.Popen(
        [sys.executable, "-m", "tools.bench.run", *argv], cwd=checkout,
        env={**os.environ, BENCH_CALLER_DIR_ENV: os.getcwd()},
    )  # fmt: skip
    try:
        status = bench.wait()
    except KeyboardInterrupt:  # the bench had the same ^C: it stops what it started, then exits
        status = bench.wait()
    return status if status >= 0 else 128 - status  # killed by a signal: 128 + its number


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["bench"]:  # its own parser and options (``run_bench``)
        configure_logging("warning", False)
        return run_bench(arguments[1:])
    parser = build_parser()
    args = parser.parse_args(arguments)
    if hasattr(args, "socket") and args.socket is None:
        args.socket = default_socket_path()
    if args.log_level is None:
        args.log_level = "info" if args.command == "start" else "warning"
    configure_logging(args.log_level, args.log_json)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
