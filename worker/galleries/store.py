"""The gallery file: an embedded SQLite database of enrolled identities (``GalleryStore``).

The file's schema and format: ``worker.galleries.file_format``.

The file is in WAL mode, owner-only (0600: it holds biometric data), with ``secure_delete`` on
(a removed identity's pages are zeroed); ``remove(..., vacuum=True)`` then rebuilds the file and
empties its WAL, so nothing of a removed person is left in either. Every change is one
``BEGIN IMMEDIATE`` transaction that also bumps ``version``: a reader in another process (a
served gallery, ``worker.galleries.session``) that reads ``version`` and the contents in one
read transaction sees a change whole or not at all. A change refused (a bad name, a bound
passed) rolls back: nothing changed.

Errors (``duomo.ipc.errors``): ``GalleryFileError`` (an ``InvalidArgumentError``) for a file
that is missing, not SQLite, SQLite but not a gallery, a gallery of another embedding model or
dimension, of a newer format, or corrupt; ``InvalidArgumentError`` for a bad name, metadata or
vector (``worker.galleries.entries``) or a name already enrolled without ``replace``;
``ResourceExhaustedError`` past ``GalleryLimits``; ``NotFoundError`` for removing a name that
is not there.

One ``GalleryStore`` is one connection, used by the thread that opened it. Callers: the
``gallery`` task's session (reads), the enrolment tools and tests (writes), ``exchange``.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duomo.ipc.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from duomo.worker.galleries.entries import (
    Identity,
    checked_metadata,
    checked_name,
    metadata_json,
    unit_vectors,
)
from duomo.worker.galleries.file_format import (
    GalleryFileError,
    connect,
    create_file,
    create_missing_file,
    read_meta,
    write_transaction,
)

SERVING_CACHE_KIB = 256  # a serving connection reads ``version`` and, on a change, scans once
BLOCK_ROWS = 1024  # embeddings read as rows, a block at a time, and stored as columns


@dataclass(frozen=True)
class GalleryLimits:
    """A gallery's bounds: what a change may not go past (``ResourceExhaustedError``)."""

    max_identities: int = 100_000
    max_embeddings_per_identity: int = 16


DEFAULT_LIMITS = GalleryLimits()


@dataclass(frozen=True)
class NewIdentity:
    """An identity to enrol: its name, its embeddings (one, or several × D) and metadata."""

    name: str
    vectors: Any
    metadata: dict[str, Any] | None = None


@dataclass(frozen=True)
class GalleryContents:
    """Everything a search needs, read in one transaction at ``version``: the identities' names
    (packed: one UTF-8 buffer and where each name ends), each embedding's identity index, and
    the embeddings as the columns of one matrix (float32 D × N, unit columns)."""

    version: int
    name_bytes: bytes
    name_ends: np.ndarray  # int64, one per identity, in enrolment order
    row_identity: np.ndarray  # int32, one per embedding: an index into the names
    matrix: np.ndarray  # float32 D × N: embedding i is column i

    @property
    def names(self) -> list[str]:
        """The names by identity index (for tools and tests: a search reads them packed)."""
        starts = [0, *self.name_ends[:-1].tolist()]
        return [self.name_bytes[a:b].decode() for a, b in zip(starts, self.name_ends.tolist())]


class GalleryStore:
    """One connection to a gallery file: ``create`` a new one or ``open`` one and check it."""

    def __init__(self, path: Path, conn: sqlite3.Connection, model: str, dimension: int) -> None:
        self.path = path
        self.embedding_model = model
        self.dimension = dimension
        self._conn = conn

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    def create(cls, path: Path, embedding_model: str, dimension: int) -> GalleryStore:
        """A new, empty gallery at ``path`` for ``embedding_model``'s ``dimension``-long
        embeddings; GalleryFileError if a file is already there."""
        if not embedding_model or dimension < 1:
            raise InvalidArgumentError(
                "a gallery needs an embedding model's name and dimension ≥ 1"
            )
        conn = create_file(path, embedding_model, dimension)
        return cls(path, conn, embedding_model, dimension)

    @staticmethod
    def create_missing(path: Path, embedding_model: str, dimension: int) -> bool:
        """An empty gallery at ``path`` unless a file is there: True if this call made it
        (several processes may race to; one makes it whole, the others find it)."""
        if not embedding_model or dimension < 1:
            raise InvalidArgumentError(
                "a gallery needs an embedding model's name and dimension ≥ 1"
            )
        return create_missing_file(path, embedding_model, dimension)

    @classmethod
    def open(
        cls,
        path: Path,
        embedding_model: str | None = None,
        dimension: int | None = None,
        check: bool = True,
    ) -> GalleryStore:
        """The gallery at ``path``, checked: a gallery of a format this code reads, made for
        ``embedding_model`` and ``dimension`` where given, and (``check``) whole by SQLite's
        ``quick_check``. GalleryFileError naming the file and what is wrong otherwise."""
        if not path.is_file():
            raise GalleryFileError(f"{path}: no gallery file there")
        conn = connect(path)
        try:
            meta = read_meta(conn, path)
            store = cls(path, conn, str(meta["embedding_model"]), int(meta["dimension"]))
            if embedding_model is not None and store.embedding_model != embedding_model:
                raise GalleryFileError(
                    f"{path}: a gallery of {store.embedding_model!r} embeddings, "
                    f"not {embedding_model!r}"
                )
            if dimension is not None and store.dimension != dimension:
                raise GalleryFileError(
                    f"{path}: a gallery of {store.dimension}-long embeddings, not {dimension}"
                )
            if check:
                store.check()
        except sqlite3.DatabaseError as err:
            conn.close()
            raise GalleryFileError(f"{path}: not a readable gallery ({err})") from None
        except BaseException:
            conn.close()
            raise
        return store

    def serve(self) -> None:
        """Make this a serving connection: a small page cache (it reads ``version`` per batch and
        scans the file only on a change), charged to the model as little as possible. Before
        ``check`` (which reads every page), so a check does not fill a large cache."""
        self._conn.execute(f"PRAGMA cache_size=-{SERVING_CACHE_KIB}")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> GalleryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ------------------------------------------------------------------------------

    def version(self) -> int:
        """The file's change counter: one indexed read (what a served gallery asks per batch)."""
        try:
            row = self._conn.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()
        except sqlite3.DatabaseError as err:
            raise GalleryFileError(f"{self.path}: cannot read its version ({err})") from None
        return int(row[0])

    def counts(self) -> tuple[int, int]:
        """How many identities, and embeddings, it holds."""
        with self._read():
            identities = self._conn.execute("SELECT count(*) FROM identities").fetchone()[0]
            embeddings = self._conn.execute("SELECT count(*) FROM embeddings").fetchone()[0]
        return int(identities), int(embeddings)

    def identities(
        self, with_embeddings: bool = False, after: str | None = None, limit: int | None = None
    ) -> list[Identity]:
        """The identities by name — every one, or a page: at most ``limit`` of those named
        after ``after`` — each with its metadata, when it was enrolled and how many embeddings
        it has; the embeddings themselves only ``with_embeddings``. A page reads its own rows
        (by the names' index), not the whole file."""
        with self._read():
            rows = self._conn.execute(
                "SELECT i.id, i.name, i.metadata, i.created,"
                " (SELECT count(*) FROM embeddings e WHERE e.identity = i.id)"
                " FROM identities i WHERE i.name > ? ORDER BY i.name LIMIT ?",
                ("" if after is None else after, -1 if limit is None else limit),
            ).fetchall()
            vectors = {}
            if with_embeddings:
                vectors = self._vectors_of([row[0] for row in rows], every=limit is None)
        return [
            Identity(name, _json_object(metadata), created, count, vectors.get(ident))
            for ident, name, metadata, created, count in rows
        ]

    def contents(self, limits: GalleryLimits | None = None) -> GalleryContents:
        """Every embedding and name, read in one transaction (a change is seen whole or not at
        all) straight into their packed arrays, one row at a time (no list of a hundred thousand
        rows on the way); ResourceExhaustedError if it holds more than ``limits`` allow,
        GalleryFileError if the file cannot be read or a vector is not D float32."""
        dimension = self.dimension
        row_bytes = dimension * 4
        ids, ends, names = array("q"), array("q"), bytearray()
        try:
            with self._read():
                version = int(
                    self._conn.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()[0]
                )
                for ident, name in self._conn.execute(
                    "SELECT id, name FROM identities ORDER BY id"
                ):
                    ids.append(ident)
                    names += name.encode()
                    ends.append(len(names))
                if limits is not None:
                    self._check_held(len(ids), limits)
                total = self._conn.execute("SELECT count(*) FROM embeddings").fetchone()[0]
                matrix = np.empty((dimension, total), dtype=np.float32)
                owners = np.empty(total, dtype=np.int64)
                block = np.empty((BLOCK_ROWS, dimension), dtype=np.float32)
                flat, filled, start = block.data.cast("B"), 0, 0
                rows = self._conn.execute(
                    "SELECT identity, vector FROM embeddings ORDER BY identity, id"
                )
                for i, (owner, vector) in enumerate(rows):
                    if len(vector) != row_bytes:
                        raise GalleryFileError(
                            f"{self.path}: an embedding of identity {owner} is not "
                            f"{dimension} float32 numbers: the file is corrupt"
                        )
                    owners[i] = owner
                    flat[filled * row_bytes : (filled + 1) * row_bytes] = vector
                    filled += 1
                    if filled == BLOCK_ROWS:  # a block of rows becomes columns at once
                        matrix[:, start : start + filled] = block.T
                        start, filled = start + filled, 0
                matrix[:, start : start + filled] = block[:filled].T
        except sqlite3.DatabaseError as err:
            raise GalleryFileError(f"{self.path}: cannot be read, corrupt? ({err})") from None
        row_identity = self._owner_indices(np.frombuffer(ids, dtype=np.int64), owners)
        if limits is not None and total:
            most = int(np.bincount(row_identity).max())
            if most > limits.max_embeddings_per_identity:
                raise ResourceExhaustedError(
                    f"{self.path}: an identity holds {most} embeddings, above "
                    f"max_embeddings_per_identity {limits.max_embeddings_per_identity}"
                )
        name_ends = np.frombuffer(ends, dtype=np.int64).copy()
        return GalleryContents(version, bytes(names), name_ends, row_identity, matrix)

    # -- changing -----------------------------------------------------------------------------

    def add(
        self,
        name: str,
        vectors: Any,
        metadata: dict[str, Any] | None = None,
        replace: bool = False,
        limits: GalleryLimits = DEFAULT_LIMITS,
    ) -> None:
        """Enrol ``name`` with one or more embeddings; with ``replace`` an identity of that
        name is replaced whole (embeddings and metadata), else it is an error."""
        self.add_many([NewIdentity(name, vectors, metadata)], replace, limits)

    def add_many(
        self,
        identities: Iterable[NewIdentity],
        replace: bool = False,
        limits: GalleryLimits = DEFAULT_LIMITS,
    ) -> int:
        """Enrol every one of ``identities`` in one transaction (``version`` bumped once): all
        of them, or none if one is refused. How many were enrolled."""
        checked = [self._checked(new, limits) for new in identities]
        if len({name for name, _, _ in checked}) != len(checked):
            raise InvalidArgumentError("the same name is enrolled twice in one change")
        created = time.time()
        with self._write():
            for name, vectors, metadata in checked:
                found = self._conn.execute(
                    "SELECT id FROM identities WHERE name = ?", (name,)
                ).fetchone()
                if found is not None:
                    if not replace:
                        raise InvalidArgumentError(
                            f"{name!r} is already enrolled in {self.path.name} (replace it, or "
                            "remove it first)"
                        )
                    self._delete(found[0])
                cursor = self._conn.execute(
                    "INSERT INTO identities (name, metadata, created) VALUES (?, ?, ?)",
                    (name, metadata_json(metadata), created),
                )
                self._conn.executemany(
                    "INSERT INTO embeddings (identity, vector) VALUES (?, ?)",
                    [(cursor.lastrowid, row.astype("<f4").tobytes()) for row in vectors],
                )
            held = self._conn.execute("SELECT count(*) FROM identities").fetchone()[0]
            if held > limits.max_identities:
                raise ResourceExhaustedError(
                    f"{self.path.name} would hold {held} identities, above max_identities "
                    f"{limits.max_identities}: nothing was enrolled"
                )
            self._bump()
        return len(checked)

    def remove(self, name: str, vacuum: bool = False) -> None:
        """Remove ``name`` and every embedding of it; with ``vacuum`` the file is then rebuilt
        and its WAL emptied, so no page of it keeps the person (``vacuum``)."""
        with self._write():
            found = self._conn.execute(
                "SELECT id FROM identities WHERE name = ?", (name,)
            ).fetchone()
            if found is None:
                raise NotFoundError(f"{name!r} is not enrolled in {self.path.name}")
            self._delete(found[0])
            self._bump()
        if vacuum:
            self.vacuum()

    def vacuum(self) -> None:
        """Rebuild the file without its free pages and empty its WAL into it (waiting for
        readers up to the busy timeout): what was removed is gone from the disk's copy."""
        self._conn.execute("VACUUM")
        busy = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        if busy:
            raise ResourceExhaustedError(
                f"{self.path.name}: a reader held the file; its WAL could not be emptied yet"
            )

    # -- the parts ----------------------------------------------------------------------------

    def _checked(
        self, new: NewIdentity, limits: GalleryLimits
    ) -> tuple[str, np.ndarray, dict[str, Any]]:
        name = checked_name(new.name)
        vectors = unit_vectors(new.vectors, self.dimension)
        if len(vectors) > limits.max_embeddings_per_identity:
            raise ResourceExhaustedError(
                f"{name!r} comes with {len(vectors)} embeddings, above "
                f"max_embeddings_per_identity {limits.max_embeddings_per_identity}"
            )
        return name, vectors, checked_metadata(new.metadata)

    def _owner_indices(self, ids: np.ndarray, owners: np.ndarray) -> np.ndarray:
        """Each embedding's identity as an index into ``ids`` (sorted); GalleryFileError if
        one belongs to no identity."""
        found = np.searchsorted(ids, owners)
        inside = found < len(ids)
        if not inside.all() or (ids[found] != owners).any():
            raise GalleryFileError(f"{self.path}: an embedding belongs to no identity: corrupt")
        return found.astype(np.int32)

    def _check_held(self, identities: int, limits: GalleryLimits) -> None:
        if identities > limits.max_identities:
            raise ResourceExhaustedError(
                f"{self.path}: holds {identities} identities, above max_identities "
                f"{limits.max_identities}"
            )

    def _delete(self, identity: int) -> None:
        self._conn.execute("DELETE FROM embeddings WHERE identity = ?", (identity,))
        self._conn.execute("DELETE FROM identities WHERE id = ?", (identity,))

    def _bump(self) -> None:
        self._conn.execute("UPDATE meta SET value = value + 1 WHERE key = 'version'")

    def _vectors_of(self, owners: list[int], every: bool) -> dict[int, np.ndarray]:
        """The embeddings of ``owners`` (identity ids), by owner; ``every``: of all of them,
        read in one scan."""
        grouped: dict[int, list[bytes]] = {}
        if every:
            rows = self._conn.execute(
                "SELECT identity, vector FROM embeddings ORDER BY identity, id"
            )
        else:
            marks = ",".join("?" * len(owners))
            rows = self._conn.execute(
                f"SELECT identity, vector FROM embeddings WHERE identity IN ({marks})"
                " ORDER BY identity, id",
                owners,
            )
        for owner, vector in rows:
            grouped.setdefault(owner, []).append(vector)
        dimension = self.dimension
        return {
            owner: np.frombuffer(b"".join(parts), dtype="<f4").reshape(-1, dimension).copy()
            for owner, parts in grouped.items()
        }

    def check(self) -> None:
        """SQLite's ``quick_check`` of the whole file; GalleryFileError if it finds damage."""
        found = [row[0] for row in self._conn.execute("PRAGMA quick_check")]
        if found != ["ok"]:
            raise GalleryFileError(f"{self.path}: corrupt ({'; '.join(map(str, found[:3]))})")

    def _write(self) -> contextlib.AbstractContextManager[None]:
        return write_transaction(self._conn)

    @contextlib.contextmanager
    def _read(self) -> Iterator[None]:
        self._conn.execute("BEGIN")
        try:
            yield
        finally:
            self._conn.execute("COMMIT")


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    return value if isinstance(value, dict) else {}
