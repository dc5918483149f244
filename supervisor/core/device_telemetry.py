"""What each configured device reports of itself: total memory, utilisation, temperature, power
and, for the CPU, this process's CPU seconds. A value the runtime does not report is absent
(``None``), never zero.

Owned by the ``Engine`` (one ``DeviceTelemetry`` for the config's devices, closed with it); read
by ``status`` and by the metrics scrape (``supervisor.operators.metrics``), neither of which may
wait for a device:

- ``cpu``: psutil (the machine's memory, this process's user and system CPU seconds);
- ``cuda``: NVML through ``nvidia-ml-py``, read when asked (each call takes microseconds);
- ``ascend``: ``npu-smi info -t common`` and ``-t usages`` for the chip that ACL's device id
  names (``npu-smi info -m`` maps it), run by a sampler thread every ``NPU_SMI_PERIOD_S`` (it
  takes tens of milliseconds and the driver rate-limits it); a read returns the last sample.
  Parsed by key, as the driver's documentation lists the keys; unconfirmed on a card here.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import psutil
import structlog

log = structlog.get_logger("duomo.telemetry")
NPU_SMI_PERIOD_S = 5.0
NPU_SMI_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class DeviceReading:
    """One device's self-report; ``None`` where it reports nothing."""

    total_bytes: int | None = None
    used_bytes: int | None = None  # by every process on the device, as its runtime sees it
    utilization: float | None = None  # 0..1, its compute units busy
    temperature_c: float | None = None
    power_w: float | None = None
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # mode -> seconds (cpu only)

    def to_dict(self) -> dict[str, Any]:
        """The fields reported, for ``status`` (``total_bytes`` is shown beside ``used_bytes``)."""
        shown = {
            "utilization": self.utilization,
            "temperature_c": self.temperature_c,
            "power_w": self.power_w,
            "runtime_used_bytes": self.used_bytes,
        }
        return {k: v for k, v in shown.items() if v is not None}


class Probe(Protocol):
    """One device's telemetry source: ``read`` returns a ``DeviceReading`` without waiting for
    the device; ``close`` lets go of it."""

    def read(self) -> DeviceReading: ...

    def close(self) -> None: ...


class CpuProbe:
    """The cpu device through psutil: the machine's memory and this process's user and system CPU
    seconds."""

    def __init__(self) -> None:
        self._process = psutil.Process()

    def read(self) -> DeviceReading:
        times = self._process.cpu_times()
        return DeviceReading(
            total_bytes=psutil.virtual_memory().total,
            cpu_seconds={"user": times.user, "system": times.system},
        )

    def close(self) -> None:
        pass


class NvmlProbe:
    """One NVIDIA GPU through NVML; every reading it cannot take is left out."""

    def __init__(self, index: int) -> None:
        import pynvml  # nvidia-ml-py; fails without the driver's libnvidia-ml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = self._handle_for(index)

    def _handle_for(self, index: int) -> Any:
        """NVML's handle for CUDA's device ``index``: the ``index``-th entry of
        ``CUDA_VISIBLE_DEVICES`` when it is set (an NVML index or a ``GPU-…`` UUID), else
        NVML's own index. NVML numbers GPUs in PCI bus order; CUDA does too with
        ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (docs/operations.md says to set it)."""
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
        visible = [v for v in visible if v]
        if not visible:
            return self._nvml.nvmlDeviceGetHandleByIndex(index)
        chosen = visible[index]  # IndexError: the config names a device CUDA cannot see
        if chosen.isdigit():
            return self._nvml.nvmlDeviceGetHandleByIndex(int(chosen))
        return self._nvml.nvmlDeviceGetHandleByUUID(chosen)

    def _try(self, read: Callable[[Any], Any]) -> Any:
        try:
            return read(self._handle)
        except self._nvml.NVMLError:
            return None

    def read(self) -> DeviceReading:
        nvml = self._nvml
        memory = self._try(nvml.nvmlDeviceGetMemoryInfo)
        rates = self._try(nvml.nvmlDeviceGetUtilizationRates)
        temperature = self._try(
            lambda handle: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
        )
        milliwatts = self._try(nvml.nvmlDeviceGetPowerUsage)
        return DeviceReading(
            total_bytes=int(memory.total) if memory is not None else None,
            used_bytes=int(memory.used) if memory is not None else None,
            utilization=rates.gpu / 100 if rates is not None else None,
            temperature_c=float(temperature) if temperature is not None else None,
            power_w=milliwatts / 1000 if milliwatts is not None else None,
        )

    def close(self) -> None:
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


def parse_npu_smi(text: str) -> dict[str, str]:
    """``Key(unit) : value`` lines of ``npu-smi info -t …`` as a dict (the first chip's values:
    a later repeat of a key is ignored)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            found.setdefault(" ".join(key.split()).lower(), value.strip())
    return found


def _number(fields: dict[str, str], *patterns: str) -> float | None:
    """The first field whose key matches one of ``patterns`` (in order) and holds a number."""
    for pattern in patterns:
        for key, value in fields.items():
            match = re.match(r"-?\d+(\.\d+)?", value)
            if re.fullmatch(pattern, key) and match:
                return float(match.group())
    return None


def reading_from_npu_smi(common: str, usages: str) -> DeviceReading:
    """A reading from the text of ``npu-smi info -t common`` and ``-t usages`` for one NPU.
    HBM parts (910B) report HBM capacity and usage, the others DDR memory."""
    c, u = parse_npu_smi(common), parse_npu_smi(usages)
    both = {**u, **c}
    kind = "hbm" if _number(u, r"hbm capacity\(mb\)") is not None else "memory"
    total_mb = _number(u, rf"{kind} capacity\(mb\)")
    rate = _number(both, rf"{kind} usage rate\(%\)")
    aicore = _number(both, r"aicore usage rate\(%\)", r"ai ?core\(%\)")
    return DeviceReading(
        total_bytes=int(total_mb * 2**20) if total_mb is not None else None,
        used_bytes=int(total_mb * 2**20 * rate / 100) if total_mb and rate is not None else None,
        utilization=aicore / 100 if aicore is not None else None,
        temperature_c=_number(c, r"temperature\(c\)", r"npu temperature\(c\)"),
        power_w=_number(
            c, r"(npu )?real-time power\(w\)", r"power\(w\)", r"power dissipation\(w\)"
        ),
    )


def chip_of(mapping: str, logic_id: int) -> tuple[int, int] | None:
    """(NPU id, chip id) of the chip whose logic id is ``logic_id``, from the table that
    ``npu-smi info -m`` prints (``NPU ID  Chip ID  Chip Logic ID  Chip Name`` rows; rows
    without a logic id, such as an MCU's, are skipped)."""
    for line in mapping.splitlines():
        fields = line.split()
        digits = len(fields) >= 3 and all(f.isdigit() for f in fields[:3])
        if digits and int(fields[2]) == logic_id:
            return int(fields[0]), int(fields[1])
    return None


def visible_logic_id(device: int) -> int:
    """The chip logic id of ACL's device ``device``: the ``device``-th entry of
    ``ASCEND_RT_VISIBLE_DEVICES`` when it is set, else ``device`` itself."""
    visible = [v.strip() for v in os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "").split(",")]
    visible = [v for v in visible if v.isdigit()]
    return int(visible[device]) if visible else device


class NpuSmiProbe:
    """One Ascend chip through ``npu-smi``, sampled on its own thread. ACL's device id is a
    logic id; ``npu-smi`` takes the card's NPU id and the chip's id on it (two chips on an
    Atlas 300I Duo), mapped once through ``npu-smi info -m``."""

    def __init__(self, device: int, command: str = "npu-smi") -> None:
        self._command = command
        self._device = device
        self._last = DeviceReading()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="duomo-npu-smi", daemon=True)
        self._thread.start()

    def _run(self, *args: str) -> str:
        done = subprocess.run(
            [self._command, "info", *args], capture_output=True, text=True,
            timeout=NPU_SMI_TIMEOUT_S,
        )  # fmt: skip
        return done.stdout if done.returncode == 0 else ""

    def _sample(self) -> None:
        chip: tuple[int, int] | None = None
        while True:
            try:
                chip = chip or chip_of(self._run("-m"), visible_logic_id(self._device))
                if chip is None:
                    self._last = DeviceReading()
                else:
                    where = ("-i", str(chip[0]), "-c", str(chip[1]))
                    common, usages = (
                        self._run("-t", "common", *where),
                        self._run("-t", "usages", *where),
                    )
                    self._last = reading_from_npu_smi(common, usages)
            except (OSError, subprocess.SubprocessError, IndexError) as err:
                log.warning("npu-smi gave no reading", device=self._device, error=str(err))
                self._last = DeviceReading()
            if self._stop.wait(NPU_SMI_PERIOD_S):
                return

    def read(self) -> DeviceReading:
        return self._last

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * NPU_SMI_TIMEOUT_S + 1)


def open_probe(kind: str, index: int) -> Probe | None:
    """The probe for one device, or None (logged) when its runtime reports nothing here."""
    try:
        if kind == "cpu":
            return CpuProbe()
        if kind == "cuda":
            return NvmlProbe(index)
        if kind == "ascend" and shutil.which("npu-smi"):
            return NpuSmiProbe(index)
    except Exception as err:  # no driver, no library: the device reports nothing
        log.info("no telemetry for this device", kind=kind, device=index, error=str(err))
    return None


class DeviceTelemetry:
    """The probes of the configured devices, by device id."""

    def __init__(self, devices: Iterable[tuple[int, str]]) -> None:
        self._probes = {id_: open_probe(kind, id_) for id_, kind in devices}

    def read(self, device: int) -> DeviceReading:
        probe = self._probes.get(device)
        if probe is None:
            return DeviceReading()
        try:
            return probe.read()
        except Exception as err:  # a reading must never fail a scrape or a status
            log.warning("device reading failed", device=device, error=str(err))
            return DeviceReading()

    def close(self) -> None:
        for probe in self._probes.values():
            if probe is not None:
                probe.close()
