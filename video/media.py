"""Opening one source with PyAV and taking its decoded frames, paced like a camera.

``MediaReader(location, pace=…)`` opens the container (``open``), then ``frames(stop)`` yields
each decoded video frame as a ``DecodedFrame`` until the source ends (a file's end, or a live
source that closed), raising ``SourceDroppedError`` when reading fails (a network feed lost, a
device unplugged). A file is paced at its own frame rate (each frame is held until its
presentation time comes, as a camera would deliver it; a reader that falls a second behind
re-anchors instead of bursting), a live source never is. Decoding happens in FFmpeg with the
GIL released, so one reader per thread decodes in parallel with the others.

**Captured time**: ``DecodedFrame.captured`` is ``time.monotonic()`` when the frame left the
decoder — for a paced file, when its presentation time came and it was released — so an
answer's ``age_ms`` counts from the moment a camera would have delivered the frame.

Owned by one ``VideoSource`` decode thread (``video.source``); a reader is used by one thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from duomo.video.locations import SourceError, SourceKind, SourceLocation

if TYPE_CHECKING:
    import av
    from av.container import InputContainer
    from av.video.stream import VideoStream

REANCHOR_BEHIND_S = 1.0  # a paced file this far behind its schedule re-anchors (no burst)


class SourceDroppedError(RuntimeError):
    """A live source stopped delivering (the read failed or timed out); it may come back."""


@dataclass(frozen=True)
class DecodedFrame:
    """One decoded picture and when it left the decoder (monotonic seconds)."""

    frame: av.VideoFrame
    captured: float


class MediaReader:
    """One opened source. Not thread-safe: one decode thread opens, reads and closes it."""

    def __init__(self, location: SourceLocation, pace: bool = True) -> None:
        self.location = location
        self.pace = pace and location.kind is SourceKind.FILE
        self._container: InputContainer | None = None
        self._stream: VideoStream | None = None

    @property
    def fps(self) -> float | None:
        """The stream's nominal frame rate, when the container says."""
        if self._stream is None:
            return None
        rate = self._stream.average_rate or self._stream.guessed_rate
        return float(rate) if rate else None

    def open(self) -> None:
        """Open the container and find its video stream. A file that cannot be decoded raises
        ``SourceError`` (it never will be); a live source that cannot be reached raises
        ``SourceDroppedError`` (it may come up later)."""
        import av

        where = self.location
        try:
            container = av.open(
                where.url, format=where.format, options=where.options, timeout=where.timeout_s
            )
        except (av.FFmpegError, OSError) as err:
            if where.live:
                raise SourceDroppedError(f"{where.text}: {_reason(err)}") from err
            raise SourceError(f"{where.text}: not a video PyAV can open ({_reason(err)})") from err
        if not container.streams.video:
            container.close()
            raise SourceError(f"{where.text}: has no video stream")
        self._container = container
        self._stream = container.streams.video[0]
        if not where.live:
            self._stream.thread_type = "AUTO"  # frame threads: throughput, files only (latency)

    def frames(self, stop: threading.Event) -> Iterator[DecodedFrame]:
        """Decoded frames until the source ends or ``stop`` is set; ``SourceDroppedError`` when
        a live source's read fails. A file's damaged packet is skipped, not fatal."""
        import av

        if self._container is None or self._stream is None:
            raise RuntimeError("MediaReader.frames before open")
        anchor: float | None = None  # monotonic time of presentation time 0 (paced files)
        try:
            for packet in self._container.demux(self._stream):
                try:
                    decoded = packet.decode()
                except av.InvalidDataError:
                    if self.location.live:
                        raise
                    continue
                for frame in decoded:
                    if stop.is_set():
                        return
                    if self.pace and frame.time is not None:
                        anchor = self._wait_until_due(frame.time, anchor, stop)
                        if stop.is_set():
                            return
                    yield DecodedFrame(frame, time.monotonic())
        except (av.FFmpegError, OSError) as err:
            if not self.location.live:
                raise SourceError(f"{self.location.text}: {_reason(err)}") from err
            raise SourceDroppedError(f"{self.location.text}: {_reason(err)}") from err

    @staticmethod
    def _wait_until_due(at_s: float, anchor: float | None, stop: threading.Event) -> float:
        now = time.monotonic()
        if anchor is None or now - (anchor + at_s) > REANCHOR_BEHIND_S:
            return now - at_s
        due = anchor + at_s
        if due > now:
            stop.wait(due - now)
        return anchor

    def close(self) -> None:
        """Close the container (idempotent)."""
        if self._container is not None:
            self._container.close()
        self._container = self._stream = None


def _reason(err: BaseException) -> str:
    import av

    if isinstance(err, av.FFmpegError):
        return err.strerror or str(err)
    return str(err)
