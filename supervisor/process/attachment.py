"""The supervisor's side of one attached ring: one client's slots for one model.

Created by the reactor on ``attach``, laid out by ``layout_for``: the model's slot spec, with
the input areas a producer asked to grow for a larger frame (``attach``'s ``inputs``; charged
in full by ``ring_charge``). ``submit`` runs when a "slot ready" notice arrives, called by the
intake (``supervisor.process.intake``) on the thread reading the client's connection (the reactor,
or the model's idle worker it is lent to: one at a time, see ``supervisor.process.lending``): it
copies the slot header out of shared memory once, validates every field against the model's slot
layout (the client may rewrite the header afterwards; only the copy is used), builds numpy
views of the inputs and queues the request.
Input descriptors byte-equal to the ones last accepted for that slot were validated then: their
payload is reused as it is.
``_complete`` runs on the model's worker thread: it writes the result (or the error) into the
slot and sends the "slot done" notice.

Invariants: a slot is in flight at most once; every accepted slot is answered exactly once (or
dropped with its client); the segment is unmapped only when no request still reads it. A slot
whose batch the watchdog abandoned is answered at once but stays reserved until that batch's
thread really ends (it may still read the input and write outputs in place): a resubmit of it
meanwhile is UNAVAILABLE.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Protocol

import numpy as np
import orjson
import structlog

from duomo.ipc.errors import (
    DuomoError,
    ErrorCode,
    InternalError,
    InvalidArgumentError,
    ModelChangedError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    echoed,
)
from duomo.ipc.framing import notice_packer
from duomo.ipc.ring import RingLayout, SlotRing, write_tensors
from duomo.ipc.wire import (
    DESCRIPTORS,
    DTYPES,
    MAGIC,
    MAX_TIMEOUT_US,
    PROTOCOL_VERSION,
    SlotHeader,
    SlotState,
    TensorDesc,
    done_packer,
    dtype_code,
    unpack_request,
    unpack_stream,
)
from duomo.supervisor.dataflow.streams import StreamState
from duomo.worker.executors.base import SlotSpec, WrittenInPlace
from duomo.worker.request import Outcome, Request, StageTimings
from duomo.worker.stats import ModelStats

log = structlog.get_logger("duomo.attachment")
PRIORITY_LIMIT = 1000  # producers' priorities are clamped to the range a config may use
_SUBMITTED = int(SlotState.SUBMITTED)


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class Servable(Protocol):
    """What an attachment serves: a model (``worker.served_model.ServedModel``) or a pipeline
    (``supervisor.dataflow.pipelines.ServedPipeline``)."""

    @property
    def reader(self) -> str: ...  # the model whose idle workers may read its producers

    @property
    def spec(self) -> _Named: ...
    @property
    def stats(self) -> ModelStats: ...
    @property
    def layout_known(self) -> bool: ...
    def slot_spec(self) -> SlotSpec: ...
    def payload_builder(self) -> Callable[[dict[str, np.ndarray], memoryview], Any]: ...
    def enqueue(self, request: Request) -> None: ...


GROWTH_STEP = 1 << 20  # a grown input area is rounded up to this (a slightly larger frame fits)


def layout_for(spec: SlotSpec, slots: int, grow: Mapping[str, int] | None = None) -> RingLayout:
    """The ring layout for ``spec`` with ``slots`` slots. ``grow`` (input -> the bytes a
    producer's frame needs: ``attach``'s ``inputs``) enlarges those areas past the model's
    default, rounded up to ``GROWTH_STEP``; INVALID_ARGUMENT for an input the model does not
    have, or more bytes than an input of fixed shape can ever take."""
    asked = dict(grow or {})
    inputs = []
    for i in spec.inputs:
        capacity = i.capacity
        need = asked.pop(i.name, 0)
        if need > capacity:
            if _fixed_size(i.shape, spec.max_rows):
                rows = f" at max_batch {spec.max_rows}" if spec.max_rows is not None else ""
                raise InvalidArgumentError(
                    f"input {i.name!r} of {need} bytes exceeds the slot's {capacity}, the most "
                    f"its shape {list(i.shape)} takes{rows}"
                )
            most = i.most_bytes
            if most is not None and need > most:
                raise InvalidArgumentError(
                    f"input {i.name!r} of {need} bytes is past its bound: at most "
                    f"{list(i.bound or ())}, {most} bytes"
                )
            capacity = -(-need // GROWTH_STEP) * GROWTH_STEP
        inputs.append((i.name, i.dtype, i.shape, capacity, i.bound))
    if asked:
        names = [i.name for i in spec.inputs]
        raise InvalidArgumentError(f"model has no input {echoed(next(iter(asked)))} ({names})")
    return RingLayout.build(slots, inputs, spec.result_capacity, spec.result, spec.outputs)


def _fixed_size(shape: tuple[int | None, ...], max_rows: int | None) -> bool:
    """Whether an input's default area already holds its largest tensor: every dimension is
    fixed but the batch (bounded by ``max_rows``)."""
    return all(d is not None for d in (shape[1:] if max_rows is not None else shape))


def ring_charge(spec: SlotSpec, layout: RingLayout) -> int:
    """The bytes of ring memory a ring is charged (``RingLedger``): what creating it commits, and
    every input area grown past ``spec``'s default in full, in every slot (a producer asked
    for that room; the defaults are bounded by the model)."""
    defaults = {i.name: i.capacity for i in spec.inputs}
    grown = sum(a.capacity for a in layout.inputs if a.capacity > defaults.get(a.name, 0))
    return layout.reserved_bytes + layout.slots * grown


class Attachment:
    """One client's ring for one model, on the supervisor's side: ``submit`` validates a ready
    slot and queues its request; the answer is written back into the slot."""

    def __init__(
        self,
        ring_id: int,
        model: Servable,
        models: Mapping[str, Servable],
        layout: RingLayout,
        send: Callable[[bytes], None],
        on_close: Callable[[], None] | None = None,
        streams: Mapping[int, StreamState] | None = None,
        flow: Hashable = None,
    ) -> None:
        """``layout``: ``layout_for(model.slot_spec(), slots, grow)``; ``on_close`` runs once
        when the ring is detached (the supervisor gives back what it charged for it);
        ``streams``: the connection's open streams by id (``Connection.streams``), which its
        slots may name; ``flow``: the connection's own flow, its plain requests'."""
        self.ring_id = ring_id
        self.model_name = model.spec.name
        # whose idle workers may borrow the connection (``supervisor.process.lending``): the model's
        # own, or a pipeline's first step's
        self.reader = model.reader
        self._models = models  # by name at every request, so a reload's replacement serves it
        self.spec = model.slot_spec()
        self._json = self.spec.result == "json"  # else tensors
        self.layout = layout
        slots = layout.slots
        self._on_close = on_close
        self._model = model  # the model the layout was made for; a reload may replace it
        self._payload_from_slot: Callable[[dict[str, np.ndarray], memoryview], Any] = (
            model.payload_builder()
        )
        self._dtypes = [np.dtype(a.dtype) for a in self.layout.inputs]
        self._codes = [dtype_code(d) for d in self._dtypes]
        self.ring = SlotRing.create(self.layout)  # after the checks: one that fails leaves none
        self._headers = [self.ring.header(i) for i in range(slots)]
        self._outputs = [self.ring.output(i) for i in range(slots)]
        # slot -> (input count, descriptor block, payload) last accepted: a producer that sends
        # the same shapes again is not validated and given views again
        self._accepted: list[tuple[int, bytes, Any] | None] = [None] * slots
        self._send = send  # the connection's: frames to the client, from any thread
        self._streams: Mapping[int, StreamState] = streams if streams is not None else {}
        self._flow = flow
        # slot -> (its stream, capture time) while a stream's frame is in it: its answer counts
        self._stream_of: list[tuple[StreamState, float] | None] = [None] * slots
        self._lock = threading.Lock()
        # slot -> its queued request (None between acceptance and queueing); the thread reading
        # the connection alone adds entries, and fills them in before it queues their requests
        self._in_flight: dict[int, Request | None] = {}
        self._seqs = [0] * slots  # the sequence number of each slot's request in flight
        # each slot's answer, made once: no callback is built per request
        self._answers = [functools.partial(self._complete, slot) for slot in range(slots)]
        self._notices = [notice_packer(ring_id, slot) for slot in range(slots)]
        self._write_done = [done_packer(header) for header in self._headers]
        self._closing = False
        self.closed = False
        self.answered = 0

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def submit(self, slot: int, seq: int) -> None:
        """Validate and queue slot ``slot``; an invalid slot is answered at once with an error.
        Raises (nothing answered) for a slot that does not exist or is already in flight."""
        if not 0 <= slot < self.layout.slots:
            raise InvalidArgumentError(
                f"slot {slot} is out of range (ring {self.ring_id} has {self.layout.slots})"
            )
        with self._lock:
            if self._closing:
                return
            if slot in self._in_flight:
                raise self._busy(slot)
            self._in_flight[slot] = None
        self._seqs[slot] = seq
        self._stream_of[slot] = None
        try:
            header = bytes(self._headers[slot])  # the one read; only this copy is used below
            magic, version, state, header_seq, priority, count, timeout_us = unpack_request(header)
            model = self._models.get(self.model_name)
            if (
                magic != MAGIC
                or version != PROTOCOL_VERSION
                or state != _SUBMITTED
                or header_seq != seq
                or not 0 <= timeout_us <= MAX_TIMEOUT_US
                or model is not self._model
            ):
                model = self._check(magic, version, state, header_seq, seq, timeout_us, model)
            if not -PRIORITY_LIMIT <= priority <= PRIORITY_LIMIT:
                priority = max(-PRIORITY_LIMIT, min(PRIORITY_LIMIT, priority))
            accepted = self._accepted[slot]  # the same inputs as last time: the same payload
            if accepted is not None and accepted[0] == count and accepted[1] == header[DESCRIPTORS]:
                payload = accepted[2]
            else:
                payload = self._accept(slot, count, header)
            now = time.monotonic()
            deadline_s = now + timeout_us / 1e6 if timeout_us else None
            request = Request(
                payload, self._answers[slot], priority, deadline_s, now, flow=self._flow
            )
            stream_block = unpack_stream(header)
            if stream_block[0]:
                self._streamed(request, model, slot, stream_block, now)
            self._in_flight[slot] = request  # cancellable by ``close`` from now on
            model.enqueue(request)
        except DuomoError as err:
            self._refuse(slot, err)
        except ValueError as err:  # a header that cannot even be decoded
            self._refuse(slot, InvalidArgumentError(str(err)))
        except Exception:  # a bug here must still answer the slot, and never reach the reactor
            log.exception("could not queue a slot", model=self.model_name, slot=slot)
            self._refuse(
                slot, InternalError(f"could not queue the request for model {self.model_name!r}")
            )

    def _streamed(
        self,
        request: Request,
        model: Servable,
        slot: int,
        stream_block: tuple[int, int, int, int, int, int],
        now: float,
    ) -> None:
        """Make ``request`` its stream's: its flow and weight, superseding under ``latest``,
        and counted as arrived with what the source did with the frames before it (the
        header's ``stream_block``: ``ipc.wire.unpack_stream``), feeding ``model``'s load; its
        answer is counted in ``_complete``."""
        stream_id, superseded, refused, skipped, _frame, captured_us = stream_block
        stream = self._streams.get(stream_id)
        if stream is None:
            raise InvalidArgumentError(f"stream {stream_id} is not open on this connection")
        settings = stream.settings
        if self.model_name not in settings.models:
            raise InvalidArgumentError(
                f"stream {stream.name!r} was opened for {list(settings.models)}, "
                f"not model {self.model_name!r}"
            )
        request.flow, request.weight = stream, settings.weight
        request.supersedes = settings.supersedes
        captured_s = captured_us / 1e6 if 0 < captured_us / 1e6 <= now else now
        self._stream_of[slot] = (stream, captured_s)
        stream.received(self.model_name, now, model.stats.streams, superseded, refused, skipped)

    def _refuse(self, slot: int, error: DuomoError) -> None:
        """Answer a request that was not queued, and count it against its model."""
        model = self._models.get(self.model_name)
        if model is not None:
            model.stats.record_refusal(error.code)
        self._complete(slot, Outcome(error=error))

    def _busy(self, slot: int) -> DuomoError:
        held = self._in_flight[slot]
        if held is not None and held.abandoned:
            return UnavailableError(
                f"slot {slot} is still held by a batch the watchdog abandoned (it may "
                "still write into it); use another slot"
            )
        return InvalidArgumentError(f"slot {slot} is already in flight")

    def _check(
        self,
        magic: bytes,
        version: int,
        state: int,
        header_seq: int,
        seq: int,
        timeout_us: int,
        model: Servable | None,
    ) -> Servable:
        """A header that is not the usual case: raise its error, or return the model that now
        serves it (a reload that kept the layout)."""
        if magic != MAGIC:
            raise InvalidArgumentError(f"bad slot header magic {magic!r}")
        if version != PROTOCOL_VERSION:
            raise InvalidArgumentError(
                f"the slot header is protocol version {version}; this supervisor speaks version "
                f"{PROTOCOL_VERSION}: use a duomo client library of the supervisor's release"
            )
        if state != SlotState.SUBMITTED:
            raise InvalidArgumentError(f"slot state is {state}, not SUBMITTED")
        if header_seq != seq:
            raise InvalidArgumentError("slot header sequence number does not match the notice")
        if not 0 <= timeout_us <= MAX_TIMEOUT_US:
            raise InvalidArgumentError(f"timeout of {timeout_us} µs is out of range")
        if model is None:
            raise NotFoundError(f"model {self.model_name!r} is no longer served (reloaded)")
        if model is not self._model:  # a reload replaced the model
            if not model.layout_known or model.slot_spec() != self.spec:
                raise ModelChangedError(
                    f"model {self.model_name!r} was reloaded with another input/output "
                    "layout; attach it again (the client library does so by itself)"
                )
            self._model, self._payload_from_slot = model, model.payload_builder()
            self._accepted = [None] * self.layout.slots
        return model

    def _accept(self, slot: int, count: int, header: bytes) -> Any:
        """The executor's payload for the inputs ``header`` declares (other inputs than the
        slot's last request), validated, and kept for the next request that declares them."""
        self._accepted[slot] = None
        views = self._validate(slot, SlotHeader.unpack(header).inputs)
        payload = self._payload_from_slot(views, self._outputs[slot])
        self._accepted[slot] = (count, header[DESCRIPTORS], payload)
        return payload

    def _validate(self, slot: int, inputs: list[TensorDesc]) -> dict[str, np.ndarray]:
        """Input views for the declared ``inputs``, each checked against this model's slot."""
        areas = self.layout.inputs
        if len(inputs) != len(areas):
            raise InvalidArgumentError(
                f"model {self.model_name!r} takes {len(areas)} input(s), "
                f"the header declares {len(inputs)}"
            )
        views: dict[str, np.ndarray] = {}
        for index, (desc, area, dtype) in enumerate(zip(inputs, areas, self._dtypes)):
            if desc.dtype != self._codes[index]:
                got = DTYPES[desc.dtype].name if desc.dtype < len(DTYPES) else f"code {desc.dtype}"
                raise InvalidArgumentError(f"input {area.name!r} must be {area.dtype}, got {got}")
            shape = desc.shape
            if len(shape) != len(area.shape):
                raise InvalidArgumentError(
                    f"input {area.name!r} has shape {list(shape)}, expected rank {len(area.shape)}"
                )
            if min(shape, default=1) < 1:
                raise InvalidArgumentError(
                    f"input {area.name!r} has shape {list(shape)}: every dimension must be at "
                    "least 1"
                )
            if self.spec.max_rows is not None and shape[0] > self.spec.max_rows:
                raise InvalidArgumentError(
                    f"input {area.name!r} has a batch of {shape[0]} rows, "
                    f"above max_batch {self.spec.max_rows}"
                )
            if any(p is not None and p != d for p, d in zip(area.shape, shape)):
                raise InvalidArgumentError(
                    f"input {area.name!r} shape {list(shape)} does not fit {list(area.shape)}"
                )
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes > area.capacity:
                raise InvalidArgumentError(
                    f"input {area.name!r} of {nbytes} bytes exceeds the slot's {area.capacity}"
                )
            views[area.name] = self.ring.input_view(slot, index, dtype, shape)
        return views

    def _complete(self, slot: int, outcome: Outcome) -> None:
        """Write the outcome into the slot and notify the client (any thread); every accepted
        slot gets exactly one answer, an INTERNAL one if writing the real one failed."""
        seq = self._seqs[slot]  # the slot stays reserved until below: nobody rewrites it
        closing = self._closing  # (read once: the ring stays mapped while the slot is in flight)
        streamed = self._stream_of[slot]
        if streamed is not None:  # counted before the answer goes out
            stream, captured_s = streamed
            now = time.monotonic()
            stream.answered(self.model_name, outcome.code, now - captured_s, now)
        if not closing:
            try:
                status, used = self._encode(outcome, self._outputs[slot])
                self._write_done[slot](seq, status, used, *_timings_us(outcome.timings))
            except Exception:
                log.exception("could not write a slot's answer", model=self.model_name, slot=slot)
                with contextlib.suppress(Exception):
                    area = self._outputs[slot]
                    text = f"internal error writing the result of model {self.model_name!r}"
                    message = text.encode()[: len(area)]
                    area[: len(message)] = message
                    self._write_done[slot](seq, ErrorCode.INTERNAL, len(message), 0, 0, 0, 0)
        with self._lock:
            # forgotten before the notice: the client may resubmit the slot the moment it hears;
            # a slot whose batch was abandoned stays reserved until that batch really ends
            request = self._in_flight.get(slot)
            if not (
                outcome.abandoned
                and request is not None
                and request.hold_until_batch_over(lambda: self._release_held(slot))
            ):
                self._in_flight.pop(slot, None)
            finished = self._closing and not self._in_flight
        if not closing:
            self._send(self._notices[slot](seq))
            self.answered += 1
        if finished:
            self._unmap()

    def _release_held(self, slot: int) -> None:
        """The abandoned batch that held ``slot`` has ended (on that batch's thread)."""
        with self._lock:
            self._in_flight.pop(slot, None)
            finished = self._closing and not self._in_flight
        if finished:
            self._unmap()

    def _encode(self, outcome: Outcome, area: memoryview) -> tuple[int, int]:
        result, error = outcome.result, outcome.error
        if error is None:
            try:
                if self._json:
                    blob = orjson.dumps(result)
                    if len(blob) > len(area):
                        raise ValueError(
                            f"result of {len(blob)} bytes exceeds the slot's {len(area)}"
                        )
                    area[: len(blob)] = blob
                    return ErrorCode.OK, len(blob)
                if isinstance(result, WrittenInPlace):
                    return ErrorCode.OK, result.nbytes
                return ErrorCode.OK, write_tensors(area, [result[n] for n in self.spec.outputs])
            except ValueError as err:
                error = ResourceExhaustedError(str(err))
        message = error.message.encode()[: len(area)]
        area[: len(message)] = message
        return error.code, len(message)

    def close(self) -> None:
        """The client detached or went away: drop its queued work, unmap once nothing reads."""
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()
        with self._lock:
            self._closing = True
            for request in self._in_flight.values():
                if request is not None:
                    request.cancelled = True
            finished = not self._in_flight
        if finished:
            self._unmap()

    def _unmap(self) -> None:
        # Numpy views that a finished batch still references keep the mapping alive until they
        # are collected (then ``retry_unmap`` succeeds); the segment has no name, so nothing
        # outlives the last mapping.
        with self._lock:
            self._try_unmap()

    def retry_unmap(self) -> bool:
        """Try again to unmap a closed attachment whose last views were still alive."""
        with self._lock:
            if self._closing and not self._in_flight:
                self._try_unmap()
            return self.closed

    def _try_unmap(self) -> None:
        if self.closed:
            return
        self._accepted = [None] * self.layout.slots  # first: its payloads hold views
        with contextlib.suppress(BufferError):  # views still alive; the next try releases it
            for view in (*self._headers, *self._outputs):
                view.release()
        self.closed = self.ring.close()


_US_MAX = 0xFFFFFFFF  # what a header's 32-bit stage timing holds


def _timings_us(t: StageTimings) -> tuple[int, int, int, int]:
    """The stage timings as the header's µs fields (clamped to them)."""
    return (
        min(max(int(t.queue_s * 1e6), 0), _US_MAX),
        min(max(int(t.preprocess_s * 1e6), 0), _US_MAX),
        min(max(int(t.infer_s * 1e6), 0), _US_MAX),
        min(max(int(t.postprocess_s * 1e6), 0), _US_MAX),
    )
