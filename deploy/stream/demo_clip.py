"""The demo clip that the images carry for their example stream source: a few seconds of H.264 in
which a fixture photo (a face) moves across a still background, written with PyAV.

deploy/Containerfile (and Containerfile.ascend) run it in the build stage; deploy/config/
sources.yaml and the Kubernetes component stream-source play it in a loop through
``duomo stream``, so that the layouts show a camera's answers before any camera is configured.

    python demo_clip.py IMAGE.png OUT.mp4 [--seconds 4] [--fps 10]
"""

from __future__ import annotations

import argparse
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

WIDTH, HEIGHT = 768, 512  # the photo (512 × 512) moves across the width


def read_rgb(path: Path) -> np.ndarray:
    """The image file as uint8 RGB, decoded by PyAV."""
    with av.open(str(path)) as container:
        frame = next(container.decode(video=0))
    image: np.ndarray = frame.to_ndarray(format="rgb24")
    return image


def frames(photo: np.ndarray, count: int) -> list[np.ndarray]:
    """``count`` frames: the photo sliding right and back over a gray gradient."""
    top = max(HEIGHT - photo.shape[0], 0) // 2
    photo = photo[: HEIGHT - top, :WIDTH]
    shade = np.linspace(90, 160, WIDTH, dtype=np.uint8)
    background = np.repeat(np.repeat(shade[None, :, None], HEIGHT, 0), 3, 2)
    travel = WIDTH - photo.shape[1]
    out = []
    for index in range(count):
        phase = index / max(count - 1, 1)
        left = round(travel * (1 - abs(2 * phase - 1)))  # there and back
        frame = background.copy()
        frame[top : top + photo.shape[0], left : left + photo.shape[1]] = photo
        out.append(frame)
    return out


def write(path: Path, images: list[np.ndarray], fps: int) -> None:
    """Encode ``images`` as H.264 (yuv420p, a key frame every second) into an MP4 file."""
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = WIDTH, HEIGHT
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = Fraction(1, fps)
        stream.options = {"crf": "26", "g": str(fps), "preset": "veryfast"}
        for image in images:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode(None))


def main() -> None:
    parser = argparse.ArgumentParser(description="write the demo clip of the stream source")
    parser.add_argument("image", type=Path, help="a photo with a face (PNG)")
    parser.add_argument("out", type=Path, help="the MP4 file to write")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--fps", type=int, default=10)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write(args.out, frames(read_rgb(args.image), round(args.seconds * args.fps)), args.fps)


if __name__ == "__main__":
    main()
