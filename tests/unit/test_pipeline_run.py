"""What a pipeline's ``for_each`` step runs on: the objects its filters select
(``supervisor.dataflow.pipelines.select``) and what each object's request is given
(``worker.executors.object_crops.object_payload``: a crop of the frame, widened and resized, or
the frame with the object's points). The run itself, on the real models, is
tests/integration/test_pipelines.py's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from duomo.ipc.errors import InvalidArgumentError
from duomo.supervisor.dataflow.pipeline_config import ForEach
from duomo.supervisor.dataflow.pipelines import select
from duomo.worker.executors.object_crops import object_payload

OBJECTS: list[dict[str, Any]] = [
    {"box": [0, 0, 10, 10], "score": 0.9},  # area 100, side 10
    {"box": [0, 0, 40, 20], "score": 0.4},  # area 800, side 20
    {"box": [10, 10, 40, 40], "score": 0.95},  # area 900, side 30
    {"box": [0, 0, 4, 50], "score": 0.99},  # area 200, side 4
]


def each(**fields: Any) -> ForEach:
    return ForEach(step="detect", **fields)


def test_select_without_filters_takes_every_object_in_order() -> None:
    assert select(OBJECTS, each()) == [0, 1, 2, 3]
    assert select([], each()) == []


def test_select_by_score_and_shorter_side() -> None:
    assert select(OBJECTS, each(min_score=0.5)) == [0, 2, 3]
    assert select(OBJECTS, each(min_size=10)) == [0, 1, 2]  # the 4 px wide one is too thin
    assert select(OBJECTS, each(min_score=0.5, min_size=10)) == [0, 2]
    assert select(OBJECTS, each(min_score=1.0)) == []


def test_select_the_largest_keeps_the_objects_order() -> None:
    assert select(OBJECTS, each(largest=2)) == [1, 2]  # 800 and 900, in their order
    assert select(OBJECTS, each(largest=3)) == [1, 2, 3]
    assert select(OBJECTS, each(largest=10)) == [0, 1, 2, 3]
    assert select(OBJECTS, each(min_score=0.5, largest=2)) == [2, 3]  # filtered first


def test_select_reads_a_polygon_by_its_bounds_and_an_object_without_a_box() -> None:
    line = {"box": [[0, 0], [30, 2], [30, 12], [0, 10]], "score": 0.8}  # bounds 30 × 12
    thin = {"box": [[0, 0], [30, 0], [30, 3], [0, 3]]}  # no score: counts as 1.0
    boxless = {"score": 0.99}
    assert select([line, thin, boxless], each(min_size=5)) == [0]
    assert select([line, thin, boxless], each(min_score=0.9)) == [1, 2]
    assert select([line, thin, boxless], each(largest=1)) == [0]


FRAME = np.arange(60 * 80 * 3, dtype=np.uint32).reshape(60, 80, 3).astype(np.uint8)


def test_a_crop_of_the_box_is_a_view_of_the_frame() -> None:
    crop = object_payload(FRAME, {"box": [10.2, 5.7, 30.5, 25.0]}, each())
    assert isinstance(crop, np.ndarray) and crop.shape == (20, 21, 3)
    np.testing.assert_array_equal(crop, FRAME[5:25, 10:31])
    assert np.shares_memory(crop, FRAME)  # no copy of the frame's pixels


def test_a_crop_with_a_margin_is_clipped_to_the_frame() -> None:
    crop = object_payload(FRAME, {"box": [10, 10, 30, 20]}, each(margin=0.5))
    np.testing.assert_array_equal(crop, FRAME[5:25, 0:40])  # 10 px and 5 px on each side
    edge = object_payload(FRAME, {"box": [70, 50, 90, 70]}, each(margin=0.25))
    np.testing.assert_array_equal(edge, FRAME[45:60, 65:80])


def test_a_crop_resized() -> None:
    crop = object_payload(FRAME, {"box": [0, 0, 40, 30]}, each(resize=(16, 8)))
    assert crop.shape == (8, 16, 3) and crop.dtype == np.uint8
    polygon = object_payload(FRAME, {"box": [[2, 3], [12, 3], [12, 9], [2, 9]]}, each())
    np.testing.assert_array_equal(polygon, FRAME[3:9, 2:12])  # a polygon: its bounds


def test_landmarks_and_quad_hand_the_whole_frame_and_the_points() -> None:
    points = [[1.5, 2.0], [3.0, 4.0], [5, 6], [7, 8], [9, 10]]
    given = object_payload(
        FRAME, {"box": [0, 0, 5, 5], "landmarks": points}, each(input="landmarks")
    )
    assert set(given) == {"image", "landmarks"} and given["image"] is FRAME
    assert given["landmarks"].dtype == np.float32 and given["landmarks"].shape == (5, 2)
    quad = [[0, 0], [10, 0], [10, 5], [0, 5]]
    given = object_payload(FRAME, {"box": quad}, each(input="quad"))
    assert set(given) == {"image", "quad"}
    np.testing.assert_array_equal(given["quad"], np.array(quad, dtype=np.float32))


@pytest.mark.parametrize(
    ("frame", "item", "fields", "message"),
    [
        (FRAME, {"box": [100, 100, 120, 120]}, {}, "outside the frame"),
        (FRAME, {"score": 0.9}, {}, "has no box"),
        (FRAME, {"box": [1, 2, 3]}, {}, "has no box"),
        (FRAME, {"box": [0, 0, 5, 5]}, {"input": "landmarks"}, "has no landmarks"),
        (FRAME, {"landmarks": [["a", "b"]]}, {"input": "landmarks"}, "not a list of points"),
        ({"x": FRAME}, {"box": [0, 0, 5, 5]}, {}, "not an image"),
        (np.zeros(5, np.uint8), {"box": [0, 0, 5, 5]}, {}, "not an image"),
    ],
)
def test_what_cannot_be_cut_is_an_invalid_argument(
    frame: Any, item: dict[str, Any], fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        object_payload(frame, item, each(**fields))
