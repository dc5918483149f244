"""The seams a producer trips on (issue 26), each against a real supervisor: ``from ipc import
Client``; a producer process that exits without ``close()`` prints nothing and is cleaned up
after; a 6000×4000 frame grows the handle's ring (and is refused with numbers past the
client's ``/dev/shm`` bound); ``duomo status`` does not list its own connection.

One supervisor (classify, face, ocr) with ``limits.shm_per_client_mb`` low enough for a test
to pass it: a ring of 2 slots grown for a 72 MB frame fits under it, one of 8 does not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import pytest

from duomo import Client, InvalidArgumentError, ResourceExhaustedError, SupervisorStatus
from duomo.supervisor.config import LoadedConfig
from duomo.worker.backends.base import SessionSettings
from duomo.worker.backends.ort_backend import OrtBackend
from duomo.worker.executors.base import Executor, StageTimer
from tests.conftest import IMAGES, ROOT, fixture_image
from tests.integration.harness import (
    SupervisorProcess,
    duomo,
    poll,
    running_supervisor,
    write_config,
)

SHM_PER_CLIENT_MB = 400
BIG_W, BIG_H = 6000, 4000


def adder_model(path: Path) -> Path:
    """y = a + b, float32, every dimension open (``a`` broadcasts): a raw model whose input
    areas are as small as its config says, so growth can be watched on a few bytes."""
    import onnx
    from onnx import TensorProto, helper

    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", "n"])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", "m"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "k"])
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "adder", [a, b], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


ADDER_INPUT_BYTES = 1024  # the model's default input areas: 256 float32 values


@pytest.fixture(scope="module")
def sup(
    tmp_path_factory: pytest.TempPathFactory, demo_config: object
) -> Iterator[SupervisorProcess]:
    folder = tmp_path_factory.mktemp("seams")
    adder = {
        "name": "adder", "task": "raw", "file": str(adder_model(folder / "adder.onnx")),
        "max_batch": 1, "params": {"max_input_bytes": ADDER_INPUT_BYTES},
    }  # fmt: skip
    config = write_config(
        folder,
        ["classify", "face", "ocr"],
        extra=[adder],
        limits={"shm_per_client_mb": SHM_PER_CLIENT_MB},
    )
    with running_supervisor(config) as running:
        yield running


def status(sup: SupervisorProcess) -> SupervisorStatus:
    with Client(sup.socket) as client:
        return client.status()


def alone(sup: SupervisorProcess) -> bool:
    """No client holds a ring and every ring is unmapped (the asker is not listed)."""
    shown = status(sup)
    return shown.clients == () and shown.mapped_rings == 0 and shown.shm_bytes == 0


def through_jpeg(rgb: np.ndarray) -> np.ndarray:
    """``rgb`` encoded as a JPEG and decoded again, as a producer reading a photo has it."""
    ok, data = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    assert ok
    return cv2.cvtColor(cv2.imdecode(data, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)


def big(image: np.ndarray, side: int, left: int = 0, fill: int = 127) -> np.ndarray:
    """A 6000×4000 RGB JPEG frame with ``image`` scaled to ``side`` pixels wide at ``left``."""
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    h, w = image.shape[:2]
    scaled = cv2.resize(image, (side, round(h * side / w)), interpolation=cv2.INTER_CUBIC)
    frame = np.full((BIG_H, BIG_W, 3), fill, dtype=np.uint8)
    frame[: scaled.shape[0], left : left + side] = scaled[:BIG_H]
    return through_jpeg(frame)


# -- 1. the documented import ---------------------------------------------------------------

LIGHT_IMPORT = """
import sys
import duomo.ipc.errors
assert "duomo.ipc.client" not in sys.modules  # the errors alone do not load the client library
from duomo import Client, ModelHandle, ResourceExhaustedError, Slot
import duomo.ipc.client as client
assert (Client, ModelHandle, Slot) == (client.Client, client.ModelHandle, client.Slot)
heavy = ("cv2", "onnxruntime", "acl", "duomo.supervisor", "duomo.worker", "pydantic", "structlog",
         "psutil")
print(sorted(m for m in heavy if m in sys.modules))
"""


def test_a_producer_imports_the_client_from_ipc_alone() -> None:
    run = subprocess.run(
        [sys.executable, "-c", LIGHT_IMPORT], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


# -- 2. a producer that exits without close() ----------------------------------------------

# Each way a producer keeps views into its slots: a handle in a function's frame (collected at
# exit by the garbage collector, finalisers first), a zero-copy slot whose input view outlives
# it, an async request (its reader thread keeps the client alive to the end). The
# SharedMemory finaliser printed a BufferError for the first two.
PRODUCER_WITHOUT_CLOSE = """
import sys
import cv2
from duomo import Client

def main() -> int:
    socket_path, image_path, how = sys.argv[1:]
    image = cv2.cvtColor(cv2.imread(image_path), cv2.COLOR_BGR2RGB)
    client = Client(socket_path, timeout_s=60)
    classify = client.model("classify", slots=2)
    if how == "infer":
        print(classify.infer(image)["top"][0]["label"], flush=True)
    elif how == "infer_async":
        print(classify.infer_async(image).result(60)["top"][0]["label"], flush=True)
    else:
        global kept
        with classify.slot() as slot:
            kept = slot.input("image", image.shape)
            kept[...] = image
            slot.submit()
            print(slot.wait()["top"][0]["label"], flush=True)
    return 0  # no client.close()

sys.exit(main())
"""


@pytest.mark.parametrize("how", ["infer", "zero_copy", "infer_async"])
def test_a_producer_that_exits_without_close_prints_nothing(
    sup: SupervisorProcess, how: str
) -> None:
    coffee = fixture_image("coffee.png")
    with Client(sup.socket) as other:
        bystander = other.model("classify", slots=1)
        run = subprocess.run(
            [sys.executable, "-c", PRODUCER_WITHOUT_CLOSE, str(sup.socket),
             str(IMAGES / "coffee.png"), how],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert run.stderr == ""  # no BufferError, no resource-tracker warning, nothing
        assert run.stdout.split() == ["espresso"]
        # its rings are reclaimed; the other client is served meanwhile and after
        assert bystander.infer(coffee)["top"][0]["label"] == "espresso"

        def reclaimed() -> bool:
            shown = other.status()
            pids = [c.pid for c in shown.clients]
            return pids == [os.getpid()] and shown.mapped_rings == 1

        poll(reclaimed)
        assert bystander.infer(coffee)["top"][0]["label"] == "espresso"
    poll(lambda: alone(sup))


# -- 3. images of any size ------------------------------------------------------------------


def test_a_6000x4000_image_grows_the_ring_and_small_ones_still_work(
    sup: SupervisorProcess,
) -> None:
    coffee, astronaut = fixture_image("coffee.png"), fixture_image("astronaut.png")
    big_coffee = big(coffee, BIG_W)  # 10× the fixture
    big_astronaut = big(astronaut, 4000, left=1000)  # 7.8125× the fixture, 1000 px in
    assert big_coffee.shape == (BIG_H, BIG_W, 3) and big_coffee.nbytes == 72_000_000
    with Client(sup.socket, timeout_s=60) as client:
        classify = client.model("classify", slots=2)
        face = client.model("face", slots=1)
        default_area = classify.layout.inputs[0].capacity
        assert default_area < big_coffee.nbytes  # what used to be refused
        [small_face] = face.infer(astronaut)["faces"]

        assert classify.infer(big_coffee)["top"][0]["label"] == "espresso"
        [big_face] = face.infer(big_astronaut)["faces"]
        assert big_face["score"] > 0.8
        expected = np.array(small_face["box"]) * 4000 / 512 + [1000, 0, 1000, 0]
        np.testing.assert_allclose(big_face["box"], expected, atol=0.015 * BIG_H)
        assert classify.layout.inputs[0].capacity >= big_coffee.nbytes

        # later small requests, on the grown rings
        assert classify.infer(coffee)["top"][0]["label"] == "espresso"
        [again] = face.infer(astronaut)["faces"]
        np.testing.assert_allclose(again["box"], small_face["box"], atol=1e-3)
        futures = [classify.infer_async(coffee) for _ in range(4)]
        assert [f.result(60)["top"][0]["label"] for f in futures] == ["espresso"] * 4

        # the default rings were detached once their slots were back; the grown areas are
        # charged in full (3 slots of ≥ 72 MB)
        def settled() -> bool:
            [mine] = [c for c in client.status().clients if c.pid == os.getpid()]
            return len(mine.rings) == 2 and mine.shm_bytes >= 3 * big_coffee.nbytes

        poll(settled)
    poll(lambda: alone(sup))


def test_ocr_reads_a_6000x4000_page(sup: SupervisorProcess) -> None:
    page = big(fixture_image("page.png"), 5760, fill=255)  # 15× the fixture
    with Client(sup.socket, timeout_s=120) as client:
        lines = client.model("ocr", slots=1).infer(page)["lines"]
    assert lines[0]["text"] == "Region-based segmentation"
    assert lines[0]["box"][2][0] > 4000  # in the frame's pixels, not the detector's


def test_growth_carries_what_the_slot_holds_and_lets_requests_in_flight_finish(
    sup: SupervisorProcess,
) -> None:
    """Zero-copy: ``a`` written, then ``b`` too large for its area: the slot moves to a grown
    ring with ``a`` in it; requests in flight on the old ring are answered there, and the old
    ring is detached once they are back."""
    wide = np.arange(1024, dtype=np.float32).reshape(1, 1024)  # 4 KiB: past the 1 KiB area
    one = {"a": np.ones((1, 8), np.float32), "b": np.full((1, 8), 2.0, np.float32)}
    with Client(sup.socket) as client:
        adder = client.model("adder", slots=3)
        first_ring = adder.ring_id
        in_flight = [adder.infer_async(one) for _ in range(2)]
        with adder.slot() as slot:
            slot.input("a", (1, 1))[...] = 5.0
            slot.input("b", wide.shape)[...] = wide  # grows the ring; the slot moves
            assert adder.ring_id != first_ring and slot.ring_id == adder.ring_id
            slot.submit()
            np.testing.assert_array_equal(slot.wait()["y"], wide + 5.0)
        for future in in_flight:
            np.testing.assert_array_equal(future.result(30)["y"], np.full((1, 8), 3.0))
        np.testing.assert_array_equal(adder.infer({"a": wide, "b": wide})["y"], 2 * wide)
        np.testing.assert_array_equal(adder.infer(one)["y"], np.full((1, 8), 3.0))
        assert adder.layout.inputs[1].capacity >= wide.nbytes

        def one_ring() -> bool:
            [mine] = [c for c in client.status().clients if c.pid == os.getpid()]
            return [r.ring for r in mine.rings] == [adder.ring_id]

        poll(one_ring)
    poll(lambda: alone(sup))


@pytest.fixture(scope="module")
def executors(demo_config: LoadedConfig) -> Iterator[dict[str, Executor]]:
    """The demo's vision executors on their real sessions, in this process."""
    backend = OrtBackend(demo_config.config.backends.onnxruntime)
    opened: dict[str, Executor] = {}
    for name in ("classify", "face", "ocr"):
        model = demo_config.models[name]
        sessions = {
            role: backend.open(path, SessionSettings(intra_op_threads=1))
            for role, path in model.files.items()
        }
        opened[name] = model.executor(model.params, sessions, 1)
    yield opened
    for executor in opened.values():
        executor.close()


FIXTURE_FOR = {"classify": "coffee.png", "face": "astronaut.png", "ocr": "page.png"}


@pytest.mark.parametrize("channels", [1, 4])
@pytest.mark.parametrize("name", ["classify", "face", "ocr"])
def test_a_large_gray_or_rgba_frame_is_never_copied_whole(
    executors: dict[str, Executor], name: str, channels: int
) -> None:
    """A 6000×4000 gray or RGBA frame is read where it lies (a slot, when served) and made RGB
    only once resized: the answer is the one its RGB twin gets, without a 72 MB copy."""
    executor = executors[name]
    rgb = big(fixture_image(FIXTURE_FOR[name]), 4000, left=1000, fill=255)
    if channels == 1:
        frame = np.ascontiguousarray(rgb[:, :, 1])
        rgb = np.repeat(frame[:, :, None], 3, axis=2)
    else:
        frame = np.dstack([rgb, np.full(rgb.shape[:2], 255, dtype=np.uint8)])
    expected = executor.execute([executor.prepare(rgb)], StageTimer())
    executor.execute([executor.prepare(frame)], StageTimer())  # (its buffers grown, and kept)
    tracemalloc.start()
    try:
        prepared = executor.prepare(frame)
        got = executor.execute([prepared], StageTimer())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.shares_memory(prepared.image, frame)
    assert got == expected
    assert peak < rgb.nbytes // 2, f"{peak} bytes allocated at the peak"  # (RGB: 72 MB)


def test_growth_past_the_clients_shm_bound_is_refused_with_numbers(
    sup: SupervisorProcess,
) -> None:
    coffee = fixture_image("coffee.png")
    big_coffee = big(coffee, BIG_W)
    with Client(sup.socket, timeout_s=60) as client:
        classify = client.model("classify", slots=8)  # 8 × 72 MB is past 400 MiB
        with pytest.raises(ResourceExhaustedError) as refused:
            classify.infer(big_coffee)
        message = refused.value.message
        assert "'image' of 72000000 bytes" in message and "8 slot(s)" in message
        assert f"at most {SHM_PER_CLIENT_MB}.0 MiB" in message
        assert "limits.shm_per_client_mb" in message
        # nothing was charged for it, and the handle serves on its default ring
        assert classify.layout.inputs[0].capacity < big_coffee.nbytes
        assert classify.infer(coffee)["top"][0]["label"] == "espresso"
        [mine] = [c for c in client.status().clients if c.pid == os.getpid()]
        assert mine.shm_bytes < 16 << 20 and len(mine.rings) == 1
        # a handle with fewer slots grows within the bound
        assert client.model("classify", slots=2).infer(big_coffee)["top"][0]["label"] == "espresso"
    poll(lambda: alone(sup))


def test_a_frame_past_the_side_bound_is_refused_before_the_ring_grows(
    sup: SupervisorProcess,
) -> None:
    """Issue 42: a frame larger than 16384 pixels a side asked the supervisor for a larger
    ring, and was refused RESOURCE_EXHAUSTED (retry) for a request that can never succeed; the
    handle checks the model's bound first (INVALID_ARGUMENT naming it) and reserves nothing."""
    with Client(sup.socket, timeout_s=60) as client:
        classify = client.model("classify", slots=2)
        ring_id = classify.ring_id
        for shape in ((20000, 20000, 3), (100000, 100000, 3), (16385, 1, 3), (16385, 1)):
            with classify.slot() as slot, pytest.raises(InvalidArgumentError) as refused:
                slot.input("image", shape)
            assert "at most [16384, 16384, 4]" in refused.value.message
            with pytest.raises(InvalidArgumentError, match=r"at most \[16384, 16384, 4\]"):
                classify.check_input("image", shape if len(shape) == 3 else (*shape, 1))
        assert classify.ring_id == ring_id  # no ring was asked for
        assert classify.infer(fixture_image("coffee.png"))["top"][0]["label"] == "espresso"
        [mine] = [c for c in client.status().clients if c.pid == os.getpid()]
        assert mine.shm_bytes < 16 << 20 and len(mine.rings) == 1
    poll(lambda: alone(sup))


# -- 4. duomo status ------------------------------------------------------------------------


def test_duomo_status_does_not_list_itself(sup: SupervisorProcess) -> None:
    poll(lambda: alone(sup))
    shown = json.loads(duomo(sup.socket, "status", "--json").stdout)
    assert shown["clients"] == []
    assert "clients 0 of" in duomo(sup.socket, "status").stdout
    with Client(sup.socket) as producer:
        producer.model("classify", slots=1)
        shown = json.loads(duomo(sup.socket, "status", "--json").stdout)
        assert [c["pid"] for c in shown["clients"]] == [os.getpid()]
        text = duomo(sup.socket, "status").stdout
        assert "clients 1 of" in text
        listed = [line for line in text.splitlines() if line.startswith("client ")]
        assert len(listed) == 1 and f"(pid {os.getpid()}): classify×1" in listed[0]
        # a producer that asks sees its own rings
        assert [len(c.rings) for c in producer.status().clients] == [1]
