"""The records of one model in the supervisor's replies: ``ModelInfo`` (one entry of the
``models`` reply) and ``ModelStatus`` (one model in ``status``), with the parts they are made
of. What each holds, who builds and who reads it: ``duomo.ipc.status_records``; their dict
form is derived from their fields (``ipc.records``), each difference said where it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from duomo.ipc.record_reading import RecordReader
from duomo.ipc.records import LEFT_OUT_WHEN_NONE, Record, left_out_with, wire

SUPERSEDED = "superseded"  # the outcome key of a frame a newer one replaced (no error)

# -- the models reply ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRecord(Record):
    """One slot input or output tensor: its dtype (numpy's name) and shape (None: any size)."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]


@dataclass(frozen=True)
class ModelInfo(Record):
    """One model of the ``models`` reply. ``inputs`` … ``batched`` are known once the model has
    been loaded (its slot layout); before that they are None here and absent on the wire, all
    together (once ``inputs`` is there, a missing ``batched`` is an error)."""

    name: str
    task: str
    backend: str | None  # None: the model is no longer in the config (a reload removed it)
    state: str
    max_batch: int
    inputs: tuple[TensorRecord, ...] | None = field(default=None, metadata=LEFT_OUT_WHEN_NONE)
    # "json": one JSON document per request, else output tensors
    result: str | None = field(default=None, metadata=left_out_with("inputs"))
    outputs: tuple[str, ...] | None = field(default=None, metadata=left_out_with("inputs"))
    output_tensors: tuple[TensorRecord, ...] | None = field(
        default=None, metadata=left_out_with("inputs")
    )
    # the inputs' first dimension is the batch
    batched: bool | None = field(default=None, metadata=left_out_with("inputs"))

    @property
    def loaded(self) -> bool:
        """Its slot layout is known (the loaded-only fields are set)."""
        return self.inputs is not None


# -- one model in status ------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement(Record):
    """One instance of a model: its device, threads, pinned cores and batches served."""

    device: int
    intra_op_threads: int
    cores: tuple[int, ...]
    batches: int


@dataclass(frozen=True)
class StateChange(Record):
    """One entry of a model's state history: when (epoch seconds), the new state, and why."""

    at: float
    state: str
    reason: str


@dataclass(frozen=True)
class WeightCopy(Record):
    """One copy of weights a model's sessions use: its file, device and size, whether it is
    device memory, and the other loaded models using the same copy (a device is charged it
    once)."""

    file: str
    device: int
    bytes: int
    on_device: bool
    shared_with: tuple[str, ...]


@dataclass(frozen=True)
class ModelMemory(Record):
    """A model's memory: whether it holds any, what its load measured, what is charged to its
    budget (by device: its own memory and its weights in full), that budget (None: none), and
    the copies of weights it uses (``weights``; its device is charged each once)."""

    loaded: bool
    measured: dict[str, Any] | None  # host_bytes, device_bytes(_by_device), weights_bytes
    charged_bytes: int | None
    charged_bytes_by_device: dict[str, int | None]
    budget_bytes: int | None
    weights: tuple[WeightCopy, ...] = ()

    @property
    def shared_weights_bytes(self) -> int:
        """Bytes of its weights that other loaded models use too (charged to the device once)."""
        return sum(w.bytes for w in self.weights if w.shared_with)


@dataclass(frozen=True)
class ComputeShare(Record):
    """A model's ``compute_weight`` and its share of its compute gate's time in the recent
    window (0..1; on its first device, and by device): the ``share`` column."""

    weight: float
    share: float
    share_by_device: dict[str, float]


@dataclass(frozen=True)
class GalleryFigures(Record):
    """What a gallery model serves (``worker.galleries``): its identities and their embeddings
    in the snapshot its next batch searches, and the file's change counter it was read at (a
    change to the file is taken at the model's next batch)."""

    identities: int
    embeddings: int
    version: int


@dataclass(frozen=True)
class TimedCount(Record):
    """Triton's count and cumulative nanoseconds of one kind of statistic."""

    count: int
    ns: int


@dataclass(frozen=True)
class StreamShare(Record):
    """One stream's part of a model's load (``ModelCapacity.streams``): the frames per second
    it offers the model, those the model serves it, and its share of all the frames the model
    served its streams (0..1)."""

    offered_fps: float
    served_fps: float
    share: float


@dataclass(frozen=True)
class ModelCapacity(Record):
    """What a model's streams offer it against what it serves them, over the last 5 s
    (``worker.stream_load`` has the definitions): ``state`` ``ok``, or ``over`` when the
    streams lose more than a tenth of their frames to its load; the frames per second offered,
    served and lost; the median time a batch takes (``service_ms``; None before any answer);
    the age bound that follows for its ``latest`` streams (``age_bound_ms``: (⌈streams ÷
    (instances × max_batch)⌉ + 1) service times, plus the batch window — the worst over the
    cameras' frame rates; a camera faster than the model gets at most a service time and a
    frame period; None without streams or a service time); and each stream's part, by name
    (the streams that offered it a frame in the window)."""

    state: str  # ok, over
    offered_fps: float
    served_fps: float
    lost_fps: float
    service_ms: float | None
    age_bound_ms: float | None
    streams: dict[str, StreamShare]


TIMED_KINDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


def _timed(r: RecordReader) -> dict[str, TimedCount]:
    return {kind: TimedCount.from_dict(r.value(kind)) for kind in TIMED_KINDS}


@dataclass(frozen=True)
class Totals(Record):
    """A model's cumulative counts, Triton's statistics: each of ``TIMED_KINDS`` as a count and
    nanoseconds, items inferred, batches executed, and the last inference (epoch ms, 0: none).

    On the wire ``timed`` is no key of its own: each kind is a key of the object, as Triton
    writes its statistics (its ``write`` and ``read``)."""

    timed: dict[str, TimedCount] = field(  # by kind, in TIMED_KINDS order
        metadata=wire(
            write=lambda t: {kind: count.to_dict() for kind, count in t.timed.items()},
            read=_timed,
        )
    )
    inference_count: int
    execution_count: int
    last_inference_ms: int


def error_count(requests: int, outcomes: dict[str, int], refused: dict[str, int]) -> int:
    """Errors, one definition for a model and a pipeline: the requests answered after being
    queued but not ``ok`` (nor SUPERSEDED, which is no error), plus those refused at admission."""
    return requests - outcomes.get("ok", 0) - outcomes.get(SUPERSEDED, 0) + sum(refused.values())


@dataclass(frozen=True)
class ModelStatus(Record):
    """One model in ``status`` (and the ``load`` reply): its state and history, instances and
    placement, queue, counts, latency, memory, compute share and its streams' load.

    **Errors, one definition** (``errors``): every request the model answered with an error —
    those that failed after being queued (``requests`` less the OK and SUPERSEDED ones) *plus*
    those refused at admission before they were queued (``refused``: a bad header, a full
    queue, a model not serving). SUPERSEDED (a ``latest`` stream's frame that a newer one
    replaced) is an outcome, never an error: it is counted on its own (``superseded``). It is
    the caller's view, the same as ``/metrics``' ``failure_total``: a refused request is a
    failed request to whoever sent it. ``duomo status``, ``--watch`` and ``--json`` (the
    ``errors`` key) all show this figure; ``requests`` counts only the requests that were
    queued. ``errors`` and ``superseded`` are written to the JSON after ``refused`` and derived
    again when it is read (never read from it: one definition; ``refused``'s ``then``).
    ``compute`` is left out of the ``load`` reply (None).
    """

    state: str
    instances: int
    max_batch: int
    batch_window_ms: float | None  # the window ``max_delay_ms: auto`` chose (None: fixed)
    devices: tuple[int, ...]
    intra_op_threads: int
    placement: tuple[Placement, ...]
    queue_depth: int
    in_flight: int
    io_buffer_bytes: int
    io_buffer_growths: int
    consecutive_failures: int
    restarts_in_window: int
    loads: int
    evictions: int
    reinitializations: int
    restart_attempts: dict[str, int]  # by cause: failing, hung
    predictive: dict[str, int]  # loads, hits, wasted
    abandoned_workers: int
    last_error: str | None
    idle_s: float | None
    history: tuple[StateChange, ...]
    requests: int  # answered after being queued (refusals are not among them)
    outcomes: dict[str, int]  # those by outcome: "ok" or an error code in lower case
    # refused before being queued, by error code in lower case
    refused: dict[str, int] = field(
        metadata=wire(then=lambda m: {"errors": m.errors, "superseded": m.superseded})
    )
    latency: dict[str, dict[str, float]]  # stage -> p50_ms, p90_ms, p99_ms ({}: none yet)
    batch_sizes: dict[str, int]  # batch size -> batches run
    totals: Totals
    memory: ModelMemory
    idle_spin: dict[str, int]  # waits, spun, caught
    preload: bool | None  # None: no longer in the config
    evictable: bool | None
    capacity: ModelCapacity
    compute: ComputeShare | None = field(default=None, metadata=LEFT_OUT_WHEN_NONE)
    gallery: GalleryFigures | None = field(default=None, metadata=LEFT_OUT_WHEN_NONE)

    @property
    def ok(self) -> int:
        return self.outcomes.get("ok", 0)  # (an outcome nothing has had yet is absent)

    @property
    def superseded(self) -> int:
        """Answered SUPERSEDED: a newer frame of their stream took their place (no error)."""
        return self.outcomes.get(SUPERSEDED, 0)

    @property
    def errors(self) -> int:
        """Failed after being queued plus refused at admission, SUPERSEDED in neither (the
        class docstring; ``error_count``)."""
        return error_count(self.requests, self.outcomes, self.refused)

    def latency_ms(self, quantile: str, stage: str = "total") -> float | None:
        """``quantile`` ("p50", "p90", "p99") of ``stage`` in ms; None before any success."""
        return self.latency.get(stage, {}).get(f"{quantile}_ms")
