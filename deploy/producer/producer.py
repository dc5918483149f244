"""A producer in a container of its own, beside a supervisor's: it feeds one model frames through
shared memory and prints one JSON line per answer.

It stands for a real producer image (a video decoder, a business service): it needs only the
``ipc`` package, numpy, orjson and structlog — no backend, no model — and reaches the supervisor
through the one volume the containers share: the socket directory (the socket and its key file,
``$DUOMO_SOCKET``). Its rings come over that socket: sealed memfd segments the supervisor
creates and passes with SCM_RIGHTS, so it shares no ``/dev/shm`` and no IPC namespace with the
supervisor. It must run as the supervisor's user id: the directory is 0700, the socket and the
key file 0600.

    python producer.py --model classify --frame /opt/producer/frames/coffee.npy [--frames N]

The supervisor may still be loading its models when this starts, or be restarted under it: the
producer waits for it (``--wait-s``) and attaches again. ``--frames 0`` runs until SIGTERM.
Exit status 0 when every frame was answered (or SIGTERM came), 1 on an error answer or when no
supervisor came within ``--wait-s``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from duomo.ipc.client import Client
from duomo.ipc.errors import DuomoError, UnavailableError


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The short form of an answer: the best label, the faces, or the text lines."""
    if "top" in result:
        best = result["top"][0]
        return {"label": best["label"], "score": round(best["score"], 3)}
    if "faces" in result:
        return {"faces": len(result["faces"]), "boxes": [f["box"] for f in result["faces"]]}
    if "lines" in result:
        return {"lines": len(result["lines"]), "text": [line["text"] for line in result["lines"]]}
    return {name: list(np.shape(value)) for name, value in result.items()}


def connect(socket: Path | None, wait_s: float, stop: threading.Event) -> Client:
    """A client of the supervisor at ``socket``, waiting up to ``wait_s`` for it to serve."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return Client(socket, timeout_s=10)
        except (DuomoError, OSError) as err:
            if time.monotonic() > deadline or stop.is_set():
                raise SystemExit(f"producer: no supervisor after {wait_s:.0f} s: {err}") from err
            stop.wait(0.5)


def feed(args: argparse.Namespace, frame: np.ndarray, stop: threading.Event) -> int:
    """Send ``frame`` until ``args.frames`` are answered (or SIGTERM); attach again, after
    waiting, whenever the supervisor goes away (a restart, a new pod's container)."""
    index = 0
    while not stop.is_set() and (args.frames == 0 or index < args.frames):
        try:
            with connect(args.socket, args.wait_s, stop) as client:
                model = client.model(args.model, slots=2)
                while not stop.is_set() and (args.frames == 0 or index < args.frames):
                    sent = time.perf_counter()
                    result = model.infer(frame, timeout_s=120)
                    answer = {
                        "model": args.model,
                        "frame": index,
                        "answer": summary(result),
                        "round_trip_ms": round((time.perf_counter() - sent) * 1000, 1),
                    }
                    print(json.dumps(answer), flush=True)
                    index += 1
                    stop.wait(args.interval_s)
        except UnavailableError as err:  # the supervisor went away: wait for the next one
            print(json.dumps({"model": args.model, "frame": index, "reconnecting": str(err)}))
        except DuomoError as err:
            print(json.dumps({"model": args.model, "frame": index, "error": str(err)}))
            return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description="feed one model frames through shared memory")
    parser.add_argument("--model", required=True)
    parser.add_argument("--frame", type=Path, required=True, help="a uint8 H×W×3 RGB .npy")
    parser.add_argument("--frames", type=int, default=4, help="0: until SIGTERM")
    parser.add_argument("--interval-s", type=float, default=0.0, help="pause between frames")
    parser.add_argument("--socket", type=Path, default=None, help="default: $DUOMO_SOCKET")
    parser.add_argument("--wait-s", type=float, default=300.0, help="for the supervisor")
    args = parser.parse_args()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return feed(args, np.load(args.frame), stop)


if __name__ == "__main__":
    sys.exit(main())
