"""OCR's two stages as tasks (``worker/executors/ocr_stages.py``), without the models: how
they are registered and configured, what ``ocr_reading`` takes, and that it reads a batch of
lines as it reads each line alone (fake sessions whose answer depends only on a row's pixels).
The real models' answers, equal to ``ocr``'s, are tests/integration/test_ocr_pipeline.py's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from duomo.ipc.errors import InvalidArgumentError
from duomo.supervisor.dataflow.pipeline_config import PipelineConfig, pipeline_problems
from duomo.worker.backends.base import ModelSession, TensorSpec
from duomo.worker.executors import resolve_executor
from duomo.worker.executors.base import StageTimer
from duomo.worker.executors.ocr import (
    OcrDetectionParams,
    OcrExecutor,
    OcrParams,
    OcrReadingParams,
    crop_rgb_line,
)
from duomo.worker.executors.ocr_stages import (
    LINE_SLOT,
    OcrDetectionExecutor,
    OcrReadingExecutor,
    line_request,
)
from tests.conftest import DEMO_CONFIG, ROOT

BENCH_CONFIG = ROOT / "configs" / "ocr-pipeline.yaml"


def test_the_stage_tasks_are_built_in_with_what_a_pipeline_needs() -> None:
    detection, reading = resolve_executor("ocr_detection"), resolve_executor("ocr_reading")
    assert detection is OcrDetectionExecutor and reading is OcrReadingExecutor
    assert detection.roles == ("det",) and detection.objects == "lines"
    assert reading.roles == ("cls", "rec") and reading.object_inputs == frozenset({"quad"})
    assert [i.name for i in LINE_SLOT.inputs] == ["image", "quad"]
    assert LINE_SLOT.inputs[1].shape == (4, 2)


def test_ocr_params_are_the_two_stages_params() -> None:
    """``ocr``'s params are detection's then reading's, each with the same default."""
    ocr = OcrParams.model_fields
    stages = {**OcrDetectionParams.model_fields, **OcrReadingParams.model_fields}
    assert list(ocr) == list(stages)
    assert {k: f.default for k, f in ocr.items()} == {k: f.default for k, f in stages.items()}
    assert OcrExecutor.roles == OcrDetectionExecutor.roles + OcrReadingExecutor.roles


def test_the_bench_pipeline_is_the_demo_ocr_split_in_two() -> None:
    """configs/ocr-pipeline.yaml: the demo's ``ocr`` files and params split between
    ``ocr_det`` and ``ocr_read``, and a valid pipeline ``ocr`` over them."""
    bench = yaml.safe_load(BENCH_CONFIG.read_text())
    demo = next(m for m in yaml.safe_load(DEMO_CONFIG.read_text())["models"] if m["name"] == "ocr")
    models = {m["name"]: m for m in bench["models"]}
    det, read = models["ocr_det"], models["ocr_read"]
    assert (det["task"], read["task"]) == ("ocr_detection", "ocr_reading")
    assert {**det["files"], **read["files"]} == demo["files"]
    assert {**det["params"], **read["params"]} == demo["params"]
    OcrDetectionParams(**det["params"])
    OcrReadingParams(**read["params"])
    (pipeline,) = [PipelineConfig(**p) for p in bench["pipelines"]]
    assert pipeline.name == "ocr"
    detect, step = pipeline.steps
    assert detect.model == "ocr_det" and detect.for_each is None
    assert step.model == "ocr_read" and step.merge
    assert step.for_each is not None
    assert (step.for_each.step, step.for_each.input) == ("detect", "quad")
    tasks = {name: resolve_executor(m["task"]) for name, m in models.items()}
    assert pipeline_problems([pipeline], tasks) == []


def test_a_quad_over_a_task_that_takes_none_is_refused() -> None:
    pipeline = PipelineConfig(
        name="ocr",
        steps=[
            {"name": "detect", "model": "det"},
            {"name": "read", "model": "reader", "for_each": {"step": "detect", "input": "quad"}},
        ],
    )
    tasks: dict[str, type | None] = {
        "det": OcrDetectionExecutor,
        "reader": resolve_executor("face_embedding"),
    }
    problems = pipeline_problems([pipeline], tasks)
    assert [p for p, _ in problems] == ["pipelines[ocr].steps[read].for_each.input"]


# -- what ocr_reading takes -------------------------------------------------------------------


def page(height: int = 60, width: int = 200, channels: int = 3) -> np.ndarray:
    rng = np.random.default_rng(7)
    return rng.integers(0, 256, (height, width, channels), dtype=np.uint8)


QUAD = np.array([[10, 5], [150, 5], [150, 35], [10, 35]], np.float32)


def test_a_line_is_cropped_as_ocr_crops_it() -> None:
    image = page()
    line = line_request({"image": image, "quad": QUAD.tolist()})
    assert line.box.dtype == np.float32 and np.array_equal(line.box, QUAD)
    assert np.array_equal(line.crop, crop_rgb_line(image, QUAD))
    assert line.crop.shape == (30, 140, 3)
    gray = line_request({"image": image[:, :, :1], "quad": QUAD}).crop
    rgba = line_request({"image": np.dstack([image, image[:, :, :1]]), "quad": QUAD}).crop
    assert gray.shape == (30, 140, 3) and np.array_equal(rgba, line.crop)


def test_a_line_given_alone_is_read_as_it_is() -> None:
    crop = page(32, 120)
    assert line_request(crop).crop is crop
    gray = line_request(crop[:, :, 0]).crop
    assert gray.shape == (32, 120, 3) and np.array_equal(gray[:, :, 2], crop[:, :, 0])
    assert line_request(np.dstack([crop, crop[:, :, :1]])).crop.shape == (32, 120, 3)


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ({"image": page()}, "inputs must be 'image' and 'quad'"),
        ({"image": page(), "quad": QUAD, "x": 1}, "inputs must be 'image' and 'quad'"),
        ({"image": page(), "quad": QUAD[:3]}, "4×2 points"),
        ({"image": page(), "quad": "corners"}, "4×2 numbers"),
        ({"image": page(), "quad": np.full((4, 2), np.nan, np.float32)}, "NaN"),
        ({"image": page(), "quad": np.full((4, 2), 3.0, np.float32)}, "within one pixel"),
        ({"image": page(), "quad": QUAD + 1000}, "outside the 200×60 image"),
        ({"image": page().astype(np.float32), "quad": QUAD}, "uint8"),
        ([1, 2, 3], "expected {'image', 'quad'}"),
    ],
)
def test_a_bad_line_request_is_refused_naming_what(payload: Any, says: str) -> None:
    with pytest.raises(InvalidArgumentError, match=says):
        line_request(payload)


# -- reading a batch of lines, with fake sessions ---------------------------------------------

CHARS = ["a", "b", "c"]
# a line's gray level -> what the fake recogniser reads in it (class, probability); white: blank
READS = {0: (1, 0.9), 60: (2, 0.8), 120: (3, 0.7), 200: (1, 0.3), 255: (0, 1.0)}


class FakeSession(ModelSession):
    """A session whose every row's answer depends on that row alone."""

    def __init__(self, name: str, answer: Any, metadata: Mapping[str, str] | None = None) -> None:
        self.inputs = (TensorSpec("x", np.dtype(np.float32), (None, 3, None, None)),)
        self.outputs = (TensorSpec("y", np.dtype(np.float32), (None, None, None)),)
        self.metadata = dict(metadata or {})
        self.path = Path(f"{name}.onnx")
        self.answer = answer
        self.runs: list[tuple[int, ...]] = []

    def input_buffer(self, name: str, shape: Sequence[int]) -> np.ndarray:
        return np.empty(tuple(shape), np.float32)

    def run(
        self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        batch = inputs["x"]
        self.runs.append(batch.shape)
        return {"y": np.stack([self.answer(row) for row in batch])}

    def close(self) -> None:
        pass


def upright(row: np.ndarray) -> np.ndarray:
    return np.array([0.99, 0.01], np.float32)


def recognise(row: np.ndarray) -> np.ndarray:
    """Its first pixel's gray level (normalised x / 127.5 − 1) picks the one character read."""
    gray = round((float(row[0, 0, 0]) + 1) * 127.5)
    best, p = READS[min(READS, key=lambda g: abs(g - gray))]
    seq = np.zeros((4, len(CHARS) + 2), np.float32)
    seq[:, 0] = 1.0  # blanks
    seq[1] = (1 - p) / (seq.shape[1] - 1)  # the rest spread over the other classes
    seq[1, best] = p
    return seq


def reading_executor(max_batch: int = 8, **params: Any) -> OcrReadingExecutor:
    sessions = {
        "cls": FakeSession("cls", upright),
        "rec": FakeSession("rec", recognise, {"character": "\n".join(CHARS)}),
    }
    return OcrReadingExecutor(OcrReadingParams(**params), sessions, max_batch)


def line(gray: int, width: int) -> np.ndarray:
    return np.full((32, width, 3), gray, np.uint8)


def test_reading_answers_text_and_score_or_none() -> None:
    executor = reading_executor()
    items = [executor.prepare(line(g, 100)) for g in (0, 60, 120, 200, 255)]
    got = executor.execute(items, StageTimer())
    assert [g and g["text"] for g in got] == ["a", "b", "c", None, None]  # 0.3 < text_score
    assert [g and round(g["score"], 4) for g in got][:3] == [0.9, 0.8, 0.7]
    low = reading_executor(text_score=0.2)
    assert low.execute([low.prepare(line(200, 100))], StageTimer()) == [
        {"text": "a", "score": pytest.approx(0.3)}
    ]


def test_a_batch_of_lines_reads_as_each_line_alone() -> None:
    """Lines of many widths (several padded widths, several recogniser batches): each reads
    what it reads alone, in its own place."""
    executor = reading_executor(max_batch=16, rec_batch=3, cls_batch=2)
    lines = [line(g, w) for w in (40, 400, 90, 1200, 300) for g in (0, 60, 120)]
    alone = [executor.execute([executor.prepare(x)], StageTimer())[0] for x in lines]
    together = executor.execute([executor.prepare(x) for x in lines], StageTimer())
    assert together == alone
    assert [a["text"] for a in alone] == ["a", "b", "c"] * 5
    rec = executor.reader.rec
    assert isinstance(rec, FakeSession) and max(shape[0] for shape in rec.runs) == 3


def test_reading_warms_up_every_batch_size() -> None:
    executor = reading_executor(max_batch=4)
    executor.warmup()
    assert sorted(executor.warmup_costs) == [1, 2, 3, 4]
