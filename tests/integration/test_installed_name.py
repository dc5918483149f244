"""The installed name (issue 33 item 7): a wheel built from the repository holds exactly one
top-level package, ``duomo``, and installs beside Supervisor (whose import name is
``supervisor``) without touching it; ``duomo`` commands never import the benchmark tools,
which are not installed.

Builds the wheel and installs it with its dependencies into a fresh virtual environment (pip's
cache makes that about 20 s once ``make test`` has installed the project).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import ROOT

SUPERVISOR = "supervisor==4.3.0"  # Supervisord: its import name is the design card's folder's


def _run(*command: str | Path, cwd: Path, timeout_s: float = 600) -> str:
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, f"{command}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


def test_the_wheel_is_one_package_that_installs_beside_supervisord(tmp_path: Path) -> None:
    # built from a copy of the tracked tree: setuptools' build/ would keep files deleted since
    source = tmp_path / "source"
    tracked = _run("git", "ls-files", "-z", cwd=ROOT).split("\0")
    for name in filter(None, tracked):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        path = ROOT / name
        if path.is_symlink():
            (source / name).symlink_to(os.readlink(path))
        elif path.is_file():
            shutil.copy2(path, source / name)
    wheels = tmp_path / "wheels"
    _run(
        sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, source, cwd=tmp_path
    )
    (wheel,) = wheels.glob("duomo-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"duomo", next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert not [n for n in names if n.startswith("duomo/tools/") or "/tests/" in n]
    assert "duomo/worker/executors/imagenet_labels.txt" in names

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    _run(venv / "bin/python", "-m", "pip", "install", "-q", SUPERVISOR, wheel, cwd=tmp_path)
    assert _run(venv / "bin/supervisord", "--version", cwd=tmp_path).strip() == "4.3.0"
    where = _run(
        venv / "bin/python", "-c",
        "import duomo, supervisor; from duomo import Client, DuomoError; "
        "print(supervisor.__file__); print(duomo.__file__)",
        cwd=tmp_path,
    ).split()  # fmt: skip
    assert where[0].endswith("site-packages/supervisor/__init__.py")  # Supervisord's, untouched
    assert where[1].endswith("site-packages/duomo/__init__.py")
    config = ROOT / "configs" / "default.yaml"
    checked = subprocess.run(
        [venv / "bin/duomo", "check", "-c", config], cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    bench = subprocess.run(
        [venv / "bin/duomo", "bench", "--help"], cwd=tmp_path, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert bench.returncode == 2 and "runs from a source checkout" in bench.stderr, bench.stderr


def test_duomo_bench_runs_from_the_checkout_wherever_it_is_called(tmp_path: Path) -> None:
    """The console script's path holds only its venv: ``duomo bench`` finds the checkout's
    tools/ beside ``duomo/`` (``make bench`` runs it so)."""
    duomo = Path(sys.executable).parent / "duomo"
    assert "usage: duomo bench" in _run(duomo, "bench", "--help", cwd=tmp_path)


def test_no_duomo_command_imports_the_benchmark() -> None:
    """``duomo bench`` imports ``tools.bench`` (and matplotlib) only when it runs."""
    probe = (
        "import sys; from duomo.supervisor.operators.cli import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.startswith(('tools', 'matplotlib'))))"
    )
    assert _run(sys.executable, "-c", probe, cwd=ROOT).strip() == "[]"
