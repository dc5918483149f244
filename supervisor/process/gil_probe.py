"""The interpreter-lock probe: a thread that asks for 1 ms sleeps and records how late it wakes.
Off unless the process was started with ``DUOMO_GIL_PROBE`` naming a file; made for
``tools/bench/request_breakdown.py``, which starts a supervisor with it.

A thread that wakes from a sleep must take the interpreter lock again before its next line of
Python runs, as the reactor does after ``epoll``, a worker after ONNX Runtime's ``run`` or an
OpenCV call, a producer's reader after ``recv``. How late the probe's sleeps end is what such a
wake-up waits for, sampled about a thousand times a second at moments unrelated to the requests:

- the kernel's share: the timer's slack (50 µs for a thread of normal policy) and the time the
  woken thread waits for a core (its run-queue wait, which the probe reads from
  ``/proc/self/task/TID/schedstat`` every ``SCHEDSTAT_EVERY`` wakes);
- the interpreter lock: the rest. A thread that finds the lock held waits until its holder lets
  go (a blocking call) or the switch interval (5 ms) passes and it asks the holder to.

Its limits: the probe's wake-ups are its own, not a request's (a worker that wakes right after
the reactor took the lock for the same notice can wait longer than a random moment does); it
takes the lock itself about a thousand times a second (a few µs each); and the run-queue wait
it subtracts is its own thread's, not the holder's. ``tools/bench/request_breakdown.py`` runs the
same probe in a process of its own beside the supervisor, where no other thread holds its lock,
to measure the kernel's share under the same load.

``GilProbe.start`` starts the thread ``duomo-gil-probe``; ``stop`` ends it and, when it has a
file, writes there every wake's time and lateness and the schedstat readings (JSON). Started
and stopped by ``Supervisor`` (``supervisor.process.server``) when ``from_environment`` gives one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from array import array
from pathlib import Path

PROBE_ENV = "DUOMO_GIL_PROBE"
PERIOD_S = 0.001
SCHEDSTAT_EVERY = 100  # wakes between two readings of the probe thread's schedstat
MAX_WAKES = 4_000_000  # about an hour at 1 ms: then it stops recording (16 bytes a wake)


class GilProbe:
    """The probe thread: ``start``, ``stop`` (which writes ``path`` when given), ``figures``."""

    def __init__(self, path: Path | None = None, period_s: float = PERIOD_S) -> None:
        self.path = path
        self.period_s = period_s
        self.woken_at = array("d")  # time.monotonic() of each wake
        self.late_s = array("d")  # how much later than asked it woke
        # (time.monotonic(), run ns, run-queue wait ns, time slices) of the probe thread
        self.schedstat: list[tuple[float, int, int, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_environment(cls) -> GilProbe | None:
        """A probe writing to the file ``DUOMO_GIL_PROBE`` names; None when it is not set."""
        path = os.environ.get(PROBE_ENV)
        return cls(Path(path)) if path else None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="duomo-gil-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        schedstat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        period = self.period_s
        clock, sleep = time.monotonic, time.sleep
        woken_at, late_s = self.woken_at, self.late_s
        n = 0
        while not self._stop.is_set() and n < MAX_WAKES:
            if n % SCHEDSTAT_EVERY == 0:
                self._read_schedstat(schedstat)
            before = clock()
            sleep(period)
            after = clock()
            woken_at.append(after)
            late_s.append(after - before - period)
            n += 1
        self._read_schedstat(schedstat)

    def _read_schedstat(self, path: str) -> None:
        try:
            with open(path, encoding="ascii") as f:
                run_ns, wait_ns, slices = (int(v) for v in f.read().split()[:3])
        except (OSError, ValueError):  # a kernel without schedstat: the lateness alone
            return
        self.schedstat.append((time.monotonic(), run_ns, wait_ns, slices))

    def stop(self) -> None:
        """End the thread; write the file, if it has one."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.path is not None:
            self.path.write_text(json.dumps(self.figures()), encoding="utf-8")

    def figures(self) -> dict[str, object]:
        """Every wake (µs on the monotonic clock, lateness in µs) and the schedstat readings."""
        return {
            "period_s": self.period_s,
            "pid": os.getpid(),
            "woken_us": [round(t * 1e6) for t in self.woken_at],
            "late_us": [round(s * 1e6, 1) for s in self.late_s],
            "schedstat": self.schedstat,
        }
