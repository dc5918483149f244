"""Image operations shared by the vision executors: resizing and normalising into a buffer.

Every function writes into caller-owned memory where it can, because executors fill the
session's reusable input buffers directly; ``ResizeScratch`` is an executor's reusable buffer
for the resized image between the request's pixels and that input buffer, so a request
allocates no image-sized memory (with the supervisor's fixed mmap threshold, a fresh 1.2 MB
buffer per request costs page faults: 0.3 ms per face request, README "Benchmarks").
"""

from __future__ import annotations

import cv2
import numpy as np


def limit_opencv_threads() -> None:
    """The server owns the CPU thread budget; OpenCV's own pool would oversubscribe it."""
    cv2.setNumThreads(1)


def _interpolation(image: np.ndarray, width: int, height: int) -> int:
    """Area averaging when shrinking (no aliasing), bilinear when enlarging."""
    h, w = image.shape[:2]
    return cv2.INTER_AREA if width * height < w * h else cv2.INTER_LINEAR


def resize(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """``image`` resized to ``width``×``height`` in a new array."""
    return cv2.resize(image, (width, height), interpolation=_interpolation(image, width, height))


class ResizeScratch:
    """One executor's reusable buffer for resized images; it grows to the largest one asked
    for up to ``keep_bytes`` (a larger one gets an array of its own, not kept) and is reused by
    every later request. Each ``resize`` may overwrite what the previous one returned: use the
    result before resizing the next image."""

    def __init__(self, keep_bytes: int = 16 << 20) -> None:
        self.keep_bytes = keep_bytes
        self._buffer = np.empty(0, dtype=np.uint8)

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    def resize(self, image: np.ndarray, width: int, height: int) -> np.ndarray:
        """``image`` (uint8 H×W×C) resized to ``width``×``height``, as a view of the buffer."""
        shape = (height, width, *image.shape[2:])
        size = int(np.prod(shape))
        if size > self.keep_bytes:
            return resize(image, width, height)
        if size > self._buffer.size:
            self._buffer = np.empty(size, dtype=np.uint8)
        out = self._buffer[:size].reshape(shape)
        written = cv2.resize(
            image, (width, height), dst=out, interpolation=_interpolation(image, width, height)
        )
        if written is not out and not np.shares_memory(written, out):
            raise RuntimeError("OpenCV did not resize into the scratch buffer")
        return out


def normalize_into(out_chw: np.ndarray, image_hwc: np.ndarray, scale: float, offset: float) -> None:
    """``out = image * scale + offset`` transposed to C×H×W, written in place into ``out``.

    ``out`` may be larger than the image (a padded canvas); only the top-left region is written.
    """
    h, w = image_hwc.shape[:2]
    region = out_chw[:, :h, :w]
    np.multiply(image_hwc.transpose(2, 0, 1), scale, out=region, casting="unsafe")
    if offset:
        region += offset


def zero_padding(out_chw: np.ndarray, height: int, width: int) -> None:
    """Zero what lies outside the top-left ``height``×``width`` region of a C×H×W canvas."""
    out_chw[:, height:, :] = 0.0
    out_chw[:, :height, width:] = 0.0
