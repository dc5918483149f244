"""Backends: the process-wide runtimes that load model files and run batches.

``create_backend(name, settings)`` is the one way the engine gets a backend; each backend module
is imported only when a model uses it, so ``onnxruntime`` (or ``acl``) loads only when needed.
"""

from __future__ import annotations

from typing import Any

from duomo.worker.backends.base import Backend, ModelSession, SessionSettings, TensorSpec

__all__ = ["Backend", "ModelSession", "SessionSettings", "TensorSpec", "create_backend"]


def create_backend(name: str, options: Any) -> Backend:
    """The backend ``name`` configured with ``options`` (that backend's config section)."""
    if name == "onnxruntime":
        from duomo.worker.backends.ort_backend import OrtBackend

        return OrtBackend(options)
    if name == "acl":
        from duomo.worker.backends.acl_backend import AclBackend

        return AclBackend(options)
    raise ValueError(f"unknown backend {name!r}")
