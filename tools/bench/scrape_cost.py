"""What one ``/metrics`` scrape costs the supervisor: its CPU time per scrape, measured on the
supervisor process itself (``psutil``) over many scrapes of a running supervisor with the
config's models loaded and answered once. The A/B under load (``duomo bench``'s
``duomo-scraped`` mode against ``duomo``) cannot resolve a cost this small on a shared machine;
this bounds it directly.

Run as ``python -m tools.bench.scrape_cost [-c CONFIG] [--scrapes N] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from duomo.ipc.runtime_dir import pid_path
from tools.bench.servers import free_port, supervisor_config

ROOT = Path(__file__).resolve().parents[2]
IMAGE = ROOT / "tests/fixtures/images/coffee.png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.scrape_cost")
    parser.add_argument("-c", "--config", type=Path, default=ROOT / "configs/default.yaml")
    parser.add_argument("--scrapes", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import yaml

    models = [m["name"] for m in yaml.safe_load(args.config.read_text())["models"]]
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="duomo-scrape-") as tmp:
        config = supervisor_config(args.config, models, Path(tmp) / "d.yaml", metrics_port=port)
        sock = Path(tmp) / "d.sock"
        cli = [sys.executable, "-m", "duomo.supervisor"]
        subprocess.run([*cli, "start", "-c", str(config), "--socket", str(sock)], check=True)
        try:
            for name in models:  # every model answered once: its series carry numbers
                subprocess.run(
                    [*cli, "infer", "--socket", str(sock), name, str(IMAGE)],
                    check=True, capture_output=True,
                )  # fmt: skip
            supervisor = psutil.Process(int(pid_path(sock).read_text()))
            url = f"http://127.0.0.1:{port}/metrics"

            def scrape() -> int:
                with urllib.request.urlopen(url, timeout=10) as reply:
                    return len(reply.read())

            for _ in range(20):
                scrape()
            cores = os.cpu_count() or 1
            for repeat in range(args.repeats):
                before, started = supervisor.cpu_times(), time.perf_counter()
                for _ in range(args.scrapes):
                    size = scrape()
                after, wall = supervisor.cpu_times(), time.perf_counter() - started
                cpu_ms = (after.user + after.system - before.user - before.system) * 1e3
                print(
                    f"repeat {repeat + 1}: {cpu_ms / args.scrapes:.2f} ms of supervisor CPU "
                    f"per scrape ({wall / args.scrapes * 1e3:.2f} ms wall, {size} bytes); "
                    f"once a second: {cpu_ms / args.scrapes / 10 / cores:.3f} % of "
                    f"this machine's {cores} cores"
                )
        finally:
            subprocess.run([*cli, "stop", "--socket", str(sock)], capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
