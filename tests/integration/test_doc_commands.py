"""Every shell command the documents give is run here, or says why not.

The commands are the lines of the ``bash`` code blocks of ``README.md`` and ``docs/*.md`` (the
Chinese twins carry the same blocks: ``tests/unit/test_docs.py``). Each must match an entry of
``RUN`` (it is run from the repository root and must exit 0: the item passes) or of ``NOT_RUN``
(the item is reported *skipped*, with the reason: it needs a card or a cluster, it writes a
secret into the work tree, or another test or CI itself runs it). A command that matches neither
fails: a new command in the docs is either run here or said why not. So the count of passed
items is the count of commands really run, and ``pytest -rs`` lists the others with their
reasons.

With ``CI=true`` a skip fails (tests/conftest.py), because a skip there usually means a tool
``make test`` should have installed is missing. Not here: a ``NOT_RUN`` command is left out by
design, the same on every machine — nothing can be installed to run ``make test`` inside itself,
an Ascend card, or a cluster — and its reason is documented in this file, so this test is marked
``skip_by_design`` and its skips stay skips in CI. A command in ``RUN`` whose program is missing
is not skipped: it fails.
The ``curl`` examples of ``docs/gateway.md`` need a supervisor with its gateway:
``test_the_gateway_curl_examples`` runs each of their blocks whole, in ``bash``, against one
(on a free port instead of the documented 8000), and checks the answer; their galleries block
needs a gallery and a token of its own: ``tests/integration/test_gallery_gateway.py`` runs it.
The example of ``docs/streams.md`` ("Try it": a demo clip played through ``duomo stream``) needs
a supervisor too: ``test_the_streams_guide_example`` runs its block whole against one (its
``/tmp/`` files in the test's own folder) and checks the answers; the commands that need a
camera are left to ``tests/integration/test_rtsp_source.py``, which plays a real RTSP camera.
The guide of ``docs/sinks.md`` ("Try it") starts its own mosquitto, redis-server, camera and
supervisor: ``tests/integration/test_sinks_guide.py`` runs its block whole (its files, ports and
socket its own) and checks the events on both brokers; here each of its lines is said so.
``docs/adding-a-model.md`` is left out: ``tests/integration/test_adding_a_model.py`` runs every
block of that guide.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import DEMO_CONFIG
from tests.integration.harness import ROOT, running_supervisor, write_config

pytestmark = pytest.mark.integration
FENCE = re.compile(r"^(```+)(bash|sh)[^\n]*\n(.*?)^\1[ \t]*$", re.S | re.M)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIPPED_PAGES = {ROOT / "docs" / "adding-a-model.md"}

# (a regular expression the whole command matches, the seconds it may take)
RUN: list[tuple[str, float]] = [
    (r"make models", 600),
    (r"make demo", 600),
    (r"\.venv/bin/duomo check", 60),
    (r"\.venv/bin/duomo check -c configs/ascend-\w+\.yaml", 60),
]
CURL_PAGE = ROOT / "docs" / "gateway.md"
CURL_RUN_BELOW = (
    "a line of the gateway's curl examples, which need a running gateway: "
    "test_the_gateway_curl_examples runs each of their blocks whole against one"
)
STREAMS_PAGE = ROOT / "docs" / "streams.md"
STREAMS_RUN_BELOW = (
    "a line of the streams guide's example, which needs a running supervisor: "
    "test_the_streams_guide_example runs its block whole against one"
)
CAMERA = (
    "needs a camera (an RTSP server, a V4L2 device, the cameras of a sources file): "
    "test_rtsp_source.py plays duomo camera-sim's RTSP camera and test_video_source.py a "
    "sources file through duomo stream"
)
MANAGED = (
    "needs a camera on the documented address: test_managed_sources.py adds, lists, shows and "
    "removes sources through duomo source and /v1/sources, with a supervisor's own, and reads "
    "their answers' tail; test_source_health.py runs duomo source tail"
)
GALLERIES_RUN_BELOW = (
    "a line of the gateway's galleries example, which needs a supervisor with a gallery: "
    "test_gallery_gateway.py runs its block whole against one and checks the answers"
)
GALLERIES_PAGE = ROOT / "docs" / "galleries.md"
GUIDE_RUN_BELOW = (
    "a line of the galleries guide, which needs a supervisor with a gallery: "
    "test_the_galleries_guide runs its block whole against one and checks the answers"
)
SINKS_PAGE = ROOT / "docs" / "sinks.md"
SINKS_RUN_BELOW = (
    "a line of the sinks guide, which starts brokers, a camera and a supervisor of its own: "
    "test_sinks_guide.py runs its block whole against Debian's mosquitto and redis-server"
)


def block_commands(block: str) -> list[str]:
    """The command lines of a bash block (comments and blank lines left out)."""
    commands = (line.split(" #", 1)[0].strip() for line in block.splitlines())
    return [c for c in commands if c and not c.startswith("#")]


def gateway_galleries_commands() -> list[str]:
    """Each line of the gateway page's galleries block (the one that calls /v1/galleries)."""
    blocks = FENCE.finditer(CURL_PAGE.read_text("utf-8"))
    return [c for m in blocks if "/v1/galleries" in m.group(3) for c in block_commands(m.group(3))]


def galleries_guide() -> str:
    """The galleries page's "Try it" block (the one that enrols with duomo gallery add)."""
    (block,) = [
        m.group(3)
        for m in FENCE.finditer(GALLERIES_PAGE.read_text("utf-8"))
        if "duomo gallery add" in m.group(3)
    ]
    return block


def sinks_guide_commands() -> list[str]:
    """Each line of the sinks guide's block (the one that keeps its files under /tmp/)."""
    blocks = FENCE.finditer(SINKS_PAGE.read_text("utf-8"))
    return [c for m in blocks if "/tmp/" in m.group(3) for c in block_commands(m.group(3))]


# (a regular expression the whole command matches, why it is not run here)
NOT_RUN: list[tuple[str, str]] = [
    (r"make test", "it is what CI runs (.ci/run), this test among its tests"),
    (r"make lint", "make test runs it first, in CI"),
    (r"make unit", "make test runs tests/unit with the rest of the suite, in CI"),
    (r"\.venv/bin/pytest tests(/unit)?", "make test runs the whole suite, in CI"),
    (r"\.venv/bin/pytest tests/hardware -v", "needs an Ascend card (skipped without one)"),
    (r"make bench", "20–25 minutes; test_bench.py runs `duomo bench` on the smoke workload"),
    (
        r"\.venv/bin/duomo bench --cameras(-only --out \S+)?",
        "5 minutes (with --cameras, 25–30) of a whole machine; test_bench.py runs `duomo bench` "
        "on the smoke workload and both halves of the camera part in miniature",
    ),
    (
        r"\.venv/bin/duomo bench --sharing(-only --out \S+)?",
        "5 minutes (with --sharing, 25–30) of a whole machine; "
        "test_bench.py runs `duomo bench --sharing-only` on the smoke workload",
    ),
    (
        r"\.venv/bin/duomo bench --fleet-only( --fleet-cameras \S+ --fleet-max-batch \d+)? "
        r"--out \S+",
        "5 minutes of a whole machine, RTSP cameras included; test_managed_sources.py and "
        "test_source_health.py run the managed sources it measures",
    ),
    (
        r"\.venv/bin/duomo bench --pipelines(-only --out \S+)?",
        "6–12 minutes (with --pipelines, 30) of a whole machine, Triton included; test_bench.py "
        "runs both halves of the pipeline part in miniature (Triton left out), "
        "test_pipelines.py and test_pipeline_gateway.py the pipeline itself",
    ),
    (
        r"\.venv/bin/python -m tools\.bench\.ocr_pipeline .*",
        "4 minutes of a whole machine; test_ocr_pipeline.py checks the answers it measures",
    ),
    (r"\.venv/bin/python tools/atc_convert\.py .*", "needs CANN's ATC, on an Ascend machine"),
    (r"\.venv/bin/python tools/ascend_smoke\.py .*", "needs .om files and an Ascend card"),
    (r"\.venv/bin/duomo start -c configs/ascend-\w+\.yaml", "needs an Ascend card"),
    (r"podman build -f deploy/Containerfile .*", "test_containers.py builds both images"),
    (r"podman build -f deploy/Containerfile\.ascend .*", "needs a CANN toolkit image"),
    (
        r"head -c 32 /dev/urandom \| base64 > deploy/gateway-token",
        "writes a secret into the work tree; test_containers.py makes a token of its own",
    ),
    (r"podman-compose -f deploy/compose\.yaml .*", "test_containers.py runs this layout"),
    (r"kubectl .*", "needs a cluster; tests/unit/test_manifests.py validates the manifests"),
    (r"\.venv/bin/python deploy/stream/demo_clip\.py \S+ /tmp/\S+\.mp4", STREAMS_RUN_BELOW),
    (r"\.venv/bin/duomo stream /tmp/\S+\.mp4 .*", STREAMS_RUN_BELOW),
    (r"\.venv/bin/duomo stream (rtsp://|/dev/video|--sources )\S* .*", CAMERA),
    (r"\.venv/bin/duomo source (add|list|show|tail|remove)( .*)?", MANAGED),
    (r"curl -s( -X DELETE)? 127\.0\.0\.1:8000/v1/sources.*", MANAGED),
    (
        r"\.venv/bin/duomo camera-sim \S+\.mp4( \S+\.mp4)*",
        "serves until stopped, from the reader's own files; test_camera_sim.py runs it",
    ),
    *((re.escape(command), SINKS_RUN_BELOW) for command in sinks_guide_commands()),
    *((re.escape(command), GALLERIES_RUN_BELOW) for command in gateway_galleries_commands()),
    *((re.escape(command), GUIDE_RUN_BELOW) for command in block_commands(galleries_guide())),
    *(
        (pattern, CURL_RUN_BELOW)
        for pattern in (
            r"curl -s 127\.0\.0\.1:8000/v2/\S+ .*",
            r"image=tests/fixtures/images/\S+",
            r"size=\$\(wc -c < \$image\)",
            r"header='\{.*",
            r"\{ printf .*\} \| curl -s 127\.0\.0\.1:8000/v2/\S+ .*",
        )
    ),
]


def doc_commands() -> list[tuple[str, str]]:
    """(page, command) for every command line of every bash block."""
    found = []
    for page in PAGES:
        if page in SKIPPED_PAGES:
            continue
        for block in FENCE.finditer(page.read_text("utf-8")):
            for command in block_commands(block.group(3)):
                found.append((str(page.relative_to(ROOT)), command))
    return found


COMMANDS = doc_commands()
# started on the demo config's fixed ports (8000–8002): never beside the other test that binds
# them, test_supervisor.py's start and stop (the demo_ports lock, tests/conftest.py)
ON_THE_DEMO_PORTS = {"make demo"}


def test_the_documents_give_commands() -> None:
    assert len(COMMANDS) >= 10


@pytest.mark.skip_by_design
@pytest.mark.parametrize(
    ("page", "command"),
    [
        pytest.param(
            page, c, id=c, marks=[pytest.mark.demo_ports] if c in ON_THE_DEMO_PORTS else []
        )
        for page, c in COMMANDS
    ],
)
def test_every_command_is_run_or_says_why_not(page: str, command: str) -> None:
    why = next((why for pattern, why in NOT_RUN if re.fullmatch(pattern, command)), None)
    if why is not None:
        pytest.skip(f"not run: {why}")
    timeout = next((t for pattern, t in RUN if re.fullmatch(pattern, command)), None)
    assert timeout is not None, (
        f"{page}: {command!r} is neither run by this test nor said why not (RUN / NOT_RUN)"
    )
    done = subprocess.run(
        shlex.split(command), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (
        f"{page}: {command!r} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )


def curl_blocks() -> list[str]:
    """The bash blocks of ``docs/gateway.md`` that call the gateway with curl (but the
    galleries block: test_gallery_gateway.py runs it)."""
    blocks = [m.group(3) for m in FENCE.finditer(CURL_PAGE.read_text("utf-8"))]
    return [block for block in blocks if "curl " in block and "/v1/galleries" not in block]


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_the_gateway_curl_examples(tmp_path: Path, demo_config: object) -> None:
    blocks = curl_blocks()
    assert len(blocks) == 2, "a JSON example and a binary one"
    http_at, grpc_at = free_address(), free_address()
    config = write_config(tmp_path, ["classify"], gateway={"http": http_at, "grpc": grpc_at})
    with running_supervisor(config):
        answers = []
        for block in blocks:
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", block.replace("127.0.0.1:8000", http_at)],
                cwd=ROOT, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert done.returncode == 0, f"{block}\nexited {done.returncode}: {done.stderr}"
            (output,) = json.loads(done.stdout)["outputs"]
            assert (output["name"], output["datatype"], output["shape"]) == ("RESULT", "BYTES", [1])
            answers.append(json.loads(output["data"][0])["top"][0])
    assert answers[1]["index"] == 967, "the coffee photo, as the page says (espresso)"


def run_block(block: str, config: Path, folder: Path) -> str:
    """Run a page's bash block whole against a supervisor on ``config`` (its ``/tmp/`` files in
    ``folder``); what it printed. It must exit 0."""
    with running_supervisor(config) as sup:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.replace("/tmp/", f"{folder}/")],
            cwd=ROOT, capture_output=True, text=True, timeout=180,
            env={**os.environ, "DUOMO_SOCKET": str(sup.socket)},
        )  # fmt: skip
    assert done.returncode == 0, f"{block}\nexited {done.returncode}: {done.stderr}"
    return done.stdout


def test_the_galleries_guide(tmp_path: Path, demo_config: object) -> None:
    """The galleries page's block, whole, against a supervisor of the demo's face models and
    ``faces`` with a gallery of its own: the astronaut enrolled is named in her mirror image
    and only there, exported, then removed."""
    block = galleries_guide()
    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    models = ["face", "face_embedding", "face_attributes", "people"]
    config = write_config(tmp_path, models, pipelines=demo["pipelines"])
    said = run_block(block, config, tmp_path)
    assert "enrolled Eileen Collins in people (1 embedding)" in said
    assert said.count("identity: name Eileen Collins, similarity 0.9") == 1, said  # the mirror
    assert said.count("identity: name None, similarity 0.1") == 1, said  # the cameraman
    found, gone = [line for line in said.splitlines() if line.startswith("   1  ")]
    assert "Eileen Collins" in found and "(nobody)" in gone, said
    export = json.loads((tmp_path / "people.json").read_text())
    assert [i["name"] for i in export["identities"]] == ["Eileen Collins"]
    assert "removed Eileen Collins from people" in said


def test_the_streams_guide_example(tmp_path: Path, demo_config: object) -> None:
    (block,) = [
        m.group(3) for m in FENCE.finditer(STREAMS_PAGE.read_text("utf-8")) if "/tmp/" in m.group(3)
    ]
    run_block(block, write_config(tmp_path, ["face", "ocr"]), tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    # the clip's 40 frames, each answered once by each model: OK, or superseded by a newer one
    assert sorted((line["frame"], line["model"]) for line in lines) == [
        (frame, model) for frame in range(40) for model in ("face", "ocr")
    ]
    assert {line["stream"] for line in lines} == {"astronaut"}, "the file's stem, as the page says"
    faces = [
        line["result"]["faces"] for line in lines if line["model"] == "face" and "result" in line
    ]
    assert faces and all(len(found) == 1 for found in faces), "the astronaut's face, in each"
    assert all(line.get("outcome", "SUPERSEDED") == "SUPERSEDED" for line in lines)
