"""The gateway's pieces without processes: the wire contract, request parsing, BYTES tensors,
the error mapping, encoded images and shared-memory regions."""

from __future__ import annotations

import struct
from multiprocessing import shared_memory
from pathlib import Path

import cv2
import numpy as np
import pytest

from gateway import protocol
from gateway.images import decode_into
from gateway.regions import Regions
from ipc.errors import ErrorCode, InvalidArgumentError, NotFoundError, UnavailableError
from tests.conftest import IMAGES

RAW_INFO = {
    "name": "affine", "task": "raw", "backend": "onnxruntime", "state": "READY", "max_batch": 4,
    "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 4]}], "result": "tensors",
    "outputs": ["y"], "output_tensors": [{"name": "y", "dtype": "float32", "shape": [None, 4]}],
    "batched": True,
}  # fmt: skip
IMAGE_INFO = {
    "name": "classify", "task": "classification", "backend": "acl", "state": "READY",
    "max_batch": 8, "inputs": [{"name": "image", "dtype": "uint8", "shape": [None, None, None]}],
    "result": "json", "outputs": [], "output_tensors": [], "batched": False,
}  # fmt: skip


def test_how_models_look_on_the_wire() -> None:
    image = protocol.model_view(IMAGE_INFO)
    assert image.image_task and image.platform == "ascend_om" and image.max_batch_size == 0
    meta = protocol.model_metadata(image)
    assert meta["inputs"] == [{"name": "IMAGE", "datatype": "UINT8", "shape": [-1, -1, -1]}]
    assert meta["outputs"] == [{"name": "RESULT", "datatype": "BYTES", "shape": [1]}]
    config = protocol.model_config(image)
    assert config["max_batch_size"] == 0 and "dynamic_batching" not in config
    assert config["input"] == [{"name": "IMAGE", "data_type": "TYPE_UINT8", "dims": [-1, -1, -1]}]
    assert config["output"] == [{"name": "RESULT", "data_type": "TYPE_STRING", "dims": [1]}]
    raw = protocol.model_view(RAW_INFO)
    assert protocol.model_metadata(raw)["inputs"] == [
        {"name": "x", "datatype": "FP32", "shape": [-1, 4]}
    ]
    config = protocol.model_config(raw)
    assert config["max_batch_size"] == 4 and config["dynamic_batching"] == {}
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
    # never loaded: an image task's contract is known, a raw model's is not
    unloaded = protocol.model_view({"name": "ocr", "task": "ocr", "state": "UNLOADED"})
    assert unloaded.image_task and protocol.model_metadata(unloaded)["name"] == "ocr"
    with pytest.raises(UnavailableError, match="load it first"):
        protocol.model_metadata(protocol.model_view({"name": "r", "task": "raw"}))


def test_every_error_code_has_one_http_and_one_grpc_status() -> None:
    assert set(protocol.HTTP_STATUS) == set(ErrorCode) - {ErrorCode.OK}
    assert set(protocol.GRPC_STATUS) == set(ErrorCode) - {ErrorCode.OK}
    assert protocol.HTTP_STATUS[ErrorCode.RESOURCE_EXHAUSTED] == 429


def describe(name: str, shape: list[int], datatype: str, size: int) -> dict[str, object]:
    return {"name": name, "shape": shape, "datatype": datatype,
            "parameters": {"binary_data_size": size}}  # fmt: skip


def test_binary_data_is_matched_to_inputs_in_order() -> None:
    blob = memoryview(bytes(range(20)))
    request = protocol.parse_infer_json(
        "m",
        {"id": "7", "inputs": [describe("a", [4], "UINT8", 4), describe("b", [4], "FP32", 16)],
         "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
         "parameters": {"timeout": 2_000_000}},
        blob,
    )  # fmt: skip
    assert bytes(request.inputs[0].raw or b"") == bytes(range(4))
    assert bytes(request.inputs[1].raw or b"") == bytes(range(4, 20))
    assert request.id == "7" and request.timeout_s == 2.0
    assert request.outputs is not None and request.outputs[0].binary
    with pytest.raises(InvalidArgumentError, match="past the end of the body"):
        protocol.parse_infer_json("m", {"inputs": [describe("a", [4], "UINT8", 40)]}, blob)
    with pytest.raises(InvalidArgumentError, match="no input claims"):
        protocol.parse_infer_json("m", {"inputs": [describe("a", [4], "UINT8", 4)]}, blob)
    with pytest.raises(InvalidArgumentError, match="no 'data'"):
        protocol.parse_infer_json(
            "m", {"inputs": [{"name": "a", "shape": [1], "datatype": "FP32"}]}, memoryview(b"")
        )
    with pytest.raises(InvalidArgumentError, match="'shape' must be a list of integers"):
        protocol.parse_infer_json(
            "m", {"inputs": [{"name": "a", "shape": "x", "datatype": "FP32", "data": [1]}]},
            memoryview(b""),
        )  # fmt: skip


def test_json_and_binary_tensors_become_arrays_of_their_shape() -> None:
    tensor = protocol.InputTensor("x", "FP32", (2, 2), data=[[1, 2], [3, 4]])
    np.testing.assert_array_equal(
        protocol.input_array(tensor, np.dtype(np.float32)), [[1, 2], [3, 4]]
    )
    tensor = protocol.InputTensor("x", "FP32", (3,), data=[1, 2])
    with pytest.raises(InvalidArgumentError, match="2 values in 'data'"):
        protocol.input_array(tensor, np.dtype(np.float32))
    elements = [b"one", b"", b"three"]
    raw = protocol.OutputTensor("s", "BYTES", (3,), elements=elements).raw()
    assert protocol.bytes_elements(protocol.InputTensor("s", "BYTES", (3,), raw=raw)) == elements
    with pytest.raises(InvalidArgumentError, match="cut short"):
        protocol.bytes_elements(protocol.InputTensor("s", "BYTES", (1,), raw=raw[:-1]))
    assert protocol.OutputTensor("y", "FP32", (2,), array=np.array([1.5, 2])).json_data() == [
        1.5,
        2.0,
    ]


def test_versions() -> None:
    protocol.check_version("m", None)
    protocol.check_version("m", "1")
    with pytest.raises(NotFoundError, match="no version '2'"):
        protocol.check_version("m", "2")


def test_encoded_images_are_decoded_into_the_target_in_rgb() -> None:
    bgr = cv2.imread(str(IMAGES / "coffee.png"), cv2.IMREAD_COLOR)
    out = np.zeros((*bgr.shape[:2], 3), dtype=np.uint8)
    decode_into((IMAGES / "coffee.png").read_bytes(), lambda shape: out[: shape[0], : shape[1]])
    np.testing.assert_array_equal(out, bgr[:, :, ::-1])
    gray = (IMAGES / "page.png").read_bytes()  # a grayscale PNG: H×W×1
    shapes: list[tuple[int, int, int]] = []

    def target(shape: tuple[int, int, int]) -> np.ndarray:
        shapes.append(shape)
        return np.zeros(shape, dtype=np.uint8)

    decode_into(gray, target)
    assert shapes == [(191, 384, 1)]
    with pytest.raises(InvalidArgumentError, match="not a PNG or JPEG"):
        decode_into(b"GIF89a nope", target)


@pytest.fixture
def segment() -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name="duomotest_region", create=True, size=4096)
    yield shm
    shm.close()
    shm.unlink()


def test_regions_bounds_and_names(tmp_path: Path, segment: shared_memory.SharedMemory) -> None:
    regions = Regions(tmp_path / "regions", allowed=True)
    regions.register("r", "/duomotest_region", 1024, 2048)
    segment.buf[1024 + 16 : 1024 + 20] = b"abcd"
    view = regions.view(protocol.RegionRef("r", 16, 4), 4)
    assert bytes(view) == b"abcd"
    view.release()
    assert regions.status("r") == [
        {"name": "r", "key": "duomotest_region", "offset": 1024, "byte_size": 2048}
    ]
    # a second worker sees the registration (the records are shared)
    other = Regions(tmp_path / "regions", allowed=True)
    assert bytes(other.view(protocol.RegionRef("r", 16, 4), 4)) == b"abcd"
    with pytest.raises(InvalidArgumentError, match="past its registered byte_size"):
        regions.view(protocol.RegionRef("r", 2000, 100), 100)
    with pytest.raises(InvalidArgumentError, match="needs 100 bytes"):
        regions.view(protocol.RegionRef("r", 0, 10), 100)
    with pytest.raises(InvalidArgumentError, match="less than offset"):
        regions.register("big", "duomotest_region", 0, 8192)
    for key in ("/duomo-0123", "../etc/passwd", "a/b", ""):
        with pytest.raises(InvalidArgumentError):
            regions.register("bad", key, 0, 16)
    regions.unregister("r")
    with pytest.raises(InvalidArgumentError, match="no shared-memory region"):
        other.view(protocol.RegionRef("r", 0, 4), 4)
    regions.close()
    other.close()
    with pytest.raises(UnavailableError, match="allow_shm"):
        Regions(tmp_path / "off", allowed=False).register("r", "duomotest_region", 0, 16)


def test_a_png_header_is_read_before_anything_is_decoded() -> None:
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 100, 8, 2, 0, 0, 0))
    asked: list[tuple[int, int, int]] = []
    with pytest.raises(InvalidArgumentError, match="20000×100 is outside"):
        decode_into(png + chunk(b"IEND", b""), lambda shape: asked.append(shape))  # type: ignore[func-returns-value]
    assert asked == []
