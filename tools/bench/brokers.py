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
from dataclasses import dataclass
from pathlib import Path

import psutil

READY_TIMEOUT_S = 15.0
PROGRAMS = {"mqtt": ("mosquitto", "mosquitto"), "redis": ("redis-server", "redis-server")}


@dataclass(frozen=True)
class LocalBroker:
    """A broker the benchmark started: where to reach it, and its process (for its CPU)."""

    kind: str
    url: str
    process: psutil.Process


def find_program(name: str, package: str) -> str:
    """The program's path (Debian puts mosquitto in /usr/sbin, which a PATH may lack)."""
    for candidate in (shutil.which(name), f"/usr/sbin/{name}"):
        if candidate and Path(candidate).exists():
            return candidate
    raise RuntimeError(f"duomo bench --sinks needs {name}: apt-get install {package}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the broker exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the broker did not listen on {port}: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def running_broker(kind: str, folder: Path) -> Iterator[LocalBroker]:
    """A broker of ``kind`` ("mqtt": mosquitto, "redis": redis-server) in ``folder``."""
    program = find_program(*PROGRAMS[kind])
    folder.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    log = folder / f"{kind}.log"
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
    with log.open("ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_listening(process, port, log)
        yield LocalBroker(kind, url, psutil.Process(process.pid))
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
