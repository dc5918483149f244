"""Thumbnails of tracked objects: the source's recent frames, kept so that an answer's object can
be cropped from the frame it was found in, and the crop as a small JPEG.

A source with ``thumbnails: left`` or ``appeared`` (and object events) has a ``FrameKeeper``:
the video source calls ``keep`` with every frame it sends (``VideoSource.on_frame``, on the
decode thread, with the slot's view just filled) and it copies the frame — subsampled so its
longest side is at most ``MAX_KEPT_SIDE_PX`` — keeping the last ``KEPT_FRAMES`` by frame number.
That copy is the only cost on the frame path, and only for such a source (a 640×480 frame is
0.9 MB; a 4K one is kept at 1280 px: 2.8 MB; ``KEPT_FRAMES`` of them at most). When an answer's
object scores higher than before in its visit, ``crop`` cuts its box from that frame (if it is
still kept: answers lag the decoder by the frames in flight) and scales it so its longest side
is at most ``MAX_SIDE_PX``; ``jpeg_b64`` encodes the visit's best crop when its event is made.

Threads: ``keep`` on the decode thread, ``crop`` on the answer-reading thread; one lock.
Used by ``video.sink_events`` (through ``video.object_visits``) and ``video.source_worker``.
"""

from __future__ import annotations

import base64
import math
import threading
from collections import OrderedDict

import numpy as np

MAX_SIDE_PX = 128  # a thumbnail's longest side
KEPT_FRAMES = 8  # recent frames kept per source (more than the frames in flight)
MAX_KEPT_SIDE_PX = 1280  # a kept frame's longest side (a larger one is subsampled)
JPEG_QUALITY = 80


class FrameKeeper:
    """A source's last ``KEPT_FRAMES`` sent frames, by frame number (the module docstring)."""

    def __init__(self, kept: int = KEPT_FRAMES) -> None:
        self.kept = kept
        self._frames: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()
        self._lock = threading.Lock()

    def keep(self, stream: str, rgb: np.ndarray, number: int) -> None:
        """(``on_frame``) Copy frame ``number`` (``rgb``: valid during the call only)."""
        step = max(1, math.ceil(max(rgb.shape[:2]) / MAX_KEPT_SIDE_PX))
        copy = np.ascontiguousarray(rgb[::step, ::step])
        with self._lock:
            self._frames[number] = (copy, step)
            while len(self._frames) > self.kept:
                self._frames.popitem(last=False)

    def crop(self, number: int, box: tuple[float, float, float, float]) -> np.ndarray | None:
        """``box`` (in the frame's pixels) cut from frame ``number`` and scaled to at most
        ``MAX_SIDE_PX``; None when the frame is no longer kept or the box is empty."""
        if box[2] <= box[0] or box[3] <= box[1]:
            return None
        with self._lock:
            kept = self._frames.get(number)
        if kept is None:
            return None
        frame, step = kept
        height, width = frame.shape[:2]
        x1, y1 = max(0, int(box[0] / step)), max(0, int(box[1] / step))
        x2, y2 = min(width, math.ceil(box[2] / step)), min(height, math.ceil(box[3] / step))
        if x2 <= x1 or y2 <= y1:
            return None
        chip = frame[y1:y2, x1:x2]
        scale = MAX_SIDE_PX / max(chip.shape[:2])
        if scale >= 1:
            return chip.copy()
        import cv2  # lazily: only a source with thumbnails needs it

        size = (max(1, round(chip.shape[1] * scale)), max(1, round(chip.shape[0] * scale)))
        return np.asarray(cv2.resize(chip, size, interpolation=cv2.INTER_AREA))


def jpeg_b64(rgb: np.ndarray) -> str:
    """``rgb`` as a JPEG, base64 (for ``thumbnail_jpeg_b64``)."""
    import cv2

    ok, encoded = cv2.imencode(
        ".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY]
    )
    if not ok:
        raise ValueError("the thumbnail could not be encoded")
    return base64.b64encode(encoded.tobytes()).decode("ascii")
