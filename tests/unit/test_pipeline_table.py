"""The pipelines in ``status``: the pipelines table of ``duomo status`` and ``--watch``
(``supervisor.operators.pipeline_table``) shows one aligned row per pipeline and step, the
pipeline's own figures on its first row, after the models and streams; none without pipelines."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from duomo.ipc.status_records import PipelineStatus, SupervisorStatus
from duomo.supervisor.operators import pipeline_table
from duomo.supervisor.operators.status_table import render_status
from duomo.supervisor.operators.status_watch import Frame, plain_frame
from tests.status_fixtures import DOCUMENTED_STATUS, status_entry
from tests.unit.test_stream_table import stream

AT = datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
BOUNDS = ["0", "1", "2", "4", "8", "16", "32", "+Inf"]


def step(name: str, model: str, for_each: str | None = None, **counts: int) -> dict[str, Any]:
    """One step's entry, as ``ServedPipeline.status`` writes it."""
    shown = {"runs": 0, "skipped": 0, "reused": 0, "errors": 0, **counts}
    return {"name": name, "model": model, "for_each": for_each, **shown}


def faces_steps() -> list[dict[str, Any]]:
    return [
        step("detect", "face", runs=120),
        step("embedding", "face_embedding", "detect", runs=230, skipped=12, reused=48, errors=1),
        step("attributes", "face_attributes", "detect", runs=278, skipped=12),
    ]


def pipeline(name: str = "faces", **fields: Any) -> dict[str, Any]:
    """One pipeline's entry in ``status``, as ``ServedPipeline.status`` writes it: 120 frames,
    278 faces (12 frames without one, 40 with one, 60 with two to four, 8 with five)."""
    shown: dict[str, Any] = {
        "name": name,
        "state": "READY",
        "requests": 121,
        "errors": 1,
        "latency_ms": {"p50": 31.25, "p99": 80.0},
        "objects": {
            "count": 278,
            "frames": 120,
            "buckets": [[le, n] for le, n in zip(BOUNDS, [12, 52, 80, 112, 120, 120, 120, 120])],
        },
        "steps": faces_steps(),
    }
    return {**shown, **fields}


def status(*pipelines: dict[str, Any], **fields: Any) -> SupervisorStatus:
    entry = status_entry(DOCUMENTED_STATUS["models"], **fields)
    entry["pipelines"] = {p["name"]: p for p in pipelines}
    return SupervisorStatus.from_dict(entry)


def test_duomo_status_shows_a_row_per_pipeline_and_step_after_the_models() -> None:
    idle = pipeline(
        "plates", state="LOADING", requests=0, errors=0, latency_ms={"p50": None, "p99": None},
        objects={"count": 0, "frames": 0, "buckets": [[le, 0] for le in BOUNDS]},
        steps=[step("find", "plate_detector"), step("read", "ocr", "find")],
    )  # fmt: skip
    lines = render_status(status(pipeline(), idle)).splitlines()
    title = lines.index(
        "pipeline  state    requests  errors  p50 ms  p99 ms  obj/frame  step        model  "
        "          on      runs  skipped  reused  failed"
    )
    assert lines[title - 1] == ""
    assert lines[title - 2].startswith("classify ")  # the models table's last row
    assert lines[title + 1 : title + 6] == [
        "faces     READY         121       1    31.2    80.0       2.32  detect      face   "
        "          frame    120        0       0       0",
        "faces                                                           embedding   "
        "face_embedding   detect   230       12      48       1",
        "faces                                                           attributes  "
        "face_attributes  detect   278       12       0       0",
        "plates    LOADING         0       0       -       -          -  find        "
        "plate_detector   frame      0        0       0       0",
        "plates                                                          read        ocr    "
        "          find       0        0       0       0",
    ]
    assert lines[title + 6].startswith("clients ")


def test_the_pipelines_come_after_the_streams() -> None:
    lines = render_status(status(pipeline(), streams=[stream("gate-3")])).splitlines()
    streams = next(i for i, line in enumerate(lines) if line.startswith("stream "))
    pipelines = next(i for i, line in enumerate(lines) if line.startswith("pipeline "))
    assert lines[streams + 1].startswith("gate-3 ")
    assert pipelines == streams + 3 and lines[pipelines - 1] == ""


def test_no_pipelines_no_table() -> None:
    assert pipeline_table.render({}) == []
    assert "obj/frame" not in render_status(status())
    text = plain_frame(Frame(Path("/s"), status()), AT)
    assert "obj/frame" not in text


def test_objects_per_frame_is_objects_over_frames() -> None:
    record = PipelineStatus.from_dict(pipeline())
    assert record.objects.per_frame == 278 / 120
    empty = PipelineStatus.from_dict(
        pipeline(objects={"count": 0, "frames": 0, "buckets": [[le, 0] for le in BOUNDS]})
    )
    assert empty.objects.per_frame is None
    assert pipeline_table.rows({"faces": empty})[0][6] == "-"


def test_the_watch_view_shows_the_same_cells() -> None:
    shown = status(pipeline(state="DEGRADED"))
    text = plain_frame(Frame(Path(shown.socket), shown), AT)
    first, *later = (line for line in text.splitlines() if line.lstrip().startswith("faces "))
    cells = pipeline_table.rows(shown.pipelines)
    assert first.split() == cells[0] == [
        "faces", "DEGRADED", "121", "1", "31.2", "80.0", "2.32", "detect", "face", "frame", "120",
        "0", "0", "0",
    ]  # fmt: skip
    assert [line.split() for line in later] == [[c for c in row if c] for row in cells[1:]]
    assert later[0].split() == ["faces", "embedding", "face_embedding", "detect", "230", "12",
                                "48", "1"]  # fmt: skip
    titles = [line for line in text.splitlines() if line.lstrip().startswith("pipeline ")]
    assert titles and "obj/frame" in titles[0] and "skipped" in titles[0]
