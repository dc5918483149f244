"""Starting and stopping the servers of each ``duomo bench`` mode, and telling producers how to
reach them.

- ``duomo``: one supervisor serving every model of the workload (``duomo start`` on a config made
  from the workload's supervisor config, only those models); ``duomo-scraped``: the same with
  its ``/metrics`` on, which ``tools.bench.mixed_load`` scrapes every ``scrape_every_s`` (the A/B of
  what a scrape costs, interleaved with ``duomo`` in one run);
- ``duomo-http`` / ``duomo-grpc``: the same supervisor with its KServe v2 gateway (one worker),
  reached over HTTP (binary tensors) or gRPC (raw contents): like for like with the peers;
- ``per-model`` / ``per-model-tuned``: one supervisor per model, each with its own backend init.
  ``per-model`` runs ONNX Runtime's own session defaults, what a hand-rolled server per model gets
  (intra-op threads = the cores, spinning on, an arena per session, memory patterns); ``-tuned``
  is the same with one intra-op thread per process;
- ``triton`` / ``mosec``: the peers from ``tools.bench.peers``, one instance per model;
- the overhead's floors (``FloorServer``, next to ``duomo``'s probe only): one bare
  ``tools.bench.floor`` process per model, with one thread or (``handoff``) two.

Used by ``tools.bench.mixed_load`` and the other parts; every server listens on loopback or a
private Unix socket only, and ``stop`` ends every process it started (SIGTERM to the process
group, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import yaml

from duomo.ipc.runtime_dir import pid_path
from duomo.supervisor.dataflow.pipeline_config import entries_over
from tools.bench import peers
from tools.bench.workload import GATEWAY_MODES

START_TIMEOUT_S = 300.0
# the peers open the same executors the way a user wrapping them would: ONNX Runtime's own arena
# per session and memory patterns (their apps give every session one intra-op thread)
PEER_ORT: dict[str, Any] = {"shared_cpu_arena": False, "memory_pattern": "on"}
# ONNX Runtime's defaults for a session: as many intra-op threads as cores, spinning while idle,
# an arena of its own, memory patterns
ORT_THREAD_DEFAULTS: dict[str, Any] = {
    "thread_budget": None,
    "allow_spinning": True,
    "shared_cpu_arena": False,
    "memory_pattern": "on",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def supervisor_config(
    base: Path,
    models: list[str],
    out: Path,
    onnxruntime: dict[str, Any] | None = None,
    gateway: dict[str, Any] | None = None,
    metrics_port: int | None = None,
) -> Path:
    """``base`` with only ``models`` (in that order), absolute model paths, the
    ``backends.onnxruntime`` settings in ``onnxruntime`` replaced, and the ``gateway`` and
    ``metrics`` sections given (none by default); the pipelines over those models only."""
    raw = yaml.safe_load(base.read_text(encoding="utf-8"))
    root = raw.get("model_root")
    raw["model_root"] = str((base.parent / root).resolve()) if root else str(base.parent)
    by_name = {m["name"]: m for m in raw["models"]}
    raw["models"] = [by_name[name] for name in models]
    raw["pipelines"] = entries_over(raw.get("pipelines"), models)
    raw.pop("gateway", None)
    if gateway is not None:
        raw["gateway"] = gateway
    raw.pop("metrics", None)
    if metrics_port is not None:
        raw["metrics"] = {"http": f"127.0.0.1:{metrics_port}"}
    raw.setdefault("backends", {}).setdefault("onnxruntime", {}).update(onnxruntime or {})
    out.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return out


class ModeServers(ABC):
    """The servers of one mode: started, serving, stopped."""

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def pids(self) -> list[int]:
        """The root processes (their descendants count too)."""

    @abstractmethod
    def target(self, model: str) -> dict[str, Any]:
        """How a producer reaches ``model`` (the producer's ``target``)."""

    @abstractmethod
    def stop(self) -> None: ...


class DuomoServers(ModeServers):
    """One supervisor per group of models: one group for ``duomo``, one per model otherwise;
    with ``transport`` (``duomo-http``, ``duomo-grpc``) one group and its gateway, reached over
    that transport."""

    def __init__(
        self,
        base: Path,
        groups: list[list[str]],
        workdir: Path,
        onnxruntime: dict[str, Any] | None = None,
        transport: str | None = None,
        metrics: bool = False,
    ) -> None:
        self.sockets: dict[str, Path] = {}
        self.metrics_ports: list[int] = []  # each supervisor's /metrics, when asked for
        self.configs: list[tuple[Path, Path]] = []
        self.transport = transport
        self.ports = {"http": free_port(), "grpc": free_port()}
        gateway: dict[str, Any] | None = None
        if transport is not None:  # slots: every producer of a model at once, and then some
            gateway = {kind: f"127.0.0.1:{port}" for kind, port in self.ports.items()}
            gateway["slots"] = 16
        for i, group in enumerate(groups):
            metrics_port = free_port() if metrics else None
            if metrics_port is not None:
                self.metrics_ports.append(metrics_port)
            config = supervisor_config(
                base, group, workdir / f"duomo-{i}.yaml", onnxruntime, gateway, metrics_port
            )
            sock = workdir / f"duomo-{i}.sock"
            self.configs.append((config, sock))
            self.sockets.update({name: sock for name in group})
        self._pids: list[int] = []

    def _cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "duomo.supervisor", *args],
            capture_output=True, text=True, timeout=START_TIMEOUT_S,
        )  # fmt: skip

    def start(self) -> None:
        for config, sock in self.configs:  # one after another, as a user's units would start
            done = self._cli("start", "-c", str(config), "--socket", str(sock))
            if done.returncode != 0:
                self.stop()
                raise RuntimeError(f"duomo start -c {config} failed: {done.stdout}{done.stderr}")
            self._pids.append(int(pid_path(sock).read_text().strip()))

    def pids(self) -> list[int]:
        return list(self._pids)

    def target(self, model: str) -> dict[str, Any]:
        if self.transport is not None:
            return {"kind": f"duomo-{self.transport}", "port": self.ports[self.transport]}
        return {"kind": "duomo", "socket": str(self.sockets[model])}

    def stop(self) -> None:
        for _, sock in self.configs:
            if pid_path(sock).exists():
                self._cli("stop", "--socket", str(sock))
        self._pids.clear()


class _PeerProcess(ModeServers):
    """A peer started as one process group, ready once every model answers a request."""

    name = ""

    def __init__(self, base: Path, models: list[str], workdir: Path) -> None:
        self.config = supervisor_config(base, models, workdir / f"{self.name}.yaml", PEER_ORT)
        self.models = models
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log = workdir / f"{self.name}.log"

    @abstractmethod
    def command(self) -> tuple[list[str], dict[str, str]]: ...

    def start(self) -> None:
        command, environ = self.command()
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                command, env=environ, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.workdir,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited at start-up; see {self.log}")
            if self._ready():
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not ready within {START_TIMEOUT_S:.0f} s; see {self.log}")

    @abstractmethod
    def _ready(self) -> bool: ...

    def pids(self) -> list[int]:
        return [self.process.pid] if self.process else []

    def target(self, model: str) -> dict[str, Any]:
        return {"kind": self.name, "port": self.port}

    def stop(self) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass
        self.process = None


class TritonServer(_PeerProcess):
    name = "triton"
    grpc_port: int | None = None  # gRPC too, on this port (not in ``duomo bench``'s mode)

    def command(self) -> tuple[list[str], dict[str, str]]:
        env = peers.ensure_env("triton")
        repository = self.workdir / "triton-models"
        peers.triton_repository(repository, self.config, self.models)
        return peers.triton_command(
            env, repository, self.workdir / "triton-backends", self.port, self.grpc_port
        )

    def _ready(self) -> bool:
        import http.client

        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", "/v2/health/ready")
            return conn.getresponse().status == 200
        except OSError:
            return False


class MosecServer(_PeerProcess):
    name = "mosec"

    def command(self) -> tuple[list[str], dict[str, str]]:
        return peers.mosec_command(peers.ensure_env("mosec"), self.config, self.models, self.port)

    def _ready(self) -> bool:
        import http.client

        try:  # the front answers as soon as it listens; a worker answers once it has loaded
            for model in self.models:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
                conn.request("POST", f"/{model}", body=b"\x01\0\0\0\x01\0\0\0\x03\0\0\0abc")
                if conn.getresponse().status >= 500:
                    return False
            return True
        except OSError:
            return False


class FloorServer(ModeServers):
    """``tools.bench.floor`` processes, one per model, each serving one client: a floor of the
    per-request overhead, probed in the same client as Duomo; ``handoff``: the two-thread one."""

    def __init__(
        self, config: Path, models: list[str], workdir: Path, handoff: bool = False
    ) -> None:
        self.config = config
        self.models = models
        self.workdir = workdir
        self.handoff = handoff
        self.processes: dict[str, subprocess.Popen[str]] = {}
        self.targets: dict[str, dict[str, Any]] = {}

    def start(self) -> None:
        for model in self.models:
            sock = self.workdir / f"floor-{model}{'-handoff' if self.handoff else ''}.sock"
            args = [sys.executable, "-m", "tools.bench.floor", str(self.config), model, str(sock)]
            process = self.processes[model] = subprocess.Popen(
                args + (["--handoff"] if self.handoff else []),
                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                start_new_session=True,
            )  # fmt: skip
            assert process.stdout is not None
            line = process.stdout.readline().split()  # "ready SHM", or EOF if it failed
            if line[:1] != ["ready"]:
                self.stop()
                raise RuntimeError(f"the floor server for {model!r} failed to start")
            self.targets[model] = {"kind": "floor", "socket": str(sock), "shm": line[1]}

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values()]

    def target(self, model: str) -> dict[str, Any]:
        return self.targets[model]

    def stop(self) -> None:
        for process in self.processes.values():  # each ends when its one client has gone
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.terminate()  # never probed: it removes its segment and exits
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            if process.stdout is not None:
                process.stdout.close()
        self.processes.clear()


def servers_for(mode: str, base: Path, models: list[str], workdir: Path) -> ModeServers:
    if mode in ("duomo", "duomo-scraped"):
        return DuomoServers(base, [models], workdir, metrics=mode == "duomo-scraped")
    if mode in GATEWAY_MODES:
        return DuomoServers(base, [models], workdir, transport=GATEWAY_MODES[mode])
    if mode == "per-model":
        return DuomoServers(base, [[m] for m in models], workdir, ORT_THREAD_DEFAULTS)
    if mode == "per-model-tuned":
        return DuomoServers(
            base, [[m] for m in models], workdir, {**ORT_THREAD_DEFAULTS, "thread_budget": 1}
        )
    if mode == "triton":
        return TritonServer(base, models, workdir)
    if mode == "mosec":
        return MosecServer(base, models, workdir)
    raise ValueError(f"no servers for mode {mode!r}")
