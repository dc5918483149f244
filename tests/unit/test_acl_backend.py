"""The ACL backend against the strict pyACL fake: contract, engine, worker threads, teardown.

The fake is installed as the ``acl`` module, so the code under test is exactly what runs on a
card: ``load_runtime`` imports it, the engine builds real worker threads, sessions are opened and
closed on them.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from duomo.ipc.errors import InternalError, InvalidArgumentError, ResourceExhaustedError
from duomo.supervisor.config import ConfigError, load_config
from duomo.supervisor.core.engine import Engine
from duomo.worker.backends import acl_runtime
from duomo.worker.backends.acl_backend import AclBackend
from duomo.worker.backends.base import SessionSettings
from duomo.worker.backends.ort_backend import (
    CANN_PROVIDER_KEYS,
    OrtOptions,
    provider_device_options,
    provider_options_for,
)
from duomo.worker.model_status import instance_placements
from tests.fakes import fake_acl
from tests.fakes.fake_acl import CONTRACT, FakeAcl, write_model

AFFINE = {
    "inputs": [{"name": "x", "dtype": "float32", "format": "ND", "dims": [-1, 4]}],
    "outputs": [
        {"name": "y", "dtype": "float32", "format": "ND", "dims": [-1, 4]},
        {"name": "s", "dtype": "float32", "format": "ND", "dims": [-1]},
    ],
    "dynamic_batch": [1, 2, 4, 8],
    "function": "affine_and_sum",
}
STATIC = {
    "inputs": [{"name": "x", "dtype": "uint8", "format": "NCHW", "dims": [1, 3, 2, 2]}],
    "outputs": [{"name": "y", "dtype": "uint8", "format": "NCHW", "dims": [1, 3, 2, 2]}],
    "function": "identity",
}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeAcl:
    acl = FakeAcl()
    monkeypatch.setitem(sys.modules, "acl", acl)
    return acl


def config(tmp_path: Path, models: list[dict[str, Any]]) -> Path:
    path = tmp_path / "ascend.yaml"
    path.write_text(yaml.safe_dump({"devices": [{"id": 0, "kind": "ascend"}], "models": models}))
    return path


def raw_model(name: str, file: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "task": "raw", "backend": "acl", "file": file, **extra}


# -- the contract ---------------------------------------------------------------------------


def test_every_call_the_runtime_makes_is_a_pyacl_function() -> None:
    source = inspect.getsource(acl_runtime)
    called = set(re.findall(r"self\._acl\.([a-z_.]+)\(", source))
    assert len(called) >= 40
    missing = sorted(name for name in called if name not in CONTRACT["functions"])
    assert not missing, f"not in the pyACL binding: {missing}"


def test_the_runtime_constants_match_the_cann_headers() -> None:
    enums, errors = CONTRACT["enums"], CONTRACT["errors"]
    assert errors["ACL_SUCCESS"] == acl_runtime.ACL_SUCCESS
    assert errors["ACL_ERROR_REPEAT_INITIALIZE"] == acl_runtime.ACL_ERROR_REPEAT_INITIALIZE
    policy = enums["aclrtMemMallocPolicy"]["ACL_MEM_MALLOC_HUGE_FIRST"]
    assert policy == acl_runtime.ACL_MEM_MALLOC_HUGE_FIRST
    kinds = enums["aclrtMemcpyKind"]
    assert kinds["ACL_MEMCPY_HOST_TO_DEVICE"] == acl_runtime.ACL_MEMCPY_HOST_TO_DEVICE
    assert kinds["ACL_MEMCPY_DEVICE_TO_HOST"] == acl_runtime.ACL_MEMCPY_DEVICE_TO_HOST
    assert enums["aclrtMemAttr"]["ACL_HBM_MEM"] == acl_runtime.ACL_HBM_MEM
    assert enums["aclrtMemAttr"]["ACL_DDR_MEM"] == acl_runtime.ACL_DDR_MEM
    assert CONTRACT["strings"]["ACL_DYNAMIC_TENSOR_NAME"] == acl_runtime.ACL_DYNAMIC_TENSOR_NAME
    names = {"float32": "FLOAT", "float64": "DOUBLE", "bool": "BOOL"}
    for code, dtype in acl_runtime.ACL_DTYPES.items():
        name = names.get(dtype.name, dtype.name.upper())
        assert enums["aclDataType"][f"ACL_{name}"] == code, dtype
    for code, name in acl_runtime.ACL_FORMATS.items():
        assert enums["aclFormat"][f"ACL_FORMAT_{name}"] == code, name
    assert set(acl_runtime.ERROR_MEANINGS) <= set(errors.values())


def test_the_fake_refuses_what_the_hardware_refuses(tmp_path: Path) -> None:
    acl = FakeAcl()
    assert acl.init() == 0 and acl.init() == fake_acl.REPEAT_INITIALIZE
    with pytest.raises(TypeError):
        acl.rt.malloc(64)  # one argument short of the binding's "ki"
    assert acl.rt.malloc(64, 0) == (0, fake_acl.CONTEXT_NULL)  # no context on this thread
    assert acl.rt.set_device(0) == 0
    context, _ = acl.rt.create_context(0)
    stream, _ = acl.rt.create_stream()
    model, ret = acl.mdl.load_from_file(str(write_model(tmp_path / "m.om", **STATIC)))
    assert ret == 0
    other: list[int] = []
    thread = threading.Thread(target=lambda: other.append(acl.rt.create_stream()[1]))
    thread.start()
    thread.join()
    assert other == [fake_acl.CONTEXT_NULL]  # a new thread has no current context
    second, _ = acl.rt.create_context(0)  # now current on this thread
    assert acl.mdl.execute_async(model, 0, 0, stream) == fake_acl.MODEL_CONTEXT
    assert acl.mdl.unload(model) == fake_acl.MODEL_CONTEXT
    assert acl.rt.destroy_context(second) == 0
    acl.rt.set_context(context)
    assert acl.rt.destroy_context(context) != 0  # its stream and model are alive
    assert acl.finalize() != 0  # resources alive
    assert acl.mdl.unload(model) == 0 and acl.rt.destroy_stream(stream) == 0
    assert acl.rt.destroy_context(context) == 0
    assert acl.rt.reset_device(0) == 0 and acl.finalize() == 0
    assert acl.leaks() == {}


# -- the backend ----------------------------------------------------------------------------


def test_models_instances_and_gear_padding(tmp_path: Path, fake: FakeAcl) -> None:
    write_model(tmp_path / "affine.om", **AFFINE)
    write_model(tmp_path / "static.om", **STATIC)
    path = config(
        tmp_path,
        [
            raw_model("affine", "affine.om", max_batch=8, instances=2),
            raw_model("static", "static.om", max_batch=1),
        ],
    )
    with Engine(load_config(path)) as engine:
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        out = engine.infer("affine", x, timeout_s=10)
        np.testing.assert_array_equal(out["y"], x * 2 + 1)  # 3 rows back, not the gear's 4
        np.testing.assert_array_equal(out["s"], x.sum(axis=1))
        image = np.arange(12, dtype=np.uint8).reshape(1, 3, 2, 2)
        np.testing.assert_array_equal(engine.infer("static", image, timeout_s=10)["y"], image)
        futures = [
            engine.submit("affine", np.full((n, 4), n, dtype=np.float32)) for n in (1, 2, 5, 8) * 5
        ]
        for future, n in zip(futures, (1, 2, 5, 8) * 5):
            assert future.result(10)["y"].tolist() == [[2.0 * n + 1] * 4] * n
        status = engine.status().to_dict()["models"]["affine"]
        assert status["state"] == "READY" and status["instances"] == 2
    assert fake.calls.count("rt.create_context") == 3  # one per instance
    assert fake.calls.count("init") == 1 and fake.calls.count("rt.set_device") == 1
    assert fake.leaks() == {}  # every create/malloc released, device reset, finalised
    assert fake.calls[-2:] == ["rt.reset_device", "finalize"]


IMAGE_GEARS = {
    "inputs": [{"name": "x", "dtype": "float32", "format": "NCHW", "dims": [1, 3, -1, -1]}],
    "outputs": [{"name": "y", "dtype": "float32", "format": "NCHW", "dims": [1, 3, -1, -1]}],
    "dynamic_hw": [[32, 32], [32, 64], [64, 64]],
    "function": "affine",
}


def test_image_size_gears(tmp_path: Path, fake: FakeAcl) -> None:
    """An .om built with --dynamic_image_size serves exactly its H×W gears (set per run with
    set_dynamic_hw_size) and refuses other sizes with the list of gears."""
    write_model(tmp_path / "hw.om", **IMAGE_GEARS)
    path = config(tmp_path, [raw_model("hw", "hw.om")])
    with Engine(load_config(path)) as engine:
        for h, w in ((32, 64), (64, 64), (32, 32), (32, 64)):
            x = np.random.default_rng(h + w).random((1, 3, h, w), dtype=np.float32)
            np.testing.assert_allclose(engine.infer("hw", x, timeout_s=10)["y"], 2 * x + 1)
        with pytest.raises(InvalidArgumentError, match="takes only"):
            engine.infer("hw", np.zeros((1, 3, 40, 40), np.float32), timeout_s=10)
        described = engine.model("hw").instances.sessions_by_device()[0][0].describe()  # type: ignore[attr-defined]
        assert described["dynamic_hw_gears"] == [[32, 32], [32, 64], [64, 64]]
    assert fake.calls.count("mdl.set_dynamic_hw_size") == 4  # one per run, warm-up has none
    assert "mdl.set_dynamic_batch_size" not in fake.calls
    assert fake.leaks() == {}


def test_the_fake_keeps_batch_and_image_size_gears_apart(tmp_path: Path) -> None:
    acl = FakeAcl()
    acl.init()
    acl.rt.set_device(0)
    context, _ = acl.rt.create_context(0)
    model, _ = acl.mdl.load_from_file(str(write_model(tmp_path / "hw.om", **IMAGE_GEARS)))
    desc = acl.mdl.create_desc()
    acl.mdl.get_desc(desc, model)
    assert acl.mdl.get_dynamic_hw(desc, 0)[1] == fake_acl.INVALID_PARAM  # the index is -1
    assert acl.mdl.get_dynamic_hw(desc, -1)[0]["hw"] == IMAGE_GEARS["dynamic_hw"]
    assert acl.mdl.get_dynamic_batch(desc)[0]["batchCount"] == 0
    dataset = acl.mdl.create_dataset()
    assert acl.mdl.set_dynamic_batch_size(model, dataset, 1, 1) != 0  # not a batch model
    assert acl.mdl.set_dynamic_hw_size(model, dataset, 1, 40, 40) != 0  # not a gear
    assert acl.mdl.set_dynamic_hw_size(model, dataset, 1, 32, 64) == 0
    both = {**IMAGE_GEARS, "dynamic_batch": [1, 2]}
    assert acl.mdl.load_from_file(str(write_model(tmp_path / "both.om", **both)))[1] != 0
    acl.mdl.destroy_dataset(dataset)
    acl.mdl.unload(model)
    acl.mdl.destroy_desc(desc)
    acl.rt.destroy_context(context)
    acl.rt.reset_device(0)
    acl.finalize()
    assert acl.leaks() == {}


def test_every_call_runs_in_the_instance_context(tmp_path: Path, fake: FakeAcl) -> None:
    """Two instances on two threads, and every synchronise leaves the thread in the device's
    default context (as ORT-CANN does): a run that did not set its own context would fail."""
    fake.rebind_default_context = True
    write_model(tmp_path / "affine.om", **AFFINE)
    model = raw_model("affine", "affine.om", max_batch=4, instances=2, queue_size=256)
    path = config(tmp_path, [model])
    with Engine(load_config(path)) as engine:
        futures = [engine.submit("affine", np.ones((2, 4), np.float32)) for _ in range(200)]
        assert all(f.result(10)["y"][0, 0] == 3.0 for f in futures)
    assert fake.leaks() == {}


def test_a_failed_execute_fails_its_batch_and_the_next_one_serves(
    tmp_path: Path, fake: FakeAcl
) -> None:
    write_model(tmp_path / "affine.om", **AFFINE)
    path = config(tmp_path, [raw_model("affine", "affine.om", max_batch=4)])
    with Engine(load_config(path)) as engine:
        fake.fail_next_executes = 1
        with pytest.raises(InternalError):
            engine.infer("affine", np.ones((1, 4), np.float32), timeout_s=10)
        assert engine.infer("affine", np.ones((1, 4), np.float32), timeout_s=10)["y"][0, 0] == 3
    assert fake.leaks() == {}


def test_unload_load_and_reinitialization_release_everything(tmp_path: Path, fake: FakeAcl) -> None:
    """Device memory is measured and charged; an unloaded model holds nothing on the device; a
    model whose executes keep failing is re-initialized by the watchdog and serves again."""
    from duomo.supervisor.process.watchdog import Watchdog

    write_model(tmp_path / "affine.om", **AFFINE)
    health = {"max_consecutive_failures": 2, "backoff_ms": 0}
    path = config(tmp_path, [raw_model("affine", "affine.om", max_batch=4, health=health)])
    x = np.ones((1, 4), np.float32)
    with Engine(load_config(path)) as engine:
        memory = engine.status().to_dict()["models"]["affine"]["memory"]
        assert memory["measured"]["device_bytes"] > 0 and memory["loaded"]
        for _ in range(3):
            engine.unload("affine")
            assert len(fake.models) == 0 and len(fake.memory) == 0  # nothing left on the card
            engine.load("affine")
            assert engine.infer("affine", x, timeout_s=10)["y"][0, 0] == 3.0
        watchdog = Watchdog(engine, period_s=0.02)
        watchdog.start()
        try:
            fake.fail_next_executes = 2
            for _ in range(2):
                with pytest.raises(InternalError):
                    engine.infer("affine", x, timeout_s=10)
            model = engine.model("affine")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(
                h.reason == "re-initialized" for h in model.history
            ):
                time.sleep(0.01)
            assert model.state.value == "READY" and model.restarts.count(time.monotonic()) == 1
            assert engine.infer("affine", x, timeout_s=10)["y"][0, 0] == 3.0
        finally:
            watchdog.stop()
        assert len(fake.models) == 1  # the failed instance's model was unloaded
    assert fake.leaks() == {}


def test_device_budgets_use_query_size_before_anything_is_allocated(
    tmp_path: Path, fake: FakeAcl
) -> None:
    """A load whose query_size does not fit its budgets is refused before anything is loaded;
    one that fits only after an eviction evicts the least recently used idle model first.
    (Each model's weights are its own here: shared ones are tests/unit/test_acl_shared_memory.)"""
    write_model(tmp_path / "affine.om", **AFFINE)
    models = [
        raw_model(name, "affine.om", max_batch=4, evictable=True, preload=name != "c",
                  share_weights=False)
        for name in ("a", "b", "c")
    ]  # fmt: skip
    models.append(
        raw_model("tiny", "affine.om", preload=False, memory_budget_mb=1, share_weights=False)
    )
    path = tmp_path / "budget.yaml"
    device = {"id": 0, "kind": "ascend", "memory_budget_mb": 3}  # two 1.1 MB models fit
    path.write_text(yaml.safe_dump({"devices": [device], "models": models}))
    x = np.ones((1, 4), np.float32)
    with Engine(load_config(path)) as engine:
        loads_before = fake.calls.count("mdl.load_from_file_with_mem")
        mallocs_before = fake.calls.count("rt.malloc")
        with pytest.raises(ResourceExhaustedError, match="query_size"):
            engine.load("tiny")  # 1 MB of weights + 64 KB of work is above 1 MB
        assert fake.calls.count("mdl.load_from_file_with_mem") == loads_before  # nor loaded
        assert fake.calls.count("rt.malloc") == mallocs_before  # nothing was allocated
        engine.infer("b", x, timeout_s=10)  # a is now the least recently used
        assert engine.infer("c", x, timeout_s=10)["y"][0, 0] == 3.0  # loaded on demand
        deadline = time.monotonic() + 10  # its first answer may come before the load is booked
        while "c" not in engine.footprints and time.monotonic() < deadline:
            time.sleep(0.01)
        states = {n: engine.model(n).state.value for n in ("a", "b", "c")}
        assert states == {"a": "UNLOADED", "b": "READY", "c": "READY"}
        assert engine.model("a").evictions == 1
        used = engine.status().to_dict()["devices"][0]["used_bytes"]
        assert 2 << 20 < used <= 3 << 20
    assert fake.leaks() == {}


def test_reload_replaces_sessions_without_leaks(tmp_path: Path, fake: FakeAcl) -> None:
    write_model(tmp_path / "affine.om", **AFFINE)
    write_model(tmp_path / "static.om", **STATIC)
    first = config(tmp_path, [raw_model("affine", "affine.om", max_batch=4)])
    with Engine(load_config(first)) as engine:
        second = config(
            tmp_path,
            [
                raw_model("affine", "affine.om", max_batch=8),
                raw_model("static", "static.om"),
            ],
        )
        summary = engine.reload(load_config(second))
        assert summary == {
            "added": ["static"], "removed": [], "replaced": ["affine"],
            "pipelines_added": [], "pipelines_removed": [], "pipelines_replaced": [],
        }  # fmt: skip
        assert engine.infer("affine", np.ones((8, 4), np.float32), timeout_s=10)["y"].shape == (
            8,
            4,
        )
        assert fake.models and len(fake.models) == 2  # the old affine session is gone
    assert fake.leaks() == {}


def test_a_max_batch_above_the_largest_gear_fails_the_load(tmp_path: Path, fake: FakeAcl) -> None:
    write_model(tmp_path / "affine.om", **AFFINE)
    path = config(tmp_path, [raw_model("affine", "affine.om", max_batch=16)])
    engine = Engine(load_config(path))
    with pytest.raises(RuntimeError, match="max_batch 16 is above the 8 rows"):
        engine.start()
    engine.close()
    assert fake.leaks() == {}


def test_a_model_built_for_another_soc_is_refused_clearly(tmp_path: Path, fake: FakeAcl) -> None:
    model = write_model(tmp_path / "affine.om", soc_version="Ascend910B3", **AFFINE)
    backend = AclBackend()
    settings = SessionSettings(intra_op_threads=1)
    with pytest.raises(RuntimeError, match="this device is Ascend310P3"):
        backend.open(model, settings)  # the fake's load says "invalid file"; we say why
    (tmp_path / "affine.om.atc.json").write_text(json.dumps({"soc_version": "Ascend910B3"}))
    with pytest.raises(RuntimeError, match="built for Ascend910B3 but this device is Ascend310P3"):
        backend.open(model, settings)  # caught before loading, from the ATC sidecar
    backend.close()
    assert fake.leaks() == {}


def test_session_writes_outputs_into_the_callers_arrays(tmp_path: Path, fake: FakeAcl) -> None:
    """The slot fast path: output shapes known up front, results copied straight in."""
    backend = AclBackend()
    session = backend.open(write_model(tmp_path / "a.om", **AFFINE), SessionSettings(1))
    x = np.ones((3, 4), np.float32)
    shapes = session.expected_output_shapes({"x": x})
    assert shapes == [(3, 4), (3,)]
    targets = {"y": np.zeros((3, 4), np.float32), "s": np.zeros(3, np.float32)}
    session.run({"x": x}, targets)
    assert targets["y"][2, 3] == 3.0 and targets["s"][0] == 4.0
    assert session.describe()["dynamic_batch_gears"] == [1, 2, 4, 8]
    assert session.memory.figures["measured_bytes"] > 0
    with pytest.raises(ValueError, match="static model takes"):
        static = backend.open(write_model(tmp_path / "s.om", **STATIC), SessionSettings(1))
        try:
            static.run({"x": np.zeros((2, 3, 2, 2), np.uint8)})
        finally:
            static.close()
    session.close()
    backend.close()
    assert fake.leaks() == {}


# -- configuration --------------------------------------------------------------------------


def test_an_acl_model_needs_an_ascend_device(tmp_path: Path) -> None:
    write_model(tmp_path / "affine.om", **AFFINE)
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump({"models": [raw_model("affine", "affine.om")]}))
    with pytest.raises(ConfigError, match="needs an ascend device"):
        load_config(path)


def test_cann_provider_options_accept_only_the_keys_the_provider_does() -> None:
    built = provider_options_for(
        "CANNExecutionProvider", {"device_id": 1, "enable_cann_graph": True}
    )
    assert built == {"device_id": "1", "enable_cann_graph": "1", "dump_om_model": "0"}
    assert len(CANN_PROVIDER_KEYS) == 10
    with pytest.raises(ValueError, match="does not accept \\['do_copy_in_default_stream'\\]"):
        OrtOptions(provider_options={"CANNExecutionProvider": {"do_copy_in_default_stream": 1}})
    assert provider_options_for("CUDAExecutionProvider", {"device_id": 0}) == {"device_id": "0"}


def test_an_accelerator_provider_runs_on_the_instances_device() -> None:
    """ONNX Runtime's CUDA and CANN providers get the instance's device as their device_id
    (``models[].device``), unless the config names one; the CPU provider gets none."""
    on_1 = SessionSettings(1, device=1)
    assert provider_device_options("CANNExecutionProvider", {}, on_1) == {"device_id": 1}
    assert provider_device_options("CUDAExecutionProvider", {"device_id": 0}, on_1) == {
        "device_id": 0
    }
    assert provider_device_options("CPUExecutionProvider", {}, on_1) == {}


# -- the command line on this machine -------------------------------------------------------


def test_check_reports_no_ascend_runtime_here(capsys: pytest.CaptureFixture[str]) -> None:
    from duomo.supervisor.operators.cli import main

    assert main(["check"]) == 0
    assert "no Ascend runtime" in capsys.readouterr().out
    assert main(["check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["acl"]["importable"] is False and "CPUExecutionProvider" in str(report)


@pytest.mark.parametrize("name", ["ascend-310p.yaml", "ascend-910b.yaml"])
def test_the_ascend_configs_validate(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from duomo.supervisor.operators.cli import main
    from tests.conftest import ROOT

    assert main(["check", "-c", str(ROOT / "configs" / name)]) == 0
    assert "not built yet" in capsys.readouterr().out  # no ATC here: the .om files are missing


def test_inspect_onnx_and_om(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(A demo model's inspection: tests/integration/test_cli_infer.py; this one needs none.)"""
    from duomo.supervisor.operators.cli import main
    from tests.unit.test_model_file_check import identity_model

    assert main(["inspect", str(identity_model(tmp_path / "identity.onnx"))]) == 0
    onnx = json.loads(capsys.readouterr().out)
    assert onnx["inputs"] == [{"name": "x", "dtype": "float32", "dims": [1]}]
    om = write_model(tmp_path / "affine.om", **AFFINE)
    assert main(["inspect", str(om)]) == 2  # no CANN here
    assert "needs the CANN runtime" in capsys.readouterr().err


def test_inspect_om_with_a_runtime(
    tmp_path: Path, fake: FakeAcl, capsys: pytest.CaptureFixture[str]
) -> None:
    from duomo.supervisor.operators.cli import main

    assert main(["inspect", str(write_model(tmp_path / "affine.om", **AFFINE))]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dynamic_batch_gears"] == [1, 2, 4, 8] and info["soc"] == "Ascend310P3"
    assert [t["name"] for t in info["inputs"]] == ["x"]  # the gear input is the backend's
    assert fake.leaks() == {}


def test_the_smoke_kit_runs_end_to_end_on_the_fake(tmp_path: Path, fake: FakeAcl) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import ascend_smoke

    models = [
        write_model(tmp_path / "affine.om", **AFFINE),
        write_model(tmp_path / "static.om", **STATIC),
        write_model(tmp_path / "hw.om", **IMAGE_GEARS),
    ]
    out = tmp_path / "report.json"
    assert ascend_smoke.main([*map(str, models), "--seconds", "0.05", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    affine = report["models"][str(models[0])]
    assert [g["gear"] for g in affine["gears_checked"]] == [[1], [2], [4], [8]]
    hw = report["models"][str(models[2])]
    assert [g["gear"] for g in hw["gears_checked"]] == IMAGE_GEARS["dynamic_hw"]
    assert set(affine["executes_per_s"]) == {"1", "2", "4"}
    assert report["ok"] and "environment" in report and "all_models_executes_per_s" in report
    assert fake.leaks() == {}


def test_a_run_holds_its_devices_compute_gate(tmp_path: Path, fake: FakeAcl) -> None:
    """execute_async and synchronize_stream run holding the model's place at the device's gate
    (the fair share of device time), and the turn is charged to the model."""
    from duomo.worker.thread_budget import ComputeGate

    gate = ComputeGate(1)
    member = gate.member("affine")
    backend = AclBackend()
    session = backend.open(
        write_model(tmp_path / "a.om", **AFFINE), SessionSettings(1, gate=member)
    )
    held: list[int] = []
    execute = session._rt.execute_async

    def recording(*args: object) -> int:
        held.append(member.running)
        return execute(*args)  # type: ignore[arg-type]

    session._rt.execute_async = recording  # type: ignore[method-assign]
    session.run({"x": np.ones((2, 4), np.float32)})
    assert held == [1] and member.running == 0 and gate.high_water == 1
    assert gate.policy.used(member, gate.policy.clock()) > 0
    session.close()
    backend.close()
    assert fake.leaks() == {}


# -- several devices ------------------------------------------------------------------------


def two_devices(tmp_path: Path, models: list[dict[str, Any]], budget_mb: int | None = None) -> Path:
    devices = [{"id": d, "kind": "ascend", "memory_budget_mb": budget_mb} for d in (0, 1)]
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump({"devices": devices, "models": models}))
    return path


def test_the_fake_refuses_memory_of_another_device(tmp_path: Path) -> None:
    """A device pointer of device 0 used from a context on device 1 (copy, free, a dataset's
    buffer in an execute) is an error, and each device reports only its own memory."""
    acl = FakeAcl(devices=2)
    assert acl.init() == 0 and acl.rt.set_device(0) == 0 and acl.rt.set_device(1) == 0
    on_0, _ = acl.rt.create_context(0)
    pointer, _ = acl.rt.malloc(64, 0)
    free_0, total, _ = acl.rt.get_mem_info(1)
    on_1, _ = acl.rt.create_context(1)
    assert acl.rt.get_mem_info(1)[0] == total > free_0  # device 1 has all of its own
    host = np.zeros(16, np.float32)
    wrong = fake_acl.WRONG_DEVICE
    assert acl.rt.memcpy(pointer, 64, host.ctypes.data, 64, fake_acl.H2D) == wrong
    assert acl.rt.free(pointer) == wrong
    assert "device 0" in acl.get_recent_err_msg()
    assert acl.rt.set_context(on_0) == 0
    assert acl.rt.memcpy(pointer, 64, host.ctypes.data, 64, fake_acl.H2D) == 0
    assert acl.rt.free(pointer) == 0
    for context in (on_0, on_1):
        assert acl.rt.destroy_context(context) == 0
    assert acl.rt.reset_device(0) == acl.rt.reset_device(1) == acl.finalize() == 0


def test_a_model_on_two_devices_runs_on_both_and_releases_each_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``device: [0, 1]`` with two instances: one context, stream and model per instance, each
    on its device; memory measured and charged on each device; every context of a device is
    destroyed before that device is reset, and finalize comes last."""
    acl = FakeAcl(devices=2)
    monkeypatch.setitem(sys.modules, "acl", acl)
    write_model(tmp_path / "affine.om", **AFFINE)
    models = [
        raw_model("both", "affine.om", max_batch=4, instances=2, device=[0, 1]),
        raw_model("second", "affine.om", max_batch=4, device=1),
    ]
    with Engine(load_config(two_devices(tmp_path, models))) as engine:
        assert {acl.contexts[m.context] for m in acl.models.values()} == {0, 1}
        assert sorted(acl.contexts[m.context] for m in acl.models.values()) == [0, 1, 1]
        x = np.ones((2, 4), np.float32)
        model = engine.model("both")
        for _ in range(200):  # until both instances have served batches
            futures = [engine.submit("both", x) for _ in range(8)]
            assert all(f.result(10)["y"][0, 0] == 3.0 for f in futures)
            if all(p.batches for p in instance_placements(model)):
                break
        assert [p.device for p in instance_placements(model)] == [0, 1]
        assert all(p.batches > 0 for p in instance_placements(model))
        status = engine.status().to_dict()
        charged = status["models"]["both"]["memory"]["charged_bytes_by_device"]
        assert charged["0"] > 0 and charged["1"] > 0
        used = {d["id"]: d["used_bytes"] for d in status["devices"]}
        # device 1 also holds "second"; a device is charged the weights once, besides the models
        assert used[1] > used[0] >= charged["0"]
    assert acl.leaks() == {}
    teardown = [(name, args) for name, args in acl.trace if name in ("rt.destroy_context",
                "rt.reset_device", "finalize")]  # fmt: skip
    for device in (0, 1):
        reset = teardown.index(("rt.reset_device", (device,)))
        destroyed = [
            i for i, (name, args) in enumerate(teardown)
            if name == "rt.destroy_context" and acl.context_devices[args[0]] == device
        ]  # fmt: skip
        assert len(destroyed) == (1 if device == 0 else 2)
        assert max(destroyed) < reset
    assert teardown[-1][0] == "finalize"


def test_a_budget_on_one_device_evicts_only_there(tmp_path: Path) -> None:
    """Two devices with budgets for two models each: a model loaded on device 0 evicts device
    0's least recently used idle model, never device 1's (even when it is older). (Weights of
    their own: each model costs its weights.)"""
    acl = FakeAcl(devices=2)
    sys.modules["acl"] = acl
    try:
        write_model(tmp_path / "affine.om", **AFFINE)
        models = [
            raw_model(name, "affine.om", max_batch=4, evictable=True, device=device,
                      preload=name != "d", share_weights=False)
            for name, device in (("c", 1), ("a", 0), ("b", 0), ("d", 0))
        ]  # fmt: skip
        x = np.ones((1, 4), np.float32)
        with Engine(load_config(two_devices(tmp_path, models, budget_mb=3))) as engine:
            for name in ("c", "a", "b"):  # c (device 1) is the oldest; a is device 0's
                engine.infer(name, x, timeout_s=10)
            assert engine.infer("d", x, timeout_s=10)["y"][0, 0] == 3.0
            deadline = time.monotonic() + 10
            while "d" not in engine.footprints and time.monotonic() < deadline:
                time.sleep(0.01)
            states = {n: engine.model(n).state.value for n in "abcd"}
            assert states == {"a": "UNLOADED", "b": "READY", "c": "READY", "d": "READY"}
            used = {d["id"]: d["used_bytes"] for d in engine.status().to_dict()["devices"]}
            assert 2 << 20 < used[0] <= 3 << 20 and 1 << 20 < used[1] <= 2 << 20
        assert acl.leaks() == {}
    finally:
        del sys.modules["acl"]
