"""The ``sinks:`` section of the config: named sinks, each an MQTT broker, a Redis stream, a
webhook or a file, with the bounds of its outbox, and how a sink's secret is read.

A sink is chosen by ``kind`` (a discriminated union, so an unknown kind or a field of another
kind is an error at its own path)::

    sinks:
      - name: broker
        kind: mqtt
        url: mqtts://broker.example:8883
        username: duomo
        password_env: DUOMO_MQTT_PASSWORD
        ca_file: /etc/duomo/ca.pem
      - name: lake
        kind: redis
        url: redis://10.0.0.5:6379/0
        maxlen: 100000
        outbox: {max_mb: 256, max_age_s: 3600}

Secrets are never values in the config: a password or an HMAC secret is named by an environment
variable (``*_env``) or a file (``*_file``, its first line, as Docker and Kubernetes mount
secrets) and read by ``read_secret`` when the publisher connects, never at load and never
logged. A password written into a URL is accepted (it is the user's own file) but every place
that shows a URL shows ``mask_url``'s (``ipc.source_urls``), this module's messages included;
the models' ``repr`` masks it too.

Who calls it: the supervisor's config composes ``SinkList`` into its own section (later), the
sink worker builds its outboxes and publishers from these records (``sinks.outbox``,
``sinks.publisher``). Imports only pydantic, the standard library and ``ipc.source_urls``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import unquote, urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from duomo.ipc.source_urls import mask_url

# The same as worker.config_model.NAME_PATTERN (a sink's name appears in file names and metric
# labels); repeated because sinks must not import worker (tests/unit/test_sink_config.py pins it).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"

MQTT_PORTS = {"mqtt": 1883, "mqtts": 8883}
REDIS_PORT = 6379


class SecretError(ValueError):
    """A secret that cannot be read: its variable is unset or its file unreadable. The message
    names the variable or the file, never a value."""


class StrictModel(BaseModel):
    """A config section: a typo is an error, not a silently ignored key (as the supervisor's
    ``worker.config_model.StrictModel``, which sinks may not import)."""

    # a URL may carry a password: pydantic's own messages must not repeat the input
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class OutboxConfig(StrictModel):
    """The bounds of a sink's outbox: past either, its oldest pending events are dropped (and
    counted; the next event delivered for that source says how many)."""

    max_mb: float = Field(default=64, gt=0, le=1_000_000)  # bytes of pending events' JSON
    max_age_s: float = Field(default=86_400, gt=0)

    @property
    def max_bytes(self) -> int:
        return int(self.max_mb * 1024 * 1024)


SinkT = TypeVar("SinkT", bound="_Sink")


class _Sink(StrictModel):
    """What every sink has: its name and its outbox's bounds."""

    name: str = Field(pattern=NAME_PATTERN)
    outbox: OutboxConfig = Field(default_factory=OutboxConfig)

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # a URL's password stays out of reprs, tracebacks and logs of the record
        for key, value in super().__repr_args__():
            yield key, mask_url(value) if key == "url" and isinstance(value, str) else value

    def resolved(self: SinkT, base: Path) -> SinkT:
        """Its file paths (``path``, ``password_file``, ``secret_file``, ``ca_file``: whichever
        its kind has) made absolute against ``base``, the config file's folder, as a source's
        ``password_file`` is: the sink worker that reads them runs elsewhere."""
        relative = {
            key: (base / value).resolve()
            for key, value in self
            if isinstance(value, Path) and not value.is_absolute()
        }
        return self.model_copy(update=relative) if relative else self

    @property
    def target(self) -> str:
        """Where the sink sends, as it may be shown: its URL (the password masked) or path."""
        url = getattr(self, "url", None)
        return mask_url(url) if isinstance(url, str) else str(getattr(self, "path", ""))


def _network_url(url: str, schemes: tuple[str, ...]) -> tuple[str, str | None, int | None]:
    """``(scheme, host, port)`` of ``url``; ValueError (with the URL masked) when its scheme is
    not one of ``schemes`` or it has no host or a bad port."""
    shown = mask_url(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in schemes:
        expected = " or ".join(f"{s}://" for s in schemes)
        raise ValueError(f"{shown!r}: the URL must start with {expected}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{shown!r}: the port must be a number from 1 to 65535") from None
    if not parts.hostname:
        raise ValueError(f"{shown!r}: the URL names no host")
    if port == 0:
        raise ValueError(f"{shown!r}: the port must be a number from 1 to 65535")
    return scheme, parts.hostname, port


def _one_secret(env: str | None, file: Path | None, what: str) -> None:
    if env is not None and file is not None:
        raise ValueError(f"give the {what} by {what}_env or {what}_file, not both")


class MqttSinkConfig(_Sink):
    """An MQTT broker: each event published to ``{topic_prefix}/{source}/{kind}`` at ``qos``
    (1 by default: an event leaves the outbox on the broker's PUBACK)."""

    kind: Literal["mqtt"]
    url: str  # mqtt://host[:1883] or mqtts://host[:8883] (TLS)
    topic_prefix: str = Field(default="duomo", min_length=1, max_length=200)
    qos: Literal[0, 1, 2] = 1
    username: str | None = None
    password_env: str | None = None
    password_file: Path | None = None
    ca_file: Path | None = None  # TLS: the CA that signed the broker's certificate
    client_id: str | None = Field(default=None, max_length=128)  # None: the broker assigns one

    @field_validator("url")
    @classmethod
    def _mqtt_url(cls, url: str) -> str:
        _network_url(url, ("mqtt", "mqtts"))
        parts = urlsplit(url)
        if parts.path not in ("", "/") or parts.query:
            raise ValueError(f"{mask_url(url)!r}: an MQTT URL has no path or query")
        return url

    @field_validator("topic_prefix")
    @classmethod
    def _plain_prefix(cls, prefix: str) -> str:
        if any(c in prefix for c in "#+\0") or prefix.startswith("/") or prefix.endswith("/"):
            raise ValueError("a topic prefix has no wildcards (# +) and no leading or trailing /")
        return prefix

    @model_validator(mode="after")
    def _secrets(self) -> MqttSinkConfig:
        _one_secret(self.password_env, self.password_file, "password")
        if self.url_password is not None and (self.password_env or self.password_file):
            raise ValueError("the URL has a password: give it there or by password_env/_file")
        if self.url_username is not None and self.username is not None:
            raise ValueError("the URL names a user: give it there or by username, not both")
        has_password = self.password_env or self.password_file or self.url_password is not None
        if has_password and self.username is None and self.url_username is None:
            raise ValueError("MQTT sends a password only with a user name: give username")
        return self

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme.lower() == "mqtts"

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or MQTT_PORTS[parts.scheme.lower()]

    @property
    def url_username(self) -> str | None:
        user = urlsplit(self.url).username
        return unquote(user) if user else None

    @property
    def url_password(self) -> str | None:
        password = urlsplit(self.url).password
        return unquote(password) if password is not None else None

    def topic(self, source: str, kind: str) -> str:
        """The topic an event of ``source`` and ``kind`` is published to."""
        return f"{self.topic_prefix}/{source}/{kind}"


class RedisSinkConfig(_Sink):
    """Redis Streams: one stream per source, ``{stream_prefix}:{source}``, each event the JSON
    in field ``event``, added by XADD (trimmed to about ``maxlen`` entries when it is set)."""

    kind: Literal["redis"]
    url: str  # redis://host[:6379][/db] or rediss:// (TLS)
    stream_prefix: str = Field(default="duomo", min_length=1, max_length=200)
    maxlen: int | None = Field(default=None, ge=1)
    username: str | None = None  # a Redis 6 ACL user (None: the default user)
    password_env: str | None = None
    password_file: Path | None = None
    ca_file: Path | None = None

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        _network_url(url, ("redis", "rediss"))
        parts = urlsplit(url)
        path = parts.path.strip("/")
        if path and not path.isdigit():
            raise ValueError(f"{mask_url(url)!r}: the path is the database, a number (/0)")
        return url

    @model_validator(mode="after")
    def _secrets(self) -> RedisSinkConfig:
        _one_secret(self.password_env, self.password_file, "password")
        if urlsplit(self.url).password is not None and (self.password_env or self.password_file):
            raise ValueError("the URL has a password: give it there or by password_env/_file")
        return self

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme.lower() == "rediss"

    def stream(self, source: str) -> str:
        """The key of ``source``'s stream."""
        return f"{self.stream_prefix}:{source}"


class WebhookSinkConfig(_Sink):
    """An HTTP endpoint: each event POSTed as its JSON, signed with HMAC-SHA256 over the body
    (``X-Duomo-Signature: sha256=<hex>``) when a secret is given."""

    kind: Literal["webhook"]
    url: str  # http:// or https://
    secret_env: str | None = None
    secret_file: Path | None = None
    timeout_s: float = Field(default=10.0, gt=0, le=600)
    ca_file: Path | None = None  # https: a CA other than the system's

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        _network_url(url, ("http", "https"))
        return url

    @model_validator(mode="after")
    def _secrets(self) -> WebhookSinkConfig:
        _one_secret(self.secret_env, self.secret_file, "secret")
        return self


class FileSinkConfig(_Sink):
    """A JSON-lines file: one event a line, the file rotated past ``max_mb`` (``path.1`` the
    newest rotated, up to ``path.{keep}``; older ones deleted)."""

    kind: Literal["file"]
    path: Path
    max_mb: float = Field(default=100, gt=0, le=1_000_000)
    keep: int = Field(default=5, ge=0, le=1000)

    @property
    def max_bytes(self) -> int:
        return max(1, int(self.max_mb * 1024 * 1024))


SinkConfig = Annotated[
    MqttSinkConfig | RedisSinkConfig | WebhookSinkConfig | FileSinkConfig,
    Field(discriminator="kind"),
]


def _unique_names(sinks: list[SinkConfig]) -> list[SinkConfig]:
    seen: set[str] = set()
    for sink in sinks:
        if sink.name in seen:
            raise ValueError(f"two sinks are named {sink.name!r}")
        seen.add(sink.name)
    return sinks


# the ``sinks:`` section: what the supervisor's config declares it as
SinkList = Annotated[list[SinkConfig], AfterValidator(_unique_names)]


def read_secret(env: str | None, file: Path | None) -> str | None:
    """The secret named by the variable ``env`` or in the first line of ``file`` (None: neither
    given). Read at each use, so a rotated secret is picked up on the next connect; SecretError
    names what is missing, never a value."""
    if env is not None:
        value = os.environ.get(env)
        if value is None:
            raise SecretError(f"the environment variable {env} is not set")
        return value
    if file is not None:
        try:
            lines = Path(file).read_text("utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            why = err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__
            raise SecretError(f"cannot read the secret file {file}: {why}") from None
        return lines[0] if lines else ""
    return None
