"""The ONNX Runtime backend: one environment per process, one session per model instance.

Created by ``worker.backends.create_backend``; ``open`` runs on the model worker's thread.

What it guarantees:
- providers are passed explicitly (onnxruntime lists ``AzureExecutionProvider`` first on some
  installs) and the provider actually in use is checked after the session is created: a silent
  fall-back to CPU is an error unless ``allow_cpu_fallback`` is set;
- each session gets the intra-op thread count the thread plan gave its instance, no inter-op
  pool, and no spinning (an idle server burns no CPU);
- I/O goes through one reused IOBinding over the session's own buffers: inputs are bound where the
  executor wrote them, outputs are bound to pre-allocated arrays once their shape for a given set
  of input shapes is known (learned on the first run with those shapes, usually the warm-up);
- every ``run`` holds the process's ``ComputeGate`` for its threads;
- a one-off run (inputs far larger than the warm-up's: ``worker.backends.base``) gives its
  activations back: the shared CPU arena shrinks once its batch is answered (its memory's
  ``give_back``: ``shrink_shared_arena``); a session with an arena of its own shrinks it at the
  end of that run;
- weights are shared (``share_weights``, on by default): the sessions that open one file with
  the same settings (the instances of a model, a replica under another name) use one
  ``InferenceSession``, made by the first and closed with the last. ONNX Runtime's ``Run`` is
  safe to call from several threads at once, each through its own I/O binding, so every instance
  keeps its own buffers, binding and place at the gate; what they share is everything the session
  holds: the weights, the copies its optimiser and pre-packing made of them, its kernels and
  its intra-op pool (docs/configuration.md, "Shared weights"). The backend's ``ShareRegistry``
  (``worker.backends.shares``) makes it once, counts its users and forgets a failed making.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from duomo.ipc.host_memory import resident_bytes, trim_heap
from duomo.worker.backends.base import (
    Backend,
    BufferedSession,
    HostMemory,
    MemoryShare,
    SessionSettings,
    TensorSpec,
)
from duomo.worker.backends.shares import ShareRegistry, file_identity
from duomo.worker.config_model import StrictModel

_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(int16)": np.int16,
    "tensor(uint16)": np.uint16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(bool)": np.bool_,
}
_OPT_LEVELS = {"disable": 0, "basic": 1, "extended": 2, "all": 99}
_SHAPE_MEMO_SIZE = 256
# what is bound for one tensor: the array (weakly), its address and shape
_Bound = tuple["weakref.ref[np.ndarray]", tuple[int, tuple[int, ...]]]
_init_lock = threading.Lock()
_logger_quieted = False
_shared_arena_registered = False
# an ONNX Identity model (float[1], opset 13): a run of it with arena shrinkage on frees what the
# shared arena holds and no session uses (ONNX Runtime has no other call for that)
_SHRINK_MODEL = bytes.fromhex(
    "08083a3c0a100a017812017922084964656e746974791206736872696e6b5a0f0a0178120a0a08080112040a020801620f0a0179120a0a08080112040a02080142040a00100d"
)
_shrinker: Any = None
_CPU = "CPUExecutionProvider"
DEVICE_PROVIDERS = frozenset({"CUDAExecutionProvider", "CANNExecutionProvider"})


# The only keys onnxruntime-cann 1.24 accepts; any other key makes the provider fail to start and
# the Python API then falls back to CPU without raising (../shared/research/ascend.md §3).
CANN_PROVIDER_KEYS = frozenset(
    {
        "device_id",
        "npu_mem_limit",
        "arena_extend_strategy",
        "enable_cann_graph",
        "enable_cann_subgraph",
        "dump_graphs",
        "dump_om_model",
        "precision_mode",
        "op_select_impl_mode",
        "optypelist_for_implmode",
    }
)
# Graph mode writes one compiled .om per input-shape set into the working directory unless told
# not to: a server keeps its working directory clean.
CANN_DEFAULTS = {"dump_om_model": "0"}


def provider_options_for(provider: str, given: dict[str, Any]) -> dict[str, str]:
    """The options passed to ``provider``: for CANN, only accepted keys (ValueError otherwise)
    and the server's defaults; values as strings, the way onnxruntime reads them."""
    if provider != "CANNExecutionProvider":
        return {k: str(v) for k, v in given.items()}
    unknown = sorted(set(given) - CANN_PROVIDER_KEYS)
    if unknown:
        raise ValueError(
            f"CANNExecutionProvider does not accept {unknown} (it would silently fall back to "
            f"CPU); accepted: {sorted(CANN_PROVIDER_KEYS)}"
        )
    values = {**CANN_DEFAULTS, **given}
    return {k: str(int(v)) if isinstance(v, bool) else str(v) for k, v in values.items()}


class OrtOptions(StrictModel):
    """``backends.onnxruntime`` in the config."""

    providers: list[str] = Field(default_factory=lambda: ["CPUExecutionProvider"], min_length=1)
    provider_options: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_provider_options(self) -> OrtOptions:
        for provider, given in self.provider_options.items():
            provider_options_for(provider, given)  # raises for keys the provider rejects
        return self

    allow_cpu_fallback: bool = False
    thread_budget: int | None = Field(
        default=None, ge=1, description="cores for intra-op threads; default: the cores available"
    )
    graph_optimization: Literal["disable", "basic", "extended", "all"] = "all"
    allow_spinning: bool = False
    enable_cpu_mem_arena: bool = True
    # one CPU arena for every session of the process (ORT's environment allocator) instead of
    # one per session, grown by what a run asks for rather than to the next power of two
    shared_cpu_arena: bool = True
    # ORT's memory patterns: one planned block per set of input shapes. "auto": on, except for
    # the sessions whose input shapes change from request to request (OCR's detector and
    # recogniser), where a block per shape fragments the arena
    memory_pattern: Literal["auto", "on", "off"] = "auto"


def _spec(arg: Any) -> TensorSpec:
    dtype = _ORT_TYPES.get(arg.type)
    if dtype is None:
        raise ValueError(f"tensor {arg.name!r} has unsupported type {arg.type}")
    shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in arg.shape)
    return TensorSpec(name=arg.name, dtype=np.dtype(dtype), shape=shape)


class OrtSession(BufferedSession):
    """One ONNX Runtime session, used only by the worker thread that opened it: runs through its
    I/O binding at its model's compute gate, into reused host buffers."""

    def __init__(
        self,
        path: Path,
        session: Any,
        gate_threads: int,
        settings: SessionSettings,
        weights: MemoryShare | None = None,
        on_close: Callable[[], object] | None = None,
        own_arena: bool = False,
    ) -> None:
        """``own_arena``: the session has a CPU arena of its own (not the shared one)."""
        super().__init__(HostMemory(shrink_shared_arena, weights))
        self._own_arena = own_arena
        self.path = path
        self._session = session
        self._on_close = on_close  # hands its use of a shared session back
        self._binding = session.io_binding()
        self._threads = gate_threads
        self._gate = settings.gate
        self.inputs = tuple(_spec(a) for a in session.get_inputs())
        self.outputs = tuple(_spec(a) for a in session.get_outputs())
        self.metadata = dict(session.get_modelmeta().custom_metadata_map)
        self.providers = list(session.get_providers())
        self._output_shapes: OrderedDict[tuple[tuple[int, ...], ...], list[tuple[int, ...]]]
        self._output_shapes = OrderedDict()
        self._data_dependent = False
        # (address, shape) currently bound per tensor name: rebinding costs more than the run
        # of a small model, and a slot or a reused buffer comes back at the same address
        self._bound_inputs: dict[str, _Bound] = {}
        self._bound_outputs: dict[str, _Bound] = {}

    def expected_output_shapes(
        self, inputs: Mapping[str, np.ndarray]
    ) -> list[tuple[int, ...]] | None:
        """Output shapes for these inputs if a run with the same input shapes taught them."""
        if self._data_dependent:
            return None
        return self._output_shapes.get(tuple(inputs[s.name].shape for s in self.inputs))

    def run(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        one_off = self.memory.note_run(inputs)
        keep_alive = []
        for spec in self.inputs:
            array = inputs.get(spec.name)
            if array is None:
                raise ValueError(f"missing input {spec.name!r} for {self.path.name}")
            if array.dtype != spec.dtype or not array.flags.c_contiguous:
                array = np.ascontiguousarray(array, dtype=spec.dtype)
                keep_alive.append(array)
            self._bind(True, spec, array)
        if outputs is not None:  # the caller's arrays (a slot's output area), shapes known
            for spec in self.outputs:
                self._bind(False, spec, outputs[spec.name])
            self._execute(one_off)
            return dict(outputs)
        key = tuple(inputs[s.name].shape for s in self.inputs)
        shapes = None if self._data_dependent else self._output_shapes.get(key)
        if shapes is not None:
            try:
                return self._run_into_buffers(key, shapes, one_off)
            except RuntimeError as err:
                if "computed output shape" not in str(err):
                    raise
                # Output shapes that depend on the data (not only on input shapes): learn that
                # once and let onnxruntime size the outputs from now on.
                self._data_dependent = True
                self._output_shapes.clear()
        return self._run_and_learn_shapes(key, one_off)

    def _bind(self, is_input: bool, spec: TensorSpec, array: np.ndarray) -> None:
        """Bind ``array`` unless the same memory at the same shape is bound already.

        The same live array object (a slot's views come back for every request with the same
        shapes) is the same memory and shape; the weak reference never keeps memory alive.
        """
        bound = self._bound_inputs if is_input else self._bound_outputs
        previous = bound.get(spec.name)
        if previous is not None and previous[0]() is array:
            return
        where = (array.__array_interface__["data"][0], array.shape)
        if previous is None or previous[1] != where:
            bind = self._binding.bind_input if is_input else self._binding.bind_output
            bind(spec.name, "cpu", 0, spec.dtype, list(array.shape), where[0])
        bound[spec.name] = (weakref.ref(array), where)

    def _execute(self, one_off: bool = False) -> None:
        """One run at the gate; a one-off run on an arena of its own shrinks it at its end."""
        options = _shrink_options() if one_off and self._own_arena else None
        gate = self._gate
        if gate is None:
            self._session.run_with_iobinding(self._binding, options)
            return
        gate.acquire(self._threads)
        try:
            self._session.run_with_iobinding(self._binding, options)
        finally:
            gate.release(self._threads)

    def _run_into_buffers(
        self, key: tuple[tuple[int, ...], ...], shapes: list[tuple[int, ...]], one_off: bool
    ) -> dict[str, np.ndarray]:
        """Outputs written by onnxruntime straight into this session's reused arrays."""
        views: dict[str, np.ndarray] = {}
        for spec, shape in zip(self.outputs, shapes):
            view = self.memory.outputs.view(spec.name, spec.dtype, shape)
            self._bind(False, spec, view)
            views[spec.name] = view
        self._execute(one_off)
        return views

    def _run_and_learn_shapes(
        self, key: tuple[tuple[int, ...], ...], one_off: bool
    ) -> dict[str, np.ndarray]:
        """Outputs allocated by onnxruntime, copied into the reused arrays; shapes remembered."""
        self._bound_outputs.clear()
        for spec in self.outputs:
            self._binding.bind_output(spec.name, "cpu")
        self._execute(one_off)
        produced = self._binding.copy_outputs_to_cpu()
        # the outputs onnxruntime allocated are copied: let go of them now, or they stay bound
        # until the next run and pin an activation-sized region of the shared arena that
        # ``release_free_memory`` cannot give back
        self._binding.clear_binding_outputs()
        if not self._data_dependent:
            self._output_shapes[key] = [tuple(a.shape) for a in produced]
            if len(self._output_shapes) > _SHAPE_MEMO_SIZE:
                self._output_shapes.popitem(last=False)
        result = {}
        for spec, array in zip(self.outputs, produced):
            view = self.memory.outputs.view(spec.name, spec.dtype, array.shape)
            view[...] = array
            result[spec.name] = view
        return result

    def close(self) -> None:
        self._binding = None
        self._session = None
        self.memory.drop_buffers()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


@dataclass(frozen=True)
class _SharedSession:
    """One ``InferenceSession`` the sessions (``OrtSession``) that open a file alike use, and
    the copy of weights it holds."""

    session: Any
    weights: MemoryShare


class OrtBackend(Backend):
    """The ONNX Runtime backend: one environment per process; ``open`` makes a session per model
    instance with the providers and threads it was given."""

    name = "onnxruntime"

    def __init__(self, options: OrtOptions | None = None) -> None:
        self.options = options or OrtOptions()
        self._shared: ShareRegistry[str, _SharedSession] = ShareRegistry()  # by ``_recipe``
        self._unshared = itertools.count(1)  # tells apart the copies of share_weights: false

    def shared_sessions(self) -> dict[str, int]:
        """Each shared session's weights key and how many sessions use it (tests, status)."""
        return self._shared.users()

    def release_free_memory(self) -> None:
        """Shrink the shared CPU arena (if there is one) to what open sessions use. Called
        before the first load too: the arena and the environment are made then, so the first
        model's measured load does not carry them."""
        import onnxruntime as ort

        if self._cpu_arena(ort.get_available_providers()) == "shared":
            _register_shared_cpu_arena(ort)
        shrink_shared_arena()

    def _cpu_arena(self, available: list[str]) -> str | None:
        """The CPU arena sessions get where the first configured provider in ``available`` is
        the CPU's (or none is): "shared", "own" (one per session), or None (arena off, another
        provider first)."""
        opts = self.options
        first = next((p for p in opts.providers if p in available), _CPU)
        if not opts.enable_cpu_mem_arena or first != _CPU:
            return None
        return "shared" if opts.shared_cpu_arena else "own"

    def open(self, path: Path, settings: SessionSettings) -> OrtSession:
        import onnxruntime as ort

        _quiet_ort_logging(ort)
        providers = self._providers(ort)
        recipe = self._recipe(path, settings, providers)
        own_arena = self._cpu_arena(providers) == "own"
        if not settings.share_weights:
            session, nbytes = _measured(lambda: self._make_session(ort, path, settings, providers))
            key = f"{recipe}#{next(self._unshared)}"
            share = MemoryShare(key, path.name, settings.device, nbytes)
            return OrtSession(
                path, session, settings.intra_op_threads, settings, share, None, own_arena
            )
        lease = self._shared.acquire(  # made by the first opener, waited for by the others
            recipe, functools.partial(self._make_shared, ort, path, settings, providers, recipe)
        )
        return OrtSession(
            path,
            lease.thing.session,
            settings.intra_op_threads,
            settings,
            lease.thing.weights,
            on_close=functools.partial(self._shared.release, lease),  # the last closes it
            own_arena=own_arena,
        )

    def _make_shared(
        self, ort: Any, path: Path, settings: SessionSettings, providers: list[str], recipe: str
    ) -> _SharedSession:
        """The session every opener of ``recipe`` uses, with its weights as measured."""
        session, nbytes = _measured(lambda: self._make_session(ort, path, settings, providers))
        return _SharedSession(session, MemoryShare(recipe, path.name, settings.device, nbytes))

    def _providers(self, ort: Any) -> list[str]:
        """The providers a session asks for: those configured and installed (an error for a
        missing one, unless ``allow_cpu_fallback``)."""
        opts = self.options
        available = ort.get_available_providers()
        missing = [p for p in opts.providers if p not in available]
        if missing and not opts.allow_cpu_fallback:
            raise RuntimeError(
                f"onnxruntime provider(s) {missing} not available in this install "
                f"(available: {available}); install the matching onnxruntime package or set "
                "backends.onnxruntime.allow_cpu_fallback: true"
            )
        return [p for p in opts.providers if p in available] or ["CPUExecutionProvider"]

    def _recipe(self, path: Path, settings: SessionSettings, providers: list[str]) -> str:
        """What makes two sessions of a file interchangeable: the file (where it is, and which
        version of it: a file replaced on disk is another model) and every setting a session is
        made with. Readable up to the file's name, then a digest."""
        made_with = (
            *dataclasses.astuple(file_identity(path)),
            tuple(providers), sorted(self.options.provider_options.items()),
            settings.intra_op_threads, settings.cores, settings.device,
            settings.varying_shapes, self.options.model_dump_json(),
        )  # fmt: skip
        digest = hashlib.sha1(repr(made_with).encode(), usedforsecurity=False).hexdigest()
        return f"{path.name}@{digest[:10]}"

    def _make_session(
        self, ort: Any, path: Path, settings: SessionSettings, providers: list[str]
    ) -> Any:
        opts = self.options
        so = ort.SessionOptions()
        so.intra_op_num_threads = settings.intra_op_threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel(
            _OPT_LEVELS[opts.graph_optimization]
        )
        so.enable_cpu_mem_arena = opts.enable_cpu_mem_arena
        so.enable_mem_pattern = opts.memory_pattern == "on" or (
            opts.memory_pattern == "auto" and not settings.varying_shapes
        )
        if self._cpu_arena(providers) == "shared":
            _register_shared_cpu_arena(ort)
            so.add_session_config_entry("session.use_env_allocators", "1")
        so.log_severity_level = 3
        if settings.cores and settings.intra_op_threads > 1:
            # every intra-op thread but the caller's (already pinned) on the device's cores;
            # onnxruntime counts processors from 1
            cores = ",".join(str(c + 1) for c in settings.cores)
            affinities = ";".join([cores] * (settings.intra_op_threads - 1))
            so.add_session_config_entry("session.intra_op_thread_affinities", affinities)
        so.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if opts.allow_spinning else "0"
        )
        provider_options = [
            provider_options_for(
                p, provider_device_options(p, opts.provider_options.get(p, {}), settings)
            )
            for p in providers
        ]
        session = ort.InferenceSession(
            str(path), sess_options=so, providers=providers, provider_options=provider_options
        )
        in_use = session.get_providers()
        if providers[0] not in in_use and not opts.allow_cpu_fallback:
            raise RuntimeError(
                f"{path.name}: asked for {providers[0]} but onnxruntime runs it on {in_use}"
            )
        return session


_making = threading.Lock()  # one session made at a time, so each one's measure is its own


def _measured(make: Callable[[], Any]) -> tuple[Any, int]:
    """What ``make`` returns and the growth of this process's anonymous resident memory across
    it, once the C heap has given back what making it freed (the parsed model, the graph
    optimiser's work): the weights a session holds, with their optimised and pre-packed copies,
    measured as the engine measures a load. Sessions are made one at a time, and a model's
    instances start one after another (``Instances.start``), so no instance's warm-up is counted
    in another's weights; requests of other models running meanwhile can still add their
    buffers to it."""
    with _making:
        before = resident_bytes()
        made = make()
        trim_heap()
        return made, max(0, resident_bytes() - before)


def provider_device_options(
    provider: str, given: dict[str, Any], settings: SessionSettings
) -> dict[str, Any]:
    """An accelerator provider's options with the instance's device as its ``device_id``
    (``models[].device``), unless the config names one."""
    if provider in DEVICE_PROVIDERS and "device_id" not in given:
        return {**given, "device_id": settings.device}
    return given


def _shrink_options() -> Any:
    """Run options that shrink the session's CPU arena at the run's end."""
    import onnxruntime as ort

    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


def shrink_shared_arena() -> None:
    """Shrink the process's shared CPU arena (if one is registered) to what open sessions use:
    a run of a one-node model with arena shrinkage on (ONNX Runtime has no other call for it).
    Safe while other sessions run: the arena frees only the regions no allocation uses."""
    global _shrinker
    with _init_lock:
        if not _shared_arena_registered:
            return
        if _shrinker is None:
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.add_session_config_entry("session.use_env_allocators", "1")
            _shrinker = ort.InferenceSession(_SHRINK_MODEL, so, providers=[_CPU])
        _shrinker.run(None, {"x": np.zeros(1, dtype=np.float32)}, _shrink_options())


def _register_shared_cpu_arena(ort: Any) -> None:
    """Register the process's one CPU arena with ONNX Runtime's environment (once)."""
    global _shared_arena_registered
    with _init_lock:
        if _shared_arena_registered:
            return
        info = ort.OrtMemoryInfo(
            "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
        )
        # max_mem 0: no cap; extend strategy 1: kSameAsRequested; defaults for the rest
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))
        _shared_arena_registered = True


def _quiet_ort_logging(ort: Any) -> None:
    global _logger_quieted
    with _init_lock:
        if not _logger_quieted:
            ort.set_default_logger_severity(3)
            _logger_quieted = True


def check_model_file(path: Path) -> str:
    """Whether ONNX Runtime can load ``path``, checked the cheapest honest way: a session on the
    CPU with graph optimisation off, one thread and no arena, dropped at once (6–55 ms for each
    demo model; parsing the protobuf alone would miss what only a load finds: unknown operators,
    an opset this install lacks, missing external data). Returns what was checked; raises
    ``ValueError`` with ONNX Runtime's reason. Called by ``duomo check``."""
    import onnxruntime as ort

    _quiet_ort_logging(ort)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.enable_cpu_mem_arena = False
    so.log_severity_level = 3
    try:
        ort.InferenceSession(str(path), sess_options=so, providers=[_CPU])
    except Exception as err:  # onnxruntime's errors (InvalidProtobuf, Fail, …) share no other base
        raise ValueError(f"onnxruntime cannot load it: {err}") from None
    return "loads in onnxruntime"
