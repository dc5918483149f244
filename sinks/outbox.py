"""A sink's durable outbox: every event is committed here before it is published, and deleted
when the broker acknowledges it.

One SQLite database in WAL mode per sink (``{directory}/{sink}.outbox.db``), written by several
processes at once (the source workers ``append``) and read by one (the sink's delivery loop:
``next_batch``, ``ack``, ``prune``), each through its own ``Outbox``. A committed append survives
a ``kill -9`` of any of them (``sinks.wal_database``).

Invariants:

- An event is a row keyed by ``(source, seq)``; appending the same one twice keeps one row.
  ``next_batch`` hands out each source's events in ``seq`` order, the sources in turn (each gets
  a share of the batch, the first source rotating), so one camera's backlog cannot hold back
  another's events.
- Bounds (``OutboxConfig``): past ``max_age_s`` or ``max_mb`` (bytes of the pending events'
  JSON, not of the file), the oldest pending events are deleted; each source's are deleted as
  a prefix of its seqs, so what is lost always precedes what is kept. The count is added to
  that source's ``dropped`` figure and carried by its next pending event (or, when none is
  left, by the next one appended), whose JSON then says ``"dropped": n`` (``events.with_dropped``)
  on every delivery of it, retries included. The producer's ``append`` enforces the bounds in
  its own transaction; the delivery loop calls ``prune()`` so events also age out while nothing
  is appended.
- The figures (pending events and bytes per source, dropped ever) are kept by triggers in a
  small ``sources`` table in the same transactions as the events, so any process reads them
  without counting rows.

Limits: an event pruned while a publisher holds it in flight may still reach the broker, and is
also counted as dropped (over-reporting the loss, never under-reporting it). Bytes are counted
on the event's JSON; SQLite's pages add to the file's size (the file does not shrink: freed
pages are reused).

Who calls it: the source workers (``append``, through one ``Outbox`` per sink they feed, with
seqs from ``sinks.sequencer.Sequencer``) and ``sinks.delivery.SinkDelivery`` (the rest).
``append`` does no network I/O, so a dead broker never slows the frame path; it waits only for
another writer's short transaction. One connection per ``Outbox``, serialised by its lock.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog

from duomo.sinks.config import OutboxConfig
from duomo.sinks.events import Event, event_id, split_id, with_dropped
from duomo.sinks.wal_database import WalFile, read_transaction, write_transaction

log = structlog.get_logger("duomo.sinks")

# once past max_mb, drop down to this share of it, so a full outbox prunes (and logs) in steps
# rather than on every append
_REFILL_SHARE = 0.98

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS events (
        id INTEGER PRIMARY KEY,
        source TEXT NOT NULL,
        seq INTEGER NOT NULL,
        kind TEXT NOT NULL,
        body BLOB NOT NULL,
        size INTEGER NOT NULL,
        created_at REAL NOT NULL,
        dropped INTEGER NOT NULL DEFAULT 0,
        UNIQUE (source, seq)
    )""",
    "CREATE INDEX IF NOT EXISTS events_by_age ON events (created_at)",
    """CREATE TABLE IF NOT EXISTS sources (
        source TEXT PRIMARY KEY,
        pending INTEGER NOT NULL DEFAULT 0,
        pending_bytes INTEGER NOT NULL DEFAULT 0,
        dropped INTEGER NOT NULL DEFAULT 0,
        carried INTEGER NOT NULL DEFAULT 0
    )""",
    """CREATE TRIGGER IF NOT EXISTS counted_in AFTER INSERT ON events BEGIN
        UPDATE sources SET pending = pending + 1, pending_bytes = pending_bytes + NEW.size
        WHERE source = NEW.source;
    END""",
    """CREATE TRIGGER IF NOT EXISTS counted_out AFTER DELETE ON events BEGIN
        UPDATE sources SET pending = pending - 1, pending_bytes = pending_bytes - OLD.size
        WHERE source = OLD.source;
    END""",
)


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """An event encoded once, to be appended to each of its source's sinks' outboxes."""

    source: str
    seq: int
    kind: str
    body: bytes

    @classmethod
    def of(cls, event: Event) -> OutboxEntry:
        return cls(event.source, event.seq, event.kind, event.encode())


@dataclass(frozen=True, slots=True)
class PendingEvent:
    """An event handed to a publisher: ``body`` is the JSON to send (with ``dropped`` set when
    the outbox dropped events of its source before it); ``created_at`` is when it was
    appended (UNIX seconds), for the delay to its acknowledgement."""

    source: str
    seq: int
    kind: str
    body: bytes
    created_at: float
    dropped: int = 0

    @property
    def id(self) -> str:
        return event_id(self.source, self.seq)


@dataclass(frozen=True, slots=True)
class Pending:
    """What waits in an outbox: events and bytes of their JSON."""

    events: int
    bytes: int


def outbox_path(directory: Path, sink: str) -> Path:
    """The file of sink ``sink``'s outbox under ``directory``."""
    return Path(directory) / f"{sink}.outbox.db"


class Outbox(WalFile):
    """The outbox in the SQLite file ``path``, bounded by ``bounds``; ``open()`` before use.
    ``name`` (the sink's) labels its log lines."""

    SCHEMA = _SCHEMA
    SYNCHRONOUS = "NORMAL"
    WHAT = "outbox"

    def __init__(self, path: Path, bounds: OutboxConfig, name: str = "") -> None:
        super().__init__(path)
        self.bounds = bounds
        self.name = name or self.path.name
        self._turn = 0  # which active source leads the next batch

    # -- the producers' side ------------------------------------------------------------------

    def append(self, events: Iterable[Event | OutboxEntry], now: float | None = None) -> int:
        """Commit ``events`` in one transaction (an event already here is kept as it is), then
        enforce the bounds; how many were new. ``now``: the append's time (UNIX seconds), for
        tests of the age bound."""
        entries = [e if isinstance(e, OutboxEntry) else OutboxEntry.of(e) for e in events]
        if not entries:
            return 0
        at = time.time() if now is None else now
        sources = sorted({e.source for e in entries})
        with self._lock, write_transaction(self._connection()) as conn:
            conn.executemany(
                "INSERT OR IGNORE INTO sources (source) VALUES (?)", [(s,) for s in sources]
            )
            added = 0
            for entry in entries:
                added += conn.execute(
                    "INSERT OR IGNORE INTO events (source, seq, kind, body, size, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (entry.source, entry.seq, entry.kind, entry.body, len(entry.body), at),
                ).rowcount
            self._hand_on_carried(conn, sources)
            dropped = self._enforce_bounds(conn, at)
        self._log_dropped(dropped)
        return added

    # -- the publisher's side -----------------------------------------------------------------

    def next_batch(self, limit: int) -> list[PendingEvent]:
        """Up to ``limit`` pending events, each source's in ``seq`` order, grouped by source.
        Each active source gets an equal share (at least one); what a source with fewer leaves
        goes to the others; which source leads rotates from one batch to the next."""
        with self._lock, read_transaction(self._connection()) as conn:
            active = sorted(
                r[0] for r in conn.execute("SELECT source FROM sources WHERE pending > 0")
            )
            if not active:
                return []
            start = self._turn % len(active)
            self._turn += 1
            active = active[start:] + active[:start]
            share = max(1, -(-limit // len(active)))
            groups: dict[str, list[PendingEvent]] = {}
            room = limit
            for source in active:
                groups[source] = self._pending_of(conn, source, 0, min(share, room))
                room -= len(groups[source])
            for source in active:  # the room left by sources with fewer than their share
                got = groups[source]
                if room > 0 and len(got) == share:
                    more = self._pending_of(conn, source, got[-1].seq, room)
                    got.extend(more)
                    room -= len(more)
        return [event for source in active for event in groups[source]]

    @staticmethod
    def _pending_of(
        conn: sqlite3.Connection, source: str, after: int, limit: int
    ) -> list[PendingEvent]:
        if limit <= 0:
            return []
        rows = conn.execute(
            "SELECT seq, kind, body, created_at, dropped FROM events "
            "WHERE source = ? AND seq > ? ORDER BY seq LIMIT ?",
            (source, after, limit),
        )
        return [
            PendingEvent(source, seq, kind, with_dropped(body, dropped), created_at, dropped)
            for seq, kind, body, created_at, dropped in rows
        ]

    def ack(self, ids: Iterable[str]) -> int:
        """Delete the events with these ids (acknowledged by the broker, or refused for good);
        how many were still here."""
        keys = [split_id(i) for i in ids]
        if not keys:
            return 0
        with self._lock, write_transaction(self._connection()) as conn:
            deleted = conn.executemany(
                "DELETE FROM events WHERE source = ? AND seq = ?", keys
            ).rowcount
        return max(deleted, 0)

    def prune(self, now: float | None = None) -> int:
        """Enforce the bounds now (the age bound ages events out while nothing is appended);
        how many events were dropped."""
        at = time.time() if now is None else now
        with self._lock, write_transaction(self._connection()) as conn:
            dropped = self._enforce_bounds(conn, at)
        self._log_dropped(dropped)
        return sum(dropped.values())

    # -- figures ------------------------------------------------------------------------------

    def pending(self) -> Pending:
        """The events waiting, and the bytes of their JSON."""
        with self._lock:
            events, size = (
                self._connection()
                .execute(
                    "SELECT COALESCE(SUM(pending), 0), COALESCE(SUM(pending_bytes), 0) FROM sources"
                )
                .fetchone()
            )
        return Pending(int(events), int(size))

    def dropped(self) -> dict[str, int]:
        """How many events of each source the bounds dropped, ever (only sources with some)."""
        with self._lock:
            rows = self._connection().execute(
                "SELECT source, dropped FROM sources WHERE dropped > 0 ORDER BY source"
            )
            return {source: int(n) for source, n in rows}

    # -- inside a write transaction -----------------------------------------------------------

    def _enforce_bounds(self, conn: sqlite3.Connection, now: float) -> dict[str, int]:
        dropped: dict[str, int] = {}
        cutoff = now - self.bounds.max_age_s
        # the oldest event by its index first: the grouped query below reads every pending
        # event's row (SQLite walks the (source, seq) index for GROUP BY), which on every
        # append would make appending cost as much as the backlog is long
        (oldest_at,) = conn.execute("SELECT MIN(created_at) FROM events").fetchone()
        expired = (
            conn.execute(
                "SELECT source, MAX(seq) FROM events WHERE created_at < ? GROUP BY source",
                (cutoff,),
            ).fetchall()
            if oldest_at is not None and oldest_at < cutoff
            else []
        )
        for source, last in expired:
            dropped[source] = self._drop_through(conn, source, last)
        (size,) = conn.execute("SELECT COALESCE(SUM(pending_bytes), 0) FROM sources").fetchone()
        if size > self.bounds.max_bytes:
            excess = size - int(self.bounds.max_bytes * _REFILL_SHARE)
            through: dict[str, int] = {}
            oldest = conn.execute("SELECT source, seq, size FROM events ORDER BY created_at, id")
            for source, seq, event_size in oldest:
                through[source] = max(seq, through.get(source, 0))
                excess -= event_size
                if excess <= 0:
                    break
            oldest.close()
            for source, last in through.items():
                dropped[source] = dropped.get(source, 0) + self._drop_through(conn, source, last)
        return {source: n for source, n in dropped.items() if n}

    @staticmethod
    def _drop_through(conn: sqlite3.Connection, source: str, last: int) -> int:
        """Drop ``source``'s pending events up to seq ``last``; their count, and the drops they
        carried, go on to its next pending event (or to the next one appended)."""
        count, carried = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(dropped), 0) FROM events WHERE source = ? AND seq <= ?",
            (source, last),
        ).fetchone()
        if not count:
            return 0
        conn.execute("DELETE FROM events WHERE source = ? AND seq <= ?", (source, last))
        conn.execute("UPDATE sources SET dropped = dropped + ? WHERE source = ?", (count, source))
        following = conn.execute(
            "SELECT id FROM events WHERE source = ? ORDER BY seq LIMIT 1", (source,)
        ).fetchone()
        if following is not None:
            conn.execute(
                "UPDATE events SET dropped = dropped + ? WHERE id = ?",
                (count + carried, following[0]),
            )
        else:
            conn.execute(
                "UPDATE sources SET carried = carried + ? WHERE source = ?",
                (count + carried, source),
            )
        return int(count)

    @staticmethod
    def _hand_on_carried(conn: sqlite3.Connection, sources: list[str]) -> None:
        """Drops carried by a source whose pending events were all dropped go to its first
        pending event now that there is one again."""
        marks = ",".join("?" * len(sources))
        carried = conn.execute(
            f"SELECT source, carried FROM sources WHERE carried > 0 AND source IN ({marks})",
            sources,
        ).fetchall()
        for source, count in carried:
            conn.execute(
                "UPDATE events SET dropped = dropped + ? WHERE id = "
                "(SELECT id FROM events WHERE source = ? ORDER BY seq LIMIT 1)",
                (count, source),
            )
            conn.execute("UPDATE sources SET carried = 0 WHERE source = ?", (source,))

    def _log_dropped(self, dropped: dict[str, int]) -> None:
        if dropped:
            log.warning(
                "sink outbox over its bound: oldest events dropped",
                sink=self.name,
                dropped=dropped,
                max_mb=self.bounds.max_mb,
                max_age_s=self.bounds.max_age_s,
            )
