"""The Redis Streams publisher: redis-py, a batch as one pipeline of XADDs, each reply its ack.

Each event is added to its source's stream ``{stream_prefix}:{source}`` with the event's JSON in
field ``event`` (``XADD key [MAXLEN ~ n] * event <json>``: with ``maxlen`` the stream is trimmed
to about that many entries, whole macro nodes at a time, which is what keeps XADD cheap). A
batch is one non-transactional pipeline, one round trip; an XADD that returns an entry id is
acknowledged. When the connection breaks during the round trip nothing of the batch is taken as
acknowledged (the replies are lost with it) and all of it is sent again: a consumer may see an
event twice, never miss one.

redis-py's own retries are off (``Retry(NoBackoff(), 0)``): the delivery loop owns the backoff
and the sink's state, and must learn at once that the server is away. Errors: a refused
password or ACL user, a command the user may not run (NOPERM), a key of another type
(WRONGTYPE), TLS verification or an unknown host → ``SinkRefusedError``; a refused or broken
connection, a timeout, the server loading or out of memory → ``SinkUnavailableError``.

Called by the sink's delivery thread only.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, AuthorizationError
from redis.retry import Retry

from duomo.ipc.source_urls import mask_text
from duomo.sinks.config import RedisSinkConfig, SecretError, read_secret
from duomo.sinks.outbox import PendingEvent
from duomo.sinks.publisher import (
    Published,
    SinkError,
    SinkRefusedError,
    SinkUnavailableError,
)

CONNECT_TIMEOUT_S = 5.0
REPLY_TIMEOUT_S = 30.0
_REFUSING_REPLIES = ("WRONGTYPE", "NOPERM", "NOAUTH", "WRONGPASS")


class RedisPublisher:
    """Publishes a sink's events to its Redis streams (``publisher.Publisher``)."""

    def __init__(self, config: RedisSinkConfig) -> None:
        self.config = config
        self._client: redis.Redis | None = None
        self._password: str | None = None

    def connect(self) -> None:
        self.close()
        config = self.config
        try:
            self._password = read_secret(config.password_env, config.password_file)
        except SecretError as err:
            raise SinkRefusedError(str(err)) from None
        options: dict[str, Any] = {
            "socket_connect_timeout": CONNECT_TIMEOUT_S,
            "socket_timeout": REPLY_TIMEOUT_S,
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": 0,
        }
        if self._password is not None:
            options["password"] = self._password
        if config.username is not None:
            options["username"] = config.username
        if config.tls and config.ca_file is not None:
            options["ssl_ca_certs"] = str(config.ca_file)
        client = redis.Redis.from_url(config.url, **options)
        try:
            client.ping()
        except (redis.RedisError, OSError) as err:
            client.close()
            raise self._classified(err) from None
        self._client = client

    def publish(self, batch: Sequence[PendingEvent]) -> Published:
        client = self._client
        if client is None:
            return Published(error=SinkUnavailableError("not connected"))
        pipe = client.pipeline(transaction=False)
        for event in batch:
            pipe.xadd(
                self.config.stream(event.source),
                {"event": event.body},
                maxlen=self.config.maxlen,
                approximate=True,
            )
        try:
            replies = pipe.execute(raise_on_error=False)
        except (redis.RedisError, OSError) as err:
            return Published(error=self._classified(err))
        acked: list[str] = []
        error: SinkError | None = None
        for event, reply in zip(batch, replies):
            if isinstance(reply, Exception):
                error = error or self._classified(reply)
            else:
                acked.append(event.id)
        return Published(acked, error=error)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _classified(self, err: BaseException) -> SinkError:
        """``err`` as the sink's error, its message masked (the URL may carry a password)."""
        secrets = (self._password,) if self._password else ()
        why = mask_text(f"{self.config.target}: {_message(err)}", *secrets)
        if isinstance(err, AuthenticationError | AuthorizationError):
            return SinkRefusedError(why)
        if isinstance(err, redis.ResponseError):
            if str(err).upper().startswith(_REFUSING_REPLIES):
                return SinkRefusedError(why)
            return SinkUnavailableError(why)  # LOADING, OOM, BUSY …: later
        cause = err.__cause__ or err.__context__
        if isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY" in str(err):
            return SinkRefusedError(why)
        if isinstance(cause, socket.gaierror) or "Name or service not known" in str(err):
            return SinkRefusedError(why)
        return SinkUnavailableError(why)


def _message(err: BaseException) -> str:
    return str(err) or type(err).__name__
