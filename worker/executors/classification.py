"""Image classification (EfficientNet-Lite0 in the demo): resize, centre crop, top-k with labels.

Result: ``{"top": [{"index": int, "label": str, "score": float}, ...]}``, best first, scores
are softmax probabilities. Labels are ImageNet-1k by default or one label per line from
``params.labels``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from duomo.ipc.errors import InvalidArgumentError
from duomo.worker.backends.base import ModelSession
from duomo.worker.config_model import StrictModel
from duomo.worker.executors.base import Executor, StageTimer
from duomo.worker.executors.image_ops import (
    ResizeScratch,
    as_image,
    lookup_into,
    normalization_table,
)

# (scale, offset) applied to 0..255 pixels; imagenet's per-channel mean/std is folded per channel.
_IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32) * 255
_IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32) * 255


class ClassificationParams(StrictModel):
    """The ``params`` of ``task: classification``: how many classes to return, the crop's side,
    the resize bound, the normalization and the labels file."""

    top_k: int = Field(default=5, ge=1, le=1000)
    input_size: int = Field(default=224, ge=8, le=4096)
    # what one request may cost: the resized image's long side (its short side is input_size)
    max_resized_side: int = Field(default=2048, ge=8, le=65536)
    normalization: Literal["tflite", "imagenet"] = "tflite"
    labels: Path | None = None

    @model_validator(mode="after")
    def _resized_side_holds_the_crop(self) -> ClassificationParams:
        if self.max_resized_side < self.input_size:
            raise ValueError(
                f"max_resized_side {self.max_resized_side} is below input_size {self.input_size}"
            )
        return self


@dataclass(frozen=True)
class CenterCrop:
    """A request's image resized to ``resized_width``×``resized_height`` (its short side the
    input size), then the centre square at (``top``, ``left``) taken."""

    image: np.ndarray  # the request's pixels, H×W×C (a view into its slot, when served)
    resized_width: int
    resized_height: int
    top: int
    left: int


def input_table(normalization: Literal["tflite", "imagenet"]) -> np.ndarray:
    """What each channel's pixel value 0..255 becomes in the model's input (3×256 float32):
    ``x / 127.5 - 1`` (tflite), or ``(x - mean) / std`` per channel (imagenet), computed by the
    same float32 operations the whole crop once went through, so the lookup gives the same bits."""
    if normalization == "tflite":
        return normalization_table(1 / 127.5, -1.0)
    table = normalization_table(1.0, 0.0)
    table -= _IMAGENET_MEAN[:, None]
    table /= _IMAGENET_STD[:, None]
    return table


def load_imagenet_labels() -> list[str]:
    text = (
        resources.files("duomo.worker.executors").joinpath("imagenet_labels.txt").read_text("utf-8")
    )
    # "n02123045<TAB>tabby, tabby cat" -> "tabby"
    return [line.split("\t", 1)[1].split(",")[0].strip() for line in text.splitlines() if line]


class ClassificationExecutor(Executor):
    """Image classification: resize and centre-crop each image, run the batch, return the top-k
    labelled classes."""

    Params = ClassificationParams

    def __init__(
        self, params: ClassificationParams, sessions: Mapping[str, ModelSession], max_batch: int
    ) -> None:
        super().__init__(params, sessions, max_batch)
        self.p = params
        self.session = sessions["model"]
        self.input = self.session.inputs[0].name
        self.output = self.session.outputs[0].name
        if params.labels is not None:
            self.labels = params.labels.read_text("utf-8").splitlines()
        else:
            self.labels = load_imagenet_labels()
        self._scratch = ResizeScratch()
        self._table = input_table(params.normalization)

    def prepare(self, payload: Any) -> CenterCrop:
        image = as_image(payload)
        h, w = image.shape[:2]
        size = self.p.input_size
        scale = size / min(h, w)
        rw, rh = max(size, round(w * scale)), max(size, round(h * scale))
        if max(rw, rh) > self.p.max_resized_side:
            raise InvalidArgumentError(
                f"image {w}×{h} would be resized to {rw}×{rh} (short side {size}); the long "
                f"side may be at most max_resized_side {self.p.max_resized_side} (an aspect "
                f"ratio of at most {self.p.max_resized_side / size:.2f})"
            )
        return CenterCrop(image, rw, rh, (rh - size) // 2, (rw - size) // 2)

    def execute(self, items: Sequence[CenterCrop], timer: StageTimer) -> list[Any]:
        size = self.p.input_size
        with timer.stage("preprocess"):
            batch = self.session.input_buffer(self.input, (len(items), 3, size, size))
            for row, item in zip(batch, items):
                resized = self._scratch.resize(item.image, item.resized_width, item.resized_height)
                crop = resized[item.top : item.top + size, item.left : item.left + size]
                lookup_into(row, crop, self._table)
        with timer.stage("infer"):
            logits = self.session.run({self.input: batch})[self.output]
        with timer.stage("postprocess"):
            return [self._top_k(row) for row in logits[: len(items)]]

    def _top_k(self, logits: np.ndarray) -> dict[str, Any]:
        shifted = np.exp(logits - logits.max())
        probs = shifted / shifted.sum()
        k = min(self.p.top_k, probs.size)
        best = np.argpartition(-probs, k - 1)[:k]
        best = best[np.argsort(-probs[best])]
        return {
            "top": [
                {
                    "index": int(i),
                    "label": self.labels[i] if i < len(self.labels) else str(i),
                    "score": float(probs[i]),
                }
                for i in best
            ]
        }

    def warmup(self) -> None:
        blank = np.zeros((self.p.input_size, self.p.input_size, 3), dtype=np.uint8)
        prepared = self.prepare(blank)
        for size in self.warmup_sizes():
            self.execute([prepared] * size, StageTimer())
