"""numbanorm: Numba-accelerated LayerNorm, RMSNorm and GroupNorm, forward and backward.

NumPy arrays run on the parallel CPU kernels; CUDA arrays (numba, CuPy, PyTorch)
run on the GPU kernels.  The contract of every function here is the project's
API document; ``numbanorm.reference`` is the NumPy oracle the kernels are tested
against.
"""

import numpy as _np

from . import _validate as _V
from . import cpu
from .layers import GroupNorm, LayerNorm, RMSNorm

__version__ = "0.1.0"

_CPU = cpu._frontend


def _pick(*arrays):
    """The CPU frontend unless some argument is a CUDA array (decided by type alone)."""
    for a in arrays:
        if a is not None and type(a) is not _np.ndarray and _V.side_of(a) == _V.DEVICE:
            from . import cuda

            return cuda._frontend
    return _CPU


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, out=None):
    """LayerNorm over the trailing ``normalized_shape`` of ``x``: ``y``."""
    return _pick(x, weight, bias, out).layer_norm(x, normalized_shape, weight, bias, eps, out=out)


def layer_norm_forward(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """LayerNorm keeping what the backward needs: ``(y, mean, rstd)``."""
    return _pick(x, weight, bias).layer_norm_forward(x, normalized_shape, weight, bias, eps)


def layer_norm_backward(dy, x, mean, rstd, normalized_shape, weight=None):
    """Gradients of LayerNorm: ``(dx, dweight, dbias)``."""
    return _pick(dy, x, mean, rstd, weight).layer_norm_backward(dy, x, mean, rstd, normalized_shape, weight)


def rms_norm(x, normalized_shape, weight=None, eps=None, *, out=None):
    """RMSNorm over the trailing ``normalized_shape`` of ``x``: ``y``."""
    return _pick(x, weight, out).rms_norm(x, normalized_shape, weight, eps, out=out)


def rms_norm_forward(x, normalized_shape, weight=None, eps=None):
    """RMSNorm keeping what the backward needs: ``(y, rstd)``."""
    return _pick(x, weight).rms_norm_forward(x, normalized_shape, weight, eps)


def rms_norm_backward(dy, x, rstd, normalized_shape, weight=None):
    """Gradients of RMSNorm: ``(dx, dweight)``."""
    return _pick(dy, x, rstd, weight).rms_norm_backward(dy, x, rstd, normalized_shape, weight)


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, *, out=None):
    """GroupNorm of ``x`` of shape ``(N, C, *spatial)``: ``y``."""
    return _pick(x, weight, bias, out).group_norm(x, num_groups, weight, bias, eps, out=out)


def group_norm_forward(x, num_groups, weight=None, bias=None, eps=1e-5):
    """GroupNorm keeping what the backward needs: ``(y, mean, rstd)``, stats ``(N, G)``."""
    return _pick(x, weight, bias).group_norm_forward(x, num_groups, weight, bias, eps)


def group_norm_backward(dy, x, mean, rstd, weight=None):
    """Gradients of GroupNorm: ``(dx, dweight, dbias)``."""
    return _pick(dy, x, mean, rstd, weight).group_norm_backward(dy, x, mean, rstd, weight)


__all__ = [
    "layer_norm", "layer_norm_forward", "layer_norm_backward",
    "rms_norm", "rms_norm_forward", "rms_norm_backward",
    "group_norm", "group_norm_forward", "group_norm_backward",
    "LayerNorm", "RMSNorm", "GroupNorm",
]
