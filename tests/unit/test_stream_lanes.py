"""A ``Stream`` runs on any link that keeps ``ipc.stream.StreamLink`` (here the in-memory one
of ``test_model_handle``): each frame is answered exactly once and its slot comes back, even
when the connection's loss answers the slot while the frame is being sent."""

from __future__ import annotations

from typing import Any

import pytest

from duomo.ipc.errors import UnavailableError
from duomo.ipc.handle import ModelHandle
from duomo.ipc.stream import Stream
from duomo.ipc.stream_settings import StreamSettings
from tests.conftest import poll
from tests.unit.test_model_handle import ROW, MemoryLink, attached


class StreamingLink(MemoryLink):
    """The in-memory link, with streams: ``stream_open`` answers id 7; a send after
    ``lose_on_send`` is the connection lost during it (the reader's word on the loss answers
    every slot before the send fails, if ``loss_answers_first``)."""

    lose_on_send = False
    loss_answers_first = True

    @property
    def connected(self) -> bool:
        return self.gone is None

    def request(self, op: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        super().request(op, timeout_s, **fields)
        return {"ok": True, "stream": 7} if op == "stream_open" else {"ok": True}

    def send_frame(self, data: bytes) -> None:
        if self.lose_on_send:
            self.gone = ConnectionError("lost during the send")
            if self.loss_answers_first:
                self.fail_all()
        super().send_frame(data)

    def fail_all(self) -> None:
        for owner in list(self.routes.values()):
            owner.fail_all(UnavailableError("lost the supervisor"))


def opened(link: StreamingLink, **settings: Any) -> Stream:
    def attach(name: str, slots: int) -> ModelHandle:
        return attached(link, slots)

    return Stream(link, attach, "gate", StreamSettings(("m",), **settings))


def test_each_frame_is_answered_once_and_the_stream_closes_what_it_opened() -> None:
    link = StreamingLink()
    stream = opened(link, policy="fifo", slots=2)
    assert stream.stream_id == 7 and link.requests[0][0] == "stream_open"
    for k in range(3):
        assert stream.send(ROW * (k + 1), captured=0.0)
    assert stream.in_flight == 2 and link.outstanding == 2  # the third waits for a slot
    link.answer_all()  # a slot freed: the stream's refill thread sends the third (no sender)
    poll(lambda: len(link.notices) == 1)
    link.answer_all()
    stream.close(drain_s=5.0)
    answers = sorted(stream.poll(), key=lambda a: a.frame)
    assert [(a.frame, a.outcome) for a in answers] == [(0, "OK"), (1, "OK"), (2, "OK")]
    assert [a.result["sum"] for a in answers] == [4.0, 8.0, 12.0]
    assert link.outstanding == 0 and stream.in_flight == 0
    assert [op for op, _ in link.requests] == ["stream_open", "stream_close", "detach"]


@pytest.mark.parametrize("loss_answers_first", [True, False])
def test_a_frame_whose_send_meets_the_loss_is_answered_once_and_its_slot_comes_back(
    loss_answers_first: bool,
) -> None:
    link = StreamingLink()
    stream = opened(link, slots=1)
    link.lose_on_send, link.loss_answers_first = True, loss_answers_first
    with pytest.raises(UnavailableError):
        stream.send(ROW, captured=0.0)
    link.fail_all()  # (again, or for the first time: after the failed send)
    answers = stream.poll()
    assert [(a.frame, a.outcome) for a in answers] == [(0, "UNAVAILABLE")]
    assert stream.in_flight == 0 and link.outstanding == 0
