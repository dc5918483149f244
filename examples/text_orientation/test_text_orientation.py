"""The text-orientation task on the real classifier, in-process: no supervisor needed.

Run from the Duomo checkout (the model's path is relative to it):
python -m pytest text_orientation
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from duomo.ipc.errors import InvalidArgumentError
from duomo.supervisor.operators.image_files import read_image
from duomo.worker.backends.base import SessionSettings
from duomo.worker.backends.ort_backend import OrtBackend
from duomo.worker.executors.base import Executor, NoParams, StageTimer
from text_orientation.executor import TextOrientationExecutor

MODEL = Path("models/ocr/ch_ppocr_mobile_v2.0_cls_mobile.onnx")
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def executor() -> Iterator[Executor]:
    settings = SessionSettings(intra_op_threads=1)
    executor = TextOrientationExecutor.open(NoParams(), {"model": MODEL}, 4, OrtBackend(), settings)
    executor.warmup()
    yield executor
    executor.close()


def answers(executor: Executor, *images: np.ndarray) -> list[Any]:
    items = [executor.prepare(image) for image in images]  # one batch, as the supervisor runs it
    return executor.execute(items, StageTimer())


def test_a_line_and_the_same_line_upside_down(executor: Executor) -> None:
    line = read_image(HERE / "line.png")
    upright, upside_down = answers(executor, line, np.rot90(line, 2))
    assert upright["angle"] == 0 and upright["score"] > 0.9
    assert upside_down["angle"] == 180 and upside_down["score"] > 0.9


def test_an_answer_is_the_same_alone_and_in_a_batch(executor: Executor) -> None:
    line, upside_down = read_image(HERE / "line.png"), read_image(HERE / "line_180.png")
    alone = answers(executor, line) + answers(executor, upside_down)
    assert answers(executor, line, upside_down) == alone


def test_an_image_that_is_not_uint8_is_refused(executor: Executor) -> None:
    with pytest.raises(InvalidArgumentError):
        executor.prepare(np.zeros((48, 192), dtype=np.float32))
