"""The Open Inference Protocol (KServe v2) as Duomo speaks it: how its models look on the wire,
what a request may carry, and how answers and errors are written back. No I/O here: both
transports (``http_front``, ``grpc_front``) decode into these structures and encode from them.

**How Duomo's models look on the wire** (a contract):

- image tasks (a model whose result is JSON and whose one input is an image): input ``IMAGE``,
  ``UINT8`` ``[H, W, C]`` (C = 1, 3 or 4, RGB order) or ``BYTES`` ``[1]`` holding an encoded
  PNG or JPEG; output ``RESULT``, ``BYTES`` ``[1]``: the result dict of ``duomo infer --json``
  as UTF-8 JSON. Their model configuration says ``max_batch_size: 0`` and ``IMAGE`` dims
  ``[-1, -1, -1]``.
- ``raw`` models: their own input and output names, datatypes and shapes; a model whose first
  dimension is the batch has ``max_batch_size`` = its ``max_batch`` (and ``dynamic_batching``
  when that is above 1), and its metadata shapes carry that dimension as ``-1``.
- ``platform``: ``onnxruntime_onnx`` or ``ascend_om``; every model has one version, ``"1"``.

**Errors**, mapped once (``HTTP_STATUS``, ``GRPC_STATUS``): every ``ipc.errors`` code to one
HTTP status and one gRPC status, the body ``{"error": message}``.

**Every value a caller sends is checked before it is used** (INVALID_ARGUMENT naming the field,
never a 500 from deeper down): shapes (rank ≤ ``MAX_RANK``, each dimension 0..``MAX_DIM``, the
slot header's bounds), datatypes (a v2 datatype), ``binary_data_size`` and the shared-memory
parameters (integers ≥ 0, never booleans), ``binary_data`` / ``binary_data_output`` (booleans),
the request ``id`` (a string of at most ``MAX_ID_CHARS``), ``timeout`` (finite µs up to
``MAX_TIMEOUT_US``), ``priority`` (an integer 0..2⁶⁴−1, accepted and not used: every gateway
request runs at the default priority), the sequence parameters (refused when set: Duomo's
models keep no state between requests), a length header (at most ``MAX_LENGTH_DIGITS``
digits), JSON ``data`` (a list of values of the tensor's datatype, in range; BYTES: strings,
as many as the shape takes), and a stream's parameters (``stream``, ``frame``,
``captured_us``, ``stream_policy``: ``gateway.streams``).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duomo.gateway.streams import StreamRequest, stream_parameters
from duomo.ipc.errors import ErrorCode, InvalidArgumentError, NotFoundError, UnavailableError
from duomo.ipc.status_records import ModelInfo, ModelStatus, TimedCount
from duomo.ipc.wire import MAX_RANK, MAX_TIMEOUT_US  # (a day: longer is a mistake, not a deadline)

VERSION = "1"  # the one version every model has on the wire
SERVER_NAME = "duomo"
IMAGE_INPUT = "IMAGE"  # an image task's input on the wire (the slot's "image")
RESULT_OUTPUT = "RESULT"  # an image task's output: the result dict as JSON in a BYTES element
PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "acl": "ascend_om"}
SERVING_STATES = ("READY", "DEGRADED")

# numpy dtype name -> v2 datatype (BYTES has no numpy dtype here: it is handled by itself)
DATATYPES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
}
NUMPY_TYPES = {v: np.dtype(k) for k, v in DATATYPES.items()}
WIRE_DATATYPES = frozenset(NUMPY_TYPES) | {"BYTES"}
MAX_DIM = 0xFFFFFFFF  # a dimension in the slot header is 32 bits
MAX_ID_CHARS = 256
MAX_UINT64 = 2**64 - 1
MAX_LENGTH_DIGITS = 18  # a length header (int() refuses thousands of digits; 18 is an exabyte)
# the kinds of JSON values a numeric datatype takes (by numpy kind of the datatype)
_JSON_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}
_LENGTH = struct.Struct("<I")  # a BYTES element's length prefix

HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.MODEL_CHANGED: 503,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.INTERNAL: 500,
    ErrorCode.SUPERSEDED: 409,  # a newer frame of its stream took its place (policy latest)
}
# grpc.StatusCode names (the gRPC front looks them up; this module does not import grpc)
GRPC_STATUS = {
    ErrorCode.INVALID_ARGUMENT: "INVALID_ARGUMENT",
    ErrorCode.NOT_FOUND: "NOT_FOUND",
    ErrorCode.UNAVAILABLE: "UNAVAILABLE",
    ErrorCode.MODEL_CHANGED: "UNAVAILABLE",
    ErrorCode.RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
    ErrorCode.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
    ErrorCode.INTERNAL: "INTERNAL",
    ErrorCode.SUPERSEDED: "ABORTED",
}


@dataclass(frozen=True)
class TensorInfo:
    """One input or output as the wire shows it (``-1``: a dimension of any size)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    slot_name: str = ""  # the slot's input of this name (inputs only)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True)
class ModelView:
    """A served model as the gateway shows it, from the supervisor's ``models`` reply."""

    name: str
    task: str
    platform: str
    state: str
    max_batch_size: int  # the configuration's: 0 when the first dimension is not the batch
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    json_result: bool  # the answer is one JSON document (RESULT), else output tensors
    known: bool  # inputs and outputs known (the model has been loaded once)

    @property
    def ready(self) -> bool:
        return self.state in SERVING_STATES

    @property
    def image_task(self) -> bool:
        return self.json_result and [i.name for i in self.inputs] == [IMAGE_INPUT]

    def input(self, name: str) -> TensorInfo:
        for tensor in self.inputs:
            if tensor.name == name:
                return tensor
        raise InvalidArgumentError(
            f"model {self.name!r} has no input {name[:100]!r} "
            f"(inputs: {[i.name for i in self.inputs]})"
        )

    def require_known(self) -> None:
        if not self.known:
            raise UnavailableError(
                f"model {self.name!r} has not been loaded yet, so its inputs are not known: "
                f"load it first (POST /v2/repository/models/{self.name}/load)"
            )


IMAGE_TASKS = ("classification", "face_detection", "ocr")
# Triton's InferStatistics, each a count and nanoseconds (``worker.stats`` keeps the same kinds)
STAT_KINDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


def model_view(info: ModelInfo) -> ModelView:
    """The wire view of one entry of the supervisor's ``models`` reply. A backend not in
    ``PLATFORMS`` (or none: a model a reload removed) shows as ONNX Runtime's platform."""
    name, task, state = info.name, info.task, info.state
    platform = PLATFORMS.get(str(info.backend), "onnxruntime_onnx")
    slot_inputs = info.inputs
    if slot_inputs is None:  # never loaded: only the image tasks' contract is known
        image = task in IMAGE_TASKS
        return ModelView(
            name, task, platform, state, 0,
            (_image_input(),) if image else (), (_result_output(),) if image else (),
            json_result=image, known=image,
        )  # fmt: skip
    json_result = info.result == "json"
    batched = bool(info.batched) and not json_result
    inputs = []
    for slot_input in slot_inputs:
        slot_name, dtype = slot_input.name, slot_input.dtype
        if json_result and slot_name == "image" and dtype == "uint8":
            inputs.append(_image_input())
            continue
        inputs.append(TensorInfo(slot_name, DATATYPES[dtype], _dims(slot_input.shape), slot_name))
    if json_result:
        outputs: tuple[TensorInfo, ...] = (_result_output(),)
    else:
        outputs = tuple(
            TensorInfo(o.name, DATATYPES[o.dtype], _dims(o.shape))
            for o in info.output_tensors or ()
        )
    max_batch = info.max_batch if batched else 0
    return ModelView(
        name, task, platform, state, max_batch, tuple(inputs), outputs, json_result, known=True
    )


def _dims(shape: Iterable[int | None]) -> tuple[int, ...]:
    return tuple(-1 if d is None else int(d) for d in shape)


def _image_input() -> TensorInfo:
    return TensorInfo(IMAGE_INPUT, "UINT8", (-1, -1, -1), "image")


def _result_output() -> TensorInfo:
    return TensorInfo(RESULT_OUTPUT, "BYTES", (1,))


# -- metadata and configuration ----------------------------------------------------------------


def server_metadata(version: str, extensions: Sequence[str]) -> dict[str, Any]:
    return {"name": SERVER_NAME, "version": version, "extensions": list(extensions)}


def model_metadata(view: ModelView) -> dict[str, Any]:
    view.require_known()
    return {
        "name": view.name,
        "versions": [VERSION],
        "platform": view.platform,
        "inputs": [t.to_dict() for t in view.inputs],
        "outputs": [t.to_dict() for t in view.outputs],
    }


def model_config(view: ModelView) -> dict[str, Any]:
    """Enough of a Triton model configuration for ``perf_analyzer`` and ``tritonclient``: the
    batch dimension is left out of ``dims`` when ``max_batch_size`` > 0, as Triton does."""
    view.require_known()
    skip = 1 if view.max_batch_size > 0 else 0

    def tensor(t: TensorInfo) -> dict[str, Any]:
        datatype = "STRING" if t.datatype == "BYTES" else t.datatype
        return {"name": t.name, "data_type": f"TYPE_{datatype}", "dims": list(t.shape[skip:])}

    config: dict[str, Any] = {
        "name": view.name,
        "platform": view.platform,
        "backend": "duomo",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": view.max_batch_size,
        "input": [tensor(t) for t in view.inputs],
        "output": [tensor(t) for t in view.outputs],
        "instance_group": [{"name": view.name, "kind": "KIND_CPU", "count": 1}],
    }
    if view.max_batch_size > 1:
        config["dynamic_batching"] = {}
    return config


def model_statistics(view: ModelView, status: ModelStatus | None) -> dict[str, Any]:
    """Triton's statistics for one model from its status (None: the supervisor no longer
    lists it, as after a reload removed it: all zero)."""
    if status is None:
        zero = TimedCount(0, 0)
        timed = {kind: zero for kind in STAT_KINDS}
        last, inferences, executions, batch_sizes = 0, 0, 0, {}
    else:
        totals = status.totals
        timed = {kind: totals.timed[kind] for kind in STAT_KINDS}
        last, inferences = totals.last_inference_ms, totals.inference_count
        executions, batch_sizes = totals.execution_count, status.batch_sizes
    return {
        "name": view.name,
        "version": VERSION,
        "last_inference": last,
        "inference_count": inferences,
        "execution_count": executions,
        "inference_stats": {kind: t.to_dict() for kind, t in timed.items()},
        "batch_stats": [
            {"batch_size": int(size), "compute_infer": {"count": count, "ns": 0}}
            for size, count in batch_sizes.items()
        ],
    }


def check_version(model: str, version: str | None) -> None:
    if version not in (None, "", VERSION):
        raise NotFoundError(
            f"model {model!r} has no version {version[:20]!r} (its one version is {VERSION!r})"
        )


# -- requests -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RegionRef:
    """Where a tensor lies in a registered system shared-memory region."""

    region: str
    offset: int
    byte_size: int


@dataclass
class InputTensor:
    """One input of a request: its declared shape and datatype and where its data is."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Any = None  # a JSON list (flattened or nested), when the data came in the JSON
    raw: bytes | memoryview | None = None  # binary data, when it came as bytes
    region: RegionRef | None = None

    @property
    def nbytes(self) -> int | None:
        """What ``shape`` × ``datatype`` takes (None for BYTES)."""
        dtype = NUMPY_TYPES.get(self.datatype)
        return None if dtype is None else math.prod(self.shape) * dtype.itemsize


@dataclass
class OutputRequest:
    """An output a request names: in binary or JSON form, or written into a shared-memory region."""

    name: str
    binary: bool
    region: RegionRef | None = None


@dataclass
class InferRequest:
    """One inference request, parsed, whichever transport it came by: the model, its inputs, the
    outputs asked for (None: all), its id and timeout, and its stream (``gateway.streams``)."""

    model: str
    inputs: list[InputTensor]
    outputs: list[OutputRequest] | None  # None: every output, in the default form
    id: str | None = None
    binary_output: bool = False  # the default form of outputs not named
    timeout_s: float | None = None
    stream: StreamRequest | None = None  # None: a plain request


@dataclass
class OutputTensor:
    """One output of an answer: its bytes (raw, row-major) or the array they came from."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    array: np.ndarray | None = None  # numeric outputs
    elements: list[bytes] = field(default_factory=list)  # BYTES outputs
    region_bytes: int | None = None  # written into a region: its size (the data is not kept)

    @property
    def byte_size(self) -> int:
        return len(self.raw()) if self.region_bytes is None else self.region_bytes

    def raw(self) -> bytes:
        """The binary form: row-major bytes, or BYTES elements each after its 4-byte length."""
        if self.array is not None:
            return np.ascontiguousarray(self.array).tobytes()
        return b"".join(_LENGTH.pack(len(e)) + e for e in self.elements)

    def json_data(self) -> list[Any]:
        if self.array is not None:
            return list(self.array.reshape(-1).tolist())
        return [e.decode("utf-8", "replace") for e in self.elements]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_int(d) for d in value):
        raise InvalidArgumentError(f"{where}: 'shape' must be a list of integers")
    if len(value) > MAX_RANK or any(not 0 <= d <= MAX_DIM for d in value):
        raise InvalidArgumentError(
            f"{where}: 'shape' {value[: MAX_RANK + 1]} is not a valid tensor shape (at most "
            f"{MAX_RANK} dimensions, each 0..{MAX_DIM})"
        )
    return tuple(value)


def input_tensor(name: Any, datatype: Any, shape: Any, where: str) -> InputTensor:
    """An input's name, datatype and shape as a caller sent them, each checked."""
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise InvalidArgumentError(f"{where} needs a string 'name' and 'datatype'")
    if datatype not in WIRE_DATATYPES:
        raise InvalidArgumentError(
            f"{where}: 'datatype' {datatype[:20]!r} is not a v2 datatype "
            f"({', '.join(sorted(WIRE_DATATYPES))})"
        )
    return InputTensor(name, datatype, parse_shape(shape, where))


def count_of(parameters: dict[str, Any], key: str, where: str, default: int = 0) -> int:
    """An integer parameter ≥ 0 (not a boolean) that fits 64 bits."""
    value = parameters.get(key, default)
    if not _is_int(value) or not 0 <= value <= MAX_UINT64:
        raise InvalidArgumentError(f"{where}: {key!r} must be an integer in 0..{MAX_UINT64}")
    return int(value)


def flag_of(parameters: dict[str, Any], key: str, where: str, default: bool = False) -> bool:
    value = parameters.get(key, default)
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{where}: {key!r} must be true or false")
    return value


def region_of(parameters: dict[str, Any], where: str) -> RegionRef | None:
    region = parameters.get("shared_memory_region")
    if region is None:
        if "shared_memory_byte_size" in parameters or "shared_memory_offset" in parameters:
            raise InvalidArgumentError(f"{where}: shared-memory parameters without a region")
        return None
    if not isinstance(region, str) or not 1 <= len(region) <= 256:
        raise InvalidArgumentError(
            f"{where}: 'shared_memory_region' must be a string of 1..256 characters"
        )
    if "shared_memory_byte_size" not in parameters:
        raise InvalidArgumentError(
            f"{where}: 'shared_memory_region' needs a 'shared_memory_byte_size'"
        )
    byte_size = count_of(parameters, "shared_memory_byte_size", where)
    offset = count_of(parameters, "shared_memory_offset", where)
    return RegionRef(region, offset, byte_size)


def request_id(value: Any) -> str | None:
    """The request's ``id`` (None or empty: none)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > MAX_ID_CHARS:
        raise InvalidArgumentError(f"'id' must be a string of at most {MAX_ID_CHARS} characters")
    return value


def check_request_parameters(parameters: dict[str, Any]) -> None:
    """The request parameters Duomo does not use, checked all the same."""
    count_of(parameters, "priority", "parameters")  # (accepted; requests run at the default)
    sequence_id = parameters.get("sequence_id", 0)
    if isinstance(sequence_id, str):
        if len(sequence_id) > MAX_ID_CHARS:
            raise InvalidArgumentError(
                f"parameters: 'sequence_id' is over {MAX_ID_CHARS} characters"
            )
    else:
        count_of(parameters, "sequence_id", "parameters")
    started = flag_of(parameters, "sequence_start", "parameters")
    ended = flag_of(parameters, "sequence_end", "parameters")
    if sequence_id or started or ended:
        raise InvalidArgumentError(
            "parameters: 'sequence_id', 'sequence_start' and 'sequence_end' are not supported "
            "(Duomo's models keep no state between requests)"
        )


def length_header(value: bytes | None) -> int | None:
    """A length header's value, or None when absent or not a decimal of at most
    ``MAX_LENGTH_DIGITS`` digits."""
    if value is None or not value.isdigit() or len(value) > MAX_LENGTH_DIGITS:
        return None
    return int(value)


def parse_infer_json(model: str, header: Any, blob: memoryview) -> InferRequest:
    """An HTTP request's JSON header (and the binary data after it) as an ``InferRequest``."""
    if not isinstance(header, dict):
        raise InvalidArgumentError("the request body must be a JSON object")
    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidArgumentError("'inputs' must be a non-empty list")
    parameters = _parameters(header, "request")
    check_request_parameters(parameters)
    inputs: list[InputTensor] = []
    at = 0
    for n, item in enumerate(raw_inputs):
        where = f"inputs[{n}]"
        if not isinstance(item, dict):
            raise InvalidArgumentError(f"{where} must be an object")
        tensor = input_tensor(item.get("name"), item.get("datatype"), item.get("shape"), where)
        params = _parameters(item, where)
        tensor.region = region_of(params, where)
        if "binary_data_size" in params:
            if tensor.region is not None:
                raise InvalidArgumentError(
                    f"{where}: 'binary_data_size' and 'shared_memory_region' both given"
                )
            size = count_of(params, "binary_data_size", where)
            if at + size > len(blob):
                raise InvalidArgumentError(
                    f"{where}: binary_data_size {size} goes past the end of the body "
                    f"({len(blob) - at} bytes left)"
                )
            tensor.raw = blob[at : at + size]
            at += size
        elif tensor.region is None:
            if "data" not in item:
                raise InvalidArgumentError(f"{where} has no 'data' and no binary data")
            tensor.data = item["data"]
        inputs.append(tensor)
    if at != len(blob):
        raise InvalidArgumentError(
            f"the body has {len(blob) - at} bytes of binary data that no input claims"
        )
    binary_default = flag_of(parameters, "binary_data_output", "parameters")
    outputs: list[OutputRequest] | None = None
    raw_outputs = header.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise InvalidArgumentError("'outputs' must be a list")
        outputs = []
        for n, item in enumerate(raw_outputs):
            where = f"outputs[{n}]"
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise InvalidArgumentError(f"{where} needs a string 'name'")
            params = _parameters(item, where)
            binary = flag_of(params, "binary_data", where, binary_default)
            outputs.append(OutputRequest(item["name"], binary, output_region(params, where)))
    return InferRequest(
        model, inputs, outputs, id=request_id(header.get("id")),
        binary_output=binary_default, timeout_s=timeout_of(parameters),
        stream=stream_parameters(parameters),
    )  # fmt: skip


def output_region(parameters: dict[str, Any], where: str) -> RegionRef | None:
    """An asked output's region (Triton's ``classification`` is not offered: refused)."""
    if "classification" in parameters:
        raise InvalidArgumentError(f"{where}: 'classification' is not supported")
    return region_of(parameters, where)


def _parameters(item: dict[str, Any], where: str) -> dict[str, Any]:
    parameters = item.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidArgumentError(f"{where}: 'parameters' must be an object")
    return parameters


def timeout_of(parameters: dict[str, Any]) -> float | None:
    """Triton's request ``timeout`` parameter, in microseconds."""
    timeout = parameters.get("timeout")
    if timeout is None:
        return None
    if (
        not isinstance(timeout, int | float)
        or isinstance(timeout, bool)
        or not 0 <= timeout <= MAX_TIMEOUT_US  # (NaN fails it too)
    ):
        raise InvalidArgumentError(
            f"parameters: 'timeout' must be a number of microseconds in 0..{MAX_TIMEOUT_US}"
        )
    return float(timeout) / 1e6 or None


def input_array(tensor: InputTensor, dtype: np.dtype) -> np.ndarray:
    """A numeric input as an array of its declared shape (a view of binary data, no copy)."""
    expected = math.prod(tensor.shape) * dtype.itemsize
    if tensor.raw is not None:
        if len(tensor.raw) != expected:
            raise InvalidArgumentError(
                f"input {tensor.name!r}: {len(tensor.raw)} bytes of data, but shape "
                f"{list(tensor.shape)} of {tensor.datatype} takes {expected}"
            )
        return np.frombuffer(tensor.raw, dtype=dtype).reshape(tensor.shape)
    array = _json_array(tensor, dtype)
    if array.size != math.prod(tensor.shape):
        raise InvalidArgumentError(
            f"input {tensor.name!r}: {array.size} values in 'data', but shape "
            f"{list(tensor.shape)} takes {math.prod(tensor.shape)}"
        )
    return array.reshape(tensor.shape)


def _json_array(tensor: InputTensor, dtype: np.dtype) -> np.ndarray:
    """JSON ``data`` (a list, maybe nested) as an array of ``dtype``: each value of a kind the
    datatype takes (no strings, nulls or objects; no floats for integers, no numbers for
    BOOL) and within its range."""
    bad = InvalidArgumentError(
        f"input {tensor.name[:100]!r}: 'data' must be a list of {tensor.datatype} values"
    )
    if not isinstance(tensor.data, list):
        raise bad
    try:
        found = np.asarray(tensor.data)
    except (TypeError, ValueError, OverflowError, RecursionError):
        raise bad from None
    if found.size == 0:
        return found.astype(dtype)
    if found.dtype.kind not in _JSON_KINDS[dtype.kind]:
        raise bad
    if dtype.kind in "iu":
        limits = np.iinfo(dtype)
        if found.min() < limits.min or found.max() > limits.max:
            raise InvalidArgumentError(
                f"input {tensor.name[:100]!r}: a value in 'data' is outside {tensor.datatype}'s "
                f"range {limits.min}..{limits.max}"
            )
    array = found.astype(dtype)
    if dtype.kind == "f" and not np.isfinite(array).all():
        raise InvalidArgumentError(
            f"input {tensor.name[:100]!r}: a value in 'data' is outside {tensor.datatype}'s range"
        )
    return array


def bytes_elements(tensor: InputTensor) -> list[bytes]:
    """A BYTES input's elements, as many as its shape takes (JSON: strings, maybe in nested
    lists; gRPC contents: bytes; binary: each after a 4-byte little-endian length)."""
    if tensor.raw is None:
        elements = _json_elements(tensor)
    else:
        elements = _binary_elements(tensor.name, tensor.raw)
    if len(elements) != math.prod(tensor.shape):
        raise InvalidArgumentError(
            f"input {tensor.name[:100]!r}: {len(elements)} BYTES elements, but shape "
            f"{list(tensor.shape)} takes {math.prod(tensor.shape)}"
        )
    return elements


def _json_elements(tensor: InputTensor) -> list[bytes]:
    if not isinstance(tensor.data, list):
        raise InvalidArgumentError(
            f"input {tensor.name[:100]!r}: 'data' of a BYTES input must be a list of strings"
        )
    elements: list[bytes] = []
    _flatten_strings(tensor.name, tensor.data, 1, elements)
    return elements


def _flatten_strings(name: str, items: list[Any], depth: int, into: list[bytes]) -> None:
    for item in items:
        if isinstance(item, str):
            into.append(item.encode())
        elif isinstance(item, bytes):  # (gRPC's bytes_contents)
            into.append(item)
        elif isinstance(item, list) and depth < MAX_RANK:
            _flatten_strings(name, item, depth + 1, into)
        else:
            kind = "lists nested too deep" if isinstance(item, list) else type(item).__name__
            raise InvalidArgumentError(
                f"input {name[:100]!r}: 'data' of a BYTES input holds {kind}; each element "
                "must be a string"
            )


def _binary_elements(name: str, raw: bytes | memoryview) -> list[bytes]:
    elements: list[bytes] = []
    view, at = memoryview(raw), 0
    while at < len(view):
        if at + 4 > len(view):
            raise InvalidArgumentError(f"input {name[:100]!r}: a BYTES element is cut short")
        (size,) = _LENGTH.unpack_from(view, at)
        if at + 4 + size > len(view):
            raise InvalidArgumentError(f"input {name[:100]!r}: a BYTES element is cut short")
        elements.append(bytes(view[at + 4 : at + 4 + size]))
        at += 4 + size
    return elements


def output_selection(
    view: ModelView, request: InferRequest
) -> list[tuple[TensorInfo, OutputRequest]]:
    """The outputs to answer, in the order asked (every output when none is named)."""
    if request.outputs is None:
        return [(t, OutputRequest(t.name, request.binary_output)) for t in view.outputs]
    by_name = {t.name: t for t in view.outputs}
    chosen = []
    for asked in request.outputs:
        tensor = by_name.get(asked.name)
        if tensor is None:
            raise InvalidArgumentError(
                f"model {view.name!r} has no output {asked.name[:100]!r} (outputs: {list(by_name)})"
            )
        chosen.append((tensor, asked))
    return chosen


def check_datatype(tensor: InputTensor, expected: str) -> None:
    if tensor.datatype != expected:
        raise InvalidArgumentError(
            f"input {tensor.name!r} must be {expected}, got {tensor.datatype[:20]!r}"
        )


def error_body(message: str) -> dict[str, str]:
    return {"error": message}
