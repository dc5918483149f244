"""One v2 inference request through a slot: its inputs written into the slot (tensors copied,
images decoded, shared-memory regions read), and the slot's answer turned into v2 outputs.

A tensor in a registered region is copied once: read from the region's descriptor straight into
the slot's input view (``Span.read_into``), and an output asked for in a region is written from
the slot's output view (``Span.write``); the region's bounds are checked first, so a tensor that
does not fit costs nothing in the slot.

Called by ``gateway.link`` (through the closures the transports build), on the gateway
worker's event loop. Everything a caller sends is checked here against the model's wire view
before it reaches the slot; the supervisor checks the slot header again (docs/operations.md: every
field a client writes is hostile), so what passes here and fails there is still a clear error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import orjson

from duomo.gateway.images import decode_into
from duomo.gateway.protocol import (
    IMAGE_INPUT,
    NUMPY_TYPES,
    RESULT_OUTPUT,
    InferRequest,
    InputTensor,
    ModelView,
    OutputRequest,
    OutputTensor,
    TensorInfo,
    bytes_elements,
    check_datatype,
    input_array,
    output_selection,
)
from duomo.gateway.regions import Regions
from duomo.gateway.streams import StreamRequest
from duomo.ipc.client import Slot
from duomo.ipc.errors import InvalidArgumentError, SupersededError


@dataclass
class Answer:
    """The outputs asked for, each with how it was asked (binary, JSON, or into a region),
    and the supervisor's times for the request (the response's ``parameters``: µs queued, and
    µs in the executor: pre-processing, inference and post-processing together); for a frame of
    a stream, also the name it went under in the supervisor, its frame number and its capture
    time on the wall clock with the clock it came from."""

    outputs: list[tuple[OutputTensor, OutputRequest]]
    queue_us: int = 0
    compute_us: int = 0
    stream: StreamRequest | None = None

    @property
    def parameters(self) -> dict[str, int | str]:
        found: dict[str, int | str] = {
            "duomo_queue_us": self.queue_us, "duomo_compute_us": self.compute_us,
        }  # fmt: skip
        if self.stream is not None and self.stream.frame is not None:
            found["duomo_stream"] = self.stream.served_as
            found["duomo_frame"] = self.stream.frame
            found["duomo_captured_at"] = self.stream.when.rfc3339
            found["duomo_clock"] = self.stream.when.clock
        return found


def write_inputs(view: ModelView, request: InferRequest, slot: Slot, regions: Regions) -> None:
    """Check ``request``'s inputs against ``view`` and write them into ``slot``."""
    view.require_known()
    given: dict[str, InputTensor] = {}
    for tensor in request.inputs:
        if tensor.name in given:
            raise InvalidArgumentError(f"input {tensor.name[:100]!r} is given twice")
        given[tensor.name] = tensor
    for info in view.inputs:
        if info.name not in given:
            raise InvalidArgumentError(f"model {view.name!r} needs input {info.name!r}")
        tensor = given.pop(info.name)
        if view.image_task and info.name == IMAGE_INPUT:
            _write_image(tensor, slot, regions)
        else:
            _write_tensor(info, tensor, slot, regions)
    if given:
        raise InvalidArgumentError(
            f"model {view.name!r} has no input {next(iter(given))[:100]!r} "
            f"(inputs: {[i.name for i in view.inputs]})"
        )


def _write_image(tensor: InputTensor, slot: Slot, regions: Regions) -> None:
    if tensor.datatype == "BYTES":
        if tensor.region is not None:
            tensor.raw = regions.span(tensor.region).read()
        elements = bytes_elements(tensor)
        if len(elements) != 1:
            raise InvalidArgumentError(
                f"input {IMAGE_INPUT!r} as BYTES holds one encoded image, got {len(elements)}"
            )
        decode_into(elements[0], lambda shape: _slot_view(slot, "image", shape))
        return
    check_datatype(tensor, "UINT8")
    shape = tensor.shape
    if len(shape) != 3 or shape[2] not in (1, 3, 4) or 0 in shape:
        raise InvalidArgumentError(
            f"input {IMAGE_INPUT!r} must be UINT8 [H, W, C] with C 1, 3 or 4 and H, W ≥ 1 "
            f"(or BYTES [1] holding a PNG or JPEG), got shape {list(shape)}"
        )
    slot.handle.check_input("image", shape)  # (before the tensor is read or a ring grows)
    _write_array(tensor, "image", np.dtype(np.uint8), slot, regions)


def _write_tensor(info: TensorInfo, tensor: InputTensor, slot: Slot, regions: Regions) -> None:
    check_datatype(tensor, info.datatype)
    if len(tensor.shape) != len(info.shape) or any(
        want not in (-1, got) for want, got in zip(info.shape, tensor.shape)
    ):
        raise InvalidArgumentError(
            f"input {info.name!r} has shape {list(tensor.shape)}, expected {list(info.shape)} "
            "(-1: any size)"
        )
    _write_array(tensor, info.slot_name, NUMPY_TYPES[info.datatype], slot, regions)


def _write_array(
    tensor: InputTensor, slot_name: str, dtype: np.dtype, slot: Slot, regions: Regions
) -> None:
    """A numeric input into the slot: from its region (read straight into the slot), or from
    the request (checked whole before the slot is touched)."""
    if tensor.region is None:
        array = input_array(tensor, dtype)
        _slot_view(slot, slot_name, tensor.shape)[...] = array
        return
    span = regions.span(tensor.region, math.prod(tensor.shape) * dtype.itemsize)
    target = _slot_view(slot, slot_name, tensor.shape)
    if target.flags.c_contiguous:
        span.read_into(target.reshape(-1).view(np.uint8).data)
    else:  # (a gray frame's view in a 3-channel area)
        target[...] = np.frombuffer(span.read(), dtype=dtype).reshape(tensor.shape)


def _slot_view(slot: Slot, name: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        return slot.input(name, shape)
    except ValueError:  # larger than the slot's area for it
        area = slot.handle.layout.inputs[[a.name for a in slot.handle.layout.inputs].index(name)]
        raise InvalidArgumentError(
            f"input of shape {list(shape)} does not fit the slot's {area.capacity} bytes for "
            f"{name!r}"
        ) from None


def read_answer(view: ModelView, request: InferRequest, slot: Slot, regions: Regions) -> Answer:
    """The answered ``slot`` as the outputs ``request`` asks for (raises the request's error;
    a superseded frame's says which frame of which stream). Everything is copied out of the
    slot (or into a region) before it returns."""
    try:
        result = slot.wait(timeout_s=0)
    except SupersededError as err:
        stream = request.stream
        if stream is None:
            raise
        raise SupersededError(
            f"superseded: frame {stream.frame} of stream {stream.name!r} was not run ({err}; "
            f"policy {stream.policy}: only the newest waiting frame runs)"
        ) from None
    outputs: list[tuple[OutputTensor, OutputRequest]] = []
    for info, asked in output_selection(view, request):
        if view.json_result:
            tensor = OutputTensor(RESULT_OUTPUT, "BYTES", (1,), elements=[orjson.dumps(result)])
            if asked.region is not None:
                raw = tensor.raw()
                regions.span(asked.region, len(raw)).write(memoryview(raw))
                tensor = OutputTensor(tensor.name, "BYTES", (1,), region_bytes=len(raw))
        elif asked.region is not None:  # written from the slot's output view: one copy
            array = result[info.name]
            flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            regions.span(asked.region, flat.nbytes).write(flat.data)
            tensor = OutputTensor(info.name, info.datatype, array.shape, region_bytes=flat.nbytes)
        else:
            array = result[info.name]
            tensor = OutputTensor(info.name, info.datatype, array.shape, array=array.copy())
        outputs.append((tensor, asked))
    queue_us, *compute_us = slot.timings_us.values()
    return Answer(outputs, queue_us, sum(compute_us), request.stream)
