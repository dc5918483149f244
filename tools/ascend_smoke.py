"""Smoke test for a deploy engineer with a real Ascend card: does Duomo's ACL backend work here?

    python tools/ascend_smoke.py models/ascend-ascend310p3/*.om [--seconds 3] [--out report.json]

It writes one JSON report (send it to us: docs/ascend.md):
- the environment (``duomo check``'s report: npu-smi, driver, CANN, pyACL, SoC, device memory);
- per ``.om``: what it takes and returns (dtypes, formats, gears), ``query_size`` and the measured
  device memory, and every gear run once with random input, compared with the same model in ONNX
  on the CPU (found through the ``.om.atc.json`` sidecar ``tools/atc_convert.py`` writes) within a
  tolerance that allows for fp16;
- execute throughput with 1, 2 and 4 streams per model (one session, hence one context, stream
  and model id, per stream, each on its own thread, as Duomo's instances run), and with all the
  given models at once.

Exit code 0 when every model loaded and matched, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from duomo.supervisor.operators.environment import probe
from duomo.worker.backends.acl_backend import AclBackend, AclSession, atc_sidecar
from duomo.worker.backends.base import SessionSettings

TOLERANCE = 2e-2  # fp16 on the AI cores against fp32 on the CPU


def _random_inputs(session: AclSession, gear: tuple[int, ...], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    inputs = {}
    for spec in session.inputs:
        shape = session.shape_at(spec, gear)
        if spec.dtype.kind == "f":
            inputs[spec.name] = rng.random(shape, dtype=np.float32).astype(spec.dtype)
        else:
            inputs[spec.name] = rng.integers(0, 255, shape).astype(spec.dtype)
    return inputs


def _compare(om: Path, session: AclSession) -> list[dict[str, Any]]:
    """Every gear once, against the ONNX model on CPU when the sidecar names it."""
    from duomo.worker.backends.ort_backend import OrtBackend

    onnx = (atc_sidecar(om) or {}).get("onnx")
    cpu = (
        OrtBackend().open(Path(onnx), SessionSettings(1)) if onnx and Path(onnx).is_file() else None
    )
    results = []
    try:
        for gear in session.every_gear():
            inputs = _random_inputs(session, gear, sum(gear))
            got = {k: v.copy() for k, v in session.run(inputs).items()}
            entry: dict[str, Any] = {
                "gear": list(gear),
                "shapes": {k: list(v.shape) for k, v in got.items()},
            }
            if cpu is not None:
                want = cpu.run({c.name: inputs[a.name] for c, a in zip(cpu.inputs, session.inputs)})
                diffs = [float(np.max(np.abs(a - b))) for a, b in zip(got.values(), want.values())]
                entry["max_abs_diff"] = max(diffs, default=0.0)
                entry["match"] = all(
                    np.allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE)
                    for a, b in zip(got.values(), want.values())
                )
            results.append(entry)
    finally:
        if cpu is not None:
            cpu.close()
    return results


def _throughput(backend: AclBackend, models: list[Path], streams: int, seconds: float) -> float:
    """Executes per second with ``streams`` sessions per model, each on its own thread."""
    counts: list[int] = []
    lock = threading.Lock()
    errors: list[str] = []
    start_at = threading.Barrier(streams * len(models))

    def worker(om: Path) -> None:
        session = backend.open(om, SessionSettings(1))
        try:
            inputs = _random_inputs(session, session.every_gear()[-1], 0)
            start_at.wait()
            end, done = time.perf_counter() + seconds, 0
            while time.perf_counter() < end:
                session.run(inputs)
                done += 1
            with lock:
                counts.append(done)
        except Exception as err:
            with lock:
                errors.append(f"{om.name}: {err}")
            start_at.abort()
        finally:
            session.close()

    threads = [threading.Thread(target=worker, args=(om,)) for om in models for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return sum(counts) / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path, help=".om files")
    parser.add_argument("--seconds", type=float, default=3.0, help="per throughput measurement")
    parser.add_argument("--out", type=Path, default=Path("ascend_smoke_report.json"))
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": probe(),
        "models": {},
    }
    ok = True
    backend = AclBackend()
    try:
        for om in args.models:
            entry: dict[str, Any] = {}
            try:
                session = backend.open(om, SessionSettings(1))
                try:
                    entry.update(session.describe())
                    entry["gears_checked"] = _compare(om, session)
                finally:
                    session.close()
                ok &= all(g.get("match", True) for g in entry["gears_checked"])
                entry["executes_per_s"] = {
                    str(n): round(_throughput(backend, [om], n, args.seconds), 1) for n in (1, 2, 4)
                }
            except Exception as err:
                entry["error"] = f"{type(err).__name__}: {err}"
                ok = False
            report["models"][str(om)] = entry
        if len(args.models) > 1 and ok:
            report["all_models_executes_per_s"] = {
                str(n): round(_throughput(backend, args.models, n, args.seconds), 1) for n in (1, 2)
            }
    finally:
        backend.close()
    report["ok"] = ok
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("ok", "models")}, indent=2))
    print(f"report: {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
