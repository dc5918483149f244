"""Triton Python-backend BLS model ``faces`` for the pipeline benchmark: the chain Duomo's
``faces`` pipeline runs, written as Triton's docs suggest for per-object fan-out (an ensemble
cannot fan out over the faces a detector found).

``IMAGE`` (UINT8 [-1, -1, 3]) in; a BLS request to ``face`` (the detector: ``triton_model.py``),
then for every face one request to ``face_embedding`` and one to ``face_attributes``
(``triton_faces_chip.py``: the frame and the face's landmarks), all of them in flight at once
(``async_exec``, so the second-stage models' dynamic batchers can batch them, and the chips of
other frames in flight in other instances of this model); out ``RESULT`` (BYTES [1]), JSON
``{"result": the detector's result with each face's "embedding" and "attributes"}`` — the shape
of Duomo's pipeline answer. A failed sub-request is that face's ``{"error": ...}``.

Copied by ``tools.bench.pipelines`` into ``<repository>/faces/1/model.py``; it runs as several
instances (one per producer: one frame each at a time).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

SUB_MODELS = {"embedding": "face_embedding", "attributes": "face_attributes"}


def _result(response: Any) -> Any:
    if response.has_error():
        return {"error": {"code": "INTERNAL", "message": response.error().message()}}
    blob = pb_utils.get_output_tensor_by_name(response, "RESULT").as_numpy().reshape(-1)[0]
    return json.loads(blob)["result"]


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        pass

    async def _frame(self, image: np.ndarray) -> dict[str, Any]:
        detect = pb_utils.InferenceRequest(
            model_name="face",
            requested_output_names=["RESULT"],
            inputs=[pb_utils.Tensor("IMAGE", image)],
        )
        found = _result(await detect.async_exec())
        if "error" in found:
            raise RuntimeError(found["error"]["message"])
        batched = image[None]
        jobs = []
        for face in found.get("faces", []):
            landmarks = np.asarray(face["landmarks"], dtype=np.float32)[None]
            for key, model in SUB_MODELS.items():
                request = pb_utils.InferenceRequest(
                    model_name=model,
                    requested_output_names=["RESULT"],
                    inputs=[pb_utils.Tensor("IMAGE", batched),
                            pb_utils.Tensor("LANDMARKS", landmarks)],
                )  # fmt: skip
                jobs.append((face, key, request.async_exec()))
        answers = await asyncio.gather(*(job for _, _, job in jobs))
        for (face, key, _), response in zip(jobs, answers):
            face[key] = _result(response)
        return dict(found)

    async def execute(self, requests: list[Any]) -> list[Any]:
        images = [pb_utils.get_input_tensor_by_name(r, "IMAGE").as_numpy() for r in requests]
        results = await asyncio.gather(
            *(self._frame(image) for image in images), return_exceptions=True
        )
        responses = []
        for result in results:
            if isinstance(result, BaseException):
                error = pb_utils.TritonError(f"{type(result).__name__}: {result}")
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            blob = json.dumps({"result": result}).encode()
            tensor = pb_utils.Tensor("RESULT", np.array([blob], dtype=np.object_))
            responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
        return responses

    def finalize(self) -> None:
        pass
