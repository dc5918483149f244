"""The supervisor's galleries over the gateway's HTTP port: who is enrolled, enrolment from
images, removal and search, for callers that are not on its host (a door's kiosk, an operator's
console).

=============================================  ==================================================
``GET /v1/galleries``                          every gallery model: a list of ``GalleryInfo``
``GET /v1/galleries/{g}``                      one (404 when there is none)
``GET /v1/galleries/{g}/identities``           ``{"identities": [...], "next": null}``: every
                                               identity, its embeddings counted;
                                               ``?embeddings=true``: the vectors themselves
                                               (past 2 000 identities, by page only);
                                               ``?limit=N`` (1..1000, with ``&after=NAME``): one
                                               page, ``next`` the name to ask after for the
                                               following one (null: it was the last)
``POST /v1/galleries/{g}/identities``          enrol: ``{"name", "images": [base64 of a PNG or
                                               JPEG, …], "replace": false, "metadata": {…}}``;
                                               201 ``{"identity", "replaced"}``; 400 naming the
                                               image (``images[1]: no face found``), nothing
                                               written
``DELETE /v1/galleries/{g}/identities/{n}``    remove, vacuumed (nothing of the person left in
                                               the file): 200 ``{"removed": n}``, 404 for none
``POST /v1/galleries/{g}/search``              ``{"image": base64}`` → ``{"faces": [{"box",
                                               "score", "identity"}, …]}``, in the answer's order
=============================================  ==================================================

Enrolment and search run the gallery's pipeline (``GalleryInfo.pipeline``) on each image
through this worker's own slots, as ``POST /v2/models/{pipeline}/infer`` would (the image
decoded here, straight into the slot), one image after another, and read its answer by the rule
the producer API and the CLI share (``ipc.gallery_faces``): exactly one face per enrolled image.
Every image is run before anything is written, so one bad image leaves the gallery as it was.
The rest is one control message each (``galleries``, ``gallery_identities``, ``gallery_add``,
``gallery_remove``); the supervisor checks names, metadata and bounds.

The same rules as every endpoint of the gateway: the bearer token when one is configured,
loopback unless a token or TLS protects the port, ``max_body_mb``, errors as
``{"error": message}``. A name in the path is percent-decoded from the raw path, so it may
hold ``/`` (``%2F``). Called by ``gateway.http_front`` for paths under ``/v1/galleries``.
"""

from __future__ import annotations

import base64
import binascii
import functools
import urllib.parse
from typing import Any

import numpy as np

from duomo.gateway.http_errors import HttpError, only
from duomo.gateway.images import decode_into
from duomo.gateway.link import SupervisorLink
from duomo.ipc.client import Slot
from duomo.ipc.errors import DuomoError, InvalidArgumentError, NotFoundError
from duomo.ipc.gallery_faces import enrolment_pipeline, identified_faces, single_embedding
from duomo.ipc.gallery_records import GalleryInfo

GALLERIES_TIMEOUT_S = 60.0  # a removal vacuums the file: seconds for a large gallery
PAGE_LIMIT = 500  # identities a control reply carries when every page is asked for
# identities with their vectors one answer holds when no page is asked for (about 5 MB of
# JSON): a caller who wants more pages through them, so no answer grows with the gallery
ALL_WITH_EMBEDDINGS = 2000
MAX_PAGE_LIMIT = 1000  # the supervisor's bound on one page
ENROL_FIELDS = frozenset({"name", "images", "replace", "metadata"})
IMAGE_IN_PIPELINE = "image"  # the slot input a pipeline's root step takes


class GalleriesApi:
    """``/v1/galleries`` on one gateway worker's link."""

    def __init__(self, link: SupervisorLink) -> None:
        self.link = link

    async def respond(
        self, method: str, route: list[str], query: bytes, body: dict[str, Any]
    ) -> tuple[int, Any]:
        """(status, JSON value) for ``method`` on ``/v1/galleries/<route…>?<query>``;
        DuomoError, and HttpError for a path (404) or a method (405) it does not take, for the
        caller to answer."""
        if not route:
            only(method, "GET")
            return 200, [info.to_dict() for info in await self._galleries()]
        gallery, rest = route[0], route[1:]
        if not rest:
            only(method, "GET")
            return 200, (await self._gallery(gallery)).to_dict()
        if rest == ["identities"]:
            only(method, "GET", "POST")
            if method == "GET":
                return 200, await self._identities(gallery, _query(query))
            return 201, await self._enrol(await self._gallery(gallery), body)
        if len(rest) == 2 and rest[0] == "identities":
            only(method, "DELETE")
            reply = await self.link.control(
                "gallery_remove", timeout_s=GALLERIES_TIMEOUT_S, gallery=gallery, name=rest[1]
            )
            return 200, {"removed": reply["removed"]}
        if rest == ["search"]:
            only(method, "POST")
            return 200, await self._search(await self._gallery(gallery), body)
        raise HttpError(404, "no endpoint: /v1/galleries/{gallery}[/identities[/{name}] | /search]")

    async def _galleries(self) -> list[GalleryInfo]:
        reply = await self.link.control("galleries", timeout_s=GALLERIES_TIMEOUT_S)
        return [GalleryInfo.from_dict(found) for found in reply["galleries"]]

    async def _gallery(self, name: str) -> GalleryInfo:
        galleries = await self._galleries()
        for info in galleries:
            if info.name == name:
                return info
        raise NotFoundError(
            f"no gallery named {name[:100]!r} (galleries: {[i.name for i in galleries]})"
        )

    async def _identities(self, gallery: str, query: dict[str, str]) -> dict[str, Any]:
        """One page when ``limit`` is asked for, else every page (``next`` null)."""
        unknown = set(query) - {"embeddings", "limit", "after"}
        if unknown:
            raise InvalidArgumentError(
                f"unknown query parameter {sorted(unknown)[0][:100]!r} (embeddings, limit, after)"
            )
        embeddings = _flag(query.get("embeddings", "false"), "embeddings")
        after = query.get("after")
        if "limit" in query:
            page = await self._page(gallery, after, _limit(query["limit"]), embeddings)
            return {"identities": page["identities"], "next": page["next"]}
        found: list[Any] = []
        while True:
            page = await self._page(gallery, after, PAGE_LIMIT, embeddings)
            found.extend(page["identities"])
            after = page["next"]
            if after is None:
                return {"identities": found, "next": None}
            if embeddings and len(found) >= ALL_WITH_EMBEDDINGS:
                raise InvalidArgumentError(
                    f"gallery {gallery[:100]!r} holds more than {ALL_WITH_EMBEDDINGS} "
                    "identities: ask for their embeddings page by page (?embeddings=true"
                    "&limit=N&after=NAME)"
                )

    async def _page(
        self, gallery: str, after: str | None, limit: int, embeddings: bool
    ) -> dict[str, Any]:
        return await self.link.control(
            "gallery_identities", timeout_s=GALLERIES_TIMEOUT_S, gallery=gallery, after=after,
            limit=limit, embeddings=embeddings,
        )  # fmt: skip

    async def _enrol(self, info: GalleryInfo, body: dict[str, Any]) -> dict[str, Any]:
        unknown = set(body) - ENROL_FIELDS
        if unknown:
            raise InvalidArgumentError(
                f"unknown field {sorted(unknown)[0][:100]!r} (fields: {sorted(ENROL_FIELDS)})"
            )
        images = body.get("images")
        if not isinstance(images, list) or not images:
            raise InvalidArgumentError("'images' must be a non-empty list of base64 images")
        if len(images) > info.max_embeddings_per_identity:
            raise InvalidArgumentError(
                f"{len(images)} images, above gallery {info.name!r}'s "
                f"max_embeddings_per_identity of {info.max_embeddings_per_identity}"
            )
        name, replace, metadata = body.get("name"), body.get("replace", False), body.get("metadata")
        if not isinstance(name, str):  # (its other checks are the supervisor's)
            raise InvalidArgumentError("'name' must be a string")
        if not isinstance(replace, bool):
            raise InvalidArgumentError("'replace' must be true or false")
        if metadata is not None and not isinstance(metadata, dict):
            raise InvalidArgumentError("'metadata' must be a JSON object or null")
        pipeline = enrolment_pipeline(info)
        embeddings = []
        for n, image in enumerate(images):  # (every image passes before anything is written)
            label = f"images[{n}]"
            answer = await self._answer(pipeline, image, label)
            embeddings.append(single_embedding(answer, info, label))
        reply = await self.link.control(
            "gallery_add", timeout_s=GALLERIES_TIMEOUT_S, gallery=info.name,
            name=name, embeddings=embeddings, replace=replace, metadata=metadata,
        )  # fmt: skip
        return {"identity": reply["identity"], "replaced": reply["replaced"]}

    async def _search(self, info: GalleryInfo, body: dict[str, Any]) -> dict[str, Any]:
        if set(body) != {"image"}:
            raise InvalidArgumentError('the body must be {"image": "<base64 of a PNG or JPEG>"}')
        answer = await self._answer(enrolment_pipeline(info), body["image"], "image")
        return {"faces": identified_faces(answer, info)}

    async def _answer(self, pipeline: str, image: object, label: str) -> Any:
        """``pipeline``'s answer for the encoded image ``image`` (base64), an error's message
        prefixed with ``label``."""
        try:
            data = _image_bytes(image)
            return await self.link.run(
                pipeline, functools.partial(_write_image, data), _read_answer
            )
        except DuomoError as err:
            raise type(err)(f"{label}: {err.message}") from None


def route_of(raw_path: bytes) -> list[str]:
    """The segments of ``raw_path`` after ``/v1/galleries``, each percent-decoded (a name may
    hold ``/`` as ``%2F``)."""
    segments = [s for s in raw_path.split(b"/") if s][2:]
    try:
        return [urllib.parse.unquote_to_bytes(s).decode("utf-8") for s in segments]
    except UnicodeDecodeError:
        raise InvalidArgumentError("the path is not UTF-8 once percent-decoded") from None


def _query(query: bytes) -> dict[str, str]:
    try:
        pairs = urllib.parse.parse_qsl(
            query.decode("ascii"), keep_blank_values=True, strict_parsing=bool(query),
            errors="strict",
        )  # fmt: skip
    except (UnicodeDecodeError, ValueError):
        raise InvalidArgumentError(f"the query {query[:100]!r} is not name=value&…") from None
    found: dict[str, str] = {}
    for key, value in pairs:
        if key in found:
            raise InvalidArgumentError(f"query parameter {key[:100]!r} is given twice")
        found[key] = value
    return found


def _flag(value: str, name: str) -> bool:
    if value not in ("true", "false"):
        raise InvalidArgumentError(f"{name} must be true or false, got {value[:20]!r}")
    return value == "true"


def _limit(value: str) -> int:
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_PAGE_LIMIT:
        raise InvalidArgumentError(
            f"limit must be an integer 1..{MAX_PAGE_LIMIT}, got {value[:20]!r}"
        )
    return int(value)


def _image_bytes(image: object) -> bytes:
    if not isinstance(image, str):
        raise InvalidArgumentError(
            f"an image is a string (base64 of a PNG or JPEG), got {type(image).__name__}"
        )
    try:
        return base64.b64decode(image, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError("not base64 (of a PNG or JPEG)") from None


def _write_image(data: bytes, slot: Slot) -> None:
    """Decode ``data`` into the slot's image (sized from its header first, as any request's)."""

    def target(shape: tuple[int, int, int]) -> np.ndarray:
        slot.handle.check_input(IMAGE_IN_PIPELINE, shape)
        return slot.input(IMAGE_IN_PIPELINE, shape)

    decode_into(data, target)


def _read_answer(slot: Slot) -> Any:
    return slot.wait(timeout_s=0)
