"""What a model's streams offer it and what it serves them: its capacity, stated and watched.

One ``StreamLoad`` per model, kept in its ``ModelStats`` (``stats.streams``). The supervisor's
stream registry (``supervisor.dataflow.streams``) feeds it as each frame of a stream arrives for the
model (``offered``) and as each is answered (``answered``), and its housekeeping calls
``check`` every 0.1 s, which logs one line per change of state. ``worker.model_status`` reads
it into the model's status (``capacity``) with the age bound that follows, and the metrics
scrape reads that record too.

The definitions, over the last ``WINDOW_S`` seconds:

- **offered**: the frames per second the model's streams hand it — every frame a source
  accepted for the model after its caps (``max_fps`` and ``every`` leave the others out):
  the frames that reached the supervisor, plus those superseded or refused at the source,
  which the next frame sent reports;
- **served**: the frames of its streams it answered OK, per second;
- **lost**: the frames offered that it did not serve because it was behind: superseded (at the
  source or in its queue), refused at the source (``fifo``'s backlog full), refused by its full
  queue (RESOURCE_EXHAUSTED) or past their deadline (DEADLINE_EXCEEDED). Other errors (a bad
  frame, a model not serving) are not a matter of capacity and are not counted here;
- **capacity**: the frames per second the model answers when a frame always waits for it (its
  instances × the frames of a batch ÷ a batch's service time). It is not guessed from a
  benchmark: what the streams lose says whether they offer more. The state is ``over`` once
  more than a tenth of the frames offered were lost (and at least ``MIN_LOST``), and ``ok``
  again once less than a twentieth are (the gap keeps one line per change when the load hovers
  near the edge); while ``over``, served is the capacity the model gives these streams.

A ``fifo`` stream's frames wait at the source rather than being lost, so such a stream shows
``over`` only once its backlog overflows (its answer age grows meanwhile).

Thread-safe: ``offered`` runs on the threads reading the producers, ``answered`` on the
threads answering, ``read`` and ``check`` on the status's, the scrape's and the housekeeping's.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import structlog

from duomo.ipc.model_records import StreamShare

log = structlog.get_logger("duomo.capacity")

WINDOW_S = 5.0
OVER_ABOVE = 0.10  # lost / offered above which the streams are over the model's capacity
OK_BELOW = 0.05  # ... and below which they are within it again
MIN_LOST = 2  # a single lost frame (two cameras' frames arriving together) is no trend
STATES = ("ok", "over")


@dataclass(frozen=True, slots=True)
class LoadReading:
    """A model's load at one moment: its state (``ok`` or ``over``), the frames per second its
    streams offered, it served and they lost, and each stream's part (by name; the streams
    that offered it a frame in the window)."""

    state: str
    offered_fps: float
    served_fps: float
    lost_fps: float
    streams: dict[str, StreamShare]


class _Counts:
    """One stream's events in the window: (time, offered, served, lost) each."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events: deque[tuple[float, int, int, int]] = deque()

    def add(self, now: float, offered: int, served: int, lost: int) -> None:
        self.events.append((now, offered, served, lost))

    def trim(self, horizon: float) -> None:
        events = self.events
        while events and events[0][0] < horizon:
            events.popleft()

    def sums(self) -> tuple[int, int, int]:
        offered = served = lost = 0
        for _, o, s, lost_here in self.events:
            offered += o
            served += s
            lost += lost_here
        return offered, served, lost


class StreamLoad:
    """One model's load from its streams (the module docstring's definitions)."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._streams: dict[str, _Counts] = {}
        self._since_s = 0.0  # when the current spell of frames began (the rates' span)
        self.state = "ok"

    def offered(self, stream: str, lost_at_source: int, now: float) -> None:
        """A frame of ``stream`` arrived; ``lost_at_source`` frames before it were superseded
        or refused at the source (offered, and lost)."""
        self._add(stream, now, 1 + lost_at_source, 0, lost_at_source)

    def answered(self, stream: str, served: bool, lost: bool, now: float) -> None:
        """A frame of ``stream`` was answered: OK (``served``), or lost to the model's load
        (``lost``: superseded in its queue, refused by its full queue, past its deadline)."""
        if served or lost:
            self._add(stream, now, 0, int(served), int(lost))

    def _add(self, stream: str, now: float, offered: int, served: int, lost: int) -> None:
        with self._lock:
            counts = self._streams.get(stream)
            if counts is None:
                if not self._streams:  # fed again after a quiet window: rates from now
                    self._since_s = now
                counts = self._streams[stream] = _Counts()
            counts.add(now, offered, served, lost)
            counts.trim(now - self.window_s)

    def read(self, now: float) -> LoadReading:
        """The load now, in the state last ``check``ed."""
        sums, span = self._window(now)
        with self._lock:
            state = self.state
        return _reading(state, sums, span)

    def check(self, model: str, now: float) -> LoadReading:
        """Decide the state from the window (the module docstring's rule); log one line when
        it changes."""
        sums, span = self._window(now)
        offered = sum(o for o, _, _ in sums.values())
        lost = sum(lost for _, _, lost in sums.values())
        ratio = lost / offered if offered else 0.0
        with self._lock:
            was = self.state
            if was == "ok" and ratio > OVER_ABOVE and lost >= MIN_LOST:
                self.state = "over"
            elif was == "over" and ratio < OK_BELOW:
                self.state = "ok"
            state = self.state
        reading = _reading(state, sums, span)
        if state != was:
            log.info(
                "model capacity",
                model=model,
                capacity=state,
                was=was,
                offered_fps=reading.offered_fps,
                served_fps=reading.served_fps,
                lost_fps=reading.lost_fps,
                streams=len(reading.streams),
            )
        return reading

    def _window(self, now: float) -> tuple[dict[str, tuple[int, int, int]], float]:
        """Each stream's (offered, served, lost) frames in the window, and the rates' span: the
        window, or less since the model was fed again."""
        with self._lock:
            horizon = now - self.window_s
            sums = {}
            for name, counts in list(self._streams.items()):
                counts.trim(horizon)
                if counts.events:
                    sums[name] = counts.sums()
                else:
                    del self._streams[name]  # (no frame in the window: it left the model)
            span = max(min(self.window_s, now - self._since_s), 1e-3)
        return sums, span


def _reading(state: str, sums: dict[str, tuple[int, int, int]], span: float) -> LoadReading:
    served_all = sum(s for _, s, _ in sums.values())
    shares = {
        name: StreamShare(
            round(offered / span, 3),
            round(served / span, 3),
            round(served / served_all, 3) if served_all else 0.0,
        )
        for name, (offered, served, _) in sorted(sums.items())
    }
    offered_all = sum(o for o, _, _ in sums.values())
    lost_all = sum(lost for _, _, lost in sums.values())
    return LoadReading(
        state,
        round(offered_all / span, 3),
        round(served_all / span, 3),
        round(lost_all / span, 3),
        shares,
    )
