"""What goes into a stream and what comes out: a frame that writes itself into its slot
(``Filler``), when a frame was captured (``FrameTime``) and one model's answer to one frame
(``StreamAnswer``, whose ``to_json`` is the line ``duomo stream`` writes: a contract).

Records only, made by ``ipc.stream.Stream`` (and by the gateway and the video source, which
carry a caller's or a camera's capture time), read by producers and by the video source's
writers (``duomo.video``); ``ipc.stream`` re-exports them. Frozen: an answer handed out is
never changed.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Filler:
    """A frame that writes itself into the slot: ``fill(out)`` writes an image of ``shape``
    and ``dtype`` into the slot's input view ``out`` (a decoder converting its colours straight
    into shared memory, say: the frame's one copy). Called once per model, on the thread that
    sends or refills."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any] | type
    fill: Callable[[np.ndarray], object]


CLOCKS = ("camera", "arrival", "caller")


@dataclass(frozen=True, slots=True)
class FrameTime:
    """When a frame was captured, on the wall clock, and where that time came from.

    Attributes:
        at: The capture time, UNIX seconds (UTC).
        clock: ``"camera"`` (the camera's own clock: an RTSP stream's RTCP sender reports),
            ``"arrival"`` (when the decoder, or the producer, received the frame) or
            ``"caller"`` (what a remote caller said: the gateway's ``captured_us``).
        pts: The frame's presentation time in its stream, seconds (None: not known).
    """

    at: float
    clock: str = "arrival"
    pts: float | None = None

    @classmethod
    def of_monotonic(cls, captured: float, pts: float | None = None) -> FrameTime:
        """The wall-clock time of ``captured`` (``time.monotonic`` seconds), as received."""
        return cls(time.time() - (time.monotonic() - captured), "arrival", pts)

    @property
    def rfc3339(self) -> str:
        """``at`` as RFC 3339 in UTC with milliseconds: ``2026-12-06T21:40:00.123Z``."""
        moment = datetime.datetime.fromtimestamp(self.at, datetime.timezone.utc)
        return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class StreamAnswer:
    """One model's answer to one frame of a stream.

    Attributes:
        stream: The stream's name.
        frame: The frame number.
        model: The model that answered.
        age_ms: Answer time minus capture time (the monotonic clock), in ms.
        outcome: ``"OK"``, ``"SUPERSEDED"`` (a newer frame took its place: not an error) or
            the error's code name (``"RESOURCE_EXHAUSTED"``, ``"UNAVAILABLE"``, …).
        result: The model's result when ``outcome`` is OK (a dict for structured tasks,
            ``{output: array}`` for raw models).
        error: The error's message, for an error outcome.
        captured: The capture time, seconds on ``time.monotonic``.
        when: The capture time on the wall clock, its clock and the frame's pts (None:
            derived from ``captured`` as its arrival).
    """

    stream: str
    frame: int
    model: str
    age_ms: float
    outcome: str
    result: Any = None
    error: str | None = None
    captured: float = 0.0
    when: FrameTime | None = None

    @property
    def ok(self) -> bool:
        """Whether the model answered with a result (``outcome`` is OK)."""
        return self.outcome == "OK"

    def to_json(self) -> dict[str, Any]:
        """The JSON line ``duomo stream`` writes (a contract): ``stream``, ``frame``,
        ``model``, ``age_ms``, ``captured_at`` (RFC 3339, UTC, ms), ``clock`` (``camera``,
        ``arrival`` or ``caller``), ``pts`` (seconds, or null), then ``result`` or
        ``outcome`` (and ``error`` for an error)."""
        when = self.when or FrameTime.of_monotonic(self.captured)
        line: dict[str, Any] = {
            "stream": self.stream,
            "frame": self.frame,
            "model": self.model,
            "age_ms": round(self.age_ms, 3),
            "captured_at": when.rfc3339,
            "clock": when.clock,
            "pts": None if when.pts is None else round(when.pts, 6),
        }
        if self.outcome == "OK":
            line["result"] = self.result
        else:
            line["outcome"] = self.outcome
            if self.error is not None:
                line["error"] = self.error
        return line
