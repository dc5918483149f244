"""Image operations shared by the vision executors: resizing and normalising into a buffer.

Every function writes into caller-owned memory where it can, because executors fill the
session's reusable input buffers directly; ``ResizeScratch`` is an executor's reusable buffer
for the resized image between the request's pixels and that input buffer, so a request
allocates no image-sized memory (with the supervisor's fixed mmap threshold, a fresh 1.2 MB
buffer per request costs page faults: 0.3 ms per face request, docs/design-notes.md, "Memory").

A request's frame is never copied at its full size, whatever its size or channels: ``as_image``
checks it and returns it as it is (a view into its slot), the resize reads it once, and gray or
RGBA pixels become RGB only after that, on the small image (``rgb``). A 6000×4000 RGBA frame
would otherwise cost a 72 MB copy before anything else happened.

``image_points`` and ``check_near_image`` check points a request gives in its image's pixels (a
face's landmarks, ``face_align``; a text line's corners, ``ocr_stages``).
"""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np

from duomo.ipc.errors import InvalidArgumentError
from duomo.worker.executors.base import MAX_IMAGE_SIDE


def limit_opencv_threads() -> None:
    """The server owns the CPU thread budget; OpenCV's own pool would oversubscribe it."""
    cv2.setNumThreads(1)


def _interpolation(image: np.ndarray, width: int, height: int) -> int:
    """Area averaging when shrinking (no aliasing), bilinear when enlarging."""
    h, w = image.shape[:2]
    return cv2.INTER_AREA if width * height < w * h else cv2.INTER_LINEAR


def as_image(payload: Any) -> np.ndarray:
    """The payload as uint8 H×W×C pixels (C: 1 gray, 3 RGB, 4 RGBA), checked but not copied
    or converted (``rgb`` converts a resized image); InvalidArgumentError otherwise."""
    if not isinstance(payload, np.ndarray):
        raise InvalidArgumentError(f"expected an image array, got {type(payload).__name__}")
    if payload.dtype != np.uint8:
        raise InvalidArgumentError(f"image must be uint8, got {payload.dtype}")
    image = payload[:, :, None] if payload.ndim == 2 else payload
    if image.ndim != 3 or image.shape[2] not in (1, 3, 4):
        raise InvalidArgumentError(
            f"image must be H×W, H×W×3 or H×W×4, got shape {tuple(payload.shape)}"
        )
    h, w = image.shape[:2]
    if not (1 <= h <= MAX_IMAGE_SIDE and 1 <= w <= MAX_IMAGE_SIDE):
        raise InvalidArgumentError(f"image size {w}×{h} is outside 1..{MAX_IMAGE_SIDE} per side")
    return image


def rgb(image: np.ndarray) -> np.ndarray:
    """An H×W×C image as RGB, as a view: gray read three times, alpha left out."""
    if image.ndim == 2:
        image = image[:, :, None]
    channels = image.shape[2]
    if channels == 4:
        return image[:, :, :3]
    if channels == 1:
        return np.broadcast_to(image, (*image.shape[:2], 3))
    return image


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
        """``image`` (uint8 H×W×C, C 1, 3 or 4: ``as_image``) resized to ``width``×``height``,
        as an RGB view of the buffer (gray and RGBA are converted after the resize: ``rgb``)."""
        if image.ndim == 3 and image.shape[2] == 1:
            image = image[:, :, 0]  # (OpenCV's one-channel image is two-dimensional)
        shape = (height, width, *image.shape[2:])
        size = int(np.prod(shape))
        if size > self.keep_bytes:
            return rgb(resize(image, width, height))
        if size > self._buffer.size:
            self._buffer = np.empty(size, dtype=np.uint8)
        out = self._buffer[:size].reshape(shape)
        written = cv2.resize(
            image, (width, height), dst=out, interpolation=_interpolation(image, width, height)
        )
        if written is not out and not np.shares_memory(written, out):
            raise RuntimeError("OpenCV did not resize into the scratch buffer")
        return rgb(out)


def normalize_into(out_chw: np.ndarray, image_hwc: np.ndarray, scale: float, offset: float) -> None:
    """``out = image * scale + offset`` transposed to C×H×W, written in place into ``out``.

    ``out`` may be larger than the image (a padded canvas); only the top-left region is written.
    """
    h, w = image_hwc.shape[:2]
    region = out_chw[:, :h, :w]
    np.multiply(image_hwc.transpose(2, 0, 1), scale, out=region, casting="unsafe")
    if offset:
        region += offset


def normalization_table(scale: float, offset: float, channels: int = 3) -> np.ndarray:
    """What ``normalize_into(out, image, scale, offset)`` makes of each pixel value 0..255, per
    channel (``channels``×256 float32): computed by ``normalize_into`` itself, so a lookup in it
    (``lookup_into``) gives the same float32 bits as the arithmetic. A caller may apply more
    per-channel arithmetic to the table (a mean, a standard deviation) to match its own."""
    values = np.broadcast_to(np.arange(256, dtype=np.uint8)[None, :, None], (1, 256, channels))
    table = np.empty((channels, 1, 256), dtype=np.float32)
    normalize_into(table, values, scale, offset)
    return table.reshape(channels, 256)


def lookup_into(out_chw: np.ndarray, image_hwc: np.ndarray, table: np.ndarray) -> None:
    """``out[c] = table[c][image[:, :, c]]``, written in place: a uint8 H×W×C image (a view: gray
    read as RGB, ``rgb``, is looked up once per channel without a copy) through one 256-entry
    float32 table per channel (``normalization_table``) into a C×H×W float32 buffer of its size.

    Half the time of ``normalize_into`` for a 224×224 RGB crop: OpenCV splits the channels into
    planes and looks each one up, where numpy's arithmetic writes the transposed image element by
    element in float64 (docs/benchmarks.md, "Classification pre-processing")."""
    h, w, channels = image_hwc.shape
    if out_chw.shape != (channels, h, w) or table.shape != (channels, 256):
        raise ValueError(
            f"lookup_into: out {out_chw.shape} and table {table.shape} do not fit an image of "
            f"shape {image_hwc.shape}"
        )
    if image_hwc.strides[2] == 0:  # one plane read as every channel
        planes = [image_hwc[:, :, 0]] * channels
    else:
        planes = list(cv2.split(image_hwc))
    for plane, values, out in zip(planes, table, out_chw):
        written = cv2.LUT(plane, values, dst=out)
        if written is not out and not np.shares_memory(written, out):
            raise RuntimeError("OpenCV did not write the lookup into the buffer given")


def zero_padding(out_chw: np.ndarray, height: int, width: int) -> None:
    """Zero what lies outside the top-left ``height``×``width`` region of a C×H×W canvas."""
    out_chw[:, height:, :] = 0.0
    out_chw[:, :height, width:] = 0.0


def image_points(value: Any, count: int, dtype: type, name: str, order: str = "") -> np.ndarray:
    """``value`` as ``count`` (x, y) points in an image's pixels (a face's landmarks, a text
    line's corners); InvalidArgumentError naming input ``name``: not ``count`` pairs of real
    numbers, or a NaN or an infinity. ``order``: how the points go, said in the shape's error."""
    try:
        points: np.ndarray = np.array(value, dtype=dtype)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"input {name!r} must be {count}×2 numbers (x, y), got {type(value).__name__} "
            "that is not an array of numbers"
        ) from None
    if points.shape != (count, 2):
        raise InvalidArgumentError(
            f"input {name!r} must be {count}×2 points (x, y) in pixels{order}, "
            f"got shape {list(points.shape)}"
        )
    if not np.isfinite(points).all():
        raise InvalidArgumentError(f"input {name!r} holds a NaN or an infinity")
    return points


def check_near_image(
    points: np.ndarray, width: int, height: int, name: str, past: str = ""
) -> None:
    """InvalidArgumentError naming input ``name`` when a point lies outside the ``width`` ×
    ``height`` image by more than the points' own extent (a little outside: an object cut by the
    frame's edge; far outside: points of another image); ``past`` ends the message."""
    reach = float(np.ptp(points, axis=0).max())
    low, high = points.min(axis=0), points.max(axis=0)
    if (low < -reach).any() or high[0] > width + reach or high[1] > height + reach:
        raise InvalidArgumentError(
            f"input {name!r} lies outside the {width}×{height} image "
            f"(x {low[0]:.1f}..{high[0]:.1f}, y {low[1]:.1f}..{high[1]:.1f}{past})"
        )
