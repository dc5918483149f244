"""``ipc.status_records``: each record reads the documented JSON back exactly (key for key, in
order), a missing or mistyped key is an error naming the record and the key, and ``duomo
status`` and its ``--watch`` view count a model's errors the same way; a pipeline's record, and
a reply older than pipelines read as none."""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
from pathlib import Path
from typing import Any

import pytest

from duomo.gateway.link import SupervisorLink
from duomo.ipc.errors import DuomoError, ErrorCode, InvalidArgumentError
from duomo.ipc.status_records import (
    ClientStatus,
    DeviceStatus,
    GatewayWorkerStatus,
    ModelInfo,
    ModelStatus,
    PipelineStatus,
    PipelineStepStatus,
    StatusRecordError,
    SupervisorStatus,
)
from duomo.supervisor.operators.status_table import render_status
from duomo.supervisor.operators.status_watch import Frame, plain_frame
from duomo.supervisor.process.control_messages import Status, parse_control
from tests.status_fixtures import DOCUMENTED_MODELS, DOCUMENTED_STATUS, model_entry, status_entry
from tests.unit.test_pipeline_table import pipeline


def test_the_documented_status_reads_back_exactly() -> None:
    status = SupervisorStatus.from_dict(DOCUMENTED_STATUS)
    assert status.to_dict() == DOCUMENTED_STATUS
    assert json.dumps(status.to_dict()) == json.dumps(DOCUMENTED_STATUS)  # the keys' order too
    classify = status.models["classify"]
    assert classify.totals.timed["success"].count == 1 and classify.memory.loaded
    assert classify.compute is not None and classify.latency_ms("p99") == 9.112


@pytest.mark.parametrize(
    ("record", "entry"),
    [
        (ModelStatus, DOCUMENTED_STATUS["models"]["classify"]),
        (DeviceStatus, DOCUMENTED_STATUS["devices"][0]),
        (ClientStatus, DOCUMENTED_STATUS["clients"][0]),
        (GatewayWorkerStatus, DOCUMENTED_STATUS["gateways"][0]),
        *((ModelInfo, info) for info in DOCUMENTED_MODELS),
    ],
)
def test_each_record_reads_its_documented_entry_back_exactly(
    record: Any, entry: dict[str, Any]
) -> None:
    assert json.dumps(record.from_dict(entry).to_dict()) == json.dumps(entry)


def test_models_reply_before_and_after_a_load() -> None:
    loaded, raw, unloaded = (ModelInfo.from_dict(info) for info in DOCUMENTED_MODELS)
    assert loaded.loaded and loaded.result == "json" and loaded.batched is False
    assert raw.output_tensors is not None and raw.output_tensors[0].shape == (None, 4)
    assert not unloaded.loaded and "inputs" not in unloaded.to_dict()


def test_the_load_reply_is_a_model_status_without_compute_shares() -> None:
    entry = model_entry()
    del entry["compute"]
    shown = ModelStatus.from_dict(entry)
    assert shown.compute is None and shown.to_dict() == entry


def without(entry: dict[str, Any], *path: str | int) -> dict[str, Any]:
    """``entry`` with the key at ``path`` removed."""
    copied = copy.deepcopy(entry)
    inner: Any = copied
    for step in path[:-1]:
        inner = inner[step]
    del inner[path[-1]]
    return copied


@pytest.mark.parametrize(
    ("path", "record", "key"),
    [
        (("pid",), "SupervisorStatus", "pid"),
        (("models", "classify", "requests"), "ModelStatus", "requests"),
        (("models", "classify", "refused"), "ModelStatus", "refused"),
        (("models", "classify", "totals", "inference_count"), "Totals", "inference_count"),
        (("models", "classify", "memory", "charged_bytes"), "ModelMemory", "charged_bytes"),
        (("devices", 0, "used_bytes"), "DeviceStatus", "used_bytes"),
        (("clients", 0, "rings", 0, "answered"), "RingStatus", "answered"),
        (("gateways", 0, "running"), "GatewayWorkerStatus", "running"),
    ],
)
def test_a_missing_key_is_an_error_naming_the_record_and_the_key(
    path: tuple[str | int, ...], record: str, key: str
) -> None:
    with pytest.raises(StatusRecordError) as raised:
        SupervisorStatus.from_dict(without(DOCUMENTED_STATUS, *path))
    assert raised.value.message == f"status record {record}: missing key {key!r}"
    assert isinstance(raised.value, DuomoError) and raised.value.code is ErrorCode.INTERNAL


def test_a_model_info_missing_a_key_is_an_error() -> None:
    with pytest.raises(StatusRecordError, match="ModelInfo: missing key 'max_batch'"):
        ModelInfo.from_dict(without(DOCUMENTED_MODELS[2], "max_batch"))
    # once loaded, every loaded-only key is there
    with pytest.raises(StatusRecordError, match="ModelInfo: missing key 'batched'"):
        ModelInfo.from_dict(without(DOCUMENTED_MODELS[0], "batched"))


def test_a_key_of_the_wrong_type_is_an_error() -> None:
    wrong = copy.deepcopy(DOCUMENTED_STATUS)
    wrong["models"]["classify"]["requests"] = "7"
    with pytest.raises(StatusRecordError, match="ModelStatus: key 'requests' must be an integer"):
        SupervisorStatus.from_dict(wrong)
    with pytest.raises(StatusRecordError, match="SupervisorStatus: expected an object"):
        SupervisorStatus.from_dict(None)


def test_errors_are_failed_after_queueing_plus_refused_at_admission() -> None:
    shown = ModelStatus.from_dict(
        model_entry(
            requests=10,
            outcomes={"ok": 7, "internal": 2, "deadline_exceeded": 1},
            refused={"resource_exhausted": 4, "invalid_argument": 1},
        )
    )
    assert (shown.ok, shown.errors) == (7, 3 + 5)


def test_superseded_frames_are_no_errors_and_the_json_says_both() -> None:
    """Issue 43: four healthy cameras read "ok 94, errors 1205": the frames a newer one
    replaced were counted as errors. They are an outcome of their own; ``--json`` writes both
    figures, derived again when read."""
    entry = model_entry(
        requests=1300,
        outcomes={"ok": 94, "superseded": 1205, "internal": 1},
        refused={"resource_exhausted": 2},
    )
    shown = ModelStatus.from_dict(entry)
    assert (shown.ok, shown.superseded, shown.errors) == (94, 1205, 1 + 2)
    written = shown.to_dict()
    assert (written["errors"], written["superseded"]) == (3, 1205)
    lying = {**written, "errors": 1205}  # never read: one definition
    assert ModelStatus.from_dict(lying).errors == 3


def test_the_table_and_the_watch_show_the_same_errors_for_a_model_with_both_kinds() -> None:
    entry = model_entry(
        requests=400,
        outcomes={"ok": 189, "internal": 211},
        refused={"resource_exhausted": 185},
    )
    status = SupervisorStatus.from_dict(status_entry({"ocr": entry}, gateways=[], clients=[]))
    lines = render_status(status).splitlines()
    title = next(line for line in lines if line.startswith("model "))
    row = next(line for line in lines if line.startswith("ocr "))
    end = title.index(" errors") + len(" errors")
    table_errors = int(row[:end].split()[-1])

    at = datetime.datetime(2025, 1, 2, tzinfo=datetime.timezone.utc)
    frame = plain_frame(Frame(Path("/s"), status), at).splitlines()
    title = next(line for line in frame if line.startswith("model "))
    row = next(line for line in frame if line.startswith("ocr "))
    end = title.index(" errors") + len(" errors")
    watch_errors = int(row[:end].split()[-1])

    assert table_errors == watch_errors == 211 + 185


def test_a_status_message_may_name_one_model() -> None:
    assert parse_control({"op": "status"}) == Status(model=None)
    assert parse_control({"op": "status", "model": "ocr"}) == Status(model="ocr")
    with pytest.raises(InvalidArgumentError, match="'status' message: 'model'"):
        parse_control({"op": "status", "model": 3})


def test_the_gateway_asks_for_one_models_status_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    link = SupervisorLink(Path("/nowhere/duomo.sock"), slots=1, request_timeout_s=1.0)
    asked: list[tuple[str, dict[str, Any]]] = []

    async def control(op: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        asked.append((op, fields))
        if "model" in fields:
            return {"ok": True, "model_status": DOCUMENTED_STATUS["models"]["classify"]}
        return {"ok": True, "status": DOCUMENTED_STATUS}

    monkeypatch.setattr(link, "control", control)
    one = asyncio.run(link.model_statuses("classify"))
    every = asyncio.run(link.model_statuses())
    assert asked == [("status", {"model": "classify"}), ("status", {})]
    assert (
        one
        == every
        == {"classify": SupervisorStatus.from_dict(DOCUMENTED_STATUS).models["classify"]}
    )


def test_a_pipeline_reads_its_entry_back_exactly() -> None:
    entry = pipeline()
    record = PipelineStatus.from_dict(entry)
    assert json.dumps(record.to_dict()) == json.dumps(entry)  # the keys' order too
    assert record.objects.buckets[0] == ("0", 12) and record.objects.buckets[-1] == ("+Inf", 120)
    assert [s.for_each for s in record.steps] == [None, "detect", "detect"]
    assert record.steps[1] == PipelineStepStatus("embedding", "face_embedding", "detect", 230,
                                                 12, 48, 1)  # fmt: skip
    whole = SupervisorStatus.from_dict({**DOCUMENTED_STATUS, "pipelines": {"faces": entry}})
    assert whole.pipelines == {"faces": record}
    assert whole.to_dict()["pipelines"] == {"faces": entry}


def test_a_pipeline_before_its_first_answer_has_no_latency() -> None:
    entry = pipeline(requests=0, errors=0, latency_ms={"p50": None, "p99": None})
    record = PipelineStatus.from_dict(entry)
    assert (record.latency_p50_ms, record.latency_p99_ms) == (None, None)
    assert record.to_dict() == entry


def test_a_reply_without_pipelines_reads_as_none_and_writes_none() -> None:
    assert "pipelines" not in DOCUMENTED_STATUS  # (a supervisor older than pipelines)
    record = SupervisorStatus.from_dict(DOCUMENTED_STATUS)
    assert record.pipelines == {}
    assert "pipelines" not in record.to_dict()


@pytest.mark.parametrize(
    ("path", "record", "key"),
    [
        (("state",), "PipelineStatus", "state"),
        (("latency_ms",), "PipelineStatus", "latency_ms"),
        (("latency_ms", "p99"), "PipelineStatus.latency_ms", "p99"),
        (("objects", "frames"), "PipelineObjects", "frames"),
        (("steps", 1, "skipped"), "PipelineStepStatus", "skipped"),
        (("steps", 0, "for_each"), "PipelineStepStatus", "for_each"),
    ],
)
def test_a_pipeline_missing_a_key_is_an_error_naming_the_record_and_the_key(
    path: tuple[str | int, ...], record: str, key: str
) -> None:
    whole = {**DOCUMENTED_STATUS, "pipelines": {"faces": without(pipeline(), *path)}}
    with pytest.raises(StatusRecordError) as raised:
        SupervisorStatus.from_dict(whole)
    assert raised.value.message == f"status record {record}: missing key {key!r}"


@pytest.mark.parametrize(
    "buckets", [[["0", "12"]], [["0"]], [[1, 3]], [[None, 3]], [["two", 3]], "none", [["0", 1.5]]]
)
def test_buckets_that_are_not_bound_and_count_pairs_are_an_error(buckets: Any) -> None:
    entry = pipeline()
    entry["objects"]["buckets"] = buckets
    with pytest.raises(StatusRecordError, match="PipelineObjects: key 'buckets' must be"):
        PipelineStatus.from_dict(entry)
