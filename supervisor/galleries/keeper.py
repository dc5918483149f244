"""The config's gallery models, and each operation on one, on its file (``GalleryKeeper``).

A gallery model is a model whose task is ``gallery`` (``worker.executors.gallery``): its file and
params come from the loaded config. The pipeline that enrols into it from images is the first
one with a step on it that takes an earlier step's result (``for_each: {step: embedding, input:
result}``); that step's ``for_each.step`` is the embedding step and the objects are those of the
whole-frame step the embedding step runs over, which must be the pipeline's first (its objects
are the answer's). A gallery in no such pipeline can be listed, removed from, exported and
imported, but not enrolled from images (``ipc.gallery_faces``).

Every operation opens the file (``GalleryStore.open`` with the model's embedding model and
dimension: a foreign file is refused with the reason), creating it empty when it is missing, and
closes it when done: nothing is held between operations, so each runs on whatever thread calls
it (the supervisor: the records on the reactor thread, pages and writes on the control-job
thread; the CLI without a supervisor: its own). A removal always vacuums: nothing of the person
is left in the file or its WAL. A page of identities reads its own rows only (by the names'
index): listing N identities reads the file once in all, whatever the page size.

Callers: ``supervisor.process.control_handlers`` (the ``galleries``, ``gallery_identities``,
``gallery_add`` and ``gallery_remove`` messages) and ``supervisor.operators.gallery_commands``
(``duomo gallery`` with ``-c CONFIG`` and no supervisor).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from duomo.ipc.errors import NotFoundError
from duomo.ipc.gallery_records import GalleryInfo
from duomo.supervisor.config import LoadedConfig
from duomo.worker.executors.gallery import GalleryParams
from duomo.worker.galleries.entries import Identity
from duomo.worker.galleries.store import GalleryLimits, GalleryStore

log = structlog.get_logger("duomo.galleries")
GALLERY_TASK = "gallery"
DEFAULT_PAGE = 500
MAX_PAGE = 1000
PAGE_JSON_BYTES = 512 * 1024  # a page's identities as JSON: a reply stays under MAX_JSON_BYTES


@dataclass(frozen=True)
class GalleryModel:
    """One gallery model of the config: its file and params, and the pipeline that enrols into
    it (``pipeline`` and the rest None: none)."""

    name: str
    file: Path
    params: GalleryParams
    pipeline: str | None = None
    objects: str | None = None
    embedding_step: str | None = None
    identity_step: str | None = None

    @property
    def limits(self) -> GalleryLimits:
        return self.params.limits

    def open(self) -> GalleryStore:
        """Its file, created empty first if missing; GalleryFileError (an InvalidArgumentError)
        for a file that is not this model's gallery. Without SQLite's whole-file check, which
        reads every page (seconds for a million identities): the served model checked the file
        at its load, and SQLite refuses a damaged page it meets."""
        p = self.params
        GalleryStore.create_missing(self.file, p.embedding_model, p.dimension)
        return GalleryStore.open(self.file, p.embedding_model, p.dimension, check=False)

    def info(self) -> GalleryInfo:
        """Its record, with the counts the file holds now."""
        with self.open() as store:
            identities, embeddings = store.counts()
        p = self.params
        return GalleryInfo(
            name=self.name, file=str(self.file), embedding_model=p.embedding_model,
            dimension=p.dimension, threshold=p.threshold, identities=identities,
            embeddings=embeddings, max_identities=p.max_identities,
            max_embeddings_per_identity=p.max_embeddings_per_identity, pipeline=self.pipeline,
            objects=self.objects, embedding_step=self.embedding_step,
            identity_step=self.identity_step,
        )  # fmt: skip


def gallery_models(loaded: LoadedConfig) -> dict[str, GalleryModel]:
    """Every model of ``loaded`` whose task is ``gallery``, by name, in the config's order."""
    found = {}
    for entry in loaded.config.models:
        resolved = loaded.models.get(entry.name)
        if resolved is None or entry.task != GALLERY_TASK:
            continue
        assert isinstance(resolved.params, GalleryParams)
        found[entry.name] = GalleryModel(
            entry.name, resolved.files["model"], resolved.params, *_enrolment(loaded, entry.name)
        )
    return found


def _enrolment(loaded: LoadedConfig, gallery: str) -> tuple[str | None, ...]:
    """(pipeline, objects, embedding step, identity step) of the first pipeline with a step on
    ``gallery`` over an earlier step's result, whose objects are its first step's; Nones if
    none."""
    for pipeline in loaded.config.pipelines:
        steps = {s.name: s for s in pipeline.steps}
        for step in pipeline.steps:
            each = step.for_each
            if step.model != gallery or each is None or each.input != "result":
                continue
            embedding = steps.get(each.step)
            over = embedding.for_each.step if embedding and embedding.for_each else None
            root = pipeline.steps[0]
            if over != root.name or root.model not in loaded.models:
                continue
            objects = getattr(loaded.models[root.model].executor, "objects", None)
            if objects is not None:
                return pipeline.name, objects, each.step, step.name
    return None, None, None, None


class GalleryKeeper:
    """The operations on the gallery models of the config running now (``config``: read for
    every operation, so a reload's galleries are the next operation's)."""

    def __init__(self, config: Callable[[], LoadedConfig]) -> None:
        self._config = config

    def model(self, name: str) -> GalleryModel:
        """The gallery model ``name``; NotFoundError if the config has no such gallery."""
        models = gallery_models(self._config())
        found = models.get(name)
        if found is None:
            known = ", ".join(models) or "none"
            raise NotFoundError(f"no gallery {name!r} (the config's galleries: {known})")
        return found

    def infos(self) -> list[GalleryInfo]:
        """Every gallery model's record."""
        return [model.info() for model in gallery_models(self._config()).values()]

    def identities(
        self,
        gallery: str,
        after: str | None = None,
        limit: int = DEFAULT_PAGE,
        embeddings: bool = False,
    ) -> dict[str, Any]:
        """One page of ``gallery``'s identities, sorted by name, those after ``after``: at most
        ``limit`` and about ``PAGE_JSON_BYTES`` of JSON (at least one). ``{"identities":
        [{"name", "metadata", "created", "embeddings"}], "next": <the name to ask after, or
        null at the end>}``; ``embeddings`` is a count, or the vectors with ``embeddings``."""
        with self.model(gallery).open() as store:
            # one more than the page: whether any is left after it
            found = store.identities(embeddings, after, limit + 1)
        page: list[dict[str, Any]] = []
        size = 0
        for identity in found[:limit]:
            shown = identity_dict(identity)
            size += len(json.dumps(shown)) + 2
            if page and size > PAGE_JSON_BYTES:
                break
            page.append(shown)
        more = len(page) < len(found)
        return {"identities": page, "next": page[-1]["name"] if more else None}

    def add(
        self,
        gallery: str,
        name: str,
        embeddings: Sequence[Sequence[float]],
        replace: bool = False,
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Enrol ``name`` with ``embeddings`` (one transaction: all or nothing).
        ``{"identity": {"name", "embeddings"}, "replaced"}``; InvalidArgumentError for a name
        already there without ``replace``, a bad name, metadata or vector;
        ResourceExhaustedError past the gallery's bounds."""
        model = self.model(gallery)
        with model.open() as store:
            held = store.counts()[0]
            store.add(name, embeddings, metadata, replace, model.limits)
            replaced = store.counts()[0] == held  # (one more identity: a new one)
        # the audit trail: who was enrolled where, never what they look like
        log.info("gallery enrolled", gallery=gallery, name=name, embeddings=len(embeddings),
                 replaced=replaced)  # fmt: skip
        return {"identity": {"name": name, "embeddings": len(embeddings)}, "replaced": replaced}

    def remove(self, gallery: str, name: str) -> dict[str, Any]:
        """Remove ``name`` and every embedding of it, then vacuum (nothing of the person left in
        the file or its WAL): ``{"removed": name}``; NotFoundError if not enrolled."""
        with self.model(gallery).open() as store:
            store.remove(name, vacuum=True)
        log.info("gallery removed", gallery=gallery, name=name, vacuumed=True)
        return {"removed": name}


def identity_dict(identity: Identity) -> dict[str, Any]:
    """An identity as the ``gallery_identities`` reply shows it: ``embeddings`` its count, or
    its vectors when they were read."""
    vectors = identity.vectors
    return {
        "name": identity.name,
        "metadata": identity.metadata,
        "created": identity.created,
        "embeddings": identity.embeddings if vectors is None else vectors.tolist(),
    }
