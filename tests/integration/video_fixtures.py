"""The test videos of the video source's tests: real H.264 made with PyAV, with known contents.

``make_test_video(folder)`` writes (once per folder: the tests pass one per session) an MP4 of
``SECONDS`` at ``FPS``: a moving synthetic background (diagonal stripes that slide), the fixture
face (the astronaut's, cut from tests/fixtures/images/astronaut.png) pasted at a position that
moves with the frame number (``face_box(n)`` says where the face is in frame ``n``), and
``TEXT`` rendered large, black on a white panel, for OCR. Key frames every second and no
B-frames, so an RTSP client that joins mid-file starts within a second. ``make_clip`` writes a
short plain clip (a moving pattern) with a chosen codec and number of slices per frame.

Cameras: ``camera_sim(files, *options)`` runs ``duomo camera-sim`` (GStreamer's RTSP server under
Debian's python3, ``video/camera_sim.py``) on a free port (or the ``port`` given, to restart a
camera where it was) and yields a ``CameraSim``: its process and the URLs of its ``READY`` line,
``/<stem>`` and ``/<stem>/corrupt`` per file; it is stopped (SIGTERM) on leaving.
``start_camera_sim`` is the same without the ``with``, for a test that stops and restarts it.
Tests that use them call ``require_camera_sim()`` first: it skips (a failure with CI=true,
tests/conftest.py) without GStreamer's RTSP server.
"""

from __future__ import annotations

import functools
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

import av
import cv2
import numpy as np
import pytest

from duomo.video.camera_sim import DEBIAN_PYTHON, SERVER
from duomo.video.camera_sim_server import DEBIAN_PACKAGES
from tests.conftest import ROOT, fixture_image
from tests.integration.harness import stop_gracefully

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


def make_clip(
    path: Path, *, seconds: float = 1.0, fps: int = 15, slices: int = 1, codec: str = "libx264"
) -> Path:
    """A 320x240 clip of a sliding pattern: H.264 with ``slices`` slices per frame, no B-frames
    and a key frame every second (``codec="mpeg4"``: MPEG-4 part 2 instead)."""
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = 320, 240, "yuv420p"
        stream.codec_context.time_base = Fraction(1, fps)
        if codec == "libx264":  # frame threads: PyAV's slice threads would add slices
            stream.codec_context.thread_type = "FRAME"
            stream.options = {"bf": "0", "g": str(fps), "x264-params": f"slices={slices}"}
        ys, xs = np.mgrid[0:240, 0:320]
        for index in range(round(seconds * fps)):
            picture = np.zeros((240, 320, 3), np.uint8)
            picture[..., 0] = ((xs + ys + 6 * index) // 16) % 2 * 200
            picture[..., 1] = (xs * 255) // 320
            picture[..., 2] = (index * 9) % 256
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


@functools.cache
def _camera_sim_missing() -> str | None:
    """Why ``duomo camera-sim`` cannot run here, or None (asked once per session)."""
    if not DEBIAN_PYTHON.is_file():
        return f"{DEBIAN_PYTHON} is missing"
    check = (
        f"import runpy, sys; found = runpy.run_path({str(SERVER)!r})['load_gstreamer'](); "
        "print(found or ''); sys.exit(found is not None)"
    )
    done = subprocess.run(
        [str(DEBIAN_PYTHON), "-I", "-c", check], capture_output=True, text=True, timeout=60
    )
    return None if done.returncode == 0 else done.stdout.strip() or done.stderr.strip()


def require_camera_sim() -> None:
    """Skip (a failure with CI=true: tests/conftest.py) without GStreamer's RTSP server for
    Debian's python3."""
    missing = _camera_sim_missing()
    if missing is not None:
        pytest.skip(
            f"duomo camera-sim cannot run ({missing}): make test installs the Debian packages "
            f"{' '.join(DEBIAN_PACKAGES)}"
        )


@dataclass
class CameraSim:
    """A running ``duomo camera-sim``: its process (the server itself: ``duomo camera-sim``
    execs it) and what it printed."""

    process: subprocess.Popen[bytes]
    urls: list[str]  # the READY line's: /<stem> and /<stem>/corrupt per file, in order
    lines: list[str]  # the lines before READY, one per URL, saying what it serves

    @property
    def port(self) -> int:
        return int(urlsplit(self.urls[0]).port or 0)

    def url(self, path: str) -> str:
        """The URL of ``path`` (``/street``, ``/street/corrupt``, or one not served)."""
        served = urlsplit(self.urls[0])
        return f"{served.scheme}://{served.netloc}{path}"


def start_camera_sim(
    files: Sequence[Path], *options: str, port: int = 0, timeout_s: float = 60.0
) -> CameraSim:
    """``duomo camera-sim FILES --port PORT OPTIONS``, once it has printed READY."""
    # stderr into a file: a pipe nobody reads could fill and block the server
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(
            [sys.executable, "-m", "duomo.supervisor", "camera-sim",
             *(str(f) for f in files), "--port", str(port), *options],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=errors,
        )  # fmt: skip
        assert process.stdout is not None
        lines = _lines_until_ready(process.stdout, time.monotonic() + timeout_s)
        if not lines or not lines[-1].startswith("READY "):
            stop_gracefully(process)
            errors.seek(0)
            said = errors.read().decode(errors="replace")
            raise AssertionError(f"duomo camera-sim did not start: {lines!r} {said}")
    return CameraSim(process, lines[-1].split()[1:], lines[:-1])


@contextmanager
def camera_sim(files: Sequence[Path], *options: str, port: int = 0) -> Iterator[CameraSim]:
    """A running ``duomo camera-sim`` (``start_camera_sim``), stopped on leaving."""
    sim = start_camera_sim(files, *options, port=port)
    try:
        yield sim
    finally:
        stop_gracefully(sim.process)


def _lines_until_ready(stdout: IO[bytes], deadline: float) -> list[str]:
    """The whole lines printed up to the READY line (or to the output's end, or the deadline).
    Read from the descriptor itself: a buffered reader could hold lines select would not see."""
    received = b""
    while True:
        lines = [line.decode() for line in received.split(b"\n")[:-1]]
        ready_at = next((n for n, line in enumerate(lines) if line.startswith("READY ")), None)
        if ready_at is not None:
            return lines[: ready_at + 1]
        readable, _, _ = select.select([stdout], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(stdout.fileno(), 65536) if readable else b""
        if not chunk:
            return lines
        received += chunk
