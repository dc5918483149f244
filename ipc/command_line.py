"""What every ``duomo`` command line shares: its exit codes, the one an error from the supervisor
gives, and the argparse types of its numbers.

Exit codes: ``EXIT_OK`` (0), ``EXIT_FAILED`` (1: no supervisor answered, or it failed) and
``EXIT_INVALID`` (2: what was asked is wrong — a bad argument, an unknown model or source, a
name in use); a command with more says so (``duomo stop``'s 3, ``duomo stream``'s 3).
``checked_number`` makes an argparse ``type`` that refuses a number out of its range as
argparse refuses any bad argument: exit 2, with ``must be …, not '…'``.

Used by ``supervisor.operators.cli``, ``supervisor.operators.source_commands``, ``video.command``
and ``video.camera_sim`` (``video`` imports only ``ipc``). Standard library only.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from duomo.ipc.errors import DuomoError, ErrorCode

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
CALLERS_MISTAKES = (ErrorCode.NOT_FOUND, ErrorCode.INVALID_ARGUMENT)

N = TypeVar("N", int, float)


def exit_code(err: DuomoError) -> int:
    """``EXIT_INVALID`` for what the caller asked wrong (NOT_FOUND, INVALID_ARGUMENT), else
    ``EXIT_FAILED``."""
    return EXIT_INVALID if err.code in CALLERS_MISTAKES else EXIT_FAILED


def checked_number(
    parse: Callable[[str], N], accepts: Callable[[N], bool], wanted: str
) -> Callable[[str], N]:
    """An argparse ``type``: the text read by ``parse`` (``int`` or ``float``) when ``accepts``
    takes it, else the error ``must be {wanted}, not '{text}'`` (``nan`` is no number any
    range accepts)."""

    def read(text: str) -> N:
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {wanted}, not {text!r}")
        return value

    return read
