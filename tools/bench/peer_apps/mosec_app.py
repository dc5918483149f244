"""Mosec service for ``duomo bench``: one route per model (``/<model>``), one worker process per
model running its Duomo executor. Request body: height, width, channels as three little-endian
uint32, then the uint8 pixels; response: JSON ``{"result": the result dict, "compute_us": the
time the worker spent in the executor}``.

Run by ``tools.bench.peers`` with the Mosec environment's Python:
``python mosec_app.py --address 127.0.0.1 --port P --timeout 60000``, with DUOMO_ROOT,
DUOMO_BENCH_CONFIG and DUOMO_BENCH_MODELS (comma-separated) in the environment.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
from mosec import Runtime, Server, Worker

sys.path.append(os.environ["DUOMO_ROOT"])


class _DuomoTask(Worker):
    model = ""

    def __init__(self) -> None:
        super().__init__()
        from tools.bench.inprocess import open_executor, run_timed

        self.run_timed = run_timed
        self.executor = open_executor(os.environ["DUOMO_BENCH_CONFIG"], self.model, threads=1)

    def deserialize(self, data: bytes) -> Any:
        h, w, c = np.frombuffer(data, dtype="<u4", count=3)
        return np.frombuffer(data, dtype=np.uint8, offset=12).reshape(h, w, c)

    def forward(self, data: Any) -> Any:
        result, compute_us = self.run_timed(self.executor, data)
        return {"result": result, "compute_us": compute_us}

    def serialize(self, data: Any) -> bytes:
        return json.dumps(data).encode()


# one Worker class per model, at module level so Mosec's spawned worker processes find them
TASKS = {
    name: type(f"Task_{name}", (_DuomoTask,), {"model": name, "__module__": __name__})
    for name in os.environ["DUOMO_BENCH_MODELS"].split(",")
}
globals().update({cls.__name__: cls for cls in TASKS.values()})

if __name__ == "__main__":
    server = Server()
    server.register_runtime(
        {f"/{name}": [Runtime(cls, num=1, timeout=60)] for name, cls in TASKS.items()}
    )
    server.run()
