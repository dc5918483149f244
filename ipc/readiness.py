"""The readiness line a child process reports on an inherited pipe: ``READY`` or ``ERROR
<reason>``, one line, and reading it with a deadline.

Written by ``duomo start --foreground --ready-fd`` (``supervisor.process.daemon``) and by a gateway
worker (``gateway.main``); read by ``duomo start``, by ``supervisor.process.gateways`` from each
gateway worker, and by the tests' harness. In ``ipc`` because the gateway imports nothing else of
Duomo's.
"""

from __future__ import annotations

import contextlib
import os
import select
import time


def report_ready(fd: int | None, line: str) -> None:
    """Write ``line`` (one line) to ``fd`` and close it; nothing if ``fd`` is None."""
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.write(fd, (line.replace("\n", " ") + "\n").encode())
        os.close(fd)


def read_ready_line(fd: int, timeout_s: float) -> str:
    """The first line written to ``fd`` within ``timeout_s`` ("" if none, or EOF first)."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").split("\n", 1)[0].strip()
