"""What this machine is: its CPU, memory and GPU, the versions of numbanorm and of what it
runs on, the load average, and whether torch is installed.

``numbanorm info`` and ``numbanorm bench`` print it, and the repository's benchmark suite
writes it into every results file.  numba.cuda and torch are imported by the functions
that need them, when they are called.
"""

from __future__ import annotations

import os
import platform

import numpy as np


def torch_or_none():
    """``torch`` if it is installed, else None (never required)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def cuda_simulated():
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def gpu_status():
    """``(usable, description)`` of the registry's 'cuda' implementation on this machine."""
    from . import registry

    if "cuda" not in registry.IMPLEMENTATIONS:
        return False, "no 'cuda' implementation registered"
    ok, why = registry.usable("cuda")
    if not ok:
        return False, why
    if cuda_simulated():
        return True, "numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1): correct but not fast"
    name = gpu_name()
    return (True, name) if name else (False, "numba.cuda finds no CUDA device")


def gpu_name():
    """Name of the current CUDA device, or None (never raises, never starts the simulator)."""
    if cuda_simulated():
        return None
    try:
        from numba import cuda

        if not cuda.is_available():
            return None
        name = cuda.get_current_device().name
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return None


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mem_total_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine_info(include_gpu=True):
    mem = mem_total_bytes()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "mem_gib": round(mem / 2**30, 1) if mem else None,
        "gpu": gpu_name() if include_gpu else None,
        "platform": platform.platform(),
    }


def _dist_version(name):
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def versions():
    import numba

    from . import __version__

    torch = torch_or_none()
    return {
        "numbanorm": __version__,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "numba-cuda": _dist_version("numba-cuda"),
        "torch": torch.__version__ if torch is not None else None,
        "python": platform.python_version(),
    }


def loadavg():
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):  # (Windows has no load average)
        return None
