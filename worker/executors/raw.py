"""Raw tensors in, raw tensors out, for any model.

Payload: ``{input_name: array}`` (or one array for a single-input model), each array with the
model's rank; for a model whose first dimension is dynamic that dimension is the request's batch
count. Requests with the same trailing shapes are concatenated along the first dimension (up to
``max_batch`` rows per run) and each gets its own rows of every output back, copied out of the
session's reused buffers. Result: ``{output_name: array}``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import Field

from duomo.ipc.errors import InvalidArgumentError
from duomo.ipc.ring import TensorPlacement, place_tensors
from duomo.ipc.wire import ALIGN
from duomo.worker.backends.base import ModelSession, TensorSpec
from duomo.worker.config_model import StrictModel
from duomo.worker.executors.base import Executor, SlotInput, SlotSpec, StageTimer, WrittenInPlace


@dataclass(eq=False)
class RawInput:
    """One request's inputs and their rows. A request that came through a slot also carries the
    slot's output area and, once a run taught the output shapes, where its outputs go there: the
    supervisor hands the same object back while the slot sends the same shapes."""

    tensors: dict[str, np.ndarray]
    rows: int
    output: memoryview | None = None
    placed: tuple[TensorPlacement, dict[str, np.ndarray]] | None = None

    @property
    def signature(self) -> tuple[tuple[int, ...], ...]:
        return tuple(a.shape[1:] for a in self.tensors.values())


class RawParams(StrictModel):
    """Slot sizes for tensors whose size the model leaves open beyond the batch dimension."""

    max_input_bytes: int = Field(default=64 << 20, ge=1)
    max_output_bytes: int = Field(default=64 << 20, ge=1)


class RawExecutor(Executor):
    """Raw tensors in and out for any model; requests with the same trailing shapes share a run
    when the first dimension is dynamic."""

    Params = RawParams

    def __init__(
        self, params: RawParams, sessions: Mapping[str, ModelSession], max_batch: int
    ) -> None:
        super().__init__(params, sessions, max_batch)
        self.p = params
        self.session = sessions["model"]
        first_dims = [s.shape[0] if s.shape else 1 for s in self.session.inputs]
        self.batchable = all(d is None for d in first_dims)

    def _bytes_for(self, spec: TensorSpec, dynamic_default: int) -> int:
        dims = spec.shape[1:] if self.batchable else spec.shape
        if any(d is None for d in dims):
            return dynamic_default
        rows = self.max_batch if self.batchable else 1
        static = [d for d in dims if d is not None]
        return rows * math.prod(static) * spec.dtype.itemsize

    def slot_spec(self) -> SlotSpec:
        inputs = tuple(
            SlotInput(s.name, s.dtype, s.shape, self._bytes_for(s, self.p.max_input_bytes))
            for s in self.session.inputs
        )
        outputs = self.session.outputs
        record = 2 * ALIGN  # a tensor record plus alignment, per output
        capacity = sum(self._bytes_for(s, self.p.max_output_bytes) + record for s in outputs)
        return SlotSpec(
            inputs,
            "tensors",
            capacity,
            tuple(s.name for s in outputs),
            max_rows=self.max_batch if self.batchable else None,
            output_specs=tuple(outputs),
        )

    def payload_from_slot(self, tensors: dict[str, np.ndarray], output: memoryview) -> RawInput:
        # The supervisor already checked every input against this model's slot layout (names,
        # dtypes, ranks, fixed dimensions, rows ≤ max_batch); what is left is that the inputs
        # agree on their rows.
        self._check_image_size(tensors)
        if not self.batchable:
            return RawInput(tensors, 1, output)
        slot_rows = {array.shape[0] for array in tensors.values()}
        if len(slot_rows) != 1:
            raise InvalidArgumentError(
                f"inputs disagree on the batch dimension: {sorted(slot_rows)}"
            )
        return RawInput(tensors, slot_rows.pop(), output)

    def prepare(self, payload: Any) -> RawInput:
        if isinstance(payload, RawInput):  # from a slot, checked when it was built
            return payload
        specs = self.session.inputs
        if isinstance(payload, np.ndarray):
            if len(specs) != 1:
                raise InvalidArgumentError(
                    f"model has {len(specs)} inputs {[s.name for s in specs]}; pass a dict"
                )
            payload = {specs[0].name: payload}
        if not isinstance(payload, dict):
            raise InvalidArgumentError(f"expected a dict of arrays, got {type(payload).__name__}")
        names = {s.name for s in specs}
        if set(payload) != names:
            raise InvalidArgumentError(
                f"inputs must be exactly {sorted(names)}, got {sorted(payload)}"
            )
        tensors: dict[str, np.ndarray] = {}
        rows: set[int] = set()
        for spec in specs:
            array = payload[spec.name]
            if not isinstance(array, np.ndarray):
                raise InvalidArgumentError(f"input {spec.name!r} must be a numpy array")
            if array.dtype != spec.dtype:
                raise InvalidArgumentError(
                    f"input {spec.name!r} must be {spec.dtype.name}, got {array.dtype.name}"
                )
            if array.ndim != len(spec.shape) or any(
                d is not None and d != a for d, a in zip(spec.shape, array.shape)
            ):
                raise InvalidArgumentError(
                    f"input {spec.name!r} shape {list(array.shape)} does not fit "
                    f"{['?' if d is None else d for d in spec.shape]}"
                )
            tensors[spec.name] = array
            rows.add(array.shape[0] if self.batchable else 1)
        if len(rows) != 1:
            raise InvalidArgumentError(f"inputs disagree on the batch dimension: {sorted(rows)}")
        self._check_image_size(tensors)
        n = rows.pop()
        if not 1 <= n <= self.max_batch:
            raise InvalidArgumentError(f"batch of {n} rows is outside 1..{self.max_batch}")
        return RawInput(tensors, n)

    def _check_image_size(self, tensors: dict[str, np.ndarray]) -> None:
        """A model compiled for a few image sizes (ACL ``--dynamic_image_size``) takes only
        those: the input whose H and W are open must come at one of them."""
        gears = self.session.hw_gears
        if not gears:
            return
        for spec in self.session.inputs:
            open_dims = [i for i, d in enumerate(spec.shape) if d is None]
            if len(open_dims) == 2 and spec.name in tensors:
                shape = tensors[spec.name].shape
                hw = (shape[open_dims[0]], shape[open_dims[1]])
                if hw not in gears:
                    raise InvalidArgumentError(
                        f"input {spec.name!r} is {hw[0]}×{hw[1]}; this model takes only "
                        f"{[f'{h}×{w}' for h, w in gears]}"
                    )

    def warmup(self) -> None:
        """Zeros at every row count, when the model fixes every dimension but the batch."""
        specs = self.session.inputs
        trailing = [s.shape[1:] if self.batchable else s.shape for s in specs]
        if any(d is None for dims in trailing for d in dims):
            return  # sizes only the requests know: the first ones size the buffers
        for rows in self.warmup_sizes() if self.batchable else (1,):
            lead = (rows,) if self.batchable else ()
            tensors = {s.name: np.zeros((*lead, *t), s.dtype) for s, t in zip(specs, trailing)}
            self.session.run(tensors)

    def execute(self, items: Sequence[RawInput], timer: StageTimer) -> list[Any]:
        if len(items) == 1 and items[0].output is not None:
            written = self._run_into_slot(items[0], timer)
            if written is not None:
                return [written]
        results: list[Any] = [None] * len(items)
        for group in self._groups(items):
            with timer.stage("preprocess"):
                feed = self._assemble([items[i] for i in group])
            with timer.stage("infer"):
                out = self.session.run(feed)
            with timer.stage("postprocess"):
                start = 0
                for i in group:
                    n = items[i].rows
                    if self.batchable:
                        results[i] = {k: v[start : start + n].copy() for k, v in out.items()}
                    else:
                        results[i] = {k: v.copy() for k, v in out.items()}
                    start += n
        return results

    def _run_into_slot(self, item: RawInput, timer: StageTimer) -> WrittenInPlace | None:
        """One request from a slot, outputs written by the runtime straight into its output
        area: no copy after the model's own. None when the output shapes are not yet known."""
        assert item.output is not None
        if item.placed is None:
            shapes = self.session.expected_output_shapes(item.tensors)
            if shapes is None:
                return None
            layout = [(s.dtype, shape) for s, shape in zip(self.session.outputs, shapes)]
            try:
                placement = place_tensors(item.output, layout)
            except ValueError:
                return None  # too large for the slot: the normal path reports it
            views = {s.name: v for s, v in zip(self.session.outputs, placement.views)}
            item.placed = (placement, views)
        else:
            placement, views = item.placed
            placement.write_records(item.output)
        with timer.stage("infer"):
            self.session.run(item.tensors, views)
        return WrittenInPlace(placement.used)

    def _groups(self, items: Sequence[RawInput]) -> list[list[int]]:
        """Indices that can share one run: same trailing shapes, rows within max_batch."""
        if not self.batchable:
            return [[i] for i in range(len(items))]
        groups: list[list[int]] = []
        open_groups: dict[tuple[tuple[int, ...], ...], tuple[list[int], int]] = {}
        for i, item in enumerate(items):
            group, rows = open_groups.get(item.signature, ([], 0))
            if group and rows + item.rows > self.max_batch:
                group, rows = [], 0
            if not group:
                groups.append(group)
            group.append(i)
            open_groups[item.signature] = (group, rows + item.rows)
        return groups

    def _assemble(self, group: list[RawInput]) -> dict[str, np.ndarray]:
        if len(group) == 1:
            return group[0].tensors
        feed = {}
        for spec in self.session.inputs:
            parts = [item.tensors[spec.name] for item in group]
            shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            buffer = self.session.input_buffer(spec.name, shape)
            np.concatenate(parts, axis=0, out=buffer)
            feed[spec.name] = buffer
        return feed
