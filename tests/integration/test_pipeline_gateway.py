"""A pipeline through the KServe v2 gateway, with clients no one here wrote
(``tritonclient.http`` and ``tritonclient.grpc``): the demo's ``faces`` on a real supervisor is
described, ready and answered like a model — ``IMAGE`` as PNG or JPEG bytes or raw UINT8
[H, W, 3], ``RESULT`` the nested JSON, the same answer a producer gets through its slot."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from duomo.ipc.client import Client
from tests.conftest import IMAGES
from tests.integration.harness import SupervisorProcess, free_port, running_supervisor
from tests.integration.test_pipelines import (
    ASTRONAUT,
    MOSAIC,
    answered_in_full,
    pipelines_config,
    vector,
)


@dataclass
class Gateway:
    sup: SupervisorProcess
    http: str  # host:port
    grpc: str


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, demo_config: object) -> Iterator[Gateway]:
    http_at, grpc_at = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    folder = tmp_path_factory.mktemp("pipeline-gateway")
    config = pipelines_config(folder, gateway={"http": http_at, "grpc": grpc_at, "slots": 4})
    with running_supervisor(config) as sup:
        yield Gateway(sup, http_at, grpc_at)


def clients(gw: Gateway) -> list[tuple[Any, Any]]:
    return [
        (httpclient, httpclient.InferenceServerClient(gw.http)),
        (grpcclient, grpcclient.InferenceServerClient(gw.grpc)),
    ]


def image_input(mod: Any, data: np.ndarray | bytes) -> Any:
    if isinstance(data, bytes):
        tensor = mod.InferInput("IMAGE", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([data], dtype=np.object_))
    else:
        tensor = mod.InferInput("IMAGE", list(data.shape), "UINT8")
        tensor.set_data_from_numpy(data)
    return tensor


def result_of(response: Any) -> dict[str, Any]:
    (raw,) = response.as_numpy("RESULT")
    return dict(json.loads(raw))


def through_slot(gw: Gateway, name: str, image: np.ndarray) -> dict[str, Any]:
    with Client(gw.sup.socket, timeout_s=60) as client:
        return dict(client.model(name, slots=1).infer(image, timeout_s=60))


def same_answer(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The same faces, boxes and attributes; embeddings equal up to float rounding."""
    assert len(got["faces"]) == len(want["faces"]) > 0
    for a, b in zip(got["faces"], want["faces"]):
        assert a["box"] == pytest.approx(b["box"], abs=1e-3)
        np.testing.assert_allclose(a["landmarks"], b["landmarks"], atol=1e-3)
        assert float(vector(a) @ vector(b)) > 0.9999
        assert a["attributes"]["gender"] == b["attributes"]["gender"]
        assert a["attributes"]["age"] == pytest.approx(b["attributes"]["age"], abs=0.05)


def described(tensors: list[dict[str, Any]]) -> list[tuple[str, str, list[int]]]:
    return [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in tensors]


def test_metadata_and_readiness_of_a_pipeline(gw: Gateway) -> None:
    for mod, client in clients(gw):
        as_json = {"as_json": True} if mod is grpcclient else {}
        assert client.is_model_ready("faces") and client.is_model_ready("faces", "1")
        meta = client.get_model_metadata("faces", **as_json)
        assert meta["name"] == "faces" and meta["versions"] == ["1"]
        assert described(meta["inputs"]) == [("IMAGE", "UINT8", [-1, -1, -1])]
        assert described(meta["outputs"]) == [("RESULT", "BYTES", [1])]
        with pytest.raises(InferenceServerException, match="no model named"):
            client.get_model_metadata("facez")
    host, port = gw.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/v2/models/faces/ready")
    assert conn.getresponse().status == 200


def test_png_jpeg_and_raw_pixels_through_both_transports(gw: Gateway) -> None:
    png = (IMAGES / "astronaut.png").read_bytes()
    ok, buffer = cv2.imencode(".jpg", cv2.cvtColor(ASTRONAUT, cv2.COLOR_RGB2BGR))
    assert ok
    decoded = cv2.imdecode(buffer, cv2.IMREAD_COLOR)
    assert decoded is not None
    jpeg_pixels = cv2.cvtColor(decoded, cv2.COLOR_BGR2RGB)
    want, want_jpeg = through_slot(gw, "faces", ASTRONAUT), through_slot(gw, "faces", jpeg_pixels)
    assert answered_in_full(want, 1) and want["faces"][0]["attributes"]["gender"] == "female"
    answered = 0
    for mod, client in clients(gw):
        for data, expected in ((png, want), (ASTRONAUT, want), (buffer.tobytes(), want_jpeg)):
            got = result_of(client.infer("faces", [image_input(mod, data)]))
            assert answered_in_full(got, 1), (mod.__name__, type(data))
            same_answer(got, expected)
            answered += 1
    assert answered == 6


def test_a_failing_sub_step_is_its_sub_result_through_the_gateway(gw: Gateway) -> None:
    for mod, client in clients(gw):
        got = result_of(client.infer("faces_faulty", [image_input(mod, MOSAIC)]))
        assert len(got["faces"]) == 3, mod.__name__
        for face in got["faces"]:
            assert face["broken"] == {
                "error": {"code": "INTERNAL", "message": face["broken"]["error"]["message"]}
            }
            assert len(vector(face)) == 128 and face["marks"]["points"] == 5
            assert face["score"] > 0.5


def test_a_frame_without_a_face_and_a_bad_image(gw: Gateway) -> None:
    blank = np.zeros((120, 160, 3), np.uint8)
    for mod, client in clients(gw):
        expected = {"faces": [], "scale": 4.0}  # (640 over its 160 pixels)
        assert result_of(client.infer("faces", [image_input(mod, blank)])) == expected
        with pytest.raises(InferenceServerException) as info:
            client.infer("faces", [image_input(mod, b"not an image at all")])
        assert "image" in str(info.value).lower()


def test_a_pipeline_in_the_repository_index(gw: Gateway, tmp_path: Path) -> None:
    index = httpclient.InferenceServerClient(gw.http).get_model_repository_index()
    names = {entry["name"]: entry for entry in index}
    assert {"faces", "faces_reuse", "faces_faulty", "face_embedding"} <= set(names)
    assert names["faces"].get("state") == "READY"
