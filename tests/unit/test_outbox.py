"""The outbox and the sequencer: order per source, turns between sources, the bounds (what is
dropped, counted and said by the next event), seqs that continue across a reopen, and real
processes: one killed with SIGKILL while it writes, two writing at once."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from duomo.ipc.stream_records import FrameTime
from duomo.sinks.config import OutboxConfig
from duomo.sinks.events import Event, decode_event
from duomo.sinks.outbox import Outbox, OutboxEntry
from duomo.sinks.sequencer import Sequencer

WHEN = FrameTime(1796420400.0, "arrival")
UNBOUNDED = OutboxConfig(max_mb=1024, max_age_s=10**9)


def answer(source: str, seq: int, padding: int = 0) -> Event:
    return Event(source, seq, "answer", WHEN, seq, model="m", result={"pad": "x" * padding})


@pytest.fixture
def outbox(tmp_path: Path) -> Iterator[Outbox]:
    with Outbox(tmp_path / "sink.outbox.db", UNBOUNDED, "sink") as box:
        yield box


def ids(batch: list) -> list[str]:  # type: ignore[type-arg]
    return [event.id for event in batch]


def test_events_come_out_in_seq_order_per_source_until_acked(outbox: Outbox) -> None:
    assert outbox.append([answer("a", 3), answer("a", 1), answer("b", 1), answer("a", 2)]) == 4
    assert outbox.append([answer("a", 2)]) == 0  # the same event again: kept once
    batch = outbox.next_batch(10)
    by_source = {s: [e.seq for e in batch if e.source == s] for s in ("a", "b")}
    assert by_source == {"a": [1, 2, 3], "b": [1]}
    assert decode_event(batch[0].body)["id"] == batch[0].id
    assert outbox.ack(["a:1", "b:1", "b:9"]) == 2  # b:9 was never here
    assert ids(outbox.next_batch(10)) == ["a:2", "a:3"]
    assert ids(outbox.next_batch(1)) == ["a:2"]
    outbox.ack(["a:2", "a:3"])
    assert outbox.next_batch(10) == [] and outbox.pending().events == 0


def test_sources_take_turns_so_a_backlog_holds_no_one_back(outbox: Outbox) -> None:
    outbox.append([answer("busy", seq) for seq in range(1, 101)] + [answer("quiet", 1)])
    batch = outbox.next_batch(10)
    assert "quiet:1" in ids(batch) and len(batch) == 10
    assert [e.seq for e in batch if e.source == "busy"] == list(range(1, 10))
    # more sources than the batch holds: the lead rotates, so every source gets its turn
    outbox.append([answer(f"cam{n:02d}", 1) for n in range(20)])
    seen: set[str] = set()
    for _ in range(30):
        seen.update(e.source for e in outbox.next_batch(4))
    assert {f"cam{n:02d}" for n in range(20)} <= seen


def test_pending_counts_events_and_the_bytes_of_their_json(outbox: Outbox) -> None:
    entries = [OutboxEntry.of(answer("a", seq, padding=seq * 10)) for seq in range(1, 6)]
    outbox.append(entries)
    pending = outbox.pending()
    assert pending.events == 5 and pending.bytes == sum(len(e.body) for e in entries)
    outbox.ack(["a:1", "a:2"])
    assert outbox.pending().bytes == sum(len(e.body) for e in entries[2:])


def test_the_byte_bound_drops_the_oldest_and_the_next_event_says_how_many(
    tmp_path: Path,
) -> None:
    size = len(answer("cam", 1, padding=900).encode())
    bound = OutboxConfig(max_mb=10 * size / 1024 / 1024, max_age_s=10**9)
    with Outbox(tmp_path / "small.outbox.db", bound, "small") as box:
        for seq in range(1, 31):  # one at a time, as a camera appends
            box.append([answer("cam", seq, padding=900)], now=1000.0 + seq)
        box.append([answer("other", 1, padding=900)], now=1100.0)
        pending = box.pending()
        assert pending.bytes <= bound.max_bytes
        dropped = box.dropped()
        kept = [e.seq for e in box.next_batch(100) if e.source == "cam"]
        # the oldest went, as a prefix of the source's seqs; what is kept is contiguous
        assert kept == list(range(dropped["cam"] + 1, 31)), (dropped, kept)
        assert dropped["cam"] + len(kept) == 30 and "other" not in dropped
        first, *rest = [e for e in box.next_batch(100) if e.source == "cam"]
        assert first.dropped == dropped["cam"]
        assert decode_event(first.body)["dropped"] == dropped["cam"]
        assert all("dropped" not in decode_event(e.body) for e in rest)
        # said on every delivery until acknowledged (a retry says it again); then not again
        again = next(e for e in box.next_batch(100) if e.source == "cam")
        assert (again.id, decode_event(again.body)["dropped"]) == (first.id, dropped["cam"])
        box.ack([first.id])
        assert all(e.dropped == 0 for e in box.next_batch(100))
        assert box.dropped() == dropped  # the figure stays


def test_drops_are_carried_to_the_next_event_when_none_is_left(tmp_path: Path) -> None:
    bound = OutboxConfig(max_mb=2000 / 1024 / 1024, max_age_s=10**9)
    with Outbox(tmp_path / "tiny.outbox.db", bound, "tiny") as box:
        box.append([answer("cam", 1, padding=100)])
        box.append([answer("cam", 2, padding=5000)])  # alone past the bound: 1 and 2 go
        assert box.pending().events == 0 and box.dropped() == {"cam": 2}
        box.append([answer("cam", 3, padding=100)])
        (event,) = box.next_batch(10)
        assert (event.seq, event.dropped, decode_event(event.body)["dropped"]) == (3, 2, 2)


def test_the_age_bound_and_a_carried_count_that_is_dropped_again(tmp_path: Path) -> None:
    bound = OutboxConfig(max_mb=64, max_age_s=30)
    with Outbox(tmp_path / "aged.outbox.db", bound, "aged") as box:
        box.append([answer("cam", seq) for seq in range(1, 6)], now=1000.0)
        box.append([answer("cam", 6)], now=1020.0)
        box.append([answer("cam", 7)], now=1040.0)  # 1..5 are 40 s old: gone
        assert [e.seq for e in box.next_batch(10)] == [6, 7]
        assert box.next_batch(10)[0].dropped == 5
        assert box.prune(now=1055.0) == 1  # 6 is 35 s old; its count of 5 goes on to 7
        (event,) = box.next_batch(10)
        assert (event.seq, event.dropped) == (7, 6)
        assert box.dropped() == {"cam": 6}


def test_seqs_are_contiguous_across_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "sequence.db"
    with Sequencer(path) as seqs:
        assert [seqs.next("a") for _ in range(3)] == [1, 2, 3]
        assert seqs.next("b") == 1
    with Sequencer(path) as seqs:
        assert seqs.next("a") == 4
        assert seqs.next("a", count=3) == 5 and seqs.last("a") == 7
        assert seqs.last("never") == 0
    assert oct(path.stat().st_mode & 0o777) == "0o600"


# A producer process: takes each seq from the sequencer, appends the event to the outbox and
# prints the seq once the append has returned (committed).
PRODUCER = """
import sys
from duomo.ipc.stream_records import FrameTime
from duomo.sinks.config import OutboxConfig
from duomo.sinks.events import Event
from duomo.sinks.outbox import Outbox
from duomo.sinks.sequencer import Sequencer

folder, source, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Sequencer(f"{folder}/sequence.db") as seqs, \\
        Outbox(f"{folder}/sink.outbox.db", OutboxConfig(max_mb=1024, max_age_s=1e9)) as box:
    print("ready", flush=True)
    n = 0
    while count == 0 or n < count:
        seq = seqs.next(source)
        box.append([Event(source, seq, "answer", FrameTime(0.0), seq, model="m",
                          result={"n": n})])
        print(seq, flush=True)
        n += 1
"""


def producer(folder: Path, source: str, count: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PRODUCER, str(folder), source, str(count)],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_kill_9_while_writing_loses_nothing_committed(tmp_path: Path) -> None:
    child = producer(tmp_path, "cam", 0)
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        printed = [int(child.stdout.readline()) for _ in range(150)]
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        printed += [int(line) for line in child.stdout.read().split()]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    assert printed == list(range(1, len(printed) + 1))
    with (
        Outbox(tmp_path / "sink.outbox.db", UNBOUNDED) as box,
        Sequencer(tmp_path / "sequence.db") as seqs,
    ):
        kept = [e.seq for e in box.next_batch(10_000)]
        # every append that returned is there; at most the one in flight is there too
        assert kept[: len(printed)] == printed and len(kept) - len(printed) <= 1
        last = seqs.last("cam")
        assert last >= kept[-1]
        assert seqs.next("cam") == last + 1  # continues: no seq handed out twice
    with sqlite3.connect(tmp_path / "sink.outbox.db") as check:
        assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_two_processes_append_at_once(tmp_path: Path) -> None:
    # both feed one source: the sequencer hands each seq to one of them only
    children = [producer(tmp_path, "cam", 300) for _ in range(2)]
    outputs = []
    started = time.monotonic()
    for child in children:
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0
        outputs.append([int(line) for line in out.split()[1:]])
    assert time.monotonic() - started < 120
    assert not set(outputs[0]) & set(outputs[1])
    assert all(seqs == sorted(seqs) for seqs in outputs)  # each in its own order
    with Outbox(tmp_path / "sink.outbox.db", UNBOUNDED) as box:
        assert [e.seq for e in box.next_batch(1000)] == list(range(1, 601))
        assert box.pending().events == 600
