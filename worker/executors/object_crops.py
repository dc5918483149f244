"""An object of a first model's answer as the input of a second: its box, its crop of the frame.

A detector answers objects as dicts (a face with its ``box``, ``score`` and ``landmarks``; a text
line with its ``box`` of four corners). ``object_box`` reads an object's box as [x1, y1, x2, y2]
(a polygon by the bounds of its points); ``object_payload`` makes what a request on the object
is given: the frame cropped to its box, widened by a margin and resized if asked, or the whole
frame with the object's points, for an executor that aligns or warps them itself
(``face_align``, ``ocr_stages``).

Invariants: the frame is never copied at its full size — a crop is a view of it (a view of the
frame in its slot, when the frame is a slot's), and only ``resize`` makes a new, small image; an
object that cannot be cut (no box, a box outside the frame, points that are not numbers) is an
``InvalidArgumentError`` for that object alone.

Who calls it: a pipeline step that runs ``for_each`` object of an earlier step
(``supervisor.dataflow.pipelines``), on the worker thread whose model answered that step; the
step's ``for_each`` (``supervisor.dataflow.pipeline_config.ForEach``) is the ``ObjectCut``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import cv2
import numpy as np

from duomo.ipc.errors import InvalidArgumentError

Box = tuple[float, float, float, float]  # x1, y1, x2, y2 in the frame's pixels


class ObjectCut(Protocol):
    """What of an object a request is given: ``input`` ``box`` (the frame cropped to the box,
    widened by ``margin`` of its size on each side, resized to ``resize`` [width, height] if
    set), ``landmarks`` or ``quad`` (the frame and those points)."""

    @property
    def input(self) -> str: ...

    @property
    def margin(self) -> float: ...

    @property
    def resize(self) -> tuple[int, int] | None: ...


def object_box(item: Mapping[str, Any]) -> Box | None:
    """The object's box, [x1, y1, x2, y2]; the bounds of its points when its box is a polygon
    (an OCR line's four corners)."""
    box = item.get("box")
    if not isinstance(box, (list, tuple)) or not box:
        return None
    try:
        if isinstance(box[0], (list, tuple)):
            xs, ys = [float(p[0]) for p in box], [float(p[1]) for p in box]
            return min(xs), min(ys), max(xs), max(ys)
        if len(box) == 4:
            x1, y1, x2, y2 = (float(v) for v in box)
            return x1, y1, x2, y2
    except (TypeError, ValueError, IndexError):
        return None
    return None


def object_payload(frame: Any, item: Mapping[str, Any], each: ObjectCut) -> Any:
    """What one object's request is given: the frame cropped to its box (a view, widened by
    ``margin``, resized when ``resize`` is set), or the frame with its landmarks."""
    if not isinstance(frame, np.ndarray) or frame.ndim not in (2, 3):
        raise InvalidArgumentError("the frame is not an image: for_each needs one")
    if each.input != "box":
        field = "box" if each.input == "quad" else each.input
        points = item.get(field)
        if points is None:
            raise InvalidArgumentError(f"the object has no {field}")
        try:
            return {"image": frame, each.input: np.asarray(points, dtype=np.float32)}
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"the object's {field} is not a list of points") from None
    box = object_box(item)
    if box is None:
        raise InvalidArgumentError("the object has no box")
    x1, y1, x2, y2 = box
    dx, dy = (x2 - x1) * each.margin, (y2 - y1) * each.margin
    height, width = frame.shape[:2]
    left, top = max(0, math.floor(x1 - dx)), max(0, math.floor(y1 - dy))
    right, bottom = min(width, math.ceil(x2 + dx)), min(height, math.ceil(y2 + dy))
    if right - left < 1 or bottom - top < 1:
        raise InvalidArgumentError(f"the object's box {list(box)} is outside the frame")
    crop = frame[top:bottom, left:right]
    if each.resize is not None:
        crop = cv2.resize(crop, each.resize, interpolation=cv2.INTER_LINEAR)
    return crop
