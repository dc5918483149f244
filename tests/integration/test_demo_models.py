"""The three demo models give real answers on the fixture images (real weights, no mocks)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from duomo.ipc.errors import InvalidArgumentError
from duomo.supervisor.config import LoadedConfig
from duomo.supervisor.core.engine import Engine
from duomo.worker.backends.base import ModelSession, SessionSettings, TensorSpec
from duomo.worker.backends.ort_backend import OrtBackend
from duomo.worker.executors.base import StageTimer
from duomo.worker.thread_budget import available_cores
from tests.conftest import alone_then_together, demo_variant, fixture_image

CAT_CLASSES = {281, 282, 283, 284, 285}  # tabby, tiger, Persian, Siamese, Egyptian cat
OCR_LINES = ["Ascend inference server", "Invoice No. 2026-0471", "Total: 1,234.56 CNY"]


def rendered_text(lines: list[str]) -> np.ndarray:
    """Black text on white in Pillow's built-in font: OCR with exact ground truth."""
    font = ImageFont.load_default(size=36)
    image = Image.new("RGB", (760, 80 + 70 * len(lines)), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((40, 40 + 70 * i), line, fill="black", font=font)
    return np.asarray(image)


def test_face_astronaut_has_exactly_one_face(demo_engine: Engine) -> None:
    faces = demo_engine.infer("face", fixture_image("astronaut.png"))["faces"]
    assert len(faces) == 1
    face = faces[0]
    x1, y1, x2, y2 = face["box"]
    assert abs(x1 - 181) < 12 and abs(y1 - 58) < 12 and abs(x2 - 270) < 12 and abs(y2 - 178) < 12
    assert face["score"] > 0.8
    assert len(face["landmarks"]) == 5
    for x, y in face["landmarks"]:
        assert x1 <= x <= x2 and y1 <= y <= y2


def test_classify_coffee_is_espresso(demo_engine: Engine) -> None:
    top = demo_engine.infer("classify", fixture_image("coffee.png"))["top"]
    assert top[0]["label"] == "espresso" and top[0]["index"] == 967
    assert len(top) == 5
    assert [t["score"] for t in top] == sorted((t["score"] for t in top), reverse=True)


def test_classify_chelsea_is_a_cat(demo_engine: Engine) -> None:
    top = demo_engine.infer("classify", fixture_image("chelsea.png"))["top"]
    assert {t["index"] for t in top[:3]} & CAT_CLASSES


def test_ocr_reads_rendered_lines_exactly_in_order(demo_engine: Engine) -> None:
    lines = demo_engine.infer("ocr", rendered_text(OCR_LINES))["lines"]
    assert [line["text"] for line in lines] == OCR_LINES
    for line in lines:
        assert line["score"] > 0.9
        assert len(line["box"]) == 4


def test_ocr_page_first_line(demo_engine: Engine) -> None:
    lines = demo_engine.infer("ocr", fixture_image("page.png"))["lines"]
    assert lines[0]["text"] == "Region-based segmentation"
    tops = [line["box"][0][1] for line in lines]
    assert tops == sorted(tops)  # reading order


def test_grayscale_and_bad_images_are_handled(demo_engine: Engine) -> None:
    gray = fixture_image("coffee.png").mean(axis=2).astype(np.uint8)
    assert demo_engine.infer("classify", gray)["top"]
    with pytest.raises(InvalidArgumentError, match="uint8"):
        demo_engine.infer("classify", np.zeros((10, 10, 3), dtype=np.float32))
    with pytest.raises(InvalidArgumentError, match="shape"):
        demo_engine.infer("face", np.zeros((10, 10, 5), dtype=np.uint8))


def _close(a: Any, b: Any, tol: float = 1e-4) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float):
        return abs(a - b) <= tol
    return bool(a == b)


@pytest.mark.parametrize(
    ("model", "images"),
    [
        ("classify", ["coffee.png", "chelsea.png", "astronaut.png", "page.png"]),
        ("face", ["astronaut.png", "coffee.png", "chelsea.png", "astronaut.png"]),
        ("ocr", ["page.png", "coffee.png", "page.png", "astronaut.png"]),
    ],
)
def test_a_batch_of_four_equals_four_single_runs(
    tmp_path: Path, model: str, images: list[str]
) -> None:
    # A long fill window and max_batch 4: four requests submitted together run as one batch.
    config = demo_variant(tmp_path, [model], max_batch=4, max_delay_ms=1000)
    arrays = [fixture_image(name) for name in images]
    if model == "ocr":
        arrays[1] = rendered_text(OCR_LINES)
    with Engine(config) as engine:
        singles, batched = alone_then_together(engine.model(model), arrays)
    assert [o.batch_size for o in singles] == [1, 1, 1, 1]
    assert [o.batch_size for o in batched] == [4, 4, 4, 4]
    for single, together in zip(singles, batched):
        assert _close(single.result, together.result), (single.result, together.result)


def test_thread_budget_of_the_demo_config(demo_engine: Engine) -> None:
    cores = available_cores()
    plan = demo_engine.plan
    assert plan.budget == cores
    assert all(1 <= t <= cores for t in plan.threads_per_instance.values())
    assert plan.max_concurrent_threads <= cores
    if sum(plan.instances.values()) <= cores:
        assert plan.total_threads <= cores
    # the sessions really run with the planned thread counts
    for name, served in demo_engine.models.items():
        for worker in served.instances.workers:
            assert worker.executor is not None
            for session in worker.executor.sessions.values():
                if not hasattr(session, "_session"):
                    continue  # no ONNX Runtime session: a gallery's matrix, searched by numpy
                opts = session._session.get_session_options()
                assert opts.intra_op_num_threads == plan.threads_per_instance[name]
    # and under load on all three models at once, no more than the budget (and the overdraft
    # an under-served model may use: worker.thread_budget.FairShare) computes at once
    images = {"ocr": "page.png", "face": "astronaut.png", "classify": "coffee.png"}
    futures = [
        demo_engine.submit(m, fixture_image(images[m])) for m in ("ocr", "face", "classify") * 3
    ]
    for f in futures:
        f.result(60)
    # two models computed at the same moment: the budget is used, not serialised
    gate = demo_engine.gate
    ceiling = min(cores + gate.overdraft, plan.total_threads)
    assert min(cores, plan.total_threads) <= gate.high_water <= ceiling


class CompiledShapes(ModelSession):
    """An ONNX Runtime session held to what a compiled ``.om`` accepts: only these H×W gears and
    one fixed batch. It fails any run outside them, so the OCR executor must pad to fit."""

    def __init__(
        self, inner: ModelSession, gears: tuple[tuple[int, int], ...] = (), rows: int | None = None
    ) -> None:
        self.inner, self._gears, self._rows = inner, gears, rows
        first = inner.inputs[0]
        shape = (rows, *first.shape[1:]) if rows else first.shape
        self.inputs = (TensorSpec(first.name, first.dtype, shape), *inner.inputs[1:])
        self.outputs, self.metadata, self.path = inner.outputs, inner.metadata, inner.path
        self.runs: list[tuple[int, ...]] = []

    @property
    def hw_gears(self) -> tuple[tuple[int, int], ...]:
        return self._gears

    def input_buffer(self, name: str, shape: Sequence[int]) -> np.ndarray:
        return self.inner.input_buffer(name, shape)

    def run(
        self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        shape = next(iter(inputs.values())).shape
        assert self._rows is None or shape[0] == self._rows, shape
        assert not self._gears or tuple(shape[2:]) in self._gears, shape
        self.runs.append(tuple(shape))
        return self.inner.run(inputs, outputs)

    def close(self) -> None:
        self.inner.close()


SIDES = (736, 1024, 1600)  # tools/atc_convert.py builds these and 1312, 2016
DET_GEARS = tuple((h, w) for h in SIDES for w in SIDES)
REC_GEARS = tuple((48, w) for w in range(320, 2561, 32))  # as tools/atc_convert.py builds them


def test_ocr_pads_to_what_compiled_models_take(demo_config: LoadedConfig) -> None:
    """The Ascend shapes (detector H×W gears, recogniser width gears with a fixed batch of 6, a
    static classifier batch of 6) read the same text as the unconstrained ONNX sessions."""
    model = demo_config.models["ocr"]
    backend = OrtBackend(demo_config.config.backends.onnxruntime)
    settings = SessionSettings(intra_op_threads=1)
    plain = {role: backend.open(path, settings) for role, path in model.files.items()}
    compiled = {
        "det": CompiledShapes(backend.open(model.files["det"], settings), DET_GEARS, rows=1),
        "cls": CompiledShapes(backend.open(model.files["cls"], settings), rows=6),
        "rec": CompiledShapes(backend.open(model.files["rec"], settings), REC_GEARS, rows=6),
    }
    params = model.params
    reference = model.executor(params, plain, 1)
    geared = model.executor(params, compiled, 1)
    geared.detector.warmup_gears()  # (the recogniser's gears: the next test, on a few of them)
    assert {s[2:] for s in compiled["det"].runs} == set(DET_GEARS)
    for image in (fixture_image("page.png"), rendered_text(OCR_LINES)):  # text with a truth
        want = reference.execute([reference.prepare(image)], StageTimer())[0]["lines"]
        got = geared.execute([geared.prepare(image)], StageTimer())[0]["lines"]
        assert [line["text"] for line in got] == [line["text"] for line in want]
        for a, b in zip(got, want):
            assert np.allclose(a["box"], b["box"], atol=3.0)
    tall = np.concatenate([rendered_text(OCR_LINES)] * 8)  # taller than any gear: scaled down
    got = geared.execute([geared.prepare(tall)], StageTimer())[0]["lines"]
    assert compiled["det"].runs[-1] == (1, 3, 1600, 736)
    assert [line["text"] for line in got] == OCR_LINES * 8
    reference.close()
    geared.close()


def test_ocr_warmup_runs_every_gear_of_a_compiled_model_once(demo_config: LoadedConfig) -> None:
    """Warm-up runs each batch size at the usual detector size, then every detector gear and
    every recogniser gear once (here a few of each: all 71 recogniser gears at a batch of 6
    take minutes on a CPU; the test above reads text through all of them)."""
    model = demo_config.models["ocr"]
    backend = OrtBackend(demo_config.config.backends.onnxruntime)
    settings = SessionSettings(intra_op_threads=1)
    det_gears, rec_gears = ((736, 736), (736, 1024)), ((48, 320), (48, 640), (48, 1280))
    compiled = {
        "det": CompiledShapes(backend.open(model.files["det"], settings), det_gears, rows=1),
        "cls": CompiledShapes(backend.open(model.files["cls"], settings), rows=6),
        "rec": CompiledShapes(backend.open(model.files["rec"], settings), rec_gears, rows=6),
    }
    geared = model.executor(model.params, compiled, 1)
    geared.warmup()
    assert {s[2:] for s in compiled["det"].runs} == set(det_gears)
    assert {s[2:] for s in compiled["rec"].runs} == set(rec_gears)
    assert {s[0] for s in compiled["cls"].runs} == {6}
    geared.close()


def test_ocr_prepare_keeps_the_image_and_requests_do_not_share_state(
    demo_config: LoadedConfig,
) -> None:
    """``prepare`` keeps the caller's image (a slot's memory in the supervisor) instead of
    copying it; the detector-sized copy is made in ``execute`` in a buffer reused by every
    request, and a request in between changes no other request's answer."""
    model = demo_config.models["ocr"]
    backend = OrtBackend(demo_config.config.backends.onnxruntime)
    settings = SessionSettings(intra_op_threads=1)
    sessions = {role: backend.open(path, settings) for role, path in model.files.items()}
    executor = model.executor(model.params, sessions, 1)
    text = rendered_text(OCR_LINES)
    prepared = executor.prepare(text)
    assert np.shares_memory(prepared.rgb, text)
    first = executor.execute([prepared], StageTimer())[0]
    executor.execute([executor.prepare(fixture_image("page.png"))], StageTimer())
    again = executor.execute([executor.prepare(text)], StageTimer())[0]
    assert [line["text"] for line in first["lines"]] == OCR_LINES
    assert again == first
    executor.close()
