"""The supervisor's ``/metrics`` as a real Prometheus server (Debian's ``prometheus``) scrapes it
and ``promtool`` lints it, and every query of the Grafana dashboard run by that server.

``make test`` installs both from Debian when they are missing (as root); without them the test
is skipped here, and fails under ``CI=true``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from duomo.ipc.client import Client
from tests.integration.harness import (
    faulty_model,
    free_port,
    poll,
    running_supervisor,
    stop_gracefully,
    write_config,
)
from tests.unit.test_grafana_dashboard import targets

pytestmark = pytest.mark.integration
X = np.array([[1, 2, 3, 4]], dtype=np.float32)
# the names issue 24 takes from Triton (nv_inference_*): promtool's naming lint flags these
TRITON_NAMES = {
    f"duomo_inference_{stage}_duration_us_total"
    for stage in ("request", "queue", "compute_input", "compute_infer", "compute_output")
} | {"duomo_inference_pending_request_count"}
# series that exist only on an accelerator or with a configured budget
NOT_HERE = (
    "duomo_device_utilization_ratio", "duomo_device_temperature_celsius",
    "duomo_device_power_watts", "_budget_bytes",
    "duomo_stream_",  # no camera here (test_stream_status.py checks the dashboard's stream series)
)  # fmt: skip
# a pipeline's series are there from the start, at zero: the dashboard's pipeline queries answer
# (test_metrics.py counts them on the face models)
ONE_STEP_PIPELINE = {"name": "p", "steps": [{"name": "only", "model": "a"}]}


def tools_or_skip() -> tuple[str, str]:
    found = shutil.which("prometheus"), shutil.which("promtool")
    if None in found:
        message = "prometheus and promtool (Debian's prometheus package) are needed"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}: make test installs them")
        pytest.skip(message)
    return found  # type: ignore[return-value]


@contextlib.contextmanager
def prometheus_scraping(binary: str, target_port: int, folder: Path) -> Iterator[int]:
    port = free_port()
    config = folder / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 500ms, evaluation_interval: 500ms}\n"
        "scrape_configs:\n"
        f"  - job_name: duomo\n    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n"
    )
    log = (folder / "prometheus.log").open("w")
    server = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield port
    finally:
        stop_gracefully(server, timeout_s=30)
        log.close()


def query(port: int, expr: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return dict(json.load(reply))
    except urllib.error.HTTPError as err:
        return dict(json.load(err))


def test_prometheus_scrapes_it_and_runs_every_dashboard_query(tmp_path: Path) -> None:
    prometheus, promtool = tools_or_skip()
    metrics_port = free_port()
    config = write_config(
        tmp_path, [], extra=[faulty_model("a"), faulty_model("b")],
        metrics={"http": f"127.0.0.1:{metrics_port}"}, pipelines=[ONE_STEP_PIPELINE],
    )  # fmt: skip
    with running_supervisor(config) as sup, Client(sup.socket) as client:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as reply:
            exposition = reply.read()
        lint = subprocess.run([promtool, "check", "metrics"], input=exposition,
                              capture_output=True, timeout=60)  # fmt: skip
        flagged = {line.split()[0] for line in lint.stdout.decode().splitlines() if line.strip()}
        assert flagged <= TRITON_NAMES, lint.stdout.decode()  # nothing but Triton's names

        with prometheus_scraping(prometheus, metrics_port, tmp_path) as port:
            for _ in range(5):
                assert client.model("a").infer(X)["y"][0, 0] == 3.0

            def prometheus_ready() -> bool:  # its API answers 503 in plain text until then
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=5):
                        return True
                except OSError:  # not listening yet, or 503
                    return False

            def scraped_all() -> bool:
                found = query(port, 'duomo_inference_request_success_total{model="a"}')
                result = found.get("data", {}).get("result", [])
                return bool(result) and float(result[0]["value"][1]) == 5

            def scrapes_in_rate_window() -> int:  # a rate over the window needs two or more
                found = query(port, 'count_over_time(up{job="duomo"}[10s])')
                result = found.get("data", {}).get("result", [])
                return int(float(result[0]["value"][1])) if result else 0

            poll(prometheus_ready, timeout_s=60)
            poll(scraped_all, timeout_s=60)
            poll(lambda: scrapes_in_rate_window() >= 3, timeout_s=60)
            filled = {"$__rate_interval": "10s", "$__range": "1m"}
            for title, target in targets():
                expr = target["expr"].replace("$instance", ".*").replace("$model", ".*")
                expr = expr.replace("$pipeline", ".*")
                for variable, value in filled.items():
                    expr = expr.replace(variable, value)
                answer = query(port, expr)
                assert answer["status"] == "success", (title, expr, answer)
                if not any(name in expr for name in NOT_HERE):
                    assert answer["data"]["result"], (title, expr)
