"""Shared arrays in numba's CUDA simulator, without its allocation race.

The simulator gives a block's threads one NumPy array per ``cuda.shared.array``
call site, created by the first thread that gets there: it looks the site up,
and if absent creates and stores an array -- without a lock, and with a slow
``traceback.extract_stack`` (which reads source files) in between.  Two threads
that reach the site together can each create their own array; each then writes
its half, and reads the other half uninitialized (a flaky garbage ``dweight``
under a loaded machine, in the kernels' shared-memory epilogues).  ``install()``
makes the lookup and the creation one step under a lock, and names the call
site from the caller's frame (file and line, as before) without reading source.
"""

import sys
import threading

import numpy as np

_lock = threading.Lock()
# what a kernel gets for each shared array: ``view(shared, array)`` (tests/_simrace.py's
# race check sets it), else the array itself
view = None


def install():
    """Replace the simulator's ``FakeCUDAShared.array`` (once; a no-op off the simulator)."""
    from numba import cuda

    if not cuda.config.ENABLE_CUDASIM:
        return False
    from numba.cuda.simulator import kernelapi

    cls = kernelapi.FakeCUDAShared
    if getattr(cls, "_nn_locked", False):
        return False
    original = cls.array

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:  # refused / dynamic: the simulator's own
            res = original(self, shape, dtype, alignment)
        else:
            if isinstance(dtype, kernelapi.types.Type):
                dtype = kernelapi.numpy_support.as_dtype(dtype)
            frame = sys._getframe(1)
            site = (frame.f_code.co_filename, frame.f_lineno)
            with _lock:
                res = self._allocations.get(site)
                if res is None:
                    res = self._allocations[site] = np.empty(shape, dtype)
        return res if view is None else view(self, res)

    cls.array = array
    cls._nn_locked = True
    return True
