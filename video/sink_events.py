"""A source's events into its sinks' outboxes: answers and object events, numbered by the
sequencer and appended off the frame path.

``SinkEvents(source, plan, pipeline)`` is made for a source that names sinks (its assignment's
``events``: ``EventPlan``; or ``duomo stream --sink``'s). ``answer(StreamAnswer)`` is called on
the source's answer-reading thread for each answer; it turns an OK answer into drafts — one
``answer`` event (``emit`` answers or both) and the object events of ``video.object_visits``
(``emit`` objects or both, a pipeline with a tracker) — and puts them on a bounded queue
(``QUEUE_BOUND``). It never waits: when the queue is full the draft is lost, counted
(``lost``) and logged at most every ``LOST_LOG_S``; a lost draft never got a seq, so the seqs
stay contiguous and the loss shows in the count and the log, not as a gap.

The writer thread takes drafts in batches, reserves their seqs in one step
(``Sequencer.next(source, n)``: one seq per event, shared by all the source's sinks), encodes
each event once and appends the batch to each sink's outbox (``Outbox.append``: a local SQLite
commit, never the network). So decoding and inference never wait for SQLite, and a dead broker
never reaches this far. A process killed between the seq's reservation and the append loses
those events as a gap (the sequencer's documented rule: a gap means lost, a seq is never
reused).

``captured_at`` / ``clock`` / ``frame`` are the answer's frame's (``StreamAnswer.when``, or its
monotonic capture time as an arrival). ``close()`` makes the ``object_left`` events of the
visits still open, writes what is queued and closes the files.

Threads: ``answer`` on the reader thread; the writer thread owns the sequencer and the outboxes.
Used by ``video.source_worker`` and ``video.command`` (``duomo stream --sink``).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from duomo.ipc.stream_records import FrameTime, StreamAnswer
from duomo.sinks.config import OutboxConfig
from duomo.sinks.events import Event, EventKind, TrackedObject
from duomo.sinks.outbox import Outbox, OutboxEntry, outbox_path
from duomo.sinks.sequencer import FILE_NAME, Sequencer
from duomo.video.object_visits import ObjectChange, ObjectVisits
from duomo.video.thumbnails import FrameKeeper

log = structlog.get_logger("duomo.video")
QUEUE_BOUND = 4096  # drafts waiting for the writer
BATCH = 256  # drafts the writer numbers and appends at once
LOST_LOG_S = 10.0
CLOSE_JOIN_S = 10.0


@dataclass(frozen=True, slots=True)
class SinkTarget:
    """One sink a source feeds: its name and its outbox's bounds."""

    name: str
    outbox: OutboxConfig


@dataclass(frozen=True, slots=True)
class EventPlan:
    """Where a source's events go and which: the outboxes' ``directory``, its ``sinks``,
    ``emit`` (answers | objects | both, resolved) and its tracker's ``max_missed`` (None: no
    tracker, no object events)."""

    directory: Path
    sinks: tuple[SinkTarget, ...]
    emit: str
    max_missed: int | None

    @classmethod
    def from_wire(cls, given: dict[str, Any]) -> EventPlan:
        """The ``events`` of a source's assignment (``SinkHub.plan``)."""
        return cls(
            Path(given["directory"]),
            tuple(SinkTarget(s["name"], cls.bounds(s["outbox"])) for s in given["sinks"]),
            str(given["emit"]),
            given.get("max_missed"),
        )

    @staticmethod
    def bounds(outbox: dict[str, Any]) -> OutboxConfig:
        """A sink's outbox bounds as the supervisor sends them."""
        return OutboxConfig.model_validate(outbox)

    @property
    def answers(self) -> bool:
        return self.emit in ("answers", "both")

    @property
    def objects(self) -> bool:
        return self.emit in ("objects", "both") and self.max_missed is not None


@dataclass(frozen=True, slots=True)
class _Draft:
    """An event before its seq."""

    kind: EventKind
    when: FrameTime
    frame: int
    feeds: str  # the model or pipeline that answered
    result: Any = None
    object: TrackedObject | None = None


_CLOSE = object()


class SinkEvents:
    """The events of the source ``source`` into ``plan``'s outboxes; ``pipeline``: whether
    what it feeds is a pipeline (the events name ``pipeline``, else ``model``)."""

    def __init__(
        self,
        source: str,
        plan: EventPlan,
        pipeline: bool,
        thumbnails: str = "none",
        frames: FrameKeeper | None = None,
    ) -> None:
        """``thumbnails`` (``none``, ``left``, ``appeared``) with ``frames``, the source's
        recent frames: object events carry the crop of the visit's best frame."""
        self.source = source
        self.plan = plan
        self.pipeline = pipeline
        self.lost = 0  # drafts the full queue refused
        self.written = 0  # events appended (to every sink)
        self._feeds = ""  # the model or pipeline of the last answer (for the visits' ends)
        tracked = plan.objects and plan.max_missed is not None
        crop = frames.crop if frames is not None else None
        self._visits = ObjectVisits(plan.max_missed or 0, thumbnails, crop) if tracked else None
        self._queue: queue.Queue[object] = queue.Queue(QUEUE_BOUND)
        self._sequencer = Sequencer(plan.directory / FILE_NAME)
        self._outboxes = [
            Outbox(outbox_path(plan.directory, s.name), s.outbox, s.name) for s in plan.sinks
        ]
        self._writer: threading.Thread | None = None
        self._next_lost_log = 0.0
        self._unlogged_lost = 0

    def start(self) -> SinkEvents:
        """Open the sequencer and the outboxes (``sqlite3.Error`` / ``OSError`` if one cannot
        be) and start the writer."""
        self._sequencer.open()
        for outbox in self._outboxes:
            outbox.open()
        self._writer = threading.Thread(
            target=self._write, name=f"events-{self.source}", daemon=True
        )
        self._writer.start()
        return self

    # -- the answer-reading thread ------------------------------------------------------------

    def answer(self, answer: StreamAnswer) -> None:
        """The drafts of one answer, queued (an answer that is not OK makes none)."""
        if not answer.ok:
            return
        self._feeds = answer.model
        when = answer.when or FrameTime.of_monotonic(answer.captured)
        if self.plan.answers:
            self._put(_Draft("answer", when, answer.frame, answer.model, result=answer.result))
        if self._visits is not None:
            for change in self._visits.update(answer.result, when, answer.frame):
                self._put_change(change, answer.model)

    def close(self) -> None:
        """The open visits leave; what is queued is written; the files close."""
        if self._visits is not None:
            for change in self._visits.end():
                self._put_change(change, self._feeds)
        if self._writer is not None:
            try:
                self._queue.put(_CLOSE, timeout=CLOSE_JOIN_S)
            except queue.Full:
                log.error("source events: the writer is stuck; closing", source=self.source)
            self._writer.join(CLOSE_JOIN_S)
        for outbox in self._outboxes:
            outbox.close()
        self._sequencer.close()
        if self._unlogged_lost:
            self._log_lost()

    def _put_change(self, change: ObjectChange, feeds: str) -> None:
        self._put(_Draft(change.kind, change.when, change.frame, feeds, object=change.object))

    def _put(self, draft: _Draft) -> None:
        try:
            self._queue.put_nowait(draft)
        except queue.Full:
            self.lost += 1
            self._unlogged_lost += 1
            if time.monotonic() >= self._next_lost_log:
                self._log_lost()

    def _log_lost(self) -> None:
        log.warning(
            "source events lost: the outbox writer is behind", source=self.source,
            lost=self._unlogged_lost, lost_total=self.lost, queue_bound=QUEUE_BOUND,
        )  # fmt: skip
        self._unlogged_lost = 0
        self._next_lost_log = time.monotonic() + LOST_LOG_S

    # -- the writer thread --------------------------------------------------------------------

    def _write(self) -> None:
        closing = False
        while not closing:
            batch: list[_Draft] = []
            item = self._queue.get()
            while True:
                if item is _CLOSE:
                    closing = True
                    break
                assert isinstance(item, _Draft)
                batch.append(item)
                if len(batch) >= BATCH:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._append(batch)

    def _append(self, batch: list[_Draft]) -> None:
        try:
            first = self._sequencer.next(self.source, len(batch))
            entries = [OutboxEntry.of(self._event(first + i, d)) for i, d in enumerate(batch)]
            for outbox in self._outboxes:
                outbox.append(entries)
        except Exception:  # (a full disk, say: those events are lost, as a gap)
            log.exception("source events: cannot append to the outboxes", source=self.source)
            return
        self.written += len(batch)

    def _event(self, seq: int, draft: _Draft) -> Event:
        feeds = draft.feeds
        return Event(
            source=self.source, seq=seq, kind=draft.kind, when=draft.when, frame=draft.frame,
            model=None if self.pipeline else feeds, pipeline=feeds if self.pipeline else None,
            result=draft.result, object=draft.object,
        )  # fmt: skip
