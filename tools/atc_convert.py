"""Convert the demo's ONNX models to Ascend ``.om`` files with ATC, the way configs/ascend-*.yaml
expects them, and record what was built next to each ``.om`` (``<name>.om.atc.json``: SoC, command,
source hash), which the ACL backend checks against the card at load.

Run on a machine with the CANN toolkit (``atc`` on PATH, ``set_env.sh`` sourced), after
``python tools/prepare_models.py``::

    python tools/atc_convert.py --soc Ascend310P3 [--out models/ascend-310p] [--dry-run]
    python tools/atc_convert.py --soc Ascend910B3 --out models/ascend-910b

``--dry-run`` prints the commands without running them (it works without CANN).

What is built, all ``--precision_mode=allow_fp32_to_fp16`` (fp16 on the AI cores where an operator
supports it, fp32 elsewhere): EfficientNet-Lite0 with batch gears 1,2,4,8 at 224×224; CenterFace
with batch gears 1,2,4 at 640×640; PP-OCR's detector at one image with image-size gears H, W in
{736, 1024, 1312, 1600, 2016} (25 gears; the executor pads each image to the smallest that holds
it); the angle classifier static at 6×48×192; the recogniser at 6 lines with widths 320..2560 in
steps of 32 (71 gears: a line is padded exactly as on ONNX Runtime, so the text is the same). No
AIPP: the executors already produce the models' float NCHW input, so host pre-processing is the
same on every backend.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Conversion:
    name: str  # output file stem
    onnx: str  # relative to models/
    input_name: str
    shape: str  # NCHW with -1 for the batch (batch gears) or for H and W (image-size gears)
    gears: tuple[int, ...] = ()  # --dynamic_batch_size
    image_sizes: tuple[tuple[int, int], ...] = ()  # --dynamic_image_size

    def command(self, models: Path, out: Path, soc: str) -> list[str]:
        cmd = [
            "atc",
            "--framework=5",
            f"--model={models / self.onnx}",
            f"--output={out / self.name}",
            f"--soc_version={soc}",
            f"--input_shape={self.input_name}:{self.shape}",
            "--input_format=NCHW",
            "--precision_mode=allow_fp32_to_fp16",
            "--log=error",
        ]
        if self.gears:
            cmd.append(f"--dynamic_batch_size={','.join(map(str, self.gears))}")
        if self.image_sizes:
            sizes = ";".join(f"{h},{w}" for h, w in self.image_sizes)
            cmd.append(f"--dynamic_image_size={sizes}")
        return cmd


OCR_DET_SIDES = (736, 1024, 1312, 1600, 2016)  # det_limit_side .. det_max_side
CONVERSIONS = (
    Conversion("efficientnet_lite0", "classify/efficientnet_lite0.onnx", "input", "-1,3,224,224",
               (1, 2, 4, 8)),
    Conversion("centerface", "face/centerface_dyn.onnx", "input.1", "-1,3,640,640", (1, 2, 4)),
    Conversion("PP-OCRv6_det_small", "ocr/PP-OCRv6_det_small.onnx", "x", "1,3,-1,-1",
               image_sizes=tuple((h, w) for h in OCR_DET_SIDES for w in OCR_DET_SIDES)),
    Conversion("ch_ppocr_mobile_v2.0_cls", "ocr/ch_ppocr_mobile_v2.0_cls_mobile.onnx", "x",
               "6,3,48,192"),
    Conversion("PP-OCRv6_rec_small", "ocr/PP-OCRv6_rec_small.onnx", "x", "6,3,-1,-1",
               image_sizes=tuple((48, w) for w in range(320, 2561, 32))),
)  # fmt: skip


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--soc", required=True, help="e.g. Ascend310P3, Ascend910B3 (npu-smi info)")
    parser.add_argument("--models", type=Path, default=ROOT / "models")
    parser.add_argument("--out", type=Path, default=None, help="default: models/ascend-<soc>")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    out = args.out or args.models / f"ascend-{args.soc.lower()}"
    if not args.dry_run and shutil.which("atc") is None:
        print("atc not found: source <CANN>/set_env.sh first (or use --dry-run)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for conversion in CONVERSIONS:
        source = args.models / conversion.onnx
        cmd = conversion.command(args.models, out, args.soc)
        print(shlex.join(cmd))
        if args.dry_run:
            continue
        if not source.is_file():
            print(f"{source} missing: run python tools/prepare_models.py", file=sys.stderr)
            return 2
        if subprocess.run(cmd, check=False).returncode != 0:
            print(f"atc failed for {conversion.name}", file=sys.stderr)
            return 1
        sidecar = out / f"{conversion.name}.om.atc.json"
        sidecar.write_text(json.dumps({
            "soc_version": args.soc, "command": cmd, "onnx": str(source),
            "onnx_sha256": _sha256(source), "dynamic_batch": list(conversion.gears),
            "dynamic_image_size": [list(hw) for hw in conversion.image_sizes],
        }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
