"""The source fleet's worker processes: the ``source_workers`` config section, how many there are,
and their command line.

Each worker is ``python -m duomo.video.source_worker --socket S --index K`` (``video/`` imports
only ``ipc``; this module only builds its command line), run by
``supervisor.process.child_processes`` like the gateway's workers: awaited until READY, restarted
when it dies (at most ``max_restarts`` times in 5 minutes), stopped first on ``duomo stop``. Workers
a killed supervisor left behind exit by themselves (their parent is gone) and are stopped at start
too.

**How many**: ``source_workers.count``, else one per core the models do not need (the cores
this process may use less the models' thread budget), at least one: decoding shares the CPU with
the models, and a worker is one process of decode threads (PyAV releases the GIL).

Used by ``supervisor.sources.fleet``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import Field

from duomo.ipc.logs import log_args
from duomo.worker.config_model import StrictModel
from duomo.worker.thread_budget import available_cores

WORKER_MODULE = "duomo.video.source_worker"


class SourceWorkersConfig(StrictModel):
    """The ``source_workers`` section: how many processes decode the managed sources, how often
    one may be restarted, and where the sources added at run time are kept."""

    count: int | None = Field(default=None, ge=1, le=256)  # None: a core the models leave each
    max_restarts: int = Field(default=5, ge=0, le=1000)
    database: Path | None = None  # None: beside the socket, <socket>.sources.db

    def resolved(self, base: Path) -> SourceWorkersConfig:
        """Its database path made absolute against ``base`` (the config file's folder)."""
        if self.database is None or self.database.is_absolute():
            return self
        return self.model_copy(update={"database": (base / self.database).resolve()})


def worker_count(config: SourceWorkersConfig, models_threads: int) -> int:
    """``config.count``, else the cores the models' ``models_threads`` leave, at least one."""
    if config.count is not None:
        return config.count
    return max(1, available_cores() - models_threads)


def database_path(config: SourceWorkersConfig, socket_path: Path) -> Path:
    return config.database or socket_path.with_name(f"{socket_path.name}.sources.db")


def worker_command(socket_path: Path, index: int) -> list[str]:
    """``python -m duomo.video.source_worker`` for worker ``index`` (and this process's log
    format)."""
    return [
        sys.executable, "-m", WORKER_MODULE, "--socket", str(socket_path), "--index", str(index),
        *log_args(),
    ]  # fmt: skip
