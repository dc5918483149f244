"""What a producer does with an attached model: ``ModelHandle``, what ``Client.model`` returns.

A handle runs requests (``infer``, ``infer_timed``, ``infer_async``), hands out slots for
zero-copy use (``slot``), answers whether an input can ever be taken (``check_input``), gives
memory back (``trim``) and detaches (``close``). The rings and slots behind it are its
``ipc.slots.SlotPool``'s: which slots are free, the re-attach after a reload changed the
model's layout, the growth of a ring for a larger frame. The handle reaches the connection
only through ``ipc.slots.HandleLink`` (``ipc.link.ClientLink`` implements it), which it gets
from ``ipc.client.Client.model``; this module imports neither the link nor the client.

``infer_async`` counts each request as outstanding on the link (``HandleLink.async_started``)
until its answer, so that someone reads the socket while nobody waits; its future completes
on the reading thread.

Invariants: a handle has exactly one pool, for its life; its ``ring_id``, ``ring`` and
``layout`` are always the pool's current ring's; a request taken by ``infer`` gives its slot
back whatever happens (``infer_async``'s: once answered).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from duomo.ipc.errors import DuomoError, InvalidArgumentError, ModelChangedError
from duomo.ipc.ring import RingLayout, SlotRing
from duomo.ipc.slots import HandleLink, Slot, SlotPool


class ModelHandle:
    """One attached model: a ring of slots in shared memory (what ``Client.model`` returns).

    Each slot holds one request at a time, so the ring's size bounds the requests in flight:
    ``infer`` and ``infer_async`` take a free slot and block while every slot is in flight.
    A handle may be shared by threads.

    When a reload changes the model's inputs or outputs, requests answer MODEL_CHANGED
    (``ModelChangedError``); the handle then re-attaches by itself as soon as all its slots are
    back (the next ``slot()`` does it), and ``infer`` retries its request once on the new ring.
    A frame larger than the ring's area for it grows the ring (see ``ipc.slots``);
    RESOURCE_EXHAUSTED when the supervisor's limits on ring memory leave no room for it.

    Example:
        classify = client.model("classify", slots=8)
        result = classify.infer(image, timeout_s=0.5, priority=10)
        futures = [classify.infer_async(f) for f in frames]  # at most 8 in flight
        results = [f.result() for f in futures]
        classify.close()

    Attributes:
        client: The client it was attached through.
        name: The model's name.
    """

    def __init__(
        self, client: Any, link: HandleLink, name: str, ring_id: int, ring: SlotRing
    ) -> None:
        """Made by ``Client.model``, never directly: ``client`` (reached through ``link``)
        has attached ring ``ring_id`` (mapped as ``ring``) for model ``name``."""
        self.client = client  # (``ipc.Client``; this module does not import ``ipc.client``)
        self.name = name
        self._link = link
        self._pool = SlotPool(self, link, name, ring_id, ring)

    @property
    def ring_id(self) -> int:
        """The current ring's id on the connection (a ring grown or re-attached has a new
        one)."""
        return self._pool.ring_id

    @property
    def layout(self) -> RingLayout:
        """The current ring's layout (``ipc.ring.RingLayout``): its slots, input areas,
        outputs."""
        return self._pool.layout

    @property
    def ring(self) -> SlotRing:
        """The current ring's mapping (``ipc.ring.SlotRing``): its slots' headers, inputs and
        outputs in shared memory."""
        return self._pool.ring

    def check_input(self, name: str, shape: tuple[int, ...]) -> None:
        """Whether the model can ever take input ``name`` at ``shape``, asked before anything
        is reserved for it (a gateway checks a request so before it reads the tensor).

        Raises:
            InvalidArgumentError: The model has no input ``name``, or ``shape`` is past the
                bound the model states (an image task's frame: 16384 pixels a side).
        """
        found = self._pool.inputs.get(name)
        if found is None:
            raise InvalidArgumentError(f"{self.name!r} has no input {name!r}")
        found.area.check(tuple(map(int, shape)))

    def slot(self, timeout_s: float | None = None) -> Slot:
        """A free slot, held until released (``with`` or ``release()``).

        Returns at once while a slot is free. While every slot is in flight it blocks until
        one is released, for at most ``timeout_s``, reading the socket like any waiter, so
        answers that free a slot arrive even when nobody else is waiting. ``timeout_s=0``
        (or less) never waits: with no slot free it raises at once. A handle whose model
        changed its layout first re-attaches once all its slots are back: two control round
        trips (``detach``, ``attach``), even under ``timeout_s=0``.

        Args:
            timeout_s: The longest wait for a free slot, in seconds; None: no bound.

        Returns:
            The slot, held by the caller.

        Raises:
            DeadlineExceededError: No slot was free within ``timeout_s``.
            UnavailableError: The connection is closed or lost.
            DuomoError: A re-attach's refusal (as for ``Client.model``).
        """
        return self._pool.take(timeout_s)

    def trim(self) -> int:
        """Give back the memory a burst of large frames left behind: a ring grown for them goes
        back to the model's default layout (one ``attach`` round trip; the supervisor's charge
        for it goes too), and the pages the free slots' inputs hold are released, in this
        process and the supervisor alike (one memfd). For a caller that knows the handle has
        been quiet (a gateway worker, after a quiet spell): the next frame faults in the pages
        it writes, and a larger one grows the ring again. A slot held or in flight is left as
        it is. Returns the bytes of input area released (pages never touched count too).

        Raises:
            DuomoError: The ``attach`` of the default ring was refused (the handle keeps its
                grown ring).
        """
        return self._pool.trim()

    def infer(self, data: Any, timeout_s: float | None = None, priority: int = 0) -> Any:
        """Run one request and wait for its answer.

        Blocks first for a free slot, without bound, while every slot is in flight (see
        ``slot``), then for the answer: up to ``timeout_s`` plus ``NOTICE_GRACE_S`` (5 s) for
        the supervisor's word, or without bound when there is no ``timeout_s``. A request
        answered MODEL_CHANGED is sent again once, after the handle re-attached.

        Args:
            data: An image (a uint8 H×W×C or H×W array) for a one-input model, or a dict of
                arrays by input name; copied into the slot (``Slot.write``).
            timeout_s: The request's deadline in the supervisor, in seconds, in
                (0, 86400]; a request still queued then is answered DEADLINE_EXCEEDED without
                running. None or 0: none.
            priority: In -32768..32767 (the supervisor clamps it to -1000..1000); higher
                runs first, with aging.

        Returns:
            The result: a dict for structured tasks, ``{output: array}`` (copies) for raw
            models.

        Raises:
            InvalidArgumentError: ``data``, ``timeout_s`` or ``priority`` is not valid for
                this model, or the supervisor refused the request's inputs.
            DeadlineExceededError: The deadline passed before it ran, or no answer came
                within ``timeout_s`` plus the grace.
            ResourceExhaustedError: The model's queue is full, or the ring cannot grow for a
                larger frame.
            ModelChangedError: The model's layout changed again after the retry.
            UnavailableError: The connection is lost or closed, or the model is not serving.
            DuomoError: Any other error of the model's (``InternalError``, ``NotFoundError``),
                as its typed subclass.
        """
        return self._infer(data, timeout_s, priority, timed=False)[0]

    def infer_timed(
        self, data: Any, timeout_s: float | None = None, priority: int = 0
    ) -> tuple[Any, dict[str, int]]:
        """``infer`` (the same arguments, blocking and errors), with the supervisor's stage
        times for its answer.

        Returns:
            The result, and the stage times in µs by name: ``queue``, then ``preprocess``,
            ``infer`` and ``postprocess``, which add up to its time in the executor.
        """
        return self._infer(data, timeout_s, priority, timed=True)

    def _infer(
        self, data: Any, timeout_s: float | None, priority: int, timed: bool
    ) -> tuple[Any, dict[str, int]]:
        for retry in (False, True):
            slot = self._pool.take(None)
            try:  # (not ``with``: two calls fewer on every request)
                slot.write(data)
                slot.submit(timeout_s=timeout_s, priority=priority)
                result = slot.wait(copy=True)
                return result, (slot.timings_us if timed else {})  # (read before the release)
            except ModelChangedError:
                if retry:
                    raise
            finally:
                slot.release()
        raise AssertionError("unreachable")

    def infer_async(
        self, data: Any, timeout_s: float | None = None, priority: int = 0
    ) -> Future[Any]:
        """Submit one request and return a future for its answer.

        Blocks only while every slot is in flight, without bound, until one is free (see
        ``slot``; with ``N`` slots, the ``N+1``-th call waits for an answer), and for the
        control round trip of a ring that must grow for ``data``; it never waits for the
        answer. The future completes on the client's reading thread (a background thread
        ``duomo-client``, or the event loop of ``Client.read_in_loop``), where its callbacks
        run. Unlike ``infer`` it does not retry a MODEL_CHANGED answer.

        Args:
            data: As for ``infer``.
            timeout_s: As for ``infer``: the request's deadline in the supervisor (the
                future itself has none).
            priority: As for ``infer``.

        Returns:
            A ``concurrent.futures.Future`` of ``infer``'s result, or of its typed error.

        Raises:
            InvalidArgumentError: ``data``, ``timeout_s`` or ``priority`` is not valid.
            UnavailableError: The connection is closed or lost.
            ResourceExhaustedError: The ring cannot grow for a larger frame.
        """
        future: Future[Any] = Future()
        slot = self.slot()
        link = self._link
        try:
            slot.write(data)

            def done(s: Slot) -> None:
                link.async_finished()
                _resolve(future, s)

            slot.on_done = done
            link.async_started()
            try:
                slot.submit(timeout_s=timeout_s, priority=priority)
            except BaseException:
                slot.on_done = None
                link.async_finished()
                raise
        except BaseException:
            slot.release()
            raise
        return future

    def close(self) -> None:
        """Detach the handle's rings and unmap them.

        Blocks for one ``detach`` round trip per ring (each up to the client's
        ``timeout_s``; their errors are ignored: a ring the supervisor freed already is
        detached). Requests still in flight on this handle fail with ``UnavailableError``."""
        self._pool.close()


def _resolve(future: Future[Any], slot: Slot) -> None:
    """Complete an ``infer_async`` future from its answered slot (on the reading thread)."""
    try:
        result: Any = slot.wait(timeout_s=0, copy=True)
        failed = False
    except DuomoError as err:
        result, failed = err, True
    slot.release()  # before the callbacks run: one of them may want a slot of its own
    if not future.set_running_or_notify_cancel():
        return  # cancelled by the caller; nobody wants the answer
    if failed:
        future.set_exception(result)
    else:
        future.set_result(result)
