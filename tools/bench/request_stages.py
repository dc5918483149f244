"""The arithmetic of ``tools.bench.request_breakdown``: a producer's timestamps joined with the
supervisor's request trace into one duration per stage, summaries of those, of the interpreter-lock
probe's wakes and of ``py-spy``'s GIL samples. No I/O; ``tests/unit/test_request_stages.py``.

Every timestamp is a ``time.monotonic`` reading (``CLOCK_MONOTONIC``, one clock for every process
of the host). A request's stages are differences of consecutive timestamps, so they add up to
its round trip exactly, whichever process took each one:

===============  ==============================================================================
stage            from → to
===============  ==============================================================================
write            the producer starts (takes a free slot) → the image is in the slot
notice           → the intake hands the slot to ``Attachment.submit``: the header written, the
                 notice sent, the socket, the reading thread's wake-up and its interpreter lock
intake           → the request is made and goes to the queue (header copied, checked)
queue wait       → the model's worker answered its previous request ("slot done" sent): time
                 behind another producer's request, 0 when the worker was free
batch formation  → the worker starts the request (the queue's put and wake-up, the previous
                 batch's end, the batch formed): the rest of the header's queue time
preprocess       the header's stage: ``prepare`` and the executor's preprocess
infer            the header's stage: the session's run
postprocess      the header's stage: the rest of ``execute``
bookkeeping      → the worker calls the slot's answer (the statistics counted)
encode           → the result is in the slot (JSON encoded and copied)
notice back      → the producer's reading thread has read the "slot done" notice
                 (``Slot.on_done``)
read             → the result is parsed and the slot released (``Slot.wait``, ``release``)
===============  ==============================================================================

Beside them, two calls that let go of the interpreter lock, timed around: ``submit call`` (the
producer's ``Slot.submit``: header, ``send``) and ``answer send`` (the worker's ``send`` of the
notice, from the encoded result until the worker runs Python again). The second is not on the
request's way (its producer may already have the answer) but holds the worker: it is in the
next request's ``queue wait``.

The stages end where a process hands over to another by what the receiver stamps, never by the
sender's stamp after its ``send`` returns: under load the sender often runs again only after
the receiver has (its core or the lock went to the woken thread), which would make a stage
negative. ``queue wait`` takes the
model's previous request as the worker's last one, which holds for one instance per model (the
demo config).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

STAGES = (
    "write", "notice", "intake", "queue wait", "batch formation", "preprocess", "infer",
    "postprocess", "bookkeeping", "encode", "notice back", "read",
)  # fmt: skip
CALLS = ("submit call", "answer send")  # timed around, beside the stages
# a producer's record of one request: (pid, ring, slot, started, written, submitted, notified,
# done), the last five time.monotonic() seconds
CLIENT_FIELDS = ("pid", "ring", "slot", "started", "written", "submitted", "notified", "done")


def server_records(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The request trace's records (``RequestTrace.write``'s JSON) as dicts, the answered ones."""
    fields = trace["fields"]
    return [r for r in (dict(zip(fields, row)) for row in trace["records"]) if r["ok"]]


def _taken(record: Mapping[str, Any]) -> float:
    return float(record["enqueued_s"] + record["queue_s"])


def queue_waits(records: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """Per record (by ``id``): the part of its queue time spent behind its model's previous
    request, which held the worker until its notice was sent (one instance per model)."""
    by_model: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        by_model.setdefault(r["model"], []).append(r)
    waits: dict[int, float] = {}
    for rows in by_model.values():
        rows.sort(key=_taken)
        previous_sent = -math.inf
        for r in rows:
            queue_s = float(r["queue_s"])
            waits[id(r)] = min(queue_s, max(0.0, previous_sent - r["enqueued_s"]))
            previous_sent = r["sent_s"]
    return waits


def join(
    clients: Sequence[Sequence[float]], records: Sequence[Mapping[str, Any]]
) -> list[dict[str, float]]:
    """Each producer request (``CLIENT_FIELDS``) with its supervisor record: the one of the same
    producer, ring and slot whose intake lies inside the request (one request in flight per
    slot); its stages in seconds (``STAGES``), ``round trip`` and the ``CALLS``. A request
    without a record is left out."""
    waits = queue_waits(records)
    by_slot: dict[tuple[int, int, int], list[Mapping[str, Any]]] = {}
    for r in records:
        by_slot.setdefault((r["pid"], r["ring"], r["slot"]), []).append(r)
    starts: dict[tuple[int, int, int], list[float]] = {}
    for key, rows in by_slot.items():
        rows.sort(key=lambda r: r["intake_s"])
        starts[key] = [r["intake_s"] for r in rows]
    joined = []
    for pid, ring, slot, started, written, submitted, notified, done in clients:
        key = (int(pid), int(ring), int(slot))
        rows = by_slot.get(key, [])
        i = bisect.bisect_left(starts.get(key, []), written)
        if i == len(rows) or rows[i]["intake_s"] > done or not rows[i]["encoded_s"]:
            continue
        r = rows[i]
        taken = _taken(r)
        computed = taken + r["preprocess_s"] + r["infer_s"] + r["postprocess_s"]
        wait = waits[id(r)]
        joined.append({
            "write": written - started,
            "notice": r["intake_s"] - written,
            "intake": r["enqueued_s"] - r["intake_s"],
            "queue wait": wait,
            "batch formation": r["queue_s"] - wait,
            "preprocess": r["preprocess_s"],
            "infer": r["infer_s"],
            "postprocess": r["postprocess_s"],
            "bookkeeping": r["answering_s"] - computed,
            "encode": r["encoded_s"] - r["answering_s"],
            "notice back": notified - r["encoded_s"],
            "read": done - notified,
            "round trip": done - started,
            "submit call": submitted - written,
            "answer send": r["sent_s"] - r["encoded_s"],
        })  # fmt: skip
    return joined


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear between the two nearest; NaN when empty)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def summarize(joined: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """Per stage, for the round trip and the calls: p50, p90 and mean in ms; the sums of the
    stages' medians and means (the means' sum is the mean round trip, exactly)."""
    names = (*STAGES, "round trip", *CALLS)
    stages = {
        name: {
            "p50_ms": quantile(values, 0.5) * 1e3,
            "p90_ms": quantile(values, 0.9) * 1e3,
            "mean_ms": sum(values) / len(values) * 1e3 if values else math.nan,
        }
        for name in names
        for values in ([j[name] for j in joined],)
    }
    return {
        "requests": len(joined),
        "stages": stages,
        "sum_of_p50_ms": sum(stages[s]["p50_ms"] for s in STAGES),
        "sum_of_mean_ms": sum(stages[s]["mean_ms"] for s in STAGES),
    }


def probe_window(figures: Mapping[str, Any], start_s: float, end_s: float) -> dict[str, Any]:
    """The interpreter-lock probe's wakes (``GilProbe.figures``) inside ``[start_s, end_s)``:
    how late they woke (µs: p50, p90, p99, mean) and, from its schedstat readings inside the
    window, the mean run-queue wait per wake (µs; None without two readings)."""
    start_us, end_us = start_s * 1e6, end_s * 1e6
    woken = figures["woken_us"]
    lo, hi = bisect.bisect_left(woken, start_us), bisect.bisect_left(woken, end_us)
    late = list(figures["late_us"][lo:hi])
    readings = [s for s in figures["schedstat"] if start_s <= s[0] < end_s]
    runqueue_us = None
    if len(readings) >= 2:
        first, last = readings[0], readings[-1]
        wakes = bisect.bisect_left(woken, last[0] * 1e6) - bisect.bisect_left(woken, first[0] * 1e6)
        if wakes > 0:
            runqueue_us = (last[2] - first[2]) / 1e3 / wakes
    return {
        "wakes": len(late),
        "p50_us": quantile(late, 0.5),
        "p90_us": quantile(late, 0.9),
        "p99_us": quantile(late, 0.99),
        "mean_us": sum(late) / len(late) if late else math.nan,
        "runqueue_mean_us": runqueue_us,
    }


def gil_wait(probe: Mapping[str, Any], twin: Mapping[str, Any]) -> dict[str, float | None]:
    """What the supervisor's probe waited for the interpreter lock per wake, in µs: its mean
    lateness less the twin's (the same probe in a process of its own, under the same load:
    timer slack and the wait for a core); and, where both have schedstat, less its own
    run-queue wait and the twin's lateness beyond the twin's run-queue wait (the slack)."""
    by_twin = probe["mean_us"] - twin["mean_us"]
    by_schedstat = None
    if probe["runqueue_mean_us"] is not None and twin["runqueue_mean_us"] is not None:
        slack = twin["mean_us"] - twin["runqueue_mean_us"]
        by_schedstat = probe["mean_us"] - probe["runqueue_mean_us"] - slack
    return {"mean_less_twin_us": by_twin, "mean_less_runqueue_and_slack_us": by_schedstat}


def gil_samples(raw: str, rate_hz: float, seconds: float) -> dict[str, Any]:
    """``py-spy record --gil --threads --format raw``'s output: the share of the time some
    thread held the interpreter lock (samples ÷ rate × seconds), and each thread's share, by
    its name (``duomo-classify-0``, ``duomo-reactor``), or where py-spy gives none, by the first
    of its frames that says whose it is (``thread_role``)."""
    threads: dict[str, int] = {}
    roles: dict[str, int] = {}  # thread -> the first of ROLES any of its stacks showed
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0] if frames[0].startswith("thread") else "?"
        threads[thread] = threads.get(thread, 0) + int(count)
        total += int(count)
        role = thread_role(frames)
        if role is not None:
            roles[thread] = min(role, roles.get(thread, role))
    ticks = rate_hz * seconds
    by_role: dict[str, float] = {}
    for thread, n in threads.items():
        name = thread.partition(": ")[2]  # py-spy 0.4: "thread (TID): NAME"
        if not name:
            name = ROLES[roles[thread]][1] if thread in roles else "other"
        by_role[name] = by_role.get(name, 0.0) + n / ticks
    return {"samples": total, "ticks": ticks, "held": total / ticks, "by_thread": by_role}


# frames that say whose a thread is, first match wins: the model's executor, then the rest
ROLES = (
    ("classification.py", "classify worker"),
    ("face_detection.py", "face worker"),
    ("ocr", "ocr worker"),
    ("reactor.py", "reactor"),
    ("lending.py", "lending worker"),
    ("gil_probe.py", "probe"),
)


def thread_role(frames: Sequence[str]) -> int | None:
    """The index in ``ROLES`` of the first role whose file one of ``frames`` names."""
    for index, (needle, _) in enumerate(ROLES):
        if any(needle in frame for frame in frames):
            return index
    return None
