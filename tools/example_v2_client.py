"""An example remote caller: ``tritonclient`` (HTTP and gRPC) against Duomo's KServe v2 gateway,
as any v2 client would call Triton, KServe or OpenVINO Model Server.

    duomo start -c configs/default.yaml        # its gateway: HTTP :8000, gRPC :8001
    python tools/example_v2_client.py [--http 127.0.0.1:8000] [--grpc 127.0.0.1:8001]

It sends a fixture image to ``classify`` as ``UINT8`` pixels over HTTP and as PNG bytes over
gRPC, and prints the answers with the server's metadata.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
IMAGE = ROOT / "tests" / "fixtures" / "images" / "coffee.png"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--http", default="127.0.0.1:8000")
    parser.add_argument("--grpc", default="127.0.0.1:8001")
    parser.add_argument("--model", default="classify")
    args = parser.parse_args()
    http = httpclient.InferenceServerClient(args.http)
    server = http.get_server_metadata()
    print(f"v2 server {server['name']} {server['version']} at {args.http}: "
          f"{', '.join(m['name'] for m in http.get_model_repository_index())}")  # fmt: skip
    image = np.asarray(Image.open(IMAGE).convert("RGB"))  # uint8 H×W×3, as a remote caller reads it
    pixels = httpclient.InferInput("IMAGE", list(image.shape), "UINT8")
    pixels.set_data_from_numpy(image)
    started = time.perf_counter()
    answer = http.infer(args.model, [pixels])
    elapsed_ms = (time.perf_counter() - started) * 1e3
    best = json.loads(answer.as_numpy("RESULT")[0])["top"][0]
    print(f"  HTTP, UINT8 {list(image.shape)}: {best['label']} ({best['score']:.2f}) "
          f"[{elapsed_ms:.1f} ms]")  # fmt: skip
    grpc = grpcclient.InferenceServerClient(args.grpc)
    png = grpcclient.InferInput("IMAGE", [1], "BYTES")
    png.set_data_from_numpy(np.array([IMAGE.read_bytes()], dtype=np.object_))
    started = time.perf_counter()
    answer = grpc.infer(args.model, [png])
    elapsed_ms = (time.perf_counter() - started) * 1e3
    best = json.loads(answer.as_numpy("RESULT")[0])["top"][0]
    print(f"  gRPC, PNG bytes: {best['label']} ({best['score']:.2f}) [{elapsed_ms:.1f} ms]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
