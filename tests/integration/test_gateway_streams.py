"""Streams through the KServe v2 gateway (``gateway.streams``): a remote caller names its stream
in the request's ``parameters``, over HTTP and gRPC with ``tritonclient``, against a real
supervisor and its gateway worker; and the worker's table of streams driven directly, on a
real connection to that supervisor (reopening for a new model, a name held by another
producer, the bound, closing idle streams).

Every answer is checked against the model's own arithmetic (``y = 2x + 1``), and every stream
against what the supervisor itself says about it.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from duomo.gateway.link import SupervisorLink
from duomo.gateway.streams import StreamRequest
from duomo.ipc.client import Client
from duomo.ipc.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from tests.integration.harness import (
    SupervisorProcess,
    affine_model,
    faulty_model,
    free_port,
    running_supervisor,
    write_config,
)

pytestmark = pytest.mark.integration

WORK_MS = 150.0  # the slow model's time per frame: a burst of frames overloads it
BURST = 12  # concurrent frames of one stream (within the gateway's slots)


class Gateway:
    def __init__(self, sup: SupervisorProcess, http: str, grpc: str) -> None:
        self.sup, self.http, self.grpc = sup, http, grpc

    def streams(self) -> dict[str, dict[str, Any]]:
        """The supervisor's stream records by name, as their JSON."""
        with Client(self.sup.socket, timeout_s=30) as client:
            return {s.name: s.to_dict() for s in client.status().streams}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    folder = tmp_path_factory.mktemp("gateway-streams")
    affine_model(folder / "affine.onnx")
    affine = {"name": "affine", "task": "raw", "file": str(folder / "affine.onnx"), "max_batch": 4}
    slow = faulty_model("slow", max_batch=1, params={"work_ms": WORK_MS}, max_delay_ms=0)
    http_at, grpc_at = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    gateway = {"http": http_at, "grpc": grpc_at, "workers": 1, "slots": 16}
    config = write_config(folder, [], extra=[affine, slow], gateway=gateway)
    with running_supervisor(config) as sup:
        yield Gateway(sup, http_at, grpc_at)


def rows(value: float) -> np.ndarray:
    return np.full((1, 4), value, dtype=np.float32)


def x_input(mod: Any, value: float) -> Any:
    tensor = mod.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(rows(value))
    return tensor


def response_parameters(response: Any) -> dict[str, Any]:
    """The response's ``parameters`` as plain values, whichever client returned it."""
    found = response.get_response()
    if isinstance(found, dict):
        return dict(found.get("parameters", {}))
    return {
        key: getattr(value, value.WhichOneof("parameter_choice"))
        for key, value in found.parameters.items()
    }


def utc(rfc3339: str) -> float:
    """An RFC 3339 time with milliseconds in UTC (``…T21:59:11.960Z``) as UNIX seconds."""
    assert rfc3339.endswith("Z") and len(rfc3339) == 24, rfc3339
    return datetime.datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


# -- a stream, over both transports ------------------------------------------------------------


def test_a_stream_over_http_and_grpc(gw: Gateway) -> None:
    now_us = int(time.time() * 1e6)
    for mod, client, name in (
        (httpclient, httpclient.InferenceServerClient(gw.http), "cam-http"),
        (grpcclient, grpcclient.InferenceServerClient(gw.grpc), "cam-grpc"),
    ):
        for n in range(4):  # counted by the gateway: 0, 1, 2, 3
            result = client.infer("affine", [x_input(mod, n)], parameters={"stream": name})
            np.testing.assert_array_equal(result.as_numpy("y"), 2 * rows(n) + 1)
            said = response_parameters(result)
            assert said["duomo_stream"] == name and int(said["duomo_frame"]) == n
            assert said["duomo_clock"] == "arrival"  # (no captured_us: the gateway's receipt)
            assert abs(utc(said["duomo_captured_at"]) - time.time()) < 10
        # numbered and timed by the caller (its capture 40 ms ago, on the wall clock)
        given = {"stream": name, "frame": 100, "captured_us": now_us - 40_000}
        result = client.infer("affine", [x_input(mod, 7)], parameters=given)
        np.testing.assert_array_equal(result.as_numpy("y"), 2 * rows(7) + 1)
        said = response_parameters(result)
        assert int(said["duomo_frame"]) == 100 and said["duomo_clock"] == "caller"
        assert abs(utc(said["duomo_captured_at"]) - (now_us - 40_000) / 1e6) < 0.001
    streams = gw.streams()
    for name in ("cam-http", "cam-grpc"):
        record = streams[name]
        assert record["state"] in ("starting", "running") and record["policy"] == "latest"
        figures = record["models"]["affine"]
        assert (figures["frames_in"], figures["answered"], figures["superseded"]) == (5, 5, 0)
        assert figures["age_ms_p99"] >= 40.0  # the caller's capture time was used
    # the stream is the gateway's on the supervisor: another producer cannot open the name
    with (
        Client(gw.sup.socket, timeout_s=30) as other,
        pytest.raises(InvalidArgumentError, match="already open"),
    ):
        other.open_stream("cam-http", ["affine"])


FRAME_NUMBERS = (0, 2**63 - 1, 2**63, 2**64 - 1)  # the documented range 0..2^64-1, its edges


def test_every_frame_number_the_range_allows_is_echoed_over_both_protocols(gw: Gateway) -> None:
    """Issue 42, item 2: gRPC answered INTERNAL for a frame of 2^63 or more (the response wrote
    it as an int64) after the inference ran; HTTP answered 200. Each is echoed in the type that
    holds it (uint64_param past int64)."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(gw.grpc))
    http = httpclient.InferenceServerClient(gw.http)
    for frame in FRAME_NUMBERS:
        request = service_pb2.ModelInferRequest(model_name="affine")
        tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
        tensor.contents.fp32_contents.extend([float(frame % 7)] * 4)
        request.parameters["stream"].string_param = "cam-frames-grpc"
        kind = "uint64_param" if frame > 2**63 - 1 else "int64_param"
        setattr(request.parameters["frame"], kind, frame)
        response = stub.ModelInfer(request, timeout=30)
        said = response.parameters["duomo_frame"]
        assert said.WhichOneof("parameter_choice") == kind
        assert getattr(said, kind) == frame
        y = np.frombuffer(response.raw_output_contents[0], np.float32)
        np.testing.assert_array_equal(y, 2 * np.float32(frame % 7) + 1)

        given = {"stream": "cam-frames-http", "frame": frame}
        result = http.infer("affine", [x_input(httpclient, frame % 7)], parameters=given)
        assert response_parameters(result)["duomo_frame"] == frame
        np.testing.assert_array_equal(result.as_numpy("y"), 2 * rows(frame % 7) + 1)


def test_a_plain_request_is_unchanged(gw: Gateway) -> None:
    before = set(gw.streams())
    for mod, client in (
        (httpclient, httpclient.InferenceServerClient(gw.http)),
        (grpcclient, grpcclient.InferenceServerClient(gw.grpc)),
    ):
        result = client.infer("affine", [x_input(mod, 3)])
        np.testing.assert_array_equal(result.as_numpy("y"), 2 * rows(3) + 1)
        said = response_parameters(result)
        assert "duomo_stream" not in said and "duomo_frame" not in said
        assert "duomo_queue_us" in said
    assert set(gw.streams()) == before


# -- latest under overload ---------------------------------------------------------------------


def burst_over_http(gw: Gateway, name: str) -> list[tuple[int, Any]]:
    """``BURST`` frames of stream ``name`` at once into the slow model: (frame, result or the
    InferenceServerException)."""
    client = httpclient.InferenceServerClient(gw.http, concurrency=BURST)
    pending = [
        (n, client.async_infer("slow", [x_input(httpclient, n)],
                               parameters={"stream": name, "frame": n}))
        for n in range(BURST)
    ]  # fmt: skip
    outcomes: list[tuple[int, Any]] = []
    for n, request in pending:
        try:
            outcomes.append((n, request.get_result(timeout=60)))
        except InferenceServerException as err:
            outcomes.append((n, err))
    return outcomes


def burst_over_grpc(gw: Gateway, name: str) -> list[tuple[int, Any]]:
    client = grpcclient.InferenceServerClient(gw.grpc)
    outcomes: list[tuple[int, Any]] = []
    all_in = threading.Event()
    lock = threading.Lock()

    def done(n: int, result: Any, error: Any) -> None:
        with lock:
            outcomes.append((n, error if error is not None else result))
            if len(outcomes) == BURST:
                all_in.set()

    for n in range(BURST):
        client.async_infer(
            "slow", [x_input(grpcclient, n)], callback=functools.partial(done, n),
            parameters={"stream": name, "frame": n},
        )  # fmt: skip
    assert all_in.wait(30), "not every frame was answered"
    return sorted(outcomes, key=lambda item: item[0])


@pytest.mark.parametrize(
    ("burst", "superseded_status"),
    [(burst_over_http, "409"), (burst_over_grpc, "StatusCode.ABORTED")],
    ids=["http", "grpc"],
)
def test_latest_supersedes_queued_frames_under_overload(
    gw: Gateway, burst: Any, superseded_status: str
) -> None:
    name = f"burst-{superseded_status[-3:].lower()}"
    outcomes = burst(gw, name)
    answered = [(n, r) for n, r in outcomes if not isinstance(r, InferenceServerException)]
    refused = [(n, r) for n, r in outcomes if isinstance(r, InferenceServerException)]
    assert len(outcomes) == BURST
    assert answered and refused, outcomes
    for n, result in answered:  # each answer is its own frame's, and it ran
        said = response_parameters(result)
        assert int(said["duomo_frame"]) == n and said["duomo_stream"] == name
        assert int(said["duomo_compute_us"]) >= WORK_MS * 1e3 * 0.9
    for n, err in refused:
        assert err.status() == superseded_status, err
        assert "superseded" in err.message() and f"frame {n} of stream {name!r}" in err.message()
    figures = gw.streams()[name]["models"]["slow"]
    assert figures["frames_in"] == BURST
    assert figures["answered"] == len(answered) and figures["superseded"] == len(refused)


# -- bad parameters ----------------------------------------------------------------------------

BAD_PARAMETERS = [
    ({"stream": "c" * 65}, "'stream'"),
    ({"stream": "cam", "frame": -1}, "'frame'"),
    ({"stream": "cam", "captured_us": True}, "'captured_us'"),
    ({"stream": "cam", "stream_policy": "newest"}, "'stream_policy'"),
    ({"frame": 3}, "'frame' needs a 'stream'"),
]


@pytest.mark.parametrize(("parameters", "named"), BAD_PARAMETERS)
def test_bad_stream_parameters_are_refused_naming_them(
    gw: Gateway, parameters: dict[str, Any], named: str
) -> None:
    for mod, client, status in (
        (httpclient, httpclient.InferenceServerClient(gw.http), "400"),
        (grpcclient, grpcclient.InferenceServerClient(gw.grpc), "StatusCode.INVALID_ARGUMENT"),
    ):
        with pytest.raises(InferenceServerException) as caught:
            client.infer("affine", [x_input(mod, 1)], parameters=parameters)
        assert caught.value.status() == status
        assert named in caught.value.message()
    assert "cam" not in gw.streams()


# -- the worker's table of streams, driven directly --------------------------------------------


async def table_scenario(socket_path: Path) -> None:
    link = SupervisorLink(socket_path, slots=2, request_timeout_s=30)
    link.streams.max_streams = 3
    link.streams.idle_close_s = 0.2
    await link.start()
    assert await link.wait_connected(30)
    table = link.streams

    def request(name: str) -> StreamRequest:
        return StreamRequest(name, None, int(time.monotonic() * 1e6))

    with Client(socket_path, timeout_s=30) as other:
        loop = asyncio.get_running_loop()
        status = await loop.run_in_executor(None, other.status)
        assert not {"t-a", "t-b", "t-c"} & {s.name for s in status.streams}
        # opened for one model, then reopened for both under the same name and id
        first = request("t-a")
        tag = await table.tag(first, "affine")
        assert first.served_as == "t-a" and tag.frame == 0
        table.release(first)
        second = request("t-a")
        again = await table.tag(second, "slow")
        assert again.stream_id == tag.stream_id and again.frame == 1
        table.release(second)
        status = await loop.run_in_executor(None, other.status)
        record = {s.name: s for s in status.streams}["t-a"]
        assert set(record.models) == {"affine", "slow"} and record.state != "ended"
        # a model the supervisor does not serve fails that request, not the stream
        with pytest.raises(NotFoundError, match="nope"):
            await table.tag(request("t-a"), "nope")
        third = request("t-a")
        assert (await table.tag(third, "affine")).stream_id == tag.stream_id
        assert third.frame == 2  # (the count goes on)
        table.release(third)
        # a name another producer holds: the gateway's goes under "<name>@2"
        held = await loop.run_in_executor(None, other.open_stream, "t-b", ["affine"])
        fourth = request("t-b")
        await table.tag(fourth, "affine")
        assert fourth.served_as == "t-b@2"
        table.release(fourth)
        await loop.run_in_executor(None, other.close_stream, held)
        # the bound: a fourth name while three are held
        fifth, sixth = request("t-c"), request("t-d")
        await table.tag(fifth, "affine")
        with pytest.raises(ResourceExhaustedError, match="holds 3 streams"):
            await table.tag(sixth, "affine")
        table.release(fifth)
        assert len(table) == 3
        # idle: every stream closed (their names free again in the supervisor)
        await asyncio.sleep(0.3)
        await table.close_idle()
        assert len(table) == 0
        status = await loop.run_in_executor(None, other.status)
        states = {s.name: s.state for s in status.streams}
        assert states["t-a"] == states["t-b@2"] == states["t-c"] == "ended"
        reopened = await loop.run_in_executor(None, other.open_stream, "t-a", ["affine"])
        await loop.run_in_executor(None, other.close_stream, reopened)
    await link.close()


def test_the_workers_table_of_streams(gw: Gateway) -> None:
    asyncio.run(table_scenario(gw.sup.socket))
