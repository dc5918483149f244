"""A strict fake of the pyACL contract, for tests only: ``FakeAcl()`` stands in for ``import acl``.

It follows the binding's conventions (int handles, payload first and ``ret`` last, status-only
calls return an int) and checks every call's argument count against the binding's format strings
in ``tests/fixtures/pyacl_contract.json``. "Device memory" is real byte regions in a separate
address space, so copies really move data: host→device reads the host address it is given, and
device→host writes to it. A model is a JSON descriptor standing in for an ``.om``::

    {"soc_version": "Ascend310P3",
     "inputs":  [{"name": "x", "dtype": "float32", "format": "NCHW", "dims": [-1, 4]}],
     "outputs": [{"name": "y", "dtype": "float32", "format": "ND", "dims": [-1, 4]}],
     "dynamic_batch": [1, 2, 4],          # gears; adds the ascend_mbatch_shape_data input
     "function": "affine",                # what "execute" computes (FUNCTIONS below)
     "work_bytes": 65536, "weight_bytes": 1048576}  # what query_size says (these defaults)

or, for a dynamic image size (``atc --dynamic_image_size``), ``"dynamic_hw": [[h, w], ...]`` with
-1 at H and W (never together with ``dynamic_batch``, which ATC refuses too).

It models several devices (``FakeAcl(devices=2)``): each has its own memory (``used``, what
``get_mem_info`` reports to a context there), every context is bound to one device, and device
memory of one device used from a context on another (copy, free, a dataset's buffer in an
execute) is an error (200002), as it is on a card with two chips.

It enforces the rules that break on hardware: a second ``init`` (100002); a call on a thread with
no current context (107002); a stream or model used from another context (107003 / 107004); the
same model on two streams at once; a dynamic model executed without a gear set, or with a batch
or an H×W that is not a gear (or set through the other kind's call); ``get_dynamic_hw`` with an
index other than -1; a dataset whose buffer count or sizes do not match the model (100017);
releases out of the documented order; and it counts leaks (``leaks()``). ``fail_next_executes``
makes the next N executes fail with 507011; ``rebind_default_context`` makes every synchronise
leave the thread in the device's default context, as ORT-CANN's per-run ``set_device`` does.

Memory a model runs in (``mdl.load_from_file_with_mem``, the documented rules): a work or weight
pointer of 0 means the runtime manages that part itself (as ``load_from_file`` does for both);
otherwise the buffer must be allocated, on the current context's device (200002), at least as
large as ``query_size`` says (100000), and neither freed while a loaded model uses it — the
fake refuses that ``rt.free`` (100000), where a card would free memory a model still reads.
Weight memory is read-only during inference, so models loaded from the same file may share
one weight buffer; one that holds another file's weights, or overlaps a model's work buffer,
is refused. Models may share a work buffer only if they never run at once: an
``execute_async`` while another model's run on another stream, over the same work buffer, has
not been synchronised is an error (100000). A card would not say so (the runs would corrupt
each other's intermediates); the fake does, so a test catches it. Each load writes the file's
digest at the start of its weight buffer, and an execute whose weights no longer start with it
fails (507011): a shared weight buffer overwritten by anything else is caught on the next run.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CONTRACT = json.loads(
    (Path(__file__).resolve().parent.parent / "fixtures" / "pyacl_contract.json").read_text()
)
ERRORS = CONTRACT["errors"]
OK = 0
REPEAT_INITIALIZE = ERRORS["ACL_ERROR_REPEAT_INITIALIZE"]
UNINITIALIZE = ERRORS["ACL_ERROR_UNINITIALIZE"]
REPEAT_FINALIZE = ERRORS["ACL_ERROR_REPEAT_FINALIZE"]
INVALID_PARAM = ERRORS["ACL_ERROR_INVALID_PARAM"]
INVALID_FILE = ERRORS["ACL_ERROR_INVALID_FILE"]
INVALID_MODEL_ID = ERRORS["ACL_ERROR_INVALID_MODEL_ID"]
INPUT_NOT_MATCH = ERRORS["ACL_ERROR_MODEL_INPUT_NOT_MATCH"]
CONTEXT_NULL = ERRORS["ACL_ERROR_RT_CONTEXT_NULL"]
STREAM_CONTEXT = ERRORS["ACL_ERROR_RT_STREAM_CONTEXT"]
MODEL_CONTEXT = ERRORS["ACL_ERROR_RT_MODEL_CONTEXT"]
MODEL_EXECUTE = ERRORS["ACL_ERROR_RT_MODEL_EXECUTE"]
WRONG_DEVICE = ERRORS["ACL_ERROR_INVALID_DEVICE"]
DTYPE_CODES = {
    np.dtype(name): CONTRACT["enums"]["aclDataType"][f"ACL_{acl}"]
    for name, acl in (
        ("float32", "FLOAT"),
        ("float16", "FLOAT16"),
        ("int8", "INT8"),
        ("int32", "INT32"),
        ("uint8", "UINT8"),
        ("int64", "INT64"),
    )
}
FORMAT_CODES = {
    name: CONTRACT["enums"]["aclFormat"][f"ACL_FORMAT_{name}"] for name in ("NCHW", "NHWC", "ND")
}
DYNAMIC_NAME = CONTRACT["strings"]["ACL_DYNAMIC_TENSOR_NAME"]
H2D = CONTRACT["enums"]["aclrtMemcpyKind"]["ACL_MEMCPY_HOST_TO_DEVICE"]
D2H = CONTRACT["enums"]["aclrtMemcpyKind"]["ACL_MEMCPY_DEVICE_TO_HOST"]
DEVICE_BYTES = 8 << 30  # each device's
DEVICE_BASE = 0x7F00_0000_0000  # fake device addresses: never valid host memory
WEIGHT_BYTES = 1 << 20  # a fake model's weights (query_size), unless it says "weight_bytes"
WORK_BYTES = 64 << 10  # its work memory, unless it says "work_bytes"

FUNCTIONS: dict[str, Callable[[list[np.ndarray]], list[np.ndarray]]] = {
    "identity": lambda xs: [x.copy() for x in xs],
    "affine": lambda xs: [xs[0] * 2 + 1],  # y = 2x + 1
    # y = 2x + 1 and s = the sum of each row of x
    "affine_and_sum": lambda xs: [xs[0] * 2 + 1, xs[0].reshape(len(xs[0]), -1).sum(axis=1)],
}


def _arity(fmt: str) -> tuple[int, int]:
    """(required, most) positional arguments of a PyArg_ParseTuple format."""
    required, _, optional = fmt.partition("|")
    count = sum(1 for c in required if c.isalpha())
    return count, count + sum(1 for c in optional if c.isalpha())


def _contract(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Check the call's argument count against the binding's format for ``name``."""
    fmt = CONTRACT["functions"][name]["format"]  # KeyError: not a pyACL function
    low, high = _arity(fmt)

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any) -> Any:
            if fmt and not low <= len(args) <= high:
                raise TypeError(f"acl.{name} takes {low}..{high} arguments ({fmt!r}), got {args}")
            self.fake.calls.append(name)
            self.fake.trace.append((name, args))
            return fn(self, *args)

        call.__name__ = fn.__name__
        return call

    return wrap


@dataclass
class Tensor:
    name: str
    dtype: np.dtype
    format: str
    dims: list[int]

    def shape(self, gear: tuple[int, ...]) -> list[int]:
        """Dims with the gear's values in place of the -1s, in order (batch: (n,); HW: (h, w))."""
        values = iter(gear)
        return [next(values, 1) if d < 0 else d for d in self.dims]

    def size(self, gear: tuple[int, ...]) -> int:
        return math.prod(self.shape(gear)) * self.dtype.itemsize


@dataclass
class Model:
    path: str
    context: int
    inputs: list[Tensor]  # the dynamic input last, as ATC adds it
    outputs: list[Tensor]
    gears: list[tuple[int, ...]]  # (batch,) gears, or (h, w) gears
    function: str
    hw: bool = False  # dynamic image size (ATC --dynamic_image_size) rather than batch
    running_on: int = 0  # the stream it executes on until that stream is synchronised
    last_gear: tuple[int, ...] = ()  # the gear of its last execute, for get_cur_output_dims
    descs: set[int] = field(default_factory=set)
    digest: bytes = b""  # of the file: what its weight buffer starts with
    work: tuple[int, int] = (0, 0)  # (pointer, bytes) of user-managed work memory; 0: runtime's
    weights: tuple[int, int] = (0, 0)  # the same for its weights
    system_bytes: int = 0  # device memory the runtime manages for it (a part passed as 0)


@dataclass
class Dataset:
    buffers: list[int] = field(default_factory=list)
    gear: tuple[int, ...] = ()  # set by set_dynamic_batch_size / set_dynamic_hw_size


class FakeAcl:
    """The ``acl`` module: top-level calls here, ``rt`` and ``mdl`` namespaces below."""

    def __init__(self, soc_name: str = "Ascend310P3", devices: int = 1) -> None:
        self.fake = self
        self.soc_name = soc_name
        self.device_count = devices
        self.lock = threading.RLock()
        self.calls: list[str] = []
        self.trace: list[tuple[str, tuple[Any, ...]]] = []  # every call with its arguments
        self.initialized = False
        self.finalized = False
        self.devices: set[int] = set()
        self.contexts: dict[int, int] = {}  # context -> device
        self.context_devices: dict[int, int] = {}  # every context ever made -> its device
        self.default_contexts: dict[int, int] = {}  # device -> its default context
        self.streams: dict[int, int] = {}  # stream -> context
        self.memory: dict[int, bytearray] = {}  # device pointer -> region
        self.memory_device: dict[int, int] = {}  # device pointer -> the device it is on
        self.models: dict[int, Model] = {}
        self.descs: dict[int, int] = {}  # desc -> model id (0 before get_desc)
        self.datasets: dict[int, Dataset] = {}
        self.buffers: dict[int, tuple[int, int]] = {}  # data buffer -> (pointer, size)
        self.used: dict[int, int] = {}  # device -> bytes in use there
        self.fail_next_executes = 0
        self.rebind_default_context = False
        self.last_error = ""
        self._current = threading.local()
        self._handles = itertools.count(0x1000)
        self._next_pointer = DEVICE_BASE
        self.rt = _Rt(self)
        self.mdl = _Mdl(self)

    # -- bookkeeping ------------------------------------------------------------------------
    def error(self, code: int, message: str) -> int:
        self.last_error = message
        return code

    def handle(self) -> int:
        return next(self._handles)

    @property
    def current_context(self) -> int:
        return int(getattr(self._current, "context", 0))

    def set_current(self, context: int) -> None:
        self._current.context = context

    @property
    def current_device(self) -> int:
        """The device of this thread's current context (-1: none)."""
        return self.contexts.get(self.current_context, -1)

    def on_current_device(self, pointer: int, call: str) -> int:
        """0 when device memory at ``pointer`` is on the current context's device: a pointer of
        another device used from this context is an error, as on a multi-device card."""
        base = next((b for b, r in self.memory.items() if b <= pointer < b + len(r)), None)
        device = self.memory_device.get(base, -1) if base is not None else -1
        if device != self.current_device:
            return self.error(
                WRONG_DEVICE, f"{call}: memory of device {device} used from a context on "
                f"device {self.current_device}"
            )  # fmt: skip
        return OK

    def needs_context(self) -> int:
        """0 when this thread has a current context, else the runtime's error."""
        if not self.current_context:
            self.error(CONTEXT_NULL, "no current context on this thread (set_context first)")
            return CONTEXT_NULL
        return OK

    def region(self, pointer: int, count: int) -> tuple[bytearray, int] | None:
        """The device region holding ``count`` bytes at ``pointer``, and the offset in it."""
        for base, region in self.memory.items():
            if base <= pointer and pointer + count <= base + len(region):
                return region, pointer - base
        return None

    def users(self, pointer: int, size: int = 1) -> list[tuple[int, str]]:
        """The loaded models whose work or weight memory overlaps ``size`` bytes at ``pointer``,
        with which of the two it is: ``(model id, "work" | "weights")``."""
        found = []
        for model_id, model in self.models.items():
            for part, (base, nbytes) in (("work", model.work), ("weights", model.weights)):
                if base and base < pointer + size and pointer < base + nbytes:
                    found.append((model_id, part))
        return found

    def leaks(self) -> dict[str, int]:
        """Everything created and not released (all zero after a clean shutdown)."""
        found = {
            "contexts": len([c for c in self.contexts if c not in self.default_contexts.values()]),
            "streams": len(self.streams),
            "device_buffers": len(self.memory),
            "models": len(self.models),
            "descs": len(self.descs),
            "datasets": len(self.datasets),
            "data_buffers": len(self.buffers),
            "devices": len(self.devices),
            "initialised": int(self.initialized),
        }
        return {k: v for k, v in found.items() if v}

    # -- top-level acl.* --------------------------------------------------------------------
    @_contract("init")
    def init(self, config_path: str = "") -> int:
        with self.lock:
            if self.initialized:
                return self.error(REPEAT_INITIALIZE, "acl is already initialised")
            self.initialized, self.finalized = True, False
            return OK

    @_contract("finalize")
    def finalize(self) -> int:
        with self.lock:
            if not self.initialized:
                return self.error(REPEAT_FINALIZE, "acl is not initialised")
            alive = {k: v for k, v in self.leaks().items() if k != "initialised"}
            if alive:
                return self.error(INVALID_PARAM, f"finalize with resources alive: {alive}")
            self.initialized, self.finalized = False, True
            return OK

    @_contract("get_soc_name")
    def get_soc_name(self) -> str:
        return self.soc_name

    @_contract("get_recent_err_msg")
    def get_recent_err_msg(self) -> str:
        return self.last_error

    @_contract("get_version")
    def get_version(self) -> tuple[int, int, int, int]:
        return 8, 0, 0, OK

    @_contract("create_data_buffer")
    def create_data_buffer(self, pointer: int, size: int) -> int:
        with self.lock:
            buffer = self.handle()
            self.buffers[buffer] = (pointer, size)
            return buffer

    @_contract("destroy_data_buffer")
    def destroy_data_buffer(self, buffer: int) -> int:
        with self.lock:
            if buffer not in self.buffers:
                return self.error(INVALID_PARAM, f"no data buffer {buffer}")
            del self.buffers[buffer]
            return OK


class _Namespace:
    def __init__(self, fake: FakeAcl) -> None:
        self.fake = fake


class _Rt(_Namespace):
    """``acl.rt``."""

    @_contract("rt.set_device")
    def set_device(self, device: int) -> int:
        f = self.fake
        with f.lock:
            if not f.initialized:
                return f.error(UNINITIALIZE, "set_device before init")
            if not 0 <= device < f.device_count:
                return f.error(ERRORS["ACL_ERROR_RT_INVALID_DEVICEID"], f"no device {device}")
            f.devices.add(device)
            if device not in f.default_contexts:
                context = f.handle()
                f.default_contexts[device] = context
                f.contexts[context] = device
            f.set_current(f.default_contexts[device])  # the device's default context
            return OK

    @_contract("rt.reset_device")
    def reset_device(self, device: int) -> int:
        f = self.fake
        with f.lock:
            if device not in f.devices:
                return f.error(INVALID_PARAM, f"device {device} was not set")
            default = f.default_contexts.get(device)
            mine = [c for c, d in f.contexts.items() if d == device and c != default]
            if mine or any(f.contexts.get(c) == device for c in f.streams.values()):
                return f.error(INVALID_PARAM, "reset_device before its contexts were destroyed")
            f.devices.discard(device)
            f.contexts.pop(default, None)
            f.default_contexts.pop(device, None)
            return OK

    @_contract("rt.get_device_count")
    def get_device_count(self) -> tuple[int, int]:
        return self.fake.device_count, OK

    @_contract("rt.create_context")
    def create_context(self, device: int) -> tuple[int, int]:
        f = self.fake
        with f.lock:
            if device not in f.devices:
                return 0, f.error(INVALID_PARAM, f"create_context on device {device} not set")
            context = f.handle()
            f.contexts[context] = f.context_devices[context] = device
            f.set_current(context)  # bound to the calling thread
            return context, OK

    @_contract("rt.set_context")
    def set_context(self, context: int) -> int:
        f = self.fake
        with f.lock:
            if context not in f.contexts:
                return f.error(INVALID_PARAM, f"no context {context}")
            f.set_current(context)
            return OK

    @_contract("rt.destroy_context")
    def destroy_context(self, context: int) -> int:
        f = self.fake
        with f.lock:
            if context not in f.contexts or context in f.default_contexts.values():
                return f.error(INVALID_PARAM, f"no context {context} to destroy")
            if context in f.streams.values() or any(
                m.context == context for m in f.models.values()
            ):
                return f.error(INVALID_PARAM, "destroy_context with streams or models alive")
            del f.contexts[context]
            if f.current_context == context:
                f.set_current(0)
            return OK

    @_contract("rt.create_stream")
    def create_stream(self) -> tuple[int, int]:
        f = self.fake
        with f.lock:
            if (ret := f.needs_context()) != OK:
                return 0, ret
            stream = f.handle()
            f.streams[stream] = f.current_context
            return stream, OK

    @_contract("rt.destroy_stream")
    def destroy_stream(self, stream: int) -> int:
        f = self.fake
        with f.lock:
            if stream not in f.streams:
                return f.error(INVALID_PARAM, f"no stream {stream}")
            if f.streams[stream] != f.current_context:
                return f.error(STREAM_CONTEXT, "stream destroyed from another context")
            if any(m.running_on == stream for m in f.models.values()):
                return f.error(INVALID_PARAM, "destroy_stream with work queued")
            del f.streams[stream]
            return OK

    @_contract("rt.synchronize_stream")
    def synchronize_stream(self, stream: int) -> int:
        f = self.fake
        with f.lock:
            if (ret := f.needs_context()) != OK:
                return ret
            if stream not in f.streams:
                return f.error(INVALID_PARAM, f"no stream {stream}")
            if f.streams[stream] != f.current_context:
                return f.error(STREAM_CONTEXT, "stream synchronised from another context")
            for model in f.models.values():
                if model.running_on == stream:
                    model.running_on = 0
            if f.rebind_default_context:  # what ORT-CANN's per-run set_device does to a thread
                f.set_current(f.default_contexts[f.contexts[f.streams[stream]]])
            return OK

    @_contract("rt.malloc")
    def malloc(self, size: int, policy: int) -> tuple[int, int]:
        f = self.fake
        with f.lock:
            if (ret := f.needs_context()) != OK:
                return 0, ret
            if size <= 0 or policy not in CONTRACT["enums"]["aclrtMemMallocPolicy"].values():
                return 0, f.error(INVALID_PARAM, f"malloc({size}, {policy})")
            device = f.current_device
            if f.used.get(device, 0) + size > DEVICE_BYTES:
                return 0, f.error(ERRORS["ACL_ERROR_RT_MEMORY_ALLOCATION"], "out of memory")
            pointer = f._next_pointer
            f._next_pointer += (size + 63) // 64 * 64 + 64
            f.memory[pointer] = bytearray(size)
            f.memory_device[pointer] = device
            f.used[device] = f.used.get(device, 0) + size
            return pointer, OK

    @_contract("rt.free")
    def free(self, pointer: int) -> int:
        f = self.fake
        with f.lock:
            if pointer not in f.memory:
                return f.error(INVALID_PARAM, f"free of {pointer:#x}, not a device buffer")
            if any(p == pointer for p, _ in f.buffers.values()):
                return f.error(INVALID_PARAM, "free of a buffer a data buffer still describes")
            if users := f.users(pointer, len(f.memory[pointer])):
                return f.error(INVALID_PARAM, f"free of memory loaded models still use: {users}")
            if (ret := f.on_current_device(pointer, "free")) != OK:
                return ret
            f.used[f.memory_device.pop(pointer)] -= len(f.memory.pop(pointer))
            return OK

    @_contract("rt.memcpy")
    def memcpy(self, dst: int, dst_max: int, src: int, count: int, kind: int) -> int:
        f = self.fake
        with f.lock:
            if (ret := f.needs_context()) != OK:
                return ret
            if count > dst_max:
                return f.error(INVALID_PARAM, f"memcpy of {count} B into {dst_max} B")
            if kind == H2D:
                target = f.region(dst, dst_max)
                if target is None or f.region(src, 1) is not None:
                    return f.error(INVALID_PARAM, "host-to-device needs a device dst, host src")
                if (ret := f.on_current_device(dst, "memcpy")) != OK:
                    return ret
                region, offset = target
                region[offset : offset + count] = ctypes.string_at(src, count)
                return OK
            if kind == D2H:
                source = f.region(src, count)
                if source is None or f.region(dst, 1) is not None:
                    return f.error(INVALID_PARAM, "device-to-host needs a device src, host dst")
                if (ret := f.on_current_device(src, "memcpy")) != OK:
                    return ret
                region, offset = source
                ctypes.memmove(dst, bytes(region[offset : offset + count]), count)
                return OK
            return f.error(INVALID_PARAM, f"memcpy kind {kind} is not used by this backend")

    @_contract("rt.get_mem_info")
    def get_mem_info(self, attr: int) -> tuple[int, int, int]:
        f = self.fake
        with f.lock:
            if (ret := f.needs_context()) != OK:
                return 0, 0, ret
            return DEVICE_BYTES - f.used.get(f.current_device, 0), DEVICE_BYTES, OK


class _Mdl(_Namespace):
    """``acl.mdl``."""

    @_contract("mdl.query_size")
    def query_size(self, path: str) -> tuple[int, int, int]:
        try:
            data = self._read(path)
        except (OSError, ValueError, KeyError) as err:
            return 0, 0, self.fake.error(INVALID_FILE, str(err))
        return (*_sizes(data), OK)

    def _read(self, path: str) -> dict[str, Any]:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or "inputs" not in data or "outputs" not in data:
            raise ValueError(f"{path} is not a model")
        return data

    @_contract("mdl.load_from_file")
    def load_from_file(self, path: str) -> tuple[int, int]:
        return self._load(path, (0, 0), (0, 0))

    @_contract("mdl.load_from_file_with_mem")
    def load_from_file_with_mem(
        self, path: str, work_ptr: int, work_size: int, weight_ptr: int, weight_size: int
    ) -> tuple[int, int]:
        return self._load(path, (work_ptr, work_size), (weight_ptr, weight_size))

    def _user_memory(self, part: str, given: tuple[int, int], needed: int, digest: bytes) -> int:
        """0 when the caller's ``part`` memory (pointer, bytes) may hold what the model needs."""
        f = self.fake
        pointer, size = given
        if size < needed:
            return f.error(INVALID_PARAM, f"{part} memory of {size} B, query_size says {needed}")
        if f.region(pointer, size) is None:
            return f.error(INVALID_PARAM, f"{part} memory at {pointer:#x} is not allocated")
        if (ret := f.on_current_device(pointer, f"load_from_file_with_mem {part}")) != OK:
            return ret
        for model_id, use in f.users(pointer, size):
            other = f.models[model_id]
            if use != part:  # work memory over weights, or weights over work
                return f.error(INVALID_PARAM, f"{part} memory overlaps model {model_id}'s {use}")
            if part == "weights" and (other.weights != given or other.digest != digest):
                return f.error(
                    INVALID_PARAM, f"weight memory holds model {model_id}'s weights, of "
                    f"another file or at another place ({other.path})"
                )  # fmt: skip
        return OK

    def _load(self, path: str, work: tuple[int, int], weights: tuple[int, int]) -> tuple[int, int]:
        f = self.fake
        with f.lock:
            if (ret := f.needs_context()) != OK:
                return 0, ret
            try:
                raw = Path(path).read_bytes()
                data = self._read(path)
            except (OSError, ValueError) as err:
                return 0, f.error(INVALID_FILE, str(err))
            if data.get("soc_version", f.soc_name) != f.soc_name:
                return 0, f.error(INVALID_FILE, f"model built for {data['soc_version']}")
            digest = hashlib.sha256(raw).digest()
            system = 0
            for part, given, needed in zip(("work", "weights"), (work, weights), _sizes(data)):
                if not given[0]:
                    system += needed  # a null pointer: the runtime manages this part
                elif (ret := self._user_memory(part, given, needed, digest)) != OK:
                    return 0, ret

            def tensors(items: list[dict[str, Any]]) -> list[Tensor]:
                return [
                    Tensor(t["name"], np.dtype(t["dtype"]), t.get("format", "ND"), list(t["dims"]))
                    for t in items
                ]

            batches, sizes = data.get("dynamic_batch", []), data.get("dynamic_hw", [])
            if batches and sizes:  # ATC refuses both in one model
                return 0, f.error(INVALID_FILE, "dynamic batch and dynamic HW in one model")
            gears = [(b,) for b in sorted(batches)] or [tuple(hw) for hw in sizes]
            inputs = tensors(data["inputs"])
            if gears:
                inputs.append(Tensor(DYNAMIC_NAME, np.dtype("int64"), "ND", [len(inputs) + 1]))
            model_id = f.handle()
            f.models[model_id] = Model(
                path, f.current_context, inputs, tensors(data["outputs"]), gears,
                data.get("function", "identity"), hw=bool(sizes), digest=digest,
                work=work if work[0] else (0, 0), weights=weights if weights[0] else (0, 0),
                system_bytes=system,
            )  # fmt: skip
            if weights[0]:  # the runtime copies the file's weights in
                region, offset = f.region(*weights)  # type: ignore[misc]
                stamp = digest[: weights[1]]
                region[offset : offset + len(stamp)] = stamp
            device = f.current_device
            f.used[device] = f.used.get(device, 0) + system
            return model_id, OK

    @_contract("mdl.unload")
    def unload(self, model_id: int) -> int:
        f = self.fake
        with f.lock:
            model = f.models.get(model_id)
            if model is None:
                return f.error(INVALID_MODEL_ID, f"no model {model_id}")
            if model.context != f.current_context:
                return f.error(MODEL_CONTEXT, "unload from another context than the load")
            if model.running_on:
                return f.error(INVALID_PARAM, "unload while executing")
            del f.models[model_id]
            f.used[f.contexts[model.context]] -= model.system_bytes
            return OK

    @_contract("mdl.create_desc")
    def create_desc(self) -> int:
        with self.fake.lock:
            desc = self.fake.handle()
            self.fake.descs[desc] = 0
            return desc

    @_contract("mdl.get_desc")
    def get_desc(self, desc: int, model_id: int) -> int:
        f = self.fake
        with f.lock:
            if desc not in f.descs or model_id not in f.models:
                return f.error(INVALID_PARAM, "get_desc of unknown desc or model")
            f.descs[desc] = model_id
            return OK

    @_contract("mdl.destroy_desc")
    def destroy_desc(self, desc: int) -> int:
        f = self.fake
        with f.lock:
            if desc not in f.descs:
                return f.error(INVALID_PARAM, f"no desc {desc}")
            if f.descs[desc] in f.models:
                return f.error(INVALID_PARAM, "destroy_desc before unloading its model")
            del f.descs[desc]
            return OK

    def _model(self, desc: int) -> Model:
        return self.fake.models[self.fake.descs[desc]]

    @_contract("mdl.get_num_inputs")
    def get_num_inputs(self, desc: int) -> int:
        return len(self._model(desc).inputs)

    @_contract("mdl.get_num_outputs")
    def get_num_outputs(self, desc: int) -> int:
        return len(self._model(desc).outputs)

    def _max(self, desc: int) -> tuple[int, ...]:
        """The gear buffers are sized for: the largest batch, or the largest H×W."""
        return max(self._model(desc).gears, key=math.prod, default=())

    @_contract("mdl.get_input_size_by_index")
    def get_input_size_by_index(self, desc: int, index: int) -> int:
        return self._model(desc).inputs[index].size(self._max(desc))

    @_contract("mdl.get_output_size_by_index")
    def get_output_size_by_index(self, desc: int, index: int) -> int:
        return self._model(desc).outputs[index].size(self._max(desc))

    @staticmethod
    def _dims(t: Tensor) -> tuple[dict[str, Any], int]:
        return {"name": t.name, "dimCount": len(t.dims), "dims": list(t.dims)}, OK

    @_contract("mdl.get_input_dims")
    def get_input_dims(self, desc: int, index: int) -> tuple[dict[str, Any], int]:
        return self._dims(self._model(desc).inputs[index])

    @_contract("mdl.get_output_dims")
    def get_output_dims(self, desc: int, index: int) -> tuple[dict[str, Any], int]:
        return self._dims(self._model(desc).outputs[index])

    @_contract("mdl.get_cur_output_dims")
    def get_cur_output_dims(self, desc: int, index: int) -> tuple[dict[str, Any], int]:
        model = self._model(desc)
        t = model.outputs[index]
        dims = t.shape(model.last_gear or self._max(desc))
        return {"name": t.name, "dimCount": len(dims), "dims": dims}, OK

    @_contract("mdl.get_input_data_type")
    def get_input_data_type(self, desc: int, index: int) -> int:
        return DTYPE_CODES[self._model(desc).inputs[index].dtype]

    @_contract("mdl.get_output_data_type")
    def get_output_data_type(self, desc: int, index: int) -> int:
        return DTYPE_CODES[self._model(desc).outputs[index].dtype]

    @_contract("mdl.get_input_format")
    def get_input_format(self, desc: int, index: int) -> int:
        return FORMAT_CODES[self._model(desc).inputs[index].format]

    @_contract("mdl.get_output_format")
    def get_output_format(self, desc: int, index: int) -> int:
        return FORMAT_CODES[self._model(desc).outputs[index].format]

    @_contract("mdl.get_input_name_by_index")
    def get_input_name_by_index(self, desc: int, index: int) -> str:
        return self._model(desc).inputs[index].name

    @_contract("mdl.get_output_name_by_index")
    def get_output_name_by_index(self, desc: int, index: int) -> str:
        return self._model(desc).outputs[index].name

    @_contract("mdl.get_input_index_by_name")
    def get_input_index_by_name(self, desc: int, name: str) -> tuple[int, int]:
        for i, t in enumerate(self._model(desc).inputs):
            if t.name == name:
                return i, OK
        return -1, self.fake.error(INVALID_PARAM, f"no input named {name!r}")

    @_contract("mdl.get_dynamic_batch")
    def get_dynamic_batch(self, desc: int) -> tuple[dict[str, Any], int]:
        model = self._model(desc)
        batches = [] if model.hw else [g[0] for g in model.gears]
        return {"batchCount": len(batches), "batch": batches}, OK

    @_contract("mdl.get_dynamic_hw")
    def get_dynamic_hw(self, desc: int, index: int) -> tuple[dict[str, Any], int]:
        if index != -1:  # reserved: the documentation says to pass -1
            return {}, self.fake.error(INVALID_PARAM, "get_dynamic_hw: index must be -1")
        model = self._model(desc)
        sizes = [list(g) for g in model.gears] if model.hw else []
        return {"hwCount": len(sizes), "hw": sizes}, OK

    @_contract("mdl.set_dynamic_hw_size")
    def set_dynamic_hw_size(self, model_id: int, dataset: int, index: int, h: int, w: int) -> int:
        return self._set_gear("set_dynamic_hw_size", model_id, dataset, index, (h, w), hw=True)

    @_contract("mdl.set_dynamic_batch_size")
    def set_dynamic_batch_size(self, model_id: int, dataset: int, index: int, batch: int) -> int:
        return self._set_gear("set_dynamic_batch_size", model_id, dataset, index, (batch,), False)

    def _set_gear(
        self, call: str, model_id: int, dataset: int, index: int, gear: tuple[int, ...], hw: bool
    ) -> int:
        f = self.fake
        with f.lock:
            model = f.models.get(model_id)
            if model is None or dataset not in f.datasets:
                return f.error(INVALID_PARAM, f"{call}: unknown model or dataset")
            if not model.gears or model.hw != hw:
                kind = "dynamic-HW" if model.hw else "dynamic-batch" if model.gears else "static"
                return f.error(ERRORS["ACL_ERROR_MODEL_NOT_DYNAMIC"], f"{call}: model is {kind}")
            if index != len(model.inputs) - 1 or model.inputs[index].name != DYNAMIC_NAME:
                return f.error(INVALID_PARAM, f"input {index} is not {DYNAMIC_NAME}")
            if gear not in model.gears:
                return f.error(INVALID_PARAM, f"{call}: {gear} is not a gear {model.gears}")
            f.datasets[dataset].gear = gear
            return OK

    @_contract("mdl.create_dataset")
    def create_dataset(self) -> int:
        with self.fake.lock:
            dataset = self.fake.handle()
            self.fake.datasets[dataset] = Dataset()
            return dataset

    @_contract("mdl.add_dataset_buffer")
    def add_dataset_buffer(self, dataset: int, buffer: int) -> tuple[int, int]:
        f = self.fake
        with f.lock:
            if dataset not in f.datasets or buffer not in f.buffers:
                return dataset, f.error(INVALID_PARAM, "add_dataset_buffer: unknown handles")
            f.datasets[dataset].buffers.append(buffer)
            return dataset, OK

    @_contract("mdl.destroy_dataset")
    def destroy_dataset(self, dataset: int) -> int:
        f = self.fake
        with f.lock:
            if dataset not in f.datasets:
                return f.error(INVALID_PARAM, f"no dataset {dataset}")
            del f.datasets[dataset]
            return OK

    @_contract("mdl.execute_async")
    def execute_async(self, model_id: int, inputs: int, outputs: int, stream: int) -> int:
        f = self.fake
        with f.lock:
            if (ret := f.needs_context()) != OK:
                return ret
            model = f.models.get(model_id)
            if model is None:
                return f.error(INVALID_MODEL_ID, f"no model {model_id}")
            if model.context != f.current_context:
                return f.error(MODEL_CONTEXT, "model executed from another context")
            if f.streams.get(stream) != f.current_context:
                return f.error(STREAM_CONTEXT, "stream of another context")
            if model.running_on and model.running_on != stream:
                return f.error(INVALID_PARAM, "the same model is executing on another stream")
            if model.work[0]:
                for other_id, use in f.users(*model.work):
                    other = f.models[other_id]
                    if use == "work" and other.running_on not in (0, stream):
                        return f.error(
                            INVALID_PARAM, f"work memory shared with model {other_id}, whose "
                            "run on another stream is not synchronised"
                        )  # fmt: skip
            if model.weights[0]:
                region, offset = f.region(*model.weights)  # type: ignore[misc]
                stamp = model.digest[: model.weights[1]]
                if bytes(region[offset : offset + len(stamp)]) != stamp:
                    return f.error(MODEL_EXECUTE, "its weight memory no longer holds its weights")
            in_ds, out_ds = f.datasets.get(inputs), f.datasets.get(outputs)
            if in_ds is None or out_ds is None:
                return f.error(INVALID_PARAM, "unknown dataset")
            gear = in_ds.gear if model.gears else ()
            if model.gears and not gear:
                return f.error(INVALID_PARAM, "dynamic model executed without a gear set")
            full = max(model.gears, key=math.prod, default=())
            for ds, tensors in ((in_ds, model.inputs), (out_ds, model.outputs)):
                for b in ds.buffers:
                    if (ret := f.on_current_device(f.buffers[b][0], "execute_async")) != OK:
                        return ret
                sizes = [f.buffers[b][1] for b in ds.buffers]
                if sizes != [t.size(full) for t in tensors]:
                    return f.error(INPUT_NOT_MATCH, f"dataset sizes {sizes} do not match")
            if f.fail_next_executes:
                f.fail_next_executes -= 1
                return f.error(MODEL_EXECUTE, "injected execution failure")
            arrays = []
            for buffer, t in zip(in_ds.buffers, model.inputs):
                if t.name == DYNAMIC_NAME:
                    continue
                pointer, _ = f.buffers[buffer]
                region, offset = f.region(pointer, t.size(gear))  # type: ignore[misc]
                data = bytes(region[offset : offset + t.size(gear)])
                arrays.append(np.frombuffer(data, dtype=t.dtype).reshape(t.shape(gear)))
            results = FUNCTIONS[model.function](arrays)
            for buffer, t, result in zip(out_ds.buffers, model.outputs, results):
                pointer, _ = f.buffers[buffer]
                region, offset = f.region(pointer, t.size(gear))  # type: ignore[misc]
                raw = np.ascontiguousarray(result, dtype=t.dtype).tobytes()
                region[offset : offset + len(raw)] = raw
            model.running_on = stream
            model.last_gear = gear
            return OK


def _sizes(data: dict[str, Any]) -> tuple[int, int]:
    """(work, weight) bytes a model needs: what query_size says."""
    return int(data.get("work_bytes", WORK_BYTES)), int(data.get("weight_bytes", WEIGHT_BYTES))


def write_model(path: Path, soc_version: str = "Ascend310P3", **spec: Any) -> Path:
    """A fake ``.om`` (a JSON descriptor) at ``path``."""
    path.write_text(json.dumps({"soc_version": soc_version, **spec}))
    return path
