"""A producer process for the integration tests: one model, one fixture image, a bounded loop.

    python -m tests.integration.producer SOCKET MODEL IMAGE --count N --seconds S [--slots K]

Keeps up to ``slots`` requests in flight, checks every answer against the fixture's known answer
and prints one JSON summary line: sent, ok, wrong, errors by type.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import Future
from typing import Any

from ipc.client import Client
from ipc.errors import DuomoError
from supervisor.image_files import read_image

EXPECTED = {
    "classify": ("coffee.png", lambda r: r["top"][0]["label"] == "espresso"),
    "face": ("astronaut.png", lambda r: len(r["faces"]) == 1 and r["faces"][0]["score"] > 0.8),
    "ocr": ("page.png", lambda r: r["lines"][0]["text"] == "Region-based segmentation"),
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("socket")
    parser.add_argument("model")
    parser.add_argument("image")
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--slots", type=int, default=2)
    args = parser.parse_args()
    check = EXPECTED[args.model][1]
    image = read_image(args.image)
    summary: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    with Client(args.socket, timeout_s=30) as client:
        model = client.model(args.model, slots=args.slots)
        print(json.dumps({"attached": args.model}), flush=True)
        deadline = time.monotonic() + args.seconds
        in_flight: list[Future[Any]] = []

        def settle(future: Future[Any]) -> None:
            try:
                result = future.result(120)
            except DuomoError as err:
                errors[type(err).__name__] += 1
                return
            summary["ok" if check(result) else "wrong"] += 1

        while summary["sent"] < args.count and time.monotonic() < deadline:
            in_flight.append(model.infer_async(image, timeout_s=60))
            summary["sent"] += 1
            if len(in_flight) >= args.slots:
                settle(in_flight.pop(0))
        for future in in_flight:
            settle(future)
    print(json.dumps({**summary, "errors": dict(errors)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
