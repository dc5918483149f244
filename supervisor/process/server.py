"""The supervisor process: one engine, one control socket, one reactor, until told to stop.

``Supervisor.start`` makes the runtime directory private, refuses to start over a live
supervisor, writes a fresh client key, loads the models to preload (the single backend init),
starts the watchdog and starts listening. Control messages are answered on the reactor thread by
``ControlHandlers`` (``supervisor.process.control_handlers``), which the supervisor builds with
what they touch; the slow ones run on the one control-job thread (``ControlJobs``), which the
supervisor starts and stops. ``reload`` (a ``reload`` message's control job, or SIGHUP through
``serve_forever`` on the main thread) applies a new config and the limits it sets; ``stop``
(the message, or a signal) wakes ``serve_forever``. ``status`` assembles the supervisor's state
from the records their owners make; it lists every client but the connection asking, unless that
one holds rings (``duomo status`` is no client of the models).
``shutdown`` stops accepting, lets queued and in-flight work finish within ``shutdown_grace_s``,
answers the rest UNAVAILABLE, releases the models, closes every connection and removes the
socket and key files; it returns how many requests it had to cut (the exit code says so).

Threads, what each owns and how they hand off: docs/architecture.md#concurrency (the one table).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import structlog

from duomo.ipc.errors import DuomoError, InvalidArgumentError, UnavailableError
from duomo.ipc.runtime_dir import ensure_private_dir, key_path, pid_path, write_key
from duomo.ipc.status_records import ClientStatus, ModelStatus, RingStatus, SupervisorStatus
from duomo.supervisor.config import (
    ConfigError,
    LoadedConfig,
    load_config,
    sink_problems,
    tracked_pipelines,
)
from duomo.supervisor.core.engine import Engine
from duomo.supervisor.dataflow.pipelines import ServedPipeline
from duomo.supervisor.dataflow.streams import StreamRegistry
from duomo.supervisor.operators.metrics import DuomoCollector, ProcessView
from duomo.supervisor.operators.metrics_http import LIVE_TIMEOUT_S, MetricsServer
from duomo.supervisor.process.connection import Connection
from duomo.supervisor.process.control_handlers import Caller, ControlHandlers
from duomo.supervisor.process.control_jobs import ControlJobs
from duomo.supervisor.process.gateways import GatewayProcesses
from duomo.supervisor.process.gil_probe import GilProbe
from duomo.supervisor.process.limits import Limits, RingLedger, resolve_limits
from duomo.supervisor.process.reactor import Reactor
from duomo.supervisor.process.request_trace import RequestTrace
from duomo.supervisor.process.watchdog import Watchdog
from duomo.supervisor.sinks.hub import SinkHub
from duomo.supervisor.sources.definition import SourceDefinition
from duomo.supervisor.sources.fleet import SourceFleet
from duomo.worker.model_spec import SERVING, ModelState
from duomo.worker.served_model import ServedModel

log = structlog.get_logger("duomo.supervisor")


class Supervisor:
    """The supervisor process: its engine, control socket and reactor, the watchdog, the
    control-job thread and, when configured, the gateway workers and the metrics server."""

    def __init__(self, loaded: LoadedConfig, socket_path: Path) -> None:
        self.loaded = loaded
        self.socket_path = socket_path
        self.engine = Engine(loaded)
        self.reactor: Reactor | None = None
        self.watchdog: Watchdog | None = None
        self.limits: Limits = resolve_limits(loaded.config.limits)
        self.shm = RingLedger(self.limits)
        self.streams = StreamRegistry(self.limits.max_streams)
        self.control_jobs = ControlJobs(
            self.limits.control_queue, self.limits.control_queue_per_client
        )
        self.gateways: GatewayProcesses | None = None
        self.metrics: MetricsServer | None = None
        # the bench's instruments (``tools/bench/request_breakdown.py``), off unless asked for
        self.trace = RequestTrace.from_environment()
        self.gil_probe = GilProbe.from_environment()
        self._process = psutil.Process()
        self._stopping = False
        self._wake = threading.Event()
        self._stop_requested = False
        self._reload_requested = False
        self._stop_waiters: list[Caller] = []
        self._created: dict[Path, int] = {}
        self._started_s = time.time()
        self.sinks = SinkHub(loaded.config.sinks, socket_path)
        self.sources = SourceFleet(
            loaded.config.source_workers, loaded.config.sources, socket_path,
            self._check_feeds, lambda: self.engine.placements.total_budget,
            lambda name: self.engine.servable(name).spec.max_batch, self._events_of,
        )  # fmt: skip
        self.control = ControlHandlers(
            self.engine, self.streams, self.sources, self.shm, self.control_jobs,
            reactor=lambda: self.reactor, config=lambda: self.loaded, reload=self.reload,
            stop=self.request_stop, status=self.status, model_status=self.model_status,
            trace=self.trace, sinks=self.sinks,
        )  # fmt: skip

    def start(self) -> None:
        path = self.socket_path
        ensure_private_dir(path.parent)
        _refuse_live_supervisor(path)
        key = write_key(path)
        self._own(key_path(path))
        metrics = self.loaded.config.metrics
        if metrics is not None:  # first: the probes answer (not ready) while the models load
            collector = DuomoCollector(
                self.engine, self._process_view, self.streams, self.sources.status,
                self.sinks.status,
            )  # fmt: skip
            self.metrics = MetricsServer(metrics, collector, self._live, self._not_ready)
            self.metrics.start()
        try:
            self.engine.start()
        except BaseException:
            if self.metrics is not None:
                self.metrics.stop()
            raise
        watchdog = self.loaded.config.watchdog
        if watchdog.enabled:
            self.watchdog = Watchdog(self.engine, watchdog.period_ms / 1e3)
            self.watchdog.start()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        old_umask = os.umask(0o177)  # the socket is created 0600
        try:
            listener.bind(str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        self._own(path)
        listener.listen(self.limits.listen_backlog)
        self.control_jobs.start()
        self.reactor = Reactor(
            listener, key, self.control.handle, self.limits, self.engine.wake_idle, self.streams
        )
        self.reactor.start()
        # lending: models' idle workers read their producers through the reactor's connections
        self.engine.idle_spin.read_from(self.reactor.lending.read_when_idle)
        pid_path(path).write_text(f"{os.getpid()}\n")
        self._own(pid_path(path))
        gateway = self.loaded.config.gateway
        if gateway is not None:  # once every model to preload is READY and the socket listens
            self.gateways = GatewayProcesses(gateway, path)
            self.gateways.start()
        self.sinks.start()  # (first: the sources' events need its folder)
        self.sources.start()  # (its workers connect: the socket listens)
        if self.gil_probe is not None:
            self.gil_probe.start()
        log.info("supervisor ready", socket=str(path), models=list(self.engine.models))

    def serve_forever(self) -> None:
        """Run until a stop is requested; reloads requested meanwhile run here, one at a time."""
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop_requested:
                return
            if self._reload_requested:
                self._reload_requested = False
                try:
                    self.reload()
                except DuomoError as err:
                    log.error("reload failed; the running models are unchanged", error=err.message)

    def request_stop(self, waiter: Caller | None = None) -> None:
        """Safe from a signal handler or any thread. ``waiter`` (a ``stop`` message with
        ``wait``) is answered once ``shutdown`` has run."""
        if waiter is not None:
            self._stop_waiters.append(waiter)
        self._stop_requested = True
        self._wake.set()

    def request_reload(self) -> None:
        """Re-read the config file (SIGHUP); safe from a signal handler or any thread."""
        self._reload_requested = True
        self._wake.set()

    def reload(self, model: str | None = None) -> dict[str, Any]:
        """Re-read the config file and apply the difference (or rebuild just ``model``).

        Raises InvalidArgumentError for an invalid config, UnavailableError (with the reason)
        when a replacement cannot be loaded, ResourceExhaustedError when it does not fit its
        memory budget; in every case the running models are unchanged.
        """
        try:
            new = load_config(self.loaded.path)
        except ConfigError as err:
            raise InvalidArgumentError(f"config not reloaded:\n{err.render()}") from None
        clashes = self.sources.reload_problems(new.config.sources) if model is None else []
        if clashes:
            raise InvalidArgumentError("config not reloaded:\n" + "\n".join(clashes))
        try:
            summary = self.engine.reload(new, only=model)
        except (RuntimeError, ValueError) as err:
            raise UnavailableError(
                f"reload failed, the running models are unchanged: {err}"
            ) from None
        self.loaded = self.engine.loaded
        self._apply_limits(resolve_limits(self.loaded.config.limits))
        reply: dict[str, Any] = dict(summary)
        if model is None:
            reply["sinks"] = self.sinks.reload(self.loaded.config.sinks)
            reply["sources"] = self.sources.reload(self.loaded.config.sources)
        log.info("config reloaded", **reply)
        return reply

    def shutdown(self) -> int:
        """Stop accepting, finish queued work within the grace period, release the models,
        close clients, remove files. Returns how many accepted requests had to be cut. The
        gateway's workers stop first (they finish the requests they have sent); the metrics
        port answers (not ready) until the end."""
        self._stopping = True
        self.sources.stop()  # (their streams close first: nothing more comes from the cameras)
        self.sinks.stop()  # (after: the sources' last events are in the outboxes, kept there)
        if self.gateways is not None:
            self.gateways.stop()
        if self.reactor is not None:
            self.reactor.stop_accepting()
        if self.watchdog is not None:
            self.watchdog.stop()
        grace_s = self.loaded.config.shutdown_grace_s
        self.control_jobs.stop(grace_s)
        cut = self.engine.close(grace_s)
        for caller in self._stop_waiters:
            caller.conn.reply(caller.message, {"ok": True, "cut": cut})
        self.engine.idle_spin.read_from(None)
        if self.reactor is not None:
            self.reactor.stop()
        for path, inode in self._created.items():
            # Only what this process made: a supervisor started meanwhile on the same path (or
            # refused because this one was running) keeps its files.
            with contextlib.suppress(FileNotFoundError):
                if path.lstat().st_ino == inode:
                    path.unlink()
        if self.metrics is not None:
            self.metrics.stop()
        if self.gil_probe is not None:
            self.gil_probe.stop()  # (writes its file)
        if self.trace is not None:
            self.trace.write()
        log.info("supervisor stopped", requests_cut=cut)
        return cut

    # -- what the metrics port reports ------------------------------------------------------

    def _live(self) -> bool:
        """Alive while starting; once it serves, its reactor must run a task within
        ``LIVE_TIMEOUT_S`` (a wedged reactor serves no one, however well the models run)."""
        reactor = self.reactor
        if reactor is None:
            return True
        answered = threading.Event()
        reactor.call_soon(answered.set)
        return answered.wait(LIVE_TIMEOUT_S)

    def _not_ready(self) -> list[str]:
        """Why it is not ready: each ``preload`` model that does not serve, with its state;
        empty once ready. A model serves when it is READY or DEGRADED (what the gateway calls a
        ready model), or when it was evicted and loads again on its next request."""
        if self._stopping:
            return ["the supervisor is stopping"]
        preload = [n for n, m in self.loaded.models.items() if m.config.preload]
        models = dict(self.engine.models)

        def serves(model: ServedModel) -> bool:
            evicted = model.state is ModelState.UNLOADED and model.auto_load and model.loads > 0
            return model.state in SERVING or evicted

        waiting = [
            f"{n}: {models[n].state.value if n in models else 'not built yet'}"
            for n in preload
            if n not in models or not serves(models[n])
        ]
        if self.reactor is None:
            waiting.append("the supervisor is not listening yet")
        return waiting

    def _process_view(self) -> ProcessView:
        reactor = self.reactor
        gateways = self.gateways.status() if self.gateways is not None else ()
        return ProcessView(
            clients_attached=sum(1 for c in reactor.connections if c.authenticated)
            if reactor is not None
            else 0,
            gateway_workers_running=sum(1 for g in gateways if g.running),
            resident_bytes=self._process.memory_info().rss,
        )

    def _apply_limits(self, limits: Limits) -> None:
        self.limits = limits
        self.shm.limits = limits
        self.streams.max_streams = limits.max_streams
        self.control_jobs.set_capacity(limits.control_queue, limits.control_queue_per_client)
        if self.reactor is not None:
            self.reactor.set_limits(limits)

    def _own(self, path: Path) -> None:
        self._created[path] = path.lstat().st_ino

    def _check_feeds(self, definition: SourceDefinition) -> None:
        """NOT_FOUND when a source's models (or pipeline) are not served; INVALID_ARGUMENT when
        it names a sink not configured or asks for object events without a tracker."""
        for name in definition.feeds:
            self.engine.servable(name)
        tracked = tracked_pipelines(self.loaded.config)
        problems = sink_problems(definition, self.sinks.names(), tracked)
        if problems:
            raise InvalidArgumentError("; ".join(f"{at}: {why}" for at, why in problems))

    def _events_of(self, definition: SourceDefinition) -> dict[str, Any] | None:
        """Where a source's events go (its assignment's ``events``)."""
        return self.sinks.plan(definition, tracked_pipelines(self.loaded.config))

    # -- the ``status`` reply (reactor thread, through ``ControlHandlers``) -----------------

    def model_status(self, name: str) -> ModelStatus:
        """``name``'s status alone (NotFoundError when it is not served, or was removed by a
        reload meanwhile). A pipeline's is its own (``ServedPipeline.model_status``: its first
        step's model's with the pipeline's state and request figures, what the gateway's
        statistics read)."""
        served = self.engine.servable(name)
        if isinstance(served, ServedPipeline):
            return served.model_status(self.engine.model_status(served.root.model))
        return self.engine.model_status(name)

    def status(self, asking: Connection | None = None) -> SupervisorStatus:
        """The supervisor's state. ``clients`` leaves out the connection ``asking`` when it holds
        no ring: the ``duomo status`` command (or its ``--watch`` view) is no client of the
        models; a producer that asks sees its own rings. Assembled from the records their owners
        make: the engine's (devices, models, pipelines), the gateways', the streams' and the
        managed sources'; the clients' are made here."""
        process = self._process
        clients = []
        for conn in self.reactor.connections if self.reactor else []:
            if conn is asking and not conn.attachments:
                continue
            slots, shm_bytes = self.shm.held(conn.id)
            rings = tuple(
                RingStatus(a.ring_id, a.model_name, a.layout.slots, a.in_flight, a.answered)
                for a in conn.attachments.values()
            )
            clients.append(
                ClientStatus(
                    id=conn.id,
                    pid=conn.pid,
                    lent=conn.lent,  # read by its model's idle worker (see Reactor)
                    slots=slots,
                    shm_bytes=shm_bytes,
                    unread_bytes=conn.unread_bytes,  # waiting in its outbox
                    unread_peak_bytes=conn.unread_peak_bytes,
                    rings=rings,
                )
            )
        engine = self.engine.status()
        return SupervisorStatus(
            pid=os.getpid(),
            socket=str(self.socket_path),
            config=str(self.loaded.path),
            uptime_s=round(time.time() - self._started_s, 1),
            rss_bytes=process.memory_info().rss,
            threads=process.num_threads(),
            open_fds=process.num_fds(),
            mapped_rings=self.reactor.mapped_rings if self.reactor else 0,
            shm_bytes=self.shm.total_bytes,
            connections_refused=self.reactor.refused_total if self.reactor else 0,
            clients_cut_off=self.reactor.cut_off_total if self.reactor else 0,
            control_jobs_waiting=self.control_jobs.waiting,
            limits=self.limits.to_dict(),
            gateways=self.gateways.status() if self.gateways is not None else (),
            thread_budget=engine.thread_budget,
            devices=engine.devices,
            models=engine.models,
            pipelines=engine.pipelines,
            clients=tuple(clients),
            streams=self.streams.snapshot(),
            sources=self.sources.status(),
            sinks=self.sinks.status(),
        )


def _refuse_live_supervisor(path: Path) -> None:
    """Another supervisor answering on ``path`` is an error; a stale socket file is removed."""
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise RuntimeError(
        f"a supervisor is already serving at {path}: to start another one beside it, give it "
        f"its own socket (duomo start --socket PATH); to stop this one: duomo stop --socket {path}"
    )
