"""A served gallery file (``GallerySession``): the snapshot it serves, kept current with the file,
and the memory it is charged.

The gallery task's executor (``worker.executors.gallery``) opens one per instance on the instance's
worker thread and uses it only there. Before each batch it asks ``current()``: one read of the
file's ``version`` (``GalleryStore.version``); when that changed, the file's contents are read in
one transaction, made into a new ``GallerySnapshot`` and swapped in whole, so a batch searches one
version or the next, never a mixture, and a change made by any process (the enrolment tools) is
live on the next batch, without a reload. A large gallery (``BACKGROUND_EMBEDDINGS`` or more)
is read on a thread of its own, with its own connection, while the batches go on searching the
last snapshot: a change to a million identities (seconds of reading) never stalls the model; it
is served from the first batch after the read. A change the session cannot serve (past its
bounds, or a file found corrupt) is logged and the last good snapshot kept; it is tried again at
the next change.

The search (a matrix product) runs at its model's compute gate, as a backend's run does, so it
takes turns and its share of the device's time like any model's.

Memory: the snapshot is the gallery's weights. ``memory.weights`` names it as a ``MemoryShare``
of its current size, read whenever the memory ledger asks (``supervisor.core.memory``), so the
model is charged the matrix like weights, and charged again as it grows or shrinks.

It is a ``ModelSession`` so that the worker, the ledger and ``status`` handle it as any other:
``run`` searches a batch of embeddings (``{"embedding": B × D}`` → ``{"identity": int32 B,
"similarity": float32 B}``).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import structlog

from duomo.ipc.errors import DuomoError
from duomo.ipc.model_records import GalleryFigures
from duomo.worker.backends.base import (
    HostBuffers,
    MemoryShare,
    ModelSession,
    SessionMemory,
    SessionSettings,
    TensorSpec,
)
from duomo.worker.galleries.snapshot import GallerySnapshot, Match
from duomo.worker.galleries.store import GalleryLimits, GalleryStore

log = structlog.get_logger("duomo.gallery")
FLOAT32 = np.dtype(np.float32)
UNREADABLE = -1  # the version of a file whose version cannot be read (versions start at 1)
# a gallery served with this many embeddings or more reads a change on a thread of its own
# (measured: a read takes 0.19-0.34 s at 100 000, 3.6 s at 1 000 000, on the batches' thread);
# below it, up to the default max_identities of one embedding each and more, a change is
# searched by the very next batch, which waits for the read
BACKGROUND_EMBEDDINGS = 250_000


class GalleryMemory(SessionMemory):
    """What a served gallery holds: its query buffer, and its snapshot as its weights (a share
    only it uses, of the snapshot's size now)."""

    def __init__(self, session: GallerySession, device: int) -> None:
        # (weakly: the session holds its memory, and a cycle would keep the matrix of an
        # unloaded gallery resident until the garbage collector's next full pass)
        self._session = weakref.ref(session)
        self._device = device
        self._key = f"gallery:{session.path}:{id(session)}"
        self._name = session.path.name
        self.buffers = HostBuffers()

    @property
    def buffer_bytes(self) -> int:
        return self.buffers.nbytes

    @property
    def buffer_growths(self) -> int:
        return self.buffers.growths

    @property
    def weights(self) -> MemoryShare:
        session = self._session()
        nbytes = session.snapshot.nbytes if session is not None else 0
        return MemoryShare(self._key, self._name, self._device, nbytes)


class GallerySession(ModelSession):
    """One gallery file served: its snapshot, swapped whole when the file changes."""

    memory: GalleryMemory

    def __init__(
        self,
        store: GalleryStore,
        snapshot: GallerySnapshot,
        limits: GalleryLimits,
        settings: SessionSettings,
    ) -> None:
        """Serve ``store`` (opened and checked: ``open``), whose contents ``snapshot`` holds;
        ``settings``: its instance's device and place at the compute gate."""
        self.path = store.path
        self.inputs = (TensorSpec("embedding", FLOAT32, (None, store.dimension)),)
        self.outputs = (
            TensorSpec("identity", np.dtype(np.int32), (None,)),
            TensorSpec("similarity", FLOAT32, (None,)),
        )
        self.metadata = {
            "embedding_model": store.embedding_model,
            "dimension": str(store.dimension),
        }
        self._store = store
        self._limits = limits
        self._refused: int | None = None  # a version it could not serve (or UNREADABLE)
        self._reading: Future[GallerySnapshot] | None = None  # a change read in the background
        self._reading_version = UNREADABLE  # the file's version when that read began
        self._embedding_model, self._dimension = store.embedding_model, store.dimension
        self.snapshot = snapshot
        self.memory = GalleryMemory(self, settings.device)
        self._gate = settings.gate
        self._threads = max(1, settings.intra_op_threads)

    @classmethod
    def open(
        cls,
        path: Path,
        embedding_model: str,
        dimension: int,
        limits: GalleryLimits,
        settings: SessionSettings,
    ) -> GallerySession:
        """The gallery at ``path``, checked to be one of ``embedding_model``'s ``dimension``-long
        embeddings, whole and within ``limits``, read into memory: GalleryFileError or
        ResourceExhaustedError saying what is wrong otherwise."""
        store = GalleryStore.open(path, embedding_model, dimension, check=False)
        try:
            store.serve()
            store.check()
            return cls(store, GallerySnapshot.of(store.contents(limits)), limits, settings)
        except BaseException:
            store.close()
            raise

    def current(self) -> GallerySnapshot:
        """The snapshot the next batch searches: the one held if the file's ``version`` is
        unchanged, else a new one read from the file and swapped in whole (a large gallery's:
        once its read in the background is done; the last one until then)."""
        if self._reading is not None:
            if not self._reading.done():
                return self.snapshot
            self._take(self._reading)
        version = UNREADABLE
        try:
            version = self._store.version()
            if version == self.snapshot.version or version == self._refused:
                return self.snapshot
            if self.snapshot.matrix.shape[1] >= BACKGROUND_EMBEDDINGS:
                self._reading, self._reading_version = self._read_in_background(), version
                return self.snapshot
            self.snapshot = GallerySnapshot.of(self._store.contents(self._limits))
        except DuomoError as err:
            self._refuse(version, err)
        return self.snapshot

    def _read_in_background(self) -> Future[GallerySnapshot]:
        """The file's contents read on a thread of its own, with a connection of its own."""
        reading: Future[GallerySnapshot] = Future()

        def read() -> None:
            try:
                with GalleryStore.open(
                    self.path, self._embedding_model, self._dimension, check=False
                ) as store:
                    reading.set_result(GallerySnapshot.of(store.contents(self._limits)))
            except BaseException as err:  # (a DuomoError is the change refused; see _take)
                reading.set_exception(err)

        threading.Thread(target=read, name=f"duomo-gallery-read-{self.path.name}").start()
        return reading

    def _take(self, reading: Future[GallerySnapshot]) -> None:
        """A background read is done: swap its snapshot in, or keep the last (its error
        logged)."""
        self._reading = None
        try:
            self.snapshot = reading.result()
        except DuomoError as err:
            self._refuse(self._reading_version, err)
        except Exception:
            log.exception("gallery change not read", file=str(self.path))

    def _refuse(self, version: int, err: DuomoError) -> None:
        if version != self._refused:  # said once per version
            log.error(
                "gallery change not served: the last good version goes on",
                file=str(self.path), version=version, served=self.snapshot.version,
                error=err.message,
            )  # fmt: skip
        self._refused = version

    def figures(self) -> GalleryFigures:
        """What it serves now (from any thread: the snapshot is read whole)."""
        snapshot = self.snapshot
        return GalleryFigures(snapshot.identities, int(snapshot.matrix.shape[1]), snapshot.version)

    def search(
        self, snapshot: GallerySnapshot, queries: np.ndarray, threshold: float
    ) -> list[Match]:
        """``snapshot.search`` at its model's compute gate, as a backend's run: the product takes
        its turn and its share of the device's time like any model's."""
        with self._turn():
            return snapshot.search(queries, threshold)

    def _turn(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self._gate is None else self._gate.hold(self._threads)

    def input_buffer(self, name: str, shape: Sequence[int]) -> np.ndarray:
        return self.memory.buffers.view(name, self.spec(name).dtype, shape)

    def run(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Search ``inputs["embedding"]`` (B × D, unit rows) in the current snapshot: each
        query's best identity index (−1 in an empty gallery) and similarity (NaN there)."""
        snapshot = self.current()
        with self._turn():
            identities, similarities = snapshot.best(inputs["embedding"])
        if outputs is not None:
            outputs["identity"][...] = identities
            outputs["similarity"][...] = similarities
            return dict(outputs)
        return {"identity": identities, "similarity": similarities}

    @staticmethod
    def served(sessions: Sequence[ModelSession]) -> GalleryFigures | None:
        """What the first of a model's ``sessions`` that is a gallery serves (None: none is)."""
        found = next((s for s in sessions if isinstance(s, GallerySession)), None)
        return found.figures() if found is not None else None

    def close(self) -> None:
        """Close the file and let the matrix go at once (an unload gives its memory back)."""
        self._store.close()
        self.snapshot = GallerySnapshot.empty(self.snapshot.dimension)
