"""Stateful layers for NumPy training loops.

``layer(x)`` runs the forward and keeps what the backward needs;
``layer.backward(dy)`` returns ``dx`` and sets ``grad_weight``/``grad_bias``.
"""

import numpy as np

from . import _validate as V
from ._dispatch import (group_norm_backward, group_norm_forward, layer_norm_backward, layer_norm_forward,
                        rms_norm_backward, rms_norm_forward)


def _saved(x):
    """A private copy of ``x`` for the backward: the caller may reuse its buffer
    between forward and backward (NumPy has no version counters to notice it)."""
    if V.side_of(x) == V.DEVICE:
        if hasattr(x, "copy"):  # CuPy and the like
            return x.copy()
        from numba import cuda

        saved = cuda.device_array_like(x)
        saved.copy_to_device(x)
        return saved
    return np.array(x, copy=True)


class _Norm:
    _stats = None

    def __getstate__(self):
        # the last input is not part of a layer: a pickle carries the parameters only
        state = self.__dict__.copy()
        state.pop("_stats", None)
        return state

    def backward(self, dy):
        if self._stats is None:
            raise RuntimeError(f"{type(self).__name__}.backward called before a forward")
        return self._backward(dy, *self._stats)

    def _set_grads(self, dw, db=None):
        self.grad_weight = dw if self.weight is not None else None
        self.grad_bias = db if self.bias is not None else None

    def __repr__(self):
        return f"{type(self).__name__}({self.extra_repr()})"


class LayerNorm(_Norm):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, dtype=np.float32):
        self.normalized_shape = V._as_shape(normalized_shape)
        self.eps = V.check_eps(eps, np.dtype(dtype))
        self.elementwise_affine = elementwise_affine
        self.weight = np.ones(self.normalized_shape, dtype) if elementwise_affine else None
        self.bias = np.zeros(self.normalized_shape, dtype) if elementwise_affine and bias else None
        self.grad_weight = self.grad_bias = None

    def __call__(self, x):
        y, mean, rstd = layer_norm_forward(x, self.normalized_shape, self.weight, self.bias, self.eps)
        self._stats = (_saved(x), mean, rstd)
        return y

    def _backward(self, dy, x, mean, rstd):
        dx, dw, db = layer_norm_backward(dy, x, mean, rstd, self.normalized_shape, self.weight)
        self._set_grads(dw, db)
        return dx

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class RMSNorm(_Norm):
    bias = None

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, dtype=np.float32):
        self.normalized_shape = V._as_shape(normalized_shape)
        self.eps = V.check_eps(eps, np.dtype(dtype), allow_none=True)
        self.elementwise_affine = elementwise_affine
        self.weight = np.ones(self.normalized_shape, dtype) if elementwise_affine else None
        self.grad_weight = self.grad_bias = None

    def __call__(self, x):
        y, rstd = rms_norm_forward(x, self.normalized_shape, self.weight, self.eps)
        self._stats = (_saved(x), rstd)
        return y

    def _backward(self, dy, x, rstd):
        dx, dw = rms_norm_backward(dy, x, rstd, self.normalized_shape, self.weight)
        self._set_grads(dw)
        return dx

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class GroupNorm(_Norm):
    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, dtype=np.float32):
        num_groups = V.integer("num_groups", num_groups)
        num_channels = V.integer("num_channels", num_channels)
        if num_groups <= 0 or num_channels <= 0 or num_channels % num_groups:
            raise ValueError(f"num_groups={num_groups} must be positive and divide num_channels={num_channels}")
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = V.check_eps(eps, np.dtype(dtype))
        self.affine = affine
        self.weight = np.ones(num_channels, dtype) if affine else None
        self.bias = np.zeros(num_channels, dtype) if affine else None
        self.grad_weight = self.grad_bias = None

    def __call__(self, x):
        if len(np.shape(x)) < 2 or np.shape(x)[1] != self.num_channels:
            raise ValueError(f"expected x of shape (N, {self.num_channels}, *spatial), got {tuple(np.shape(x))}")
        y, mean, rstd = group_norm_forward(x, self.num_groups, self.weight, self.bias, self.eps)
        self._stats = (_saved(x), mean, rstd)
        return y

    def _backward(self, dy, x, mean, rstd):
        dx, dw, db = group_norm_backward(dy, x, mean, rstd, self.weight)
        self._set_grads(dw, db)
        return dx

    def extra_repr(self):
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"
