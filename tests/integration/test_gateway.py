"""The KServe v2 gateway against clients no one here wrote (``tritonclient.http`` and
``tritonclient.grpc``), on a real supervisor with the demo models, and against hostile input.

Every answer through the gateway is compared with the answer the same supervisor gives a
producer through ``ipc.Client``: the gateway must change nothing but the transport.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
import yaml
from tritonclient.utils import InferenceServerException

from duomo.ipc.client import Client
from duomo.supervisor.operators.image_files import read_image
from tests.conftest import IMAGES, ROOT
from tests.integration.harness import (
    SupervisorProcess,
    affine_model,
    free_port,
    poll,
    running_supervisor,
    write_config,
)

IMAGE_MODELS = {"classify": ["coffee.png", "chelsea.png", "astronaut.png", "page.png"],
                "face": ["astronaut.png", "coffee.png", "chelsea.png", "page.png"],
                "ocr": ["page.png"]}  # fmt: skip
SLOTS = 4


@dataclass
class Gateway:
    sup: SupervisorProcess
    http: str  # host:port
    grpc: str

    @property
    def http_port(self) -> int:
        return int(self.http.rsplit(":", 1)[1])


def gateway_config(folder: Path, models: list[str], **section: object) -> tuple[Path, str, str]:
    affine_model(folder / "affine.onnx")
    affine = {"name": "affine", "task": "raw", "file": str(folder / "affine.onnx"), "max_batch": 4}
    http_at, grpc_at = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    gateway = {"http": http_at, "grpc": grpc_at, **section}
    return write_config(folder, models, extra=[affine], gateway=gateway), http_at, grpc_at


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, demo_config: object) -> Iterator[Gateway]:
    config, http_at, grpc_at = gateway_config(
        tmp_path_factory.mktemp("gateway"), ["ocr", "face", "classify"],
        slots=SLOTS, allow_shm=True, max_body_mb=32, header_timeout_s=1.0, idle_timeout_s=3.0,
    )  # fmt: skip
    with running_supervisor(config) as sup:
        yield Gateway(sup, http_at, grpc_at)


def clients(gw: Gateway) -> list[tuple[Any, Any]]:
    """(module, client) for both transports."""
    return [
        (httpclient, httpclient.InferenceServerClient(gw.http)),
        (grpcclient, grpcclient.InferenceServerClient(gw.grpc)),
    ]


def reference(gw: Gateway, model: str, image: np.ndarray) -> dict[str, Any]:
    with Client(gw.sup.socket, timeout_s=60) as client:
        return dict(client.model(model, slots=1).infer(image, timeout_s=60))


def image_input(mod: Any, data: np.ndarray | bytes) -> Any:
    if isinstance(data, bytes):
        tensor = mod.InferInput("IMAGE", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([data], dtype=np.object_))
    else:
        pixels = data[:, :, None] if data.ndim == 2 else data  # (gray travels as H×W×1)
        tensor = mod.InferInput("IMAGE", list(pixels.shape), "UINT8")
        tensor.set_data_from_numpy(pixels)
    return tensor


def result_of(response: Any) -> dict[str, Any]:
    return dict(json.loads(response.as_numpy("RESULT")[0]))


# -- what works ---------------------------------------------------------------------------------


def described(tensors: list[dict[str, Any]]) -> list[tuple[str, str, list[int]]]:
    """(name, datatype, shape) of metadata tensors (gRPC's JSON writes int64 as strings)."""
    return [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in tensors]


def test_metadata_config_and_readiness(gw: Gateway) -> None:
    for mod, client in clients(gw):
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("classify") and client.is_model_ready("affine", "1")
        as_json = {"as_json": True} if mod is grpcclient else {}
        meta = client.get_model_metadata("classify", **as_json)
        config = client.get_model_config("affine", **as_json)
        server = client.get_server_metadata(**as_json)
        config = config.get("config", config)
        assert meta["platform"] == "onnxruntime_onnx" and meta["versions"] == ["1"]
        assert described(meta["inputs"]) == [("IMAGE", "UINT8", [-1, -1, -1])]
        assert described(meta["outputs"]) == [("RESULT", "BYTES", [1])]
        assert int(config["max_batch_size"]) == 4 and "dynamic_batching" in config
        assert [
            (t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config["input"]
        ] == [("x", "TYPE_FP32", [4])]
        assert "statistics" in server["extensions"] and "binary_tensor_data" in server["extensions"]
        with pytest.raises(InferenceServerException, match="no model named"):
            client.get_model_metadata("nope")
        with pytest.raises(InferenceServerException, match="no version"):
            client.get_model_metadata("classify", "7")
    image_config = httpclient.InferenceServerClient(gw.http).get_model_config("classify")
    assert image_config["max_batch_size"] == 0
    assert image_config["input"][0]["dims"] == [-1, -1, -1]


def test_every_fixture_image_through_both_transports_as_pixels_png_and_jpeg(gw: Gateway) -> None:
    for model, names in IMAGE_MODELS.items():
        for name in names:
            pixels = read_image(IMAGES / name)
            png = (IMAGES / name).read_bytes()
            ok, jpeg_buffer = cv2.imencode(".jpg", cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR))
            assert ok
            jpeg = jpeg_buffer.tobytes()
            jpeg_pixels = cv2.cvtColor(
                cv2.imdecode(jpeg_buffer, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB
            )
            expected = reference(gw, model, pixels)
            expected_jpeg = reference(gw, model, jpeg_pixels)
            for mod, client in clients(gw):
                for data, want in ((pixels, expected), (png, expected), (jpeg, expected_jpeg)):
                    answer = client.infer(model, [image_input(mod, data)])
                    assert result_of(answer) == want, (model, name, mod.__name__, type(data))
    assert IMAGE_MODELS["classify"][0] == "coffee.png" and expected  # (the loop ran)


def test_a_raw_model_with_json_and_binary_tensors(gw: Gateway) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for mod, client in clients(gw):
        for binary in (True, False):
            tensor = mod.InferInput("x", [3, 4], "FP32")
            if mod is httpclient:
                tensor.set_data_from_numpy(x, binary_data=binary)
                outputs = [mod.InferRequestedOutput(n, binary_data=binary) for n in ("y", "s")]
            else:
                tensor.set_data_from_numpy(x)
                outputs = [mod.InferRequestedOutput(n) for n in ("y", "s")]
            answer = client.infer("affine", [tensor], outputs=outputs, request_id="r-7")
            np.testing.assert_array_equal(answer.as_numpy("y"), 2 * x + 1)
            np.testing.assert_array_equal(answer.as_numpy("s"), x.sum(axis=1, keepdims=True))
            response = answer.get_response()
            assert (response["id"] if mod is httpclient else response.id) == "r-7"


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_system_shared_memory_in_and_out(gw: Gateway, transport: str) -> None:
    mod = httpclient if transport == "http" else grpcclient
    client = mod.InferenceServerClient(gw.http if transport == "http" else gw.grpc)
    image = read_image(IMAGES / "coffee.png")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    key = f"/duomo_test_{transport}"
    size = image.nbytes + x.nbytes + 64
    region = shm.create_shared_memory_region(f"in-{transport}", key, size)
    out = shm.create_shared_memory_region(f"out-{transport}", key + "_out", 4096)
    try:
        shm.set_shared_memory_region(region, [image])
        shm.set_shared_memory_region(region, [x], offset=image.nbytes)
        client.register_system_shared_memory(f"in-{transport}", key, size)
        client.register_system_shared_memory(f"out-{transport}", key + "_out", 4096)
        status = client.get_system_shared_memory_status(
            **({"as_json": True} if mod is grpcclient else {})
        )
        assert f"in-{transport}" in json.dumps(status)
        tensor = mod.InferInput("IMAGE", list(image.shape), "UINT8")
        tensor.set_shared_memory(f"in-{transport}", image.nbytes)
        answer = client.infer("classify", [tensor])
        assert result_of(answer) == reference(gw, "classify", image)
        tensor = mod.InferInput("x", [2, 4], "FP32")
        tensor.set_shared_memory(f"in-{transport}", x.nbytes, offset=image.nbytes)
        wanted = mod.InferRequestedOutput("y")
        wanted.set_shared_memory(f"out-{transport}", x.nbytes)
        client.infer("affine", [tensor], outputs=[wanted])
        got = shm.get_contents_as_numpy(out, np.float32, [2, 4])
        np.testing.assert_array_equal(got, 2 * x + 1)
        # a region part past its registered size, and one never registered
        tensor = mod.InferInput("x", [2, 4], "FP32")
        tensor.set_shared_memory(f"in-{transport}", x.nbytes, offset=size - 8)
        with pytest.raises(InferenceServerException, match="past its registered byte_size"):
            client.infer("affine", [tensor])
        tensor.set_shared_memory("never-registered", x.nbytes)
        with pytest.raises(InferenceServerException, match="no shared-memory region"):
            client.infer("affine", [tensor])
        with pytest.raises(InferenceServerException, match="one of Duomo's own"):
            client.register_system_shared_memory("mine", "/duomo-abc", 64)
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(region)
        shm.destroy_shared_memory_region(out)


def test_statistics_and_the_repository(gw: Gateway) -> None:
    http_client = httpclient.InferenceServerClient(gw.http)
    grpc_client = grpcclient.InferenceServerClient(gw.grpc)
    tensor = httpclient.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    http_client.infer("affine", [tensor])
    stats = http_client.get_inference_statistics("affine")["model_stats"][0]
    assert stats["name"] == "affine" and stats["version"] == "1"
    assert stats["inference_stats"]["success"]["count"] >= 1
    assert stats["inference_stats"]["compute_infer"]["ns"] > 0
    grpc_stats = grpc_client.get_inference_statistics("affine").model_stats[0]
    assert grpc_stats.inference_stats.success.count >= stats["inference_stats"]["success"]["count"]
    index = {m["name"]: m["state"] for m in http_client.get_model_repository_index()}
    assert index == {"ocr": "READY", "face": "READY", "classify": "READY", "affine": "READY"}
    http_client.unload_model("affine")
    assert not http_client.is_model_ready("affine")
    states = {m.name: m.state for m in grpc_client.get_model_repository_index().models}
    assert states["affine"] == "UNLOADED"
    grpc_client.load_model("affine")
    assert grpc_client.is_model_ready("affine")
    assert http_client.infer("affine", [tensor]).as_numpy("y")[0, 0] == 3.0


# -- hostile input: each a clear 4xx (or gRPC status), and everyone else still served -----------


def post(
    gw: Gateway, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        return response.status, (json.loads(data) if data else {})
    finally:
        conn.close()


def binary_request(
    inputs: list[dict[str, Any]], blob: bytes, header_length: int | None = None
) -> tuple[bytes, dict[str, str]]:
    header = json.dumps({"inputs": inputs}).encode()
    length = len(header) if header_length is None else header_length
    return header + blob, {"Inference-Header-Content-Length": str(length),
                           "Content-Type": "application/octet-stream"}  # fmt: skip


def giant_png(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width``×``height`` (its data is a few bytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def still_served(gw: Gateway) -> None:
    client = httpclient.InferenceServerClient(gw.http)
    answer = client.infer("classify", [image_input(httpclient, read_image(IMAGES / "coffee.png"))])
    assert result_of(answer)["top"][0]["label"] == "espresso"


def one_input(
    name: str, shape: list[int], datatype: str, data: bytes, header_length: int | None = None
) -> tuple[bytes, dict[str, str]]:
    """A binary request whose one input says it is ``shape`` × ``datatype`` and is ``data``
    (``header_length``: what Inference-Header-Content-Length says instead of the truth)."""
    described = {"name": name, "shape": shape, "datatype": datatype,
                 "parameters": {"binary_data_size": len(data)}}  # fmt: skip
    return binary_request([described], data, header_length)


def test_bad_requests_get_clear_errors(gw: Gateway) -> None:
    pixels = bytes(48)  # 4 × 4 × 3
    cases = [
        ("classify", (b"{not json", {}), 400, "not valid"),
        (
            "classify",
            one_input("IMAGE", [4, 4, 3], "UINT8", pixels, 10**6),
            400,
            "Inference-Header",
        ),
        ("classify", one_input("IMAGE", [4, 4, 3], "UINT8", pixels[:40]), 400, "takes 48"),
        ("classify", one_input("IMAGE", [4, 4, 3], "FP32", pixels), 400, "must be UINT8"),
        ("classify", one_input("IMAGE", [48], "UINT8", pixels), 400, "[H, W, C]"),
        ("classify", one_input("IMAGE", [0, 0, 3], "UINT8", b""), 400, "H, W ≥ 1"),
        ("affine", one_input("x", [2, 4, 1], "FP32", bytes(32)), 400, "expected [-1, 4]"),
        ("affine", one_input("x", [2, 4], "INT64", bytes(64)), 400, "must be FP32"),
        ("nope", one_input("x", [1], "FP32", bytes(4)), 404, "no model named"),
    ]
    for model, (body, headers), status, message in cases:
        got, reply = post(gw, f"/v2/models/{model}/infer", body, headers)
        assert (got, message in reply.get("error", "")) == (status, True), (model, reply)
    giant = giant_png(60000, 60000)
    body, headers = one_input("IMAGE", [1], "BYTES", struct.pack("<I", len(giant)) + giant)
    got, reply = post(gw, "/v2/models/classify/infer", body, headers)
    assert got == 400 and "too large to decode" in reply["error"]
    giant = giant_png(20000, 200)  # past the side the executors take, but not a decompression bomb
    body, headers = one_input("IMAGE", [1], "BYTES", struct.pack("<I", len(giant)) + giant)
    got, reply = post(gw, "/v2/models/classify/infer", body, headers)
    assert got == 400 and "20000×200" in reply["error"]
    got, reply = post(gw, "/v2/models/classify/versions/2/infer", b"{}", {})
    assert got == 404 and "no version" in reply["error"]
    still_served(gw)


def test_a_body_over_the_limit_is_refused_before_it_is_read(gw: Gateway) -> None:
    with socket.create_connection(("127.0.0.1", gw.http_port), timeout=30) as sock:
        sock.sendall(
            b"POST /v2/models/classify/infer HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 10800000000\r\nContent-Type: application/octet-stream\r\n\r\n"
        )
        answer = b""
        while b"max_body_mb" not in answer and (chunk := sock.recv(65536)):
            answer += chunk  # (the status line and the body may come apart)
    assert answer.startswith(b"HTTP/1.1 413") and b"max_body_mb" in answer
    body = bytes(33 << 20)  # over 32 MiB, sent whole
    got, _ = post(gw, "/v2/models/classify/infer", body, {"Content-Type": "application/json"})
    assert got == 413
    still_served(gw)


def test_garbage_on_the_grpc_port_and_a_stalled_http_client(gw: Gateway) -> None:
    grpc_port = int(gw.grpc.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", grpc_port), timeout=30) as sock:
        sock.sendall(b"\x16\x03\x01 definitely not HTTP/2 " * 50)
        with contextlib.suppress(OSError):  # the server answers with a GOAWAY, or just closes
            while sock.recv(4096):
                pass
    silent = socket.create_connection(("127.0.0.1", gw.http_port), timeout=30)
    stalled = socket.create_connection(("127.0.0.1", gw.http_port), timeout=30)
    stalled.sendall(b"POST /v2/models/classify/infer HTTP/1.1\r\nHost: x\r\nContent-Le")
    started = time.monotonic()
    still_served(gw)  # served while the stalled one waits
    assert stalled.recv(1) == b""  # closed at the header timeout (1 s here)
    assert silent.recv(1) == b""  # one that never begins a request: at the idle timeout (3 s)
    assert time.monotonic() - started < 10
    stalled.close()
    silent.close()
    assert grpcclient.InferenceServerClient(gw.grpc).is_server_ready()


def test_more_concurrent_requests_than_slots_are_refused_at_once(gw: Gateway) -> None:
    page = read_image(IMAGES / "page.png")  # OCR: hundreds of ms each, so the slots stay taken
    outcomes: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(3 * SLOTS)

    def one() -> None:
        client = httpclient.InferenceServerClient(gw.http, network_timeout=120)
        start.wait()
        began = time.monotonic()
        try:
            result_of(client.infer("ocr", [image_input(httpclient, page)]))
            outcome = "ok"
        except InferenceServerException as err:
            outcome = (
                "refused" if "slots" in str(err) and time.monotonic() - began < 5 else str(err)
            )
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=one) for _ in range(3 * SLOTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert sorted(set(outcomes)) == ["ok", "refused"], outcomes
    assert outcomes.count("ok") >= SLOTS
    still_served(gw)


# -- tokens, and supervisors and workers that die -----------------------------------------------


def test_a_token_guards_a_non_loopback_bind(tmp_path: Path, demo_config: object) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    http_port, grpc_port = free_port(), free_port()
    config, _, _ = gateway_config(
        tmp_path, [], http=f"0.0.0.0:{http_port}", grpc=f"0.0.0.0:{grpc_port}",
        token_file=str(token),
    )  # fmt: skip
    with running_supervisor(config):
        url = f"127.0.0.1:{http_port}"
        assert httpclient.InferenceServerClient(url).is_server_ready()  # probes need none
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(InferenceServerException, match="bearer token"):
                httpclient.InferenceServerClient(url).get_model_metadata("affine", headers=headers)
        meta = httpclient.InferenceServerClient(url).get_model_metadata(
            "affine", headers={"Authorization": "Bearer s3cret"}
        )
        assert meta["name"] == "affine"
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        with pytest.raises(InferenceServerException, match="bearer token"):
            client.get_model_metadata("affine")
        assert (
            client.get_model_metadata("affine", headers={"authorization": "Bearer s3cret"}).name
            == "affine"
        )


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a certificate")
def test_tls_on_both_transports(tmp_path: Path, demo_config: object) -> None:
    """A non-loopback bind with TLS: tritonclient over HTTPS and gRPC with TLS, trusting the
    gateway's self-signed certificate."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    http_port, grpc_port = free_port(), free_port()
    config, _, _ = gateway_config(
        tmp_path, [], http=f"0.0.0.0:{http_port}", grpc=f"0.0.0.0:{grpc_port}",
        tls_cert=str(cert), tls_key=str(key),
    )  # fmt: skip
    with running_supervisor(config):
        secure = httpclient.InferenceServerClient(
            f"127.0.0.1:{http_port}", ssl=True, ssl_options={"ca_certs": str(cert)},
            insecure=True,
        )  # fmt: skip
        assert secure.get_model_metadata("affine")["name"] == "affine"
        plain = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", network_timeout=10)
        with pytest.raises(Exception):  # noqa: B017 (plain HTTP to a TLS port: any failure)
            plain.get_model_metadata("affine")
        tls = grpcclient.InferenceServerClient(
            f"localhost:{grpc_port}", ssl=True, root_certificates=str(cert)
        )
        assert tls.get_model_metadata("affine").name == "affine"


def test_without_a_token_a_non_loopback_bind_is_refused(tmp_path: Path) -> None:
    config = write_config(tmp_path, ["classify"], gateway={"http": "0.0.0.0:18999"})
    check = subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", "check", "-c", str(config)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert check.returncode == 2 and "not a loopback address" in check.stderr


def affine_infer(http_at: str) -> float:
    tensor = httpclient.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    return float(
        httpclient.InferenceServerClient(http_at).infer("affine", [tensor]).as_numpy("y")[0, 0]
    )


def test_the_supervisor_killed_under_load_then_back(tmp_path: Path, demo_config: object) -> None:
    """``duomo gateway`` beside a supervisor: SIGKILL the supervisor while requests run, get
    503 from the dropped connection (within 10 s, where a request's own timeout is 60 s), start
    a supervisor again, and be served again."""
    config, http_at, grpc_at = gateway_config(tmp_path, [])
    raw = yaml.safe_load(config.read_text())
    del raw["gateway"]  # this supervisor starts none: ``duomo gateway`` runs beside it
    config.write_text(yaml.safe_dump(raw))
    statuses: list[tuple[float, int]] = []
    stop = threading.Event()
    with running_supervisor(config) as sup:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "duomo.supervisor", "gateway", "--socket", str(sup.socket),
             "--http", http_at, "--grpc", grpc_at],
            cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            assert gateway.stdout is not None and "duomo gateway:" in gateway.stdout.readline()
            poll(lambda: affine_infer(http_at) == 3.0)
            port = int(http_at.rsplit(":", 1)[1])

            def load() -> None:
                tensor = (
                    b'{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","data":[1,1,1,1]}]}'
                )
                while not stop.is_set():
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                    conn.request("POST", "/v2/models/affine/infer", body=tensor)
                    status = conn.getresponse().status
                    conn.close()
                    statuses.append((time.monotonic(), status))

            loader = threading.Thread(target=load)
            loader.start()
            poll(lambda: len(statuses) > 20)
            killed_at = time.monotonic()
            sup.process.send_signal(signal.SIGKILL)
            sup.process.wait(30)
            # 10 s, a sixth of the gateway's request timeout (60 s): the 503 comes from the
            # dropped connection, not from a request that waited out its deadline
            poll(lambda: any(s == 503 and t > killed_at for t, s in statuses), timeout_s=10)
            assert not httpclient.InferenceServerClient(http_at).is_server_ready()
            with running_supervisor(config, socket_path=sup.socket):
                poll(lambda: statuses[-1][1] == 200, timeout_s=30)
                stop.set()
                loader.join(30)
                assert affine_infer(http_at) == 3.0
            assert {s for _, s in statuses} <= {200, 503}
        finally:
            stop.set()
            gateway.send_signal(signal.SIGTERM)
            gateway.wait(30)


def test_two_workers_share_the_ports_and_the_registered_regions(
    tmp_path: Path, demo_config: object
) -> None:
    """``workers: 2``: both serve (SO_REUSEPORT spreads connections over them), and a region
    registered through one is read by either."""
    config, http_at, _ = gateway_config(tmp_path, [], workers=2, allow_shm=True)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    region = shm.create_shared_memory_region("in", "/duomo_test_workers", x.nbytes)
    try:
        shm.set_shared_memory_region(region, [x])
        with running_supervisor(config) as sup:
            with Client(sup.socket) as client:
                workers = client.status().gateways
                gateway_clients = {c.pid for c in client.status().clients if c.rings}
            assert len(workers) == 2 and all(w.running for w in workers)
            assert {w.pid for w in workers} == gateway_clients  # each holds its own rings
            httpclient.InferenceServerClient(http_at).register_system_shared_memory(
                "in", "/duomo_test_workers", x.nbytes
            )
            for _ in range(12):  # a new connection each: the kernel picks a worker each time
                tensor = httpclient.InferInput("x", [2, 4], "FP32")
                tensor.set_shared_memory("in", x.nbytes)
                answer = httpclient.InferenceServerClient(http_at).infer("affine", [tensor])
                np.testing.assert_array_equal(answer.as_numpy("y"), 2 * x + 1)
            with Client(sup.socket) as client:
                answered = [
                    sum(r.answered for r in c.rings)
                    for c in client.status().clients
                    if c.pid in gateway_clients
                ]
            assert len(answered) == 2 and min(answered) > 0, answered  # both served
    finally:
        shm.destroy_shared_memory_region(region)


def test_a_killed_gateway_worker_is_restarted(tmp_path: Path, demo_config: object) -> None:
    config, http_at, _ = gateway_config(tmp_path, [])
    with running_supervisor(config) as sup:
        with Client(sup.socket) as client:
            (worker,) = client.status().gateways
        assert affine_infer(http_at) == 3.0
        subprocess.run(["kill", "-9", str(worker.pid)], check=True)

        def restarted() -> bool:
            with Client(sup.socket) as client:
                (now,) = client.status().gateways
            return bool(now.running and now.pid != worker.pid and now.restarts == 1)

        poll(restarted, timeout_s=60)
        poll(lambda: _serves(http_at), timeout_s=30)
        # a killed supervisor leaves its workers serving 503; the next one takes over the ports
        sup.process.send_signal(signal.SIGKILL)
        sup.process.wait(30)
        with running_supervisor(config, socket_path=sup.socket):
            poll(lambda: _serves(http_at), timeout_s=30)


def _serves(http_at: str) -> bool:
    try:
        return affine_infer(http_at) == 3.0
    except (InferenceServerException, OSError):
        return False
