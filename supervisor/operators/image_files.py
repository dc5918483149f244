"""Reading image files into the arrays the vision executors take (uint8 RGB H×W×3 or gray H×W).

Called by the CLI and the benchmark; producers that decode video hand arrays over directly.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from duomo.ipc.errors import InvalidArgumentError, NotFoundError


def read_image(path: str | Path) -> np.ndarray:
    """Decode PNG/JPEG (or anything OpenCV reads) to uint8 RGB, or gray for a gray file.

    16-bit images are scaled to 8 bits; an alpha channel is dropped. A missing file raises
    NotFoundError, a file that is not an image InvalidArgumentError.
    """
    path = Path(path)
    try:
        data = np.fromfile(path, dtype=np.uint8)
    except FileNotFoundError:
        raise NotFoundError(f"{path}: no such file") from None
    except (IsADirectoryError, PermissionError, OSError) as err:
        raise InvalidArgumentError(f"{path}: cannot read ({err.strerror or err})") from None
    image = cv2.imdecode(data, cv2.IMREAD_UNCHANGED) if data.size else None
    if image is None:
        raise InvalidArgumentError(f"{path}: not an image OpenCV can decode (PNG, JPEG, ...)")
    if image.dtype == np.uint16:
        image = (np.asarray(image, dtype=np.uint16) // 257).astype(np.uint8)
    elif image.dtype != np.uint8:
        raise InvalidArgumentError(f"{path}: unsupported pixel type {image.dtype}")
    if image.ndim == 2:
        return image
    if image.shape[2] == 4:
        return cv2.cvtColor(image, cv2.COLOR_BGRA2RGB)
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
