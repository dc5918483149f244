"""Local brokers for ``duomo bench --sinks``: Debian's mosquitto and redis-server, each on a free
loopback port in a folder of the benchmark's own, anonymous and without persistence (what is
measured is the publishing side, not the broker's disk), stopped at the end.

``running_broker("mqtt" | "redis", folder)`` yields a ``LocalBroker``: its URL for a sink's
``url`` and its process (the broker's own CPU is reported beside the publisher's). The tests'
brokers (``tests/integration/brokers.py``) add what the tests need beyond this: users and
passwords, TLS, persistence, and stopping one mid-test.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tools.bench.servers import free_port

READY_TIMEOUT_S = 15.0
PROGRAMS = {"mqtt": ("mosquitto", "mosquitto"), "redis": ("redis-server", "redis-server")}


@dataclass
class Broker:
    """A broker process on ``port`` (``command`` starts it; its output goes to ``log``), which
    may be stopped and started again on the same port (an outage). Used by ``running_broker``
    and by the sink tests' brokers (``tests/integration/brokers.py``)."""

    name: str
    port: int
    command: list[str]
    log: Path
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> None:
        """Start it and wait until it listens; RuntimeError with its log's tail if it does
        not within ``READY_TIMEOUT_S``."""
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._listening():
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not listen: {self._log_tail()}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop it as its service would (SIGTERM: redis-server writes its AOF on the way)."""
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _listening(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited: {self._log_tail()}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.5):
            return True
        return False

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]


@dataclass(frozen=True)
class LocalBroker:
    """A broker the benchmark started: where to reach it, and its process (for its CPU)."""

    kind: str
    url: str
    process: psutil.Process


def find_program(name: str, package: str) -> str:
    """The program's path (Debian puts mosquitto in /usr/sbin, which a PATH may lack);
    RuntimeError naming the package when it is not installed."""
    for candidate in (shutil.which(name), f"/usr/sbin/{name}"):
        if candidate and Path(candidate).exists():
            return candidate
    raise RuntimeError(f"{name} is not installed: apt-get install {package}")


@contextlib.contextmanager
def running_broker(kind: str, folder: Path) -> Iterator[LocalBroker]:
    """A broker of ``kind`` ("mqtt": mosquitto, "redis": redis-server) in ``folder``."""
    program = find_program(*PROGRAMS[kind])
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    if kind == "mqtt":
        config = folder / "mosquitto.conf"
        config.write_text(
            f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
            "user root\nmax_queued_messages 1000000\nlog_type error\n"
        )
        command, url = [program, "-c", str(config)], f"mqtt://127.0.0.1:{port}"
    else:
        command = [program, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", str(folder)]  # fmt: skip
        url = f"redis://127.0.0.1:{port}/0"
    broker = Broker(PROGRAMS[kind][0], port, command, folder / f"{kind}.log")
    broker.start()
    try:
        assert broker.process is not None
        yield LocalBroker(kind, url, psutil.Process(broker.process.pid))
    finally:
        broker.stop()
