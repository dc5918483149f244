"""The limits' defaults from the machine, the shared-memory ledger, and the control-job queue."""

from __future__ import annotations

import resource
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from duomo.ipc.errors import ErrorCode, ResourceExhaustedError, UnavailableError
from duomo.supervisor.process.control_jobs import ControlJob, ControlJobs
from duomo.supervisor.process.limits import (
    MIB,
    LimitsConfig,
    RingLedger,
    memory_capacity_bytes,
    resolve_limits,
)
from duomo.worker.cgroup_limits import memory_limit
from duomo.worker.executors.classification import ClassificationParams


def test_defaults_come_from_the_machine() -> None:
    limits = resolve_limits(LimitsConfig())
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert limits.max_connections == min(1024, soft // 2)
    assert limits.listen_backlog == int(Path("/proc/sys/net/core/somaxconn").read_text())
    memory = memory_capacity_bytes()
    assert limits.shm_per_client_bytes == memory // 8
    assert limits.shm_total_bytes == memory // 4
    configured = resolve_limits(LimitsConfig(max_connections=5, shm_total_mb=3))
    assert configured.max_connections == 5 and configured.shm_total_bytes == 3 * MIB


def test_the_memory_default_follows_a_cgroup_memory_limit(tmp_path: Path) -> None:
    """A container's or pod's memory limit (v2 ``memory.max``, v1 ``limit_in_bytes``) is
    where the rings' memfd pages are charged: the smallest along the path counts."""
    proc = tmp_path / "cgroup"
    root = tmp_path / "fs"
    (root / "kubepods" / "pod1").mkdir(parents=True)
    proc.write_text("0::/kubepods/pod1\n")
    (root / "memory.max").write_text("max\n")
    (root / "kubepods" / "memory.max").write_text(f"{8 << 30}\n")
    (root / "kubepods" / "pod1" / "memory.max").write_text(f"{2 << 30}\n")
    assert memory_limit(root, proc) == 2 << 30
    (root / "kubepods" / "pod1" / "memory.max").write_text("max\n")
    assert memory_limit(root, proc) == 8 << 30
    v1 = tmp_path / "v1"
    (v1 / "memory" / "docker" / "abc").mkdir(parents=True)
    proc.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    (v1 / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text(f"{1 << 30}\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    assert memory_limit(v1, proc) == 1 << 30
    proc.write_text("0::/\n")
    assert memory_limit(tmp_path / "empty", proc) is None


def test_a_limit_key_with_a_typo_is_an_error() -> None:
    with pytest.raises(ValidationError, match="max_conections"):
        LimitsConfig.model_validate({"max_conections": 5})


def test_the_ledger_refuses_past_each_bound_and_holds_nothing_for_a_refusal() -> None:
    ledger = RingLedger(
        resolve_limits(LimitsConfig(max_slots_per_client=10, shm_per_client_mb=4, shm_total_mb=6))
    )
    ledger.charge(1, 8, 3 * MIB)
    with pytest.raises(ResourceExhaustedError, match=r"at most 10 slots.*holds 8 and asked for 3"):
        ledger.charge(1, 3, 1)
    with pytest.raises(ResourceExhaustedError, match=r"at most 4\.0 MiB.*needs 2\.0 MiB"):
        ledger.charge(1, 1, 2 * MIB)
    ledger.charge(2, 1, 3 * MIB)
    with pytest.raises(ResourceExhaustedError, match=r"6\.0 MiB of ring memory in all"):
        ledger.charge(3, 1, MIB)
    assert ledger.held(1) == (8, 3 * MIB) and ledger.held(3) == (0, 0)
    ledger.release(2, 1, 3 * MIB)
    ledger.charge(3, 1, MIB)
    assert ledger.total_bytes == 4 * MIB


class Recorder:
    """Stands in for a connection: the replies it was sent, in order."""

    def __init__(self, id_: int = 1) -> None:
        self.id = id_
        self.replies: list[dict[str, Any]] = []
        self.done = threading.Event()

    def reply(self, message: dict[str, Any], reply: dict[str, Any]) -> None:
        self.replies.append({"id": message["id"], **reply})
        self.done.set()


def test_control_jobs_run_in_order_on_one_thread_and_every_one_is_answered() -> None:
    jobs = ControlJobs(capacity=3, per_client=3)
    conn = Recorder()
    gate = threading.Event()
    ran: list[str] = []

    started = threading.Event()

    def job(n: int) -> dict[str, Any]:
        started.set()
        gate.wait(10)
        ran.append(threading.current_thread().name)
        if n == 1:
            raise RuntimeError("a bug")
        return {"n": n}

    for n in range(3):
        jobs.submit(ControlJob(conn, {"id": n}, lambda n=n: job(n)))  # type: ignore[arg-type, misc]
    jobs.start()
    assert started.wait(10)  # the first runs: two wait, so one more fits, then none
    jobs.submit(ControlJob(conn, {"id": 99}, lambda: job(99)))  # type: ignore[arg-type]
    with pytest.raises(ResourceExhaustedError, match=r"limits\.control_queue: 3"):
        jobs.submit(ControlJob(conn, {"id": 100}, lambda: job(100)))  # type: ignore[arg-type]
    gate.set()
    deadline = time.monotonic() + 10
    while len(conn.replies) < 4 and time.monotonic() < deadline:
        conn.done.wait(0.05)
        conn.done.clear()
    jobs.stop(10)
    ids = [r["id"] for r in conn.replies]
    assert ids == [0, 1, 2, 99] and conn.replies[3]["ok"]
    # a bug is INTERNAL, named by the job, without the exception's text (that goes to the log)
    assert (
        conn.replies[1]["code"] == ErrorCode.INTERNAL and "a bug" not in conn.replies[1]["message"]
    )
    assert conn.replies[1]["message"].startswith("internal error in a control job")
    assert set(ran) == {"duomo-control"}
    with pytest.raises(UnavailableError):
        jobs.submit(ControlJob(conn, {"id": 5}, lambda: {}))  # type: ignore[arg-type]


def test_jobs_still_queued_at_stop_are_answered_unavailable() -> None:
    jobs = ControlJobs(capacity=5, per_client=5)
    conn = Recorder()
    for n in range(3):
        jobs.submit(ControlJob(conn, {"id": n}, lambda: {}))  # type: ignore[arg-type]
    jobs.stop(1)  # never started
    assert [(r["id"], r["code"]) for r in conn.replies] == [
        (n, ErrorCode.UNAVAILABLE) for n in range(3)
    ]


def test_one_client_cannot_fill_the_control_queue_for_the_others() -> None:
    jobs = ControlJobs(capacity=6, per_client=2)
    greedy, other = Recorder(1), Recorder(2)
    for n in range(2):
        jobs.submit(ControlJob(greedy, {"id": n}, lambda: {}))  # type: ignore[arg-type]
    with pytest.raises(ResourceExhaustedError, match=r"control_queue_per_client: 2"):
        jobs.submit(ControlJob(greedy, {"id": 2}, lambda: {}))  # type: ignore[arg-type]
    jobs.submit(ControlJob(other, {"id": 10}, lambda: {"n": 10}))  # type: ignore[arg-type]
    jobs.start()
    deadline = time.monotonic() + 10
    while len(other.replies) < 1 and time.monotonic() < deadline:
        other.done.wait(0.05)
    assert other.replies == [{"id": 10, "ok": True, "n": 10}]
    while len(greedy.replies) < 2 and time.monotonic() < deadline:
        greedy.done.wait(0.05)
    jobs.submit(ControlJob(greedy, {"id": 3}, lambda: {}))  # type: ignore[arg-type]  # room again
    jobs.stop(10)
    assert [r["id"] for r in greedy.replies] == [0, 1, 3]


def test_classification_bounds_the_resized_image() -> None:
    assert ClassificationParams().max_resized_side == 2048
    with pytest.raises(ValidationError, match="below input_size 224"):
        ClassificationParams(max_resized_side=100)
