"""``duomo status``'s text (``render_status``), read from the ``SupervisorStatus`` record that
``Client.status`` returns: the process, each device, the copies of weights shared, the model
table, then the streams and capacity tables (``stream_table``), the pipelines table
(``pipeline_table``), the managed sources (``source_table``) and the sinks (``sink_table``) when
there are some, the limits, gateway workers and clients.

The model table (its columns: docs/operations.md) has a layout of its own: each column at least
its least width and as wide as its widest cell (a long model name, a model on many devices), one
space apart and two before the last, a model's last error on a line under its row; the other
tables share ``text_table``'s. ``duomo status --watch`` (``status_watch``) shows the same
records in rich tables. Called by ``supervisor.operators.cli``'s ``cmd_status``.
"""

from __future__ import annotations

from collections.abc import Sequence

from duomo.ipc.status_records import SupervisorStatus
from duomo.supervisor.operators import pipeline_table, sink_table, source_table, stream_table

# the model table of ``duomo status``: (title, alignment, least width); a column grows to its
# widest cell (a long model name, a model on many devices), so the table stays aligned
STATUS_COLUMNS = (
    ("model", "<", 12), ("state", "<", 14), ("dev", "<", 5), ("inst", ">", 4),
    ("queue", ">", 5), ("busy", ">", 4), ("ok", ">", 7), ("errors", ">", 6),
    ("superseded", ">", 10), ("p50 ms", ">", 8), ("p99 ms", ">", 8), ("MiB", ">", 6),
    ("rst", ">", 3), ("share", ">", 11), ("batches", "<", 0),
)  # fmt: skip


def _aligned(
    columns: Sequence[tuple[str, str, int]], rows: Sequence[tuple[list[str], str | None]]
) -> list[str]:
    """The title line and one line per row, each followed by its note line if it has one;
    columns one space apart (two before the last), as wide as their widest cell."""
    widths = [
        max(least, len(title), *(len(cells[i]) for cells, _ in rows))
        for i, (title, _, least) in enumerate(columns)
    ]

    def line(cells: Sequence[str]) -> str:
        shown = [f"{c:{a}{w}}" for c, (_, a, _), w in zip(cells, columns, widths)]
        return (" ".join(shown[:-1]) + "  " + shown[-1]).rstrip()

    out = [line([title for title, _, _ in columns])]
    for cells, note in rows:
        out.append(line(cells))
        if note is not None:
            out.append(note)
    return out


def _shared_weights(status: SupervisorStatus) -> list[str]:
    """A line per copy of weights that several loaded models use (the MEM column counts it for
    each; the device's line, once)."""
    copies: dict[tuple[str, int, int], set[str]] = {}
    for name, m in status.models.items():
        for w in m.memory.weights:
            if w.shared_with:
                copies.setdefault((w.file, w.device, w.bytes), set()).update({name, *w.shared_with})
    return [
        f"  weights shared on device {device}: {file} {nbytes / 2**20:.0f} MiB, one copy for "
        f"{', '.join(sorted(users))}"
        for (file, device, nbytes), users in sorted(copies.items())
    ]


def render_status(status: SupervisorStatus) -> str:
    """``duomo status``'s text: the process, each device, the model table (its columns:
    docs/operations.md), the streams table and the models' capacity when there are streams
    (``stream_table``), the pipelines table when there are pipelines (``pipeline_table``), the
    managed sources when there are some (``source_table``), limits, gateway workers and
    clients."""
    rss_mb = status.rss_bytes / 2**20
    lines = [
        f"supervisor pid {status.pid} on {status.socket}, up {status.uptime_s:.0f}s, "
        f"{rss_mb:.0f} MiB resident, thread budget {status.thread_budget}",
    ]
    for device in status.devices:
        budget, total = device.budget_bytes, device.total_bytes
        limit = f" of {budget / 2**20:.0f} MiB budget" if budget else ""
        size = f"; {total / 2**20:.0f} MiB in all" if total else ""
        cores = device.cores
        pinned = f", cores {','.join(map(str, cores))}" if cores else ""
        threads = device.thread_budget
        budget_note = f", thread budget {threads}" if threads and len(status.devices) > 1 else ""
        lines.append(
            f"device {device.id} ({device.kind}{pinned}{budget_note}): "
            f"{device.used_bytes / 2**20:.0f} MiB charged to loaded models{limit}{size}"
        )
    lines += _shared_weights(status)
    rows: list[tuple[list[str], str | None]] = []  # a model's cells, and its last error
    for name, m in status.models.items():
        batches = " ".join(f"{k}:{v}" for k, v in m.batch_sizes.items()) or "-"
        charged = m.memory.charged_bytes
        size = f"{charged / 2**20:.0f}" if charged is not None else "-"
        compute = m.compute
        share = f"{compute.share:.0%} (w {compute.weight:g})" if compute is not None else "-"
        devices = ",".join(str(d) for d in m.devices or [0])
        cells = [
            name, m.state, devices, str(m.instances), str(m.queue_depth),
            str(m.in_flight), str(m.ok), str(m.errors), str(m.superseded),
            f"{m.latency_ms('p50') or 0:.1f}", f"{m.latency_ms('p99') or 0:.1f}", size,
            str(m.restarts_in_window), share, batches,
        ]  # fmt: skip
        error = m.last_error if m.state != "READY" else None
        rows.append((cells, f"  {name}: {error}" if error else None))
    lines += _aligned(STATUS_COLUMNS, rows)
    streams = stream_table.render(status.streams)
    lines += ["", *streams] if streams else []
    capacity = stream_table.render_capacity(status.models)
    lines += ["", *capacity] if capacity else []
    pipelines = pipeline_table.render(status.pipelines)
    lines += ["", *pipelines] if pipelines else []
    sources = source_table.render(status.sources)
    lines += ["", *sources] if sources else []
    sinks = sink_table.render(status.sinks)
    lines += ["", *sinks] if sinks else []
    limits = status.limits
    lines.append(
        f"clients {len(status.clients)} of {limits['max_connections']}, "
        f"{status.shm_bytes / 2**20:.1f} of {limits['shm_total_bytes'] / 2**20:.0f} MiB "
        f"of ring memory committed, {status.connections_refused} connection(s) refused, "
        f"{status.clients_cut_off} cut off"
    )
    for g in status.gateways:
        lines.append(
            f"gateway worker {g.worker} (pid {g.pid}): {g.condition}, http {g.http}, "
            f"grpc {g.grpc}, {g.restarts} restart(s)"
        )
    for c in status.clients:
        rings = ", ".join(f"{r.model}×{r.slots}" for r in c.rings) or "no models"
        lent = " (read by its idle worker)" if c.lent else ""
        waiting = f", {c.unread_bytes} bytes of answers unread" if c.unread_bytes else ""
        lines.append(f"client {c.id} (pid {c.pid}): {rings}{lent}{waiting}")
    return "\n".join(lines)
