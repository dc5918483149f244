"""Config loading: a valid file loads; each kind of mistake names the file and the field path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from duomo.supervisor.config import ConfigError, load_config
from duomo.supervisor.operators.cli import main
from tests.unit.test_model_file_check import identity_model


def write_config(tmp_path: Path, models: list[dict[str, object]], **top: object) -> Path:
    for name in ("a.onnx", "det.onnx", "cls.onnx", "rec.onnx"):
        (tmp_path / name).write_bytes(b"")
    path = tmp_path / "duomo.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "models": models, **top}))
    return path


def classify(**overrides: object) -> dict[str, object]:
    return {"name": "classify", "task": "classification", "file": "a.onnx", **overrides}


def problems(path: Path) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in info.value.render()
    return info.value.problems


def test_valid_config_loads_with_defaults_and_absolute_paths(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        [
            classify(max_batch=8, max_delay_ms=2, params={"top_k": 3}),
            {
                "name": "ocr",
                "task": "ocr",
                "files": {"det": "det.onnx", "cls": "cls.onnx", "rec": "rec.onnx"},
            },
        ],
    )
    loaded = load_config(path)
    model = loaded.models["classify"]
    assert model.config.max_batch == 8
    assert model.params.top_k == 3  # type: ignore[attr-defined]
    assert model.files["model"] == tmp_path / "a.onnx"
    assert set(loaded.models["ocr"].files) == {"det", "cls", "rec"}
    assert loaded.config.backends.onnxruntime.providers == ["CPUExecutionProvider"]


def test_typo_is_rejected_with_field_path(tmp_path: Path) -> None:
    found = problems(write_config(tmp_path, [classify(max_bach=4)]))
    assert found == [("models[classify].max_bach", "unknown key (check the spelling)")]


def test_wrong_type_is_rejected_with_field_path(tmp_path: Path) -> None:
    found = problems(write_config(tmp_path, [classify(), classify(name="b", max_batch="eight")]))
    assert [where for where, _ in found] == ["models[b].max_batch"]
    assert "integer" in found[0][1]


def test_missing_model_file_names_the_path(tmp_path: Path) -> None:
    found = problems(write_config(tmp_path, [classify(file="nowhere/missing.onnx")]))
    assert found[0][0] == "models[classify].file"
    assert str(tmp_path / "nowhere" / "missing.onnx") in found[0][1]


def test_executor_params_are_strict_too(tmp_path: Path) -> None:
    found = problems(write_config(tmp_path, [classify(params={"top_kk": 3})]))
    assert found == [("models[classify].params.top_kk", "unknown key (check the spelling)")]


def test_backend_options_typo(tmp_path: Path) -> None:
    found = problems(
        write_config(tmp_path, [classify()], backends={"onnxruntime": {"provider": ["X"]}})
    )
    assert found[0][0] == "backends.onnxruntime.provider"


def test_unknown_task_duplicate_name_and_wrong_roles(tmp_path: Path) -> None:
    found = dict(
        problems(
            write_config(
                tmp_path,
                [
                    classify(),
                    classify(),
                    {"name": "x", "task": "segmentation", "file": "a.onnx"},
                    {"name": "o", "task": "ocr", "file": "a.onnx"},
                ],
            )
        )
    )
    assert "duplicate" in found["models[1].name"]  # a name used twice tells nothing apart
    assert "unknown task 'segmentation'" in found["models[x].task"]
    assert "det" in found["models[o].file"]


def test_a_model_is_named_by_its_name_or_by_its_index_without_a_usable_one(
    tmp_path: Path,
) -> None:
    def wheres(*models: Any) -> list[str]:
        return [where for where, _ in problems(write_config(tmp_path, list(models)))]

    assert wheres(classify(), classify(name="ocr", max_bach=4)) == ["models[ocr].max_bach"]
    assert wheres(classify(), {"task": "raw", "file": "a.onnx"}) == ["models[1].name"]  # missing
    assert wheres(classify(name=7)) == ["models[0].name"]  # not a string
    assert wheres(classify(name="no spaces", max_bach=1)) == [
        "models[0].name",  # not a valid name: the index says which entry
        "models[0].max_bach",
    ]
    assert wheres(classify(name="7", max_bach=1)) == ["models[0].max_bach"]  # reads as an index
    assert wheres(classify(), "just a string") == ["models[1]"]  # not even a mapping
    # the loader's own checks, after the schema's, name the model too
    assert wheres(classify(name="ocr", device=3)) == ["models[ocr].device"]


def test_model_root_is_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "m.onnx").write_bytes(b"")
    path = write_config(tmp_path, [classify(file="m.onnx")], model_root="weights")
    assert load_config(path).models["classify"].files["model"] == tmp_path / "weights" / "m.onnx"


def test_user_executor_class_from_the_config_folder(tmp_path: Path) -> None:
    (tmp_path / "my_tasks.py").write_text(
        "from worker.executors.raw import RawExecutor\nclass Doubler(RawExecutor):\n    pass\n"
    )
    path = write_config(tmp_path, [{"name": "d", "task": "my_tasks:Doubler", "file": "a.onnx"}])
    assert load_config(path).models["d"].executor.__name__ == "Doubler"


def test_a_user_task_that_cannot_be_resolved_says_why(tmp_path: Path) -> None:
    (tmp_path / "own_tasks.py").write_text(
        "from worker.executors.raw import RawExecutor\n"
        "class Doubler(RawExecutor):\n    pass\n"
        "class NotOne:\n    pass\n"
    )
    (tmp_path / "broken_tasks.py").write_text("import no_such_dependency_anywhere\n")

    def why(task: str) -> str:
        entry = {"name": "d", "task": task, "file": "a.onnx"}
        ((where, reason),) = problems(write_config(tmp_path, [entry]))
        assert where == "models[d].task"
        return reason

    assert why("own_tasks:Doubler2") == "module own_tasks has no class Doubler2"
    assert why("own_tasks:NotOne") == "'own_tasks:NotOne' is not an Executor subclass"
    assert why("own_taskz:Doubler").startswith("executor module own_taskz not found")
    assert why("own_tasks.sub:Doubler").startswith("executor module own_tasks.sub not found")
    broken = why("broken_tasks:Doubler")  # found, but what it imports is not
    assert broken.startswith("cannot import executor module broken_tasks:"), broken
    assert "no_such_dependency_anywhere" in broken


def test_invalid_yaml_and_non_mapping(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    assert "not valid YAML" in problems(bad)[0][1]
    bad.write_text("- 1\n- 2\n")
    assert problems(bad)[0][0] == "(top level)"


def test_check_command_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write_config(tmp_path, [classify()])
    identity_model(tmp_path / "a.onnx")  # `check` opens it (tests/unit/test_model_file_check.py)
    assert main(["check", "-c", str(good)]) == 0
    assert "OK (1 models)" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"models": [classify(max_batch=0)]}))
    assert main(["check", "-c", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: models[classify].max_batch:" in err


def test_path_params_resolve_against_the_config_folder(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_text("a\nb\n")
    path = write_config(tmp_path, [classify(params={"labels": "labels.txt"})])
    params = load_config(path).models["classify"].params
    assert params.labels == tmp_path / "labels.txt"  # type: ignore[attr-defined]
    found = problems(write_config(tmp_path, [classify(params={"labels": "nope.txt"})]))
    assert found[0][0] == "models[classify].params.labels" and "not found" in found[0][1]


def test_thread_override_above_the_budget(tmp_path: Path) -> None:
    found = problems(
        write_config(
            tmp_path,
            [classify(intra_op_threads=16)],
            backends={"onnxruntime": {"thread_budget": 2}},
        )
    )
    assert found == [
        ("models[classify].intra_op_threads", "16 is above the thread budget of 2 cores")
    ]


def test_unavailable_provider_is_a_config_error(tmp_path: Path) -> None:
    found = problems(
        write_config(tmp_path, [classify()], backends={"onnxruntime": {"providers": ["NopeEP"]}})
    )
    assert found[0][0] == "backends.onnxruntime.providers[0]"


def test_the_gateway_section_refuses_an_open_bind_without_a_token_or_tls() -> None:
    from pydantic import ValidationError

    from duomo.supervisor.process.gateways import GatewayConfig

    assert GatewayConfig().http == "127.0.0.1:8000" and GatewayConfig().grpc == "127.0.0.1:8001"
    GatewayConfig(http="[::1]:9000", grpc=None)  # loopback, either family
    with pytest.raises(ValidationError, match="not a loopback address"):
        GatewayConfig(http="0.0.0.0:8000")
    GatewayConfig(http="0.0.0.0:8000", token_file=Path("t"))
    with pytest.raises(ValidationError, match="tls_cert and tls_key go together"):
        GatewayConfig(tls_cert=Path("c"))
    with pytest.raises(ValidationError, match="HOST:PORT"):
        GatewayConfig(http="8000")
    with pytest.raises(ValidationError, match="give http, grpc or both"):
        GatewayConfig(http=None, grpc=None)


def test_the_metrics_section_is_off_when_absent_and_needs_host_and_port(tmp_path: Path) -> None:
    assert load_config(write_config(tmp_path, [classify()])).config.metrics is None
    on = load_config(write_config(tmp_path, [classify()], metrics={"http": "0.0.0.0:9100"}))
    assert on.config.metrics is not None and on.config.metrics.http == "0.0.0.0:9100"
    found = problems(write_config(tmp_path, [classify()], metrics={"http": "9100"}))
    assert found and found[0][0] == "metrics.http" and "HOST:PORT" in found[0][1], found
    found = problems(write_config(tmp_path, [classify()], metrics={"port": 9100}))
    assert found[0][0] == "metrics.port", found


def test_max_delay_auto_needs_an_slo_and_batches(tmp_path: Path) -> None:
    auto = {"max_batch": 8, "max_delay_ms": "auto", "health": {"slo_p99_ms": 50}}
    loaded = load_config(write_config(tmp_path, [classify(**auto)]))
    assert loaded.models["classify"].config.max_delay_ms == "auto"
    for wrong in ({**auto, "health": {}}, {**auto, "max_batch": 1}):
        found = problems(write_config(tmp_path, [classify(**wrong)]))
        assert any("max_delay_ms: auto needs health.slo_p99_ms" in why for _, why in found), found
    found = problems(write_config(tmp_path, [classify(max_delay_ms="soon")]))
    assert found and found[0][0].startswith("models[classify].max_delay_ms"), found


def test_a_model_on_several_devices_places_its_instances_in_turn(tmp_path: Path) -> None:
    devices = [{"id": 0, "kind": "cpu"}, {"id": 1, "kind": "cpu"}]
    path = write_config(tmp_path, [classify(device=[1, 0], instances=3)], devices=devices)
    model = load_config(path).models["classify"].config
    assert model.device_ids == (1, 0)
    assert [model.instance_device(i) for i in range(3)] == [1, 0, 1]


def test_device_placement_mistakes_name_the_field(tmp_path: Path) -> None:
    devices = [{"id": 0, "kind": "cpu"}, {"id": 1, "kind": "ascend"}, {"id": 2, "kind": "cpu"}]

    def found(**entry: object) -> list[tuple[str, str]]:
        return problems(write_config(tmp_path, [classify(**entry)], devices=devices))

    assert found(device=[0, 3]) == [("models[classify].device", "no device with id 3 in 'devices'")]
    (where, why), *_ = found(device=[0, 1])
    assert where == "models[classify].device" and "different kinds ['ascend', 'cpu']" in why
    (where, why), *_ = found(device=[0, 0])
    assert where == "models[classify]" and "device lists a device twice" in why
    (where, why), *_ = found(device=[])
    assert where.startswith("models[classify].device")


def test_device_cores_mistakes_name_the_field(tmp_path: Path) -> None:
    from duomo.worker.thread_budget import usable_cores

    first = usable_cores()[0]

    def found(*devices: dict[str, object]) -> list[tuple[str, str]]:
        return problems(write_config(tmp_path, [classify()], devices=list(devices)))

    assert found({"id": 0, "cores": [first]}, {"id": 1, "cores": [first]}) == [
        ("devices[1].cores", f"core {first} is already device 0's")
    ]
    assert found({"id": 0, "cores": [4096]})[0][0] == "devices[0].cores"
    assert "not one this process may run on" in found({"id": 0, "cores": [4096]})[0][1]
    (where, why), *_ = found({"id": 0, "kind": "ascend", "cores": [first]})
    assert where == "devices[0]" and "cores is for cpu devices" in why
    assert found({"id": 0}, {"id": 0}) == [("devices[1].id", "device id 0 is used twice")]


def test_a_pinned_devices_thread_budget_is_its_cores(tmp_path: Path) -> None:
    from duomo.worker.thread_budget import usable_cores

    devices = [{"id": 0, "cores": usable_cores()[:1]}]
    found = problems(write_config(tmp_path, [classify(intra_op_threads=2)], devices=devices))
    assert found == [
        ("models[classify].intra_op_threads", "2 is above the thread budget of 1 cores of device 0")
    ]
