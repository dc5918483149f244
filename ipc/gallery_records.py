"""A gallery model as the supervisor shows it (``GalleryInfo``): its file, what the file is made
for, how many identities and embeddings it holds, its bounds, and the pipeline that enrols into
it from images.

A flat record of scalars whose dict form is derived from its fields (``ipc.records``): a key
missing or of the wrong type is an error naming the record and the key, never a default.

Made by ``supervisor.galleries.keeper`` (the ``galleries`` control message's reply); read by the
producer API (``ipc.galleries``), the CLI (``duomo gallery``) and the gateway
(``/v1/galleries``).
"""

from __future__ import annotations

import dataclasses

from duomo.ipc.records import Record


@dataclasses.dataclass(frozen=True)
class GalleryInfo(Record):
    """One model whose task is ``gallery``.

    Attributes:
        name: The model's name.
        file: The gallery file's absolute path.
        embedding_model: The embedding model the file is made for (its params).
        dimension: Its embeddings' length.
        threshold: The similarity under which a face is nobody.
        identities: Identities the file holds now.
        embeddings: Embeddings it holds, over all of them.
        max_identities: Its bound on identities.
        max_embeddings_per_identity: Its bound on one identity's embeddings.
        pipeline: The first pipeline with a step on this model that takes an earlier step's
            result (``for_each.input: result``): what enrolment from images runs. None: none.
        objects: The key of the objects in that pipeline's answer (``faces``).
        embedding_step: The step whose result the gallery step takes (``embedding``).
        identity_step: The gallery step's own name (``identity``).
    """

    name: str
    file: str
    embedding_model: str
    dimension: int
    threshold: float
    identities: int
    embeddings: int
    max_identities: int
    max_embeddings_per_identity: int
    pipeline: str | None
    objects: str | None
    embedding_step: str | None
    identity_step: str | None
