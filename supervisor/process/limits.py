"""What one client, and all of them together, may take from the supervisor: the ``limits``
config section, its defaults read off the machine, and the ledger of ring memory in use.

Read by ``Supervisor`` at start and at every reload (``resolve_limits``), and enforced by the
reactor (connections, the listen backlog, authentication and idle timeouts, each connection's
unread backlog), by the control handlers (``supervisor.process.control_handlers``) on ``attach``
(slots and ring memory, through ``RingLedger``) and for slow control messages (``ControlJobs``'
queue). Every refusal names the limit and the numbers that passed it; docs/operations.md
("Security and limits") states each limit with its default.

Ring memory (the rings' sealed memfd segments: shared memory charged to the supervisor's
memory cgroup, not to a /dev/shm mount) is charged by what the supervisor commits when it
creates a ring (its slot headers and result areas, ``RingLayout.reserved_bytes``): that is
what a client can make the supervisor hold. Input pages are committed by the producer's own
writes; an input area a producer asked to grow past the model's default (for a larger frame)
is charged in full, in every slot (``supervisor.process.attachment.ring_charge``), so these bounds
are what bound growth.
"""

from __future__ import annotations

import os
import resource
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from duomo.ipc.errors import ResourceExhaustedError
from duomo.worker.cgroup_limits import memory_limit
from duomo.worker.config_model import StrictModel

MIB = 1 << 20
SOMAXCONN_FILE = Path("/proc/sys/net/core/somaxconn")
DEFAULT_MAX_CONNECTIONS = 1024  # and at most half the process's file descriptors


class LimitsConfig(StrictModel):
    """The ``limits`` section; ``None`` means "from the machine" (see ``resolve_limits``)."""

    max_connections: int | None = Field(default=None, ge=1, le=1_000_000)
    max_unauthenticated: int = Field(default=64, ge=1, le=1_000_000)
    listen_backlog: int | None = Field(default=None, ge=1, le=1_000_000)
    auth_timeout_s: float = Field(default=5.0, gt=0, le=3600)
    idle_timeout_s: float = Field(default=600.0, ge=0, le=30 * 86400)
    max_unread_bytes: int = Field(default=8 * MIB, ge=64 * 1024, le=1 << 34)
    max_unread_frames: int = Field(default=16384, ge=64, le=1 << 24)
    stall_timeout_s: float = Field(default=30.0, gt=0, le=86400)
    max_slots_per_client: int = Field(default=1024, ge=1, le=1 << 20)
    shm_per_client_mb: int | None = Field(default=None, ge=1)
    shm_total_mb: int | None = Field(default=None, ge=1)
    control_queue: int = Field(default=64, ge=1, le=100_000)
    control_queue_per_client: int = Field(default=8, ge=1, le=100_000)
    max_streams: int = Field(default=64, ge=1, le=100_000)  # live and ended, by name


@dataclass(frozen=True)
class Limits:
    """``LimitsConfig`` with every default resolved to a number for this machine."""

    max_connections: int
    max_unauthenticated: int  # at most max_connections
    listen_backlog: int
    auth_timeout_s: float
    idle_timeout_s: float  # 0: never
    max_unread_bytes: int
    max_unread_frames: int
    stall_timeout_s: float
    max_slots_per_client: int
    shm_per_client_bytes: int
    shm_total_bytes: int
    control_queue: int
    control_queue_per_client: int
    max_streams: int

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def resolve_limits(config: LimitsConfig) -> Limits:
    """The limits in force: the configured ones, the rest from the machine.

    ``max_connections``: half the process's file-descriptor limit (``RLIMIT_NOFILE``, soft),
    at most 1024 (``max_unauthenticated``, 64 unless set, is never above it);
    ``listen_backlog``: the system's ``somaxconn``; ring memory: an eighth of the
    memory the supervisor may use per client and a quarter of it in all (the share of a
    /dev/shm mount of its default size, half the memory, that the named segments had).
    """
    shm_size = memory_capacity_bytes() // 2
    max_connections = config.max_connections or default_max_connections()
    return Limits(
        max_connections=max_connections,
        max_unauthenticated=min(config.max_unauthenticated, max_connections),
        listen_backlog=config.listen_backlog or system_somaxconn(),
        auth_timeout_s=config.auth_timeout_s,
        idle_timeout_s=config.idle_timeout_s,
        max_unread_bytes=config.max_unread_bytes,
        max_unread_frames=config.max_unread_frames,
        stall_timeout_s=config.stall_timeout_s,
        max_slots_per_client=config.max_slots_per_client,
        shm_per_client_bytes=(config.shm_per_client_mb or 0) * MIB or shm_size // 4,
        shm_total_bytes=(config.shm_total_mb or 0) * MIB or shm_size // 2,
        control_queue=config.control_queue,
        control_queue_per_client=config.control_queue_per_client,
        max_streams=config.max_streams,
    )


def default_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_CONNECTIONS
    return max(1, min(DEFAULT_MAX_CONNECTIONS, soft // 2))


def system_somaxconn() -> int:
    try:
        return max(1, int(SOMAXCONN_FILE.read_text().strip()))
    except (OSError, ValueError):
        return socket.SOMAXCONN


def memory_capacity_bytes() -> int:
    """The memory this process may use: the machine's, or its memory cgroup's limit (a
    container's or pod's) where that is lower. The rings' memfd pages are charged there."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = memory_limit()
    return physical if limit is None else min(physical, limit)


class RingLedger:
    """Slots and committed ring memory per client and in all (any thread).

    ``charge`` checks every bound before it records anything, so a refused attach holds
    nothing; ``release`` gives back what a detached ring was charged."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits  # replaced whole on reload; a lowered bound refuses new rings only
        self._lock = threading.Lock()
        self._slots: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self.total_bytes = 0

    def charge(self, client: int, slots: int, nbytes: int) -> None:
        """Record a new ring of ``slots`` slots committing ``nbytes`` for ``client``, or raise
        ResourceExhaustedError naming the bound it would pass."""
        limits = self.limits
        with self._lock:
            held_slots = self._slots.get(client, 0)
            held_bytes = self._bytes.get(client, 0)
            if held_slots + slots > limits.max_slots_per_client:
                raise ResourceExhaustedError(
                    f"a client may hold at most {limits.max_slots_per_client} slots "
                    f"(limits.max_slots_per_client); it holds {held_slots} and asked for "
                    f"{slots} more: detach a ring first"
                )
            if held_bytes + nbytes > limits.shm_per_client_bytes:
                raise ResourceExhaustedError(
                    f"a client may commit at most {_mib(limits.shm_per_client_bytes)} of "
                    f"ring memory (limits.shm_per_client_mb); it holds {_mib(held_bytes)} and this "
                    f"ring needs {_mib(nbytes)}"
                )
            if self.total_bytes + nbytes > limits.shm_total_bytes:
                raise ResourceExhaustedError(
                    f"clients may commit at most {_mib(limits.shm_total_bytes)} of ring memory "
                    f"in all (limits.shm_total_mb); {_mib(self.total_bytes)} are held and this "
                    f"ring needs {_mib(nbytes)}"
                )
            self._slots[client] = held_slots + slots
            self._bytes[client] = held_bytes + nbytes
            self.total_bytes += nbytes

    def release(self, client: int, slots: int, nbytes: int) -> None:
        with self._lock:
            left_slots = self._slots.get(client, 0) - slots
            left_bytes = self._bytes.get(client, 0) - nbytes
            if left_slots > 0:
                self._slots[client], self._bytes[client] = left_slots, left_bytes
            else:
                self._slots.pop(client, None)
                self._bytes.pop(client, None)
            self.total_bytes -= nbytes

    def held(self, client: int) -> tuple[int, int]:
        """(slots, bytes) ``client`` holds."""
        with self._lock:
            return self._slots.get(client, 0), self._bytes.get(client, 0)


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f} MiB"
