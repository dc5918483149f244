"""The answers to control messages: one handler per operation, on the reactor thread.

The reactor (``supervisor.process.reactor``) calls ``ControlHandlers.handle`` for every control
message of an authenticated client, on its own thread. ``handle`` parses the message once (the
protocol: ``supervisor.process.control_messages``) and dispatches on its operation to one handler
each (``_on_<op>``). Most answer at once; the slow ones (``reload``, ``load``, ``unload``,
attaching a model that was never loaded, and everything that reads or writes a gallery file:
the galleries' records, a page of identities, enrolment and removal, which vacuums the file)
queue for the one control-job thread (``ControlJobs``) and answer when done, so the reactor
never waits for a model or a file. A handler that fails unexpectedly
answers INTERNAL with a fixed message; the details go to the log. ``handle`` never raises.

``attach`` is charged against the ``limits`` on slots and ring memory per client and in all
(``RingLedger``; a ring a producer grew for a larger frame is charged its grown input areas in
full, ``ring_charge``); the reactor enforces the others. A client holds at most
``MAX_RINGS_PER_CLIENT`` rings. Attaching a model never loaded loads it on the control-job
thread, then creates the ring back on the reactor thread (``Reactor.call_soon``), which owns
the connections and their attachments.

Owned by ``Supervisor`` (``supervisor.process.server``), which hands it what the handlers
touch: the engine, the stream registry, the source fleet, the sink hub, the ring ledger, the
control jobs, and its own reactor, config, ``reload``, stop and status, as callables (the
reactor exists only once the supervisor has started; the config is replaced by each reload).
``status`` and ``model_status`` are assembled by the supervisor; the ``models`` reply's records
are made here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import structlog

from duomo.ipc.errors import (
    DuomoError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    echoed,
)
from duomo.ipc.status_records import ModelInfo, ModelStatus, SupervisorStatus, TensorRecord
from duomo.supervisor.config import LoadedConfig, tracked_pipelines
from duomo.supervisor.core.engine import Engine
from duomo.supervisor.dataflow.pipelines import ServedPipeline
from duomo.supervisor.dataflow.streams import StreamRegistry
from duomo.supervisor.galleries.keeper import GalleryKeeper
from duomo.supervisor.process.attachment import Attachment, layout_for, ring_charge
from duomo.supervisor.process.connection import Connection
from duomo.supervisor.process.control_jobs import ControlJob, ControlJobs
from duomo.supervisor.process.control_messages import (
    Attach,
    ControlMessage,
    Detach,
    Galleries,
    GalleryAdd,
    GalleryIdentities,
    GalleryRemove,
    Load,
    Models,
    Ping,
    Reload,
    Reply,
    SinkReports,
    SinkTarget,
    SourceAdd,
    SourceRemove,
    SourceReports,
    Sources,
    SourceShow,
    Status,
    Stop,
    StreamClose,
    StreamOpen,
    Unload,
    error_reply,
    internal_reply,
    parse_control,
)
from duomo.supervisor.process.limits import RingLedger
from duomo.supervisor.process.reactor import Reactor
from duomo.supervisor.process.request_trace import RequestTrace
from duomo.supervisor.sinks.hub import SinkHub
from duomo.supervisor.sources.fleet import SourceFleet

log = structlog.get_logger("duomo.supervisor")
MAX_RINGS_PER_CLIENT = 64


@dataclass(frozen=True)
class Caller:
    """Who sent a control message, and the message as it came (a reply sent later carries
    its id)."""

    conn: Connection
    message: dict[str, Any]


# a control message's handler: its reply, or None when it is answered later
Handler = Callable[[Caller, Any], Reply | None]


class ControlHandlers:
    """The reply to each control message (reactor thread), or the control job that answers it
    later."""

    def __init__(
        self,
        engine: Engine,
        streams: StreamRegistry,
        sources: SourceFleet,
        shm: RingLedger,
        control_jobs: ControlJobs,
        *,
        reactor: Callable[[], Reactor | None],
        config: Callable[[], LoadedConfig],
        reload: Callable[[str | None], dict[str, Any]],
        stop: Callable[[Caller | None], None],
        status: Callable[[Connection | None], SupervisorStatus],
        model_status: Callable[[str], ModelStatus],
        trace: RequestTrace | None = None,
        sinks: SinkHub | None = None,
    ) -> None:
        """``reactor``: the supervisor's reactor, None until it starts. ``config``: the config
        running now. ``reload``: ``Supervisor.reload`` (run as a control job). ``stop``: asks
        the supervisor to stop; a caller given is answered once it has (``stop`` with
        ``wait``). ``status`` and ``model_status``: the supervisor's records. ``trace``: the
        request trace, when the process was started with one (its rings are traced). ``sinks``:
        the sink hub (None: no sink messages are answered but with UNAVAILABLE)."""
        self.engine = engine
        self.streams = streams
        self.sources = sources
        self.shm = shm
        self.control_jobs = control_jobs
        self._reactor = reactor
        self._config = config
        self._reload = reload
        self._stop = stop
        self._status = status
        self._model_status = model_status
        self._trace = trace
        self.sinks = sinks
        self.galleries = GalleryKeeper(config)
        # operation -> its handler, which takes that operation's message (``control_messages``)
        self._handlers: dict[str, Handler] = {
            Models.op: self._on_models,
            Attach.op: self._on_attach,
            Detach.op: self._on_detach,
            Status.op: self._on_status,
            Stop.op: self._on_stop,
            Reload.op: self._on_reload,
            Load.op: self._on_load,
            Unload.op: self._on_unload,
            StreamOpen.op: self._on_stream_open,
            StreamClose.op: self._on_stream_close,
            Ping.op: self._on_ping,
            SourceReports.op: self._on_source_report,
            Sources.op: self._on_sources,
            SourceShow.op: self._on_source,
            SourceAdd.op: self._on_source_add,
            SourceRemove.op: self._on_source_remove,
            SinkReports.op: self._on_sink_report,
            SinkTarget.op: self._on_sink,
            Galleries.op: self._on_galleries,
            GalleryIdentities.op: self._on_gallery_identities,
            GalleryAdd.op: self._on_gallery_add,
            GalleryRemove.op: self._on_gallery_remove,
        }

    def handle(self, conn: Connection, message: dict[str, Any]) -> Reply | None:
        """The reply to one control message, or None when it is answered later (a control job,
        or ``stop`` with ``wait``). Never raises: a ``DuomoError`` is its error reply, anything
        else an INTERNAL one that names the operation (the traceback goes to the log)."""
        request: ControlMessage | None = None
        try:
            request = parse_control(message)
            return self._handlers[request.op](Caller(conn, message), request)
        except DuomoError as err:
            return error_reply(err)
        except Exception:  # a bug: the client gets its answer, the log the details
            what = request.what if request is not None else echoed(message.get("op"))
            log.exception("control message failed", what=what)
            return internal_reply(what)

    def _later(
        self, caller: Caller, request: ControlMessage, job: Callable[[], Reply | None]
    ) -> None:
        """Queue a slow control job; it answers when done (RESOURCE_EXHAUSTED at once when
        the queue is full)."""
        self.control_jobs.submit(ControlJob(caller.conn, caller.message, job, request.what))

    def _on_models(self, caller: Caller, request: Models) -> Reply:
        names = [*self.engine.models, *self.engine.pipelines]
        return {"ok": True, "models": [self._model_info(n).to_dict() for n in names]}

    def _on_attach(self, caller: Caller, request: Attach) -> Reply | None:
        if self.engine.servable(request.model).layout_known:  # NotFoundError for unknown names
            self._attach_ring(caller, request)
            return None  # answered: the reply carries the ring's descriptor
        # never loaded yet (preload: false): load it on the control thread, then attach
        self._check_ring_room(caller.conn)
        self._later(caller, request, functools.partial(self._load_then_attach, caller, request))
        return None

    def _load_then_attach(self, caller: Caller, request: Attach) -> None:
        """(control-job thread) Load the model, then attach on the reactor thread, which owns
        the attachments and answers; what that raises is this job's error."""
        self.engine.load(request.model)
        reactor = self._reactor()
        assert reactor is not None
        attached: Future[None] = Future()

        def attach() -> None:
            try:
                if caller.conn.closed:
                    raise UnavailableError("client gone")
                self._attach_ring(caller, request)
                attached.set_result(None)
            except Exception as err:
                attached.set_exception(err)

        reactor.call_soon(attach)
        attached.result(60)

    def _check_ring_room(self, conn: Connection) -> None:
        if len(conn.attachments) >= MAX_RINGS_PER_CLIENT:
            raise ResourceExhaustedError(
                f"a client may attach at most {MAX_RINGS_PER_CLIENT} rings; close some first"
            )

    def _attach_ring(self, caller: Caller, request: Attach) -> None:
        """(reactor thread) Create and record a ring of ``request.slots`` slots, charged against
        the limits on slots and ring memory, and answer with its descriptor."""
        conn = caller.conn
        self._check_ring_room(conn)
        name, slots, grow = request.model, request.slots, request.inputs
        model = self.engine.servable(name)
        if not model.layout_known:  # (after a load: a reload replaced it meanwhile)
            raise UnavailableError(f"model {name!r} was replaced while it loaded; attach again")
        spec = model.slot_spec()
        layout = layout_for(spec, slots, grow)  # InvalidArgumentError: no such or fixed input
        charge = (conn.id, slots, ring_charge(spec, layout))
        try:
            self.shm.charge(*charge)  # ResourceExhaustedError past a bound on slots or memory
        except ResourceExhaustedError as err:
            if not grow:
                raise
            needed = ", ".join(f"{n!r} of {b} bytes" for n, b in grow.items())
            room = ", ".join(f"{a.name!r} {a.capacity}" for a in layout.inputs)
            raise ResourceExhaustedError(
                f"no room to grow {name!r}'s ring for an input {needed} ({slots} slot(s) with "
                f"input areas of {room} bytes): {err.message}"
            ) from None
        ring_id = conn.next_ring_id()
        try:
            served = (
                self.engine.pipelines if isinstance(model, ServedPipeline) else self.engine.models
            )
            make = Attachment if self._trace is None else self._trace.attachment(conn.pid)
            attachment = make(
                ring_id, model, served, layout, conn.send,
                on_close=functools.partial(self.shm.release, *charge),
                streams=conn.streams, flow=conn.flow,
            )  # fmt: skip
        except BaseException as err:
            self.shm.release(*charge)
            if isinstance(err, OSError):  # out of memory or file descriptors
                raise ResourceExhaustedError(f"cannot create a ring for {name!r}: {err}") from None
            raise
        reactor = self._reactor()
        assert reactor is not None
        reactor.attach(conn, ring_id, attachment)
        reply = {"ok": True, "ring": ring_id, "layout": attachment.layout.to_dict()}
        conn.reply(caller.message, reply, fd=attachment.ring.share())

    def _on_detach(self, caller: Caller, request: Detach) -> Reply:
        self._attachment(caller.conn, request.ring)  # NotFoundError for a ring not attached
        reactor = self._reactor()
        assert reactor is not None
        reactor.detach(caller.conn, request.ring)
        return {"ok": True}

    def _attachment(self, conn: Connection, ring: int) -> Attachment:
        attachment = conn.attachments.get(ring)
        if attachment is None:
            raise NotFoundError(f"no attached ring {ring}")
        return attachment

    def _on_status(self, caller: Caller, request: Status) -> Reply:
        if request.model is not None:  # NotFoundError for a model not served
            return {"ok": True, "model_status": self._model_status(request.model).to_dict()}
        return {"ok": True, "status": self._status(caller.conn).to_dict()}

    def _on_stop(self, caller: Caller, request: Stop) -> Reply | None:
        # with ``wait``: answered once the queued work is done or cut (``Supervisor.shutdown``)
        self._stop(caller if request.wait else None)
        return None if request.wait else {"ok": True}

    def _on_reload(self, caller: Caller, request: Reload) -> None:
        self._later(caller, request, lambda: self._reload(request.model))

    def _on_load(self, caller: Caller, request: Load) -> None:
        self.engine.servable(request.model)  # NotFoundError at once
        self._later(caller, request, lambda: {"load": self.engine.load(request.model).to_dict()})

    def _on_unload(self, caller: Caller, request: Unload) -> None:
        self.engine.servable(request.model)  # NotFoundError at once
        self._later(caller, request, lambda: {"unload": self.engine.unload(request.model)})

    def _on_stream_open(self, caller: Caller, request: StreamOpen) -> Reply:
        for name in request.settings.models:
            self.engine.servable(name)  # NotFoundError for a model or pipeline not served
        conn = caller.conn
        client = f"client {conn.id} (pid {conn.pid})" if conn.pid else f"client {conn.id}"
        stream = self.streams.open(request.name, request.settings, client=client)
        conn.streams[stream.id] = stream
        return {"ok": True, "stream": stream.id}

    def _on_stream_close(self, caller: Caller, request: StreamClose) -> Reply:
        stream = caller.conn.streams.pop(request.stream, None)
        if stream is None:
            raise NotFoundError(f"no open stream {request.stream}")
        self.streams.close([stream])
        return {"ok": True}

    def _on_ping(self, caller: Caller, request: Ping) -> Reply:
        return {"ok": True}

    def _on_source_report(self, caller: Caller, request: SourceReports) -> Reply:
        return {"ok": True, "assigned": self.sources.report(request.worker, request.sources)}

    def _on_sources(self, caller: Caller, request: Sources) -> Reply:
        return {"ok": True, "sources": [s.to_dict() for s in self.sources.status()]}

    def _on_source(self, caller: Caller, request: SourceShow) -> Reply:
        return {"ok": True, "source": self.sources.status_of(request.name).to_dict()}

    def _on_source_add(self, caller: Caller, request: SourceAdd) -> Reply:
        definition = request.definition.resolved(self._config().path.parent)
        return {"ok": True, "source": self.sources.add(definition).to_dict()}

    def _on_source_remove(self, caller: Caller, request: SourceRemove) -> Reply:
        self.sources.remove(request.name)
        return {"ok": True}

    def _sink_hub(self) -> SinkHub:
        if self.sinks is None:
            raise UnavailableError("this supervisor runs no sinks")
        return self.sinks

    def _on_sink_report(self, caller: Caller, request: SinkReports) -> Reply:
        return {"ok": True, **self._sink_hub().report(request.sinks)}

    def _on_sink(self, caller: Caller, request: SinkTarget) -> Reply:
        tracked = tracked_pipelines(self._config().config)
        max_missed = tracked.get(request.pipeline) if request.pipeline is not None else None
        return {"ok": True, **self._sink_hub().target(request.name), "max_missed": max_missed}

    def _on_galleries(self, caller: Caller, request: Galleries) -> None:
        # (each record counts its file's rows: milliseconds to tens of them at a million, never
        # on the reactor's thread)
        def records() -> Reply:
            return {"galleries": [i.to_dict() for i in self.galleries.infos()]}

        self._later(caller, request, records)

    def _on_gallery_identities(self, caller: Caller, request: GalleryIdentities) -> None:
        self.galleries.model(request.gallery)  # NotFoundError at once
        page = functools.partial(
            self.galleries.identities,
            request.gallery, request.after, request.limit, request.embeddings,
        )  # fmt: skip
        self._later(caller, request, page)

    def _on_gallery_add(self, caller: Caller, request: GalleryAdd) -> None:
        self.galleries.model(request.gallery)  # NotFoundError at once
        add = functools.partial(
            self.galleries.add,
            request.gallery, request.name, request.embeddings, request.replace, request.metadata,
        )  # fmt: skip
        self._later(caller, request, add)

    def _on_gallery_remove(self, caller: Caller, request: GalleryRemove) -> None:
        self.galleries.model(request.gallery)  # NotFoundError at once
        remove = functools.partial(self.galleries.remove, request.gallery, request.name)
        self._later(caller, request, remove)

    def _model_info(self, name: str) -> ModelInfo:
        """One model (or pipeline) of the ``models`` reply; its slot layout once known."""
        model = self.engine.servable(name)
        resolved = self._config().models.get(name)
        head = (
            name,
            model.spec.task,  # "pipeline" for a pipeline
            resolved.config.backend if resolved else None,
            model.state.value,
            model.spec.max_batch,
        )
        if not model.layout_known:  # it loads when first attached
            return ModelInfo(*head)
        spec = model.slot_spec()
        return ModelInfo(
            *head,
            inputs=tuple(TensorRecord(i.name, i.dtype.name, tuple(i.shape)) for i in spec.inputs),
            result=spec.result,
            outputs=tuple(spec.outputs),
            output_tensors=tuple(
                TensorRecord(o.name, o.dtype.name, tuple(o.shape)) for o in spec.output_specs
            ),
            batched=spec.max_rows is not None,  # inputs' first dimension is the batch
        )
