"""Executors: the per-task plugins, and how a config's ``task`` names one.

``resolve_executor(task, search_dir)`` returns the class for a built-in task name or for a
``package.module:ClassName`` reference (importable from ``search_dir`` — the config file's
folder — or the Python path). Called by the config loader (to validate params) and the engine.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from worker.executors.base import Executor, StageTimer

__all__ = ["BUILTIN_TASKS", "Executor", "StageTimer", "resolve_executor"]

BUILTIN_TASKS = {
    "raw": "worker.executors.raw:RawExecutor",
    "classification": "worker.executors.classification:ClassificationExecutor",
    "face_detection": "worker.executors.face_detection:FaceDetectionExecutor",
    "ocr": "worker.executors.ocr:OcrExecutor",
}


def resolve_executor(task: str, search_dir: Path | None = None) -> type[Executor]:
    """The executor class for ``task``; ValueError with the reason if it cannot be found."""
    reference = BUILTIN_TASKS.get(task, task)
    module_name, sep, class_name = reference.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(
            f"unknown task {task!r}: use one of {sorted(BUILTIN_TASKS)} "
            "or 'package.module:ClassName'"
        )
    if search_dir is not None and str(search_dir) not in sys.path:
        sys.path.append(str(search_dir))
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import executor module {module_name!r}: {err}") from err
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise ValueError(f"{reference!r} is not an Executor subclass")
    return cls
