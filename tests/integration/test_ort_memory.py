"""The ONNX Runtime backend's memory policy on a real model: which sessions use memory patterns,
the shared CPU arena, and that shrinking it after sessions close gives their memory back."""

from __future__ import annotations

import json
import subprocess
import sys

from duomo.worker.backends.base import SessionSettings
from duomo.worker.backends.ort_backend import OrtBackend, OrtOptions
from duomo.worker.executors.ocr import OcrExecutor
from tests.conftest import ROOT

FACE = ROOT / "models" / "face" / "centerface_dyn.onnx"
DET = ROOT / "models" / "ocr" / "PP-OCRv6_det_small.onnx"


def _pattern(backend: OrtBackend, varying: bool) -> bool:
    session = backend.open(DET, SessionSettings(intra_op_threads=1, varying_shapes=varying))
    try:
        return bool(session._session.get_session_options().enable_mem_pattern)
    finally:
        session.close()


def test_memory_patterns_are_off_only_where_shapes_vary(demo_config: object) -> None:
    auto = OrtBackend(OrtOptions())
    assert _pattern(auto, varying=False) and not _pattern(auto, varying=True)
    assert _pattern(OrtBackend(OrtOptions(memory_pattern="on")), varying=True)
    assert not _pattern(OrtBackend(OrtOptions(memory_pattern="off")), varying=False)
    settings = SessionSettings(intra_op_threads=1)
    varying = [OcrExecutor.session_settings(r, settings).varying_shapes for r in OcrExecutor.roles]
    assert varying == [True, False, True]  # det, cls, rec


# In a process of its own: this test process's shared arena is shared with whatever earlier
# tests left open (the session-wide demo engine), so a new session may fill room they left in
# it and its use would not show; there, CI once saw 41 MiB where a fresh process grows hundreds.
ARENA_PROBE = """
import gc, json, sys
from pathlib import Path
import numpy as np, psutil
from duomo.worker.backends.base import SessionSettings
from duomo.worker.backends.ort_backend import OrtBackend, OrtOptions
backend = OrtBackend(OrtOptions())  # shared_cpu_arena is on by default
process = psutil.Process()
backend.release_free_memory()  # the arena and the environment made before the baseline
before = process.memory_info().rss
session = backend.open(Path(sys.argv[1]), SessionSettings(intra_op_threads=1))
session.run({session.inputs[0].name: np.zeros((2, 3, 672, 672), dtype=np.float32)})
used = process.memory_info().rss - before
session.close()
del session
gc.collect()
backend.release_free_memory()
print(json.dumps({"used": used, "left": process.memory_info().rss - before}))
"""


def test_the_shared_arena_gives_back_what_closed_sessions_used(demo_config: object) -> None:
    probe = subprocess.run(
        [sys.executable, "-c", ARENA_PROBE, str(FACE)], capture_output=True, text=True, timeout=300
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    figures = json.loads(probe.stdout.splitlines()[-1])
    used, left = figures["used"], figures["left"]
    assert used > 50 * 2**20  # CenterFace at 2×672²: hundreds of MB of activations when fresh
    assert left < used / 2, (left / 2**20, used / 2**20)
