"""A test-only executor that misbehaves on cue: it raises, hangs or returns garbage.

For the lifecycle tests only; no shipped config names it. A config uses it as

    task: tests.fakes.faulty_executor:FaultyExecutor
    files: {}                       # it loads no model file
    params: {fault: raise, first_call: 5, fault_calls: 3, control_file: /tmp/x, ...}

Requests are raw float32 ``x`` of shape N×4 (N ≤ max_batch); the answer is ``y = 2x + offset``
(the model of ``tools.soak_executor.AffineExecutor``, which this extends), so a test can check
every answer and tell models apart by ``offset``. ``fault`` applies from
this instance's ``first_call``-th batch on, for ``fault_calls`` batches (0: for good); a
``control_file``, when it exists, overrides ``fault`` on every batch with its content ("none",
"raise", "hang", "garbage"), so a test can switch a running model's behaviour. A hang lasts
while the control file still says "hang" (or ``hang_s``). ``work_ms`` is time spent per batch
and ``item_ms`` per item of it (``work_ms`` alone: a batch costs the same whatever its size, as
on a device that batches well),
``ballast_mb`` memory each loaded instance holds (touched, so it is resident), ``load_s`` how
long each instance takes to load. ``fault_device``: faults (and the control file) apply only to
the instances on that device (``models[].device`` with several), so a test can hold one
device's instance busy while the others serve. ``slot_dtype``: the dtype its slot declares for
``x``; one the wire cannot carry (``complex64``) is an executor bug that makes attaching it
fail with an exception no one expected. ``batch_log``: a file each batch appends one JSON line
to — when it began (``at``, ``time.monotonic``) and the first row's first two values of each
item, in the batch's order (``items``) — so a test that writes which camera and which frame
into those values can tell which frames ran together.

``FaultyImageExecutor`` is the same on cue for pipelines' ``for_each`` steps: it takes an image
(an object's crop) or ``{"image", "landmarks"}``, answers what it was handed, and raises on cue.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from duomo.ipc.errors import InvalidArgumentError
from duomo.worker.backends.base import ModelSession
from duomo.worker.config_model import StrictModel
from duomo.worker.executors.base import IMAGE_SLOT, Executor, SlotSpec, StageTimer
from tools.soak_executor import AffineExecutor, AffineParams

Fault = Literal["none", "raise", "hang", "garbage"]
FAULTS = ("none", "raise", "hang", "garbage")


def scheduled_fault(p: FaultyParams | FaultyImageParams, calls: int, faults: Sequence[str]) -> str:
    """The fault an instance's ``calls``-th batch has: what its ``control_file`` says (one of
    ``faults``), else ``p.fault`` from batch ``first_call`` on, for ``fault_calls`` batches (0:
    for good)."""
    control = p.control_file
    if control is not None:
        try:
            said = control.read_text().strip()
        except OSError:
            said = ""
        if said in faults:
            return said
    if calls < p.first_call:
        return "none"
    if p.fault_calls and calls >= p.first_call + p.fault_calls:
        return "none"
    return p.fault


class FaultyParams(AffineParams):
    fault: Fault = "none"
    first_call: int = Field(default=1, ge=1)
    fault_calls: int = Field(default=0, ge=0)
    control_file: Path | None = None
    hang_s: float = Field(default=3600.0, ge=0)
    work_ms: float = Field(default=0.0, ge=0)
    ballast_mb: int = Field(default=0, ge=0)
    load_s: float = Field(default=0.0, ge=0)
    item_ms: float = Field(default=0.0, ge=0)
    fault_device: int | None = None
    slot_dtype: str = "float32"
    batch_log: Path | None = None


class FaultyExecutor(AffineExecutor):
    Params = FaultyParams

    def __init__(
        self, params: FaultyParams, sessions: Mapping[str, ModelSession], max_batch: int
    ) -> None:
        super().__init__(params, sessions, max_batch)
        self.p = params
        self.calls = 0
        self._ballast: np.ndarray | None = None
        time.sleep(params.load_s)
        if params.ballast_mb:
            self._ballast = np.ones(params.ballast_mb << 17, dtype=np.float64)  # 8 B each

    def warmup(self) -> None:
        """Its batch cost is what its params say: ``warmup_costs`` is that curve, stated
        rather than slept through (a test's ``work_ms`` may be seconds)."""
        for size in range(self.max_batch, 0, -1):
            self.warmup_costs[size] = (self.p.work_ms + self.p.item_ms * size) / 1e3

    def slot_spec(self) -> SlotSpec:
        spec = super().slot_spec()
        x = dataclasses.replace(spec.inputs[0], dtype=np.dtype(self.p.slot_dtype))
        return dataclasses.replace(spec, inputs=(x,))

    def _fault_now(self) -> str:
        if self.p.fault_device is not None and self.device != self.p.fault_device:
            return "none"
        return scheduled_fault(self.p, self.calls, FAULTS)

    def execute(self, items: Sequence[Any], timer: StageTimer) -> list[Any]:
        self.calls += 1
        if self.p.batch_log is not None:
            self._log_batch(self.p.batch_log, items)
        fault = self._fault_now()
        if fault == "raise":
            raise RuntimeError(f"injected fault on call {self.calls}")
        if fault == "hang":
            until = time.monotonic() + self.p.hang_s
            while time.monotonic() < until and self._fault_now() == "hang":
                time.sleep(0.02)
        if self.p.work_ms or self.p.item_ms:  # a batch of n costs work_ms + n × item_ms
            time.sleep((self.p.work_ms + self.p.item_ms * len(items)) / 1e3)
        if fault == "garbage":  # one result too many: the batch cannot be split back
            return [None] * (len(items) + 1)
        return self.answer(items, timer)

    @staticmethod
    def _log_batch(path: Path, items: Sequence[Any]) -> None:
        """One line per batch: when it began, and each item's first row's first two values."""
        shown = [[float(x[0, 0]), float(x[0, 1])] for x in items]
        line = json.dumps({"at": time.monotonic(), "items": shown})
        with path.open("a") as log:
            log.write(line + "\n")

    def close(self) -> None:
        self._ballast = None
        super().close()


class FaultyImageParams(StrictModel):
    fault: Literal["none", "raise", "hang"] = "none"
    first_call: int = Field(default=1, ge=1)
    fault_calls: int = Field(default=0, ge=0)
    control_file: Path | None = None
    work_ms: float = Field(default=0.0, ge=0)
    item_ms: float = Field(default=0.0, ge=0)


class FaultyImageExecutor(Executor):
    """A test-only image task for pipelines' ``for_each`` steps (no model file): a request is a
    uint8 image (a crop of an object's box) or ``{"image", "landmarks"}`` (the frame and one
    object's points); the answer is ``{"mean": the image's mean, "shape": [h, w], "points": n}``
    (``points``: the landmarks given, 0 for a crop), so a test can tell what each request was
    handed. ``fault: raise`` raises on this instance's batches from ``first_call`` on, for
    ``fault_calls`` batches (0: for good), ``hang`` hangs while the fault lasts; a
    ``control_file``, when it exists, says "none", "raise" or "hang" on every batch instead;
    ``work_ms`` + ``item_ms`` × n is the time a batch of n takes."""

    roles = ()
    Params = FaultyImageParams
    object_inputs = frozenset({"landmarks"})

    def __init__(
        self, params: FaultyImageParams, sessions: Mapping[str, ModelSession], max_batch: int
    ) -> None:
        super().__init__(params, sessions, max_batch)
        self.p = params
        self.calls = 0

    def warmup(self) -> None:
        for size in range(self.max_batch, 0, -1):
            self.warmup_costs[size] = (self.p.work_ms + self.p.item_ms * size) / 1e3

    def slot_spec(self) -> SlotSpec:
        return IMAGE_SLOT

    def prepare(self, payload: Any) -> tuple[np.ndarray, int]:
        points = 0
        if isinstance(payload, Mapping):
            landmarks = payload.get("landmarks")
            if landmarks is not None:
                points = int(np.asarray(landmarks).reshape(-1, 2).shape[0])
            payload = payload.get("image")
        if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8 or payload.ndim < 2:
            raise InvalidArgumentError("expected a uint8 image")
        return payload, points

    def _fault_now(self) -> str:
        return scheduled_fault(self.p, self.calls, ("none", "raise", "hang"))

    def execute(self, items: Sequence[tuple[np.ndarray, int]], timer: StageTimer) -> list[Any]:
        self.calls += 1
        fault = self._fault_now()
        if fault == "raise":
            raise RuntimeError(f"injected image fault on call {self.calls}")
        while fault == "hang":  # until the control file says otherwise
            time.sleep(0.02)
            fault = self._fault_now()
        if self.p.work_ms or self.p.item_ms:
            time.sleep((self.p.work_ms + self.p.item_ms * len(items)) / 1e3)
        with timer.stage("infer"):
            return [
                {"mean": float(image.mean()), "shape": list(image.shape[:2]), "points": points}
                for image, points in items
            ]
