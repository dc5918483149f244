"""The sources table: one row per managed source, read from ``SourceStatus`` records — what
``duomo source list`` prints, and the sources part of ``duomo status``.

A source's ``last_error`` (masked) goes on a line of its own under the table, one per source
that has one: it is long, and a table cell would hide it.
"""

from __future__ import annotations

from collections.abc import Sequence

from duomo.ipc.source_records import SourceStatus
from duomo.supervisor.operators import text_table
from duomo.supervisor.operators.text_table import Column, ms

COLUMNS = (
    Column("source"), Column("state"), Column("feeds"), Column("worker", True),
    Column("in fps", True), Column("answered fps", True), Column("age p50 ms", True),
    Column("age p99 ms", True), Column("decoded", True), Column("decode errors", True),
    Column("reconnects", True), Column("answered", True), Column("sinks"), Column("url"),
)  # fmt: skip
STATE_COLUMN = 1
STATE_STYLES = {
    "connecting": "cyan",
    "playing": "green",
    "reconnecting": "yellow",
    "failed": "bold red",
    "stopped": "dim",
}


def rows(sources: Sequence[SourceStatus]) -> list[list[str]]:
    return [_cells(s) for s in sources]


def _cells(s: SourceStatus) -> list[str]:
    return [
        s.name, s.state, s.feeds, "-" if s.worker is None else str(s.worker),
        f"{s.input_fps:.1f}", f"{s.answered_fps:.1f}", ms(s.age_p50_ms), ms(s.age_p99_ms),
        str(s.decoded), str(s.decode_errors), str(s.reconnects), str(s.answered),
        f"{s.sinks} ({s.emit})" if s.sinks else "-", s.url,
    ]  # fmt: skip


def render(sources: Sequence[SourceStatus]) -> list[str]:
    """The table as lines of plain text (none without sources), then each last error."""
    lines = text_table.render(COLUMNS, rows(sources))
    lines += [f"{s.name}: {s.state}: {s.last_error}" for s in sources if s.last_error]
    return lines
