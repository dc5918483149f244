"""``duomo stream``: video sources into a running supervisor, answers out as JSON lines.

``run(args)`` is the command's body (``supervisor.operators.cli`` parses the arguments and calls
it): it gathers the sources (SOURCE… and the entries of ``--sources FILE``: ``video.sources_file``),
checks every one, connects one ``SupervisorLink`` (``video.supervisor_link``: with ``--wait-s
S`` it waits up to S seconds for the supervisor's socket and key, a log line per backoff step),
opens one ``VideoSource`` per source (one decode thread each) and one answer thread per source
that writes each answer to the ``AnswerLines`` sink (and to the live preview with
``--preview``), then waits until the files end, ``--duration`` passes, or SIGINT/SIGTERM
arrives. With ``--sink NAME`` (repeatable) each source's events also go to the running
supervisor's sinks of those names (``video.sink_events``, appended to the outboxes the
supervisor's sink worker delivers; it asks the supervisor where with the ``sink`` message, and
refuses to start when no sink worker runs); ``--emit`` as a managed source's. A supervisor that
goes away meanwhile is waited for and connected to again, and every stream opens again on it
under its name (``video.source``): the process runs beside the supervisor for as long as the
operator wants it to. At the end decoding stops, the answers
still owed are awaited for up to ``DRAIN_S`` (not after a signal), and every stream is closed.

Exit codes (those of ``supervisor.operators.cli``): 0 when the files ended, the duration passed or a
signal came, 1 when no supervisor answered at the start (within ``--wait-s``) or a file failed
while playing, 2 for a bad source, an unknown model or bad arguments, 3 when every source has
``failed`` (``video.health``: a permanent error such as 401/403/404 or a host name that does not
resolve, or a failure lasting ``--failed-after`` seconds: a typo is not waited on forever) — each
with a one-line message on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from duomo.ipc.command_line import EXIT_FAILED, EXIT_INVALID, EXIT_OK, exit_code
from duomo.ipc.errors import DuomoError
from duomo.video.answer_lines import AnswerLines
from duomo.video.locations import SourceError, SourceLocation, parse_location, stream_names
from duomo.video.sink_events import EventPlan, SinkEvents, SinkTarget
from duomo.video.source import VideoSource
from duomo.video.sources_file import SourceEntry, SourcesFileError, read_sources
from duomo.video.supervisor_link import SupervisorLink

if TYPE_CHECKING:
    from duomo.video.preview import PreviewServer

EXIT_SOURCES_FAILED = 3  # every source failed (``video.health``)
DRAIN_S = 30.0  # the answers still owed when the run ends, awaited for at most this long
FIGURES_EVERY_S = 1.0  # the preview's figures refresh


class ArgumentError(ValueError):
    """An option the command cannot use (``--preview`` without a port, a port in use)."""


def run(args: argparse.Namespace) -> int:
    """Run ``duomo stream`` as parsed by ``supervisor.operators.cli``; the exit code."""
    try:
        entries = _entries(args)
        locations = [parse_location(entry.url) for entry in entries]
    except (SourceError, SourcesFileError) as err:
        return _fail(str(err), EXIT_INVALID)
    sink = AnswerLines(args.out)
    try:
        sink.open()
    except OSError as err:
        return _fail(f"--out {args.out}: {err.strerror or err}", EXIT_INVALID)
    signalled = threading.Event()
    try:
        with _stopped_by_signals(signalled), contextlib.ExitStack() as stack:
            stack.callback(sink.close)
            link = SupervisorLink(args.socket, timeout_s=30)
            stack.callback(link.close)
            if link.connect(args.wait_s, signalled) is None:
                return EXIT_OK  # a signal while waiting for the supervisor
            plan = _sink_plan(args, link)
            preview = _start_preview(args.preview, stack)
            sources = _start_sources(args, entries, locations, link, preview, stack)
            events = _start_events(args, sources, plan, stack)
            return _play(args, sources, sink, preview, signalled, events)
    except (SourceError, ArgumentError) as err:
        return _fail(str(err), EXIT_INVALID)
    except DuomoError as err:
        code = exit_code(err)
        waited = f"waited {args.wait_s:g} s; " if args.wait_s else ""
        hint = "" if code == EXIT_INVALID else f" ({waited}is a supervisor running? duomo start)"
        return _fail(f"{err.message}{hint}", code)


def _entries(args: argparse.Namespace) -> list[SourceEntry]:
    """The sources of the command line (SOURCE…, named by ``--name``), then the file's."""
    models = tuple(args.model or ([args.pipeline] if args.pipeline else []))
    if len(args.name) > len(args.sources):
        raise SourceError(f"{len(args.name)} names for {len(args.sources)} source(s)")
    if args.sources and not models:
        raise SourceError("give the models (--model M …) or a pipeline (--pipeline P)")
    names = [*args.name, *[None] * (len(args.sources) - len(args.name))]
    entries = [
        SourceEntry(url, name, models, args.policy, args.max_fps)
        for url, name in zip(args.sources, names)
    ]
    if args.sources_file is not None:
        entries += read_sources(args.sources_file, models, args.policy, args.max_fps)
    if not entries:
        raise SourceError("no source: give SOURCE… or --sources FILE")
    return entries


def _sink_plan(args: argparse.Namespace, link: SupervisorLink) -> EventPlan | None:
    """Where ``--sink``'s events go, as the supervisor says (None without ``--sink``);
    ArgumentError for a sink or an ``--emit`` it cannot have."""
    names = list(dict.fromkeys(getattr(args, "sinks", None) or []))
    if not names:
        if getattr(args, "emit", None) is not None:
            raise ArgumentError("--emit says what goes to the sinks: give --sink NAME too")
        return None
    client, _ = link.current()
    if client is None:
        raise ArgumentError("--sink: the supervisor went away before it said where")
    targets, directory, max_missed = [], "", None
    for name in names:
        reply = client.request("sink", name=name, pipeline=args.pipeline)
        directory, max_missed = reply["directory"], reply["max_missed"]
        outbox = reply["sink"]["outbox"]
        targets.append(SinkTarget(name, EventPlan.bounds(outbox)))
    emit = args.emit or ("both" if max_missed is not None else "answers")
    if emit in ("objects", "both") and max_missed is None:
        raise ArgumentError(f"--emit {emit} needs object events: a pipeline with a tracker")
    return EventPlan(Path(directory), tuple(targets), emit, max_missed)


def _start_events(
    args: argparse.Namespace,
    sources: list[VideoSource],
    plan: EventPlan | None,
    stack: contextlib.ExitStack,
) -> dict[str, SinkEvents]:
    """Each source's ``SinkEvents`` (none without ``--sink``), closed on the way out."""
    if plan is None:
        return {}
    events = {}
    for source in sources:
        events[source.name] = SinkEvents(source.name, plan, args.pipeline is not None).start()
        stack.callback(events[source.name].close)
    return events


def _fail(message: str, code: int) -> int:
    print(f"duomo stream: {message}", file=sys.stderr)
    return code


def _start_preview(where: str | None, stack: contextlib.ExitStack) -> PreviewServer | None:
    if where is None:
        return None
    from duomo.video.preview import PreviewServer  # (only with --preview)

    host, _, port = where.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise ArgumentError(f"--preview {where}: give HOST:PORT (127.0.0.1:8090, say)")
    preview = PreviewServer(host.strip("[]") or "127.0.0.1", int(port))
    try:
        preview.start()
    except OSError as err:
        raise ArgumentError(f"--preview {where}: {err.strerror or err}") from None
    stack.callback(preview.stop)
    print(f"duomo stream: preview at {preview.url}", file=sys.stderr, flush=True)
    return preview


def _start_sources(
    args: argparse.Namespace,
    entries: list[SourceEntry],
    locations: list[SourceLocation],
    link: SupervisorLink,
    preview: PreviewServer | None,
    stack: contextlib.ExitStack,
) -> list[VideoSource]:
    sources = []
    names = stream_names(locations, [entry.name for entry in entries])
    for entry, name in zip(entries, names):
        source = VideoSource(
            entry.url, name, models=entry.models, client=link, policy=entry.policy,
            max_fps=entry.max_fps, every=args.every, stall_after_s=args.stall_after,
            loop=args.loop, as_fast_as_possible=args.as_fast_as_possible,
            on_frame=None if preview is None else preview.frame,
            failed_after_s=args.failed_after,
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
    signalled: threading.Event,
    events: dict[str, SinkEvents],
) -> int:
    readers = [
        threading.Thread(
            target=_read_answers,
            args=(s, sink, preview, events.get(s.name)),
            name=f"answers-{s.name}",
        )
        for s in sources
    ]
    for reader in readers:
        reader.start()
    deadline = None if args.duration is None else time.monotonic() + args.duration
    next_figures = 0.0
    all_failed = False
    while not signalled.is_set() and not all(s.ended for s in sources):
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            break
        all_failed = all(s.health.state == "failed" for s in sources)
        if all_failed:
            break
        if preview is not None and now >= next_figures:
            _show_figures(preview, sources)
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
    if all_failed:
        for source in sources:
            why = source.health.last_error
            print(f"duomo stream: {source.name}: failed: {why}", file=sys.stderr)
        return EXIT_SOURCES_FAILED
    failed = [s for s in sources if s.error]
    for source in failed:
        print(f"duomo stream: {source.name}: {source.error}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


def _show_figures(preview: PreviewServer, sources: list[VideoSource]) -> None:
    """Each source's figures on the page, its ``state`` the supervisor's (running, stalled …)
    when the status says, the source's own (playing, reconnecting …) as ``source``."""
    states: dict[str, str] = {}
    client = sources[0].client  # (None while the supervisor is being reconnected)
    with contextlib.suppress(DuomoError):
        streams = () if client is None else client.status().streams
        states = {stream.name: stream.state for stream in streams}
    for source in sources:
        figures = source.figures.snapshot()
        figures["source"] = figures["state"]
        figures["state"] = states.get(source.name, figures["state"])
        preview.figures(source.name, figures)


def _read_answers(
    source: VideoSource,
    sink: AnswerLines,
    preview: PreviewServer | None,
    events: SinkEvents | None,
) -> None:
    for answer in source.answers():
        sink.write(answer)
        if preview is not None:
            preview.answer(source.name, answer)
        if events is not None:
            events.answer(answer)


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
