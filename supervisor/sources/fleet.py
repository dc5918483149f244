"""The camera fleet the supervisor runs: what should play, which worker decodes each source, and
what the workers last said.

**What should play**: the config's ``sources:`` (origin ``config``: changed by editing the file
and ``duomo reload``, which adds, removes and replaces them while the others keep playing) and
the sources added at run time (origin ``runtime``: ``duomo source add`` / ``POST /v1/sources``,
kept in the ``SourceStore`` so that they outlive the supervisor; ``remove`` forgets them). A name
is one source's: adding a name in use is INVALID_ARGUMENT, and so is removing a config source
(edit the file). A source's models (or pipeline) must be served.

**Who decodes it**: the source workers (``supervisor.sources.workers``, run by
``ChildProcesses``). A new source goes to the live worker with the fewest; a healthy source
never moves; when a worker dies its sources go to the others at once (``_worker_exited``, on the
watcher thread, within ``WATCH_PERIOD_S``), and a worker that starts again gets only sources that
wait for one. A worker learns its sources in the reply to its ``source_report`` (every 0.5 s), so
a change plays within a second.

**What they said**: each report (``SourceReport``) is kept with its source; ``status`` joins it
with the definition (the URL masked), the origin and the worker's pid into ``SourceStatus``
records — ``connecting`` and zeros until the first report, or while the source waits for a
worker. State changes are logged once each, from the reports.

Workers start with the supervisor when there are sources to play, else with the first one added
(on a thread of their own: the reactor never waits for a process). Thread-safety: one lock; the
reactor thread calls ``report``, ``add``, ``remove`` and ``status``, the watcher thread the
worker callbacks, the control-job thread ``reload``. Owned by ``supervisor.process.server``; the
source messages reach it through ``supervisor.process.control_handlers``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from duomo.ipc.errors import DuomoError, InvalidArgumentError, NotFoundError, echoed
from duomo.ipc.source_records import NO_REPORT, SourceReport, SourceStatus
from duomo.ipc.source_urls import mask_text
from duomo.supervisor.process.child_processes import ChildProcesses, stop_orphans
from duomo.supervisor.sources.definition import SourceDefinition
from duomo.supervisor.sources.store import SourceStore
from duomo.supervisor.sources.workers import (
    WORKER_MODULE,
    SourceWorkersConfig,
    database_path,
    worker_command,
    worker_count,
)

log = structlog.get_logger("duomo.sources")
CONFIG, RUNTIME = "config", "runtime"
FRESH_SLOTS = 3  # slots: auto, for a model that runs one frame at a time
BATCHED_SLOTS = 1  # slots: auto, when every model fed batches


@dataclass
class Placed:
    """One source that should play: its definition, where it comes from, the worker decoding it
    (its index; None while it waits for one) and that worker's last report."""

    definition: SourceDefinition
    origin: str
    worker: int | None = None
    report: SourceReport | None = None
    state: str = "connecting"
    state_since: float = 0.0


class SourceFleet:
    """The managed sources and their workers (the module docstring's rules)."""

    def __init__(
        self,
        config: SourceWorkersConfig,
        declared: Iterable[SourceDefinition],
        socket_path: Path,
        check_feeds: Callable[[SourceDefinition], None],
        models_threads: Callable[[], int],
        max_batch: Callable[[str], int],
        events: Callable[[SourceDefinition], dict[str, Any] | None] = lambda _: None,
    ) -> None:
        """``check_feeds`` raises NotFoundError for a source whose models (or pipeline) are not
        served (and INVALID_ARGUMENT for sinks it cannot have); ``models_threads`` is the
        models' thread budget (for the default count); ``max_batch`` a served model's (or
        pipeline's) ``max_batch`` (for ``slots: auto``); ``events`` where a source's events go
        (``SinkHub.plan``: sent in its assignment)."""
        self.config = config
        self.socket_path = socket_path
        self.check_feeds = check_feeds
        self.models_threads = models_threads
        self.max_batch = max_batch
        self.events = events
        self._declared = list(declared)
        self._sources: dict[str, Placed] = {}
        self._lock = threading.Lock()
        self._store: SourceStore | None = None
        self._pool: ChildProcesses | None = None
        self._pool_starting = False

    # -- life --------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the store, gather what should play, and start the workers if anything should
        (once the supervisor listens: the workers connect to it)."""
        self._store = SourceStore(database_path(self.config, self.socket_path))
        now = time.monotonic()
        for definition in self._declared:
            self._sources[definition.name] = Placed(definition, CONFIG, state_since=now)
        for definition in self._store.load():
            if definition.name in self._sources:
                log.error(
                    "a source added at run time has the name of a config source; the config's "
                    "plays", source=definition.name,
                )  # fmt: skip
                continue
            self._sources[definition.name] = Placed(definition, RUNTIME, state_since=now)
        stop_orphans(WORKER_MODULE, self.socket_path)
        if self._sources:
            self._start_pool()
        log.info(
            "source fleet ready", sources=len(self._sources),
            from_config=len(self._declared), database=str(self._store.path),
        )  # fmt: skip

    def _start_pool(self) -> None:
        """Start the workers (once); the sources are placed as each reports READY."""
        with self._lock:
            if self._pool is not None or self._pool_starting:
                return
            self._pool_starting = True
        count = worker_count(self.config, self.models_threads())
        pool = ChildProcesses(
            "source worker", lambda index: worker_command(self.socket_path, index), count,
            self.config.max_restarts, on_exit=self._worker_exited,
            on_started=self._worker_started, thread="duomo-source-workers",
        )  # fmt: skip
        with self._lock:
            self._pool = pool
        try:
            pool.start()
        except RuntimeError as err:  # (stopped meanwhile, or a worker that cannot start)
            log.error("source workers did not start; the sources wait", error=str(err))
            with self._lock:
                self._pool = None
            return
        finally:
            with self._lock:
                self._pool_starting = False
        log.info("source workers started", workers=count, pids=[w.pid for w in pool.workers])

    def _start_pool_soon(self) -> None:
        """Start the workers on a thread of their own if they are not running (the caller, the
        reactor or a control job, never waits for a process)."""
        if self._pool is None:
            threading.Thread(
                target=self._start_pool, name="duomo-source-start", daemon=True
            ).start()

    def stop(self) -> None:
        """Stop the workers (their streams close), then the store."""
        if self._pool is not None:
            self._pool.stop()
        if self._store is not None:
            self._store.close()

    # -- the workers -------------------------------------------------------------------------

    def _live_workers(self) -> list[int]:
        pool = self._pool
        if pool is None:
            return []
        return [w.index for w in pool.workers if w.pid is not None]

    def _place_waiting(self, exclude: int | None = None) -> None:
        """(Under the lock) Give each source without a worker to the live one with the fewest."""
        live = [w for w in self._live_workers() if w != exclude]
        if not live:
            return
        load = {w: 0 for w in live}
        for placed in self._sources.values():
            if placed.worker in load:
                load[placed.worker] += 1
        for placed in self._sources.values():
            if placed.worker is None:
                chosen = min(live, key=lambda w: (load[w], w))
                placed.worker, placed.report = chosen, None
                load[chosen] += 1

    def _worker_exited(self, index: int) -> None:
        """(watcher thread) Worker ``index`` died: its sources go to the others now."""
        with self._lock:
            moved = [p.definition.name for p in self._sources.values() if p.worker == index]
            for name in moved:
                self._sources[name].worker = None
                self._sources[name].report = None
            self._place_waiting(exclude=index)
        if moved:
            log.warning("source worker exited; its sources move", worker=index, sources=moved)

    def _worker_started(self, index: int, pid: int) -> None:
        """(watcher thread, or ``start``) Worker ``index`` is READY: it takes what waits."""
        with self._lock:
            self._place_waiting()

    def report(self, worker: int, reports: Iterable[SourceReport]) -> list[dict[str, Any]]:
        """(reactor thread) Worker ``worker`` says what its sources do; the definitions of the
        sources it should decode now."""
        now = time.monotonic()
        with self._lock:
            for report in reports:
                placed = self._sources.get(report.name)
                if placed is None or placed.worker != worker:
                    continue  # (gone, or moved: the worker drops it on this reply)
                placed.report = report
                if report.state != placed.state:
                    self._log_state(placed, report, now)
            self._place_waiting()
            return [
                p.definition.assignment(self.slots(p.definition), self.events(p.definition))
                for p in self._sources.values()
                if p.worker == worker
            ]

    def slots(self, definition: SourceDefinition) -> int:
        """Its frames in flight per model: as given, or (``auto``) ``BATCHED_SLOTS`` when every
        model it feeds batches (``max_batch`` > 1: its cameras' frames go into one batch, and
        holding the next frame at the source, unconverted, until the one sent is answered costs
        no freshness), else ``FRESH_SLOTS`` (the model's next frame is always the newest)."""
        if definition.slots is not None:
            return definition.slots
        try:
            batched = all(self.max_batch(name) > 1 for name in definition.feeds)
        except DuomoError:  # (a model not served: its source is failed anyway)
            batched = False
        return BATCHED_SLOTS if batched else FRESH_SLOTS

    @staticmethod
    def _log_state(placed: Placed, report: SourceReport, now: float) -> None:
        was, placed.state, placed.state_since = placed.state, report.state, now
        fields = {"source": report.name, "state": report.state, "was": was}
        if report.state == "failed":
            log.error("source state", error=report.last_error, **fields)
        elif report.state == "reconnecting":
            log.warning("source state", error=report.last_error, **fields)
        else:
            log.info("source state", **fields)

    # -- changes -----------------------------------------------------------------------------

    def add(self, definition: SourceDefinition) -> SourceStatus:
        """(reactor thread) Add a run-time source: stored, then placed (INVALID_ARGUMENT for a
        name in use, NOT_FOUND for models not served)."""
        self.check_feeds(definition)
        assert self._store is not None
        with self._lock:
            if definition.name in self._sources:
                origin = self._sources[definition.name].origin
                raise InvalidArgumentError(
                    f"source {definition.name!r} exists already (from the {origin}): remove it "
                    "first, or choose another name"
                )
            self._store.put(definition)
            placed = self._sources[definition.name] = Placed(
                definition, RUNTIME, state_since=time.monotonic()
            )
            self._place_waiting()
        log.info(
            "source added", source=definition.name, url=definition.shown_url,
            feeds=list(definition.feeds),
        )  # fmt: skip
        self._start_pool_soon()
        return self._status(placed, time.monotonic())

    def remove(self, name: str) -> None:
        """(reactor thread) Forget a run-time source; its worker stops it within a second."""
        assert self._store is not None
        with self._lock:
            placed = self._sources.get(name)
            if placed is None:
                raise NotFoundError(f"no source named {echoed(name)}")
            if placed.origin == CONFIG:
                raise InvalidArgumentError(
                    f"source {name!r} is declared in the config: remove it there and run "
                    "duomo reload"
                )
            self._store.delete(name)
            del self._sources[name]
        log.info("source removed", source=name)

    def reload_problems(self, declared: Iterable[SourceDefinition]) -> list[str]:
        """Why a new config's sources cannot replace these: a name a run-time source has."""
        with self._lock:
            return [
                f"sources[{d.name}]: a source of that name was added at run time (duomo source "
                f"remove {d.name}, then reload)"
                for d in declared
                if d.name in self._sources and self._sources[d.name].origin == RUNTIME
            ]

    def reload(self, declared: Iterable[SourceDefinition]) -> dict[str, list[str]]:
        """(control-job thread) Apply a new config's sources: add, remove and replace the
        config's (the others keep playing); what changed."""
        wanted = {d.name: d for d in declared}
        now = time.monotonic()
        with self._lock:
            current = {n: p for n, p in self._sources.items() if p.origin == CONFIG}
            removed = [n for n in current if n not in wanted]
            added = [n for n in wanted if n not in current]
            replaced = [n for n in wanted if n in current and current[n].definition != wanted[n]]
            for name in removed:
                del self._sources[name]
            for name in added:
                self._sources[name] = Placed(wanted[name], CONFIG, state_since=now)
            for name in replaced:  # (same worker: it sees the new definition and replays)
                self._sources[name].definition = wanted[name]
                self._sources[name].report = None
            self._place_waiting()
        self._declared = list(wanted.values())
        if added:
            self._start_pool_soon()
        return {"added": added, "removed": removed, "replaced": replaced}

    # -- what is shown -----------------------------------------------------------------------

    def status(self) -> tuple[SourceStatus, ...]:
        """Every source, by name."""
        now = time.monotonic()
        with self._lock:
            placed = sorted(self._sources.values(), key=lambda p: p.definition.name)
            return tuple(self._status(p, now) for p in placed)

    def status_of(self, name: str) -> SourceStatus:
        with self._lock:
            placed = self._sources.get(name)
            if placed is None:
                raise NotFoundError(f"no source named {echoed(name)}")
            return self._status(placed, time.monotonic())

    def _status(self, placed: Placed, now: float) -> SourceStatus:
        definition, pool = placed.definition, self._pool
        pid = None
        if pool is not None and placed.worker is not None:
            pid = pool.workers[placed.worker].pid
        r = placed.report if placed.report is not None and pid is not None else NO_REPORT
        plan = self.events(definition)
        return SourceStatus(
            name=definition.name, url=definition.shown_url, feeds=",".join(definition.feeds),
            policy=definition.policy, slots=self.slots(definition), origin=placed.origin,
            worker=pid,
            worker_index=placed.worker, state=r.state,
            since_s=round(now - placed.state_since, 3),
            last_error=None if r.last_error is None else mask_text(r.last_error),
            decoded=r.decoded, decode_errors=r.decode_errors, reconnects=r.reconnects,
            answered=r.answered, superseded=r.superseded, failed=r.failed,
            input_fps=r.input_fps, answered_fps=r.answered_fps, age_p50_ms=r.age_p50_ms,
            age_p99_ms=r.age_p99_ms, sinks=",".join(definition.sinks),
            emit=plan["emit"] if plan is not None else None,
        )  # fmt: skip
