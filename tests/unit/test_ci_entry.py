"""``.ci/run``, CI's entry point, sets ``CI=true`` itself: with it every skip fails
(tests/conftest.py), so whoever runs it — a CI service that sets nothing, or a person — gets the
strict run. Checked with a stand-in ``make`` first on PATH that reports what it was given."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import ROOT


def test_ci_run_sets_ci_true_whatever_its_caller_has(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_make = bin_dir / "make"
    fake_make.write_text('#!/bin/sh\necho "CI=${CI-unset} cwd=$PWD args=$*"\n')
    fake_make.chmod(0o755)
    for caller in ({}, {"CI": ""}, {"CI": "false"}):
        env = {k: v for k, v in os.environ.items() if k != "CI"}
        env |= {"PATH": f"{bin_dir}:{env['PATH']}", **caller}
        done = subprocess.run(
            [str(ROOT / ".ci" / "run")], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=30,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"CI=true cwd={ROOT} args=test", (caller, done.stdout)
