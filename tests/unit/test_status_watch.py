"""``duomo status --watch``'s pure parts: rates between two snapshots, and the plain frame."""

from __future__ import annotations

import copy
import datetime
import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from duomo.ipc.status_records import SupervisorStatus
from duomo.supervisor.operators.status_table import render_status
from duomo.supervisor.operators.status_watch import (
    Frame,
    ModelRates,
    model_rates,
    plain_frame,
    render,
)
from tests.status_fixtures import (
    client_entry,
    device_entry,
    gateway_entry,
    model_entry,
    status_entry,
)

MIB = 2**20
AT = datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)


def model(
    requests: int, ok: int, inferences: int, executions: int, **fields: Any
) -> dict[str, Any]:
    """One model's entry in ``status``, with the values the view shows set here."""
    shown: dict[str, Any] = {
        "state": "READY",
        "requests": requests,
        "outcomes": {"ok": ok} if ok else {},
        "refused": {},
        "queue_depth": 0,
        "in_flight": 0,
        "reinitializations": 0,
        "last_error": None,
        "totals": {"inference_count": inferences, "execution_count": executions},
        "latency": {"total": {"p50_ms": 18.7, "p90_ms": 20.0, "p99_ms": 24.8}},
        "memory": {"charged_bytes": 38 * MIB, "budget_bytes": None},
    }
    return model_entry(**{**shown, **fields})


def status(pid: int = 100, **models: dict[str, Any]) -> dict[str, Any]:
    return status_entry(
        models,
        pid=pid,
        socket="/run/duomo/duomo.sock",
        uptime_s=3725.4,
        rss_bytes=275 * MIB,
        thread_budget=8,
        devices=[device_entry(id=0, kind="cpu", used_bytes=331 * MIB, budget_bytes=None)],
        gateways=[
            gateway_entry(
                worker=0, pid=7, running=True, gave_up=False, restarts=0,
                http="127.0.0.1:8000", grpc="127.0.0.1:8001",
            ),
        ],
        clients=[
            client_entry(id=1, pid=7, rings=[{"model": "classify", "slots": 16}]),
            client_entry(id=2, pid=4242, rings=[]),
        ],
    )  # fmt: skip


def record(shown: dict[str, Any]) -> SupervisorStatus:
    return SupervisorStatus.from_dict(shown)


def test_rates_between_two_snapshots_of_one_supervisor() -> None:
    before = status(classify=model(10, 10, inferences=10, executions=10))
    after = status(classify=model(30, 28, inferences=30, executions=15))
    assert model_rates(record(before), record(after), elapsed_s=2.0) == {
        "classify": ModelRates(10.0, 4.0)
    }


def test_no_rate_without_an_earlier_snapshot_of_the_same_process() -> None:
    after = status(classify=model(30, 30, inferences=30, executions=15))
    assert model_rates(None, record(after), 1.0)["classify"] == ModelRates(
        None, 2.0
    )  # all-time batch
    restarted = status(pid=101, classify=model(3, 3, inferences=3, executions=3))
    assert model_rates(record(after), record(restarted), 1.0)["classify"].requests_per_s is None


def test_mean_batch_over_all_time_when_nothing_ran_in_the_interval() -> None:
    before = status(classify=model(8, 8, inferences=8, executions=2))
    rates = model_rates(record(before), record(copy.deepcopy(before)), elapsed_s=0.5)
    assert rates == {"classify": ModelRates(0.0, 4.0)}
    idle = status(face=model(0, 0, inferences=0, executions=0))
    assert model_rates(record(idle), record(idle), 1.0)["face"] == ModelRates(0.0, None)


def test_plain_frame_shows_the_table_without_escape_codes() -> None:
    shown = status(
        classify=model(30, 28, inferences=30, executions=15),
        face=model(
            0, 0, 0, 0, state="FAILED", last_error="face: onnxruntime aborted", latency={},
            memory={"charged_bytes": 90 * MIB, "budget_bytes": 100 * MIB},
        ),
    )  # fmt: skip
    shown["devices"][0].update(
        budget_bytes=1000 * MIB, total_bytes=64 * 2**30,
        telemetry={"utilization": 0.42, "temperature_c": 55.0, "power_w": 120.4},
    )  # fmt: skip
    rates = {"classify": ModelRates(12.5, 2.0), "face": ModelRates(None, None)}
    text = plain_frame(Frame(Path("/s"), record(shown), rates, own_pid=4242), AT)

    lines = text.splitlines()
    assert lines[0] == "-- duomo status at 2025-01-02T03:04:05+00:00 --"
    assert "\x1b[" not in text and "█" not in text and "─" not in text
    assert "pid 100" in lines[1] and "up 1h 02m" in lines[1]
    assert "1 client(s) attached" in lines[1]  # the view's own connection is not counted
    classify = next(line for line in lines if line.startswith("classify"))
    assert " ".join(classify.split()[:10]) == "classify READY 0 12.5 30 2 18.7 24.8 0 0"
    assert "38 MiB" in classify
    face = next(line for line in lines if line.startswith("face "))
    assert "FAILED" in face and "#######. 90 / 100 MiB" in face
    assert "face last error: face: onnxruntime aborted" in text
    device = next(line for line in lines if line.startswith("0 (cpu)"))
    assert "###..... 331 MiB" in device and "1000 MiB" in device
    assert "64.0 GiB" in device and "util 42%" in device and "55 °C" in device
    assert "120 W" in device
    assert "gateway worker 0 (pid 7): running" in text
    assert "client 1 (pid 7): classify×16" in text and "client 2" not in text


NO_READINGS = {"cores": None, "total_bytes": None, "telemetry": {}}


@pytest.mark.parametrize("devices", [[device_entry(used_bytes=0, **NO_READINGS)], []])
def test_plain_frame_copes_with_null_optional_fields(devices: list[dict[str, Any]]) -> None:
    unmeasured = {"charged_bytes": None, "budget_bytes": None}
    shown = status(classify=model(0, 0, 0, 0, memory=unmeasured, latency={"total": {}}))
    shown["devices"] = [{**d, "budget_bytes": None} for d in devices]
    lines = plain_frame(Frame(Path("/s"), record(shown)), AT).splitlines()
    row = next(line for line in lines if line.startswith("classify"))
    assert " ".join(row.split()) == "classify READY 0 - 0 0 - - 0 0 - 0 -"  # (device 0)


def test_plain_frame_while_reconnecting() -> None:
    text = plain_frame(Frame(Path("/tmp/d.sock"), problem="no supervisor (no key file)"), AT)
    assert text.splitlines()[1] == "reconnecting to /tmp/d.sock … (no supervisor (no key file))"


LONG_NAME = "face-detection-retinaface-r50-1080p-fp16"  # 40 characters


def test_a_long_model_name_keeps_the_columns_aligned_and_nothing_is_cut() -> None:
    assert len(LONG_NAME) == 40
    shown = status(
        classify=model(30, 28, inferences=30, executions=15),
        **{LONG_NAME: model(
            123456, 5, 5, 5, state="REINITIALIZING", devices=[0, 1, 2, 3],
            memory={"charged_bytes": 900 * MIB, "budget_bytes": 1000 * MIB},
        )},
    )  # fmt: skip
    rates = {"classify": ModelRates(12.5, 2.0), LONG_NAME: ModelRates(1234.5, 3.0)}
    frame = Frame(Path("/s"), record(shown), rates)

    lines = plain_frame(frame, AT).splitlines()  # piped: as wide as the table needs
    title = next(line for line in lines if line.startswith("model "))
    rows = [next(line for line in lines if line.startswith(n + " ")) for n in rates]
    assert "…" not in "".join(rows)
    assert [row.index(state) for row, state in zip(rows, ("READY", "REINITIALIZING"))] == [
        title.index("state")
    ] * 2
    requests_end = title.index("requests") + len("requests")  # right-aligned
    assert [row[:requests_end].split()[-1] for row in rows] == ["30", "123456"]
    assert "1234.5" in rows[1] and "123451" in rows[1] and "900 / 1000 MiB" in rows[1]

    # on a terminal too narrow for it, the long name folds: the numbers stay whole
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(render(frame))
    shown_lines = out.getvalue().splitlines()
    assert max(map(len, shown_lines)) <= 140
    row = next(line for line in shown_lines if "REINITIALIZING" in line)
    assert "…" not in row and "1234.5" in row and "123451" in row and "900 / 1000 MiB" in row
    start = shown_lines.index(row)
    folded = "".join(line.split(" ")[0] for line in shown_lines[start : start + 3])
    assert folded == LONG_NAME


def test_each_sink_is_a_row_and_a_failing_ones_reason_a_line_of_its_own() -> None:
    shown = status(classify=model(30, 28, inferences=30, executions=15))
    sink = {
        "name": "broker", "kind": "mqtt", "target": "mqtt://10.0.0.5:1883", "state": "failing",
        "reason": "the broker refused the credentials", "published": 1200,
        "pending_events": 37, "pending_bytes": 3 * MIB, "dropped": 4, "rejected": 1,
        "errors": 9, "last_error": "refused", "delay_p50_ms": 12.5, "delay_p99_ms": 80.25,
    }  # fmt: skip
    shown["sinks"] = [sink, {**sink, "name": "lake", "state": "connected", "reason": None}]
    for text in (
        plain_frame(Frame(Path("/s"), record(shown), {}, own_pid=4242), AT),
        render_status(record(shown)),
    ):
        row = next(line for line in text.splitlines() if line.startswith("broker"))
        assert row.split()[:10] == [
            "broker", "failing", "mqtt", "1200", "37", "3.00", "5", "9", "12.5", "80.2"
        ], row  # fmt: skip
        assert "broker: failing: the broker refused the credentials" in text
        assert "lake: connected" not in text  # (no reason: no line)
