"""The supervisor's replies about itself, as records: built once by the supervisor, read by the
gateway, ``duomo status`` and its ``--watch`` view.

Each record is a frozen dataclass with ``to_dict`` (the JSON object on the wire, key for key and
in the order ``docs/operations.md`` documents) and ``from_dict`` (that object read back). A key
that is missing, or holds a value of the wrong type, raises ``StatusRecordError`` naming the record
and the key — never a default, so a renamed key fails loudly instead of showing 0 or "UNKNOWN".
A field that may be ``null`` on the wire is ``X | None`` here; ``null`` and a missing key are not
the same thing (only ``ModelInfo``'s loaded-only keys and ``ModelStatus.compute`` may be absent).

======================  ======================================  ==================  ===============
record                  what it holds                           built by            read by
======================  ======================================  ==================  ===============
``ModelInfo``           one model of the ``models`` reply:      ``supervisor.       ``gateway.
                        name, task, backend, state, max_batch;  server`` (models)   protocol``
                        once loaded its slot inputs and                             (``model_view``)
                        outputs (``TensorRecord``)
``ModelStatus``         one model in ``status``: state,         ``supervisor.       CLI table,
                        queue, counts by outcome and refusals,  server`` (from the  ``--watch``,
                        latency, totals, memory, compute share  engine's view)      gateway stats
``DeviceStatus``        one device: memory charged and budget,  ``supervisor.       CLI, ``--watch``
                        its own telemetry                       server``
``ClientStatus``        one attached client and its rings       ``supervisor.       CLI, ``--watch``
                        (``RingStatus``)                        server``
``GatewayWorkerStatus`` one gateway worker process              ``supervisor.       CLI, ``--watch``
                                                                server``
``SupervisorStatus``    the whole ``status`` reply: the         ``Supervisor.       CLI, ``--watch``
                        process, its limits, and the records    status``
                        above
======================  ======================================  ==================  ===============

The records import nothing but the standard library and ``ipc.errors``: ``ipc`` stays light.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from duomo.ipc.errors import InternalError

T = TypeVar("T")
JSON = dict[str, Any]


class StatusRecordError(InternalError):
    """A reply about the supervisor that does not have the documented shape: a key missing or
    of the wrong type (the supervisor and its reader disagree on the wire)."""


class _Reader:
    """One JSON object read as one record: each key checked once, by name."""

    def __init__(self, record: str, data: object) -> None:
        if not isinstance(data, Mapping):
            raise StatusRecordError(f"status record {record}: expected an object, not {data!r:.80}")
        self.record = record
        self.data = data

    def _get(self, key: str) -> Any:
        if key not in self.data:
            raise StatusRecordError(f"status record {self.record}: missing key {key!r}")
        return self.data[key]

    def _wrong(self, key: str, expected: str) -> StatusRecordError:
        value = self.data.get(key)
        return StatusRecordError(
            f"status record {self.record}: key {key!r} must be {expected}, not {value!r:.80}"
        )

    def integer(self, key: str) -> int:
        value = self._get(key)
        if type(value) is not int:
            raise self._wrong(key, "an integer")
        return value

    def optional_integer(self, key: str) -> int | None:
        return None if self._get(key) is None else self.integer(key)

    def number(self, key: str) -> float:
        value = self._get(key)
        if type(value) not in (int, float):
            raise self._wrong(key, "a number")
        return value  # (an integer stays one: read back, the wire is unchanged)

    def optional_number(self, key: str) -> float | None:
        return None if self._get(key) is None else self.number(key)

    def text(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise self._wrong(key, "a string")
        return value

    def optional_text(self, key: str) -> str | None:
        return None if self._get(key) is None else self.text(key)

    def flag(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise self._wrong(key, "true or false")
        return value

    def optional_flag(self, key: str) -> bool | None:
        return None if self._get(key) is None else self.flag(key)

    def object(self, key: str) -> dict[str, Any]:
        value = self._get(key)
        if not isinstance(value, Mapping):
            raise self._wrong(key, "an object")
        return dict(value)

    def optional_object(self, key: str) -> dict[str, Any] | None:
        return None if self._get(key) is None else self.object(key)

    def array(self, key: str) -> list[Any]:
        value = self._get(key)
        if not isinstance(value, list):
            raise self._wrong(key, "a list")
        return value

    def records(self, key: str, read: Callable[[Any], T]) -> tuple[T, ...]:
        return tuple(read(item) for item in self.array(key))


def _counts(reader: _Reader, key: str) -> dict[str, int]:
    counts = reader.object(key)
    if not all(type(v) is int for v in counts.values()):
        raise reader._wrong(key, "an object of integer counts")
    return counts


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
        r = _Reader("TensorRecord", data)
        shape = r.array("shape")
        if not all(d is None or type(d) is int for d in shape):
            raise r._wrong("shape", "a list of integers or nulls")
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
        r = _Reader("ModelInfo", data)
        head = (r.text("name"), r.text("task"), r.optional_text("backend"), r.text("state"))
        max_batch = r.integer("max_batch")
        if "inputs" not in r.data:
            return cls(*head, max_batch)
        outputs = r.array("outputs")
        if not all(isinstance(o, str) for o in outputs):
            raise r._wrong("outputs", "a list of names")
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
        r = _Reader("Placement", data)
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
        r = _Reader("StateChange", data)
        return cls(r.number("at"), r.text("state"), r.text("reason"))


@dataclass(frozen=True)
class ModelMemory:
    """A model's memory: whether it holds any, what its load measured, what is charged to its
    budget (by device) and that budget (None: none)."""

    loaded: bool
    measured: dict[str, Any] | None  # host_bytes, device_bytes, device_bytes_by_device
    charged_bytes: int | None
    charged_bytes_by_device: dict[str, int | None]
    budget_bytes: int | None

    def to_dict(self) -> JSON:
        return {
            "loaded": self.loaded,
            "measured": self.measured,
            "charged_bytes": self.charged_bytes,
            "charged_bytes_by_device": dict(self.charged_bytes_by_device),
            "budget_bytes": self.budget_bytes,
        }

    @classmethod
    def from_dict(cls, data: object) -> ModelMemory:
        r = _Reader("ModelMemory", data)
        return cls(
            r.flag("loaded"), r.optional_object("measured"), r.optional_integer("charged_bytes"),
            r.object("charged_bytes_by_device"), r.optional_integer("budget_bytes"),
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
        r = _Reader("ComputeShare", data)
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
        r = _Reader("TimedCount", data)
        return cls(r.integer("count"), r.integer("ns"))


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
        r = _Reader("Totals", data)
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
    placement, queue, counts, latency, memory and compute share.

    **Errors, one definition** (``errors``): every request the model answered with an error —
    those that failed after being queued (``requests - outcomes["ok"]``) *plus* those refused at
    admission before they were queued (``refused``: a bad header, a full queue, a model not
    serving). It is the caller's view, the same as ``/metrics``' ``failure_total``: a refused
    request is a failed request to whoever sent it. ``duomo status`` and ``--watch`` both show
    this figure; ``requests`` counts only the requests that were queued.
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
    compute: ComputeShare | None = None  # absent in the ``load`` reply only

    @property
    def ok(self) -> int:
        return self.outcomes.get("ok", 0)  # (an outcome nothing has had yet is absent)

    @property
    def errors(self) -> int:
        """Failed after being queued plus refused at admission (the class docstring)."""
        return self.requests - self.ok + sum(self.refused.values())

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
            "latency": {stage: dict(q) for stage, q in self.latency.items()},
            "batch_sizes": dict(self.batch_sizes),
            "totals": self.totals.to_dict(),
            "memory": self.memory.to_dict(),
            "idle_spin": dict(self.idle_spin),
            "preload": self.preload,
            "evictable": self.evictable,
        }
        if self.compute is not None:
            shown["compute"] = self.compute.to_dict()
        return shown

    @classmethod
    def from_dict(cls, data: object) -> ModelStatus:
        r = _Reader("ModelStatus", data)
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
            restart_attempts=_counts(r, "restart_attempts"),
            predictive=_counts(r, "predictive"),
            abandoned_workers=r.integer("abandoned_workers"),
            last_error=r.optional_text("last_error"),
            idle_s=r.optional_number("idle_s"),
            history=r.records("history", StateChange.from_dict),
            requests=r.integer("requests"),
            outcomes=_counts(r, "outcomes"),
            refused=_counts(r, "refused"),
            latency={k: dict(v) for k, v in r.object("latency").items()},
            batch_sizes=_counts(r, "batch_sizes"),
            totals=Totals.from_dict(r._get("totals")),
            memory=ModelMemory.from_dict(r._get("memory")),
            idle_spin=_counts(r, "idle_spin"),
            preload=r.optional_flag("preload"),
            evictable=r.optional_flag("evictable"),
            compute=None if compute is None else ComputeShare.from_dict(compute),
        )


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
        r = _Reader("DeviceStatus", data)
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
        r = _Reader("RingStatus", data)
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
        r = _Reader("ClientStatus", data)
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
        r = _Reader("GatewayWorkerStatus", data)
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


# -- the whole status ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SupervisorStatus:
    """The ``status`` reply: the process (pid, socket, config, uptime, memory, threads, fds),
    its rings and refusals, its ``limits``, and a record per gateway worker, device, model and
    client."""

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
    limits: dict[str, Any]  # ``supervisor.limits.Limits.to_dict``
    gateways: tuple[GatewayWorkerStatus, ...]
    thread_budget: int
    devices: tuple[DeviceStatus, ...]
    models: dict[str, ModelStatus]
    clients: tuple[ClientStatus, ...]

    def to_dict(self) -> JSON:
        return {
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

    @classmethod
    def from_dict(cls, data: object) -> SupervisorStatus:
        r = _Reader("SupervisorStatus", data)
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
        )
