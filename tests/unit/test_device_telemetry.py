"""Device telemetry: npu-smi's text read by key (310P with DDR memory, 910B with HBM), through a
real ``npu-smi`` executable on PATH that prints the documented format; the CPU's reading; and a
device with no runtime reporting nothing rather than zeros."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from duomo.supervisor.core.device_telemetry import (
    DeviceReading,
    DeviceTelemetry,
    NpuSmiProbe,
    chip_of,
    reading_from_npu_smi,
    visible_logic_id,
)
from tests.conftest import poll

pytestmark = pytest.mark.unit

COMMON_310P = """
        NPU ID                         : 0
        Chip Count                     : 1

        Chip ID                        : 0
        Memory Usage Rate(%)           : 25
        HBM Usage Rate(%)              : 0
        Aicore Usage Rate(%)           : 37
        Aicore Freq(MHZ)               : 1080
        Aicore Count                   : 8
        Temperature(C)                 : 46
        NPU Real-time Power(W)         : 13.1
"""
USAGES_310P = """
        NPU ID                         : 0
        Chip Count                     : 1

        Chip ID                        : 0
        Memory Capacity(MB)            : 21534
        Memory Usage Rate(%)           : 25
        Hugepages Total(page)          : 0
        Aicore Usage Rate(%)           : 37
        Aicpu Usage Rate(%)            : 0
        Memory Bandwidth Usage Rate(%) : 1
"""
USAGES_910B = """
        NPU ID                         : 2
        Chip Count                     : 1

        Chip ID                        : 0
        Memory Capacity(MB)            : 15039
        Memory Usage Rate(%)           : 6
        HBM Capacity(MB)               : 65536
        HBM Usage Rate(%)              : 50
        Aicore Usage Rate(%)           : 80
"""


def test_a_310p_reports_its_ddr_memory_utilisation_temperature_and_power() -> None:
    reading = reading_from_npu_smi(COMMON_310P, USAGES_310P)
    assert reading.total_bytes == 21534 * 2**20
    assert reading.used_bytes == int(21534 * 2**20 * 0.25)  # not the 0 % of HBM it has none of
    assert reading.utilization == pytest.approx(0.37)
    assert reading.temperature_c == 46 and reading.power_w == pytest.approx(13.1)


def test_a_910b_reports_its_hbm() -> None:
    reading = reading_from_npu_smi("", USAGES_910B)
    assert reading.total_bytes == 65536 * 2**20
    assert reading.used_bytes == 32768 * 2**20
    assert reading.utilization == pytest.approx(0.8)
    assert reading.temperature_c is None and reading.power_w is None  # absent, not zero


def test_unparseable_output_reports_nothing() -> None:
    assert reading_from_npu_smi("Error: device 7 not found", "") == DeviceReading()


MAPPING_DUO = """
        NPU ID                         Chip ID                        Chip Logic ID                  Chip Name
        1                              0                              2                              Ascend 310P3
        1                              1                              3                              Ascend 310P3
        1                              2                              -                              Mcu
"""  # noqa: E501 (as npu-smi prints it)


def test_acl_device_ids_map_to_a_card_and_its_chip(monkeypatch: pytest.MonkeyPatch) -> None:
    assert chip_of(MAPPING_DUO, 3) == (1, 1)  # the Duo card's second chip
    assert chip_of(MAPPING_DUO, 2) == (1, 0)
    assert chip_of(MAPPING_DUO, 7) is None
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    assert visible_logic_id(1) == 1
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2,3")
    assert visible_logic_id(1) == 3


def test_the_probe_samples_a_real_npu_smi_on_its_own_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "m.txt").write_text(MAPPING_DUO)
    (tmp_path / "common.txt").write_text(COMMON_310P)
    (tmp_path / "usages.txt").write_text(USAGES_310P)
    script = tmp_path / "npu-smi"
    script.write_text(  # answers only for the chip ACL's device 1 is (logic id 3: NPU 1, chip 1)
        "#!/bin/sh\n"
        '[ "$*" = "info -m" ] && exec cat "' + str(tmp_path) + '/m.txt"\n'
        '[ "$1 $2 $4 $5 $6 $7" = "info -t -i 1 -c 1" ] || { echo "bad: $*" >&2; exit 2; }\n'
        'cat "' + str(tmp_path) + '/$3.txt"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2,3")
    telemetry = DeviceTelemetry([(1, "ascend")])
    try:
        poll(lambda: telemetry.read(1).total_bytes is not None, timeout_s=10)  # its first sample
        reading = telemetry.read(1)
        assert reading.total_bytes == 21534 * 2**20 and reading.temperature_c == 46
    finally:
        telemetry.close()
    broken = NpuSmiProbe(0, command=str(tmp_path / "missing-npu-smi"))
    try:
        assert broken.read() == DeviceReading()
    finally:
        broken.close()


def test_the_cpu_reports_memory_and_this_process_cpu_seconds_and_nothing_it_cannot_know() -> None:
    telemetry = DeviceTelemetry([(0, "cpu"), (1, "ascend")])
    try:
        cpu = telemetry.read(0)
        assert cpu.total_bytes and cpu.total_bytes > 2**28
        assert set(cpu.cpu_seconds) == {"user", "system"} and cpu.cpu_seconds["user"] > 0
        assert cpu.utilization is None and cpu.temperature_c is None
        assert cpu.to_dict() == {}  # nothing but what ``status`` shows beside it
        if not any(Path(p, "npu-smi").exists() for p in os.environ["PATH"].split(os.pathsep)):
            assert telemetry.read(1) == DeviceReading()  # no npu-smi here: nothing, not zeros
        assert telemetry.read(9) == DeviceReading()  # not configured
    finally:
        telemetry.close()


def test_without_an_nvidia_driver_a_cuda_device_reports_nothing() -> None:
    telemetry = DeviceTelemetry([(0, "cuda")])
    try:
        if not Path("/dev/nvidiactl").exists():  # no driver here: NVML cannot start
            assert telemetry.read(0) == DeviceReading()
    finally:
        telemetry.close()


def test_nvml_readings_are_converted_and_a_failing_one_is_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NVML's own Python binding with its C calls answered here: no GPU on this machine."""
    from types import SimpleNamespace

    import pynvml

    from duomo.supervisor.core.device_telemetry import NvmlProbe

    calls: list[str] = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")  # device 1 is GPU-bbbb
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", lambda uuid: f"handle {uuid}")
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: calls.append("init"))
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: f"gpu{index}")
    handles: list[object] = []
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetMemoryInfo",
        lambda handle: handles.append(handle)
        or SimpleNamespace(total=80 * 2**30, used=20 * 2**30, free=60 * 2**30),
    )  # fmt: skip
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetUtilizationRates", lambda handle: SimpleNamespace(gpu=42, memory=7)
    )
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperature", lambda handle, sensor: 61)

    def no_power(handle: object) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", no_power)
    probe = NvmlProbe(1)
    reading = probe.read()
    probe.close()
    assert reading == DeviceReading(
        total_bytes=80 * 2**30, used_bytes=20 * 2**30, utilization=0.42, temperature_c=61.0,
        power_w=None,
    )  # fmt: skip
    assert calls == ["init", "shutdown"]
    assert handles == ["handle GPU-bbbb"]
