"""Enrolment while a real supervisor serves: ``duomo gallery`` (through the supervisor, and with
``-c CONFIG`` and no supervisor) and the producer API (``Client.gallery``), over real models and
the test's own gallery files.

A person enrolled from one image is found by name in the next search, without a reload; ``list``
never shows an embedding unless ``--embeddings`` asks; a removed person is gone from the file and
its WAL, byte for byte (their name and their embedding); an export imports whole into another
gallery; and an image with no face or two, a name with a control character, a gallery in no
pipeline, a name enrolled twice, each is a clear error that changes nothing. The identities come
in pages by name (``gallery_identities``), each under its size."""

from __future__ import annotations

import functools
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import yaml

from duomo.ipc.client import Client
from duomo.ipc.errors import InvalidArgumentError, NotFoundError
from duomo.ipc.gallery_faces import EnrolmentError
from duomo.supervisor.config import load_config
from duomo.supervisor.galleries import keeper as keeper_module
from duomo.supervisor.galleries.keeper import GalleryKeeper
from duomo.worker.galleries.store import GalleryStore, NewIdentity
from tests.conftest import IMAGES, fixture_image
from tests.integration.harness import duomo, free_port, running_supervisor, write_config

D = 128
FACES = [
    {"name": "faces", "steps": [
        {"name": "detect", "model": "face"},
        {"name": "embedding", "model": "face_embedding",
         "for_each": {"step": "detect", "input": "landmarks", "min_score": 0.5}},
        {"name": "identity", "model": "people",
         "for_each": {"step": "embedding", "input": "result"}},
    ]},
]  # fmt: skip
ASTRONAUT = str(IMAGES / "astronaut.png")
CAMERA = str(IMAGES / "camera.png")


def gallery_config(folder: Path) -> Path:
    """The demo's face models, its ``people`` gallery (in ``folder``) in the ``faces`` pipeline,
    and a gallery ``staff`` (in ``folder`` too) that no pipeline uses."""
    staff = {"name": "staff", "task": "gallery", "file": str(folder / "staff.gallery")}
    models = ["face", "face_embedding", "people"]
    metrics = {"http": f"127.0.0.1:{free_port()}"}
    return write_config(folder, models, extra=[staff], pipelines=FACES, metrics=metrics)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("galleries")


@pytest.fixture(scope="module")
def supervisor(folder: Path) -> Iterator[Path]:
    """A supervisor serving ``gallery_config``: its socket."""
    with running_supervisor(gallery_config(folder)) as sup:
        yield sup.socket


@pytest.fixture(scope="module")
def client(supervisor: Path) -> Iterator[Client]:
    with Client(supervisor) as client:
        yield client


@pytest.fixture(scope="module")
def two_faces(folder: Path) -> str:
    """astronaut.png and camera.png side by side: an image of two faces."""
    camera = cv2.cvtColor(fixture_image("camera.png"), cv2.COLOR_GRAY2RGB)
    both = np.concatenate([fixture_image("astronaut.png"), camera], axis=1)
    path = folder / "two_faces.png"
    cv2.imwrite(str(path), cv2.cvtColor(both, cv2.COLOR_RGB2BGR))
    return str(path)


def gallery(socket: Path, *args: str) -> Any:
    """``duomo gallery ARGS`` against the supervisor: its output (JSON when it is)."""
    done = duomo(socket, "gallery", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout) if "--json" in args else done.stdout


def refused(socket: Path, *args: str) -> str:
    """``duomo gallery ARGS``, which must fail as the caller's mistake (exit 2): its message."""
    done = duomo(socket, "gallery", *args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    return done.stderr.strip()


def names(client: Client, gallery: str = "people") -> set[str]:
    return {i["name"] for i in client.gallery(gallery).identities()}


def test_enrolled_with_the_cli_found_at_once_and_never_listed_with_embeddings(
    supervisor: Path, client: Client, folder: Path
) -> None:
    mirrored = folder / "astronaut_mirrored.png"
    cv2.imwrite(str(mirrored), cv2.imread(ASTRONAUT)[:, ::-1])
    before = client.gallery("people").search(cv2.imread(str(mirrored))[:, :, ::-1].copy())
    assert [f["identity"]["name"] for f in before] == [None]
    out = gallery(supervisor, "add", "people", "Astronaut", ASTRONAUT, "--metadata", '{"badge": 7}')
    assert out.strip() == "enrolled Astronaut in people (1 embedding)"
    # the next search sees it, in another view of her face, without a reload
    (face,) = gallery(supervisor, "search", "people", str(mirrored), "--json")["faces"]
    assert face["identity"]["name"] == "Astronaut" and face["identity"]["similarity"] > 0.8
    (seen,) = client.gallery("people").search(fixture_image("astronaut.png"))
    assert seen["identity"]["name"] == "Astronaut" and seen["score"] > 0.5
    listed = {i["name"]: i for i in gallery(supervisor, "list", "people", "--json")}
    assert listed["Astronaut"]["embeddings"] == 1
    assert listed["Astronaut"]["metadata"] == {"badge": 7}
    table = gallery(supervisor, "list", "people")
    assert "Astronaut" in table and '{"badge": 7}' in table and "0." not in table
    shown = {i["name"]: i for i in gallery(supervisor, "list", "people", "--json", "--embeddings")}
    (vector,) = shown["Astronaut"]["embeddings"]
    assert len(vector) == D and abs(np.linalg.norm(vector) - 1) < 1e-5


def test_enrolled_with_the_producer_api(client: Client) -> None:
    people = client.gallery("people")
    reply = people.add("Cameraman", [fixture_image("camera.png")], labels=["camera.png"])
    assert reply == {"identity": {"name": "Cameraman", "embeddings": 1}, "replaced": False}
    again = people.add("Cameraman", [fixture_image("camera.png")] * 2, replace=True)
    assert again["replaced"] is True and again["identity"]["embeddings"] == 2
    info = people.info()
    assert (info.pipeline, info.objects, info.embedding_step, info.identity_step) == (
        "faces", "faces", "embedding", "identity"
    )  # fmt: skip
    assert info.file.endswith("people.gallery") and info.dimension == D
    (face,) = people.search(fixture_image("camera.png"))
    assert face["identity"]["name"] == "Cameraman"
    # what the model serves (its search ran after the change): in status and on /metrics
    info = people.info()
    served = client.status().models["people"].gallery
    assert served is not None and (served.identities, served.embeddings) == (
        info.identities, info.embeddings,
    )  # fmt: skip
    address = yaml.safe_load(Path(client.status().config).read_text())["metrics"]["http"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    assert f'duomo_gallery_identities{{model="people"}} {float(info.identities)}' in text
    assert f'duomo_gallery_embeddings{{model="people"}} {float(info.embeddings)}' in text
    assert 'duomo_gallery_identities{model="face"}' not in text
    listed = {i["name"]: i["embeddings"] for i in people.identities()}
    assert listed["Cameraman"] == 2
    assert [g.name for g in client.galleries()] == ["people", "staff"]


def test_a_removed_person_leaves_no_trace_in_the_file(
    supervisor: Path, client: Client, folder: Path
) -> None:
    name = "Quintessa Marrowby"  # in no other test: any of its bytes in the file are hers
    people = client.gallery("people")
    mirrored = np.ascontiguousarray(fixture_image("astronaut.png")[:, ::-1])  # (its own vector)
    people.add(name, [mirrored], metadata={"note": "to be forgotten"})
    (vector,) = {i["name"]: i for i in people.identities(embeddings=True)}[name]["embeddings"]
    stored = np.asarray(vector, dtype="<f4").tobytes()
    file = folder / "people.gallery"
    wal = folder / "people.gallery-wal"

    def on_disk() -> bytes:
        return file.read_bytes() + (wal.read_bytes() if wal.exists() else b"")

    assert name.encode() in on_disk() and stored in on_disk()  # (findable: the check can fail)
    out = gallery(supervisor, "remove", "people", name)
    assert out.startswith(f"removed {name} from people")
    assert name not in names(client)
    raw = on_disk()
    assert name.encode() not in raw
    assert b"to be forgotten" not in raw
    assert stored not in raw
    assert not wal.exists() or wal.stat().st_size == 0
    assert refused(supervisor, "remove", "people", name).endswith(
        "is not enrolled in people.gallery"
    )
    with pytest.raises(NotFoundError):
        people.remove(name)


def test_an_export_imports_whole_into_another_gallery(
    supervisor: Path, client: Client, folder: Path
) -> None:
    client.gallery("people").add("Exported", [fixture_image("astronaut.png")], metadata={"k": 1})
    exported = folder / "people.json"
    out = gallery(supervisor, "export", "people", str(exported))
    assert out.startswith("exported ") and exported.stat().st_mode & 0o077 == 0
    document = json.loads(exported.read_text())
    assert document["embedding_model"] == "sface" and document["dimension"] == D
    gallery(supervisor, "import", "staff", str(exported))
    source = client.gallery("people").identities(embeddings=True)
    copied = client.gallery("staff").identities(embeddings=True)
    assert [(i["name"], i["metadata"]) for i in copied] == [
        (i["name"], i["metadata"]) for i in source
    ]
    for mine, theirs in zip(copied, source):
        assert np.abs(np.asarray(mine["embeddings"]) - theirs["embeddings"]).max() < 1e-6
    # again without --replace: the names are there, and nothing is enrolled (all or nothing)
    assert "already enrolled" in refused(supervisor, "import", "staff", str(exported))
    assert client.gallery("staff").identities(embeddings=True) == copied
    gallery(supervisor, "import", "staff", str(exported), "--replace")
    assert names(client, "staff") == {i["name"] for i in source}


def test_bad_input_is_a_clear_error_that_changes_nothing(
    supervisor: Path, client: Client, two_faces: str
) -> None:
    people = client.gallery("people")
    before = people.identities(embeddings=True)
    coffee = str(IMAGES / "coffee.png")
    assert refused(supervisor, "add", "people", "Nobody", coffee) == (
        f"duomo gallery add: {coffee}: no face found"
    )
    assert refused(supervisor, "add", "people", "Both", ASTRONAUT, two_faces) == (
        f"duomo gallery add: {two_faces}: 2 faces found; enrol from an image with exactly one"
    )
    assert "control or format character U+001B" in refused(
        supervisor, "add", "people", "Eve\x1b[31m", ASTRONAUT
    )
    assert refused(supervisor, "add", "staff", "Someone", ASTRONAUT) == (
        "duomo gallery add: gallery 'staff' is a step of no pipeline: add it to one to enrol "
        "from images"
    )
    assert "no gallery 'nobody'" in refused(supervisor, "list", "nobody")
    with pytest.raises(EnrolmentError, match=r"^INVALID_ARGUMENT: page.png: no face found$"):
        people.add("Page", [fixture_image("astronaut.png"), fixture_image("page.png")],
                   labels=["astronaut.png", "page.png"])  # fmt: skip
    with pytest.raises(EnrolmentError, match=r"^INVALID_ARGUMENT: image 1: 2 faces found"):
        people.add("Both", [cv2.cvtColor(cv2.imread(two_faces), cv2.COLOR_BGR2RGB)])
    with pytest.raises(InvalidArgumentError, match="control or format character U\\+000A"):
        people.add("Line\nbreak", [fixture_image("astronaut.png")])
    assert people.identities(embeddings=True) == before


def test_without_a_supervisor_the_command_edits_the_file(tmp_path: Path) -> None:
    """``-c CONFIG``: the config's own gallery file, the pipeline run in the command."""
    config = str(gallery_config(tmp_path))

    def run(*args: str) -> Any:
        done = duomo(tmp_path / "no-supervisor.sock", "gallery", *args, "-c", config)
        return done

    added = run("add", "people", "Astronaut", ASTRONAUT)
    assert added.returncode == 0, added.stderr
    assert (tmp_path / "people.gallery").stat().st_mode & 0o077 == 0
    listed = json.loads(run("list", "people", "--json").stdout)
    assert [(i["name"], i["embeddings"]) for i in listed] == [("Astronaut", 1)]
    found = json.loads(run("search", "people", CAMERA, "--json").stdout)["faces"]
    assert [f["identity"]["name"] for f in found] == [None]
    removed = run("remove", "people", "Astronaut")
    assert removed.returncode == 0, removed.stderr
    with GalleryStore.open(tmp_path / "people.gallery", "sface", D) as store:
        assert store.counts() == (0, 0)


def test_identities_come_in_pages_by_name_each_under_its_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keeper's pages (``gallery_identities``): by name, at most ``limit``, cut by their JSON
    size (at least one each), joined whole; a gallery missing is made empty at its first use."""
    keeper = GalleryKeeper(functools.partial(load_config, gallery_config(tmp_path)))
    assert keeper.identities("people") == {"identities": [], "next": None}
    rows = np.random.default_rng(7).standard_normal((5, 3, D))
    with GalleryStore.open(tmp_path / "people.gallery", "sface", D) as store:
        store.add_many(NewIdentity(f"p{i}", v) for i, v in zip([3, 0, 4, 1, 2], rows))

    def pages(**asked: Any) -> list[list[str]]:
        found, after = [], None
        while True:
            page = keeper.identities("people", after, **asked)
            found.append([i["name"] for i in page["identities"]])
            if (after := page["next"]) is None:
                return found

    assert pages(limit=2) == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    first = keeper.identities("people", limit=2)
    with GalleryStore.open(tmp_path / "people.gallery", "sface", D) as store:
        store.add("p1a", rows[0])  # a change between two pages: the next page has it
    assert [i["name"] for i in keeper.identities("people", first["next"], 2)["identities"]] == [
        "p1a", "p2"
    ]  # fmt: skip
    with GalleryStore.open(tmp_path / "people.gallery", "sface", D) as store:
        store.remove("p1a")
    monkeypatch.setattr(keeper_module, "PAGE_JSON_BYTES", 1)  # one identity a page, whatever
    assert pages(embeddings=True) == [["p0"], ["p1"], ["p2"], ["p3"], ["p4"]]
    (one,) = keeper.identities("people", limit=1, embeddings=True)["identities"]
    assert np.asarray(one["embeddings"]).shape == (3, D)
    with pytest.raises(NotFoundError, match="no gallery 'nobody'"):
        keeper.identities("nobody")
