"""What the status tables of named rows share: their columns, and their plain-text layout.

Used by ``supervisor.operators.stream_table`` and ``supervisor.operators.pipeline_table`` (each
makes its rows' cells), by ``supervisor.operators.status_table``'s ``render_status`` through their
``render``, and by ``supervisor.operators.status_watch``, which puts the same cells in a rich table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    """One column: its title, and whether it holds numbers (aligned right)."""

    title: str
    number: bool = False


def ms(value: float | None) -> str:
    """A time in ms to one decimal; ``-`` when there is none (nothing answered yet)."""
    return "-" if value is None else f"{value:.1f}"


def render(columns: Sequence[Column], cells: Sequence[Sequence[str]]) -> list[str]:
    """The table as lines of plain text (none without rows): the titles, then each row, each
    column as wide as its widest cell, two spaces apart."""
    if not cells:
        return []
    widths = [max(len(c.title), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]

    def line(row: Sequence[str]) -> str:
        shown = (
            f"{cell:>{width}}" if column.number else f"{cell:<{width}}"
            for cell, column, width in zip(row, columns, widths, strict=True)
        )
        return "  ".join(shown).rstrip()

    return [line([c.title for c in columns]), *(line(row) for row in cells)]
