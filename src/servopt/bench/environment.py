"""The environment a figure was measured in: CPU, cores, threads, library versions."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from functools import lru_cache
from importlib import metadata

LIBRARIES = ("numpy", "onnx", "onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino", "torch", "openvino", "nncf")


@lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def gpu_present() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return sorted(flags & {"avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8"})
    except OSError:
        pass
    return []


def library_versions() -> dict[str, str]:
    out = {}
    for lib in LIBRARIES:
        try:
            out[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            continue
    return out


def environment(session_info: dict | None = None) -> dict:
    env = {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gpu": gpu_present(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "libraries": library_versions(),
    }
    if session_info:
        env["session"] = session_info
    return env


def machine_label() -> str:
    return f"{cpu_model()} ({os.cpu_count()} cores)"
