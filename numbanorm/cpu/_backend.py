"""The CPU backend of the frontend in ``numbanorm._api``: NumPy arrays in and out.

It implements ``numbanorm._api.Backend``; a CPU call has no context (``None``).
"""

import numpy as np

from .. import _validate as V
from ._kernels import add_norm, group_norm, layer_norm, rms_norm  # noqa: F401  (the launchers)

name = "cpu"


def native(role, a):
    if a is None or type(a) is np.ndarray:
        return a
    if V.side_of(a) == V.DEVICE:
        raise TypeError(
            f"`{role}` is a CUDA array, but numbanorm.cpu runs on host arrays: call "
            "numbanorm.cuda (or the top-level functions, which dispatch on the array type)"
        )
    return np.asarray(a)


def call_context(leading):
    return None


def launch(ctx, launcher, *args, callers_out=False, **kwargs):
    # y in a caller's out= has its pages mapped: a large one is written with streaming stores
    if callers_out:
        kwargs["y_mapped"] = True
    return launcher(*args, **kwargs)


def contiguous(ctx, a, shape):
    return np.ascontiguousarray(a).reshape(shape)


def empty(ctx, shape, dtype):
    return np.empty(shape, dtype)


def out_view(out, shape):
    if not out.flags.writeable:
        raise ValueError("`out` is read-only")
    return out.reshape(shape) if out.flags.c_contiguous else None


def copy_into(ctx, dst, src):
    np.copyto(dst, src)


def cast(ctx, a, dtype):
    return a.astype(dtype, copy=False)


def wrap(a, like):
    return a
