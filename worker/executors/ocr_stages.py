"""OCR's two stages as tasks of their own, for OCR as a pipeline (issue 35).

``ocr`` (``worker.executors.ocr``) chains detection, the angle classifier and recognition in one
executor, so a frame's lines are read only with that frame's. Split in two, a pipeline runs
detection on the frame and then one request per text line, and the reading model's batcher
gathers lines of many frames (and streams) into one batch::

    models:
      - {name: ocr_det, task: ocr_detection, files: {det: ocr/PP-OCRv6_det_small.onnx}}
      - name: ocr_read
        task: ocr_reading
        files: {cls: ocr/ch_ppocr_mobile_v2.0_cls_mobile.onnx, rec: ocr/PP-OCRv6_rec_small.onnx}
    pipelines:
      - name: ocr
        steps:
          - {name: detect, model: ocr_det}
          - {name: read, model: ocr_read, for_each: {step: detect, input: quad}, merge: true}

answers what ``ocr`` answers: ``{"lines": [{"box", "text", "score"}]}``, the lines in reading
order, a line read below ``text_score`` or as nothing dropped (configs/ocr-pipeline.yaml).

- ``ocr_detection`` (role ``det``; the ``det_`` params of ``ocr``): ``{"lines": [{"box":
  [[x, y] × 4]}]}``, each text line's quadrilateral in the image's pixels, clockwise from the
  top-left corner, in reading order — the boxes ``ocr`` answers (``ocr.TextDetector``).
- ``ocr_reading`` (roles ``cls``, ``rec``; the ``cls_``, ``rec_`` and ``text_score`` params of
  ``ocr``): one text line, ``{"image": frame, "quad": float32 4×2}`` (through a slot, the two
  inputs; in-process also the line's own pixels alone, already cropped upright), cropped as
  ``ocr`` crops it, turned 180° when the classifier says so, read: ``{"text", "score"}``, or
  ``null`` when the score is below ``text_score`` or the text is empty (a ``merge: true``
  step's null drops the line). A batch of lines is read as ``ocr`` reads a frame's lines
  (``ocr.LineReader``): grouped by a padded width that depends only on each line's own aspect
  ratio, so what a line reads does not depend on the lines it was batched with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import cv2
import numpy as np

from duomo.ipc.errors import InvalidArgumentError
from duomo.worker.backends.base import ModelSession
from duomo.worker.executors.base import (
    JSON_RESULT_BYTES,
    Executor,
    SlotInput,
    SlotSpec,
    StageTimer,
    image_input,
)
from duomo.worker.executors.image_ops import as_image, check_near_image, image_points
from duomo.worker.executors.ocr import (
    LineReader,
    OcrDetectionParams,
    OcrInput,
    OcrReadingParams,
    TextDetector,
    TextLine,
    crop_rgb_line,
    rgb_line,
)

QUAD = (4, 2)
# what an ``ocr_reading`` request holds in its slot: the frame and one line's four corners
LINE_SLOT = SlotSpec(
    inputs=(
        image_input(),
        SlotInput("quad", np.dtype(np.float32), QUAD, QUAD[0] * QUAD[1] * 4),
    ),
    result="json",
    result_capacity=JSON_RESULT_BYTES,
)


class OcrDetectionExecutor(Executor):
    """Text detection alone: each image's text lines' boxes, in reading order."""

    roles = ("det",)
    varying_shape_roles = ("det",)  # image sizes
    Params = OcrDetectionParams
    objects = "lines"  # a pipeline's step may run for_each line (input: quad)

    def __init__(
        self, params: OcrDetectionParams, sessions: Mapping[str, ModelSession], max_batch: int
    ) -> None:
        super().__init__(params, sessions, max_batch)
        self.detector = TextDetector(params, sessions["det"])

    def prepare(self, payload: Any) -> OcrInput:
        return self.detector.prepare(payload)

    def settle(self) -> None:
        super().settle()
        self.detector.settle()

    def execute(self, items: Sequence[OcrInput], timer: StageTimer) -> list[Any]:
        found = self.detector.detect(items, timer)
        with timer.stage("postprocess"):
            results: list[dict[str, Any]] = [{"lines": []} for _ in items]
            for index, box in found:
                results[index]["lines"].append({"box": [[float(x), float(y)] for x, y in box]})
            return list(results)

    def warmup(self) -> None:
        """Every batch size at the usual detector size, then every gear of a compiled
        detector once."""
        prepared = self.detector.warmup_blank()
        for size in self.warmup_sizes():
            self.execute([prepared] * size, StageTimer())
        self.detector.warmup_gears()


def line_quad(value: Any, width: int, height: int) -> np.ndarray:
    """``value`` as a text line's four corners (float32 4×2) in a ``width``×``height`` image;
    InvalidArgumentError naming input ``quad``: not four pairs of real numbers, a NaN or an
    infinity, corners within one pixel of each other, or a corner outside the image by more
    than the line's own size."""
    quad = image_points(value, QUAD[0], np.float32, "quad", ", clockwise from the top-left")
    if float(np.ptp(quad, axis=0).min()) < 1.0:
        raise InvalidArgumentError("input 'quad': the four corners lie within one pixel")
    check_near_image(quad, width, height, "quad")
    return quad


def line_request(payload: Any) -> TextLine:
    """The payload of ``ocr_reading`` checked and its line cropped upright (RGB), as ``ocr``
    crops a detected line: ``{"image", "quad"}``, or a line's pixels alone."""
    if isinstance(payload, np.ndarray):
        line = as_image(payload)
        crop = rgb_line(line[:, :, 0] if line.shape[2] == 1 else line)
        return TextLine(0, np.zeros(QUAD, np.float32), crop)
    if not isinstance(payload, Mapping):
        raise InvalidArgumentError(
            f"expected {{'image', 'quad'}} or a text line's image, got {type(payload).__name__}"
        )
    if set(payload) != {"image", "quad"}:
        raise InvalidArgumentError(
            f"inputs must be 'image' and 'quad', got {sorted(map(str, payload))}"
        )
    image = as_image(payload["image"])
    h, w = image.shape[:2]
    quad = line_quad(payload["quad"], w, h)
    try:
        crop = crop_rgb_line(image, quad)
    except cv2.error:
        raise InvalidArgumentError(
            f"input 'quad' {quad.tolist()} is not a quadrilateral a line can be cropped from"
        ) from None
    return TextLine(0, quad, crop)


class OcrReadingExecutor(Executor):
    """Text-line reading alone: each request one line, turned and read; lines of a batch are
    read together (``ocr.LineReader``)."""

    roles = ("cls", "rec")
    varying_shape_roles = ("rec",)  # text-line widths
    one_off_roles = ()  # a line's width follows its aspect, bounded by rec_max_width (``ocr``)
    Params = OcrReadingParams
    object_inputs = frozenset({"quad"})  # a pipeline hands it the frame and a line's corners

    def __init__(
        self, params: OcrReadingParams, sessions: Mapping[str, ModelSession], max_batch: int
    ) -> None:
        super().__init__(params, sessions, max_batch)
        self.reader = LineReader(params, sessions["cls"], sessions["rec"])

    def slot_spec(self) -> SlotSpec:
        return LINE_SLOT

    def payload_from_slot(self, tensors: dict[str, np.ndarray], output: memoryview) -> Any:
        return {"image": tensors["image"], "quad": tensors["quad"]}

    def prepare(self, payload: Any) -> TextLine:
        """The line cropped here, not in ``execute``: a line-sized copy (as ``ocr`` makes one
        per line), and a quadrilateral that cannot be cropped fails its request alone."""
        return line_request(payload)

    def execute(self, items: Sequence[TextLine], timer: StageTimer) -> list[Any]:
        lines = [TextLine(i, item.box, item.crop) for i, item in enumerate(items)]
        self.reader.read(lines, timer)  # (a line turned 180° gets a new crop: items are kept)
        with timer.stage("postprocess"):
            return [
                {"text": line.text, "score": line.score} if self.reader.keeps(line) else None
                for line in lines
            ]

    def warmup(self) -> None:
        """Every batch size on a blank line, then the classifier and recogniser at their own
        batches and every gear of a compiled recogniser once."""
        blank = TextLine(0, np.zeros(QUAD, np.float32), np.full((48, 320, 3), 255, np.uint8))
        for size in self.warmup_sizes():
            self.execute([blank] * size, StageTimer())
        self.reader.warmup()
