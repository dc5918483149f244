"""The wire format, defined in one place: frames on the control socket and the slot header.

Imported by the client library and by the supervisor; nothing here imports numpy-heavy code or a
backend. Every number a peer writes is untrusted: ``SlotHeader.unpack`` only decodes, callers
validate against what they know (the supervisor against the model, the client against its slot).

Control socket frames: ``<I`` payload length, ``<B`` kind, then the payload.

=============  ==========================================================================
kind           payload
=============  ==========================================================================
CHALLENGE      32 random bytes (server → client, first frame on every connection)
RESPONSE       HMAC-SHA256(key, challenge) (client → server, the only frame accepted before)
JSON           one UTF-8 JSON object, at most ``MAX_JSON_BYTES`` (requests, replies, events)
NOTICE         ``<HHI`` ring id, slot index, sequence number: "slot ready" (client → server)
               or "slot done" (server → client); 8 bytes, nothing else rides on it
=============  ==========================================================================

No pickle, anywhere.

A ring's life in JSON control messages (each request carries an ``id``; its reply echoes it with
``ok`` and, on failure, ``code`` and ``message``)::

    {"op": "attach", "model": M, "slots": N}          -> {"ring": R, "layout": {...},
                                                          "descriptor": true} + the ring's
                                                          sealed memfd (SCM_RIGHTS)
    {"op": "attach", ..., "inputs": {"image": BYTES}} -> the same, those input areas holding
                                                         at least BYTES (a producer's larger frame)
    {"op": "detach", "ring": R}                        done with it (the reply may go unread)

``inputs`` is optional (a client that never sends it is served as before): those areas are
made at least that large, rounded up to a MiB, and charged in full against the client's
limits on ring memory. INVALID_ARGUMENT for an input the model does not have or one of fixed
shape asked to hold more than its largest tensor; RESOURCE_EXHAUSTED, with the numbers, when
the limits leave no room for the ring.

Slot header (``SlotHeader.FORMAT``, 256 bytes, little-endian) at the start of every slot:
magic/version, sequence number, state, status code, priority, input count, relative timeout,
result length, four stage timings, per input its dtype code, rank and dims, and at
``STREAM_AT`` the stream block: the stream's id (0: a plain request); what the source did with
the frames since its last one sent to this model — how many it superseded (``latest``), refused
(``fifo``'s backlog full) and skipped (its ``max_fps`` and ``every`` caps); the frame number;
and the capture time (µs on the host's ``CLOCK_MONOTONIC``, the clock of ``time.monotonic``:
producers run on the supervisor's host). Version 2 added the stream block, version 3 its refused
and skipped counts; the supervisor answers a header of another version INVALID_ARGUMENT, saying
which version it speaks.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from duomo.ipc.errors import InvalidArgumentError

PROTOCOL_VERSION = 3  # 2: the stream block; 3: its refused and skipped counts
MAGIC = b"DUO1"
FRAME = struct.Struct("<IB")
NOTICE = struct.Struct("<HHI")
MAX_JSON_BYTES = 1 << 20
CHALLENGE_BYTES = 32
ALIGN = 64


class FrameKind(IntEnum):
    """The kind byte of a control-socket frame (the module docstring's table)."""

    CHALLENGE = 1
    RESPONSE = 2
    JSON = 3
    NOTICE = 4


class SlotState(IntEnum):
    """A slot's state in its header: FREE (no request in it), SUBMITTED (a request the client
    wrote, for the supervisor), DONE (its answer, for the client)."""

    FREE = 0
    SUBMITTED = 1
    DONE = 2


# dtype codes on the wire; the order is part of the format
DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t)
    for t in (
        "uint8",
        "int8",
        "uint16",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
        "bool",
    )
)
DTYPE_CODES = {dt: i for i, dt in enumerate(DTYPES)}
MAX_INPUTS = 4
MAX_RANK = 6
MAX_DIM = 0xFFFFFFFF  # a dimension's field
MAX_TIMEOUT_US = 24 * 3600 * 10**6  # a request's timeout: at most one day

_FIXED = struct.Struct("<4sHHIHhHHQQIIII")
# The fields a producer sets, read in one call: _FIXED up to the timeout, status and flags skipped.
_REQUEST = struct.Struct("<4sHHI2xhH2xQ")
# The fields the supervisor's answer sets: _FIXED's state, seq, status, result length, timings.
_DONE = struct.Struct("<6xHIH14xQIIII")
_TENSOR = struct.Struct("<BB2x" + "I" * MAX_RANK)
_HEADER_USED = _FIXED.size + MAX_INPUTS * _TENSOR.size
DESCRIPTORS = slice(_FIXED.size, _HEADER_USED)  # the per-input descriptor block of a header
_ZERO_DIMS = (0,) * MAX_RANK
# The stream block: stream id; frames superseded, refused and skipped at the source since the
# last one sent to this model; frame number; capture time in µs (CLOCK_MONOTONIC)
_STREAM = struct.Struct("<IIIIQQ")
STREAM_AT = ALIGN * ((_HEADER_USED + ALIGN - 1) // ALIGN)
HEADER_BYTES = 256
assert STREAM_AT + _STREAM.size <= HEADER_BYTES
MAX_STREAM_ID = 0xFFFFFFFF
MAX_SOURCE_COUNT = 0xFFFFFFFF  # a count of the stream block (superseded, refused, skipped)


def pack_descriptors(inputs: Iterable[TensorDesc]) -> tuple[int, bytes]:
    """The input count and the header's descriptor block for ``inputs`` (unused entries zero).

    A producer that sends the same shapes again can reuse the block as it is.
    """
    block = bytearray(_HEADER_USED - _FIXED.size)
    count = 0
    for desc in inputs:
        rank = len(desc.shape)
        if count == MAX_INPUTS:
            raise InvalidArgumentError(f"at most {MAX_INPUTS} inputs per request")
        if rank > MAX_RANK:
            raise InvalidArgumentError(f"rank {rank} is above {MAX_RANK}")
        if not all(0 <= d <= MAX_DIM for d in desc.shape):
            raise InvalidArgumentError(f"shape {list(desc.shape)} has a dimension out of range")
        _TENSOR.pack_into(
            block, count * _TENSOR.size, desc.dtype, rank, *desc.shape, *_ZERO_DIMS[rank:]
        )
        count += 1
    return count, bytes(block)


# What a producer writes: _FIXED with status, flags, the result length and the timings zero.
_REQUEST_WRITE = struct.Struct("<4sHHI2xhH2xQ24x")
assert _REQUEST_WRITE.size == _FIXED.size


def request_packer(buffer: memoryview) -> Callable[[int, int, int, int], None]:
    """The fixed fields of a producer's request header for the slot header ``buffer``, as a
    call that runs no Python (every request's path): ``(seq, priority, input count, timeout
    µs)``. The descriptor block goes in ``buffer[DESCRIPTORS]``."""
    return functools.partial(
        _REQUEST_WRITE.pack_into, buffer, 0, MAGIC, PROTOCOL_VERSION, SlotState.SUBMITTED
    )


# (magic, version, state, seq, priority, input count, timeout µs) of a request header; the
# struct's own method, since the reactor calls it for every request
unpack_request = _REQUEST.unpack_from


def stream_packer(buffer: memoryview) -> Callable[[int, int, int, int, int, int], None]:
    """The stream block's write for the slot header ``buffer``, as a call that runs no Python:
    ``(stream id, superseded, refused, skipped at the source, frame number, captured µs)``;
    all zero for a plain request."""
    return functools.partial(_STREAM.pack_into, buffer, STREAM_AT)


# (stream id, superseded, refused, skipped at the source, frame, captured µs) of a request
# header copy; a call that runs no Python, as ``unpack_request`` (every request's path)
unpack_stream = functools.partial(_STREAM.unpack_from, offset=STREAM_AT)


# The supervisor's answer: _FIXED with magic, version, state, seq, status, the request's
# priority..timeout zeroed, result length, timings (the inputs' descriptors stay as written).
_ANSWER = struct.Struct("<4sHHIH14xQIIII")
assert _ANSWER.size == _FIXED.size


def done_packer(buffer: memoryview) -> Callable[..., None]:
    """The answer's header write for the slot header ``buffer``, as a call that runs no Python
    (every request's path): ``(seq, status, result_len, queue_us, preprocess_us, infer_us,
    postprocess_us)``."""
    return functools.partial(_ANSWER.pack_into, buffer, 0, MAGIC, PROTOCOL_VERSION, SlotState.DONE)


# (state, seq, status, result_len, then the four stage timings in µs) of an answered header;
# the struct's own method, as ``unpack_request``
unpack_done = _DONE.unpack_from


def dtype_code(dtype: np.dtype) -> int:
    try:
        return DTYPE_CODES[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel on the wire") from None


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class TensorDesc:
    """An input's dtype code and actual shape as written in the header."""

    dtype: int
    shape: tuple[int, ...]


@dataclass
class SlotHeader:
    """A slot header's fields, as ``pack_into`` writes them and ``unpack`` decodes them (only
    decodes: callers validate every value)."""

    seq: int = 0
    state: int = SlotState.FREE
    status: int = 0
    priority: int = 0
    timeout_us: int = 0
    result_len: int = 0
    queue_us: int = 0
    preprocess_us: int = 0
    infer_us: int = 0
    postprocess_us: int = 0
    inputs: list[TensorDesc] = field(default_factory=list)
    stream: int = 0
    superseded_before: int = 0
    refused_before: int = 0
    skipped_before: int = 0
    frame: int = 0
    captured_us: int = 0
    magic: bytes = MAGIC
    version: int = PROTOCOL_VERSION

    def pack_into(self, buffer: memoryview | bytearray, offset: int = 0) -> None:
        count, block = pack_descriptors(self.inputs)
        buffer[offset + _FIXED.size : offset + _HEADER_USED] = block
        _FIXED.pack_into(
            buffer,
            offset,
            self.magic,
            self.version,
            self.state,
            self.seq,
            self.status,
            self.priority,
            count,
            0,
            self.timeout_us,
            self.result_len,
            self.queue_us,
            self.preprocess_us,
            self.infer_us,
            self.postprocess_us,
        )
        _STREAM.pack_into(
            buffer,
            offset + STREAM_AT,
            self.stream,
            self.superseded_before,
            self.refused_before,
            self.skipped_before,
            self.frame,
            self.captured_us,
        )

    @classmethod
    def unpack(cls, buffer: memoryview | bytes, offset: int = 0) -> SlotHeader:
        """Decode a header copy; raises ValueError only for a count that cannot be decoded."""
        (
            magic,
            version,
            state,
            seq,
            status,
            priority,
            n_inputs,
            _flags,
            timeout_us,
            result_len,
            queue_us,
            preprocess_us,
            infer_us,
            postprocess_us,
        ) = _FIXED.unpack_from(buffer, offset)
        if n_inputs > MAX_INPUTS:
            raise ValueError(f"header declares {n_inputs} inputs (at most {MAX_INPUTS})")
        inputs = []
        at = offset + _FIXED.size
        for _ in range(n_inputs):
            dtype, rank, *dims = _TENSOR.unpack_from(buffer, at)
            if rank > MAX_RANK:
                raise ValueError(f"header declares rank {rank} (at most {MAX_RANK})")
            inputs.append(TensorDesc(dtype, tuple(dims[:rank])))
            at += _TENSOR.size
        stream, superseded, refused, skipped, frame_number, captured_us = _STREAM.unpack_from(
            buffer, offset + STREAM_AT
        )
        return cls(
            seq=seq,
            state=state,
            status=status,
            priority=priority,
            timeout_us=timeout_us,
            result_len=result_len,
            queue_us=queue_us,
            preprocess_us=preprocess_us,
            infer_us=infer_us,
            postprocess_us=postprocess_us,
            inputs=inputs,
            stream=stream,
            superseded_before=superseded,
            refused_before=refused,
            skipped_before=skipped,
            frame=frame_number,
            captured_us=captured_us,
            magic=magic,
            version=version,
        )


# Tensor records in a slot's output area (raw results): dtype, rank, dims, then the data at the
# next 64-byte boundary; records follow each other in the model's output order.
TENSOR_RECORD = struct.Struct("<BB2x" + "Q" * MAX_RANK)


def frame(kind: FrameKind, payload: bytes) -> bytes:
    return FRAME.pack(len(payload), kind) + payload
