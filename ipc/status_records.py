"""The supervisor's replies about itself, as records: each made by its owner, assembled by the
supervisor, read by the gateway, producers (``Client.status``, ``Client.models``), ``duomo
status``, its ``--watch`` view and ``duomo stream``.

Each record is made by its owner (the table's "made by") and travels as a record up to the
wire, where one ``to_dict`` writes it; nobody builds a dict to read it back. It is a frozen
dataclass whose ``to_dict`` (the JSON object on the wire, key for key and in the order
``docs/operations.md`` documents) and ``from_dict`` (that object read back, on the other side of
the wire) are derived from its fields once (``ipc.records``); where a field's wire form differs,
the record's docstring says how. A key that is missing, or holds a value of the wrong type,
raises ``StatusRecordError`` naming the record and the key — never a default, so a renamed key
fails loudly instead of showing 0 or "UNKNOWN". A field that may be ``null`` on the wire is
``X | None`` here; ``null`` and a missing key are not the same thing (only ``ModelInfo``'s
loaded-only keys, ``ModelStatus.compute``, ``SupervisorStatus.streams``, ``.pipelines``,
``.sources`` and ``.sinks`` may be absent).

======================  ====================================  ========================  ============
record                  what it holds                         made by                   read by
======================  ====================================  ========================  ============
``ModelInfo``           one model of the ``models`` reply:    ``supervisor.process.     gateway
                        name, task, backend, state,           control_handlers``        (``model_
                        max_batch; once loaded its slot                                 view``),
                        inputs and outputs                                              producers
                        (``TensorRecord``)
``ModelStatus``         one model in ``status``: state,       ``worker.model_status``   CLI table,
                        queue, counts by outcome and          (the served model; the    ``--watch``,
                        refusals, latency, totals, memory,    engine hands it memory,   gateway
                        compute share, its streams' load      compute share, flags);    stats
                        (``ModelCapacity``, ``StreamShare``)  a pipeline's: ``Served
                                                              Pipeline.model_status``
``DeviceStatus``        one device: memory charged and        ``supervisor.core.        CLI,
                        budget, its own telemetry             engine_status``           ``--watch``
``ClientStatus``        one attached client and its rings     ``supervisor.process.     CLI,
                        (``RingStatus``)                      server``                  ``--watch``
``GatewayWorkerStatus`` one gateway worker process            ``supervisor.process.     CLI,
                                                              gateways``                ``--watch``
``StreamStatus``        one stream (a camera): its            ``supervisor.dataflow.    CLI,
                        liveness, settings, and per model     streams`` (the            ``--watch``,
                        its figures                           registry's snapshot)      /metrics,
                        (``StreamModelFigures``)                                        ``duomo
                                                                                        stream``
``PipelineStatus``      one pipeline: its state, requests,    ``supervisor.dataflow.    CLI,
                        latency, objects per frame            pipelines``               ``--watch``,
                        (``PipelineObjects``) and per step    (``ServedPipeline``)      ``/metrics``
                        its counts (``PipelineStepStatus``)                             (the steps)
``SourceStatus``        one managed source: its masked URL,   ``supervisor.sources.     CLI, gateway
                        state, worker, figures, last error    fleet``                   ``--watch``,
                        (``ipc.source_records``)                                        ``/metrics``
``SinkStatus``          one sink: state and reason,           ``sinks.delivery``, in    CLI,
                        published, pending, dropped, errors,  the sink worker           ``--watch``,
                        ack delay (``ipc.sink_records``)                                ``/metrics``
``SupervisorStatus``    the whole ``status`` reply: the       ``Supervisor.status``,    CLI,
                        process, its limits, and the records  from the records above    ``--watch``,
                        above                                 (the engine's in its      producers
                                                              ``EngineStatus``)
======================  ====================================  ========================  ============

One model's records are in ``duomo.ipc.model_records`` (``ModelInfo``, ``ModelStatus`` and
their parts), their dict form in ``duomo.ipc.records``; this module holds the rest and names
them all. The records import nothing but the standard library and ``ipc.errors``: ``ipc`` stays
light.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from duomo.ipc.model_records import (
    ComputeShare,
    ModelCapacity,
    ModelInfo,
    ModelMemory,
    ModelStatus,
    Placement,
    StateChange,
    StreamShare,
    TensorRecord,
    TimedCount,
    Totals,
    WeightCopy,
)
from duomo.ipc.record_reading import RecordReader, StatusRecordError
from duomo.ipc.records import LEFT_OUT_WHEN_EMPTY, Record, wire
from duomo.ipc.sink_records import SinkStatus
from duomo.ipc.source_records import SourceStatus

__all__ = [
    "ClientStatus",
    "ComputeShare",
    "DeviceStatus",
    "GatewayWorkerStatus",
    "ModelCapacity",
    "ModelInfo",
    "ModelMemory",
    "ModelStatus",
    "PipelineObjects",
    "PipelineStatus",
    "PipelineStepStatus",
    "Placement",
    "RingStatus",
    "StateChange",
    "StatusRecordError",
    "StreamModelFigures",
    "StreamShare",
    "StreamStatus",
    "SupervisorStatus",
    "TensorRecord",
    "TimedCount",
    "Totals",
    "WeightCopy",
]


# -- devices, clients, gateway workers ----------------------------------------------------------


@dataclass(frozen=True)
class DeviceStatus(Record):
    """One device: memory charged to its loaded models against its budget (None: none), its
    total memory as it reports it (None: unknown) and its telemetry (absent readings left out)."""

    id: int
    kind: str  # cpu, cuda, ascend
    cores: tuple[int, ...] | None  # the pinned cores (cpu), None: the device's own
    thread_budget: int | None  # a cpu device's pool's; None: an accelerator's (its own)
    used_bytes: int
    budget_bytes: int | None
    total_bytes: int | None
    telemetry: dict[str, Any]  # utilization, temperature_c, power_w, runtime_used_bytes, …


@dataclass(frozen=True)
class RingStatus(Record):
    """One ring a client attached: its model, slots, requests in flight and answered."""

    ring: int
    model: str
    slots: int
    in_flight: int
    answered: int


@dataclass(frozen=True)
class ClientStatus(Record):
    """One attached client: its pid (None: unknown), whether its model's idle worker reads it
    now (``lent``), the slots and ring memory it holds, answers waiting unread, and its rings."""

    id: int
    pid: int | None
    lent: bool
    slots: int
    shm_bytes: int
    unread_bytes: int
    unread_peak_bytes: int
    rings: tuple[RingStatus, ...]


@dataclass(frozen=True)
class GatewayWorkerStatus(Record):
    """One gateway worker process that ``duomo start`` runs: its pid (None: not running), how it
    fares, and the endpoints it serves."""

    worker: int
    pid: int | None
    running: bool
    restarts: int
    gave_up: bool
    last_exit: int | None
    http: str | None
    grpc: str | None

    @property
    def condition(self) -> str:
        """running, restarting, or gave up."""
        return "running" if self.running else "gave up" if self.gave_up else "restarting"


# -- streams ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamModelFigures(Record):
    """One stream's figures for one of its models (a frame sent to two models counts in each).

    ``frames_in`` counts the frames that reached the supervisor; ``superseded`` those a newer
    frame replaced in the queue or at the source (which never reached it); ``refused`` those
    refused at the source (``fifo``'s backlog full: never sent) and every other outcome than OK
    and SUPERSEDED in the supervisor; ``skipped`` those the source's caps dropped (``max_fps``,
    ``every``: never sent, by the camera's own settings). The counts go on across a reopening
    of the stream; the rates (over the last 5 s) and the answer ages (answer time minus capture
    time, over the last 60 s) start afresh with it; None before the first answer."""

    frames_in: int
    answered: int
    superseded: int
    refused: int
    skipped: int
    input_fps: float
    answered_fps: float
    age_ms_p50: float | None
    age_ms_p99: float | None


@dataclass(frozen=True)
class StreamStatus(Record):
    """One stream, live or ended: its liveness (``state``: starting, running, blocked, stalled
    or ended, for ``since_s`` seconds), what it was opened with, the client that opened it,
    and its figures per model it feeds now (``supervisor.dataflow.streams`` has the rules)."""

    name: str
    state: str
    since_s: float
    policy: str  # latest, fifo
    weight: float
    fps_nominal: float | None  # the frame rate its producer declared (None: not declared)
    stall_after_s: float
    client: str
    models: dict[str, StreamModelFigures]


# -- pipelines ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineStepStatus(Record):
    """One step of a pipeline: its model, the step whose objects it runs on (None: the whole
    frame), and its counts since the pipeline was built: requests it sent to its model
    (``runs``), frames on which it had nothing to run on (``skipped``: no object left after its
    filters), sub-results reused from the tracker (``reused``) and sub-results that failed."""

    name: str
    model: str
    for_each: str | None
    runs: int
    skipped: int
    reused: int
    errors: int


def _buckets(r: RecordReader) -> tuple[tuple[str, int], ...]:
    """Each ``[le, count]`` pair: a bound that reads as a number, and an integer count."""
    return tuple(_bucket(r, bucket) for bucket in r.array("buckets"))


def _bucket(r: RecordReader, bucket: object) -> tuple[str, int]:
    if isinstance(bucket, list) and len(bucket) == 2:
        le, count = bucket
        if isinstance(le, str) and type(count) is int:
            with contextlib.suppress(ValueError):
                float(le)
                return le, count
    raise r.wrong("buckets", 'a list of [bound, count] pairs such as ["2", 5]')


@dataclass(frozen=True)
class PipelineObjects(Record):
    """Objects per frame of a pipeline: the objects its steps iterated (``count``) over the
    frames whose first step answered (``frames``), and their histogram: each bucket's bound as
    Prometheus writes its ``le`` (``"2"``, the last ``"+Inf"``) and the frames with at most that
    many objects (cumulative). ``buckets`` is read by its own ``read``: a bound must read as a
    number."""

    count: int
    frames: int
    buckets: tuple[tuple[str, int], ...] = field(metadata=wire(read=_buckets))

    @property
    def per_frame(self) -> float | None:
        """The mean objects per frame; None before the first frame."""
        return self.count / self.frames if self.frames else None


def _latency(quantile: str) -> Callable[[RecordReader], float | None]:
    """The reader of one quantile of ``latency_ms``, an object of its own on the wire."""

    def read(r: RecordReader) -> float | None:
        return RecordReader("PipelineStatus.latency_ms", r.object("latency_ms")).optional_number(
            quantile
        )

    return read


@dataclass(frozen=True)
class PipelineStatus(Record):
    """One pipeline (``supervisor.dataflow.pipelines``): its state (READY when every step's model
    serves, else the first step model's state that is not), the requests it answered and how
    many of them were errors, their latency (None before the first success), its objects per
    frame and its steps, in order.

    On the wire the two latency fields are one object, ``latency_ms: {"p50", "p99"}`` (written
    by ``latency_p50_ms``'s ``write``, ``latency_p99_ms`` writing no key of its own)."""

    name: str
    state: str
    requests: int
    errors: int
    latency_p50_ms: float | None = field(
        metadata=wire(
            write=lambda p: {"latency_ms": {"p50": p.latency_p50_ms, "p99": p.latency_p99_ms}},
            read=_latency("p50"),
        )
    )
    latency_p99_ms: float | None = field(metadata=wire(write=lambda p: {}, read=_latency("p99")))
    objects: PipelineObjects
    steps: tuple[PipelineStepStatus, ...]


# -- the whole status ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SupervisorStatus(Record):
    """The ``status`` reply: the process (pid, socket, config, uptime, memory, threads, fds),
    its rings and refusals, its ``limits``, and a record per gateway worker, device, model,
    client, stream, pipeline, managed source and sink. ``streams``, ``pipelines``, ``sources``
    and ``sinks`` are left out of the JSON when there is none (a supervisor older than them
    never sends them): they read back as none."""

    pid: int
    socket: str
    config: str
    uptime_s: float
    rss_bytes: int
    threads: int
    open_fds: int
    mapped_rings: int
    shm_bytes: int
    connections_refused: int
    clients_cut_off: int
    control_jobs_waiting: int
    limits: dict[str, Any]  # ``supervisor.process.limits.Limits.to_dict``
    gateways: tuple[GatewayWorkerStatus, ...]
    thread_budget: int
    devices: tuple[DeviceStatus, ...]
    models: dict[str, ModelStatus]
    clients: tuple[ClientStatus, ...]
    streams: tuple[StreamStatus, ...] = field(default=(), metadata=LEFT_OUT_WHEN_EMPTY)
    pipelines: dict[str, PipelineStatus] = field(default_factory=dict, metadata=LEFT_OUT_WHEN_EMPTY)
    # the managed sources (``ipc.source_records``)
    sources: tuple[SourceStatus, ...] = field(default=(), metadata=LEFT_OUT_WHEN_EMPTY)
    # the sinks (``ipc.sink_records``): what the sink worker last said of each
    sinks: tuple[SinkStatus, ...] = field(default=(), metadata=LEFT_OUT_WHEN_EMPTY)
