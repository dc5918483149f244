"""Galleries over the gateway's HTTP port (``/v1/galleries``), on a real supervisor with the
demo's face models and a gallery ``people`` of the test's own (its file in the test's folder):
a face enrolled from a base64 PNG is listed (its vectors only when asked for), found by name
in its mirror image, identified in the ``faces`` answer ``tritonclient`` gets, and gone once
removed; an image that cannot enrol is a 400 naming it, with nothing written; the bearer token
guards these routes as every other. The curl examples of docs/gateway.md's galleries block run
whole here against the same gateway (tests/integration/test_doc_commands.py says so)."""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import tritonclient.http as httpclient

from duomo.worker.galleries.store import GalleryStore, NewIdentity
from tests.conftest import IMAGES, ROOT
from tests.integration.harness import free_port, running_supervisor, write_config
from tests.integration.test_pipelines import ASTRONAUT, BLANK, CAMERA, MIRROR

TOKEN = "gallery-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
THRESHOLD = 0.363  # the gallery model's default (SFace's one-to-one threshold)
LANDMARKS = {"step": "detect", "input": "landmarks", "min_score": 0.5}
FACES = {
    "name": "faces",
    "steps": [
        {"name": "detect", "model": "face"},
        {"name": "embedding", "model": "face_embedding", "for_each": LANDMARKS},
        {
            "name": "identity",
            "model": "people",
            "for_each": {"step": "embedding", "input": "result"},
        },
    ],
}
GUIDE = ROOT / "docs" / "gateway.md"
FENCE = re.compile(r"^(```+)bash[^\n]*\n(.*?)^\1[ \t]*$", re.S | re.M)


@dataclass
class Gateway:
    http: str  # host:port
    gallery: Path
    folder: Path

    def call(
        self, method: str, path: str, body: Any = None, token: str | None = TOKEN
    ) -> tuple[int, Any]:
        """(status, JSON answer) of one request to the gateway."""
        host, port = self.http.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        payload = None if body is None else json.dumps(body).encode()
        try:
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        return response.status, json.loads(raw) if raw else None


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, demo_config: object) -> Iterator[Gateway]:
    folder = tmp_path_factory.mktemp("gallery-gateway")
    (folder / "token").write_text(TOKEN + "\n")
    gallery = folder / "people.gallery"  # (missing: made empty at the model's first load)
    people = {"name": "people", "task": "gallery", "file": str(gallery), "max_batch": 8}
    http_at = f"127.0.0.1:{free_port()}"
    gateway = {"http": http_at, "grpc": None, "slots": 4, "token_file": str(folder / "token")}
    config = write_config(
        folder, ["face", "face_embedding"], extra=[people], pipelines=[FACES], gateway=gateway
    )
    with running_supervisor(config):
        yield Gateway(http_at, gallery, folder)


def png64(image: np.ndarray) -> str:
    """``image`` (RGB) as the base64 of a PNG."""
    ok, buffer = cv2.imencode(".png", cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
    assert ok
    return base64.b64encode(buffer.tobytes()).decode()


def fixture64(name: str) -> str:
    return base64.b64encode((IMAGES / name).read_bytes()).decode()


def names(gw: Gateway) -> list[str]:
    status, listed = gw.call("GET", "/v1/galleries/people/identities")
    assert status == 200, listed
    return [identity["name"] for identity in listed["identities"]]


def test_a_face_enrolled_over_http_is_listed_found_and_removed(gw: Gateway) -> None:
    status, galleries = gw.call("GET", "/v1/galleries")
    assert status == 200, galleries
    (people,) = galleries
    assert people["name"] == "people" and people["file"] == str(gw.gallery)
    assert (people["pipeline"], people["objects"]) == ("faces", "faces")
    assert (people["embedding_step"], people["identity_step"]) == ("embedding", "identity")
    assert (people["dimension"], people["threshold"]) == (128, THRESHOLD)

    name = "astronaut/1998"  # (a "/" in the path: %2F)
    body = {"name": name, "images": [fixture64("astronaut.png")], "metadata": {"crew": 93}}
    status, added = gw.call("POST", "/v1/galleries/people/identities", body)
    assert (status, added) == (201, {"identity": {"name": name, "embeddings": 1},
                                     "replaced": False})  # fmt: skip
    status, again = gw.call("POST", "/v1/galleries/people/identities", body)
    assert status == 400 and "replace" in again["error"], again  # (enrolled: replace it or not)
    h, w = ASTRONAUT.shape[:2]
    smaller = cv2.resize(ASTRONAUT, (w * 3 // 5, h * 3 // 5), interpolation=cv2.INTER_AREA)
    body |= {"images": [fixture64("astronaut.png"), png64(smaller)], "replace": True}
    status, replaced = gw.call("POST", "/v1/galleries/people/identities", body)
    assert (status, replaced) == (201, {"identity": {"name": name, "embeddings": 2},
                                        "replaced": True})  # fmt: skip
    body = {"name": "cameraman", "images": [png64(CAMERA)]}
    assert gw.call("POST", "/v1/galleries/people/identities", body)[0] == 201
    assert gw.call("GET", "/v1/galleries/people")[1]["identities"] == 2

    status, listed = gw.call("GET", "/v1/galleries/people/identities")
    assert status == 200 and listed["next"] is None
    assert [(i["name"], i["embeddings"]) for i in listed["identities"]] == [
        (name, 2), ("cameraman", 1),
    ], "sorted by name; a count, never the vectors, unless asked for"  # fmt: skip
    assert listed["identities"][0]["metadata"] == {"crew": 93}
    status, full = gw.call("GET", "/v1/galleries/people/identities?embeddings=true")
    vectors = np.asarray(full["identities"][0]["embeddings"])
    assert status == 200 and vectors.shape == (2, 128)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    status, first = gw.call("GET", "/v1/galleries/people/identities?limit=1")
    assert [i["name"] for i in first["identities"]] == [name] and first["next"] == name
    status, last = gw.call("GET", "/v1/galleries/people/identities?limit=1&after=astronaut%2F1998")
    assert [i["name"] for i in last["identities"]] == ["cameraman"] and last["next"] is None

    status, found = gw.call("POST", "/v1/galleries/people/search", {"image": png64(MIRROR)})
    assert status == 200, found
    (face,) = found["faces"]
    assert face["identity"]["name"] == name, face  # (a view not enrolled)
    assert face["identity"]["similarity"] > THRESHOLD and face["score"] > 0.5
    assert len(face["box"]) == 4

    triton = httpclient.InferenceServerClient(gw.http)
    tensor = httpclient.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(
        np.array([(IMAGES / "astronaut.png").read_bytes()], dtype=np.object_)
    )
    answer = json.loads(triton.infer("faces", [tensor], headers=AUTH).as_numpy("RESULT")[0])
    (face,) = answer["faces"]
    assert face["identity"]["name"] == name, face["identity"]
    assert face["identity"]["similarity"] > 0.99  # (the very image it was enrolled from)

    at = "/v1/galleries/people/identities/astronaut%2F1998"
    assert gw.call("DELETE", at) == (200, {"removed": name})
    assert names(gw) == ["cameraman"]
    assert gw.call("DELETE", "/v1/galleries/people/identities/cameraman")[0] == 200
    assert names(gw) == []
    status, found = gw.call("POST", "/v1/galleries/people/search", {"image": png64(MIRROR)})
    assert status == 200 and found["faces"][0]["identity"]["name"] is None, found
    status, missing = gw.call("DELETE", at)
    assert status == 404 and name in missing["error"], missing


def test_an_image_that_cannot_enrol_is_named_and_nothing_is_written(gw: Gateway) -> None:
    astronaut, blank = fixture64("astronaut.png"), png64(BLANK)
    two_faces = png64(np.ascontiguousarray(np.concatenate([ASTRONAUT, MIRROR], axis=1)))
    refused = {
        "images[0]: no face found": [blank],
        "images[1]: no face found": [astronaut, blank],
        "images[1]: 2 faces found": [astronaut, two_faces],
        "images[1]: not base64": [astronaut, "not an image!"],
        "images[0]: IMAGE bytes are not a PNG or JPEG": [base64.b64encode(b"GIF89a").decode()],
    }
    for message, images in refused.items():
        body = {"name": "nobody", "images": images}
        status, error = gw.call("POST", "/v1/galleries/people/identities", body)
        assert status == 400 and error["error"].startswith(message), (message, error)
    assert names(gw) == [], "nothing written"
    for path, body, status in [
        ("/v1/galleries/nope/identities", {"name": "x", "images": [astronaut]}, 404),
        ("/v1/galleries/people/identities", {"name": "x", "images": []}, 400),
        ("/v1/galleries/people/identities", {"name": "x\x1b[2J", "images": [astronaut]}, 400),
        ("/v1/galleries/people/search", {"image": blank, "extra": 1}, 400),
    ]:
        assert gw.call("POST", path, body)[0] == status, (path, body)
    assert gw.call("GET", "/v1/galleries/people/identities?embeddings=yes")[0] == 400
    assert gw.call("GET", "/v1/galleries/nope")[0] == 404
    assert gw.call("PUT", "/v1/galleries/people/identities")[0] == 405
    assert names(gw) == []


def test_the_bearer_token_guards_the_galleries(gw: Gateway) -> None:
    for token in (None, "wrong"):
        for method, path in [
            ("GET", "/v1/galleries"),
            ("GET", "/v1/galleries/people/identities"),
            ("DELETE", "/v1/galleries/people/identities/astronaut"),
        ]:
            status, error = gw.call(method, path, token=token)
            assert status == 401 and "bearer token" in error["error"], (method, path, token)
        body = {"name": "astronaut", "images": [fixture64("astronaut.png")]}
        assert gw.call("POST", "/v1/galleries/people/identities", body, token=token)[0] == 401
    assert names(gw) == []


def test_the_guide_curl_examples(gw: Gateway) -> None:
    """docs/gateway.md's galleries block, whole, on this gateway (curl sends the token from a
    ``.curlrc`` of the test's own: the guide's gateway has none)."""
    (block,) = [m.group(2) for m in FENCE.finditer(GUIDE.read_text("utf-8"))
                if "/v1/galleries" in m.group(2)]  # fmt: skip
    curl_home = gw.folder / "curl"
    curl_home.mkdir(exist_ok=True)
    (curl_home / ".curlrc").write_text(f'header = "Authorization: Bearer {TOKEN}"\n')
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.replace("127.0.0.1:8000", gw.http)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "CURL_HOME": str(curl_home)},
    )  # fmt: skip
    assert done.returncode == 0, f"{block}\nexited {done.returncode}: {done.stderr}"
    answers, text, at = [], done.stdout, 0
    decoder = json.JSONDecoder()
    while at < len(text.rstrip()):
        value, at = decoder.raw_decode(text, at)
        answers.append(value)
        while at < len(text) and text[at].isspace():
            at += 1
    added, listed, found, removed = answers
    assert added == {"identity": {"name": "Eileen Collins", "embeddings": 1}, "replaced": False}
    assert [(i["name"], i["embeddings"]) for i in listed["identities"]] == [("Eileen Collins", 1)]
    (face,) = found["faces"]
    assert face["identity"]["name"] == "Eileen Collins" and face["identity"]["similarity"] > 0.99
    assert removed == {"removed": "Eileen Collins"}
    assert names(gw) == []


def test_a_large_gallerys_vectors_come_by_page_only(gw: Gateway) -> None:
    """More than 2 000 identities: all their vectors in one answer is refused with what to
    do instead; a page of them, and every name without them, are answered. (Last in the
    file: it leaves the gallery large.)"""
    rows = np.random.default_rng(3).standard_normal((2100, 128)).astype(np.float32)
    with GalleryStore.open(gw.gallery) as store:
        store.add_many([NewIdentity(f"crowd-{i:04d}", row) for i, row in enumerate(rows)])
    status, refused = gw.call("GET", "/v1/galleries/people/identities?embeddings=true")
    assert status == 400 and "page by page" in refused["error"], refused
    status, page = gw.call("GET", "/v1/galleries/people/identities?embeddings=true&limit=1000")
    # (a page is cut at about 512 KiB of JSON: some 180 identities with a vector each)
    assert status == 200 and 100 < len(page["identities"]) <= 1000 and page["next"]
    assert all(len(i["embeddings"][0]) == 128 for i in page["identities"])
    assert len(names(gw)) >= 2100
