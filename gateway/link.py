"""The supervisor as one gateway worker sees it: the connection, the models' wire views, and a
ring of slots per model through which requests run.

Owned by the worker's event loop (``gateway.main``). The loop is the client's one reader
(``Client.read_in_loop``): it reads the socket when it is readable and the slots' answers
complete the requests awaiting them, with no thread in between. What blocks — connecting,
attaching a model (which may load it), control messages — runs on executor threads, which
wait for the loop to read their replies.

Concurrency is bounded by the slots: a request that finds every slot of its model in flight is
answered RESOURCE_EXHAUSTED at once (HTTP 429), never queued. When the supervisor goes away
every request in flight fails UNAVAILABLE, readiness turns false, and the link reconnects with
back-off; requests meanwhile fail UNAVAILABLE at once.

A request that names a stream (``gateway.streams``) runs as a frame of it: the worker's
``GatewayStreams`` opens the stream on this connection first (control messages, off the loop),
and the slot carries its stream block. The streams end with the connection and are opened
again on the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from duomo.gateway.protocol import ModelView, model_view
from duomo.gateway.streams import GatewayStreams, StreamRequest, StreamTag
from duomo.ipc.client import Client, ModelHandle, Slot
from duomo.ipc.errors import (
    DeadlineExceededError,
    DuomoError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from duomo.ipc.status_records import ModelInfo, ModelStatus, SupervisorStatus

log = structlog.get_logger("duomo.gateway.link")
T = TypeVar("T")
RECONNECT_FIRST_S = 0.1
RECONNECT_MAX_S = 2.0
REFRESH_S = 2.0  # the models' states are read again this often
ANSWER_GRACE_S = 5.0  # past a request's own timeout, how long the gateway waits for its answer
UNKNOWN_REFRESH_S = 1.0  # a name not known reads the models again at most this often


class SupervisorLink:
    """One gateway worker's way to the supervisor: the connection (reconnected with back-off),
    the models' wire views, and a ring of slots per model its requests run through."""

    def __init__(self, socket_path: Path, slots: int, request_timeout_s: float) -> None:
        self.socket_path = socket_path
        self.slots = slots
        self.request_timeout_s = request_timeout_s
        self.client: Client | None = None
        self.views: dict[str, ModelView] = {}
        self.supervisor_pid: int | None = None
        self._handles: dict[str, ModelHandle] = {}
        self.taken: Counter[str] = Counter()  # slots taken per model (``MemoryKeeper`` reads it)
        self._attaching: dict[str, asyncio.Future[ModelHandle]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1  # the client's socket, watched by the loop
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._lost = asyncio.Event()  # set when the connection drops: reconnect at once
        self._refreshed_s = 0.0  # when an unknown name last made the models be read again
        self._closing = False
        self.streams = GatewayStreams(self._client)

    @property
    def ready(self) -> bool:
        return self.client is not None and self.client.connected

    async def start(self) -> None:
        """Connect in the background (and again whenever the supervisor goes away)."""
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._keep_connected())
        self.streams.start()

    async def wait_connected(self, timeout_s: float) -> bool:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._connected.wait(), timeout_s)
        return self.ready

    async def close(self) -> None:
        self._closing = True
        await self.streams.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._drop()

    # -- the connection -------------------------------------------------------------------

    async def _keep_connected(self) -> None:
        delay_s = RECONNECT_FIRST_S
        while not self._closing:
            try:
                await self._connect()
            except (DuomoError, OSError) as err:
                log.info("supervisor not reachable", socket=str(self.socket_path), error=str(err))
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, RECONNECT_MAX_S)
                continue
            delay_s = RECONNECT_FIRST_S
            log.info(
                "connected to the supervisor", pid=self.supervisor_pid, models=list(self.views)
            )
            while self.ready and not self._closing:  # the loop's reader drops it when it goes
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._lost.wait(), REFRESH_S)
                if self.ready:
                    with contextlib.suppress(DuomoError):
                        await self.refresh()
            if not self._closing:
                log.warning("lost the supervisor; reconnecting", socket=str(self.socket_path))

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        client = await loop.run_in_executor(None, functools.partial(Client, self.socket_path))
        try:
            models = await loop.run_in_executor(None, client.models)
            handles = {}
            for info in models:  # attach what is loaded now; the rest when first asked for
                if info.loaded and info.state in ("READY", "DEGRADED"):
                    handles[info.name] = await loop.run_in_executor(
                        None, functools.partial(client.model, info.name, self.slots)
                    )
            status = await loop.run_in_executor(None, client.status)
        except BaseException:
            client.close()
            raise
        self._fd = client.read_in_loop()
        loop.add_reader(self._fd, self._readable)
        self.client = client
        self.supervisor_pid = status.pid
        self._handles = handles
        self.views = {info.name: model_view(info) for info in models}
        self._lost.clear()
        self._connected.set()

    def _readable(self) -> None:
        client = self.client
        if client is None:
            return
        client.read_available()
        if not client.connected:
            self._drop()

    def _drop(self) -> None:
        client, self.client = self.client, None
        self._connected.clear()
        self._lost.set()
        self._handles = {}
        if client is None:
            return
        if self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._fd)
        client.close()  # (every request in flight has been failed UNAVAILABLE)

    def _client(self) -> Client:
        client = self.client
        if client is None or not client.connected:
            raise UnavailableError(f"no supervisor at {self.socket_path} (reconnecting)")
        return client

    # -- models ---------------------------------------------------------------------------

    async def control(
        self, op: str, timeout_s: float | None = None, **fields: Any
    ) -> dict[str, Any]:
        """One control message, answered on an executor thread (the loop reads the reply)."""
        client = self._client()
        call = functools.partial(client.request, op, timeout_s, **fields)
        return await asyncio.get_running_loop().run_in_executor(None, call)

    async def refresh(self) -> None:
        reply = await self.control("models")
        models = (ModelInfo.from_dict(info) for info in reply["models"])
        self.views = {info.name: model_view(info) for info in models}

    async def model_statuses(self, name: str | None = None) -> dict[str, ModelStatus]:
        """Every model's status by name; with ``name``, that model's alone, asked for alone
        (NOT_FOUND when it is not served)."""
        if name is not None:
            reply = await self.control("status", model=name)
            return {name: ModelStatus.from_dict(reply.get("model_status"))}
        reply = await self.control("status")
        return SupervisorStatus.from_dict(reply.get("status")).models

    async def view(self, name: str) -> ModelView:
        """``name``'s wire view (the models are read again once for a name not known)."""
        self._client()
        view = self.views.get(name)
        now = time.monotonic()
        if view is None and now - self._refreshed_s > UNKNOWN_REFRESH_S:  # (a new model, maybe)
            self._refreshed_s = now
            await self.refresh()
            view = self.views.get(name)
        if view is None:
            raise NotFoundError(f"no model named {name[:100]!r} (serving: {sorted(self.views)})")
        return view

    async def _handle(self, name: str) -> ModelHandle:
        handle = self._handles.get(name)
        if handle is not None:
            return handle
        pending = self._attaching.get(name)
        if pending is None:  # attach (which loads a model not loaded yet) off the loop
            client = self._client()
            loop = asyncio.get_running_loop()
            pending = asyncio.ensure_future(
                loop.run_in_executor(None, functools.partial(client.model, name, self.slots))
            )
            self._attaching[name] = pending
            try:
                handle = await pending
            finally:
                self._attaching.pop(name, None)
            if self.client is client:
                self._handles[name] = handle
                with contextlib.suppress(DuomoError):
                    await self.refresh()  # its layout is known now
            return handle
        return await asyncio.shield(pending)

    def handles(self) -> dict[str, ModelHandle]:
        """The models attached on the current connection, and their handles."""
        return dict(self._handles)

    def forget(self, name: str) -> None:
        """``name`` was unloaded through this gateway: attach it afresh when next asked for."""
        handle = self._handles.pop(name, None)
        if handle is not None:
            with contextlib.suppress(DuomoError):
                handle.close()

    # -- requests -------------------------------------------------------------------------

    async def run(
        self,
        name: str,
        write: Callable[[Slot], None],
        read: Callable[[Slot], T],
        timeout_s: float | None = None,
        stream: StreamRequest | None = None,
    ) -> T:
        """One request through a slot of ``name``: ``write`` fills its inputs, the supervisor
        answers, ``read`` takes what it needs from the answered slot (which is released after).
        RESOURCE_EXHAUSTED at once when every slot is in flight. With ``stream``, the request
        is a frame of that stream (``gateway.streams``: opened on the supervisor first)."""
        handle = await self._handle(name)
        tag = await self.streams.tag(stream, name) if stream is not None else None
        try:
            return await self._run(handle, write, read, timeout_s, tag)
        finally:
            if stream is not None:
                self.streams.release(stream)

    async def _run(
        self,
        handle: ModelHandle,
        write: Callable[[Slot], None],
        read: Callable[[Slot], T],
        timeout_s: float | None,
        tag: StreamTag | None,
    ) -> T:
        name = handle.name
        try:
            slot = handle.slot(timeout_s=0)
        except DeadlineExceededError:
            raise ResourceExhaustedError(
                f"all {self.slots} slots of this gateway worker for {name!r} are in flight; "
                "retry, or raise gateway.slots / gateway.workers"
            ) from None
        self.taken[name] += 1
        wait_s = timeout_s or self.request_timeout_s
        loop = asyncio.get_running_loop()
        timer = None
        try:
            write(slot)
            if tag is not None:
                slot.set_stream(tag.stream_id, tag.frame, tag.captured_us)
            answered: asyncio.Future[None] = loop.create_future()

            def done(_: Slot) -> None:
                if not answered.done():
                    answered.set_result(None)

            slot.on_done = done
            slot.submit(timeout_s=wait_s)
            # (a timer, not asyncio.wait_for: it costs a task per request)
            timer = loop.call_later(wait_s + ANSWER_GRACE_S, _expire, answered)
            await answered
            return read(slot)
        except asyncio.TimeoutError:
            raise DeadlineExceededError(
                f"no answer from {name!r} within {wait_s + ANSWER_GRACE_S:g} s"
            ) from None
        finally:
            if timer is not None:
                timer.cancel()
            slot.release()  # (still in flight: it comes back when answered)


def _expire(answered: asyncio.Future[None]) -> None:
    if not answered.done():
        answered.set_exception(asyncio.TimeoutError())
