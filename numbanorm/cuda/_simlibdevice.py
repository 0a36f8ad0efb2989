"""libdevice's bit casts (and its unfused products) for numba's CUDA simulator.

Under the simulator a kernel runs as Python, and ``numba.cuda.libdevice``'s
functions are documentation stubs that return None.  The bfloat16 loads and
stores (``_kernels.common.load_fn``/``store_fn``) move bits between float32 and
int32 with ``float_as_int``/``int_as_float``; ``install()`` gives the stubs of
the bit-reinterpreting functions their meaning (a NumPy view of the same bits),
so bfloat16 kernels run in the simulator through the same code as on hardware.
It only replaces a function that is still a stub (returns None).
"""

import numpy as np


def float_as_int(x):
    return np.float32(x).view(np.int32)


def int_as_float(x):
    return np.int32(x).view(np.float32)


def double_as_longlong(x):
    return np.float64(x).view(np.int64)


def longlong_as_double(x):
    return np.int64(x).view(np.float64)


def double2hiint(x):
    return np.int32(np.float64(x).view(np.int64) >> 32)


def double2loint(x):
    return np.uint32(np.float64(x).view(np.uint64) & 0xFFFFFFFF).view(np.int32)


def hiloint2double(hi, lo):
    return np.uint64((int(np.int32(hi).view(np.uint32)) << 32) | int(np.int32(lo).view(np.uint32))).view(np.float64)


def fmul_rn(x, y):  # a product rounded on its own (hardware never fuses it into an fma)
    return np.float32(x) * np.float32(y)


def dmul_rn(x, y):
    return np.float64(x) * np.float64(y)


# (function, an argument) -- the argument only probes whether the stub is still one
_CASTS = {f.__name__: (f, args) for f, args in (
    (float_as_int, (1.0,)), (int_as_float, (1,)), (double_as_longlong, (1.0,)),
    (longlong_as_double, (1,)), (double2hiint, (1.0,)), (double2loint, (1.0,)),
    (hiloint2double, (1, 1)), (fmul_rn, (1.0, 1.0)), (dmul_rn, (1.0, 1.0)))}


def install():
    """Fill in the libdevice bit casts the simulator lacks; returns the names filled in."""
    from numba import cuda

    if not cuda.config.ENABLE_CUDASIM:
        return ()
    from numba.cuda import libdevice

    added = []
    for name, (fn, probe) in _CASTS.items():
        current = getattr(libdevice, name, None)
        if current is fn:
            continue
        if current is None or current(*probe) is None:  # a documentation stub
            setattr(libdevice, name, fn)
            added.append(name)
    return tuple(added)
