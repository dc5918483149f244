"""A source worker: one process of the supervisor's source fleet, decoding the sources it is given
into their streams.

The supervisor starts its source workers (``supervisor.sources.workers``: ``python -m
duomo.video.source_worker --socket S --index K``, readiness on ``--ready-fd``, restarted when one
dies) and spreads the managed sources over them. A worker is a producer like any other: it
connects through a ``SupervisorLink`` and writes frames into its rings, never into the
supervisor's memory. Every ``REPORT_S`` it sends ``source_report`` — what each of its sources is
doing (``ipc.source_records.SourceReport``) — and the reply names the sources it should decode now
(their definitions, secrets as references). It starts what is new (a ``VideoSource`` each: one
decode thread, and one thread reading its answers), stops what is gone and starts again what
changed; the others keep playing. Secrets are filled in here (``ipc.source_urls.expand_url``),
from this process's environment and files, and nowhere else; a source whose secret is missing,
whose file is gone or whose model is not served is reported ``failed`` with why, and tried again
every ``retry_failed_s``.

Answers are counted by the source (``video.figures``) and handed to the tail socket
(``video.answer_tail``: ``duomo source tail``) and, for a source that names sinks (its
assignment's ``events``), to its ``SinkEvents`` (``video.sink_events``: the events go to its
sinks' outboxes off the frame path; the visits still open leave when the source stops).

It ends on SIGTERM or SIGINT (its sources closed, frames in flight drained up to ``DRAIN_S``),
and when the supervisor that started it is gone (its parent changed: a supervisor killed with
``-9`` leaves no worker decoding for nobody; the next one starts its own).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from duomo.ipc.errors import DuomoError
from duomo.ipc.logs import configure_logging
from duomo.ipc.readiness import report_ready
from duomo.ipc.runtime_dir import source_tail_path
from duomo.ipc.source_records import NO_REPORT, SourceReport
from duomo.ipc.source_urls import SecretError, expand_url, mask_text
from duomo.video.answer_tail import AnswerTail
from duomo.video.locations import SourceError
from duomo.video.sink_events import EventPlan, SinkEvents
from duomo.video.source import VideoSource
from duomo.video.supervisor_link import SupervisorLink
from duomo.video.thumbnails import FrameKeeper

log = structlog.get_logger("duomo.video")
REPORT_S = 0.5
DRAIN_S = 2.0
CONNECT_WAIT_S = 30.0


@dataclass
class ManagedSource:
    """One assigned source: its definition as it came, and its ``VideoSource`` — or why there
    is none yet (``error``) and when to try again."""

    definition: dict[str, Any]
    source: VideoSource | None = None
    error: str | None = None
    retry_at: float = 0.0
    reader: threading.Thread | None = field(default=None, repr=False)
    events: SinkEvents | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return str(self.definition["name"])

    def report(self) -> SourceReport:
        if self.source is None:
            return _failed_report(self.name, self.error)
        f = self.source.figures.snapshot()
        state = f["state"] if f["state"] != "detached" else "connecting"
        return SourceReport(
            name=self.name, state=state, last_error=f["last_error"] or self.source.error,
            decoded=f["decoded"], sent=f["sent"], dropped=f["dropped"], corrupt=f["corrupt"],
            decode_errors=f["decode_errors"], reconnects=f["reconnects"],
            answered=f["answered"], superseded=f["superseded"], failed=f["failed"],
            input_fps=f["input_fps"], answered_fps=f["answered_fps"],
            age_p50_ms=f["age_ms_p50"], age_p99_ms=f["age_ms_p99"],
        )  # fmt: skip


def _failed_report(name: str, error: str | None) -> SourceReport:
    return dataclasses.replace(NO_REPORT, name=name, state="failed", last_error=error)


class SourceWorker:
    """The worker's sources and its one link to the supervisor (the module docstring)."""

    def __init__(self, socket_path: Path, index: int) -> None:
        self.socket_path = socket_path
        self.index = index
        self.link = SupervisorLink(socket_path, timeout_s=30)
        self.tail = AnswerTail(source_tail_path(socket_path, index))
        self.sources: dict[str, ManagedSource] = {}
        self.stop = threading.Event()
        self._parent = os.getppid()

    def run(self, ready_fd: int | None) -> int:
        """Serve until stopped; the exit code."""
        try:
            self.link.connect(CONNECT_WAIT_S, self.stop)
        except DuomoError as err:
            report_ready(ready_fd, f"ERROR {err.message}")
            return 1
        self.tail.start()
        report_ready(ready_fd, "READY")
        log.info("source worker ready", worker=self.index, pid=os.getpid())
        try:
            while not self.stop.is_set():
                if os.getppid() != self._parent:
                    log.warning("source worker: the supervisor is gone; stopping")
                    break
                self._report_and_follow()
                self.stop.wait(REPORT_S)
        finally:
            for managed in self.sources.values():
                self._stop_source(managed, DRAIN_S)
            self.tail.close()
            self.link.close()
        return 0

    def _report_and_follow(self) -> None:
        """Send the sources' reports; play what the reply assigns."""
        client, _ = self.link.current()
        if client is None:
            return  # (the link is connecting again: the sources go on decoding meanwhile)
        reports = [m.report().to_dict() for m in self.sources.values()]
        try:
            reply = client.request(
                "source_report", worker=self.index, pid=os.getpid(), sources=reports
            )
        except DuomoError as err:
            log.info("source worker: report not taken", error=err.message)
            return
        self._follow({d["name"]: d for d in reply["assigned"]})

    def _follow(self, assigned: dict[str, dict[str, Any]]) -> None:
        for name in [n for n, m in self.sources.items() if assigned.get(n) != m.definition]:
            log.info("source worker: stopping a source", source=name, worker=self.index)
            self._stop_source(self.sources.pop(name), 0.0)
        now = time.monotonic()
        for name, definition in assigned.items():
            managed = self.sources.get(name)
            if managed is None:
                managed = self.sources[name] = ManagedSource(definition)
            if managed.source is None and now >= managed.retry_at:
                self._start_source(managed)
        self.tail.sources = frozenset(self.sources)

    def _start_source(self, managed: ManagedSource) -> None:
        d = managed.definition  # (every field: ``SourceDefinition.assignment``)
        try:
            url = expand_url(d["url"], d["password_file"])
        except SecretError as err:
            return self._not_started(managed, str(err))
        frames = _frames_for_thumbnails(d)
        source = VideoSource(
            url, managed.name, models=d["models"] or [d["pipeline"]], client=self.link,
            policy=d["policy"], weight=d["weight"], max_fps=d["max_fps"], every=d["every"],
            stall_after_s=d["stall_after_s"], loop=d["loop"], slots=d["slots"],
            failed_after_s=d["failed_after_s"], retry_failed_s=d["retry_failed_s"],
            on_frame=frames.keep if frames is not None else None, frame_every_s=0.0,
        )  # fmt: skip
        try:
            source.start()
        except (SourceError, DuomoError) as err:
            message = err.message if isinstance(err, DuomoError) else str(err)
            return self._not_started(managed, mask_text(message, url))
        try:
            events = _events_of(managed.name, d, frames)
        except Exception as err:  # (the outboxes' folder or files: events cannot be kept)
            source.close(0.0)
            return self._not_started(managed, f"cannot open the sinks' outboxes: {err}")
        managed.source, managed.error, managed.events = source, None, events
        managed.reader = threading.Thread(
            target=self._read_answers, args=(source, events), name=f"answers-{managed.name}",
            daemon=True,
        )  # fmt: skip
        managed.reader.start()
        log.info("source worker: playing a source", source=managed.name, worker=self.index)

    def _not_started(self, managed: ManagedSource, error: str) -> None:
        managed.error = error
        managed.retry_at = time.monotonic() + managed.definition["retry_failed_s"]
        log.error("source worker: cannot start a source", source=managed.name, error=error)

    def _read_answers(self, source: VideoSource, events: SinkEvents | None) -> None:
        for answer in source.answers():
            self.tail.publish(source.name, answer)
            if events is not None:
                events.answer(answer)

    def _stop_source(self, managed: ManagedSource, drain_s: float) -> None:
        if managed.source is not None:
            managed.source.close(drain_s)
        if managed.reader is not None:
            managed.reader.join(DRAIN_S + 1)
        if managed.events is not None:
            managed.events.close()


def _frames_for_thumbnails(definition: dict[str, Any]) -> FrameKeeper | None:
    """The source's recent frames, kept for thumbnails (None: it has none)."""
    plan = definition.get("events")
    if definition["thumbnails"] == "none" or not plan or plan.get("max_missed") is None:
        return None
    return FrameKeeper()


def _events_of(
    name: str, definition: dict[str, Any], frames: FrameKeeper | None
) -> SinkEvents | None:
    """The source's ``SinkEvents`` (started), or None when it names no sink."""
    plan = definition.get("events")
    if not plan:
        return None
    pipeline = definition["pipeline"] is not None
    thumbnails = definition["thumbnails"]
    return SinkEvents(name, EventPlan.from_wire(plan), pipeline, thumbnails, frames).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m duomo.video.source_worker")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--ready-fd", type=int, default=None)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-json", action="store_true")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_json)
    worker = SourceWorker(args.socket, args.index)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: worker.stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        return worker.run(args.ready_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
