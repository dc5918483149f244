"""Streams through the gateway: a remote caller's camera, named in the request's ``parameters``,
as a stream of the supervisor (``supervisor.dataflow.streams``) opened on this worker's connection.

**The parameters** (``stream_parameters``; each checked, INVALID_ARGUMENT naming it):

==================  ===========================================================================
``stream``          the stream's name, 1..64 printable characters (without it: a plain request)
``frame``           the frame number, an integer ≥ 0 (default: this worker counts, per stream,
                    from 0)
``captured_us``     when the frame was captured, an integer of µs since the UNIX epoch (a remote
                    caller does not share this host's monotonic clock); turned into the monotonic
                    clock on arrival (``time.time()`` and ``time.monotonic()`` read together) and
                    never later than the arrival. Default: the arrival
``stream_policy``   ``latest`` (default) or ``fifo``
==================  ===========================================================================

A frame's answer says which stream and frame it was (``duomo_stream``, ``duomo_frame``) and when
it was captured on the wall clock: ``duomo_captured_at`` (RFC 3339, UTC, ms) with
``duomo_clock`` ``caller`` (its ``captured_us``) or ``arrival`` (the gateway's receipt).

``frame``, ``captured_us`` and ``stream_policy`` without ``stream`` are refused.

**The table** (``GatewayStreams``, one per gateway worker, on its event loop):

- A name is opened on the supervisor the first time a request names it, for that request's
  model and policy. A request for a model the stream was not opened for, or with another
  policy, closes it and opens it again with every model it has been asked for and the new
  policy (the supervisor keeps one stream per name, its figures per model, and carries an
  ended stream's counts on when it opens again). Requests meanwhile wait; frames already in
  flight are answered as usual.
- Several gateway workers share the ports, each with its own connection, and a name is
  unique among the supervisor's live streams: a worker whose ``stream_open`` finds the name
  held (by another worker, or another producer) opens ``<name>@2``, then ``@3``, … (at most
  ``MAX_HOLDERS``; the name cut to fit 64 characters). The response's ``duomo_stream``
  parameter says which name the frame went under.
- A stream with no request for ``idle_close_s`` (60 s) is closed; at most ``max_streams``
  (256) are held per worker: one more is RESOURCE_EXHAUSTED (HTTP 429). (The supervisor's
  ``limits.max_streams`` bounds them all, and answers the same.)
- The streams belong to the connection: when the supervisor goes away they end with it, and
  each is opened again on the next connection by its next request.

Called by ``gateway.link`` (``SupervisorLink.run``), which sets the slot's stream block from
the ``StreamTag`` before submitting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from duomo.ipc.client import Client
from duomo.ipc.errors import (
    DuomoError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from duomo.ipc.stream import FrameTime
from duomo.ipc.stream_settings import POLICIES

log = structlog.get_logger("duomo.gateway.streams")

MAX_NAME = 64
MAX_UINT64 = 2**64 - 1
MAX_HOLDERS = 16  # "<name>", "<name>@2" … "<name>@16"
MAX_STREAMS = 256
IDLE_CLOSE_S = 60.0
SWEEP_S = 5.0  # how often idle streams are looked for (at most idle_close_s)
STREAM_KEYS = ("stream", "frame", "captured_us", "stream_policy")


@dataclass
class StreamRequest:
    """A request's stream, from its parameters; ``frame`` is set by ``GatewayStreams.tag``
    when the caller gave none, and ``served_as`` to the supervisor's name for the stream.
    ``when`` is the capture time on the wall clock the answer carries: the caller's
    ``captured_us`` (clock ``caller``), else the arrival (clock ``arrival``)."""

    name: str
    frame: int | None
    captured_us: int  # CLOCK_MONOTONIC µs (converted on arrival)
    policy: str = "latest"
    served_as: str = ""
    when: FrameTime = field(default_factory=lambda: FrameTime(time.time()))


def stream_parameters(parameters: dict[str, Any]) -> StreamRequest | None:
    """The request's stream (None: a plain request), each parameter checked."""
    name = parameters.get("stream")
    if name is None:
        given = [key for key in STREAM_KEYS if key in parameters]
        if given:
            raise InvalidArgumentError(f"parameters: {given[0]!r} needs a 'stream' (its name)")
        return None
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not name.isprintable():
        raise InvalidArgumentError(
            f"parameters: 'stream' must be a string of 1..{MAX_NAME} printable characters"
        )
    frame = parameters.get("frame")
    if frame is not None and not _count(frame):
        raise InvalidArgumentError(f"parameters: 'frame' must be an integer in 0..{MAX_UINT64}")
    policy = parameters.get("stream_policy", "latest")
    if policy not in POLICIES:
        raise InvalidArgumentError(
            f"parameters: 'stream_policy' must be one of {list(POLICIES)}, not {str(policy)[:20]!r}"
        )
    captured = parameters.get("captured_us")
    monotonic = monotonic_us(captured)  # (checks it)
    when = FrameTime(time.time()) if captured is None else FrameTime(captured / 1e6, "caller")
    return StreamRequest(name, frame, monotonic, policy, when=when)


def monotonic_us(captured: Any) -> int:
    """``captured_us`` (µs of the UNIX epoch, or None: now) on this host's monotonic clock,
    never after now, never before its zero."""
    now_s = time.monotonic()
    if captured is None:
        return int(now_s * 1e6)
    if not _count(captured):
        raise InvalidArgumentError(
            f"parameters: 'captured_us' must be an integer in 0..{MAX_UINT64} "
            "(µs since the UNIX epoch)"
        )
    age_us = max(0, int(time.time() * 1e6) - captured)
    return max(0, int(now_s * 1e6) - age_us)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_UINT64


@dataclass(frozen=True)
class StreamTag:
    """What a request's slot carries for its stream (``Slot.set_stream``)."""

    stream_id: int
    frame: int
    captured_us: int


@dataclass(eq=False)
class _Entry:
    """One caller's stream as this worker holds it; ``stream_id`` None while it is not open
    (new, being reopened, or being closed). Changed only under ``lock``."""

    name: str
    models: frozenset[str] = frozenset()
    policy: str = "latest"
    served_as: str = ""
    stream_id: int | None = None
    client: Client | None = None  # the connection it is open on
    users: int = 0  # requests holding it (tagged, or waiting to be)
    last_used_s: float = 0.0
    next_frame: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def fits(self, model: str, policy: str, client: Client) -> bool:
        return (
            self.stream_id is not None
            and self.client is client
            and model in self.models
            and policy == self.policy
        )


class GatewayStreams:
    """A gateway worker's streams by the callers' names (the module docstring's rules)."""

    def __init__(
        self,
        client: Callable[[], Client],
        max_streams: int = MAX_STREAMS,
        idle_close_s: float = IDLE_CLOSE_S,
    ) -> None:
        self._client = client  # the connection now (UNAVAILABLE while there is none)
        self.max_streams = max_streams
        self.idle_close_s = idle_close_s
        self._entries: dict[str, _Entry] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def start(self) -> None:
        """Close idle streams in the background (on the running loop)."""
        self._sweeper = asyncio.create_task(self._sweeping())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def tag(self, request: StreamRequest, model: str) -> StreamTag:
        """The stream block for one request of ``request.name`` to ``model``: the stream opened
        (or reopened) for it first. Give it back with ``release`` once answered."""
        entry = self._entries.get(request.name)
        if entry is None:
            if len(self._entries) >= self.max_streams:
                raise ResourceExhaustedError(
                    f"this gateway worker holds {self.max_streams} streams; one closes after "
                    f"{self.idle_close_s:g} s without a request"
                )
            entry = self._entries[request.name] = _Entry(request.name)
        entry.users += 1
        entry.last_used_s = time.monotonic()
        try:
            client = self._client()
            if not entry.fits(model, request.policy, client):
                async with entry.lock:
                    client = self._client()
                    if not entry.fits(model, request.policy, client):
                        await self._open(entry, model, request.policy, client)
        except BaseException:
            self.release(request)
            raise
        assert entry.stream_id is not None
        if request.frame is None:
            request.frame = entry.next_frame
        entry.next_frame = min(max(entry.next_frame, request.frame + 1), MAX_UINT64)
        request.served_as = entry.served_as
        return StreamTag(entry.stream_id, request.frame, request.captured_us)

    def release(self, request: StreamRequest) -> None:
        """A request tagged by ``tag`` is done (answered, or it failed)."""
        entry = self._entries.get(request.name)
        if entry is None:
            return
        entry.users -= 1
        entry.last_used_s = time.monotonic()
        never_opened = entry.stream_id is None and not entry.served_as
        if entry.users == 0 and never_opened and not entry.lock.locked():
            del self._entries[request.name]  # (nothing to keep: not even a frame count)

    async def _open(self, entry: _Entry, model: str, policy: str, client: Client) -> None:
        """(Re)open ``entry`` on ``client`` with ``model`` added and ``policy``; under its lock.
        A model asked for earlier that the supervisor no longer serves (a reload removed it)
        is dropped: the stream opens again for ``model`` alone."""
        same_connection = entry.client is client
        models = (entry.models if same_connection else frozenset()) | {model}
        loop = asyncio.get_running_loop()
        if entry.stream_id is not None and same_connection:
            stream_id, entry.stream_id = entry.stream_id, None  # (requests wait meanwhile)
            with contextlib.suppress(DuomoError):
                await loop.run_in_executor(None, client.close_stream, stream_id)
        entry.stream_id = None
        try:
            name, stream_id = await self._open_as(entry, client, models, policy)
        except NotFoundError:
            if models == {model}:
                raise
            models = frozenset({model})
            name, stream_id = await self._open_as(entry, client, models, policy)
        entry.models, entry.policy, entry.served_as = models, policy, name
        entry.client, entry.stream_id = client, stream_id
        log.info("stream opened", stream=entry.name, served_as=name, models=sorted(models),
                 policy=policy)  # fmt: skip

    @staticmethod
    async def _open_as(
        entry: _Entry, client: Client, models: frozenset[str], policy: str
    ) -> tuple[str, int]:
        """Open the stream under the first of its names free in the supervisor (the one it
        had before first, so its figures carry on): that name and the stream's id."""
        names = [_held_name(entry.name, n) for n in range(1, MAX_HOLDERS + 1)]
        if entry.served_as in names:
            names.remove(entry.served_as)
            names.insert(0, entry.served_as)
        loop = asyncio.get_running_loop()
        for name in names:
            opening = functools.partial(client.open_stream, name, sorted(models), policy)
            try:
                return name, await loop.run_in_executor(None, opening)
            except InvalidArgumentError as err:
                if "already open" not in err.message:
                    raise
        raise ResourceExhaustedError(
            f"stream {entry.name!r} is open under {names[0]!r} and {MAX_HOLDERS - 1} more "
            "names of it by others: give this camera another name"
        )

    async def _sweeping(self) -> None:
        while True:
            await asyncio.sleep(min(SWEEP_S, self.idle_close_s))
            await self.close_idle()

    async def close_idle(self) -> None:
        """Close every stream with no request for ``idle_close_s``."""
        horizon = time.monotonic() - self.idle_close_s
        for entry in [e for e in self._entries.values() if e.last_used_s < horizon]:
            if entry.users or entry.lock.locked():
                continue
            async with entry.lock:
                stream_id, entry.stream_id = entry.stream_id, None
                client = entry.client
                if stream_id is not None and client is not None and client.connected:
                    with contextlib.suppress(DuomoError):
                        await asyncio.get_running_loop().run_in_executor(
                            None, client.close_stream, stream_id
                        )
                    log.info("idle stream closed", stream=entry.name, served_as=entry.served_as)
            if entry.users == 0 and self._entries.get(entry.name) is entry:
                del self._entries[entry.name]


def _held_name(name: str, n: int) -> str:
    """The ``n``-th name a stream called ``name`` may go under (1: its own)."""
    if n == 1:
        return name
    suffix = f"@{n}"
    return name[: MAX_NAME - len(suffix)] + suffix
