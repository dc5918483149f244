"""``duomo inspect MODEL_FILE``: what a model takes and returns, without a config.

``.onnx`` is opened with ONNX Runtime on CPU; ``.om`` with the ACL backend (it needs the CANN
runtime: a clear error says so where there is none). Called by the CLI only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from duomo.worker.backends.base import SessionSettings


def inspect_model(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError("no such file")
    if path.suffix == ".om":
        return _inspect_om(path)
    if path.suffix == ".onnx":
        return _inspect_onnx(path)
    raise ValueError("expected an .onnx or .om file")


def _inspect_onnx(path: Path) -> dict[str, Any]:
    from duomo.worker.backends.ort_backend import OrtBackend

    session = OrtBackend().open(path, SessionSettings(intra_op_threads=1))
    try:

        def tensor(spec: Any) -> dict[str, Any]:
            dims = ["?" if d is None else d for d in spec.shape]
            return {"name": spec.name, "dtype": spec.dtype.name, "dims": dims}

        return {
            "file": str(path),
            "format": "onnx",
            "inputs": [tensor(s) for s in session.inputs],
            "outputs": [tensor(s) for s in session.outputs],
            "metadata": {k: v[:200] for k, v in session.metadata.items()},
        }
    finally:
        session.close()


def _inspect_om(path: Path) -> dict[str, Any]:
    from duomo.worker.backends.acl_backend import AclBackend, atc_sidecar

    backend = AclBackend()
    try:
        session = backend.open(path, SessionSettings(intra_op_threads=1))
        try:
            return {
                "file": str(path),
                "format": "om",
                "soc": backend.soc_name,
                "atc": atc_sidecar(path),
                **session.describe(),
            }
        finally:
            session.close()
    finally:
        backend.close()
