"""Executors: the per-task plugins, and how a config's ``task`` names one.

``resolve_executor(task, search_dir)`` returns the class for a built-in task name or for a
``package.module:ClassName`` reference (importable from ``search_dir`` — the config file's
folder — or the Python path). Called by the config loader (to validate params) and so on every
start and reload. Its errors tell apart a module that is not found, one that fails to import,
a module without the class, and a class that is not an ``Executor``.

A user's module (any but Duomo's own packages) is imported again, from its source, when its
file has changed since it was last imported: ``duomo reload`` then serves the new code, and a
changed file is a change of the model (the new class is a new object, which the engine's
signature of the model sees). The old module object is left as it was, so the instances still
serving with its class keep their code and globals until they are replaced. Only the module the
task names is imported again, not modules it imports.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import sys
import threading
from pathlib import Path
from types import CodeType, ModuleType

from duomo.worker.executors.base import Executor, StageTimer

__all__ = ["BUILTIN_TASKS", "Executor", "StageTimer", "resolve_executor"]

BUILTIN_TASKS = {
    "raw": "duomo.worker.executors.raw:RawExecutor",
    "classification": "duomo.worker.executors.classification:ClassificationExecutor",
    "face_detection": "duomo.worker.executors.face_detection:FaceDetectionExecutor",
    "ocr": "duomo.worker.executors.ocr:OcrExecutor",
    "ocr_detection": "duomo.worker.executors.ocr_stages:OcrDetectionExecutor",
    "ocr_reading": "duomo.worker.executors.ocr_stages:OcrReadingExecutor",
    "face_embedding": "duomo.worker.executors.face_embedding:FaceEmbeddingExecutor",
    "face_attributes": "duomo.worker.executors.face_attributes:FaceAttributesExecutor",
    "gallery": "duomo.worker.executors.gallery:GalleryExecutor",
}
DUOMO_PACKAGES = frozenset({"duomo", "tools"})  # never re-imported

SourceStamp = tuple[str, bytes]  # a module file's path and the SHA-256 of its content
_stamps: dict[str, SourceStamp] = {}  # user module name -> its file when it was last imported
_imports = threading.Lock()


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
        if module_name.partition(".")[0] in DUOMO_PACKAGES:
            module = importlib.import_module(module_name)
        else:
            with _imports:
                module = _import_current(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not _is_prefix(err.name, module_name):  # one it imports
            raise ValueError(f"cannot import executor module {module_name}: {err}") from err
        looked = f"the config's folder {search_dir} and " if search_dir is not None else ""
        raise ValueError(
            f"executor module {module_name} not found (looked in {looked}the Python path)"
        ) from err
    except Exception as err:  # the user's module raised while it ran (SyntaxError included)
        raise ValueError(
            f"cannot import executor module {module_name}: {type(err).__name__}: {err}"
        ) from err
    if not hasattr(module, class_name):
        raise ValueError(f"module {module_name} has no class {class_name}")
    cls = getattr(module, class_name)
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise ValueError(f"{reference!r} is not an Executor subclass")
    return cls


def _is_prefix(name: str, module_name: str) -> bool:
    """``name`` is ``module_name`` or one of its parent packages."""
    return module_name == name or module_name.startswith(name + ".")


def _import_current(module_name: str) -> ModuleType:
    """A user's module as its file is now: imported, or imported again if its file's content
    changed since it last was (by content, not time: an edit within a clock tick of the last
    import, or that keeps the file's size, still counts). An edit made while the module is
    imported again shows as a change next time (it is stamped first); a failed import stamps
    nothing, so it is tried again rather than the old module kept."""
    module = sys.modules.get(module_name)
    if module is None:
        module = importlib.import_module(module_name)
        now = _source_stamp(module)
    else:
        now = _source_stamp(module)
        known = _stamps.get(module_name)
        if now is not None and known is not None and now != known:
            module = _import_from_source(module_name, module, now[0])
    if now is not None:
        _stamps[module_name] = now
    return module


def _source_stamp(module: ModuleType) -> SourceStamp | None:
    """The module's source file as it is now; None for a module without one."""
    spec = module.__spec__
    if spec is None or spec.origin is None:
        return None
    if not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
        return None
    try:
        content = Path(spec.origin).read_bytes()
    except OSError:
        return None
    return (spec.origin, hashlib.sha256(content).digest())


class _SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """Compiles the source every time: a cached .pyc is trusted when the source's size and
    whole-second mtime match, so an edit that keeps the length within the second of the last
    import would otherwise load the old code."""

    def get_code(self, fullname: str) -> CodeType:
        return self.source_to_code(self.get_data(self.path), self.path)


def _import_from_source(module_name: str, old: ModuleType, path: str) -> ModuleType:
    """A new module object for ``module_name`` from its source file, in ``sys.modules`` (and its
    package) in place of ``old``; ``old`` stays in place if the new one fails to run."""
    old_spec = old.__spec__
    spec = importlib.util.spec_from_file_location(
        module_name,
        path,
        loader=_SourceOnlyLoader(module_name, path),
        submodule_search_locations=old_spec.submodule_search_locations if old_spec else None,
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules[module_name] = old
        raise
    parent, _, leaf = module_name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], leaf, module)
    return module
