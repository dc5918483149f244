"""Text orientation: is a line of text upright (0) or upside down (180)?

PP-OCR's text-direction classifier on its own, fed as Duomo's OCR task feeds it.
Request: an image of one text line (uint8 RGB H×W×3, or gray H×W).
Result: {"angle": 0 or 180, "score": the classifier's probability for that angle}.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from duomo.worker.executors.base import Executor, StageTimer, as_rgb_image
from duomo.worker.executors.image_ops import normalize_into, resize

HEIGHT, WIDTH = 48, 192  # the classifier's input size


class TextOrientationExecutor(Executor):
    def prepare(self, payload: Any) -> np.ndarray:
        return as_rgb_image(payload)  # checks type and shape; gray becomes RGB

    def execute(self, items: Sequence[np.ndarray], timer: StageTimer) -> list[Any]:
        session = self.sessions["model"]
        name = session.inputs[0].name
        with timer.stage("preprocess"):
            batch = session.input_buffer(name, (len(items), 3, HEIGHT, WIDTH))
            batch.fill(0.0)  # the padding right of a short line
            for row, line in zip(batch, items):
                h, w = line.shape[:2]
                width = min(WIDTH, math.ceil(HEIGHT * w / h))  # a long line is squeezed
                bgr = resize(line, width, HEIGHT)[:, :, ::-1]  # PP-OCR was trained on BGR
                normalize_into(row, bgr, 1 / 127.5, -1.0)  # 0..255 to -1..1
        with timer.stage("infer"):
            probs = session.run({name: batch})[session.outputs[0].name]
        with timer.stage("postprocess"):
            return [
                {"angle": 180 * int(p.argmax()), "score": round(float(p.max()), 4)}
                for p in probs[: len(items)]
            ]

    def warmup(self) -> None:
        blank = np.zeros((HEIGHT, WIDTH, 3), dtype=np.uint8)
        for size in self.warmup_sizes():
            self.execute([blank] * size, StageTimer())
