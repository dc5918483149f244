"""The control protocol: each operation's message parsed and checked once, and the supervisor's
handler table answering every operation (the supervisor is built, not started)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from duomo.ipc.errors import ErrorCode, InvalidArgumentError
from duomo.supervisor.config import load_config
from duomo.supervisor.process.control_messages import (
    MESSAGES,
    Attach,
    Detach,
    Load,
    Models,
    Ping,
    Reload,
    Status,
    Stop,
    Unload,
    parse_control,
)
from duomo.supervisor.process.server import Supervisor
from tests.unit.test_config import classify, write_config


def test_each_operation_becomes_its_message() -> None:
    assert parse_control({"op": "models", "id": 7}) == Models()
    assert parse_control({"op": "attach", "model": "m"}) == Attach("m", 4, {})
    assert parse_control(
        {"op": "attach", "model": "m", "slots": 64, "inputs": {"image": 5 << 20}}
    ) == Attach("m", 64, {"image": 5 << 20})
    assert parse_control({"op": "detach", "ring": 3}) == Detach(3)
    assert parse_control({"op": "status"}) == Status()
    assert parse_control({"op": "stop"}) == Stop(wait=False)
    assert parse_control({"op": "stop", "wait": True}) == Stop(wait=True)
    assert parse_control({"op": "reload", "model": None}) == Reload(None)  # (`duomo reload`)
    assert parse_control({"op": "reload", "model": "m"}) == Reload("m")
    assert parse_control({"op": "load", "model": "m"}) == Load("m")
    assert parse_control({"op": "unload", "model": "m"}) == Unload("m")
    assert parse_control({"op": "ping", "unknown_field": 1}) == Ping()


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({"op": "attach"}, "'attach' message: 'model' is missing (a string)"),
        ({"op": "attach", "model": 5}, "'model' must be a string, not 5"),
        ({"op": "attach", "model": "m", "slots": 65}, "'slots' must be an integer in 1..64"),
        ({"op": "attach", "model": "m", "slots": True}, "'slots' must be an integer in 1..64"),
        ({"op": "attach", "model": "m", "slots": 2.0}, "'slots' must be an integer in 1..64"),
        ({"op": "attach", "model": "m", "inputs": {"x": -1}}, "'inputs' must be an object"),
        ({"op": "attach", "model": "m", "inputs": [1]}, "'inputs' must be an object"),
        ({"op": "detach"}, "'detach' message: 'ring' is missing (an integer)"),
        ({"op": "mapped", "ring": 3}, "unknown control operation 'mapped'"),  # (rings: no name)
        ({"op": "detach", "ring": "1"}, "'detach' message: 'ring' must be an integer, not '1'"),
        ({"op": "stop", "wait": 1}, "'wait' must be true or false, not 1"),
        ({"op": "reload", "model": ["m"]}, "'model' must be a string, not ['m']"),
        ({"op": "load"}, "'load' message: 'model' is missing"),
        ({"op": "unload", "model": {}}, "'unload' message: 'model' must be a string"),
        ({"op": "format_disk"}, "unknown control operation 'format_disk'"),
        *(  # (issue 42: 5e-324 was accepted, and its stride was infinite)
            (
                {"op": "stream_open", "name": "s", "models": ["m"], "weight": weight},
                "'weight' must be a number in [0.001, 1000]",
            )
            for weight in (5e-324, 1e-300, 0.000999, 0, -1, 1000.5, float("inf"), True)
        ),
        ({"op": ["attach"]}, "unknown control operation ['attach']"),
        ({}, "unknown control operation None"),
    ],
)
def test_a_bad_message_is_invalid_argument_naming_the_field(
    message: dict[str, Any], expected: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse_control(message)
    assert expected in caught.value.message


def test_a_stream_weight_at_either_bound_is_taken() -> None:
    for weight in (0.001, 1, 1000):
        message = {"op": "stream_open", "name": "s", "models": ["m"], "weight": weight}
        assert parse_control(message).settings.weight == weight  # type: ignore[attr-defined]


def test_a_long_value_is_quoted_cut() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse_control({"op": "attach", "model": "m", "slots": "9" * 100_000})
    assert "100002 characters" in caught.value.message and len(caught.value.message) < 400


class Asking:
    """Stands in for the connection that asks (the handlers here read only these)."""

    def __init__(self) -> None:
        self.id = 1
        self.attachments: dict[int, object] = {}


@pytest.fixture
def supervisor(tmp_path: Path) -> Supervisor:
    config = load_config(write_config(tmp_path, [classify()]))  # no model is loaded: no file read
    return Supervisor(config, tmp_path / "duomo.sock")


def test_the_supervisor_handles_every_operation(supervisor: Supervisor) -> None:
    assert set(supervisor.control._handlers) == set(MESSAGES)
    conn: Any = Asking()
    assert supervisor.control.handle(conn, {"op": "ping", "id": 1}) == {"ok": True}
    models = supervisor.control.handle(conn, {"op": "models"})
    assert models is not None and models["models"] == []  # (built, not started)
    unknown = supervisor.control.handle(conn, {"op": "format_disk"})
    assert unknown is not None and unknown["code"] == ErrorCode.INVALID_ARGUMENT
    missing = supervisor.control.handle(conn, {"op": "load", "model": "nope"})
    assert missing is not None and missing["code"] == ErrorCode.NOT_FOUND


def test_a_handler_that_fails_unexpectedly_answers_internal_without_the_text(
    supervisor: Supervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(asking: object = None) -> dict[str, Any]:
        raise KeyError("the secret inside")

    monkeypatch.setattr(supervisor.control, "_status", broken)
    reply = supervisor.control.handle(Asking(), {"op": "status"})  # type: ignore[arg-type]
    assert reply == {
        "ok": False,
        "code": ErrorCode.INTERNAL,
        "message": "internal error in 'status'; the supervisor log has details",
    }
    assert supervisor.control.handle(Asking(), {"op": "ping"}) == {"ok": True}  # type: ignore[arg-type]
