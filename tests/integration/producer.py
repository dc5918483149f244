"""A producer process for the integration tests: one model, one fixture image, a bounded loop.

    python -m tests.integration.producer SOCKET MODEL IMAGE --count N --seconds S [--slots K]
        [--kind classify|face|ocr|affine] [--offset F]

Keeps up to ``slots`` requests in flight, checks every answer against the fixture's known answer
(``affine``: a raw model answering y = 2x + offset, for x = [[1, 2, 3, 4]]; IMAGE is ignored)
and prints one JSON summary line: sent, ok, wrong, errors by type, and the p50/p99 latency in ms
of the correct answers. An error does not stop it: every request sent is accounted for.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from duomo.ipc.client import Client
from duomo.ipc.errors import DuomoError
from duomo.supervisor.operators.image_files import read_image

EXPECTED = {
    "classify": ("coffee.png", lambda r: r["top"][0]["label"] == "espresso"),
    "face": ("astronaut.png", lambda r: len(r["faces"]) == 1 and r["faces"][0]["score"] > 0.8),
    "ocr": ("page.png", lambda r: r["lines"][0]["text"] == "Region-based segmentation"),
}


AFFINE_X = np.array([[1, 2, 3, 4]], dtype=np.float32)


def affine_check(offset: float) -> Callable[[Any], bool]:
    expected = 2 * AFFINE_X + np.float32(offset)
    return lambda result: bool(np.array_equal(result["y"], expected))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("socket")
    parser.add_argument("model")
    parser.add_argument("image")
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--kind", default=None, help="what answers to expect (default: MODEL)")
    parser.add_argument("--offset", type=float, default=1.0)
    args = parser.parse_args()
    kind = args.kind or args.model
    if kind == "affine":
        check, payload = affine_check(args.offset), AFFINE_X
    else:
        check, payload = EXPECTED[kind][1], read_image(args.image)
    summary: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    latencies: list[float] = []
    with Client(args.socket, timeout_s=60) as client:
        model = client.model(args.model, slots=args.slots)
        print(json.dumps({"attached": args.model}), flush=True)
        deadline = time.monotonic() + args.seconds
        in_flight: list[tuple[float, Future[Any]]] = []

        def settle(sent_at: float, future: Future[Any]) -> None:
            try:
                result = future.result(120)
            except DuomoError as err:
                errors[type(err).__name__] += 1
                return
            if check(result):
                summary["ok"] += 1
                latencies.append(time.perf_counter() - sent_at)
            else:
                summary["wrong"] += 1

        while summary["sent"] < args.count and time.monotonic() < deadline:
            try:
                in_flight.append((time.perf_counter(), model.infer_async(payload, timeout_s=60)))
            except DuomoError as err:  # refused before it was sent (the connection is gone)
                errors[type(err).__name__] += 1
            summary["sent"] += 1
            if len(in_flight) >= args.slots:
                settle(*in_flight.pop(0))
        for sent_at, future in in_flight:
            settle(sent_at, future)
    report: dict[str, Any] = {**summary, "errors": dict(errors)}
    if latencies:
        p50, p99 = np.percentile(np.array(latencies) * 1e3, [50, 99])
        report.update(p50_ms=round(float(p50), 2), p99_ms=round(float(p99), 2))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
