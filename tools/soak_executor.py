"""The soak's failing model: an executor that loads no file, answers ``y = 2x + offset`` for raw
float32 ``x`` of shape N×4, and raises on every batch from each instance's ``fail_from``-th on,
so that the watchdog re-initializes it again and again while the other models serve.

Owns: ``AffineExecutor``, that model's contract (its slot, its validation, its answer), and
``FlakyExecutor``, the same model failing from a given batch on. A config names it as

    task: tools.soak_executor:FlakyExecutor
    files: {}                       # it loads no model file
    params: {fail_from: 40}

Called by: the supervisor, for the config ``tools/soak.py`` writes (no shipped config names
it). The tests' faulty executor (``tests/fakes/faulty_executor.py``) builds its faults on cue on
``AffineExecutor``; the tool never imports the test tree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import Field

from duomo.ipc.errors import InvalidArgumentError
from duomo.worker.backends.base import ModelSession
from duomo.worker.config_model import StrictModel
from duomo.worker.executors.base import Executor, SlotInput, SlotSpec, StageTimer


class AffineParams(StrictModel):
    offset: float = 1.0  # tells models apart by their answers


class AffineExecutor(Executor):
    """``y = 2x + offset`` row by row; a batch is N×4 float32 rows, N ≤ ``max_batch``."""

    roles = ()
    Params = AffineParams

    def __init__(
        self, params: AffineParams, sessions: Mapping[str, ModelSession], max_batch: int
    ) -> None:
        super().__init__(params, sessions, max_batch)
        self.offset = np.float32(params.offset)

    def slot_spec(self) -> SlotSpec:
        x = SlotInput("x", np.dtype(np.float32), (None, 4), self.max_batch * 16)
        return SlotSpec((x,), "tensors", self.max_batch * 16 + 256, ("y",), self.max_batch)

    def payload_from_slot(self, tensors: dict[str, np.ndarray], output: memoryview) -> Any:
        return tensors["x"]

    def prepare(self, payload: Any) -> np.ndarray:
        if isinstance(payload, dict):
            payload = payload.get("x")
        if not isinstance(payload, np.ndarray) or payload.dtype != np.float32:
            raise InvalidArgumentError("x must be a float32 array")
        if payload.ndim != 2 or payload.shape[1] != 4 or not 1 <= len(payload) <= self.max_batch:
            raise InvalidArgumentError(f"x must be N×4 with N in 1..{self.max_batch}")
        return payload

    def execute(self, items: Sequence[Any], timer: StageTimer) -> list[Any]:
        return self.answer(items, timer)

    def answer(self, items: Sequence[Any], timer: StageTimer) -> list[Any]:
        """Every item's ``{"y": 2x + offset}``."""
        with timer.stage("infer"):
            return [{"y": 2 * x + self.offset} for x in items]


class FlakyParams(AffineParams):
    fail_from: int = Field(default=40, ge=1)  # this instance's batches from this one on raise


class FlakyExecutor(AffineExecutor):
    """An ``AffineExecutor`` whose every batch from its ``fail_from``-th on raises: the model
    fails until the watchdog re-initializes it, and again ``fail_from`` batches later."""

    Params = FlakyParams

    def __init__(
        self, params: FlakyParams, sessions: Mapping[str, ModelSession], max_batch: int
    ) -> None:
        super().__init__(params, sessions, max_batch)
        self.fail_from = params.fail_from
        self.batches = 0

    def execute(self, items: Sequence[Any], timer: StageTimer) -> list[Any]:
        self.batches += 1
        if self.batches >= self.fail_from:
            raise RuntimeError(f"injected fault on batch {self.batches}")
        return self.answer(items, timer)
