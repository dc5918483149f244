"""OCR as a pipeline (issue 35, item 6) on the real models: configs/ocr-pipeline.yaml's
``ocr`` (``ocr_det`` → for each line ``ocr_read``) answers what the demo's ``ocr`` model answers
on every fixture image; the lines of many frames are read in one batch; a frame without text
runs no reading; and through a supervisor's slots, the pipeline and ``ocr_read`` alone
(``image`` + ``quad``). How fast it is against the one executor is ``python -m
tools.bench.ocr_pipeline``'s to say, not a test's."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from duomo.ipc.client import Client
from duomo.supervisor.config import load_config
from duomo.supervisor.core.engine import Engine
from tests.conftest import IMAGES, ROOT, demo_variant, fixture_image
from tests.integration.harness import running_supervisor
from tests.integration.test_demo_models import OCR_LINES, rendered_text

BENCH_CONFIG = ROOT / "configs" / "ocr-pipeline.yaml"
FIXTURES = sorted(p.name for p in IMAGES.glob("*.png"))
SCORE_TOLERANCE = 1e-5


def pipeline_config(folder: Path, **models: dict[str, Any]) -> Path:
    """configs/ocr-pipeline.yaml with absolute model paths and ``models[name]`` keys
    updated."""
    raw = yaml.safe_load(BENCH_CONFIG.read_text())
    raw["model_root"] = str(ROOT / "models")
    raw["models"] = [{**m, **models.get(m["name"], {})} for m in raw["models"]]
    path = folder / "ocr_pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def executor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The demo's ``ocr`` model, one executor."""
    with Engine(demo_variant(tmp_path_factory.mktemp("ocr-executor"), ["ocr"])) as engine:
        yield engine


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The pipeline ``ocr``, with batch windows long enough that frames sent together are
    detected together and their lines read together."""
    path = pipeline_config(
        tmp_path_factory.mktemp("ocr-pipeline"),
        ocr_det={"max_batch": 4, "max_delay_ms": 200},
        ocr_read={"max_batch": 8, "max_delay_ms": 200},
    )
    with Engine(load_config(path)) as engine:
        yield engine


def assert_same_lines(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The same lines in the same order: text, box, score within 1e-5, and nothing else."""
    assert set(got) == {"lines"}
    assert [line["text"] for line in got["lines"]] == [line["text"] for line in want["lines"]]
    for a, b in zip(got["lines"], want["lines"]):
        assert set(a) == {"text", "score", "box"}
        assert a["box"] == b["box"]
        assert abs(a["score"] - b["score"]) <= SCORE_TOLERANCE


def images() -> dict[str, np.ndarray]:
    return {**{n: fixture_image(n) for n in FIXTURES}, "rendered": rendered_text(OCR_LINES)}


def test_the_pipeline_answers_what_the_executor_answers(executor: Engine, pipeline: Engine) -> None:
    for name, image in images().items():
        want = executor.infer("ocr", image, timeout_s=120)
        got = pipeline.infer("ocr", image, timeout_s=120)
        assert_same_lines(got, want)
        if name == "rendered":
            assert [line["text"] for line in got["lines"]] == OCR_LINES
        if name == "page.png":
            assert len(got["lines"]) >= 5


def read_steps(engine: Engine) -> dict[str, Any]:
    steps = engine.status().pipelines["ocr"].steps
    return {s.name: s.to_dict() for s in steps}["read"]


def test_a_frame_without_text_runs_no_reading(pipeline: Engine) -> None:
    before = read_steps(pipeline)
    assert pipeline.infer("ocr", fixture_image("astronaut.png"), timeout_s=120) == {"lines": []}
    after = read_steps(pipeline)
    assert after["skipped"] == before["skipped"] + 1
    assert after["runs"] == before["runs"]
    assert after["errors"] == 0


def batch_sizes(engine: Engine, model: str) -> dict[int, int]:
    return {int(k): v for k, v in engine.status().models[model].batch_sizes.items()}


def test_lines_of_many_frames_are_read_in_one_batch(executor: Engine, pipeline: Engine) -> None:
    """Four producers, three frames each of three lines: ``ocr_read``'s batches hold more than
    three lines, so lines of more than one frame; every frame's answer is still its own."""
    frame = rendered_text(OCR_LINES)
    want = executor.infer("ocr", frame, timeout_s=120)
    before = batch_sizes(pipeline, "ocr_read")

    def producer(_: int) -> list[dict[str, Any]]:
        return [pipeline.infer("ocr", frame, timeout_s=120) for _ in range(3)]

    with ThreadPoolExecutor(4) as pool:
        answers = [a for answers in pool.map(producer, range(4)) for a in answers]
    for answer in answers:
        assert_same_lines(answer, want)
    after = batch_sizes(pipeline, "ocr_read")
    new = {size: after[size] - before.get(size, 0) for size in after}
    assert sum(size * n for size, n in new.items()) == 12 * len(OCR_LINES)
    assert max(size for size, n in new.items() if n) > len(OCR_LINES), new


def test_through_a_supervisor_the_pipeline_and_a_line_alone(tmp_path: Path) -> None:
    """Through slots: the pipeline ``ocr`` as a model, and ``ocr_read`` given the frame and one
    line's corners reads what the pipeline read there."""
    page = fixture_image("page.png")
    with running_supervisor(pipeline_config(tmp_path)) as supervisor:
        client = Client(supervisor.socket, timeout_s=120)
        try:
            listed = {m.name: m for m in client.models()}
            assert listed["ocr"].task == "pipeline"
            answer = client.model("ocr", slots=2).infer(page, timeout_s=120)
            first = answer["lines"][0]
            quad = np.asarray(first["box"], dtype=np.float32)
            line = client.model("ocr_read", slots=2).infer(
                {"image": page, "quad": quad}, timeout_s=120
            )
        finally:
            client.close()
    assert line["text"] == first["text"]
    assert abs(line["score"] - first["score"]) <= SCORE_TOLERANCE
    assert first["text"] == "Region-based segmentation"
