"""The executors' image operations: a resize into the reusable scratch buffer is the same image
as a fresh resize, reuses the same memory request after request, and never keeps an oversized
buffer; padding is zeroed around the written region; a lookup through a normalization table
gives the bits ``normalize_into`` computes."""

from __future__ import annotations

import numpy as np
import pytest

from duomo.worker.executors.image_ops import (
    ResizeScratch,
    lookup_into,
    normalization_table,
    normalize_into,
    resize,
    rgb,
    zero_padding,
)


def _image(h: int, w: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, channels), dtype=np.uint8)


def test_scratch_resize_is_a_fresh_resize_in_reused_memory() -> None:
    scratch = ResizeScratch()
    big = scratch.resize(_image(512, 512), 640, 640)  # enlarging: bilinear
    assert np.array_equal(big, resize(_image(512, 512), 640, 640))
    small = scratch.resize(_image(400, 600, seed=1), 224, 149)  # shrinking: area
    assert np.array_equal(small, resize(_image(400, 600, seed=1), 224, 149))
    assert small.flags.c_contiguous and small.shape == (149, 224, 3)
    assert np.shares_memory(big, small)  # the second request reused the first one's buffer
    assert scratch.nbytes == 640 * 640 * 3


def test_scratch_does_not_keep_an_oversized_buffer() -> None:
    scratch = ResizeScratch(keep_bytes=100 * 100 * 3)
    kept = scratch.resize(_image(50, 50), 100, 100)
    large = scratch.resize(_image(50, 50), 200, 200)
    assert large.shape == (200, 200, 3) and not np.shares_memory(kept, large)
    assert scratch.nbytes == 100 * 100 * 3


def test_scratch_takes_a_view_with_strides() -> None:
    rgba = _image(64, 48, channels=4)
    rgb = rgba[:, :, :3]  # not contiguous
    assert np.array_equal(
        ResizeScratch().resize(rgb, 32, 24), resize(np.ascontiguousarray(rgb), 32, 24)
    )


def test_normalize_and_zero_padding_fill_a_canvas() -> None:
    canvas = np.full((3, 8, 8), 7.0, dtype=np.float32)
    image = _image(5, 6)
    normalize_into(canvas, image, 0.5, -1.0)
    zero_padding(canvas, 5, 6)
    assert np.allclose(canvas[:, :5, :6], image.transpose(2, 0, 1) * 0.5 - 1.0)
    assert not canvas[:, 5:, :].any() and not canvas[:, :5, 6:].any()


@pytest.mark.parametrize("scale, offset", [(1 / 127.5, -1.0), (1.0, 0.0), (1 / 255, 0.0)])
def test_a_lookup_gives_the_bits_normalize_into_computes(scale: float, offset: float) -> None:
    table = normalization_table(scale, offset)
    rgba = _image(40, 30, channels=4, seed=2)
    for image in (_image(40, 30), rgba[:, :, :3], rgb(rgba[:, :, :1])):  # RGB, a view, gray
        expected = np.empty((3, 40, 30), dtype=np.float32)
        normalize_into(expected, image, scale, offset)
        out = np.full((3, 40, 30), np.nan, dtype=np.float32)
        lookup_into(out, image, table)
        assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_a_lookup_refuses_a_buffer_of_another_size() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        lookup_into(np.empty((3, 8, 8), np.float32), _image(8, 9), normalization_table(1.0, 0.0))
