"""Streams on the supervisor's side: each camera's state, its liveness and its figures.

A producer opens a stream over the control socket (``stream_open``: a name, the models it
feeds, a policy, a weight, its nominal frame rate); the server records it here and on the
connection (``Connection.streams``), which ends it when it closes. Every slot of the stream
carries its id (``ipc.wire``'s stream block); the attachment (``supervisor.process.attachment``)
counts each frame here as it arrives (``received``, on the thread reading the connection) and each
answer (``answered``, on the thread answering it, before the answer is sent: a scrape made the
moment a producer has its answer counts it). The batcher sees a stream only as a request's
``flow`` and ``weight``, and a ``latest`` stream's requests as superseding.

Figures are per stream and model (a frame sent to two models is two requests): frames in,
answered, superseded (in the queue, and at the source), refused (at the source: ``fifo``'s
backlog full; and any other outcome than OK and SUPERSEDED here), skipped (by the source's caps,
``max_fps`` and ``every``), the input and answered rates over the last ``RATE_WINDOW_S``, and
the answer age (answer time minus capture time) percentiles over the last ``AGE_WINDOW_S``. What
happened at the source to the frames it did not send, the next frame it sends says (its header's
stream block). A stream opened again under its name carries its counts on (they are Prometheus
counters) but starts its rates and ages afresh, and shows only the models it feeds now (a model
it no longer feeds keeps its counts, hidden, for when it feeds it again).

What a stream shows is its ``StreamStatus`` record (``ipc.status_records``), made here
(``StreamState.status``; every stream's: the registry's ``snapshot``) and read as it is by the
supervisor's ``status`` and by ``/metrics``.

Each frame and answer also feeds its model's load (``worker.stream_load``: what the streams
offer a model against what it serves them), and ``tick`` checks each model's load, which logs
one line per change of its capacity state.

Liveness, per stream, from those timestamps (``StreamState.state``)::

    starting  opened, nothing answered yet
    running   answering
    blocked   a frame was superseded or refused in the last ``blocked_for_s`` (the models are
              behind this stream: at least 1 s, or 3 nominal frame periods)
    stalled   no frame for ``stall_after_s`` (the camera, or its source, went silent)
    ended     closed, or its producer went away (kept for the status until its slot in
              ``limits.max_streams`` is needed)

The reactor's housekeeping calls ``tick``, which logs one line per change of state (a stream's
liveness, a model's capacity).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from duomo.ipc.errors import ErrorCode, InvalidArgumentError, ResourceExhaustedError, echoed
from duomo.ipc.status_records import StreamModelFigures, StreamStatus
from duomo.ipc.stream_settings import StreamSettings
from duomo.worker.stream_load import StreamLoad

log = structlog.get_logger("duomo.streams")

STATES = ("starting", "running", "blocked", "stalled", "ended")
MAX_NAME = 64
RATE_WINDOW_S = 5.0
AGE_WINDOW_S = 60.0
AGE_SAMPLES = 1 << 16  # the most answers the age window keeps (a bound on memory at any rate)
BLOCKED_FOR_S = 1.0
# the outcomes of a frame lost to its model's load (``worker.stream_load``'s "lost")
LOST_TO_LOAD = frozenset(
    {ErrorCode.SUPERSEDED, ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.DEADLINE_EXCEEDED}
)


def check_name(name: str) -> str:
    """A stream's name: 1..64 printable characters."""
    if not 0 < len(name) <= MAX_NAME or not name.isprintable():
        raise InvalidArgumentError(
            f"a stream's name is 1..{MAX_NAME} printable characters, not {echoed(name)}"
        )
    return name


@dataclass
class ModelFigures:
    """One stream's counts and recent samples for one of its models (under its lock)."""

    frames_in: int = 0
    answered: int = 0
    superseded: int = 0
    refused: int = 0
    skipped: int = 0
    arrivals: deque[float] = field(default_factory=deque)  # within RATE_WINDOW_S
    answers: deque[float] = field(default_factory=deque)  # OK answers, within RATE_WINDOW_S
    # (answer time, age) of OK answers within AGE_WINDOW_S
    ages_s: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=AGE_SAMPLES))

    def start_afresh(self) -> None:
        """Forget the rates' and ages' samples (a reopened stream); the counts go on."""
        self.arrivals.clear()
        self.answers.clear()
        self.ages_s.clear()


def blocked_for_s(settings: StreamSettings) -> float:
    """How long a superseded or refused frame keeps a stream opened with ``settings``
    ``blocked``: at least ``BLOCKED_FOR_S``, or 3 nominal frame periods."""
    return max(BLOCKED_FOR_S, 3 / settings.fps) if settings.fps else BLOCKED_FOR_S


class StreamState:
    """One stream: what it was opened with, its figures and its liveness. Hashable by
    identity: it is its requests' ``flow`` in the batcher."""

    def __init__(
        self,
        stream_id: int,
        name: str,
        settings: StreamSettings,
        client: str,
        now: float,
        loads: dict[str, StreamLoad] | None = None,
    ) -> None:
        """``loads``: the registry's table of each model's load, as last fed (``tick`` checks
        them)."""
        self.id = stream_id
        self.name = name
        self._lock = threading.Lock()
        self._figures: dict[str, ModelFigures] = {}
        self._loads = loads if loads is not None else {}
        self.reopen(settings, client, now)

    def reopen(self, settings: StreamSettings, client: str, now: float) -> None:
        """(Re)start it with these settings: an ended stream's counts carry on, its rates and
        ages start afresh, and only the models it feeds now are shown."""
        with self._lock:
            self.settings = settings
            self.client = client
            self.opened_s = now
            self.last_frame_s = now
            self.last_trouble_s = -1e18
            self.any_answer = False
            self.ended = False
            for figures in self._figures.values():
                figures.start_afresh()
            for model in settings.models:
                self._figures.setdefault(model, ModelFigures())
        self.logged_state = "starting"
        self.state_since_s = now

    def received(
        self,
        model: str,
        now: float,
        load: StreamLoad | None = None,
        superseded: int = 0,
        refused: int = 0,
        skipped: int = 0,
    ) -> None:
        """A frame of this stream for ``model`` arrived (its ``load``: the model's, which it
        feeds); since its last one the source superseded ``superseded`` frames, refused
        ``refused`` and its caps skipped ``skipped`` (the header's stream block)."""
        with self._lock:
            figures = self._figures[model]
            figures.frames_in += 1
            figures.arrivals.append(now)
            _trim(figures.arrivals, now)
            self.last_frame_s = now
            figures.skipped += skipped
            if superseded or refused:
                figures.superseded += superseded
                figures.refused += refused
                self.last_trouble_s = now
        if load is not None:
            self._loads[model] = load
            load.offered(self.name, superseded + refused, now)

    def answered(self, model: str, code: ErrorCode, age_s: float, now: float) -> None:
        """A frame of this stream was answered by ``model``, ``age_s`` after its capture."""
        load = self._loads.get(model)
        if load is not None:
            load.answered(self.name, code is ErrorCode.OK, code in LOST_TO_LOAD, now)
        with self._lock:
            figures = self._figures[model]
            if code is ErrorCode.OK:
                figures.answered += 1
                figures.answers.append(now)
                _trim(figures.answers, now)
                figures.ages_s.append((now, age_s))
                _trim_ages(figures.ages_s, now)
                self.any_answer = True
                return
            if code is ErrorCode.SUPERSEDED:
                figures.superseded += 1
            else:
                figures.refused += 1
            self.last_trouble_s = now

    def end(self) -> None:
        with self._lock:
            self.ended = True

    def state(self, now: float) -> str:
        """Its liveness now (the module docstring's rules)."""
        if self.ended:
            return "ended"
        settings = self.settings
        if now - self.last_frame_s > settings.stall_after_s:
            return "stalled"
        if now - self.last_trouble_s < blocked_for_s(settings):
            return "blocked"
        return "running" if self.any_answer else "starting"

    def status(self, now: float) -> StreamStatus:
        """Its status record: its liveness now, its settings, and its figures per model it
        feeds now."""
        state = self.state(now)
        span = max(min(RATE_WINDOW_S, now - self.opened_s), 1e-3)
        with self._lock:
            per_model: dict[str, StreamModelFigures] = {}
            for model in self.settings.models:  # (a model it no longer feeds: not shown)
                f = self._figures[model]
                _trim(f.arrivals, now)
                _trim(f.answers, now)
                _trim_ages(f.ages_s, now)
                ages = sorted(age for _, age in f.ages_s)
                per_model[model] = StreamModelFigures(
                    frames_in=f.frames_in,
                    answered=f.answered,
                    superseded=f.superseded,
                    refused=f.refused,
                    skipped=f.skipped,
                    input_fps=round(len(f.arrivals) / span, 3),
                    answered_fps=round(len(f.answers) / span, 3),
                    age_ms_p50=_percentile_ms(ages, 0.50),
                    age_ms_p99=_percentile_ms(ages, 0.99),
                )
        return StreamStatus(
            name=self.name,
            state=state,
            since_s=round(max(now - self.state_since_s, 0.0), 3),
            policy=self.settings.policy,
            weight=self.settings.weight,
            fps_nominal=self.settings.fps,
            stall_after_s=self.settings.stall_after_s,
            client=self.client,
            models=per_model,
        )


def _trim(times: deque[float], now: float) -> None:
    horizon = now - RATE_WINDOW_S
    while times and times[0] < horizon:
        times.popleft()


def _trim_ages(ages: deque[tuple[float, float]], now: float) -> None:
    horizon = now - AGE_WINDOW_S
    while ages and ages[0][0] < horizon:
        ages.popleft()


def _percentile_ms(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)


class StreamRegistry:
    """Every stream by name, live or ended; at most ``max_streams`` of them (the bound on the
    metrics' ``stream`` label): opening one more forgets the longest-ended, or is refused."""

    def __init__(self, max_streams: int) -> None:
        self.max_streams = max_streams
        self._lock = threading.Lock()
        self._by_name: dict[str, StreamState] = {}
        self._ended_s: dict[str, float] = {}  # name -> when it ended
        self._ids = itertools.count(1)
        # model -> its load as last fed by a stream (a model rebuilt by a reload: its new one)
        self._loads: dict[str, StreamLoad] = {}

    def open(
        self, name: str, settings: StreamSettings, client: str = "", now: float | None = None
    ) -> StreamState:
        """Open stream ``name`` (INVALID_ARGUMENT if a live stream has it;
        RESOURCE_EXHAUSTED at ``max_streams`` live streams). An ended stream of that name is
        opened again, its counts carried on."""
        check_name(name)  # (``settings`` were checked when made: ``ipc.stream_settings``)
        now = time.monotonic() if now is None else now
        with self._lock:
            stream = self._by_name.get(name)
            if stream is not None and not stream.ended:
                raise InvalidArgumentError(
                    f"stream {name!r} is already open (by {stream.client}); close it first"
                )
            if stream is None:
                if len(self._by_name) >= self.max_streams:
                    self._forget_oldest_ended(name)
                stream = StreamState(next(self._ids), name, settings, client, now, self._loads)
                self._by_name[name] = stream
            else:
                self._ended_s.pop(name, None)
                stream.reopen(settings, client, now)
        log.info(
            "stream opened",
            stream=name,
            models=list(settings.models),
            policy=settings.policy,
            client=client,
        )
        return stream

    def _forget_oldest_ended(self, name: str) -> None:
        if not self._ended_s:
            raise ResourceExhaustedError(
                f"cannot open stream {name!r}: {self.max_streams} streams are open "
                "(limits.max_streams)"
            )
        oldest = min(self._ended_s, key=self._ended_s.__getitem__)
        del self._ended_s[oldest]
        del self._by_name[oldest]

    def close(self, streams: Iterable[StreamState], why: str = "closed") -> None:
        """End these streams (closed by their producer, or it went away)."""
        now = time.monotonic()
        for stream in streams:
            with self._lock:
                if self._by_name.get(stream.name) is not stream or stream.ended:
                    continue
                stream.end()
                self._ended_s[stream.name] = now
            self._log_state(stream, "ended", now, why=why)

    def tick(self, now: float) -> None:
        """Log each stream whose liveness changed since the last tick, and check each model's
        load, which logs a change of its capacity state (the reactor's housekeeping)."""
        with self._lock:
            streams = list(self._by_name.values())
        for stream in streams:
            state = stream.state(now)
            if state != stream.logged_state:
                self._log_state(stream, state, now)
        for model, load in list(self._loads.items()):
            load.check(model, now)

    @staticmethod
    def _log_state(stream: StreamState, state: str, now: float, **extra: Any) -> None:
        was, stream.logged_state = stream.logged_state, state
        if was == state:
            return
        stream.state_since_s = now
        log.info("stream state", stream=stream.name, state=state, was=was, **extra)

    def snapshot(self, now: float | None = None) -> tuple[StreamStatus, ...]:
        """Every stream's status record, by name (``status``, ``/metrics``)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            streams = sorted(self._by_name.values(), key=lambda s: s.name)
        return tuple(stream.status(now) for stream in streams)
