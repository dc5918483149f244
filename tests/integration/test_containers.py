"""One card, producers in their own containers, end to end: the images of deploy/Containerfile are
built and deploy/compose.yaml runs a supervisor, two producer containers and a stream source
(`duomo stream` from the supervisor's image) that share only a memory-backed socket directory
and one user id.

What it checks: the socket directory is the only volume the containers share, none mounts
/dev/shm or joins another's IPC namespace; each producer's answers (the espresso, the
astronaut's face) came back through shared memory across containers all the same (the rings are
sealed memfd segments the supervisor passes over the socket); the stream source plays the
image's demo clip (deploy/config/sources.yaml, the compose file's default) into face detection
as the stream "demo", answered with the face, the stream in /metrics; the supervisor's probes and
/metrics on the published port, and its gateway over HTTP (401 without the bearer token, a v2
inference with it); a container of another user id is refused the key; `podman stop` stops the
supervisor gracefully (exit 0, no request cut).

Where it runs: as root with podman (Debian's, installed by `make test`'s tools target with runc,
netavark, iptables and mmdebstrap) and podman-compose (the test extra). No registry image can be
pulled here, so the base image is made with `mmdebstrap --variant=minbase bookworm` (Debian's
python3) and imported once as localhost/duomo-test-base:bookworm. Otherwise it skips, saying
why, and with CI=true that skip is a failure (tests/conftest.py): CI runs as root and `make
test` installs podman. On this sandbox crun 1.8 refuses the host's hybrid cgroups ("cgroups in
hybrid mode not supported") and the default rlimits exceed what a container may set ("setrlimit
RLIMIT_NOFILE: Operation not permitted"): the test then runs podman with a containers.conf of
its own (runc, rlimits within the host's), as it says in its output. pip inside the build uses
the host's index and CA bundle (PIP_INDEX_URL, and PIP_CERT or the system bundle as the build
secret pip-ca: the registry is reached through a TLS-inspecting proxy here).

Time on the 2-core development VM: about 4 minutes from nothing (the base image 45 s, the two
images 3 minutes, the run 20 s); 3¼ minutes when the base image is there. The untagged build
stage is pruned afterwards, so a later run builds again (about 1 GB less on disk).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import fixture_image, poll
from tests.integration.harness import ROOT, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]
BASE = "localhost/duomo-test-base:bookworm"
IMAGE = "localhost/duomo:cpu-test"
PRODUCER = "localhost/duomo-producer:cpu-test"
FRAMES = 3
UID = 10001
SERVICES = ("supervisor", "producer-classify", "producer-face", "stream-source")


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 900, check: bool = True):
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return done


def ensure_base_image() -> None:
    if subprocess.run(["podman", "image", "exists", BASE]).returncode == 0:
        return
    if shutil.which("mmdebstrap") is None:
        pytest.skip(f"no {BASE} and no mmdebstrap to make it (Debian package mmdebstrap)")
    packages = "python3,python3-venv,passwd,ca-certificates"
    command = (
        f"mmdebstrap --quiet --variant=minbase --include={packages} bookworm - "
        f"| podman import --change 'CMD [\"/bin/bash\"]' - {BASE}"
    )
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"could not make the base image {BASE}: {done.stderr.strip()[-500:]}")


def podman_environment(tmp: Path) -> tuple[dict[str, str], list[str]]:
    """The environment and the extra `podman build` flags under which a container starts here;
    skip, with the errors, when none does."""
    env = dict(os.environ)
    probe = ["podman", "run", "--rm", "--network", "none", BASE, "true"]
    done = subprocess.run(probe, capture_output=True, text=True, env=env)
    if done.returncode == 0:
        return env, []
    errors = [f"podman's defaults: {done.stderr.strip()[-300:]}"]
    runtime = "runc" if shutil.which("runc") else "crun"
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc_hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    for nproc in sorted({min(nproc_hard, n) for n in (nproc_hard, 32768, 4096)}, reverse=True):
        ulimits = [f"nofile={nofile}:{nofile}", f"nproc={nproc}:{nproc}"]
        conf = tmp / f"containers-{nproc}.conf"
        conf.write_text(
            "[containers]\n"
            f"default_ulimits = {json.dumps(ulimits)}\n"
            f'[engine]\nruntime = "{runtime}"\n'
        )
        env = {**os.environ, "CONTAINERS_CONF": str(conf)}
        done = subprocess.run(probe, capture_output=True, text=True, env=env)
        if done.returncode == 0:
            print(f"podman runs here with {runtime} and {ulimits} ({conf})")
            return env, [flag for u in ulimits for flag in ("--ulimit", u)]
        errors.append(f"{runtime}, {ulimits}: {done.stderr.strip()[-300:]}")
    pytest.skip("podman cannot start a container here: " + " | ".join(errors))


def build(env: dict[str, str], flags: list[str], target: str, tag: str) -> float:
    args = ["podman", "build", *flags, "-f", "deploy/Containerfile"]
    args += ["--ignorefile", "deploy/containerignore", "--build-arg", f"BASE_IMAGE={BASE}"]
    args += ["--target", target, "-t", tag]
    ca = os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
    if Path(ca).is_file():
        args += ["--secret", f"id=pip-ca,src={ca}"]
    if os.environ.get("PIP_INDEX_URL"):
        args += ["--build-arg", f"PIP_INDEX_URL={os.environ['PIP_INDEX_URL']}"]
    started = time.monotonic()
    done = subprocess.run([*args, "."], cwd=ROOT, capture_output=True, text=True, env=env)
    output = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"podman build --target {target}:\n{output}"
    return time.monotonic() - started


@dataclass
class Layout:
    project: str
    env: dict[str, str]
    compose: list[str]
    token: str
    http: int
    metrics: int

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def logs(self, service: str) -> str:
        done = run("podman", "logs", self.container(service), env=self.env)
        return done.stdout + done.stderr

    def inspect(self, service: str) -> dict:
        done = run("podman", "inspect", self.container(service), env=self.env)
        return json.loads(done.stdout)[0]

    def state(self, service: str) -> dict:
        return self.inspect(service)["State"]

    def answers(self, service: str) -> list[dict]:
        lines = [line for line in self.logs(service).splitlines() if line.startswith("{")]
        return [json.loads(line) for line in lines]


def http_status(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return 0


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Layout]:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (make test installs it as root: the tools target)")
    try:
        import podman_compose  # noqa: F401
    except ImportError:
        pytest.skip("podman-compose is not installed (pip install -e '.[test]')")
    if os.geteuid() != 0:
        pytest.skip("rootful podman only: run as root")
    tmp = tmp_path_factory.mktemp("containers")
    ensure_base_image()
    env, flags = podman_environment(tmp)
    seconds = build(env, flags, "cpu", IMAGE)
    seconds += build(env, flags, "producer", PRODUCER)
    print(f"images built in {seconds:.0f} s")
    token = uuid.uuid4().hex
    (tmp / "token").write_text(token + "\n")
    (tmp / "token").chmod(0o644)  # the supervisor (uid 10001) reads it through the secret
    project = f"duomotest{uuid.uuid4().hex[:8]}"
    http, grpc, metrics = free_port(), free_port(), free_port()
    env = {
        **env,
        "DUOMO_IMAGE": IMAGE,
        "DUOMO_PRODUCER_IMAGE": PRODUCER,
        "DUOMO_GATEWAY_TOKEN_FILE": str(tmp / "token"),
        "DUOMO_HTTP_PORT": str(http),
        "DUOMO_GRPC_PORT": str(grpc),
        "DUOMO_METRICS_PORT": str(metrics),
        "PRODUCER_FRAMES": str(FRAMES),
    }
    compose = [sys.executable, "-m", "podman_compose", "-f", str(ROOT / "deploy" / "compose.yaml")]
    compose += ["-p", project]
    found = Layout(project, env, compose, token, http, metrics)
    try:
        run(*compose, "up", "-d", env=env, timeout=300)
        yield found
    finally:
        subprocess.run([*compose, "down", "-v", "-t", "45"], env=env, capture_output=True)
        # the build stages left untagged (about 1 GB each time); the tagged images stay
        subprocess.run(["podman", "image", "prune", "-f"], env=env, capture_output=True)


def test_the_socket_directory_is_the_only_volume_the_containers_share(layout: Layout) -> None:
    users: dict[str, set[str]] = {}  # volume -> the services that mount it
    for service in SERVICES:
        found = layout.inspect(service)
        ipc = found["HostConfig"]["IpcMode"]
        assert ipc in ("private", "shareable", ""), (service, ipc)  # not container:… nor host
        mounts = {m["Destination"]: m for m in found["Mounts"]}
        assert not [d for d in mounts if d == "/dev/shm" or d.startswith("/dev/shm/")], mounts
        assert mounts["/run/duomo"]["Name"] == f"{layout.project}_run", mounts["/run/duomo"]
        for mount in mounts.values():
            if mount["Type"] in ("volume", "bind"):
                users.setdefault(mount.get("Name") or mount["Source"], set()).add(service)
    shared = {name: who for name, who in users.items() if len(who) > 1}
    assert shared == {f"{layout.project}_run": set(SERVICES)}, users


def test_producers_in_their_own_containers_are_answered(layout: Layout) -> None:
    def producers_done() -> bool:
        return all(
            layout.state(s)["Status"] == "exited" for s in ("producer-classify", "producer-face")
        )

    poll(producers_done, timeout_s=300)
    for service in ("producer-classify", "producer-face"):
        assert layout.state(service)["ExitCode"] == 0, layout.logs(service)
    classify = layout.answers("producer-classify")
    face = layout.answers("producer-face")
    assert [a["frame"] for a in classify] == list(range(FRAMES))
    assert all(a["answer"]["label"] == "espresso" for a in classify), classify
    assert [a["frame"] for a in face] == list(range(FRAMES))
    assert all(a["answer"]["faces"] == 1 for a in face), face


def test_probes_metrics_and_gateway_on_the_published_ports(layout: Layout) -> None:
    base = f"http://127.0.0.1:{layout.metrics}"
    poll(lambda: http_status(f"{base}/v2/health/ready") == 200, timeout_s=300)
    assert http_status(f"{base}/v2/health/live") == 200
    poll(lambda: layout.state("producer-face")["Status"] == "exited", timeout_s=300)
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    line = f'duomo_inference_request_success_total{{model="classify"}} {FRAMES:.1f}'
    assert line in text.splitlines()
    # face also answers the stream source's frames, all the time
    assert metric(text, 'duomo_inference_request_success_total{model="face"}') >= FRAMES

    gateway = f"http://127.0.0.1:{layout.http}"
    assert http_status(f"{gateway}/v2/health/ready") == 200  # the probes need no token
    assert http_status(f"{gateway}/v2/models/classify") == 401
    assert http_status(f"{gateway}/v2/models/classify", layout.token) == 200
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{layout.http}")
    image = fixture_image("coffee.png")
    tensor = httpclient.InferInput("IMAGE", list(image.shape), "UINT8")
    tensor.set_data_from_numpy(np.ascontiguousarray(image))
    answer = client.infer("classify", [tensor], headers={"Authorization": f"Bearer {layout.token}"})
    result = json.loads(answer.as_numpy("RESULT")[0])
    assert result["top"][0]["label"] == "espresso"


def metric(text: str, series: str) -> float:
    values = [
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith(series + " ")
    ]
    assert len(values) == 1, series
    return values[0]


def test_the_stream_source_plays_the_demo_clip_into_face(layout: Layout) -> None:
    def answered() -> list[dict]:
        lines = layout.answers("stream-source")
        return [a for a in lines if a.get("stream") == "demo" and "result" in a]

    def enough() -> bool:
        time.sleep(0.5)  # each look runs podman logs
        return len(answered()) >= FRAMES

    poll(enough, timeout_s=300)
    assert layout.state("stream-source")["Status"] == "running"  # --loop: it plays on
    for answer in answered():
        assert answer["model"] == "face", answer
        assert len(answer["result"]["faces"]) == 1, answer
        assert 0 <= answer["age_ms"] < 60_000, answer
    with urllib.request.urlopen(f"http://127.0.0.1:{layout.metrics}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    assert 'stream="demo"' in text


def test_another_user_id_is_refused_the_key(layout: Layout) -> None:
    base = f"http://127.0.0.1:{layout.metrics}"
    poll(lambda: http_status(f"{base}/v2/health/ready") == 200, timeout_s=300)
    volumes = [f"{layout.project}_run:/run/duomo"]
    args = ["podman", "run", "--rm", "--user", f"{UID + 1}:{UID + 1}"]
    args += [flag for v in volumes for flag in ("-v", v)]
    args += [PRODUCER, "--model", "classify", "--frame", "/opt/producer/frames/coffee.npy"]
    args += ["--frames", "1", "--wait-s", "2"]
    done = run(*args, env=layout.env, check=False, timeout=120)
    assert done.returncode != 0
    assert "Permission denied" in done.stdout + done.stderr


def test_the_supervisor_stops_gracefully(layout: Layout) -> None:
    poll(lambda: http_status(f"http://127.0.0.1:{layout.metrics}/v2/health/ready") == 200)
    run("podman", "stop", "-t", "45", layout.container("supervisor"), env=layout.env)
    state = layout.state("supervisor")
    assert state["ExitCode"] == 0, layout.logs("supervisor")[-3000:]
    assert "requests_cut=0" in layout.logs("supervisor")
