"""The floor of the per-request overhead: the least that any server in another process adds to
a request on this machine, measured next to Duomo's, in two shapes.

The floor server does nothing but the unavoidable: one client. Per request it receives the
image's shape (12 bytes) on a Unix socket, runs the same executor as every mode on the image the
client wrote into a shared-memory segment, writes the JSON result after it and answers the
result's length and its time in the executor (8 bytes). No validation, batching, deadline,
bookkeeping or protocol. The result travels as JSON encoded as Duomo encodes it (orjson).

- **one thread** (``floor``): the thread that receives the request runs it. What this costs
  (two process wake-ups, the image read from memory another core wrote, the result's encoding)
  no server in another process can avoid.
- **two threads** (``design floor``, ``--handoff``): the receiving thread hands each request to
  a compute thread through a queue and goes back to the socket; the compute thread runs it and
  answers. That is the least Duomo's design asks for (a reactor thread that reads notices, a model
  worker thread that runs them), so whatever Duomo adds on top of it is Duomo's own code.

Server side: ``python -m tools.bench.floor CONFIG MODEL SOCKET [--handoff]``, started by
``tools.bench.servers.FloorServer``; it prints ``ready SHM_NAME`` once its executor is warm,
serves one client and exits when that client disconnects. Client side: ``floor_sender`` (used
by ``tools.bench.producer``); it maps the segment before it connects, and the server removes the
segment's name as soon as it has accepted, so nothing is left in /dev/shm however either ends.
"""

from __future__ import annotations

import functools
import queue
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np
import orjson

from duomo.supervisor.core.memory import tune_heap
from duomo.worker.executors.base import IMAGE_SLOT_BYTES, JSON_RESULT_BYTES, Executor
from tools.bench.answers import Reply
from tools.bench.inprocess import open_executor, run_timed

_SHAPE = struct.Struct("<3I")  # height, width, channels (0: a 2-D gray image)
_ANSWER = struct.Struct("<II")  # the result's length, the µs spent in the executor


def _image(buffer: memoryview, h: int, w: int, c: int) -> np.ndarray:
    return np.ndarray((h, w, c) if c else (h, w), np.uint8, buffer)


def serve(config: str, model: str, socket_path: str, handoff: bool = False) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stopped before a client came
    tune_heap()  # as the supervisor process does
    executor = open_executor(config, model, threads=1)
    shm = shared_memory.SharedMemory(create=True, size=IMAGE_SLOT_BYTES + JSON_RESULT_BYTES)
    buf = shm.buf
    assert buf is not None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unlinked = False
    try:
        listener.bind(socket_path)
        listener.listen(1)
        print(f"ready {shm.name}", flush=True)
        conn, _ = listener.accept()
        shm.unlink()  # the client mapped it before connecting
        unlinked = True
        with conn:
            answer = functools.partial(_answer, executor, buf, conn)
            if handoff:
                _receive_and_hand_off(conn, answer)
            else:
                while len(head := conn.recv(_SHAPE.size, socket.MSG_WAITALL)) == _SHAPE.size:
                    answer(head)
    finally:
        listener.close()
        executor.close()
        del buf
        shm.close()
        if not unlinked:
            shm.unlink()


def _answer(executor: Executor, buf: memoryview, conn: socket.socket, head: bytes) -> None:
    """Run the request whose image shape is ``head`` and answer it."""
    result, compute_us = run_timed(executor, _image(buf, *_SHAPE.unpack(head)))
    blob = orjson.dumps(result)  # as Duomo encodes a result
    buf[IMAGE_SLOT_BYTES : IMAGE_SLOT_BYTES + len(blob)] = blob
    conn.sendall(_ANSWER.pack(len(blob), compute_us))


def _receive_and_hand_off(conn: socket.socket, answer: Callable[[bytes], None]) -> None:
    """This thread receives; a compute thread answers what it hands over (None: the end)."""
    handed: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def compute() -> None:
        try:
            while (head := handed.get()) is not None:
                answer(head)
        except BaseException:
            conn.shutdown(socket.SHUT_RDWR)  # the client sees EOF instead of waiting forever
            raise

    worker = threading.Thread(target=compute, name="floor-compute")
    worker.start()
    try:
        while len(head := conn.recv(_SHAPE.size, socket.MSG_WAITALL)) == _SHAPE.size:
            handed.put(head)
    finally:
        handed.put(None)
        worker.join()


def floor_sender(target: dict[str, Any]) -> Callable[[np.ndarray], Reply]:
    """A producer's ``send`` for the floor server: the image into the segment, its shape on the
    socket, the result's JSON from the segment."""
    shm = shared_memory.SharedMemory(name=target["shm"])
    # the server's segment: this process must not remove it at exit
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(target["socket"])

    def send(image: np.ndarray) -> Reply:
        buf = shm.buf  # (the closure keeps the segment mapped)
        assert buf is not None
        h, w = image.shape[:2]
        c = image.shape[2] if image.ndim == 3 else 0
        _image(buf, h, w, c)[...] = image
        conn.sendall(_SHAPE.pack(h, w, c))
        length, compute_us = _ANSWER.unpack(conn.recv(_ANSWER.size, socket.MSG_WAITALL))
        result = orjson.loads(buf[IMAGE_SLOT_BYTES : IMAGE_SLOT_BYTES + length])
        return Reply(result, compute_us / 1e6)

    return send


if __name__ == "__main__":
    config, model, socket_path, *flags = sys.argv[1:]
    serve(config, model, socket_path, handoff=flags == ["--handoff"])
