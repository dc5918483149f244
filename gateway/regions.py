"""The system shared-memory extension: regions a caller registers by their POSIX name, read for
inputs and written for outputs instead of carrying tensors in the request.

Called by both transports (register, status, unregister) and by ``gateway.inference`` (a
tensor's ``shared_memory_region``). Off unless the gateway runs with ``allow_shm`` (as Triton's
``--allow-client-shm``): a caller could otherwise make the gateway read or write any segment
its user can open.

Registrations live in a directory of the runtime folder that every worker of one gateway
shares (``SO_REUSEPORT`` may send the registration and the request to different workers):
one small JSON record per region; each worker maps a region when first used and maps it
again when its record changes. A key may not name one of Duomo's own segments (``duomo-``),
nor anything but a plain name in ``/dev/shm``; every access is checked against the region's
``byte_size`` and the segment's real size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.protocol import RegionRef
from ipc.errors import InvalidArgumentError, NotFoundError, UnavailableError

SHM_DIR = Path("/dev/shm")
_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")
OWN_PREFIX = "duomo-"


@dataclass(frozen=True)
class Registration:
    name: str
    key: str
    offset: int
    byte_size: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}  # fmt: skip


class Regions:
    def __init__(self, directory: Path, allowed: bool) -> None:
        self.directory = directory
        self.allowed = allowed
        # name -> (the record it was mapped from, its mapping)
        self._mapped: dict[str, tuple[Registration, mmap.mmap]] = {}

    def _refuse_unless_allowed(self) -> None:
        if not self.allowed:
            raise UnavailableError(
                "system shared memory is off for this gateway (gateway.allow_shm: false)"
            )

    def _record(self, name: str) -> Path:
        return self.directory / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.json"

    def register(self, name: Any, key: Any, offset: Any, byte_size: Any) -> None:
        """Register ``name`` (values as a caller sent them: each is checked)."""
        self._refuse_unless_allowed()
        if not isinstance(name, str) or not name or len(name) > 256:
            raise InvalidArgumentError("a region's name must be a string of 1..256 characters")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, byte_size)):
            raise InvalidArgumentError("'offset' and 'byte_size' must be integers")
        registration = Registration(name, _plain_key(key), offset, byte_size)
        if offset < 0 or byte_size <= 0:
            raise InvalidArgumentError("a region needs 'offset' ≥ 0 and 'byte_size' > 0")
        if self._read_record(name) is not None:
            raise InvalidArgumentError(f"a region named {name[:100]!r} is registered already")
        mapping = _map(registration)  # the segment exists and is large enough
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        record = self._record(name)
        partial = record.with_suffix(".tmp")
        partial.write_text(json.dumps(registration.to_dict()))
        partial.replace(record)
        self._keep(registration, mapping)

    def unregister(self, name: str | None) -> None:
        """One region, or every one (``name`` None)."""
        self._refuse_unless_allowed()
        if name is None:
            for record in self.directory.glob("*.json"):
                record.unlink(missing_ok=True)
        else:
            self._record(name).unlink(missing_ok=True)  # (Triton: unknown names are no error)
        for stale in [n for n in self._mapped if name is None or n == name]:
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
            with contextlib.suppress(OSError, ValueError, KeyError):
                found.append(_registration(json.loads(record.read_text())).to_dict())
        return found

    def view(self, ref: RegionRef, nbytes: int | None = None) -> memoryview:
        """The bytes of ``ref`` in its region (``nbytes``: what the tensor needs, which must fit
        the part of the region ``ref`` names)."""
        self._refuse_unless_allowed()
        registration, mapping = self._mapping(ref.region)
        size = ref.byte_size if nbytes is None else nbytes
        if size > ref.byte_size:
            raise InvalidArgumentError(
                f"region {ref.region!r}: the tensor needs {size} bytes, "
                f"shared_memory_byte_size says {ref.byte_size}"
            )
        if ref.offset + ref.byte_size > registration.byte_size:
            raise InvalidArgumentError(
                f"region {ref.region!r}: offset {ref.offset} + {ref.byte_size} bytes is past its "
                f"registered byte_size {registration.byte_size}"
            )
        start = registration.offset + ref.offset
        return memoryview(mapping)[start : start + size]

    def _mapping(self, name: str) -> tuple[Registration, mmap.mmap]:
        registration = self._read_record(name)
        if registration is None:
            self._forget(name)
            raise InvalidArgumentError(
                f"no shared-memory region named {name[:100]!r} is registered"
            )
        kept = self._mapped.get(name)
        if kept is not None and kept[0] == registration:
            return kept
        self._forget(name)
        return self._keep(registration, _map(registration))

    def _keep(
        self, registration: Registration, mapping: mmap.mmap
    ) -> tuple[Registration, mmap.mmap]:
        self._forget(registration.name)
        self._mapped[registration.name] = (registration, mapping)
        return registration, mapping

    def _forget(self, name: str) -> None:
        kept = self._mapped.pop(name, None)
        if kept is not None:
            with contextlib.suppress(BufferError):  # a view is still alive: unmapped with it
                kept[1].close()

    def _read_record(self, name: str) -> Registration | None:
        try:
            return _registration(json.loads(self._record(name).read_text()))
        except (OSError, ValueError, KeyError):
            return None

    def close(self) -> None:
        for name in list(self._mapped):
            self._forget(name)


def _registration(raw: dict[str, Any]) -> Registration:
    return Registration(str(raw["name"]), str(raw["key"]), int(raw["offset"]),
                        int(raw["byte_size"]))  # fmt: skip


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


def _map(registration: Registration) -> mmap.mmap:
    try:
        fd = os.open(SHM_DIR / registration.key, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise InvalidArgumentError(
            f"cannot open shared-memory key {registration.key!r}: {err.strerror}"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if registration.offset + registration.byte_size > size:
            raise InvalidArgumentError(
                f"shared-memory key {registration.key!r} holds {size} bytes, less than offset "
                f"{registration.offset} + byte_size {registration.byte_size}"
            )
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
