"""A source's tracked objects as visits (``video.object_visits``) and its events into outboxes
(``video.sink_events``): which answers make which events, and every event numbered once,
contiguous, in each sink's outbox."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from duomo.ipc.stream_records import FrameTime, StreamAnswer
from duomo.sinks.config import OutboxConfig
from duomo.sinks.events import decode_event
from duomo.sinks.outbox import Outbox, outbox_path
from duomo.video import sink_events
from duomo.video.object_visits import ObjectVisits
from duomo.video.sink_events import EventPlan, SinkEvents, SinkTarget
from duomo.video.thumbnails import MAX_SIDE_PX, FrameKeeper


def face(track: int, x: float = 10.0, gender: str = "female", age: float = 40.0) -> dict[str, Any]:
    return {
        "box": [x, 10.0, x + 50.0, 70.0], "score": 0.9, "landmarks": [[1, 2]] * 5,
        "track_id": track, "embedding": {"embedding": [0.1 * x, 0.2]},
        "attributes": {"gender": gender, "gender_probability": 0.97, "age": age},
    }  # fmt: skip


def frames(visits: ObjectVisits, results: list[list[dict[str, Any]]]) -> list[tuple[str, int]]:
    out = []
    for n, faces in enumerate(results):
        for change in visits.update({"faces": faces}, FrameTime(1000.0 + n), n):
            out.append((change.kind, change.object.track))
    return out


def test_a_visit_is_confirmed_on_its_second_frame_and_leaves_after_max_missed_plus_one() -> None:
    visits = ObjectVisits(max_missed=2)
    seen = [[face(1)], [face(1, x=11, age=41.5)], [face(1, x=12)], [], [], []]
    assert frames(visits, seen) == [("object_appeared", 1), ("object_left", 1)]
    assert len(visits) == 0


def test_a_one_frame_detection_makes_no_event_and_missing_frames_within_bound_keep_it() -> None:
    visits = ObjectVisits(max_missed=2)
    # track 2 is seen once only; track 1 misses two frames (within max_missed) and comes back
    seen = [[face(1), face(2)], [face(1)], [], [], [face(1)], [], [], []]
    assert frames(visits, seen) == [("object_appeared", 1), ("object_left", 1)]


def test_a_settled_change_is_an_update_float_jitter_is_not() -> None:
    visits = ObjectVisits(max_missed=5)
    seen = [
        [face(1)], [face(1, age=41.0)],  # appeared
        [face(1, x=13, age=39.2)],  # floats only (box, age, embedding): no event
        [face(1, gender="male")],  # a label changed: updated
        [face(1, gender="male", age=50.0)],
    ]  # fmt: skip
    assert frames(visits, seen) == [("object_appeared", 1), ("object_updated", 1)]
    (left,) = visits.end()
    assert left.kind == "object_left" and left.object.frames == 5
    assert left.object.first_seen == 1000.0 and left.object.last_seen == 1004.0
    assert set(left.object.results) == {"embedding", "attributes"}


def test_an_identity_found_is_one_update_and_stays_with_the_visit() -> None:
    def named(name: str | None, similarity: float = 0.5) -> dict[str, Any]:
        return {**face(1), "identity": {"name": name, "similarity": similarity}}

    visits = ObjectVisits(max_missed=5)
    seen = [
        [named(None, 0.1)], [named(None, 0.2)],  # appeared, no one yet
        [named("Ada", 0.71)],  # found: updated
        [named("Ada", 0.64)], [named(None, 0.2)],  # the same, then a frame that matches no one
        [{**named("Ada"), "identity": {"name": "Ada", "similarity": 0.7, "reused": True}}],
        [named("Bob", 0.52)],  # another name: updated
    ]  # fmt: skip
    changes = [c for n, faces in enumerate(seen) for c in visits.update(
        {"faces": faces}, FrameTime(1000.0 + n), n)]  # fmt: skip
    assert [(c.kind, c.frame) for c in changes] == [
        ("object_appeared", 1), ("object_updated", 2), ("object_updated", 6),
    ]  # fmt: skip
    assert changes[0].object.results["identity"] == {"name": None, "similarity": 0.2}
    assert changes[1].object.results["identity"] == {"name": "Ada", "similarity": 0.71}
    (left,) = visits.end()
    assert left.object.results["identity"] == {"name": "Bob", "similarity": 0.52}


def test_events_are_numbered_once_and_appended_to_every_sink(tmp_path: Path) -> None:
    bounds = OutboxConfig()
    plan = EventPlan(tmp_path, (SinkTarget("a", bounds), SinkTarget("b", bounds)), "both", 1)
    events = SinkEvents("gate", plan, pipeline=True).start()
    for n in range(4):
        faces = [face(7)] if n < 2 else []
        answer = StreamAnswer("gate", n, "faces", 5.0, "OK", {"faces": faces},
                              when=FrameTime(2000.0 + n, "camera"))  # fmt: skip
        events.answer(answer)
    events.answer(StreamAnswer("gate", 4, "faces", 5.0, "SUPERSEDED"))  # no event
    events.close()
    for sink in ("a", "b"):
        with Outbox(outbox_path(tmp_path, sink), bounds) as outbox:
            got = [decode_event(e.body) for e in outbox.next_batch(100)]
        assert [e["seq"] for e in got] == list(range(1, 7))
        assert [e["kind"] for e in got] == [
            "answer", "answer", "object_appeared", "answer", "answer", "object_left"
        ]  # fmt: skip
        assert got[0]["id"] == "gate:1" and got[0]["pipeline"] == "faces"
        assert got[0]["clock"] == "camera" and got[0]["frame"] == 0
        assert got[2]["object"]["track"] == 7 and got[5]["object"]["frames"] == 2
    # a new writer of the same source continues the seqs
    again = SinkEvents("gate", plan, pipeline=True).start()
    again.answer(StreamAnswer("gate", 9, "faces", 5.0, "OK", {"faces": []}))
    again.close()
    with Outbox(outbox_path(tmp_path, "a"), bounds) as outbox:
        assert outbox.next_batch(100)[-1].seq == 7


def test_the_left_event_carries_the_best_frames_crop_as_a_small_jpeg() -> None:
    keeper = FrameKeeper(kept=3)
    visits = ObjectVisits(max_missed=0, thumbnails="left", crop=keeper.crop)
    big = np.zeros((2160, 3840, 3), np.uint8)  # (kept subsampled to 1280 px)
    big[300:900, 600:1200] = (200, 30, 30)
    kinds = []
    for n, score in enumerate([0.5, 0.9, 0.7]):
        keeper.keep("cam", big, n)
        found = {**face(4, x=600), "box": [600.0, 300.0, 1200.0, 900.0], "score": score}
        kinds += [c.kind for c in visits.update({"faces": [found]}, FrameTime(n), n)]
    assert kinds == ["object_appeared"]
    (left,) = visits.update({"faces": []}, FrameTime(9.0), 9)
    assert left.object.score == 0.7 and left.object.thumbnail_jpeg_b64 is not None
    jpeg = base64.b64decode(left.object.thumbnail_jpeg_b64)
    picture = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert max(picture.shape[:2]) == MAX_SIDE_PX and picture[64, 64, 2] > 150  # (BGR: red)
    keeper.keep("cam", big, 3)
    assert keeper.crop(0, (0.0, 0.0, 10.0, 10.0)) is None  # no longer kept
    assert keeper.crop(3, (5.0, 5.0, 5.0, 90.0)) is None  # an empty box


def test_a_full_queue_loses_drafts_counted_and_never_numbered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sink_events, "QUEUE_BOUND", 3)
    plan = EventPlan(tmp_path, (SinkTarget("a", OutboxConfig()),), "answers", None)
    events = SinkEvents("gate", plan, pipeline=False)  # (not started: the writer is stuck)
    for n in range(5):
        events.answer(StreamAnswer("gate", n, "classify", 1.0, "OK", {"top": n}))
    assert events.lost == 2
    events.start()
    events.close()  # the three queued are written, numbered 1..3
    with Outbox(outbox_path(tmp_path, "a"), OutboxConfig()) as outbox:
        got = [decode_event(e.body) for e in outbox.next_batch(10)]
    assert [(e["seq"], e["frame"], e["model"]) for e in got] == [
        (1, 0, "classify"), (2, 1, "classify"), (3, 2, "classify")
    ]  # fmt: skip
