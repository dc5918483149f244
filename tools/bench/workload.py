"""The workload file of ``duomo bench``: which models and images, how many producers, closed or
open loop, warm-up, how long and how many, which modes, how many interleaved rounds.

Loaded by ``tools.bench.run``; the shipped ones are ``configs/bench/*.yaml``. Paths are relative
to the workload file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from duomo.worker.config_model import StrictModel

Mode = Literal[
    "engine", "duomo", "duomo-scraped", "duomo-http", "duomo-grpc", "per-model",
    "per-model-tuned", "triton", "mosec",
]  # fmt: skip
ALL_MODES: tuple[Mode, ...] = (
    "engine", "duomo", "duomo-scraped", "duomo-http", "duomo-grpc", "per-model",
    "per-model-tuned", "triton", "mosec",
)  # fmt: skip
PEER_MODES: tuple[Mode, ...] = ("triton", "mosec")
# Duomo through its KServe v2 gateway (a supervisor and one gateway worker): the mode's transport
GATEWAY_MODES: dict[str, str] = {"duomo-http": "http", "duomo-grpc": "grpc"}


class ModelLoad(StrictModel):
    """One model of the mix: the images its producers cycle through, and how hard they push."""

    name: str
    images: list[Path] = Field(min_length=1)
    producers: int = Field(default=2, ge=1, le=64)  # client processes, one request in flight each
    rate_per_s: float | None = Field(default=None, gt=0)  # open loop: this model's arrival rate


class Workload(StrictModel):
    config: Path  # the supervisor config the models and their settings come from
    models: list[ModelLoad] = Field(min_length=1)
    modes: list[Mode] = Field(default_factory=lambda: list(ALL_MODES), min_length=1)
    loop: Literal["closed", "open"] = "closed"
    rounds: int = Field(default=2, ge=1)  # the modes run A B C … then … C B A, and so on
    warmup_s: float = Field(default=5.0, ge=0)
    duration_s: float = Field(default=20.0, gt=0)  # the measured window, bounded by time …
    max_requests: int = Field(default=1_000_000, ge=1)  # … and by count, per producer
    alone_s: float = Field(default=8.0, gt=0)  # the weights: each model alone, one thread
    overhead_s: float = Field(default=5.0, ge=0)  # one client, one model at a time (0: skip)
    overhead_models: list[str] = Field(default_factory=lambda: ["classify"])
    idle_s: float = Field(default=5.0, ge=0)  # the idle supervisor's CPU (0: skip)
    # ``duomo-scraped``: ``duomo`` with its /metrics scraped this often (what a scrape costs)
    scrape_every_s: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> Workload:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"a model appears twice in models: {names}")
        unknown = [m for m in self.overhead_models if m not in names]
        if unknown:
            raise ValueError(f"overhead_models {unknown} are not in models {names}")
        if self.loop == "open" and any(m.rate_per_s is None for m in self.models):
            raise ValueError("loop: open needs rate_per_s on every model")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"a mode appears twice in modes: {self.modes}")
        return self


def load_workload(path: Path, **overrides: object) -> Workload:
    """Parse and validate ``path`` (with ``overrides`` of top-level fields); relative paths
    become absolute. ValueError names the field."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a workload file is a mapping (config, models, modes, ...)")
    base = path.resolve().parent
    raw.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(raw.get("config"), str):
        raw["config"] = base / raw["config"]
    for model in raw.get("models") or []:
        if isinstance(model, dict) and isinstance(model.get("images"), list):
            model["images"] = [base / image for image in model["images"]]
    try:
        return Workload.model_validate(raw)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in err.errors()
        )
        raise ValueError(f"{path}: {problems}") from None
