"""The ACL backend: Huawei Ascend ``.om`` models through pyACL.

Created by ``create_backend("acl", AclOptions)``; ``AclBackend.open`` runs on the model worker's
thread and returns an ``AclSession`` that only that thread uses. Hardware status: built to the
pyACL call contract (``worker.backends.acl_runtime``) and tested against the strict fake in
``tests/fakes/fake_acl.py``; not yet verified on a 310P3 or 910B card (docs/ascend.md).

Process-wide (``AclBackend``): the first ``open`` calls ``acl.init`` (100002, "already
initialised", is fine: ORT's CANN provider may have done it) and ``rt.set_device`` once per device;
``close`` resets the devices and finalises, after every session is gone. Its ``DeviceMemory``
(``worker.backends.acl_memory``) holds the device buffers sessions share, counting their users.

Per session (one per model instance): its own context (made current again before every call the
session makes), its own stream and its own model id (so one model id never runs on two streams),
device buffers for every input and output at the largest gear allocated once (HUGE_FIRST), and
both datasets built once, including the ``ascend_mbatch_shape_data`` input ATC adds to a
dynamic-batch model. The model is loaded with ``load_from_file_with_mem`` into memory allocated
at ``query_size``'s sizes (so what a model takes is known before it loads): its weights shared
with every session that loads the same file on its device (``share_weights``, the default), its
work shared with the device's other models when the device's gate runs one at a time
(``runs_alone``); ``acl_memory`` holds the rules and frees a shared buffer with its last user,
after that session unloaded its model.

Its ``memory`` (``acl_memory.AclMemory``) holds its buffers and tells what they cost:
``device_bytes`` is what the session takes as its own: its input and output buffers, and its
work and weights unless shared; a shared weight buffer is ``weights``, a shared work buffer
``shared_work`` (each a ``MemoryShare``, charged once per device at the buffer's size).
``memory.figures`` keeps ``query_size``'s figures and the ``get_mem_info`` drop across the load,
which on a card shows what the runtime takes beyond the buffers.

Per run: host→device ``memcpy`` straight from the caller's arrays (a shared-memory slot's views or
the session's host buffers), ``set_dynamic_batch_size`` to the smallest gear that holds the batch
(padding rows are never copied back) or, for a model built with ``--dynamic_image_size``,
``set_dynamic_hw_size`` to the inputs' H×W (which must be one of its gears: ``hw_gears``),
``execute_async`` + ``synchronize_stream`` holding the device's compute gate (weighted fair
share, as the CPU's: ``worker.thread_budget``; the GIL is free while the device works; the
synchronous ``execute`` would hold it and stall every model), then device→host copies of only
the real rows of each output (``get_cur_output_dims``).

Close releases in the documented order: data buffers and datasets, model, description, device
buffers (a shared work or weight buffer only when its last user has unloaded), stream, context.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from duomo.worker.backends.acl_memory import AclMemory, DeviceMemory, check_release
from duomo.worker.backends.acl_runtime import (
    ACL_DTYPES,
    ACL_DYNAMIC_TENSOR_NAME,
    ACL_ERROR_REPEAT_INITIALIZE,
    ACL_FORMATS,
    ACL_HBM_MEM,
    ACL_MEM_MALLOC_HUGE_FIRST,
    ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE,
    ACL_SUCCESS,
    AclError,
    AclRuntime,
    load_runtime,
)
from duomo.worker.backends.base import Backend, BufferedSession, SessionSettings, TensorSpec
from duomo.worker.backends.shares import file_identity
from duomo.worker.config_model import StrictModel
from duomo.worker.thread_budget import GateMember

log = structlog.get_logger("duomo.acl")
ATC_SIDECAR_SUFFIX = ".atc.json"  # written next to the .om by tools/atc_convert.py
_LOAD_FAILURES_WORTH_A_SOC_HINT = {100003, 500001, 500002, 507033}


class AclOptions(StrictModel):
    """``backends.acl`` in the config."""

    check_soc: bool = True  # compare the SoC an .om was built for with the device's


def atc_sidecar(path: Path) -> dict[str, Any] | None:
    """What ``tools/atc_convert.py`` recorded about ``path`` (SoC, command), if it did."""
    sidecar = path.with_name(path.name + ATC_SIDECAR_SUFFIX)
    if not sidecar.is_file():
        return None
    data = json.loads(sidecar.read_text())
    return data if isinstance(data, dict) else None


class AclBackend(Backend):
    """The Ascend runtime, initialised once per process: ``open`` loads a ``.om`` model on its
    device into an ``AclSession`` for the calling worker thread."""

    name = "acl"

    def __init__(
        self,
        options: AclOptions | None = None,
        runtime_factory: Callable[[], AclRuntime] = load_runtime,
    ) -> None:
        self.options = options or AclOptions()
        self._runtime_factory = runtime_factory
        self._runtime: AclRuntime | None = None
        self._devices: list[int] = []
        self._lock = threading.Lock()
        self.soc_name = ""
        self.memory = DeviceMemory()

    def _runtime_for(self, device: int) -> AclRuntime:
        """The process's runtime, initialised once, with ``device`` set once."""
        with self._lock:
            rt = self._runtime
            if rt is None:
                rt = self._runtime_factory()
                ret = rt.init()
                if ret not in (ACL_SUCCESS, ACL_ERROR_REPEAT_INITIALIZE):
                    rt.check(ret, "init")
                self._runtime = rt
                self.soc_name = rt.get_soc_name()
            if device not in self._devices:
                rt.check(rt.set_device(device), f"rt.set_device({device})")
                self._devices.append(device)
            return rt

    def open(self, path: Path, settings: SessionSettings) -> AclSession:
        rt = self._runtime_for(settings.device)
        if self.options.check_soc:
            _check_soc(path, self.soc_name)
        return AclSession(rt, path, settings, self.soc_name, self.memory)

    def close(self) -> None:
        with self._lock:
            rt, self._runtime = self._runtime, None
            devices, self._devices = self._devices, []
        if rt is None:
            return
        held = self.memory.held()
        if held["buffers"]:  # a session left open: reset_device reclaims its memory
            log.warning("acl shared buffers still held at close", **held)
        for device in reversed(devices):
            check_release(rt, rt.reset_device(device), f"rt.reset_device({device})")
        check_release(rt, rt.finalize(), "finalize")


def _check_soc(path: Path, soc_name: str) -> None:
    built_for = (atc_sidecar(path) or {}).get("soc_version")
    if built_for and soc_name and built_for.replace(" ", "").lower() != soc_name.lower():
        raise RuntimeError(
            f"{path.name} was built for {built_for} but this device is {soc_name}: convert it "
            f"again with atc --soc_version={soc_name} (tools/atc_convert.py)"
        )


@dataclass(frozen=True)
class _Tensor:
    """One model input or output as the model description reports it."""

    spec: TensorSpec
    dims: tuple[int, ...]  # -1 where a gear decides
    size: int  # device bytes, at the largest gear
    format: str


class AclSession(BufferedSession):
    """One ``.om`` model loaded on an Ascend device, used only by the worker thread that opened
    it: its device memory, its runs at the compute gate, and its reused host buffers."""

    memory: AclMemory

    def __init__(
        self,
        rt: AclRuntime,
        path: Path,
        settings: SessionSettings,
        soc_name: str,
        memory: DeviceMemory,
    ) -> None:
        super().__init__(AclMemory(path, settings.device))
        self._rt = rt
        self._settings = settings  # device, room its budgets leave, sharing
        self._gate: GateMember | None = settings.gate  # its model's place at the device's gate
        self._device_memory = memory
        self.path = path
        self.device = settings.device
        self.metadata: dict[str, str] = {"soc": soc_name}
        self._context = self._stream = self._model_id = self._desc = 0
        self._input_dataset = self._output_dataset = 0
        self._pointers: list[int] = []
        self._data_buffers: list[int] = []
        self._input_pointers: list[int] = []
        self._data_input_pointers: list[int] = []
        self._output_pointers: list[int] = []
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    # -- loading ----------------------------------------------------------------------------
    def _load(self) -> None:
        rt = self._rt
        context, ret = rt.create_context(self.device)  # current on this thread from now on
        rt.check(ret, f"rt.create_context({self.device})")
        self._context = context
        stream, ret = rt.create_stream()
        rt.check(ret, "rt.create_stream")
        self._stream = stream
        free_before = self._free_device_bytes()
        work, weight, ret = rt.query_size(str(self.path))
        rt.check(ret, f"mdl.query_size({self.path.name})")
        held = self.memory
        if self._settings.share_weights:
            held.identity = file_identity(self.path)
        held.work, held.weight = self._device_memory.claim(
            rt, self.path, self._settings, (work, weight), held.identity
        )
        work_buffer, weight_buffer = held.work.thing, held.weight.thing
        model_id, ret = rt.load_from_file_with_mem(
            str(self.path), work_buffer.pointer, work, weight_buffer.pointer, weight
        )
        if ret != ACL_SUCCESS:
            hint = ""
            if ret in _LOAD_FAILURES_WORTH_A_SOC_HINT:
                hint = f"; this device is {self.metadata['soc']}: was it built for it?"
            call = f"mdl.load_from_file_with_mem({self.path})"
            raise AclError(call, ret, rt.get_recent_err_msg() + hint)
        self._model_id = model_id
        self._desc = rt.create_desc()
        rt.check(rt.get_desc(self._desc, model_id), "mdl.get_desc")
        self._describe()
        self._input_dataset, self._input_pointers = self._dataset(self._input_sizes)
        self._data_input_pointers = [  # the inputs a caller fills (not the gear input)
            p for i, p in enumerate(self._input_pointers) if i != self._dynamic_index
        ]
        self._output_dataset, self._output_pointers = self._dataset([t.size for t in self._outputs])
        io_bytes = sum(self._input_sizes) + sum(t.size for t in self._outputs)
        held.figures = {
            "query_work_bytes": work,
            "query_weight_bytes": weight,
            "work_buffer_bytes": work_buffer.nbytes,  # the shared one's, when shared
            "work_shared": int(work_buffer.shared),
            "weights_shared": int(weight_buffer.shared),
            "io_bytes": io_bytes,
            "own_bytes": io_bytes
            + (0 if work_buffer.shared else work)
            + (0 if weight_buffer.shared else weight),
            "measured_bytes": max(0, free_before - self._free_device_bytes()),
        }

    def _free_device_bytes(self) -> int:
        free, _total, ret = self._rt.get_mem_info(ACL_HBM_MEM)
        return free if ret == ACL_SUCCESS else 0

    def _describe(self) -> None:
        rt, desc = self._rt, self._desc
        count = rt.get_num_inputs(desc)
        index, ret = rt.get_input_index_by_name(desc, ACL_DYNAMIC_TENSOR_NAME)
        self._dynamic_index = index if ret == ACL_SUCCESS else None
        gears: list[int] = []
        sizes: list[tuple[int, int]] = []
        if self._dynamic_index is not None:
            info, ret = rt.get_dynamic_batch(desc)
            rt.check(ret, "mdl.get_dynamic_batch")
            gears = sorted(int(b) for b in info.get("batch", [])[: int(info.get("batchCount", 0))])
            if not gears:
                info, ret = rt.get_dynamic_hw(desc)
                rt.check(ret, "mdl.get_dynamic_hw")
                listed = info.get("hw", [])[: int(info.get("hwCount", 0))]
                sizes = sorted((int(h), int(w)) for h, w in listed)
            if not gears and not sizes:
                raise RuntimeError(
                    f"{self.path.name} has dynamic dims (atc --dynamic_dims), which this backend "
                    "does not serve; rebuild it with --dynamic_batch_size or --dynamic_image_size"
                )
        self.gears = tuple(gears)
        self._hw = tuple(sizes)
        self._input_sizes = [rt.get_input_size_by_index(desc, i) for i in range(count)]
        self._inputs = [
            self._tensor(
                rt.get_input_name_by_index(desc, i),
                rt.get_input_dims(desc, i),
                rt.get_input_data_type(desc, i),
                rt.get_input_format(desc, i),
                self._input_sizes[i],
            )
            for i in range(count)
            if i != self._dynamic_index
        ]
        self._outputs = [
            self._tensor(
                rt.get_output_name_by_index(desc, i),
                rt.get_output_dims(desc, i),
                rt.get_output_data_type(desc, i),
                rt.get_output_format(desc, i),
                rt.get_output_size_by_index(desc, i),
            )
            for i in range(rt.get_num_outputs(desc))
        ]
        self.inputs = tuple(t.spec for t in self._inputs)
        self.outputs = tuple(t.spec for t in self._outputs)

    def _tensor(
        self, name: str, dims: tuple[dict[str, Any], int], dtype: int, fmt: int, size: int
    ) -> _Tensor:
        info, ret = dims
        self._rt.check(ret, f"mdl dims of {name!r}")
        if dtype not in ACL_DTYPES:
            raise RuntimeError(f"{self.path.name}: tensor {name!r} has unsupported type {dtype}")
        shape = tuple(int(d) for d in info["dims"][: int(info["dimCount"])])
        spec = TensorSpec(name, ACL_DTYPES[dtype], tuple(d if d >= 0 else None for d in shape))
        return _Tensor(spec, shape, size, ACL_FORMATS.get(fmt, str(fmt)))

    def _dataset(self, sizes: list[int]) -> tuple[int, list[int]]:
        """A dataset of fresh device buffers of ``sizes`` bytes (kept for release)."""
        rt = self._rt
        dataset = rt.create_dataset()
        pointers = []
        try:
            for size in sizes:
                pointer, ret = rt.malloc(size, ACL_MEM_MALLOC_HUGE_FIRST)
                rt.check(ret, f"rt.malloc({size})")
                self._pointers.append(pointer)
                pointers.append(pointer)
                buffer = rt.create_data_buffer(pointer, size)
                self._data_buffers.append(buffer)
                dataset, ret = rt.add_dataset_buffer(dataset, buffer)
                rt.check(ret, "mdl.add_dataset_buffer")
        except BaseException:
            check_release(rt, rt.destroy_dataset(dataset), "mdl.destroy_dataset")
            raise
        return dataset, pointers

    # -- serving ----------------------------------------------------------------------------

    @property
    def hw_gears(self) -> tuple[tuple[int, int], ...]:
        return self._hw

    def every_gear(self) -> list[tuple[int, ...]]:
        """Each gear as the values of the inputs' open dimensions, in order: ``(batch,)`` for
        batch gears, ``(h, w)`` for image-size gears, ``()`` once for a static model."""
        return [(g,) for g in self.gears] or list(self._hw) or [()]

    @staticmethod
    def shape_at(spec: TensorSpec, gear: tuple[int, ...]) -> tuple[int, ...]:
        """``spec``'s shape with the gear's values in its open dimensions."""
        values = iter(gear)
        return tuple(next(values, 1) if d is None else d for d in spec.shape)

    def _hw_of(self, inputs: Mapping[str, np.ndarray]) -> tuple[int, int]:
        """The H×W the inputs have at their dynamic dimensions; it must be one of the gears
        (the executor pads or scales to one: the model cannot take any other size)."""
        for t in self._inputs:
            dynamic = [i for i, d in enumerate(t.dims) if d < 0]
            array = inputs.get(t.spec.name)
            if len(dynamic) == 2 and array is not None and array.ndim == len(t.dims):
                hw = (int(array.shape[dynamic[0]]), int(array.shape[dynamic[1]]))
                if hw not in self._hw:
                    raise ValueError(
                        f"{self.path.name}: input {t.spec.name!r} is {hw[0]}×{hw[1]}, not one of "
                        f"the model's image-size gears {[list(g) for g in self._hw]}; pad or "
                        "scale to one, or add it with atc --dynamic_image_size"
                    )
                return hw
        raise ValueError(f"{self.path.name}: no input carries the dynamic H×W")

    @property
    def max_rows(self) -> int | None:
        if self.gears:
            return self.gears[-1]
        first = self._inputs[0].dims if self._inputs else ()
        return first[0] if first and first[0] > 0 else None

    def gear_for(self, batch: int) -> int:
        """The smallest gear that holds ``batch`` rows (ValueError when none does)."""
        for gear in self.gears:
            if gear >= batch:
                return gear
        raise ValueError(
            f"{self.path.name}: a batch of {batch} is above its largest gear "
            f"{self.gears[-1]} (gears {list(self.gears)}); lower max_batch or add a gear with "
            "atc --dynamic_batch_size"
        )

    def _rows(self, inputs: Mapping[str, np.ndarray]) -> int:
        first = inputs[self._inputs[0].spec.name]
        return int(first.shape[0]) if first.ndim else 1

    def expected_output_shapes(
        self, inputs: Mapping[str, np.ndarray]
    ) -> list[tuple[int, ...]] | None:
        batch = self._rows(inputs)
        shapes = []
        for t in self._outputs:
            dims = list(t.dims)
            if self.gears and dims and dims[0] < 0:
                dims[0] = batch
            if any(d < 0 for d in dims):
                return None
            shapes.append(tuple(dims))
        return shapes

    def _execute(self) -> None:
        """The model's turn on the device: ``execute_async`` + ``synchronize_stream``, holding
        the device's compute gate (the same weighted fair share as the CPU's), if any."""
        rt, gate = self._rt, self._gate
        if gate is not None:
            gate.acquire(1)
        try:
            rt.check(
                rt.execute_async(
                    self._model_id, self._input_dataset, self._output_dataset, self._stream
                ),
                "mdl.execute_async",
            )
            rt.check(rt.synchronize_stream(self._stream), "rt.synchronize_stream")
        finally:
            if gate is not None:
                gate.release(1)

    def run(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        rt = self._rt
        rt.check(rt.set_context(self._context), "rt.set_context")
        batch = self._rows(inputs)
        gear = self.gear_for(batch) if self.gears else None
        hw = self._hw_of(inputs) if self._hw else None
        for t, pointer in zip(self._inputs, self._data_input_pointers):
            array = inputs.get(t.spec.name)
            if array is None:
                raise ValueError(f"missing input {t.spec.name!r} for {self.path.name}")
            self._check_input(t, array, batch, hw)
            if array.dtype != t.spec.dtype or not array.flags.c_contiguous:
                array = np.ascontiguousarray(array, dtype=t.spec.dtype)
            rt.check(
                rt.memcpy(
                    pointer, t.size, array.ctypes.data, array.nbytes, ACL_MEMCPY_HOST_TO_DEVICE
                ),
                f"rt.memcpy to {t.spec.name!r}",
            )
        if gear is not None:
            assert self._dynamic_index is not None
            rt.check(
                rt.set_dynamic_batch_size(
                    self._model_id, self._input_dataset, self._dynamic_index, gear
                ),
                f"mdl.set_dynamic_batch_size({gear})",
            )
        elif hw is not None:
            assert self._dynamic_index is not None
            rt.check(
                rt.set_dynamic_hw_size(
                    self._model_id, self._input_dataset, self._dynamic_index, *hw
                ),
                f"mdl.set_dynamic_hw_size({hw[0]}, {hw[1]})",
            )
        self._execute()
        results: dict[str, np.ndarray] = {}
        for i, (t, pointer) in enumerate(zip(self._outputs, self._output_pointers)):
            dims, ret = rt.get_cur_output_dims(self._desc, i)
            shape = [int(d) for d in dims["dims"][: int(dims["dimCount"])]] if ret == 0 else []
            if not shape or any(d < 0 for d in shape):
                shape = list(t.dims)
            if gear is not None and shape and shape[0] == gear:
                shape[0] = batch  # the padding rows stay on the device
            if outputs is not None:
                target = outputs[t.spec.name]
                if target.shape != tuple(shape) or target.dtype != t.spec.dtype:
                    raise ValueError(
                        f"output {t.spec.name!r} is {t.spec.dtype}{shape}, the caller's array "
                        f"is {target.dtype}{list(target.shape)}"
                    )
            else:
                target = self.memory.outputs.view(t.spec.name, t.spec.dtype, shape)
            if target.nbytes > t.size:
                raise ValueError(f"output {t.spec.name!r} of {target.nbytes} B exceeds {t.size}")
            rt.check(
                rt.memcpy(
                    target.ctypes.data, target.nbytes, pointer, target.nbytes,
                    ACL_MEMCPY_DEVICE_TO_HOST,
                ),
                f"rt.memcpy from {t.spec.name!r}",
            )  # fmt: skip
            results[t.spec.name] = target
        return results

    def _check_input(
        self, t: _Tensor, array: np.ndarray, batch: int, hw: tuple[int, int] | None
    ) -> None:
        expected = list(t.dims)
        if self.gears and expected and expected[0] < 0:
            expected[0] = batch
        if hw is not None:
            values = iter(hw)
            expected = [next(values, d) if d < 0 else d for d in expected]
        if list(array.shape) != expected:
            kind = "dynamic-batch" if self.gears else "dynamic-HW" if hw else "static"
            raise ValueError(
                f"{self.path.name}: input {t.spec.name!r} has shape {list(array.shape)}, the "
                f"{kind} model takes {[d if d >= 0 else '?' for d in t.dims]}"
            )
        if array.size * t.spec.dtype.itemsize > t.size:
            raise ValueError(f"input {t.spec.name!r} of {array.nbytes} B exceeds {t.size}")

    def describe(self) -> dict[str, Any]:
        """Inputs, outputs, dtypes, formats and gears (``duomo inspect``)."""

        def tensor(t: _Tensor) -> dict[str, Any]:
            return {
                "name": t.spec.name,
                "dtype": t.spec.dtype.name,
                "dims": list(t.dims),
                "format": t.format,
                "bytes": t.size,
            }

        return {
            "inputs": [tensor(t) for t in self._inputs],
            "outputs": [tensor(t) for t in self._outputs],
            "dynamic_batch_gears": list(self.gears),
            "dynamic_hw_gears": [list(g) for g in self._hw],
            "memory": dict(self.memory.figures),
        }

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release everything this session created, in the documented order (idempotent)."""
        rt = self._rt
        if self._context:
            check_release(rt, rt.set_context(self._context), "rt.set_context")
        for buffer in self._data_buffers:
            check_release(rt, rt.destroy_data_buffer(buffer), "destroy_data_buffer")
        self._data_buffers = []
        for dataset in (self._input_dataset, self._output_dataset):
            if dataset:
                check_release(rt, rt.destroy_dataset(dataset), "mdl.destroy_dataset")
        self._input_dataset = self._output_dataset = 0
        if self._model_id:
            ret = rt.unload(self._model_id)
            check_release(rt, ret, "mdl.unload")
            if ret == ACL_SUCCESS:  # else its memory stays: a model may still read it
                self._model_id = 0
        if self._desc:
            check_release(rt, rt.destroy_desc(self._desc), "mdl.destroy_desc")
            self._desc = 0
        for pointer in self._pointers:
            check_release(rt, rt.free(pointer), "rt.free")
        self._pointers = []
        memory = self.memory
        if not self._model_id:  # unloaded (or never loaded): nothing reads its memory now
            for lease in (memory.work, memory.weight):
                if lease is not None:
                    self._device_memory.release(rt, lease)
            memory.work = memory.weight = None
        if self._stream:
            check_release(rt, rt.destroy_stream(self._stream), "rt.destroy_stream")
            self._stream = 0
        if self._context:
            check_release(rt, rt.destroy_context(self._context), "rt.destroy_context")
            self._context = 0
        memory.drop_buffers()


__all__ = ["AclBackend", "AclOptions", "AclSession", "atc_sidecar"]


def check_model_file(path: Path) -> str:
    """What can be known of an ``.om`` without loading it: that it is there, readable and not
    empty. Whether it loads needs the CANN runtime and a device (``duomo inspect`` or ``duomo
    start`` on the Ascend host); the answer says so rather than guess from the bytes. Raises
    ``ValueError`` with the reason. Called by ``duomo check``."""
    try:
        with path.open("rb") as file:
            first = file.read(1)
    except OSError as err:
        raise ValueError(f"cannot read it: {err.strerror or err}") from None
    if not first:
        raise ValueError("the file is empty (run tools/atc_convert.py again)")
    size_mb = path.stat().st_size / 2**20
    return (
        f"readable, {size_mb:.1f} MiB; not loaded: that needs the CANN runtime "
        "(duomo inspect FILE on the Ascend host)"
    )
