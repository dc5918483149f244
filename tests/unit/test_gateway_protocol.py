"""The gateway's pieces without processes: the wire contract, request parsing, BYTES tensors,
the error mapping, encoded images and shared-memory regions."""

from __future__ import annotations

import contextlib
import os
import struct
import time
from multiprocessing import shared_memory
from pathlib import Path

import cv2
import numpy as np
import pytest

from duomo.gateway import protocol
from duomo.gateway.images import decode_into
from duomo.gateway.regions import Regions
from duomo.gateway.streams import StreamRequest
from duomo.ipc.errors import ErrorCode, InvalidArgumentError, NotFoundError, UnavailableError
from duomo.ipc.status_records import ModelInfo
from tests.conftest import IMAGES

RAW_INFO = ModelInfo.from_dict({
    "name": "affine", "task": "raw", "backend": "onnxruntime", "state": "READY", "max_batch": 4,
    "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 4]}], "result": "tensors",
    "outputs": ["y"], "output_tensors": [{"name": "y", "dtype": "float32", "shape": [None, 4]}],
    "batched": True,
})  # fmt: skip
IMAGE_INFO = ModelInfo.from_dict({
    "name": "classify", "task": "classification", "backend": "acl", "state": "READY",
    "max_batch": 8, "inputs": [{"name": "image", "dtype": "uint8", "shape": [None, None, None]}],
    "result": "json", "outputs": [], "output_tensors": [], "batched": False,
})  # fmt: skip


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
    unloaded = protocol.model_view(ModelInfo("ocr", "ocr", "onnxruntime", "UNLOADED", 1))
    assert unloaded.image_task and protocol.model_metadata(unloaded)["name"] == "ocr"
    with pytest.raises(UnavailableError, match="load it first"):
        protocol.model_metadata(protocol.model_view(ModelInfo("r", "raw", None, "UNLOADED", 1)))


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


def stream_of(**parameters: object) -> StreamRequest | None:
    header = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
              "parameters": parameters}  # fmt: skip
    return protocol.parse_infer_json("m", header, memoryview(b"")).stream


def test_a_stream_in_the_parameters() -> None:
    assert stream_of() is None and stream_of(priority=0) is None  # a plain request
    before_us = time.monotonic() * 1e6
    plain = stream_of(stream="gate-3")
    assert plain is not None and (plain.name, plain.frame, plain.policy) == (
        "gate-3",
        None,
        "latest",
    )
    assert before_us <= plain.captured_us <= time.monotonic() * 1e6  # arrival, when not given
    # captured_us is µs of the UNIX epoch: 250 ms ago there is 250 ms ago on the monotonic clock
    ago = stream_of(stream="s", frame=9, stream_policy="fifo",
                    captured_us=int(time.time() * 1e6) - 250_000)  # fmt: skip
    assert ago is not None and (ago.frame, ago.policy) == (9, "fifo")
    age_s = time.monotonic() - ago.captured_us / 1e6
    assert 0.25 <= age_s < 0.25 + 0.5
    # never in the future, never before the monotonic clock's zero
    ahead = stream_of(stream="s", captured_us=int(time.time() * 1e6) + 10_000_000)
    assert ahead is not None and ahead.captured_us <= time.monotonic() * 1e6
    ancient = stream_of(stream="s", captured_us=0)
    assert ancient is not None and ancient.captured_us == 0
    assert stream_of(stream="c" * 64, frame=2**64 - 1) is not None


@pytest.mark.parametrize(
    ("parameters", "named"),
    [
        ({"stream": "c" * 65}, "'stream' must be a string of 1..64"),
        ({"stream": ""}, "'stream' must be a string"),
        ({"stream": "tab\there"}, "'stream' must be a string of 1..64 printable"),
        ({"stream": 7}, "'stream' must be a string"),
        ({"stream": "s", "frame": -1}, "'frame' must be an integer"),
        ({"stream": "s", "frame": 2**64}, "'frame' must be an integer"),
        ({"stream": "s", "frame": 1.0}, "'frame' must be an integer"),
        ({"stream": "s", "frame": True}, "'frame' must be an integer"),
        ({"stream": "s", "captured_us": True}, "'captured_us' must be an integer"),
        ({"stream": "s", "captured_us": 1.7e15}, "'captured_us' must be an integer"),
        ({"stream": "s", "captured_us": "now"}, "'captured_us' must be an integer"),
        ({"stream": "s", "stream_policy": "newest"}, "'stream_policy' must be one of"),
        ({"stream": "s", "stream_policy": None}, "'stream_policy' must be one of"),
        ({"frame": 3}, "'frame' needs a 'stream'"),
        ({"stream_policy": "fifo"}, "'stream_policy' needs a 'stream'"),
    ],
)
def test_bad_stream_parameters_name_themselves(parameters: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        stream_of(**parameters)


def test_a_superseded_frame_is_its_own_status_on_both_transports() -> None:
    assert protocol.HTTP_STATUS[ErrorCode.SUPERSEDED] == 409
    assert protocol.GRPC_STATUS[ErrorCode.SUPERSEDED] == "ABORTED"


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


# this process's own names in /dev/shm (never fixed ones: another run of the suite on the host,
# or another worker of this one, makes its own)
SHM = Path("/dev/shm")
REGION, LINK, FIFO, SYMLINK = (
    f"duomotest_{what}_{os.getpid()}" for what in ("region", "link", "fifo", "symlink")
)


@pytest.fixture
def segment() -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=REGION, create=True, size=4096)
    yield shm
    shm.close()
    shm.unlink()


def test_regions_bounds_and_names(tmp_path: Path, segment: shared_memory.SharedMemory) -> None:
    regions = Regions(tmp_path / "regions", allowed=True)
    regions.register("r", f"/{REGION}", 1024, 2048)
    segment.buf[1024 + 16 : 1024 + 20] = b"abcd"
    assert regions.span(protocol.RegionRef("r", 16, 4), 4).read() == b"abcd"
    assert regions.status("r") == [{"name": "r", "key": REGION, "offset": 1024, "byte_size": 2048}]
    # a second worker sees the registration (the records are shared)
    other = Regions(tmp_path / "regions", allowed=True)
    assert other.span(protocol.RegionRef("r", 16, 4), 4).read() == b"abcd"
    other.span(protocol.RegionRef("r", 20, 4), 4).write(memoryview(b"wxyz"))
    assert bytes(segment.buf[1024 + 20 : 1024 + 24]) == b"wxyz"
    with pytest.raises(InvalidArgumentError, match="past its registered byte_size"):
        regions.span(protocol.RegionRef("r", 2000, 100), 100)
    with pytest.raises(InvalidArgumentError, match="needs 100 bytes"):
        regions.span(protocol.RegionRef("r", 0, 10), 100)
    with pytest.raises(InvalidArgumentError, match="less than offset"):
        regions.register("big", REGION, 0, 8192)
    with pytest.raises(InvalidArgumentError, match="already registered"):
        other.register("r", REGION, 0, 16)
    for key in ("/duomo-0123", "../etc/passwd", "a/b", ""):
        with pytest.raises(InvalidArgumentError):
            regions.register("bad", key, 0, 16)
    regions.unregister("r")
    with pytest.raises(InvalidArgumentError, match="no shared-memory region"):
        other.span(protocol.RegionRef("r", 0, 4), 4)
    regions.close()
    other.close()
    with pytest.raises(UnavailableError, match="allow_shm"):
        Regions(tmp_path / "off", allowed=False).register("r", REGION, 0, 16)


def held_segments(key: str) -> list[str]:
    """This process's descriptors open on /dev/shm/``key``."""
    fds = Path("/proc/self/fd")
    found = []
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd).startswith(f"/dev/shm/{key}"):
                found.append(fd.name)
    return found


def test_a_shrunk_region_is_refused_not_faulted(
    tmp_path: Path, segment: shared_memory.SharedMemory
) -> None:
    """Reads and writes go through the descriptor, checked against the size now: a segment
    truncated after registration is INVALID_ARGUMENT (a mapping would have been SIGBUS)."""
    regions = Regions(tmp_path / "regions", allowed=True)
    regions.register("r", REGION, 0, 4096)
    fd = os.open(f"/dev/shm/{REGION}", os.O_RDWR)
    try:
        os.ftruncate(fd, 100)
        with pytest.raises(InvalidArgumentError, match="holds 100 bytes now"):
            regions.span(protocol.RegionRef("r", 0, 4096), 4096)
        with pytest.raises(InvalidArgumentError, match="holds 100 bytes now"):
            regions.span(protocol.RegionRef("r", 96, 8), 8)
        assert regions.span(protocol.RegionRef("r", 96, 4), 4).read() == bytes(4)
        span = regions.span(protocol.RegionRef("r", 0, 64), 64)
        os.ftruncate(fd, 10)  # shrunk between the check and the read
        with pytest.raises(InvalidArgumentError, match="became smaller"):
            span.read()
        os.ftruncate(fd, 4096)
    finally:
        os.close(fd)
    regions.close()


def test_what_a_region_is_not(tmp_path: Path, segment: shared_memory.SharedMemory) -> None:
    """The descriptor decides: a hard link to a segment, a FIFO or a symbolic link in /dev/shm
    are refused whatever their name; a registered segment that is unlinked or replaced stops
    being served, and its descriptor is closed."""
    regions = Regions(tmp_path / "regions", allowed=True)
    link = SHM / LINK
    fifo = SHM / FIFO
    symlink = SHM / SYMLINK
    mine = len(held_segments(REGION))  # (the fixture's own: its fd and its mapping's)
    try:
        os.link(f"/dev/shm/{REGION}", link)
        with pytest.raises(InvalidArgumentError, match="2 names"):
            regions.register("linked", LINK, 0, 16)
        with pytest.raises(InvalidArgumentError, match="2 names"):
            regions.register("original", REGION, 0, 16)
        link.unlink()
        os.mkfifo(fifo)
        with pytest.raises(InvalidArgumentError, match="not a regular file"):
            regions.register("fifo", FIFO, 0, 16)
        symlink.symlink_to(f"/dev/shm/{REGION}")
        with pytest.raises(InvalidArgumentError, match="cannot open"):
            regions.register("symlink", SYMLINK, 0, 16)
        regions.register("r", REGION, 0, 16)
        other = Regions(tmp_path / "regions", allowed=True)
        other.span(protocol.RegionRef("r", 0, 4), 4)
        assert len(held_segments(REGION)) == mine + 2  # one per "worker"
        os.link(f"/dev/shm/{REGION}", link)  # a second name later: refused at use
        with pytest.raises(InvalidArgumentError, match="no longer names"):
            other.span(protocol.RegionRef("r", 0, 4), 4)
        assert len(held_segments(REGION)) == mine + 1  # (it closed its own)
        link.unlink()
        other.span(protocol.RegionRef("r", 0, 4), 4)  # one name again: served again
        regions.unregister("r")
        assert len(held_segments(REGION)) == mine + 1  # the other's, until a sweep
        other.sweep()
        assert len(held_segments(REGION)) == mine
        other.close()
    finally:
        for path in (link, fifo, symlink):
            path.unlink(missing_ok=True)
        regions.close()


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
