"""Running the supervisor as a service: in the foreground, or detached with a readiness report.

Called by ``duomo start``. ``run_foreground`` owns the process: signal handlers (SIGTERM/SIGINT:
graceful stop; SIGHUP: reload the config), the pid file, and the readiness line written to
``--ready-fd`` ("READY" or "ERROR <reason>"). Its exit code: 0 after a clean stop, 3 (``EXIT_CUT``)
when the grace period cut accepted requests, 1 when it could not start. ``start_background``
launches the same command detached (its own session, output to ``<socket>.log``) and returns only
once that line arrives, so ``duomo start`` exits 0 when every model is READY and non-zero with the
reason otherwise. ``stop`` asks a running supervisor to stop and waits until its process is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import structlog

from duomo.ipc.errors import DuomoError
from duomo.ipc.readiness import read_ready_line, report_ready
from duomo.ipc.runtime_dir import ensure_private_dir, log_path, pid_path
from duomo.supervisor.config import LoadedConfig
from duomo.supervisor.core.memory import tune_heap
from duomo.supervisor.process.server import Supervisor

log = structlog.get_logger("duomo.daemon")
START_TIMEOUT_S = 600.0
EXIT_CUT = 3  # stopped, but the grace period ran out: some accepted requests were cut


def run_foreground(loaded: LoadedConfig, socket_path: Path, ready_fd: int | None = None) -> int:
    tune_heap()  # before any thread of the supervisor starts
    supervisor = Supervisor(loaded, socket_path)
    signal.signal(signal.SIGTERM, lambda *_: supervisor.request_stop())
    signal.signal(signal.SIGINT, lambda *_: supervisor.request_stop())
    signal.signal(signal.SIGHUP, lambda *_: supervisor.request_reload())
    try:
        supervisor.start()
    except (RuntimeError, ValueError, OSError, DuomoError) as err:
        supervisor.shutdown()
        report_ready(ready_fd, f"ERROR {err}")
        print(f"duomo start: {err}", file=sys.stderr)
        return 1
    report_ready(ready_fd, "READY")
    supervisor.serve_forever()
    cut = supervisor.shutdown()
    return EXIT_CUT if cut else 0


def start_background(config: Path, socket_path: Path, log_level: str) -> int:
    ensure_private_dir(socket_path.parent)
    logfile = log_path(socket_path)
    read_fd, write_fd = os.pipe()
    command = [
        sys.executable, "-m", "duomo.supervisor", "--log-level", log_level,
        "start", "-c", str(config), "--socket", str(socket_path),
        "--foreground", "--ready-fd", str(write_fd),
    ]  # fmt: skip
    with open(logfile, "ab") as out:
        process = subprocess.Popen(
            command,
            pass_fds=(write_fd,),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    os.close(write_fd)
    line = read_ready_line(read_fd, START_TIMEOUT_S)
    os.close(read_fd)
    if line == "READY":
        print(f"duomo started: pid {process.pid}, socket {socket_path}, log {logfile}")
        return 0
    if not line:
        code = process.poll()
        line = f"the supervisor exited (code {code}) before it was ready"
        if code is None:
            process.terminate()
            line = f"the supervisor did not become ready in {START_TIMEOUT_S:.0f}s"
    print(f"duomo start: {line.removeprefix('ERROR ')} (log: {logfile})", file=sys.stderr)
    return 1


def wait_for_exit(socket_path: Path, timeout_s: float) -> bool:
    """True once the supervisor whose pid file sits beside ``socket_path`` has exited (a zombie
    its parent has not reaped yet counts as exited)."""
    try:
        pid = int(pid_path(socket_path).read_text().strip())
    except (FileNotFoundError, ValueError):
        return not socket_path.exists()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        except psutil.AccessDenied:
            return False
        time.sleep(0.05)
    return False
