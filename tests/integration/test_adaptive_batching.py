"""``max_delay_ms: auto`` in a real supervisor: under a steady open-loop stream, a model whose
batches cost mostly a fixed part chooses a window and runs fuller batches; one whose cost is
linear never waits. (The rule's numbers, and a closed loop that switches the window off, are
tested on a fake clock: tests/unit/test_batch_window.py.)"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from duomo.ipc.client import Client
from tests.integration.harness import faulty_model, running_supervisor, write_config

# serial: the window follows an open-loop stream's timing (tests/conftest.py)
pytestmark = [pytest.mark.integration, pytest.mark.serial]
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


def window_during(watcher: Client, model: str, after_s: float) -> Future[float]:
    """``model``'s ``batch_window_ms`` read ``after_s`` from now, on a thread of its own (its
    stream runs on the caller's meanwhile)."""
    seen: Future[float] = Future()

    def read() -> None:
        time.sleep(after_s)
        try:
            seen.set_result(watcher.status().models[model].batch_window_ms)
        except BaseException as err:
            seen.set_exception(err)

    threading.Thread(target=read, daemon=True).start()
    return seen


def test_a_fixed_cost_gets_a_window_and_a_linear_one_does_not(tmp_path: Path) -> None:
    fixed = faulty_model("fixed", params={"work_ms": 20}, health={"slo_p99_ms": 400}, **AUTO)
    linear = faulty_model("linear", params={"item_ms": 4}, health={"slo_p99_ms": 400}, **AUTO)
    config = write_config(tmp_path, [], extra=[fixed, linear])
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=60) as client:
        # each model's window as it is while its stream still runs: once the stream ends, its
        # last fills gain nothing and switch the window off (rule 5), which is not under test
        with Client(sup.socket, timeout_s=60) as watcher:
            while_fixed = window_during(watcher, "fixed", after_s=2.0)
            assert stream(client, "fixed", 3.0, rate=150) > 0
            while_linear = window_during(watcher, "linear", after_s=2.0)
            assert stream(client, "linear", 3.0, rate=150) > 0
        models = client.status().models
    fixed_seen, linear_seen = models["fixed"], models["linear"]
    assert while_fixed.result(30) > 0, fixed_seen
    assert while_linear.result(30) == 0, linear_seen
    assert linear_seen.batch_window_ms == 0, linear_seen
    totals = fixed_seen.totals
    assert totals.inference_count / totals.execution_count > 2  # fuller batches
    assert fixed_seen.outcomes == {"ok": fixed_seen.requests}
