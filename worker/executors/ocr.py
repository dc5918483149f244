"""OCR: PP-OCR text detection → line crops → angle classifier (0/180°) → CTC recognition.

The three models are chained inside one executor on one worker thread, so a request crosses no
extra queue or process between stages. Result::

    {"lines": [{"text": str, "score": float, "box": [[x, y] × 4]}, ...]}

in reading order (top to bottom, then left to right), boxes in the input image's pixels,
clockwise from the top-left corner. Lines whose recognition score is below ``text_score`` are
dropped. The recogniser's character list is read from the ONNX metadata (``character``).

Batching never changes a result: images of the same detector size share a detection run (frames
of one camera do); text lines of all images are then classified (fixed 48×192 input) and
recognised together, grouped by a padded width that depends only on each line's own aspect
ratio, in batches of up to ``cls_batch`` / ``rec_batch``.

Compiled models (Ascend ``.om``) take only the shapes they were built for, and the executor
follows what its sessions say: a detector with image-size gears (``hw_gears``) gets each image
resized as usual and then padded (zeros after normalisation, bottom and right) to the smallest
gear that holds it — or scaled down to fit the largest — and only the image's own region of the
probability map is read back; a recogniser with gears pads each line to the smallest gear width
that holds its natural width; a model with a fixed batch gets its batches padded with empty rows.

The stages are ``TextDetector`` and ``LineReader``: ``ocr_stages`` runs the same two as tasks of
their own (``ocr_detection``, ``ocr_reading``), so that OCR can be a pipeline whose text lines of
many frames batch together in recognition.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
from pydantic import Field

from duomo.worker.backends.base import ONE_OFF_FACTOR, ModelSession
from duomo.worker.config_model import StrictModel
from duomo.worker.executors.base import Executor, StageTimer
from duomo.worker.executors.image_ops import ResizeScratch, as_image, normalize_into, resize, rgb
from duomo.worker.executors.ocr_geometry import DbParams, crop_text_line, detect_boxes

# PP-OCR normalises every stage with mean 0.5 / std 0.5 on 0..1 pixels: x/127.5 - 1.
_SCALE, _OFFSET = 1 / 127.5, -1.0
_CLS_SHAPE = (48, 192)


class OcrDetectionParams(StrictModel):
    """Text detection's part of the OCR params: detection sizes and DB thresholds (``det_``);
    the ``params`` of ``task: ocr_detection`` (``ocr_stages``)."""

    det_limit_side: int = Field(default=736, ge=32, le=4096)
    det_max_side: int = Field(default=2016, ge=64, le=8192, multiple_of=32)
    det_thresh: float = Field(default=0.3, gt=0, lt=1)
    det_box_thresh: float = Field(default=0.5, gt=0, lt=1)
    det_unclip_ratio: float = Field(default=1.6, gt=0, le=10)
    det_max_candidates: int = Field(default=1000, ge=1)
    det_use_dilation: bool = True


class OcrReadingParams(StrictModel):
    """Reading's part of the OCR params: the angle classifier (``cls_``), recognition batch and
    line sizes (``rec_``), and the score a line needs; the ``params`` of ``task: ocr_reading``
    (``ocr_stages``)."""

    use_angle_cls: bool = True
    cls_thresh: float = Field(default=0.9, gt=0, lt=1)
    cls_batch: int = Field(default=6, ge=1, le=256)
    rec_batch: int = Field(default=6, ge=1, le=256)
    rec_height: int = Field(default=48, ge=8, le=256)
    rec_min_width: int = Field(default=320, ge=8, le=8192)
    rec_max_width: int = Field(default=2560, ge=8, le=16384)
    text_score: float = Field(default=0.5, ge=0, le=1)


class OcrParams(OcrReadingParams, OcrDetectionParams):
    """The ``params`` of ``task: ocr``: detection sizes and DB thresholds (``det_``), the angle
    classifier (``cls_``), recognition batch and line sizes (``rec_``), and the score a line
    needs."""


@dataclass(frozen=True)
class OcrInput:
    """One image as the request gave it (H×W×C, C 1, 3 or 4: a view of the payload), the
    (H, W) it is resized to for the detector, and the detector input (H, W) that is padded to
    (the same unless the detector takes only some sizes). The resized image and each text
    line's crop are made RGB; PP-OCR was trained on BGR: channels are swapped where the pixels
    are normalised into a model's input."""

    image: np.ndarray
    size: tuple[int, int]
    canvas: tuple[int, int]

    @property
    def rgb(self) -> np.ndarray:
        """The image as RGB, a view of it (``image_ops.rgb``)."""
        return rgb(self.image)


@dataclass
class TextLine:
    """One text line found in a batch: the index of its image, its box, its crop, and what
    recognition read in it."""

    image: int
    box: np.ndarray
    crop: np.ndarray  # RGB, cut from the image
    text: str = ""
    score: float = 0.0


def _round32(x: float) -> int:
    return max(32, int(round(x / 32) * 32))


def _fixed_rows(session: ModelSession) -> int | None:
    """The batch a compiled model always runs with (its first dimension is fixed), if any."""
    first = session.inputs[0].shape[0] if session.inputs[0].shape else None
    return first if isinstance(first, int) and first > 0 else None


def _fit_gear(rh: int, rw: int, gears: Sequence[tuple[int, int]]) -> tuple[int, int, int, int]:
    """(content h, content w, canvas h, canvas w): the smallest gear that holds rh×rw, or the
    gear that keeps the most of it, with the content scaled down (to multiples of 32) to fit."""
    holding = [g for g in gears if g[0] >= rh and g[1] >= rw]
    if holding:
        gh, gw = min(holding, key=lambda g: (g[0] * g[1], g))
        return rh, rw, gh, gw
    gh, gw = max(gears, key=lambda g: (min(g[0] / rh, g[1] / rw), -g[0] * g[1]))
    scale = min(gh / rh, gw / rw)
    return (
        max(32, min(gh, int(rh * scale) // 32 * 32)),
        max(32, min(gw, int(rw * scale) // 32 * 32)),
        gh,
        gw,
    )


def crop_rgb_line(image: np.ndarray, box: np.ndarray) -> np.ndarray:
    """The text line at ``box`` as an RGB crop: a gray or RGBA image is converted line by
    line, never as a whole."""
    return rgb_line(crop_text_line(image[:, :, 0] if image.shape[2] == 1 else image, box))


def rgb_line(crop: np.ndarray) -> np.ndarray:
    """A text line's pixels (H×W gray, H×W×3 RGB or H×W×4 RGBA) as an RGB crop."""
    if crop.ndim == 2:
        return cv2.cvtColor(crop, cv2.COLOR_GRAY2RGB)
    if crop.shape[2] == 4:
        return cv2.cvtColor(crop, cv2.COLOR_RGBA2RGB)
    return crop


def _same_size(items: Sequence[OcrInput]) -> list[list[int]]:
    """Indices grouped by detector input size: only equal sizes share a detector run."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault((*item.canvas, *item.size), []).append(i)
    return list(groups.values())


class TextDetector:
    """PP-OCR text detection over one session (role ``det``): each image sized for the
    detector (``prepare``), images of one size run together, and each one's text boxes in
    reading order (``detect``). The first stage of ``OcrExecutor`` and the whole of
    ``ocr_detection`` (``ocr_stages``)."""

    def __init__(self, params: OcrDetectionParams, det: ModelSession) -> None:
        self.p = params
        self.det = det
        self.db = DbParams(
            thresh=params.det_thresh,
            box_thresh=params.det_box_thresh,
            unclip_ratio=params.det_unclip_ratio,
            max_candidates=params.det_max_candidates,
            use_dilation=params.det_use_dilation,
        )
        self.gears = det.hw_gears  # what a compiled detector dictates (nothing, for ORT)
        self.rows = _fixed_rows(det)
        self._scratch = ResizeScratch()  # each image's detector-sized copy, reused

    def prepare(self, payload: Any) -> OcrInput:
        image = as_image(payload)
        h, w = image.shape[:2]
        ratio = self.p.det_limit_side / min(h, w) if min(h, w) < self.p.det_limit_side else 1.0
        if max(h, w) * ratio > self.p.det_max_side:
            ratio = self.p.det_max_side / max(h, w)
        rw = min(_round32(w * ratio), self.p.det_max_side)
        rh = min(_round32(h * ratio), self.p.det_max_side)
        canvas = (rh, rw)
        if self.gears:
            rh, rw, *gear = _fit_gear(rh, rw, self.gears)
            canvas = (gear[0], gear[1])
        return OcrInput(image=image, size=(rh, rw), canvas=canvas)

    def detect(self, items: Sequence[OcrInput], timer: StageTimer) -> list[tuple[int, np.ndarray]]:
        """(index of its image, its box) of every text line found in ``items``: each image's
        boxes together, in reading order."""
        boxes: list[tuple[int, np.ndarray]] = []
        for group in _same_size(items):
            boxes.extend(self.detect_group([items[i] for i in group], group, timer))
        return boxes

    def detect_group(
        self, group: list[OcrInput], indices: list[int], timer: StageTimer
    ) -> list[tuple[int, np.ndarray]]:
        """One detector run over images of one size (``indices``: theirs in the batch)."""
        det_in = self.det.inputs[0].name
        rh, rw = group[0].size
        ch, cw = group[0].canvas
        rows = self.rows or len(group)
        with timer.stage("preprocess"):
            batch = self.det.input_buffer(det_in, (rows, 3, ch, cw))
            if (ch, cw) != (rh, rw) or rows != len(group):
                batch.fill(0.0)  # the padding: zero after normalisation
            for row, item in zip(batch, group):
                resized = self._scratch.resize(item.image, rw, rh)
                normalize_into(row, resized[:, :, ::-1], _SCALE, _OFFSET)
        with timer.stage("infer"):
            prob = self.det.run({det_in: batch})[self.det.outputs[0].name]
        with timer.stage("postprocess"):
            boxes: list[tuple[int, np.ndarray]] = []
            for k, (index, item) in enumerate(zip(indices, group)):
                h, w = item.image.shape[:2]
                found, _ = detect_boxes(prob[k, 0, :rh, :rw], w, h, self.db)
                boxes.extend((index, b) for b in found)
            return boxes

    def settle(self) -> None:
        """The warm-up is over: the resize buffer is kept up to ``ONE_OFF_FACTOR`` times the
        size the warm-up gave it; a larger image (a huge frame, resized to ``det_max_side``)
        gets a copy of its own, freed with its request (``worker.backends.base``)."""
        scratch = self._scratch
        scratch.keep_bytes = min(scratch.keep_bytes, ONE_OFF_FACTOR * scratch.nbytes)

    def warmup_blank(self) -> OcrInput:
        """A blank page at the usual detector size, prepared (what warm-up runs per batch)."""
        blank = np.full((self.p.det_limit_side, self.p.det_limit_side, 3), 255, dtype=np.uint8)
        return self.prepare(blank)

    def warmup_gears(self) -> None:
        """Every detector gear of a compiled model once."""
        for gh, gw in self.gears:
            canvas = np.full((gh, gw, 3), 255, dtype=np.uint8)
            self.detect_group([OcrInput(canvas, (gh, gw), (gh, gw))], [0], StageTimer())


class LineReader:
    """PP-OCR reading of text-line crops over two sessions (roles ``cls``, ``rec``): the angle
    classifier (0/180°, fixed 48×192 input) turns lines, then CTC recognition reads them,
    grouped by a padded width that depends only on each line's own aspect ratio, in batches
    of up to ``cls_batch`` / ``rec_batch``: what a line reads never depends on the lines it was
    batched with. The later stages of ``OcrExecutor`` and the whole of ``ocr_reading``
    (``ocr_stages``)."""

    def __init__(self, params: OcrReadingParams, cls: ModelSession, rec: ModelSession) -> None:
        self.p = params
        self.cls, self.rec = cls, rec
        characters = rec.metadata.get("character")
        if not characters:
            raise ValueError(
                f"{rec.path.name}: no 'character' list in the ONNX metadata; "
                "a PP-OCR recognition model exported by PaddleOCR/rapidocr carries one"
            )
        self.charset = ["", *characters.splitlines(), " "]  # index 0 is the CTC blank
        # what a compiled recogniser dictates (nothing, for ONNX Runtime sessions)
        self._rec_widths = sorted(w for h, w in rec.hw_gears if h == params.rec_height)
        if rec.hw_gears and not self._rec_widths:
            raise ValueError(
                f"{rec.path.name}: no image-size gear has the height rec_height "
                f"{params.rec_height} ({[list(g) for g in rec.hw_gears]})"
            )
        sessions = {"cls": cls, "rec": rec}
        self._rows = {role: _fixed_rows(session) for role, session in sessions.items()}
        for role, batch in (("cls", params.cls_batch), ("rec", params.rec_batch)):
            fixed = self._rows[role]
            if fixed is not None and batch > fixed:
                raise ValueError(
                    f"{role}_batch {batch} is above the {fixed} rows "
                    f"{sessions[role].path.name} runs with; lower {role}_batch"
                )

    def read(self, lines: list[TextLine], timer: StageTimer) -> None:
        """Turn and read every line (``text`` and ``score`` set on each)."""
        if lines:
            if self.p.use_angle_cls:
                self._classify_angles(lines, timer)
            self._recognize(lines, timer)

    def keeps(self, line: TextLine) -> bool:
        """Whether a read line is answered: a text, read with at least ``text_score``."""
        return line.score >= self.p.text_score and bool(line.text)

    def _by_aspect(self, lines: list[TextLine], size: int) -> list[list[TextLine]]:
        ordered = sorted(lines, key=lambda ln: ln.crop.shape[1] / ln.crop.shape[0])
        return [ordered[i : i + size] for i in range(0, len(ordered), size)]

    def _fill_line_batch(
        self, session: ModelSession, group: list[TextLine], width: int, max_width: int
    ) -> np.ndarray:
        """Each crop resized to the line height keeping its aspect, left-aligned, zero-padded."""
        role = "rec" if session is self.rec else "cls"
        height = self.p.rec_height if role == "rec" else _CLS_SHAPE[0]
        name = session.inputs[0].name
        rows = self._rows[role] or len(group)
        batch = session.input_buffer(name, (rows, 3, height, width))
        batch.fill(0.0)
        for row, line in zip(batch, group):
            h, w = line.crop.shape[:2]
            target_w = min(max_width, width, max(1, math.ceil(height * w / h)))
            normalize_into(row, resize(line.crop, target_w, height)[:, :, ::-1], _SCALE, _OFFSET)
        return batch

    def _classify_angles(self, lines: list[TextLine], timer: StageTimer) -> None:
        for group in self._by_aspect(lines, self.p.cls_batch):
            with timer.stage("preprocess"):
                batch = self._fill_line_batch(self.cls, group, _CLS_SHAPE[1], _CLS_SHAPE[1])
            with timer.stage("infer"):
                probs = self.cls.run({self.cls.inputs[0].name: batch})[self.cls.outputs[0].name]
            with timer.stage("postprocess"):
                for line, p in zip(group, probs[: len(group)]):
                    if int(np.argmax(p)) == 1 and float(p[1]) > self.p.cls_thresh:
                        line.crop = cv2.rotate(line.crop, cv2.ROTATE_180)

    def _rec_width(self, crop: np.ndarray) -> int:
        """The padded width for one crop, from its own aspect ratio alone (multiple of 32).

        Depending on nothing else makes a line's result independent of what it is batched with.
        """
        natural = math.ceil(self.p.rec_height * crop.shape[1] / crop.shape[0])
        width = min(max(self.p.rec_min_width, -(-natural // 32) * 32), self.p.rec_max_width)
        if self._rec_widths:  # a compiled recogniser: the smallest gear that holds it
            width = next((g for g in self._rec_widths if g >= width), self._rec_widths[-1])
        return width

    def _recognize(self, lines: list[TextLine], timer: StageTimer) -> None:
        by_width: dict[int, list[TextLine]] = {}
        for line in lines:
            by_width.setdefault(self._rec_width(line.crop), []).append(line)
        for width, same in sorted(by_width.items()):
            for start in range(0, len(same), self.p.rec_batch):
                group = same[start : start + self.p.rec_batch]
                with timer.stage("preprocess"):
                    batch = self._fill_line_batch(self.rec, group, width, width)
                with timer.stage("infer"):
                    name = self.rec.inputs[0].name
                    probs = self.rec.run({name: batch})[self.rec.outputs[0].name]
                with timer.stage("postprocess"):
                    for line, seq in zip(group, probs[: len(group)]):
                        line.text, line.score = self._ctc_decode(seq)

    def _ctc_decode(self, seq: np.ndarray) -> tuple[str, float]:
        """Greedy CTC: best class per step, repeats merged, blanks dropped."""
        best = seq.argmax(axis=1)
        keep = np.ones(best.shape, dtype=bool)
        keep[1:] = best[1:] != best[:-1]
        keep &= best != 0
        if not keep.any():
            return "", 0.0
        chars = self.charset
        text = "".join(chars[i] if i < len(chars) else "" for i in best[keep])
        score = float(seq[np.flatnonzero(keep), best[keep]].mean())
        return text, score

    def warmup(self) -> None:
        """The classifier at ``cls_batch`` and the recogniser at ``rec_batch`` on a blank line,
        then every recogniser gear of a compiled model once."""
        line = TextLine(0, np.zeros((4, 2), np.float32), np.full((48, 320, 3), 255, np.uint8))
        if self.p.use_angle_cls:
            self._classify_angles([line] * self.p.cls_batch, StageTimer())
        self._recognize([line] * self.p.rec_batch, StageTimer())
        for width in self._rec_widths:
            crop = np.full((self.p.rec_height, width, 3), 255, dtype=np.uint8)
            self._recognize([TextLine(0, line.box, crop)], StageTimer())


class OcrExecutor(Executor):
    """PP-OCR: text detection, then the angle classifier and recognition over the line crops,
    chained on one worker thread (``TextDetector``, then ``LineReader``)."""

    roles = ("det", "cls", "rec")
    varying_shape_roles = ("det", "rec")  # image sizes, text-line widths
    # the detector's input follows the frame (up to det_max_side); a line's width follows its
    # aspect, whatever the frame, bounded by rec_max_width and rec_batch: long lines are usual
    # in documents, and giving back after each would cost their batch a fifth more CPU
    one_off_roles = ("det",)
    Params = OcrParams

    def __init__(
        self, params: OcrParams, sessions: Mapping[str, ModelSession], max_batch: int
    ) -> None:
        super().__init__(params, sessions, max_batch)
        self.p = params
        self.detector = TextDetector(params, sessions["det"])
        self.reader = LineReader(params, sessions["cls"], sessions["rec"])

    def prepare(self, payload: Any) -> OcrInput:
        return self.detector.prepare(payload)

    def settle(self) -> None:
        super().settle()
        self.detector.settle()

    def execute(self, items: Sequence[OcrInput], timer: StageTimer) -> list[Any]:
        found = self.detector.detect(items, timer)
        with timer.stage("postprocess"):
            lines = [TextLine(i, box, crop_rgb_line(items[i].image, box)) for i, box in found]
        self.reader.read(lines, timer)
        with timer.stage("postprocess"):
            results: list[dict[str, Any]] = [{"lines": []} for _ in items]
            for line in lines:
                if self.reader.keeps(line):
                    results[line.image]["lines"].append(
                        {
                            "text": line.text,
                            "score": line.score,
                            "box": [[float(x), float(y)] for x, y in line.box],
                        }
                    )
            return list(results)

    def warmup(self) -> None:
        """Every batch size at the usual detector size, then every detector and recogniser
        gear of a compiled model once."""
        prepared = self.detector.warmup_blank()
        for size in self.warmup_sizes():
            self.execute([prepared] * size, StageTimer())
        self.detector.warmup_gears()
        self.reader.warmup()
