"""The executor contract: per-task pre/post-processing around one or more backend sessions.

An executor instance belongs to one worker thread and owns the sessions it was given (one per
role: ``("model",)`` for most tasks, ``("det", "cls", "rec")`` for OCR). The worker calls
``prepare`` once per request (validation + per-image work; a bad request fails alone with
``InvalidArgumentError``) and ``execute`` once per batch, which writes the prepared items into the
sessions' reusable input buffers, runs, and turns outputs into one result per item.

A new task is a subclass with ``roles``, a ``Params`` model (its config section, strict) and
those two methods; register it by name in ``worker.executors`` or point a config's ``task`` at
``package.module:ClassName``.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from duomo.ipc.errors import InvalidArgumentError
from duomo.worker.backends.base import Backend, ModelSession, SessionSettings, TensorSpec
from duomo.worker.config_model import StrictModel

MAX_IMAGE_SIDE = 16384
IMAGE_SLOT_BYTES = 3840 * 2160 * 4  # a 4K RGBA frame; shared memory is committed only when written
JSON_RESULT_BYTES = 1 << 20  # a dense OCR page is ~100 KB of JSON


@dataclass(frozen=True)
class SlotInput:
    """One input as a producer writes it into a shared-memory slot; ``bound``, where the task
    has one, is the largest shape it takes (checked by the producer's handle and the gateway
    before a ring grows for it, and by the supervisor before it grows one)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]  # None: any size in that dimension
    capacity: int  # bytes
    bound: tuple[int, ...] | None = None

    @property
    def most_bytes(self) -> int | None:
        """The bytes of its largest tensor (None: no bound)."""
        return None if self.bound is None else math.prod(self.bound) * self.dtype.itemsize


def image_input() -> SlotInput:
    """An image task's frame: uint8 H×W×C (C 1, 3 or 4), up to ``MAX_IMAGE_SIDE`` a side; its
    default area holds a 4K RGBA frame, and a larger frame grows the ring."""
    bound = (MAX_IMAGE_SIDE, MAX_IMAGE_SIDE, 4)
    return SlotInput("image", np.dtype(np.uint8), (None, None, None), IMAGE_SLOT_BYTES, bound)


@dataclass(frozen=True)
class SlotSpec:
    """What one request of this executor needs in a slot: its inputs and its result area."""

    inputs: tuple[SlotInput, ...]
    result: str  # "json": a structured result; "tensors": output arrays
    result_capacity: int
    outputs: tuple[str, ...] = field(default_factory=tuple)
    max_rows: int | None = None  # inputs' first dimension is the batch, at most this many rows
    # each output tensor's dtype and shape (``result == "tensors"``; None: a dynamic dimension)
    output_specs: tuple[TensorSpec, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class WrittenInPlace:
    """A result the executor already wrote into the request's slot output area (``nbytes``)."""

    nbytes: int


IMAGE_SLOT = SlotSpec(
    inputs=(image_input(),),
    result="json",
    result_capacity=JSON_RESULT_BYTES,
)


class NoParams(StrictModel):
    """For executors that take no parameters."""


class StageTimer:
    """Accumulates the seconds one batch spends per stage inside ``execute``."""

    def __init__(self) -> None:
        self.seconds = {"preprocess": 0.0, "infer": 0.0, "postprocess": 0.0}

    def stage(self, name: str) -> _Stage:
        """A context manager that adds the seconds spent inside it to stage ``name``.

        ``name`` is one of "preprocess", "infer" and "postprocess"; any other is a
        ``KeyError`` when the block ends.
        """
        return _Stage(self.seconds, name)


class _Stage:
    """``with timer.stage("infer"):`` (a plain class: cheaper than a generator context)."""

    __slots__ = ("_name", "_seconds", "_start")

    def __init__(self, seconds: dict[str, float], name: str) -> None:
        self._seconds = seconds
        self._name = name
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._seconds[self._name] += time.perf_counter() - self._start


class Executor(ABC):
    """A task's plugin: pre-processing, the runs of its sessions, and post-processing.

    A model worker opens one executor per instance (``open``: one ``ModelSession`` per name
    in ``roles``, from the config entry's ``files``) on its own thread and uses it only there.
    For each request the worker takes the payload out of its slot (``payload_from_slot``, laid
    out by ``slot_spec``) and calls ``prepare``, which validates it (``InvalidArgumentError``
    fails that request alone); then ``execute`` runs a batch of prepared items and returns one
    result or one ``DuomoError`` per item. ``Params`` is the pydantic model of the entry's
    ``params`` (``extra="forbid"``). A config names a new task by its class
    (``task: "package.module:Class"``); the guide is docs/adding-a-model.md.

    Example:
        class ScoreExecutor(Executor):  # one model (role "model"): an image in, a score out
            def prepare(self, payload: Any) -> np.ndarray:
                return as_rgb_image(payload)

            def execute(self, items: Sequence[Any], timer: StageTimer) -> list[Any]:
                session = self.sessions["model"]
                name = session.inputs[0].name
                with timer.stage("preprocess"):
                    batch = session.input_buffer(name, (len(items), 3, 224, 224))
                    for row, image in zip(batch, items):
                        row[...] = cv2.resize(image, (224, 224)).transpose(2, 0, 1) / 255
                with timer.stage("infer"):
                    scores = session.run({name: batch})[session.outputs[0].name]
                return [{"score": float(score)} for score in scores[:, 0]]
    """

    roles: ClassVar[tuple[str, ...]] = ("model",)
    varying_shape_roles: ClassVar[tuple[str, ...]] = ()  # roles fed a new shape per request
    # roles whose inputs follow the request's size, so that a request far larger than the
    # warm-up's is a one-off whose memory goes back (``settle``); None: every role. A role
    # left out keeps what its largest input took, bounded by the task's own params.
    one_off_roles: ClassVar[tuple[str, ...] | None] = None
    Params: ClassVar[type[StrictModel]] = NoParams
    # For pipelines (``supervisor.dataflow.pipelines``): the key of the result's list of objects a
    # later step may run ``for_each`` of (dicts with a ``box`` [x1, y1, x2, y2] in the frame's
    # pixels, and a ``score``); None: its results have no objects.
    objects: ClassVar[str | None] = None
    # what of an object, besides a crop of its box, a ``for_each`` may hand one of its requests
    # (``{"image": frame, name: the object's value}``; "landmarks": a face task)
    object_inputs: ClassVar[frozenset[str]] = frozenset()
    # its file is data it keeps itself (a gallery): ``open`` makes a missing one, and it serves
    # changes to it without a reload, so a reload does not replace the model when it changed
    data_file: ClassVar[bool] = False

    @classmethod
    def check_data_file(cls, params: StrictModel, path: Path) -> str:
        """What ``duomo check`` says of a ``data_file`` task's file: what it holds; ValueError
        with the reason for one it cannot serve."""
        raise NotImplementedError(f"{cls.__name__} keeps no data file")

    @classmethod
    def session_settings(cls, role: str, settings: SessionSettings) -> SessionSettings:
        """What the session for ``role`` is opened with: ``settings``, and whether its input
        shapes vary per request (backends plan memory differently for those)."""
        return replace(settings, varying_shapes=role in cls.varying_shape_roles)

    @classmethod
    def open(
        cls,
        params: StrictModel,
        files: Mapping[str, Path],
        max_batch: int,
        backend: Backend,
        settings: SessionSettings,
    ) -> Executor:
        """An executor over one session per role, opened by ``backend`` (a model worker's load,
        and the benchmark's in-process modes). A session that takes fewer rows per run than
        ``max_batch`` is an error; on any error the sessions opened so far are closed."""
        sessions: dict[str, ModelSession] = {}
        try:
            for role in cls.roles:
                session = sessions[role] = backend.open(
                    files[role], cls.session_settings(role, settings)
                )
                if session.max_rows is not None and max_batch > session.max_rows:
                    raise RuntimeError(
                        f"max_batch {max_batch} is above the {session.max_rows} rows "
                        f"{session.path.name} takes per run; lower max_batch or rebuild the model"
                    )
            executor = cls(params, sessions, max_batch)
            executor.device = settings.device
            return executor
        except BaseException:
            for session in sessions.values():
                session.close()
            raise

    def __init__(
        self, params: StrictModel, sessions: Mapping[str, ModelSession], max_batch: int
    ) -> None:
        self.params = params
        self.sessions = sessions
        self.max_batch = max_batch
        self.warmup_costs: dict[int, float] = {}  # batch size -> seconds its warm-up run took
        self.device = 0  # the device its instance runs on (set by ``open``)

    @abstractmethod
    def prepare(self, payload: Any) -> Any:
        """Validate and pre-process one request's payload; raise InvalidArgumentError if bad.

        What it returns may keep views of the payload (a slot's memory stays valid until the
        request is answered); image-sized work belongs in ``execute``, where it can write into
        the executor's reusable buffers instead of allocating per request."""

    @abstractmethod
    def execute(self, items: Sequence[Any], timer: StageTimer) -> list[Any]:
        """Run one batch of prepared items; return one result (or a DuomoError) per item."""

    def warmup(self) -> None:  # noqa: B027 - optional hook
        """Run once at every batch size (``warmup_sizes``) at the largest shapes, so every buffer
        is sized and every batch shape has run at load, not under load."""

    def settle(self) -> None:
        """The warm-up is over (the model worker calls this once): the session of each role in
        ``one_off_roles`` keeps what the warm-up sized, and a request far larger is a one-off
        whose memory goes back when it is answered (``worker.backends.base``)."""
        roles = self.sessions.keys() if self.one_off_roles is None else self.one_off_roles
        for role in roles:
            self.sessions[role].memory.settle()

    def release_one_offs(self) -> bool:
        """After a batch is answered (the model worker calls this): each session that ran a
        one-off since the last call hands back what it left in its runtime's pools. Whether
        any did."""
        released = False
        for session in self.sessions.values():
            released = session.memory.release_one_off() or released
        return released

    def warmup_sizes(self) -> Iterator[int]:
        """Every batch size this instance will run, largest first (buffers are sized first).
        The time the caller's loop spends on each size is kept in ``warmup_costs`` (what
        ``max_delay_ms: auto`` starts from: ``worker.batch_window``)."""
        for size in range(self.max_batch, 0, -1):
            started = time.perf_counter()
            yield size
            self.warmup_costs[size] = time.perf_counter() - started

    def slot_spec(self) -> SlotSpec:
        """The slot layout for this task; vision tasks take one uint8 H×W×C image."""
        return IMAGE_SLOT

    def payload_from_slot(self, tensors: dict[str, np.ndarray], output: memoryview) -> Any:
        """The ``prepare`` payload from the input views of a slot (and its output area, for an
        executor that can write its result there directly)."""
        return tensors["image"]

    def close(self) -> None:
        """Close every session it owns, on the worker thread that opened them.

        An override that holds more releases it and calls ``super().close()``.
        """
        for session in self.sessions.values():
            session.close()


def as_rgb_image(payload: Any) -> np.ndarray:
    """The payload as a uint8 H×W×3 array; grayscale is expanded, an alpha channel dropped."""
    if not isinstance(payload, np.ndarray):
        raise InvalidArgumentError(f"expected an image array, got {type(payload).__name__}")
    image = payload
    if image.dtype != np.uint8:
        raise InvalidArgumentError(f"image must be uint8, got {image.dtype}")
    if image.ndim == 3 and image.shape[2] == 1:
        image = image[:, :, 0]
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    elif image.ndim == 3 and image.shape[2] == 4:
        image = image[:, :, :3]
    if image.ndim != 3 or image.shape[2] != 3:
        raise InvalidArgumentError(
            f"image must be H×W, H×W×3 or H×W×4, got shape {tuple(payload.shape)}"
        )
    h, w = image.shape[:2]
    if not (1 <= h <= MAX_IMAGE_SIDE and 1 <= w <= MAX_IMAGE_SIDE):
        raise InvalidArgumentError(f"image size {w}×{h} is outside 1..{MAX_IMAGE_SIDE} per side")
    return np.ascontiguousarray(image)
