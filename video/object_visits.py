"""One source's tracked objects as visits: which answers make an ``object_appeared``, an
``object_updated`` and an ``object_left`` event (DESIGN.md §4d).

Fed each OK answer of a pipeline that has a tracker, in the order the answers are read: its
objects are the dicts of the answer's lists that carry a ``track_id`` (``faces`` for the demo's
``faces``; the supervisor's tracker sets it, ``supervisor/dataflow/object_tracker.py``). A track
is keyed by its list's name and its id (a pipeline may track two steps' objects). The rules:

- **appeared**: a track is *confirmed* when it has been seen in ``CONFIRM_FRAMES`` (2) answered
  frames — one frame's detection is not yet an object (a false positive rarely repeats). The
  event carries the box and score of that frame and the sub-results known so far.
- **updated**: a confirmed track's sub-results *changed*, where only what settles counts: the
  strings, booleans and integers in the step results (an attribute's label, an identity's name,
  a class id), never the floats (scores, probabilities, an age estimate, an embedding's values:
  they change with every frame). One event per change, with the new sub-results.
- **left**: a track not seen for ``max_missed + 1`` answered frames — the pipeline's tracker
  forgets it then, so a face that comes back later is a new track and a new visit — or when
  the source stops (``end``). It carries ``first_seen``, ``last_seen`` (the capture times of
  its first and last frame, each on that frame's clock: a camera whose sender reports begin
  mid-visit moves from its arrival clock to its own) and ``frames`` (answered frames it was
  seen in), with the last box, score and sub-results. A track forgotten before it
  was confirmed makes no event at all.

**Thumbnails** (``thumbnails``: ``left`` or ``appeared``; ``none`` by default): each time a
visit's object scores higher than before, ``crop`` (``video.thumbnails.FrameKeeper.crop``) cuts
it from its frame; the best crop so far goes, as a JPEG, into that visit's ``object_left`` or
``object_appeared`` event (``thumbnail_jpeg_b64``); none when no frame of it was still kept.

The sub-results are each step's result on the object (every key of the object but ``box``,
``score``, ``landmarks``, ``track_id``; a reused result's ``reused`` marker left out), merged
over the visit: a step skipped on one frame keeps its last result, and a gallery's match
(``identity``: ``{"name", "similarity"}``) keeps its name through frames that match no one (a
face turned away), so an identity found is one ``object_updated`` and another name another.

Pure and single-threaded: used by ``video.sink_events`` on a source's answer-reading thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duomo.ipc.stream_records import FrameTime
from duomo.sinks.events import EventKind, TrackedObject
from duomo.video.thumbnails import jpeg_b64

CONFIRM_FRAMES = 2
Crop = Callable[[int, tuple[float, float, float, float]], "np.ndarray | None"]
OBJECT_KEYS = frozenset({"box", "score", "landmarks", "track_id", "reused", "quad"})


@dataclass(frozen=True, slots=True)
class ObjectChange:
    """One object event to emit: its kind, the object, and the frame it is about."""

    kind: EventKind  # object_appeared | object_updated | object_left
    object: TrackedObject
    when: FrameTime
    frame: int


@dataclass
class _Visit:
    track: int
    first_seen: float
    last_seen: float
    last_when: FrameTime
    last_frame: int
    box: tuple[float, float, float, float]
    score: float
    frames: int = 0
    missed: int = 0
    confirmed: bool = False
    results: dict[str, Any] = field(default_factory=dict)
    settled: Any = None  # the signature of ``results`` last emitted
    best_score: float = -1.0
    thumbnail: np.ndarray | None = None  # the crop of its best-scored frame (thumbnails on)

    def seen(self, box: tuple[float, float, float, float], score: float, results: Mapping[str, Any],
             when: FrameTime, frame: int) -> None:  # fmt: skip
        self.box, self.score, self.missed = box, score, 0
        self.frames += 1
        self.last_seen, self.last_when, self.last_frame = when.at, when, frame
        for step, result in results.items():
            if not (_unnamed(result) and _named(self.results.get(step))):
                self.results[step] = result  # (a person found stays found for the visit)

    def object(self, left: bool = False, thumbnail: bool = False) -> TrackedObject:
        jpeg = jpeg_b64(self.thumbnail) if thumbnail and self.thumbnail is not None else None
        return TrackedObject(
            track=self.track, box=self.box, score=self.score, results=dict(self.results),
            first_seen=self.first_seen if left else None,
            last_seen=self.last_seen if left else None, frames=self.frames if left else None,
            thumbnail_jpeg_b64=jpeg,
        )  # fmt: skip


class ObjectVisits:
    """The visits of one source's tracked objects (the module docstring's rules)."""

    def __init__(self, max_missed: int, thumbnails: str = "none", crop: Crop | None = None) -> None:
        """``thumbnails``: ``none``, ``left`` or ``appeared``, with ``crop`` (frame number,
        box) → the object's picture, or None."""
        self.max_missed = max_missed
        self.thumbnails = thumbnails if crop is not None else "none"
        self.crop = crop
        self._visits: dict[tuple[str, int], _Visit] = {}

    def update(self, result: Any, when: FrameTime, frame: int) -> list[ObjectChange]:
        """The events one answered frame makes (its ``result``: the pipeline's answer)."""
        changes: list[ObjectChange] = []
        present: set[tuple[str, int]] = set()
        for key, item in _tracked(result):
            present.add(key)
            visit = self._visits.get(key)
            box, score = _box(item.get("box")), _number(item.get("score"))
            if visit is None:
                visit = _Visit(key[1], when.at, when.at, when, frame, box, score)
                self._visits[key] = visit
            visit.seen(box, score, _sub_results(item), when, frame)
            if self.crop is not None and self.thumbnails != "none" and score > visit.best_score:
                chip = self.crop(frame, box)
                if chip is not None:
                    visit.best_score, visit.thumbnail = score, chip
            settled = _settled(visit.results)
            if not visit.confirmed and visit.frames >= CONFIRM_FRAMES:
                visit.confirmed, visit.settled = True, settled
                shown = visit.object(thumbnail=self.thumbnails == "appeared")
                changes.append(ObjectChange("object_appeared", shown, when, frame))
            elif visit.confirmed and settled != visit.settled:
                visit.settled = settled
                changes.append(ObjectChange("object_updated", visit.object(), when, frame))
        for key in [k for k in self._visits if k not in present]:
            visit = self._visits[key]
            visit.missed += 1
            if visit.missed > self.max_missed:
                del self._visits[key]
                if visit.confirmed:
                    changes.append(self._left(visit))
        return changes

    def end(self) -> list[ObjectChange]:
        """The source stops: every confirmed visit leaves."""
        visits, self._visits = list(self._visits.values()), {}
        return [self._left(v) for v in visits if v.confirmed]

    def _left(self, visit: _Visit) -> ObjectChange:
        shown = visit.object(left=True, thumbnail=self.thumbnails == "left")
        return ObjectChange("object_left", shown, visit.last_when, visit.last_frame)

    def __len__(self) -> int:
        return len(self._visits)


def _tracked(result: Any) -> Iterator[tuple[tuple[str, int], Mapping[str, Any]]]:
    """``((list name, track id), object)`` for each tracked object of an answer."""
    if not isinstance(result, Mapping):
        return
    for name, items in result.items():
        if not isinstance(items, list):
            continue
        for item in items:
            if isinstance(item, Mapping):
                track = item.get("track_id")
                if isinstance(track, int) and not isinstance(track, bool):
                    yield (str(name), track), item


def _sub_results(item: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in item.items():
        if key in OBJECT_KEYS:
            continue
        if isinstance(value, Mapping) and "reused" in value:
            value = {k: v for k, v in value.items() if k != "reused"}
        out[str(key)] = value
    return out


def _named(value: Any) -> bool:
    """A gallery's match with a name (``{"name": "Ada", "similarity": 0.8}``)."""
    return isinstance(value, Mapping) and isinstance(value.get("name"), str)


def _unnamed(value: Any) -> bool:
    """A gallery's answer of no match (``{"name": null, "similarity": …}``)."""
    return isinstance(value, Mapping) and "name" in value and value["name"] is None


def _settled(value: Any) -> Any:
    """What of a sub-result counts as a change: strings, booleans and integers, by key; floats
    (and lists of them: embeddings) never."""
    if isinstance(value, Mapping):
        kept = {str(k): _settled(v) for k, v in value.items()}
        return tuple(sorted((k, v) for k, v in kept.items() if v is not None))
    if isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, (list, tuple)):
        kept_items = tuple(s for s in (_settled(v) for v in value) if s is not None)
        return kept_items or None
    return None


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def _box(value: Any) -> tuple[float, float, float, float]:
    """``(x1, y1, x2, y2)`` of a box given as four numbers or as a polygon's points."""
    try:
        if (
            isinstance(value, (list, tuple))
            and len(value) == 4
            and all(isinstance(v, (int, float)) for v in value)
        ):
            x1, y1, x2, y2 = (float(v) for v in value)
            return x1, y1, x2, y2
        points = [(float(p[0]), float(p[1])) for p in value]
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        return min(xs), min(ys), max(xs), max(ys)
    except (TypeError, ValueError, IndexError):
        return 0.0, 0.0, 0.0, 0.0
