"""The YAML configuration: schema, loading, and every check that can run without loading a model.

Called by the CLI (``duomo check``, ``duomo infer``, later ``duomo start``) and the engine.

``load_config(path)`` returns a validated ``DuomoConfig`` or raises ``ConfigError`` whose lines each
name the file, the field path and the reason. A model's fields are named by its name
(``models[ocr].max_batch``), or by its index (``models[2].max_batch``) when the entry has no
name that tells it apart (missing, not a string, not a valid name, all digits, or used twice).
Checked here: unknown keys (at every level, executor params included), types and ranges, unique
model names, known devices, known tasks with the model-file roles they need, and that every
model file exists. Relative paths are resolved against ``model_root``, itself relative to the
config file's folder (default: the config file's folder).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeGuard

import yaml
from pydantic import Field, ValidationError, model_validator

from duomo.sinks.config import SinkList
from duomo.supervisor.dataflow.pipeline_config import PipelineConfig, pipeline_problems
from duomo.supervisor.operators.metrics_http import MetricsConfig
from duomo.supervisor.process.gateways import GatewayConfig
from duomo.supervisor.process.limits import LimitsConfig
from duomo.supervisor.sources.definition import SourceDefinition
from duomo.supervisor.sources.workers import SourceWorkersConfig
from duomo.worker.backends.acl_backend import AclOptions
from duomo.worker.backends.ort_backend import OrtOptions
from duomo.worker.config_model import NAME_PATTERN, StrictModel
from duomo.worker.executors import resolve_executor
from duomo.worker.executors.base import Executor
from duomo.worker.health import HealthPolicy
from duomo.worker.thread_budget import available_cores, usable_cores

DeviceId = Annotated[int, Field(ge=0)]
UNBUILT_OM = "model file not built yet"


class DeviceConfig(StrictModel):
    """One entry of ``devices``: its id and kind, its memory budget, its compute gate and, for a
    cpu device, its own cores."""

    id: int = Field(default=0, ge=0)
    kind: Literal["cpu", "cuda", "ascend"] = "cpu"
    # what the models on this device may use together (host memory on cpu, device memory on an
    # accelerator); a load that does not fit evicts idle evictable models, else fails
    memory_budget_mb: int | None = Field(default=None, ge=1)
    # its compute gate (worker.thread_budget.FairShare): runs at once on an accelerator (the
    # CPU's come from the thread budget), and how many more an under-served model may start
    runs_at_once: int | None = Field(default=None, ge=1, le=64)
    overdraft: int = Field(default=1, ge=0, le=64)
    # a cpu device's own cores (ids as os.sched_getaffinity lists them): its models' threads and
    # their intra-op threads run only there, and its thread budget is their number. Without
    # it, a cpu device shares the process's cores (backends.onnxruntime.thread_budget)
    cores: list[int] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _runs_on_accelerators(self) -> DeviceConfig:
        if self.kind == "cpu" and self.runs_at_once is not None:
            raise ValueError(
                "runs_at_once is for accelerators; on the cpu the thread budget "
                "(backends.onnxruntime.thread_budget, or the device's cores) says how many "
                "run at once"
            )
        if self.cores is not None:
            if self.kind != "cpu":
                raise ValueError("cores is for cpu devices (an accelerator has its own)")
            if len(set(self.cores)) != len(self.cores) or min(self.cores) < 0:
                raise ValueError(f"cores must be distinct core ids, got {self.cores}")
        return self


class WatchdogConfig(StrictModel):
    """The ``watchdog`` section: whether the health watchdog runs, and how often it looks."""

    enabled: bool = True
    period_ms: float = Field(default=250, ge=10, le=60_000)


class BackendsConfig(StrictModel):
    """The ``backends`` section: each runtime's options."""

    onnxruntime: OrtOptions = Field(default_factory=OrtOptions)
    acl: AclOptions = Field(default_factory=AclOptions)


class ModelConfig(StrictModel):
    """One entry of ``models``: its task, backend, devices and files, and how it is batched,
    queued, shared, loaded, checked and threaded; ``params`` go to its executor."""

    name: str = Field(pattern=NAME_PATTERN)
    task: str
    backend: Literal["onnxruntime", "acl"] = "onnxruntime"
    # the device it runs on, or several: its instances are spread over them in turn
    device: DeviceId | Annotated[list[DeviceId], Field(min_length=1)] = 0
    file: Path | None = None
    files: dict[str, Path] | None = None
    instances: int = Field(default=1, ge=1, le=64)
    max_batch: int = Field(default=1, ge=1, le=1024)
    # a fixed fill window, or "auto": chosen from the batch costs and health.slo_p99_ms
    max_delay_ms: Annotated[float, Field(ge=0, le=10_000)] | Literal["auto"] = 0.0
    queue_size: int = Field(default=64, ge=1, le=1_000_000)
    priority: int = Field(default=0, ge=-1000, le=1000)
    priority_aging_per_s: float = Field(default=10.0, ge=0, le=1_000_000)
    # its share of its device's compute time, relative to the other models' (equal by default)
    compute_weight: float = Field(default=1.0, gt=0, le=1000)
    memory_budget_mb: int | None = Field(default=None, ge=1)
    preload: bool = True
    evictable: bool = False
    # instances and models that open the same file alike use one copy of its weights
    share_weights: bool = True
    health: HealthPolicy = Field(default_factory=HealthPolicy)
    # threads per instance: planned (None), a number, or "all": the whole thread budget of its
    # pool while it computes (the compute gate has it take turns with the others)
    intra_op_threads: Annotated[int, Field(ge=1, le=1024)] | Literal["all"] | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_file_field(self) -> ModelConfig:
        if (self.file is None) == (self.files is None):
            raise ValueError("give exactly one of 'file' (one model file) or 'files' (role: path)")
        if len(set(self.device_ids)) != len(self.device_ids):
            raise ValueError(f"device lists a device twice: {self.device}")
        if self.max_delay_ms == "auto" and (self.health.slo_p99_ms is None or self.max_batch < 2):
            raise ValueError(
                "max_delay_ms: auto needs health.slo_p99_ms (the latency it keeps under) and "
                "max_batch of 2 or more"
            )
        return self

    @property
    def device_ids(self) -> tuple[int, ...]:
        """Its devices, in the order its instances are placed on them."""
        return tuple(self.device) if isinstance(self.device, list) else (self.device,)

    def instance_device(self, index: int) -> int:
        """The device instance ``index`` runs on: round-robin over ``device_ids``."""
        ids = self.device_ids
        return ids[index % len(ids)]

    @property
    def file_roles(self) -> dict[str, Path]:
        return dict(self.files) if self.files is not None else {"model": self.file}  # type: ignore[dict-item]


class DuomoConfig(StrictModel):
    """A whole config file: where models live, the devices and backends, the watchdog and limits,
    the gateway and metrics sections, how unloaded models come back, and the models."""

    version: Literal[1] = 1
    model_root: Path | None = None
    devices: list[DeviceConfig] = Field(default_factory=lambda: [DeviceConfig()], min_length=1)
    backends: BackendsConfig = Field(default_factory=BackendsConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    shutdown_grace_s: float = Field(default=30.0, ge=0, le=3600)
    idle_spin_us: int = Field(default=1000, ge=0, le=10_000)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    gateway: GatewayConfig | None = None  # the KServe v2 gateway, started by ``duomo start``
    metrics: MetricsConfig | None = None  # /metrics and the health probes, off when absent
    # how unloaded models come back: on their request only (lru), or also in the background
    # when the request stream says they are next (predictive: supervisor.core.background_loads)
    preload_policy: Literal["lru", "predictive"] = "lru"
    predictive_threshold: float = Field(default=0.5, gt=0, le=1)
    models: list[ModelConfig] = Field(min_length=1)
    # named graphs of steps over the models, each served like a model
    # (supervisor.dataflow.pipelines)
    pipelines: list[PipelineConfig] = Field(default_factory=list)
    # cameras the supervisor decodes itself, in its source workers (supervisor.sources)
    sources: list[SourceDefinition] = Field(default_factory=list)
    source_workers: SourceWorkersConfig = Field(default_factory=SourceWorkersConfig)
    # where the sources' answers and object events go (``duomo.sinks``; run by the sink worker)
    sinks: SinkList = Field(default_factory=list)

    def device(self, device_id: int) -> DeviceConfig:
        """The device with ``device_id``, or a default cpu device of that id when none is
        declared (a model's device is checked to exist when the config loads)."""
        found = next((d for d in self.devices if d.id == device_id), None)
        return found if found is not None else DeviceConfig(id=device_id)


@dataclass(frozen=True)
class ResolvedModel:
    """A model entry with its executor class, validated params and absolute file paths."""

    config: ModelConfig
    executor: type[Executor]
    params: StrictModel
    files: dict[str, Path]


@dataclass(frozen=True)
class LoadedConfig:
    """A config file as loaded and checked: its path, the config, every model resolved by name,
    and the warnings that do not stop it."""

    path: Path
    config: DuomoConfig
    models: dict[str, ResolvedModel]
    # (field, reason) that do not stop a check: .om files not built yet (``unbuilt_om_ok``)
    warnings: tuple[tuple[str, str], ...] = ()


class ConfigError(Exception):
    """An invalid configuration; ``problems`` are (field path, reason) pairs."""

    def __init__(self, path: Path, problems: Sequence[tuple[str, str]]) -> None:
        self.path = path
        self.problems = list(problems)
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(f"{self.path}: {where}: {why}" for where, why in self.problems)


def field_path(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _model_labels(names: Sequence[object]) -> list[str]:
    """How each ``models`` entry is named in a field path, from the entries' ``name`` values:
    the name when it is a valid name that no other entry has and that cannot be read as an
    index (all digits), else the entry's index."""
    counts = Counter(n for n in names if isinstance(n, str))

    def tells_apart(name: object) -> TypeGuard[str]:
        return (
            isinstance(name, str) and counts[name] == 1 and not name.isdigit()
            and re.fullmatch(NAME_PATTERN, name) is not None
        )  # fmt: skip

    return [n if tells_apart(n) else str(i) for i, n in enumerate(names)]


def _raw_labels(entries: object) -> list[str]:
    """``_model_labels`` of a file's list of named entries, before they are validated."""
    if not isinstance(entries, list):
        return []
    return _model_labels([e.get("name") if isinstance(e, dict) else None for e in entries])


_NAMED_LISTS = ("models", "pipelines", "steps", "sources", "sinks")


def _labelled(loc: list[int | str], raw: object) -> list[int | str]:
    """``loc`` with each index into a list of named entries (``models``, ``pipelines``, a
    pipeline's ``steps``, ``sources``, ``sinks``) replaced by the entry's label:
    ``models[face]``, not ``models[2]``. The tag pydantic puts after an entry of a discriminated
    union (a sink's ``kind``) is left out: ``sinks[lake].url``, not ``sinks[lake].redis.url``."""
    out: list[int | str] = []
    node = raw
    entry: object = None  # the named entry the last part indexed, until the next part
    for i, part in enumerate(loc):
        if isinstance(part, int) and i and isinstance(loc[i - 1], str) and out:
            labels = _raw_labels(node)
            if loc[i - 1] in _NAMED_LISTS and part < len(labels):
                out[-1] = f"{out[-1]}[{labels[part]}]"
                node = entry = node[part] if isinstance(node, list) else None
                continue
        if isinstance(entry, dict) and isinstance(part, str) and entry.get("kind") == part:
            entry = None
            continue
        entry = None
        out.append(part)
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            node = None
    return out


def pydantic_problems(
    err: ValidationError, prefix: Sequence[int | str] = (), raw: object = None
) -> list[tuple[str, str]]:
    """``raw``: the file's data the error is located in, for labels of named entries."""
    problems = []
    for e in err.errors(include_url=False):
        loc = [p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        loc = _labelled(loc, raw)
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            message = "unknown key (check the spelling)"
        problems.append((field_path([*prefix, *loc]), message))
    return problems


def load_config(path: str | Path, unbuilt_om_ok: bool = False) -> LoadedConfig:
    """``unbuilt_om_ok``: a missing ``.om`` of an ``acl`` model is a warning, not an error
    (``duomo check`` on a machine where ATC has not run yet); starting always needs every file.
    """
    path = Path(path).resolve()
    try:
        raw = yaml.safe_load(path.read_text("utf-8"))
    except FileNotFoundError:
        raise ConfigError(path, [("(file)", "no such file")]) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(path, [("(file)", f"cannot read: {err}")]) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        raise ConfigError(
            path, [(where, f"not valid YAML: {getattr(err, 'problem', err)}")]
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(path, [("(top level)", "must be a mapping with a 'models' list")])
    try:
        config = DuomoConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(path, pydantic_problems(err, raw=raw)) from None
    problems = _device_problems(config)
    models, model_problems = _resolve_models(path, config)
    problems.extend(model_problems)
    declared = {
        m.name: models[m.name].executor if m.name in models else None for m in config.models
    }
    problems.extend(pipeline_problems(config.pipelines, declared))
    problems.extend(_provider_problems(config))
    if config.gateway is not None:
        gateway = config.gateway.resolved(path.parent)
        config = config.model_copy(update={"gateway": gateway})
        problems.extend((f"gateway.{name}", why) for name, why in gateway.missing_files())
    served = {*declared, *(p.name for p in config.pipelines)}
    sinks = {s.name for s in config.sinks}
    problems.extend(source_problems(config.sources, served, sinks, tracked_pipelines(config)))
    config = config.model_copy(
        update={
            "sources": [d.resolved(path.parent) for d in config.sources],
            "sinks": [s.resolved(path.parent) for s in config.sinks],
            "source_workers": config.source_workers.resolved(path.parent),
        }
    )
    unbuilt = [p for p in problems if p[1].startswith(UNBUILT_OM)] if unbuilt_om_ok else []
    problems = [p for p in problems if p not in unbuilt]
    if problems:
        raise ConfigError(path, problems)
    return LoadedConfig(path=path, config=config, models=models, warnings=tuple(unbuilt))


def tracked_pipelines(config: DuomoConfig) -> dict[str, int]:
    """The pipelines that have a tracker, each with its ``max_missed``."""
    return {p.name: p.tracker.max_missed for p in config.pipelines if p.tracker is not None}


def source_problems(
    sources: Sequence[SourceDefinition],
    served: set[str],
    sinks: set[str] = frozenset(),  # type: ignore[assignment]
    tracked: Mapping[str, int] | None = None,
) -> list[tuple[str, str]]:
    """(field, reason) for each source that repeats a name, feeds what is not served, names a
    sink not in ``sinks`` or asks for object events without a pipeline in ``tracked``."""
    problems: list[tuple[str, str]] = []
    seen: set[str] = set()
    for label, source in zip(_model_labels([s.name for s in sources]), sources):
        where = f"sources[{label}]"
        if source.name in seen:
            problems.append((f"{where}.name", f"duplicate source name {source.name!r}"))
        seen.add(source.name)
        key = "models" if source.models is not None else "pipeline"
        for name in source.feeds:
            if name not in served:
                problems.append((f"{where}.{key}", f"no model or pipeline named {name!r}"))
        problems.extend((f"{where}.{at}", why) for at, why in sink_problems(source, sinks, tracked))
    return problems


def sink_problems(
    source: SourceDefinition, sinks: set[str], tracked: Mapping[str, int] | None
) -> list[tuple[str, str]]:
    """(field, reason) for a source naming a sink not in ``sinks``, or emitting object events
    without a pipeline that has a tracker (``tracked``: their names); the fleet asks the same
    of a source added at run time."""
    problems = [
        ("sinks", f"no sink named {name!r} (the config's sinks: section)")
        for name in source.sinks
        if name not in sinks
    ]
    untracked = source.pipeline not in (tracked or {})
    if source.emit in ("objects", "both") and untracked:
        problems.append(("emit", f"{source.emit!r} needs object events: a pipeline with a tracker"))
    if source.thumbnails != "none" and untracked:
        problems.append(("thumbnails", "thumbnails need object events: a pipeline with a tracker"))
    return problems


def _resolve_models(
    path: Path, config: DuomoConfig
) -> tuple[dict[str, ResolvedModel], list[tuple[str, str]]]:
    root = (path.parent / config.model_root) if config.model_root else path.parent
    problems: list[tuple[str, str]] = []
    models: dict[str, ResolvedModel] = {}
    labels = _model_labels([m.name for m in config.models])
    for label, model in zip(labels, config.models):
        where = f"models[{label}]"
        if model.name in models:
            problems.append((f"{where}.name", f"duplicate model name {model.name!r}"))
            continue
        problems.extend(_placement_problems(where, model, config))
        try:
            executor = resolve_executor(model.task, path.parent)
        except ValueError as err:
            problems.append((f"{where}.task", str(err)))
            continue
        try:
            params = executor.Params.model_validate(model.params)
        except ValidationError as err:
            problems.extend(pydantic_problems(err, (where, "params")))
            continue
        params, missing = _resolve_param_paths(params, path.parent)
        problems.extend((f"{where}.params.{name}", why) for name, why in missing)
        files: dict[str, Path] = {}
        key = "files" if model.files is not None else "file"
        roles = model.file_roles
        if set(roles) != set(executor.roles):
            problems.append(
                (
                    f"{where}.{key}",
                    f"task {model.task!r} needs files for roles {list(executor.roles)}, "
                    f"got {list(roles)}",
                )
            )
            continue
        for role, file in roles.items():
            resolved = (root / file).resolve()
            if not resolved.is_file() and not (executor.data_file and not resolved.exists()):
                field = f"{where}.files.{role}" if key == "files" else f"{where}.file"
                if model.backend == "acl" and resolved.suffix == ".om":
                    problems.append((field, f"{UNBUILT_OM}: {resolved} (tools/atc_convert.py)"))
                else:
                    problems.append((field, f"model file not found: {resolved}"))
            files[role] = resolved
        models[model.name] = ResolvedModel(model, executor, params, files)
    return models, problems


def pool_cores(config: DuomoConfig, device: DeviceConfig | None) -> tuple[int, ...]:
    """The cores a device's model threads are pinned to: its own (``cores``); for any other
    device, while some device has cores of its own, the process's cores that none holds;
    else none (not pinned: the operating system places them)."""
    if device is not None and device.cores is not None:
        return tuple(device.cores)
    pinned = {c for d in config.devices for c in d.cores or ()}
    if not pinned:
        return ()
    usable = usable_cores()
    return tuple([c for c in usable if c not in pinned] or usable)


def thread_budget(config: DuomoConfig, device: DeviceConfig | None) -> int:
    """The intra-op threads a device's models share: a cpu device's own cores, else
    ``backends.onnxruntime.thread_budget``, else the cores of the host's pool (the process's,
    less those devices hold; fewer under a cgroup CPU quota: ``available_cores``), which
    unpinned cpu devices and accelerators' ONNX Runtime sessions share."""
    if device is not None and device.cores is not None:
        return len(device.cores)
    if config.backends.onnxruntime.thread_budget is not None:
        return config.backends.onnxruntime.thread_budget
    pool = pool_cores(config, None)
    return min(len(pool), available_cores()) if pool else available_cores()


def _device_problems(config: DuomoConfig) -> list[tuple[str, str]]:
    """Device ids used twice, and cores that are not this process's or that two devices hold."""
    problems: list[tuple[str, str]] = []
    seen: set[int] = set()
    owner: dict[int, int] = {}
    usable = set(usable_cores())
    for i, device in enumerate(config.devices):
        where = f"devices[{i}]"
        if device.id in seen:
            problems.append((f"{where}.id", f"device id {device.id} is used twice"))
        seen.add(device.id)
        for core in device.cores or ():
            if core not in usable:
                problems.append(
                    (f"{where}.cores", f"core {core} is not one this process may run on "
                     f"(it may use {sorted(usable)})")
                )  # fmt: skip
            elif core in owner:
                problems.append(
                    (f"{where}.cores", f"core {core} is already device {owner[core]}'s")
                )
            else:
                owner[core] = device.id
    return problems


def _placement_problems(
    where: str, model: ModelConfig, config: DuomoConfig
) -> list[tuple[str, str]]:
    """The model's devices exist, are of one kind, suit its backend, and have the threads it
    asks for."""
    devices = {d.id: d for d in config.devices}
    unknown = [d for d in model.device_ids if d not in devices]
    if unknown:
        return [(f"{where}.device", f"no device with id {unknown[0]} in 'devices'")]
    kinds = {devices[d].kind for d in model.device_ids}
    if len(kinds) > 1:
        return [(f"{where}.device", f"its devices are of different kinds {sorted(kinds)}; "
                 "one model runs on devices of one kind")]  # fmt: skip
    kind = kinds.pop()
    if model.backend == "acl" and kind != "ascend":
        return [
            (f"{where}.backend", f"the acl backend needs an ascend device, device "
             f"{model.device_ids[0]} is {kind!r}")
        ]  # fmt: skip
    if isinstance(model.intra_op_threads, int) and model.backend == "onnxruntime":
        for d in model.device_ids:
            budget = thread_budget(config, devices[d] if kind == "cpu" else None)
            if model.intra_op_threads > budget:
                return [(f"{where}.intra_op_threads",
                         f"{model.intra_op_threads} is above the thread budget of {budget} cores"
                         + (f" of device {d}" if devices[d].cores else ""))]  # fmt: skip
    return []


def _provider_problems(config: DuomoConfig) -> list[tuple[str, str]]:
    """Providers the installed onnxruntime lacks (importing it loads no model)."""
    ort_options = config.backends.onnxruntime
    if ort_options.allow_cpu_fallback or not any(m.backend == "onnxruntime" for m in config.models):
        return []
    import onnxruntime

    available = onnxruntime.get_available_providers()
    return [
        (
            f"backends.onnxruntime.providers[{i}]",
            f"{name} is not available in this onnxruntime (available: {available}); install the "
            "matching onnxruntime package or set allow_cpu_fallback: true",
        )
        for i, name in enumerate(ort_options.providers)
        if name not in available
    ]


def _resolve_param_paths(
    params: StrictModel, base: Path
) -> tuple[StrictModel, list[tuple[str, str]]]:
    """Executor params that are paths, made absolute against the config's folder and checked."""
    updates: dict[str, Path] = {}
    missing: list[tuple[str, str]] = []
    for name, value in params:
        if isinstance(value, Path):
            resolved = (base / value).resolve()
            updates[name] = resolved
            if not resolved.is_file():
                missing.append((name, f"file not found: {resolved}"))
    return params.model_copy(update=updates), missing
