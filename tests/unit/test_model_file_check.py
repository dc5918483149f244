"""``duomo check -c`` opens each model file with its backend's cheapest check (issue 33): a file
ONNX Runtime cannot load, or an empty ``.om``, is named with its field, path and the backend's
reason, exit 2; an ``.om`` is only read here, and the answer says loading it needs CANN."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from duomo.supervisor.operators.cli import main
from duomo.worker.backends import acl_backend, ort_backend


def identity_model(path: Path) -> Path:
    """The smallest model ONNX Runtime loads: y = x, float[1]."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def write_config(tmp_path: Path, models: list[dict[str, object]], **top: object) -> Path:
    path = tmp_path / "duomo.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "models": models, **top}))
    return path


def test_a_text_file_named_onnx_fails_the_check_naming_field_file_and_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    identity_model(tmp_path / "good.onnx")
    (tmp_path / "notes.onnx").write_text("not a model, only a name that says so\n")
    config = write_config(
        tmp_path,
        [
            {"name": "classify", "task": "classification", "file": "good.onnx"},
            {
                "name": "ocr", "task": "ocr",
                "files": {"det": "good.onnx", "cls": "good.onnx", "rec": "notes.onnx"},
            },
        ],
    )  # fmt: skip
    assert main(["check", "-c", str(config)]) == 2
    captured = capsys.readouterr()
    bad = tmp_path / "notes.onnx"
    assert f"{config}: models[ocr].files.rec: {bad}: onnxruntime cannot load it: " in captured.err
    assert "Protobuf parsing failed" in captured.err  # ONNX Runtime's own reason
    assert f"{config}: invalid" in captured.err
    assert "models[classify]" not in captured.err and "files.det" not in captured.err
    assert captured.out.count("loads in onnxruntime") == 3  # classify, ocr's det and cls
    assert "OK" not in captured.out


def test_every_file_that_loads_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    identity_model(tmp_path / "good.onnx")
    config = write_config(tmp_path, [{"name": "a", "task": "classification", "file": "good.onnx"}])
    assert main(["check", "-c", str(config)]) == 0
    out = capsys.readouterr().out
    assert "    file: loads in onnxruntime" in out and f"{config}: OK (1 models)" in out


@pytest.mark.parametrize(("content", "reason"), [(b"", "No graph was found"), (b"\x08\x07", "")])
def test_ort_check_raises_with_onnxruntimes_reason(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(content)  # empty; a valid protobuf header (ir_version 7) and no graph
    with pytest.raises(ValueError, match="onnxruntime cannot load it") as caught:
        ort_backend.check_model_file(path)
    assert reason in str(caught.value)
    assert ort_backend.check_model_file(identity_model(path)) == "loads in onnxruntime"


def test_om_check_reads_the_file_and_says_loading_needs_cann(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "built.om").write_bytes(b"\0" * 4096)
    (tmp_path / "empty.om").write_bytes(b"")
    config = write_config(
        tmp_path,
        [
            {"name": "a", "task": "classification", "backend": "acl", "file": "built.om"},
            {"name": "b", "task": "classification", "backend": "acl", "file": "empty.om"},
        ],
        devices=[{"id": 0, "kind": "ascend"}],
    )
    assert main(["check", "-c", str(config)]) == 2
    captured = capsys.readouterr()
    assert "    file: readable, 0.0 MiB; not loaded: that needs the CANN runtime" in captured.out
    empty = tmp_path / "empty.om"
    assert f"{config}: models[b].file: {empty}: the file is empty" in captured.err
    assert "models[a]" not in captured.err
    with pytest.raises(ValueError, match="cannot read it"):
        acl_backend.check_model_file(tmp_path)  # a directory: open fails
