"""What the sessions of a process use as one: a registry of shared things counted by user, and
what makes two loads of a model file "the same file".

``ShareRegistry`` holds one thing per key. ``acquire(key, make)`` returns a ``Lease`` on the thing
under ``key``, made by ``make`` when none is there; ``release(lease)`` gives that use back, and
the release of the last use takes the thing out of the registry and returns it, for the caller to
free (a device buffer) or drop (an ONNX Runtime session). Its users:

- ``ort_backend``: one ``InferenceSession`` for every session that opens a file with the same
  settings (keyed by its recipe);
- ``acl_memory``: one device buffer of weights per device and file, and one work buffer per
  device whose models run one at a time.

Invariants:

- a thing is made once per key: ``acquire`` looks under the lock, registers an entry that is
  still being made, and makes it outside the lock; an acquirer of that key meanwhile finds the
  entry and waits for it instead of making another;
- users are counted from ``acquire`` to ``release``; an entry in the registry has at least one;
- a failed ``make`` is not kept: its entry leaves the registry at once, its error is raised to
  the maker and to every acquirer that waited for it, and the next ``acquire`` makes it again;
- ``acquire(..., fresh=True)`` makes a new thing under a key that has one (one that it has
  outgrown: a larger work buffer); the old one stays with its users and leaves with the last,
  and is found under the key again if the new one's ``make`` fails.

``FileIdentity`` (``file_identity``) is the one definition of "the same file" both backends key
their shares by.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar, cast

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class _Entry(Generic[T]):
    """One shared thing and the count of its users; ``ready`` is set once it is made (or its
    making failed: ``error``)."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.thing: T | None = None
        self.error: BaseException | None = None
        self.users = 0


@dataclass(frozen=True, eq=False)
class Lease(Generic[T]):
    """One use of a thing: ``thing`` is the caller's until it hands the lease to ``release``.
    ``key`` None: a thing nobody shares (``ShareRegistry.alone``)."""

    key: Hashable
    thing: T
    _entry: _Entry[T] = field(repr=False)


class ShareRegistry(Generic[K, T]):
    """Things made once per key and shared by every acquirer of the key, counted by user, each
    given back by the release of its last use (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[K, _Entry[T]] = {}

    def acquire(self, key: K, make: Callable[[], T], *, fresh: bool = False) -> Lease[T]:
        """A use of the thing under ``key``, made by ``make`` (on the calling thread, outside the
        lock) when there is none; an acquirer that finds it being made waits for it.
        ``fresh``: make a new one even if there is one (it stays with its users).

        Raises whatever ``make`` raised, to its caller and to the acquirers that waited; the
        failed entry is not kept."""
        with self._lock:
            previous = self._entries.get(key)  # (``fresh``: the one it replaces)
            entry = None if fresh else previous
            making = entry is None
            if entry is None:
                entry = self._entries[key] = _Entry()
            entry.users += 1
        if making:
            try:
                entry.thing = make()
            except BaseException as err:
                entry.error = err
                raise
            finally:
                if entry.error is not None:  # acquirers from now on try again
                    with self._lock:
                        if self._entries.get(key) is entry:
                            if fresh and previous is not None and previous.users > 0:
                                self._entries[key] = previous  # still shared, still found
                            else:
                                del self._entries[key]
                    self._drop_use(key, entry)
                entry.ready.set()
        else:
            entry.ready.wait()
            if entry.error is not None:
                self._drop_use(key, entry)
                raise entry.error
        return Lease(key, cast(T, entry.thing), entry)

    def alone(self, thing: T) -> Lease[T]:
        """A lease on ``thing`` that nobody shares: not in the registry, its ``release`` (its
        only use) returns it, so a caller holds shared and unshared things alike."""
        entry: _Entry[T] = _Entry()
        entry.thing, entry.users = thing, 1
        entry.ready.set()
        return Lease(None, thing, entry)

    def release(self, lease: Lease[T]) -> T | None:
        """One use of ``lease``'s thing given back. The last use's release takes the thing out
        of the registry and returns it (the caller frees it, if it must); None for the others."""
        return self._drop_use(lease.key, lease._entry)

    def _drop_use(self, key: Hashable, entry: _Entry[T]) -> T | None:
        with self._lock:
            entry.users -= 1
            if entry.users > 0:
                return None
            if self._entries.get(cast(K, key)) is entry:
                del self._entries[cast(K, key)]
            thing, entry.thing = entry.thing, None
            return thing

    def get(self, key: K) -> T | None:
        """The thing shared under ``key`` now, without taking a use of it; None when there is
        none (or it is still being made)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.ready.is_set():
                return None
            return entry.thing

    def users(self) -> dict[K, int]:
        """Each key in the registry and how many uses its thing has (a thing being made
        counts its maker and those waiting for it)."""
        with self._lock:
            return {key: entry.users for key, entry in self._entries.items()}

    def things(self) -> list[T]:
        """The things in the registry, made and still in use."""
        with self._lock:
            return [e.thing for e in self._entries.values() if e.thing is not None]


@dataclass(frozen=True)
class FileIdentity:
    """What makes two loads of a model "the same file": where it is (its resolved path) and which
    version of it (its device, inode, size and mtime: a file replaced on disk, or rewritten in
    place, is another file). Fields in this order: ``ort_backend`` hashes them as a tuple."""

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int

    @property
    def key(self) -> str:
        """The identity as one string (a share's key)."""
        return f"{self.path}:{self.device}:{self.inode}:{self.size}:{self.mtime_ns}"


def file_identity(path: Path) -> FileIdentity:
    """The identity of the file ``path`` names now (symlinks followed)."""
    resolved = path.resolve()
    stat = resolved.stat()
    return FileIdentity(str(resolved), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
