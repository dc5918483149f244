"""``duomo bench`` as a user runs it: the smoke workload (engine and duomo modes, a few seconds)
through the real CLI, real supervisor and producer processes, so the tool never rots. No timing
is asserted: the figures only have to exist, be consistent and count no wrong answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

SMOKE = ROOT / "configs" / "bench" / "smoke.yaml"


def _segments() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_bench_smoke_writes_the_report(demo_config: object, tmp_path: Path) -> None:
    out = tmp_path / "report"
    segments_before = _segments()
    run = subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", "bench", "-w", str(SMOKE),
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
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
    # every supervisor the run started is gone, and so are its sockets; no segment is left
    assert not list(Path(out).glob("*.sock"))
    assert _segments() <= segments_before


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
    """``--sharing-only``: one round (sharing on, then off) of the demo config at two instances
    a model under the smoke workload's producers; both trials answer correctly, the ledger counts
    one copy of each file's weights with sharing on and more with it off, and the supervisor
    holds less after load with sharing on (about one copy of the demo's 105 MB of weights)."""
    out = tmp_path / "report"
    segments_before = _segments()
    run = subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", "bench", "-w", str(SMOKE), "--out",
         str(out), "--sharing-only", "--sharing-rounds", "1", "--sharing-window", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
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
    assert _segments() <= segments_before
