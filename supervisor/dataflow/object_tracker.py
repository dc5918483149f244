"""An IoU tracker for one stream's objects, and what a pipeline keeps per tracked object.

Created by a pipeline (``supervisor.dataflow.pipelines``) per stream and per step whose objects a
later step runs ``for_each`` of, when its config has a ``tracker``; ``update`` is called with each
frame's boxes, in the order the step answers them. Objects are matched to the last frame's
tracks greedily, the pair of highest IoU first, a pair below ``iou`` never; an unmatched
object starts a new track, a track unmatched for more than ``max_missed`` frames is forgotten.
Each track keeps the last result of every step run on it (``Kept``), which a step with
``reinfer_every`` reuses (DeepStream's ``secondary-reinfer-interval``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_TRACKS = 1024  # a stream's tracks; the oldest unmatched go first past this


@dataclass(frozen=True, slots=True)
class Kept:
    """A step's result for a track: the frame it was made on and the box's area then."""

    result: Any
    frame: int
    area: float


@dataclass(slots=True)
class Track:
    """One tracked object: its id, its last box, and the steps' results kept for it."""

    id: int
    box: np.ndarray  # [x1, y1, x2, y2]
    missed: int = 0
    kept: dict[str, Kept] = field(default_factory=dict)  # by step name

    @property
    def area(self) -> float:
        return box_area(self.box)


def box_area(box: np.ndarray) -> float:
    return float(max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1]))


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of ``a`` (N×4) with every box of ``b`` (M×4): N×M."""
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-9), 0.0)


class IouTracker:
    """One stream's tracks over one step's objects (thread-safe: frames may be answered by
    several instances of the step's model)."""

    def __init__(self, iou: float, max_missed: int) -> None:
        self.iou = iou
        self.max_missed = max_missed
        self.frame = 0  # frames seen
        self._tracks: list[Track] = []
        self._next_id = 1
        self.lock = threading.Lock()

    def update(self, boxes: Sequence[Sequence[float]]) -> tuple[int, list[Track]]:
        """This frame's number and the track of each box, in order (held under ``lock``: a
        caller reads and writes the tracks' ``kept`` under it too)."""
        with self.lock:
            self.frame += 1
            current = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
            assigned: list[Track | None] = [None] * len(current)
            matched: set[int] = set()
            if self._tracks and len(current):
                previous = np.stack([t.box for t in self._tracks])
                scores = iou_matrix(current, previous)
                for flat in np.argsort(-scores, axis=None):
                    i, j = divmod(int(flat), scores.shape[1])
                    if scores[i, j] < self.iou:
                        break
                    if assigned[i] is not None or j in matched:
                        continue
                    assigned[i] = self._tracks[j]
                    matched.add(j)
            for j, track in enumerate(self._tracks):
                track.missed = 0 if j in matched else track.missed + 1
            self._tracks = [t for t in self._tracks if t.missed <= self.max_missed]
            for i, box in enumerate(current):
                found = assigned[i]
                if found is None:
                    found = assigned[i] = Track(self._next_id, box)
                    self._next_id += 1
                    self._tracks.append(found)
                found.box = box
            if len(self._tracks) > MAX_TRACKS:
                self._tracks.sort(key=lambda t: t.missed)
                del self._tracks[MAX_TRACKS:]
            return self.frame, [t for t in assigned if t is not None]
