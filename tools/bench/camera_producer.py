"""A camera producer process of the camera benchmark (``tools.bench.cameras``).

``python -m tools.bench.camera_producer KIND`` with a JSON spec on stdin, the protocol of
``tools.bench.children.Child``: it loads, prints ``ready``, reads the window (wall-clock start and
end), plays until the window ends and prints one JSON line with its figures. KIND is:

- ``source`` — Duomo's video source: one process, one ``Client``, one ``duomo.video``
  ``VideoSource`` per camera (one decode thread each, the file paced at its own rate, looped) and
  one answer thread per camera, as ``duomo stream`` runs them; policy ``latest`` or ``fifo``;
- ``naive`` — one camera as users hand-write it: ``cv2.VideoCapture`` paced at the camera's rate,
  the frame turned RGB, then ``client.model(m).infer(frame)`` for each model in turn (every
  frame answered, in order: FIFO);
- ``triton`` — the same loop, each model asked through ``tritonclient.http`` (binary tensors)
  of the Triton server ``tools.bench.servers`` starts;
- ``calibrate`` — the CPU one frame's decode costs, alone: PyAV as the video source decodes
  (``video.media`` with frame threads, then ``video.conversion.write_rgb`` into a buffer) and
  ``cv2.VideoCapture.read`` + ``cvtColor`` to RGB.

Figures, per camera and model, count the answers that arrived inside the window: OK answers,
superseded, each error outcome, and the answers' age (answer time − capture time; for the
hand-written loops a frame is captured when it is due on the camera's clock, so a loop that
falls behind shows its lag as age). The frames decoded inside the window are counted too.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tools.bench.inprocess import await_window, print_figures
from tools.bench.report import percentile

Infer = Callable[[np.ndarray], object]
# past the window's end, a producer still running dumps its threads' stacks and exits (a hang
# is a finding to read, not a run that never ends)
HANG_AFTER_S = 120.0


@dataclass
class Window:
    """The measured window on this process's monotonic clock."""

    start: float
    end: float

    @classmethod
    def await_start(cls) -> Window:
        """The window from ``tools.bench.cameras`` (``await_window``), on the monotonic clock; the
        hang watchdog armed for ``HANG_AFTER_S`` past its end."""
        start_at, end_at = await_window()
        faulthandler.dump_traceback_later(end_at - time.time() + HANG_AFTER_S, exit=True)
        offset = time.monotonic() - time.time()
        return cls(start_at + offset, end_at + offset)

    def holds(self, t: float) -> bool:
        return self.start <= t < self.end


@dataclass
class Tally:
    """One camera's answers from one model inside the window (thread-safe enough: one writer)."""

    ok: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    ages_ms: list[float] = field(default_factory=list)

    def count(self, outcome: str, age_ms: float) -> None:
        if outcome == "OK":
            self.ok += 1
            self.ages_ms.append(age_ms)
        else:
            self.outcomes[outcome] += 1

    def figures(self) -> dict[str, Any]:
        ages = self.ages_ms
        return {
            "ok": self.ok,
            "outcomes": dict(self.outcomes),
            "age_ms_p50": percentile(ages, 0.50),
            "age_ms_p90": percentile(ages, 0.90),
            "age_ms_p99": percentile(ages, 0.99),
            "age_ms_max": max(ages) if ages else None,
        }


def _camera_figures(
    tallies: dict[str, Tally], decoded: int, sent: int | None = None
) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "decoded": decoded,
        "models": {m: t.figures() for m, t in tallies.items()},
    }
    if sent is not None:
        figures["sent"] = sent
    return figures


# -- Duomo's video source --------------------------------------------------------------------


def play_sources(spec: dict[str, Any]) -> dict[str, Any]:
    """N ``VideoSource``s on one client, as ``duomo stream`` runs them."""
    from duomo.ipc.client import Client
    from duomo.video.source import VideoSource

    models: list[str] = spec["models"]
    client = Client(spec["socket"], timeout_s=60)
    sources = [
        VideoSource(
            spec["clip"], name, models=models, client=client, policy=spec["policy"], loop=True
        )
        for name in spec["cameras"]
    ]
    tallies = {s.name: {m: Tally() for m in models} for s in sources}
    readers: list[threading.Thread] = []
    window = Window.await_start()

    def read(source: VideoSource) -> None:
        for answer in source.answers():
            answered = answer.captured + answer.age_ms / 1e3
            if window.holds(answered):
                tallies[source.name][answer.model].count(answer.outcome, answer.age_ms)

    for source in sources:
        source.start()
        reader = threading.Thread(
            target=read, args=(source,), name=f"answers-{source.name}", daemon=True
        )
        reader.start()
        readers.append(reader)
    time.sleep(max(0.0, window.start - time.monotonic()))
    at_start = {s.name: s.figures.snapshot() for s in sources}
    time.sleep(max(0.0, window.end - time.monotonic()))
    at_end = {s.name: s.figures.snapshot() for s in sources}
    for source in sources:
        source.stop()
    for source in sources:
        source.close()
    for reader in readers:
        reader.join(30)
    client.close()
    return {
        "cameras": {
            s.name: _camera_figures(
                tallies[s.name],
                at_end[s.name]["decoded"] - at_start[s.name]["decoded"],
                at_end[s.name]["sent"] - at_start[s.name]["sent"],
            )
            for s in sources
        },
        "errors": [f"{s.name}: {s.error}" for s in sources if s.error],
    }


# -- the hand-written loops ------------------------------------------------------------------


def _duomo_infers(spec: dict[str, Any]) -> tuple[dict[str, Infer], Callable[[], None]]:
    from duomo.ipc.client import Client

    client = Client(spec["socket"], timeout_s=120)

    def asker(model: str) -> Infer:
        handle = client.model(model)
        return lambda image: handle.infer(image, timeout_s=120)

    return {m: asker(m) for m in spec["models"]}, client.close


def _triton_infers(spec: dict[str, Any]) -> tuple[dict[str, Infer], Callable[[], None]]:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{spec['port']}", network_timeout=120)
    wanted = [httpclient.InferRequestedOutput("RESULT", binary_data=True)]

    def infer(model: str, image: np.ndarray) -> object:
        tensor = httpclient.InferInput("IMAGE", list(image.shape), "UINT8")
        tensor.set_data_from_numpy(image, binary_data=True)
        return client.infer(model, [tensor], outputs=wanted).as_numpy("RESULT")

    def asker(model: str) -> Infer:
        return lambda image: infer(model, image)

    return {m: asker(m) for m in spec["models"]}, client.close


def play_loop(spec: dict[str, Any], infers: dict[str, Infer]) -> dict[str, Any]:
    """One camera: read, convert, ask each model in turn, wait for the next frame's time."""
    import cv2

    capture = cv2.VideoCapture(spec["clip"])
    period_s = 1.0 / float(spec["fps"])
    tallies = {m: Tally() for m in infers}
    errors: Counter[str] = Counter()
    decoded = 0
    window = Window.await_start()
    first_due = time.monotonic()
    k = 0
    while True:
        due = first_due + k * period_s
        k += 1
        now = time.monotonic()
        if now >= window.end:
            break
        if due > now:
            time.sleep(due - now)
        ok, frame = capture.read()
        if not ok:  # the file's end: start it again, as a looping user's code does
            capture.set(cv2.CAP_PROP_POS_FRAMES, 0)
            ok, frame = capture.read()
        if window.holds(time.monotonic()):
            decoded += 1
        rgb = cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
        for model, infer in infers.items():
            try:
                infer(rgb)
                outcome = "OK"
            except Exception as err:  # counted by kind; the loop goes on, as users' loops do
                outcome = type(err).__name__
                errors[f"{type(err).__name__}: {err}"[:200]] += 1
            answered = time.monotonic()
            if window.holds(answered):
                tallies[model].count(outcome, (answered - due) * 1e3)
    capture.release()
    return {
        "cameras": {spec["camera"]: _camera_figures(tallies, decoded)},
        "errors": [f"{n} × {e}" for e, n in errors.items()],
    }


# -- decode's cost alone ---------------------------------------------------------------------


def calibrate(spec: dict[str, Any]) -> dict[str, Any]:
    """CPU seconds per frame of each decode path, over ``frames`` frames of the clip."""
    import cv2

    from duomo.video.conversion import rgb_shape, write_rgb
    from duomo.video.locations import parse_location
    from duomo.video.media import MediaReader

    frames = int(spec["frames"])
    await_window()
    figures: dict[str, Any] = {}

    reader = MediaReader(parse_location(spec["clip"]), pace=False)
    reader.open()
    out: np.ndarray | None = None
    cpu0, n = time.process_time(), 0
    for decoded in reader.frames(threading.Event()):
        if out is None:
            out = np.empty(rgb_shape(decoded.frame), np.uint8)
        write_rgb(decoded.frame, out)
        n += 1
        if n == frames:
            break
    reader.close()
    figures["source"] = {"cpu_ms_per_frame": (time.process_time() - cpu0) * 1e3 / n, "frames": n}

    capture = cv2.VideoCapture(spec["clip"])
    cpu0, n = time.process_time(), 0
    while n < frames:
        ok, frame = capture.read()
        if not ok:
            break
        cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
        n += 1
    capture.release()
    figures["opencv"] = {"cpu_ms_per_frame": (time.process_time() - cpu0) * 1e3 / n, "frames": n}
    return figures


def main(argv: list[str]) -> int:
    """``python -m tools.bench.camera_producer source|naive|triton|calibrate``."""
    kind = argv[0]
    spec = json.loads(sys.stdin.readline())
    cpu0 = time.process_time()
    if kind == "source":
        result = play_sources(spec)
    elif kind == "calibrate":
        result = calibrate(spec)
    else:
        opened = _duomo_infers(spec) if kind == "naive" else _triton_infers(spec)
        infers, close = opened
        try:
            result = play_loop(spec, infers)
        finally:
            close()
    return print_figures(result, cpu0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
