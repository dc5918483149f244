"""The backend interface every runtime implements, and the reusable host I/O buffers.

A ``Backend`` is created once per process (one runtime init); ``open`` is called on a model
worker's own thread and returns a ``ModelSession`` that only that thread uses. Executors write
their batch straight into ``session.input_buffer(...)`` views and read outputs from the views
``run`` returns; both live in memory allocated once per session and reused, so the steady state
allocates nothing per request. What a session holds in memory (those buffers, its device
memory, the copies it shares with other sessions) is its ``memory``, a ``SessionMemory``: what the
memory ledger and ``status`` read, and the two calls below.

Invariant: output views returned by ``run`` stay valid until the next ``run`` on that session.

A one-off request gives its memory back. The model worker calls ``memory.settle`` once its
warm-up is over; from then on a buffer grows and is kept only up to ``ONE_OFF_FACTOR`` times the
bytes the warm-up gave it, and a run whose inputs take more than that factor times the warm-up's
is a one-off run (a 10 000 × 10 000 frame's OCR detector input): its buffers are its own, freed
as soon as the executor drops them, and once the worker has answered the batch it calls
``memory.release_one_off``, which makes the session hand back what the run left in its runtime's
pools (``give_back``: ONNX Runtime's shared arena). Measured on the demo models:
docs/operations.md, "What a large frame costs".
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from duomo.worker.thread_budget import GateMember


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output: name, element type and shape (``None`` = dynamic dimension)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]


@dataclass(frozen=True)
class DeviceRoom:
    """What the budgets leave a model on one accelerator device as it loads (the memory
    ledger's ``rooms``): ``model_bytes``, its own ``memory_budget_mb``, what it may be charged
    alone; ``device_bytes``, what the device's budget has left beside the models loaded there.
    None: no such budget. The ACL backend checks ``query_size``'s figures against both before
    it allocates anything."""

    model_bytes: int | None = None
    device_bytes: int | None = None


@dataclass(frozen=True)
class SessionSettings:
    """What a worker asks of the session it opens."""

    intra_op_threads: int
    gate: GateMember | None = None  # its model's place at the device's compute gate
    device: int = 0  # the device the instance runs on (ACL's device id; ORT's CUDA and CANN)
    cores: tuple[int, ...] = ()  # a cpu device's own cores, its threads pinned there
    room: DeviceRoom = DeviceRoom()  # device memory the model may still take (budgets)
    varying_shapes: bool = False  # its input shapes change from request to request
    # one copy of a file's weights for every session that opens it alike (``share_weights``)
    share_weights: bool = True
    # its device's compute gate starts one run at a time (``runs_at_once: 1``, ``overdraft:
    # 0``): models there never run together, so they may share one work buffer (ACL)
    runs_alone: bool = False


@dataclass(frozen=True)
class MemoryShare:
    """Memory several sessions in this process use as one, charged once per device: one copy
    of a model file's weights, used by every session that opened the file alike (instances of a
    model, a replica under another name, a pipeline step); or, ``kind`` "work", the work buffer
    the models of an ACL device that runs one model at a time share.

    ``key`` tells copies apart (two sessions with the same key use the same memory); ``file``
    is the file's name as ``status`` shows it (a work buffer's: "work buffer"); ``nbytes`` what
    the copy holds, measured when it was made: host memory (ONNX Runtime: the resident growth
    across the shared session's creation) unless ``on_device`` (ACL: the buffer,
    ``query_size``'s size). The memory ledger charges each key once per device, whatever the
    number of users; ``status`` and the weights series of ``/metrics`` show the weights. A model
    alone (its ``memory_budget_mb``, what a load of it needs) is charged ``alone_bytes`` of it:
    a shared work buffer sized by a larger model costs it only its own work.
    """

    key: str
    file: str
    device: int
    nbytes: int
    on_device: bool = False
    kind: Literal["weights", "work"] = "weights"
    alone_bytes: int | None = None  # what a model using it is charged alone; None: nbytes

    @property
    def charged_alone(self) -> int:
        """What a model using it is charged for it, alone."""
        return self.nbytes if self.alone_bytes is None else self.alone_bytes


class NotEnoughDeviceMemoryError(RuntimeError):
    """A model's own size estimate (ACL ``query_size``) does not fit the room its budgets leave;
    raised before anything is allocated, so the engine can make room and try again."""

    def __init__(self, path: Path, needed: int, room: int, device: int = 0) -> None:
        super().__init__(
            f"{path.name} needs {needed / 2**20:.2f} MB of device memory (query_size: work + "
            f"weights), and its budgets leave {room / 2**20:.2f} MB on device {device}"
        )
        self.needed = needed
        self.room = room
        self.device = device


# A request needing more than this many times the bytes of its model's warm-up is a one-off: what
# it takes goes back once it is answered (an image twice the warm-up's side is four times its bytes)
ONE_OFF_FACTOR = 4


class HostBuffers:
    """Named flat host arrays handed out as shaped views; grown only when a shape needs more.

    Buffers are sized by the warm-up at ``max_batch``. Before ``settle`` a buffer grows to any
    shape asked of it and keeps that size. After it, a buffer still grows for a larger shape, up
    to ``ONE_OFF_FACTOR`` times the bytes it had when settled, and keeps that size; a shape that
    needs more gets an array of its own (a one-off), not kept: it is freed when the caller drops
    it, so a one-off giant frame leaves nothing behind. ``growths`` counts every allocation
    (kept or one-off) and is shown in ``status`` so a regrowth is visible.
    """

    def __init__(self) -> None:
        self._flat: dict[str, np.ndarray] = {}
        # bytes each buffer may grow to and be kept; None until ``settle``
        self._kept_limit: dict[str, int] | None = None
        self.growths = 0

    def settle(self) -> None:
        """The warm-up is over: from now on each buffer is kept up to ``ONE_OFF_FACTOR`` times
        its present size (a buffer the warm-up never made has no usual size: it grows and is
        kept as before)."""
        self._kept_limit = {name: ONE_OFF_FACTOR * a.nbytes for name, a in self._flat.items()}

    def view(self, name: str, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
        """A view of buffer ``name`` as ``dtype`` at ``shape``, its contents undefined.

        The buffer is reallocated (``growths`` counts it) when it does not exist yet, has
        another dtype, or is smaller than ``shape`` needs; otherwise its memory is reused, so
        the view shares memory with every earlier view of ``name``. After ``settle``, a shape
        past the buffer's limit gets a new array of its own instead, which shares memory with
        nothing and is not kept.
        """
        count = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.dtype != dtype or flat.size < count:
            flat = np.empty(max(count, 1), dtype=dtype)
            self.growths += 1
            limit = None if self._kept_limit is None else self._kept_limit.get(name)
            if limit is not None and flat.nbytes > limit:
                return flat[:count].reshape(shape)
            self._flat[name] = flat
        return flat[:count].reshape(shape)

    @property
    def nbytes(self) -> int:
        """Bytes held by every buffer (not counting one-off arrays)."""
        return sum(a.nbytes for a in self._flat.values())


class SessionMemory:
    """What one session holds in memory, as the memory ledger and ``status`` read it, and the two
    calls by which the model worker has it give memory back: a session's ``memory``.

    This one holds nothing (a session whose runtime keeps no reusable buffers: a test double);
    ``HostMemory`` is a ``BufferedSession``'s, and a runtime's subclass adds what it shares
    (``weights``) or holds on a device.
    """

    def settle(self) -> None:
        """The warm-up is over (called once by the model worker): what it sized is the usual
        size, and a request far above it is a one-off (see the module docstring)."""

    def release_one_off(self) -> bool:
        """After a batch is answered (called by the model worker): if a one-off run happened
        since the last call, hand back what it left in the runtime's pools. Whether it did."""
        return False

    @property
    def buffer_bytes(self) -> int:
        """Bytes of reusable host I/O buffers the session holds."""
        return 0

    @property
    def buffer_growths(self) -> int:
        """Times a buffer had to be (re)allocated; after warm-up it grows only for new maxima."""
        return 0

    @property
    def device_bytes(self) -> int:
        """Accelerator memory the session took when it loaded, not counting the shared weights
        of ``weights`` (0 for host-only runtimes)."""
        return 0

    @property
    def weights(self) -> MemoryShare | None:
        """The shared copy of weights the session uses, or None (its weights are its own and
        counted in what its load took)."""
        return None

    @property
    def shared_work(self) -> MemoryShare | None:
        """The work buffer the session shares with other models (ACL, on a device that runs
        one model at a time), or None (its work is its own, counted in ``device_bytes``)."""
        return None


class ModelSession(ABC):
    """One loaded model file, used by exactly one worker thread.

    ``inputs`` and ``outputs`` describe its tensors (``TensorSpec``; ``None`` for a dimension
    of any size). An executor writes a batch into ``input_buffer`` (memory the session reuses,
    so nothing is allocated per batch) and calls ``run``, whose outputs stay valid until the
    next ``run``; ``close`` releases the runtime objects on the same thread. What it holds in
    memory, and the calls that give some back, are its ``memory`` (``SessionMemory``).

    Example:
        x = session.input_buffer("x", (2, 4))  # a view of the session's own memory
        x[:] = rows
        y = session.run({"x": x})["y"]
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    metadata: Mapping[str, str]
    path: Path
    memory: SessionMemory = SessionMemory()  # holds nothing; a runtime's session has its own

    @abstractmethod
    def input_buffer(self, name: str, shape: Sequence[int]) -> np.ndarray:
        """A writable view of this session's reusable memory for input ``name`` at ``shape``."""

    @abstractmethod
    def run(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Execute once. Outputs are views valid until the next ``run``.

        With ``outputs`` (arrays of the right shapes, e.g. views into a slot's output area) the
        results are written there instead, and those arrays are returned.
        """

    def expected_output_shapes(
        self, inputs: Mapping[str, np.ndarray]
    ) -> list[tuple[int, ...]] | None:
        """Output shapes for ``inputs`` when the session knows them in advance, else None."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release the runtime objects; the session is unusable afterwards."""

    @property
    def max_rows(self) -> int | None:
        """The most rows one run takes (a compiled model's largest batch), None if unbounded."""
        return None

    @property
    def hw_gears(self) -> tuple[tuple[int, int], ...]:
        """The image sizes (H, W) a compiled model takes, when only those; () when any."""
        return ()

    def spec(self, name: str) -> TensorSpec:
        """The ``TensorSpec`` of the input or output called ``name``.

        Raises:
            KeyError: the model has no tensor of that name.
        """
        for spec in (*self.inputs, *self.outputs):
            if spec.name == name:
                return spec
        raise KeyError(f"{self.path.name} has no tensor named {name!r}")


class HostMemory(SessionMemory):
    """A ``BufferedSession``'s memory: its input and output ``HostBuffers``, the bytes of its
    warm-up's inputs, whether a one-off run is waiting to be given back, and the copy of weights
    it shares (``weights``, given by its runtime).

    Its session's ``run`` calls ``note_run`` with the inputs, so a one-off run (see the module
    docstring) is known; ``give_back`` is what the runtime does after one, once the batch is
    answered."""

    def __init__(
        self, give_back: Callable[[], None] | None = None, weights: MemoryShare | None = None
    ) -> None:
        self.inputs = HostBuffers()
        self.outputs = HostBuffers()
        self._give_back = give_back
        self._weights = weights
        # each input's largest bytes in the warm-up's runs; frozen by ``settle``
        self._usual_bytes: dict[str, int] = {}
        self._settled = False
        self._one_off_pending = False  # a one-off run since the last ``release_one_off``

    def note_run(self, inputs: Mapping[str, np.ndarray]) -> bool:
        """Called by ``run`` with its inputs: whether this run is a one-off (after ``settle``,
        an input of more than ``ONE_OFF_FACTOR`` times the bytes it had in the warm-up's
        runs; an input the warm-up never ran has no usual size). Before ``settle`` it records
        those bytes."""
        usual = self._usual_bytes
        if not self._settled:
            for name, array in inputs.items():
                usual[name] = max(usual.get(name, 0), array.nbytes)
            return False
        for name, array in inputs.items():
            if array.nbytes > ONE_OFF_FACTOR * usual.get(name, array.nbytes):
                self._one_off_pending = True
                return True
        return False

    def settle(self) -> None:
        """The warm-up is over: its buffers' sizes and its runs' input bytes are the usual."""
        self.inputs.settle()
        self.outputs.settle()
        self._settled = True

    def release_one_off(self) -> bool:
        """After a batch is answered: ``give_back`` if a one-off run happened since the last
        call. Whether one did."""
        if not self._one_off_pending:
            return False
        self._one_off_pending = False
        if self._give_back is not None:
            self._give_back()
        return True

    @property
    def buffer_bytes(self) -> int:
        """Bytes of its input and output host buffers (one-off arrays are not kept)."""
        return self.inputs.nbytes + self.outputs.nbytes

    @property
    def buffer_growths(self) -> int:
        """Allocations of its input and output host buffers so far (one-offs included)."""
        return self.inputs.growths + self.outputs.growths

    @property
    def weights(self) -> MemoryShare | None:
        """The copy of weights its runtime said it shares, or None (its own)."""
        return self._weights

    def drop_buffers(self) -> None:
        """On close: the host buffers go with the session, even if something keeps the session
        object itself (an executor referenced by a client's attachment)."""
        self.inputs = HostBuffers()
        self.outputs = HostBuffers()


class BufferedSession(ModelSession):
    """A session whose host-side inputs and outputs live in the ``HostBuffers`` of its
    ``memory`` (``HostMemory``), reused from run to run.

    Its ``run`` calls ``memory.note_run`` with the inputs; ``give_back`` is what a runtime does
    after a one-off run, once the batch is answered."""

    memory: HostMemory

    def __init__(self, memory: HostMemory | None = None) -> None:
        """``memory``: the runtime's (it shares weights, holds device buffers); by default host
        buffers alone, giving back through ``give_back``."""
        self.memory = memory if memory is not None else HostMemory(self.give_back)

    def input_buffer(self, name: str, shape: Sequence[int]) -> np.ndarray:
        """A view of the reused input buffer for ``name`` at ``shape``, in the input's dtype
        (after ``settle``, an array of its own for a shape far past the warm-up's).

        Raises:
            KeyError: the model has no tensor of that name.
        """
        return self.memory.inputs.view(name, self.spec(name).dtype, shape)

    def give_back(self) -> None:
        """Hand back to the system what a one-off run left in the runtime's memory pools."""


class Backend(ABC):
    """A runtime initialised once per process: it opens model files into sessions.

    The engine creates one per config (``create_backend``: ``onnxruntime`` or ``acl``, each
    imported only when used); every model instance calls ``open`` on its own worker thread and
    uses the ``ModelSession`` it returns only there (for ACL the context is per thread). After
    an unload or eviction the engine calls ``release_free_memory``; ``close`` comes last, once
    every session is closed. A new runtime is one subclass and one case in ``create_backend``.

    Example:
        class EchoBackend(Backend):  # a test double: each session returns its inputs
            name = "echo"

            def open(self, path: Path, settings: SessionSettings) -> ModelSession:
                return EchoSession(path)  # a ModelSession subclass
    """

    name: str

    @abstractmethod
    def open(self, path: Path, settings: SessionSettings) -> ModelSession:
        """Load ``path``; called on the worker thread that will use the session."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing process-wide
        """Release process-wide runtime state after every session is closed."""

    def release_free_memory(self) -> None:  # noqa: B027 - most backends pool nothing
        """Hand back memory a process-wide pool holds but no open session uses (called by the
        engine after an unload, an eviction or a failed load)."""
