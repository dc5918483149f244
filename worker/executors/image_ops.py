"""Image operations shared by the vision executors: resizing and normalising into a buffer.

Every function writes into caller-owned memory where it can, because executors fill the
session's reusable input buffers directly.
"""

from __future__ import annotations

import cv2
import numpy as np


def limit_opencv_threads() -> None:
    """The server owns the CPU thread budget; OpenCV's own pool would oversubscribe it."""
    cv2.setNumThreads(1)


def resize(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """Resize with area averaging when shrinking (no aliasing) and bilinear when enlarging."""
    h, w = image.shape[:2]
    shrinking = width * height < w * h
    interpolation = cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR
    return cv2.resize(image, (width, height), interpolation=interpolation)


def normalize_into(out_chw: np.ndarray, image_hwc: np.ndarray, scale: float, offset: float) -> None:
    """``out = image * scale + offset`` transposed to C×H×W, written in place into ``out``.

    ``out`` may be larger than the image (a padded canvas); only the top-left region is written.
    """
    h, w = image_hwc.shape[:2]
    region = out_chw[:, :h, :w]
    np.multiply(image_hwc.transpose(2, 0, 1), scale, out=region, casting="unsafe")
    region += offset
