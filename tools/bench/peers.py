"""The peers' own environments and how to launch them: Triton 2.51 (the server binary shipped in
the ``nvidia-pytriton`` 0.7.0 wheel, Python backend) and Mosec 0.9.8, each in a virtual
environment under ``.bench/envs/<peer>`` created on demand (never by CI), with the same
numpy/OpenCV/ONNX Runtime pins for both (numpy < 2: Triton's Python stub is built against 1.x).

Called by ``tools.bench.servers`` when a peer mode runs, and by ``tools.bench.pipelines`` for its
Triton models. What each gotcha below is, and how it was found, is in
``shared/research/peers.md``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENVS = ROOT / ".bench" / "envs"
APPS = Path(__file__).resolve().parent / "peer_apps"
PEER_PACKAGES = {"triton": ["nvidia-pytriton==0.7.0"], "mosec": ["mosec==0.9.8"]}


def _common_packages() -> list[str]:
    import onnxruntime

    return [
        "numpy<2",
        "opencv-python-headless==4.11.0.86",  # the last OpenCV that takes numpy 1.x
        f"onnxruntime=={onnxruntime.__version__}",  # the same runtime as Duomo's
        "pyclipper",
        "pyyaml",
        "pydantic>=2.6",
        "structlog",
        "psutil",
        "prometheus-client>=0.20",  # (duomo.supervisor.config imports it: the apps load configs)
    ]


def ensure_env(peer: str) -> Path:
    """The peer's environment, created and installed unless it already holds the same pins."""
    env = ENVS / peer
    wanted = "\n".join([*PEER_PACKAGES[peer], *_common_packages()]) + "\n"
    stamp = env / "duomo-bench-packages.txt"
    if stamp.exists() and stamp.read_text(encoding="utf-8") == wanted:
        return env
    print(f"duomo bench: installing {peer} into {env} (once) ...", file=sys.stderr, flush=True)
    shutil.rmtree(env, ignore_errors=True)
    ENVS.mkdir(parents=True, exist_ok=True)
    base_python = getattr(sys, "_base_executable", sys.executable)
    log = ENVS / f"{peer}-install.log"
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    with log.open("w") as out:
        for step in (
            [base_python, "-m", "venv", str(env)],
            [*pip, "--upgrade", "pip"],
            [*pip, *wanted.split()],
        ):
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"installing {peer} failed at {' '.join(step)}: see {log}")
    stamp.write_text(wanted, encoding="utf-8")
    return env


def _site_packages(env: Path) -> Path:
    return next((env / "lib").glob("python3*/site-packages"))


def _base_libdir() -> str:
    return str(Path(sys.base_prefix) / "lib")


def triton_command(
    env: Path, repository: Path, backends: Path, port: int, grpc_port: int | None = None
) -> tuple[list[str], dict[str, str]]:
    """The tritonserver command line and environment, HTTP on 127.0.0.1:``port`` (and gRPC on
    ``grpc_port``, where given: ``tools/bench_perf_analyzer.py``; ``duomo bench`` runs HTTP only).

    The Python stub embeds the interpreter found first on PATH (so the environment's ``bin``
    goes first) and loads ``libpython`` from LD_LIBRARY_PATH (so the interpreter's own ``lib``
    goes first, not the system's older libpython of the same version)."""
    site = _site_packages(env)
    triton = site / "pytriton" / "tritonserver"
    python_be = backends / "python"
    python_be.mkdir(parents=True, exist_ok=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for source in (
        triton / "backends" / "python" / "libtriton_python.so",
        triton / "backends" / "python" / "triton_python_backend_utils.py",
        triton / "python_backend_stubs" / version / "triton_python_backend_stub",
    ):
        shutil.copy2(source, python_be / source.name)
    environ = dict(os.environ)
    environ["PATH"] = f"{env / 'bin'}:{environ.get('PATH', '')}"
    environ["LD_LIBRARY_PATH"] = f"{_base_libdir()}:{site / 'nvidia_pytriton.libs'}"
    command = [
        str(triton / "bin" / "tritonserver"),
        f"--model-repository={repository}",
        f"--backend-directory={backends}",
        "--http-address=127.0.0.1",
        f"--http-port={port}",
        *(
            ["--grpc-address=127.0.0.1", f"--grpc-port={grpc_port}"]
            if grpc_port
            else ["--allow-grpc=false"]
        ),
        "--allow-metrics=false",
        "--disable-auto-complete-config",
        "--exit-timeout-secs=5",
        "--log-warning=false",
        "--log-info=false",
    ]
    return command, environ


def triton_repository(repository: Path, config: Path, models: list[str]) -> None:
    """One Python-backend model per Duomo model: one CPU instance, no dynamic batching."""
    for name in models:
        python_model(
            repository,
            name,
            "triton_model.py",
            "max_batch_size: 0\n"
            'input [{ name: "IMAGE", data_type: TYPE_UINT8, dims: [-1, -1, -1] }]\n'
            'output [{ name: "RESULT", data_type: TYPE_STRING, dims: [1] }]\n'
            "instance_group [{ kind: KIND_CPU, count: 1 }]\n",
            duomo_config=config,
        )


def python_model(
    repository: Path, name: str, app: str, settings: str, duomo_config: Path | None = None
) -> None:
    """Triton model ``name`` in ``repository``: ``app`` (a file of ``peer_apps``) copied in as its
    ``1/model.py`` and a Python-backend ``config.pbtxt`` of ``settings`` (its lines after the name
    and the backend), then, with ``duomo_config``, the parameters the app opens its Duomo executor
    by (the checkout, that config and the model ``name``). Called by ``triton_repository`` and
    ``tools.bench.pipelines.triton_faces_repository``."""
    version = repository / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    shutil.copy2(APPS / app, version / "model.py")
    parameters = (
        ""
        if duomo_config is None
        else "parameters [\n"
        f'  {{ key: "duomo_root", value: {{ string_value: "{ROOT}" }} }},\n'
        f'  {{ key: "duomo_config", value: {{ string_value: "{duomo_config}" }} }},\n'
        f'  {{ key: "duomo_model", value: {{ string_value: "{name}" }} }}\n'
        "]\n"
    )
    (repository / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\n{settings}{parameters}', encoding="utf-8"
    )


def mosec_command(
    env: Path, config: Path, models: list[str], port: int
) -> tuple[list[str], dict[str, str]]:
    """Mosec's command line and environment: its Rust front on 127.0.0.1:``port``, a 60 s
    request timeout (the 3 s default is shorter than an OCR request under load)."""
    environ = dict(os.environ)
    environ.update(
        DUOMO_ROOT=str(ROOT), DUOMO_BENCH_CONFIG=str(config), DUOMO_BENCH_MODELS=",".join(models)
    )
    command = [
        str(env / "bin" / "python"),
        str(APPS / "mosec_app.py"),
        "--address=127.0.0.1",
        f"--port={port}",
        "--timeout=60000",
        "--log-level=warning",
    ]
    return command, environ
