"""A gallery model as a producer uses it: ``GalleryHandle``, what ``Client.gallery`` returns.

    people = client.gallery("people")
    people.add("Ada", [photo, other_photo], metadata={"badge": 7})   # enrol from images
    people.search(frame)        # [{"box", "score", "identity": {"name", "similarity"}}, ...]
    people.identities()         # [{"name", "metadata", "created", "embeddings": 2}, ...]
    people.remove("Ada")        # gone from the file, and its WAL

Enrolment runs the gallery's pipeline (``GalleryInfo.pipeline``, the one with a step on the
gallery over the embedding step's result) on each image, through an attached ring like any
request, takes the one face of each (``ipc.gallery_faces``: no face, several, or a failed
embedding is an ``EnrolmentError`` naming the image) and only then, if every image passed, sends
the embeddings in one ``gallery_add`` control message: nothing is written otherwise. The
supervisor writes the gallery file on its control-job thread; the served gallery answers with
the change from its next batch, without a reload.

Imports only ``ipc``: the handle reaches the supervisor through the client's public methods
(``request``, ``model``), and this module does not import ``ipc.client``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from duomo.ipc.errors import InvalidArgumentError, NotFoundError
from duomo.ipc.gallery_faces import enrolment_pipeline, identified_faces, single_embedding
from duomo.ipc.gallery_records import GalleryInfo

if TYPE_CHECKING:
    from duomo.ipc.client import Client

WRITE_TIMEOUT_S = 120.0  # a write waits its turn on the control-job thread, and a vacuum
INFER_TIMEOUT_S = 60.0  # an image through the pipeline (a model may load first)


def every_page(page: Callable[[str | None], Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every identity of a gallery, page after page: ``page(after)`` answers one page of
    ``gallery_identities`` (``{"identities", "next"}``), those named after ``after``."""
    found: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        reply = page(after)
        found.extend(reply["identities"])
        after = reply["next"]
        if after is None:
            return found


def gallery_infos(client: Client) -> list[GalleryInfo]:
    """Every gallery model the supervisor has (the ``galleries`` reply's records)."""
    return [GalleryInfo.from_dict(g) for g in client.request("galleries")["galleries"]]


class GalleryHandle:
    """One gallery model of a supervisor, by name: enrol, remove, list and search.

    Holds nothing but its client and name: each call asks the supervisor afresh (a reload may
    have changed the gallery or its pipeline), and a call that runs the pipeline attaches it
    for that call. A handle may be shared by threads as its client is.

    Attributes:
        client: The client it works through.
        name: The gallery model's name.
    """

    def __init__(self, client: Client, name: str) -> None:
        """Made by ``Client.gallery``: no round trip until a method is called."""
        self.client = client
        self.name = name

    def info(self) -> GalleryInfo:
        """The gallery's record now: its file, embedding model, counts, bounds and pipeline.

        Raises:
            NotFoundError: The supervisor has no gallery of this name.
        """
        for info in gallery_infos(self.client):
            if info.name == self.name:
                return info
        raise NotFoundError(f"no gallery {self.name!r}")

    def add(
        self,
        name: str,
        images: Sequence[np.ndarray],
        replace: bool = False,
        metadata: dict[str, Any] | None = None,
        labels: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Enrol ``name`` from ``images``, each showing exactly one face: one embedding each.

        Args:
            name: The identity's name (no control characters, at most 128 characters).
            images: uint8 H×W×3 RGB (or H×W gray) arrays.
            replace: Replace an identity already enrolled under ``name`` (else an error).
            metadata: A JSON object kept with it (at most 4 KiB as JSON).
            labels: What to call each image in an error (a file name); default "image 1", ….

        Returns:
            ``{"identity": {"name", "embeddings"}, "replaced": bool}``.

        Raises:
            EnrolmentError: An image with no face, several, or whose face's embedding failed
                (an ``InvalidArgumentError`` whose message starts with the image's label);
                nothing was written.
            InvalidArgumentError: No images, a bad name or metadata, ``name`` already enrolled
                without ``replace``, or a gallery in no pipeline.
            ResourceExhaustedError: Past the gallery's bounds.
            NotFoundError: No such gallery.
        """
        if not images:
            raise InvalidArgumentError(f"enrol {name!r} from at least one image")
        shown = list(labels) if labels is not None else []
        if labels is not None and len(shown) != len(images):
            raise InvalidArgumentError(f"{len(shown)} labels for {len(images)} images")
        shown = shown or [f"image {i + 1}" for i in range(len(images))]
        info = self.info()
        answers = self._run(info, images)
        embeddings = [single_embedding(a, info, label) for a, label in zip(answers, shown)]
        return self.add_embeddings(name, embeddings, replace, metadata)

    def add_embeddings(
        self,
        name: str,
        embeddings: Sequence[Sequence[float]],
        replace: bool = False,
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Enrol ``name`` with ``embeddings`` already made (the gallery's embedding model's,
        each of its dimension), in one change: what ``add`` does once its images passed.

        Returns:
            ``{"identity": {"name", "embeddings"}, "replaced": bool}``.

        Raises:
            InvalidArgumentError: A bad name, metadata or vector, or ``name`` already enrolled
                without ``replace``.
            ResourceExhaustedError: Past the gallery's bounds.
            NotFoundError: No such gallery.
        """
        reply = self.client.request(
            "gallery_add", timeout_s=WRITE_TIMEOUT_S, gallery=self.name, name=name,
            embeddings=[list(map(float, e)) for e in embeddings], replace=replace,
            metadata=metadata,
        )  # fmt: skip
        return {"identity": reply["identity"], "replaced": reply["replaced"]}

    def remove(self, name: str) -> None:
        """Remove ``name`` and every embedding of it; the file is vacuumed, so nothing of the
        person is left in it or its WAL.

        Raises:
            NotFoundError: ``name`` is not enrolled, or no such gallery.
        """
        self.client.request(
            "gallery_remove", timeout_s=WRITE_TIMEOUT_S, gallery=self.name, name=name
        )

    def identities(self, embeddings: bool = False) -> list[dict[str, Any]]:
        """Every identity, by name: ``{"name", "metadata", "created", "embeddings"}``, where
        ``embeddings`` is how many it has, or (``embeddings=True``) the vectors themselves."""

        def page(after: str | None) -> dict[str, Any]:
            return self.client.request(
                "gallery_identities", timeout_s=WRITE_TIMEOUT_S, gallery=self.name,
                after=after, embeddings=embeddings,
            )  # fmt: skip

        return every_page(page)

    def search(self, image: np.ndarray) -> list[dict[str, Any]]:
        """Each face the gallery's pipeline finds in ``image``, in its answer's order:
        ``{"box", "score", "identity": {"name", "similarity"}}`` (``name`` None below the
        threshold; ``identity`` is ``{"error": ...}`` where that face's request failed).

        Raises:
            InvalidArgumentError: A gallery in no pipeline, or an image the pipeline refuses.
        """
        info = self.info()
        (answer,) = self._run(info, [image])
        return identified_faces(answer, info)

    def _run(self, info: GalleryInfo, images: Sequence[np.ndarray]) -> list[Any]:
        """The gallery's pipeline's answer for each image (attached for this call)."""
        pipeline = self.client.model(enrolment_pipeline(info), slots=1)
        try:
            return [pipeline.infer(image, timeout_s=INFER_TIMEOUT_S) for image in images]
        finally:
            pipeline.close()
