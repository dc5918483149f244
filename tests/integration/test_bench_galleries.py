"""``duomo bench --galleries-only`` in miniature: the real command on two small galleries, each
query checked against the name it was enrolled under (the part fails on a wrong answer), then its
pipeline part in short rounds: a supervisor with ``faces`` with and without its ``identity``
step, a 4-face frame whose every answer is checked (the three enrolled faces by name, the
stranger nobody), and a few enrolments through the producer API. No figure is asserted beyond
existing and being consistent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
from tests.integration.face_images import GRACE_HOPPER, TOM_HANKS, face_image


def test_bench_galleries_only_searches_every_size_and_reports_it(tmp_path: Path) -> None:
    for name in (GRACE_HOPPER, TOM_HANKS):
        face_image(name)  # (the pipeline part's photos: a skip, which CI fails, if missing)
    out = tmp_path / "report"
    run = subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", "bench", "--galleries-only",
         "--gallery-sizes", "64,2000", "--gallery-seconds", "0.2",
         "--gallery-pipeline-seconds", "0.5", "--gallery-pipeline-rounds", "1",
         "--gallery-enrol-images", "3", "--out", str(out)],
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
    pipeline = report["galleries"]["pipeline"]
    rounds = pipeline["rounds"]
    assert [t["pipeline"] for t in rounds] == ["faces", "faces_without_identity"], rounds
    assert all(t["frames"] > 0 for t in rounds), rounds
    rate = pipeline["frames_per_s"]
    assert pipeline["with_over_without"] == rate["faces"] / rate["faces_without_identity"]
    assert all(t["cores"] > 0 for t in rounds) and pipeline["with_over_without_per_core"] > 0
    assert pipeline["enrolment"]["images"] == 3 and pipeline["enrolment"]["images_per_s"] > 0
    text = (out / "report.md").read_text()
    assert "## Galleries: search, memory, enrolment" in text
    assert "| `faces` (identity) |" in text and "images/s" in text
    for bad in (["--gallery-sizes", "1000,x"], ["--gallery-pipeline-rounds", "0"]):
        refused = subprocess.run(
            [sys.executable, "-m", "duomo.supervisor", "bench", "--galleries-only", *bad],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert refused.returncode == 2 and bad[0] in refused.stderr, refused.stderr
