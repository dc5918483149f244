"""Wake-up benchmark: how soon a thread waiting on a Unix socket runs after a request arrives,
by what it did before it waited. It is the measurement behind the model workers' idle spin
(docs/design-notes.md, "Idle spin"); it uses none of Duomo's code.

A client process sends 16 bytes, the server answers after one classification (the demo's
EfficientNet-Lite0 in ONNX Runtime, one intra-op thread, spinning off), and the client works
for 140 µs before its next request, as a producer does. *wake* is the server's clock when its
wait returned minus the client's just before it sent (one monotonic clock for both processes).
The server's ways to wait:

- ``after-inference``: the thread that ran the inference waits in ``poll`` (a lent connection
  without the idle spin);
- ``after-sleep``: the same, but the "inference" is a sleep of the same length: no CPU used;
- ``separate-reader``: a thread that never computes waits and hands the request to a second
  thread that runs it (Duomo's reactor and worker, the bench's *design floor*); only the
  reader's wake is counted, not the second one, of the thread it hands the request to;
- ``spin``: as ``after-inference``, but it polls without sleeping for up to 1 ms first,
  yielding the core at every turn, as a model worker's idle spin does.

Then what a spin costs the process's other threads: round trips to a thread that only echoes
(it waits in a blocking ``recv``), in a process where another thread spins as an idle worker
does all the time, or sleeps (``gil``: the spinner holds the GIL between its polls).

Run on an otherwise idle machine, after ``make models``::

    python -m tools.bench.experiments.bench_wake [--rounds 3] [--requests 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import queue
import select
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

MODES = ("after-inference", "after-sleep", "separate-reader", "spin")
MODEL = Path(__file__).resolve().parents[3] / "models" / "classify" / "efficientnet_lite0.onnx"
STAMP = struct.Struct("=d")
CLIENT_WORK_S = 140e-6
SPIN_S = 1e-3


def inference() -> Callable[[], object]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(MODEL), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    return lambda: session.run(None, {"input": x})


def spin(poller: select.poll, spin_s: float) -> bool:
    """Poll without sleeping for up to ``spin_s``, yielding the core at every turn, as a model
    worker's idle spin does; True if an event came."""
    end = time.perf_counter() + spin_s
    while not poller.poll(0):
        if time.perf_counter() >= end:
            return False
        os.sched_yield()
    return True


def wait_readable(poller: select.poll, spin_s: float) -> None:
    if not spin(poller, spin_s):
        poller.poll()


def serve(sock: socket.socket, mode: str) -> None:
    run = inference()
    run()
    start = time.perf_counter()
    run()
    if mode == "after-sleep":  # as long as one inference, without using the CPU
        run = functools.partial(time.sleep, time.perf_counter() - start)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    if mode != "separate-reader":
        spin_s = SPIN_S if mode == "spin" else 0.0
        while True:
            wait_readable(poller, spin_s)
            woke = time.perf_counter()
            if not sock.recv(64):
                return
            run()
            sock.sendall(STAMP.pack(woke))
    handed: queue.SimpleQueue[float | None] = queue.SimpleQueue()

    def runner() -> None:
        while (woke := handed.get()) is not None:
            run()
            sock.sendall(STAMP.pack(woke))

    thread = threading.Thread(target=runner)
    thread.start()
    while True:
        poller.poll()
        woke = time.perf_counter()
        if not sock.recv(64):
            handed.put(None)
            thread.join()
            return
        handed.put(woke)


def echo_beside(sock: socket.socket, spinning: bool) -> None:
    never, _ = os.pipe()
    idle = select.poll()
    idle.register(never, select.POLLIN)
    done = threading.Event()

    def neighbour() -> None:
        while not done.is_set():
            if spinning:
                spin(idle, SPIN_S)
            else:
                time.sleep(0.01)

    thread = threading.Thread(target=neighbour)
    thread.start()
    while data := sock.recv(64):
        sock.sendall(data)
    done.set()
    thread.join()


def forked(server: Callable[[socket.socket], None]) -> tuple[socket.socket, int]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        ours.close()
        try:
            server(theirs)
        finally:
            os._exit(0)
    theirs.close()
    return ours, pid


def gil_probe(spinning: bool, requests: int) -> list[float]:
    """Round trips in µs to the echoing thread (its first 100 not counted)."""
    ours, pid = forked(functools.partial(echo_beside, spinning=spinning))
    trips: list[float] = []
    for i in range(requests + 100):
        sent = time.perf_counter()
        ours.sendall(b"x")
        ours.recv(64)
        if i >= 100:
            trips.append((time.perf_counter() - sent) * 1e6)
        time.sleep(0.0005)
    ours.close()
    os.waitpid(pid, 0)
    return trips


def probe(mode: str, requests: int) -> list[float]:
    """Wake-ups in µs of one server process in ``mode`` (its first 20 requests not counted)."""
    ours, pid = forked(functools.partial(serve, mode=mode))
    wakes: list[float] = []
    for i in range(requests + 20):
        sent = time.perf_counter()
        ours.sendall(b"x" * 16)
        (woke,) = STAMP.unpack(ours.recv(STAMP.size, socket.MSG_WAITALL))
        if i >= 20:
            wakes.append((woke - sent) * 1e6)
        end = time.perf_counter() + CLIENT_WORK_S
        while time.perf_counter() < end:
            pass
    ours.close()
    os.waitpid(pid, 0)
    return wakes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not MODEL.exists():
        print(f"{MODEL} is missing: run `make models` first", file=sys.stderr)
        return 2
    wakes: dict[str, list[float]] = {mode: [] for mode in MODES}
    trips: dict[str, list[float]] = {"sleeps": [], "spins": []}
    for _ in range(args.rounds):  # modes interleaved round by round: drift hits all alike
        for mode in MODES:
            wakes[mode] += probe(mode, args.requests)
        for neighbour in trips:
            trips[neighbour] += gil_probe(neighbour == "spins", 5 * args.requests)
    report: dict[str, dict[str, dict[str, float]]] = {"wake_us": {}, "echo_round_trip_us": {}}
    print(f"{'server waits':16} {'p10':>7} {'p50':>7} {'p90':>7}  µs from send to awake")
    for mode, values in wakes.items():
        shown = report["wake_us"][mode] = percentiles(values, (10, 50, 90))
        print(f"{mode:16} " + " ".join(f"{v:7.1f}" for v in shown.values()))
    print(f"{'neighbour':16} {'p50':>7} {'p90':>7} {'p99':>7}  µs round trip to an echo thread")
    for neighbour, values in trips.items():
        shown = report["echo_round_trip_us"][neighbour] = percentiles(values, (50, 90, 99))
        print(f"{neighbour:16} " + " ".join(f"{v:7.1f}" for v in shown.values()))
    if args.json is not None:
        args.json.write_text(json.dumps({"rounds": args.rounds, **report}, indent=2))
    return 0


def percentiles(values: list[float], which: tuple[int, ...]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100)
    return {f"p{p}": statistics.median(values) if p == 50 else cuts[p - 1] for p in which}


if __name__ == "__main__":
    raise SystemExit(main())
