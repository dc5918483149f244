"""The streams tables of ``duomo status`` and ``duomo status --watch``: one row per stream and
model, each cell read from the ``status`` reply's ``streams`` (``ipc.status_records``'s
``StreamStatus``), and the capacity table: one row per model that streams feed, from its
``capacity`` (``ModelCapacity``).

``rows`` and ``capacity_rows`` make the cells, which both views show; ``render`` and
``render_capacity`` lay them out as the plain text of ``duomo status``
(``supervisor.operators.status_table``'s ``render_status``), and
``supervisor.operators.status_watch`` puts them in its rich tables, colouring the states with
``STATE_STYLES`` and ``CAPACITY_STYLES``. With no stream there is no table. A stream fed to
several models has a row per model, each repeating the stream's name, state and policy, so that
every row reads alone (``grep gate-3``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from duomo.ipc.status_records import ModelStatus, StreamModelFigures, StreamStatus
from duomo.supervisor.operators import text_table
from duomo.supervisor.operators.text_table import Column, ms

COLUMNS = (
    Column("stream"), Column("state"), Column("model"), Column("policy"),
    Column("in fps", True), Column("answered fps", True), Column("age p50 ms", True),
    Column("age p99 ms", True), Column("in", True), Column("answered", True),
    Column("superseded", True), Column("refused", True), Column("skipped", True),
)  # fmt: skip
CAPACITY_COLUMNS = (
    Column("model"), Column("capacity"), Column("streams", True), Column("offered fps", True),
    Column("served fps", True), Column("lost fps", True), Column("service ms", True),
    Column("age bound ms", True), Column("share of served"),
)  # fmt: skip
CAPACITY_STATE_COLUMN = 1
CAPACITY_STYLES = {"ok": "green", "over": "bold yellow"}
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
        str(f.frames_in), str(f.answered), str(f.superseded), str(f.refused), str(f.skipped),
    ]  # fmt: skip


def render(streams: Sequence[StreamStatus]) -> list[str]:
    """The table as lines of plain text (none without streams): the titles, then a row per
    stream and model, each column as wide as its widest cell, two spaces apart."""
    return text_table.render(COLUMNS, rows(streams))


def capacity_rows(models: Mapping[str, ModelStatus]) -> list[list[str]]:
    """The cells of each model that streams fed in the last 5 s (or still ``over``), in the
    reply's order: its capacity state, streams, frames per second offered, served and lost,
    the median service time, the age bound, and each stream's share of the frames served."""
    return [
        [
            name, c.state, str(len(c.streams)), f"{c.offered_fps:.1f}", f"{c.served_fps:.1f}",
            f"{c.lost_fps:.1f}", ms(c.service_ms), ms(c.age_bound_ms),
            " ".join(f"{stream} {share.share:.0%}" for stream, share in c.streams.items()),
        ]
        for name, m in models.items()
        for c in (m.capacity,)
        if c.streams or c.state != "ok"
    ]  # fmt: skip


def render_capacity(models: Mapping[str, ModelStatus]) -> list[str]:
    """The capacity table as lines of plain text (none when no stream feeds a model)."""
    return text_table.render(CAPACITY_COLUMNS, capacity_rows(models))
