"""The deployment files (deploy/) agree with the Kubernetes schemas, with each other and with the
code's defaults — offline, with no cluster.

* Every overlay of ``deploy/kubernetes`` and the KServe pair is rendered with ``kubectl
  kustomize`` (``make test`` installs kubectl into the virtual environment; without it these
  tests skip, and fail with CI=true: tests/conftest.py); each Kubernetes object is validated
  strictly (unknown fields fail) against the schemas of ``kubernetes-validate`` for the oldest
  and newest Kubernetes versions it ships, and so are the pod-spec parts inside KServe's
  resources.
* ServiceMonitor, ServingRuntime and InferenceService are custom resources whose schemas no
  package ships: their fields are checked against the names in their CRDs (prometheus-operator
  ``monitoring.coreos.com_servicemonitors.yaml`` at 6adcebc5, KServe
  ``serving.kserve.io_{servingruntimes,inferenceservices}.yaml`` at aaac4e29; the lists below
  hold the fields these files may use) and against each other (the ServiceMonitor's port is a
  Service port, the InferenceService names the runtime and its model format).
* The ports, the probe paths and the metrics port are the code's: the gateway's and the metrics
  section's default ports, paths that ``MetricsServer`` and the gateway's HTTP front answer 200
  without a token; every config that deploy/ carries loads with ``load_config``.
* The layout's invariants: every container of a pod (and every service of the compose file)
  mounts the same memory-backed socket directory and runs as uid 10001; that directory is the
  only volume two containers share, and none mounts ``/dev/shm`` or shares an IPC namespace
  (the rings are sealed memfd segments passed over the socket).
* The stream source (issue 34): every overlay's pod has the sidecar ``stream-source`` of
  ``components/stream-source`` — the supervisor's image running ``duomo stream --sources``, the
  file it names mounted from the ConfigMap ``duomo-sources``, resource requests and limits, the
  pod's hardening — and compose's service ``stream-source`` is the same beside the supervisor,
  started once the supervisor is healthy. Every sources file deploy/ carries follows the format
  of docs/deployment.md ("Cameras"), names only models its pod serves, and plays a clip the
  images write; both Containerfiles copy every package of ``duomo``.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes_validate
import numpy as np
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from duomo.supervisor.config import ConfigError, load_config
from duomo.supervisor.operators.metrics_http import MetricsConfig, MetricsServer
from duomo.supervisor.process.gateways import GatewayConfig
from tests.conftest import require_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBE / "overlays").iterdir() if p.is_dir())
TARGETS = [f"overlays/{name}" for name in OVERLAYS] + ["kserve"]
DEVICE_RESOURCE = {
    "cpu": None,
    "ascend-310p": "huawei.com/Ascend310P",
    "ascend-910b": "huawei.com/Ascend910",
    "nvidia-gpu": "nvidia.com/gpu",
}
CUSTOM_KINDS = {"ServiceMonitor", "ServingRuntime", "InferenceService"}
UID = 10001
SOCKET_DIR = "/run/duomo"
SOCKET = "/run/duomo/sock/duomo.sock"
SOURCES = "/etc/duomo-sources/sources.yaml"  # where the stream source reads its cameras
SOURCE_KEYS = {"name", "url", "models", "policy", "max_fps"}  # docs/deployment.md, "Cameras"
HARDENING = {
    "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}  # fmt: skip

# Field names from the CRDs named in the docstring, for the parts these files fill in.
SERVICE_MONITOR_SPEC = {
    "selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels", "podTargetLabels",
    "sampleLimit", "scrapeProtocols", "attachMetadata",
}  # fmt: skip
SERVICE_MONITOR_ENDPOINT = {
    "port", "targetPort", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
    "honorTimestamps", "params", "relabelings", "metricRelabelings", "bearerTokenSecret",
    "authorization", "basicAuth", "oauth2", "tlsConfig", "followRedirects", "enableHttp2",
    "filterRunning", "proxyUrl", "trackTimestampsStaleness",
}  # fmt: skip
SERVING_RUNTIME_SPEC = {
    "affinity", "annotations", "builtInAdapter", "containers", "disabled", "grpcDataEndpoint",
    "grpcEndpoint", "hostIPC", "httpDataEndpoint", "imagePullSecrets", "labels", "multiModel",
    "nodeSelector", "protocolVersions", "replicas", "resourceClaims", "schedulerName",
    "storageHelper", "supportedModelFormats", "tolerations", "volumes", "workerSpec",
}  # fmt: skip
MODEL_FORMAT = {"name", "version", "autoSelect", "priority"}
INFERENCE_SERVICE_PREDICTOR = {
    "model", "minReplicas", "maxReplicas", "scaleMetric", "scaleMetricType", "scaleTarget",
    "containerConcurrency", "timeout", "canaryTrafficPercent", "annotations", "labels",
    "deploymentStrategy", "nodeSelector", "tolerations", "affinity", "serviceAccountName",
    "resources", "volumes",
}  # fmt: skip
INFERENCE_SERVICE_MODEL = {
    "modelFormat", "runtime", "runtimeVersion", "protocolVersion", "storageUri", "storage",
    "args", "env", "resources", "ports", "volumeMounts",
}  # fmt: skip


@cache
def rendered(target: str) -> tuple[dict[str, Any], ...]:
    kubectl = require_tool("kubectl", "its kustomize renders deploy/kubernetes (make test's tools)")
    done = subprocess.run(
        [kubectl, "kustomize", str(KUBE / target)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{target}: {done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def one(target: str, kind: str) -> dict[str, Any]:
    found = [doc for doc in rendered(target) if doc["kind"] == kind]
    assert len(found) == 1, f"{target}: {len(found)} {kind}"
    return found[0]


def containers(target: str) -> dict[str, dict[str, Any]]:
    spec = one(target, "Deployment")["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"]}


def port_of(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


GATEWAY_HTTP = port_of(GatewayConfig().http or "")
GATEWAY_GRPC = port_of(GatewayConfig().grpc or "")
METRICS = port_of(MetricsConfig().http)


# --- the Kubernetes schemas --------------------------------------------------------------


def test_every_kind_is_one_we_know() -> None:
    for target in TARGETS:
        kinds = {doc["kind"] for doc in rendered(target)}
        assert kinds - CUSTOM_KINDS <= {
            "Deployment", "Service", "ConfigMap", "PodDisruptionBudget",
        }, target  # fmt: skip
    kinds = {doc["kind"] for doc in rendered("overlays/cpu")}
    assert kinds == {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceMonitor"}
    assert {doc["kind"] for doc in rendered("kserve")} == {"ServingRuntime", "InferenceService"}


@pytest.mark.parametrize("version", [all_versions()[0], all_versions()[-1]])
@pytest.mark.parametrize("target", TARGETS)
def test_manifests_validate_against_the_kubernetes_schemas(target: str, version: str) -> None:
    for doc in rendered(target):
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, version, strict=True)


def core_validator(definition: str, version: str) -> Any:
    """A strict validator for one core type (``io.k8s.api.core.v1.Container``, ...)."""
    import jsonschema
    from kubernetes_validate.utils import schema_contents
    from referencing import Registry, Resource

    folder = f"kubernetes-json-schema/v{version}-local-strict"
    definitions = Resource.from_contents(schema_contents(f"{folder}/_definitions.json", version))
    schema = {"$ref": f"{definitions.id()}#/$defs/{definition}"}
    registry: Registry[Any] = definitions @ Registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


@pytest.mark.parametrize("version", [all_versions()[0], all_versions()[-1]])
def test_kserve_runtime_pod_parts_validate_against_the_core_schemas(version: str) -> None:
    runtime = one("kserve", "ServingRuntime")["spec"]
    for container in runtime["containers"]:
        core_validator("io.k8s.api.core.v1.Container", version).validate(container)
    for volume in runtime["volumes"]:
        core_validator("io.k8s.api.core.v1.Volume", version).validate(volume)


def test_core_validator_rejects_a_misspelt_field() -> None:
    container = dict(containers("overlays/cpu")["supervisor"])
    container["livenesProbe"] = container.pop("livenessProbe")
    with pytest.raises(Exception, match="livenesProbe"):
        core_validator("io.k8s.api.core.v1.Container", all_versions()[-1]).validate(container)


# --- the custom resources -----------------------------------------------------------------


@pytest.mark.parametrize("target", [f"overlays/{name}" for name in OVERLAYS])
def test_service_monitor_scrapes_the_metrics_port(target: str) -> None:
    monitor, service = one(target, "ServiceMonitor"), one(target, "Service")
    assert set(monitor["spec"]) <= SERVICE_MONITOR_SPEC
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) <= SERVICE_MONITOR_ENDPOINT
    assert endpoint["path"] == "/metrics"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports[endpoint["port"]]["port"] == METRICS
    supervisor = containers(target)["supervisor"]
    container_ports = {p["name"]: p["containerPort"] for p in supervisor["ports"]}
    assert container_ports[ports[endpoint["port"]]["targetPort"]] == METRICS
    assert metrics_status(endpoint["path"]) == "200 OK"


def test_kserve_runtime_and_inference_service_fit_together() -> None:
    runtime, service = one("kserve", "ServingRuntime"), one("kserve", "InferenceService")
    spec = runtime["spec"]
    assert set(spec) <= SERVING_RUNTIME_SPEC
    assert "v2" in spec["protocolVersions"]
    assert spec["multiModel"] is False
    for model_format in spec["supportedModelFormats"]:
        assert set(model_format) <= MODEL_FORMAT
    (container,) = spec["containers"]
    assert container["name"] == "kserve-container"  # the container KServe merges the model into
    assert [p["containerPort"] for p in container["ports"]] == [GATEWAY_HTTP]
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] == GATEWAY_HTTP
        assert gateway_status(get["path"]) == 200, f"{probe}: {get['path']}"
    predictor = service["spec"]["predictor"]
    assert set(predictor) <= INFERENCE_SERVICE_PREDICTOR
    model = predictor["model"]
    assert set(model) <= INFERENCE_SERVICE_MODEL
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["protocolVersion"] in spec["protocolVersions"]
    assert model["modelFormat"] in [
        {k: v for k, v in f.items() if k in ("name", "version")}
        for f in spec["supportedModelFormats"]
    ]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts[SOCKET_DIR]]["emptyDir"]["medium"] == "Memory"
    assert not any(on_dev_shm(path) for path in mounts), mounts
    assert "hostIPC" not in spec
    assert container["securityContext"]["runAsUser"] == UID


# --- the code's ports and probes ---------------------------------------------------------


class NoSeries:
    def collect(self) -> list[Any]:
        return []


def metrics_status(path: str) -> str:
    """What the supervisor's metrics port answers on ``path`` when every model serves."""
    collector = NoSeries()
    server = MetricsServer(MetricsConfig(), collector, live=lambda: True, not_ready=list)
    answer: list[str] = []
    environ = {"PATH_INFO": path, "REQUEST_METHOD": "GET"}
    server._app(environ, lambda status, _headers: answer.append(status))
    return answer[0]


def gateway_status(path: str) -> int:
    """What the gateway's HTTP front answers on ``path`` without a token, connected."""
    from duomo.gateway.http_front import HttpFront, HttpOptions

    options = HttpOptions(max_body_bytes=1024, token="secret", extensions=(), version="test")
    front = HttpFront(SimpleNamespace(ready=True), None, options)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": []}
    asyncio.run(front(scope, receive, send))
    return int(sent[0]["status"])


def test_an_unknown_path_is_not_200() -> None:  # so that the two checks above can fail
    assert metrics_status("/v2/health/readyy") != "200 OK"
    assert gateway_status("/v2/models/classify") == 401


@pytest.mark.parametrize("target", [f"overlays/{name}" for name in OVERLAYS])
def test_ports_and_probes_are_the_codes(target: str) -> None:
    supervisor = containers(target)["supervisor"]
    ports = {p["name"]: p["containerPort"] for p in supervisor["ports"]}
    assert ports == {"http": GATEWAY_HTTP, "grpc": GATEWAY_GRPC, "metrics": METRICS}
    for probe, path in (
        ("startupProbe", "/v2/health/ready"),
        ("readinessProbe", "/v2/health/ready"),
        ("livenessProbe", "/v2/health/live"),
    ):
        get = supervisor[probe]["httpGet"]
        assert (get["path"], get["port"]) == (path, "metrics")
        assert metrics_status(get["path"]) == "200 OK"
    service = {p["name"]: p for p in one(target, "Service")["spec"]["ports"]}
    for name, port in ports.items():
        assert (service[name]["port"], service[name]["targetPort"]) == (port, name)
    config = pod_config(target)
    assert port_of(config["gateway"]["http"]) == GATEWAY_HTTP
    assert port_of(config["gateway"]["grpc"]) == GATEWAY_GRPC
    assert port_of(config["metrics"]["http"]) == METRICS


def config_map(target: str, name: str) -> dict[str, Any]:
    """The ConfigMap that the generator ``name`` made (its name gains a hash of the data)."""
    found = [
        doc
        for doc in rendered(target)
        if doc["kind"] == "ConfigMap"
        and re.fullmatch(rf"{name}(-[a-z0-9]+)?", doc["metadata"]["name"])
    ]
    assert len(found) == 1, f"{target}: {len(found)} ConfigMap {name}"
    return found[0]


def pod_config(target: str) -> dict[str, Any]:
    data = config_map(target, "duomo-config")["data"]
    config: dict[str, Any] = yaml.safe_load(data["duomo.yaml"])
    return config


# --- the pod's layout and resources --------------------------------------------------------


def on_dev_shm(path: str) -> bool:
    return path.rstrip("/") == "/dev/shm" or path.startswith("/dev/shm/")


@pytest.mark.parametrize("target", [f"overlays/{name}" for name in OVERLAYS])
def test_the_socket_directory_is_the_only_volume_the_containers_share(target: str) -> None:
    pod = one(target, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == UID
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert "hostIPC" not in pod
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert len(pod["containers"]) >= 2, "the supervisor and its producers"
    users: dict[str, set[str]] = {}  # volume -> the containers that mount it
    for container in pod["containers"]:
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts[SOCKET_DIR]]["emptyDir"]["medium"] == "Memory", container["name"]
        assert not any(on_dev_shm(path) for path in mounts), (container["name"], mounts)
        for name in mounts.values():
            users.setdefault(name, set()).add(container["name"])
        assert {"name": "DUOMO_SOCKET", "value": SOCKET} in container["env"], container["name"]
        assert "runAsUser" not in container.get("securityContext", {}), "one uid for the pod"
    shared = {name for name, who in users.items() if len(who) > 1}
    assert shared == {"run"}, users
    assert users["run"] == {c["name"] for c in pod["containers"]}
    config = pod_config(target)
    assert config["gateway"]["token_file"] in {
        m["mountPath"] for m in containers(target)["supervisor"]["volumeMounts"]
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_asks_for_its_device_and_follows_its_budgets(overlay: str) -> None:
    target = f"overlays/{overlay}"
    pod = one(target, "Deployment")["spec"]["template"]["spec"]
    supervisor = containers(target)["supervisor"]
    limits = supervisor["resources"]["limits"]
    extended = {name for name in limits if "/" in name}
    expected = DEVICE_RESOURCE[overlay]
    assert extended == ({expected} if expected else set())
    if expected:
        assert limits[expected] == "1", "one card (chip) per supervisor"
    config = pod_config(target)
    threads = config["backends"]["onnxruntime"]["thread_budget"]
    assert threads + config["gateway"]["workers"] == int(limits["cpu"])
    pre_stop = int(supervisor["lifecycle"]["preStop"]["exec"]["command"][1])
    assert config["shutdown_grace_s"] + pre_stop < pod["terminationGracePeriodSeconds"]
    requests = supervisor["resources"]["requests"]
    assert mebibytes(requests["memory"]) >= 768  # measured: 490 + 63 + 11 MiB (docs/deployment.md)
    assert mebibytes(limits["memory"]) >= mebibytes(requests["memory"])


def mebibytes(quantity: str) -> int:
    match = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    assert match, quantity
    number, unit = match.groups()
    return int(number) * (1024 if unit == "Gi" else 1)


def test_the_disruption_budget_and_the_service_select_the_pods() -> None:
    deployment = one("overlays/cpu", "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert one("overlays/cpu", "Service")["spec"]["selector"].items() <= labels.items()
    budget = one("overlays/cpu", "PodDisruptionBudget")["spec"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert budget["maxUnavailable"] == 1


# --- the stream source (cameras) ---------------------------------------------------------


def check_sources(text: str, served: set[str]) -> list[dict[str, Any]]:
    """The sources file ``text`` in the format of docs/deployment.md ("Cameras"): a list of
    {name, url, models, policy, max_fps}; here every entry names its models (no --model), all
    of them served by the pod's supervisor (``served``)."""
    sources = yaml.safe_load(text)
    assert isinstance(sources, list) and sources, "a YAML list of sources"
    names = [source["name"] for source in sources]
    assert len(set(names)) == len(names), f"the stream names repeat: {names}"
    for source in sources:
        assert {"name", "url", "models"} <= set(source) <= SOURCE_KEYS, source
        name, url, models = source["name"], source["url"], source["models"]
        assert isinstance(name, str) and 1 <= len(name) <= 64 and name.isprintable(), name
        assert isinstance(url, str) and url.strip() == url and url, source
        assert isinstance(models, list) and models and set(models) <= served, (models, served)
        assert source.get("policy", "latest") in ("latest", "fifo"), source
        max_fps = source.get("max_fps")
        assert max_fps is None or (type(max_fps) in (int, float) and max_fps > 0), source
    return sources


def millicores(quantity: str) -> int:
    match = re.fullmatch(r"(\d+)(m?)", quantity)
    assert match, quantity
    return int(match[1]) * (1 if match[2] else 1000)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_runs_the_stream_source_beside_the_supervisor(overlay: str) -> None:
    target = f"overlays/{overlay}"
    pod = one(target, "Deployment")["spec"]["template"]["spec"]
    source, supervisor = containers(target)["stream-source"], containers(target)["supervisor"]
    assert source["image"] == supervisor["image"], "duomo stream is in the supervisor's image"
    assert source["command"] == ["duomo", "stream"]
    args = source["args"]
    assert args[args.index("--sources") + 1] == SOURCES
    mounts = {m["mountPath"]: m for m in source["volumeMounts"]}
    mount = mounts[str(Path(SOURCES).parent)]
    assert mount["readOnly"] is True
    volume = {v["name"]: v for v in pod["volumes"]}[mount["name"]]
    sources = config_map(target, "duomo-sources")
    assert volume["configMap"]["name"] == sources["metadata"]["name"]
    served = {model["name"] for model in pod_config(target)["models"]}
    check_sources(sources["data"][Path(SOURCES).name], served)
    requests, limits = source["resources"]["requests"], source["resources"]["limits"]
    assert set(requests) == set(limits) == {"cpu", "memory"}, "decoding needs no device"
    assert millicores(limits["cpu"]) >= millicores(requests["cpu"]) > 0
    assert mebibytes(limits["memory"]) >= mebibytes(requests["memory"]) >= 128  # measured: 60
    assert source["securityContext"] == supervisor["securityContext"] == HARDENING
    # no probe: a camera that is down is reported by the supervisor (the stream is stalled) and
    # the source reconnects it by itself; restarting the container would not bring it back
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(source)


def test_the_sources_files_agree_and_play_the_images_clip() -> None:
    """The component's list and compose's default are the same, and the clip they play is the
    one both Containerfiles write."""
    component = KUBE / "components" / "stream-source" / "sources.yaml"
    compose = DEPLOY / "config" / "sources.yaml"
    assert yaml.safe_load(component.read_text()) == yaml.safe_load(compose.read_text())
    served = {model["name"] for model in yaml.safe_load(CONFIGS["image"].read_text())["models"]}
    files = [s["url"] for s in check_sources(compose.read_text(), served) if s["url"][0] == "/"]
    assert files, "the demo plays a file of the image"
    for containerfile in ("Containerfile", "Containerfile.ascend"):
        text = (DEPLOY / containerfile).read_text()
        written = re.findall(r"demo_clip\.py (\S+) \\\n\s+(\S+)", text)
        assert {out for _, out in written} == set(files), containerfile
        assert all(photo == "frames/astronaut.png" for photo, _ in written), containerfile


def test_the_demo_clip_is_h264_with_the_frames_asked_for(tmp_path: Path) -> None:
    import av

    clip = tmp_path / "demo.mp4"
    photo = ROOT / "tests" / "fixtures" / "images" / "astronaut.png"
    script = DEPLOY / "stream" / "demo_clip.py"
    done = subprocess.run(
        [sys.executable, str(script), str(photo), str(clip), "--seconds", "2", "--fps", "5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with av.open(str(clip)) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.name, stream.average_rate) == ("h264", 5)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    assert len(frames) == 10
    assert {frame.shape for frame in frames} == {(512, 768, 3)}
    assert not np.array_equal(frames[0], frames[4]), "the photo moves"


# --- the configs deploy/ carries ---------------------------------------------------------

CONFIGS = {
    "image": DEPLOY / "config" / "duomo.yaml",
    "base": KUBE / "base" / "duomo.yaml",
    **{name: KUBE / "overlays" / name / "duomo.yaml" for name in OVERLAYS if name != "cpu"},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_config_loads(name: str, tmp_path: Path) -> None:
    """With model_root at empty stand-ins for the model files, and the token file here."""
    raw = yaml.safe_load(CONFIGS[name].read_text())
    assert raw["model_root"] == "/opt/duomo/models"  # where the image puts them
    for model in raw["models"]:
        for file in [model["file"]] if "file" in model else model["files"].values():
            if not file.endswith(".om"):
                (tmp_path / "models" / file).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / "models" / file).write_bytes(b"")
    raw["model_root"] = str(tmp_path / "models")
    assert raw["gateway"]["token_file"] == "/run/secrets/duomo-gateway-token"
    raw["gateway"]["token_file"] = str(tmp_path / "token")
    (tmp_path / "token").write_text("secret\n")
    (tmp_path / "duomo.yaml").write_text(yaml.safe_dump(raw))
    try:
        loaded = load_config(tmp_path / "duomo.yaml", unbuilt_om_ok=True)
    except ConfigError as err:  # a CUDA build of ONNX Runtime is not installed here
        assert all("CUDAExecutionProvider is not available" in why for _, why in err.problems)
        assert name == "nvidia-gpu"
        return
    assert set(loaded.models) == {"ocr", "face", "classify"}


@pytest.mark.parametrize("soc", ["310p", "910b"])
def test_ascend_configs_serve_what_configs_ascend_serves(soc: str) -> None:
    pod = yaml.safe_load((KUBE / "overlays" / f"ascend-{soc}" / "duomo.yaml").read_text())
    source = yaml.safe_load((ROOT / "configs" / f"ascend-{soc}.yaml").read_text())
    assert pod["models"] == source["models"]
    assert pod["devices"] == source["devices"]
    assert pod["backends"]["acl"] == source["backends"]["acl"]


# --- the compose file and the Containerfile ------------------------------------------------


def test_compose_layout_shares_only_the_socket_directory_and_one_uid() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"supervisor", "producer-classify", "producer-face", "stream-source"}
    for name, service in services.items():
        assert service["user"] == f"{UID}:{UID}", name
        assert service["volumes"][0] == f"run:{SOCKET_DIR}", name
        others = service["volumes"][1:]
        assert others == ([COMPOSE_SOURCES] if name == "stream-source" else []), name
        assert not {"ipc", "shm_size", "volumes_from"} & set(service), name
        assert not any(on_dev_shm(path) for path in service.get("tmpfs", [])), name
        assert service["environment"]["DUOMO_SOCKET"] == SOCKET, name
    assert set(compose["volumes"]) == {"run"}
    options = compose["volumes"]["run"]["driver_opts"]
    assert (options["type"], options["device"]) == ("tmpfs", "tmpfs")
    assert f"uid={UID}" in options["o"] and "mode=0700" in options["o"]
    published = {p.rpartition(":")[2] for p in services["supervisor"]["ports"]}
    assert published == {str(GATEWAY_HTTP), str(GATEWAY_GRPC), str(METRICS)}
    secret = services["supervisor"]["secrets"][0]["target"]
    image_config = yaml.safe_load(CONFIGS["image"].read_text())
    assert image_config["gateway"]["token_file"] == f"/run/secrets/{secret}"


COMPOSE_SOURCES = f"${{DUOMO_SOURCES_FILE:-./config/sources.yaml}}:{SOURCES}:ro"


def test_compose_runs_the_stream_source_once_the_supervisor_is_healthy() -> None:
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    source, supervisor = services["stream-source"], services["supervisor"]
    assert source["image"] == supervisor["image"], "duomo stream is in the supervisor's image"
    assert source["entrypoint"] == ["duomo", "stream"]
    command = source["command"]
    assert command[command.index("--sources") + 1] == SOURCES
    assert source["depends_on"] == {"supervisor": {"condition": "service_healthy"}}
    assert "healthcheck" in supervisor
    assert source["restart"] == "on-failure"
    default = re.fullmatch(r"\$\{DUOMO_SOURCES_FILE:-(.+)\}", COMPOSE_SOURCES.split(":/")[0])
    assert default
    served = {model["name"] for model in yaml.safe_load(CONFIGS["image"].read_text())["models"]}
    check_sources((DEPLOY / default[1]).read_text(), served)


def test_the_images_carry_every_package_of_duomo() -> None:
    """Each folder that ``duomo`` links (ipc, supervisor, video, ...) is in the build context and
    copied by both Containerfiles, with the demo clip's script."""
    packages = sorted(p.name for p in (ROOT / "duomo").iterdir() if p.is_symlink())
    assert "video" in packages
    context = (DEPLOY / "containerignore").read_text().splitlines()
    assert {f"!{name}" for name in packages} | {"!deploy/stream"} <= set(context)
    for containerfile in ("Containerfile", "Containerfile.ascend"):
        text = (DEPLOY / containerfile).read_text()
        for name in packages:
            assert re.search(rf"^COPY {name} {name}$", text, re.M), (containerfile, name)
        assert "COPY deploy/stream/demo_clip.py deploy/stream/" in text, containerfile


def test_containerfile_runs_the_supervisor_as_the_shared_uid() -> None:
    text = (DEPLOY / "Containerfile").read_text()
    assert f"ARG UID={UID}" in text
    assert f"DUOMO_SOCKET={SOCKET}" in text
    assert re.search(r"^EXPOSE 8000 8001 8002$", text, re.M)
    assert (GATEWAY_HTTP, GATEWAY_GRPC, METRICS) == (8000, 8001, 8002)
    assert 'ENTRYPOINT ["duomo", "start", "--foreground"]' in text
    assert "COPY deploy/config/duomo.yaml /etc/duomo/duomo.yaml" in text
