"""Which faces of a pipeline's answer a gallery counts: the rule enrolment and search share.

A gallery's pipeline (``GalleryInfo.pipeline``) answers an image with its objects under
``GalleryInfo.objects``; each object the embedding step ran on carries that step's result under
``GalleryInfo.embedding_step`` — ``{"embedding": [...]}``, or ``{"error": {...}}`` when that
request failed — and, from the gallery step, ``{"name", "similarity"}`` under
``GalleryInfo.identity_step``. An object the embedding step did not run on (a detection under its
``min_score``, past its ``largest``) is no face here: it has no embedding to enrol or search.

Enrolment takes exactly one face per image (``single_embedding``): none, two or more, or one
whose embedding failed is an ``EnrolmentError`` naming the image and why, so a caller can refuse
the whole enrolment before it writes anything.

Pure functions over the answer and the record, importing only ``ipc``: used by the producer API
(``ipc.galleries``), the CLI's in-process path (``supervisor.operators.gallery_commands``) and
the gateway (``gateway.galleries_api``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from duomo.ipc.errors import InvalidArgumentError
from duomo.ipc.gallery_records import GalleryInfo


class EnrolmentError(InvalidArgumentError):
    """An image that cannot enrol a person: no face, several, or a failed embedding. Its message
    starts with the image's label (``"astronaut.png: no face found"``)."""


def enrolment_pipeline(info: GalleryInfo) -> str:
    """The pipeline that enrols into ``info``'s gallery from images; InvalidArgumentError when
    no pipeline has a step on it (it can still be listed, removed from, exported)."""
    return _keys(info)[0]


def embedded_objects(answer: Any, info: GalleryInfo) -> list[dict[str, Any]]:
    """The objects of ``answer`` the embedding step ran on (its result or its error), in the
    answer's order."""
    _, objects_key, step = _keys(info)
    objects = answer.get(objects_key) if isinstance(answer, Mapping) else None
    if not isinstance(objects, list):
        return []
    return [
        dict(item)
        for item in objects
        if isinstance(item, Mapping) and isinstance(item.get(step), Mapping)
    ]


def faces_with_embeddings(answer: Any, info: GalleryInfo) -> list[dict[str, Any]]:
    """The objects of ``answer`` whose embedding step answered an ``"embedding"`` list."""
    step = _keys(info)[2]
    return [
        item
        for item in embedded_objects(answer, info)
        if isinstance(item[step].get("embedding"), list)
    ]


def single_embedding(answer: Any, info: GalleryInfo, label: str) -> list[float]:
    """The embedding of the one face in ``answer`` (the pipeline's answer for the image
    ``label``); EnrolmentError naming ``label`` if there is none, more than one, or its
    embedding failed."""
    found = embedded_objects(answer, info)
    if not found:
        raise EnrolmentError(f"{label}: no face found")
    if len(found) > 1:
        raise EnrolmentError(
            f"{label}: {len(found)} faces found; enrol from an image with exactly one"
        )
    result = found[0][_keys(info)[2]]
    embedding = result.get("embedding")
    if not isinstance(embedding, list):
        error = result.get("error")
        why = error.get("message") if isinstance(error, Mapping) else None
        raise EnrolmentError(f"{label}: the face's embedding failed: {why or repr(result)}")
    return [float(x) for x in embedding]


def identified_faces(answer: Any, info: GalleryInfo) -> list[dict[str, Any]]:
    """Each face of ``answer`` with what the gallery made of it, in the answer's order:
    ``{"box", "score", "identity"}``, ``identity`` being ``{"name", "similarity"}`` (``name``
    null below the threshold), or ``{"error": {...}}`` where its embedding or search failed."""
    step = _keys(info)[2]
    faces = []
    for item in embedded_objects(answer, info):
        identity = item.get(info.identity_step or "")
        if not isinstance(identity, Mapping):
            identity = item[step]  # (no search without an embedding: the embedding's error)
        if "error" in identity:
            shown = {"error": identity["error"]}
        else:
            shown = {"name": identity.get("name"), "similarity": identity.get("similarity")}
        faces.append({"box": item.get("box"), "score": item.get("score"), "identity": shown})
    return faces


def _keys(info: GalleryInfo) -> tuple[str, str, str]:
    """(pipeline, objects key, embedding step) of ``info``; InvalidArgumentError if none."""
    if info.pipeline is None or info.objects is None or info.embedding_step is None:
        raise InvalidArgumentError(
            f"gallery {info.name!r} is a step of no pipeline: add it to one to enrol from images"
        )
    return info.pipeline, info.objects, info.embedding_step
