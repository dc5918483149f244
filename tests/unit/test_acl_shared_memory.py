"""Weight and work buffers ACL sessions share, against the strict pyACL fake.

Instances of one ``.om`` (and other models naming the same file) on a device load with
``load_from_file_with_mem`` into one weight buffer, freed by the last to unload; models on a
device whose gate runs one at a time share one work buffer sized to the largest. The fake holds
the contract: it refuses a weight buffer freed while a model uses it, and a run over a work
buffer another model's unsynchronised run still uses. ``leaks() == {}`` at the end of a test
also proves the backend never had a free refused (the buffer would still be there). The engine's
ledger charges a device each shared weight or work buffer once, at its size, whatever the number
of models using it: the device's charge is what the fake has allocated.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from duomo.ipc.errors import ResourceExhaustedError
from duomo.supervisor.config import load_config
from duomo.supervisor.core.engine import Engine
from duomo.worker.backends.acl_backend import AclBackend, AclSession
from duomo.worker.backends.acl_runtime import AclError
from duomo.worker.backends.base import (
    DeviceRoom,
    MemoryShare,
    NotEnoughDeviceMemoryError,
    SessionSettings,
)
from tests.fakes import fake_acl
from tests.fakes.fake_acl import WEIGHT_BYTES, WORK_BYTES, FakeAcl, write_model
from tests.unit.test_acl_backend import AFFINE, STATIC, raw_model

BIG_WORK = 256 << 10  # a model whose work memory is four times the default
X = np.ones((2, 4), np.float32)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeAcl:
    acl = FakeAcl()
    monkeypatch.setitem(sys.modules, "acl", acl)
    return acl


def buffers_of(fake: FakeAcl, nbytes: int) -> list[int]:
    """The fake's live device buffers of exactly ``nbytes``."""
    return [p for p, region in fake.memory.items() if len(region) == nbytes]


def io_bytes(session: AclSession) -> int:
    return session.memory.figures["io_bytes"]


# -- weights --------------------------------------------------------------------------------


def test_two_sessions_of_one_om_share_one_weight_buffer_until_the_last_closes(
    tmp_path: Path, fake: FakeAcl
) -> None:
    om = write_model(tmp_path / "affine.om", **AFFINE)
    backend = AclBackend()
    first = backend.open(om, SessionSettings(1))
    second = backend.open(om, SessionSettings(1))
    assert len(buffers_of(fake, WEIGHT_BYTES)) == 1  # one copy of the weights
    weights = {m.weights for m in fake.models.values()}
    assert len(weights) == 1 and len(fake.models) == 2  # two model ids, one weight buffer
    assert fake.calls.count("mdl.load_from_file_with_mem") == 2
    assert "mdl.load_from_file" not in fake.calls
    share = first.memory.weights
    assert share == second.memory.weights
    assert share == MemoryShare(share.key, "affine.om", 0, WEIGHT_BYTES, on_device=True)
    assert first.memory.device_bytes == second.memory.device_bytes == WORK_BYTES + io_bytes(first)
    assert fake.used[0] == WEIGHT_BYTES + 2 * (WORK_BYTES + io_bytes(first))

    first.close()  # the other still uses the weights
    assert len(buffers_of(fake, WEIGHT_BYTES)) == 1
    assert second.run({"x": X})["y"][0, 0] == 3.0  # its weights are intact
    (pointer,) = buffers_of(fake, WEIGHT_BYTES)
    second.close()  # the last user: unloaded, then freed
    assert buffers_of(fake, WEIGHT_BYTES) == []
    calls = [(name, args) for name, args in fake.trace if name in ("mdl.unload", "rt.free")]
    unloads = [i for i, (name, _) in enumerate(calls) if name == "mdl.unload"]
    assert len(unloads) == 2 and calls.index(("rt.free", (pointer,))) > unloads[-1]
    assert backend.memory.held() == {"buffers": 0, "bytes": 0}
    backend.close()
    assert fake.leaks() == {}


def test_instances_and_a_replica_share_the_weights_and_unloading_one_keeps_them(
    tmp_path: Path, fake: FakeAcl
) -> None:
    """``instances: 2`` and a replica under another name naming the same file: three model ids,
    one weight buffer; unloading the replica keeps it, unloading the last user frees it."""
    write_model(tmp_path / "affine.om", **AFFINE)
    path = tmp_path / "ascend.yaml"
    models = [
        raw_model("main", "affine.om", max_batch=4, instances=2),
        raw_model("replica", "affine.om", max_batch=4),
    ]
    path.write_text(yaml.safe_dump({"devices": [{"id": 0, "kind": "ascend"}], "models": models}))
    with Engine(load_config(path)) as engine:
        assert len(fake.models) == 3 and len(buffers_of(fake, WEIGHT_BYTES)) == 1
        sessions = [
            s
            for name in ("main", "replica")
            for s in engine.model(name).instances.sessions_by_device()[0]
        ]
        assert len(sessions) == 3 and len({s.memory.weights for s in sessions}) == 1
        engine.unload("replica")
        assert len(fake.models) == 2 and len(buffers_of(fake, WEIGHT_BYTES)) == 1
        assert engine.infer("main", X, timeout_s=10)["y"][0, 0] == 3.0
        engine.unload("main")
        assert fake.models == {} and buffers_of(fake, WEIGHT_BYTES) == []
        engine.load("replica")
        assert len(buffers_of(fake, WEIGHT_BYTES)) == 1  # loaded again
        assert engine.infer("replica", X, timeout_s=10)["y"][0, 0] == 3.0
    assert fake.leaks() == {}


def test_share_weights_false_gives_each_session_its_own(tmp_path: Path, fake: FakeAcl) -> None:
    om = write_model(tmp_path / "affine.om", **AFFINE)
    backend = AclBackend()
    own = SessionSettings(1, share_weights=False)
    sessions = [backend.open(om, own), backend.open(om, own)]
    assert len(buffers_of(fake, WEIGHT_BYTES)) == 2
    assert len({m.weights for m in fake.models.values()}) == 2
    for session in sessions:
        assert session.memory.weights is None  # its weights are its own, counted in device_bytes
        assert session.memory.device_bytes == WEIGHT_BYTES + WORK_BYTES + io_bytes(session)
    shared = backend.open(om, SessionSettings(1))  # joins neither
    assert len(buffers_of(fake, WEIGHT_BYTES)) == 3 and shared.memory.weights is not None
    for session in (*sessions, shared):
        assert session.run({"x": X})["y"][0, 0] == 3.0
        session.close()
    backend.close()
    assert fake.leaks() == {}


def test_only_the_same_file_on_the_same_device_shares(tmp_path: Path) -> None:
    """A copy of the file, the file rewritten in place (a new mtime), and the same file on
    another device each get their own weight buffer."""
    acl = FakeAcl(devices=2)
    sys.modules["acl"] = acl
    try:
        om = write_model(tmp_path / "affine.om", **AFFINE)
        copy = shutil.copy(om, tmp_path / "copy.om")
        backend = AclBackend()
        sessions = [
            backend.open(om, SessionSettings(1)),
            backend.open(Path(copy), SessionSettings(1)),
        ]
        sessions.append(backend.open(om, SessionSettings(1, device=1)))
        assert len({s.memory.weights.key for s in sessions if s.memory.weights}) == 3
        assert len(buffers_of(acl, WEIGHT_BYTES)) == 3
        stat = om.stat()
        os.utime(om, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
        sessions.append(backend.open(om, SessionSettings(1)))
        assert len(buffers_of(acl, WEIGHT_BYTES)) == 4  # a new file as far as sharing goes
        assert sessions[-1].memory.weights != sessions[0].memory.weights
        sessions.append(backend.open(om, SessionSettings(1)))
        assert len(buffers_of(acl, WEIGHT_BYTES)) == 4  # shares the rewritten file's
        for session in sessions:
            session.close()
        backend.close()
        assert acl.leaks() == {}
    finally:
        del sys.modules["acl"]


def test_a_load_whose_weights_are_resident_needs_only_its_work(
    tmp_path: Path, fake: FakeAcl
) -> None:
    """The room check compares query_size's work plus its weights unless they are on the
    device already; refused before anything is allocated, with what it compared."""
    om = write_model(tmp_path / "affine.om", **AFFINE)
    backend = AclBackend()
    tight = SessionSettings(1, room=DeviceRoom(None, WORK_BYTES + WEIGHT_BYTES // 2))
    with pytest.raises(NotEnoughDeviceMemoryError, match="query_size: work \\+ weights"):
        backend.open(om, tight)  # the first load must bring the weights
    first = backend.open(om, SessionSettings(1))
    second = backend.open(om, tight)  # they are there: its work fits
    mallocs = fake.calls.count("rt.malloc")
    with pytest.raises(NotEnoughDeviceMemoryError, match="weights are on device 0 already") as err:
        backend.open(om, SessionSettings(1, room=DeviceRoom(None, WORK_BYTES - 1)))
    assert err.value.needed == WORK_BYTES and err.value.room == WORK_BYTES - 1
    assert fake.calls.count("rt.malloc") == mallocs  # refused before allocating
    room = DeviceRoom(None, WORK_BYTES + WEIGHT_BYTES // 2)
    own = SessionSettings(1, room=room, share_weights=False)
    with pytest.raises(NotEnoughDeviceMemoryError, match="work \\+ weights"):
        backend.open(om, own)  # its own weights would not fit
    for session in (first, second):
        session.close()
    backend.close()
    assert fake.leaks() == {}


# -- work -----------------------------------------------------------------------------------


def test_models_that_may_run_at_once_get_their_own_work_buffers(
    tmp_path: Path, fake: FakeAcl
) -> None:
    backend = AclBackend()
    a = backend.open(write_model(tmp_path / "a.om", **AFFINE), SessionSettings(1))
    b = backend.open(write_model(tmp_path / "b.om", **STATIC), SessionSettings(1))
    works = [m.work for m in fake.models.values()]
    assert len(set(works)) == 2 and set(works) == {
        (p, WORK_BYTES) for p in buffers_of(fake, WORK_BYTES)
    }
    assert a.memory.figures["work_shared"] == b.memory.figures["work_shared"] == 0
    for session in (a, b):
        session.close()
    backend.close()
    assert fake.leaks() == {}


def test_models_that_run_alone_share_one_work_buffer_sized_to_the_largest(
    tmp_path: Path, fake: FakeAcl
) -> None:
    """On a device that starts one run at a time: a larger model first makes the buffer the
    smaller ones join; a larger one after gets a new buffer (the old stays with its users)
    that later loads share; each buffer is freed by its last user."""
    big = write_model(tmp_path / "big.om", **AFFINE, work_bytes=BIG_WORK)
    small = write_model(tmp_path / "small.om", **STATIC)
    backend = AclBackend()
    alone = SessionSettings(1, runs_alone=True)
    first = backend.open(small, alone)
    second = backend.open(small, alone)  # instances of one model share it too
    assert len(buffers_of(fake, WORK_BYTES)) == 1
    larger = backend.open(big, alone)  # more than the current one: a new, larger buffer
    assert len(buffers_of(fake, WORK_BYTES)) == 1 and len(buffers_of(fake, BIG_WORK)) == 1
    third = backend.open(small, alone)  # joins the larger one
    works = {s: fake.models[s._model_id].work[0] for s in (first, second, larger, third)}
    assert works[first] == works[second] != works[larger] == works[third]
    assert (
        third.memory.figures["work_buffer_bytes"] == BIG_WORK
        and third.memory.figures["work_shared"] == 1
    )
    assert third.memory.device_bytes == io_bytes(third)  # the shared buffer is charged apart:
    share, big_share = third.memory.shared_work, larger.memory.shared_work
    assert share is not None and big_share is not None and share.key == big_share.key
    assert share.nbytes == big_share.nbytes == BIG_WORK  # one share, at the buffer's size
    assert (share.charged_alone, big_share.charged_alone) == (WORK_BYTES, BIG_WORK)
    assert first.memory.shared_work is not None and first.memory.shared_work.nbytes == WORK_BYTES
    assert first.memory.shared_work.key != share.key
    for session in (first, second, larger, third):  # one after another, as their gate runs
        spec = session.inputs[0]
        session.run({"x": np.zeros(session.shape_at(spec, session.every_gear()[0]), spec.dtype)})
    first.close()
    second.close()
    assert buffers_of(fake, WORK_BYTES) == []  # the old one's last users are gone
    assert len(buffers_of(fake, BIG_WORK)) == 1
    larger.close()
    assert len(buffers_of(fake, BIG_WORK)) == 1  # the small model still uses it
    third.close()
    assert buffers_of(fake, BIG_WORK) == [] and backend.memory.held()["buffers"] == 0
    fresh = backend.open(big, alone)  # none held: a new one
    assert len(buffers_of(fake, BIG_WORK)) == 1
    fresh.close()
    backend.close()
    assert fake.leaks() == {}


def test_two_sessions_sharing_a_work_buffer_must_not_run_at_once(
    tmp_path: Path, fake: FakeAcl
) -> None:
    """Without the gate that keeps them apart, a second model's run while the first's is not
    synchronised fails in the fake (on a card they would corrupt each other's work)."""
    backend = AclBackend()
    alone = SessionSettings(1, runs_alone=True)  # but no gate holds them apart here
    a = backend.open(write_model(tmp_path / "a.om", **AFFINE), alone)
    b = backend.open(write_model(tmp_path / "b.om", **AFFINE), alone)
    synchronize = a._rt.synchronize_stream
    refused: list[str] = []

    def b_runs_meanwhile(stream: int) -> int:  # a's run is queued, not yet synchronised
        if stream == a._stream and not refused:
            with pytest.raises(AclError, match="execute_async") as err:
                b.run({"x": X})
            refused.append(str(err.value))
            a._rt.set_context(a._context)  # b's run made its own context current
        return synchronize(stream)

    a._rt.synchronize_stream = b_runs_meanwhile  # type: ignore[method-assign]
    assert a.run({"x": X})["y"][0, 0] == 3.0
    assert refused and "not synchronised" in refused[0]
    assert b.run({"x": X})["y"][0, 0] == 3.0  # after a's run: fine
    for session in (a, b):
        session.close()
    backend.close()
    assert fake.leaks() == {}


def ascend_config(tmp_path: Path, models: list[dict[str, Any]], **device: Any) -> Path:
    path = tmp_path / "ascend.yaml"
    devices = [{"id": 0, "kind": "ascend", **device}]
    path.write_text(yaml.safe_dump({"devices": devices, "models": models}))
    return path


@pytest.mark.parametrize(
    ("gate", "shared"), [({"runs_at_once": 1, "overdraft": 0}, True), ({}, False)]
)
def test_the_devices_gate_decides_whether_work_is_shared(
    tmp_path: Path, fake: FakeAcl, gate: dict[str, int], shared: bool
) -> None:
    """``runs_at_once: 1`` and ``overdraft: 0``: the device's models share one work buffer
    (sized to the largest), and many requests to both at once are all answered — the gate
    never lets two of them run together, which the fake would refuse. Otherwise (the default
    lets an under-served model overdraw) each has its own."""
    write_model(tmp_path / "big.om", **AFFINE, work_bytes=BIG_WORK)
    write_model(tmp_path / "small.om", **AFFINE)
    models = [
        raw_model("big", "big.om", max_batch=4, instances=2),
        raw_model("small", "small.om", max_batch=4, instances=2),
    ]
    with Engine(load_config(ascend_config(tmp_path, models, **gate))) as engine:
        works = {m.work[0] for m in fake.models.values()}  # the pointers
        assert len(fake.models) == 4
        if shared:
            assert works == set(buffers_of(fake, BIG_WORK)) and len(works) == 1
        else:
            assert len(works) == 4
        futures = [engine.submit(name, X) for _ in range(40) for name in ("big", "small")]
        assert all(f.result(10)["y"][0, 0] == 3.0 for f in futures)
    assert fake.leaks() == {}


# -- the engine's ledger ----------------------------------------------------------------------


def own_bytes(engine: Engine, name: str) -> int:
    """What ``name``'s sessions on device 0 take as their own (``device_bytes``, no weights)."""
    sessions = engine.model(name).instances.sessions_by_device()[0]
    assert sessions and all(s.memory.weights is not None for s in sessions)
    return sum(s.memory.device_bytes for s in sessions)


def test_the_ledger_charges_a_device_the_shared_weights_once(tmp_path: Path, fake: FakeAcl) -> None:
    """``instances: 2`` and a replica of the same .om on one device: the device is charged the
    weights once and every session's own memory, which is what the fake has allocated; each
    model's status names the copy and the other model using it. Unloading the replica takes
    off its own memory only (the other model still uses the weights); unloading the last takes
    off the rest, and the weight buffer is freed."""
    write_model(tmp_path / "affine.om", **AFFINE)
    models = [
        raw_model("main", "affine.om", max_batch=4, instances=2),
        raw_model("replica", "affine.om", max_batch=4),
    ]
    with Engine(load_config(ascend_config(tmp_path, models))) as engine:
        main, replica = own_bytes(engine, "main"), own_bytes(engine, "replica")
        assert main == 2 * replica > 0
        status = engine.status().to_dict()
        used = status["devices"][0]["used_bytes"]
        assert used == WEIGHT_BYTES + main + replica == fake.used[0]
        for name, other in (("main", "replica"), ("replica", "main")):
            (weights,) = status["models"][name]["memory"]["weights"]
            assert weights == {
                "file": "affine.om",
                "device": 0,
                "bytes": WEIGHT_BYTES,
                "on_device": True,
                "shared_with": [other],
            }

        engine.unload("replica")
        status = engine.status().to_dict()
        assert status["devices"][0]["used_bytes"] == used - replica == WEIGHT_BYTES + main
        assert status["models"]["main"]["memory"]["weights"][0]["shared_with"] == []
        assert len(buffers_of(fake, WEIGHT_BYTES)) == 1
        engine.unload("main")
        assert engine.status().to_dict()["devices"][0]["used_bytes"] == 0
        assert buffers_of(fake, WEIGHT_BYTES) == [] and fake.used[0] == 0
    assert fake.leaks() == {}


def test_a_device_budget_that_holds_the_weights_once_takes_both_models(
    tmp_path: Path, fake: FakeAcl
) -> None:
    """The device's ``memory_budget_mb`` fits the weights once and both models' own memory,
    not the weights twice: both load (charging each model the weights would refuse or evict
    one of them)."""
    write_model(tmp_path / "affine.om", **AFFINE)
    models = [
        raw_model("main", "affine.om", max_batch=4, instances=2),
        raw_model("replica", "affine.om", max_batch=4),
    ]
    budget_mb = 2
    config = load_config(ascend_config(tmp_path, models, memory_budget_mb=budget_mb))
    with Engine(config) as engine:
        status = engine.status().to_dict()
        assert all(status["models"][n]["memory"]["loaded"] for n in ("main", "replica"))
        own = own_bytes(engine, "main") + own_bytes(engine, "replica")
        budget = budget_mb << 20
        assert WEIGHT_BYTES + own <= budget < 2 * WEIGHT_BYTES + own  # the case this is
        device = status["devices"][0]
        assert (device["used_bytes"], device["budget_bytes"]) == (WEIGHT_BYTES + own, budget)
        assert engine.infer("replica", X, timeout_s=10)["y"][0, 0] == 3.0
        assert engine.infer("main", X, timeout_s=10)["y"][0, 0] == 3.0
    assert fake.leaks() == {}


def test_the_ledger_charges_a_shared_work_buffer_once_at_its_size(
    tmp_path: Path, fake: FakeAcl
) -> None:
    """On a device that runs one model at a time, a big model and a small one share one work
    buffer sized to the big one: the device is charged that buffer once, which is what the fake
    has allocated; each model alone is charged its own work, so the small one fits a
    ``memory_budget_mb`` the big buffer would overflow. Unloading the big model first leaves the
    buffer, at its size, with the small one, and the device's charge says so; unloading the
    small one frees it and the charge falls to zero."""
    big_work, small_weights = 3 << 19, 512 << 10  # (1.5 MiB: no other buffer has its size)
    write_model(tmp_path / "big.om", **AFFINE, work_bytes=big_work)
    write_model(tmp_path / "small.om", **AFFINE, weight_bytes=small_weights)
    models = [
        raw_model("big", "big.om", max_batch=4),
        {**raw_model("small", "small.om", max_batch=4, instances=2), "memory_budget_mb": 1},
    ]
    assert small_weights + WORK_BYTES < 1 << 20 < small_weights + big_work
    gate = {"runs_at_once": 1, "overdraft": 0}
    with Engine(load_config(ascend_config(tmp_path, models, **gate))) as engine:
        status = engine.status().to_dict()
        assert all(status["models"][n]["memory"]["loaded"] for n in ("big", "small")), status
        assert status["devices"][0]["used_bytes"] == fake.used[0]
        assert len(buffers_of(fake, big_work)) == 1 and buffers_of(fake, WORK_BYTES) == []
        for name, work in (("big", big_work), ("small", WORK_BYTES)):
            measured = status["models"][name]["memory"]["measured"]
            assert measured["shared_work_bytes"] == work, (name, measured)
        engine.unload("big")
        status = engine.status().to_dict()
        assert len(buffers_of(fake, big_work)) == 1  # the small model still uses it
        assert status["devices"][0]["used_bytes"] == fake.used[0]
        assert engine.infer("small", X, timeout_s=10)["y"][0, 0] == 3.0
        engine.unload("small")
        assert engine.status().to_dict()["devices"][0]["used_bytes"] == 0 == fake.used[0]
    assert fake.leaks() == {}


def test_a_load_that_joins_a_shared_work_buffer_needs_no_room_for_its_work(
    tmp_path: Path, fake: FakeAcl
) -> None:
    """A device budget that holds the shared work buffer once, both models' weights and their
    I/O, but not the work twice: both models load on a device that runs one at a time
    (counting each model's own work would refuse the second)."""
    work = 3 << 19  # 1.5 MiB each
    write_model(tmp_path / "a.om", **AFFINE, work_bytes=work)
    write_model(tmp_path / "b.om", **AFFINE, work_bytes=work)
    models = [raw_model("a", "a.om", max_batch=4), raw_model("b", "b.om", max_batch=4)]
    gate = {"runs_at_once": 1, "overdraft": 0}
    budget_mb = 4
    assert work + 2 * WEIGHT_BYTES < budget_mb << 20 < 2 * work + 2 * WEIGHT_BYTES
    config = load_config(ascend_config(tmp_path, models, memory_budget_mb=budget_mb, **gate))
    with Engine(config) as engine:
        status = engine.status().to_dict()
        assert all(status["models"][n]["memory"]["loaded"] for n in ("a", "b")), status
        assert status["devices"][0]["used_bytes"] == fake.used[0] <= budget_mb << 20
        assert len(buffers_of(fake, work)) == 1
        assert engine.infer("b", X, timeout_s=10)["y"][0, 0] == 3.0
    assert fake.leaks() == {}


def test_a_reload_joins_the_shared_work_buffer_in_place_of_the_one_it_used(
    tmp_path: Path, fake: FakeAcl
) -> None:
    """A model's last load used a shared work buffer that is gone (it was its only user); a
    larger model's buffer is there now. Loading it again needs only its weights and I/O on the
    device, as its first load after the larger model did: it is not refused, and nothing is
    evicted for room it does not need."""
    mib = 1 << 20
    write_model(tmp_path / "a.om", **AFFINE, work_bytes=2 * mib, weight_bytes=mib // 4)
    write_model(tmp_path / "b.om", **AFFINE, work_bytes=3 * mib, weight_bytes=mib // 4)
    models = [
        {**raw_model("a", "a.om", max_batch=4), "preload": False},
        {**raw_model("b", "b.om", max_batch=4), "preload": False},
    ]
    gate = {"runs_at_once": 1, "overdraft": 0}
    config = load_config(ascend_config(tmp_path, models, memory_budget_mb=4, **gate))
    with Engine(config) as engine:
        engine.load("a")
        engine.unload("a")  # its buffer (2 MiB) is freed with it
        engine.load("b")
        engine.load("a")  # joins b's 3 MiB buffer: 3.5 MiB in all, under the 4 MiB budget
        status = engine.status().to_dict()
        assert all(status["models"][n]["memory"]["loaded"] for n in ("a", "b")), status
        assert status["devices"][0]["used_bytes"] == fake.used[0] <= 4 * mib
        assert len(buffers_of(fake, 3 * mib)) == 1 and buffers_of(fake, 2 * mib) == []
        assert engine.infer("a", X, timeout_s=10)["y"][0, 0] == 3.0
    assert fake.leaks() == {}


def test_a_refusal_names_the_shared_buffers_it_would_join(tmp_path: Path, fake: FakeAcl) -> None:
    backend = AclBackend()
    alone = SessionSettings(1, runs_alone=True)
    first = backend.open(write_model(tmp_path / "a.om", **AFFINE), alone)
    tight = SessionSettings(1, runs_alone=True, room=DeviceRoom(None, WEIGHT_BYTES - 1))
    with pytest.raises(NotEnoughDeviceMemoryError) as err:  # another file: its weights to bring
        backend.open(write_model(tmp_path / "b.om", **AFFINE), tight)
    assert "(query_size's weights; its work buffer is on device 0 already)" in str(err.value)
    assert err.value.needed == WEIGHT_BYTES
    first.close()
    backend.close()
    assert fake.leaks() == {}


def test_a_model_over_its_own_budget_is_refused_before_loading_though_its_weights_are_there(
    tmp_path: Path, fake: FakeAcl
) -> None:
    """A replica whose ``memory_budget_mb`` cannot hold its weights and work: the weights are on
    the device already (the main model's), so the device has room, but the replica alone is
    charged them in full. It is refused before anything is allocated, naming its budget,
    rather than loaded and then undone."""
    write_model(tmp_path / "affine.om", **AFFINE)
    models = [
        raw_model("main", "affine.om", max_batch=4),
        {**raw_model("replica", "affine.om", max_batch=4), "memory_budget_mb": 1,
         "preload": False},
    ]  # fmt: skip
    assert WEIGHT_BYTES + WORK_BYTES > 1 << 20
    with Engine(load_config(ascend_config(tmp_path, models))) as engine:
        calls = len(fake.calls)
        with pytest.raises(ResourceExhaustedError, match=r"above its memory_budget_mb of 1\.0 MB"):
            engine.load("replica")
        assert not [
            c for c in fake.calls[calls:] if c in ("rt.malloc", "mdl.load_from_file_with_mem")
        ]
        assert engine.status().to_dict()["models"]["replica"]["state"] == "UNLOADED"
        assert engine.infer("main", X, timeout_s=10)["y"][0, 0] == 3.0
    assert fake.leaks() == {}


# -- the fake's contract for load_from_file_with_mem ------------------------------------------


def fake_on_device(tmp_path: Path, devices: int = 1) -> tuple[FakeAcl, str]:
    acl = FakeAcl(devices=devices)
    assert acl.init() == 0
    for device in range(devices):
        assert acl.rt.set_device(device) == 0
    acl.rt.create_context(0)
    return acl, str(write_model(tmp_path / "affine.om", **AFFINE))


def test_the_fake_load_with_mem_contract(tmp_path: Path) -> None:
    acl, om = fake_on_device(tmp_path, devices=2)
    work_size, weight_size, ret = acl.mdl.query_size(om)
    assert (work_size, weight_size, ret) == (WORK_BYTES, WEIGHT_BYTES, 0)
    with pytest.raises(TypeError):
        acl.mdl.load_from_file_with_mem(om, 0, 0, 0)  # the binding's "skkkk"
    work, _ = acl.rt.malloc(work_size, 0)
    weights, _ = acl.rt.malloc(weight_size, 0)
    used = acl.used[0]
    invalid = fake_acl.INVALID_PARAM
    load = acl.mdl.load_from_file_with_mem
    assert load(om, work, work_size - 1, weights, weight_size)[1] == invalid  # too small
    assert load(om, work, work_size, weights, weight_size - 1)[1] == invalid
    assert load(om, work, work_size, weights, 2 * weight_size)[1] == invalid  # past the buffer
    assert load(om, work, work_size, work, weight_size)[1] == invalid  # not that large
    freed, _ = acl.rt.malloc(weight_size, 0)
    assert acl.rt.free(freed) == 0
    assert load(om, work, work_size, freed, weight_size)[1] == invalid  # freed
    context_1, _ = acl.rt.create_context(1)
    on_1, _ = acl.rt.malloc(weight_size, 0)
    acl.rt.create_context(0)
    assert load(om, work, work_size, on_1, weight_size)[1] == fake_acl.WRONG_DEVICE
    model, ret = load(om, work, work_size, weights, weight_size)
    assert ret == 0 and model and acl.used[0] == used  # it runs in the caller's memory
    twin, ret = load(om, 0, 0, weights, weight_size)  # the same file's weights: shared
    assert ret == 0 and acl.used[0] == used + work_size  # a null pointer: the runtime's own
    other = str(write_model(tmp_path / "other.om", **STATIC))
    assert load(other, 0, 0, weights, weight_size)[1] == invalid  # another file's weights
    assert load(om, weights, work_size, 0, 0)[1] == invalid  # work over a model's weights
    assert acl.rt.free(weights) == invalid  # loaded models still use it
    assert "still use" in acl.get_recent_err_msg() and weights in acl.memory
    assert acl.mdl.unload(model) == 0 and acl.rt.free(weights) == invalid  # the twin still does
    assert acl.mdl.unload(twin) == 0 and acl.used[0] == used
    assert acl.rt.free(weights) == 0 and acl.rt.free(work) == 0
    acl.rt.set_context(context_1)
    assert acl.rt.free(on_1) == 0


def run_once(acl: FakeAcl, model: int, stream: int) -> int:
    """One execute of an AFFINE model at gear 1 (no synchronise); the datasets it made."""
    datasets = []
    # buffers at the largest gear (8): inputs x (8×4 float32) and the gear input (2 int64),
    # outputs y (8×4 float32) and s (8 float32)
    for sizes in ((128, 16), (128, 32)):
        dataset = acl.mdl.create_dataset()
        for size in sizes:
            pointer, _ = acl.rt.malloc(size, 0)
            acl.mdl.add_dataset_buffer(dataset, acl.create_data_buffer(pointer, size))
        datasets.append(dataset)
    acl.mdl.set_dynamic_batch_size(model, datasets[0], 1, 1)
    return acl.mdl.execute_async(model, datasets[0], datasets[1], stream)


def test_the_fake_refuses_two_runs_at_once_over_one_work_buffer(tmp_path: Path) -> None:
    """Sharing a work buffer is documented for models run one after another: on one stream,
    or synchronised in turn. Two unsynchronised runs on two streams over it fail."""
    acl, om = fake_on_device(tmp_path)
    work, _ = acl.rt.malloc(WORK_BYTES, 0)
    first, _ = acl.mdl.load_from_file_with_mem(om, work, WORK_BYTES, 0, 0)
    second, _ = acl.mdl.load_from_file_with_mem(om, work, WORK_BYTES, 0, 0)
    one, _ = acl.rt.create_stream()
    two, _ = acl.rt.create_stream()
    assert run_once(acl, first, one) == 0
    assert run_once(acl, second, two) == fake_acl.INVALID_PARAM
    assert "not synchronised" in acl.get_recent_err_msg()
    assert run_once(acl, second, one) == 0  # the same stream keeps them in order
    assert acl.rt.synchronize_stream(one) == 0
    assert run_once(acl, second, two) == 0  # after the first's run is done


def test_the_fake_notices_weights_overwritten(tmp_path: Path) -> None:
    """A copy into a shared weight buffer (never the backend's) breaks the next run."""
    acl, om = fake_on_device(tmp_path)
    weights, _ = acl.rt.malloc(WEIGHT_BYTES, 0)
    model, _ = acl.mdl.load_from_file_with_mem(om, 0, 0, weights, WEIGHT_BYTES)
    stream, _ = acl.rt.create_stream()
    assert run_once(acl, model, stream) == 0 and acl.rt.synchronize_stream(stream) == 0
    junk = np.zeros(8, np.uint8)
    assert acl.rt.memcpy(weights, WEIGHT_BYTES, junk.ctypes.data, 8, fake_acl.H2D) == 0
    assert run_once(acl, model, stream) == fake_acl.MODEL_EXECUTE
