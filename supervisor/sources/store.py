"""The sources added at run time, kept in an embedded SQLite database so that they outlive the
supervisor: ``duomo source add`` and ``POST /v1/sources`` write here before they answer, ``remove``
deletes here, and a supervisor that starts plays what it finds (beside the config's ``sources:``).

One table, ``sources(name PRIMARY KEY, definition JSON, added_at)``; a definition is
``SourceDefinition.wire()`` — the URL as written, its secrets references, never their values.
The database is the source of truth for what was added at run time: a row that no longer reads
as a definition (written by a newer Duomo, or edited by hand) is logged and skipped, never a
reason not to start. WAL mode, one connection, used under the store's lock; the file is made by
the first source added (a supervisor that never adds one leaves none behind).

Where: ``source_workers.database`` in the config, else beside the socket (``<socket>.sources.db``,
in the supervisor's private runtime folder). Used by ``supervisor.sources.fleet``.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import structlog
from pydantic import ValidationError

from duomo.supervisor.sources.definition import SourceDefinition

log = structlog.get_logger("duomo.sources")
SCHEMA = """
CREATE TABLE IF NOT EXISTS sources (
    name TEXT PRIMARY KEY,
    definition TEXT NOT NULL,
    added_at REAL NOT NULL
)
"""


class SourceStore:
    """The run-time sources, one row each (thread-safe)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._connection: sqlite3.Connection | None = None

    @property
    def _db(self) -> sqlite3.Connection:
        """The database, created with its table on first use (a supervisor that never adds a
        source leaves no file behind)."""
        if self._connection is None:
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")  # an answered add survives a power cut
            db.execute(SCHEMA)
            self._connection = db
        return self._connection

    def load(self) -> list[SourceDefinition]:
        """Every stored definition that still reads as one, in the order they were added."""
        if self._connection is None and not self.path.exists():
            return []
        with self._lock:
            rows = self._db.execute(
                "SELECT name, definition FROM sources ORDER BY added_at"
            ).fetchall()
        found = []
        for name, text in rows:
            try:
                found.append(SourceDefinition.model_validate(json.loads(text)))
            except (ValueError, ValidationError) as err:
                log.error(
                    "a stored source does not read as one; skipped",
                    source=name, database=str(self.path), error=str(err).splitlines()[0],
                )  # fmt: skip
        return found

    def put(self, definition: SourceDefinition) -> None:
        """Store ``definition`` (replacing one of its name)."""
        text = json.dumps(definition.wire(), sort_keys=True)
        with self._lock:
            self._db.execute(
                "INSERT INTO sources (name, definition, added_at) VALUES (?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET definition = excluded.definition",
                (definition.name, text, time.time()),
            )

    def delete(self, name: str) -> bool:
        """Forget ``name``; whether it was stored."""
        with self._lock:
            return self._db.execute("DELETE FROM sources WHERE name = ?", (name,)).rowcount > 0

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None
