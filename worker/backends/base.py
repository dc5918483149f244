"""The backend interface every runtime implements, and the reusable host I/O buffers.

A ``Backend`` is created once per process (one runtime init); ``open`` is called on a model
worker's own thread and returns a ``ModelSession`` that only that thread uses. Executors write
their batch straight into ``session.input_buffer(...)`` views and read outputs from the views
``run`` returns; both live in memory allocated once per session and reused, so the steady state
allocates nothing per request.

Invariant: output views returned by ``run`` stay valid until the next ``run`` on that session.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from duomo.worker.thread_budget import GateMember


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output: name, element type and shape (``None`` = dynamic dimension)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]


@dataclass(frozen=True)
class SessionSettings:
    """What a worker asks of the session it opens."""

    intra_op_threads: int
    gate: GateMember | None = None  # its model's place at the device's compute gate
    device: int = 0  # the device the instance runs on (ACL's device id; ORT's CUDA and CANN)
    cores: tuple[int, ...] = ()  # a cpu device's own cores, its threads pinned there
    device_room_bytes: int | None = None  # device memory the model may still take (budgets)
    varying_shapes: bool = False  # its input shapes change from request to request
    # one copy of a file's weights for every session that opens it alike (``share_weights``)
    share_weights: bool = True
    # its device's compute gate starts one run at a time (``runs_at_once: 1``, ``overdraft:
    # 0``): models there never run together, so they may share one work buffer (ACL)
    runs_alone: bool = False


@dataclass(frozen=True)
class WeightShare:
    """One copy of a model file's weights in this process, used by every session that opened
    the file alike (instances of a model, a replica under another name, a pipeline step).

    ``key`` tells copies apart (two sessions with the same key use the same memory); ``file``
    is the file's name as ``status`` shows it; ``nbytes`` what the copy holds, measured when it
    was made: host memory (ONNX Runtime: the resident growth across the shared session's
    creation) unless ``on_device`` (ACL: the weight buffer, ``query_size``'s weight size). The
    memory ledger charges each key once per device, whatever the number of users.
    """

    key: str
    file: str
    device: int
    nbytes: int
    on_device: bool = False


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


class HostBuffers:
    """Named flat host arrays handed out as shaped views; grown only when a shape needs more.

    Buffers are sized by the warm-up at ``max_batch`` and grow only when a request needs a larger
    shape than any before it (an OCR page larger than the warm-up image, say); they never shrink.
    ``growths`` counts allocations and is shown in ``status`` so a regrowth is visible.
    """

    def __init__(self) -> None:
        self._flat: dict[str, np.ndarray] = {}
        self.growths = 0

    def view(self, name: str, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
        """A view of buffer ``name`` as ``dtype`` at ``shape``, its contents undefined.

        The buffer is reallocated (``growths`` counts it) when it does not exist yet, has
        another dtype, or is smaller than ``shape`` needs; otherwise its memory is reused, so
        the view shares memory with every earlier view of ``name``.
        """
        count = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.dtype != dtype or flat.size < count:
            flat = np.empty(max(count, 1), dtype=dtype)
            self._flat[name] = flat
            self.growths += 1
        return flat[:count].reshape(shape)

    @property
    def nbytes(self) -> int:
        """Bytes held by every buffer."""
        return sum(a.nbytes for a in self._flat.values())


class ModelSession(ABC):
    """One loaded model file, used by exactly one worker thread.

    ``inputs`` and ``outputs`` describe its tensors (``TensorSpec``; ``None`` for a dimension
    of any size). An executor writes a batch into ``input_buffer`` (memory the session reuses,
    so nothing is allocated per batch) and calls ``run``, whose outputs stay valid until the
    next ``run``; ``close`` releases the runtime objects on the same thread.

    Example:
        x = session.input_buffer("x", (2, 4))  # a view of the session's own memory
        x[:] = rows
        y = session.run({"x": x})["y"]
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    metadata: Mapping[str, str]
    path: Path

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
    def buffer_bytes(self) -> int:
        """Bytes of reusable host I/O buffers this session holds."""
        return 0

    @property
    def buffer_growths(self) -> int:
        """Times a buffer had to be (re)allocated; after warm-up it grows only for new maxima."""
        return 0

    @property
    def device_bytes(self) -> int:
        """Accelerator memory this session took when it loaded, not counting the shared
        weights of ``weights`` (0 for host-only runtimes)."""
        return 0

    @property
    def weights(self) -> WeightShare | None:
        """The shared copy of weights this session uses, or None (its weights are its own and
        counted in what its load took)."""
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


class BufferedSession(ModelSession):
    """A session whose host-side inputs and outputs live in ``HostBuffers`` it reuses."""

    def __init__(self) -> None:
        self._in = HostBuffers()
        self._out = HostBuffers()

    def input_buffer(self, name: str, shape: Sequence[int]) -> np.ndarray:
        """A view of the reused input buffer for ``name`` at ``shape``, in the input's dtype.

        Raises:
            KeyError: the model has no tensor of that name.
        """
        return self._in.view(name, self.spec(name).dtype, shape)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of its input and output host buffers."""
        return self._in.nbytes + self._out.nbytes

    def _drop_buffers(self) -> None:
        """On close: the host buffers go with the session, even if something keeps the session
        object itself (an executor referenced by a client's attachment)."""
        self._in = HostBuffers()
        self._out = HostBuffers()

    @property
    def buffer_growths(self) -> int:
        """Allocations of its input and output host buffers so far."""
        return self._in.growths + self._out.growths


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
