"""numbanorm: Numba-accelerated LayerNorm, RMSNorm and GroupNorm, forward and backward.

NumPy arrays run on the parallel CPU kernels; CUDA arrays (numba, CuPy, PyTorch)
run on the GPU kernels.  The contract of every function here is the project's
API document; ``numbanorm.reference`` is the NumPy oracle the kernels are tested
against.
"""

import numba as _numba

if _numba.config.DISABLE_JIT:  # (the kernels' intrinsics have no Python form to fall back on)
    raise ImportError("numbanorm's kernels are compiled by Numba, which NUMBA_DISABLE_JIT=1 turns off: "
                      "unset NUMBA_DISABLE_JIT to use numbanorm")

from . import cpu  # noqa: E402
from ._dispatch import *  # noqa: F401,F403  (the table's functions, dispatching on the arrays' side)
from .layers import GroupNorm, LayerNorm, RMSNorm
from .operations import FUNCTIONS as _FUNCTIONS

__version__ = "0.1.0"

__all__ = [*_FUNCTIONS, "LayerNorm", "RMSNorm", "GroupNorm"]


def __getattr__(name):
    # numbanorm.cuda on its first use (numbanorm.cpu is there at once): its import of
    # numba-cuda is a cost a CPU-only process does not pay
    if name == "cuda":
        import importlib

        return importlib.import_module(".cuda", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
