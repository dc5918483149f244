"""The control protocol: every control message a client may send, parsed and checked once.

A control message is one JSON object in a JSON frame (``ipc.framing``): ``op`` names the
operation, ``id`` (optional: an integer, or a string of at most 64 characters; the reactor
checks it) is echoed in the reply, and the operation's own fields follow. Fields this module
does not know are ignored; an optional field may be left out or be ``null``. Each message is
answered exactly once, with an object that has ``ok``; a failure is
``{"ok": false, "code": <ipc.errors.ErrorCode>, "message": ...}`` and the client raises the
matching ``DuomoError``. A field that is missing or of the wrong type is INVALID_ARGUMENT
naming the operation and the field; an operation not listed here is INVALID_ARGUMENT
"unknown control operation"; an unexpected failure is INTERNAL with a fixed message naming
the operation (and its model), never the exception's text, which goes to the supervisor log.

==========  ===========================================  ========================================
op          fields                                       reply (besides ``ok: true``)
==========  ===========================================  ========================================
models      —                                            ``models``: one object per model: name,
                                                         task, backend, state, max_batch; once
                                                         loaded also inputs, result, outputs,
                                                         output_tensors, batched (``ModelInfo``)
attach      ``model`` str; ``slots`` int 1..64 (4);      ``ring`` int, ``layout``
            ``inputs`` {input: bytes ≥ 0} (none): the    (``RingLayout``), ``descriptor: true``:
            room a larger frame needs                    the ring's sealed memfd rides with the
                                                         reply (``SCM_RIGHTS``); a model never
                                                         loaded is loaded first (later)
detach      ``ring`` int                                 — (its queued work is dropped, the
                                                         segment unmapped once nothing reads it)
status      ``model`` str (none: the whole supervisor)   ``status``: the supervisor's state
                                                         (``ipc.status_records.SupervisorStatus``);
                                                         with ``model``, ``model_status``: that
                                                         model's alone (``ModelStatus``)
stop        ``wait`` bool (false)                        — at once; with ``wait``, once stopped:
                                                         ``cut`` int, the requests cut
reload      ``model`` str (none: the whole config)       ``added``, ``removed``, ``replaced``:
                                                         lists of model names (later)
load        ``model`` str                                ``load``: the model's status once READY
                                                         (later)
unload      ``model`` str                                ``unload``: ``model``,
                                                         ``answered_unavailable`` int (later)
stream_     ``name`` str (1..64 printable); ``models``   ``stream`` int: its id, for the slot
open        [str] (1..16); ``policy`` latest|fifo        headers' stream block
            (latest); ``weight`` [0.001, 1000] (1);
            ``fps`` (0, 1000] (none); ``stall_after_s``
            (5)
stream_     ``stream`` int                               — (the stream is ``ended``)
close
ping        —                                            —
source_     ``worker`` int ≥ 0, ``pid`` int; ``sources``  ``assigned``: the definitions of the
report      [``SourceReport``] (≤ 4096): a source        sources it should decode now
            worker's word on its sources
sources     —                                            ``sources``: [``SourceStatus``]
source      ``name`` str                                 ``source``: its ``SourceStatus``
source_     ``source`` {a ``sources:`` entry's fields}   ``source``: its ``SourceStatus`` (kept in
add                                                      the source database before the reply)
source_     ``name`` str                                 — (a config source: INVALID_ARGUMENT)
remove
sink_       ``sinks`` [``SinkStatus``] (≤ 1024): the     ``sinks``: the sink definitions now;
report      sink worker's word on its sinks              ``directory``: their outboxes' folder
sink        ``name`` str; ``pipeline`` str (none)        ``directory``, ``sink`` (its name and
                                                         outbox bounds): where ``duomo stream
                                                         --sink`` appends (no sink worker:
                                                         UNAVAILABLE); ``max_missed``: the
                                                         pipeline tracker's (null: none)
galleries   —                                            ``galleries``: [``GalleryInfo``], every
                                                         model whose task is ``gallery``
gallery_    ``gallery`` str; ``after`` str (none);       ``identities``: a page of [{name,
identities  ``limit`` int 1..1000 (500); ``embeddings``  metadata, created, embeddings: a count,
            bool (false)                                 or the vectors}] by name, under ~512 KiB;
                                                         ``next``: the name to ask after (null:
                                                         the end) (later)
gallery_    ``gallery`` str; ``name`` str;               ``identity`` {name, embeddings: n},
add         ``embeddings`` [[float]] (1..1024: the       ``replaced`` bool (later)
            gallery's bound checks); ``replace`` bool
            (false); ``metadata`` object (none)
gallery_    ``gallery`` str; ``name`` str                ``removed``: the name, gone from the
remove                                                   file and its WAL (later)
==========  ===========================================  ========================================

A model that is not served is NOT_FOUND, and so is a ring (or stream) this client has not
attached (opened), and a gallery the config does not have, or a name it does not hold; a
gallery's name already enrolled (``gallery_add`` without ``replace``) is INVALID_ARGUMENT, and
one past its bounds RESOURCE_EXHAUSTED; a stream name a live stream has is INVALID_ARGUMENT, and
one past ``limits.max_streams`` RESOURCE_EXHAUSTED; ``attach`` past 64 rings per client or the
``limits`` on slots and ring memory is RESOURCE_EXHAUSTED. The slow operations (marked "later")
are control jobs, answered when done, in the order they came; past ``limits.control_queue`` (or
``control_queue_per_client``) waiting, RESOURCE_EXHAUSTED at once.

Each operation is one dataclass whose ``parse`` reads its fields; ``parse_control`` picks it
by ``op`` (``ControlHandlers.handle``, ``supervisor.process.control_handlers``, then dispatches
on ``op`` to its handler). ``error_reply`` and ``internal_reply`` are the failure replies, on
the reactor thread and on the control-job thread alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from pydantic import ValidationError

from duomo.ipc.errors import DuomoError, InternalError, InvalidArgumentError, echoed
from duomo.ipc.record_reading import StatusRecordError
from duomo.ipc.sink_records import SinkStatus
from duomo.ipc.source_records import SourceReport
from duomo.ipc.stream_settings import StreamSettings
from duomo.supervisor.config import pydantic_problems
from duomo.supervisor.sources.definition import SourceDefinition

Reply = dict[str, Any]
T = TypeVar("T")
MAX_SLOTS = 64  # in one ring
DEFAULT_SLOTS = 4


class Fields:
    """One message's fields, each read and checked once; a field missing or of the wrong type
    is INVALID_ARGUMENT naming the operation and the field. Absent and ``null`` are the same."""

    def __init__(self, op: str, message: Mapping[str, Any]) -> None:
        self.op = op
        self._message = message

    def text(self, name: str) -> str:
        value = self._message.get(name)
        if isinstance(value, str):
            return value
        raise self._wrong(name, "a string")

    def optional_text(self, name: str) -> str | None:
        return None if self._message.get(name) is None else self.text(name)

    def integer(
        self, name: str, default: int | None = None, low: int | None = None, high: int | None = None
    ) -> int:
        value = self._message.get(name)
        if value is None and default is not None:
            return default
        if (
            type(value) is int  # (a bool is no integer here)
            and (low is None or value >= low)
            and (high is None or value <= high)
        ):
            return value
        bounds = f" in {low}..{high}" if low is not None and high is not None else ""
        raise self._wrong(name, f"an integer{bounds}")

    def object(self, name: str) -> dict[str, Any]:
        value = self._message.get(name)
        if isinstance(value, dict):
            return value
        raise self._wrong(name, "an object")

    def optional_object(self, name: str) -> dict[str, Any] | None:
        return None if self._message.get(name) is None else self.object(name)

    def vectors(self, name: str, most: int) -> list[list[float]]:
        """A list of 1..``most`` lists of numbers (their length is the reader's to check)."""
        value = self._message.get(name)
        if (
            isinstance(value, list)
            and 1 <= len(value) <= most
            and all(
                isinstance(v, list)
                and all(type(x) in (int, float) for x in v)  # (a bool is no number here)
                for v in value
            )
        ):
            return value
        raise self._wrong(name, f"a list of 1..{most} lists of numbers")

    def objects(self, name: str, most: int) -> list[dict[str, Any]]:
        """A list of at most ``most`` objects."""
        value = self._message.get(name)
        if (
            isinstance(value, list)
            and len(value) <= most
            and all(isinstance(v, dict) for v in value)
        ):
            return value
        raise self._wrong(name, f"a list of at most {most} objects")

    def record(self, read: Callable[[Mapping[str, Any]], T]) -> T:
        """A record its owner reads from the whole message, by the owner's rules (a stream's
        settings: ``ipc.stream_settings.StreamSettings.from_dict``, the producer's own
        check); its INVALID_ARGUMENT names this operation like a field's."""
        try:
            return read(self._message)
        except InvalidArgumentError as err:
            raise InvalidArgumentError(f"malformed {self.op!r} message: {err.message}") from None

    def flag(self, name: str) -> bool:
        value = self._message.get(name, False)
        if value is None or isinstance(value, bool):
            return bool(value)
        raise self._wrong(name, "true or false")

    def byte_counts(self, name: str) -> dict[str, int]:
        value = self._message.get(name)
        if value is None:
            return {}
        if isinstance(value, dict) and all(
            isinstance(k, str) and type(v) is int and v >= 0 for k, v in value.items()
        ):
            return value
        raise self._wrong(name, "an object mapping input names to byte counts")

    def _wrong(self, name: str, expected: str) -> InvalidArgumentError:
        value = self._message.get(name)
        problem = f"is missing ({expected})" if value is None else f"must be {expected}, not "
        shown = "" if value is None else echoed(value)
        return InvalidArgumentError(f"malformed {self.op!r} message: {name!r} {problem}{shown}")


@dataclass(frozen=True)
class ControlMessage:
    """What every operation's message has: its name, and how it is read from the wire."""

    op: ClassVar[str]

    @classmethod
    def parse(cls, fields: Fields) -> ControlMessage:
        return cls()  # (an operation without fields)

    @property
    def what(self) -> str:
        """The operation, and the model it names: what an INTERNAL reply and the log say."""
        model = getattr(self, "model", None)
        return f"{self.op!r} for model {echoed(model)}" if model is not None else repr(self.op)


@dataclass(frozen=True)
class Models(ControlMessage):
    """``models``: every served model (its ``ModelInfo``: state, and its slot layout once known)."""

    op = "models"


@dataclass(frozen=True)
class Attach(ControlMessage):
    """``attach``: a ring of ``slots`` slots for ``model``, with the input areas named in
    ``inputs`` holding at least that many bytes."""

    op = "attach"
    model: str
    slots: int = DEFAULT_SLOTS
    inputs: Mapping[str, int] = field(default_factory=dict)  # input -> bytes its area must hold

    @classmethod
    def parse(cls, fields: Fields) -> Attach:
        return cls(
            model=fields.text("model"),
            slots=fields.integer("slots", default=DEFAULT_SLOTS, low=1, high=MAX_SLOTS),
            inputs=fields.byte_counts("inputs"),
        )


@dataclass(frozen=True)
class RingMessage(ControlMessage):
    """An operation on one of the asking client's rings."""

    ring: int

    @classmethod
    def parse(cls, fields: Fields) -> RingMessage:
        return cls(ring=fields.integer("ring"))


@dataclass(frozen=True)
class Detach(RingMessage):
    """``detach``: the client is done with ``ring``."""

    op = "detach"


@dataclass(frozen=True)
class Status(ControlMessage):
    """``status``: the whole supervisor's status, or one model's."""

    op = "status"
    model: str | None = None  # None: the whole supervisor; else that model's status alone

    @classmethod
    def parse(cls, fields: Fields) -> Status:
        return cls(model=fields.optional_text("model"))


@dataclass(frozen=True)
class Stop(ControlMessage):
    """``stop``: stop the supervisor; with ``wait``, answer once it has stopped."""

    op = "stop"
    wait: bool = False  # answer once stopped, with how many requests were cut

    @classmethod
    def parse(cls, fields: Fields) -> Stop:
        return cls(wait=fields.flag("wait"))


@dataclass(frozen=True)
class Reload(ControlMessage):
    """``reload``: read the config file again and apply its difference, or only one model's."""

    op = "reload"
    model: str | None = None  # None: the whole config file

    @classmethod
    def parse(cls, fields: Fields) -> Reload:
        return cls(model=fields.optional_text("model"))


@dataclass(frozen=True)
class ModelMessage(ControlMessage):
    """An operation on one model, by name."""

    model: str

    @classmethod
    def parse(cls, fields: Fields) -> ModelMessage:
        return cls(model=fields.text("model"))


@dataclass(frozen=True)
class Load(ModelMessage):
    """``load``: an operator's load of one model."""

    op = "load"


@dataclass(frozen=True)
class Unload(ModelMessage):
    """``unload``: an operator's unload of one model (it stays unloaded until loaded again)."""

    op = "unload"


@dataclass(frozen=True)
class StreamOpen(ControlMessage):
    """``stream_open``: a stream named ``name`` opened with ``settings``
    (``supervisor.dataflow.streams``); answered with its id, which the producer writes into each of
    its slots' headers."""

    op = "stream_open"
    name: str
    settings: StreamSettings

    @classmethod
    def parse(cls, fields: Fields) -> StreamOpen:
        return cls(name=fields.text("name"), settings=fields.record(StreamSettings.from_dict))


@dataclass(frozen=True)
class StreamClose(ControlMessage):
    """``stream_close``: the producer is done with stream ``stream`` (its id)."""

    op = "stream_close"
    stream: int

    @classmethod
    def parse(cls, fields: Fields) -> StreamClose:
        return cls(stream=fields.integer("stream"))


@dataclass(frozen=True)
class Ping(ControlMessage):
    """``ping``: answered at once, to show the supervisor is there."""

    op = "ping"


# -- the managed sources (supervisor.sources.fleet) ---------------------------------------------

MAX_REPORTED = 4096  # sources one worker may report on


@dataclass(frozen=True)
class SourceReports(ControlMessage):
    """``source_report``: source worker ``worker`` (pid ``pid``) says what its sources do; the
    reply assigns it the sources to decode now."""

    op = "source_report"
    worker: int
    pid: int
    sources: tuple[SourceReport, ...]

    @classmethod
    def parse(cls, fields: Fields) -> SourceReports:
        reports = fields.objects("sources", most=MAX_REPORTED)
        try:
            read = tuple(SourceReport.from_dict(r) for r in reports)
        except StatusRecordError as err:
            raise InvalidArgumentError(
                f"malformed 'source_report' message: {err.message}"
            ) from None
        return cls(fields.integer("worker", low=0), fields.integer("pid", low=1), read)


@dataclass(frozen=True)
class Sources(ControlMessage):
    """``sources``: every managed source (``SourceStatus``)."""

    op = "sources"


@dataclass(frozen=True)
class SourceShow(ControlMessage):
    """``source``: the managed source ``name``."""

    op = "source"
    name: str

    @classmethod
    def parse(cls, fields: Fields) -> SourceShow:
        return cls(fields.text("name"))


@dataclass(frozen=True)
class SourceAdd(ControlMessage):
    """``source_add``: a source added at run time, its fields those of a ``sources:`` entry."""

    op = "source_add"
    definition: SourceDefinition

    @classmethod
    def parse(cls, fields: Fields) -> SourceAdd:
        given = fields.object("source")
        try:
            return cls(SourceDefinition.model_validate(given))
        except ValidationError as err:  # (told as a config's field is: one rule for both)
            problems = "; ".join(f"{at}: {why}" for at, why in pydantic_problems(err))
            raise InvalidArgumentError(f"not a source: {problems}") from None


@dataclass(frozen=True)
class SourceRemove(ControlMessage):
    """``source_remove``: forget the run-time source ``name``."""

    op = "source_remove"
    name: str

    @classmethod
    def parse(cls, fields: Fields) -> SourceRemove:
        return cls(fields.text("name"))


# -- the sinks (supervisor.sinks.hub) ------------------------------------------------------------

MAX_SINKS = 1024  # sinks the sink worker may report on


@dataclass(frozen=True)
class SinkReports(ControlMessage):
    """``sink_report``: the sink worker says what each of its sinks does; the reply carries the
    sink definitions now."""

    op = "sink_report"
    sinks: tuple[SinkStatus, ...]

    @classmethod
    def parse(cls, fields: Fields) -> SinkReports:
        reports = fields.objects("sinks", most=MAX_SINKS)
        try:
            return cls(tuple(SinkStatus.from_dict(r) for r in reports))
        except StatusRecordError as err:
            raise InvalidArgumentError(f"malformed 'sink_report' message: {err.message}") from None


@dataclass(frozen=True)
class SinkTarget(ControlMessage):
    """``sink``: where a producer appends the events of the sink ``name``."""

    op = "sink"
    name: str
    pipeline: str | None = None

    @classmethod
    def parse(cls, fields: Fields) -> SinkTarget:
        return cls(fields.text("name"), fields.optional_text("pipeline"))


# -- the galleries (supervisor.galleries.keeper) -------------------------------------------------

MAX_PAGE = 1000  # identities in one page
DEFAULT_PAGE = 500
MAX_VECTORS = 1024  # embeddings in one enrolment (the gallery's own bound is checked after)


@dataclass(frozen=True)
class Galleries(ControlMessage):
    """``galleries``: every gallery model (``GalleryInfo``)."""

    op = "galleries"


@dataclass(frozen=True)
class GalleryIdentities(ControlMessage):
    """``gallery_identities``: a page of ``gallery``'s identities, by name, after ``after``."""

    op = "gallery_identities"
    gallery: str
    after: str | None = None
    limit: int = DEFAULT_PAGE
    embeddings: bool = False  # the vectors themselves, not their count

    @classmethod
    def parse(cls, fields: Fields) -> GalleryIdentities:
        return cls(
            fields.text("gallery"),
            fields.optional_text("after"),
            fields.integer("limit", default=DEFAULT_PAGE, low=1, high=MAX_PAGE),
            fields.flag("embeddings"),
        )


@dataclass(frozen=True)
class GalleryAdd(ControlMessage):
    """``gallery_add``: enrol ``name`` into ``gallery`` with ``embeddings``."""

    op = "gallery_add"
    gallery: str
    name: str
    embeddings: list[list[float]]
    replace: bool = False
    metadata: dict[str, Any] | None = None

    @classmethod
    def parse(cls, fields: Fields) -> GalleryAdd:
        return cls(
            fields.text("gallery"),
            fields.text("name"),
            fields.vectors("embeddings", most=MAX_VECTORS),
            fields.flag("replace"),
            fields.optional_object("metadata"),
        )


@dataclass(frozen=True)
class GalleryRemove(ControlMessage):
    """``gallery_remove``: remove ``name`` from ``gallery``, and every trace of it."""

    op = "gallery_remove"
    gallery: str
    name: str

    @classmethod
    def parse(cls, fields: Fields) -> GalleryRemove:
        return cls(fields.text("gallery"), fields.text("name"))


MESSAGES: dict[str, type[ControlMessage]] = {
    m.op: m
    for m in (
        Models,
        Attach,
        Detach,
        Status,
        Stop,
        Reload,
        Load,
        Unload,
        StreamOpen,
        StreamClose,
        Ping,
        SourceReports,
        Sources,
        SourceShow,
        SourceAdd,
        SourceRemove,
        SinkReports,
        SinkTarget,
        Galleries,
        GalleryIdentities,
        GalleryAdd,
        GalleryRemove,
    )
}


def parse_control(message: Mapping[str, Any]) -> ControlMessage:
    """The dataclass for one decoded control message; InvalidArgumentError for an unknown
    operation or a field missing or of the wrong type."""
    op = message.get("op")
    kind = MESSAGES.get(op) if isinstance(op, str) else None
    if kind is None:
        raise InvalidArgumentError(f"unknown control operation {echoed(op)}")
    return kind.parse(Fields(kind.op, message))


def error_reply(err: DuomoError) -> Reply:
    """The reply for an error raised on purpose: its code and its own message."""
    return {"ok": False, "code": int(err.code), "message": err.message}


def internal_reply(what: str) -> Reply:
    """The reply when handling ``what`` (``ControlMessage.what``) failed unexpectedly: a fixed
    message, never the exception's text (the caller logs the traceback)."""
    return error_reply(InternalError(f"internal error in {what}; the supervisor log has details"))
