"""Worker processes the supervisor runs beside itself — the gateway's, the source fleet's: each
started and awaited until it reports ready, one that dies started again (bounded, logged), all
stopped on the way out.

``ChildProcesses(kind, command, count, max_restarts, thread=…)`` runs ``count`` copies of
``command(index)``, each given ``--ready-fd FD`` to report ``READY`` (``ipc.readiness``) within
``START_TIMEOUT_S``. A worker that exits is started again after ``RESTART_BACKOFF_S`` (doubling, at
most ``RESTART_BACKOFF_MAX_S``); more than ``max_restarts`` restarts of one worker within
``RESTART_WINDOW_S`` and it stays down (``gave_up``: ``status`` shows it, the log says why).
``on_exit(index)`` and ``on_started(index, pid)``, when given, are called on the watcher thread
when a worker is seen to have exited and when one (re)starts: the source fleet moves a dead
worker's sources to the others at once, and gives the restarted worker new ones.

Threads: ``start`` and ``stop`` run on the caller's; one watcher thread polls the processes every
``WATCH_PERIOD_S`` and is the one writer of their state once ``start`` returned (their readers,
the gateways' ``status``, read it as it is; ``stop`` waits for the watcher before it touches it).
Used by ``supervisor.process.gateways`` and ``supervisor.sources.workers``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from duomo.ipc.readiness import read_ready_line

log = structlog.get_logger("duomo.children")
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
WATCH_PERIOD_S = 0.2
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
RESTART_WINDOW_S = 300.0


@dataclass
class ChildWorker:
    """One worker process and its restart history."""

    index: int
    process: subprocess.Popen[bytes] | None = None
    restarts: deque[float] = field(default_factory=deque)  # when it was started again
    next_start_s: float | None = None  # a restart is due then
    gave_up: bool = False
    last_exit: int | None = None

    @property
    def pid(self) -> int | None:
        process = self.process  # (read once: the watcher may replace it meanwhile)
        return process.pid if process is not None and process.poll() is None else None


def stop_orphans(module: str, socket_path: Path) -> None:
    """Stop the ``python -m module`` workers left serving ``socket_path`` by a supervisor that
    was killed (a gateway worker outlives it, answering 503 until one is back); its successor
    starts its own."""
    import psutil

    target = str(socket_path)
    orphans = []
    for process in psutil.process_iter(["cmdline", "uids"]):
        command = process.info["cmdline"] or []
        if (
            command[1:3] == ["-m", module]
            and target in command
            and command[command.index(target) - 1] == "--socket"
            and process.info["uids"] is not None
            and process.info["uids"].real == os.getuid()
        ):
            orphans.append(process)
    for process in orphans:
        log.warning(
            "stopping a worker left by an earlier supervisor", pid=process.pid, module=module
        )
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(orphans, timeout=STOP_GRACE_S)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


class ChildProcesses:
    """``count`` worker processes of one ``kind``: started and awaited until each is READY, one
    that dies restarted (bounded), all stopped by ``stop``."""

    def __init__(
        self,
        kind: str,
        command: Callable[[int], list[str]],
        count: int,
        max_restarts: int,
        on_exit: Callable[[int], None] | None = None,
        on_started: Callable[[int, int], None] | None = None,
        thread: str = "duomo-children",
    ) -> None:
        self.kind = kind
        self.thread = thread
        self.command = command
        self.max_restarts = max_restarts
        self.on_exit = on_exit
        self.on_started = on_started
        self.workers = [ChildWorker(i) for i in range(count)]
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        """Start every worker and wait for each to report READY; RuntimeError (every worker
        stopped) with the first one's reason when one cannot start."""
        try:
            for worker in self.workers:
                pid = self._start(worker)
                if self.on_started is not None:
                    self.on_started(worker.index, pid)
        except RuntimeError:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._watch, name=self.thread, daemon=True)
        self._watcher.start()

    def _start(self, worker: ChildWorker) -> int:
        """Start ``worker`` and wait for its READY; its pid."""
        read_fd, write_fd = os.pipe()
        command = [*self.command(worker.index), "--ready-fd", str(write_fd)]
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
        raise RuntimeError(f"{self.kind} {worker.index} did not start: {line or 'no answer'}")

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_PERIOD_S):
            now = time.monotonic()
            for worker in self.workers:
                if self._stopping.is_set():
                    return
                self._tend(worker, now)

    def _tend(self, worker: ChildWorker, now: float) -> None:
        """Note a worker that exited; start it again when due."""
        process = worker.process
        if process is not None and process.poll() is not None:
            worker.last_exit = process.returncode
            worker.process = None
            if self.on_exit is not None:
                self.on_exit(worker.index)
            while worker.restarts and now - worker.restarts[0] > RESTART_WINDOW_S:
                worker.restarts.popleft()
            if len(worker.restarts) >= self.max_restarts:
                worker.gave_up = True
                log.error(
                    f"{self.kind} keeps exiting; not restarted", worker=worker.index,
                    exit_code=process.returncode, restarts=len(worker.restarts),
                    window_s=RESTART_WINDOW_S,
                )  # fmt: skip
                return
            delay = min(RESTART_BACKOFF_S * 2 ** len(worker.restarts), RESTART_BACKOFF_MAX_S)
            worker.next_start_s = now + delay
            log.warning(
                f"{self.kind} exited; restarting", worker=worker.index,
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
                log.error(f"{self.kind} restart failed", worker=worker.index, error=str(err))
                worker.next_start_s = now + RESTART_BACKOFF_MAX_S
            else:
                log.info(f"{self.kind} restarted", worker=worker.index, pid=pid)
                if self.on_started is not None:
                    self.on_started(worker.index, pid)

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
    def _kill(worker: ChildWorker) -> None:
        if worker.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            worker.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.process.wait(10)
        worker.process = None
