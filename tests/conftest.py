"""Shared fixtures: paths, fixture images, one engine over the demo config per session,
``poll``, how a test waits for something to happen (never a bare sleep), and the rule for skips.

Tests under tests/unit are fast and need no model; tests under tests/integration use the real
demo models from ``python tools/prepare_models.py`` (the README's test command runs it first).

How ``make test`` runs them: in two parts. First every test not marked ``serial``, on three
pytest-xdist workers (``-n 3``: on CI's two cores, tests that wait for paced models, back-offs
or periodic keepers, about a quarter of the time, leave room for a third). Each test file runs
whole on one worker (``--dist loadfile``, pyproject.toml), so a supervisor a module's tests
share starts once, and the files go out in the order collected: the integration tier, whose
files take seconds to minutes each, before the unit tier's, which fill the end. Then the tests
marked ``serial``, one at a time, nothing else of the suite running. A test is ``serial`` when a
busy neighbour could change what it asserts (a bound in milliseconds on an answer's age, a rate
or a share between cameras, a camera's clock within 50 ms), because another worker's load
delays the threads these measure. Memory is measured per process (the supervisor's own resident
set, its ledger), so those tests run in the parallel part. Everything else must be safe beside
any other test: its own tmp dirs and sockets (``harness.short_socket_dir``), ports from
``harness.free_port``, nothing that looks past its own processes (STYLE.md). The two tests that
start the demo config as it is, on its fixed ports, are marked ``demo_ports`` and take turns on
a lock (``_demo_ports_in_turn``). A session-scoped fixture (``demo_engine``) is made once per
worker.

Skips. A test that needs a program or a package the machine lacks skips, saying what and how to
get it (``require_tool`` finds a program in the virtual environment's bin/, where ``make test``
installs kubectl, or on PATH). With ``CI=true`` in the environment, as CI runs ``make test``,
**every skip is a failure** (``pytest_runtest_makereport`` below): ``make test`` installs what the
tests need, so a skip in CI means a test proved nothing while the run stayed green. Two kinds of
skip stay skips there, because nothing can be installed to run them:

* tests marked ``hardware`` (everything under tests/hardware: an Ascend card);
* tests marked ``skip_by_design``, whose skip is the documented outcome, not something missing:
  a documented command that is not run, with the reason (``test_doc_commands.py``).

A property of the machine is no exception: ``test_devices.py`` needs two cores to make two
devices, and CI's machines have two; a CI run with fewer fails instead of dropping those tests.

An expected failure (``xfail``) is not a skip and is left alone. The rule covers the setup, call
and teardown of a test (a fixture's skip reports an error) and a module that skips as it is
collected (a collection error, which stops the run; under xdist the other files still run,
and the run fails). It holds the same on an xdist worker: the hooks run there, and the failed
report is what the worker sends back. ``make test`` passes ``-rs`` to both parts, so every skip
that remains prints its reason.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from pluggy import Result

from duomo.ipc.logs import configure_logging
from duomo.supervisor.config import LoadedConfig, load_config
from duomo.supervisor.dataflow.pipeline_config import entries_over
from duomo.supervisor.operators.image_files import read_image

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "tests" / "fixtures" / "images"
DEMO_CONFIG = ROOT / "configs" / "default.yaml"


IN_CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}
SKIPS_ALLOWED_IN_CI = ("hardware", "skip_by_design")
# pytest imports readline, which exports COLUMNS=80 and LINES=24 into the process's C
# environment without a terminal: an xdist worker, started by that process, finds them in its
# os.environ and hands them to every program its tests start, where they override the size of
# a real terminal (test_status_watch.py's tmux pane). A worker takes them as its controller's
# os.environ has them, as a test in a run without -n sees them.
TERMINAL_SIZE = ("COLUMNS", "LINES")


def pytest_configure(config: pytest.Config) -> None:
    configure_logging("info")
    config.addinivalue_line(
        "markers",
        "skip_by_design: its skip is the documented outcome, not a missing tool (stays a skip "
        "with CI=true)",
    )
    worker_input = getattr(config, "workerinput", None)  # (set on an xdist worker only)
    if worker_input is not None:
        for name, value in worker_input["terminal_size"].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """(pytest-xdist, on the controller, for each worker it starts) what the worker's
    ``pytest_configure`` sets ``TERMINAL_SIZE`` to."""
    node.workerinput["terminal_size"] = {name: os.environ.get(name) for name in TERMINAL_SIZE}


def require_tool(name: str, why: str) -> str:
    """The path of the program ``name`` (this virtual environment's bin/ first, then PATH);
    without it the test skips (fails with CI=true), saying ``why`` it is needed."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed: {why}")
    return found


def _skip_allowed_in_ci(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) for name in SKIPS_ALLOWED_IN_CI)


def _as_failure(report: pytest.TestReport | pytest.CollectReport) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (
        f"a skip fails with CI=true: {reason.removeprefix('Skipped: ')}\n"
        "(make test installs what the tests need, the Makefile's tools target; tests/conftest.py)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Result[pytest.TestReport], None]:
    report = (yield).get_result()
    expected = hasattr(report, "wasxfail")
    if IN_CI and report.skipped and not expected and not _skip_allowed_in_ci(item):
        _as_failure(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, Result[pytest.CollectReport], None]:
    report = (yield).get_result()
    if IN_CI and report.skipped and "hardware/" not in report.nodeid:
        _as_failure(report)


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


def alone_then_together(served: Any, payloads: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """The outcomes of ``payloads`` submitted to ``served`` (a ``ServedModel``) one at a time,
    each waited for (with a long fill window, a batch of 1 each), then all at once (one batch).
    For the tests that a batch answers what single runs answer."""
    singles = []
    for payload in payloads:
        future: Future[Any] = Future()
        served.submit(payload, future.set_result)
        singles.append(future.result(60))  # alone, it waits out the window: a batch of 1
    futures: list[Future[Any]] = []
    for payload in payloads:
        future = Future()
        served.submit(payload, future.set_result)
        futures.append(future)
    return singles, [f.result(60) for f in futures]


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
    raw["pipelines"] = entries_over(raw.get("pipelines"), models)  # those over the models kept
    path = tmp_dir / "variant.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)


@pytest.fixture(scope="session")
def demo_engine(demo_config: LoadedConfig) -> Iterator[object]:
    from duomo.supervisor.core.engine import Engine

    engine = Engine(demo_config)
    engine.start()
    yield engine
    engine.close()


@pytest.fixture(autouse=True)
def _demo_ports_in_turn(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``demo_ports`` starts a supervisor on ``configs/default.yaml`` as it is,
    on its fixed ports (8000–8002), as ``make demo`` does: it holds this machine's lock on them
    while it runs, so that no two such tests run at once, on two xdist workers or in two runs
    side by side."""
    if request.node.get_closest_marker("demo_ports") is None:
        yield
        return
    path = Path(tempfile.gettempdir()) / f"duomo-demo-ports-{os.getuid()}.lock"
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file is closed)
        yield
