"""``duomo status --watch``: a live view of one supervisor, redrawn every interval.

Owns the polling loop, the rates computed between two polls, and the view's layout. Called only
by ``supervisor/operators/cli.py``'s ``cmd_status``.

- One ``Client`` stays open between polls. When a poll fails it is closed, "reconnecting" is
  shown, and a new one is tried every interval, so a supervisor restarted on the same socket
  (a new process, its counters back at zero) is picked up again.
- On a terminal the view is a rich ``Live`` on the alternate screen; stdin is put in cbreak
  mode so ``q`` quits at once. Otherwise each poll prints one plain-text frame (the same
  layout without colour, its bars and rules in ASCII, as wide as its model table) for pipes
  and logs. On a terminal too narrow for the model table, long model names fold onto more
  lines first.
- ``q``, Ctrl-C and SIGTERM all end with exit 0, and every exit path restores the terminal.

Under the models, the streams table when there are streams (``supervisor.operators.stream_table``'s
cells, each stream's state in colour) and the capacity of the models they feed (its state in
colour), then the pipelines table when there are pipelines
(``supervisor.operators.pipeline_table``'s cells, each pipeline's state coloured as a model's), then
the managed sources (``supervisor.operators.source_table``'s cells, each state coloured, and each
last error on a line of its own), then the sinks (``supervisor.operators.sink_table``'s cells,
each state coloured, and each reason a sink is retrying or failing on a line of its own).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import select
import signal
import sys
import termios
import time
import tty
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rich.box import SIMPLE_HEAD, Box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.table import Table
from rich.text import Text

from duomo.ipc.client import Client
from duomo.ipc.errors import DuomoError
from duomo.ipc.sink_records import SinkStatus
from duomo.ipc.source_records import SourceStatus
from duomo.ipc.status_records import (
    DeviceStatus,
    ModelStatus,
    PipelineStatus,
    StreamStatus,
    SupervisorStatus,
)
from duomo.supervisor.operators import (
    pipeline_table,
    sink_table,
    source_table,
    stream_table,
)
from duomo.supervisor.operators.text_table import Column

STATUS_TIMEOUT_S = 5.0  # the longest one poll waits for the supervisor's reply
PLAIN_WIDTH = 140  # a plain frame's least width
UNLIMITED_WIDTH = 10_000  # where a table is measured at its natural width
NAME_CELLS = 12  # the narrowest a long model name folds to when the model table is too wide
BAR_CELLS = 8
CLIENTS_LISTED = 8  # the rest are counted, so that the view fits a terminal
PLAIN_BOX = Box("    \n    \n -- \n    \n    \n    \n    \n    \n")  # SIMPLE_HEAD in ASCII
STATE_STYLES = {
    "READY": "green",
    "DEGRADED": "yellow",
    "FAILED": "bold red",
    "LOADING": "cyan",
    "REINITIALIZING": "cyan",
    "UNLOADING": "cyan",
    "UNLOADED": "dim",
    "STOPPED": "dim",
}
MODEL_COLUMNS = (
    "model", "state", "device", "req/s", "requests", "errors", "p50 ms", "p99 ms", "queue",
    "busy", "batch", "restarts", "memory",
)  # fmt: skip
NUMBERS = set(MODEL_COLUMNS[3:-1])  # the columns aligned right
GATEWAY_STYLES = {"running": "green", "gave up": "red", "restarting": "yellow"}


class _Quit(Exception):
    """SIGTERM, raised in the main thread so that every ``finally`` runs."""


@dataclass(frozen=True)
class ModelRates:
    """One model's rates since the previous poll: requests per second and the mean batch size."""

    requests_per_s: float | None  # None: no earlier poll of the same supervisor process
    mean_batch: float | None  # None: nothing executed yet


@dataclass(frozen=True)
class Frame:
    """What one redraw shows: the supervisor's status, or why there is none."""

    socket: Path
    status: SupervisorStatus | None = None
    rates: dict[str, ModelRates] = field(default_factory=dict)
    problem: str = ""  # why the last poll failed (then ``status`` is None)
    own_pid: int = 0  # this view's own connection is not counted among the clients


def model_rates(
    before: SupervisorStatus | None, after: SupervisorStatus, elapsed_s: float
) -> dict[str, ModelRates]:
    """Requests answered per second and mean batch size per model between two status snapshots.

    A rate needs both snapshots from one supervisor process (a new one starts from zero); the
    mean batch is over the interval's executions, or over all of them when there were none."""
    same = before is not None and before.pid == after.pid and elapsed_s > 0
    rates = {}
    for name, m in after.models.items():
        old = before.models.get(name) if same and before is not None else None
        inferences, executions = m.totals.inference_count, m.totals.execution_count
        per_s = None
        if old is not None and m.requests >= old.requests:
            per_s = (m.requests - old.requests) / elapsed_s
            if executions > old.totals.execution_count:
                inferences -= old.totals.inference_count
                executions -= old.totals.execution_count
        rates[name] = ModelRates(per_s, inferences / executions if executions else None)
    return rates


class StatusPoller:
    """One connection to the supervisor at ``socket``, reopened on the poll after a failure."""

    def __init__(self, socket: Path, timeout_s: float) -> None:
        self.socket = socket
        self.timeout_s = timeout_s
        self._client: Client | None = None
        self._last: SupervisorStatus | None = None
        self._last_at_s = 0.0

    def poll(self) -> Frame:
        try:
            if self._client is None:
                self._client = Client(self.socket, timeout_s=self.timeout_s)
            status = self._client.status()
        except (DuomoError, OSError) as err:  # (a reply of the wrong shape too: it says why)
            self.close()
            return Frame(self.socket, problem=getattr(err, "message", None) or str(err))
        now_s = time.monotonic()
        rates = model_rates(self._last, status, now_s - self._last_at_s)
        self._last, self._last_at_s = status, now_s
        return Frame(self.socket, status, rates, own_pid=os.getpid())

    def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            client.close()


def render(frame: Frame, plain: bool = False) -> RenderableType:
    """The view of one frame; ``plain``: bars and rules in ASCII (colour is the console's)."""
    if frame.status is None:
        return Text(f"reconnecting to {frame.socket} … ({frame.problem})", style="bold yellow")
    s = frame.status
    clients = [c for c in s.clients if c.pid != frame.own_pid]
    lines: list[RenderableType] = [
        Text.assemble(
            ("duomo ", "bold"),
            f"pid {s.pid} on {s.socket} · up {_duration(s.uptime_s)} · "
            f"{_size(s.rss_bytes)} resident · thread budget {s.thread_budget} · "
            f"{len(clients)} client(s) attached",
        ),
        Text(),
        _FittedModelsTable(s.models, frame.rates, plain),
    ]
    for name, m in s.models.items():
        if m.last_error:
            style = "dim" if m.state == "READY" else "red"
            line = f"{name} last error: {m.last_error}"
            lines.append(Text(line, style=style, no_wrap=True, overflow="ellipsis"))
    if s.streams:
        lines += [Text(), _streams_table(s.streams, plain)]
    if stream_table.capacity_rows(s.models):
        lines += [Text(), _capacity_table(s.models, plain)]
    if s.pipelines:
        lines += [Text(), _pipelines_table(s.pipelines, plain)]
    if s.sources:
        lines += [Text(), _sources_table(s.sources, plain)]
        for source in s.sources:
            if source.last_error:
                line = f"{source.name} {source.state}: {source.last_error}"
                style = "red" if source.state == "failed" else "yellow"
                lines.append(Text(line, style=style, no_wrap=True, overflow="ellipsis"))
    if s.sinks:
        lines += [Text(), _sinks_table(s.sinks, plain)]
        for sink, line in sink_table.reasons(s.sinks):
            style = "red" if sink.state == "failing" else "yellow"
            lines.append(Text(line, style=style, no_wrap=True, overflow="ellipsis"))
    lines += [Text(), _devices_table(s.devices, plain), Text()]
    for g in s.gateways:
        lines.append(
            Text.assemble(
                f"gateway worker {g.worker} (pid {g.pid}): ",
                (g.condition, GATEWAY_STYLES[g.condition]),
                f", http {g.http}, grpc {g.grpc}, {g.restarts} restart(s)",
            )
        )
    for c in clients[:CLIENTS_LISTED]:
        models = ", ".join(f"{r.model}×{r.slots}" for r in c.rings) or "no models"
        line = f"client {c.id} (pid {c.pid}): {models}"
        lines.append(Text(line, no_wrap=True, overflow="ellipsis"))
    if len(clients) > CLIENTS_LISTED:
        lines.append(Text(f"… and {len(clients) - CLIENTS_LISTED} more client(s)"))
    return Group(*lines)


def plain_frame(frame: Frame, at: datetime.datetime) -> str:
    """One frame as plain text: a line with the time, then the view without colour, at least
    ``PLAIN_WIDTH`` wide and as wide as the model and streams tables need (nothing in them is
    cut)."""
    out = io.StringIO()
    width = PLAIN_WIDTH
    if frame.status is not None:
        tables = [
            _models_table(frame.status.models, frame.rates, plain=True),
            _streams_table(frame.status.streams, plain=True),
            _capacity_table(frame.status.models, plain=True),
            _pipelines_table(frame.status.pipelines, plain=True),
        ]
        measuring = Console(file=io.StringIO(), width=UNLIMITED_WIDTH)
        width = max(width, *(measuring.measure(table).maximum for table in tables))
    console = Console(file=out, color_system=None, width=width, highlight=False)
    console.print(render(frame, plain=True))
    lines = [f"-- duomo status at {at.isoformat(timespec='seconds')} --"]
    lines += [line.rstrip() for line in out.getvalue().splitlines()]  # cells are padded
    return "\n".join(lines) + "\n"


def _table(plain: bool, *titles: str, numbers: Collection[str] = NUMBERS) -> Table:
    """Columns with a rule under their titles only; ``numbers``' columns aligned right."""
    table = Table(
        box=PLAIN_BOX if plain else SIMPLE_HEAD, show_edge=False, pad_edge=False,
        collapse_padding=True,
    )  # fmt: skip
    for title in titles:
        table.add_column(title, justify="right" if title in numbers else "left", no_wrap=True)
    return table


class _FittedModelsTable:
    """The model table, fitted to the width it is drawn at: when it is too wide, long model
    names fold onto more lines (down to ``NAME_CELLS`` wide) before rich cuts every column
    short, so the numbers stay whole and two long names that begin alike stay apart."""

    def __init__(
        self, models: dict[str, ModelStatus], rates: dict[str, ModelRates], plain: bool
    ) -> None:
        self.models, self.rates, self.plain = models, rates, plain

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table = _models_table(self.models, self.rates, self.plain)
        natural = console.measure(table, options=options.update_width(UNLIMITED_WIDTH))
        excess = natural.maximum - options.max_width
        longest = max(map(len, self.models), default=0)
        if excess > 0 and longest > NAME_CELLS:  # (a fixed width: rich never narrows it alone)
            name = table.columns[0]
            name.width, name.no_wrap = max(NAME_CELLS, longest - excess), False
            name.overflow = "fold"
        yield table


def _models_table(
    models: dict[str, ModelStatus], rates: dict[str, ModelRates], plain: bool
) -> Table:
    table = _table(plain, *MODEL_COLUMNS)
    for name, m in models.items():
        rate = rates.get(name, ModelRates(None, None))
        table.add_row(
            Text(name, style="bold"),
            Text(m.state, style=STATE_STYLES.get(m.state, "")),
            ",".join(str(d) for d in m.devices or [0]),
            _number(rate.requests_per_s, ".1f"),
            str(m.requests),
            Text(str(m.errors), style="red" if m.errors else ""),  # failed + refused
            _number(m.latency_ms("p50"), ".1f"),
            _number(m.latency_ms("p99"), ".1f"),
            str(m.queue_depth),
            str(m.in_flight),
            _number(rate.mean_batch, ".1f"),
            str(sum(m.restart_attempts.values())),
            _memory(m.memory.charged_bytes, m.memory.budget_bytes, plain),
        )
    return table


def _streams_table(streams: tuple[StreamStatus, ...], plain: bool) -> Table:
    styles = stream_table.STATE_STYLES
    cells = stream_table.rows(streams)
    return _named_rows(stream_table.COLUMNS, cells, stream_table.STATE_COLUMN, styles, plain)


def _capacity_table(models: dict[str, ModelStatus], plain: bool) -> Table:
    cells = stream_table.capacity_rows(models)
    return _named_rows(
        stream_table.CAPACITY_COLUMNS, cells, stream_table.CAPACITY_STATE_COLUMN,
        stream_table.CAPACITY_STYLES, plain,
    )  # fmt: skip


def _pipelines_table(pipelines: dict[str, PipelineStatus], plain: bool) -> Table:
    cells = pipeline_table.rows(pipelines)
    return _named_rows(
        pipeline_table.COLUMNS, cells, pipeline_table.STATE_COLUMN, STATE_STYLES, plain
    )


def _sources_table(sources: tuple[SourceStatus, ...], plain: bool) -> Table:
    cells = source_table.rows(sources)
    return _named_rows(
        source_table.COLUMNS, cells, source_table.STATE_COLUMN, source_table.STATE_STYLES, plain
    )


def _sinks_table(sinks: tuple[SinkStatus, ...], plain: bool) -> Table:
    cells = sink_table.rows(sinks)
    return _named_rows(
        sink_table.COLUMNS, cells, sink_table.STATE_COLUMN, sink_table.STATE_STYLES, plain
    )


def _named_rows(
    columns: Sequence[Column],
    cells: list[list[str]],
    state_column: int,
    styles: Mapping[str, str],
    plain: bool,
) -> Table:
    """A rich table of rows that each start with a name (bold) and show a state (coloured)."""
    numbers = {c.title for c in columns if c.number}
    table = _table(plain, *(c.title for c in columns), numbers=numbers)
    for row in cells:
        shown: list[Text | str] = list(row)
        shown[0] = Text(row[0], style="bold")
        shown[state_column] = Text(row[state_column], style=styles.get(row[state_column], ""))
        table.add_row(*shown)
    return table


def _devices_table(devices: tuple[DeviceStatus, ...], plain: bool) -> Table:
    table = _table(plain, "device", "used", "budget", "total", "telemetry")
    for d in devices:
        budget, total = d.budget_bytes, d.total_bytes
        table.add_row(
            f"{d.id} ({d.kind}{_cores(d.cores)})",
            _memory(d.used_bytes, budget or total, plain, show_limit=False),
            _size(budget) if budget else "-",
            _size(total) if total else "-",
            _telemetry(d.telemetry),
        )
    return table


def _cores(cores: tuple[int, ...] | None) -> str:
    return f", cores {','.join(str(c) for c in cores)}" if cores else ""


def _memory(used: int | None, limit: int | None, plain: bool, show_limit: bool = True) -> Text:
    """Used bytes, after a bar against ``limit`` when there is one."""
    if used is None:
        return Text("-")
    if not limit:
        return Text(_size(used))
    fraction = used / limit
    cells = min(BAR_CELLS, round(fraction * BAR_CELLS))
    full, empty = ("#", ".") if plain else ("█", "░")
    style = "green" if fraction < 0.7 else "yellow" if fraction < 0.9 else "red"
    return Text.assemble(
        (full * cells, style), (empty * (BAR_CELLS - cells), "dim"),
        " " + (_size(used, limit) if show_limit else _size(used)),
    )  # fmt: skip


def _telemetry(reading: dict[str, Any]) -> str:
    shown = {
        "utilization": lambda v: f"util {v:.0%}",
        "temperature_c": lambda v: f"{v:.0f} °C",
        "power_w": lambda v: f"{v:.0f} W",
        "runtime_used_bytes": lambda v: f"{_size(v)} used on device",
    }
    return " · ".join(
        shown[k](v) if k in shown else f"{k} {v}" for k, v in reading.items() if v is not None
    )


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _size(*counts: int) -> str:
    """Byte counts in one unit, chosen by the largest: ``38 / 45 MiB``."""
    if max(counts) >= 10 * 2**30:
        return " / ".join(f"{count / 2**30:.1f}" for count in counts) + " GiB"
    return " / ".join(f"{count / 2**20:.0f}" for count in counts) + " MiB"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def watch(socket: Path, interval_s: float) -> int:
    """Show the supervisor at ``socket`` every ``interval_s`` until q, Ctrl-C or SIGTERM: 0."""
    poller = StatusPoller(socket, max(STATUS_TIMEOUT_S, interval_s))
    # both quit, whatever was inherited (a shell without job control starts a background
    # command with SIGINT ignored; the view's Ctrl-C is its contract)
    previous = {sig: signal.signal(sig, _raise_quit) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if sys.stdout.isatty():
            _watch_terminal(poller, interval_s)
        else:
            _watch_plain(poller, interval_s)
    except (KeyboardInterrupt, _Quit):
        pass
    except BrokenPipeError:  # the reader went away (``| head``): nothing left to show
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    finally:
        poller.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _watch_plain(poller: StatusPoller, interval_s: float) -> None:
    while True:
        next_s = time.monotonic() + interval_s
        frame = poller.poll()
        sys.stdout.write(plain_frame(frame, datetime.datetime.now().astimezone()))
        sys.stdout.flush()
        time.sleep(max(0.0, next_s - time.monotonic()))


def _watch_terminal(poller: StatusPoller, interval_s: float) -> None:
    console = Console()
    with _cbreak_stdin() as keys, Live(console=console, screen=True, auto_refresh=False) as live:
        while True:
            next_s = time.monotonic() + interval_s
            footer = Text(f"every {interval_s:g}s · q or Ctrl-C quits", style="dim")
            live.update(Group(render(poller.poll()), footer), refresh=True)
            if _quit_key_before(keys, next_s):
                return


@contextlib.contextmanager
def _cbreak_stdin() -> Iterator[int | None]:
    """The fd of stdin in cbreak mode (each key arrives at once, unechoed; Ctrl-C still
    signals), restored on exit; None when stdin is no terminal (then only signals quit)."""
    if not sys.stdin.isatty():
        yield None
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _quit_key_before(fd: int | None, until_s: float) -> bool:
    """Wait until the monotonic time ``until_s``; True as soon as q is pressed (or the
    terminal is gone)."""
    while (left_s := until_s - time.monotonic()) > 0:
        if fd is None:
            time.sleep(left_s)
            return False
        if select.select([fd], [], [], left_s)[0]:
            keys = os.read(fd, 64)
            if not keys or b"q" in keys.lower():
                return True
    return False


def _raise_quit(signum: int, frame: FrameType | None) -> None:
    raise _Quit
