"""``duomo stream``: video sources into a running supervisor, answers out as JSON lines.

``run(args)`` is the command's body (``supervisor.cli`` parses the arguments and calls it):
it checks every source, connects one ``Client``, opens one ``VideoSource`` per source (one
decode thread each) and one answer thread per source that writes each answer to the
``AnswerLines`` sink (and to the live preview with ``--preview``), then waits until the files
end, ``--duration`` passes, or SIGINT/SIGTERM arrives. At the end decoding stops, the answers
still owed are awaited for up to ``DRAIN_S`` (not after a signal), and every stream is closed.

Exit codes (those of ``supervisor.cli``): 0 when the files ended or the duration passed, 1 when
the supervisor is unreachable or a file failed while playing, 2 for a bad source, an unknown
model or bad arguments — each with a one-line message on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from duomo.ipc.client import Client
from duomo.ipc.errors import DuomoError, ErrorCode
from duomo.video.answer_lines import AnswerLines
from duomo.video.locations import SourceError, SourceLocation, parse_location, stream_names
from duomo.video.source import VideoSource

if TYPE_CHECKING:
    from duomo.video.preview import PreviewServer

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
DRAIN_S = 30.0  # the answers still owed when the run ends, awaited for at most this long
FIGURES_EVERY_S = 1.0  # the preview's figures refresh


def run(args: argparse.Namespace) -> int:
    """Run ``duomo stream`` as parsed by ``supervisor.cli``; the exit code."""
    try:
        locations = [parse_location(text) for text in args.sources]
    except SourceError as err:
        return _fail(str(err), EXIT_INVALID)
    if len(args.name) > len(locations):
        return _fail(f"{len(args.name)} names for {len(locations)} source(s)", EXIT_INVALID)
    models = args.model or [args.pipeline]
    sink = AnswerLines(args.out)
    try:
        sink.open()
    except OSError as err:
        return _fail(f"--out {args.out}: {err.strerror or err}", EXIT_INVALID)
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(sink.close)
            client = Client(args.socket, timeout_s=30)
            stack.enter_context(client)
            preview = _start_preview(args.preview, stack)
            sources = _start_sources(args, locations, models, client, preview, stack)
            return _play(args, sources, sink, preview)
    except SourceError as err:
        return _fail(str(err), EXIT_INVALID)
    except DuomoError as err:
        invalid = err.code in (ErrorCode.NOT_FOUND, ErrorCode.INVALID_ARGUMENT)
        hint = "" if invalid else " (is a supervisor running? duomo start)"
        return _fail(f"{err.message}{hint}", EXIT_INVALID if invalid else EXIT_FAILED)


def _fail(message: str, code: int) -> int:
    print(f"duomo stream: {message}", file=sys.stderr)
    return code


def _start_preview(where: str | None, stack: contextlib.ExitStack) -> PreviewServer | None:
    if where is None:
        return None
    from duomo.video.preview import PreviewServer  # (only with --preview)

    host, _, port = where.rpartition(":")
    preview = PreviewServer(host or "127.0.0.1", int(port))
    preview.start()
    stack.callback(preview.stop)
    print(f"duomo stream: preview at {preview.url}", file=sys.stderr, flush=True)
    return preview


def _start_sources(
    args: argparse.Namespace,
    locations: list[SourceLocation],
    models: list[str],
    client: Client,
    preview: PreviewServer | None,
    stack: contextlib.ExitStack,
) -> list[VideoSource]:
    sources = []
    for location, name in zip(locations, stream_names(locations, args.name)):
        source = VideoSource(
            location.text, name, models=models, client=client, policy=args.policy,
            max_fps=args.max_fps, every=args.every, stall_after_s=args.stall_after,
            loop=args.loop, as_fast_as_possible=args.as_fast_as_possible,
            on_frame=None if preview is None else preview.frame,
        )  # fmt: skip
        source.start()
        stack.callback(source.close)
        sources.append(source)
    return sources


def _play(
    args: argparse.Namespace,
    sources: list[VideoSource],
    sink: AnswerLines,
    preview: PreviewServer | None,
) -> int:
    signalled = threading.Event()
    with _stopped_by_signals(signalled):
        readers = [
            threading.Thread(
                target=_read_answers, args=(s, sink, preview), name=f"answers-{s.name}"
            )
            for s in sources
        ]
        for reader in readers:
            reader.start()
        deadline = None if args.duration is None else time.monotonic() + args.duration
        next_figures = 0.0
        while not signalled.is_set() and not all(s.ended for s in sources):
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if preview is not None and now >= next_figures:
                for source in sources:
                    preview.figures(source.name, source.figures.snapshot())
                next_figures = now + FIGURES_EVERY_S
            wait_s = 0.1 if deadline is None else min(0.1, max(deadline - now, 0.0))
            signalled.wait(wait_s)
        for source in sources:
            source.stop()
        if not signalled.is_set():
            drain_until = time.monotonic() + DRAIN_S
            for source in sources:
                source.drain(max(drain_until - time.monotonic(), 0.0))
        for source in sources:
            source.close(0.0 if signalled.is_set() else 5.0)  # the readers finish
        for reader in readers:
            reader.join(DRAIN_S)
    failed = [s for s in sources if s.error]
    for source in failed:
        print(f"duomo stream: {source.name}: {source.error}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


def _read_answers(source: VideoSource, sink: AnswerLines, preview: PreviewServer | None) -> None:
    for answer in source.answers():
        sink.write(answer)
        if preview is not None:
            preview.answer(source.name, answer)


@contextlib.contextmanager
def _stopped_by_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop`` while inside (the previous handlers come back after)."""
    previous: dict[int, Any] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, lambda *_: stop.set())
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
