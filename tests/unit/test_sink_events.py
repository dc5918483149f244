"""The event contract: the JSON's field names and values for an answer and for object events,
``dropped`` only when > 0, and what is not an event."""

from __future__ import annotations

import numpy as np
import pytest

from duomo.ipc.stream_records import FrameTime
from duomo.sinks.events import (
    EVENT_KINDS,
    Event,
    TrackedObject,
    decode_event,
    event_id,
    split_id,
    with_dropped,
)

WHEN = FrameTime(1796420400.123, "camera", pts=12.5)  # 2026-12-04T21:40:00.123Z


def test_an_answer_event() -> None:
    event = Event("gate-3", 7, "answer", WHEN, frame=120, model="classify", result={"top": 1})
    assert event.id == "gate-3:7"
    assert decode_event(event.encode()) == {
        "id": "gate-3:7",
        "seq": 7,
        "source": "gate-3",
        "kind": "answer",
        "captured_at": "2026-12-04T21:40:00.123Z",
        "clock": "camera",
        "frame": 120,
        "model": "classify",
        "result": {"top": 1},
    }
    # the contract's order, which a person reading the raw stream sees
    assert list(decode_event(event.encode())) == [
        "id", "seq", "source", "kind", "captured_at", "clock", "frame", "model", "result"
    ]  # fmt: skip


def test_object_events() -> None:
    appeared = TrackedObject(17, (412, 96.5, 520, 230), 0.97, {"detect": {"label": "face"}})
    event = Event("gate-3", 8, "object_appeared", WHEN, 121, pipeline="faces", object=appeared)
    body = decode_event(event.encode())
    assert body["pipeline"] == "faces" and "model" not in body and "result" not in body
    assert body["object"] == {
        "track": 17,
        "box": [412.0, 96.5, 520.0, 230.0],
        "score": 0.97,
        "results": {"detect": {"label": "face"}},
    }
    left = TrackedObject(
        17,
        (400, 90, 510, 220),
        0.95,
        {"identify": {"name": "alice"}},
        first_seen=WHEN.at - 9.119,
        last_seen=WHEN.at,
        frames=212,
        thumbnail_jpeg_b64="/9j/4AAQ",
    )
    body = decode_event(Event("gate-3", 9, "object_left", WHEN, 130, pipeline="faces",
                              object=left).encode())  # fmt: skip
    assert body["object"]["first_seen"] == "2026-12-04T21:39:51.004Z"
    assert body["object"]["last_seen"] == "2026-12-04T21:40:00.123Z"
    assert body["object"]["frames"] == 212
    assert body["object"]["thumbnail_jpeg_b64"] == "/9j/4AAQ"
    assert set(EVENT_KINDS) == {"answer", "object_appeared", "object_updated", "object_left"}


def test_numpy_in_a_result_becomes_lists_and_numbers() -> None:
    result = {
        "boxes": np.arange(6, dtype=np.float32).reshape(2, 3),
        "strided": np.arange(10)[::3],  # not contiguous: through the fallback
        "score": np.float32(0.5),
        "half": np.float16(1.5),
    }
    body = decode_event(Event("cam", 1, "answer", WHEN, 1, model="m", result=result).encode())
    assert body["result"] == {
        "boxes": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]],
        "strided": [0, 3, 6, 9],
        "score": 0.5,
        "half": 1.5,
    }


def test_dropped_is_there_only_when_some_were() -> None:
    body = Event("cam", 5, "answer", WHEN, 1, model="m", result=None).encode()
    assert "dropped" not in decode_event(body)
    assert with_dropped(body, 0) is body
    assert decode_event(with_dropped(body, 3))["dropped"] == 3


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"kind": "frame"}, "kind is one of"),
        ({"seq": 0}, "seq counts from 1"),
        ({"source": "a:b"}, "no ':'"),
        ({"pipeline": "faces"}, "exactly one of model and pipeline"),
        ({"model": None}, "exactly one of model and pipeline"),
        ({"object": TrackedObject(1, (0, 0, 1, 1), 1.0)}, "carries a result, not an object"),
        ({"kind": "object_left"}, "carries an object, not a result"),
    ],
)
def test_what_is_not_an_event(fields: dict[str, object], why: str) -> None:
    base: dict[str, object] = {"source": "cam", "seq": 1, "kind": "answer", "when": WHEN,
                               "frame": 1, "model": "m"}  # fmt: skip
    with pytest.raises(ValueError, match=why):
        Event(**{**base, **fields})  # type: ignore[arg-type]


def test_ids_round_trip() -> None:
    assert split_id(event_id("gate-3.main", 1042)) == ("gate-3.main", 1042)
    for bad in ("gate-3", ":4", "gate:x"):
        with pytest.raises(ValueError):
            split_id(bad)
