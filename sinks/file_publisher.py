"""The file publisher: JSON lines appended to a file, rotated by size, a bounded number kept.

One event a line. Before a line would take the file past ``max_mb`` the file is rotated, as
logrotate numbers them: ``path`` becomes ``path.1``, ``path.1`` becomes ``path.2`` … up to
``path.{keep}``; the oldest beyond ``keep`` is deleted (``keep: 0``: the full file is
deleted). A line longer than ``max_mb`` goes alone into a fresh file. A batch is acknowledged
once its lines are written and flushed to the operating system: a ``kill -9`` of the process
then loses none of them (a power loss may lose what the disk had not yet written).

Errors: the folder cannot be made or written (EACCES, EROFS, ENOENT …) → ``SinkRefusedError``;
a full disk or an I/O error → ``SinkUnavailableError`` (retried: space may come back).
Called by the sink's delivery thread only.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from duomo.sinks.config import FileSinkConfig
from duomo.sinks.outbox import PendingEvent
from duomo.sinks.publisher import Published, SinkError, SinkRefusedError, SinkUnavailableError

_LATER = {errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EAGAIN, errno.EINTR}


class FilePublisher:
    """Writes a sink's events as JSON lines to its file (``publisher.Publisher``)."""

    def __init__(self, config: FileSinkConfig) -> None:
        self.config = config
        self._file: BinaryIO | None = None
        self._size = 0

    def connect(self) -> None:
        self.close()
        try:
            self._open()
        except OSError as err:
            raise self._classified(err) from None

    def publish(self, batch: Sequence[PendingEvent]) -> Published:
        if self._file is None:
            return Published(error=SinkUnavailableError("not open"))
        try:
            for event in batch:
                line = event.body + b"\n"
                if self._size > 0 and self._size + len(line) > self.config.max_bytes:
                    self._rotate()
                self._file.write(line)
                self._size += len(line)
            self._file.flush()
        except OSError as err:
            # what reached the file before the error is there, but not known to be whole:
            # the batch is sent again (a line may then appear twice)
            self.close()
            return Published(error=self._classified(err))
        return Published([event.id for event in batch])

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):  # (a write error already said what failed)
                file.close()

    def rotated(self) -> list[Path]:
        """The rotated files that exist, newest first (``path.1``, ``path.2`` …)."""
        path = self.config.path
        found = []
        for n in range(1, self.config.keep + 1):
            candidate = path.with_name(f"{path.name}.{n}")
            if candidate.exists():
                found.append(candidate)
        return found

    def _open(self) -> None:
        path = self.config.path
        if path.parent.exists() and not path.parent.is_dir():  # (mkdir would say "File exists")
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(path.parent))
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("ab")
        self._size = self._file.tell()

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        path, keep = self.config.path, self.config.keep
        if keep == 0:
            path.unlink(missing_ok=True)
        else:
            for n in range(keep - 1, 0, -1):
                older = path.with_name(f"{path.name}.{n}")
                if older.exists():
                    os.replace(older, path.with_name(f"{path.name}.{n + 1}"))
            os.replace(path, path.with_name(f"{path.name}.1"))
        self._open()

    def _classified(self, err: OSError) -> SinkError:
        why = f"{err.filename or self.config.path}: {err.strerror or err}"
        if err.errno in _LATER:
            return SinkUnavailableError(why)
        return SinkRefusedError(why)
