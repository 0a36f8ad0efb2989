"""numbanorm's functions pinned to the GPU kernels (numba-cuda).

CUDA arrays (numba device arrays, CuPy arrays, CUDA torch tensors, CUDA DLPack
objects) run in place and come back in the caller's array type; host NumPy
arrays are copied to the GPU and the results copied back.  Under
``NUMBA_ENABLE_CUDASIM=1`` the same kernels run in numba's CUDA simulator.

Importing this module never fails: where numba-cuda or a GPU is missing,
``is_available()`` is False, ``why_unavailable()`` says why, and every function
raises ``RuntimeError`` with that reason.
"""

import inspect
import threading

from .. import _api
from ..operations import FUNCTIONS as _FUNCTIONS


def _probe():
    try:
        from numba import cuda
    except Exception as e:  # numba-cuda missing, or its CUDA bindings
        return f"numba-cuda cannot be imported ({type(e).__name__}: {e}); install numbanorm[cuda]"
    if getattr(cuda, "implementation", None) != "NVIDIA":  # (numba's own, older numba.cuda answered)
        return "numba-cuda is not installed (numba's built-in numba.cuda answered); install numbanorm[cuda]"
    import numpy as np

    if not hasattr(np, "row_stack"):  # NumPy >= 2.5, which numba-cuda 0.30 predates
        try:
            import numba.cuda.np.arrayobj  # noqa: F401  (what every kernel's first compile loads)
        except AttributeError as e:
            return (f"numba-cuda does not run with NumPy {np.__version__} (AttributeError: {e}: it "
                    "registers np.row_stack, which NumPy 2.5 removed; NVIDIA/numba-cuda#907); "
                    "install 'numpy<2.5'")
    try:
        if not cuda.is_available():
            return ("numba-cuda finds no usable CUDA GPU or driver (numba.cuda.is_available() is "
                    "False); NUMBA_ENABLE_CUDASIM=1 runs the kernels in numba's CUDA simulator")
    except Exception as e:  # pragma: no cover - a broken driver
        return f"the CUDA driver failed to initialise ({type(e).__name__}: {e})"
    return ""


_why = _probe()


class _Unavailable:
    """Stands for the frontend where the GPU kernels cannot run: every function raises."""

    def shortcut(self, op, direction):
        return None  # no call on device arrays is ever replayed (the top level asks once imported)

    def __getattr__(self, name):
        if name not in _FUNCTIONS:
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"numbanorm.cuda.{name}: the GPU kernels cannot run here: {_why}")

        # the signature and docstring of the same function where it can run (the CPU's)
        from .. import cpu

        unavailable.__signature__ = inspect.signature(getattr(cpu, name))
        unavailable.__name__, unavailable.__doc__ = name, getattr(cpu, name).__doc__
        return unavailable


if _why:
    _frontend = _frontend_sides_checked = _Unavailable()
else:
    from . import _simblock, _simlibdevice, _simshared, _simwarp

    # under NUMBA_ENABLE_CUDASIM=1 only: what the simulator lacks to run the GPU code
    _simblock.install()   # a barrier the threads drive (first: _simwarp wraps syncthreads)
    _simwarp.install()
    _simlibdevice.install()
    _simshared.install()  # one shared array per block (the simulator's allocation races)
    from . import _backend

    # The simulator swaps numba.cuda for a fake module in the globals of a running kernel's
    # modules, where another thread's host code would find it: there, one call at a time
    _serial = threading.RLock() if _backend.C.SIMULATED else None
    _frontend = _api.Frontend(_backend, serial=_serial)
    # for numbanorm's top level, which has checked the arguments' sides before choosing the GPU
    _frontend_sides_checked = _api.Frontend(_backend, sides_checked=True, serial=_serial)


def is_available():
    """True where the GPU kernels can run (a CUDA GPU, or numba's simulator)."""
    return not _why


def why_unavailable():
    """Why the GPU kernels cannot run here ('' where they can)."""
    return _why


# the table's functions: the frontend's methods of those names
globals().update({name: getattr(_frontend, name) for name in _FUNCTIONS})

__all__ = [*_FUNCTIONS, "is_available", "why_unavailable"]
