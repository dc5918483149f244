"""``duomo bench --sinks-only`` in miniature: the real command, a few hundred events per trial,
against the local mosquitto and redis-server it starts itself (Debian's; with CI=true a missing
one fails, tests/conftest.py). No figure is asserted beyond existing and being consistent: every
event was acknowledged, and the report has the section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
from tests.integration.brokers import broker_program
from tools.bench.brokers import PROGRAMS


def test_bench_sinks_only_publishes_every_event_to_both_brokers(tmp_path: Path) -> None:
    for name, package in PROGRAMS.values():
        broker_program(name, package)  # (duomo bench --sinks starts them)
    out = tmp_path / "report"
    run = subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", "bench", "--sinks-only", "--sink-events",
         "300", "--sink-cameras", "0", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "report.json").read_text())
    assert "modes" not in report  # the mixed load did not run
    trials = report["sinks"]["trials"]
    assert {(t["kind"], t["payload"]) for t in trials} == {
        (kind, payload) for kind in ("mqtt", "redis") for payload in ("classify", "faces")
    }
    for t in trials:
        assert t["events"] == 300 and t["publish_per_s"] > 0 and t["append_per_s"] > 0, t
        assert t["event_bytes"] > 0 and t["publish_cpu_ms_per_1000"] > 0, t
    assert "## Sinks: what one sink sustains" in (out / "report.md").read_text()
