"""A source's health: whether it plays, why not, and when to try again — so that a typo is told
from an outage.

States (``SourceHealth.state``), the contract of ``duomo source list`` and the preview::

    connecting    started, no frame decoded yet
    playing       frames are decoded
    reconnecting  it failed or dropped; tried again with backoff (0.5 s doubling to 10 s)
    failed        it has not played for ``failed_after_s`` since its first failure, or failed
                  ``PERMANENT_AFTER`` times in a row with a permanent error: the reason is in
                  ``last_error``; still tried again, every ``retry_failed_s``
    stopped       it ended: stopped, removed, or a file played to its end

**Permanent errors** (``permanent_reason``): the camera answered but refused (HTTP/RTSP 401, 403,
404), its host name does not resolve, or it sends what no decoder here takes. Anything else — a
refused port, a timeout, a dropped connection — is an outage, which may end by itself; it turns
``failed`` only once it has lasted ``failed_after_s``. A decoded frame makes it ``playing`` again
and forgets the failures.

``last_error`` is masked (``ipc.source_urls.mask_text``: FFmpeg names the URL it failed on). Used
by one ``VideoSource``'s decode thread (``video.source``); read by anyone through its
``SourceFigures``.
"""

from __future__ import annotations

import errno
import socket
import time
from urllib.parse import urlsplit

from duomo.video.backoff import Backoff

PERMANENT_AFTER = 3  # failures in a row with a permanent error, then failed
FAILED_AFTER_S = 30.0
RETRY_FAILED_S = 60.0


def permanent_reason(err: BaseException, url: str) -> str | None:
    """Why ``err`` (opening or reading ``url``) will not go away by itself, or None when it
    may (an outage)."""
    import av

    if isinstance(err, av.HTTPUnauthorizedError):
        return "the camera refused the credentials (401 Unauthorized)"
    if isinstance(err, av.HTTPForbiddenError):
        return "the camera refused access (403 Forbidden)"
    if isinstance(err, av.HTTPNotFoundError):
        return "the camera has no such path (404 Not Found)"
    if isinstance(err, (av.DecoderNotFoundError, av.DemuxerNotFoundError)):
        return f"no decoder here takes it ({err})"
    if isinstance(err, OSError) and err.errno in (errno.EIO, errno.EINVAL, None):
        host = urlsplit(url).hostname if "://" in url else None
        if host and not _resolves(host):
            return f"its host name {host!r} does not resolve (DNS)"
    return None


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as err:
        return err.errno not in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5))
    except OSError:
        return True
    return True


class SourceHealth:
    """One source's state, its failures since it last played, and the wait before the next try
    (the module docstring's rules). Not thread-safe: its decode thread owns it."""

    def __init__(
        self,
        failed_after_s: float = FAILED_AFTER_S,
        retry_failed_s: float = RETRY_FAILED_S,
        backoff: Backoff | None = None,
    ) -> None:
        self.failed_after_s = failed_after_s
        self.retry_failed_s = retry_failed_s
        self.backoff = backoff or Backoff()
        self.state = "connecting"
        self.last_error: str | None = None
        self.permanent = False  # the last failure was a permanent one
        self._failing_since: float | None = None
        self._permanent_in_a_row = 0

    def playing(self) -> bool:
        """A frame was decoded: playing (forgetting the failures); whether it was not before."""
        came_back = self.state != "playing"
        self.state = "playing"
        self._failing_since = None
        self._permanent_in_a_row = 0
        self.permanent = False
        self.backoff.reset()
        return came_back

    def failed(self, error: str, permanent: str | None = None, now: float | None = None) -> float:
        """It failed (``error``, masked; ``permanent``: why it will not go away by itself);
        the wait before the next attempt, in seconds."""
        now = time.monotonic() if now is None else now
        if self._failing_since is None:
            self._failing_since = now
        self._permanent_in_a_row = self._permanent_in_a_row + 1 if permanent else 0
        self.permanent = permanent is not None
        self.last_error = f"{permanent}: {error}" if permanent else error
        lasting = now - self._failing_since >= self.failed_after_s
        if lasting or self._permanent_in_a_row >= PERMANENT_AFTER:
            self.state = "failed"
            return self.retry_failed_s
        self.state = "reconnecting"
        return self.backoff.next_delay_s()

    def stopped(self) -> None:
        self.state = "stopped"
