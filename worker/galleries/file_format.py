"""The gallery file's format: its SQLite schema, how it is opened, and how a file is told to be
a gallery of a format this code reads (``GalleryFileError`` otherwise).

Schema (``FORMAT_VERSION`` 1)::

    meta(key TEXT PRIMARY KEY, value NOT NULL)
        format           "duomo-gallery"  (what tells a gallery from another SQLite file)
        format_version   1
        embedding_model  the name of the model whose embeddings it holds ("sface")
        dimension        D, the length of every embedding
        version          a counter bumped by every change, in the change's own transaction
    identities(id INTEGER PRIMARY KEY, name TEXT UNIQUE, metadata TEXT (JSON), created REAL)
    embeddings(id INTEGER PRIMARY KEY, identity → identities.id, vector BLOB)
        vector: D float32, little-endian, unit length

Connections never create a file (``create_file`` does, owner-only), wait ``BUSY_TIMEOUT_S`` for
another process's write, and zero what they delete (``secure_delete``). Used by
``worker.galleries.store`` alone.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from duomo.ipc.errors import InvalidArgumentError

FORMAT = "duomo-gallery"
FORMAT_VERSION = 1
BUSY_TIMEOUT_S = 30.0  # how long a writer waits for another process's transaction

SCHEMA = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value NOT NULL)",
    "CREATE TABLE identities (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE,"
    " metadata TEXT NOT NULL, created REAL NOT NULL)",
    "CREATE TABLE embeddings (id INTEGER PRIMARY KEY,"
    " identity INTEGER NOT NULL REFERENCES identities(id), vector BLOB NOT NULL)",
    "CREATE INDEX embeddings_by_identity ON embeddings(identity)",
)


class GalleryFileError(InvalidArgumentError):
    """The file is not a gallery this model can use: missing, not one, another embedding model
    or dimension, a newer format, or corrupt. The message names the file and what is wrong."""


def create_file(path: Path, embedding_model: str, dimension: int) -> sqlite3.Connection:
    """A new gallery at ``path`` (owner-only: it holds biometric data; WAL mode), empty, for
    ``embedding_model``'s ``dimension``-long embeddings: a connection to it.
    GalleryFileError if a file is already there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    except FileExistsError:
        raise GalleryFileError(f"{path}: a file is already there") from None
    conn = connect(path)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        with write_transaction(conn):
            for statement in SCHEMA:
                conn.execute(statement)
            conn.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?)",
                [
                    ("format", FORMAT),
                    ("format_version", FORMAT_VERSION),
                    ("embedding_model", embedding_model),
                    ("dimension", dimension),
                    ("version", 1),
                ],
            )
    except BaseException:
        conn.close()
        path.unlink(missing_ok=True)
        raise
    return conn


def create_missing_file(path: Path, embedding_model: str, dimension: int) -> bool:
    """An empty gallery at ``path`` unless a file is there already: True if this call made it.
    Safe when processes race (a supervisor's instances, a command beside it): the gallery is
    made under a temporary name and linked into place whole, so no reader sees half a file."""
    if path.exists():
        return False
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.new")
    create_file(temporary, embedding_model, dimension).close()  # the last close empties the WAL
    try:
        os.link(temporary, path)
    except FileExistsError:
        return False
    finally:
        for leftover in (temporary, *(Path(f"{temporary}{end}") for end in ("-wal", "-shm"))):
            leftover.unlink(missing_ok=True)
    return True


@contextlib.contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """One write transaction, the write lock taken at its start: committed when the block
    ends, rolled back (nothing changed) if it raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def connect(path: Path) -> sqlite3.Connection:
    """A connection to the existing file at ``path`` (never one that creates it)."""
    uri = f"{path.resolve().as_uri()}?mode=rw"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    except sqlite3.Error as err:
        raise GalleryFileError(f"{path}: cannot be opened ({err})") from None
    with contextlib.suppress(sqlite3.DatabaseError):  # not a database: ``read_meta`` says so
        conn.execute("PRAGMA secure_delete=ON")
    return conn


def read_meta(conn: sqlite3.Connection, path: Path) -> dict[str, Any]:
    """The gallery's ``meta``, checked to be one of ours, in a format this code reads."""
    try:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    except sqlite3.DatabaseError as err:
        raise GalleryFileError(f"{path}: not a gallery (not an SQLite database: {err})") from None
    if not {"meta", "identities", "embeddings"} <= tables:
        raise GalleryFileError(f"{path}: an SQLite database, but not a gallery (no gallery tables)")
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    if meta.get("format") != FORMAT:
        raise GalleryFileError(f"{path}: an SQLite database, but not a gallery (format "
                               f"{meta.get('format')!r})")  # fmt: skip
    missing = {"format_version", "embedding_model", "dimension", "version"} - set(meta)
    if missing:
        raise GalleryFileError(f"{path}: a gallery without {sorted(missing)}: corrupt")
    if not isinstance(meta["format_version"], int) or meta["format_version"] > FORMAT_VERSION:
        raise GalleryFileError(
            f"{path}: gallery format {meta['format_version']!r}, newer than this Duomo reads "
            f"({FORMAT_VERSION})"
        )
    if not isinstance(meta["dimension"], int) or meta["dimension"] < 1:
        raise GalleryFileError(f"{path}: its dimension {meta['dimension']!r} is not valid")
    return meta
