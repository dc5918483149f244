"""The streams in ``status``: ``StreamStatus`` reads its entry back exactly (and an older reply
without ``streams`` reads as none), and the streams table of ``duomo status`` and ``--watch``
(``supervisor.operators.stream_table``) shows one aligned row per stream and model."""

from __future__ import annotations

import copy
import datetime
import json
from pathlib import Path
from typing import Any

import pytest

from duomo.ipc.status_records import StatusRecordError, StreamStatus, SupervisorStatus
from duomo.supervisor.operators import stream_table
from duomo.supervisor.operators.status_table import render_status
from duomo.supervisor.operators.status_watch import Frame, plain_frame
from tests.status_fixtures import DOCUMENTED_STATUS, status_entry

AT = datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)


def figures(**fields: Any) -> dict[str, Any]:
    """One model's figures of a stream, as ``supervisor.dataflow.streams`` writes them."""
    shown: dict[str, Any] = {
        "frames_in": 900,
        "answered": 310,
        "superseded": 589,
        "refused": 1,
        "skipped": 0,
        "input_fps": 30.012,
        "answered_fps": 10.4,
        "age_ms_p50": 61.3,
        "age_ms_p99": 140.0,
    }
    return {**shown, **fields}


def stream(name: str, state: str = "running", **models: dict[str, Any]) -> dict[str, Any]:
    """One stream's entry in ``status``, as ``StreamRegistry.snapshot`` writes it."""
    return {
        "name": name,
        "state": state,
        "since_s": 12.5,
        "policy": "latest",
        "weight": 1.0,
        "fps_nominal": 30.0,
        "stall_after_s": 5.0,
        "client": "client 3 (pid 4242)",
        "models": models or {"face": figures()},
    }


def status(*streams: dict[str, Any]) -> SupervisorStatus:
    return SupervisorStatus.from_dict(
        status_entry(DOCUMENTED_STATUS["models"], streams=list(streams))
    )


def test_a_stream_reads_its_entry_back_exactly() -> None:
    entry = stream("gate-3", face=figures(), ocr=figures(age_ms_p50=None, age_ms_p99=None))
    record = StreamStatus.from_dict(entry)
    assert json.dumps(record.to_dict()) == json.dumps(entry)  # the keys' order too
    assert record.models["ocr"].age_ms_p99 is None and record.models["face"].refused == 1
    whole = status(entry)
    assert whole.streams == (record,)
    assert whole.to_dict()["streams"] == [entry]


def test_a_reply_without_streams_reads_as_none_and_writes_none() -> None:
    older = copy.deepcopy(DOCUMENTED_STATUS)
    older.pop("streams", None)
    record = SupervisorStatus.from_dict(older)
    assert record.streams == ()
    assert "streams" not in record.to_dict()


@pytest.mark.parametrize(
    ("path", "record", "key"),
    [
        (("state",), "StreamStatus", "state"),
        (("models", "face", "answered"), "StreamModelFigures", "answered"),
    ],
)
def test_a_missing_key_names_its_record(path: tuple[str, ...], record: str, key: str) -> None:
    entry = stream("gate-3")
    inner: Any = entry
    for step in path[:-1]:
        inner = inner[step]
    del inner[path[-1]]
    with pytest.raises(StatusRecordError, match=f"status record {record}: missing key '{key}'"):
        status(entry)


def test_duomo_status_shows_a_row_per_stream_and_model_after_the_models() -> None:
    text = render_status(
        status(
            stream("gate-3", face=figures(), ocr=figures(answered_fps=2.0, refused=0)),
            stream(
                "loading-dock-camera-17", "starting",
                face=figures(frames_in=0, answered=0, superseded=0, refused=0, skipped=30,
                             input_fps=0.0, answered_fps=0.0, age_ms_p50=None, age_ms_p99=None),
            ),
        )
    )  # fmt: skip
    lines = text.splitlines()
    title = lines.index(
        "stream                  state     model  policy  in fps  answered fps  age p50 ms  "
        "age p99 ms   in  answered  superseded  refused  skipped"
    )
    assert lines[title - 1] == ""
    assert lines[title - 2].startswith("classify ")  # the models table's last row
    assert lines[title + 1 : title + 4] == [
        "gate-3                  running   face   latest    30.0          10.4        61.3  "
        "     140.0  900       310         589        1        0",
        "gate-3                  running   ocr    latest    30.0           2.0        61.3  "
        "     140.0  900       310         589        0        0",
        "loading-dock-camera-17  starting  face   latest     0.0           0.0           -  "
        "         -    0         0           0        0       30",
    ]
    assert lines[title + 4].startswith("clients ")


def test_no_streams_no_table() -> None:
    assert stream_table.render(()) == []
    assert stream_table.render_capacity(status().models) == []
    shown = render_status(status())
    assert "answered fps" not in shown and "offered fps" not in shown


def test_the_watch_view_shows_the_same_cells() -> None:
    shown = status(stream("gate-3", "stalled"))
    text = plain_frame(Frame(Path(shown.socket), shown), AT)
    [row] = [line for line in text.splitlines() if line.lstrip().startswith("gate-3")]
    assert row.split() == stream_table.rows(shown.streams)[0]
    assert row.split() == [
        "gate-3", "stalled", "face", "latest", "30.0", "10.4", "61.3", "140.0", "900", "310",
        "589", "1", "0",
    ]  # fmt: skip
    titles = [line for line in text.splitlines() if line.lstrip().startswith("stream ")]
    assert titles and "age p99 ms" in titles[0]
