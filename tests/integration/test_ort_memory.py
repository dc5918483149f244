"""The ONNX Runtime backend's memory policy on a real model: which sessions use memory patterns,
the shared CPU arena, and that shrinking it after sessions close gives their memory back."""

from __future__ import annotations

import gc

import numpy as np
import psutil

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


def test_the_shared_arena_gives_back_what_closed_sessions_used(demo_config: object) -> None:
    backend = OrtBackend(OrtOptions())  # shared_cpu_arena is on by default
    process = psutil.Process()
    gc.collect()
    backend.release_free_memory()  # earlier tests in this process may have left free chunks
    before = process.memory_info().rss
    session = backend.open(FACE, SessionSettings(intra_op_threads=1))
    x = np.zeros((2, 3, 672, 672), dtype=np.float32)
    session.run({session.inputs[0].name: x})
    used = process.memory_info().rss - before
    assert used > 50 * 2**20  # CenterFace at 2×672²: hundreds of MB of activations when fresh
    session.close()
    del session
    gc.collect()
    backend.release_free_memory()
    left = process.memory_info().rss - before
    assert left < used / 2, (left / 2**20, used / 2**20)
