"""Several devices in one supervisor, on the CPU: two cpu "devices" of one core each
(``devices[].cores``), a model spread over both (``device: [0, 1]``, ``instances: 2``).

In a real supervisor: batches run on both devices; when one device's instance is held busy,
every request flows to the other; a memory budget on one device evicts only there. In process:
an instance's thread is pinned to its device's core, and the intra-op threads a session starts
are pinned to the device's cores too.

They need two cores (two one-core devices) and skip on a machine with fewer. With CI=true that
skip fails (tests/conftest.py): CI's machines have two cores, so a skip there would drop these
tests unseen.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from duomo.ipc.client import Client
from duomo.ipc.errors import InvalidArgumentError
from duomo.supervisor.config import load_config
from duomo.supervisor.core.engine import Engine
from duomo.worker.backends.base import SessionSettings
from duomo.worker.backends.ort_backend import OrtBackend
from duomo.worker.thread_budget import usable_cores
from tests.conftest import fixture_image
from tests.integration.harness import (
    ROOT,
    SupervisorProcess,
    faulty_model,
    poll,
    running_supervisor,
    write_config,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(len(usable_cores()) < 2, reason="needs two cores to make two devices"),
]
X = np.array([[1, 2, 3, 4]], dtype=np.float32)


def two_devices(**extra: Any) -> list[dict[str, Any]]:
    first, second = usable_cores()[:2]
    return [
        {"id": 0, "kind": "cpu", "cores": [first], **extra},
        {"id": 1, "kind": "cpu", "cores": [second], **extra},
    ]


def model_status(sup: SupervisorProcess, name: str) -> dict[str, Any]:
    """``name``'s status, as its JSON."""
    with Client(sup.socket) as client:
        return client.status().models[name].to_dict()


def batches_by_device(sup: SupervisorProcess, name: str) -> dict[int, int]:
    found: dict[int, int] = {}
    for place in model_status(sup, name)["placement"]:
        found[place["device"]] = found.get(place["device"], 0) + place["batches"]
    return found


def test_a_model_on_two_devices_serves_from_both_and_a_busy_one_sends_work_to_the_other(
    tmp_path: Path,
) -> None:
    control = tmp_path / "hold"
    control.write_text("none")
    params = {"work_ms": 20, "control_file": str(control), "fault_device": 0}
    health = {"exec_timeout_ms": 120_000}
    entry = faulty_model("m", max_batch=1, device=[0, 1], instances=2, params=params, health=health)
    config = write_config(tmp_path, [], extra=[entry], devices=two_devices())
    with running_supervisor(config) as sup:
        shown = model_status(sup, "m")
        assert shown["devices"] == [0, 1]
        assert [p["device"] for p in shown["placement"]] == [0, 1]
        assert [p["cores"] for p in shown["placement"]] == [[c] for c in usable_cores()[:2]]
        with Client(sup.socket) as client:
            devices = {d.id: d for d in client.status().devices}
        assert devices[0].thread_budget == devices[1].thread_budget == 1
        with Client(sup.socket, timeout_s=60) as client:
            handle = client.model("m", slots=8)
            # batches run on both: eight at a time keep both instances busy
            for _ in range(10):
                futures = [handle.infer_async(X) for _ in range(8)]
                assert all(f.result(30)["y"][0, 0] == 3.0 for f in futures)
            both = batches_by_device(sup, "m")
            assert both[0] > 0 and both[1] > 0, both
            # hold device 0's instance: the next request it takes does not finish
            control.write_text("hang")
            sent: list[Future[Any]] = []
            before = batches_by_device(sup, "m")

            def taken_by_device_0() -> bool:
                return batches_by_device(sup, "m")[0] > before[0]

            while not taken_by_device_0():  # one at a time, until device 0 takes one
                future = handle.infer_async(X)
                sent.append(future)
                # answered by device 1, or taken by device 0 (and held there)
                poll(lambda f=future: f.done() or taken_by_device_0())
            held = [f for f in sent if not f.done()]
            assert held == sent[-1:], "only the request device 0 took is held"
            busy = batches_by_device(sup, "m")
            for _ in range(20):  # every request now flows to device 1
                assert handle.infer(X, timeout_s=30)["y"][0, 0] == 3.0
            after = batches_by_device(sup, "m")
            assert after[0] == busy[0] and after[1] == busy[1] + 20, (busy, after)
            assert not held[0].done()  # still held while the twenty were answered
            control.write_text("none")  # released: the held request is answered
            assert held[0].result(30)["y"][0, 0] == 3.0


def test_a_budget_on_one_device_evicts_only_there(tmp_path: Path) -> None:
    """Device 0 holds two 60 MB models of its budget of 150 MB; device 1 holds one. A third
    model for device 0 evicts the least recently used one there, never device 1's."""

    def entry(name: str, device: int, preload: bool = True) -> dict[str, Any]:
        params = {"ballast_mb": 60}
        return faulty_model(name, device=device, evictable=True, preload=preload, params=params)

    models = [entry("a", 0), entry("b", 0), entry("c", 1), entry("d", 0, preload=False)]
    devices = two_devices(memory_budget_mb=150)
    config = write_config(tmp_path, [], extra=models, devices=devices)
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=60) as client:
        for name in ("a", "c", "b"):  # a is now device 0's least recently used
            assert client.model(name).infer(X)["y"][0, 0] == 3.0
        assert client.model("d").infer(X)["y"][0, 0] == 3.0  # loaded on demand
        poll(lambda: model_status(sup, "a")["state"] == "UNLOADED", timeout_s=30)
        states = {n: model_status(sup, n)["state"] for n in "abcd"}
        assert states == {"a": "UNLOADED", "b": "READY", "c": "READY", "d": "READY"}
        assert model_status(sup, "c")["evictions"] == 0
        used = {d.id: d.used_bytes for d in client.status().devices}
        assert used[0] <= 150 << 20 and 40 << 20 < used[1] <= 150 << 20, used


def test_instance_threads_are_pinned_to_their_devices_cores(tmp_path: Path) -> None:
    """A real ONNX Runtime model on two one-core devices: each instance's thread runs only on
    its device's core (its warm-up and every batch)."""
    first, second = usable_cores()[:2]
    config = write_config(
        tmp_path,
        ["classify"],
        overrides={"classify": {"device": [0, 1], "instances": 2}},
        devices=two_devices(),
    )
    with Engine(load_config(config)) as engine:
        workers = engine.model("classify").instances.workers
        pinned = {w.index: os.sched_getaffinity(w.native_id) for w in workers}
        assert pinned == {0: {first}, 1: {second}}
        assert engine.infer("classify", fixture_image("coffee.png"), timeout_s=60)["top"]


def test_an_unpinned_device_runs_on_the_cores_no_device_holds(tmp_path: Path) -> None:
    """Device 0 has a core of its own; device 1 has none: its models share the rest of the
    process's cores (their threads pinned there, so a thread started by a pinned one cannot
    carry device 0's core over), with a thread budget of that many cores."""
    first, *rest = usable_cores()
    devices = [{"id": 0, "kind": "cpu", "cores": [first]}, {"id": 1, "kind": "cpu"}]
    overrides = {"classify": {"device": 1}}
    config = write_config(tmp_path, ["classify"], overrides=overrides, devices=devices)
    with Engine(load_config(config)) as engine:
        (worker,) = engine.model("classify").instances.workers
        assert os.sched_getaffinity(worker.native_id) == set(rest)
        budgets = {d.id: d.thread_budget for d in engine.status().devices}
        assert budgets == {0: 1, 1: len(rest)}


def test_a_sessions_intra_op_threads_are_pinned_to_the_devices_cores() -> None:
    """onnxruntime starts the intra-op threads of a session opened for a device with cores
    on those cores only (``session.intra_op_thread_affinities``, processors counted from 1)."""
    core = usable_cores()[1]
    model = next((ROOT / "models").rglob("*.onnx"))
    before = set(os.listdir("/proc/self/task"))
    session = OrtBackend().open(model, SessionSettings(intra_op_threads=2, cores=(core,)))
    try:
        started = set(os.listdir("/proc/self/task")) - before
        assert started, "onnxruntime started no intra-op thread"
        assert all(os.sched_getaffinity(int(tid)) == {core} for tid in started)
    finally:
        session.close()


def test_a_reload_keeps_the_devices_fixed_at_start_but_takes_a_new_budget(tmp_path: Path) -> None:
    first, second = usable_cores()[:2]
    entry = faulty_model("m", device=[0, 1], instances=2)
    config = write_config(tmp_path, [], extra=[entry], devices=two_devices())
    with Engine(load_config(config)) as engine:
        moved = [
            {"id": 0, "kind": "cpu", "cores": [second]},
            {"id": 1, "kind": "cpu", "cores": [first]},
        ]
        write_config(tmp_path, [], extra=[entry], devices=moved)
        with pytest.raises(InvalidArgumentError, match="restart the supervisor"):
            engine.reload(load_config(config))
        write_config(tmp_path, [], extra=[entry], devices=two_devices(memory_budget_mb=500))
        engine.reload(load_config(config))
        budgets = {d.id: d.budget_bytes for d in engine.status().devices}
        assert budgets == {0: 500 << 20, 1: 500 << 20}
        assert engine.infer("m", X, timeout_s=10)["y"][0, 0] == 3.0
