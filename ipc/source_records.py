"""The managed sources' records on the wire: what a source worker reports about each source it
decodes (``SourceReport``, in its ``source_report`` message), and what the supervisor shows about
each source (``SourceStatus``: ``duomo source list --json``, ``GET /v1/sources``, status).

Both are flat records of scalars whose dict form is derived from their fields (``ipc.records``):
every field by its name, each read by its declared type — a key missing or of the wrong type is
an error naming the record and the key, never a default.

Written by ``video.source_worker`` (reports) and ``supervisor.sources.fleet`` (status); read by
the supervisor, the CLI (``duomo source``) and the gateway.
"""

from __future__ import annotations

import dataclasses

from duomo.ipc.records import Record

SOURCE_STATES = ("connecting", "playing", "reconnecting", "failed", "stopped")


@dataclasses.dataclass(frozen=True)
class SourceReport(Record):
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
class SourceStatus(Record):
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
    sinks: str = ""  # the sinks its events go to (comma-separated)
    emit: str | None = None  # answers | objects | both (resolved); None without sinks
