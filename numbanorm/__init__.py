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


def _pick(**arrays):
    """The CPU frontend unless some argument is a CUDA array (decided by type alone).

    Host and device arrays mixed in one call are rejected here, before
    ``numbanorm.cuda`` (and so numba.cuda) is even imported.
    """
    for a in arrays.values():
        if a is not None and type(a) is not _np.ndarray and _V.side_of(a) == _V.DEVICE:
            _V.common_side(**arrays)
            from . import cuda

            return cuda._frontend
    return _CPU


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, out=None):
    """LayerNorm over the trailing ``normalized_shape`` of ``x``: ``y``."""
    return _pick(x=x, weight=weight, bias=bias, out=out).layer_norm(x, normalized_shape, weight, bias, eps, out=out)


def layer_norm_forward(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """LayerNorm keeping what the backward needs: ``(y, mean, rstd)``."""
    return _pick(x=x, weight=weight, bias=bias).layer_norm_forward(x, normalized_shape, weight, bias, eps)


def layer_norm_backward(dy, x, mean, rstd, normalized_shape, weight=None):
    """Gradients of LayerNorm: ``(dx, dweight, dbias)``."""
    return _pick(dy=dy, x=x, mean=mean, rstd=rstd, weight=weight).layer_norm_backward(dy, x, mean, rstd, normalized_shape, weight)


def rms_norm(x, normalized_shape, weight=None, eps=None, *, out=None):
    """RMSNorm over the trailing ``normalized_shape`` of ``x``: ``y``."""
    return _pick(x=x, weight=weight, out=out).rms_norm(x, normalized_shape, weight, eps, out=out)


def rms_norm_forward(x, normalized_shape, weight=None, eps=None):
    """RMSNorm keeping what the backward needs: ``(y, rstd)``."""
    return _pick(x=x, weight=weight).rms_norm_forward(x, normalized_shape, weight, eps)


def rms_norm_backward(dy, x, rstd, normalized_shape, weight=None):
    """Gradients of RMSNorm: ``(dx, dweight)``."""
    return _pick(dy=dy, x=x, rstd=rstd, weight=weight).rms_norm_backward(dy, x, rstd, normalized_shape, weight)


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, *, out=None):
    """GroupNorm of ``x`` of shape ``(N, C, *spatial)``: ``y``."""
    return _pick(x=x, weight=weight, bias=bias, out=out).group_norm(x, num_groups, weight, bias, eps, out=out)


def group_norm_forward(x, num_groups, weight=None, bias=None, eps=1e-5):
    """GroupNorm keeping what the backward needs: ``(y, mean, rstd)``, stats ``(N, G)``."""
    return _pick(x=x, weight=weight, bias=bias).group_norm_forward(x, num_groups, weight, bias, eps)


def group_norm_backward(dy, x, mean, rstd, weight=None):
    """Gradients of GroupNorm: ``(dx, dweight, dbias)``."""
    return _pick(dy=dy, x=x, mean=mean, rstd=rstd, weight=weight).group_norm_backward(dy, x, mean, rstd, weight)


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``s = x + residual`` and its LayerNorm in one pass over memory: ``(y, s)``."""
    return _pick(x=x, residual=residual, weight=weight, bias=bias).add_layer_norm(
        x, residual, normalized_shape, weight, bias, eps)


def add_layer_norm_forward(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Fused add + LayerNorm keeping what the backward needs: ``(y, s, mean, rstd)``."""
    return _pick(x=x, residual=residual, weight=weight, bias=bias).add_layer_norm_forward(
        x, residual, normalized_shape, weight, bias, eps)


def add_layer_norm_backward(dy, ds, s, mean, rstd, normalized_shape, weight=None):
    """Gradients of fused add + LayerNorm: ``(dx, dweight, dbias)``; dx is also d(residual)."""
    return _pick(dy=dy, ds=ds, s=s, mean=mean, rstd=rstd, weight=weight).add_layer_norm_backward(
        dy, ds, s, mean, rstd, normalized_shape, weight)


def add_rms_norm(x, residual, normalized_shape, weight=None, eps=None):
    """``s = x + residual`` and its RMSNorm in one pass over memory: ``(y, s)``."""
    return _pick(x=x, residual=residual, weight=weight).add_rms_norm(x, residual, normalized_shape, weight, eps)


def add_rms_norm_forward(x, residual, normalized_shape, weight=None, eps=None):
    """Fused add + RMSNorm keeping what the backward needs: ``(y, s, rstd)``."""
    return _pick(x=x, residual=residual, weight=weight).add_rms_norm_forward(
        x, residual, normalized_shape, weight, eps)


def add_rms_norm_backward(dy, ds, s, rstd, normalized_shape, weight=None):
    """Gradients of fused add + RMSNorm: ``(dx, dweight)``; dx is also d(residual)."""
    return _pick(dy=dy, ds=ds, s=s, rstd=rstd, weight=weight).add_rms_norm_backward(
        dy, ds, s, rstd, normalized_shape, weight)


__all__ = [
    "layer_norm", "layer_norm_forward", "layer_norm_backward",
    "rms_norm", "rms_norm_forward", "rms_norm_backward",
    "group_norm", "group_norm_forward", "group_norm_backward",
    "add_layer_norm", "add_layer_norm_forward", "add_layer_norm_backward",
    "add_rms_norm", "add_rms_norm_forward", "add_rms_norm_backward",
    "LayerNorm", "RMSNorm", "GroupNorm",
]
