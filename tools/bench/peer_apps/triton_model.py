"""Triton Python-backend model for ``duomo bench``: one Duomo executor, an image in (UINT8
[-1, -1, -1]), out as JSON in a BYTES tensor ``{"result": the result dict, "compute_us": the
time this model spent in the executor}``.

Copied by ``tools.bench.peers`` into ``<repository>/<model>/1/model.py``. The model's
``config.pbtxt`` names the Duomo checkout (``duomo_root``), the supervisor config and the model.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        params = {
            k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()
        }
        sys.path.append(params["duomo_root"])
        from tools.bench.inprocess import open_executor, run_timed

        self.run_timed = run_timed
        self.executor = open_executor(params["duomo_config"], params["duomo_model"], threads=1)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            image = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            try:
                result, compute_us = self.run_timed(self.executor, image)
                blob = json.dumps({"result": result, "compute_us": compute_us}).encode()
            except Exception as err:  # the client gets the reason; the model keeps serving
                error = pb_utils.TritonError(f"{type(err).__name__}: {err}")
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            tensor = pb_utils.Tensor("RESULT", np.array([blob], dtype=np.object_))
            responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
        return responses

    def finalize(self) -> None:
        self.executor.close()
