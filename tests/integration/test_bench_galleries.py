"""``duomo bench --galleries-only`` in miniature: the real command on two small galleries, each
query checked against the name it was enrolled under (the part fails on a wrong answer). No
figure is asserted beyond existing and being consistent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_bench_galleries_only_searches_every_size_and_reports_it(tmp_path: Path) -> None:
    out = tmp_path / "report"
    run = subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", "bench", "--galleries-only",
         "--gallery-sizes", "64,2000", "--gallery-seconds", "0.2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "report.json").read_text())
    assert "modes" not in report  # the mixed load did not run
    trials = report["galleries"]["trials"]
    assert [t["identities"] for t in trials] == [64, 2000]
    for t in trials:
        assert t["enrol_per_s"] > 0 and t["file_mib"] > 0, t
        # a snapshot holds each identity's 128 float32 and its name: about 0.5 KB
        assert 512 <= t["bytes_per_identity"] < 600, t
        for batch in ("1", "8"):
            assert t["search"][batch]["batches"] >= 3 and t["search"][batch]["per_query_ms"] > 0
    assert "## Galleries: search, memory, enrolment" in (out / "report.md").read_text()
    bad = subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", "bench", "--galleries-only",
         "--gallery-sizes", "1000,x"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--gallery-sizes" in bad.stderr
