"""The camera benchmark's clip: a real 1280×720 H.264 file made with PyAV, like a street camera.

``make_clip(folder, fps)`` writes (once: an existing file is reused) ``SECONDS`` of moving
synthetic content — diagonal stripes that slide, a gradient, a dark block crossing the frame —
with the fixture face (the astronaut's, from ``tests/fixtures/images/astronaut.png``) pasted at
a position that moves with time, so the face model finds one face in every frame and no two
frames are alike (an encoder cannot make them free). Encoded as a camera would: yuv420p, a key
frame every two seconds, no B-frames. The content depends on time, not on the frame number, so
the 30 fps and the 10 fps clips show the same scene.

Called by ``tools.bench.cameras`` (clips cached under ``.bench/clips``, which git ignores).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np

WIDTH, HEIGHT, SECONDS = 1280, 720, 10
ROOT = Path(__file__).resolve().parents[2]
FACE_IMAGE = ROOT / "tests" / "fixtures" / "images" / "astronaut.png"
PATCH = (140, 20, 310, 220)  # x1, y1, x2, y2 of the face and its surroundings in astronaut.png


def _face_patch() -> np.ndarray:
    from duomo.supervisor.operators.image_files import read_image

    x1, y1, x2, y2 = PATCH
    return np.ascontiguousarray(read_image(FACE_IMAGE)[y1:y2, x1:x2, :3])


def _triangle(t_s: float, period_s: float) -> float:
    """0 → 1 → 0 over ``period_s``."""
    phase = (t_s % period_s) / period_s
    return 1.0 - abs(2.0 * phase - 1.0)


def render(t_s: float, patch: np.ndarray) -> np.ndarray:
    """The scene at ``t_s`` seconds, RGB."""
    ys, xs = np.mgrid[0:HEIGHT, 0:WIDTH]
    stripes = ((xs + ys + int(120 * t_s)) // 40) % 2
    image = np.empty((HEIGHT, WIDTH, 3), np.uint8)
    image[..., 0] = np.where(stripes, 70, 115)
    image[..., 1] = np.where(stripes, 125, 90)
    image[..., 2] = (50 + (xs * 120) // WIDTH).astype(np.uint8)
    block = int((WIDTH - 200) * _triangle(t_s, 7.0))  # a "vehicle" crossing the lower half
    image[480:620, block : block + 200] = (30, 30, 40)
    ph, pw = patch.shape[:2]
    left = 20 + int((WIDTH - pw - 40) * _triangle(t_s, 5.0))
    top = 40 + int(200 * _triangle(t_s, 3.0))
    image[top : top + ph, left : left + pw] = patch
    return image


def make_clip(folder: Path, fps: int) -> Path:
    """The clip at ``fps`` frames a second in ``folder`` (made the first time)."""
    import av

    path = folder / f"camera-{WIDTH}x{HEIGHT}-{fps}fps.mp4"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    patch = _face_patch()
    partial = folder / f".{path.name}.partial"
    with av.open(str(partial), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.codec_context.time_base = Fraction(1, fps)
        stream.options = {"crf": "23", "g": str(2 * fps), "bf": "0", "preset": "veryfast"}
        for index in range(fps * SECONDS):
            picture = av.VideoFrame.from_ndarray(render(index / fps, patch), format="rgb24")
            container.mux(stream.encode(picture))
        container.mux(stream.encode(None))
    partial.rename(path)  # (a run cut short leaves no half file under the name)
    return path
