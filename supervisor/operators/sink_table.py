"""The sinks table: one row per configured sink, read from ``SinkStatus`` records — the sinks part
of ``duomo status`` and its ``--watch`` view.

A sink's reason (why it is retrying or failing) goes on a line of its own under the table: it is
long, and a table cell would hide it.
"""

from __future__ import annotations

from collections.abc import Sequence

from duomo.ipc.sink_records import SinkStatus
from duomo.supervisor.operators import text_table
from duomo.supervisor.operators.text_table import Column, ms

COLUMNS = (
    Column("sink"), Column("state"), Column("kind"), Column("published", True),
    Column("pending", True), Column("pending MiB", True), Column("dropped", True),
    Column("errors", True), Column("ack p50 ms", True), Column("ack p99 ms", True),
    Column("target"),
)  # fmt: skip
STATE_COLUMN = 1
STATE_STYLES = {
    "connecting": "cyan",
    "connected": "green",
    "retrying": "yellow",
    "failing": "bold red",
}


def rows(sinks: Sequence[SinkStatus]) -> list[list[str]]:
    return [_cells(s) for s in sinks]


def _cells(s: SinkStatus) -> list[str]:
    return [
        s.name, s.state, s.kind, str(s.published), str(s.pending_events),
        f"{s.pending_bytes / 2**20:.2f}", str(s.dropped + s.rejected), str(s.errors),
        ms(s.delay_p50_ms), ms(s.delay_p99_ms), s.target,
    ]  # fmt: skip


def reasons(sinks: Sequence[SinkStatus]) -> list[tuple[SinkStatus, str]]:
    """Each sink that is retrying or failing, with the line that says why."""
    return [(s, f"{s.name}: {s.state}: {s.reason}") for s in sinks if s.reason]


def render(sinks: Sequence[SinkStatus]) -> list[str]:
    """The table as lines of plain text (none without sinks), then each reason."""
    lines = text_table.render(COLUMNS, rows(sinks))
    return lines + [line for _, line in reasons(sinks)]
