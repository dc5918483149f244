"""The parent's side of the bench's child processes: ``Child`` starts one (``python -m MODULE``
from the checkout), sends it its JSON spec, waits for its ``ready``, sends it the measured window
and reads its one JSON result; ``open_window`` gives a set of children the same window.

The child's side is ``tools.bench.inprocess`` (``await_window``, ``print_figures``). Used by every
part of the benchmark that starts children (``mixed_load``, ``cameras``, ``pipelines``,
``ocr_pipeline``, ``experiments.bench_layout``); it imports nothing of the benchmark, so they
all stand above it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULT_TIMEOUT_S = 600.0


class Child:
    """A bench child process (``tools.bench.inprocess`` or ``tools.bench.producer``): spec in,
    ``ready``, window in, one JSON result out."""

    def __init__(self, module: str, args: list[str], spec: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        self._send(spec)

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(obj) + "\n")
        self.process.stdin.flush()

    def wait_ready(self) -> None:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if line != "ready":
            self.process.kill()
            raise RuntimeError(f"{self.process.args!r} did not start (said {line!r})")

    def go(self, start_at: float, end_at: float) -> None:
        self._send({"start_at": start_at, "end_at": end_at})

    def result(self) -> dict[str, Any]:
        try:
            out, _ = self.process.communicate(timeout=RESULT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        if self.process.returncode != 0:
            raise RuntimeError(f"{self.process.args!r} exited {self.process.returncode}")
        return dict(json.loads(out.strip().splitlines()[-1]))


def open_window(children: list[Child], warmup_s: float, duration_s: float) -> tuple[float, float]:
    """Wait until every child is ready, then send them all one window: ``warmup_s`` from now,
    ``duration_s`` long (wall-clock start and end)."""
    for child in children:
        child.wait_ready()
    start_at = time.time() + warmup_s
    end_at = start_at + duration_s
    for child in children:
        child.go(start_at, end_at)
    return start_at, end_at
