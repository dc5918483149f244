"""The background loads with the budgeted load handed in as a callable: a waiting request gets
one load on demand, and under ``preload_policy: predictive`` the model likely to come next
loads ahead of its request, evicting none of those at least as likely, and counts its hit."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from duomo.supervisor.core.background_loads import BackgroundLoads
from duomo.worker.backends.ort_backend import OrtBackend
from duomo.worker.executors.base import Executor, NoParams, StageTimer
from duomo.worker.model_spec import ModelSpec, ModelState
from duomo.worker.request import Outcome
from duomo.worker.served_model import ServedModel
from tests.conftest import poll

pytestmark = pytest.mark.unit


class Echo(Executor):
    roles = ()

    def prepare(self, payload: Any) -> Any:
        return payload

    def execute(self, items: Sequence[Any], timer: StageTimer) -> list[Any]:
        return [f"done:{x}" for x in items]


def ask(model: ServedModel, payload: str) -> Any:
    future: Future[Outcome] = Future()
    model.submit(payload, future.set_result)
    return future.result(10).result


def test_loads_on_demand_and_ahead_of_the_next_request_go_through_the_load_handed_in() -> None:
    calls: list[tuple[str, set[str]]] = []

    def budgeted_load(model: ServedModel, keep: set[str]) -> None:
        calls.append((model.spec.name, set(keep)))
        model.load(10.0)

    models: dict[str, ServedModel] = {}
    config = SimpleNamespace(preload_policy="predictive", predictive_threshold=0.5)
    loads = BackgroundLoads(budgeted_load, threading.RLock(), models, lambda: config)
    for name in ("a", "b"):
        spec = ModelSpec(name=name, task="test", executor=Echo, params=NoParams(), files={})
        models[name] = ServedModel(
            spec, OrtBackend(), gates=None, on_demand=loads.demand, on_request=loads.observe
        )
    a, b = models["a"], models["b"]
    try:
        assert ask(a, "1") == "done:1"  # waited for its load on demand
        assert ask(b, "2") == "done:2"  # (a → b learned)
        poll(b.evict)  # (once its load and its request have ended)
        assert ask(a, "3") == "done:3"  # b comes next after a: it loads ahead, keeping a
        poll(lambda: b.state is ModelState.READY and b.predictions.loads == 1)
        assert b.predictions.to_dict() == {"loads": 1, "hits": 0, "wasted": 0}
        assert ask(b, "4") == "done:4"
        assert b.predictions.to_dict() == {"loads": 1, "hits": 1, "wasted": 0}
        assert calls == [("a", set()), ("b", set()), ("b", {"a"})]
    finally:
        loads.close()
        for model in models.values():
            model.stop()
