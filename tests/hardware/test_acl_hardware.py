"""On a real Ascend card: the ACL backend loads the demo .om files and answers like ONNX on CPU.

Skipped (with the reason) wherever ``import acl`` fails, which is every CI machine. On a card:
build the .om files (``python tools/atc_convert.py --soc <SoC>``), then
``pytest tests/hardware -v``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("acl") is None,
    reason="no Ascend runtime: `import acl` (pyACL from CANN) is not available here",
)


def _om_files() -> list[Path]:
    return sorted((ROOT / "models").glob("ascend-*/*.om"))


def test_every_built_om_matches_its_onnx_on_every_gear() -> None:
    from duomo.worker.backends.acl_backend import AclBackend, atc_sidecar
    from duomo.worker.backends.base import SessionSettings
    from duomo.worker.backends.ort_backend import OrtBackend

    files = _om_files()
    if not files:
        pytest.skip("no .om files: run python tools/atc_convert.py --soc <SoC> first")
    acl, ort = AclBackend(), OrtBackend()
    try:
        for om in files:
            onnx = Path((atc_sidecar(om) or {})["onnx"])
            npu = acl.open(om, SessionSettings(intra_op_threads=1))
            cpu = ort.open(onnx, SessionSettings(intra_op_threads=1))
            try:
                spec = npu.inputs[0]
                for gear in npu.every_gear():
                    shape = npu.shape_at(spec, gear)
                    x = np.random.default_rng(sum(gear)).random(shape, dtype=np.float32)
                    got = npu.run({spec.name: x})
                    want = cpu.run({cpu.inputs[0].name: x})
                    for a, b in zip(got.values(), want.values()):
                        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)  # fp16 on the NPU
            finally:
                npu.close()
                cpu.close()
    finally:
        acl.close()
