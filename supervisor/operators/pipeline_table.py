"""The pipelines table of ``duomo status`` and ``duomo status --watch``: one row per pipeline and
step, each cell read from the ``status`` reply's ``pipelines`` (``ipc.status_records``'
``PipelineStatus``).

``rows`` makes the cells, which both views show; ``render`` lays them out as the plain text of
``duomo status`` (``supervisor.operators.status_table``'s ``render_status``), and
``supervisor.operators.status_watch`` puts them in its rich table, colouring the state as a model's.
With no pipeline there is no table. Every row names its pipeline (``grep faces``); the pipeline's
own figures (state, requests, errors, latency, objects per frame) are on its first step's row only,
the rows of its later steps leave them blank, so a sum down a column counts each pipeline once.
"""

from __future__ import annotations

from collections.abc import Mapping

from duomo.ipc.status_records import PipelineStatus, PipelineStepStatus
from duomo.supervisor.operators import text_table
from duomo.supervisor.operators.text_table import Column, ms

COLUMNS = (
    Column("pipeline"), Column("state"), Column("requests", True), Column("errors", True),
    Column("p50 ms", True), Column("p99 ms", True), Column("obj/frame", True), Column("step"),
    Column("model"), Column("on"), Column("runs", True), Column("skipped", True),
    Column("reused", True), Column("failed", True),
)  # fmt: skip
STATE_COLUMN = 1
WHOLE_FRAME = "frame"  # the ``on`` of a step that runs on the whole frame


def rows(pipelines: Mapping[str, PipelineStatus]) -> list[list[str]]:
    """The cells of each pipeline's steps, in the reply's order (the config's)."""
    out = []
    for name, p in pipelines.items():
        figures = _pipeline_figures(p)
        for step in p.steps:
            out.append([name, *figures, *_step_figures(step)])
            figures = [""] * len(figures)  # (the pipeline's own figures once, on its first row)
    return out


def _pipeline_figures(p: PipelineStatus) -> list[str]:
    per_frame = p.objects.per_frame
    return [
        p.state, str(p.requests), str(p.errors), ms(p.latency_p50_ms), ms(p.latency_p99_ms),
        "-" if per_frame is None else f"{per_frame:.2f}",
    ]  # fmt: skip


def _step_figures(step: PipelineStepStatus) -> list[str]:
    return [
        step.name, step.model, step.for_each or WHOLE_FRAME, str(step.runs), str(step.skipped),
        str(step.reused), str(step.errors),
    ]  # fmt: skip


def render(pipelines: Mapping[str, PipelineStatus]) -> list[str]:
    """The table as lines of plain text (none without pipelines): the titles, then a row per
    pipeline and step, each column as wide as its widest cell, two spaces apart."""
    return text_table.render(COLUMNS, rows(pipelines))
