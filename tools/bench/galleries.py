"""The galleries benchmark of ``duomo bench --galleries`` (issue 47): what a gallery model costs
at 1 000, 100 000 and 1 000 000 identities (``sizes``), in this process.

For each size: a gallery file of that many identities, one random unit 128-d embedding each (the
SFace dimension), enrolled through ``GalleryStore.add_many`` in changes of ``CHUNK`` (the
store's enrolment rate, identities per second); the ``gallery`` task's executor opened on it as a
model worker opens it (the load's seconds, and the bytes per identity it is charged: its
snapshot, which ``tests/integration/test_gallery_model.py`` checks against what a supervisor
grows); then searches through the executor (``prepare`` and
``execute``, as a worker runs a batch) at batch 1 and batch 8, each for ``seconds``: the time per
query and per batch. Every query is an enrolled embedding with noise added, and must come back
as its own name (a wrong answer fails the part). numpy's BLAS threads are as the process has
them (the report says how many cores).

Then, unless told not to, the pipeline part (``tools.bench.gallery_pipeline``): ``faces``
frames per second with and without its ``identity`` step on 4-face frames, and enrolment through
the producer API in images per second, in a supervisor of its own.

Called by ``tools.bench.run``; its section is added to the report here (``add_part``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import numpy as np

from duomo.worker.backends.base import Backend, SessionSettings
from duomo.worker.executors.base import StageTimer
from duomo.worker.executors.gallery import GalleryExecutor, GalleryParams
from duomo.worker.galleries.store import GalleryLimits, GalleryStore, NewIdentity
from tools.bench.gallery_pipeline import GalleryPipelineSettings, run_gallery_pipeline
from tools.bench.gallery_pipeline import markdown as pipeline_markdown
from tools.bench.report import add_part

DIMENSION = 128
CHUNK = 10_000  # identities per change while enrolling
QUERIES = 64  # the enrolled identities queried (with noise), in turn
NOISE = 0.02  # per coordinate, on a unit vector of 128: the queries stay far above the threshold


def _log(message: str) -> None:
    print(f"duomo bench: galleries: {message}", file=sys.stderr, flush=True)


def _unit_rows(rng: np.random.Generator, count: int) -> np.ndarray:
    rows = rng.standard_normal((count, DIMENSION)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def _enrol(path: Path, size: int, rng: np.random.Generator) -> tuple[float, np.ndarray]:
    """A gallery of ``size`` identities ``id-<i>`` at ``path``: the seconds it took, and the
    first ``QUERIES`` enrolled vectors (``id-0`` …) to query with."""
    limits = GalleryLimits(max_identities=max(size, 1))
    first_rows = np.empty((0, DIMENSION), np.float32)
    started = time.perf_counter()
    with GalleryStore.create(path, "sface", DIMENSION) as store:
        for first in range(0, size, CHUNK):
            rows = _unit_rows(rng, min(CHUNK, size - first))
            store.add_many(
                (NewIdentity(f"id-{first + i}", row) for i, row in enumerate(rows)),
                limits=limits,
            )
            if first == 0:
                first_rows = rows[:QUERIES].copy()
    return time.perf_counter() - started, first_rows


def _search(
    executor: GalleryExecutor, queries: np.ndarray, batch: int, seconds: float
) -> dict[str, float]:
    """Batches of ``batch`` queries for ``seconds``: ms per batch and per query; every answer
    checked against its name (query ``i`` is ``id-i`` with noise)."""
    batches = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds or batches < 3:
        picked = [(batches * batch + k) % len(queries) for k in range(batch)]
        answers = executor.execute([executor.prepare(queries[i]) for i in picked], StageTimer())
        for i, answer in zip(picked, answers):
            if not isinstance(answer, dict) or answer.get("name") != f"id-{i}":
                raise RuntimeError(f"query {i} answered {answer!r}")
        batches += 1
    per_batch_ms = 1e3 * (time.perf_counter() - started) / batches
    return {"batches": batches, "per_batch_ms": per_batch_ms, "per_query_ms": per_batch_ms / batch}


def trial(size: int, seconds: float, folder: Path) -> dict[str, Any]:
    """One gallery of ``size`` identities: enrolment, load, memory, searches."""
    rng = np.random.default_rng(size)
    path = folder / f"gallery-{size}.db"
    enrol_s, enrolled = _enrol(path, size, rng)
    noisy = enrolled + rng.normal(0, NOISE, enrolled.shape).astype(np.float32)
    params = GalleryParams(dimension=DIMENSION, max_identities=max(size, 1))
    started = time.perf_counter()
    executor = GalleryExecutor.open(
        params, {"model": path}, 8, cast(Backend, None), SessionSettings(intra_op_threads=1)
    )
    load_s = time.perf_counter() - started
    assert isinstance(executor, GalleryExecutor)
    try:
        charged = executor.sessions["model"].memory.weights
        searches = {str(b): _search(executor, noisy, b, seconds) for b in (1, 8)}
    finally:
        executor.close()
    return {
        "identities": size,
        "enrol_per_s": size / enrol_s,
        "file_mib": path.stat().st_size / 2**20,
        "load_s": load_s,
        "charged_bytes": charged.nbytes if charged is not None else None,
        "bytes_per_identity": (charged.nbytes / size) if charged is not None else None,
        "search": searches,
    }


def run_galleries(sizes: tuple[int, ...], seconds: float) -> dict[str, Any]:
    trials = []
    with tempfile.TemporaryDirectory(prefix="duomo-bench-galleries-") as tmp:
        for size in sizes:
            _log(f"{size} identities")
            trials.append(trial(size, seconds, Path(tmp)))
            for leftover in Path(tmp).iterdir():  # (a million identities' file is 0.6 GB)
                leftover.unlink()
    return {"sizes": list(sizes), "seconds": seconds, "cpus": os.cpu_count(), "trials": trials}


def markdown(raw: dict[str, Any]) -> str:
    lines = [
        "## Galleries: search, memory, enrolment",
        "",
        f"A gallery of N random 128-d identities (one embedding each) served by the `gallery` "
        f"task's executor in this process ({raw['cpus']} cores; numpy's BLAS threads as the "
        "process has them); each query an enrolled embedding with noise, answered by its own "
        "name. Enrolment: `GalleryStore.add_many`, 10 000 identities a change.",
        "",
        "| identities | enrolled/s | file MiB | load s | charged bytes per identity | "
        "ms per query, batch 1 | ms per query, batch 8 |",
        "|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for t in raw["trials"]:
        per_identity = t["bytes_per_identity"]
        lines.append(
            f"| {t['identities']:,} | {t['enrol_per_s']:,.0f} | {t['file_mib']:.1f} | "
            f"{t['load_s']:.2f} | {'—' if per_identity is None else f'{per_identity:.0f}'} | "
            f"{t['search']['1']['per_query_ms']:.3f} | {t['search']['8']['per_query_ms']:.3f} |"
        )
    section = "\n".join(lines) + "\n"
    if raw.get("pipeline") is not None:
        section += pipeline_markdown(raw["pipeline"])
    return section


def bench_galleries(
    out: Path,
    sizes: tuple[int, ...],
    seconds: float,
    pipeline: GalleryPipelineSettings | None = None,
) -> str:
    """``duomo bench --galleries``: run it (with ``pipeline``, the pipeline part too) and add it
    to the report in ``out``; its section."""
    raw = run_galleries(sizes, seconds)
    raw["pipeline"] = None if pipeline is None else run_gallery_pipeline(pipeline)
    section = markdown(raw)
    add_part(out, "galleries", raw, section)
    return section
