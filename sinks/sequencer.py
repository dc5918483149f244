"""Each source's event numbers (``seq``): handed out once, contiguous, durable across restarts.

One small SQLite file (``sequence.db`` beside the outboxes), shared by every sink and every
process: a row per source with the last seq handed out. ``next(source)`` adds one to it in a
write transaction and returns the new value (``next(source, count)`` reserves ``count`` at once
and returns the first), so a seq is never handed out twice, even by two processes at once, and a
restarted source worker continues from the last one. The caller allocates a seq once per event
and appends the same event to each of the source's sinks' outboxes, so an event has one ``id``
everywhere.

What it promises and what it cannot: the file is written with ``synchronous=FULL``, so not even a
power loss hands a seq out twice (a consumer dedupes by ``id``; a reused one would hide a real
event). A seq taken by a process that dies before it appends the event is lost: the consumer
sees the gap, which is what a gap means (that event was lost), never a reuse.

Called by the source workers (``video``) as events are made. One connection per ``Sequencer``,
serialised by its lock: threads may share one.
"""

from __future__ import annotations

from duomo.sinks.wal_database import WalFile, write_transaction

FILE_NAME = "sequence.db"

_SCHEMA = ("CREATE TABLE IF NOT EXISTS seqs (source TEXT PRIMARY KEY, last INTEGER NOT NULL)",)


class Sequencer(WalFile):
    """The seqs of every source, in the SQLite file ``path``; ``open()`` before use."""

    SCHEMA = _SCHEMA
    SYNCHRONOUS = "FULL"
    WHAT = "sequencer"

    def next(self, source: str, count: int = 1) -> int:
        """The first of ``count`` new contiguous seqs of ``source`` (the first ever is 1),
        durable once this returns."""
        if count < 1:
            raise ValueError(f"count must be at least 1: {count}")
        with self._lock, write_transaction(self._connection()) as conn:
            (last,) = conn.execute(
                "INSERT INTO seqs (source, last) VALUES (?, ?) "
                "ON CONFLICT (source) DO UPDATE SET last = last + excluded.last RETURNING last",
                (source, count),
            ).fetchall()[0]
        return int(last) - count + 1

    def last(self, source: str) -> int:
        """The last seq handed out for ``source`` (0: none yet)."""
        with self._lock:
            row = (
                self._connection()
                .execute("SELECT last FROM seqs WHERE source = ?", (source,))
                .fetchone()
            )
        return int(row[0]) if row else 0
