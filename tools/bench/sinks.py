"""The sinks benchmark of ``duomo bench --sinks`` (issue 46).

**What one sink sustains.** For each broker (a local mosquitto and a local redis-server, started
by ``tools.bench.brokers``) and two event sizes (a classify answer, about 0.4 KB, and a ``faces``
answer with four faces and their embeddings, about 6 KB), in this process:

1. *append*: ``events`` events from four sources, each given its seq (``Sequencer.next``) and
   committed to the sink's outbox alone (``Outbox.append``), as a source worker appends them:
   appends per second and CPU per thousand;
2. *publish*: the sink's delivery loop (``SinkDelivery``) started on that backlog, timed until
   the outbox is empty: events per second, this process's CPU per thousand events (the loop,
   and paho's network thread for MQTT) and the broker's.

Every event must be acknowledged once (the broker's own count is not read: the outbox empties
only on acknowledgements, and ``published`` must equal ``events``).

The camera part (answered rate with sinks on against off, and the delay from answer to
acknowledgement at four cameras) is ``tools.bench.sink_cameras``. Called by ``tools.bench.run``;
the section is added to the report here (``add_part``).
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from duomo.ipc.stream_records import FrameTime
from duomo.sinks.config import SinkConfig
from duomo.sinks.delivery import SinkDelivery
from duomo.sinks.events import Event
from duomo.sinks.outbox import Outbox, OutboxEntry, outbox_path
from duomo.sinks.sequencer import Sequencer
from tools.bench.brokers import running_broker
from tools.bench.report import add_part

SOURCES = ("cam-1", "cam-2", "cam-3", "cam-4")
DRAIN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class SinkBenchSettings:
    """What the sink throughput part runs (``duomo bench --sink-events``)."""

    events: int = 20_000
    kinds: tuple[str, ...] = ("mqtt", "redis")
    payloads: tuple[str, ...] = ("classify", "faces")


def _log(message: str) -> None:
    print(f"duomo bench: sinks: {message}", file=sys.stderr, flush=True)


def _result(payload: str, n: int) -> dict[str, Any]:
    """An answer shaped as the demo's: classify's top 5, or ``faces`` with four faces (box,
    score, five landmarks, a 128-number embedding and the attributes), varied by ``n``."""
    if payload == "classify":
        return {"top": [{"index": (n + k) % 1000, "label": f"label {k}", "score": 0.5 / (k + 1)}
                        for k in range(5)]}  # fmt: skip
    phase = n * 0.001
    faces = []
    for k in range(4):
        x, y = 100.0 * k + phase, 80.0 + phase
        faces.append({
            "box": [x, y, x + 90.0, y + 110.0],
            "score": 0.9,
            "landmarks": [[x + 30, y + 40], [x + 60, y + 40], [x + 45, y + 60],
                          [x + 32, y + 80], [x + 58, y + 80]],
            "track_id": k + 1,
            "embedding": [math.sin(phase + k + i) for i in range(128)],
            "attributes": {"age": 31, "gender": "female", "gender_score": 0.93},
        })  # fmt: skip
    return {"faces": faces, "scale": 1.0}


def _entries(payload: str, events: int, sequencer: Sequencer) -> list[OutboxEntry]:
    """The events to append, with their seqs taken from ``sequencer``, round-robin over the
    sources (the seqs are taken here, once, as a source worker takes one per event)."""
    model = "classify" if payload == "classify" else None
    pipeline = None if model else "faces"
    out = []
    for n in range(events):
        source = SOURCES[n % len(SOURCES)]
        event = Event(source=source, seq=sequencer.next(source), kind="answer",
                      when=FrameTime(time.time(), "camera"), frame=n // len(SOURCES),
                      model=model, pipeline=pipeline, result=_result(payload, n))  # fmt: skip
        out.append(OutboxEntry.of(event))
    return out


def trial(kind: str, url: str, broker_cpu: Any, payload: str, events: int, folder: Path) -> dict:
    """One sink of ``kind`` at ``url``: append ``events``, then publish them all."""
    folder.mkdir(parents=True)
    config: Any = TypeAdapter(SinkConfig).validate_python(
        {"name": "bench", "kind": kind, "url": url, "outbox": {"max_mb": 4096}}
    )
    with Sequencer(folder / "sequence.db") as sequencer:
        entries = _entries(payload, events, sequencer)
    size = sum(len(e.body) for e in entries) / len(entries)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    with Outbox(outbox_path(folder, "bench"), config.outbox, "bench") as outbox:
        for entry in entries:
            outbox.append([entry])
    append_s, append_cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    delivery = SinkDelivery.of(config, folder)
    broker0 = broker_cpu()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    delivery.start()
    try:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while (status := delivery.status()).pending_events and time.monotonic() < deadline:
            time.sleep(0.01)
        publish_s, publish_cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        broker_s = broker_cpu() - broker0
    finally:
        delivery.stop()
    if status.pending_events or status.published != events:
        raise RuntimeError(f"{kind}: {status.published} of {events} acknowledged ({status})")
    return {
        "kind": kind,
        "payload": payload,
        "events": events,
        "event_bytes": size,
        "append_per_s": events / append_s,
        "append_cpu_ms_per_1000": 1e6 * append_cpu / events,
        "publish_per_s": events / publish_s,
        "publish_cpu_ms_per_1000": 1e6 * publish_cpu / events,
        "broker_cpu_ms_per_1000": 1e6 * broker_s / events,
        "errors": status.errors,
    }


def run_sinks(settings: SinkBenchSettings) -> dict[str, Any]:
    trials = []
    with tempfile.TemporaryDirectory(prefix="duomo-bench-sinks-") as tmp:
        for kind in settings.kinds:
            with running_broker(kind, Path(tmp) / f"{kind}-broker") as broker:

                def broker_cpu(process: Any = broker.process) -> float:
                    times = process.cpu_times()
                    return float(times.user + times.system)

                for payload in settings.payloads:
                    _log(f"{kind}, {payload} answers: {settings.events} events")
                    folder = Path(tmp) / f"{kind}-{payload}"
                    trials.append(
                        trial(kind, broker.url, broker_cpu, payload, settings.events, folder)
                    )
    return {"settings": asdict(settings), "trials": trials}


def markdown(raw: dict[str, Any]) -> str:
    lines = [
        "## Sinks: what one sink sustains",
        "",
        f"{raw['settings']['events']} answer events from four sources, each appended alone (its "
        "seq taken, committed to the sink's SQLite outbox), then published by the sink's "
        "delivery loop to a local broker until the outbox is empty (every event acknowledged: "
        "MQTT QoS 1 PUBACK, the XADD reply). CPU per thousand events: this process's (the "
        "loop, and paho's network thread) and the broker's.",
        "",
        "| sink | event | bytes | appends/s | append CPU ms per 1000 | published/s | "
        "publish CPU ms per 1000 | broker CPU ms per 1000 |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for t in raw["trials"]:
        lines.append(
            f"| {t['kind']} | {t['payload']} answer | {t['event_bytes']:.0f} | "
            f"{t['append_per_s']:.0f} | {t['append_cpu_ms_per_1000']:.0f} | "
            f"{t['publish_per_s']:.0f} | {t['publish_cpu_ms_per_1000']:.0f} | "
            f"{t['broker_cpu_ms_per_1000']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def bench_sinks(out: Path, events: int, cameras: int, window_s: float) -> str:
    """``duomo bench --sinks``: run both parts (the camera part unless ``cameras`` is 0) and
    add them to the report in ``out``; the section."""
    raw = run_sinks(SinkBenchSettings(events=events))
    section = markdown(raw)
    if cameras:
        from tools.bench.sink_cameras import SinkCameraSettings, run_sink_cameras
        from tools.bench.sink_cameras import markdown as cameras_markdown

        with tempfile.TemporaryDirectory(prefix="duomo-bench-sink-brokers-") as tmp:
            settings = SinkCameraSettings(cameras=cameras, window_s=window_s)
            raw["cameras"] = run_sink_cameras(settings, Path(tmp))
        section += "\n" + cameras_markdown(raw["cameras"])
    add_part(out, "sinks", raw, section)
    return section
