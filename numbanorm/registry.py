"""One registry of implementations, shared by the tests, the benchmarks and ``numbanorm check``.

Every entry exposes every function of the table of operations
(``numbanorm.operations.FUNCTIONS``) with the public signatures:
``oracle`` is the NumPy reference (float64 results), ``cpu`` the parallel Numba
kernels, ``cuda`` the GPU kernels (on host arrays, copied in and out; under
``NUMBA_ENABLE_CUDASIM=1`` they run in numba's CUDA simulator).
"""

import importlib

from .operations import FUNCTIONS

IMPLEMENTATIONS = {
    "oracle": "numbanorm.reference",
    "cpu": "numbanorm.cpu",
    "cuda": "numbanorm.cuda",
}


def get(name):
    """The implementation module registered under ``name``."""
    return importlib.import_module(IMPLEMENTATIONS[name])


def usable(name):
    """``(True, '')`` if ``name`` can run here, else ``(False, why)``."""
    try:
        mod = get(name)
    except Exception as e:  # numba-cuda missing, broken driver, ...
        return False, f"{type(e).__name__}: {e}"
    missing = [f for f in FUNCTIONS if not callable(getattr(mod, f, None))]
    if missing:
        return False, f"{IMPLEMENTATIONS[name]} lacks {', '.join(missing)} of numbanorm.operations"
    check = getattr(mod, "is_available", None)
    if check is not None and not check():
        return False, getattr(mod, "why_unavailable", lambda: "not available")()
    return True, ""


def available(include_oracle=True):
    """Names of the implementations that can run on this machine."""
    return [n for n in IMPLEMENTATIONS if (include_oracle or n != "oracle") and usable(n)[0]]
