"""The registry: the served models by name, built from the config, and a reload's difference
and swap (DESIGN.md §4).

Owned by the ``Engine``, which calls it under its lifecycle lock: ``build`` makes a
``ServedModel`` from a config entry (its backend created once per kind and shared, its
instances placed by ``supervisor.core.placement``), recording what it was built from; ``diff``
compares a new config with what is served; ``swap`` puts the fresh models in and takes the
replaced and removed out; ``retire`` lets the old ones finish. The engine loads, in between,
what the new config needs loaded (the budgeted load is the engine's).

Invariants: ``models`` is one dict for the process's life, changed only by ``build``'s caller
through ``add`` and by ``swap`` (the memory ledger, the background loads, the watchdog and the
server read it, taking a copy of its items first); each model's signature is what its model
was built from, so a reload rebuilds exactly the models whose entry, executor or files changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from duomo.ipc.errors import DuomoError, InvalidArgumentError, NotFoundError, echoed
from duomo.ipc.host_memory import trim_heap
from duomo.supervisor.config import LoadedConfig, ResolvedModel
from duomo.supervisor.core.placement import Placements
from duomo.worker.backends import Backend, create_backend
from duomo.worker.batcher import IdleReader
from duomo.worker.model_spec import SERVING, ModelSpec
from duomo.worker.model_worker import Activity
from duomo.worker.served_model import ServedModel

ModelHook = Callable[[ServedModel], None]


@dataclass(frozen=True)
class ReloadDiff:
    """What a reload changes, by model name."""

    added: list[str]
    removed: list[str]
    changed: list[str]  # rebuilt: their entry, executor or files changed (or named by ``only``)


class ModelRegistry:
    """The served models by name: builds a ``ServedModel`` from a config entry, finds a reload's
    difference, swaps the models and retires the old ones."""

    def __init__(self, placements: Placements, idle_reader: IdleReader, activity: Activity) -> None:
        self.models: dict[str, ServedModel] = {}
        self._placements = placements
        self._idle_reader = idle_reader  # every batcher's (the engine's idle spin)
        self._activity = activity  # the process's instances at work
        self._backends: dict[str, Backend] = {}
        self._signatures: dict[str, tuple[Any, ...]] = {}  # name -> what its model was built from

    def model(self, name: str) -> ServedModel:
        try:
            return self.models[name]
        except KeyError:
            raise NotFoundError(
                f"no model named {echoed(name)} (serving: {sorted(self.models)})"
            ) from None

    # -- building -----------------------------------------------------------------------

    def build(
        self,
        name: str,
        loaded: LoadedConfig,
        on_demand: ModelHook | None,
        on_request: ModelHook | None,
        unloaded_by_operator: bool = False,
    ) -> ServedModel:
        """A new ``ServedModel`` for ``loaded``'s entry ``name`` (not yet in ``models``);
        ``on_demand`` and ``on_request`` as ``ServedModel`` takes them."""
        resolved = loaded.models[name]
        cfg = resolved.config
        backend = self._backends.get(cfg.backend)
        if backend is None:
            backend = create_backend(cfg.backend, getattr(loaded.config.backends, cfg.backend))
            self._backends[cfg.backend] = backend
        placements = self._placements
        spec = ModelSpec(
            name=name,
            task=cfg.task,
            executor=resolved.executor,
            params=resolved.params,
            files=resolved.files,
            instances=cfg.instances,
            max_batch=cfg.max_batch,
            max_delay_s=0.0 if cfg.max_delay_ms == "auto" else cfg.max_delay_ms / 1e3,
            adaptive_delay=cfg.max_delay_ms == "auto",
            queue_size=cfg.queue_size,
            priority=cfg.priority,
            priority_aging_per_s=cfg.priority_aging_per_s,
            compute_weight=cfg.compute_weight,
            share_weights=cfg.share_weights,
            health=cfg.health,
            placements=tuple(placements.placement(name, cfg, i) for i in range(cfg.instances)),
        )
        self._signatures[name] = _signature(resolved)
        return ServedModel(
            spec,
            backend,
            {d: placements.gate_for(cfg.backend, d) for d in cfg.device_ids},
            on_demand=on_demand,
            idle_reader=self._idle_reader,
            activity=self._activity,
            on_request=on_request,
            unloaded_by_operator=unloaded_by_operator,
        )

    def add(self, model: ServedModel) -> None:
        self.models[model.spec.name] = model

    # -- reload ---------------------------------------------------------------------------

    def diff(self, running: LoadedConfig, new: LoadedConfig, only: str | None) -> ReloadDiff:
        """What applying ``new`` over ``running`` changes (with ``only``, just that model, even
        if its entry did not change: its file may have). InvalidArgumentError if the devices
        changed, NotFoundError for an ``only`` neither config nor the registry has."""
        if _device_layout(new) != _device_layout(running):
            raise InvalidArgumentError(
                "the devices changed (ids, kinds, cores, runs_at_once or overdraft): they are "
                "set at start; restart the supervisor to change them (a memory_budget_mb "
                "change reloads)"
            )
        if only is not None and only not in new.models and only not in self.models:
            raise NotFoundError(f"no model named {echoed(only)} in {new.path} or being served")
        names = list(new.models)
        added = [n for n in names if n not in self.models]
        removed = [n for n in self.models if n not in new.models]
        changed = [
            n
            for n in names
            if n in self.models and (n == only or _signature(new.models[n]) != self._signatures[n])
        ]
        if only is not None:
            added, removed, changed = (
                [n for n in group if n == only] for group in (added, removed, changed)
            )
        return ReloadDiff(added, removed, changed)

    def swap(self, fresh: Mapping[str, ServedModel], removed: Iterable[str]) -> None:
        """Put the ``fresh`` models in (replacing those of their names) and take ``removed``
        out; the models taken out are the caller's to ``retire``."""
        self.models.update(fresh)
        for name in removed:
            del self.models[name]
            self._signatures.pop(name, None)

    def retire(self, old_models: Iterable[ServedModel]) -> None:
        """Let models a reload took out finish what they accepted (outside the lifecycle lock:
        others may load meanwhile); requests waiting for one unloaded go to its replacement."""
        for old in old_models:
            replacement = self.models.get(old.spec.name)
            if replacement is not None and old.state not in SERVING and old.pending:
                _hand_over_queue(old, replacement)  # it has no workers to finish them itself
            old.stop()

    # -- the backends ---------------------------------------------------------------------

    def release_memory(self) -> None:
        """After models went away: backends hand back what their shared pools no longer use,
        then the C heap is trimmed."""
        for backend in list(self._backends.values()):
            backend.release_free_memory()
        trim_heap()

    def close_backends(self) -> None:
        for backend in self._backends.values():
            backend.close()
        self._backends.clear()


def _signature(resolved: ResolvedModel) -> tuple[Any, ...]:
    """What a model was built from: its entry, its executor class and its files' sizes and
    times (a data file's, a gallery's, not: it serves its changes itself). A user's executor
    module whose file changed is imported again by the config loader (``resolve_executor``),
    so its class is a new object and the model a changed one."""

    def stamp(path: Path) -> tuple[int, int]:
        if resolved.executor.data_file:
            return (0, 0)
        try:
            st = path.stat()
        except OSError:
            return (0, 0)
        return (st.st_size, st.st_mtime_ns)

    files = tuple(sorted((role, str(p), stamp(p)) for role, p in resolved.files.items()))
    return (resolved.config, resolved.executor, files)


def _device_layout(loaded: LoadedConfig) -> list[dict[str, Any]]:
    """What of the devices is fixed at start: all but their memory budgets."""
    return [d.model_dump(exclude={"memory_budget_mb"}) for d in loaded.config.devices]


def _hand_over_queue(old: ServedModel, new: ServedModel) -> None:
    """Requests waiting for an unloaded model that a reload replaced go to its replacement when
    their payloads fit it (same slot layout); otherwise ``stop`` answers them UNAVAILABLE."""
    if not (old.layout_known and new.layout_known and old.slot_spec() == new.slot_spec()):
        return
    for request in old.batcher.drain():
        try:  # answered through the old request: its client's callback, its bookkeeping
            new.submit(request.payload, request.deliver, request.priority, request.deadline_s)
        except DuomoError as err:
            request.complete(error=err)
