"""The event a sink delivers: its fields are a contract with the consumers (keep the names).

One JSON object per event, encoded with orjson::

    {"id": "gate-3:1042", "seq": 1042, "source": "gate-3", "kind": "object_left",
     "captured_at": "2026-12-06T21:40:00.123Z", "clock": "camera", "frame": 5120,
     "pipeline": "faces",
     "object": {"track": 17, "box": [412.0, 96.5, 520.0, 230.0], "score": 0.97,
                "results": {"identify": {"name": "alice", "score": 0.81}},
                "first_seen": "2026-12-06T21:39:51.004Z", "last_seen": "2026-12-06T21:40:00.123Z",
                "frames": 212, "thumbnail_jpeg_b64": "/9j/4AAQ..."},
     "dropped": 3}

- ``id`` is ``"<source>:<seq>"``: a consumer dedupes by it (delivery is at least once).
- ``seq`` counts a source's events from 1, contiguous for every event the source emits, across
  restarts (``sinks.sequencer.Sequencer`` hands them out): 5 then 7 means 6 was lost.
- ``kind``: ``answer`` (one per answer, with ``result``) or ``object_appeared`` /
  ``object_updated`` / ``object_left`` (one tracked object's visit, with ``object``).
- ``captured_at`` (RFC 3339, UTC, ms) and ``clock`` (``camera``, ``arrival`` or ``caller``) as in
  ``duomo stream``'s lines (``ipc.stream_records.FrameTime``); ``frame`` the frame number.
- ``model`` or ``pipeline``: what answered (exactly one of them).
- ``object``: ``track``, ``box`` (x1, y1, x2, y2 in the frame's pixels), ``score``, ``results``
  (the sub-results known so far, by step), for ``object_left`` also ``first_seen``,
  ``last_seen`` and ``frames``, and optionally ``thumbnail_jpeg_b64``.
- ``dropped``: how many of this source's events the outbox dropped by its bound just before this
  one; present only when > 0. It is not part of ``Event``: the outbox adds it when it hands the
  event to a publisher (``with_dropped``), since only the outbox knows.

Made by the source workers (``video``) as answers and track changes come in; encoded once and
appended to each of the source's sinks' outboxes (``sinks.outbox``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import orjson

from duomo.ipc.json_values import json_default
from duomo.ipc.stream_records import FrameTime

EventKind = Literal["answer", "object_appeared", "object_updated", "object_left"]
EVENT_KINDS: tuple[str, ...] = get_args(EventKind)
OBJECT_KINDS = ("object_appeared", "object_updated", "object_left")
_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


@dataclass(frozen=True, slots=True)
class TrackedObject:
    """One tracked object as an object event carries it.

    Attributes:
        track: The tracker's id of the object (unique within the source's visit).
        box: ``(x1, y1, x2, y2)`` in the frame's pixels.
        score: The detector's confidence.
        results: The sub-results known so far, by the pipeline step that made each.
        first_seen: When it was first seen, UNIX seconds (``object_left``).
        last_seen: When it was last seen, UNIX seconds (``object_left``).
        frames: In how many frames it was seen (``object_left``).
        thumbnail_jpeg_b64: A JPEG of the object's best crop, base64 (optional).
    """

    track: int
    box: tuple[float, float, float, float]
    score: float
    results: Mapping[str, Any] = field(default_factory=dict)
    first_seen: float | None = None
    last_seen: float | None = None
    frames: int | None = None
    thumbnail_jpeg_b64: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The ``object`` of an event (a field left out when it is None)."""
        out: dict[str, Any] = {
            "track": self.track,
            "box": [float(v) for v in self.box],
            "score": float(self.score),
            "results": dict(self.results),
        }
        if self.first_seen is not None:
            out["first_seen"] = FrameTime(self.first_seen).rfc3339
        if self.last_seen is not None:
            out["last_seen"] = FrameTime(self.last_seen).rfc3339
        if self.frames is not None:
            out["frames"] = self.frames
        if self.thumbnail_jpeg_b64 is not None:
            out["thumbnail_jpeg_b64"] = self.thumbnail_jpeg_b64
        return out


@dataclass(frozen=True, slots=True)
class Event:
    """One event of a source, before it is encoded (``encode``). ValueError when the fields do
    not make an event: a bad kind, a seq below 1, not exactly one of model and pipeline, or an
    answer without ``result`` / an object event without ``object``."""

    source: str
    seq: int
    kind: EventKind
    when: FrameTime  # the frame's capture time and its clock
    frame: int
    model: str | None = None
    pipeline: str | None = None
    result: Any = None
    object: TrackedObject | None = None

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"an event's kind is one of {', '.join(EVENT_KINDS)}: {self.kind!r}")
        if self.seq < 1:
            raise ValueError(f"seq counts from 1: {self.seq}")
        if not self.source or ":" in self.source:
            raise ValueError(f"a source's name is not empty and has no ':': {self.source!r}")
        if (self.model is None) == (self.pipeline is None):
            raise ValueError("an event names exactly one of model and pipeline")
        if self.kind == "answer" and self.object is not None:
            raise ValueError("an answer event carries a result, not an object")
        if self.kind in OBJECT_KINDS and (self.object is None or self.result is not None):
            raise ValueError(f"a {self.kind} event carries an object, not a result")

    @property
    def id(self) -> str:
        """``"<source>:<seq>"``, what a consumer dedupes by."""
        return event_id(self.source, self.seq)

    def to_json(self) -> dict[str, Any]:
        """The event's JSON object, in the contract's order (without ``dropped``)."""
        out: dict[str, Any] = {
            "id": self.id,
            "seq": self.seq,
            "source": self.source,
            "kind": self.kind,
            "captured_at": self.when.rfc3339,
            "clock": self.when.clock,
            "frame": self.frame,
        }
        if self.model is not None:
            out["model"] = self.model
        else:
            out["pipeline"] = self.pipeline
        if self.object is not None:
            out["object"] = self.object.to_json()
        else:
            out["result"] = self.result
        return out

    def encode(self) -> bytes:
        """The JSON bytes a sink delivers (numpy arrays as nested lists)."""
        return orjson.dumps(self.to_json(), default=json_default, option=_OPTIONS)


def event_id(source: str, seq: int) -> str:
    """The ``id`` of ``source``'s event ``seq``."""
    return f"{source}:{seq}"


def split_id(event: str) -> tuple[str, int]:
    """``(source, seq)`` of an event ``id``; ValueError if it is not one."""
    source, sep, seq = event.rpartition(":")
    if not sep or not source or not seq.isdigit():
        raise ValueError(f"not an event id: {event!r}")
    return source, int(seq)


def with_dropped(body: bytes, dropped: int) -> bytes:
    """``body`` (an encoded event) with ``dropped`` set, or as it is when ``dropped`` is 0."""
    if dropped <= 0:
        return body
    decoded = orjson.loads(body)
    decoded["dropped"] = dropped
    return orjson.dumps(decoded)


def decode_event(body: bytes | str) -> dict[str, Any]:
    """An encoded event as a dict (for consumers and tests); ValueError if it is not one."""
    decoded = orjson.loads(body)
    if not isinstance(decoded, dict) or "id" not in decoded:
        raise ValueError("not an event")
    return decoded
