"""``VideoSource``: one video decoded on its own thread straight into a supervisor stream.

    from duomo import Client
    from duomo.video import VideoSource

    with Client() as client:
        gate = VideoSource("rtsp://10.0.0.3/main", "gate-3", models=["face"], client=client)
        gate.start()                                 # opens the stream; decoding begins
        for answer in gate.answers():                # frame, model, age_ms, result / outcome
            print(answer.to_json())

A source opens the stream (``client.stream``: policy, weight, ``max_fps``, ``every`` and the
stall bound pass through) and starts one decode thread that reads its ``MediaReader``
(``video.media``) and sends each frame as a ``Filler``: the slot's view is filled with RGB by
``video.conversion.write_rgb`` — the one copy from the decoder's frame into the slot. A file is
paced at its own frame rate unless ``as_fast_as_possible``, and ends (or restarts, with
``loop``) at its end. A live source (network URL, V4L2 device) that fails to open, fails to
read or ends is reopened after a backoff (``video.backoff``: 0.5 s doubling to 10 s), each
attempt logged; meanwhile nothing is sent, so the supervisor shows the stream ``stalled``. Its
``health`` (``video.health``) tells an outage from a typo: failing for ``failed_after_s``, or
three times in a row with a permanent error (401/403/404, a host name that does not resolve, no
decoder), it is ``failed`` with the reason and tried again only every ``retry_failed_s``. A frame
the decoder had to conceal (a missing slice) is counted as a decode error and not sent; damage is
logged at most every ``DECODE_LOG_S``. Every message shows the URL with its password masked.
Frame numbers count on across loops and reconnects. A frame's captured time is
``time.monotonic()`` when it left the decoder (for a paced file: when it was due), and its
wall-clock time the camera's own when its RTCP reports give it (``video.media``): both travel
with the frame, and its answers carry them.

**The supervisor going away.** Given a plain ``Client``, a source stops when the connection is
lost (``error`` says why). Given a ``SupervisorLink`` (``video.supervisor_link``, as ``duomo
stream`` does), it goes on decoding: the stream is closed (the frames in flight are answered
``UNAVAILABLE``), the link connects again with backoff, and the first frame decoded after that
opens the stream again on the new connection under the same name and settings; the frames
decoded meanwhile are dropped (counted ``detached``; their numbers are skipped, so the numbers
count on). A new supervisor that refuses the stream (its models changed) is asked again with
the same backoff, a log line each time.

Threads: the decode thread (one per source; PyAV decodes with the GIL released, so several
sources in one process decode in parallel) runs ``_play``; answers are read by whoever iterates
``answers()`` (``duomo stream`` runs one thread per source for it), across the streams a
reconnected source opens in turn. ``on_frame(stream, rgb,
number)``, for a live preview, sees at most one sent frame per ``frame_every_s`` (the slot's
view, just filled), on the thread that fills the slot. ``stop()`` stops decoding; ``close()``
also closes the stream, which ends ``answers()``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import structlog

from duomo.ipc.errors import DuomoError, UnavailableError
from duomo.ipc.source_urls import mask_text
from duomo.video.backoff import Backoff
from duomo.video.conversion import rgb_shape, write_rgb
from duomo.video.figures import SourceFigures
from duomo.video.health import FAILED_AFTER_S, RETRY_FAILED_S, SourceHealth
from duomo.video.locations import SourceError, SourceLocation, parse_location
from duomo.video.media import DecodedFrame, MediaReader, SourceDroppedError
from duomo.video.supervisor_link import SupervisorLink

if TYPE_CHECKING:
    from duomo.ipc.client import Client
    from duomo.ipc.stream import Stream, StreamAnswer

log = structlog.get_logger("duomo.video")

FRAME_EVERY_S = 0.2  # ``on_frame``: at most 5 pictures a second per source
ANSWER_CHECK_S = 0.25  # answers(): how often it checks whether a file's answers are all in
STOP_JOIN_S = 10.0  # a decode thread blocked in a network read ends by its read timeout
DECODE_LOG_S = 10.0  # damaged frames are logged at most this often per source


class VideoSource:
    """One video (file, URL or device) fed into the stream ``stream`` of ``client``.

    Args:
        url_or_path: a file, an ``rtsp://`` ``rtmp://`` ``http(s)://`` … URL, or ``/dev/videoN``.
        stream: the stream's name (1..64 printable characters, unique among live streams).
        models: the models (or a pipeline's name) the frames feed.
        client: the connection the stream belongs to (several sources may share one); a
            ``SupervisorLink`` also opens the stream again after the supervisor restarts.
        policy: ``"latest"`` or ``"fifo"``; weight, fps caps and the stall bound: see
            ``Client.stream``.
        loop: restart a file at its end.
        as_fast_as_possible: do not pace a file at its frame rate.
        on_frame: called with ``(stream, rgb, frame number)`` for a sent frame, at most once
            per ``frame_every_s``; ``rgb`` is the slot's view, valid during the call only
            (``PreviewServer.frame`` copies what it keeps).
        failed_after_s, retry_failed_s: a live source failing this long (or failing with a
            permanent error three times) is ``failed``, then tried again every
            ``retry_failed_s`` (``video.health``).
    """

    def __init__(
        self,
        url_or_path: str,
        stream: str,
        *,
        models: Sequence[str],
        client: Client | SupervisorLink,
        policy: str = "latest",
        weight: float = 1.0,
        max_fps: float | None = None,
        every: int | None = None,
        stall_after_s: float = 5.0,
        slots: int = 3,
        loop: bool = False,
        as_fast_as_possible: bool = False,
        on_frame: Callable[[str, np.ndarray, int], None] | None = None,
        frame_every_s: float = FRAME_EVERY_S,
        backoff: Backoff | None = None,
        failed_after_s: float = FAILED_AFTER_S,
        retry_failed_s: float = RETRY_FAILED_S,
    ) -> None:
        self.url_or_path = url_or_path
        self.name = stream
        self.models = list(models)
        self.link = client if isinstance(client, SupervisorLink) else None
        self._client = None if isinstance(client, SupervisorLink) else client
        self.policy = policy
        self.weight = weight
        self.max_fps = max_fps
        self.every = every
        self.stall_after_s = stall_after_s
        self.slots = slots
        self.loop = loop
        self.as_fast_as_possible = as_fast_as_possible
        self.on_frame = on_frame
        self.frame_every_s = frame_every_s
        self.backoff = backoff or Backoff()
        self.health = SourceHealth(failed_after_s, retry_failed_s, self.backoff)
        self._unlogged_errors = 0  # decode errors since the last log line about them
        self._next_error_log = 0.0
        self._reopen = Backoff(self.backoff.first_s, self.backoff.max_s, self.backoff.factor)
        self._reopen_at = 0.0  # a refused reopening is asked again from this monotonic time
        self._generation = 0  # the link's connection the stream was opened on
        self._lock = threading.Lock()  # ``stream`` and ``_owed`` (decode thread, answers reader)
        self._owed = 0  # answers still due on the stream now open
        self.figures = SourceFigures()
        self.error: str | None = None  # why a file stopped before its end (bad data)
        self.stream: Stream | None = None
        self._location: SourceLocation | None = None
        self._reader: MediaReader | None = None  # a file's, opened by start()
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._next_frame = 0
        self._next_picture_at = 0.0

    def start(self) -> None:
        """Check the source, open the stream and start decoding. Raises ``SourceError`` for a
        source that can never play (a missing or undecodable file, an unknown scheme) and the
        client's ``DuomoError`` when the stream is refused (``NotFoundError``: no such model)."""
        location = parse_location(self.url_or_path)
        if not location.live:  # a file is opened now: a bad one is the caller's error at once
            self._reader = MediaReader(location, pace=not self.as_fast_as_possible)
            self._reader.open()
            self.figures.fps_nominal = self._reader.fps
        self._location = location
        try:
            client, self._generation = self._connection()
            if client is None:
                raise UnavailableError("the supervisor is being reconnected")
            self.stream = self._open(client, self._generation)
        except BaseException:
            if self._reader is not None:
                self._reader.close()
            raise
        self._thread = threading.Thread(target=self._play, name=f"video-{self.name}", daemon=True)
        self._thread.start()

    @property
    def client(self) -> Client | None:
        """The connection now (None while a ``SupervisorLink`` makes it again)."""
        return self._connection()[0]

    def _connection(self) -> tuple[Client | None, int]:
        """The client and its link generation (0 for a plain client)."""
        return (self._client, 0) if self.link is None else self.link.current()

    def _open(self, client: Client, generation: int) -> Stream:
        """Open the stream on ``client``, held on the link meanwhile and after (a lost
        connection is not closed under a stream opening or open on it)."""
        if self.link is not None:
            self.link.opened(generation)
        try:
            return client.stream(
                self.name, models=self.models, policy=self.policy, weight=self.weight,
                fps=self.figures.fps_nominal, max_fps=self.max_fps, every=self.every,
                stall_after_s=self.stall_after_s, slots=self.slots,
            )  # fmt: skip
        except BaseException:
            if self.link is not None:
                self.link.closed(generation)
            raise

    @property
    def ended(self) -> bool:
        """The decode thread has finished (a file's end, ``stop()``, or a fatal error)."""
        return self._thread is not None and not self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for decoding to end; whether it has."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.ended

    def answers(self) -> Iterator[StreamAnswer]:
        """The stream's answers as they come (counted in ``figures``). Ends after ``close()``,
        or once decoding has ended (a file's end) and every frame sent has its answers. After
        the supervisor went away, the closed stream's last answers come first (``UNAVAILABLE``
        for the frames it had in flight), then the reopened stream's."""
        if self._thread is None:
            raise RuntimeError("VideoSource.answers before start")
        while True:
            stream = self.stream
            if stream is None:  # detached: the supervisor is being reconnected
                self._stop.wait(ANSWER_CHECK_S)
            else:
                for answer in stream.answers(timeout_s=ANSWER_CHECK_S):
                    yield self._took(stream, answer)
                if stream is not self.stream:  # (closed before it was replaced: all is in)
                    for answer in stream.poll():
                        yield self._took(stream, answer)
                    continue
            if self._closed or (self.ended and self.all_answered()):
                return

    def _took(self, stream: Stream, answer: StreamAnswer) -> StreamAnswer:
        self.figures.answered(answer)
        with self._lock:
            if stream is self.stream:
                self._owed -= 1
        return answer

    def all_answered(self) -> bool:
        """Every frame sent on the stream now open has an answer from every model (OK,
        superseded or not); a stream closed when the supervisor went away owes nothing."""
        with self._lock:
            return self._owed <= 0

    def drain(self, timeout_s: float) -> bool:
        """Wait until ``all_answered()`` (needs a reader of ``answers()``); whether it was
        within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.all_answered():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self) -> None:
        """Stop decoding (the stream stays open: answers in flight still arrive)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(STOP_JOIN_S)

    def close(self, drain_s: float = 5.0) -> None:
        """Stop decoding and close the stream, after waiting up to ``drain_s`` for the frames
        in flight (``Stream.close``); ``answers()`` ends."""
        self.stop()
        stream = self.stream
        if stream is not None:
            stream.close(drain_s)
            if self.link is not None:
                self.link.closed(self._generation)
        self._closed = True  # (after: the answers that came while it drained are read first)

    def __enter__(self) -> VideoSource:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the decode thread ---------------------------------------------------------------------

    def _play(self) -> None:
        assert self._location is not None
        reader, self._reader = self._reader, None
        try:
            while not self._stop.is_set():
                if reader is None:
                    reader = MediaReader(self._location, pace=not self.as_fast_as_possible)
                    try:
                        reader.open()
                    except SourceDroppedError as err:
                        reader = None
                        self._wait_to_reconnect(err)
                        continue
                if not self._play_reader(reader):
                    return
                reader = None
        except SourceError as err:  # a file that turned out damaged beyond repair
            self.error = mask_text(str(err))
            log.error("video source failed", stream=self.name, error=self.error)
        except DuomoError as err:  # the supervisor went away (a plain client), or refused frames
            self.error = err.message
            log.error("video source stopped", stream=self.name, error=self.error)
        except Exception as err:  # a bug must not die silently on a thread
            self.error = mask_text(f"{type(err).__name__}: {err}")
            log.exception("video source failed", stream=self.name)
        finally:
            if reader is not None:
                reader.close()
            self.health.stopped()
            self.figures.set_state("stopped", self.error)

    def _play_reader(self, reader: MediaReader) -> bool:
        """Send ``reader``'s frames until it ends; whether to open the source again."""
        counted = 0  # the reader's decode errors counted so far
        try:
            for decoded in reader.frames(self._stop):
                if self.health.state != "playing":
                    self._playing_again()
                if reader.decode_errors != counted:
                    self._decode_errors(reader.decode_errors - counted)
                    counted = reader.decode_errors
                if decoded.corrupt:  # concealed damage (half a picture green): not sent
                    self.figures.decoded(False, corrupt=True)
                    continue
                self._send(decoded)
        except SourceDroppedError as err:
            self._wait_to_reconnect(err)
            return True
        finally:
            reader.close()
        if self._stop.is_set():
            return False
        if self._location is not None and self._location.live:
            self._wait_to_reconnect(SourceDroppedError(f"{self._location.text}: the source ended"))
            return True
        return self.loop

    def _playing_again(self) -> None:
        """The first frame since it started or failed."""
        reconnects = self.health.backoff.attempts
        self.health.playing()
        self.figures.set_state("playing")
        if reconnects:
            log.warning("video source reconnected", stream=self.name, attempts=reconnects)

    def _decode_errors(self, count: int) -> None:
        """``count`` more packets refused or frames concealed: counted, logged at most once
        every ``DECODE_LOG_S`` (a camera with a broken encoder damages every frame)."""
        self.figures.add_decode_errors(count)
        self._unlogged_errors += count
        now = time.monotonic()
        if now >= self._next_error_log:
            log.warning(
                "video source: damaged frames", stream=self.name, count=self._unlogged_errors,
                since_s=round(DECODE_LOG_S if self._next_error_log else 0.0, 1),
            )  # fmt: skip
            self._unlogged_errors = 0
            self._next_error_log = now + DECODE_LOG_S

    def _wait_to_reconnect(self, err: SourceDroppedError) -> None:
        """It failed to open or dropped: its health says the state and the wait (a permanent
        error, or a failure lasting ``failed_after_s``, is ``failed``: tried again slowly)."""
        was = self.health.state
        delay_s = self.health.failed(mask_text(str(err)), err.permanent)
        state = self.health.state
        self.figures.set_state(state, self.health.last_error)
        fields = {"stream": self.name, "delay_s": delay_s, "error": self.health.last_error}
        if state == "failed" and was != "failed":
            log.error("video source failed; trying again slowly", **fields)
        elif state == "failed":
            log.info("video source still failing", **fields)
        else:
            log.warning("video source lost; reconnecting", attempt=self.backoff.attempts, **fields)
        self._stop.wait(delay_s)

    def _send(self, decoded: DecodedFrame) -> None:
        from duomo.ipc.stream import Filler

        stream = self._attached()
        number = self._next_frame
        self._next_frame += 1
        if stream is None:  # no supervisor now: the frame is dropped, its number skipped
            if self.figures.state != "detached":  # (a camera reopened meanwhile says playing)
                self.figures.set_state("detached")
            self.figures.decoded(False, attached=False)
            return
        frame = decoded.frame
        picture_due = self.on_frame is not None and decoded.captured >= self._next_picture_at
        if picture_due:
            self._next_picture_at = decoded.captured + self.frame_every_s
        taken = False

        def fill(out: np.ndarray) -> None:
            nonlocal taken
            write_rgb(frame, out)
            if picture_due and not taken and self.on_frame is not None:
                taken = True  # (a frame fed to two models fills two slots: one picture)
                self.on_frame(self.name, out, number)

        try:
            accepted = stream.send(
                Filler(rgb_shape(frame), np.uint8, fill),
                captured=decoded.captured,
                frame=number,
                when=decoded.when,
            )
        except UnavailableError as err:
            if self.link is None:
                raise
            self._detach(err.message)  # (the frame's answers, UNAVAILABLE, end the old stream)
            self.figures.decoded(False, attached=False)
            return
        if accepted:
            with self._lock:
                if stream is self.stream:
                    self._owed += len(self.models)
        self.figures.decoded(accepted)

    # -- the supervisor going away (with a SupervisorLink) -------------------------------------

    def _attached(self) -> Stream | None:
        """The stream to send to: the one open, or (with a link) one opened again on the
        link's new connection after the supervisor was lost; None while there is none."""
        if self.link is None:
            return self.stream
        client, generation = self.link.current()
        if self.stream is not None and client is not None and generation == self._generation:
            return self.stream
        if self.stream is not None:
            self._detach("the supervisor closed the connection")
        if client is None or time.monotonic() < self._reopen_at:
            return None
        try:
            stream = self._open(client, generation)
        except UnavailableError as err:  # lost again already
            self.link.lost(generation, err.message)
            return None
        except DuomoError as err:  # the new supervisor refuses it (a model gone, say)
            delay_s = self._reopen.next_delay_s()
            self._reopen_at = time.monotonic() + delay_s
            log.warning(
                "video source: the supervisor refused the stream; asking again",
                stream=self.name, attempt=self._reopen.attempts, delay_s=delay_s,
                error=err.message,
            )  # fmt: skip
            return None
        with self._lock:
            self.stream, self._owed = stream, 0
        self._generation = generation
        self._reopen.reset()
        self._reopen_at = 0.0
        self.figures.reattached()
        log.warning("video source attached again", stream=self.name)
        return stream

    def _detach(self, why: str) -> None:
        """(With a link) the supervisor went away: close the stream (its last answers stay
        readable), hand the connection to the link to make again, and send nothing meanwhile."""
        assert self.link is not None
        stream = self.stream
        self.figures.set_state("detached")
        log.warning("video source detached: the supervisor went away", stream=self.name, error=why)
        self.link.lost(self._generation, why)
        if stream is not None:
            stream.close(0.0)
        with self._lock:
            self.stream, self._owed = None, 0
        self.link.closed(self._generation)  # (the last stream on it closes the lost client)
