"""The wire format: slot headers, frames and tensor records round-trip; limits hold."""

from __future__ import annotations

import numpy as np
import pytest

from duomo.ipc.framing import FrameReader, ProtocolError, json_frame, notice_frame, notice_packer
from duomo.ipc.ring import place_tensors, read_tensors, write_tensors
from duomo.ipc.wire import (
    DESCRIPTORS,
    FRAME,
    HEADER_BYTES,
    MAX_JSON_BYTES,
    PROTOCOL_VERSION,
    STREAM_AT,
    FrameKind,
    SlotHeader,
    SlotState,
    TensorDesc,
    done_packer,
    frame,
    pack_descriptors,
    request_packer,
    stream_packer,
    unpack_done,
    unpack_stream,
)


def test_slot_header_round_trip() -> None:
    buffer = bytearray(HEADER_BYTES)
    header = SlotHeader(
        seq=7, state=SlotState.SUBMITTED, priority=-3, timeout_us=1500,
        inputs=[TensorDesc(0, (480, 640, 3)), TensorDesc(7, (2, 5))],
    )  # fmt: skip
    header.pack_into(memoryview(buffer))
    back = SlotHeader.unpack(memoryview(buffer))
    assert (back.seq, back.state, back.priority, back.timeout_us) == (7, 1, -3, 1500)
    assert [(d.dtype, d.shape) for d in back.inputs] == [(0, (480, 640, 3)), (7, (2, 5))]
    done_packer(memoryview(buffer))(7, 4, 123, 1, 2, 3, 4)
    assert unpack_done(memoryview(buffer)) == (SlotState.DONE, 7, 4, 123, 1, 2, 3, 4)


def test_the_packers_write_what_the_header_layout_says() -> None:
    inputs = [TensorDesc(0, (480, 640, 3))]
    reference = bytearray(HEADER_BYTES)
    SlotHeader(
        seq=9, state=SlotState.SUBMITTED, priority=-2, timeout_us=70, inputs=inputs
    ).pack_into(memoryview(reference))
    written = bytearray(HEADER_BYTES)
    count, block = pack_descriptors(inputs)
    written[DESCRIPTORS] = block  # as a producer's submit writes it
    request_packer(memoryview(written))(9, -2, count, 70)
    assert written == reference
    answered = bytearray(written)
    done_packer(memoryview(answered))(9, 3, 40, 1, 2, 3, 4)
    laid_out = bytearray(HEADER_BYTES)
    SlotHeader(
        seq=9, state=SlotState.DONE, status=3, result_len=40,
        queue_us=1, preprocess_us=2, infer_us=3, postprocess_us=4,
    ).pack_into(memoryview(laid_out))  # fmt: skip
    fixed = slice(0, DESCRIPTORS.start)
    assert answered[fixed] == laid_out[fixed]
    assert unpack_done(memoryview(answered)) == (SlotState.DONE, 9, 3, 40, 1, 2, 3, 4)
    assert answered[DESCRIPTORS] == reference[DESCRIPTORS]  # the inputs' block stays
    assert notice_packer(3, 4)(5) == notice_frame(3, 4, 5)


def test_the_stream_block_carries_what_the_source_did_with_the_frames_it_did_not_send() -> None:
    """Version 3: the block says how many frames the source superseded, refused and skipped
    since its last one sent, beside the stream, the frame and its capture time; the producer's
    packer writes what ``SlotHeader`` lays out, and the block fits the header after the
    descriptors, at a 64-byte boundary."""
    assert PROTOCOL_VERSION == 3
    block = (7, 3, 2, 11, 2**64 - 1, 1_234_567)  # stream, superseded, refused, skipped, ...
    written = bytearray(HEADER_BYTES)
    stream_packer(memoryview(written))(*block)
    assert unpack_stream(bytes(written)) == block
    reference = bytearray(HEADER_BYTES)
    SlotHeader(
        stream=7, superseded_before=3, refused_before=2, skipped_before=11, frame=2**64 - 1,
        captured_us=1_234_567,
    ).pack_into(memoryview(reference))  # fmt: skip
    stream_block = slice(STREAM_AT, STREAM_AT + 32)
    assert written[stream_block] == reference[stream_block]
    back = SlotHeader.unpack(memoryview(reference))
    assert (back.superseded_before, back.refused_before, back.skipped_before) == (3, 2, 11)
    assert (back.stream, back.frame, back.captured_us) == (7, 2**64 - 1, 1_234_567)
    assert DESCRIPTORS.stop <= STREAM_AT and STREAM_AT % 64 == 0
    assert STREAM_AT + 32 <= HEADER_BYTES


def test_header_that_lies_about_counts_is_rejected() -> None:
    buffer = bytearray(HEADER_BYTES)
    SlotHeader(inputs=[TensorDesc(0, (1,))]).pack_into(memoryview(buffer))
    buffer[16] = 200  # the input count
    with pytest.raises(ValueError, match="inputs"):
        SlotHeader.unpack(memoryview(buffer))


def test_frames_split_anywhere_are_reassembled() -> None:
    stream = json_frame({"op": "ping", "id": 1}) + notice_frame(3, 4, 5) + json_frame({"x": 2})
    reader = FrameReader()
    frames = [f for i in range(len(stream)) for f in reader.feed(stream[i : i + 1])]
    assert [k for k, _ in frames] == [FrameKind.JSON, FrameKind.NOTICE, FrameKind.JSON]
    assert reader.empty


@pytest.mark.parametrize(
    "bad",
    [
        FRAME.pack(MAX_JSON_BYTES + 1, FrameKind.JSON),
        FRAME.pack(4, 99),
        frame(FrameKind.NOTICE, b"\x00" * 7),
        frame(FrameKind.RESPONSE, b"\x00" * 5),
    ],
)
def test_frames_of_the_wrong_size_or_kind_are_protocol_errors(bad: bytes) -> None:
    with pytest.raises(ProtocolError):
        list(FrameReader().feed(bad + b"\x00" * 8))


def test_tensor_records_round_trip_and_refuse_to_overflow() -> None:
    area = memoryview(bytearray(4096))
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.array([[1, 2]], dtype=np.int64)
    used = write_tensors(area, [a, b])
    read = read_tensors(area, 2, used)
    np.testing.assert_array_equal(read.views[0], a)
    np.testing.assert_array_equal(read.views[1], b)
    # a reader may keep the views while the area describes the same tensors
    assert write_tensors(area, [a + 1, b]) == used and read.describes(area, used)
    np.testing.assert_array_equal(read.views[0], a + 1)
    write_tensors(area, [a.reshape(4, 3), b])
    assert not read.describes(area, used)
    write_tensors(area, [a, b])
    area[:5] = b"error"  # an error answer overwrites the first record
    assert not read.describes(area, used)
    with pytest.raises(ValueError, match="output bytes"):
        place_tensors(area, [(np.dtype(np.float64), (100, 100))])
    write_tensors(area, [a, b])
    with pytest.raises(ValueError, match="past the result"):
        read_tensors(area, 2, used - 1)


def test_descriptors_out_of_the_header_s_range_are_invalid_arguments() -> None:
    """What cannot be written into the header is the caller's error, not a ``struct.error``."""
    from duomo.ipc.errors import InvalidArgumentError
    from duomo.ipc.wire import MAX_DIM, TensorDesc, pack_descriptors

    with pytest.raises(InvalidArgumentError, match="rank 7 is above 6"):
        pack_descriptors([TensorDesc(1, (1,) * 7)])
    with pytest.raises(InvalidArgumentError, match="dimension out of range"):
        pack_descriptors([TensorDesc(1, (1, MAX_DIM + 1))])
    with pytest.raises(InvalidArgumentError, match="at most 4 inputs"):
        pack_descriptors([TensorDesc(1, (1,))] * 5)
