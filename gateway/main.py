"""One gateway worker process: the HTTP and gRPC fronts on one event loop, one link to the
supervisor, until SIGTERM or SIGINT.

Started as ``python -m duomo.gateway`` by ``duomo gateway`` and by ``duomo start`` (one process per
worker; ``supervisor.process.gateways`` restarts one that dies). Several workers share the ports
(``SO_REUSEPORT``); each holds its own ``ipc.Client`` and slots. It reports ``READY`` on
``--ready-fd`` once both ports are bound and it has reached the supervisor (or after
``CONNECT_WAIT_S`` without: the link keeps trying in the background, and again whenever the
supervisor comes back; ``/v2/health/ready`` says whether it is connected).

Security at start: a port bound to anything but loopback is refused unless a bearer token
(``--token-file``) or TLS (``--tls-cert`` and ``--tls-key``) protects it (exit 2, with why).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import structlog

from duomo.gateway.http_front import HttpFront, HttpOptions, http_server
from duomo.gateway.link import SupervisorLink
from duomo.gateway.memory_keeper import MemoryKeeper
from duomo.gateway.regions import Regions
from duomo.ipc.endpoints import is_loopback, parse_endpoint
from duomo.ipc.host_memory import (
    M_ARENA_MAX,
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    set_malloc_options,
)
from duomo.ipc.logs import configure_logging
from duomo.ipc.readiness import report_ready

log = structlog.get_logger("duomo.gateway")
VERSION = "0.1.0"
STOP_GRACE_S = 5.0
CONNECT_WAIT_S = 5.0  # how long READY waits for the supervisor
EXTENSIONS = ("binary_tensor_data", "model_configuration", "model_repository", "statistics")


@dataclass(frozen=True)
class GatewayOptions:
    """One gateway worker's settings, from its command line: the supervisor's socket, the
    addresses served (None: that front is off), shared memory, limits, TLS and timeouts."""

    socket: Path
    http: tuple[str, int] | None  # None: no HTTP front
    grpc: tuple[str, int] | None
    slots: int
    allow_shm: bool
    max_body_bytes: int
    token: str | None
    tls: tuple[Path, Path] | None  # certificate, key
    regions_dir: Path
    request_timeout_s: float
    header_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float
    loop: str = "uvloop"

    @property
    def extensions(self) -> tuple[str, ...]:
        return EXTENSIONS + (("system_shared_memory",) if self.allow_shm else ())


def address(value: str) -> tuple[str, int]:
    try:
        return parse_endpoint(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_args(argv: list[str] | None = None) -> tuple[GatewayOptions, int | None]:
    """The options, and the file descriptor to report readiness on."""
    parser = argparse.ArgumentParser(
        prog="python -m duomo.gateway", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--socket", type=Path, required=True, help="the supervisor's socket")
    parser.add_argument("--http", type=address, help="HOST:PORT for HTTP/REST (none: off)")
    parser.add_argument("--grpc", type=address, help="HOST:PORT for gRPC (none: off)")
    parser.add_argument("--slots", type=int, default=16, help="slots per model (concurrency)")
    parser.add_argument(
        "--allow-shm", action="store_true", help="the system shared-memory extension"
    )
    parser.add_argument("--max-body-mb", type=float, default=64.0)
    parser.add_argument("--token-file", type=Path, help="a file holding the bearer token")
    parser.add_argument("--tls-cert", type=Path)
    parser.add_argument("--tls-key", type=Path)
    parser.add_argument("--regions-dir", type=Path, help="shared-memory registrations (default: "
                        "<socket>.gateway/regions)")  # fmt: skip
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop",
                        help="the event loop (see tools/bench/experiments/"
                        "bench_http_stack.py)")  # fmt: skip
    parser.add_argument("--request-timeout-s", type=float, default=60.0)
    parser.add_argument("--header-timeout-s", type=float, default=10.0)
    parser.add_argument("--body-timeout-s", type=float, default=30.0)
    parser.add_argument("--idle-timeout-s", type=float, default=30.0)
    parser.add_argument("--ready-fd", type=int, help="write READY (or ERROR reason) here")
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    parser.add_argument("--log-json", action="store_true", help="JSON lines instead of text")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_json)
    if args.http is None and args.grpc is None:
        parser.error("give --http, --grpc or both")
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    token = None
    if args.token_file is not None:
        token = args.token_file.read_text(encoding="utf-8").strip()
        if not token:
            parser.error(f"{args.token_file} holds no token")
    regions = args.regions_dir or Path(f"{args.socket}.gateway") / "regions"
    options = GatewayOptions(
        socket=args.socket, http=args.http, grpc=args.grpc, slots=args.slots,
        allow_shm=args.allow_shm, max_body_bytes=int(args.max_body_mb * (1 << 20)),
        token=token, tls=(args.tls_cert, args.tls_key) if args.tls_cert else None,
        regions_dir=regions, request_timeout_s=args.request_timeout_s,
        header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
        idle_timeout_s=args.idle_timeout_s,
        loop=args.loop,
    )  # fmt: skip
    return options, args.ready_fd


HEAP_KEEP_BYTES = 64 << 20


def keep_request_buffers() -> None:
    """Keep request-sized buffers in glibc's heap (a no-op elsewhere). By default a block over
    128 KiB is mapped on its own and the heap's top is trimmed after a free, so a 720 KB image
    body came as 180 fresh pages faulted in on every request: 0.8 ms of a 2.4 ms round trip
    (``tools/bench/experiments/bench_http_stack.py``, classify with a 400×600 image). Blocks up to
    half of ``HEAP_KEEP_BYTES`` now come from the heap, which keeps up to ``HEAP_KEEP_BYTES``
    free. Every thread allocates from that one heap (one arena): ``malloc_trim`` gives back the
    free pages of an arena's middle but never the top of a thread's own arena, so a 27 MB gRPC
    message received on gRPC's thread stayed resident for good (``gateway.memory_keeper``, which
    trims the heap once the worker is quiet). Measured with one arena against the default: HTTP
    and gRPC answers/s the same within noise (4 clients, affine and classify)."""
    set_malloc_options(
        {
            M_MMAP_THRESHOLD: HEAP_KEEP_BYTES // 2,
            M_TRIM_THRESHOLD: HEAP_KEEP_BYTES,
            M_ARENA_MAX: 1,
        }
    )


def exposure_problem(options: GatewayOptions) -> str | None:
    """Why the gateway must not start as configured: a port open beyond loopback with nothing
    to protect it."""
    if options.token is not None or options.tls is not None:
        return None
    for bound in (options.http, options.grpc):
        if bound is not None and not is_loopback(bound[0]):
            return (
                f"{bound[0]}:{bound[1]} is not a loopback address: give a bearer token "
                "(gateway.token_file) or TLS (gateway.tls_cert, tls_key) to listen there"
            )
    return None


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound with SO_REUSEPORT, so every worker of a gateway shares the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # (IPPROTO_TCP named: asyncio sets TCP_NODELAY on accepted sockets only when it is, and
    # without it a response written in two parts waits for the client's delayed ACK, 40 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def serve(options: GatewayOptions, ready_fd: int | None) -> None:
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    from duomo.gateway.grpc_front import GrpcFront, TokenInterceptor

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    link = SupervisorLink(options.socket, options.slots, options.request_timeout_s)
    regions = Regions(options.regions_dir, options.allow_shm)
    sweeper = asyncio.create_task(regions.sweeping()) if options.allow_shm else None
    http_task = http = None
    if options.http is not None:
        sock = listening_socket(*options.http)
        front = HttpFront(link, regions, HttpOptions(
            options.max_body_bytes, options.token, options.extensions, VERSION,
        ))  # fmt: skip
        http = http_server(
            front, options.header_timeout_s, options.body_timeout_s, options.idle_timeout_s,
            options.tls,
        )  # fmt: skip
        http_task = asyncio.create_task(http.serve(sockets=[sock]))
    grpc_server = None
    if options.grpc is not None:
        grpc_server = grpc.aio.server(
            interceptors=[TokenInterceptor(options.token)] if options.token else None,
            options=[
                ("grpc.so_reuseport", 1),
                ("grpc.max_receive_message_length", options.max_body_bytes),
                ("grpc.max_send_message_length", options.max_body_bytes),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.max_connection_idle_ms", int(options.idle_timeout_s * 1000)),
            ],
        )
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            GrpcFront(link, regions, options.extensions, VERSION), grpc_server
        )
        target = f"{options.grpc[0]}:{options.grpc[1]}"
        if options.tls is not None:
            cert, key = (p.read_bytes() for p in options.tls)
            bound = grpc_server.add_secure_port(target, grpc.ssl_server_credentials([(key, cert)]))
        else:
            bound = grpc_server.add_insecure_port(target)
        if not bound:
            raise OSError(f"cannot bind gRPC to {target}")
        await grpc_server.start()
    await link.start()
    if http is not None:
        while not http.started and not (http_task is not None and http_task.done()):
            await asyncio.sleep(0.01)
        if http_task is not None and http_task.done():
            http_task.result()  # (raises why it stopped)
    await link.wait_connected(CONNECT_WAIT_S)  # (ready without it: health says so meanwhile)
    keeper = asyncio.create_task(MemoryKeeper(link).run())
    report_ready(ready_fd, "READY")
    log.info(
        "gateway worker ready", pid=os.getpid(), socket=str(options.socket),
        http=options.http, grpc=options.grpc, slots=options.slots,
    )  # fmt: skip
    await stop.wait()
    keeper.cancel()
    if grpc_server is not None:
        await grpc_server.stop(STOP_GRACE_S)
    if http is not None and http_task is not None:
        http.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(http_task, STOP_GRACE_S + 1)
    await link.close()
    if sweeper is not None:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
    regions.close()


def main(argv: list[str] | None = None) -> int:
    options, ready_fd = parse_args(argv)
    problem = exposure_problem(options)
    if problem is not None:
        report_ready(ready_fd, f"ERROR {problem}")
        print(f"duomo gateway: {problem}", file=sys.stderr)
        return 2
    keep_request_buffers()
    if options.loop == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        asyncio.run(serve(options, ready_fd))
    except OSError as err:
        report_ready(ready_fd, f"ERROR {err}")
        print(f"duomo gateway: {err}", file=sys.stderr)
        return 1
    return 0
