"""The sink worker: the process that delivers every configured sink's outbox to its broker.

The supervisor starts it when its config has sinks (``supervisor.sinks.hub``: ``python -m
duomo.sinks.worker --socket S --directory D``, readiness on ``--ready-fd``, restarted when it
dies, stopped on ``duomo stop``). It is a client of the supervisor like any producer, and holds
no ring: every ``REPORT_S`` it sends ``sink_report`` — each sink's ``SinkStatus`` — and the
reply carries the sink definitions now. It runs one ``SinkDelivery`` thread per sink, starts
what is new, stops what is gone and starts again what changed (the others keep delivering), so a
``duomo reload`` that changes the sinks needs no restart of anything. The outboxes are files in
``D`` (``{sink}.outbox.db``), written by the producers; nothing a producer does waits for this
process, and a ``kill -9`` of it loses nothing that was in an outbox (the restarted worker sends
what was not acknowledged: at least once).

Secrets are read here, from this process's environment and files, when a publisher connects
(``sinks.config.read_secret``); a sink whose definition does not validate is logged and left
out (the supervisor validated it already: it cannot happen but by a version mismatch).

While the supervisor is away (restarting) the sinks go on delivering and the reports wait; the
worker ends on SIGTERM or SIGINT (each delivery stopped, what is pending kept in its outbox), and
when the supervisor that started it is gone (its parent changed).

Threads: the main thread (reports, starting and stopping deliveries), one delivery thread per
sink (``sinks.delivery``), and paho's network thread per MQTT sink.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import structlog
from pydantic import TypeAdapter, ValidationError

from duomo.ipc.client import Client
from duomo.ipc.errors import DuomoError
from duomo.ipc.logs import configure_logging
from duomo.ipc.readiness import report_ready
from duomo.sinks.config import SinkConfig
from duomo.sinks.delivery import DeliveryTiming, SinkDelivery

log = structlog.get_logger("duomo.sinks")
REPORT_S = 0.5
CONNECT_WAIT_S = 30.0
RECONNECT_S = 1.0
STOP_S = 10.0  # a delivery's publish in progress finishes or is cut after this
_SINK = TypeAdapter[SinkConfig](SinkConfig)


class SinkWorker:
    """The worker's deliveries and its connection to the supervisor (the module docstring)."""

    def __init__(self, socket_path: Path, directory: Path, timing: DeliveryTiming | None = None):
        self.socket_path = socket_path
        self.directory = directory
        self.timing = timing
        self.deliveries: dict[str, tuple[dict[str, Any], SinkDelivery]] = {}
        self.stop = threading.Event()
        self._client: Client | None = None
        self._parent = os.getppid()

    def run(self, ready_fd: int | None) -> int:
        """Serve until stopped; the exit code."""
        try:
            self._client = self._connect(CONNECT_WAIT_S)
        except DuomoError as err:
            report_ready(ready_fd, f"ERROR {err.message}")
            return 1
        report_ready(ready_fd, "READY")
        log.info("sink worker ready", pid=os.getpid(), directory=str(self.directory))
        try:
            while not self.stop.is_set():
                if os.getppid() != self._parent:
                    log.warning("sink worker: the supervisor is gone; stopping")
                    break
                self._report_and_follow()
                self.stop.wait(REPORT_S)
        finally:
            for _, delivery in self.deliveries.values():
                delivery.stop(STOP_S)
            if self._client is not None:
                self._client.close()
        return 0

    def _connect(self, wait_s: float) -> Client:
        """A client of the supervisor, tried every ``RECONNECT_S`` for up to ``wait_s``."""
        waited = 0.0
        while True:
            try:
                return Client(self.socket_path, timeout_s=30)
            except (DuomoError, OSError):
                if waited >= wait_s or self.stop.is_set():
                    raise
            self.stop.wait(RECONNECT_S)
            waited += RECONNECT_S

    def _report_and_follow(self) -> None:
        """Send each sink's status; deliver what the reply names."""
        if self._client is None or not self._client.connected:
            if self._client is not None:
                self._client.close()
                self._client = None
            try:
                self._client = self._connect(0.0)
            except (DuomoError, OSError):
                return  # (the deliveries go on meanwhile)
        statuses = [delivery.status().to_dict() for _, delivery in self.deliveries.values()]
        try:
            reply = self._client.request("sink_report", sinks=statuses)
        except DuomoError as err:
            log.info("sink worker: report not taken", error=err.message)
            return
        self._follow({d["name"]: d for d in reply["sinks"]})

    def _follow(self, wanted: dict[str, dict[str, Any]]) -> None:
        for name in [n for n, (d, _) in self.deliveries.items() if wanted.get(n) != d]:
            _, delivery = self.deliveries.pop(name)
            log.info("sink worker: stopping a sink", sink=name)
            delivery.stop(STOP_S)
        for name, definition in wanted.items():
            if name not in self.deliveries:
                self._start(definition)

    def _start(self, definition: dict[str, Any]) -> None:
        try:
            config = _SINK.validate_python(definition)
        except ValidationError as err:
            log.error(
                "sink worker: a sink it cannot read", sink=definition.get("name"),
                problems=[e["msg"] for e in err.errors(include_url=False)],
            )  # fmt: skip
            return
        try:
            delivery = SinkDelivery.of(config, self.directory, self.timing)
        except Exception as err:  # (its outbox file: a full disk, a folder gone)
            log.error("sink worker: cannot open a sink's outbox", sink=config.name, error=str(err))
            return
        delivery.start()
        self.deliveries[config.name] = (definition, delivery)
        log.info("sink worker: delivering a sink", sink=config.name, target=config.target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m duomo.sinks.worker")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--directory", type=Path, required=True)
    parser.add_argument("--ready-fd", type=int, default=None)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-json", action="store_true")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_json)
    worker = SinkWorker(args.socket, args.directory, _timing_from_environment())
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: worker.stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        return worker.run(args.ready_fd)
    return 0


def _timing_from_environment() -> DeliveryTiming | None:
    """``DUOMO_SINK_MAX_RETRY_S`` / ``DUOMO_SINK_FAILING_RETRY_S``: a shorter backoff ceiling
    and failing retry than a broker's defaults (tests, and an operator who wants a returning
    broker noticed sooner); None: the defaults."""
    max_retry = os.environ.get("DUOMO_SINK_MAX_RETRY_S")
    failing = os.environ.get("DUOMO_SINK_FAILING_RETRY_S")
    if max_retry is None and failing is None:
        return None
    default = DeliveryTiming()
    return DeliveryTiming(
        max_retry_s=float(max_retry) if max_retry else default.max_retry_s,
        failing_retry_s=float(failing) if failing else default.failing_retry_s,
    )


if __name__ == "__main__":
    sys.exit(main())
