"""A ring's segment and its size: a sealed memfd that cannot be resized, handed over by its
descriptor, unmapped only when no view points into it; a grown input area is laid out, bounded
and charged as stated in ``supervisor.attachment`` (``layout_for``, ``ring_charge``)."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest

from duomo.ipc.errors import InvalidArgumentError
from duomo.ipc.ring import SlotRing
from duomo.supervisor.attachment import GROWTH_STEP, layout_for, ring_charge
from duomo.worker.executors.base import IMAGE_SLOT, SlotInput, SlotSpec

RAW = SlotSpec(
    inputs=(SlotInput("x", np.dtype(np.float32), (None, 4), 4 * 4 * 4),),
    result="tensors",
    result_capacity=4096,
    outputs=("y",),
    max_rows=4,
)


def test_a_ring_is_a_sealed_memfd_handed_over_and_unmapped_once_no_view_is_left() -> None:
    layout = layout_for(RAW, 2)
    made = SlotRing.create(layout)
    fd = made.share()
    with pytest.raises(RuntimeError, match="handed over already"):
        made.share()
    size = os.fstat(fd).st_size
    assert size == layout.slots * layout.slot_bytes
    assert os.readlink(f"/proc/self/fd/{fd}") == "/memfd:duomo-ring (deleted)"  # no name
    for resize in (0, size // 2, size + 4096):  # a client can neither shrink nor grow it
        with pytest.raises(PermissionError):
            os.ftruncate(fd, resize)
    with pytest.raises(PermissionError):  # nor lift the seals
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)
    assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # (a spawned gateway gets none)
    seen = SlotRing.attach(fd, layout)
    with pytest.raises(OSError):
        os.fstat(fd)  # attach took it and closed it
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


def test_a_descriptor_that_is_not_a_sealed_segment_of_the_layout_is_refused() -> None:
    layout = layout_for(RAW, 2)
    unsealed = os.memfd_create("other", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, layout.slots * layout.slot_bytes)
    with pytest.raises(ValueError, match="not sealed"):
        SlotRing.attach(unsealed, layout)
    small = SlotRing.create(layout_for(RAW, 1))
    with pytest.raises(ValueError, match="smaller than its layout"):
        SlotRing.attach(small.share(), layout)
    assert small.close()


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
