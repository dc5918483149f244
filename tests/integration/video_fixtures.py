"""The test videos of the video source's tests: real H.264 made with PyAV, with known contents.

``make_test_video(folder)`` writes (once per folder: the tests pass one per session) an MP4 of
``SECONDS`` at ``FPS``: a moving synthetic background (diagonal stripes that slide), the fixture
face (the astronaut's, cut from tests/fixtures/images/astronaut.png) pasted at a position that
moves with the frame number (``face_box(n)`` says where the face is in frame ``n``), and
``TEXT`` rendered large, black on a white panel, for OCR. Key frames every second and no
B-frames, so an RTSP client that joins mid-file starts within a second.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import cv2
import numpy as np

from tests.conftest import fixture_image

WIDTH, HEIGHT, FPS, SECONDS = 640, 480, 15, 20
TEXT = "DUOMO 34"
# the astronaut's face in astronaut.png (the face model's box there: 180,62 - 271,178) and the
# patch around it that is pasted into the frames
PATCH = (140, 20, 310, 220)  # x1, y1, x2, y2 in astronaut.png
FACE_IN_PATCH = (40, 42, 131, 158)  # the face box inside the patch
PANEL = (40, 360, 600, 460)  # the white panel the text is written on


def face_origin(frame: int) -> tuple[int, int]:
    """The patch's top-left corner in frame ``frame``: there and back along the width, every
    4 seconds, and a little up and down."""
    travel = WIDTH - (PATCH[2] - PATCH[0]) - 20
    phase = (frame % (4 * FPS)) / (4 * FPS)
    left = 10 + round(travel * (1 - abs(2 * phase - 1)))
    top = 40 + round(30 * abs(2 * ((frame % (2 * FPS)) / (2 * FPS)) - 1))
    return left, top


def face_box(frame: int) -> tuple[int, int, int, int]:
    """Where the face is in frame ``frame`` (x1, y1, x2, y2)."""
    left, top = face_origin(frame)
    x1, y1, x2, y2 = FACE_IN_PATCH
    return left + x1, top + y1, left + x2, top + y2


def render(frame: int, patch: np.ndarray) -> np.ndarray:
    """Frame ``frame`` as RGB."""
    ys, xs = np.mgrid[0:HEIGHT, 0:WIDTH]
    stripes = ((xs + ys + 4 * frame) // 24) % 2
    image = np.empty((HEIGHT, WIDTH, 3), np.uint8)
    image[..., 0] = np.where(stripes, 70, 110)
    image[..., 1] = np.where(stripes, 120, 90)
    image[..., 2] = (60 + (xs * 100) // WIDTH).astype(np.uint8)
    left, top = face_origin(frame)
    image[top : top + patch.shape[0], left : left + patch.shape[1]] = patch
    x1, y1, x2, y2 = PANEL
    image[y1:y2, x1:x2] = 255
    cv2.putText(
        image, TEXT, (x1 + 40, y2 - 28), cv2.FONT_HERSHEY_SIMPLEX, 2.0, (0, 0, 0), 5, cv2.LINE_AA
    )
    return image


def make_test_video(folder: Path) -> Path:
    """The test video in ``folder`` (made the first time)."""
    path = folder / "street.mp4"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    x1, y1, x2, y2 = PATCH
    patch = np.ascontiguousarray(fixture_image("astronaut.png")[y1:y2, x1:x2, :3])
    partial = folder / "street.partial.mp4"
    with av.open(str(partial), mode="w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.codec_context.time_base = Fraction(1, FPS)
        stream.options = {"crf": "20", "g": str(FPS), "bf": "0", "preset": "veryfast"}
        for index in range(FPS * SECONDS):
            picture = av.VideoFrame.from_ndarray(render(index, patch), format="rgb24")
            container.mux(stream.encode(picture))
        container.mux(stream.encode(None))
    partial.rename(path)  # (a run cut short leaves no half file behind under the name)
    return path
