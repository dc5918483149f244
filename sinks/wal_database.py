"""How the sinks open their SQLite files: WAL mode, a long busy timeout, owner-only files, and
write transactions that take the write lock up front.

Several processes open the same file (the source workers append to an outbox and take seqs; the
sink worker publishes and acknowledges), each through its own connection. WAL lets readers go on
beside the one writer; ``BEGIN IMMEDIATE`` takes the write lock at the start of a write
transaction, so two writers queue on the busy timeout instead of one failing with "database is
locked" when it upgrades a read lock. A committed transaction survives the process being
killed (its pages are in the WAL, which the next opener recovers); ``synchronous`` says what a
power loss may undo (NORMAL: the last commits; FULL: nothing committed).

Used by ``sinks.outbox`` (``Outbox``) and ``sinks.sequencer`` (``Sequencer``), each a
``WalFile``: one connection per object, serialised by that object's lock.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, TypeVar

BUSY_TIMEOUT_S = 30.0
Synchronous = Literal["NORMAL", "FULL"]  # how long a writer waits for another process's transaction


def open_database(
    path: Path, schema: tuple[str, ...], synchronous: Synchronous
) -> sqlite3.Connection:
    """A connection to ``path`` (created 0600 in an existing or new folder) in WAL mode with
    ``schema``'s statements applied (each ``CREATE … IF NOT EXISTS``, so any number of
    processes may open it at once). ``sqlite3.Error`` or ``OSError`` if it cannot be opened."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # the file holds the events (faces' thumbnails among them): owner-only, and SQLite gives
    # its -wal and -shm files the same mode
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    conn = sqlite3.connect(
        path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
    )
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(f"{path}: cannot use WAL mode (got {mode})")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        with write_transaction(conn):
            for statement in schema:
                conn.execute(statement)
    except BaseException:
        conn.close()
        raise
    return conn


@contextlib.contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction: committed when the block ends, rolled back if it raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


@contextlib.contextmanager
def read_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One read transaction: the queries in the block see one snapshot."""
    conn.execute("BEGIN")
    try:
        yield conn
    finally:
        conn.execute("COMMIT")


WalFileT = TypeVar("WalFileT", bound="WalFile")


class WalFile:
    """One process's connection to one of these files: opened (``open``, or a ``with`` block)
    with the subclass's ``SCHEMA`` and ``SYNCHRONOUS``, closed by ``close``; ``_lock``
    serialises its use, ``_connection()`` is it (RuntimeError naming ``WHAT`` when not open).
    The base of ``Outbox`` and ``Sequencer``."""

    SCHEMA: tuple[str, ...] = ()
    SYNCHRONOUS: Synchronous = "NORMAL"
    WHAT = "file"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def open(self: WalFileT) -> WalFileT:
        """Open (creating) the file; ``sqlite3.Error`` or ``OSError`` if it cannot be."""
        self._conn = open_database(self.path, self.SCHEMA, synchronous=self.SYNCHRONOUS)
        return self

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self: WalFileT) -> WalFileT:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError(f"the {self.WHAT} {self.path} is not open")
        return self._conn
