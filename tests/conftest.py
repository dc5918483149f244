"""Shared fixtures: paths, fixture images, one engine over the demo config per session, and
``poll``, how a test waits for something to happen (never a bare sleep).

Tests under tests/unit are fast and need no model; tests under tests/integration use the real
demo models from ``python tools/prepare_models.py`` (the README's test command runs it first).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from ipc.logs import configure_logging
from supervisor.config import LoadedConfig, load_config
from supervisor.image_files import read_image

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "tests" / "fixtures" / "images"
DEMO_CONFIG = ROOT / "configs" / "default.yaml"


def pytest_configure(config: pytest.Config) -> None:
    configure_logging("info")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for folder in ("unit", "integration", "hardware"):
            if f"{folder}/" in item.nodeid:
                item.add_marker(getattr(pytest.mark, folder))


def fixture_image(name: str) -> np.ndarray:
    return read_image(IMAGES / name)


def poll(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait until ``condition()`` holds (checked every 20 ms); AssertionError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


@pytest.fixture(scope="session")
def demo_config() -> LoadedConfig:
    missing = [
        p
        for p in ("ocr/PP-OCRv6_det_small.onnx", "face/centerface_dyn.onnx")
        if not (ROOT / "models" / p).is_file()
    ]
    if missing:
        pytest.fail(f"demo models missing ({missing}); run: python tools/prepare_models.py")
    return load_config(DEMO_CONFIG)


def demo_variant(tmp_dir: Path, models: list[str], **overrides: object) -> LoadedConfig:
    """The demo config restricted to ``models``, with ``overrides`` applied to each of them."""
    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    raw["model_root"] = str(ROOT / "models")
    raw["models"] = [{**m, **overrides} for m in raw["models"] if m["name"] in models]
    path = tmp_dir / "variant.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)


@pytest.fixture(scope="session")
def demo_engine(demo_config: LoadedConfig) -> Iterator[object]:
    from supervisor.engine import Engine

    engine = Engine(demo_config)
    engine.start()
    yield engine
    engine.close()
