"""HostBuffers and BufferedSession after ``settle``: a shape within ONE_OFF_FACTOR of the
warm-up's is kept, a larger one is an array of its own; a run far above the warm-up's inputs is a
one-off, given back once."""

from __future__ import annotations

import numpy as np

from duomo.worker.backends.base import ONE_OFF_FACTOR, BufferedSession, HostBuffers

F32 = np.dtype(np.float32)


def test_a_buffer_keeps_up_to_the_factor_and_hands_a_larger_shape_its_own_array() -> None:
    buffers = HostBuffers()
    warm = buffers.view("x", F32, (1, 100))
    buffers.settle()
    kept = buffers.view("x", F32, (ONE_OFF_FACTOR, 100))  # grown and kept
    assert buffers.nbytes == kept.nbytes and not np.shares_memory(kept, warm)
    one_off = buffers.view("x", F32, (ONE_OFF_FACTOR * 4 + 1, 100))
    assert buffers.nbytes == kept.nbytes  # not kept
    assert not np.shares_memory(one_off, buffers.view("x", F32, (1, 100)))
    assert buffers.growths == 3


def test_before_settle_every_shape_is_kept() -> None:
    buffers = HostBuffers()
    buffers.view("x", F32, (1, 10))
    big = buffers.view("x", F32, (1000, 10))
    assert buffers.nbytes == big.nbytes


class _Echo(BufferedSession):
    def __init__(self) -> None:
        super().__init__()
        self.given_back = 0

    def run(self, inputs, outputs=None):  # type: ignore[no-untyped-def]
        self.memory.note_run(inputs)
        return dict(inputs)

    def close(self) -> None:
        pass

    def give_back(self) -> None:
        self.given_back += 1


def test_a_run_far_above_the_warm_ups_is_a_one_off_given_back_once() -> None:
    session = _Echo()
    session.run({"x": np.zeros((1, 100), F32)})  # the warm-up
    session.memory.settle()
    session.run({"x": np.zeros((ONE_OFF_FACTOR, 100), F32)})
    assert not session.memory.release_one_off()
    session.run({"x": np.zeros((ONE_OFF_FACTOR + 1, 100), F32)})
    assert session.memory.release_one_off() and not session.memory.release_one_off()
    assert session.given_back == 1
