"""A ring's segment and its size: the mapping outlives its name and is unmapped only when no
view points into it; a grown input area is laid out, bounded and charged as stated in
``supervisor.attachment`` (``layout_for``, ``ring_charge``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ipc.errors import InvalidArgumentError
from ipc.ring import SlotRing
from supervisor.attachment import GROWTH_STEP, layout_for, ring_charge
from worker.executors.base import IMAGE_SLOT, SlotInput, SlotSpec

RAW = SlotSpec(
    inputs=(SlotInput("x", np.dtype(np.float32), (None, 4), 4 * 4 * 4),),
    result="tensors",
    result_capacity=4096,
    outputs=("y",),
    max_rows=4,
)


def test_a_ring_is_shared_unlinked_and_unmapped_once_no_view_is_left() -> None:
    layout = layout_for(RAW, 2)
    made = SlotRing.create(layout)
    path = f"/dev/shm/{made.name}"
    assert os.stat(path).st_mode & 0o777 == 0o600
    seen = SlotRing.attach(made.name, layout)
    assert not os.path.exists(path)  # the client unlinked it as soon as it was mapped
    written = seen.input_view(1, 0, np.dtype(np.float32), (2, 4))
    written[...] = 7.0
    read = made.input_view(1, 0, np.dtype(np.float32), (2, 4))
    assert (read == 7.0).all()
    assert not made.close()  # a view is alive: still mapped (and nothing raised)
    del read
    assert made.close() and made.close()
    assert not seen.close()
    del written
    assert seen.close()


def test_a_larger_frame_grows_an_open_area_rounded_to_the_step() -> None:
    default = IMAGE_SLOT.inputs[0].capacity
    assert layout_for(IMAGE_SLOT, 4, {"image": default}).inputs[0].capacity == default
    grown = layout_for(IMAGE_SLOT, 4, {"image": 72_000_000})
    assert grown.inputs[0].capacity == 69 * GROWTH_STEP >= 72_000_000
    assert grown.output_offset >= grown.inputs[0].offset + grown.inputs[0].capacity
    plain = layout_for(IMAGE_SLOT, 4)
    assert ring_charge(IMAGE_SLOT, plain) == plain.reserved_bytes  # defaults: as before
    assert ring_charge(IMAGE_SLOT, grown) == grown.reserved_bytes + 4 * 69 * GROWTH_STEP


def test_an_area_of_fixed_size_or_an_unknown_input_is_not_grown() -> None:
    assert layout_for(RAW, 2, {"x": 64}).inputs[0].capacity == 64  # its most: 4 rows
    with pytest.raises(InvalidArgumentError, match=r"of 80 bytes exceeds the slot's 64.*max_batch"):
        layout_for(RAW, 2, {"x": 80})
    with pytest.raises(InvalidArgumentError, match="no input 'z'"):
        layout_for(RAW, 2, {"z": 8})
