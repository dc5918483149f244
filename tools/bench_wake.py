"""Wake-up benchmark: how soon a thread waiting on a Unix socket runs after a request arrives,
by what it did before it waited. It is the measurement behind the model workers' idle spin
(README "Idle spin"); it uses none of Duomo's code.

A client process sends 16 bytes, the server answers after one classification (the demo's
EfficientNet-Lite0 in ONNX Runtime, one intra-op thread, spinning off), and the client works
for 140 µs before its next request, as a producer does. *wake* is the server's clock when its
wait returned minus the client's just before it sent (one monotonic clock for both processes).
The server's ways to wait:

- ``after-inference``: the thread that ran the inference waits in ``poll`` (a lent connection
  without the idle spin);
- ``after-sleep``: the same, but the "inference" is a sleep of the same length: no CPU used;
- ``separate-reader``: a thread that never computes waits and hands the request to a second
  thread that runs it (DESIGN §3's reactor and worker, the bench's *design floor*);
- ``spin``: as ``after-inference``, but it polls without sleeping for up to 1 ms first.

Run on an otherwise idle machine, after ``make models``::

    python tools/bench_wake.py [--rounds 3] [--requests 200] [--json OUT]
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
MODEL = Path(__file__).resolve().parent.parent / "models" / "classify" / "efficientnet_lite0.onnx"
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


def wait_readable(poller: select.poll, spin_s: float) -> None:
    end = time.perf_counter() + spin_s
    while not poller.poll(0):
        if time.perf_counter() >= end:
            poller.poll()
            return


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


def probe(mode: str, requests: int) -> list[float]:
    """Wake-ups in µs of one server process in ``mode`` (its first 20 requests not counted)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        ours.close()
        try:
            serve(theirs, mode)
        finally:
            os._exit(0)
    theirs.close()
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
    for _ in range(args.rounds):  # modes interleaved round by round: drift hits all alike
        for mode in MODES:
            wakes[mode] += probe(mode, args.requests)
    report = {}
    print(f"{'server waits':16} {'p10':>7} {'p50':>7} {'p90':>7}  µs from send to awake")
    for mode, values in wakes.items():
        deciles = statistics.quantiles(values, n=10)
        report[mode] = {"p10": deciles[0], "p50": statistics.median(values), "p90": deciles[-1]}
        print(f"{mode:16} {deciles[0]:7.1f} {statistics.median(values):7.1f} {deciles[-1]:7.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rounds": args.rounds, "wake_us": report}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
