"""``duomo bench`` as a user runs it: the smoke workload (engine and duomo modes, a few seconds)
through the real CLI, real supervisor and producer processes, so the tool never rots. No timing
is asserted: the figures only have to exist, be consistent and count no wrong answer."""

from __future__ import annotations

import contextlib
import ctypes
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import DEMO_CONFIG, ROOT
from tests.integration.harness import our_segments, poll, short_socket_dir, write_config

SMOKE = ROOT / "configs" / "bench" / "smoke.yaml"
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def _subreaper(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


@contextlib.contextmanager
def left_behind() -> Iterator[Callable[[], list[str]]]:
    """What the processes started in the block leave behind: a line for each process of theirs
    still running once they have exited, and each ring (``our_segments``) it holds.

    The bench starts supervisors and producers, which start workers of their own; when the
    bench exits, one it failed to stop would be re-parented to init and vanish from this
    test's view. While the block runs this process is a child subreaper
    (``PR_SET_CHILD_SUBREAPER``), so such a process becomes its child instead. Only this
    test's own processes are looked at, never the machine's process table or the whole of
    /dev/shm, where other programs' segments and semaphores come and go. Leaving the block
    kills and reaps whatever it adopted."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    segments = our_segments()

    def adopted() -> list[psutil.Process]:
        return [p for p in me.children(recursive=True) if p.pid not in before]

    def left() -> list[str]:
        running = []
        for process in adopted():
            with contextlib.suppress(psutil.Error):
                if process.status() != psutil.STATUS_ZOMBIE:
                    running.append(f"pid {process.pid}: {' '.join(process.cmdline()[:6])}")
        return running + sorted(our_segments() - segments)

    _subreaper(True)
    try:
        yield left
    finally:
        _subreaper(False)
        for process in adopted():
            with contextlib.suppress(psutil.Error, ChildProcessError):
                process.kill()
                process.wait(10)


def nothing_left(left: Callable[[], list[str]]) -> None:
    """Every process the run started has exited (a supervisor's workers may outlive it by a
    moment), holding no ring."""
    with contextlib.suppress(AssertionError):
        poll(lambda: not left(), timeout_s=10)
    assert not left(), left()


def test_left_behind_sees_a_process_a_finished_run_left_running() -> None:
    """The check below can fail: a child that exits leaving a process of its own running is
    seen (that process is adopted by this one, not lost to init), and killed on leaving."""
    with left_behind() as left:
        started = subprocess.run(
            ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        orphan = psutil.Process(int(started.stdout))
        assert orphan.ppid() == psutil.Process().pid
        assert [line.split(":")[0] for line in left()] == [f"pid {orphan.pid}"]
    assert not orphan.is_running()


def test_bench_smoke_writes_the_report(demo_config: object, tmp_path: Path) -> None:
    out = tmp_path / "report"
    with left_behind() as left:
        run = subprocess.run(
            [sys.executable, "-m", "duomo.supervisor", "bench", "-w", str(SMOKE),
             "--out", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        nothing_left(left)
    report = json.loads((out / "report.json").read_text())
    assert set(report["modes"]) == {"engine", "duomo"}
    assert set(report["alone"]) == {"face", "classify"}
    for name, alone in report["alone"].items():
        assert alone["rps"] > 0 and alone["p50_ms"] > 0, name
    for mode, figures in report["modes"].items():
        for name, model in figures["models"].items():
            assert model["wrong"] == 0 and not model["errors"], (mode, name, model)
            assert model["rps"] > 0 and model["p50_ms"] <= model["p99_ms"], (mode, name)
        assert figures["work"] > 0 and figures["rss_peak_mib"] > 0, mode
        assert len(figures["work_rounds"]) == 1
    duomo = report["modes"]["duomo"]
    assert duomo["processes"] >= 1 and duomo["idle_cpu_percent"] is not None
    assert duomo["models"]["classify"]["overhead_ms"] is not None
    # the bare servers, one and two threads, probed in the same client
    assert duomo["models"]["classify"]["floor_ms"] is not None
    assert duomo["models"]["classify"]["design_floor_ms"] is not None
    # and each server's own time in the executor taken off its round trips: what it adds
    for key in ("accounted_ms", "floor_accounted_ms", "design_floor_accounted_ms"):
        assert duomo["models"]["classify"][key] > 0, key
    # the work ratio is reported as a target; whether it holds is the benchmark's business
    names = [t["target"] for t in report["targets"]]
    assert "duomo work ÷ engine work" in names and "idle supervisor CPU %" in names
    markdown = (out / "report.md").read_text()
    assert "| engine |" in markdown and "| duomo |" in markdown and "| floor |" in markdown
    assert "| design floor |" in markdown
    assert markdown in run.stdout
    for chart in ("throughput.png", "latency.png"):
        assert (out / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every supervisor the run started is gone, holding no ring (nothing_left, above), and so
    # are its sockets
    assert not list(Path(out).glob("*.sock"))


def test_bench_rejects_a_bad_workload_with_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "config: ../default.yaml\nmodels: [{name: classify, images: [a.png]}]\n"
        "overhead_models: [face]\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", "bench", "-w", str(bad),
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    assert "overhead_models ['face'] are not in models ['classify']" in run.stderr


def test_bench_sharing_only_measures_both_settings(demo_config: object, tmp_path: Path) -> None:
    """``--sharing-only``: one round (sharing on, then off) of the demo config's two models the
    smoke workload sends to (face and classify: the part runs the workload's config whole, and
    the demo's other four would only lengthen it) at two instances a model under the smoke
    workload's producers; both trials answer correctly, the ledger counts one copy of each
    file's weights with sharing on and more with it off, and the supervisor holds less after
    load with sharing on (about one copy of their 26 MB of weights)."""
    out = tmp_path / "report"
    workload = yaml.safe_load(SMOKE.read_text())
    workload["config"] = str(write_config(tmp_path, ["face", "classify"]))
    workload["models"] = [
        {**m, "images": [str((SMOKE.parent / i).resolve()) for i in m["images"]]}
        for m in workload["models"]
    ]
    smoke = tmp_path / "smoke.yaml"
    smoke.write_text(yaml.safe_dump(workload))
    with left_behind() as left:
        run = subprocess.run(
            [sys.executable, "-m", "duomo.supervisor", "bench", "-w", str(smoke), "--out",
             str(out), "--sharing-only", "--sharing-rounds", "1", "--sharing-window", "2"],
            cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        nothing_left(left)
    report = json.loads((out / "report.json").read_text())
    assert "modes" not in report  # the mixed load did not run
    part = report["sharing"]
    trials = {t["sharing"]: t for t in part["trials"]}
    assert set(trials) == {"on", "off"} and len(part["raw"]["trials"]) == 2
    for setting, t in trials.items():
        assert t["wrong"] == 0 and t["errors"] == 0, (setting, t)
        assert set(t["rps"]) == {"face", "classify"} and t["work"] > 0, setting
        assert t["rss_peak_mib"] > 0 and t["after_load_rss_mib"] > 0, setting
    files = {w["file"] for w in part["raw"]["trials"][0]["after_load"]["ledger"]["weights"]}
    assert trials["on"]["weight_copies"] == len(files) < trials["off"]["weight_copies"]
    assert trials["on"]["after_load_rss_mib"] < trials["off"]["after_load_rss_mib"]
    assert "## Shared weights" in (out / "report.md").read_text()


# -- the camera and pipeline parts, in miniature ----------------------------------------------
# ``duomo bench --cameras`` and ``--pipelines`` take 5 to 30 minutes of a whole machine; their
# parts run here end to end on settings a few seconds long (the parts' own settings objects, as
# the command line fills them), with real supervisors and producer processes. A part records a
# trial that failed and goes on, so each test asserts that no trial failed. No timing is
# asserted.


def test_bench_cameras_in_miniature(
    demo_config: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tools.bench.cameras`` both parts: one camera fifo and latest, at its rate and at 3×
    what face answered; then one camera from each of Duomo's video source and the hand-written
    loop into face + classify; its section joins the report. The clips are 2 s, made in this
    test's folder (the command caches 10 s ones under .bench/clips)."""
    from tools.bench import camera_clip, cameras
    from tools.bench.camera_report import add_to_report

    monkeypatch.setattr(camera_clip, "SECONDS", 2)
    monkeypatch.setattr(cameras, "CLIPS", tmp_path / "clips")
    settings = cameras.CameraSettings(
        warmup_s=0.5, freshness_s=1.0, window_s=1.0, one_fps=10, many_fps=5, max_cameras=1,
        producers=("source", "naive"), calibrate_frames=5,
    )  # fmt: skip
    workdir = short_socket_dir()  # (the supervisors' sockets are made in it)
    try:
        with left_behind() as left:
            raw = cameras.run_cameras(DEMO_CONFIG, settings, workdir)
            nothing_left(left)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    section = add_to_report(raw, tmp_path / "report")

    for path in ("source", "opencv"):
        assert raw["calibration"][path]["cpu_ms_per_frame"] > 0, path
    trials = raw["freshness"]["trials"]
    assert [(t["policy"], t.get("error")) for t in trials] == [
        ("fifo", None), ("latest", None), ("latest", None), ("fifo", None),
    ]  # fmt: skip
    for trial in trials:
        assert trial["sent_fps"] > 0 and trial["answered_fps"] > 0, trial
        assert trial["errors"] == [] and trial["age_ms_p50"] is not None, trial
    for kind in settings.producers:
        part = raw["scaling"][kind]
        assert "error" not in part and len(part["trials"]) == 1, (kind, part)
        (trial,) = part["trials"]
        assert trial["errors"] == [] and trial["decoded"] > 0, (kind, trial)
        assert set(trial["shares"]["cam-1"]) == {"face", "classify"}, (kind, trial)
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["cameras"]["raw"]["freshness"]["trials"] == json.loads(json.dumps(trials))
    assert (
        section.startswith("## Cameras")
        and section in (tmp_path / "report" / "report.md").read_text()
    )


def test_bench_pipelines_in_miniature(demo_config: object, tmp_path: Path) -> None:
    """``tools.bench.pipelines`` both parts: the chain of configs/pipelines-bench.yaml as a
    Duomo pipeline and driven from the client, one producer, a frame with one face; then the
    tracker's reuse at ``reinfer_every: 10``; its section joins the report. Triton is left out
    (``make bench`` installs it)."""
    from tools.bench import pipelines
    from tools.bench.pipeline_report import add_to_report

    settings = pipelines.PipelineSettings(
        warmup_s=0.5, window_s=1.0, producers=1, variants=("pipeline", "client"), faces=(1,),
        reinfer_every=(10,), clip_frames=10, rounds=1, quiet_wait_s=0.0, retries=0,
    )  # fmt: skip
    workdir = short_socket_dir()
    try:
        with left_behind() as left:
            raw = pipelines.run_pipelines(pipelines.CONFIG, settings, workdir)
            nothing_left(left)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    section = add_to_report(raw, tmp_path / "report")

    assert raw["pipelines_served"] and raw["frames"]["1"]["faces"] == 1
    trials = {t["variant"]: t for t in raw["chain"]["trials"]}
    assert set(trials) == {"pipeline", "client"}
    for variant, trial in trials.items():
        assert "error" not in trial, (variant, trial)
        assert trial["frames"] > 0 and trial["wrong"] == 0 and not trial["errors"], trial
    assert trials["pipeline"]["counts"]["pipeline"]["requests"] > 0
    assert trials["client"]["counts"]["pipeline"]["requests"] == 0  # (the client chains)
    (tracked,) = raw["tracker"]["trials"]
    assert "error" not in tracked and tracked["frames"] > 0 and tracked["wrong"] == 0, tracked
    assert tracked["reused_sub_results"] > 0  # reinfer_every 10: most frames reuse
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert set(report["pipelines"]) >= {"targets", "ratios", "tracker", "raw"}
    assert (
        section.startswith("## Pipelines")
        and section in (tmp_path / "report" / "report.md").read_text()
    )
