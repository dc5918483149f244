"""The pyACL calls the ACL backend makes, all in one narrow place, and the CANN constants.

``AclRuntime`` wraps an ``acl``-shaped module: the real one (``load_runtime`` imports it lazily,
so nothing here needs CANN until an ``acl`` model is loaded) or the strict contract fake the tests
use. Every method is a one-line passthrough with pyACL's exact arity and return order, taken from
the binding source (hicann/runtime@134e2edb8c46, python/pyACL): handles and pointers are ints,
payloads come first and ``ret`` last (``(ptr, ret)``, ``(free, total, ret)``), status-only calls
return a bare int, and pure getters return only the value. ``tests/fixtures/pyacl_contract.json``
lists the binding's function names and the header constants; a test checks every call below and
every constant here against it.

Used only by ``worker.backends.acl_backend`` and ``worker.backends.acl_memory``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ACL_SUCCESS = 0
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_MEM_MALLOC_HUGE_FIRST = 0  # aclrtMemMallocPolicy
ACL_MEMCPY_HOST_TO_DEVICE = 1  # aclrtMemcpyKind
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_DDR_MEM = 0  # aclrtMemAttr (on 310P, HBM is mapped to DDR)
ACL_HBM_MEM = 1
ACL_DYNAMIC_TENSOR_NAME = "ascend_mbatch_shape_data"

# aclDataType -> numpy
ACL_DTYPES: dict[int, np.dtype] = {
    code: np.dtype(name)
    for code, name in {
        0: "float32",
        1: "float16",
        2: "int8",
        3: "int32",
        4: "uint8",
        6: "int16",
        7: "uint16",
        8: "uint32",
        9: "int64",
        10: "uint64",
        11: "float64",
        12: "bool",
    }.items()
}
# aclFormat -> name
ACL_FORMATS = {
    -1: "UNDEFINED",
    0: "NCHW",
    1: "NHWC",
    2: "ND",
    3: "NC1HWC0",
    4: "FRACTAL_Z",
    12: "NC1HWC0_C04",
    16: "HWCN",
    27: "NDHWC",
    29: "FRACTAL_NZ",
    30: "NCDHW",
    32: "NDC1HWC0",
}

# what an error code means, for messages a deploy engineer can act on
ERROR_MEANINGS = {
    100000: "invalid parameter",
    100001: "ACL is not initialised",
    100002: "ACL is already initialised",
    100003: "invalid model file (wrong format, or built for another SoC)",
    100011: "invalid model id",
    100017: "model input does not match (buffer count or size)",
    100019: "the model is not dynamic",
    100037: "ACL is already finalised",
    107000: "runtime: invalid parameter",
    107002: "runtime: no current context on this thread",
    107003: "runtime: the stream belongs to another context",
    107004: "runtime: the model belongs to another context",
    200000: "out of memory",
    200002: "invalid device",
    207001: "device memory allocation failed",
    300000: "device storage over limit",
    500000: "internal error",
    500001: "graph engine (GE) failure",
    500002: "runtime failure",
    500003: "driver failure",
    507011: "model execution failed",
    507033: "device setup failed",
}


class AclError(RuntimeError):
    """A pyACL call returned a code other than ACL_SUCCESS."""

    def __init__(self, call: str, code: int, detail: str = "") -> None:
        meaning = ERROR_MEANINGS.get(code, "unknown error")
        text = f"acl {call} failed with {code} ({meaning})"
        super().__init__(f"{text}: {detail}" if detail else text)
        self.call = call
        self.code = code


class AclRuntime:
    """The ~40 pyACL functions the backend uses, over an ``acl``-shaped module."""

    def __init__(self, acl: Any) -> None:
        self._acl = acl

    def check(self, ret: int, call: str) -> None:
        """Raise ``AclError`` for a non-zero ``ret``, with the runtime's own last message."""
        if ret != ACL_SUCCESS:
            raise AclError(call, ret, self.get_recent_err_msg())

    # -- process, device, context, stream ---------------------------------------------------
    def init(self) -> int:
        return int(self._acl.init())

    def finalize(self) -> int:
        return int(self._acl.finalize())

    def get_soc_name(self) -> str:
        return str(self._acl.get_soc_name())

    def get_recent_err_msg(self) -> str:
        return str(self._acl.get_recent_err_msg() or "")

    def get_version(self) -> tuple[int, int, int, int]:
        major, minor, patch, ret = self._acl.get_version()
        return int(major), int(minor), int(patch), int(ret)

    def set_device(self, device: int) -> int:
        return int(self._acl.rt.set_device(device))

    def reset_device(self, device: int) -> int:
        return int(self._acl.rt.reset_device(device))

    def get_device_count(self) -> tuple[int, int]:
        count, ret = self._acl.rt.get_device_count()
        return int(count), int(ret)

    def create_context(self, device: int) -> tuple[int, int]:
        context, ret = self._acl.rt.create_context(device)
        return int(context), int(ret)

    def set_context(self, context: int) -> int:
        return int(self._acl.rt.set_context(context))

    def destroy_context(self, context: int) -> int:
        return int(self._acl.rt.destroy_context(context))

    def create_stream(self) -> tuple[int, int]:
        stream, ret = self._acl.rt.create_stream()
        return int(stream), int(ret)

    def destroy_stream(self, stream: int) -> int:
        return int(self._acl.rt.destroy_stream(stream))

    def synchronize_stream(self, stream: int) -> int:
        """Releases the GIL while it waits (the binding's ``PyEval_SaveThread``)."""
        return int(self._acl.rt.synchronize_stream(stream))

    # -- memory -----------------------------------------------------------------------------
    def malloc(self, size: int, policy: int) -> tuple[int, int]:
        pointer, ret = self._acl.rt.malloc(size, policy)
        return int(pointer), int(ret)

    def free(self, pointer: int) -> int:
        return int(self._acl.rt.free(pointer))

    def memcpy(self, dst: int, dst_max: int, src: int, count: int, kind: int) -> int:
        """Synchronous; holds the GIL for the copy."""
        return int(self._acl.rt.memcpy(dst, dst_max, src, count, kind))

    def get_mem_info(self, attr: int) -> tuple[int, int, int]:
        free, total, ret = self._acl.rt.get_mem_info(attr)
        return int(free), int(total), int(ret)

    # -- model ------------------------------------------------------------------------------
    def query_size(self, path: str) -> tuple[int, int, int]:
        work, weight, ret = self._acl.mdl.query_size(path)
        return int(work), int(weight), int(ret)

    def load_from_file_with_mem(
        self, path: str, work_ptr: int, work_size: int, weight_ptr: int, weight_size: int
    ) -> tuple[int, int]:
        """Into the caller's device memory (a pointer of 0: the runtime manages that part).
        Weight memory is read-only during inference, so loads of one file may share it; work
        memory only models that never run at once may share."""
        model_id, ret = self._acl.mdl.load_from_file_with_mem(
            path, work_ptr, work_size, weight_ptr, weight_size
        )
        return int(model_id), int(ret)

    def unload(self, model_id: int) -> int:
        return int(self._acl.mdl.unload(model_id))

    def create_desc(self) -> int:
        return int(self._acl.mdl.create_desc())

    def get_desc(self, desc: int, model_id: int) -> int:
        return int(self._acl.mdl.get_desc(desc, model_id))

    def destroy_desc(self, desc: int) -> int:
        return int(self._acl.mdl.destroy_desc(desc))

    def get_num_inputs(self, desc: int) -> int:
        return int(self._acl.mdl.get_num_inputs(desc))

    def get_num_outputs(self, desc: int) -> int:
        return int(self._acl.mdl.get_num_outputs(desc))

    def get_input_size_by_index(self, desc: int, index: int) -> int:
        return int(self._acl.mdl.get_input_size_by_index(desc, index))

    def get_output_size_by_index(self, desc: int, index: int) -> int:
        return int(self._acl.mdl.get_output_size_by_index(desc, index))

    def get_input_dims(self, desc: int, index: int) -> tuple[dict[str, Any], int]:
        dims, ret = self._acl.mdl.get_input_dims(desc, index)
        return dims, int(ret)

    def get_output_dims(self, desc: int, index: int) -> tuple[dict[str, Any], int]:
        dims, ret = self._acl.mdl.get_output_dims(desc, index)
        return dims, int(ret)

    def get_cur_output_dims(self, desc: int, index: int) -> tuple[dict[str, Any], int]:
        dims, ret = self._acl.mdl.get_cur_output_dims(desc, index)
        return dims, int(ret)

    def get_input_data_type(self, desc: int, index: int) -> int:
        return int(self._acl.mdl.get_input_data_type(desc, index))

    def get_output_data_type(self, desc: int, index: int) -> int:
        return int(self._acl.mdl.get_output_data_type(desc, index))

    def get_input_format(self, desc: int, index: int) -> int:
        return int(self._acl.mdl.get_input_format(desc, index))

    def get_output_format(self, desc: int, index: int) -> int:
        return int(self._acl.mdl.get_output_format(desc, index))

    def get_input_name_by_index(self, desc: int, index: int) -> str:
        return str(self._acl.mdl.get_input_name_by_index(desc, index))

    def get_output_name_by_index(self, desc: int, index: int) -> str:
        return str(self._acl.mdl.get_output_name_by_index(desc, index))

    def get_input_index_by_name(self, desc: int, name: str) -> tuple[int, int]:
        index, ret = self._acl.mdl.get_input_index_by_name(desc, name)
        return int(index), int(ret)

    def get_dynamic_batch(self, desc: int) -> tuple[dict[str, Any], int]:
        info, ret = self._acl.mdl.get_dynamic_batch(desc)
        return info, int(ret)

    def set_dynamic_batch_size(self, model_id: int, dataset: int, index: int, batch: int) -> int:
        return int(self._acl.mdl.set_dynamic_batch_size(model_id, dataset, index, batch))

    def get_dynamic_hw(self, desc: int) -> tuple[dict[str, Any], int]:
        """``{"hwCount": n, "hw": [[h, w], ...]}``; the index argument is reserved: -1."""
        info, ret = self._acl.mdl.get_dynamic_hw(desc, -1)
        return info, int(ret)

    def set_dynamic_hw_size(self, model_id: int, dataset: int, index: int, h: int, w: int) -> int:
        return int(self._acl.mdl.set_dynamic_hw_size(model_id, dataset, index, h, w))

    def execute_async(self, model_id: int, inputs: int, outputs: int, stream: int) -> int:
        """Only enqueues (keeps the GIL briefly); ``synchronize_stream`` waits without it."""
        return int(self._acl.mdl.execute_async(model_id, inputs, outputs, stream))

    # -- datasets ---------------------------------------------------------------------------
    def create_dataset(self) -> int:
        return int(self._acl.mdl.create_dataset())

    def add_dataset_buffer(self, dataset: int, buffer: int) -> tuple[int, int]:
        """The odd one out: returns ``(dataset, ret)``."""
        dataset, ret = self._acl.mdl.add_dataset_buffer(dataset, buffer)
        return int(dataset), int(ret)

    def destroy_dataset(self, dataset: int) -> int:
        return int(self._acl.mdl.destroy_dataset(dataset))

    def create_data_buffer(self, pointer: int, size: int) -> int:
        return int(self._acl.create_data_buffer(pointer, size))

    def destroy_data_buffer(self, buffer: int) -> int:
        return int(self._acl.destroy_data_buffer(buffer))


def load_runtime() -> AclRuntime:
    """The real pyACL; a clear error where CANN is not installed."""
    try:
        import acl  # type: ignore[import-not-found]
    except ImportError as err:
        raise RuntimeError(
            "the acl backend needs the CANN runtime (pyACL, `import acl`): install the CANN "
            "toolkit or nnrt and source its set_env.sh; `duomo check` reports what is missing "
            f"({err})"
        ) from None
    return AclRuntime(acl)
