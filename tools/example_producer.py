"""An example producer: a separate process that feeds frames to a running supervisor through
shared-memory slots, zero-copy, and prints what comes back.

    duomo start -c configs/default.yaml
    python tools/example_producer.py [--socket PATH] [--frames N]

For each demo model it attaches a ring of two slots and keeps both in flight: while the
supervisor works on one frame, the producer writes the next one straight into the other slot
(``slot.input(...)`` is a numpy view of shared memory: a decoder that can write into a caller's
buffer fills it with no copy at all; here the fixture image is copied in once). Results are
read in place from the same slot.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from duomo import Client, Slot
from duomo.supervisor.operators.image_files import read_image

IMAGES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "images"
FEEDS = {"classify": "coffee.png", "face": "astronaut.png", "ocr": "page.png"}


def summary(model: str, result: dict[str, Any]) -> str:
    if model == "classify":
        best = result["top"][0]
        return f"{best['label']} ({best['score']:.2f})"
    if model == "face":
        boxes = ", ".join(
            "[" + " ".join(f"{v:.0f}" for v in f["box"]) + "]" for f in result["faces"]
        )
        return f"{len(result['faces'])} face(s) {boxes}"
    lines = result["lines"]
    return f"{len(lines)} line(s), first: {lines[0]['text']!r}" if lines else "no text"


def decode_into(slot: Slot, frame: np.ndarray) -> None:
    """Stand-in for a video decoder writing its output straight into the slot."""
    slot.input("image", frame.shape)[...] = frame


def run(client: Client, model_name: str, frames: int) -> None:
    model = client.model(model_name, slots=2)
    frame = read_image(IMAGES / FEEDS[model_name])
    in_flight: deque[tuple[Slot, float, int]] = deque()
    started = time.perf_counter()
    for index in range(frames):
        slot = model.slot()  # blocks while both slots are in flight
        decode_into(slot, frame)
        sent = time.perf_counter()  # before submit: the supervisor may answer before it returns
        slot.submit(timeout_s=30)
        in_flight.append((slot, sent, index))
        if len(in_flight) == 2 or index == frames - 1:
            while in_flight and (len(in_flight) == 2 or index == frames - 1):
                done, sent, number = in_flight.popleft()
                result = done.wait()
                took = (time.perf_counter() - sent) * 1e3
                infer_ms = done.timings_us["infer"] / 1e3
                print(
                    f"  {model_name:<8} frame {number}: {summary(model_name, result)}"
                    f"  [{took:.1f} ms round trip, {infer_ms:.1f} ms in the model]"
                )
                done.release()
    rate = frames / (time.perf_counter() - started)
    print(f"  {model_name}: {frames} frames, {rate:.1f} frames/s")
    model.close()


def main() -> int:
    parser = argparse.ArgumentParser(description="feed frames to a running Duomo supervisor")
    parser.add_argument("--socket", default=None, help="default: $DUOMO_SOCKET or the runtime dir")
    parser.add_argument("--frames", type=int, default=4)
    args = parser.parse_args()
    with Client(args.socket) as client:
        models = [m.name for m in client.models()]
        print(f"producer pid {__import__('os').getpid()}: supervisor serves {models}")
        for name in FEEDS:
            if name in models:
                run(client, name, args.frames)
    return 0


if __name__ == "__main__":
    sys.exit(main())
