"""The pieces every ``duomo`` command line shares (``ipc.command_line``): the numbers' argparse
types, as the commands parse them, and the exit code of a supervisor's error."""

from __future__ import annotations

import pytest

from duomo.ipc.command_line import EXIT_FAILED, EXIT_INVALID, exit_code
from duomo.ipc.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from duomo.supervisor.operators.cli import build_parser

STREAM = ["stream", "x.mp4", "--model", "m"]


def parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The message argparse exits 2 with for ``argv``."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["stream", "x.mp4", "--model", "m", "--wait-s", "-1"],
            "a number of seconds ≥ 0, not '-1'",
        ),
        (["stream", "x.mp4", "--model", "m", "--wait-s", "inf"], "a number of seconds ≥ 0"),
        (
            ["stream", "x.mp4", "--model", "m", "--duration", "0"],
            "a number of seconds > 0, not '0'",
        ),
        (["status", "--interval", "nan"], "a number of seconds > 0, not 'nan'"),
        (["camera-sim", "a.mp4", "--port", "65536"], "a port from 0 to 65535, not '65536'"),
        (["camera-sim", "a.mp4", "--port", "http"], "a port from 0 to 65535, not 'http'"),
        (["camera-sim", "a.mp4", "--fps", "0"], "above 0 and at most"),
        (["camera-sim", "a.mp4", "--clock-offset-s=-inf"], "a number of seconds, not '-inf'"),
    ],
)
def test_a_number_out_of_its_range_is_refused_naming_the_range(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert f"must be {message}" in parse_error(argv, capsys)


def test_numbers_in_range_are_read() -> None:
    parser = build_parser()
    sim = parser.parse_args(["camera-sim", "a.mp4", "--port", "0", "--clock-offset-s", "-2.5"])
    assert (sim.port, sim.clock_offset_s) == (0, -2.5)
    streamed = parser.parse_args([*STREAM, "--wait-s", "0"])
    assert streamed.wait_s == 0.0


def test_the_callers_mistakes_exit_2_and_the_rest_1() -> None:
    assert exit_code(NotFoundError("no model")) == EXIT_INVALID
    assert exit_code(InvalidArgumentError("bad")) == EXIT_INVALID
    assert exit_code(UnavailableError("gone")) == EXIT_FAILED
    assert exit_code(ResourceExhaustedError("full")) == EXIT_FAILED
