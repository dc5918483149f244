"""Triton Python-backend model for the pipeline benchmark: one of Duomo's face tasks
(``face_embedding`` or ``face_attributes``) over Triton's dynamic batcher.

Inputs (a batch dimension first, as ``max_batch_size`` > 0 makes it): ``IMAGE`` (UINT8
[-1, -1, 3], the frame) and ``LANDMARKS`` (FP32 [5, 2], one face's five points in that frame);
out ``RESULT`` (BYTES [1]): JSON ``{"result": the executor's result, "compute_us": the time the
batch spent in the executor}``. Every request the batcher hands to ``execute`` together runs as
one batch of the executor (up to the model's ``max_batch``), as Duomo's batcher runs them.

Copied by ``tools.bench.pipelines`` into ``<repository>/<model>/1/model.py``; its
``config.pbtxt`` names the Duomo checkout (``duomo_root``), the supervisor config and the model.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        params = {
            k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()
        }
        sys.path.append(params["duomo_root"])
        from duomo.worker.executors.base import StageTimer
        from tools.bench.inprocess import open_executor

        self.timer = StageTimer
        self.executor = open_executor(params["duomo_config"], params["duomo_model"], threads=1)

    def execute(self, requests: list[Any]) -> list[Any]:
        items: list[Any] = []
        failed: dict[int, str] = {}
        for i, request in enumerate(requests):
            image = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()[0]
            landmarks = pb_utils.get_input_tensor_by_name(request, "LANDMARKS").as_numpy()[0]
            try:
                items.append(self.executor.prepare({"image": image, "landmarks": landmarks}))
            except Exception as err:  # this request fails; the others run
                failed[i] = f"{type(err).__name__}: {err}"
        started = time.perf_counter()
        try:
            results = self.executor.execute(items, self.timer()) if items else []
        except Exception as err:
            results = [err] * len(items)
        compute_us = int((time.perf_counter() - started) * 1e6)
        answers = iter(results)
        responses = []
        for i in range(len(requests)):
            result = next(answers) if i not in failed else None
            if i in failed or isinstance(result, Exception):
                message = failed.get(i) or f"{type(result).__name__}: {result}"
                error = pb_utils.TritonError(message)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            blob = json.dumps({"result": result, "compute_us": compute_us}).encode()
            tensor = pb_utils.Tensor("RESULT", np.array([[blob]], dtype=np.object_))
            responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
        return responses

    def finalize(self) -> None:
        self.executor.close()
