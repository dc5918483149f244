"""A stream's settings are one record, checked once, in the same words on both sides: what
``Client.stream`` and ``Client.open_stream`` refuse before sending, the supervisor's
``stream_open`` refuses too (with its ``malformed`` prefix), and what one sends the other reads
back unchanged."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from duomo.ipc.client import Client
from duomo.ipc.errors import InvalidArgumentError
from duomo.ipc.stream_settings import StreamSettings
from duomo.supervisor.process.control_messages import StreamOpen, parse_control

WIRE_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"models": []}, "'models' must be a list of 1..16 distinct names, not []"),
    ({"models": ["a", "a"]}, "'models' must be a list of 1..16 distinct names"),
    ({"models": [f"m{i}" for i in range(17)]}, "'models' must be a list of 1..16"),
    ({"models": ["m", 5]}, "'models' must be a list of 1..16 distinct names"),
    ({"policy": "newest"}, "policy must be one of ['latest', 'fifo'], not 'newest'"),
    ({"policy": ""}, "policy must be one of ['latest', 'fifo'], not ''"),
    *(
        ({"weight": w}, f"'weight' must be a number in [0.001, 1000], not {w!r}")
        for w in (5e-324, 0.000999, 0, -1, 1000.5, float("inf"), True, "1")
    ),
    *(
        ({"fps": f}, f"'fps' must be a number in (0, 1000], not {f!r}")
        for f in (0, -5, 1000.1, False)
    ),
    *(
        ({"stall_after_s": s}, f"'stall_after_s' must be a number in (0, 86400], not {s!r}")
        for s in (0, 86401, "5")
    ),
]


def settings(**fields: Any) -> StreamSettings:
    return StreamSettings(**{"models": ["m"], **fields})


@pytest.mark.parametrize(("fields", "expected"), WIRE_REFUSALS)
def test_a_value_the_producer_refuses_the_supervisor_refuses_in_the_same_words(
    fields: dict[str, Any], expected: str
) -> None:
    with pytest.raises(InvalidArgumentError) as here:
        settings(**fields)
    assert expected in here.value.message
    message = {"op": "stream_open", "name": "s", "models": ["m"], **fields}
    with pytest.raises(InvalidArgumentError) as there:
        parse_control(message)
    assert there.value.message == f"malformed 'stream_open' message: {here.value.message}"


def test_what_the_producer_sends_the_supervisor_reads_back() -> None:
    sent = StreamSettings(("face", "ocr"), "fifo", 0.001, 25, 0.5)
    assert sent.to_dict() == {
        "models": ["face", "ocr"],
        "policy": "fifo",
        "weight": 0.001,
        "fps": 25.0,
        "stall_after_s": 0.5,
    }
    opened = parse_control({"op": "stream_open", "name": "gate", **sent.to_dict()})
    assert opened == StreamOpen("gate", sent)
    assert isinstance(opened, StreamOpen) and not opened.settings.supersedes
    bare = parse_control({"op": "stream_open", "name": "s", "models": ["m"], "weight": None})
    assert isinstance(bare, StreamOpen) and bare.settings == StreamSettings(("m",))
    with pytest.raises(InvalidArgumentError, match="'models' is missing"):
        parse_control({"op": "stream_open", "name": "s"})


def test_the_source_s_own_settings_are_checked_as_before_and_never_sent() -> None:
    for fields, expected in (
        ({"max_fps": 0}, "max_fps must be above 0, not 0"),
        ({"every": 0}, "every must be an integer ≥ 1, not 0"),
        ({"every": 2.5}, "every must be an integer ≥ 1, not 2.5"),
        ({"slots": 0}, "slots and backlog must be at least 1"),
        ({"backlog": 0}, "slots and backlog must be at least 1"),
    ):
        with pytest.raises(InvalidArgumentError, match=expected):
            settings(**fields)
    capped = settings(max_fps=2.0, every=3, slots=65, backlog=8, timeout_s=0.5)
    assert set(capped.to_dict()) == {"models", "policy", "weight", "fps", "stall_after_s"}


def test_the_client_s_defaults_are_the_settings_defaults() -> None:
    """``Client.stream`` and ``Client.open_stream`` spell their parameters out (the producer's
    documented signatures); their defaults are the record's."""
    fields = inspect.signature(StreamSettings).parameters
    for call in (Client.stream, Client.open_stream):
        for name, parameter in inspect.signature(call).parameters.items():
            if name in fields and name != "models":
                assert parameter.default == fields[name].default, (call.__name__, name)
