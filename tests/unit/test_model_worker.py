"""Model workers with event gates: which requests ran together, and how failures stay contained."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import pytest

from duomo.ipc.errors import DuomoError, ErrorCode, InvalidArgumentError
from duomo.worker.backends.ort_backend import OrtBackend
from duomo.worker.executors.base import Executor, NoParams, StageTimer
from duomo.worker.health import HealthPolicy
from duomo.worker.model_spec import ModelSpec, ModelState
from duomo.worker.request import Outcome, Request
from duomo.worker.served_model import ServedModel
from tests.conftest import poll


class GatedExecutor(Executor):
    """Records every batch; the first batch blocks until the test opens the gate."""

    roles = ()
    batches: list[list[Any]]
    gate: threading.Event
    entered: threading.Event

    def prepare(self, payload: Any) -> Any:
        if payload == "bad":
            raise InvalidArgumentError("bad payload")
        if payload == "crash-prepare":
            raise ZeroDivisionError("bug in preprocessing")
        return payload

    def execute(self, items: Sequence[Any], timer: StageTimer) -> list[Any]:
        cls = type(self)
        cls.batches.append(list(items))
        if len(cls.batches) == 1:
            cls.entered.set()
            assert cls.gate.wait(10)
        if "explode" in items:
            raise RuntimeError("backend fell over")
        return [f"done:{x}" for x in items]


@pytest.fixture
def gated() -> Iterator[type[GatedExecutor]]:
    GatedExecutor.batches = []
    GatedExecutor.gate = threading.Event()
    GatedExecutor.entered = threading.Event()
    yield GatedExecutor
    GatedExecutor.gate.set()


def serve(executor: type[Executor], max_batch: int, instances: int = 1) -> ServedModel:
    spec = ModelSpec(
        name="m",
        task="test",
        executor=executor,
        params=NoParams(),
        files={},
        instances=instances,
        max_batch=max_batch,
        max_delay_s=0.0,
        queue_size=100,
    )
    model = ServedModel(spec, OrtBackend(), gates=None)
    model.load()
    return model


def submit(model: ServedModel, payload: Any) -> Future[Outcome]:
    future: Future[Outcome] = Future()
    model.submit(payload, future.set_result)
    return future


def test_requests_queued_behind_a_busy_worker_run_together(gated: type[GatedExecutor]) -> None:
    model = serve(gated, max_batch=3)
    try:
        first = submit(model, "r1")
        assert gated.entered.wait(10)  # r1 is executing alone; the rest queue up behind it
        rest = [submit(model, f"r{i}") for i in range(2, 7)]
        gated.gate.set()
        outcomes = [f.result(10) for f in [first, *rest]]
    finally:
        model.stop()
    assert gated.batches == [["r1"], ["r2", "r3", "r4"], ["r5", "r6"]]
    assert [o.result for o in outcomes] == [f"done:r{i}" for i in range(1, 7)]
    assert [o.batch_size for o in outcomes] == [1, 3, 3, 3, 2, 2]
    assert model.stats.snapshot().batch_sizes == {"1": 1, "2": 1, "3": 1}


def test_a_bad_request_fails_alone(gated: type[GatedExecutor]) -> None:
    model = serve(gated, max_batch=4)
    try:
        blocker = submit(model, "block")
        assert gated.entered.wait(10)
        futures = [submit(model, p) for p in ("a", "bad", "crash-prepare", "b")]
        gated.gate.set()
        blocker.result(10)
        outcomes = [f.result(10) for f in futures]
    finally:
        model.stop()
    assert [o.code for o in outcomes] == [
        ErrorCode.OK,
        ErrorCode.INVALID_ARGUMENT,
        ErrorCode.INTERNAL,
        ErrorCode.OK,
    ]
    assert gated.batches[-1] == ["a", "b"]
    assert "bad payload" in str(outcomes[1].error)
    assert "ZeroDivisionError" not in str(outcomes[2].error)  # no internals leak to the caller


def test_a_backend_failure_fails_the_whole_batch(gated: type[GatedExecutor]) -> None:
    model = serve(gated, max_batch=4)
    try:
        blocker = submit(model, "block")
        assert gated.entered.wait(10)
        futures = [submit(model, p) for p in ("a", "explode", "b")]
        gated.gate.set()
        blocker.result(10)
        outcomes = [f.result(10) for f in futures]
        after = submit(model, "c").result(10)  # the model keeps serving
    finally:
        model.stop()
    assert all(o.code is ErrorCode.INTERNAL for o in outcomes)
    assert after.result == "done:c"
    assert model.stats.snapshot().outcomes == {"ok": 2, "internal": 3}


def test_stop_finishes_queued_work_within_the_grace_period(gated: type[GatedExecutor]) -> None:
    model = serve(gated, max_batch=1)
    blocker = submit(model, "block")
    assert gated.entered.wait(10)
    queued = [submit(model, f"q{i}") for i in range(3)]
    threading.Timer(0.2, gated.gate.set).start()
    model.stop(timeout_s=30)
    assert blocker.result(10).code is ErrorCode.OK
    assert all(f.result(10).code is ErrorCode.OK for f in queued)
    with pytest.raises(DuomoError) as info:
        model.submit("late", lambda _o: None)
    assert info.value.code is ErrorCode.UNAVAILABLE


def test_stop_fails_what_is_still_queued_after_the_grace_period(
    gated: type[GatedExecutor],
) -> None:
    model = serve(gated, max_batch=1)
    blocker = submit(model, "block")
    assert gated.entered.wait(10)
    queued = [submit(model, f"q{i}") for i in range(3)]
    cut = model.stop(timeout_s=0.1)  # the worker is stuck in the first batch: all is cut
    assert [f.result(10).code for f in queued] == [ErrorCode.UNAVAILABLE] * 3
    assert blocker.result(10).code is ErrorCode.UNAVAILABLE  # its batch, too, is answered
    assert cut == 4
    gated.gate.set()  # the abandoned batch ends later; its answer is not sent twice


def test_two_instances_share_one_queue_and_never_split_a_forming_batch(
    gated: type[GatedExecutor],
) -> None:
    gated.gate.set()
    model = serve(gated, max_batch=4, instances=2)
    try:
        futures = [submit(model, f"r{i}") for i in range(12)]
        outcomes = [f.result(10) for f in futures]
    finally:
        model.stop()
    assert all(o.code is ErrorCode.OK for o in outcomes)
    ran = sorted(x for batch in gated.batches for x in batch)
    assert ran == sorted(f"r{i}" for i in range(12))  # each request ran exactly once
    assert all(1 <= len(batch) <= 4 for batch in gated.batches)


def test_load_failure_names_the_model() -> None:
    class Broken(Executor):
        roles = ()

        def __init__(self, *args: Any) -> None:
            raise ValueError("weights are corrupt")

        def prepare(self, payload: Any) -> Any:
            return payload

        def execute(self, items: Sequence[Any], timer: StageTimer) -> list[Any]:
            return list(items)

    with pytest.raises(RuntimeError, match="model 'm' failed to load: weights are corrupt"):
        serve(Broken, max_batch=1)


def test_a_broken_callback_does_not_stop_the_batch(gated: type[GatedExecutor]) -> None:
    model = serve(gated, max_batch=4)
    try:
        blocker = submit(model, "block")
        assert gated.entered.wait(10)

        def explode(_outcome: Outcome) -> None:
            raise RuntimeError("caller bug")

        model.submit("a", explode)
        after = submit(model, "b")
        gated.gate.set()
        blocker.result(10)
        assert after.result(10).result == "done:b"
        assert submit(model, "c").result(10).result == "done:c"
    finally:
        model.stop()


def test_an_operator_unload_answers_requests_waiting_for_a_load(
    gated: type[GatedExecutor],
) -> None:
    """A request for an unloaded model waits for its load; an operator's unload meanwhile
    answers it, and from then on requests are refused at once (never queued and stranded)."""
    wanted: list[str] = []
    spec = ModelSpec(name="m", task="test", executor=gated, params=NoParams(), files={})
    model = ServedModel(spec, OrtBackend(), gates=None, on_demand=lambda m: wanted.append("load"))
    waiting = submit(model, "r1")
    assert wanted == ["load"] and model.pending == 1
    assert model.unload() == 1
    assert waiting.result(10).code is ErrorCode.UNAVAILABLE
    with pytest.raises(DuomoError, match="duomo load m"):
        model.submit("r2", lambda _o: None)
    with pytest.raises(DuomoError):  # even a caller that read the state before the unload
        model.batcher.put(Request(payload="r3", on_done=lambda _o: None))
    model.load()
    gated.gate.set()
    assert submit(model, "r4").result(10).result == "done:r4"
    model.stop()


@pytest.mark.parametrize("policy", ["wait", "fail"])
def test_requests_during_a_reinitialization_wait_or_fail_as_configured(
    gated: type[GatedExecutor], policy: str
) -> None:
    gated.gate.set()
    health = HealthPolicy(backoff_ms=300, while_reinitializing=policy)  # type: ignore[arg-type]
    spec = ModelSpec(
        name="m", task="test", executor=gated, params=NoParams(), files={}, health=health
    )
    model = ServedModel(spec, OrtBackend(), gates=None)
    model.load()
    restart = threading.Thread(target=model.reinitialize, args=("test", threading.Event()))
    restart.start()
    poll(lambda: model.state is ModelState.REINITIALIZING, timeout_s=5)  # (its 300 ms backoff)
    if policy == "wait":
        waiting = submit(model, "during")
        assert waiting.result(10).result == "done:during"  # served by the new instance
    else:
        with pytest.raises(DuomoError, match="re-initializing"):
            model.submit("during", lambda _o: None)
    restart.join(10)
    assert model.state is ModelState.READY
    assert submit(model, "after").result(10).result == "done:after"
    model.stop()
