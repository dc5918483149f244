"""The ``duomo`` command line: thin commands that parse arguments and delegate.

Commands today: ``check`` (validate a config without loading anything) and ``infer`` (run images
through a model in-process). Exit codes: 0 success, 1 a request failed, 2 invalid input
(bad config, unknown model, bad arguments).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ipc.errors import DuomoError, NotFoundError
from supervisor.config import ConfigError, LoadedConfig, load_config
from supervisor.logs import LEVELS, configure_logging

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
DEFAULT_CONFIG = Path("configs/default.yaml")


def _load(path: Path) -> LoadedConfig | None:
    try:
        return load_config(path)
    except ConfigError as err:
        print(err.render(), file=sys.stderr)
        return None


def cmd_check(args: argparse.Namespace) -> int:
    loaded = _load(args.config)
    if loaded is None:
        print(f"{args.config}: invalid", file=sys.stderr)
        return EXIT_INVALID
    for name, model in loaded.models.items():
        files = ", ".join(f"{role}={path}" for role, path in model.files.items())
        print(
            f"  {name}: task={model.config.task} instances={model.config.instances} "
            f"max_batch={model.config.max_batch} files: {files}"
        )
    print(f"{loaded.path}: OK ({len(loaded.models)} models)")
    return EXIT_OK


def cmd_infer(args: argparse.Namespace) -> int:
    from supervisor.engine import Engine
    from supervisor.image_files import read_image

    loaded = _load(args.config)
    if loaded is None:
        return EXIT_INVALID
    engine = Engine(loaded, only=[args.model])
    status = EXIT_OK
    try:
        try:
            engine.start()
        except NotFoundError as err:
            print(f"duomo infer: {err.message}", file=sys.stderr)
            return EXIT_INVALID
        except (ValueError, RuntimeError) as err:  # a thread plan or a model that cannot load
            print(f"duomo infer: {err}", file=sys.stderr)
            return EXIT_INVALID
        for path in args.images:
            try:
                result = engine.infer(args.model, read_image(path))
            except DuomoError as err:
                print(f"duomo infer: {err}", file=sys.stderr)
                status = EXIT_FAILED
                continue
            _print_result(path, args.model, result, args.json)
    finally:
        engine.close()
    return status


def _json_default(value: object) -> object:
    """Raw results carry numpy arrays; JSON gets them as nested lists."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _print_result(path: str, model: str, result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        row = {"image": path, "model": model, "result": result}
        print(json.dumps(row, ensure_ascii=False, default=_json_default))
        return
    print(f"{path} [{model}]")
    if "top" in result:
        for entry in result["top"]:
            print(f"  {entry['score']:.3f}  {entry['label']} ({entry['index']})")
    elif "faces" in result:
        for face in result["faces"]:
            box = ", ".join(f"{v:.0f}" for v in face["box"])
            print(f"  face {face['score']:.3f} at [{box}]")
        if not result["faces"]:
            print("  no faces")
    elif "lines" in result:
        for line in result["lines"]:
            print(f"  {line['score']:.3f}  {line['text']}")
        if not result["lines"]:
            print("  no text")
    else:
        for name, value in result.items():
            print(f"  {name}: {getattr(value, 'shape', value)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="duomo", description="Serve many models from one process."
    )
    parser.add_argument("--log-level", choices=LEVELS, default="warning")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of text")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="validate a configuration without loading models")
    check.add_argument("-c", "--config", type=Path, default=DEFAULT_CONFIG)
    check.set_defaults(func=cmd_check)

    infer = sub.add_parser("infer", help="run image files through one model")
    infer.add_argument("-c", "--config", type=Path, default=DEFAULT_CONFIG)
    infer.add_argument("model")
    infer.add_argument("images", nargs="+", metavar="IMAGE")
    infer.add_argument("--json", action="store_true", help="one JSON object per image per line")
    infer.set_defaults(func=cmd_infer)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_json)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
