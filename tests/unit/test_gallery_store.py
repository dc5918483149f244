"""The gallery file (``worker.galleries.store``, ``entries``, ``exchange``): create, enrol, remove,
list, export and import; names, metadata and vectors checked; bounds; foreign and corrupt files
refused with the reason; a removed person gone from the file's bytes after a VACUUM."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from duomo.ipc.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from duomo.worker.galleries.exchange import export_gallery, import_gallery
from duomo.worker.galleries.store import (
    BLOCK_ROWS,
    GalleryFileError,
    GalleryLimits,
    GalleryStore,
    NewIdentity,
)

D = 8


def unit(seed: int, dimension: int = D) -> np.ndarray:
    vector = np.random.default_rng(seed).standard_normal(dimension).astype(np.float32)
    return vector / np.linalg.norm(vector)


@pytest.fixture
def store(tmp_path: Path) -> GalleryStore:
    return GalleryStore.create(tmp_path / "people.db", "sface", D)


def test_a_new_gallery_is_empty_owner_only_and_knows_its_model(tmp_path: Path) -> None:
    path = tmp_path / "g" / "people.db"
    GalleryStore.create(path, "sface", 128).close()
    assert path.stat().st_mode & 0o777 == 0o600
    with GalleryStore.open(path, "sface", 128) as store:
        assert (store.embedding_model, store.dimension) == ("sface", 128)
        assert store.counts() == (0, 0) and store.identities() == []
        assert store.version() == 1
    with pytest.raises(GalleryFileError, match="already there"):
        GalleryStore.create(path, "sface", 128)


def test_a_missing_gallery_is_made_once_whole_and_nothing_else_is_touched(
    tmp_path: Path,
) -> None:
    path = tmp_path / "deep" / "people.gallery"
    assert GalleryStore.create_missing(path, "sface", 128) is True
    assert GalleryStore.create_missing(path, "sface", 128) is False  # there: left as it is
    with GalleryStore.open(path, "sface", 128) as made:
        assert made.counts() == (0, 0)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["people.gallery"]  # no leftovers
    other = tmp_path / "notes.txt"
    other.write_text("not a gallery")
    assert GalleryStore.create_missing(other, "sface", 128) is False
    assert other.read_text() == "not a gallery"


def test_enrol_list_and_remove(store: GalleryStore) -> None:
    store.add("Ada", unit(1), {"badge": 7})
    store.add("Bo", np.stack([unit(2), 3 * unit(3)]))  # scaled to unit length when stored
    assert store.version() == 3
    listed = store.identities()
    assert [(i.name, i.metadata, i.embeddings, i.vectors) for i in listed] == [
        ("Ada", {"badge": 7}, 1, None),
        ("Bo", {}, 2, None),
    ]
    bo = store.identities(with_embeddings=True)[1]
    assert bo.vectors is not None and np.allclose(bo.vectors, [unit(2), unit(3)], atol=1e-6)
    store.remove("Ada")
    assert [i.name for i in store.identities()] == ["Bo"] and store.counts() == (1, 2)
    with pytest.raises(NotFoundError, match="'Ada' is not enrolled"):
        store.remove("Ada")
    assert store.version() == 4


def test_enrolling_a_name_again_needs_replace_which_replaces_it_whole(store: GalleryStore) -> None:
    store.add("Ada", np.stack([unit(1), unit(2)]), {"badge": 7})
    with pytest.raises(InvalidArgumentError, match="already enrolled"):
        store.add("Ada", unit(3))
    assert store.version() == 2 and store.counts() == (1, 2)
    store.add("Ada", unit(3), {"badge": 8}, replace=True)
    (ada,) = store.identities(with_embeddings=True)
    assert ada.metadata == {"badge": 8} and ada.vectors is not None
    assert np.allclose(ada.vectors, [unit(3)], atol=1e-6) and store.counts() == (1, 1)


BAD_NAMES = [
    ("", "non-empty"),
    (" Ada", "surrounding spaces"),
    ("A" * 129, "129 characters"),
    ("Ada\x1b[31m", "U\\+001B"),
    ("Ada\u202eevil", "U\\+202E"),  # a right-to-left override
    (7, "must be a string"),
]
BAD_METADATA = [
    ([1, 2], "must be a JSON object"),
    ({"note": "line\nbreak"}, "U\\+000A"),
    ({"bad\x00key": 1}, "U\\+0000"),
    ({"x": float("nan")}, "NaN"),
    ({"x": "y" * 5000}, "above the 4096 allowed"),
    ({"a": {"b": {"c": {"d": {"e": {}}}}}}, "nested deeper"),
    ({"x": b"bytes"}, "not a JSON value"),
]
BAD_VECTORS = [
    (np.ones(D + 1), "embeddings of 8 numbers"),
    (np.full(D, np.nan), "NaN"),
    (np.zeros(D), "all zeros"),
    (["a"] * D, "must be numbers"),
]


@pytest.mark.parametrize(("name", "why"), BAD_NAMES)
def test_a_bad_name_is_refused_with_the_reason_and_nothing_changes(
    store: GalleryStore, name: object, why: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=why):
        store.add(name, unit(1))  # type: ignore[arg-type]
    assert store.counts() == (0, 0) and store.version() == 1


@pytest.mark.parametrize(("metadata", "why"), BAD_METADATA)
def test_bad_metadata_is_refused_with_the_reason(
    store: GalleryStore, metadata: object, why: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=why):
        store.add("Ada", unit(1), metadata)  # type: ignore[arg-type]
    assert store.counts() == (0, 0) and store.version() == 1


@pytest.mark.parametrize(("vector", "why"), BAD_VECTORS)
def test_a_bad_vector_is_refused_with_the_reason(
    store: GalleryStore, vector: object, why: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=why):
        store.add("Ada", vector)
    assert store.counts() == (0, 0)


def test_past_the_bounds_nothing_is_enrolled(store: GalleryStore) -> None:
    limits = GalleryLimits(max_identities=2, max_embeddings_per_identity=2)
    store.add("Ada", unit(1), limits=limits)
    with pytest.raises(ResourceExhaustedError, match="would hold 3 identities, above max_id"):
        store.add_many([NewIdentity("Bo", unit(2)), NewIdentity("Cy", unit(3))], limits=limits)
    with pytest.raises(ResourceExhaustedError, match="3 embeddings, above max_embeddings_per"):
        store.add("Bo", np.stack([unit(2), unit(3), unit(4)]), limits=limits)
    assert [i.name for i in store.identities()] == ["Ada"] and store.version() == 2
    store.add("Bo", unit(2), limits=limits)  # at the bound
    store.add("Ada", np.stack([unit(5), unit(6)]), replace=True, limits=limits)  # a replacement
    assert store.counts() == (2, 3)


def test_contents_are_one_matrix_with_each_rows_identity(store: GalleryStore) -> None:
    store.add("Ada", np.stack([unit(1), unit(2)]))
    store.add("Bo", unit(3))
    store.add("Cy", unit(4))
    store.remove("Bo")
    contents = store.contents()
    assert contents.version == store.version() and contents.names == ["Ada", "Cy"]
    assert contents.row_identity.tolist() == [0, 0, 1]
    assert np.allclose(contents.matrix.T, [unit(1), unit(2), unit(4)], atol=1e-6)
    with pytest.raises(ResourceExhaustedError, match="holds 2 identities, above max_identities 1"):
        store.contents(GalleryLimits(max_identities=1))


def test_contents_of_several_blocks_keep_every_embedding_in_order(tmp_path: Path) -> None:
    rows = np.random.default_rng(5).standard_normal((BLOCK_ROWS * 2 + 7, D)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    with GalleryStore.create(tmp_path / "big.db", "sface", D) as store:
        store.add_many(NewIdentity(f"p{i}", pair) for i, pair in enumerate(rows.reshape(-1, 1, D)))
        contents = store.contents()
    assert contents.matrix.shape == (D, len(rows)) and contents.matrix.flags.c_contiguous
    assert np.abs(contents.matrix.T - rows).max() < 1e-6
    assert contents.row_identity.tolist() == list(range(len(rows)))


def test_vacuum_leaves_nothing_of_a_removed_person_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "people.db"
    secret = unit(99)
    with GalleryStore.create(path, "sface", D) as store:
        store.add("Zelda Quintessa", secret, {"note": "Quintessa's badge"})
        store.add("Bo", unit(2))

    def on_disk() -> bytes:  # the file and its WAL, if any
        wal = path.with_name(path.name + "-wal")
        return path.read_bytes() + (wal.read_bytes() if wal.exists() else b"")

    stored = secret.astype("<f4").tobytes()
    assert b"Quintessa" in on_disk() and stored in on_disk()  # there before: the test can fail
    with GalleryStore.open(path, "sface", D) as store:
        store.remove("Zelda Quintessa", vacuum=True)
        assert b"Quintessa" not in on_disk() and stored not in on_disk()
        assert [i.name for i in store.identities()] == ["Bo"]
    assert b"Quintessa" not in on_disk() and stored not in on_disk()


def test_a_foreign_or_broken_file_is_refused_naming_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "people.db"
    GalleryStore.create(path, "sface", D).close()
    with pytest.raises(GalleryFileError, match="a gallery of 'sface' embeddings, not 'arcface'"):
        GalleryStore.open(path, "arcface", D)
    with pytest.raises(GalleryFileError, match="a gallery of 8-long embeddings, not 512"):
        GalleryStore.open(path, "sface", 512)
    with pytest.raises(GalleryFileError, match="no gallery file there"):
        GalleryStore.open(tmp_path / "missing.db")
    text = tmp_path / "notes.txt"
    text.write_text("hello " * 1000)
    with pytest.raises(GalleryFileError, match="not an SQLite database"):
        GalleryStore.open(text)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE things (x)")
    with pytest.raises(GalleryFileError, match="an SQLite database, but not a gallery"):
        GalleryStore.open(other)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = 99 WHERE key = 'format_version'")
    with pytest.raises(GalleryFileError, match="gallery format 99, newer than this Duomo reads"):
        GalleryStore.open(path)


def test_a_corrupt_gallery_is_refused_not_crashed_on(tmp_path: Path) -> None:
    path = tmp_path / "people.db"
    with GalleryStore.create(path, "sface", D) as store:
        store.add_many([NewIdentity(f"person-{i}", unit(i)) for i in range(2000)])
    data = bytearray(path.read_bytes())
    assert not path.with_name(path.name + "-wal").exists()  # all of it in the file
    page = 4096
    data[3 * page : 6 * page] = np.random.default_rng(0).bytes(3 * page)
    path.write_bytes(bytes(data))
    with (
        pytest.raises(GalleryFileError, match=r"people\.db: (corrupt|not a readable gallery)"),
        GalleryStore.open(path, "sface", D) as store,
    ):
        store.contents()
    header = bytearray(path.read_bytes())
    header[:100] = b"\x00" * 100
    path.write_bytes(bytes(header))
    with pytest.raises(GalleryFileError, match="not an SQLite database"):
        GalleryStore.open(path)


def test_export_then_import_gives_the_same_gallery(tmp_path: Path, store: GalleryStore) -> None:
    store.add("Ada", np.stack([unit(1), unit(2)]), {"badge": 7, "team": ["blue"]})
    store.add("Bo", unit(3))
    exported = tmp_path / "export.json"
    assert export_gallery(store, exported) == 2
    assert exported.stat().st_mode & 0o777 == 0o600
    document = json.loads(exported.read_text())
    assert document["format"] == "duomo-gallery-export" and document["dimension"] == D
    with GalleryStore.create(tmp_path / "copy.db", "sface", D) as copy:
        assert import_gallery(copy, exported) == 2
        for a, b in zip(store.identities(True), copy.identities(True), strict=True):
            assert (a.name, a.metadata, a.embeddings) == (b.name, b.metadata, b.embeddings)
            assert a.vectors is not None and b.vectors is not None
            assert np.abs(a.vectors - b.vectors).max() < 1e-7
        with pytest.raises(InvalidArgumentError, match="'Ada' is already enrolled"):
            import_gallery(copy, exported)  # all or nothing: Bo is not enrolled again either
        assert copy.version() == 2
        assert import_gallery(copy, exported, replace=True) == 2
    with (
        GalleryStore.create(tmp_path / "other.db", "arcface", D) as other,
        pytest.raises(InvalidArgumentError, match="an export of 'sface' embeddings of 8"),
    ):
        import_gallery(other, exported)
    with GalleryStore.create(tmp_path / "small.db", "sface", D) as small:
        with pytest.raises(ResourceExhaustedError, match="above max_identities 1"):
            import_gallery(small, exported, limits=GalleryLimits(max_identities=1))
        assert small.counts() == (0, 0)
    exported.write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="not a readable gallery export"):
        import_gallery(store, exported)
