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
answer's ``age_ms`` counts from the moment a camera would have delivered the frame. Its
wall-clock time (``DecodedFrame.when``, an ``ipc.stream.FrameTime``) is the camera's own when the
source says it: an RTSP camera that sends RTCP sender reports gives FFmpeg the NTP time of its
stream's start (``start_time_realtime``, set once the first report came), and a frame was
captured at that time plus its pts (clock ``camera``); otherwise, and before the first report,
it is ``captured`` on the wall clock (clock ``arrival``). ``pts`` is the frame's presentation time
in seconds (None when the container gives none).

**Damage**: a packet the decoder refuses is skipped and a frame it had to conceal (FFmpeg's
corrupt and decode-error flags: a missing slice comes out half green) is passed on marked
``corrupt``; both count in ``decode_errors``.

Owned by one ``VideoSource`` decode thread (``video.source``); a reader is used by one thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from duomo.ipc.stream import FrameTime
from duomo.video.health import permanent_reason
from duomo.video.locations import SourceError, SourceKind, SourceLocation

if TYPE_CHECKING:
    import av
    from av.container import InputContainer
    from av.video.stream import VideoStream

REANCHOR_BEHIND_S = 1.0  # a paced file this far behind its schedule re-anchors (no burst)


class SourceDroppedError(RuntimeError):
    """A live source failed to open or stopped delivering; ``permanent`` says why it will not
    come back by itself (``video.health.permanent_reason``), None when it may (an outage)."""

    def __init__(self, message: str, permanent: str | None = None) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class DecodedFrame:
    """One decoded picture, when it left the decoder (monotonic seconds), its wall-clock capture
    time, and whether the decoder had to conceal damage in it."""

    frame: av.VideoFrame
    captured: float
    when: FrameTime
    corrupt: bool = False


class MediaReader:
    """One opened source. Not thread-safe: one decode thread opens, reads and closes it."""

    def __init__(self, location: SourceLocation, pace: bool = True) -> None:
        self.location = location
        self.pace = pace and location.kind is SourceKind.FILE
        self._container: InputContainer | None = None
        self._stream: VideoStream | None = None
        self.decode_errors = 0  # packets refused and frames concealed, since it was made

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
                raise SourceDroppedError(
                    f"{where.text}: {_reason(err)}", permanent_reason(err, where.url)
                ) from err
            raise SourceError(f"{where.text}: not a video PyAV can open ({_reason(err)})") from err
        if not container.streams.video:
            container.close()
            if where.live:
                raise SourceDroppedError(f"{where.text}: has no video stream", "no video")
            raise SourceError(f"{where.text}: has no video stream")
        self._container = container
        self._stream = container.streams.video[0]
        if not where.live:
            self._stream.thread_type = "AUTO"  # frame threads: throughput, files only (latency)
        else:  # one thread: FFmpeg's slice threads turn error concealment off, so a damaged
            # slice of a multi-slice camera would pass unflagged (0 of 60 flagged, against 60 of
            # 60 with one thread); a fleet decodes in parallel across its cameras instead
            self._stream.thread_type = "NONE"

    def frames(self, stop: threading.Event) -> Iterator[DecodedFrame]:
        """Decoded frames until the source ends or ``stop`` is set; ``SourceDroppedError`` when
        a live source's read fails. A file's damaged packet is skipped, not fatal."""
        import av

        if self._container is None or self._stream is None:
            raise RuntimeError("MediaReader.frames before open")
        anchor: float | None = None  # monotonic time of presentation time 0 (paced files)
        container = self._container
        try:
            for packet in container.demux(self._stream):
                try:
                    decoded = packet.decode()
                except av.InvalidDataError:
                    self.decode_errors += 1
                    continue
                for frame in decoded:
                    if stop.is_set():
                        return
                    pts = frame.time
                    if self.pace and pts is not None:
                        anchor = self._wait_until_due(pts, anchor, stop)
                        if stop.is_set():
                            return
                    captured = time.monotonic()
                    corrupt = frame.is_corrupt
                    if corrupt:
                        self.decode_errors += 1
                    realtime_us = container.start_time_realtime if self.location.live else None
                    if realtime_us is not None and pts is not None:
                        when = FrameTime(realtime_us / 1e6 + pts, "camera", pts)
                    else:
                        when = FrameTime.of_monotonic(captured, pts)
                    yield DecodedFrame(frame, captured, when, corrupt)
        except (av.FFmpegError, OSError) as err:
            if not self.location.live:
                raise SourceError(f"{self.location.text}: {_reason(err)}") from err
            raise SourceDroppedError(
                f"{self.location.text}: {_reason(err)}", permanent_reason(err, self.location.url)
            ) from err

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
