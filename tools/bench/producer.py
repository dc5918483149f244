"""A load-generating client process of ``duomo bench``: sends one model's images to a server —
Duomo through shared memory (``ipc.Client``), Duomo's gateway and Triton over KServe v2 (HTTP
with the binary tensor extension; the gateway over gRPC too), Mosec over HTTP, or the
overhead's floor (``tools.bench.floor``) — closed loop (one request in
flight) or open loop (requests due at a fixed rate, several in flight, latency counted from when
each was due), and checks every answer.

With ``probe`` in its spec it measures the per-request overhead instead: one request at a time,
blocks of requests that go round the same executor called in this process (one thread, as
``alone``) and every server the probe names (``targets``: each mode's, Duomo's floors), so every
p50 comes from the same minutes, against the same in-process reference. Every server also says how
long it spent in the executor for each request (``Reply.compute_s``), so the probe gives a
second figure that no difference in compute speed between processes enters: the p50 of the
round trip minus that time.

Run by ``tools.bench.mixed_load`` as ``python -m tools.bench.producer`` with a JSON spec on
stdin; the same protocol as ``tools.bench.inprocess``: ``ready``, then the window on stdin, then
one JSON line with its tally and its own CPU seconds (or the probe's figures).
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from duomo.ipc.client import Client
from duomo.ipc.errors import DuomoError
from duomo.supervisor.operators.image_files import read_image
from tools.bench.answers import Reply
from tools.bench.floor import floor_sender
from tools.bench.report import percentile
from tools.bench.tally import Tally

Send = Callable[[np.ndarray], Reply]
T = TypeVar("T")  # one request: the server's reply, or raises


class RequestFailed(Exception):
    """A server answered with an error (the message names its status)."""


def _http(port: int) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.connect()
    assert conn.sock is not None
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _post(conn: http.client.HTTPConnection, path: str, body: bytes, headers: dict[str, str]) -> Any:
    conn.request("POST", path, body=body, headers=headers)
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise RequestFailed(f"HTTP {response.status}: {data[:200]!r}")
    return response, data


def encoded_once(build: Callable[[np.ndarray], T]) -> Callable[[np.ndarray], T]:
    """``build`` (a request body from an image) once per image, then the same bytes again: a
    client encodes a frame once, and the probe measures what the server adds, not the
    client's own copying of a 720 KB image into a new body on every request (which, with
    glibc's page faults for each fresh large buffer, put 1.7 ms into every HTTP mode's
    overhead and none into Duomo's shared-memory one)."""
    built: dict[int, tuple[np.ndarray, T]] = {}

    def body(image: np.ndarray) -> T:
        entry = built.get(id(image))
        if entry is None or entry[0] is not image:  # (the image is kept: its id stays its own)
            entry = built[id(image)] = (image, build(image))
        return entry[1]

    return body


def _reply(answer: dict[str, Any]) -> Reply:
    """A peer app's answer: ``{"result": …, "compute_us": …}`` (``tools.bench.peer_apps``)."""
    return Reply(answer["result"], answer["compute_us"] / 1e6)


def v2_http(port: int, model: str) -> Callable[[np.ndarray], tuple[dict[str, Any], bytes]]:
    """One KServe v2 request over HTTP: the image as a binary ``UINT8`` tensor in, the
    ``RESULT`` ``BYTES`` tensor out binary; returns the response's JSON header and RESULT's
    one element."""
    conn = _http(port)
    path = f"/v2/models/{model}/infer"

    def build(image: np.ndarray) -> tuple[bytes, dict[str, str]]:
        if image.ndim == 2:  # the model's input is [-1, -1, -1]: a gray image is H×W×1
            image = image[:, :, None]
        header = json.dumps({
            "inputs": [{
                "name": "IMAGE", "shape": list(image.shape), "datatype": "UINT8",
                "parameters": {"binary_data_size": image.nbytes},
            }],
            "outputs": [{"name": "RESULT", "parameters": {"binary_data": True}}],
        }).encode()  # fmt: skip
        headers = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(header)),
        }
        return header + image.tobytes(), headers

    request = encoded_once(build)

    def infer(image: np.ndarray) -> tuple[dict[str, Any], bytes]:
        response, data = _post(conn, path, *request(image))
        json_size = response.getheader("Inference-Header-Content-Length")
        if json_size is None:  # a JSON-only answer
            answer = json.loads(data)
            return answer, answer["outputs"][0]["data"][0].encode()
        blob = data[int(json_size) :]
        size = int.from_bytes(blob[:4], "little")
        return json.loads(data[: int(json_size)]), blob[4 : 4 + size]

    return infer


def triton_sender(port: int, model: str) -> Send:
    """Triton: the peer app puts its result and its time in the executor in RESULT."""
    infer = v2_http(port, model)
    return lambda image: _reply(json.loads(infer(image)[1]))


def duomo_http_sender(port: int, model: str) -> Send:
    """Duomo's gateway over HTTP: RESULT is the result; the response's parameters carry the
    supervisor's time in the executor (``duomo_compute_us``)."""
    infer = v2_http(port, model)

    def send(image: np.ndarray) -> Reply:
        header, result = infer(image)
        return Reply(json.loads(result), header["parameters"]["duomo_compute_us"] / 1e6)

    return send


def duomo_grpc_sender(port: int, model: str) -> Send:
    """Duomo's gateway over gRPC (``GRPCInferenceService/ModelInfer``, raw contents), through
    grpcio's own stub and the message classes tritonclient ships."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

    def build(image: np.ndarray) -> Any:
        if image.ndim == 2:
            image = image[:, :, None]
        request = service_pb2.ModelInferRequest(model_name=model)
        tensor = request.inputs.add(name="IMAGE", datatype="UINT8")
        tensor.shape.extend(image.shape)
        request.raw_input_contents.append(image.tobytes())
        return request

    request = encoded_once(build)

    def send(image: np.ndarray) -> Reply:
        response = stub.ModelInfer(request(image), timeout=120)
        blob = response.raw_output_contents[0]
        size = int.from_bytes(blob[:4], "little")
        compute_us = response.parameters["duomo_compute_us"].int64_param
        return Reply(json.loads(blob[4 : 4 + size]), compute_us / 1e6)

    return send


def mosec_sender(port: int, model: str) -> Send:
    conn = _http(port)
    headers = {"Content-Type": "application/octet-stream"}

    def build(image: np.ndarray) -> bytes:
        h, w = image.shape[:2]
        c = image.shape[2] if image.ndim == 3 else 1
        return np.array([h, w, c], dtype="<u4").tobytes() + image.tobytes()

    body = encoded_once(build)

    def send(image: np.ndarray) -> Reply:
        _, data = _post(conn, f"/{model}", body(image), headers)
        return _reply(json.loads(data))

    return send


def duomo_sender(socket_path: str, model: str, client: list[Client]) -> Send:
    """``ModelHandle.infer`` through one slot, with the answer's stage timings."""
    c = Client(socket_path, timeout_s=120)
    client.append(c)
    handle = c.model(model, slots=1)

    def send(image: np.ndarray) -> Reply:
        result, t = handle.infer_timed(image, timeout_s=120)
        return Reply(result, (t["preprocess"] + t["infer"] + t["postprocess"]) / 1e6)

    return send


PROBE_BLOCK = 20  # requests per block; the blocks go round in-process, then each server
# The first requests of a block are not counted: right after a switch the caches still hold the
# other side's model (the first classify request ran 0.5-1.1 ms slower, the next three up to
# 0.2 ms), which is the probe's own doing, not a client's steady per-request overhead.
PROBE_SETTLE = 5


def probe_overhead(
    senders: dict[str, Send],
    spec: dict[str, Any],
    images: list[np.ndarray],
    start_at: float,
    end_at: float,
) -> dict[str, dict[str, Any]]:
    """Per server (``senders``' labels): its p50, this process's in-process p50 and the
    difference (``overhead_ms``), from blocks of requests that go round in-process and through
    each server in turn, so every server is measured against the same in-process reference in
    the same minutes, each block past its first ``PROBE_SETTLE`` requests; and the p50 of each
    round trip minus the server's own time in the executor (``accounted_ms``)."""
    from tools.bench.answers import is_correct
    from tools.bench.inprocess import open_executor, run_one

    executor = open_executor(spec["probe"]["config"], spec["model"], threads=1)
    turns: list[tuple[str | None, Send]] = [
        (None, lambda image: Reply(run_one(executor, image), 0.0)),
        *senders.items(),
    ]
    latencies: dict[str | None, list[float]] = {label: [] for label, _ in turns}
    added: dict[str | None, list[float]] = {label: [] for label, _ in turns}
    wrong: dict[str | None, int] = dict.fromkeys(latencies, 0)
    i = 0
    while time.time() < end_at:
        label, send = turns[(i // PROBE_BLOCK) % len(turns)]
        k = i % len(images)
        t0 = time.perf_counter()
        reply = send(images[k])
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        wrong[label] += not is_correct(reply.result, spec["expected"][k])
        if time.time() >= start_at and i % PROBE_BLOCK >= PROBE_SETTLE:
            latencies[label].append(elapsed_ms)
            added[label].append(elapsed_ms - reply.compute_s * 1e3)
        i += 1
    executor.close()
    direct = percentile(latencies[None], 0.5)
    probes = {}
    for n, label in enumerate(senders):
        served = percentile(latencies[label], 0.5)
        probes[label] = {
            "model": spec["model"],
            "served": len(latencies[label]),
            "direct": len(latencies[None]),
            "wrong": wrong[label] + (wrong[None] if n == 0 else 0),  # in-process: counted once
            "p50_ms": served,
            "direct_p50_ms": direct,
            "overhead_ms": served - direct if served and direct else None,
            "accounted_ms": percentile(added[label], 0.5),
        }
    return probes


def _sender(target: dict[str, Any], model: str, clients: list[Client]) -> Send:
    if target["kind"] == "duomo":
        return duomo_sender(target["socket"], model, clients)
    if target["kind"] == "triton":
        return triton_sender(target["port"], model)
    if target["kind"] == "duomo-http":
        return duomo_http_sender(target["port"], model)
    if target["kind"] == "duomo-grpc":
        return duomo_grpc_sender(target["port"], model)
    if target["kind"] == "floor":
        return floor_sender(target)
    return mosec_sender(target["port"], model)


def produce(spec: dict[str, Any]) -> dict[str, Any]:
    target = spec["target"]
    model = spec["model"]
    images = [read_image(p) for p in spec["images"]]
    expected = spec["expected"]
    open_loop = spec["rate_per_s"] is not None
    threads = int(spec.get("threads", 8)) if open_loop else 1
    clients: list[Client] = []
    probe = spec.get("probe")
    if probe:  # the overhead probe: every server it names, in turn
        by_label = {label: _sender(t, model, clients) for label, t in probe["targets"].items()}
        print("ready", flush=True)
        window = json.loads(sys.stdin.readline())
        try:
            return probe_overhead(
                by_label, spec, images, float(window["start_at"]), float(window["end_at"])
            )
        finally:
            for c in clients:
                c.close()
    senders = [_sender(target, model, clients) for _ in range(threads)]
    tally = Tally()
    print("ready", flush=True)
    window = json.loads(sys.stdin.readline())
    start_at, end_at = float(window["start_at"]), float(window["end_at"])
    interval = 1.0 / spec["rate_per_s"] if open_loop else 0.0
    lock = threading.Lock()
    next_index = [0]
    first_due = time.time()

    def loop(send: Send) -> None:
        while tally.counted < spec["max_requests"]:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            due = first_due + i * interval if open_loop else time.time()
            if due >= end_at:
                return
            if open_loop and due > time.time():
                time.sleep(due - time.time())
            k = i % len(images)
            try:
                reply = send(images[k])
            except (DuomoError, RequestFailed, OSError, http.client.HTTPException) as err:
                name = err.code.name if isinstance(err, DuomoError) else type(err).__name__
                with lock:
                    tally.add(due, time.time(), start_at, end_at, error=name, message=str(err))
            else:
                with lock:
                    tally.add(due, time.time(), start_at, end_at, reply.result, expected[k])

    cpu0 = time.process_time()
    workers = [threading.Thread(target=loop, args=(s,), daemon=True) for s in senders]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    cpu = time.process_time() - cpu0
    for c in clients:
        c.close()
    return {"model": model, "cpu_s": cpu, **tally.as_dict()}


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    print(json.dumps(produce(spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
