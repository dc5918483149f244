"""Where models compute: a thread plan and a compute gate per pool of CPU cores, a gate per
accelerator, and the device, threads and cores of each model instance.

Owned by the ``Engine``, which builds it at start (``Placements.start``), plans again with the
same budgets on reload (``replan``), and asks it for each instance's ``Placement`` and each
model's gates when it builds a ``ServedModel``; the benchmark's in-process modes use
``plan_for``.

A *pool* of cores is a cpu device with ``cores`` of its own (its id), or the host's shared pool
(``HOST``): every other cpu device and the host-side threads of accelerator models, pinned to
the cores no device holds once any device holds some (``supervisor.config.pool_cores``). A model
lists its devices; instance *i* runs on the (*i* mod *n*)-th (``ModelConfig.instance_device``).
ONNX Runtime's runs hold their pool's gate (tokens: the pool's thread budget); the ACL
backend's hold their device's (tokens: ``runs_at_once``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from duomo.ipc.errors import NotFoundError
from duomo.supervisor.config import (
    DeviceConfig,
    LoadedConfig,
    ModelConfig,
    pool_cores,
    thread_budget,
)
from duomo.worker.model_spec import Placement
from duomo.worker.thread_budget import ComputeGate, InstanceDemand, ThreadPlan, plan_threads

Pool = int | None  # a pool of cores: a cpu device's own (its id), or the host's shared one
HOST: Pool = None


def pool_of(device: DeviceConfig) -> Pool:
    """The pool of cores a device's ONNX Runtime threads come from: its own if it has cores,
    else the host's."""
    return device.id if device.kind == "cpu" and device.cores is not None else HOST


def plan_for(
    loaded: LoadedConfig, names: list[str], budgets: Mapping[Pool, int] | None = None
) -> dict[Pool, ThreadPlan]:
    """The thread plan of each pool of cores for ``names`` of ``loaded``: a pool's budget
    (``budgets``, else ``supervisor.config.thread_budget``) split over the instances placed
    there of the models that compute on the CPU."""
    for name in names:
        if name not in loaded.models:
            raise NotFoundError(
                f"no model named {name!r} in {loaded.path} (have: {sorted(loaded.models)})"
            )
    config = loaded.config
    devices = {d.id: d for d in config.devices}
    pools: dict[Pool, list[InstanceDemand]] = {HOST: []}
    pools.update((d.id, []) for d in config.devices if pool_of(d) is not HOST)
    for name in names:
        cfg = loaded.models[name].config
        if cfg.backend != "onnxruntime":  # CPU threads for the models computing on the CPU
            continue
        placed = Counter(pool_of(devices[cfg.instance_device(i)]) for i in range(cfg.instances))
        for pool, instances in placed.items():
            pools[pool].append(InstanceDemand(name, instances, cfg.intra_op_threads))
    budgets = budgets or {}

    def budget(pool: Pool) -> int:
        return budgets.get(pool) or thread_budget(config, None if pool is None else devices[pool])

    return {pool: plan_threads(demands, budget(pool)) for pool, demands in pools.items()}


class Placements:
    """The engine's plans and gates; ``loaded`` is the config they follow (replaced on
    reload: devices are fixed at start, so only the plans change)."""

    def __init__(self, loaded: LoadedConfig) -> None:
        self.loaded = loaded
        self.plans: dict[Pool, ThreadPlan] = {HOST: ThreadPlan(1, {}, {})}
        self.cpu_gates: dict[Pool, ComputeGate] = {HOST: ComputeGate(1)}
        self.device_gates: dict[int, ComputeGate] = {}  # an accelerator's, for the ACL backend

    def start(self, names: list[str]) -> None:
        """Plan every pool for ``names`` and make the gates."""
        self.plans = plan_for(self.loaded, names)
        self.cpu_gates = {
            pool: ComputeGate(plan.budget, self._cpu_overdraft(pool))
            for pool, plan in self.plans.items()
        }
        self.device_gates = {
            d.id: ComputeGate(d.runs_at_once or 1, d.overdraft)
            for d in self.loaded.config.devices
            if d.kind != "cpu"
        }

    def replan(self, loaded: LoadedConfig, names: list[str]) -> dict[Pool, ThreadPlan]:
        """The plans for a new config's ``names``, with the budgets of start (the gates stay);
        the caller sets them (``plans``) once the reload holds."""
        return plan_for(loaded, names, {p: plan.budget for p, plan in self.plans.items()})

    def placement(self, name: str, cfg: ModelConfig, index: int) -> Placement:
        """Instance ``index``'s device (round-robin over the model's), the intra-op threads its
        pool's plan gives it, and the cores its threads are pinned to (``pool_cores``)."""
        device = self.loaded.config.device(cfg.instance_device(index))
        pool = pool_of(device)
        threads = self.plans.get(pool, self.plans[HOST]).threads_per_instance.get(name, 1)
        cores = pool_cores(self.loaded.config, device if pool is not HOST else None)
        return Placement(device.id, threads, cores)

    def gate_for(self, backend: str, device: int) -> ComputeGate:
        """ONNX Runtime's runs share their pool of cores' gate (its thread budget); the ACL
        backend's share their device's."""
        if backend == "acl" and device in self.device_gates:
            return self.device_gates[device]
        found = self.loaded.config.device(device)
        return self.cpu_gates.get(pool_of(found), self.cpu_gates[HOST])

    def gates(self) -> list[ComputeGate]:
        return [*self.cpu_gates.values(), *self.device_gates.values()]

    def thread_budget_of(self, device: DeviceConfig) -> int | None:
        """A cpu device's thread budget (its pool's), None for an accelerator."""
        plan = self.plans.get(pool_of(device)) if device.kind == "cpu" else None
        return plan.budget if plan is not None else None

    @property
    def total_budget(self) -> int:
        return sum(plan.budget for plan in self.plans.values())

    def _cpu_overdraft(self, pool: Pool) -> int:
        devices = self.loaded.config.devices
        return next((d.overdraft for d in devices if d.kind == "cpu" and pool_of(d) == pool), 1)
