"""The gateway's worker processes as the supervisor runs them: the ``gateway`` config section,
starting each worker (``python -m duomo.gateway``) and waiting for its readiness, restarting one
that dies (bounded, logged), and stopping them.

Used by ``Supervisor`` (``duomo start`` with a ``gateway:`` section starts the workers once
the models are READY and stops them first on ``duomo stop``) and by ``duomo gateway`` (the
same workers in the foreground). The gateway itself (``gateway/``) imports only ``ipc``; this
module only builds its command line.

Restarts: a worker that exits is started again after ``RESTART_BACKOFF_S`` (doubling, at most
``RESTART_BACKOFF_MAX_S``); more than ``max_restarts`` restarts of one worker within
``RESTART_WINDOW_S`` and it stays down (``status`` shows it, the log says why).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from pydantic import Field, field_validator, model_validator

from duomo.ipc.endpoints import is_loopback, parse_endpoint
from duomo.ipc.logs import log_args
from duomo.ipc.readiness import read_ready_line
from duomo.worker.config_model import StrictModel

log = structlog.get_logger("duomo.gateways")
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
WATCH_PERIOD_S = 0.2
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
RESTART_WINDOW_S = 300.0


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


def stop_orphans(socket_path: Path) -> None:
    """Stop gateway workers left serving ``socket_path`` by a supervisor that was killed (they
    outlive it, answering 503 until one is back; its successor starts its own)."""
    import psutil

    target = str(socket_path)
    orphans = []
    for process in psutil.process_iter(["cmdline", "uids"]):
        command = process.info["cmdline"] or []
        if (
            command[1:3] == ["-m", "duomo.gateway"]
            and target in command
            and command[command.index(target) - 1] == "--socket"
            and process.info["uids"] is not None
            and process.info["uids"].real == os.getuid()
        ):
            orphans.append(process)
    for process in orphans:
        log.warning("stopping a gateway worker left by an earlier supervisor", pid=process.pid)
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(orphans, timeout=STOP_GRACE_S)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


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
        sys.executable, "-m", "duomo.gateway", "--socket", str(socket_path), *log_args(),
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


@dataclass
class GatewayWorker:
    """One worker process and its restart history."""

    index: int
    process: subprocess.Popen[bytes] | None = None
    restarts: deque[float] = field(default_factory=deque)  # when it was started again
    next_start_s: float | None = None  # a restart is due then
    gave_up: bool = False
    last_exit: int | None = None


class GatewayProcesses:
    """The gateway's worker processes: started and awaited until each is READY, one that dies
    restarted (bounded), all stopped by ``stop``."""

    def __init__(self, config: GatewayConfig, socket_path: Path) -> None:
        self.config = config
        self.socket_path = socket_path
        self.workers = [GatewayWorker(i) for i in range(config.workers)]
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        """Start every worker and wait for each to report READY; RuntimeError (every worker
        stopped) with the first one's reason when one cannot start, or when a port is taken
        (the workers share theirs with SO_REUSEPORT, which would let them share another
        server's of the same user unnoticed)."""
        stop_orphans(self.socket_path)
        for bound in (self.config.http, self.config.grpc):
            if bound is not None:
                _refuse_if_taken(bound)
        try:
            for worker in self.workers:
                self._start(worker)
        except RuntimeError:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._watch, name="duomo-gateways", daemon=True)
        self._watcher.start()
        log.info(
            "gateway started", workers=len(self.workers), http=self.config.http,
            grpc=self.config.grpc, pids=[w.process.pid for w in self.workers if w.process],
        )  # fmt: skip

    def _start(self, worker: GatewayWorker) -> int:
        """Start ``worker`` and wait for its READY; its pid."""
        read_fd, write_fd = os.pipe()
        command = [*gateway_command(self.config, self.socket_path), "--ready-fd", str(write_fd)]
        try:
            process = worker.process = subprocess.Popen(
                command, pass_fds=(write_fd,), stdin=subprocess.DEVNULL, start_new_session=True
            )
        finally:
            os.close(write_fd)
        try:
            line = read_ready_line(read_fd, START_TIMEOUT_S)
        finally:
            os.close(read_fd)
        if line == "READY":
            return process.pid
        self._kill(worker)
        raise RuntimeError(f"gateway worker {worker.index} did not start: {line or 'no answer'}")

    def _watch(self) -> None:
        """The watcher thread: the one writer of the workers' state once ``start`` returned
        (``status`` reads it as it is; ``stop`` waits for this thread before it touches it)."""
        while not self._stopping.wait(WATCH_PERIOD_S):
            now = time.monotonic()
            for worker in self.workers:
                if self._stopping.is_set():
                    return
                self._tend(worker, now)

    def _tend(self, worker: GatewayWorker, now: float) -> None:
        """Note a worker that exited; start it again when due."""
        process = worker.process
        if process is not None and process.poll() is not None:
            worker.last_exit = process.returncode
            worker.process = None
            while worker.restarts and now - worker.restarts[0] > RESTART_WINDOW_S:
                worker.restarts.popleft()
            if len(worker.restarts) >= self.config.max_restarts:
                worker.gave_up = True
                log.error(
                    "gateway worker keeps exiting; not restarted", worker=worker.index,
                    exit_code=process.returncode, restarts=len(worker.restarts),
                    window_s=RESTART_WINDOW_S,
                )  # fmt: skip
                return
            delay = min(RESTART_BACKOFF_S * 2 ** len(worker.restarts), RESTART_BACKOFF_MAX_S)
            worker.next_start_s = now + delay
            log.warning(
                "gateway worker exited; restarting", worker=worker.index,
                exit_code=process.returncode, in_s=delay,
            )  # fmt: skip
        if (
            worker.process is None
            and worker.next_start_s is not None
            and now >= worker.next_start_s
        ):
            worker.next_start_s = None
            worker.restarts.append(now)
            try:
                pid = self._start(worker)
            except (RuntimeError, OSError) as err:
                log.error("gateway worker restart failed", worker=worker.index, error=str(err))
                worker.next_start_s = now + RESTART_BACKOFF_MAX_S
            else:
                log.info("gateway worker restarted", worker=worker.index, pid=pid)

    def stop(self) -> None:
        """SIGTERM every worker (each finishes what it serves), SIGKILL any still there after
        ``STOP_GRACE_S``; a restart in progress finishes first."""
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(START_TIMEOUT_S + 5)
        for worker in self.workers:
            if worker.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for worker in self.workers:
            if worker.process is not None:
                try:
                    worker.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._kill(worker)
                worker.process = None

    @staticmethod
    def _kill(worker: GatewayWorker) -> None:
        if worker.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            worker.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.process.wait(10)
        worker.process = None

    def status(self) -> list[dict[str, Any]]:
        shown = []
        for w in self.workers:
            process = w.process  # (read once: the watcher may replace it meanwhile)
            shown.append(
                {
                    "worker": w.index,
                    "pid": process.pid if process is not None else None,
                    "running": process is not None and process.poll() is None,
                    "restarts": len(w.restarts),
                    "gave_up": w.gave_up,
                    "last_exit": w.last_exit,
                    "http": self.config.http,
                    "grpc": self.config.grpc,
                }
            )
        return shown
