"""A ring's segment and its size: a sealed memfd that cannot be resized, handed over by its
descriptor, unmapped only when no view points into it; a grown input area is laid out, bounded
and charged as stated in ``supervisor.process.attachment`` (``layout_for``, ``ring_charge``)."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest

from duomo.ipc.errors import InvalidArgumentError
from duomo.ipc.ring import RingLayout, SlotRing
from duomo.supervisor.process.attachment import GROWTH_STEP, layout_for, ring_charge
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


def test_an_area_is_never_grown_past_the_bound_its_model_states() -> None:
    """An image task's frame is at most 16384 pixels a side (RGBA): a ring is never grown past
    that (issue 42: a [20000, 20000, 3] frame was answered "no room to grow", which says retry,
    for a request that can never succeed)."""
    most = 16384 * 16384 * 4
    assert layout_for(IMAGE_SLOT, 1, {"image": most}).inputs[0].capacity >= most
    for asked in (most + 1, 20000 * 20000 * 3, 100000 * 100000 * 3):
        with pytest.raises(
            InvalidArgumentError, match=r"past its bound: at most \[16384, 16384, 4\]"
        ):
            layout_for(IMAGE_SLOT, 1, {"image": asked})


def test_the_bound_travels_with_the_layout_and_is_checked_by_shape() -> None:
    layout = layout_for(IMAGE_SLOT, 2)
    seen = RingLayout.from_dict(layout.to_dict())
    assert seen == layout and seen.inputs[0].bound == (16384, 16384, 4)
    area = seen.inputs[0]
    for fine in ((16384, 16384, 4), (1, 1, 1), (16384, 1, 3)):
        area.check(fine)
    for past in ((16385, 1, 3), (1, 16385, 3), (2, 2, 5), (100000, 100000, 3), (4, 4)):
        with pytest.raises(InvalidArgumentError, match=r"at most \[16384, 16384, 4\]"):
            area.check(past)
    unbounded = layout_for(RAW, 2)  # a raw model's input states no bound: growth limits it
    assert RingLayout.from_dict(unbounded.to_dict()).inputs[0].bound is None
    assert "bound" not in unbounded.to_dict()["inputs"][0]


def test_a_free_slots_input_pages_are_given_back_for_both_sides() -> None:
    """``discard_inputs`` frees the memfd's pages under a slot's input areas (the seals forbid
    resizing, not that): both mappings read zeros, and the slot is written again as before; the
    other slot and the headers keep what they hold."""
    layout = layout_for(IMAGE_SLOT, 2)
    made = SlotRing.create(layout)
    seen = SlotRing.attach(made.share(), layout)
    frame = (1080, 1920, 3)
    for slot in (0, 1):
        seen.input_view(slot, 0, np.dtype(np.uint8), frame)[...] = 7
    seen.header(1)[:4] = b"DUO1"
    written = made.input_view(0, 0, np.dtype(np.uint8), frame)
    assert int(written[-1, -1, -1]) == 7
    discarded = seen.discard_inputs(0)
    assert discarded >= layout.inputs[0].capacity - 2 * 4096
    # the supervisor's side reads zeros: the pages are gone (whole pages: the area's first
    # bytes share a page with the header)
    assert not written.reshape(-1)[4096:].any()
    assert (seen.input_view(1, 0, np.dtype(np.uint8), frame) == 7).all()
    assert bytes(made.header(1)[:4]) == b"DUO1"
    seen.input_view(0, 0, np.dtype(np.uint8), frame)[...] = 9  # written again as before
    assert int(written[0, 0, 0]) == 9
    del written
    assert made.close() and seen.close()
