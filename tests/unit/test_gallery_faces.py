"""The rule enrolment and search share (``ipc.gallery_faces``): which faces of a pipeline's
answer count (those the embedding step ran on), exactly one per enrolment image, each refusal
naming the image and why; the gallery record's wire form."""

from __future__ import annotations

from typing import Any

import pytest

from duomo.ipc.errors import InvalidArgumentError
from duomo.ipc.gallery_faces import (
    EnrolmentError,
    enrolment_pipeline,
    faces_with_embeddings,
    identified_faces,
    single_embedding,
)
from duomo.ipc.gallery_records import GalleryInfo
from duomo.ipc.record_reading import StatusRecordError

INFO = GalleryInfo(
    name="people", file="/g/people.gallery", embedding_model="sface", dimension=3,
    threshold=0.363, identities=2, embeddings=3, max_identities=100, max_embeddings_per_identity=4,
    pipeline="faces", objects="faces", embedding_step="embedding", identity_step="identity",
)  # fmt: skip
ALONE = GalleryInfo(**{**INFO.to_dict(), "pipeline": None, "objects": None,
                       "embedding_step": None, "identity_step": None})  # fmt: skip


def face(embedding: Any = None, identity: Any = None, score: float = 0.9) -> dict[str, Any]:
    """A face of the ``faces`` answer: no embedding key at all when ``embedding`` is None."""
    found: dict[str, Any] = {"box": [1, 2, 30, 40], "score": score, "landmarks": [[0, 0]] * 5}
    if embedding is not None:
        found["embedding"] = embedding
    if identity is not None:
        found["identity"] = identity
    return found


def answer(*faces: dict[str, Any]) -> dict[str, Any]:
    return {"faces": list(faces)}


def test_the_record_round_trips_and_a_missing_key_is_an_error() -> None:
    assert GalleryInfo.from_dict(INFO.to_dict()) == INFO
    assert list(INFO.to_dict())[:3] == ["name", "file", "embedding_model"]
    broken = INFO.to_dict()
    del broken["pipeline"]
    with pytest.raises(StatusRecordError, match="pipeline"):
        GalleryInfo.from_dict(broken)


def test_only_faces_the_embedding_step_answered_count() -> None:
    ok = face({"embedding": [0.1, 0.2, 0.3]})
    failed = face({"error": {"code": "INTERNAL", "message": "boom"}})
    small = face(score=0.2)  # under min_score: never embedded
    assert faces_with_embeddings(answer(small, ok, failed), INFO) == [ok]
    assert faces_with_embeddings({"text": "no faces key"}, INFO) == []
    assert faces_with_embeddings(None, INFO) == []


def test_one_face_gives_its_embedding() -> None:
    found = answer(face(score=0.1), face({"embedding": [1, 0, 0.5]}))
    assert single_embedding(found, INFO, "a.png") == [1.0, 0.0, 0.5]


@pytest.mark.parametrize(
    ("faces", "why"),
    [
        ((), "a.png: no face found"),
        ((face(score=0.1),), "a.png: no face found"),
        (
            (face({"embedding": [1, 0, 0]}), face({"embedding": [0, 1, 0]})),
            "a.png: 2 faces found; enrol from an image with exactly one",
        ),
        (
            (face({"error": {"code": "INTERNAL", "message": "the model crashed"}}),),
            "a.png: the face's embedding failed: the model crashed",
        ),
    ],
)
def test_an_image_without_exactly_one_face_is_refused_by_its_label(
    faces: tuple[dict[str, Any], ...], why: str
) -> None:
    with pytest.raises(EnrolmentError) as caught:
        single_embedding(answer(*faces), INFO, "a.png")
    assert caught.value.message == why
    assert isinstance(caught.value, InvalidArgumentError)


def test_a_gallery_in_no_pipeline_cannot_enrol_from_images() -> None:
    assert enrolment_pipeline(INFO) == "faces"
    why = "gallery 'people' is a step of no pipeline: add it to one to enrol from images"
    for call in (
        lambda: enrolment_pipeline(ALONE),
        lambda: single_embedding(answer(face({"embedding": [1, 0, 0]})), ALONE, "a.png"),
        lambda: identified_faces(answer(), ALONE),
    ):
        with pytest.raises(InvalidArgumentError) as caught:
            call()
        assert caught.value.message == why


def test_search_shows_each_face_with_its_identity_in_order() -> None:
    ada = face({"embedding": [1, 0, 0]}, {"name": "Ada", "similarity": 0.9, "reused": True})
    nobody = face({"embedding": [0, 1, 0]}, {"name": None, "similarity": 0.1}, score=0.8)
    broken = face({"error": {"code": "INTERNAL", "message": "x"}}, score=0.7)
    found = identified_faces(answer(ada, face(score=0.1), nobody, broken), INFO)
    assert found == [
        {"box": [1, 2, 30, 40], "score": 0.9, "identity": {"name": "Ada", "similarity": 0.9}},
        {"box": [1, 2, 30, 40], "score": 0.8, "identity": {"name": None, "similarity": 0.1}},
        {"box": [1, 2, 30, 40], "score": 0.7,
         "identity": {"error": {"code": "INTERNAL", "message": "x"}}},
    ]  # fmt: skip
