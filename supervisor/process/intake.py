"""The intake: what a client's "slot ready" notices become — validated requests in their models'
queues. Every request's path goes through it.

One ``Intake`` is built by the reactor and shared with its ``Lending``; it is used, one at a
time per connection (under the connection's ``owner`` lock), by the two threads that may read
a client's socket:

- the **reactor**, for every connection it reads (``receive``; ``notice`` for each notice it
  finds among the frames of a longer read);
- a model's **idle worker** that has borrowed the connection (``supervisor.process.lending``): it
  queues a lone notice itself, so the request it then takes was never handed from one thread
  to another; anything else it read it leaves to the reactor.

``receive`` reads the socket once. A read that is exactly one notice frame (the usual case: a
producer sends one notice per request) goes straight to ``notice``, without the frame reader;
everything else is returned to the caller to decode. ``notice`` looks the ring up and hands
the slot to its ``Attachment.submit``, which copies the slot header out of shared memory once,
validates it against the model and queues the request (or answers the slot with the error); a
notice for a ring the connection does not hold, or a slot that does not exist or is in flight,
is answered on the socket with an error event.

The intake keeps no state of its own and takes no lock: what it reads is the connection's
(its stage, its frame reader, its attachments) and the attachment's.
"""

from __future__ import annotations

from duomo.ipc.errors import DuomoError, NotFoundError
from duomo.ipc.wire import FRAME, NOTICE, FrameKind
from duomo.supervisor.process.connection import OPEN, Connection

NOTICE_FRAME_BYTES = FRAME.size + NOTICE.size
NOTICE_PREFIX = FRAME.pack(NOTICE.size, FrameKind.NOTICE)
RECV_BYTES = 65536  # the most one read of a client's socket takes


class Intake:
    """Notices in, requests queued: the one way from a client's socket to a model's queue."""

    def receive(self, conn: Connection) -> bytes | None:
        """One read of ``conn`` (by the thread that holds its ``owner`` lock and reads it): a
        lone notice is queued here, and None returned; None as well when nothing was there.
        Otherwise what arrived, for the caller to handle (b"": EOF, or the socket failed)."""
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError, TimeoutError):
            return None
        except OSError:
            return b""
        if (
            len(data) == NOTICE_FRAME_BYTES
            and data.startswith(NOTICE_PREFIX)
            and conn.stage is OPEN
            and conn.reader.empty
        ):
            self.notice(conn, *NOTICE.unpack_from(data, FRAME.size))
            return None
        return data

    def notice(self, conn: Connection, ring: int, slot: int, seq: int) -> None:
        """Slot ``slot`` of ring ``ring`` is ready with request ``seq``: validate and queue it
        (an invalid request is answered in its slot; with no slot to answer in, on the
        socket)."""
        attachment = conn.attachments.get(ring)
        try:
            if attachment is None:
                raise NotFoundError(f"no attached ring {ring}")
            attachment.submit(slot, seq)
        except DuomoError as err:  # no slot to answer in
            conn.send_error(err.code, err.message, ring=ring, slot=slot)
