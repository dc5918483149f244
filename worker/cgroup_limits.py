"""What this process's cgroups allow it: CPUs (a quota) and memory (a limit).

A container's or Kubernetes pod's limits are set on its cgroup, not on the machine: the
affinity mask and ``SC_PHYS_PAGES`` do not show them. Each limit is the smallest set along
the process's cgroup path up to the root, read from cgroup v2's one hierarchy or from v1's
hierarchy of that controller. Called by ``worker.thread_budget`` (how many cores to keep busy)
and ``supervisor.process.limits`` (how much ring memory clients may commit by default).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")  # "ID:CONTROLLERS:PATH" per hierarchy ("0::/..." in v2)
T = TypeVar("T")


def cpu_quota(cgroup_root: Path = CGROUP_ROOT, membership: Path = MEMBERSHIP) -> float | None:
    """The CPUs this process's cgroup may use (``cpu.max``, cgroup v2; ``cpu.cfs_quota_us`` ÷
    ``cpu.cfs_period_us``, v1), the smallest along its path up to the root; None without one."""
    return _smallest(
        cgroup_root, membership, "cpu",
        v2=lambda folder: _read_quota(folder / "cpu.max", None),
        v1=lambda folder: _read_quota(folder / "cpu.cfs_quota_us", folder / "cpu.cfs_period_us"),
    )  # fmt: skip


def memory_limit(cgroup_root: Path = CGROUP_ROOT, membership: Path = MEMBERSHIP) -> int | None:
    """The bytes this process's cgroup may use (``memory.max``, v2; ``memory.limit_in_bytes``,
    v1), the smallest along its path up to the root; None without one."""
    return _smallest(
        cgroup_root, membership, "memory",
        v2=lambda folder: _read_bytes(folder / "memory.max"),
        v1=lambda folder: _read_bytes(folder / "memory.limit_in_bytes"),
    )  # fmt: skip


def _smallest(
    cgroup_root: Path,
    membership: Path,
    controller: str,
    v2: Callable[[Path], T | None],
    v1: Callable[[Path], T | None],
) -> T | None:
    """The smallest value ``v2`` (or, in ``controller``'s v1 hierarchy, ``v1``) reads from a
    folder along the process's cgroup path; None where none is set."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    found: list[T] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            base, read = cgroup_root, v2
        elif controller in controllers.split(","):  # v1: the controller's own hierarchy
            base, read = cgroup_root / controllers, v1
        else:
            continue
        for folder in _up_to_root(base, path):
            value = read(folder)
            if value is not None:
                found.append(value)
    return min(found) if found else None  # type: ignore[type-var]


def _up_to_root(base: Path, path: str) -> list[Path]:
    parts = [p for p in path.split("/") if p]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _read_quota(limit: Path, period: Path | None) -> float | None:
    """``max 100000`` / ``200000 100000`` (v2), or a quota and a period file (v1, -1: none)."""
    try:
        if period is None:
            quota_text, _, period_text = limit.read_text().strip().partition(" ")
        else:
            quota_text, period_text = limit.read_text().strip(), period.read_text().strip()
        if quota_text in ("max", "-1") or not period_text:
            return None
        return int(quota_text) / int(period_text)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _read_bytes(limit: Path) -> int | None:
    """``max`` or a byte count (v1 writes a huge page-aligned number for "no limit")."""
    try:
        text = limit.read_text().strip()
        value = None if text == "max" else int(text)
    except (OSError, ValueError):
        return None
    return value if value is not None and value < 1 << 62 else None
