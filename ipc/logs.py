"""Logging setup for every Duomo entry point: structlog to stderr, console or JSON lines.

Called once by the ``duomo`` CLI and by a gateway worker (``gateway.main``) before anything
logs; in ``ipc`` because both import it and the gateway imports nothing else of Duomo's.
Library modules only call ``structlog.get_logger(...)`` and bind the model name; they never
configure logging.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading

import structlog

LEVELS = ("debug", "info", "warning", "error")


class StderrLogger:
    """Writes each rendered line to the *current* ``sys.stderr``; a closed stream drops the line.

    structlog's ``PrintLogger`` keeps the stream it was created with; when that stream is closed
    (a daemon that detached, a test harness that swapped it), every later log call would raise in
    whichever thread logged — a worker thread included.
    """

    _lock = threading.Lock()

    def msg(self, message: str) -> None:
        with self._lock, contextlib.suppress(ValueError, OSError):
            sys.stderr.write(message + "\n")  # one write per line: threads never interleave
            sys.stderr.flush()

    debug = info = warning = warn = error = critical = exception = fatal = log = msg


_configured: list[str] = []  # the command-line flags that reproduce the current setup


def log_args() -> list[str]:
    """``--log-level … [--log-json]`` as configured: for a child process that logs the same
    way (the gateway's workers)."""
    return list(_configured)


def configure_logging(level: str = "info", json: bool = False) -> None:
    numeric = getattr(logging, level.upper())
    _configured[:] = ["--log-level", level, *(["--log-json"] if json else [])]
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=lambda *_args: StderrLogger(),
        cache_logger_on_first_use=False,
    )
