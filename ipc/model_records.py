"""The records of one model in the supervisor's replies: ``ModelInfo`` (one entry of the
``models`` reply) and ``ModelStatus`` (one model in ``status``), with the parts they are made
of. What each holds, who builds and who reads it: ``duomo.ipc.status_records``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from duomo.ipc.record_reading import JSON, RecordReader, read_counts

SUPERSEDED = "superseded"  # the outcome key of a frame a newer one replaced (no error)

# -- the models reply ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRecord:
    """One slot input or output tensor: its dtype (numpy's name) and shape (None: any size)."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]

    def to_dict(self) -> JSON:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: object) -> TensorRecord:
        r = RecordReader("TensorRecord", data)
        shape = r.array("shape")
        if not all(d is None or type(d) is int for d in shape):
            raise r.wrong("shape", "a list of integers or nulls")
        return cls(r.text("name"), r.text("dtype"), tuple(shape))


@dataclass(frozen=True)
class ModelInfo:
    """One model of the ``models`` reply. ``inputs`` … ``batched`` are known once the model has
    been loaded (its slot layout); before that they are None here and absent on the wire."""

    name: str
    task: str
    backend: str | None  # None: the model is no longer in the config (a reload removed it)
    state: str
    max_batch: int
    inputs: tuple[TensorRecord, ...] | None = None
    result: str | None = None  # "json": one JSON document per request, else output tensors
    outputs: tuple[str, ...] | None = None
    output_tensors: tuple[TensorRecord, ...] | None = None
    batched: bool | None = None  # the inputs' first dimension is the batch

    @property
    def loaded(self) -> bool:
        """Its slot layout is known (the loaded-only fields are set)."""
        return self.inputs is not None

    def to_dict(self) -> JSON:
        shown: JSON = {
            "name": self.name,
            "task": self.task,
            "backend": self.backend,
            "state": self.state,
            "max_batch": self.max_batch,
        }
        if self.inputs is not None:
            shown["inputs"] = [t.to_dict() for t in self.inputs]
            shown["result"] = self.result
            shown["outputs"] = list(self.outputs or ())
            shown["output_tensors"] = [t.to_dict() for t in self.output_tensors or ()]
            shown["batched"] = self.batched
        return shown

    @classmethod
    def from_dict(cls, data: object) -> ModelInfo:
        r = RecordReader("ModelInfo", data)
        head = (r.text("name"), r.text("task"), r.optional_text("backend"), r.text("state"))
        max_batch = r.integer("max_batch")
        if "inputs" not in r.data:
            return cls(*head, max_batch)
        outputs = r.array("outputs")
        if not all(isinstance(o, str) for o in outputs):
            raise r.wrong("outputs", "a list of names")
        return cls(
            *head, max_batch,
            inputs=r.records("inputs", TensorRecord.from_dict),
            result=r.optional_text("result"),
            outputs=tuple(outputs),
            output_tensors=r.records("output_tensors", TensorRecord.from_dict),
            batched=r.flag("batched"),
        )  # fmt: skip


# -- one model in status ------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """One instance of a model: its device, threads, pinned cores and batches served."""

    device: int
    intra_op_threads: int
    cores: tuple[int, ...]
    batches: int

    def to_dict(self) -> JSON:
        return {
            "device": self.device,
            "intra_op_threads": self.intra_op_threads,
            "cores": list(self.cores),
            "batches": self.batches,
        }

    @classmethod
    def from_dict(cls, data: object) -> Placement:
        r = RecordReader("Placement", data)
        return cls(
            r.integer("device"),
            r.integer("intra_op_threads"),
            tuple(r.array("cores")),
            r.integer("batches"),
        )


@dataclass(frozen=True)
class StateChange:
    """One entry of a model's state history: when (epoch seconds), the new state, and why."""

    at: float
    state: str
    reason: str

    def to_dict(self) -> JSON:
        return {"at": self.at, "state": self.state, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: object) -> StateChange:
        r = RecordReader("StateChange", data)
        return cls(r.number("at"), r.text("state"), r.text("reason"))


@dataclass(frozen=True)
class WeightCopy:
    """One copy of weights a model's sessions use: its file, device and size, whether it is
    device memory, and the other loaded models using the same copy (a device is charged it
    once)."""

    file: str
    device: int
    bytes: int
    on_device: bool
    shared_with: tuple[str, ...]

    def to_dict(self) -> JSON:
        return {
            "file": self.file, "device": self.device, "bytes": self.bytes,
            "on_device": self.on_device, "shared_with": list(self.shared_with),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: object) -> WeightCopy:
        r = RecordReader("WeightCopy", data)
        users = r.array("shared_with")
        if not all(isinstance(u, str) for u in users):
            raise r.wrong("shared_with", "a list of model names")
        return cls(
            r.text("file"), r.integer("device"), r.integer("bytes"), r.flag("on_device"),
            tuple(users),
        )  # fmt: skip


@dataclass(frozen=True)
class ModelMemory:
    """A model's memory: whether it holds any, what its load measured, what is charged to its
    budget (by device: its own memory and its weights in full), that budget (None: none), and
    the copies of weights it uses (``weights``; its device is charged each once)."""

    loaded: bool
    measured: dict[str, Any] | None  # host_bytes, device_bytes(_by_device), weights_bytes
    charged_bytes: int | None
    charged_bytes_by_device: dict[str, int | None]
    budget_bytes: int | None
    weights: tuple[WeightCopy, ...] = ()

    def to_dict(self) -> JSON:
        return {
            "loaded": self.loaded,
            "measured": self.measured,
            "charged_bytes": self.charged_bytes,
            "charged_bytes_by_device": dict(self.charged_bytes_by_device),
            "budget_bytes": self.budget_bytes,
            "weights": [w.to_dict() for w in self.weights],
        }

    @property
    def shared_weights_bytes(self) -> int:
        """Bytes of its weights that other loaded models use too (charged to the device once)."""
        return sum(w.bytes for w in self.weights if w.shared_with)

    @classmethod
    def from_dict(cls, data: object) -> ModelMemory:
        r = RecordReader("ModelMemory", data)
        return cls(
            r.flag("loaded"), r.optional_object("measured"), r.optional_integer("charged_bytes"),
            r.object("charged_bytes_by_device"), r.optional_integer("budget_bytes"),
            r.records("weights", WeightCopy.from_dict),
        )  # fmt: skip


@dataclass(frozen=True)
class ComputeShare:
    """A model's ``compute_weight`` and its share of its compute gate's time in the recent
    window (0..1; on its first device, and by device): the ``share`` column."""

    weight: float
    share: float
    share_by_device: dict[str, float]

    def to_dict(self) -> JSON:
        return {
            "weight": self.weight,
            "share": self.share,
            "share_by_device": dict(self.share_by_device),
        }

    @classmethod
    def from_dict(cls, data: object) -> ComputeShare:
        r = RecordReader("ComputeShare", data)
        return cls(r.number("weight"), r.number("share"), r.object("share_by_device"))


@dataclass(frozen=True)
class TimedCount:
    """Triton's count and cumulative nanoseconds of one kind of statistic."""

    count: int
    ns: int

    def to_dict(self) -> JSON:
        return {"count": self.count, "ns": self.ns}

    @classmethod
    def from_dict(cls, data: object) -> TimedCount:
        r = RecordReader("TimedCount", data)
        return cls(r.integer("count"), r.integer("ns"))


@dataclass(frozen=True)
class StreamShare:
    """One stream's part of a model's load (``ModelCapacity.streams``): the frames per second
    it offers the model, those the model serves it, and its share of all the frames the model
    served its streams (0..1)."""

    offered_fps: float
    served_fps: float
    share: float

    def to_dict(self) -> JSON:
        return {"offered_fps": self.offered_fps, "served_fps": self.served_fps, "share": self.share}

    @classmethod
    def from_dict(cls, data: object) -> StreamShare:
        r = RecordReader("StreamShare", data)
        return cls(r.number("offered_fps"), r.number("served_fps"), r.number("share"))


@dataclass(frozen=True)
class ModelCapacity:
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

    def to_dict(self) -> JSON:
        return {
            "state": self.state,
            "offered_fps": self.offered_fps,
            "served_fps": self.served_fps,
            "lost_fps": self.lost_fps,
            "service_ms": self.service_ms,
            "age_bound_ms": self.age_bound_ms,
            "streams": {name: share.to_dict() for name, share in self.streams.items()},
        }

    @classmethod
    def from_dict(cls, data: object) -> ModelCapacity:
        r = RecordReader("ModelCapacity", data)
        return cls(
            r.text("state"), r.number("offered_fps"), r.number("served_fps"),
            r.number("lost_fps"), r.optional_number("service_ms"),
            r.optional_number("age_bound_ms"),
            {name: StreamShare.from_dict(s) for name, s in r.object("streams").items()},
        )  # fmt: skip


TIMED_KINDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


@dataclass(frozen=True)
class Totals:
    """A model's cumulative counts, Triton's statistics: each of ``TIMED_KINDS`` as a count and
    nanoseconds, items inferred, batches executed, and the last inference (epoch ms, 0: none)."""

    timed: dict[str, TimedCount]  # by kind, in TIMED_KINDS order
    inference_count: int
    execution_count: int
    last_inference_ms: int

    def to_dict(self) -> JSON:
        shown: JSON = {kind: count.to_dict() for kind, count in self.timed.items()}
        shown.update(
            inference_count=self.inference_count,
            execution_count=self.execution_count,
            last_inference_ms=self.last_inference_ms,
        )
        return shown

    @classmethod
    def from_dict(cls, data: object) -> Totals:
        r = RecordReader("Totals", data)
        timed = {kind: TimedCount.from_dict(r._get(kind)) for kind in TIMED_KINDS}
        return cls(
            timed,
            r.integer("inference_count"),
            r.integer("execution_count"),
            r.integer("last_inference_ms"),
        )


@dataclass(frozen=True)
class ModelStatus:
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
    queued. ``errors`` and ``superseded`` are written to the JSON and derived again when it
    is read (never read from it: one definition).
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
    refused: dict[str, int]  # refused before being queued, by error code in lower case
    latency: dict[str, dict[str, float]]  # stage -> p50_ms, p90_ms, p99_ms ({}: none yet)
    batch_sizes: dict[str, int]  # batch size -> batches run
    totals: Totals
    memory: ModelMemory
    idle_spin: dict[str, int]  # waits, spun, caught
    preload: bool | None  # None: no longer in the config
    evictable: bool | None
    capacity: ModelCapacity
    compute: ComputeShare | None = None  # absent in the ``load`` reply only

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
        class docstring)."""
        return self.requests - self.ok - self.superseded + sum(self.refused.values())

    def latency_ms(self, quantile: str, stage: str = "total") -> float | None:
        """``quantile`` ("p50", "p90", "p99") of ``stage`` in ms; None before any success."""
        return self.latency.get(stage, {}).get(f"{quantile}_ms")

    def to_dict(self) -> JSON:
        shown: JSON = {
            "state": self.state,
            "instances": self.instances,
            "max_batch": self.max_batch,
            "batch_window_ms": self.batch_window_ms,
            "devices": list(self.devices),
            "intra_op_threads": self.intra_op_threads,
            "placement": [p.to_dict() for p in self.placement],
            "queue_depth": self.queue_depth,
            "in_flight": self.in_flight,
            "io_buffer_bytes": self.io_buffer_bytes,
            "io_buffer_growths": self.io_buffer_growths,
            "consecutive_failures": self.consecutive_failures,
            "restarts_in_window": self.restarts_in_window,
            "loads": self.loads,
            "evictions": self.evictions,
            "reinitializations": self.reinitializations,
            "restart_attempts": dict(self.restart_attempts),
            "predictive": dict(self.predictive),
            "abandoned_workers": self.abandoned_workers,
            "last_error": self.last_error,
            "idle_s": self.idle_s,
            "history": [h.to_dict() for h in self.history],
            "requests": self.requests,
            "outcomes": dict(self.outcomes),
            "refused": dict(self.refused),
            "errors": self.errors,
            "superseded": self.superseded,
            "latency": {stage: dict(q) for stage, q in self.latency.items()},
            "batch_sizes": dict(self.batch_sizes),
            "totals": self.totals.to_dict(),
            "memory": self.memory.to_dict(),
            "idle_spin": dict(self.idle_spin),
            "preload": self.preload,
            "evictable": self.evictable,
            "capacity": self.capacity.to_dict(),
        }
        if self.compute is not None:
            shown["compute"] = self.compute.to_dict()
        return shown

    @classmethod
    def from_dict(cls, data: object) -> ModelStatus:
        r = RecordReader("ModelStatus", data)
        compute = r.data.get("compute")
        return cls(
            state=r.text("state"),
            instances=r.integer("instances"),
            max_batch=r.integer("max_batch"),
            batch_window_ms=r.optional_number("batch_window_ms"),
            devices=tuple(r.array("devices")),
            intra_op_threads=r.integer("intra_op_threads"),
            placement=r.records("placement", Placement.from_dict),
            queue_depth=r.integer("queue_depth"),
            in_flight=r.integer("in_flight"),
            io_buffer_bytes=r.integer("io_buffer_bytes"),
            io_buffer_growths=r.integer("io_buffer_growths"),
            consecutive_failures=r.integer("consecutive_failures"),
            restarts_in_window=r.integer("restarts_in_window"),
            loads=r.integer("loads"),
            evictions=r.integer("evictions"),
            reinitializations=r.integer("reinitializations"),
            restart_attempts=read_counts(r, "restart_attempts"),
            predictive=read_counts(r, "predictive"),
            abandoned_workers=r.integer("abandoned_workers"),
            last_error=r.optional_text("last_error"),
            idle_s=r.optional_number("idle_s"),
            history=r.records("history", StateChange.from_dict),
            requests=r.integer("requests"),
            outcomes=read_counts(r, "outcomes"),
            refused=read_counts(r, "refused"),
            latency={k: dict(v) for k, v in r.object("latency").items()},
            batch_sizes=read_counts(r, "batch_sizes"),
            totals=Totals.from_dict(r._get("totals")),
            memory=ModelMemory.from_dict(r._get("memory")),
            idle_spin=read_counts(r, "idle_spin"),
            preload=r.optional_flag("preload"),
            evictable=r.optional_flag("evictable"),
            capacity=ModelCapacity.from_dict(r._get("capacity")),
            compute=None if compute is None else ComputeShare.from_dict(compute),
        )
