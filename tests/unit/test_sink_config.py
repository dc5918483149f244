"""The ``sinks:`` section: each kind's fields and defaults, what is refused (with the field's
path), and that secrets stay out of what is shown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from duomo.sinks.config import (
    FileSinkConfig,
    MqttSinkConfig,
    RedisSinkConfig,
    SecretError,
    SinkList,
    WebhookSinkConfig,
    read_secret,
)
from duomo.worker.config_model import NAME_PATTERN as MODEL_NAME_PATTERN

SINKS: TypeAdapter[Any] = TypeAdapter(SinkList)


def problems(raw: list[dict[str, Any]]) -> list[tuple[tuple[Any, ...], str]]:
    with pytest.raises(ValidationError) as caught:
        SINKS.validate_python(raw)
    return [(e["loc"], e["msg"]) for e in caught.value.errors(include_url=False)]


def test_each_kind_with_its_defaults() -> None:
    sinks = SINKS.validate_python(
        [
            {"name": "broker", "kind": "mqtt", "url": "mqtt://127.0.0.1"},
            {"name": "lake", "kind": "redis", "url": "redis://10.0.0.5/2", "maxlen": 1000},
            {"name": "alarm", "kind": "webhook", "url": "https://alarm.example/hook"},
            {"name": "local", "kind": "file", "path": "/var/lib/duomo/events.jsonl"},
        ]
    )
    mqtt, redis, hook, file = sinks
    assert isinstance(mqtt, MqttSinkConfig)
    assert (mqtt.topic_prefix, mqtt.qos, mqtt.port, mqtt.tls) == ("duomo", 1, 1883, False)
    assert mqtt.topic("gate-3", "object_left") == "duomo/gate-3/object_left"
    assert mqtt.outbox.max_mb == 64 and mqtt.outbox.max_age_s == 86_400
    assert isinstance(redis, RedisSinkConfig)
    assert redis.stream("gate-3") == "duomo:gate-3" and redis.maxlen == 1000
    assert isinstance(hook, WebhookSinkConfig) and hook.timeout_s == 10.0
    assert isinstance(file, FileSinkConfig) and (file.max_mb, file.keep) == (100, 5)
    assert file.path == Path("/var/lib/duomo/events.jsonl")


def test_tls_schemes_and_ports() -> None:
    mqtts = MqttSinkConfig.model_validate({"name": "b", "kind": "mqtt", "url": "mqtts://h"})
    assert (mqtts.tls, mqtts.port) == (True, 8883)
    other = MqttSinkConfig.model_validate({"name": "b", "kind": "mqtt", "url": "mqtt://h:1999"})
    assert other.port == 1999
    rediss = RedisSinkConfig.model_validate({"name": "r", "kind": "redis", "url": "rediss://h"})
    assert rediss.tls


@pytest.mark.parametrize(
    ("entry", "field", "fragment"),
    [
        ({"kind": "kafka"}, None, "expected tags: 'mqtt', 'redis', 'webhook', 'file'"),
        ({"kind": "mqtt", "url": "http://h"}, "url", "must start with mqtt:// or mqtts://"),
        ({"kind": "mqtt", "url": "mqtt://"}, "url", "names no host"),
        ({"kind": "mqtt", "url": "mqtt://h:99999"}, "url", "port must be a number"),
        ({"kind": "mqtt", "url": "mqtt://h/x"}, "url", "no path"),
        ({"kind": "mqtt", "url": "mqtt://h", "qos": 3}, "qos", "Input should be 0, 1 or 2"),
        ({"kind": "mqtt", "url": "mqtt://h", "topic_prefix": "a/#"}, "topic_prefix", "wildcard"),
        ({"kind": "redis", "url": "redis://h/db"}, "url", "the database, a number"),
        ({"kind": "redis", "url": "redis://h", "maxlen": 0}, "maxlen", "greater than or equal"),
        ({"kind": "webhook", "url": "ftp://h"}, "url", "http:// or https://"),
        ({"kind": "file", "path": "/x", "keep": -1}, "keep", "greater than or equal to 0"),
        ({"kind": "file", "path": "/x", "max_mb": 0}, "max_mb", "greater than 0"),
        ({"kind": "file", "path": "/x", "url": "u"}, "url", "Extra inputs"),
        ({"kind": "file", "path": "/x", "outbox": {"max_mb": 0}}, "outbox", "greater than 0"),
    ],
)
def test_bad_entries_are_refused_at_their_field(
    entry: dict[str, Any], field: str | None, fragment: str
) -> None:
    found = problems([{"name": "s", **entry}])
    assert len(found) == 1, found
    loc, message = found[0]
    assert loc[0] == 0
    if field is not None:
        assert loc[1] == entry["kind"] and field in loc, loc
    assert fragment in message, message


def test_names_follow_the_models_pattern_and_are_unique() -> None:
    from duomo.sinks import config

    assert config.NAME_PATTERN == MODEL_NAME_PATTERN
    found = problems([{"name": "no spaces", "kind": "file", "path": "/x"}])
    assert found[0][0] == (0, "file", "name")
    found = problems(
        [{"name": "a", "kind": "file", "path": "/x"}, {"name": "a", "kind": "file", "path": "/y"}]
    )
    assert "two sinks are named 'a'" in found[0][1]


def test_a_secret_is_given_one_way() -> None:
    found = problems(
        [
            {
                "name": "b",
                "kind": "mqtt",
                "url": "mqtt://h",
                "username": "u",
                "password_env": "P",
                "password_file": "/run/secrets/p",
            }
        ]
    )
    assert "not both" in found[0][1]
    found = problems([{"name": "b", "kind": "mqtt", "url": "mqtt://u:pw@h", "password_env": "P"}])
    assert "the URL has a password" in found[0][1]
    found = problems([{"name": "b", "kind": "mqtt", "url": "mqtt://h", "password_env": "P"}])
    assert "give username" in found[0][1]
    found = problems(
        [{"name": "w", "kind": "webhook", "url": "http://h", "secret_env": "S", "secret_file": "f"}]
    )
    assert "secret_env or secret_file" in found[0][1]


def test_a_password_in_a_url_is_never_shown() -> None:
    secret = "hunter2-0xDEAD"
    sink = MqttSinkConfig.model_validate(
        {"name": "b", "kind": "mqtt", "url": f"mqtt://duomo:{secret}@broker:1883"}
    )
    assert (sink.url_username, sink.url_password) == ("duomo", secret)
    assert secret not in repr(sink) and secret not in str(sink)
    assert sink.target == "mqtt://duomo:***@broker:1883"
    # nor in the message of a URL that is refused
    found = problems([{"name": "b", "kind": "mqtt", "url": f"http://duomo:{secret}@broker"}])
    assert secret not in found[0][1] and "***" in found[0][1]
    found = problems([{"name": "r", "kind": "redis", "url": f"redis://:{secret}@h/x"}])
    assert secret not in found[0][1]
    # nor in pydantic's whole message, which repeats a bad input unless told not to
    with pytest.raises(ValidationError) as caught:
        MqttSinkConfig.model_validate(
            {"name": "b", "kind": "mqtt", "url": f"http://duomo:{secret}@broker"}
        )
    assert secret not in str(caught.value)


def test_secrets_are_read_at_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUOMO_TEST_SINK_SECRET", "s3cret")
    assert read_secret("DUOMO_TEST_SINK_SECRET", None) == "s3cret"
    monkeypatch.setenv("DUOMO_TEST_SINK_SECRET", "rotated")
    assert read_secret("DUOMO_TEST_SINK_SECRET", None) == "rotated"
    monkeypatch.delenv("DUOMO_TEST_SINK_SECRET")
    with pytest.raises(SecretError, match="DUOMO_TEST_SINK_SECRET is not set"):
        read_secret("DUOMO_TEST_SINK_SECRET", None)
    file = tmp_path / "password"
    file.write_text("from-a-file\nignored second line\n")
    assert read_secret(None, file) == "from-a-file"
    with pytest.raises(SecretError, match="cannot read the secret file") as caught:
        read_secret(None, tmp_path / "missing")
    assert "from-a-file" not in str(caught.value)
    assert read_secret(None, None) is None


def test_relative_file_paths_are_the_config_folders(tmp_path: Path) -> None:
    """A sink's file paths, relative, are made absolute against the config file's folder (the
    sink worker that reads them runs elsewhere); absolute ones and URLs are left as they are."""
    sinks = SINKS.validate_python([
        {"name": "lines", "kind": "file", "path": "events/answers.jsonl"},
        {"name": "broker", "kind": "mqtt", "url": "mqtts://broker.example:8883",
         "username": "cams", "password_file": "secrets/mqtt", "ca_file": "/etc/ssl/ca.pem"},
        {"name": "hook", "kind": "webhook", "url": "https://hooks.example/in",
         "secret_file": "../hook-secret"},
    ])  # fmt: skip
    lines, broker, hook = (s.resolved(tmp_path / "conf") for s in sinks)
    assert lines.path == (tmp_path / "conf" / "events" / "answers.jsonl").resolve()
    assert broker.password_file == (tmp_path / "conf" / "secrets" / "mqtt").resolve()
    assert broker.ca_file == Path("/etc/ssl/ca.pem")
    assert broker.url == "mqtts://broker.example:8883"
    assert hook.secret_file == (tmp_path / "hook-secret").resolve()
    assert sinks[0].resolved(tmp_path) == sinks[0].resolved(tmp_path).resolved(Path("/other"))
