"""What this machine offers Duomo, checked the way a deploy engineer checks an Ascend host by hand.

Used by ``duomo check``. Every probe is read-only and bounded (``npu-smi`` gets a timeout); on a
machine without Ascend hardware the report says so and names what would be needed.

Probed: ``npu-smi`` and the cards it lists; driver and CANN versions (``version.info`` /
``version.cfg`` under the usual install roots); whether ``import acl`` works, and then its
version, the SoC name, the device count and each device's memory; the ONNX Runtime providers.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

ASCEND_ROOTS = (
    os.environ.get("ASCEND_HOME_PATH", ""),
    os.environ.get("ASCEND_TOOLKIT_HOME", ""),
    "/usr/local/Ascend/ascend-toolkit/latest",
    "/usr/local/Ascend/nnrt/latest",
    "/usr/local/Ascend/cann",
)
DRIVER_VERSION = Path("/usr/local/Ascend/driver/version.info")


def _version_file(path: Path) -> str | None:
    """The ``Version=`` (or ``version=``) line of a CANN/driver version file."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"^\s*[Vv]ersion\s*=\s*(\S+)", text, re.MULTILINE)
    return match.group(1) if match else text.strip().splitlines()[0] if text.strip() else None


def _cann_version() -> tuple[str | None, str | None]:
    for root in filter(None, ASCEND_ROOTS):
        base = Path(root)
        for candidate in (base / "version.cfg", *sorted(base.glob("*/version.info"))):
            version = _version_file(candidate)
            if version:
                return version, str(candidate)
    return None, None


def _npu_smi() -> dict[str, Any]:
    exe = shutil.which("npu-smi")
    if exe is None:
        return {"present": False}
    try:
        out = subprocess.run(
            [exe, "info", "-l"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"present": True, "error": str(err)}
    cards = re.findall(r"NPU ID\s*:\s*(\d+)", out)
    return {"present": True, "path": exe, "cards": [int(c) for c in cards]}


def _acl() -> dict[str, Any]:
    try:
        import acl  # type: ignore[import-not-found]
    except ImportError as err:
        return {"importable": False, "error": str(err)}
    report: dict[str, Any] = {"importable": True}
    try:
        major, minor, patch, ret = acl.get_version()
        if ret == 0:
            report["version"] = f"{major}.{minor}.{patch}"
        ret = acl.init()
        if ret not in (0, 100002):
            report["error"] = f"acl.init returned {ret}: {acl.get_recent_err_msg()}"
            return report
        report["soc"] = acl.get_soc_name()
        count, ret = acl.rt.get_device_count()
        report["devices"] = count if ret == 0 else 0
        memory = []
        for device in range(report["devices"]):
            if acl.rt.set_device(device) == 0:
                free, total, ret = acl.rt.get_mem_info(1)  # ACL_HBM_MEM (DDR on 310P)
                memory.append({"device": device, "free_mb": free >> 20, "total_mb": total >> 20})
                acl.rt.reset_device(device)
        report["memory"] = memory
        acl.finalize()
    except Exception as err:  # a broken install must still produce a report
        report["error"] = f"{type(err).__name__}: {err}"
    return report


def _ort_providers() -> list[str] | str:
    try:
        import onnxruntime
    except ImportError as err:
        return f"onnxruntime not importable: {err}"
    return list(onnxruntime.get_available_providers())


def probe() -> dict[str, Any]:
    """The environment report, with a verdict and what to fix."""
    cann, cann_file = _cann_version()
    report: dict[str, Any] = {
        "npu_smi": _npu_smi(),
        "driver_version": _version_file(DRIVER_VERSION),
        "cann_version": cann,
        "cann_version_file": cann_file,
        "acl": _acl(),
        "onnxruntime_providers": _ort_providers(),
    }
    report["verdict"], report["fix"] = _verdict(report)
    return report


def _verdict(report: dict[str, Any]) -> tuple[str, list[str]]:
    acl, smi = report["acl"], report["npu_smi"]
    fix: list[str] = []
    if not smi.get("present") and not acl.get("importable"):
        return "no Ascend runtime: the onnxruntime backend (CPU) is what this machine runs", []
    if not smi.get("present"):
        fix.append("npu-smi not found: install the Ascend driver (it ships npu-smi)")
    elif not smi.get("cards"):
        fix.append("npu-smi lists no cards: check the driver and /dev/davinci* in the container")
    if report["cann_version"] is None:
        fix.append("no CANN version file: install the CANN toolkit or nnrt")
    if not acl.get("importable"):
        fix.append("`import acl` fails: source <cann>/set_env.sh in the supervisor's environment")
    elif "error" in acl:
        fix.append(f"pyACL is present but failed: {acl['error']}")
    elif not acl.get("devices"):
        fix.append("pyACL sees no device: check ASCEND_RT_VISIBLE_DEVICES and the driver")
    if fix:
        return "Ascend runtime incomplete", fix
    return f"Ascend ready: {acl.get('soc')} × {acl.get('devices')}", []


def format_report(report: dict[str, Any]) -> str:
    smi, acl = report["npu_smi"], report["acl"]
    cards = f"cards {smi.get('cards')}" if smi.get("present") else "not found"
    lines = [
        f"  npu-smi:      {cards}",
        f"  driver:       {report['driver_version'] or 'not found'}",
        f"  CANN:         {report['cann_version'] or 'not found'}",
        "  pyACL:        "
        + (
            f"{acl.get('version', '?')}, SoC {acl.get('soc', '?')}, {acl.get('devices', 0)} "
            f"device(s) {acl.get('memory', '')}"
            if acl.get("importable")
            else "not importable"
        ),
        f"  onnxruntime:  {report['onnxruntime_providers']}",
        f"  verdict:      {report['verdict']}",
    ]
    lines += [f"  fix:          {item}" for item in report["fix"]]
    return "\n".join(lines)
