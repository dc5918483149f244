"""The answers of ``duomo stream`` as JSON lines: one line per answer, a contract for scripts.

Each line is ``StreamAnswer.to_json()`` (``answer_line``): ``stream``, ``frame``, ``model``,
``age_ms``, ``captured_at``, ``clock``, ``pts`` and either ``result`` (the model's result, as
``duomo infer --json`` prints it) or ``outcome`` (``"SUPERSEDED"``, or an error's name with
``error``). Written to a file (``--out FILE.jsonl``) or standard output (``-``), flushed line by
line so a reader can follow it live. Several answer threads write through one ``AnswerLines``;
a lock keeps their lines whole. ``duomo source tail`` writes the same lines.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import IO, TYPE_CHECKING

from duomo.ipc.json_values import json_default

if TYPE_CHECKING:
    from duomo.ipc.stream import StreamAnswer

STDOUT = "-"


class AnswerLines:
    """A JSON-lines sink for answers: ``target`` is a path or ``"-"`` (standard output)."""

    def __init__(self, target: str = STDOUT) -> None:
        self.target = target
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        self.lines = 0

    def open(self) -> None:
        """Open (truncate) the file; ``OSError`` if it cannot be written."""
        self._file = sys.stdout if self.target == STDOUT else Path(self.target).open("w")  # noqa: SIM115 (open across calls)

    def write(self, answer: StreamAnswer) -> None:
        """One line for ``answer``; a closed sink (a reader that went away) drops it."""
        line = answer_line(answer)
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(line + "\n")
                self._file.flush()
            except (BrokenPipeError, ValueError):  # `| head`, or closed meanwhile
                self._file = None
                return
            self.lines += 1

    def close(self) -> None:
        with self._lock:
            if self._file is not None and self._file is not sys.stdout:
                self._file.close()
            self._file = None


def answer_line(answer: StreamAnswer) -> str:
    """``answer`` as its JSON line (without the newline): the contract of ``duomo stream --out``
    and ``duomo source tail``."""
    return json.dumps(answer.to_json(), ensure_ascii=False, default=json_default)
