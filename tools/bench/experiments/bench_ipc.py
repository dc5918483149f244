"""Data-plane benchmark: one request's round trip through Duomo's shared-memory slots, next to
the same bytes through ``multiprocessing.Queue`` (pickle), through a plain Unix socket, and a
bare ``memcpy`` of the payload as the floor.

``bare`` is the floor of the design itself, with none of Duomo's code: the producer writes the
payload into an anonymous shared mapping and sends 8 bytes on a Unix socket; in the server a
reactor thread (``selectors``) hands the notice to a worker thread through a condition, the
worker copies the input region to the output region (the identity model's copy) and answers with
8 bytes. What Duomo adds to a round trip is ``duomo`` minus ``bare``.

Run by whoever changes the data path, on an otherwise idle machine::

    python -m tools.bench.experiments.bench_ipc [--rounds 3] [--seconds 2] [--json OUT]

Every path is a round trip to another process and back: Duomo through a supervisor serving a
``raw`` identity model (ONNX ``Identity``, uint8, dynamic size), the others through an echo
process. Payloads: 1 KB, 150 KB (224×224×3), 1.2 MB (640×640×3), 6.2 MB (1920×1080×3). Modes
are interleaved round by round so drift hits all of them alike. ``--cpus 0`` pins every process
to one CPU, which shows how much of a round trip is cross-CPU wake-up latency. The Duomo
producer uses the zero-copy slot API: it copies the payload into the slot (the one copy a
producer that already holds the bytes cannot avoid) and reads the answer in place.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import mmap
import multiprocessing as mp
import os
import platform
import selectors
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from duomo.ipc.client import Client
from duomo.supervisor.process.daemon import start_background, wait_for_exit

PAYLOADS = {
    "1 KB": 1024,
    "150 KB": 224 * 224 * 3,
    "1.2 MB": 640 * 640 * 3,
    "6.2 MB": 1920 * 1080 * 3,
}
_LEN = struct.Struct("<Q")


def identity_model(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.UINT8, ["batch", "n"])
    y = helper.make_tensor_value_info("y", TensorProto.UINT8, ["batch", "n"])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def _queue_echo(inbox: Any, outbox: Any) -> None:
    while (item := inbox.get()) is not None:
        outbox.put(item)


def _socket_echo(sock: socket.socket) -> None:
    view = bytearray(max(PAYLOADS.values()))
    while True:
        header = sock.recv(_LEN.size, socket.MSG_WAITALL)
        if len(header) < _LEN.size:
            return
        (n,) = _LEN.unpack(header)
        got = 0
        while got < n:
            got += sock.recv_into(memoryview(view)[got:n], n - got)
        sock.sendall(header)
        sock.sendall(memoryview(view)[:n])


def _bare_server(sock: socket.socket, parent_end: socket.socket, memory: mmap.mmap) -> None:
    """The bare topology's server: reactor thread → condition → worker thread → answer."""
    parent_end.close()  # inherited by the fork: the parent closing its end must mean EOF here
    half = len(memory) // 2
    region = np.frombuffer(memory, dtype=np.uint8)
    inputs, outputs = region[:half], region[half:]
    queue: list[bytes] = []
    cond = threading.Condition(threading.Lock())

    def worker() -> None:
        while True:
            with cond:
                while not queue:
                    cond.wait()
                header = queue.pop()
            if not header:
                return
            (n,) = _LEN.unpack(header)
            np.copyto(outputs[:n], inputs[:n])
            sock.send(header)

    thread = threading.Thread(target=worker)
    thread.start()
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    while True:
        selector.select()
        header = sock.recv(_LEN.size)
        with cond:
            queue.append(header)
            cond.notify()
        if not header:
            thread.join()
            return


def time_loop(call: Callable[[], None], seconds: float, min_calls: int = 20) -> list[float]:
    samples: list[float] = []
    end = time.perf_counter() + seconds
    while len(samples) < min_calls or time.perf_counter() < end:
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
        if len(samples) >= 200_000:
            break
    return samples


class Paths:
    """The four ways to move one payload there and back."""

    def __init__(self, socket_path: Path) -> None:
        # Forked first (it needs the anonymous shared mapping), before this process holds any
        # other socket or thread the child would inherit.
        self.bare_memory = mmap.mmap(-1, 2 * max(PAYLOADS.values()))
        self.bare_sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.bare_proc = mp.get_context("fork").Process(
            target=_bare_server, args=(theirs, self.bare_sock, self.bare_memory)
        )
        self.bare_proc.start()
        theirs.close()
        self.client = Client(socket_path)
        self.model = self.client.model("identity", slots=1)
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.queue_proc = ctx.Process(target=_queue_echo, args=(self.inbox, self.outbox))
        self.queue_proc.start()
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock_proc = ctx.Process(target=_socket_echo, args=(theirs,))
        self.sock_proc.start()
        theirs.close()
        self.echo_buffer = bytearray(max(PAYLOADS.values()))

    def duomo(self, payload: np.ndarray) -> Callable[[], None]:
        shape = (1, payload.size)

        def call() -> None:
            with self.model.slot() as slot:
                slot.input("x", shape)[0] = payload
                slot.submit()
                out = slot.wait()["y"]
                assert out.shape == shape

        return call

    def bare(self, payload: np.ndarray) -> Callable[[], None]:
        n = payload.nbytes
        inputs = np.frombuffer(self.bare_memory, dtype=np.uint8, count=n)
        header = _LEN.pack(n)

        def call() -> None:
            np.copyto(inputs, payload)
            self.bare_sock.sendall(header)
            self.bare_sock.recv(_LEN.size, socket.MSG_WAITALL)

        return call

    def queue(self, payload: np.ndarray) -> Callable[[], None]:
        def call() -> None:
            self.inbox.put(payload)
            back = self.outbox.get()
            assert back.size == payload.size

        return call

    def plain_socket(self, payload: np.ndarray) -> Callable[[], None]:
        n = payload.nbytes
        back = memoryview(self.echo_buffer)[:n]

        def call() -> None:
            self.sock.sendall(_LEN.pack(n))
            self.sock.sendall(payload.data)
            self.sock.recv(_LEN.size, socket.MSG_WAITALL)
            got = 0
            while got < n:
                got += self.sock.recv_into(back[got:], n - got)

        return call

    @staticmethod
    def memcpy(payload: np.ndarray) -> Callable[[], None]:
        target = np.empty_like(payload)

        def call() -> None:
            np.copyto(target, payload)

        return call

    def close(self) -> None:
        self.bare_sock.close()
        self.bare_proc.join(10)
        self.inbox.put(None)
        self.queue_proc.join(10)
        self.sock.close()
        self.sock_proc.join(10)
        self.client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.5, help="per mode, size and round")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--cpus",
        default=None,
        help="pin everything (supervisor, echo processes, producer) to these CPUs, e.g. 0",
    )
    args = parser.parse_args()
    if args.cpus:  # children inherit the mask
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})

    work = Path(tempfile.mkdtemp(prefix="duomo-bench-"))
    identity_model(work / "identity.onnx")
    config = work / "bench.yaml"
    raw_params = {"max_input_bytes": 8 << 20, "max_output_bytes": 8 << 20}
    config.write_text(
        yaml.safe_dump(
            {"models": [{"name": "identity", "task": "raw", "file": "identity.onnx",
                         "max_batch": 1, "params": raw_params}]}
        )
    )  # fmt: skip
    socket_path = work / "duomo.sock"
    if start_background(config, socket_path, "warning") != 0:
        return 1
    modes = ("memcpy", "bare", "duomo", "queue", "plain_socket")
    samples: dict[tuple[str, str], list[float]] = {(m, s): [] for m in modes for s in PAYLOADS}
    paths = Paths(socket_path)
    try:
        rng = np.random.default_rng(0)
        payloads = {s: rng.integers(0, 255, n, dtype=np.uint8) for s, n in PAYLOADS.items()}
        for payload in payloads.values():  # warm-up: first use of each size
            for mode in modes:
                time_loop(getattr(paths, mode)(payload), 0.1, 5)
        for r in range(args.rounds):
            order = modes if r % 2 == 0 else tuple(reversed(modes))
            for name, payload in payloads.items():
                for mode in order:
                    samples[(mode, name)] += time_loop(getattr(paths, mode)(payload), args.seconds)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        paths.close()
        with Client(socket_path) as client:
            client.request("stop")
        wait_for_exit(socket_path, 60)

    rows = []
    for name, n in PAYLOADS.items():
        floor = statistics.median(samples[("memcpy", name)])
        for mode in modes:
            values = np.array(samples[(mode, name)])
            p50, p99 = np.percentile(values, [50, 99])
            rows.append({
                "payload": name, "bytes": n, "mode": mode, "calls": len(values),
                "p50_us": p50 * 1e6, "p99_us": p99 * 1e6,
                "per_s": 1 / values.mean(), "mb_per_s": n / values.mean() / 1e6,
                "p50_vs_memcpy": p50 / floor,
            })  # fmt: skip
    print("| payload | path | calls | p50 µs | p99 µs | round trips/s | MB/s | p50 ÷ memcpy |")
    print("|---|---|--:|--:|--:|--:|--:|--:|")
    for row in rows:
        print(
            f"| {row['payload']} | {row['mode']} | {row['calls']} | {row['p50_us']:.1f} | "
            f"{row['p99_us']:.1f} | {row['per_s']:.0f} | {row['mb_per_s']:.0f} | "
            f"{row['p50_vs_memcpy']:.1f}× |"
        )
    if args.json:
        meta = {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "pinned_to": args.cpus,
        }  # fmt: skip
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
