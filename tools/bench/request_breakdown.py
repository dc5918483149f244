"""Where a small model's milliseconds go, request by request (issue 45, item 1): a real
supervisor on the demo config, producers in other processes, and for each request of classify
and face its round trip cut into stages that add up to it, alone (one producer) and under the
mixed load (every model of ``configs/bench/mixed.yaml`` with its producers, as ``duomo bench``
drives it); and how long a thread of the supervisor waits for the interpreter lock.

How:

- **the stages** (``tools.bench.request_stages`` defines each): the producers here take a free
  slot, write the image, submit and wait as ``ModelHandle.infer`` does, stamping
  ``time.monotonic`` between the steps and when their reading thread has the answer's notice
  (``Slot.on_done``); the supervisor, started with ``DUOMO_REQUEST_TRACE``, stamps the same clock
  (``CLOCK_MONOTONIC``: one clock for every process of the host) at the intake, the queue, the
  answer, the encoding and the notice back (``supervisor.process.request_trace``); its slot
  header's stage times (queue, preprocess, infer, postprocess) give the rest. Each request is
  joined with its record (producer pid, ring, slot, and the time), so every stage is that
  request's own; the report gives each stage's median, p90 and mean (the means add up to the
  mean round trip exactly; the medians nearly to the median's). Beside them: the Triton-style
  totals of the window (``status``: mean queue, compute input, infer and output) as a check,
  and the same executor in-process (one thread, as ``duomo bench``'s ``alone``) with the same
  three stage times;
- **the interpreter lock**, two ways. The probe (``supervisor.process.gil_probe``,
  ``DUOMO_GIL_PROBE``): a thread of the supervisor asks for 1 ms sleeps and records how late it
  wakes; a twin of it in a process of its own beside the supervisor, where no other thread holds
  its lock, measures what the kernel alone adds under the same load (timer slack, the wait for a
  core); the difference of their means is the lock's wait at a wake-up. And ``py-spy record
  --gil --nonblocking`` on the supervisor (when ``py-spy`` is on the path, or ``--py-spy``): the
  share of samples in which some thread held the lock, and which thread;
- **three kinds of supervisor**, interleaved in every round (A B C, then C B A): ``traced`` (the
  trace; the breakdown comes from it), ``plain`` (no instrument: its round trip is the cost of
  the trace against no trace) and ``probed`` (the probe, its twin and py-spy; none of its
  round trips enters the breakdown). Every producer keeps each image's answer: the three kinds
  must give the same ones.

Limits: a stage that crosses from one process to another ends at the receiver's stamp, so it
holds the receiver's wake-up and its wait for a core and for the lock; ``queue wait`` takes the
model's previous request as its worker's (one instance per model); the in-process reference
runs minutes apart from the supervisor's windows, and this host's inference speed drifts by
more than the path costs, so the path is read from its own stages, not from the difference.
The probe's waits are a random wake-up's, not a request's; py-spy samples 100 times a second
without stopping the process, so a share under a few percent is noise. All processes run at
the niceness the tool was started with (``nice -n 19`` keeps it off a shared machine's other
work, and keeps them level with each other).

Run from the repository root::

    nice -n 19 python -m tools.bench.request_breakdown --out DIR [--rounds 2] [--window-s 15]

It writes ``DIR/result.json`` and ``DIR/report.md`` (``tools.bench.request_report``) and prints
the report; ``--raw FILE`` keeps every round's raw records too (megabytes), which
``--from-raw FILE`` reports again without measuring. The producers (``producer``), the twin
probe (``twin``) and the in-process reference (``inprocess``) are this module's children.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tools.bench.request_breakdown"
KINDS = ("traced", "plain", "probed")
SMALL = ("classify", "face")  # the models the breakdown is for
PY_SPY_RATE_HZ = 100


def producer(spec: dict[str, Any]) -> dict[str, Any]:
    """One closed-loop producer (a child): ``infer``'s steps, stamped, for the window."""
    from duomo.ipc.client import Client
    from duomo.supervisor.operators.image_files import read_image

    client = Client(spec["socket"], timeout_s=120)
    handle = client.model(spec["model"], slots=1)
    images = [read_image(p) for p in spec["images"]]
    pid = os.getpid()
    clock = time.monotonic
    notified = [0.0]

    def on_done(_slot: Any) -> None:
        notified[0] = clock()

    print("ready", flush=True)
    window = json.loads(sys.stdin.readline())
    start_at, end_at = float(window["start_at"]), float(window["end_at"])
    records: list[tuple[Any, ...]] = []
    answers: dict[int, str] = {}
    differing = 0
    i = 0
    while (now := time.time()) < end_at:
        k = i % len(images)
        started = clock()
        slot = handle.slot(None)
        slot.write(images[k])
        written = clock()
        slot.on_done = on_done
        notified[0] = 0.0
        slot.submit(timeout_s=120)
        submitted = clock()
        result = slot.wait(copy=True)
        ring, index = slot.ring_id, slot.index
        slot.release()
        done = clock()
        answer = json.dumps(result, sort_keys=True)
        differing += answers.setdefault(k, answer) != answer
        if now >= start_at and notified[0]:  # (stamped by the reading thread, as it must be)
            records.append((pid, ring, index, started, written, submitted, notified[0], done))
        i += 1
    client.close()
    return {"model": spec["model"], "records": records, "answers": answers, "differing": differing}


def twin(seconds: float) -> dict[str, Any]:
    """The probe alone in this process (a child) for ``seconds``: the kernel's share."""
    from duomo.supervisor.process.gil_probe import GilProbe

    probe = GilProbe()
    probe.start()
    time.sleep(seconds)
    probe.stop()
    return probe.figures()


def inprocess(spec: dict[str, Any]) -> dict[str, Any]:
    """Each small model's executor in this process (a child), one thread, closed loop for
    ``seconds``: the three stages as a worker times them, and the round trip."""
    from duomo.supervisor.operators.image_files import read_image
    from duomo.worker.executors.base import StageTimer
    from tools.bench.inprocess import open_executor
    from tools.bench.request_stages import quantile

    figures: dict[str, Any] = {}
    for name, paths in spec["models"].items():
        executor = open_executor(spec["config"], name, threads=1)
        images = [read_image(p) for p in paths]
        stages: dict[str, list[float]] = {"preprocess": [], "infer": [], "postprocess": []}
        totals: list[float] = []
        answers: dict[int, str] = {}
        stop_at = time.monotonic() + spec["seconds"]
        while time.monotonic() < stop_at:
            k = len(totals) % len(images)
            timer = StageTimer()
            t0 = time.perf_counter()
            item = executor.prepare(images[k])
            t1 = time.perf_counter()
            result = executor.execute([item], timer)[0]
            t2 = time.perf_counter()
            pre, infer = timer.seconds["preprocess"], timer.seconds["infer"]
            stages["preprocess"].append(t1 - t0 + pre)
            stages["infer"].append(infer)
            stages["postprocess"].append(t2 - t1 - pre - infer)
            totals.append(t2 - t0)
            answers.setdefault(k, json.dumps(result, sort_keys=True))
        executor.close()
        figures[name] = {
            "calls": len(totals),
            "p50_ms": {s: quantile(v, 0.5) * 1e3 for s, v in {**stages, "total": totals}.items()},
            "answers": answers,
        }
    return figures


def _child_main(kind: str) -> int:
    spec = json.loads(sys.stdin.readline())
    if kind == "producer":
        out = producer(spec)
    elif kind == "twin":
        out = twin(float(spec["seconds"]))
    else:
        out = inprocess(spec)
    print(json.dumps(out), flush=True)
    return 0


def _totals(socket: Path, names: list[str]) -> dict[str, dict[str, list[int]]]:
    """Each model's Triton-style totals now: kind -> [count, ns]."""
    from duomo.ipc.client import Client

    with Client(str(socket), timeout_s=30) as client:
        models = client.status().models
    return {n: {k: [c.count, c.ns] for k, c in models[n].totals.timed.items()} for n in names}


def _window_totals(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The totals of the window: per model and kind, the mean ms of the requests it answered."""
    out: dict[str, Any] = {}
    for name in after:
        means = {}
        for kind, (count, ns) in after[name].items():
            n, spent = count - before[name][kind][0], ns - before[name][kind][1]
            means[kind] = spent / n / 1e6 if n else None
        out[name] = {"requests": after[name]["success"][0] - before[name]["success"][0], **means}
    return out


def _cpu_s(pid: int) -> tuple[float, float]:
    """The CPU seconds process ``pid`` has used (user + system, every thread), and the
    machine's busy CPU seconds (every core: all but idle and iowait), both from ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    process = (int(fields[11]) + int(fields[12])) / tick
    cpu = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return process, (sum(cpu) - cpu[3] - cpu[4]) / tick


def _wait_until(wall_s: float) -> None:
    time.sleep(max(0.0, wall_s - time.time()))


def run_phase(
    args: argparse.Namespace,
    socket: Path,
    pid: int,
    producers: dict[str, int],
    images: dict[str, list[str]],
    kind: str,
    workdir: Path,
) -> dict[str, Any]:
    """One window of one kind of supervisor: ``producers[model]`` producers each; the
    producers' records and answers, the window's totals, and for ``probed`` the twin's figures
    and py-spy's output."""
    from tools.bench.children import Child, open_window

    children = [
        Child(MODULE, ["producer"], {"socket": str(socket), "model": m, "images": images[m]})
        for m, n in producers.items()
        for _ in range(n)
    ]
    start_at, end_at = open_window(children, args.warmup_s, args.window_s)
    mono_offset = time.monotonic() - time.time()  # wall → monotonic, for the probe's window
    _wait_until(start_at)
    before = _totals(socket, list(producers))
    cpu_before = _cpu_s(pid)
    spy = twin_child = None
    if kind == "probed":
        twin_child = Child(MODULE, ["twin"], {"seconds": args.window_s})
        if args.py_spy:
            spy_out = workdir / f"py-spy-{time.time_ns()}.txt"
            spy = subprocess.Popen(
                [args.py_spy, "record", "--pid", str(pid), "--gil", "--threads", "--nonblocking",
                 "--rate", str(PY_SPY_RATE_HZ), "--format", "raw", "--duration",
                 str(round(args.window_s)), "--output", str(spy_out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
    _wait_until(end_at)
    cpu_after = _cpu_s(pid)
    after = _totals(socket, list(producers))
    figures: dict[str, Any] = {
        "window_monotonic_s": [start_at + mono_offset, end_at + mono_offset],
        "producers": [c.result() for c in children],
        "totals": _window_totals(before, after),
        "cores_used": {  # over the window: the supervisor's, and every process's
            "supervisor": (cpu_after[0] - cpu_before[0]) / args.window_s,
            "machine": (cpu_after[1] - cpu_before[1]) / args.window_s,
        },
    }
    if twin_child is not None:
        figures["twin"] = twin_child.result()
    if spy is not None:
        _, err = spy.communicate(timeout=60)
        text = spy_out.read_text() if spy_out.exists() else ""
        figures["py_spy"] = {"raw": text, "stderr": err[-2000:], "seconds": args.window_s}
    return figures


def run_kind(args: argparse.Namespace, workload: Any, kind: str, workdir: Path) -> dict[str, Any]:
    """One supervisor of ``kind`` on the workload's config, through the phases; its figures."""
    from duomo.supervisor.process.gil_probe import PROBE_ENV
    from duomo.supervisor.process.request_trace import TRACE_ENV
    from tools.bench.servers import DuomoServers

    names = [m.name for m in workload.models]
    images = {m.name: [str(p) for p in m.images] for m in workload.models}
    phases = {f"{m} alone": {m: 1} for m in SMALL}
    phases["mixed"] = {m.name: m.producers for m in workload.models}
    files = {"traced": (TRACE_ENV, "trace.json"), "probed": (PROBE_ENV, "probe.json")}
    env_name, file_name = files.get(kind, (None, None))
    out_file = workdir / file_name if file_name else None
    servers = DuomoServers(workload.config, [names], workdir)
    if env_name:
        os.environ[env_name] = str(out_file)
    try:
        servers.start()
    finally:
        if env_name:
            del os.environ[env_name]
    result: dict[str, Any] = {}
    try:
        pid = servers.pids()[0]
        socket = Path(servers.target(names[0])["socket"])
        for phase, producers in phases.items():
            print(f"request_breakdown: {kind}: {phase}", file=sys.stderr, flush=True)
            result[phase] = run_phase(args, socket, pid, producers, images, kind, workdir)
    finally:
        servers.stop()
    if out_file is not None:
        result["server"] = json.loads(out_file.read_text())
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from tools.bench.children import Child
    from tools.bench.report import machine
    from tools.bench.request_report import reduce_round
    from tools.bench.workload import load_workload

    workload = load_workload(args.workload)
    images = {m.name: [str(p) for p in m.images] for m in workload.models}
    raws: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="duomo-breakdown-") as tmp:
        for r in range(args.rounds):
            print(f"request_breakdown: round {r + 1}: in-process", file=sys.stderr, flush=True)
            spec = {"config": str(workload.config), "seconds": args.inprocess_s,
                    "models": {m: images[m] for m in SMALL}}  # fmt: skip
            child = Child(MODULE, ["inprocess"], spec)
            raw: dict[str, Any] = {"inprocess": child.result()}
            for kind in KINDS if r % 2 == 0 else tuple(reversed(KINDS)):
                workdir = Path(tmp) / f"{kind}-{r}"
                workdir.mkdir()
                raw[kind] = run_kind(args, workload, kind, workdir)
            raws.append(raw)
    if args.raw is not None:
        args.raw.write_text(json.dumps(raws))
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m tools.bench.request_breakdown " + " ".join(args.argv),
        "workload": str(args.workload.relative_to(ROOT)),
        "warmup_s": args.warmup_s,
        "window_s": args.window_s,
        "machine": machine(),
        "niceness": os.nice(0),
        "py_spy": args.py_spy,
        "rounds": [reduce_round(raw) for raw in raws],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["producer"], ["twin"], ["inprocess"]):
        return _child_main(argv[0])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, default=ROOT / "configs/bench/mixed.yaml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--inprocess-s", type=float, default=6.0)
    parser.add_argument("--py-spy", default=shutil.which("py-spy"), help="py-spy's path")
    parser.add_argument("--out", type=Path, help="folder for result.json and report.md")
    parser.add_argument("--raw", type=Path, help="also keep the raw records in this file")
    parser.add_argument("--from-raw", type=Path, help="report the result.json in --out again")
    args = parser.parse_args(argv)
    args.argv = argv
    args.workload = args.workload.resolve()
    from tools.bench.report import print_and_keep
    from tools.bench.request_report import markdown, reduce_round

    if args.from_raw is not None:  # the same figures from kept records, with today's arithmetic
        result = json.loads((args.out / "result.json").read_text())
        result["rounds"] = [reduce_round(raw) for raw in json.loads(args.from_raw.read_text())]
    else:
        result = measure(args)
    print_and_keep(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
