"""A producer's camera: a stream of frames into one or more models, freshest first.

``Client.stream`` opens one (the supervisor's ``stream_open``) and attaches a ring per model;
``Stream.send`` hands it a frame and returns at once, never waiting for the models, and
``Stream.answers`` yields each frame's answers as they come (``StreamAnswer``; the records in
and out are ``ipc.stream_records``', re-exported here). Used by producers directly, and by the
video source (``duomo.video``). What it is opened with is one
``ipc.stream_settings.StreamSettings``, checked before anything is sent; what it needs of the
connection is ``StreamLink`` (``ipc.link.ClientLink`` is one) and a way to attach a model
(``Client.model``): this module imports neither the client nor the link.

Each model has a lane: the stream's own slots for it (taken once and kept), and the frames
waiting for one of them. A frame goes into a free slot at once (its header's stream block says
which stream, which frame, when it was captured); with every slot in flight it waits in the
lane:

- ``latest`` keeps only the newest waiting frame: the one it replaces is answered SUPERSEDED
  here; in the supervisor a queued, not yet started frame is superseded by the stream's next
  one as well.
  With at least three slots a new frame always finds one free (one runs, one waits in the
  queue, the third takes the newest and supersedes the one waiting), so an answer's age is
  bounded by the time to finish the batch running, one batch window, its own service time
  and at most one frame period — whatever the load.
- ``fifo`` answers every frame: frames wait in order, at most ``backlog`` of them; beyond
  that a frame is answered RESOURCE_EXHAUSTED here without being sent.

``max_fps`` and ``every`` drop frames before anything is written (``send`` returns False; no
answer comes for them). Slots freed by an answer are refilled from the lane by the thread that
sends, or, when nobody sends, by the stream's own refill thread (the answer's thread reads the
client's socket and never writes a frame).

Each lane counts what happened here to the frames it did not send — superseded, refused
(``backlog full``), skipped by a cap — and the next frame it sends carries those counts in its
slot header's stream block (``Slot.set_stream``), so that the supervisor's figures of the
stream include every frame it was handed, sent or not.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from duomo.ipc.errors import (
    DuomoError,
    ModelChangedError,
    SupersededError,
    UnavailableError,
)
from duomo.ipc.stream_records import Filler, FrameTime, StreamAnswer
from duomo.ipc.stream_settings import StreamSettings
from duomo.ipc.wire import MAX_SOURCE_COUNT

if TYPE_CHECKING:
    from duomo.ipc.handle import ModelHandle
    from duomo.ipc.slots import Slot

__all__ = [
    "Filler",
    "FrameTime",
    "Stream",
    "StreamAnswer",
    "StreamLink",
    "close_stream",
    "open_stream",
]


class StreamLink(Protocol):
    """What a ``Stream`` needs of the connection it runs on (``ipc.link.ClientLink`` is one):
    whether it is open, control round trips (``stream_open``, ``stream_close``), and the count
    of the requests whose answers come on the reading thread, so that someone reads while
    nobody waits."""

    @property
    def connected(self) -> bool:
        """Whether the connection is open."""
        ...

    def request(self, op: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """One control round trip (``Client.request``)."""
        ...

    def async_started(self) -> None:
        """A frame was submitted: its answer comes on the reading thread."""
        ...

    def async_finished(self) -> None:
        """A frame counted by ``async_started`` is done with (answered, or not sent)."""
        ...


def open_stream(link: StreamLink, name: str, settings: StreamSettings) -> int:
    """Open stream ``name`` in the supervisor (``stream_open``): its id, for the slot
    headers' stream block. The errors are ``Client.open_stream``'s."""
    return int(link.request("stream_open", name=name, **settings.to_dict())["stream"])


def close_stream(link: StreamLink, stream_id: int) -> None:
    """Close stream ``stream_id`` in the supervisor (``stream_close``: it turns ``ended``)."""
    link.request("stream_close", stream=stream_id)


@dataclass(slots=True)
class _Frame:
    data: Any
    captured: float
    number: int
    when: FrameTime


@dataclass(slots=True)
class _SourceCounts:
    """What a lane did with the frames it did not send, since the last one it sent: the
    counts the next frame carries (``Slot.set_stream``)."""

    superseded: int
    refused: int
    skipped: int

    @classmethod
    def take(cls, lane: _Lane) -> _SourceCounts:
        """(Under the lock) the lane's counts, as much as a header's field holds (the rest
        rides on a later frame), taken out of it."""
        taken = cls(
            min(lane.superseded, MAX_SOURCE_COUNT),
            min(lane.refused, MAX_SOURCE_COUNT),
            min(lane.skipped, MAX_SOURCE_COUNT),
        )
        lane.superseded -= taken.superseded
        lane.refused -= taken.refused
        lane.skipped -= taken.skipped
        return taken

    def give_back(self, lane: _Lane) -> None:
        """(Under the lock) counts that were not sent, for the next frame."""
        lane.superseded += self.superseded
        lane.refused += self.refused
        lane.skipped += self.skipped


@dataclass(slots=True)
class _Sent:
    """One frame submitted to one model: answered once, by its slot's answer or by the
    failure to send it (``Stream._settle``)."""

    model: str
    lane: _Lane
    item: _Frame
    settled: bool = False


class _Lane:
    """One model's slots of the stream and the frames waiting for them (under the stream's
    lock)."""

    def __init__(self, handle: ModelHandle, slots: int) -> None:
        self.handle = handle
        self.size = slots
        self.free: list[Slot] = [handle.slot() for _ in range(slots)]
        self.waiting: deque[_Frame] = deque()
        # since the last frame sent: replaced here (latest), refused here (fifo's backlog
        # full), dropped by a cap (max_fps, every); the next frame sent carries them
        self.superseded = 0
        self.refused = 0
        self.skipped = 0
        self.pumping = False  # a thread is writing waiting frames into free slots
        self.stale = False  # answered MODEL_CHANGED: take the slots anew once all are back

    @property
    def idle(self) -> bool:
        return len(self.free) == self.size and not self.waiting


class Stream:
    """A stream of frames into models, opened by ``Client.stream`` (see the module docstring
    for the policies).

    Example:
        cam = client.stream("gate-3", models=["face", "ocr"], policy="latest")
        cam.send(frame, captured=time.monotonic())  # returns at once
        for answer in cam.answers(timeout_s=1.0):
            print(answer.to_json())

    Attributes:
        name: The stream's name.
        models: The models each frame goes to.
        policy: ``latest`` or ``fifo``.
        stream_id: Its id on the connection (the slot headers carry it).
    """

    def __init__(
        self,
        link: StreamLink,
        attach: Callable[[str, int], ModelHandle],
        name: str,
        settings: StreamSettings,
    ) -> None:
        """Made by ``Client.stream``, which documents the settings: opens stream ``name`` on
        ``link`` and attaches each of its models with ``attach`` (``Client.model``); on a
        failure nothing stays open."""
        self.name = name
        self.models = settings.models
        self.policy = settings.policy
        self.timeout_s = settings.timeout_s
        self._link = link
        self._period = 1.0 / settings.max_fps if settings.max_fps else 0.0
        self._every = settings.every or 1
        self._backlog = settings.backlog
        self._due = 0.0
        self._offered = 0  # frames offered to send (``every`` counts them)
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._answers: deque[StreamAnswer] = deque()
        self._arrived = threading.Condition(self._lock)
        self._closed = False  # no more frames are taken
        self._stopped = False  # nothing more is written (closing, after the drain)
        self.stream_id = open_stream(link, name, settings)
        self._lanes: dict[str, _Lane] = {}
        slots = settings.slots
        try:
            for model in self.models:
                self._lanes[model] = _Lane(attach(model, slots), slots)
        except BaseException:  # (a model not served, no room for a ring): nothing stays open
            self._close_lanes()
            with contextlib.suppress(DuomoError):
                close_stream(link, self.stream_id)
            raise
        self._refill_wanted = threading.Event()
        self._refiller: threading.Thread | None = None

    # -- sending ---------------------------------------------------------------------------

    def send(
        self,
        data: np.ndarray | Mapping[str, np.ndarray] | Filler,
        captured: float | None = None,
        frame: int | None = None,
        when: FrameTime | None = None,
    ) -> bool:
        """Hand one frame to every model of the stream; returns at once.

        Args:
            data: An image (uint8 H×W×C RGB, or H×W), a dict of arrays by input name, or a
                ``Filler``. Kept, not copied, while it waits for a slot: do not change it.
            captured: When it was captured, seconds on ``time.monotonic`` (default: now).
            frame: Its frame number (default: counted from 0).
            when: Its capture time on the wall clock, with the clock it came from and its
                pts, which the answers carry (default: ``captured`` as its arrival).

        Returns:
            False when ``max_fps`` or ``every`` dropped it (no answer will come for it).

        Raises:
            UnavailableError: The stream is closed, or the connection is lost.
        """
        if self._closed:
            raise UnavailableError(f"stream {self.name!r} is closed")
        now = time.monotonic()
        captured = now if captured is None else captured
        number = next(self._numbers) if frame is None else frame
        if self._dropped_at_source(captured):
            with self._lock:
                for lane in self._lanes.values():
                    lane.skipped += 1
            return False
        item = _Frame(data, captured, number, when or FrameTime.of_monotonic(captured))
        for model, lane in self._lanes.items():
            with self._arrived:
                if self.policy == "latest" and lane.waiting:
                    old = lane.waiting.pop()
                    lane.superseded += 1
                    self._answer_held(_local(self.name, model, old, "SUPERSEDED"))
                if len(lane.waiting) >= self._backlog:
                    lane.refused += 1
                    self._answer_held(
                        _local(self.name, model, item, "RESOURCE_EXHAUSTED", "backlog full")
                    )
                    continue
                lane.waiting.append(item)
            self._pump(model, lane)
        return True

    def _dropped_at_source(self, captured: float) -> bool:
        self._offered += 1
        if self._every > 1 and (self._offered - 1) % self._every:
            return True
        if self._period:
            if captured < self._due:
                return True
            self._due = max(self._due + self._period, captured + self._period / 2)
        return False

    def _pump(self, model: str, lane: _Lane) -> None:
        """Write waiting frames into free slots, oldest first, until either runs out; one
        thread at a time per lane (another finds it pumping and leaves its frame to it)."""
        with self._lock:
            if lane.pumping:
                return
            lane.pumping = True
        try:
            while True:
                with self._lock:
                    renew = lane.stale and len(lane.free) == lane.size and not self._stopped
                    if not renew and (
                        lane.stale or self._stopped or not (lane.waiting and lane.free)
                    ):
                        lane.pumping = False
                        return
                    if not renew:
                        item = lane.waiting.popleft()
                        slot = lane.free.pop()
                        counts = _SourceCounts.take(lane)
                if renew:
                    self._take_slots_anew(lane)
                else:
                    self._submit(model, lane, slot, item, counts)
        except BaseException:
            with self._lock:
                lane.pumping = False
            raise

    def _take_slots_anew(self, lane: _Lane) -> None:
        """(Pumping, every slot back) after MODEL_CHANGED: the handle re-attaches."""
        with self._lock:
            old, lane.free = lane.free, []
        for slot in old:
            slot.release()
        fresh = [lane.handle.slot() for _ in range(lane.size)]
        with self._lock:
            lane.free, lane.stale = fresh, False

    def _submit(
        self, model: str, lane: _Lane, slot: Slot, item: _Frame, counts: _SourceCounts
    ) -> None:
        """Write ``item`` into ``slot`` and submit it, carrying ``counts``; a failure is the
        frame's answer (once: a connection lost during the submit may have answered it
        already, through the slot), and ``counts`` ride on the next frame instead."""
        try:
            data = item.data
            if isinstance(data, Filler):
                name = lane.handle.layout.inputs[0].name
                data.fill(slot.input(name, tuple(data.shape)))
            else:
                slot.write(data)
            slot.set_stream(
                self.stream_id,
                item.number,
                int(item.captured * 1e6),
                counts.superseded,
                counts.refused,
                counts.skipped,
            )
        except DuomoError as err:
            self._failed(model, lane, slot, item, err, counts)
            return
        sent = _Sent(model, lane, item)
        slot.on_done = functools.partial(self._on_answer, sent)
        self._link.async_started()
        try:
            slot.submit(timeout_s=self.timeout_s)
        except BaseException as err:
            if not self._settle(sent):  # the connection's loss answered it, and gave it back
                raise
            if not isinstance(err, DuomoError):
                raise
            self._failed(model, lane, slot, item, err, counts)

    def _settle(self, sent: _Sent) -> bool:
        """Whether this is the first word on ``sent`` — its answer, or the failure to send
        it — and so the one that answers the frame and gives its slot back (once: a connection
        lost during the submit answers the slot as well)."""
        with self._lock:
            if sent.settled:
                return False
            sent.settled = True
        self._link.async_finished()
        return True

    def _failed(
        self,
        model: str,
        lane: _Lane,
        slot: Slot,
        item: _Frame,
        err: DuomoError,
        counts: _SourceCounts,
    ) -> None:
        """``item`` could not be sent: answered with ``err``, its slot free again, and the
        counts it was to carry left for the next frame sent."""
        with self._lock:
            lane.free.append(slot)
            counts.give_back(lane)
        self._answer(_local(self.name, model, item, err.code.name, err.message))
        if isinstance(err, UnavailableError):
            raise err

    def _on_answer(self, sent: _Sent, slot: Slot) -> None:
        """A slot's answer, on the client's reading thread: record it, give the slot back to
        the lane, and wake the refill thread if frames wait."""
        if not self._settle(sent):  # (the failure to send it answered it already)
            return
        model, lane, item = sent.model, sent.lane, sent.item
        now = time.monotonic()
        outcome, result, error = "OK", None, None
        try:
            result = slot.wait(timeout_s=0, copy=True)
        except SupersededError:
            outcome = "SUPERSEDED"
        except DuomoError as err:
            outcome, error = err.code.name, err.message
            if isinstance(err, ModelChangedError):
                lane.stale = True
        answer = StreamAnswer(
            self.name,
            item.number,
            model,
            (now - item.captured) * 1e3,
            outcome,
            result,
            error,
            item.captured,
            item.when,
        )
        with self._lock:
            lane.free.append(slot)
            refill = bool(lane.waiting) and not lane.pumping
            self._answers.append(answer)
            self._arrived.notify_all()
        if refill:
            self._refill_soon()

    def _refill_soon(self) -> None:
        if self._refiller is None:
            with self._lock:
                if self._refiller is None:
                    self._refiller = threading.Thread(
                        target=self._refill, name=f"duomo-stream-{self.name}", daemon=True
                    )
                    self._refiller.start()
        self._refill_wanted.set()

    def _refill(self) -> None:
        while not self._stopped:
            self._refill_wanted.wait(0.5)
            self._refill_wanted.clear()
            for model, lane in self._lanes.items():
                try:
                    self._pump(model, lane)
                except DuomoError:
                    return  # the connection is gone: nothing more can be sent

    def _answer(self, answer: StreamAnswer) -> None:
        with self._arrived:
            self._answer_held(answer)

    def _answer_held(self, answer: StreamAnswer) -> None:
        """(Under the lock) an answer for ``answers``."""
        self._answers.append(answer)
        self._arrived.notify_all()

    # -- answers ----------------------------------------------------------------------------

    def answers(self, timeout_s: float | None = None) -> Iterator[StreamAnswer]:
        """The answers in the order they arrive: blocks for each; ends once the stream is
        closed and every answer was taken, or after ``timeout_s`` with none."""
        while True:
            with self._arrived:
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                while not self._answers:
                    if self._closed and self._quiet():
                        return
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return
                    self._arrived.wait(0.25 if remaining is None else min(remaining, 0.25))
                answer = self._answers.popleft()
            yield answer

    def poll(self) -> list[StreamAnswer]:
        """The answers that have arrived, without waiting."""
        with self._arrived:
            taken = list(self._answers)
            self._answers.clear()
        return taken

    def _quiet(self) -> bool:
        return all(lane.idle for lane in self._lanes.values())

    @property
    def in_flight(self) -> int:
        """Frames sent and not answered, over all models."""
        with self._lock:
            return sum(lane.size - len(lane.free) for lane in self._lanes.values())

    # -- closing ----------------------------------------------------------------------------

    def close(self, drain_s: float = 5.0) -> None:
        """Stop sending: wait up to ``drain_s`` for the frames in flight and waiting to be
        answered, then close the stream (``ended`` in the supervisor) and detach its rings.
        Answers already arrived stay readable (``answers``, ``poll``)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + drain_s
        self._refill_wanted.set()
        while time.monotonic() < deadline and self._link.connected:
            with self._arrived:
                if self._quiet():
                    break
                self._arrived.wait(0.05)
            for model, lane in self._lanes.items():
                if lane.waiting and not lane.pumping:
                    try:
                        self._pump(model, lane)
                    except DuomoError:
                        break
        with self._arrived:  # what still waits is not sent
            self._stopped = True
            for model, lane in self._lanes.items():
                for item in lane.waiting:
                    self._answers.append(_local(self.name, model, item, "UNAVAILABLE", "closed"))
                lane.waiting.clear()
            self._arrived.notify_all()
        self._refill_wanted.set()
        while any(lane.pumping for lane in self._lanes.values()):  # (a write under way)
            time.sleep(0.001)
        with contextlib.suppress(DuomoError):  # (gone: the supervisor ended it already)
            close_stream(self._link, self.stream_id)
        self._close_lanes()  # frames in flight are answered UNAVAILABLE

    def _close_lanes(self) -> None:
        for lane in self._lanes.values():
            with contextlib.suppress(DuomoError):
                lane.handle.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _local(
    stream: str, model: str, item: _Frame, outcome: str, error: str | None = None
) -> StreamAnswer:
    """An answer given at the source, without the supervisor (superseded, or refused)."""
    age_ms = (time.monotonic() - item.captured) * 1e3
    return StreamAnswer(
        stream, item.number, model, age_ms, outcome, None, error, item.captured, item.when
    )
