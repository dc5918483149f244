"""Face alignment (worker/executors/face_align.py): a known similarity transform is recovered
from five points, a mirrored face is rotated rather than reflected, chips are cut in RGB from
any channel count, the templates sit where they should, and bad landmarks are refused naming
the input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from duomo.ipc.errors import InvalidArgumentError
from duomo.worker.executors.face_align import (
    ARCFACE,
    chip_transform,
    dlib_mean_face,
    face_landmarks,
    similarity_transform,
    warp_chip,
)

FACE = np.array([[202.6, 100.4], [249.2, 103.4], [224.5, 123.8], [202.8, 142.1], [242.6, 144.4]])


def _similarity(scale: float, degrees: float, tx: float, ty: float) -> np.ndarray:
    a = math.radians(degrees)
    rotation = scale * np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])
    return np.hstack([rotation, [[tx], [ty]]])


def _apply(matrix: np.ndarray, points: np.ndarray) -> np.ndarray:
    return points @ matrix[:, :2].T + matrix[:, 2]


@pytest.mark.parametrize(
    ("scale", "degrees", "tx", "ty"), [(0.47, 23.0, -61.0, 12.5), (2.5, -170.0, 300.0, -4.0)]
)
def test_a_known_similarity_is_recovered(
    scale: float, degrees: float, tx: float, ty: float
) -> None:
    known = _similarity(scale, degrees, tx, ty)
    found = similarity_transform(FACE, _apply(known, FACE))
    assert np.allclose(found, known, atol=1e-9)


def test_noisy_points_give_the_least_squares_fit() -> None:
    known = _similarity(0.5, 10.0, 5.0, -3.0)
    noise = np.random.default_rng(0).normal(0.0, 0.5, FACE.shape)
    target = _apply(known, FACE) + noise
    found = similarity_transform(FACE, target)
    residual = np.square(_apply(found, FACE) - target).sum()
    assert residual <= np.square(_apply(known, FACE) - target).sum()  # no worse than the truth
    for nudged in (found + 1e-3 * np.eye(2, 3), found - 1e-3 * np.eye(2, 3)):
        assert residual < np.square(_apply(nudged, FACE) - target).sum()


def test_a_mirrored_face_is_rotated_not_reflected() -> None:
    mirrored = FACE * [-1.0, 1.0]  # a reflection would fit exactly; a similarity may not reflect
    found = similarity_transform(mirrored, FACE)
    assert np.linalg.det(found[:, :2]) > 0


def test_templates_sit_where_their_sources_put_them() -> None:
    assert np.allclose(ARCFACE.pixels(112)[0], [38.2946, 51.6963])
    assert np.allclose(ARCFACE.pixels(224), ARCFACE.pixels(112) * 2)
    dlib = dlib_mean_face(0.2)  # dlib's face chip: (padding + p) / (1 + 2 · padding) · size
    assert np.allclose(dlib.pixels(64)[2], (0.2 + np.array([0.490127, 0.515625])) / 1.4 * 64)
    left, right = dlib.pixels(32)[[0, 1]]
    assert left[0] < right[0] and left[1] == right[1]  # the eyes level, image-left first


def test_the_chip_of_a_pure_translation_is_the_image_region() -> None:
    image = np.random.default_rng(1).integers(0, 256, (80, 100, 3), dtype=np.uint8)
    chip = warp_chip(image, _similarity(1.0, 0.0, -30.0, -20.0), 32)
    assert np.array_equal(chip, image[20:52, 30:62])


@pytest.mark.parametrize("channels", [1, 4])
def test_gray_and_rgba_images_give_rgb_chips(channels: int) -> None:
    image = np.random.default_rng(2).integers(0, 256, (40, 50, channels), dtype=np.uint8)
    chip = warp_chip(image, _similarity(1.0, 0.0, -5.0, -5.0), 16)
    assert chip.shape == (16, 16, 3)
    want = image[5:21, 5:21]
    assert np.array_equal(chip, np.repeat(want, 3, axis=2) if channels == 1 else want[:, :, :3])


def test_the_edge_is_repeated_past_the_border() -> None:
    image = np.full((20, 20, 3), 7, dtype=np.uint8)
    chip = warp_chip(image, _similarity(1.0, 0.0, 10.0, 10.0), 40)  # the image in the middle
    assert (chip == 7).all()


def test_a_face_lands_on_its_template() -> None:
    matrix = chip_transform(FACE, ARCFACE, 112)
    assert np.abs(_apply(matrix, FACE) - ARCFACE.pixels(112)).max() < 4.0  # a real face: 3 px


def test_landmarks_are_accepted_as_lists_and_copied() -> None:
    given = np.asarray(FACE, dtype=np.float32)
    points = face_landmarks(given.tolist(), 512, 512)
    assert points.dtype == np.float64 and np.allclose(points, FACE, atol=1e-4)
    given[:] = 0  # the slot's memory rewritten afterwards changes nothing
    assert np.allclose(face_landmarks(FACE, 512, 512), points, atol=1e-4)


def test_a_face_cut_by_the_edge_is_accepted() -> None:
    assert (
        face_landmarks(FACE - np.array([210.0, 0.0]), 512, 512)[0, 0] < 0
    )  # 7 px past the left edge


@pytest.mark.parametrize(
    ("landmarks", "message"),
    [
        (FACE[:4], r"5×2 points .* got shape \[4, 2\]"),
        (FACE.T, r"got shape \[2, 5\]"),
        ([["a", "b"]] * 5, "5×2 numbers"),
        (np.where(np.eye(5, 2, dtype=bool), np.nan, FACE), "NaN"),
        (np.full((5, 2), 100.0), "within one pixel"),
        (FACE + np.array([1000.0, 0.0]), "outside the 512×512 image"),
        (FACE - np.array([0.0, 300.0]), "outside the 512×512 image"),
    ],
)
def test_bad_landmarks_are_refused_naming_the_input(landmarks: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message) as caught:
        face_landmarks(landmarks, 512, 512)
    assert "'landmarks'" in str(caught.value)
