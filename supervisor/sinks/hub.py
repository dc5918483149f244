"""The sinks the supervisor runs: the config's ``sinks:``, the one sink worker that delivers them,
what it last said about each, and where a source's events go.

**The sink worker** is ``python -m duomo.sinks.worker --socket S --directory D`` (``sinks``
imports only ``ipc``; this module only builds its command line), run by ``ChildProcesses`` as
the source workers are: awaited until READY, restarted when it dies (at most ``MAX_RESTARTS``
times in 5 minutes, each logged), stopped on ``duomo stop`` after the source workers (so the
last events they appended are still picked up while it drains). It starts with the supervisor
when the config has sinks, else with the first ``duomo reload`` that adds one. Every 0.5 s it
sends ``sink_report`` (each sink's ``SinkStatus``); the reply (``report``) carries the sink
definitions now, so a reload that adds, removes or changes sinks reaches it within a second,
without restarting any source.

**The files** live beside the socket: ``{socket}.sinks/`` (made private, 0700), holding each
sink's outbox (``{sink}.outbox.db``) and the sources' sequencer (``sequence.db``). Producers
(the source workers, ``duomo stream --sink``) append there; the sink worker delivers from there.

**Where a source's events go** (``plan``): its sinks' names and outbox bounds, the directory,
what it emits (``emit``, resolved) and its pipeline tracker's ``max_missed`` — the ``events``
of its assignment (``SourceDefinition.assignment``). The producers enforce the outbox bounds as
they append, so a reload that changes a sink's ``outbox`` bounds restarts the sources that name
it (their assignment changed); a change of its broker, credentials or topics restarts none.

Thread-safety: one lock over the definitions and reports; the reactor thread calls ``report``,
``status``, ``plan`` and ``target``, the control-job thread ``reload``. Owned by
``supervisor.process.server``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from duomo.ipc.errors import NotFoundError, UnavailableError, echoed
from duomo.ipc.logs import log_args
from duomo.ipc.runtime_dir import ensure_private_dir
from duomo.ipc.sink_records import SinkStatus, waiting_status
from duomo.sinks.config import SinkConfig
from duomo.supervisor.process.child_processes import ChildProcesses, stop_orphans
from duomo.supervisor.sources.definition import SourceDefinition

log = structlog.get_logger("duomo.sinks")
WORKER_MODULE = "duomo.sinks.worker"
MAX_RESTARTS = 5  # in ``child_processes.RESTART_WINDOW_S``


def sinks_directory(socket_path: Path) -> Path:
    """The outboxes' and the sequencer's folder: ``{socket}.sinks`` beside the socket."""
    return socket_path.with_name(f"{socket_path.name}.sinks")


def worker_command(socket_path: Path, directory: Path) -> list[str]:
    """``python -m duomo.sinks.worker`` (and this process's log format)."""
    return [
        sys.executable, "-m", WORKER_MODULE, "--socket", str(socket_path),
        "--directory", str(directory), *log_args(),
    ]  # fmt: skip


def outbox_bounds(sink: SinkConfig) -> dict[str, Any]:
    """A sink as a producer needs it: its name and its outbox's bounds."""
    return {"name": sink.name, "outbox": sink.outbox.model_dump(mode="json")}


class SinkHub:
    """The configured sinks and their worker (the module docstring's rules)."""

    def __init__(self, sinks: Sequence[SinkConfig], socket_path: Path) -> None:
        self.socket_path = socket_path
        self.directory = sinks_directory(socket_path)
        self._sinks: dict[str, SinkConfig] = {s.name: s for s in sinks}
        self._reports: dict[str, SinkStatus] = {}
        self._lock = threading.Lock()
        self._pool: ChildProcesses | None = None
        self._pool_starting = False

    # -- life --------------------------------------------------------------------------------

    def start(self) -> None:
        """Make the folder private and start the worker if there are sinks (once the
        supervisor listens: the worker connects to it)."""
        stop_orphans(WORKER_MODULE, self.socket_path)
        if self._sinks:
            ensure_private_dir(self.directory)
            self._start_pool()

    def _start_pool(self) -> None:
        with self._lock:
            if self._pool is not None or self._pool_starting:
                return
            self._pool_starting = True
        pool = ChildProcesses(
            "sink worker", lambda _: worker_command(self.socket_path, self.directory), 1,
            MAX_RESTARTS, on_exit=self._worker_exited, thread="duomo-sink-worker",
        )  # fmt: skip
        try:
            pool.start()
        except RuntimeError as err:
            log.error("the sink worker did not start; events wait in the outboxes", error=str(err))
            return
        finally:
            with self._lock:
                self._pool_starting = False
        with self._lock:
            self._pool = pool
        log.info("sink worker started", pid=pool.workers[0].pid, sinks=sorted(self._sinks))

    def stop(self) -> None:
        """Stop the worker (each sink's delivery ends; what is pending stays in its outbox)."""
        if self._pool is not None:
            self._pool.stop()

    def _worker_exited(self, index: int) -> None:
        with self._lock:
            self._reports.clear()

    @property
    def running(self) -> bool:
        pool = self._pool
        return pool is not None and pool.workers[0].pid is not None

    # -- the worker --------------------------------------------------------------------------

    def report(self, statuses: Sequence[SinkStatus]) -> dict[str, Any]:
        """(reactor thread) The sink worker's word on its sinks; the sinks it should deliver
        now (each definition as the config has it) and the folder of their outboxes."""
        with self._lock:
            self._reports = {s.name: s for s in statuses if s.name in self._sinks}
            sinks = [s.model_dump(mode="json") for s in self._sinks.values()]
        return {"sinks": sinks, "directory": str(self.directory)}

    def reload(self, sinks: Sequence[SinkConfig]) -> dict[str, list[str]]:
        """(control-job thread) A new config's sinks; what changed. The worker follows on its
        next report; the first sinks start it."""
        wanted = {s.name: s for s in sinks}
        with self._lock:
            current = self._sinks
            changed = {
                "added": [n for n in wanted if n not in current],
                "removed": [n for n in current if n not in wanted],
                "replaced": [n for n in wanted if n in current and current[n] != wanted[n]],
            }
            self._sinks = wanted
        if wanted and self._pool is None:
            ensure_private_dir(self.directory)
            threading.Thread(target=self._start_pool, name="duomo-sink-start", daemon=True).start()
        return changed

    # -- what producers and operators ask ----------------------------------------------------

    def plan(self, source: SourceDefinition, tracked: Mapping[str, int]) -> dict[str, Any] | None:
        """Where ``source``'s events go (None: it names no sink): ``directory``, ``sinks``
        (name and outbox bounds of each that exists), ``emit`` (resolved) and ``max_missed``
        (its pipeline tracker's; None without one). ``tracked``: the pipelines with a tracker."""
        with self._lock:
            sinks = [outbox_bounds(self._sinks[n]) for n in source.sinks if n in self._sinks]
        if not sinks:  # (none named, or a reload took away the sinks a run-time one names)
            return None
        max_missed = tracked.get(source.pipeline) if source.pipeline is not None else None
        return {
            "directory": str(self.directory),
            "sinks": sinks,
            "emit": source.emits(max_missed is not None),
            "max_missed": max_missed,
        }

    def target(self, name: str) -> dict[str, Any]:
        """``duomo stream --sink name``: the folder and the sink's bounds. NOT_FOUND for a sink
        not configured, UNAVAILABLE while no sink worker runs (nothing would deliver)."""
        with self._lock:
            sink = self._sinks.get(name)
        if sink is None:
            raise NotFoundError(f"no sink named {echoed(name)} in the supervisor's config")
        if not self.running:
            raise UnavailableError(
                "the supervisor runs no sink worker now (it starts with the config's sinks): "
                "nothing would deliver the events"
            )
        return {"directory": str(self.directory), "sink": outbox_bounds(sink)}

    def names(self) -> set[str]:
        with self._lock:
            return set(self._sinks)

    def status(self) -> tuple[SinkStatus, ...]:
        """Every configured sink, by name: the worker's last word on it, or ``connecting`` and
        zeros until then."""
        with self._lock:
            sinks = sorted(self._sinks.values(), key=lambda s: s.name)
            reports = dict(self._reports) if self.running else {}
        return tuple(reports.get(s.name) or waiting_status(s.name, s.kind, s.target) for s in sinks)
