"""The system shared-memory extension: regions a caller registers by their POSIX name, read for
inputs and written for outputs instead of carrying tensors in the request.

Called by both transports (register, status, unregister) and by ``gateway.inference`` (a
tensor's ``shared_memory_region``). Off unless the gateway runs with ``allow_shm`` (as Triton's
``--allow-client-shm``): a caller could otherwise make the gateway read or write any segment
its user can open.

**Shared by the workers.** Registrations live in a directory of the runtime folder that every
worker of one gateway shares (``SO_REUSEPORT`` may send the registration and the request to
different workers): one small JSON record per region (its name, key, offset, byte_size and the
segment's ``(st_dev, st_ino)``). A record is created whole and at once (written under a private
name, then ``link()``-ed to its own, which fails if it exists), so of concurrent registrations
of one name, in any workers, exactly one succeeds and the others are told it is registered
already.

**Descriptors, never mappings.** Each worker keeps one descriptor per region it has used
(``O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK``) and reads inputs with ``preadv`` straight
into the slot and writes outputs with ``pwrite``: a caller that shrinks its segment after
registering it (``ftruncate``) makes a read come short, where a mapping would have killed the
worker with SIGBUS. At every use the record is read again (gone or changed: the descriptor is
closed, and a changed one is opened afresh), the key must still name the object recorded
(same ``st_dev``/``st_ino``), and offsets and sizes are checked against the region's registered
``byte_size`` and against the segment's size *now* (``fstat``); a region that became too small
is INVALID_ARGUMENT, naming it. A periodic ``sweep`` closes the descriptors of regions another
worker unregistered, so no worker keeps an unregistered segment alive.

**What may be registered** is decided by what the descriptor is, not what it is called:

- a regular file (not a FIFO, device or directory: reads and writes must not block or reach
  anything but memory);
- on the filesystem of ``/dev/shm`` itself (``st_dev`` equal to the directory's): a POSIX
  shared-memory object by the protocol's definition, not a file reached some other way; a
  memfd (Duomo's own rings) lives on the kernel's internal tmpfs and can never match;
- with exactly one name (``st_nlink == 1``): a hard link is a second name for someone else's
  segment (one of Duomo's while it still had a name in ``/dev/shm``, or another caller's), and
  registering it would let a caller read or write memory it never created. A segment that
  loses its name while registered (``shm_unlink``) is no longer served either.

The key must also be a plain name (no ``/`` but one leading one, no ``..``), and a key beginning
``duomo-`` is refused outright: harmless, but it says clearly why.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from duomo.gateway.protocol import RegionRef
from duomo.ipc.errors import InvalidArgumentError, NotFoundError, UnavailableError

SHM_DIR = Path("/dev/shm")
_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")
OWN_PREFIX = "duomo-"
SWEEP_S = 1.0  # how often a worker closes the descriptors of regions unregistered elsewhere
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_MAX_IO = 1 << 30  # bytes per preadv/pwrite call (Linux moves at most ~2 GiB in one)


@dataclass(frozen=True)
class Registration:
    """One registered region as its record holds it: the caller's name, the POSIX key, the byte
    range, and the segment's ``(st_dev, st_ino)`` when it was registered."""

    name: str
    key: str
    offset: int
    byte_size: int
    device: int = 0  # the segment's st_dev and st_ino when it was registered
    inode: int = 0

    def to_dict(self) -> dict[str, Any]:
        """As the status calls show it (Triton's fields)."""
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}  # fmt: skip

    def record(self) -> dict[str, Any]:
        return {**self.to_dict(), "dev": self.device, "ino": self.inode}


@dataclass(frozen=True)
class Span:
    """Bytes of a region a tensor occupies, checked when made: ``nbytes`` at ``position`` of
    the open segment ``fd``. Used at once, on the event loop (no await in between)."""

    region: str
    fd: int
    position: int
    nbytes: int

    def read_into(self, target: memoryview) -> None:
        """Fill ``target`` (``nbytes`` long, writable) from the segment."""
        done = 0
        while done < self.nbytes:
            got = os.preadv(self.fd, [target[done : done + _MAX_IO]], self.position + done)
            if got <= 0:
                raise self._shrunk(done)
            done += got

    def read(self) -> bytes:
        out = bytearray(self.nbytes)
        self.read_into(memoryview(out))
        return bytes(out)

    def write(self, data: memoryview) -> None:
        """Write ``data`` (``nbytes`` long) into the segment. A segment shrunk meanwhile
        would grow again by a write past its end (its size was checked just before)."""
        done = 0
        while done < self.nbytes:
            done += os.pwrite(self.fd, data[done : done + _MAX_IO], self.position + done)

    def _shrunk(self, done: int) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"shared-memory region {self.region[:100]!r} became smaller while it was read "
            f"({done} of {self.nbytes} bytes at {self.position})"
        )


class Regions:
    """The system shared-memory regions of one gateway, shared by its workers through their
    records: register, status, unregister, and the span a tensor reads or writes."""

    def __init__(self, directory: Path, allowed: bool) -> None:
        self.directory = directory
        self.allowed = allowed
        # name -> (the record it was opened from, its descriptor)
        self._held: dict[str, tuple[Registration, int]] = {}

    def _refuse_unless_allowed(self) -> None:
        if not self.allowed:
            raise UnavailableError(
                "system shared memory is off for this gateway (gateway.allow_shm: false)"
            )

    def _record(self, name: str) -> Path:
        return self.directory / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.json"

    def register(self, name: Any, key: Any, offset: Any, byte_size: Any) -> None:
        """Register ``name`` (values as a caller sent them: each is checked). Atomic across
        workers: of concurrent registrations of one name exactly one succeeds."""
        self._refuse_unless_allowed()
        if not isinstance(name, str) or not name or len(name) > 256:
            raise InvalidArgumentError("a region's name must be a string of 1..256 characters")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, byte_size)):
            raise InvalidArgumentError("'offset' and 'byte_size' must be integers")
        plain = _plain_key(key)
        if offset < 0 or byte_size <= 0:
            raise InvalidArgumentError("a region needs 'offset' ≥ 0 and 'byte_size' > 0")
        if self._read_record(name) is not None:
            raise _registered_already(name)
        fd = _open_segment(plain)
        try:
            st = os.fstat(fd)
            if offset + byte_size > st.st_size:
                raise InvalidArgumentError(
                    f"shared-memory key {plain!r} holds {st.st_size} bytes, less than offset "
                    f"{offset} + byte_size {byte_size}"
                )
            registration = Registration(name, plain, offset, byte_size, st.st_dev, st.st_ino)
            self._create_record(registration)
        except BaseException:
            os.close(fd)
            raise
        self._keep(registration, fd)

    def _create_record(self, registration: Registration) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = self.directory / f".{os.getpid()}-{secrets.token_hex(8)}.tmp"
        partial.write_text(json.dumps(registration.record()))
        try:
            os.link(partial, self._record(registration.name))  # (fails if it exists)
        except FileExistsError:
            raise _registered_already(registration.name) from None
        finally:
            partial.unlink(missing_ok=True)

    def unregister(self, name: str | None) -> None:
        """One region, or every one (``name`` None)."""
        self._refuse_unless_allowed()
        if name is None:
            for record in self.directory.glob("*.json"):
                record.unlink(missing_ok=True)
        else:
            self._record(name).unlink(missing_ok=True)  # (Triton: unknown names are no error)
        for stale in [n for n in self._held if name is None or n == name]:
            self._forget(stale)

    def status(self, name: str | None) -> list[dict[str, Any]]:
        self._refuse_unless_allowed()
        if name is not None:
            registration = self._read_record(name)
            if registration is None:
                raise NotFoundError(f"no shared-memory region named {name[:100]!r}")
            return [registration.to_dict()]
        found = []
        for record in sorted(self.directory.glob("*.json")):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                found.append(_registration(json.loads(record.read_text())).to_dict())
        return found

    def span(self, ref: RegionRef, nbytes: int | None = None) -> Span:
        """Where ``ref``'s bytes are, checked now against the registration and the segment's
        current size (``nbytes``: what the tensor takes, which must fit the part of the region
        ``ref`` names; None: all of that part)."""
        self._refuse_unless_allowed()
        registration, fd = self._descriptor(ref.region)
        size = ref.byte_size if nbytes is None else nbytes
        if size > ref.byte_size:
            raise InvalidArgumentError(
                f"region {ref.region[:100]!r}: the tensor needs {size} bytes, "
                f"shared_memory_byte_size says {ref.byte_size}"
            )
        if ref.offset + ref.byte_size > registration.byte_size:
            raise InvalidArgumentError(
                f"region {ref.region[:100]!r}: offset {ref.offset} + {ref.byte_size} bytes is "
                f"past its registered byte_size {registration.byte_size}"
            )
        position = registration.offset + ref.offset
        now = os.fstat(fd).st_size
        if position + size > now:
            raise InvalidArgumentError(
                f"region {ref.region[:100]!r}: its segment {registration.key!r} holds {now} bytes "
                f"now, too small for {size} bytes at {position} (it shrank since it was "
                "registered)"
            )
        return Span(ref.region, fd, position, size)

    def _descriptor(self, name: str) -> tuple[Registration, int]:
        """The open segment of region ``name``, as its record says now."""
        registration = self._read_record(name)
        if registration is None:
            self._forget(name)
            raise InvalidArgumentError(
                f"no shared-memory region named {name[:100]!r} is registered"
            )
        kept = self._held.get(name)
        if kept is not None and kept[0] == registration:
            fd = kept[1]
        else:
            self._forget(name)
            fd = _open_segment(registration.key)
            self._keep(registration, fd)
        if not _still_named(registration, fd):
            self._forget(name)
            raise InvalidArgumentError(
                f"shared-memory region {name[:100]!r}: its key {registration.key!r} no longer "
                "names the segment registered (removed, replaced or linked elsewhere since)"
            )
        return registration, fd

    def sweep(self) -> None:
        """Close the descriptors of regions unregistered or changed (by any worker), and of
        segments that lost their name."""
        for name, (registration, fd) in list(self._held.items()):
            if self._read_record(name) != registration or not _still_named(registration, fd):
                self._forget(name)

    async def sweeping(self, interval_s: float = SWEEP_S) -> None:
        """``sweep`` every ``interval_s`` until cancelled (a worker's event loop runs it)."""
        while True:
            await asyncio.sleep(interval_s)
            if self._held:
                self.sweep()

    def _keep(self, registration: Registration, fd: int) -> None:
        self._forget(registration.name)
        self._held[registration.name] = (registration, fd)

    def _forget(self, name: str) -> None:
        kept = self._held.pop(name, None)
        if kept is not None:
            with contextlib.suppress(OSError):
                os.close(kept[1])

    def _read_record(self, name: str) -> Registration | None:
        try:
            registration = _registration(json.loads(self._record(name).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return registration if registration.name == name else None

    def close(self) -> None:
        for name in list(self._held):
            self._forget(name)


def _registration(raw: dict[str, Any]) -> Registration:
    return Registration(str(raw["name"]), str(raw["key"]), int(raw["offset"]),
                        int(raw["byte_size"]), int(raw["dev"]), int(raw["ino"]))  # fmt: skip


def _registered_already(name: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"a region named {name[:100]!r} is already registered")


def _plain_key(key: Any) -> str:
    """A POSIX shared-memory name as a plain file name in /dev/shm (one leading '/' allowed)."""
    if not isinstance(key, str):
        raise InvalidArgumentError("a region's 'key' must be a string")
    plain = key[1:] if key.startswith("/") else key
    if not _KEY.match(plain):
        raise InvalidArgumentError(
            f"shared-memory key {key[:100]!r} is not a plain POSIX name (letters, digits, '_', "
            "'.', '-')"
        )
    if plain.startswith(OWN_PREFIX):
        raise InvalidArgumentError(f"shared-memory key {key[:100]!r} names one of Duomo's own")
    return plain


def _open_segment(key: str) -> int:
    """A descriptor of ``/dev/shm/<key>``, checked to be a POSIX shared-memory segment of one
    name (the module docstring says why each check)."""
    try:
        fd = os.open(SHM_DIR / key, _OPEN_FLAGS)
    except OSError as err:
        raise InvalidArgumentError(
            f"cannot open shared-memory key {key!r}: {err.strerror}"
        ) from None
    try:
        problem = _segment_problem(os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        raise InvalidArgumentError(f"shared-memory key {key!r} {problem}")
    return fd


def _segment_problem(st: os.stat_result) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "is not a shared-memory segment (not a regular file)"
    if st.st_dev != os.stat(SHM_DIR).st_dev:
        return f"is not a segment of {SHM_DIR}"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} names (a hard link to another segment is refused)"
    return None


def _still_named(registration: Registration, fd: int) -> bool:
    """Whether the key still names the segment registered, with one name, and ``fd`` is it."""
    try:
        named = os.stat(SHM_DIR / registration.key, follow_symlinks=False)
        held = os.fstat(fd)
    except OSError:
        return False
    same = (registration.device, registration.inode)
    return (
        (named.st_dev, named.st_ino) == same
        and (held.st_dev, held.st_ino) == same
        and named.st_nlink == 1
    )
