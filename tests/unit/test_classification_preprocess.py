"""The classification executor's model input, bit for bit: what it writes into the session's input
buffer for every fixture image (as decoded, as RGBA and as H×W×1 gray), for both normalizations
and in a batch, equals what the pre-processing gave before it was made faster (written out here
as it was: OpenCV's resize of the frame, the centre crop, numpy's arithmetic on the transposed
crop); and with the real model, every fixture image's top-5 and scores are the reference
pipeline's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from duomo.supervisor.config import LoadedConfig
from duomo.worker.backends.base import ModelSession, SessionSettings, TensorSpec
from duomo.worker.backends.ort_backend import OrtBackend
from duomo.worker.executors.base import StageTimer
from duomo.worker.executors.classification import ClassificationExecutor, ClassificationParams
from tests.conftest import IMAGES, fixture_image

FIXTURES = sorted(p.name for p in IMAGES.iterdir() if p.suffix == ".png")
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32) * 255


def reference_input(image: np.ndarray, params: ClassificationParams) -> np.ndarray:
    """The model input (3×S×S float32) as the executor computed it before: the frame resized by
    OpenCV (area when shrinking, bilinear otherwise) with its own channels, made RGB, centre
    cropped, then ``x * scale + offset`` in numpy on the transposed crop."""
    h, w = image.shape[:2]
    size = params.input_size
    scale = size / min(h, w)
    rw, rh = max(size, round(w * scale)), max(size, round(h * scale))
    method = cv2.INTER_AREA if rw * rh < w * h else cv2.INTER_LINEAR
    pixels = image[:, :, 0] if image.ndim == 3 and image.shape[2] == 1 else image
    resized = cv2.resize(pixels, (rw, rh), interpolation=method)
    if resized.ndim == 2:
        resized = np.broadcast_to(resized[:, :, None], (rh, rw, 3))
    top, left = (rh - size) // 2, (rw - size) // 2
    crop = resized[top : top + size, left : left + size, :3]
    out = np.empty((3, size, size), dtype=np.float32)
    if params.normalization == "tflite":
        np.multiply(crop.transpose(2, 0, 1), 1 / 127.5, out=out, casting="unsafe")
        out += -1.0
    else:
        np.multiply(crop.transpose(2, 0, 1), 1.0, out=out, casting="unsafe")
        out -= MEAN[:, None, None]
        out /= STD[:, None, None]
    return out


class InputRecorder(ModelSession):
    """A classifier session that keeps a copy of every batch it is given and answers zeros."""

    def __init__(self) -> None:
        self.inputs = (TensorSpec("input", np.dtype(np.float32), (None, 3, 224, 224)),)
        self.outputs = (TensorSpec("logits", np.dtype(np.float32), (None, 1000)),)
        self.metadata: dict[str, str] = {}
        self.path = Path("recorder.onnx")
        self.batches: list[np.ndarray] = []
        self._buffer = np.full((8, 3, 224, 224), np.nan, dtype=np.float32)

    def input_buffer(self, name: str, shape: Sequence[int]) -> np.ndarray:
        return self._buffer[: shape[0]]

    def run(
        self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        batch = inputs["input"]
        self.batches.append(batch.copy())
        return {"logits": np.zeros((batch.shape[0], 1000), dtype=np.float32)}

    def close(self) -> None:
        pass


def recorded_inputs(images: list[np.ndarray], **params: Any) -> tuple[np.ndarray, Any]:
    session = InputRecorder()
    executor = ClassificationExecutor(ClassificationParams(**params), {"model": session}, 8)
    executor.execute([executor.prepare(image) for image in images], StageTimer())
    (batch,) = session.batches
    return batch, executor.p


def layouts(image: np.ndarray) -> dict[str, np.ndarray]:
    """One fixture image as a producer may send it: as decoded (RGB, or H×W gray), as RGBA, and
    as gray H×W×1."""
    rgb = image if image.ndim == 3 else cv2.cvtColor(image, cv2.COLOR_GRAY2RGB)
    gray = image if image.ndim == 2 else cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
    return {
        "decoded": image,
        "rgba": cv2.cvtColor(rgb, cv2.COLOR_RGB2RGBA),
        "gray-hw1": gray[:, :, None],
    }


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("normalization", ["tflite", "imagenet"])
@pytest.mark.parametrize("name", FIXTURES)
def test_the_model_input_is_the_reference_bit_for_bit(name: str, normalization: str) -> None:
    for layout, image in layouts(fixture_image(name)).items():
        batch, params = recorded_inputs([image], normalization=normalization)
        assert same_bits(batch[0], reference_input(image, params)), f"{name} {layout}"


def test_a_batch_of_images_and_other_sizes_give_each_its_reference_row() -> None:
    rng = np.random.default_rng(3)
    images = [fixture_image(name) for name in FIXTURES] + [
        rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        for h, w in ((224, 224), (224, 1000), (1000, 230), (97, 61), (448, 449), (720, 1280))
    ]
    batch, params = recorded_inputs(images, max_resized_side=4096)
    for row, image in zip(batch, images):
        assert same_bits(row, reference_input(image, params)), image.shape


def test_the_answer_is_the_reference_pipelines_on_every_fixture_image(
    demo_config: LoadedConfig,
) -> None:
    resolved = demo_config.models["classify"]
    params = resolved.params
    assert isinstance(params, ClassificationParams)
    backend = OrtBackend(demo_config.config.backends.onnxruntime)
    executor = ClassificationExecutor.open(
        params, resolved.files, 1, backend, SessionSettings(intra_op_threads=1)
    )
    assert isinstance(executor, ClassificationExecutor)
    try:
        for name in FIXTURES:
            image = fixture_image(name)
            answer = executor.execute([executor.prepare(image)], StageTimer())[0]["top"]
            x = reference_input(image, params)[None]
            logits = executor.session.run({executor.input: x})[executor.output][0]
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            best = np.argsort(-probs, kind="stable")[: params.top_k]
            assert [c["index"] for c in answer] == best.tolist(), name
            assert max(abs(c["score"] - float(probs[i])) for c, i in zip(answer, best)) <= 1e-6
    finally:
        executor.close()
