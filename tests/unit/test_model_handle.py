"""A model handle and its slots run on any link that keeps ``ipc.slots.HandleLink``: here an
in-memory one that makes rings in this process and answers their notices itself, so the
handle's own rules — a request's way through a slot, ``infer_async``'s count of outstanding
requests, a ring grown make-before-break and retired once its last slot is back, ``close`` —
are checked without a supervisor or a socket."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import orjson
import pytest

from duomo.ipc.errors import UnavailableError
from duomo.ipc.handle import ModelHandle
from duomo.ipc.ring import SlotRing
from duomo.ipc.slots import SlotPool
from duomo.ipc.wire import FRAME, NOTICE, done_packer
from duomo.supervisor.process.attachment import layout_for
from duomo.worker.executors.base import SlotInput, SlotSpec

SPEC = SlotSpec(  # one open input of 4 columns (16 bytes a row: 4 rows by default), JSON results
    inputs=(SlotInput("x", np.dtype(np.float32), (None, 4), 4 * 4 * 4),),
    result="json",
    result_capacity=4096,
)
ROW = np.ones((1, 4), dtype=np.float32)


class MemoryLink:
    """``HandleLink`` in memory: ``attach_ring`` makes a ring here (its other mapping is the
    "supervisor's"), a notice is recorded, and ``answer_all`` answers each one with the ring,
    slot and sum of its input."""

    def __init__(self) -> None:
        self.rings: dict[int, SlotRing] = {}  # the supervisor's mappings
        self.routes: dict[int, SlotPool] = {}
        self.notices: list[tuple[int, int, int]] = []
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.detached_later: list[int] = []
        self.outstanding = 0
        self.gone: BaseException | None = None
        self._ids = itertools.count(1)

    def lost(self) -> BaseException | None:
        return self.gone

    def send_frame(self, data: bytes) -> None:
        if self.gone is not None:
            raise UnavailableError("gone")
        self.notices.append(NOTICE.unpack_from(data, FRAME.size))

    def wait_for(
        self, done: Callable[[], bool], deadline: float | None, by_frame: bool = False
    ) -> None:
        self.answer_all()  # (one thread: what it waits for can only come from here)

    def request(self, op: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        self.requests.append((op, fields))
        return {"ok": True}

    def attach_ring(
        self, name: str, slots: int, inputs: dict[str, int] | None = None
    ) -> tuple[int, SlotRing]:
        layout = layout_for(SPEC, slots, inputs)
        made = SlotRing.create(layout)
        ring_id = next(self._ids)
        self.rings[ring_id] = made
        return ring_id, SlotRing.attach(made.share(), layout)

    def route_ring(self, owner: SlotPool, ring_id: int, old_ring: int | None = None) -> None:
        if old_ring is not None:
            self.routes.pop(old_ring, None)
        self.routes[ring_id] = owner

    def unroute_rings(self, ring_ids: Iterable[int]) -> None:
        for ring_id in ring_ids:
            self.routes.pop(ring_id, None)

    def detach_ring_later(self, ring_id: int) -> None:
        self.routes.pop(ring_id, None)
        self.detached_later.append(ring_id)

    def wake_waiters(self) -> None:
        pass

    def async_started(self) -> None:
        self.outstanding += 1

    def async_finished(self) -> None:
        self.outstanding -= 1

    def answer_all(self) -> None:
        notices, self.notices = self.notices, []
        for ring_id, slot, seq in notices:
            ring = self.rings[ring_id]
            rows = ring.layout.inputs[0].capacity // 16
            total = float(ring.input_view(slot, 0, np.dtype(np.float32), (rows, 4)).sum())
            payload = orjson.dumps({"ring": ring_id, "slot": slot, "sum": total})
            ring.output(slot)[: len(payload)] = payload
            done_packer(ring.header(slot))(seq, 0, len(payload), 1, 2, 3, 4)
            self.routes[ring_id].answer(ring_id, slot, seq)


@pytest.fixture
def link() -> MemoryLink:
    return MemoryLink()


def attached(link: MemoryLink, slots: int = 2) -> ModelHandle:
    ring_id, ring = link.attach_ring("m", slots)
    return ModelHandle(None, link, "m", ring_id, ring)


def test_a_request_goes_through_a_slot_and_its_answer_comes_back_by_the_route(
    link: MemoryLink,
) -> None:
    handle = attached(link)
    assert set(link.routes) == {handle.ring_id}  # routed before any slot could be taken
    result, timings = handle.infer_timed(ROW * 2)
    assert result == {"ring": handle.ring_id, "slot": 1, "sum": 8.0}
    assert timings == {"queue": 1, "preprocess": 2, "infer": 3, "postprocess": 4}
    assert handle.infer(ROW)["sum"] == 4.0  # the slot's area is zeroed as it was written


def test_infer_async_counts_each_request_until_its_answer(link: MemoryLink) -> None:
    handle = attached(link)
    futures = [handle.infer_async(ROW * k) for k in (1, 2)]
    assert link.outstanding == 2 and not any(f.done() for f in futures)
    link.answer_all()
    assert [f.result()["sum"] for f in futures] == [4.0, 8.0]
    assert link.outstanding == 0
    assert handle.slot(timeout_s=0).index in (0, 1)  # both came back


def test_a_larger_frame_grows_the_ring_and_the_old_one_retires_when_its_last_slot_is_back(
    link: MemoryLink,
) -> None:
    handle = attached(link)
    first = handle.ring_id
    held = handle.slot()
    held.write(ROW)
    held.submit()  # in flight on the first ring while a larger frame arrives
    big = np.ones((100, 4), dtype=np.float32)  # 1600 bytes: past the 64-byte area
    result = handle.infer(big)
    grown = handle.ring_id
    assert grown != first and handle.layout.inputs[0].capacity >= big.nbytes
    assert result["ring"] == grown and result["sum"] == 400.0
    assert held.ring_id == first and held.wait(timeout_s=0)["ring"] == first
    assert link.detached_later == []  # its last slot is still held
    held.release()
    assert link.detached_later == [first] and set(link.routes) == {grown}
    handle.trim()  # back to the default layout
    assert handle.ring_id not in (first, grown) and handle.layout.inputs[0].capacity == 64
    assert link.detached_later == [first, grown] and set(link.routes) == {handle.ring_id}


def test_close_detaches_and_a_lost_link_fails_what_waits(link: MemoryLink) -> None:
    handle = attached(link)
    slot = handle.slot()
    slot.write(ROW)
    slot.submit()
    link.routes[handle.ring_id].fail_all(UnavailableError("lost the supervisor"))
    with pytest.raises(UnavailableError, match="lost the supervisor"):
        slot.wait(timeout_s=0)
    slot.release()
    ring_id = handle.ring_id
    handle.close()
    assert link.requests == [("detach", {"ring": ring_id})] and link.routes == {}
