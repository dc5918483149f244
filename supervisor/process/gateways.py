"""The gateway's worker processes as the supervisor runs them: the ``gateway`` config section,
starting each worker (``python -m duomo.gateway``) and waiting for its readiness, restarting one
that dies (bounded, logged), and stopping them.

Used by ``Supervisor`` (``duomo start`` with a ``gateway:`` section starts the workers once
the models are READY and stops them first on ``duomo stop``) and by ``duomo gateway`` (the
same workers in the foreground). The gateway itself (``gateway/``) imports only ``ipc``; this
module only builds its command line.

Restarts: as ``supervisor.process.child_processes`` runs every worker process of the supervisor's (a
worker that exits is started again with backoff; more than ``max_restarts`` restarts of one
within ``RESTART_WINDOW_S`` and it stays down; ``status`` shows it, the log says why).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import structlog
from pydantic import Field, field_validator, model_validator

from duomo.ipc.endpoints import is_loopback, parse_endpoint
from duomo.ipc.logs import log_args
from duomo.ipc.status_records import GatewayWorkerStatus
from duomo.supervisor.process.child_processes import ChildProcesses, stop_orphans
from duomo.worker.config_model import StrictModel

log = structlog.get_logger("duomo.gateways")
GATEWAY_MODULE = "duomo.gateway"  # each worker is python -m GATEWAY_MODULE


class GatewayConfig(StrictModel):
    """The ``gateway`` section: where the v2 fronts listen and what protects them."""

    http: str | None = "127.0.0.1:8000"  # HOST:PORT, or null for no HTTP front
    grpc: str | None = "127.0.0.1:8001"
    workers: int = Field(default=1, ge=1, le=64)
    slots: int = Field(default=16, ge=1, le=64)  # per model and worker: its concurrency
    allow_shm: bool = False
    max_body_mb: float = Field(default=64.0, gt=0, le=4096)
    token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    request_timeout_s: float = Field(default=60.0, gt=0, le=86400)
    header_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    body_timeout_s: float = Field(default=30.0, gt=0, le=86400)
    idle_timeout_s: float = Field(default=30.0, gt=0, le=86400)
    max_restarts: int = Field(default=5, ge=0, le=1000)

    @field_validator("http", "grpc")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            parse_endpoint(value)  # (ValueError: not HOST:PORT)
        return value

    @model_validator(mode="after")
    def _protected_beyond_loopback(self) -> GatewayConfig:
        if self.http is None and self.grpc is None:
            raise ValueError("give http, grpc or both (or leave the gateway section out)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.token_file is None and self.tls_cert is None:
            for bound in (self.http, self.grpc):
                if bound is not None and not is_loopback(parse_endpoint(bound)[0]):
                    raise ValueError(
                        f"{bound} is not a loopback address: give token_file (a bearer token) "
                        "or tls_cert and tls_key to listen there"
                    )
        return self

    def resolved(self, base: Path) -> GatewayConfig:
        """Its file paths made absolute against ``base`` (the config file's folder)."""
        updates = {
            name: (base / value).resolve()
            for name in ("token_file", "tls_cert", "tls_key")
            if (value := getattr(self, name)) is not None
        }
        return self.model_copy(update=updates)

    def missing_files(self) -> list[tuple[str, str]]:
        return [
            (name, f"file not found: {value}")
            for name in ("token_file", "tls_cert", "tls_key")
            if (value := getattr(self, name)) is not None and not Path(value).is_file()
        ]


def _refuse_if_taken(bound: str) -> None:
    host, port = parse_endpoint(bound)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR: past connections in TIME_WAIT do not count; no SO_REUSEPORT: a
        # listener that holds the port does
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise RuntimeError(f"cannot listen on {bound}: {err.strerror}") from None


def gateway_command(config: GatewayConfig, socket_path: Path) -> list[str]:
    """``python -m duomo.gateway`` with the section's settings (and this process's log format)."""
    command = [
        sys.executable, "-m", GATEWAY_MODULE, "--socket", str(socket_path), *log_args(),
        "--slots", str(config.slots), "--max-body-mb", str(config.max_body_mb),
        "--request-timeout-s", str(config.request_timeout_s),
        "--header-timeout-s", str(config.header_timeout_s),
        "--body-timeout-s", str(config.body_timeout_s),
        "--idle-timeout-s", str(config.idle_timeout_s),
    ]  # fmt: skip
    for flag, value in (
        ("--http", config.http),
        ("--grpc", config.grpc),
        ("--token-file", config.token_file),
        ("--tls-cert", config.tls_cert),
        ("--tls-key", config.tls_key),
    ):
        if value is not None:
            command += [flag, str(value)]
    if config.allow_shm:
        command.append("--allow-shm")
    return command


class GatewayProcesses:
    """The gateway's worker processes (``ChildProcesses``): started once its ports are known to
    be free, one that dies restarted (bounded), all stopped by ``stop``."""

    def __init__(self, config: GatewayConfig, socket_path: Path) -> None:
        self.config = config
        self.socket_path = socket_path
        self.children = ChildProcesses(
            "gateway worker",
            lambda index: gateway_command(config, socket_path),
            config.workers,
            config.max_restarts,
            thread="duomo-gateways",
        )

    def start(self) -> None:
        """Start every worker and wait for each to report READY; RuntimeError (every worker
        stopped) with the first one's reason when one cannot start, or when a port is taken
        (the workers share theirs with SO_REUSEPORT, which would let them share another
        server's of the same user unnoticed)."""
        stop_orphans(GATEWAY_MODULE, self.socket_path)
        for bound in (self.config.http, self.config.grpc):
            if bound is not None:
                _refuse_if_taken(bound)
        self.children.start()
        log.info(
            "gateway started", workers=self.config.workers, http=self.config.http,
            grpc=self.config.grpc, pids=[w.pid for w in self.children.workers],
        )  # fmt: skip

    def stop(self) -> None:
        """Every worker stopped (each finishes what it serves first)."""
        self.children.stop()

    def status(self) -> tuple[GatewayWorkerStatus, ...]:
        """Each worker's status record: its index, pid, whether it runs, its restarts, whether
        it was given up on, its last exit code, and the endpoints it serves."""
        shown = []
        for w in self.children.workers:
            process = w.process  # (read once: the watcher may replace it meanwhile)
            shown.append(
                GatewayWorkerStatus(
                    worker=w.index,
                    pid=process.pid if process is not None else None,
                    running=process is not None and process.poll() is None,
                    restarts=len(w.restarts),
                    gave_up=w.gave_up,
                    last_exit=w.last_exit,
                    http=self.config.http,
                    grpc=self.config.grpc,
                )
            )
        return tuple(shown)
