"""The producer-side client: attach to models served by a supervisor and run requests through
shared-memory slots.

    client = Client()                          # $DUOMO_SOCKET or the standard runtime dir
    ocr = client.model("ocr", slots=4)         # maps a ring of 4 slots
    result = ocr.infer(frame)                  # the same dict `duomo infer --json` prints
    future = ocr.infer_async(frame)            # concurrent.futures.Future
    with ocr.slot() as s:                      # zero-copy: decode straight into the slot
        s.input("image", frame.shape)[...] = frame
        s.submit()
        result = s.wait()

``from ipc import Client`` is the same class. ``Client`` is the producer's facade, one object
per job behind it: the connection (``ipc.link.ClientLink``: connecting, authenticating, who
reads the socket, where each answer goes), an attached model (``ipc.handle.ModelHandle``, its
slots in ``ipc.slots``) and a camera's stream (``ipc.stream.Stream``, opened with one
``ipc.stream_settings.StreamSettings``). This module makes the link and hands it to the
handles and streams it makes; none of them imports this module, and the link lives and dies
with its client (``close``). A gallery model (``ipc.galleries.GalleryHandle``: enrol, remove,
list, search) works through the client's own ``request`` and ``model``. ``ModelHandle`` and
``Slot`` are importable from here too.

A frame larger than the model's default slot area grows the handle's ring by itself
(``ipc.slots``), within the supervisor's limits on ring memory. A ring is a sealed memfd whose
descriptor arrives with the ``attach`` reply (``SCM_RIGHTS``); it has no name anywhere. A
process may exit without ``close()``: the supervisor frees its rings when the connection ends,
and nothing is printed here (``ipc.ring``).

Threads: no thread of its own for synchronous use. A thread that waits (``wait``, ``infer``,
a control request) reads the socket itself while nobody else does ("leader"); other waiters
sleep on a condition and are woken when the leader has dispatched their answer or stepped down
— so a synchronous round trip costs no extra thread hop. While ``infer_async`` requests are
outstanding, one background thread leads, so their futures complete and callbacks run without
anybody waiting. Nothing spins: a reader waiting for a slot's answer blocks in ``recv`` alone
(one system call on the way back), waking every ``READ_SLICE_S`` to check its deadline; other
waits also watch a wake pipe. If the supervisor goes away, whoever reads sees it at once and
every waiting call raises ``UnavailableError``. An event loop can instead be the client's one
reader for good (``read_in_loop``, then ``read_available`` whenever the socket is readable: the
gateway does this), and threads that wait follow it (``ipc.link`` has the details).
Errors are the typed exceptions of ``ipc.errors``, carrying the supervisor's message.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from duomo.ipc.errors import DuomoError
from duomo.ipc.galleries import GalleryHandle, gallery_infos
from duomo.ipc.gallery_records import GalleryInfo
from duomo.ipc.handle import ModelHandle
from duomo.ipc.link import ATTACH_TIMEOUT_S, READ_SLICE_S, ClientLink
from duomo.ipc.runtime_dir import default_socket_path
from duomo.ipc.slots import Slot
from duomo.ipc.status_records import ModelInfo, SupervisorStatus
from duomo.ipc.stream import Stream, close_stream, open_stream
from duomo.ipc.stream_settings import (
    DEFAULT_BACKLOG,
    DEFAULT_SLOTS,
    DEFAULT_STALL_AFTER_S,
    StreamSettings,
)

__all__ = ["ATTACH_TIMEOUT_S", "READ_SLICE_S", "Client", "ModelHandle", "Slot"]


class Client:
    """A producer's connection to one supervisor: control requests, and the models it attaches.

    One Unix socket carries framed JSON control messages and the 8-byte "slot ready" / "slot
    done" notices; tensors travel through the shared-memory rings that ``model`` attaches.
    A client may be shared by threads. It starts no thread for synchronous use: a thread that
    waits reads the socket itself while no other does, and the others wait for it (see the
    module docstring); one background thread reads while ``infer_async`` requests are
    outstanding. Every error is a typed ``ipc.errors.DuomoError``; once the supervisor goes
    away, every waiting and later call raises ``UnavailableError``.

    It is a facade over its link (``ipc.link.ClientLink``): the connection, who reads it and
    where each answer goes, which its handles and streams use directly.

    Example:
        from duomo import Client

        with Client() as client:  # $DUOMO_SOCKET, or the standard runtime directory
            classify = client.model("classify", slots=4)
            result = classify.infer(image)  # a uint8 H×W×C array
            names = [m.name for m in client.models()]

    Attributes:
        socket_path: The supervisor's control socket.
        events: Errors the supervisor reported without a slot to pin them on
            (``next_event``).
    """

    def __init__(self, socket_path: str | Path | None = None, timeout_s: float = 10.0) -> None:
        """Connect and authenticate (with the key file beside the socket).

        Args:
            socket_path: The supervisor's socket; None: ``$DUOMO_SOCKET``, else the standard
                runtime directory's.
            timeout_s: Bounds connecting and authenticating, and is the default bound on each
                control round trip afterwards.

        Raises:
            UnavailableError: No key file at the socket's directory (no supervisor there), or
                the supervisor cannot be reached or did not authenticate within ``timeout_s``.
            ResourceExhaustedError: The supervisor refused the connection (its
                ``limits.max_connections``, or it is out of file descriptors).
        """
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self._link = ClientLink.connect(self.socket_path, timeout_s)
        self.events: queue.SimpleQueue[DuomoError] = self._link.events

    @property
    def timeout_s(self) -> float:
        """The default bound on a control round trip (``request``, ``models``, ``status``), in
        seconds; ``model`` waits at least ``ATTACH_TIMEOUT_S`` for a model to load. May be
        set."""
        return self._link.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._link.timeout_s = value

    def request(self, op: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one control message and wait for its reply.

        The calling thread blocks until the reply arrives, for at most ``timeout_s`` (reading
        the socket itself while no other thread does).

        Args:
            op: The operation (``"status"``, ``"models"``, ``"load"``, ``"reload"``, …).
            timeout_s: How long to wait for the reply; None: the client's ``timeout_s``.
            **fields: The message's other fields.

        Returns:
            The reply, whose ``"ok"`` is true.

        Raises:
            DeadlineExceededError: No reply within ``timeout_s``.
            UnavailableError: The connection is closed or was lost.
            DuomoError: The supervisor's refusal, as its typed subclass
                (``NotFoundError``, ``InvalidArgumentError``, ``ResourceExhaustedError``, …).
        """
        return self._link.request(op, timeout_s, **fields)

    def next_event(self, timeout_s: float) -> DuomoError | None:
        """The next error the supervisor reported without a slot to pin it on (for example a
        notice for a slot index that does not exist).

        Blocks (reading the socket while no other thread does) until there is one, for at
        most ``timeout_s``, or until the connection is lost.

        Args:
            timeout_s: The longest wait, in seconds.

        Returns:
            The error (not raised), or None if none came in time.
        """
        self._link.wait_for(lambda: not self.events.empty(), time.monotonic() + timeout_s)
        try:
            return self.events.get_nowait()
        except queue.Empty:
            return None

    @property
    def connected(self) -> bool:
        """Whether the connection to the supervisor is open (False once closed or lost)."""
        return self._link.connected

    def models(self) -> list[ModelInfo]:
        """The models (and pipelines) the supervisor serves, one ``ModelInfo`` record each (its
        name, task, backend, state, max_batch; once loaded its inputs and outputs): one
        ``request`` round trip, with its errors.

        Raises:
            StatusRecordError: The reply does not have the documented shape (a key missing or
                of the wrong type; ``INTERNAL``).
        """
        return [ModelInfo.from_dict(info) for info in self.request("models")["models"]]

    def status(self) -> SupervisorStatus:
        """The supervisor's status, its ``SupervisorStatus`` record (``ipc.status_records``:
        its process, devices, models, clients, streams, pipelines, sources); ``.to_dict()`` is
        the JSON ``duomo status --json`` prints. One ``request`` round trip, with its errors.

        Raises:
            StatusRecordError: The reply does not have the documented shape (a key missing or
                of the wrong type; ``INTERNAL``).
        """
        return SupervisorStatus.from_dict(self.request("status")["status"])

    def model(self, name: str, slots: int = 4) -> ModelHandle:
        """Attach to model ``name`` with a ring of ``slots`` slots: up to that many requests
        in flight at once.

        Blocks for one control round trip, for at most the larger of the client's
        ``timeout_s`` and ``ATTACH_TIMEOUT_S`` (300 s): a model declared ``preload: false``
        is loaded by this call, which waits for the load.

        Args:
            name: The model's name in the supervisor's configuration.
            slots: The ring's slots.

        Returns:
            The handle; close it (``ModelHandle.close``) or the client to detach.

        Raises:
            NotFoundError: The supervisor serves no model ``name``.
            InvalidArgumentError: ``slots`` is out of range.
            ResourceExhaustedError: The client's or the supervisor's limits on rings, slots
                or ring memory leave no room for the ring.
            DeadlineExceededError: No reply in time (the model is still loading).
            UnavailableError: The connection is closed or lost, or the ring could not be
                mapped.
            DuomoError: Any other refusal of the supervisor's, as its typed subclass (a
                model that failed to load, say).
        """
        ring_id, ring = self._link.attach_ring(name, slots)
        return ModelHandle(self, self._link, name, ring_id, ring)

    def gallery(self, name: str) -> GalleryHandle:
        """The gallery model ``name`` (a model whose task is ``gallery``): enrol people from
        images, remove them, list them and search images for them (``ipc.galleries``).

        No round trip here: each of the handle's methods asks the supervisor. ``add`` runs the
        gallery's pipeline on each image (exactly one face each, else ``EnrolmentError``, an
        ``InvalidArgumentError`` naming the image: nothing is written) and enrols the faces'
        embeddings in one change; ``remove`` leaves nothing of the person in the gallery file or
        its WAL. A change is live for the next frame, without a reload.

        Example:
            people = client.gallery("people")
            people.add("Ada", [photo], metadata={"badge": 7})  # {"identity", "replaced"}
            people.search(frame)   # [{"box", "score", "identity": {"name", "similarity"}}]
            people.identities()    # [{"name", "metadata", "created", "embeddings": 1}]
            people.remove("Ada")

        Args:
            name: The gallery model's name in the supervisor's configuration.

        Returns:
            The handle (``GalleryHandle``: ``info``, ``add``, ``remove``, ``identities``,
                ``search``); it holds nothing to close.
        """
        return GalleryHandle(self, name)

    def galleries(self) -> list[GalleryInfo]:
        """Every gallery model the supervisor has, one ``GalleryInfo`` record each (its file,
        embedding model, counts, bounds, and the pipeline that enrols into it): one
        ``request`` round trip, with its errors."""
        return gallery_infos(self)

    def stream(
        self,
        name: str,
        models: Sequence[str],
        policy: str = "latest",
        weight: float = 1.0,
        fps: float | None = None,
        max_fps: float | None = None,
        every: int | None = None,
        stall_after_s: float = DEFAULT_STALL_AFTER_S,
        slots: int = DEFAULT_SLOTS,
        backlog: int = DEFAULT_BACKLOG,
        timeout_s: float | None = None,
    ) -> Stream:
        """Open stream ``name`` into ``models``: a camera's frames, answered freshest first
        (``ipc.stream``). Blocks for the ``stream_open`` round trip and one ``attach`` per
        model.

        Args:
            name: 1..64 printable characters, unique among the supervisor's live streams.
            models: The models each frame goes to.
            policy: ``latest`` (a frame waiting for a model is superseded by the next) or
                ``fifo`` (every frame answered).
            weight: Its share, against the other streams and clients of each model, in
                [0.001, 1000].
            fps: Its nominal frame rate, if known (the status shows it; liveness uses it).
            max_fps: Drop frames at the source above this rate.
            every: Keep one frame in ``every`` at the source.
            stall_after_s: No frame for this long: the supervisor shows it ``stalled``.
            slots: Slots per model (at least 3 keeps ``latest``'s age bound).
            backlog: ``fifo``: frames that may wait at the source per model.
            timeout_s: Each frame's deadline in the supervisor; None: none.

        Returns:
            The stream; close it (``Stream.close``) or the client to end it.

        Raises:
            InvalidArgumentError: A bad name, policy, weight, rate or count, or the name is
                another live stream's.
            NotFoundError: A model that is not served.
            ResourceExhaustedError: ``limits.max_streams`` streams exist, or no room for a
                ring.
            UnavailableError: The connection is closed or lost.
        """
        settings = StreamSettings(
            tuple(models), policy, weight, fps, stall_after_s, max_fps, every, slots, backlog,
            timeout_s,
        )  # fmt: skip
        return Stream(self._link, self.model, name, settings)

    def open_stream(
        self,
        name: str,
        models: Sequence[str],
        policy: str = "latest",
        weight: float = 1.0,
        fps: float | None = None,
        stall_after_s: float = DEFAULT_STALL_AFTER_S,
    ) -> int:
        """Open stream ``name`` in the supervisor only, for a producer that writes its slots
        itself (``Slot.set_stream``): its id. ``stream`` does this and the rest for you.

        Raises:
            As ``stream``.
        """
        settings = StreamSettings(tuple(models), policy, weight, fps, stall_after_s)
        return open_stream(self._link, name, settings)

    def close_stream(self, stream_id: int) -> None:
        """Close a stream opened by ``open_stream`` (it turns ``ended``)."""
        close_stream(self._link, stream_id)

    def close(self) -> None:
        """Disconnect: the supervisor frees this client's rings, and they are unmapped here.

        Requests still in flight fail with ``UnavailableError`` (waiting callers, futures).
        Waits up to 5 s for the background reader thread, if ``infer_async`` started one, to
        end. Closing twice is harmless."""
        self._link.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_in_loop(self) -> int:
        """Make the calling thread this client's one reader for good: an event loop that calls
        ``read_available`` whenever the returned file descriptor is readable (and may use slots
        and their ``on_done`` callbacks, which then run on it). Other threads that wait
        (``request``, ``model``, ``Slot.wait``) follow it instead of reading themselves.

        Returns:
            The socket's file descriptor, to watch for readability.

        Raises:
            RuntimeError: Another thread is reading the socket right now.
        """
        return self._link.read_in_loop()

    def read_available(self) -> None:
        """(The loop's reader, after ``read_in_loop``) Read what has arrived, without
        blocking, and dispatch it: answered slots' ``on_done`` callbacks run here. Raises
        nothing: a lost connection fails what waits with ``UnavailableError``."""
        self._link.read_available()
