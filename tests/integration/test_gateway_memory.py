"""A gateway worker gives back what hostile callers made it allocate (issue 42, item 4).

Over a long hostile run one worker's resident memory grew from 72 MiB to about 405 MiB and stayed
there: rings grown for large frames and the pages their slots touched, the heap's free pages, and
the top of gRPC's own malloc arena. Here a burst of large and malformed requests (bodies that do
not parse, shapes past their data, frames from 1000 to 4000 pixels a side over HTTP, gRPC and
JSON, a flood of registered regions, hundreds of stream names) goes to one worker; once the
callers have left, the worker's memory keeper (``gateway.memory_keeper``) must bring it back near
its level before.

Measured on a 2-core machine (five runs of the burst): RSS before 70 MiB, at the end of the
burst 180-219 MiB, back to 71-73 MiB within two looks of the keeper (20 s); without the keeper
it stayed at 161-227 MiB (anonymous memory +65..100 MiB, ring pages 45 MiB). The margin allowed,
``MARGIN_MIB``, is a few times the spread seen and a fifth of the growth.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from duomo.ipc.client import Client
from tests.conftest import poll
from tests.integration.harness import running_supervisor
from tests.integration.test_gateway import Gateway, gateway_config, post
from tests.integration.test_gateway_hostile import region_call, segment

pytestmark = pytest.mark.integration

MARGIN_MIB = 16
QUIET_WITHIN_S = 60  # the keeper looks every 10 s; the bound is a minute


@pytest.fixture(scope="module")
def lone(tmp_path_factory: pytest.TempPathFactory, demo_config: object) -> Iterator[Gateway]:
    """One gateway worker with shared memory allowed and room for 48 MB bodies."""
    config, http_at, grpc_at = gateway_config(
        tmp_path_factory.mktemp("memory"), ["classify"], workers=1, allow_shm=True,
        max_body_mb=64,
    )  # fmt: skip
    with running_supervisor(config) as sup:
        yield Gateway(sup, http_at, grpc_at)


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS and its anonymous and shared-memory parts, MiB."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssShmem"):
            found[key] = int(value.split()[0]) / 1024
    return found


def image_request(
    gw: Gateway, image: np.ndarray, parameters: dict[str, object] | None = None
) -> int:
    """A binary classify request (with the request ``parameters`` given); its status."""
    tensor = {"name": "IMAGE", "shape": list(image.shape), "datatype": "UINT8",
              "parameters": {"binary_data_size": image.nbytes}}  # fmt: skip
    header = json.dumps({"inputs": [tensor], "parameters": parameters or {}}).encode()
    headers = {"Inference-Header-Content-Length": str(len(header))}
    return post(gw, "/v2/models/classify/infer", header + image.tobytes(), headers)[0]


def hostile_burst(gw: Gateway) -> None:
    """Large and malformed requests of every kind the gateway takes."""
    short = {"name": "IMAGE", "shape": [2, 2, 3], "datatype": "UINT8", "data": [1]}
    for _ in range(200):
        post(gw, "/v2/models/classify/infer", b"{not json" * 1000, {})
        post(gw, "/v2/models/classify/infer", json.dumps({"inputs": [short]}).encode(), {})
    for side in range(1000, 4001, 500):  # 3 to 48 MB bodies: the ring grows past its default
        assert image_request(gw, np.zeros((side, side, 3), np.uint8)) == 200
    pixels = np.random.default_rng(0).integers(0, 255, (600, 600, 3), np.uint8)
    as_json = {"inputs": [{"name": "IMAGE", "shape": [600, 600, 3], "datatype": "UINT8",
                           "data": pixels.ravel().tolist()}]}  # fmt: skip
    assert post(gw, "/v2/models/classify/infer", json.dumps(as_json).encode(), {})[0] == 200
    client = grpcclient.InferenceServerClient(gw.grpc)
    try:
        for side in (1000, 2000, 3000):
            image = grpcclient.InferInput("IMAGE", [side, side, 3], "UINT8")
            image.set_data_from_numpy(np.zeros((side, side, 3), np.uint8))
            client.infer("classify", [image])
    finally:
        client.close()
    key = f"duomo_memory_flood_{os.getpid()}"
    with segment(key, 1 << 20):
        for n in range(50):
            assert (
                region_call(gw, f"region/flood-{n}/register", {"key": key, "byte_size": 4096})[0]
                == 200
            )
        region_call(gw, "unregister")
    small = np.zeros((32, 32, 3), np.uint8)
    for n in range(300):  # names the worker opens, up to its bound, and closes when idle
        image_request(gw, small, {"stream": f"hostile-{n}"})


def test_a_worker_gives_back_what_a_hostile_burst_made_it_allocate(lone: Gateway) -> None:
    with Client(lone.sup.socket) as client:
        [pid] = [worker.pid for worker in client.status().gateways]
    warm = np.random.default_rng(1).integers(0, 255, (480, 640, 3), np.uint8)
    for _ in range(10):  # what it holds to serve at all: normal requests first
        assert image_request(lone, warm) == 200
    before = memory_mib(pid)
    hostile_burst(lone)
    peak = memory_mib(pid)
    assert peak["VmRSS"] > before["VmRSS"] + 3 * MARGIN_MIB, (before, peak)  # (it did grow)

    def given_back() -> bool:
        return memory_mib(pid)["VmRSS"] <= before["VmRSS"] + MARGIN_MIB

    with contextlib.suppress(AssertionError):
        poll(given_back, timeout_s=QUIET_WITHIN_S)
    after = memory_mib(pid)
    assert given_back(), (before, peak, after)
    assert after["RssShmem"] <= before["RssShmem"] + 2, (before, after)  # the rings' pages too
    assert image_request(lone, warm) == 200  # and it serves as before
