"""A producer process of the pipeline benchmark (``tools.bench.pipelines``).

``python -m tools.bench.pipeline_producer KIND`` with a JSON spec on stdin, the protocol of
``tools.bench.children.Child``: it connects, prints ``ready``, reads the window (wall-clock start
and end), sends frames closed loop (the next frame once the last one is answered) until the
window ends and prints one JSON line with its figures. KIND is:

- ``pipeline`` — ``client.model("faces").infer(frame)``: the Duomo pipeline, one request per
  frame, every face's embedding and attributes in its answer;
- ``client`` — the same chain driven from the producer: ``client.model("face").infer(frame)``,
  then, for every face found, one request to ``face_embedding`` and one to ``face_attributes``,
  each ``{"image": frame, "landmarks": the face's five points}`` (the slot of a face task holds
  the frame and one face's landmarks: the producer writes the frame once per face and model, and
  the supervisor aligns the chip), all of a frame's 2 × faces requests in flight at once
  (``infer_async``), the frame answered when the last has; ``client-seq`` sends them one after
  another (``infer``), as the simplest loop does;
- ``triton`` — ``tritonclient.http`` to the BLS model ``faces`` of the Triton server
  ``tools.bench.pipelines`` starts (``tools/bench/peer_apps/triton_faces_bls.py``);
- ``stream`` — one ``client.stream(name, models=["faces"], policy="fifo")`` fed with a clip of
  synthetic frames where the faces persist and move (``moving_frame``), at most ``in_flight``
  frames sent and not answered.

A frame counts when its answer arrives inside the window; its latency is send → last answer.
An answer that does not hold ``faces`` faces, each with both sub-results, counts as wrong.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from tools.bench.inprocess import await_window, print_figures

# past the window's end, a producer still running dumps its threads' stacks and exits
HANG_AFTER_S = 120.0
SUB_STEPS = ("embedding", "attributes")
TIMEOUT_S = 60.0

Frame = Callable[[int], np.ndarray]
Answer = dict[str, Any]


def moving_frame(base: np.ndarray, i: int, amplitude: int = 12) -> np.ndarray:
    """Frame ``i`` of a clip where ``base``'s faces persist: ``base`` shifted by a triangle wave
    (1 px a frame across, 1 px every other frame down, within ±``amplitude`` px), the edge
    repeated; the same shape as ``base``."""

    def wave(t: int) -> int:
        period = 4 * amplitude
        phase = t % period
        return phase if phase <= 2 * amplitude else period - phase

    dx, dy = wave(i) - amplitude, wave(i // 2) - amplitude
    padded = np.pad(base, ((amplitude, amplitude), (amplitude, amplitude), (0, 0)), mode="edge")
    h, w = base.shape[:2]
    top, left = amplitude - dy, amplitude - dx
    return np.ascontiguousarray(padded[top : top + h, left : left + w])


def check_answer(answer: Any, faces: int) -> bool:
    """Whether a pipeline answer holds ``faces`` faces, each with an embedding and attributes
    that are results, not errors."""
    found = answer.get("faces") if isinstance(answer, dict) else None
    if not isinstance(found, list) or len(found) != faces:
        return False
    for face in found:
        for step in SUB_STEPS:
            sub = face.get(step)
            if not isinstance(sub, dict) or "error" in sub:
                return False
    return True


# -- the three ways to run the chain --------------------------------------------------------


def _pipeline(spec: dict[str, Any]) -> tuple[Callable[[np.ndarray], Answer], Callable[[], None]]:
    from duomo.ipc.client import Client

    client = Client(spec["socket"], timeout_s=TIMEOUT_S)
    handle = client.model(spec.get("pipeline", "faces"), slots=2)

    def run(frame: np.ndarray) -> Answer:
        return dict(handle.infer(frame, timeout_s=TIMEOUT_S))

    return run, client.close


def _client_chain(
    spec: dict[str, Any], sequential: bool
) -> tuple[Callable[[np.ndarray], Answer], Callable[[], None]]:
    from duomo.ipc.client import Client

    client = Client(spec["socket"], timeout_s=TIMEOUT_S)
    detect = client.model("face", slots=2)
    slots = max(2, int(spec.get("faces", 1)))
    second = {"embedding": client.model("face_embedding", slots=slots),
              "attributes": client.model("face_attributes", slots=slots)}  # fmt: skip

    def run(frame: np.ndarray) -> Answer:
        answer = dict(detect.infer(frame, timeout_s=TIMEOUT_S))
        faces = answer.get("faces", [])
        requests = [
            (face, step, {"image": frame, "landmarks": np.asarray(face["landmarks"], np.float32)})
            for face in faces
            for step in SUB_STEPS
        ]
        if sequential:
            for face, step, data in requests:
                face[step] = second[step].infer(data, timeout_s=TIMEOUT_S)
        else:
            futures = [
                (face, step, second[step].infer_async(data, timeout_s=TIMEOUT_S))
                for face, step, data in requests
            ]
            for face, step, future in futures:
                face[step] = future.result(TIMEOUT_S)
        return answer

    return run, client.close


def _triton(spec: dict[str, Any]) -> tuple[Callable[[np.ndarray], Answer], Callable[[], None]]:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(
        f"127.0.0.1:{spec['port']}", network_timeout=TIMEOUT_S
    )
    wanted = [httpclient.InferRequestedOutput("RESULT", binary_data=True)]

    def run(frame: np.ndarray) -> Answer:
        tensor = httpclient.InferInput("IMAGE", list(frame.shape), "UINT8")
        tensor.set_data_from_numpy(frame, binary_data=True)
        blob = client.infer("faces", [tensor], outputs=wanted).as_numpy("RESULT")
        return dict(json.loads(blob.reshape(-1)[0])["result"])

    return run, client.close


def closed_loop(run: Callable[[np.ndarray], Answer], frame: Frame, faces: int) -> dict[str, Any]:
    """Frames one after another until the window ends: the answers inside it."""
    start_at, end_at = await_window()
    faulthandler.dump_traceback_later(end_at - time.time() + HANG_AFTER_S, exit=True)
    latencies: list[float] = []
    wrong = 0
    errors: Counter[str] = Counter()
    i = 0
    while time.time() < end_at:
        image = frame(i)
        i += 1
        sent = time.time()
        try:
            answer = run(image)
            error = None
        except Exception as err:  # counted by kind; the loop goes on
            error = f"{type(err).__name__}: {err}"[:200]
        done = time.time()
        if not start_at <= done <= end_at:
            continue
        if error is not None:
            errors[error] += 1
        elif check_answer(answer, faces):
            latencies.append((done - sent) * 1e3)
        else:
            wrong += 1
    return {"ok": len(latencies), "wrong": wrong, "errors": dict(errors),
            "latencies_ms": [round(x, 3) for x in latencies]}  # fmt: skip


# -- a stream of moving faces ---------------------------------------------------------------


def play_stream(spec: dict[str, Any], base: np.ndarray) -> dict[str, Any]:
    """One stream into the pipeline, closed loop with ``in_flight`` frames outstanding."""
    from duomo.ipc.client import Client

    client = Client(spec["socket"], timeout_s=TIMEOUT_S)
    pipeline = spec.get("pipeline", "faces")
    stream = client.stream(
        spec["stream"], models=[pipeline], policy="fifo", slots=int(spec["in_flight"]) + 1
    )
    clip = int(spec.get("clip_frames", 300))
    frames = [moving_frame(base, i) for i in range(clip)]
    faces = int(spec["faces"])
    start_at, end_at = await_window()
    faulthandler.dump_traceback_later(end_at - time.time() + HANG_AFTER_S, exit=True)
    sent_at: dict[int, float] = {}
    latencies: list[float] = []
    wrong = 0
    reused = 0
    tracked = 0
    errors: Counter[str] = Counter()
    number = 0
    while True:
        now = time.time()
        if now >= end_at and not sent_at:
            break
        if now < end_at and len(sent_at) < int(spec["in_flight"]):
            sent_at[number] = time.time()
            stream.send(frames[number % clip], frame=number)
            number += 1
            continue
        for answer in stream.answers(timeout_s=TIMEOUT_S):
            sent = sent_at.pop(answer.frame, None)
            done = time.time()
            if sent is not None and start_at <= done <= end_at:
                if answer.outcome != "OK":
                    errors[f"{answer.outcome}: {answer.error}"[:200]] += 1
                elif check_answer(answer.result, faces):
                    latencies.append((done - sent) * 1e3)
                    for face in answer.result["faces"]:
                        tracked += "track_id" in face
                        reused += sum(bool(face[s].get("reused")) for s in SUB_STEPS)
                else:
                    wrong += 1
            break
        else:
            errors["no answer within the timeout"] += 1
            break
    stream.close()
    client.close()
    return {"ok": len(latencies), "wrong": wrong, "errors": dict(errors),
            "latencies_ms": [round(x, 3) for x in latencies],
            "reused_sub_results": reused, "tracked_faces": tracked}  # fmt: skip


def main(argv: list[str]) -> int:
    """``python -m tools.bench.pipeline_producer pipeline|client|client-seq|triton|stream``."""
    kind = argv[0]
    spec = json.loads(sys.stdin.readline())
    base = np.load(spec["frame"])
    cpu0 = time.process_time()
    if kind == "stream":
        result = play_stream(spec, base)
    else:
        if kind == "pipeline":
            run, close = _pipeline(spec)
        elif kind in ("client", "client-seq"):
            run, close = _client_chain(spec, sequential=kind == "client-seq")
        elif kind == "triton":
            run, close = _triton(spec)
        else:
            raise SystemExit(f"unknown producer kind {kind!r}")
        try:
            result = closed_loop(run, lambda i: base, int(spec["faces"]))
        finally:
            close()
    return print_figures(result, cpu0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
