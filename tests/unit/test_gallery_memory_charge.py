"""The memory ledger charges a loaded model's shares at their size now (``MemoryLedger._found``):
a gallery's matrix, its weights, is charged again as enrolments grow it and removals shrink it;
an unloaded model keeps the charge of its last load."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np

from duomo.supervisor.config import load_config
from duomo.supervisor.core.memory import MemoryLedger
from duomo.worker.backends.base import SessionSettings
from duomo.worker.galleries.session import GallerySession
from duomo.worker.galleries.store import GalleryLimits, GalleryStore, NewIdentity
from duomo.worker.served_model import ServedModel
from tests.conftest import DEMO_CONFIG

D = 128
ROW = D * 4


class FakeModel:
    """A stand-in for a served model: one instance on device 0 holding ``session``."""

    def __init__(self, name: str, session: GallerySession) -> None:
        self.spec = SimpleNamespace(
            name=name, devices=(0,), instances=1, placement=lambda i: SimpleNamespace(device=0)
        )
        self.instances = SimpleNamespace(
            sessions_by_device=lambda: {0: [session]}, sessions=lambda: [session]
        )
        self.loaded = True

    @property
    def holds_memory(self) -> bool:
        return self.loaded


def test_a_gallery_is_charged_its_matrix_as_it_grows_and_shrinks(tmp_path: Path) -> None:
    path = tmp_path / "people.db"
    rows = np.random.default_rng(0).standard_normal((1000, D)).astype(np.float32)
    with GalleryStore.create(path, "sface", D) as store:
        store.add_many([NewIdentity(f"p{i}", v) for i, v in enumerate(rows)])
    session = GallerySession.open(
        path, "sface", D, GalleryLimits(), SessionSettings(intra_op_threads=1)
    )
    model = FakeModel("people", session)
    models = {"people": cast(ServedModel, model)}
    ledger = MemoryLedger(models, load_config(DEMO_CONFIG), release=lambda: None)
    ledger.record(models["people"], host_bytes=session.snapshot.nbytes + 4096)
    at_load = ledger.charged("people", 0)
    assert at_load == session.snapshot.nbytes + 4096  # its matrix as weights, and the rest
    assert 1000 * ROW <= ledger.weights_bytes("people", 0) < 1000 * ROW * 1.05
    with GalleryStore.open(path, "sface", D) as writer:
        writer.add_many([NewIdentity(f"q{i}", v) for i, v in enumerate(rows[:500])])
        session.current()  # the next batch takes the change in
        grown = ledger.charged("people", 0)
        assert grown - at_load >= 500 * ROW and ledger.used(0) == grown
        assert ledger.weights_of("people")[0].bytes == session.snapshot.nbytes
        for i in range(500):
            writer.remove(f"q{i}")
    session.current()
    assert ledger.charged("people", 0) == at_load
    model.loaded = False  # unloaded: the charge of its last load stays for the next
    with GalleryStore.open(path, "sface", D) as writer:
        writer.add("late", rows[0])
    session.current()
    assert ledger.charged("people", 0) == at_load
    session.close()
