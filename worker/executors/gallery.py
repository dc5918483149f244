"""The ``gallery`` task: an embedding in, the enrolled identity it matches out.

The model's ``file`` is a gallery (``worker.galleries.store``; a missing one is made empty at
the first load) made for ``embedding_model``'s ``dimension``-long embeddings; a gallery of
another model or dimension, or a file that is not one, fails the load with the reason. Its
identities are searched exactly, by cosine, in memory (``worker.galleries.snapshot``);
enrolments and removals by any process are served from the next batch on (a large gallery's
once read on a thread of its own), without a reload (``worker.galleries.session``), and the
matrix is charged to the model like weights.

Request, through a slot: ``embedding`` (float32 D). In-process (``Engine.infer``, a pipeline's
step): a float32 array of D, a list of D numbers, or ``{"embedding": [...]}`` as the
``face_embedding`` task answers it. The query is scaled to unit length.

Result: ``{"name": <the best identity>, "similarity": <its cosine>}``, the best identity's
similarity being the best over its embeddings; ``{"name": null, "similarity": <best>}`` when the
best is below ``threshold``; ``{"name": null, "similarity": null}`` in an empty gallery.

``threshold`` defaults to 0.363, SFace's published same-person cosine threshold (OpenCV's
``FaceRecognizerSF``, chosen for one-to-one verification on LFW). Checked on the faces we have
(tests/integration/test_gallery_model.py): the astronaut enrolled from astronaut.png is found at
0.961 in its mirror image, 0.975 at 0.6 × its size and 0.909 at 0.4 ×, and the cameraman scores
0.166 against her. It is a one-to-one threshold: the best of many identities is higher by chance
(the best of 100 000 random 128-d vectors scored 0.375 against her), so a large gallery may want
a higher one. A gallery of another embedding model needs that model's own threshold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from pydantic import Field

from duomo.ipc.errors import DuomoError, InvalidArgumentError
from duomo.worker.backends.base import Backend, ModelSession, SessionSettings
from duomo.worker.config_model import StrictModel
from duomo.worker.executors.base import (
    JSON_RESULT_BYTES,
    Executor,
    SlotInput,
    SlotSpec,
    StageTimer,
)
from duomo.worker.galleries.entries import unit_vectors
from duomo.worker.galleries.session import GallerySession
from duomo.worker.galleries.store import GalleryLimits, GalleryStore

log = structlog.get_logger("duomo.gallery")

SFACE_SAME_PERSON = 0.363  # OpenCV FaceRecognizerSF's cosine threshold (face_embedding's note)


class GalleryParams(StrictModel):
    """A gallery model's ``params``: what its file must hold, the match threshold, its bounds."""

    embedding_model: str = Field(default="sface", min_length=1)
    dimension: int = Field(default=128, ge=1, le=65536)
    threshold: float = Field(default=SFACE_SAME_PERSON, ge=-1.0, le=1.0)
    max_identities: int = Field(default=GalleryLimits.max_identities, ge=1)
    max_embeddings_per_identity: int = Field(
        default=GalleryLimits.max_embeddings_per_identity, ge=1
    )

    @property
    def limits(self) -> GalleryLimits:
        return GalleryLimits(self.max_identities, self.max_embeddings_per_identity)


class GalleryExecutor(Executor):
    """Search a gallery file for each request's embedding; a batch is one matrix product."""

    Params = GalleryParams
    # in a pipeline: the result of an earlier per-object step (``for_each: {input: result}``)
    object_inputs = frozenset({"result"})
    data_file = True  # made empty at the first load; enrolments are served as they come

    @classmethod
    def open(
        cls,
        params: StrictModel,
        files: Mapping[str, Path],
        max_batch: int,
        backend: Backend,
        settings: SessionSettings,
    ) -> Executor:
        """The executor over the gallery file (``files["model"]``), read into memory: no backend
        runs a gallery, it is searched here. A missing file is made, an empty gallery."""
        assert isinstance(params, GalleryParams)
        if GalleryStore.create_missing(files["model"], params.embedding_model, params.dimension):
            log.info("gallery created", file=str(files["model"]), model=params.embedding_model)
        session = GallerySession.open(
            files["model"], params.embedding_model, params.dimension, params.limits, settings
        )
        executor = cls(params, {"model": session}, max_batch)
        executor.device = settings.device
        return executor

    @classmethod
    def check_data_file(cls, params: StrictModel, path: Path) -> str:
        """The gallery's contents (``duomo check``); ValueError for a file it cannot serve."""
        assert isinstance(params, GalleryParams)
        try:
            with GalleryStore.open(path, params.embedding_model, params.dimension) as store:
                identities, embeddings = store.counts()
        except DuomoError as err:
            raise ValueError(err.message) from None
        return (
            f"a gallery of {identities} identities, {embeddings} embeddings "
            f"({params.embedding_model}, {params.dimension} long)"
        )

    def __init__(
        self, params: StrictModel, sessions: Mapping[str, ModelSession], max_batch: int
    ) -> None:
        super().__init__(params, sessions, max_batch)
        assert isinstance(params, GalleryParams)
        self.p = params
        session = sessions["model"]
        assert isinstance(session, GallerySession)
        self.session = session

    def slot_spec(self) -> SlotSpec:
        dimension = self.p.dimension
        embedding = SlotInput("embedding", np.dtype(np.float32), (dimension,), dimension * 4)
        return SlotSpec(inputs=(embedding,), result="json", result_capacity=JSON_RESULT_BYTES)

    def payload_from_slot(self, tensors: dict[str, np.ndarray], output: memoryview) -> Any:
        return tensors["embedding"]

    def prepare(self, payload: Any) -> np.ndarray:
        """The query as a float32 unit vector of D; InvalidArgumentError naming what is wrong."""
        if isinstance(payload, Mapping):
            if set(payload) != {"embedding"}:
                raise InvalidArgumentError(
                    f"expected {{'embedding': [...]}}, got keys {sorted(map(str, payload))}"
                )
            payload = payload["embedding"]
        if isinstance(payload, np.ndarray) and payload.ndim != 1:
            raise InvalidArgumentError(
                f"expected one embedding of {self.p.dimension}, got shape {list(payload.shape)}"
            )
        return unit_vectors(payload, self.p.dimension)[0]

    def execute(self, items: Sequence[np.ndarray], timer: StageTimer) -> list[Any]:
        with timer.stage("preprocess"):
            snapshot = self.session.current()  # this batch's gallery, whole
            queries = self.session.input_buffer("embedding", (len(items), self.p.dimension))
            for row, item in zip(queries, items):
                row[...] = item
        with timer.stage("infer"):
            matches = self.session.search(snapshot, queries, self.p.threshold)
        return [match.to_dict() for match in matches]

    def warmup(self) -> None:
        query = np.zeros(self.p.dimension, dtype=np.float32)
        query[0] = 1.0
        for size in self.warmup_sizes():
            self.execute([query] * size, StageTimer())
