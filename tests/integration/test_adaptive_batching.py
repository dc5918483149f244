"""``max_delay_ms: auto`` in a real supervisor: under a steady open-loop stream, a model whose
batches cost mostly a fixed part chooses a window and runs fuller batches; one whose cost is
linear never waits. (The rule's numbers, and a closed loop that switches the window off, are
tested on a fake clock: tests/unit/test_batch_window.py.)"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from duomo.ipc.client import Client
from tests.integration.harness import faulty_model, running_supervisor, write_config

pytestmark = pytest.mark.integration
X = np.array([[1, 2, 3, 4]], dtype=np.float32)
AUTO = {"max_batch": 8, "max_delay_ms": "auto", "instances": 1}


def stream(client: Client, model: str, seconds: float, rate: float) -> int:
    """Requests sent at ``rate`` per second for ``seconds`` (open loop: they keep arriving
    while a batch fills); every answer checked."""
    handle = client.model(model, slots=32)
    pending: deque[Future[Any]] = deque()
    started = time.monotonic()
    for i in range(int(seconds * rate)):
        delay = started + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # open loop: each request goes when it is due
        pending.append(handle.infer_async(X))
        while pending and pending[0].done():
            assert pending.popleft().result()["y"][0, 0] == 3.0
    while pending:
        assert pending.popleft().result(30)["y"][0, 0] == 3.0
    return int(seconds * rate)


def test_a_fixed_cost_gets_a_window_and_a_linear_one_does_not(tmp_path: Path) -> None:
    fixed = faulty_model("fixed", params={"work_ms": 20}, health={"slo_p99_ms": 400}, **AUTO)
    linear = faulty_model("linear", params={"item_ms": 4}, health={"slo_p99_ms": 400}, **AUTO)
    config = write_config(tmp_path, [], extra=[fixed, linear])
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=60) as client:
        assert stream(client, "fixed", 3.0, rate=150) > 0
        assert stream(client, "linear", 3.0, rate=150) > 0
        models = client.status()["models"]
    fixed_seen, linear_seen = models["fixed"], models["linear"]
    assert fixed_seen["batch_window_ms"] > 0, fixed_seen
    assert linear_seen["batch_window_ms"] == 0, linear_seen
    totals = fixed_seen["totals"]
    assert totals["inference_count"] / totals["execution_count"] > 2  # fuller batches
    assert fixed_seen["outcomes"] == {"ok": fixed_seen["requests"]}
