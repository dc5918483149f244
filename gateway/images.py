"""Encoded images (PNG, JPEG) decoded in the gateway, straight into a request's slot.

Called by ``gateway.inference`` for an ``IMAGE`` input sent as ``BYTES``. The image's size is
read from its header before anything is decoded, so a small file that claims 60000×60000
pixels costs nothing; the pixels are decoded by OpenCV and converted from its BGR order into
the slot's RGB view in one pass (``cvtColor`` with the slot as its destination).
"""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np

from duomo.ipc.errors import InvalidArgumentError

MAX_SIDE = 16384  # as the supervisor's executors: larger images are refused there anyway


def image_size(data: bytes) -> tuple[int, int, int]:
    """(height, width, channels) of an encoded image, from its header alone; the channels are
    those ``decode_into`` writes (1 for gray, with or without alpha; 4 for RGBA; else 3)."""
    from PIL import Image, UnidentifiedImageError  # (only a worker that is sent images needs it)

    try:
        with Image.open(io.BytesIO(data)) as header:
            width, height = header.size
            channels = {"L": 1, "LA": 1, "I": 1, "I;16": 1, "RGBA": 4}.get(header.mode, 3)
            if header.format not in ("PNG", "JPEG"):
                raise InvalidArgumentError(
                    f"IMAGE bytes are {header.format}; send a PNG or a JPEG, or UINT8 pixels"
                )
    except Image.DecompressionBombError as err:
        raise InvalidArgumentError(f"IMAGE is too large to decode: {err}") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidArgumentError("IMAGE bytes are not a PNG or JPEG image") from None
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
        raise InvalidArgumentError(f"image size {width}×{height} is outside 1..{MAX_SIDE} per side")
    return height, width, channels


def decode_into(data: bytes, target: Callable[[tuple[int, int, int]], np.ndarray]) -> None:
    """Decode ``data`` into the array ``target(shape)`` gives (a view of the slot, asked for
    before anything is decoded, so an image larger than the slot costs nothing)."""
    import cv2  # (only a worker that is sent encoded images needs OpenCV: tens of MiB)

    shape = image_size(data)
    out = target(shape)
    flags = {1: cv2.IMREAD_GRAYSCALE, 3: cv2.IMREAD_COLOR, 4: cv2.IMREAD_UNCHANGED}[shape[2]]
    decoded = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), flags)
    if decoded is None or decoded.shape[:2] != shape[:2]:
        raise InvalidArgumentError("IMAGE bytes could not be decoded")
    if decoded.dtype != np.uint8:  # a 16-bit PNG: scale to 8 bits
        decoded = (decoded // 257).astype(np.uint8)
    if shape[2] == 1:
        out[:, :, 0] = decoded if decoded.ndim == 2 else decoded[:, :, 0]
        return
    if decoded.ndim != 3 or decoded.shape[2] != shape[2] or shape[2] not in (3, 4):
        raise InvalidArgumentError("IMAGE bytes could not be decoded")
    to_rgb = cv2.COLOR_BGR2RGB if shape[2] == 3 else cv2.COLOR_BGRA2RGBA
    written = cv2.cvtColor(decoded, to_rgb, dst=out)
    if written is not out and not np.shares_memory(written, out):
        out[...] = written  # (OpenCV made an array of its own)
