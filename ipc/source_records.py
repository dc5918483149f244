"""The managed sources' records on the wire: what a source worker reports about each source it
decodes (``SourceReport``, in its ``source_report`` message), and what the supervisor shows about
each source (``SourceStatus``: ``duomo source list --json``, ``GET /v1/sources``, status).

Both are flat records of scalars; their dict form is derived from the dataclass fields, once
(``FlatRecord``): ``to_dict`` writes every field by its name, ``from_dict`` reads each by its
declared type through ``RecordReader`` — a key missing or of the wrong type is an error naming
the record and the key, never a default.

Written by ``video.source_worker`` (reports) and ``supervisor.sources.fleet`` (status); read by
the supervisor, the CLI (``duomo source``) and the gateway.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar, get_type_hints

from duomo.ipc.record_reading import JSON, RecordReader

R = TypeVar("R", bound="FlatRecord")

SOURCE_STATES = ("connecting", "playing", "reconnecting", "failed", "stopped")

_READERS = {
    int: RecordReader.integer,
    int | None: RecordReader.optional_integer,
    float: RecordReader.number,
    float | None: RecordReader.optional_number,
    str: RecordReader.text,
    str | None: RecordReader.optional_text,
    bool: RecordReader.flag,
}


class FlatRecord:
    """A dataclass of scalars whose dict form is its fields by name."""

    _readers: ClassVar[dict[str, Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._readers = {}  # filled on first use, once the class is a dataclass

    def to_dict(self) -> JSON:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[R], data: object) -> R:
        readers = cls._readers
        if not readers:
            hints = get_type_hints(cls)
            for field in dataclasses.fields(cls):  # type: ignore[arg-type]
                readers[field.name] = _READERS[hints[field.name]]
        r = RecordReader(cls.__name__, data)
        return cls(**{name: read(r, name) for name, read in readers.items()})


@dataclasses.dataclass(frozen=True)
class SourceReport(FlatRecord):
    """One source as the worker decoding it sees it (``video.health`` has the states, and
    ``video.figures`` the counts: decoded = sent + dropped + detached + corrupt)."""

    name: str
    state: str
    last_error: str | None  # masked
    decoded: int
    sent: int
    dropped: int  # by max_fps / every
    corrupt: int  # concealed by the decoder: not sent
    decode_errors: int
    reconnects: int
    answered: int  # OK answers, over its models
    superseded: int
    failed: int  # answers with an error
    input_fps: float
    answered_fps: float
    age_p50_ms: float | None
    age_p99_ms: float | None


# what a source shows before its worker's first report, or while it waits for a worker
NO_REPORT = SourceReport(
    name="", state="connecting", last_error=None, decoded=0, sent=0, dropped=0, corrupt=0,
    decode_errors=0, reconnects=0, answered=0, superseded=0, failed=0, input_fps=0.0,
    answered_fps=0.0, age_p50_ms=None, age_p99_ms=None,
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SourceStatus(FlatRecord):
    """One managed source as the supervisor shows it: its definition (the URL masked), where it
    comes from (``config`` or ``runtime``), the worker decoding it (``worker``: its pid, None
    while it waits for one) and what that worker last reported (``connecting`` and zeros before
    the first report)."""

    name: str
    url: str  # masked
    feeds: str  # the models (comma-separated) or the pipeline its frames go to
    policy: str
    slots: int  # frames in flight per model (as given, or what auto chose)
    origin: str  # config | runtime
    worker: int | None  # the decoding process's pid
    worker_index: int | None  # which of the supervisor's source workers (its tail socket)
    state: str
    since_s: float  # in this state
    last_error: str | None
    decoded: int
    decode_errors: int
    reconnects: int
    answered: int
    superseded: int
    failed: int
    input_fps: float
    answered_fps: float
    age_p50_ms: float | None
    age_p99_ms: float | None
