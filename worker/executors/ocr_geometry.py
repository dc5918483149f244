"""Text-detection geometry for OCR: DB post-processing, reading order, and text-line crops.

Called by ``OcrExecutor`` on its worker thread. Implements the Differentiable Binarization
post-process as PaddleOCR defines it: threshold the probability map, dilate, take contours, fit a
minimum-area rectangle, score it by the mean probability inside ("fast" mode), grow it by
``area * unclip_ratio / perimeter`` (a rounded polygon offset), fit the rectangle again, and map it
back to image pixels.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np
import pyclipper

_MIN_SIDE = 3
_SAME_LINE_PX = 10


@dataclass(frozen=True)
class DbParams:
    """The DB post-process's settings: the pixel and box thresholds, the unclip ratio, the most
    candidate boxes, and whether the map is dilated."""

    thresh: float
    box_thresh: float
    unclip_ratio: float
    max_candidates: int
    use_dilation: bool


def _min_area_box(points: np.ndarray) -> tuple[np.ndarray, float]:
    """The minimum-area rectangle's corners (tl, tr, br, bl by x then y) and its short side."""
    rect = cv2.minAreaRect(points.astype(np.float32))
    corners = sorted(cv2.boxPoints(rect).tolist(), key=lambda p: p[0])
    left = sorted(corners[:2], key=lambda p: p[1])
    right = sorted(corners[2:], key=lambda p: p[1])
    box = np.array([left[0], right[0], right[1], left[1]], dtype=np.float32)
    return box, float(min(rect[1]))


def _mean_score(prob: np.ndarray, box: np.ndarray) -> float:
    """Mean probability inside the polygon ``box`` (PaddleOCR's "fast" score)."""
    h, w = prob.shape
    x0 = int(np.clip(np.floor(box[:, 0].min()), 0, w - 1))
    x1 = int(np.clip(np.ceil(box[:, 0].max()), 0, w - 1))
    y0 = int(np.clip(np.floor(box[:, 1].min()), 0, h - 1))
    y1 = int(np.clip(np.ceil(box[:, 1].max()), 0, h - 1))
    mask = np.zeros((y1 - y0 + 1, x1 - x0 + 1), dtype=np.uint8)
    shifted = (box - np.array([x0, y0], dtype=np.float32)).astype(np.int32)
    cv2.fillPoly(mask, [shifted.reshape(-1, 2)], 1)
    return float(cv2.mean(prob[y0 : y1 + 1, x0 : x1 + 1], mask)[0])


def _unclip(box: np.ndarray, ratio: float) -> np.ndarray:
    area = abs(cv2.contourArea(box))
    perimeter = cv2.arcLength(box, closed=True)
    if perimeter == 0:
        return box
    offset = pyclipper.PyclipperOffset()
    offset.AddPath(box.tolist(), pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    grown = offset.Execute(area * ratio / perimeter)
    if not grown:
        return box
    return np.asarray(grown[0], dtype=np.float32)


def _order_clockwise(box: np.ndarray) -> np.ndarray:
    by_x = box[np.argsort(box[:, 0], kind="stable")]
    left = by_x[:2][np.argsort(by_x[:2, 1], kind="stable")]
    right = by_x[2:][np.argsort(by_x[2:, 1], kind="stable")]
    return np.array([left[0], right[0], right[1], left[1]], dtype=np.float32)


def detect_boxes(
    prob: np.ndarray, image_w: int, image_h: int, params: DbParams
) -> tuple[list[np.ndarray], list[float]]:
    """Text boxes (4×2 float32, image pixels, clockwise from top-left) in reading order.

    ``prob`` is the detector's probability map for the resized image (H×W); boxes are scaled to
    the ``image_w`` × ``image_h`` original.
    """
    map_h, map_w = prob.shape
    bitmap = (prob > params.thresh).astype(np.uint8) * 255
    if params.use_dilation:
        bitmap = np.asarray(cv2.dilate(bitmap, np.ones((2, 2), dtype=np.uint8)))
    contours, _ = cv2.findContours(bitmap, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    boxes: list[np.ndarray] = []
    scores: list[float] = []
    for contour in contours[: params.max_candidates]:
        box, short_side = _min_area_box(contour.reshape(-1, 2))
        if short_side < _MIN_SIDE:
            continue
        score = _mean_score(prob, box)
        if score < params.box_thresh:
            continue
        box, short_side = _min_area_box(_unclip(box, params.unclip_ratio))
        if short_side < _MIN_SIDE + 2:
            continue
        box[:, 0] = np.clip(np.round(box[:, 0] / map_w * image_w), 0, image_w)
        box[:, 1] = np.clip(np.round(box[:, 1] / map_h * image_h), 0, image_h)
        box = _order_clockwise(box)
        box[:, 0] = np.clip(box[:, 0], 0, image_w - 1).astype(np.int32)
        box[:, 1] = np.clip(box[:, 1], 0, image_h - 1).astype(np.int32)
        if (
            np.linalg.norm(box[0] - box[1]) <= _MIN_SIDE
            or np.linalg.norm(box[0] - box[3]) <= _MIN_SIDE
        ):
            continue
        boxes.append(box)
        scores.append(score)
    return reading_order(boxes, scores)


def reading_order(
    boxes: list[np.ndarray], scores: list[float]
) -> tuple[list[np.ndarray], list[float]]:
    """Top to bottom, then left to right for boxes whose tops are within a few pixels."""
    if not boxes:
        return boxes, scores
    tops = np.array([b[0, 1] for b in boxes])
    by_y = np.argsort(tops, kind="stable")
    line_ids = np.concatenate([[0], np.cumsum(np.diff(tops[by_y]) >= _SAME_LINE_PX)])
    lefts = np.array([boxes[i][0, 0] for i in by_y])
    order = by_y[np.lexsort((lefts, line_ids))]
    return [boxes[i] for i in order], [scores[i] for i in order]


def crop_text_line(image: np.ndarray, box: np.ndarray) -> np.ndarray:
    """The quadrilateral ``box`` rectified to an upright crop; tall crops are turned 90°."""
    width = int(max(np.linalg.norm(box[0] - box[1]), np.linalg.norm(box[2] - box[3])))
    height = int(max(np.linalg.norm(box[0] - box[3]), np.linalg.norm(box[1] - box[2])))
    width, height = max(width, 1), max(height, 1)
    target = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
    transform = cv2.getPerspectiveTransform(box.astype(np.float32), target)
    crop = cv2.warpPerspective(
        image, transform, (width, height), borderMode=cv2.BORDER_REPLICATE, flags=cv2.INTER_CUBIC
    )
    if crop.shape[0] / crop.shape[1] >= 1.5:
        crop = np.rot90(crop)
    return crop
