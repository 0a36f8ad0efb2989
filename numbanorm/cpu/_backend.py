"""The CPU backend of the frontend in ``numbanorm._api``: NumPy arrays in and out."""

import numpy as np

from .. import _validate as V
from ._kernels import add_norm, group_norm, layer_norm, rms_norm  # noqa: F401  (the launchers)

name = "cpu"


def native(arg, a):
    if a is None or type(a) is np.ndarray:
        return a
    if V.side_of(a) == V.DEVICE:
        raise TypeError(
            f"`{arg}` is a CUDA array, but numbanorm.cpu runs on host arrays: call "
            "numbanorm.cuda (or the top-level functions, which dispatch on the array type)"
        )
    return np.asarray(a)


def contiguous(a, shape):
    return np.ascontiguousarray(a).reshape(shape)


empty = np.empty


def out_view(out, shape):
    if not out.flags.writeable:
        raise ValueError("`out` is read-only")
    return out.reshape(shape) if out.flags.c_contiguous else None


def copy_into(dst, src):
    np.copyto(dst, src)


def cast(a, dtype):
    return a.astype(dtype, copy=False)


def wrap(a, like):
    return a
