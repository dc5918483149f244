"""``resolve_executor`` and a user's executor module: imported again when its file changed,
never when it did not, and never Duomo's own executors."""

from __future__ import annotations

import importlib.util
import os
import py_compile
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import duomo.worker.executors
from duomo.worker.executors import resolve_executor
from duomo.worker.executors.raw import RawExecutor

# one executor whose answers show which version of its module built it (``OFFSET``, a global
# read when it runs, so that an old class still reading its own module's globals shows too)
SOURCE = """
from duomo.worker.executors.raw import RawExecutor
OFFSET = {offset}
class Shift(RawExecutor):
    def offset(self):
        return OFFSET
"""


@pytest.fixture
def module(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A user module's name (new for each test: ``sys.modules`` is the process's) and file."""
    name = f"user_tasks_{uuid.uuid4().hex[:12]}"
    path = tmp_path / f"{name}.py"
    path.write_text(SOURCE.format(offset="1.0"))
    yield name, path
    sys.modules.pop(name, None)


def offset_of(cls: type) -> float:
    return float(cls.offset(None))  # type: ignore[attr-defined]


def test_a_changed_module_is_imported_again_and_an_unchanged_one_is_not(
    module: tuple[str, Path],
) -> None:
    name, path = module
    first = resolve_executor(f"{name}:Shift", path.parent)
    assert offset_of(first) == 1.0
    assert resolve_executor(f"{name}:Shift", path.parent) is first  # unchanged: the same class
    # an edit of the same length and modification time (in the same second is enough) passes
    # Python's check of a cached .pyc (whole-second mtime and size): that .pyc, as an import
    # without PYTHONDONTWRITEBYTECODE writes it, must not be what is loaded
    py_compile.compile(str(path), cfile=importlib.util.cache_from_source(str(path)))
    mtime_ns = path.stat().st_mtime_ns
    path.write_text(SOURCE.format(offset="2.0"))
    os.utime(path, ns=(mtime_ns, mtime_ns))
    second = resolve_executor(f"{name}:Shift", path.parent)
    assert second is not first and offset_of(second) == 2.0
    assert sys.modules[name].Shift is second
    # the old class keeps its own module's globals: models still serving with it do not change
    assert offset_of(first) == 1.0
    path.touch()  # a newer time, the same content: no change
    assert resolve_executor(f"{name}:Shift", path.parent) is second


def test_a_broken_edit_fails_every_time_until_it_is_fixed(module: tuple[str, Path]) -> None:
    name, path = module
    first = resolve_executor(f"{name}:Shift", path.parent)
    path.write_text(SOURCE.format(offset="1.0 +"))  # a syntax error
    for _ in range(2):  # not the old module, quietly, the second time
        with pytest.raises(ValueError, match=f"cannot import executor module {name}: Syntax"):
            resolve_executor(f"{name}:Shift", path.parent)
    assert sys.modules[name].Shift is first  # the old module stays in place meanwhile
    path.write_text(SOURCE.format(offset="3.0"))
    assert offset_of(resolve_executor(f"{name}:Shift", path.parent)) == 3.0


def test_duomos_own_executors_are_never_imported_again(
    module: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    name, path = module
    first = resolve_executor(f"{name}:Shift", path.parent)
    stamps = iter(range(1_000_000))  # every file looks changed on every look
    monkeypatch.setattr(
        duomo.worker.executors, "_source_stamp", lambda m: (m.__file__, bytes([next(stamps) % 256]))
    )
    assert resolve_executor(f"{name}:Shift", path.parent) is not first  # (a user's module is)
    for task in ("raw", "duomo.worker.executors.raw:RawExecutor"):
        assert resolve_executor(task) is RawExecutor
        assert resolve_executor(task) is RawExecutor
