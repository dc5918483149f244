"""The batching rule: composition, max_delay from the first request, priorities, deadlines."""

from __future__ import annotations

import os
import select
import threading
import time

import pytest

from duomo.ipc.errors import ResourceExhaustedError, UnavailableError
from duomo.ipc.stream_settings import MAX_WEIGHT
from duomo.worker.batcher import Batcher
from duomo.worker.flows import Level
from duomo.worker.request import Outcome, Request
from tests.conftest import poll


def request(
    name: str, priority: int = 0, deadline_s: float | None = None, at: float | None = None
) -> Request:
    """A request; ``at`` backdates (or postdates) its enqueue time for a fake clock."""
    r = Request(payload=name, on_done=lambda _o: None, priority=priority, deadline_s=deadline_s)
    if at is not None:
        r.enqueued_s = at
    return r


def names(batch: list[Request]) -> list[str]:
    return [r.payload for r in batch]


def test_full_batch_is_taken_without_waiting_for_the_delay() -> None:
    b = Batcher("m", max_batch=3, max_delay_s=30.0, queue_size=10)
    for n in "abcd":
        b.put(request(n))
    start = time.monotonic()
    taken = b.next_batch()
    assert taken is not None and names(taken.run) == ["a", "b", "c"]
    assert time.monotonic() - start < 5.0
    b.close()  # closing ends the fill window of the rest
    taken = b.next_batch()
    assert taken is not None and names(taken.run) == ["d"]


def test_max_delay_counts_from_the_first_request_not_from_the_call() -> None:
    delay = 2.0
    b = Batcher("m", max_batch=8, max_delay_s=delay, queue_size=10)
    first = request("a")
    first.enqueued_s -= 1.5  # the batch is most of the way through its window before anyone asks
    b.put(first)
    b.put(request("b"))
    called = time.monotonic()
    taken = b.next_batch()
    returned = time.monotonic()
    assert taken is not None and names(taken.run) == ["a", "b"]
    assert returned - first.enqueued_s >= delay  # it waited out the window...
    assert returned - called < 1.5  # ...counted from the first request, not from the call


def test_backlog_is_taken_at_once() -> None:
    b = Batcher("m", max_batch=8, max_delay_s=30.0, queue_size=10)
    old = request("old")
    old.enqueued_s -= 60.0
    b.put(old)
    start = time.monotonic()
    taken = b.next_batch()
    assert taken is not None and names(taken.run) == ["old"]
    assert time.monotonic() - start < 5.0


def test_late_arrivals_within_the_window_join_the_batch() -> None:
    b = Batcher("m", max_batch=3, max_delay_s=30.0, queue_size=10)
    b.put(request("a"))
    result: list[list[str]] = []
    t = threading.Thread(target=lambda: result.append(names(b.next_batch().run)))  # type: ignore[union-attr]
    t.start()
    poll(lambda: b._filling)  # the worker is inside its fill window
    b.put(request("b"))
    b.put(request("c"))  # fills the batch: the waiting worker returns now, not after 30 s
    t.join(timeout=10)
    assert result == [["a", "b", "c"]]


def test_priority_order_then_fifo() -> None:
    b = Batcher("m", max_batch=2, max_delay_s=0.0, queue_size=10)
    for name, prio in [("low1", 0), ("high", 5), ("low2", 0), ("mid", 2)]:
        b.put(request(name, priority=prio))
    first, second = b.next_batch(), b.next_batch()
    assert first is not None and names(first.run) == ["high", "mid"]
    assert second is not None and names(second.run) == ["low1", "low2"]


def test_expired_requests_are_handed_back_not_run() -> None:
    b = Batcher("m", max_batch=4, max_delay_s=0.0, queue_size=10)
    b.put(request("late", deadline_s=time.monotonic() - 1))
    b.put(request("ok", deadline_s=time.monotonic() + 60))
    taken = b.next_batch()
    assert taken is not None
    assert names(taken.run) == ["ok"] and names(taken.expired) == ["late"]


def test_full_queue_is_resource_exhausted_at_once() -> None:
    b = Batcher("m", max_batch=1, max_delay_s=0.0, queue_size=2)
    b.put(request("a"))
    b.put(request("b"))
    with pytest.raises(ResourceExhaustedError, match="queue is full"):
        b.put(request("c"))


def test_close_drains_then_ends() -> None:
    b = Batcher("m", max_batch=4, max_delay_s=30.0, queue_size=10)
    b.put(request("a"))
    b.close()
    with pytest.raises(UnavailableError):
        b.put(request("b"))
    taken = b.next_batch()
    assert taken is not None and names(taken.run) == ["a"]
    assert b.next_batch() is None


def test_request_completes_once() -> None:
    seen: list[Outcome] = []
    r = Request(payload=None, on_done=seen.append)
    assert r.complete(result=1)
    assert not r.complete(result=2)
    assert [o.result for o in seen] == [1]


def test_aging_lets_a_long_waiting_low_priority_request_through() -> None:
    now = [100.0]
    b = Batcher(
        "m", max_batch=1, max_delay_s=0.0, queue_size=10, clock=lambda: now[0], aging_per_s=10
    )
    b.put(request("low", priority=0, at=100.0))
    for i in range(3):
        b.put(request(f"high{i}", priority=50, at=now[0]))
    # at t=100 the high-priority requests win (50 > 0 + 0)
    taken = b.next_batch()
    assert taken is not None and names(taken.run) == ["high0"]
    # after 5.1 s the low one's effective priority 0 + 51 beats a fresh 50
    now[0] = 105.1
    b.put(request("high3", priority=50, at=now[0]))
    taken = b.next_batch()
    # high1/high2 have waited 5.1 s too (50 + 51), so they still go first, oldest first ...
    assert taken is not None and names(taken.run) == ["high1"]
    taken = b.next_batch()
    assert taken is not None and names(taken.run) == ["high2"]
    # ... but the low one now beats the fresh high3
    taken = b.next_batch()
    assert taken is not None and names(taken.run) == ["low"]


def test_without_aging_priorities_are_strict() -> None:
    now = [0.0]
    b = Batcher("m", max_batch=1, max_delay_s=0.0, queue_size=10, clock=lambda: now[0])
    b.put(request("low", priority=0, at=0.0))
    now[0] = 1e6
    b.put(request("high", priority=1, at=now[0]))
    taken = b.next_batch()
    assert taken is not None and names(taken.run) == ["high"]


def test_retired_workers_stop_and_the_queue_waits_for_the_next_generation() -> None:
    b = Batcher("m", max_batch=2, max_delay_s=0.0, queue_size=10)
    old = b.generation
    returned: list[object] = []
    idle = threading.Thread(target=lambda: returned.append(b.next_batch(old)))
    idle.start()
    poll(lambda: len(b._sleepers) == 1)  # the idle worker waits for work
    new = b.retire_workers()
    idle.join(5)
    assert returned == [None] and new != old  # woken and told to stop
    b.put(request("a"))
    assert b.next_batch(old) is None  # a retired generation takes nothing
    taken = b.next_batch(new)
    assert taken is not None and names(taken.run) == ["a"]


def test_expired_requests_are_taken_out_while_no_worker_runs() -> None:
    b = Batcher("m", max_batch=4, max_delay_s=0.0, queue_size=10)
    now = time.monotonic()
    for name, deadline in (("a", now + 60), ("b", None), ("c", now - 2)):
        b.put(request(name, deadline_s=deadline))
    b.put(request("d", priority=3, deadline_s=now - 1))
    assert sorted(names(b.take_expired(now))) == ["c", "d"]
    assert b.depth == 2
    taken = b.next_batch()
    assert taken is not None and names(taken.run) == ["a", "b"]


def test_priorities_order_a_queue_that_emptied_and_filled_again() -> None:
    b = Batcher("m", max_batch=1, max_delay_s=0.0, queue_size=10)
    b.put(request("a"))
    taken = b.next_batch()
    assert taken is not None and names(taken.run) == ["a"]  # the queue is empty again
    for n, priority in (("low", 0), ("high", 5), ("low2", 0)):
        b.put(request(n, priority=priority))
    order = []
    for _ in range(3):
        taken = b.next_batch()
        assert taken is not None
        order += names(taken.run)
    assert order == ["high", "low", "low2"]
    b.put(request("late", priority=5))
    assert names(b.drain()) == ["late"]


# -- the idle reader: a worker with nothing queued reads notices itself ------------------------


class IdleReader:
    """Stands in for the reactor's ``read_when_idle``: what it "reads" it queues on the calling
    thread; with nothing scripted it waits on the wake fd like the real one (or has nothing)."""

    def __init__(self, script: list[str], lendable: bool = True) -> None:
        self.batcher: Batcher | None = None
        self.script, self.lendable = script, lendable
        self.threads: list[int] = []

    def __call__(self, model: str, wake_fd: int) -> bool:
        self.threads.append(threading.get_ident())
        if not self.lendable:
            return False
        if self.script:
            assert self.batcher is not None
            self.batcher.put(request(self.script.pop(0)))  # queued by the reading worker
            return True
        select.select([wake_fd], [], [], 30)
        return True


def with_wake_fd() -> int:
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


def reading(reader: IdleReader) -> Batcher:
    b = Batcher("m", max_batch=4, max_delay_s=0.0, queue_size=10, idle_reader=reader)
    reader.batcher = b
    return b


def test_an_idle_worker_takes_what_it_read_itself() -> None:
    reader = IdleReader(["a"])
    b = reading(reader)
    wake = with_wake_fd()
    taken = b.next_batch(0, wake)
    assert taken is not None and names(taken.run) == ["a"]
    assert reader.threads == [threading.get_ident()]
    os.close(wake)


def test_a_request_queued_elsewhere_wakes_the_worker_in_the_idle_reader() -> None:
    b = reading(IdleReader([]))
    wake = with_wake_fd()
    got: list[list[str]] = []
    worker = threading.Thread(target=lambda: got.append(names(b.next_batch(0, wake).run)))  # type: ignore[union-attr]
    worker.start()
    poll(lambda: b._seat.holder is not None)
    b.put(request("x"))  # the engine's in-process path, or another connection's notice
    worker.join(10)
    assert got == [["x"]]
    with pytest.raises(BlockingIOError):  # the wake-up was consumed: the next wait is real
        os.eventfd_read(wake)
    ended: list[object] = []
    worker = threading.Thread(target=lambda: ended.append(b.next_batch(0, wake)))
    worker.start()
    poll(lambda: b._seat.holder is not None)
    b.close()  # closing (or retiring the workers) ends the wait too
    worker.join(10)
    assert ended == [None]
    os.close(wake)


def test_with_nothing_to_read_the_worker_sleeps_until_told_to_look_again() -> None:
    reader = IdleReader([], lendable=False)
    b = reading(reader)
    wake = with_wake_fd()
    got: list[list[str]] = []
    worker = threading.Thread(target=lambda: got.append(names(b.next_batch(0, wake).run)))  # type: ignore[union-attr]
    worker.start()
    poll(lambda: len(b._sleepers) == 1)
    assert len(reader.threads) == 1
    reader.lendable, reader.script = True, ["y"]
    b.wake_idle()  # a connection became its to read
    worker.join(10)
    assert got == [["y"]] and len(reader.threads) == 2
    os.close(wake)


def test_a_request_queued_while_the_reader_finds_nothing_is_not_lost() -> None:
    """The idle reader lets go of the lock; a request queued in that moment wakes it through
    the wake fd. If the reader then reports nothing to read, the worker must still see the
    request, not sleep on it (a lost wake-up: the request would wait forever)."""

    def reader_that_finds_nothing(model: str, wake_fd: int) -> bool:
        elsewhere = threading.Thread(target=b.put, args=(request("meanwhile"),))
        elsewhere.start()  # (the reactor queues a notice of another connection)
        elsewhere.join()
        return False  # nothing of its own to read

    b = Batcher(
        "m", max_batch=4, max_delay_s=0.0, queue_size=10, idle_reader=reader_that_finds_nothing
    )
    wake = with_wake_fd()
    got: list[object] = []
    worker = threading.Thread(target=lambda: got.append(b.next_batch(0, wake)), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the worker slept on a queued request"
    assert names(got[0].run) == ["meanwhile"]  # type: ignore[attr-defined]
    with pytest.raises(BlockingIOError):  # the wake-up was consumed
        os.eventfd_read(wake)
    b.close()
    os.close(wake)


# -- fairness between flows (streams, connections) -----------------------------------------


def flowed(name: str, flow: object, weight: float = 1.0, supersedes: bool = False) -> Request:
    r = request(name)
    r.flow, r.weight, r.supersedes = flow, weight, supersedes
    return r


def take_all(b: Batcher) -> list[str]:
    taken: list[str] = []
    while b.depth:
        batch = b.next_batch()
        assert batch is not None
        taken += names(batch.run)
    return taken


def test_flows_are_taken_in_round_robin_not_in_arrival_order() -> None:
    b = Batcher("m", max_batch=1, max_delay_s=0.0, queue_size=64)
    for i in range(6):  # a busy camera's backlog first, then a slow camera's one frame
        b.put(flowed(f"a{i}", "cam-a"))
    b.put(flowed("b0", "cam-b"))
    b.put(flowed("b1", "cam-b"))
    assert take_all(b) == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]


def test_weights_share_the_model_in_proportion() -> None:
    b = Batcher("m", max_batch=1, max_delay_s=0.0, queue_size=64)
    for i in range(12):
        b.put(flowed(f"h{i}", "heavy", weight=3.0))
        b.put(flowed(f"l{i}", "light", weight=1.0))
    first = take_all(b)[:16]
    assert sum(n.startswith("h") for n in first) == 12  # 3 : 1
    assert sum(n.startswith("l") for n in first) == 4


def test_an_idle_flow_saves_up_no_credit() -> None:
    b = Batcher("m", max_batch=1, max_delay_s=0.0, queue_size=64)
    for i in range(4):
        b.put(flowed(f"a{i}", "a"))
    assert take_all(b) == ["a0", "a1", "a2", "a3"]
    for i in range(3):  # b was idle all along: it joins at the pass last served, no burst
        b.put(flowed(f"b{i}", "b"))
        b.put(flowed(f"a{i + 4}", "a"))
    assert take_all(b) == ["b0", "a4", "b1", "a5", "b2", "a6"]


def test_the_round_robin_stays_exact_at_the_extreme_weights_however_long_the_queue_is_busy() -> (
    None
):
    """A level's passes after a long busy period: at 2^52 a stride of 0.001 was lost to
    rounding and every flow tied (arrival order); the passes are counted afresh instead."""
    level = Level()
    level.served = 2.0**52  # (a queue that never emptied, for a very long time)
    for i in range(2000):
        level.append(flowed(f"heavy{i}", "heavy", weight=MAX_WEIGHT))  # a stride of 0.001
    for i in range(4):
        level.append(flowed(f"light{i}", "light", weight=1.0))
    first = [level.pop().payload for _ in range(1500)]
    # a thousand to one: after its first request, the light flow's next comes 1000 heavy
    # ones later (without the rebase the heavy flow's pass never moved: light1 never came)
    assert [n for n in first if n.startswith("light")] == ["light0", "light1"]
    assert first.index("light1") in range(1000, 1004), first.index("light1")
    assert level.served < 2.0**32


def test_priority_comes_before_fairness() -> None:
    b = Batcher("m", max_batch=1, max_delay_s=0.0, queue_size=64)
    b.put(flowed("low-b", "b"))
    urgent = flowed("high-a", "a")
    urgent.priority = 10
    b.put(urgent)
    assert take_all(b) == ["high-a", "low-b"]


def test_a_superseding_request_takes_its_flows_queued_place() -> None:
    b = Batcher("m", max_batch=4, max_delay_s=0.0, queue_size=64)
    answered: dict[str, str] = {}
    old = flowed("frame-1", "cam", supersedes=True)
    other = flowed("other-1", "other", supersedes=True)
    assert b.put(old) == [] and b.put(other) == []
    displaced = b.put(flowed("frame-2", "cam", supersedes=True))
    for r, error in displaced:
        answered[r.payload] = error.code.name
    assert answered == {"frame-1": "SUPERSEDED"}  # the other stream's frame is not touched
    assert take_all(b) == ["other-1", "frame-2"]


def test_a_full_queue_makes_room_from_the_flow_holding_the_most() -> None:
    b = Batcher("m", max_batch=1, max_delay_s=0.0, queue_size=4)
    for i in range(4):
        assert b.put(flowed(f"greedy{i}", "greedy")) == []
    displaced = b.put(flowed("modest0", "modest"))
    assert [(r.payload, e.code.name) for r, e in displaced] == [
        ("greedy3", "RESOURCE_EXHAUSTED")  # its newest
    ]
    with pytest.raises(ResourceExhaustedError):  # its own flow holds the most now: refused
        b.put(flowed("greedy4", "greedy"))
    b.put(flowed("modest1", "modest"))  # (made room again: greedy still holds more)
    assert take_all(b) == ["greedy0", "modest0", "greedy1", "modest1"]
