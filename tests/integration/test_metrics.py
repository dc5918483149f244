"""The operators' port on real supervisor processes: ``/metrics`` read with prometheus_client's own
parser (counts that match the requests sent exactly, failures and restarts, loads, unloads and
evictions, every series present at zero from the start, a pipeline's frames, objects and skipped
steps), and the health probes while a preload model loads, serves and fails."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from duomo.ipc.client import Client
from duomo.ipc.errors import DuomoError, ErrorCode
from tests.conftest import ROOT, fixture_image
from tests.integration.harness import (
    duomo,
    faulty_model,
    free_port,
    poll,
    running_supervisor,
    short_socket_dir,
    stop_gracefully,
    write_config,
)
from tests.unit.test_grafana_dashboard import dashboard_metric_names

pytestmark = pytest.mark.integration
X = np.array([[1, 2, 3, 4]], dtype=np.float32)
FAST_WATCHDOG = {"period_ms": 100}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """Every sample of ``/metrics``, parsed by prometheus_client: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_every_series_exists_at_zero_and_counts_exactly_the_requests_sent(
    tmp_path: Path,
) -> None:
    port = free_port()
    config = write_config(
        tmp_path, [], extra=[faulty_model("a"), faulty_model("b")],
        metrics={"http": f"127.0.0.1:{port}"},
    )  # fmt: skip
    with running_supervisor(config) as sup, Client(sup.socket) as client:
        before = scrape(port)
        for code in ErrorCode:
            if code not in (ErrorCode.OK, ErrorCode.SUPERSEDED):  # (an outcome, no failure)
                reason = code.name
                assert value(before, "duomo_inference_request_failure_total", model="a",
                             reason=reason) == 0  # fmt: skip
        failures = {labels for name, labels in before if name.endswith("_failure_total")}
        assert not any(("reason", "SUPERSEDED") in labels for labels in failures)
        assert value(before, "duomo_inference_request_superseded_total", model="a") == 0
        assert value(before, "duomo_model_capacity_over", model="a") == 0
        assert value(before, "duomo_model_offered_fps", model="a") == 0
        assert value(before, "duomo_model_served_fps", model="a") == 0
        for cause in ("hung", "failing"):
            assert value(before, "duomo_model_restarts_total", model="a", cause=cause) == 0
        assert value(before, "duomo_model_state", model="a", state="READY") == 1
        assert value(before, "duomo_model_state", model="a", state="FAILED") == 0
        assert value(before, "duomo_model_loads_total", model="a") == 1
        assert value(before, "duomo_model_load_duration_seconds_count", model="a") == 1
        assert value(before, "duomo_inference_pending_request_count", model="a") == 0
        assert value(before, "duomo_device_memory_total_bytes", device="0") > 0
        assert value(before, "duomo_process_resident_bytes") > 0

        n = 7
        handle = client.model("a")
        for _ in range(n):
            assert handle.infer(X)["y"][0, 0] == 3.0
        with pytest.raises(DuomoError) as refused:  # a bad request: INVALID_ARGUMENT
            handle.infer(np.zeros((1, 3), dtype=np.float32))
        assert refused.value.code is ErrorCode.INVALID_ARGUMENT
        # an answer reaches its client a moment before its model counts it: wait for the count
        poll(lambda: value(scrape(port), "duomo_inference_request_success_total", model="a") == n)
        after = scrape(port)

    def rose(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert rose("duomo_inference_request_success_total", model="a") == n
    assert rose("duomo_request_duration_seconds_count", model="a") == n
    assert rose("duomo_request_duration_seconds_bucket", model="a", le="+Inf") == n
    assert rose("duomo_inference_count_total", model="a") == n
    assert rose("duomo_inference_exec_count_total", model="a") == n  # one at a time: n batches
    assert rose("duomo_batch_size_count", model="a") == n
    # refused at the door (the header's shape), never queued: still counted, and not a success
    assert rose("duomo_inference_request_failure_total", model="a", reason="INVALID_ARGUMENT") == 1
    total_us = rose("duomo_inference_request_duration_us_total", model="a")
    stages_us = sum(
        rose(f"duomo_inference_{stage}_duration_us_total", model="a")
        for stage in ("queue", "compute_input", "compute_infer", "compute_output")
    )
    assert 0 < stages_us <= total_us
    assert rose("duomo_request_duration_seconds_sum", model="a") == pytest.approx(
        total_us / 1e6,
        abs=n * 1e-9,  # the µs total keeps whole nanoseconds
    )
    assert rose("duomo_inference_request_success_total", model="b") == 0
    assert value(after, "duomo_clients_attached") >= 1
    # the Grafana dashboard asks only for what is exposed (accelerators add their telemetry,
    # budgets exist where they are configured: the eviction test sees them; streams where one
    # is open: test_stream_status sees them)
    exposed = {name for name, _ in after}
    not_here = {
        "duomo_device_utilization_ratio", "duomo_device_temperature_celsius",
        "duomo_device_power_watts", "duomo_model_memory_budget_bytes",
        "duomo_device_memory_budget_bytes", "duomo_stream_answered_total", "duomo_stream_age_ms",
    }  # fmt: skip
    pipelines = {name for name in dashboard_metric_names() if name.startswith("duomo_pipeline_")}
    assert dashboard_metric_names() - not_here - pipelines <= exposed  # (pipelines: below)


def test_a_failing_model_counts_internal_failures_and_its_restarts(tmp_path: Path) -> None:
    port = free_port()
    control = tmp_path / "flaky.fault"
    control.write_text("raise")
    flaky = faulty_model(
        "flaky", params={"control_file": str(control)},
        health={"max_consecutive_failures": 1, "backoff_ms": 50, "max_restarts": 50},
    )  # fmt: skip
    config = write_config(
        tmp_path, [], extra=[flaky], watchdog=FAST_WATCHDOG, metrics={"http": f"127.0.0.1:{port}"}
    )
    with running_supervisor(config) as sup, Client(sup.socket) as client:
        with pytest.raises(DuomoError) as failed:
            client.model("flaky").infer(X, timeout_s=10)
        assert failed.value.code is ErrorCode.INTERNAL
        poll(
            lambda: value(scrape(port), "duomo_model_restarts_total", model="flaky",
                          cause="failing") >= 1,
        )  # fmt: skip
        samples = scrape(port)
        assert value(samples, "duomo_inference_request_failure_total", model="flaky",
                     reason="INTERNAL") == 1  # fmt: skip
        assert value(samples, "duomo_inference_request_success_total", model="flaky") == 0
        assert value(samples, "duomo_model_restarts_total", model="flaky", cause="hung") == 0
        control.write_text("none")
        poll(lambda: value(scrape(port), "duomo_model_state", model="flaky", state="READY") == 1)


def evictable(name: str, offset: float) -> dict[str, object]:
    params = {"ballast_mb": 60, "offset": offset}
    return faulty_model(name, evictable=True, preload=name != "c", params=params)


def test_unload_load_and_eviction_move_the_lifecycle_series(tmp_path: Path) -> None:
    port = free_port()
    models = [evictable("a", 1.0), evictable("b", 2.0), evictable("c", 3.0)]
    budget_for_two = {"id": 0, "kind": "cpu", "memory_budget_mb": 150}
    config = write_config(
        tmp_path, [], extra=models, devices=[budget_for_two],
        metrics={"http": f"127.0.0.1:{port}"},
    )  # fmt: skip
    with running_supervisor(config) as sup:
        start = scrape(port)
        assert value(start, "duomo_model_loads_total", model="c") == 0
        assert value(start, "duomo_model_state", model="c", state="UNLOADED") == 1
        assert value(start, "duomo_device_memory_budget_bytes", device="0") == 150 * 2**20
        used = value(start, "duomo_device_memory_used_bytes", device="0")
        held = sum(value(start, "duomo_model_memory_bytes", model=m, device="0") for m in "ab")
        assert used == held > 0

        assert duomo(sup.socket, "unload", "a").returncode == 0
        unloaded = scrape(port)
        assert value(unloaded, "duomo_model_state", model="a", state="UNLOADED") == 1
        assert value(unloaded, "duomo_model_state", model="a", state="READY") == 0
        assert value(unloaded, "duomo_model_memory_bytes", model="a", device="0") == 0
        assert duomo(sup.socket, "load", "a").returncode == 0
        loaded = scrape(port)
        assert value(loaded, "duomo_model_loads_total", model="a") == 2
        assert value(loaded, "duomo_model_load_duration_seconds_count", model="a") == 2
        assert value(loaded, "duomo_model_state", model="a", state="READY") == 1

        with Client(sup.socket, timeout_s=60) as client:  # c loads on demand: one is evicted
            assert client.model("c").infer(X)["y"][0, 0] == 5.0
        evicted = scrape(port)
        assert value(evicted, "duomo_model_loads_total", model="c") == 1
        assert sum(value(evicted, "duomo_model_evictions_total", model=m) for m in "abc") == 1


@contextlib.contextmanager
def starting_supervisor(config: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A supervisor process that is not waited for: the test watches it start."""
    folder = short_socket_dir()
    sock = folder / "duomo.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "duomo.supervisor", "start", "-c", str(config), "--socket",
         str(sock), "--foreground"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield process, sock
    finally:
        stop_gracefully(process)
        with contextlib.suppress(OSError):
            for leftover in folder.iterdir():
                leftover.unlink()
            folder.rmdir()


def test_probes_say_ready_only_while_every_preload_model_serves(tmp_path: Path) -> None:
    port = free_port()
    control = tmp_path / "slow.fault"
    control.write_text("none")
    slow = faulty_model(
        "slow", params={"load_s": 2.0, "control_file": str(control)},
        health={"max_consecutive_failures": 1, "max_restarts": 0},
    )  # fmt: skip
    lazy = faulty_model("lazy", preload=False)  # not loaded: it does not hold readiness back
    config = write_config(
        tmp_path, [], extra=[slow, lazy], watchdog=FAST_WATCHDOG,
        metrics={"http": f"127.0.0.1:{port}"},
    )  # fmt: skip
    with starting_supervisor(config) as (process, sock):
        seen: list[tuple[int, bytes]] = []

        def answers() -> bool:
            with contextlib.suppress(OSError):
                seen.append(get(port, "/v2/health/ready"))
                return True
            return False

        poll(answers, timeout_s=60)
        status, body = seen[-1]  # the port answers before the models are even built
        before_ready = (b"slow: not built", b"slow: UNLOADED", b"slow: LOADING")  # (built, not
        # yet loading: the moment between the registry's build and the model's load)
        assert status == 503 and any(state in body for state in before_ready), body
        assert get(port, "/v2/health/live")[0] == 200  # starting counts as alive
        poll(lambda: get(port, "/v2/health/ready")[0] == 200, timeout_s=60)
        assert get(port, "/v2/health/live")[0] == 200
        assert get(port, "/nowhere")[0] == 404

        control.write_text("raise")  # no restarts allowed: the first failure makes it FAILED
        with Client(sock) as client, pytest.raises(DuomoError):
            client.model("slow").infer(X, timeout_s=10)
        poll(lambda: get(port, "/v2/health/ready")[0] == 503, timeout_s=30)
        status, body = get(port, "/v2/health/ready")
        assert b"slow: FAILED" in body, body
        assert get(port, "/v2/health/live")[0] == 200
        assert process.poll() is None


def test_a_taken_metrics_port_stops_the_start_with_the_reason(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(
            tmp_path, [], extra=[faulty_model("a")], metrics={"http": f"127.0.0.1:{port}"}
        )
        sock = short_socket_dir() / "duomo.sock"
        done = subprocess.run(
            [sys.executable, "-m", "duomo.supervisor", "start", "-c", str(config), "--socket",
             str(sock)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1, done
    assert f"metrics.http 127.0.0.1:{port} cannot be bound" in done.stderr, done.stderr
    assert not sock.exists()


FACES_PIPELINE = {
    "name": "faces",
    "steps": [
        {"name": "detect", "model": "face"},
        {"name": "embedding", "model": "face_embedding",
         "for_each": {"step": "detect", "input": "landmarks"}},
        {"name": "attributes", "model": "face_attributes",
         "for_each": {"step": "detect", "input": "landmarks"}},
    ],
}  # fmt: skip
STEP_MODELS = {"detect": "face", "embedding": "face_embedding", "attributes": "face_attributes"}


def test_a_pipeline_has_its_series_at_zero_and_counts_frames_objects_and_skipped_steps(
    tmp_path: Path,
) -> None:
    port = free_port()
    config = write_config(
        tmp_path, ["face", "face_embedding", "face_attributes"], pipelines=[FACES_PIPELINE],
        metrics={"http": f"127.0.0.1:{port}"},
    )  # fmt: skip
    frames = [fixture_image("astronaut.png"), fixture_image("coffee.png")] * 2  # 1 face, none
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=60) as client:
        before = scrape(port)
        for code in ErrorCode:
            assert value(before, "duomo_pipeline_requests_total", pipeline="faces",
                         code=code.name) == 0  # fmt: skip
        assert value(before, "duomo_pipeline_objects_per_frame_count", pipeline="faces") == 0
        for step, model in STEP_MODELS.items():
            key = {"pipeline": "faces", "step": step}
            assert value(before, "duomo_pipeline_step_runs_total", **key, model=model) == 0
            for kind in ("skipped", "reused", "errors"):
                assert value(before, f"duomo_pipeline_step_{kind}_total", **key) == 0

        faces = client.model("faces")
        answers = [faces.infer(frame, timeout_s=60) for frame in frames]
        assert [len(answer["faces"]) for answer in answers] == [1, 0, 1, 0]
        assert all("embedding" in face for face in answers[0]["faces"])
        ok = ("duomo_pipeline_requests_total", "OK")
        poll(lambda: value(scrape(port), ok[0], pipeline="faces", code=ok[1]) == len(frames))
        after = scrape(port)
        status = client.status()
        table = duomo(sup.socket, "status").stdout.splitlines()

    def series(name: str, **labels: str) -> float:
        return value(after, name, pipeline="faces", **labels)

    assert series("duomo_pipeline_latency_seconds_count") == len(frames)
    assert series("duomo_pipeline_objects_per_frame_count") == 4  # frames with a detection
    assert series("duomo_pipeline_objects_per_frame_sum") == 2  # faces in them
    assert series("duomo_pipeline_objects_per_frame_bucket", le="0.0") == 2  # the faceless
    assert series("duomo_pipeline_step_runs_total", step="detect", model="face") == 4
    for step in ("embedding", "attributes"):
        model = STEP_MODELS[step]
        assert series("duomo_pipeline_step_runs_total", step=step, model=model) == 2  # a face
        assert series("duomo_pipeline_step_skipped_total", step=step) == 2  # no face: skipped
        assert series("duomo_pipeline_step_errors_total", step=step) == 0
    assert series("duomo_pipeline_step_reused_total", step="embedding") == 0  # no tracker
    # duomo status reads the same counts (its table: supervisor.operators.pipeline_table)
    shown = status.pipelines["faces"]
    assert (shown.state, shown.requests, shown.errors) == ("READY", 4, 0)
    assert (shown.objects.count, shown.objects.frames) == (2, 4)
    steps = {s.name: (s.model, s.for_each, s.runs, s.skipped) for s in shown.steps}
    assert steps == {
        "detect": ("face", None, 4, 0),
        "embedding": ("face_embedding", "detect", 2, 2),
        "attributes": ("face_attributes", "detect", 2, 2),
    }
    rows = [line.split() for line in table if line.startswith("faces ")]
    assert rows == [
        ["faces", "READY", "4", "0", *rows[0][4:7], "detect", "face", "frame", "4", "0", "0", "0"],
        ["faces", "embedding", "face_embedding", "detect", "2", "2", "0", "0"],
        ["faces", "attributes", "face_attributes", "detect", "2", "2", "0", "0"],
    ]
    assert rows[0][6] == "0.50"  # objects per frame
    # every pipeline series the Grafana dashboard asks for is exposed
    asked = {name for name in dashboard_metric_names() if name.startswith("duomo_pipeline_")}
    assert asked and asked <= {name for name, _ in after}
