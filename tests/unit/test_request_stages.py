"""The request breakdown's arithmetic (``tools.bench.request_stages``): a producer's stamps joined
with the supervisor's trace give stages that add up to the round trip, the queue split at the
previous request's answer, the probe's window, and py-spy's GIL samples; and the probe itself
(``supervisor.process.gil_probe``) records its wakes and is off unless asked for."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from duomo.supervisor.process.gil_probe import PROBE_ENV, GilProbe
from duomo.supervisor.process.request_trace import FIELDS, TRACE_ENV, RequestTrace
from tools.bench.request_stages import (
    CALLS,
    STAGES,
    gil_samples,
    gil_wait,
    join,
    probe_window,
    quantile,
    server_records,
    summarize,
)


def record(**values: object) -> list[object]:
    base = dict.fromkeys(FIELDS, 0.0)
    base.update(pid=7, model="classify", ring=1, slot=0, ok=True)
    base.update(values)
    return [base[f] for f in FIELDS]


def trace(*rows: list[object]) -> dict[str, object]:
    return {"fields": list(FIELDS), "records": list(rows)}


# One request: written at 10.001, intake at 10.003, queued at 10.0031, taken 1 ms later, three
# stages of 2, 5 and 1 ms, answered 10.0132, encoded 10.0133, sent 10.0134; the producer hears
# it at 10.0136 and is done at 10.0137.
ONE = record(
    intake_s=10.003, enqueued_s=10.0031, queue_s=0.001, preprocess_s=0.002, infer_s=0.005,
    postprocess_s=0.001, answering_s=10.0132, encoded_s=10.0133, sent_s=10.0134,
)  # fmt: skip
CLIENT = (7, 1, 0, 10.0, 10.001, 10.002, 10.0136, 10.0137)


def test_the_stages_add_up_to_the_round_trip() -> None:
    [stages] = join([CLIENT], server_records(trace(ONE)))
    assert stages["round trip"] == pytest.approx(0.0137)
    assert sum(stages[s] for s in STAGES) == pytest.approx(stages["round trip"])
    assert stages["notice"] == pytest.approx(0.002)
    assert stages["submit call"] == pytest.approx(0.001)  # (beside: inside the notice)
    assert stages["intake"] == pytest.approx(0.0001)
    assert stages["queue wait"] == 0.0  # nothing answered before it: the worker was free
    assert stages["batch formation"] == pytest.approx(0.001)
    assert stages["bookkeeping"] == pytest.approx(10.0132 - (10.0041 + 0.008))
    assert stages["notice back"] == pytest.approx(0.0003)
    assert stages["answer send"] == pytest.approx(0.0001)
    assert stages["read"] == pytest.approx(0.0001)


def test_a_request_is_joined_with_its_own_record_only() -> None:
    other_producer = record(pid=8, intake_s=10.003, sent_s=10.0134, encoded_s=10.0133)
    earlier = record(intake_s=9.5, sent_s=9.51, encoded_s=9.509)
    later = record(intake_s=10.02, sent_s=10.03, encoded_s=10.029)
    failed = record(ok=False, intake_s=10.003, encoded_s=10.0133)
    records = server_records(trace(other_producer, earlier, later, failed, ONE))
    assert len(records) == 4  # the failed one is left out
    [stages] = join([CLIENT], records)
    assert stages["infer"] == pytest.approx(0.005)
    assert join([(7, 2, 0, *CLIENT[3:])], records) == []  # another ring: no record


def test_the_queue_is_split_at_the_previous_answer() -> None:
    # the worker was busy with another producer's request until 10.0035, then took ours
    busy = record(pid=8, enqueued_s=9.99, queue_s=0.0, sent_s=10.0035, encoded_s=10.0034)
    ours = record(
        intake_s=10.003, enqueued_s=10.0031, queue_s=0.0009, answering_s=10.0132,
        encoded_s=10.0133, sent_s=10.0134,
    )  # fmt: skip
    [stages] = join([CLIENT], server_records(trace(busy, ours)))
    assert stages["queue wait"] == pytest.approx(0.0004)
    assert stages["batch formation"] == pytest.approx(0.0005)
    face = record(model="face", enqueued_s=9.99, queue_s=0.0, sent_s=10.009, encoded_s=10.0089)
    [stages] = join([CLIENT], server_records(trace(face, ours)))
    assert stages["queue wait"] == 0.0  # another model's worker holds no one up


def test_summaries_give_medians_and_means_that_add_up() -> None:
    joined = [dict.fromkeys((*STAGES, "round trip", *CALLS), 0.0) for _ in range(3)]
    for i, j in enumerate(joined):
        j["infer"] = 0.001 * (i + 1)
        j["read"] = 0.0001
        j["round trip"] = j["infer"] + j["read"]
    summary = summarize(joined)
    assert summary["requests"] == 3
    assert summary["stages"]["infer"]["p50_ms"] == pytest.approx(2.0)
    assert summary["stages"]["infer"]["p90_ms"] == pytest.approx(2.8)
    assert summary["sum_of_mean_ms"] == pytest.approx(summary["stages"]["round trip"]["mean_ms"])
    assert math.isnan(quantile([], 0.5))


def test_the_probe_window_counts_only_its_wakes() -> None:
    figures = {
        "woken_us": [1_000_000, 2_000_000, 3_000_000, 4_000_000],
        "late_us": [900.0, 100.0, 300.0, 5000.0],
        # (time, run ns, run-queue wait ns, slices): 50 µs of waiting over the two wakes between
        "schedstat": [(0.5, 0, 0, 0), (1.5, 0, 10_000, 1), (3.4, 0, 110_000, 3), (4.5, 0, 0, 0)],
    }
    window = probe_window(figures, 1.5, 3.5)
    assert window["wakes"] == 2
    assert window["mean_us"] == pytest.approx(200.0)
    assert window["runqueue_mean_us"] == pytest.approx(50.0)
    twin = {"mean_us": 80.0, "runqueue_mean_us": 20.0}
    wait = gil_wait(window, twin)
    assert wait["mean_less_twin_us"] == pytest.approx(120.0)
    assert wait["mean_less_runqueue_and_slack_us"] == pytest.approx(200.0 - 50.0 - 60.0)


def test_py_spy_samples_give_the_held_share_by_thread() -> None:
    raw = "\n".join([
        "thread (0x1);_run (worker/model_worker.py:140);prepare (classification.py:80) 30",
        "thread (0x1);_run (worker/model_worker.py:140);_finish (worker/model_worker.py:250) 10",
        "thread (0x2);_loop (supervisor/process/reactor.py:200) 20",
        "thread (0x3);_run (supervisor/process/control_jobs.py:50) 5",
        "thread (41): duomo-face-0;_run (worker/model_worker.py:140) 15",
        "Wrote raw flamegraph data",
    ])  # fmt: skip
    samples = gil_samples(raw, rate_hz=100, seconds=1)
    assert samples["samples"] == 80
    assert samples["held"] == pytest.approx(0.80)
    assert samples["by_thread"] == pytest.approx(
        {"classify worker": 0.40, "reactor": 0.20, "other": 0.05, "duomo-face-0": 0.15}
    )


def test_the_instruments_are_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROBE_ENV, raising=False)
    monkeypatch.delenv(TRACE_ENV, raising=False)
    assert GilProbe.from_environment() is None
    assert RequestTrace.from_environment() is None
    monkeypatch.setenv(TRACE_ENV, "/nowhere/trace.json")
    trace_on = RequestTrace.from_environment()
    assert trace_on is not None and trace_on.path == Path("/nowhere/trace.json")


def test_the_probe_records_its_wakes(tmp_path: Path) -> None:
    probe = GilProbe(tmp_path / "probe.json")
    probe.start()
    deadline = time.monotonic() + 10
    while len(probe.late_s) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    probe.stop()
    figures = json.loads((tmp_path / "probe.json").read_text())
    assert len(figures["woken_us"]) == len(figures["late_us"]) >= 5
    assert figures["woken_us"] == sorted(figures["woken_us"])
    assert min(figures["late_us"]) > -100  # never much earlier than asked
