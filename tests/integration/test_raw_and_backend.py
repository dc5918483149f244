"""The raw executor on a small generated ONNX model, and the ORT backend's provider checks."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import yaml

from duomo.ipc.errors import InvalidArgumentError
from duomo.supervisor.config import ConfigError, load_config
from duomo.supervisor.core.engine import Engine
from duomo.worker.request import Outcome
from tests.integration.harness import affine_model


def raw_config(tmp_path: Path, **backend: object) -> Path:
    affine_model(tmp_path / "affine.onnx")
    path = tmp_path / "raw.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "backends": {"onnxruntime": backend},
                "models": [
                    {
                        "name": "affine",
                        "task": "raw",
                        "file": "affine.onnx",
                        "max_batch": 8,
                        "max_delay_ms": 1000,
                    }
                ],
            }
        )
    )
    return path


def test_raw_rows_are_batched_and_split_back(tmp_path: Path) -> None:
    with Engine(load_config(raw_config(tmp_path))) as engine:
        served = engine.model("affine")
        inputs = [np.full((n, 4), n, dtype=np.float32) for n in (1, 3, 2)]
        futures: list[Future[Outcome]] = []
        for x in inputs:
            future: Future[Outcome] = Future()
            served.submit({"x": x}, future.set_result)
            futures.append(future)
        outcomes = [f.result(30) for f in futures]
    for x, outcome in zip(inputs, outcomes):
        assert outcome.error is None
        np.testing.assert_array_equal(outcome.result["y"], 2 * x + 1)
        np.testing.assert_array_equal(outcome.result["s"], x.sum(axis=1, keepdims=True))
    assert {o.batch_size for o in outcomes} == {3}


def test_raw_rejects_wrong_dtype_shape_and_names(tmp_path: Path) -> None:
    with Engine(load_config(raw_config(tmp_path))) as engine:
        with pytest.raises(InvalidArgumentError, match="float32"):
            engine.infer("affine", np.zeros((1, 4), dtype=np.float64))
        with pytest.raises(InvalidArgumentError, match="does not fit"):
            engine.infer("affine", np.zeros((1, 5), dtype=np.float32))
        with pytest.raises(InvalidArgumentError, match="exactly"):
            engine.infer("affine", {"z": np.zeros((1, 4), dtype=np.float32)})
        with pytest.raises(InvalidArgumentError, match=r"outside 1\.\.8"):
            engine.infer("affine", np.zeros((9, 4), dtype=np.float32))
        # and it still serves afterwards
        out = engine.infer("affine", np.ones((2, 4), dtype=np.float32))
        np.testing.assert_array_equal(out["y"], np.full((2, 4), 3.0, dtype=np.float32))


def test_missing_provider_is_an_error_unless_fallback_is_allowed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"CUDAExecutionProvider is not available"):
        load_config(raw_config(tmp_path, providers=["CUDAExecutionProvider"]))
    lenient = load_config(
        raw_config(tmp_path, providers=["CUDAExecutionProvider"], allow_cpu_fallback=True)
    )
    with Engine(lenient) as engine:
        out = engine.infer("affine", np.zeros((1, 4), dtype=np.float32))
        np.testing.assert_array_equal(out["y"], np.ones((1, 4), dtype=np.float32))


def test_outputs_whose_shape_depends_on_the_data(tmp_path: Path) -> None:
    """NonZero's output size changes with the values: the session must notice and adapt."""
    import onnx
    from onnx import TensorProto, helper

    from duomo.worker.backends.base import SessionSettings
    from duomo.worker.backends.ort_backend import OrtBackend

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [1, None])
    graph = helper.make_graph([helper.make_node("NonZero", ["x"], ["y"])], "nz", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "nz.onnx")
    session = OrtBackend().open(tmp_path / "nz.onnx", SessionSettings(intra_op_threads=1))
    try:
        for values in ([1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1], [1, 1, 1, 1]):
            out = session.run({"x": np.array(values, dtype=np.float32)})["y"]
            np.testing.assert_array_equal(out, np.nonzero(values)[0][None, :])
    finally:
        session.close()
