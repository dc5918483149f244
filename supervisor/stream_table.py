"""The streams table of ``duomo status`` and ``duomo status --watch``: one row per stream and
model, each cell read from the ``status`` reply's ``streams`` (``ipc.status_records``'s
``StreamStatus``).

``rows`` makes the cells, which both views show; ``render`` lays them out as the plain text
of ``duomo status`` (``supervisor.cli``'s ``render_status``), and ``supervisor.status_watch``
puts them in its rich table, colouring the state with ``STATE_STYLES``. With no stream there
is no table. A stream fed to several models has a row per model, each repeating the stream's
name, state and policy, so that every row reads alone (``grep gate-3``).
"""

from __future__ import annotations

from collections.abc import Sequence

from duomo.ipc.status_records import StreamModelFigures, StreamStatus
from duomo.supervisor import text_table
from duomo.supervisor.text_table import Column, ms

COLUMNS = (
    Column("stream"), Column("state"), Column("model"), Column("policy"),
    Column("in fps", True), Column("answered fps", True), Column("age p50 ms", True),
    Column("age p99 ms", True), Column("in", True), Column("answered", True),
    Column("superseded", True), Column("refused", True),
)  # fmt: skip
STATE_COLUMN = 1
STATE_STYLES = {
    "starting": "cyan",
    "running": "green",
    "blocked": "yellow",
    "stalled": "bold red",
    "ended": "dim",
}


def rows(streams: Sequence[StreamStatus]) -> list[list[str]]:
    """The cells of each stream and model, in the reply's order (the streams by name)."""
    return [
        [stream.name, stream.state, model, stream.policy, *_figures(f)]
        for stream in streams
        for model, f in stream.models.items()
    ]


def _figures(f: StreamModelFigures) -> list[str]:
    return [
        f"{f.input_fps:.1f}", f"{f.answered_fps:.1f}", ms(f.age_ms_p50), ms(f.age_ms_p99),
        str(f.frames_in), str(f.answered), str(f.superseded), str(f.refused),
    ]  # fmt: skip


def render(streams: Sequence[StreamStatus]) -> list[str]:
    """The table as lines of plain text (none without streams): the titles, then a row per
    stream and model, each column as wide as its widest cell, two spaces apart."""
    return text_table.render(COLUMNS, rows(streams))
