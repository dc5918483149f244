"""The supervisor's replies about itself, as records: built once by the supervisor, read by the
gateway, ``duomo status`` and its ``--watch`` view.

Each record is a frozen dataclass with ``to_dict`` (the JSON object on the wire, key for key and
in the order ``docs/operations.md`` documents) and ``from_dict`` (that object read back). A key
that is missing, or holds a value of the wrong type, raises ``StatusRecordError`` naming the record
and the key — never a default, so a renamed key fails loudly instead of showing 0 or "UNKNOWN".
A field that may be ``null`` on the wire is ``X | None`` here; ``null`` and a missing key are not
the same thing (only ``ModelInfo``'s loaded-only keys, ``ModelStatus.compute``,
``SupervisorStatus.streams``, ``.pipelines`` and ``.sources`` may be absent).

======================  ======================================  ==================  ===============
record                  what it holds                           built by            read by
======================  ======================================  ==================  ===============
``ModelInfo``           one model of the ``models`` reply:      ``supervisor.       ``gateway.
                        name, task, backend, state, max_batch;  server`` (models)   protocol``
                        once loaded its slot inputs and                             (``model_view``)
                        outputs (``TensorRecord``)
``ModelStatus``         one model in ``status``: state,         ``supervisor.       CLI table,
                        queue, counts by outcome and refusals,  server`` (from the  ``--watch``,
                        latency, totals, memory, compute        engine's view)      gateway stats
                        share, its streams' load
                        (``ModelCapacity``, ``StreamShare``)
``DeviceStatus``        one device: memory charged and budget,  ``supervisor.       CLI, ``--watch``
                        its own telemetry                       server``
``ClientStatus``        one attached client and its rings       ``supervisor.       CLI, ``--watch``
                        (``RingStatus``)                        server``
``GatewayWorkerStatus`` one gateway worker process              ``supervisor.       CLI, ``--watch``
                                                                server``
``StreamStatus``        one stream (a camera): its liveness,    ``supervisor.       CLI, ``--watch``
                        settings, and per model its figures     streams`` (the
                        (``StreamModelFigures``)                registry's
                                                                snapshot)
``PipelineStatus``      one pipeline: its state, requests,      ``supervisor.       CLI, ``--watch``
                        latency, objects per frame              pipelines`` (the
                        (``PipelineObjects``) and per step its  engine's view)
                        counts (``PipelineStepStatus``)
``SourceStatus``        one managed source: its masked URL,     ``supervisor.       CLI, gateway,
                        state, worker, figures, last error      sources.fleet``     ``--watch``
                        (``ipc.source_records``)
``SupervisorStatus``    the whole ``status`` reply: the         ``Supervisor.       CLI, ``--watch``
                        process, its limits, and the records    status``
                        above
======================  ======================================  ==================  ===============

One model's records are in ``duomo.ipc.model_records`` (``ModelInfo``, ``ModelStatus`` and
their parts), reading a reply key by key in ``duomo.ipc.record_reading``; this module holds
the rest and names them all. The records import nothing but the standard library and
``ipc.errors``: ``ipc`` stays light.
"""

from __future__ import annotations

import contextlib
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
)
from duomo.ipc.record_reading import JSON, RecordReader, StatusRecordError
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
]


# -- devices, clients, gateway workers ----------------------------------------------------------


@dataclass(frozen=True)
class DeviceStatus:
    """One device: memory charged to its loaded models against its budget (None: none), its
    total memory as it reports it (None: unknown) and its telemetry (absent readings left out)."""

    id: int
    kind: str  # cpu, cuda, ascend
    cores: tuple[int, ...] | None  # the pinned cores (cpu), None: the device's own
    thread_budget: int
    used_bytes: int
    budget_bytes: int | None
    total_bytes: int | None
    telemetry: dict[str, Any]  # utilization, temperature_c, power_w, runtime_used_bytes, …

    def to_dict(self) -> JSON:
        return {
            "id": self.id,
            "kind": self.kind,
            "cores": None if self.cores is None else list(self.cores),
            "thread_budget": self.thread_budget,
            "used_bytes": self.used_bytes,
            "budget_bytes": self.budget_bytes,
            "total_bytes": self.total_bytes,
            "telemetry": dict(self.telemetry),
        }

    @classmethod
    def from_dict(cls, data: object) -> DeviceStatus:
        r = RecordReader("DeviceStatus", data)
        cores = None if r._get("cores") is None else tuple(r.array("cores"))
        return cls(
            r.integer("id"),
            r.text("kind"),
            cores,
            r.integer("thread_budget"),
            r.integer("used_bytes"),
            r.optional_integer("budget_bytes"),
            r.optional_integer("total_bytes"),
            r.object("telemetry"),
        )


@dataclass(frozen=True)
class RingStatus:
    """One ring a client attached: its model, slots, requests in flight and answered."""

    ring: int
    model: str
    slots: int
    in_flight: int
    answered: int

    def to_dict(self) -> JSON:
        return {
            "ring": self.ring,
            "model": self.model,
            "slots": self.slots,
            "in_flight": self.in_flight,
            "answered": self.answered,
        }

    @classmethod
    def from_dict(cls, data: object) -> RingStatus:
        r = RecordReader("RingStatus", data)
        return cls(
            r.integer("ring"),
            r.text("model"),
            r.integer("slots"),
            r.integer("in_flight"),
            r.integer("answered"),
        )


@dataclass(frozen=True)
class ClientStatus:
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

    def to_dict(self) -> JSON:
        return {
            "id": self.id,
            "pid": self.pid,
            "lent": self.lent,
            "slots": self.slots,
            "shm_bytes": self.shm_bytes,
            "unread_bytes": self.unread_bytes,
            "unread_peak_bytes": self.unread_peak_bytes,
            "rings": [ring.to_dict() for ring in self.rings],
        }

    @classmethod
    def from_dict(cls, data: object) -> ClientStatus:
        r = RecordReader("ClientStatus", data)
        return cls(
            r.integer("id"), r.optional_integer("pid"), r.flag("lent"), r.integer("slots"),
            r.integer("shm_bytes"), r.integer("unread_bytes"), r.integer("unread_peak_bytes"),
            r.records("rings", RingStatus.from_dict),
        )  # fmt: skip


@dataclass(frozen=True)
class GatewayWorkerStatus:
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

    def to_dict(self) -> JSON:
        return {
            "worker": self.worker,
            "pid": self.pid,
            "running": self.running,
            "restarts": self.restarts,
            "gave_up": self.gave_up,
            "last_exit": self.last_exit,
            "http": self.http,
            "grpc": self.grpc,
        }

    @classmethod
    def from_dict(cls, data: object) -> GatewayWorkerStatus:
        r = RecordReader("GatewayWorkerStatus", data)
        return cls(
            r.integer("worker"),
            r.optional_integer("pid"),
            r.flag("running"),
            r.integer("restarts"),
            r.flag("gave_up"),
            r.optional_integer("last_exit"),
            r.optional_text("http"),
            r.optional_text("grpc"),
        )


# -- streams ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamModelFigures:
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

    def to_dict(self) -> JSON:
        return {
            "frames_in": self.frames_in,
            "answered": self.answered,
            "superseded": self.superseded,
            "refused": self.refused,
            "skipped": self.skipped,
            "input_fps": self.input_fps,
            "answered_fps": self.answered_fps,
            "age_ms_p50": self.age_ms_p50,
            "age_ms_p99": self.age_ms_p99,
        }

    @classmethod
    def from_dict(cls, data: object) -> StreamModelFigures:
        r = RecordReader("StreamModelFigures", data)
        return cls(
            r.integer("frames_in"),
            r.integer("answered"),
            r.integer("superseded"),
            r.integer("refused"),
            r.integer("skipped"),
            r.number("input_fps"),
            r.number("answered_fps"),
            r.optional_number("age_ms_p50"),
            r.optional_number("age_ms_p99"),
        )


@dataclass(frozen=True)
class StreamStatus:
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

    def to_dict(self) -> JSON:
        return {
            "name": self.name,
            "state": self.state,
            "since_s": self.since_s,
            "policy": self.policy,
            "weight": self.weight,
            "fps_nominal": self.fps_nominal,
            "stall_after_s": self.stall_after_s,
            "client": self.client,
            "models": {name: m.to_dict() for name, m in self.models.items()},
        }

    @classmethod
    def from_dict(cls, data: object) -> StreamStatus:
        r = RecordReader("StreamStatus", data)
        return cls(
            name=r.text("name"),
            state=r.text("state"),
            since_s=r.number("since_s"),
            policy=r.text("policy"),
            weight=r.number("weight"),
            fps_nominal=r.optional_number("fps_nominal"),
            stall_after_s=r.number("stall_after_s"),
            client=r.text("client"),
            models={n: StreamModelFigures.from_dict(m) for n, m in r.object("models").items()},
        )


# -- pipelines ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineStepStatus:
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

    def to_dict(self) -> JSON:
        return {
            "name": self.name,
            "model": self.model,
            "for_each": self.for_each,
            "runs": self.runs,
            "skipped": self.skipped,
            "reused": self.reused,
            "errors": self.errors,
        }

    @classmethod
    def from_dict(cls, data: object) -> PipelineStepStatus:
        r = RecordReader("PipelineStepStatus", data)
        return cls(
            r.text("name"), r.text("model"), r.optional_text("for_each"), r.integer("runs"),
            r.integer("skipped"), r.integer("reused"), r.integer("errors"),
        )  # fmt: skip


@dataclass(frozen=True)
class PipelineObjects:
    """Objects per frame of a pipeline: the objects its steps iterated (``count``) over the
    frames whose first step answered (``frames``), and their histogram: each bucket's bound as
    Prometheus writes its ``le`` (``"2"``, the last ``"+Inf"``) and the frames with at most that
    many objects (cumulative)."""

    count: int
    frames: int
    buckets: tuple[tuple[str, int], ...]

    @property
    def per_frame(self) -> float | None:
        """The mean objects per frame; None before the first frame."""
        return self.count / self.frames if self.frames else None

    def to_dict(self) -> JSON:
        return {
            "count": self.count,
            "frames": self.frames,
            "buckets": [[le, n] for le, n in self.buckets],
        }

    @classmethod
    def from_dict(cls, data: object) -> PipelineObjects:
        r = RecordReader("PipelineObjects", data)
        buckets = tuple(_bucket(r, bucket) for bucket in r.array("buckets"))
        return cls(r.integer("count"), r.integer("frames"), buckets)


def _bucket(r: RecordReader, bucket: object) -> tuple[str, int]:
    """One ``[le, count]`` pair: a bound that reads as a number, and an integer count."""
    if isinstance(bucket, list) and len(bucket) == 2:
        le, count = bucket
        if isinstance(le, str) and type(count) is int:
            with contextlib.suppress(ValueError):
                float(le)
                return le, count
    raise r.wrong("buckets", 'a list of [bound, count] pairs such as ["2", 5]')


@dataclass(frozen=True)
class PipelineStatus:
    """One pipeline (``supervisor.dataflow.pipelines``): its state (READY when every step's model
    serves, else the first step model's state that is not), the requests it answered and how
    many of them were errors, their latency (None before the first success), its objects per
    frame and its steps, in order."""

    name: str
    state: str
    requests: int
    errors: int
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    objects: PipelineObjects
    steps: tuple[PipelineStepStatus, ...]

    def to_dict(self) -> JSON:
        return {
            "name": self.name,
            "state": self.state,
            "requests": self.requests,
            "errors": self.errors,
            "latency_ms": {"p50": self.latency_p50_ms, "p99": self.latency_p99_ms},
            "objects": self.objects.to_dict(),
            "steps": [step.to_dict() for step in self.steps],
        }

    @classmethod
    def from_dict(cls, data: object) -> PipelineStatus:
        r = RecordReader("PipelineStatus", data)
        latency = RecordReader("PipelineStatus.latency_ms", r.object("latency_ms"))
        return cls(
            name=r.text("name"),
            state=r.text("state"),
            requests=r.integer("requests"),
            errors=r.integer("errors"),
            latency_p50_ms=latency.optional_number("p50"),
            latency_p99_ms=latency.optional_number("p99"),
            objects=PipelineObjects.from_dict(r._get("objects")),
            steps=r.records("steps", PipelineStepStatus.from_dict),
        )


# -- the whole status ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SupervisorStatus:
    """The ``status`` reply: the process (pid, socket, config, uptime, memory, threads, fds),
    its rings and refusals, its ``limits``, and a record per gateway worker, device, model,
    client, stream, pipeline and managed source. ``streams``, ``pipelines`` and ``sources`` are
    left out of the JSON when there is none (a supervisor older than them never sends them):
    they read back as none."""

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
    streams: tuple[StreamStatus, ...] = ()
    pipelines: dict[str, PipelineStatus] = field(default_factory=dict)
    sources: tuple[SourceStatus, ...] = ()  # the managed sources (``ipc.source_records``)

    def to_dict(self) -> JSON:
        shown: JSON = {
            "pid": self.pid,
            "socket": self.socket,
            "config": self.config,
            "uptime_s": self.uptime_s,
            "rss_bytes": self.rss_bytes,
            "threads": self.threads,
            "open_fds": self.open_fds,
            "mapped_rings": self.mapped_rings,
            "shm_bytes": self.shm_bytes,
            "connections_refused": self.connections_refused,
            "clients_cut_off": self.clients_cut_off,
            "control_jobs_waiting": self.control_jobs_waiting,
            "limits": dict(self.limits),
            "gateways": [g.to_dict() for g in self.gateways],
            "thread_budget": self.thread_budget,
            "devices": [d.to_dict() for d in self.devices],
            "models": {name: m.to_dict() for name, m in self.models.items()},
            "clients": [c.to_dict() for c in self.clients],
        }
        if self.streams:
            shown["streams"] = [s.to_dict() for s in self.streams]
        if self.pipelines:
            shown["pipelines"] = {name: p.to_dict() for name, p in self.pipelines.items()}
        if self.sources:
            shown["sources"] = [s.to_dict() for s in self.sources]
        return shown

    @classmethod
    def from_dict(cls, data: object) -> SupervisorStatus:
        r = RecordReader("SupervisorStatus", data)
        return cls(
            pid=r.integer("pid"),
            socket=r.text("socket"),
            config=r.text("config"),
            uptime_s=r.number("uptime_s"),
            rss_bytes=r.integer("rss_bytes"),
            threads=r.integer("threads"),
            open_fds=r.integer("open_fds"),
            mapped_rings=r.integer("mapped_rings"),
            shm_bytes=r.integer("shm_bytes"),
            connections_refused=r.integer("connections_refused"),
            clients_cut_off=r.integer("clients_cut_off"),
            control_jobs_waiting=r.integer("control_jobs_waiting"),
            limits=r.object("limits"),
            gateways=r.records("gateways", GatewayWorkerStatus.from_dict),
            thread_budget=r.integer("thread_budget"),
            devices=r.records("devices", DeviceStatus.from_dict),
            models={n: ModelStatus.from_dict(m) for n, m in r.object("models").items()},
            clients=r.records("clients", ClientStatus.from_dict),
            streams=r.records("streams", StreamStatus.from_dict) if "streams" in r.data else (),
            pipelines=(
                {n: PipelineStatus.from_dict(p) for n, p in r.object("pipelines").items()}
                if "pipelines" in r.data
                else {}
            ),
            sources=r.records("sources", SourceStatus.from_dict) if "sources" in r.data else (),
        )
