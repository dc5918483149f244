"""The webhook publisher: httpx (its sync client, one keep-alive connection pool), each event
one POST of its JSON.

Headers: ``Content-Type: application/json``, ``X-Duomo-Event: <id>`` (so a receiver can dedupe
without parsing), and with a secret ``X-Duomo-Signature: sha256=<hex>``, the HMAC-SHA256 of the
body with the secret as key (as GitHub signs its webhooks: the receiver recomputes it over the
raw body and compares in constant time).

What each answer means for the event (decided here, one table):

================================  ===============================================================
2xx                               acknowledged: deleted from the outbox
408, 429, 5xx, no answer          ``SinkUnavailableError``: the batch stops there, the event and
(refused, reset, timed out)       those after it stay in the outbox and are retried with backoff
401, 403, 404, 405, 407           ``SinkRefusedError``: the receiver refuses us (the secret or a
                                  credential) or the URL is wrong; every event would get the
                                  same, so none is dropped: the sink is ``failing`` with the
                                  status, the events wait (up to the outbox's bounds)
any other 4xx (400, 413, 422 …)   the receiver refuses *this* event for good: it is rejected
                                  (dropped from the outbox, counted, logged) and the batch goes on
TLS verification, unknown host    ``SinkRefusedError``
================================  ===============================================================

Events are posted one at a time in the batch's order (each source's in seq order), so a failure
never lets a later event of a source overtake an earlier one. Called by the sink's delivery
thread only.
"""

from __future__ import annotations

import hashlib
import hmac
import ssl
from collections.abc import Sequence

import httpx

from duomo.sinks.config import SecretError, WebhookSinkConfig, read_secret
from duomo.sinks.outbox import PendingEvent
from duomo.sinks.publisher import Published, SinkRefusedError, SinkUnavailableError

SIGNATURE_HEADER = "X-Duomo-Signature"
EVENT_HEADER = "X-Duomo-Event"
RETRY_LATER = {408, 429}
REFUSES_THE_SINK = {401, 403, 404, 405, 407}


def signature(secret: str, body: bytes) -> str:
    """The ``X-Duomo-Signature`` value of ``body``: ``sha256=<hex HMAC-SHA256>``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class WebhookPublisher:
    """POSTs a sink's events to its URL (``publisher.Publisher``)."""

    def __init__(self, config: WebhookSinkConfig) -> None:
        self.config = config
        self._client: httpx.Client | None = None
        self._secret: str | None = None

    def connect(self) -> None:
        """HTTP has no session to open: read the secret (so an unset one fails here, once)
        and make the connection pool; the first POST finds out whether the receiver is up."""
        self.close()
        config = self.config
        try:
            self._secret = read_secret(config.secret_env, config.secret_file)
        except SecretError as err:
            raise SinkRefusedError(str(err)) from None
        verify: ssl.SSLContext | bool = True
        if config.ca_file is not None:
            try:
                verify = ssl.create_default_context(cafile=str(config.ca_file))
            except (OSError, ssl.SSLError) as err:
                raise SinkRefusedError(f"ca_file {config.ca_file}: {err}") from None
        self._client = httpx.Client(timeout=config.timeout_s, verify=verify)

    def publish(self, batch: Sequence[PendingEvent]) -> Published:
        client = self._client
        if client is None:
            return Published(error=SinkUnavailableError("not connected"))
        acked: list[str] = []
        rejected: list[tuple[str, str]] = []
        for event in batch:
            headers = {"Content-Type": "application/json", EVENT_HEADER: event.id}
            if self._secret is not None:
                headers[SIGNATURE_HEADER] = signature(self._secret, event.body)
            try:
                answer = client.post(self.config.url, content=event.body, headers=headers)
            except httpx.HTTPError as err:
                return Published(acked, rejected, self._transport_error(err))
            status = answer.status_code
            if 200 <= status < 300:
                acked.append(event.id)
            elif status in RETRY_LATER or status >= 500:
                why = f"{self.config.target} answered {status} {answer.reason_phrase}"
                return Published(acked, rejected, SinkUnavailableError(why))
            elif status in REFUSES_THE_SINK:
                why = f"{self.config.target} refused: {status} {answer.reason_phrase}"
                return Published(acked, rejected, SinkRefusedError(why))
            else:
                rejected.append((event.id, f"{status} {answer.reason_phrase}"))
        return Published(acked, rejected)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _transport_error(self, err: httpx.HTTPError) -> SinkRefusedError | SinkUnavailableError:
        why = f"{self.config.target}: {err or type(err).__name__}"
        cause = err.__cause__ or err.__context__
        if isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY" in str(err):
            return SinkRefusedError(why)
        if "Name or service not known" in str(err) or "nodename nor servname" in str(err):
            return SinkRefusedError(why)
        return SinkUnavailableError(why)
