"""Which HTTP stack the gateway runs on, by measurement: the same gateway core (``HttpFront``,
``SupervisorLink``) served by uvicorn + httptools (asyncio's loop, and uvloop's) and by
aiohttp's low-level server, each in its own process beside one supervisor, probed in turns
from one client against the same model called through ``ipc.Client`` (the reference).

    python -m tools.bench.experiments.bench_http_stack [--seconds 20] [--model affine|classify]

For each stack: the p50 round trip of a v2 binary-tensor request and its *overhead* (that p50
minus the reference's p50: what the HTTP hop costs), from blocks of requests that go round the
reference and every stack in turn, each block past its first requests (the caches hold the
previous side's state). Prints a table and writes JSON with ``--out``. docs/gateway.md ("The
HTTP stack") says what was chosen from it.

``--serve-aiohttp PORT SOCKET`` is this tool's own aiohttp server process (not for users).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from duomo.gateway.http_front import HttpFront, HttpOptions
from duomo.gateway.link import SupervisorLink
from duomo.gateway.regions import Regions
from duomo.ipc.client import Client

ROOT = Path(__file__).resolve().parents[3]
BLOCK, SETTLE = 40, 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_aiohttp(port: int, socket_path: Path) -> None:
    """The gateway's HTTP core on aiohttp's low-level server (one process, like a worker)."""
    from aiohttp import web

    async def main() -> None:
        link = SupervisorLink(socket_path, slots=4, request_timeout_s=60)
        front = HttpFront(link, Regions(Path(tempfile.mkdtemp()), False), HttpOptions(
            64 << 20, None, ("binary_tensor_data",), "bench",
        ))  # fmt: skip

        async def handle(request: web.BaseRequest) -> web.Response:
            headers = {k.lower().encode(): v.encode() for k, v in request.headers.items()}
            body = await request.read()
            reply = await front.respond(request.method, request.path, headers, body)
            extra = {}
            if reply.header_length is not None:
                extra["Inference-Header-Content-Length"] = str(reply.header_length)
            return web.Response(
                status=reply.status, body=reply.body, headers=extra,
                content_type=reply.content_type.decode(),
            )  # fmt: skip

        await link.start()
        await link.wait_connected(30)
        runner = web.ServerRunner(web.Server(handle, access_log=None))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print("ready", flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await runner.cleanup()
        await link.close()

    asyncio.run(main())


def start(command: list[str], ready: Callable[[], bool]) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(command, cwd=ROOT, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 60
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{command} did not start")
        time.sleep(0.2)
    return process


def answers(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/v2/health/ready")
        return conn.getresponse().status == 200
    except OSError:
        return False


def v2_sender(port: int, model: str, tensor: np.ndarray, input_name: str) -> Callable[[], None]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.connect()
    assert conn.sock is not None
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    datatype = "UINT8" if tensor.dtype == np.uint8 else "FP32"
    header = json.dumps({
        "inputs": [{"name": input_name, "shape": list(tensor.shape), "datatype": datatype,
                    "parameters": {"binary_data_size": tensor.nbytes}}],
        "parameters": {"binary_data_output": True},
    }).encode()  # fmt: skip
    body = header + tensor.tobytes()
    headers = {"Inference-Header-Content-Length": str(len(header)),
               "Content-Type": "application/octet-stream"}  # fmt: skip

    def send() -> None:
        conn.request("POST", f"/v2/models/{model}/infer", body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")

    return send


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--model", default="affine", choices=("affine", "classify"))
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--serve-aiohttp", nargs=2, metavar=("PORT", "SOCKET"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.serve_aiohttp:
        serve_aiohttp(int(args.serve_aiohttp[0]), Path(args.serve_aiohttp[1]))
        return 0
    from duomo.supervisor.operators.image_files import read_image
    from tests.integration.harness import affine_model  # (a checkable raw model)

    work = Path(tempfile.mkdtemp(prefix="duomo-stack-", dir="/tmp"))
    affine_model(work / "affine.onnx")
    config = work / "config.yaml"
    config.write_text(
        f"model_root: {ROOT / 'models'}\nmodels:\n"
        f"  - {{name: affine, task: raw, file: {work / 'affine.onnx'}, max_batch: 4}}\n"
        "  - {name: classify, task: classification, file: classify/efficientnet_lite0.onnx}\n"
    )
    sock = work / "duomo.sock"
    duomo = [sys.executable, "-m", "duomo.supervisor"]
    subprocess.run([*duomo, "start", "-c", str(config), "--socket", str(sock)], check=True,
                   cwd=ROOT, capture_output=True)  # fmt: skip
    tensor = (np.ones((1, 4), dtype=np.float32) if args.model == "affine"
              else read_image(ROOT / "tests/fixtures/images/coffee.png"))  # fmt: skip
    input_name = "x" if args.model == "affine" else "IMAGE"
    ports = {
        "uvicorn (asyncio)": free_port(),
        "uvicorn (uvloop)": free_port(),
        "aiohttp": free_port(),
    }
    processes = []
    try:
        gateway = [sys.executable, "-m", "duomo.gateway", "--socket", str(sock), "--http"]
        uv = ports["uvicorn (uvloop)"]
        processes.append(start([*gateway, f"127.0.0.1:{ports['uvicorn (asyncio)']}"],
                               lambda: answers(ports["uvicorn (asyncio)"])))  # fmt: skip
        processes.append(start([*gateway, f"127.0.0.1:{uv}", "--loop", "uvloop"],
                               lambda: answers(uv)))  # fmt: skip
        processes.append(start([sys.executable, "-m", "tools.bench.experiments.bench_http_stack",
                                "--serve-aiohttp", str(ports["aiohttp"]), str(sock)],
                               lambda: answers(ports["aiohttp"])))  # fmt: skip
        client = Client(sock, timeout_s=60)
        handle = client.model(args.model, slots=1)
        senders: dict[str, Callable[[], None]] = {
            "reference (ipc.Client)": lambda: handle.infer(tensor, timeout_s=60),
            **{
                label: v2_sender(port, args.model, tensor, input_name)
                for label, port in ports.items()
            },
        }
        samples: dict[str, list[float]] = {label: [] for label in senders}
        turns = list(senders.items())
        end = time.monotonic() + args.seconds
        i = 0
        while time.monotonic() < end:
            label, send = turns[(i // BLOCK) % len(turns)]
            t0 = time.perf_counter()
            send()
            if i % BLOCK >= SETTLE:
                samples[label].append((time.perf_counter() - t0) * 1e3)
            i += 1
        client.close()
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
            process.wait(30)
        subprocess.run([*duomo, "stop", "--socket", str(sock)], cwd=ROOT, capture_output=True)
    reference = float(np.median(samples["reference (ipc.Client)"]))
    rows = []
    for label, values in samples.items():
        p50 = float(np.median(values))
        rows.append({"stack": label, "requests": len(values), "p50_ms": round(p50, 3),
                     "p99_ms": round(float(np.percentile(values, 99)), 3),
                     "overhead_ms": round(p50 - reference, 3)})  # fmt: skip
    print(f"model {args.model}, {args.seconds:g} s, blocks of {BLOCK} (first {SETTLE} not counted)")
    print(f"{'stack':<24} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'overhead ms':>12}")
    for row in rows:
        print(f"{row['stack']:<24} {row['requests']:>8} {row['p50_ms']:>8.3f} "
              f"{row['p99_ms']:>8.3f} {row['overhead_ms']:>12.3f}")  # fmt: skip
    if args.out:
        args.out.write_text(
            json.dumps({"model": args.model, "seconds": args.seconds, "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
