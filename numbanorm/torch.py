"""numbanorm inside PyTorch: differentiable functions and drop-in ``torch.nn`` modules.

    import numbanorm.torch as nt
    y = nt.layer_norm(x, (768,), weight, bias)          # torch.nn.functional's signature
    y, s = nt.add_layer_norm(x, residual, 768, w, b)    # fused residual add, returns (y, s)
    model = nt.replace_norms(model)                     # swap torch.nn norms in place

Each function is a ``torch.autograd.Function`` over numbanorm's public forward and
backward (``layer_norm_forward``/``layer_norm_backward`` and siblings), so the
kernels, validation and errors are the package's own.  How tensors cross:

* CPU tensors are seen as NumPy arrays without a copy (``tensor.detach().numpy()``:
  a strided tensor becomes a strided view, which the frontend makes contiguous
  as it would any NumPy input) and results come back with ``torch.from_numpy``,
  sharing memory;
* CUDA tensors are handed over as they are (detached): the GPU backend reads
  them through the CUDA array interface, queues the kernels on PyTorch's current
  stream and returns torch tensors.

Tensors that require grad are detached before crossing (autograd tracks the
``Function``, not the kernels).  Gradients for ``weight``/``bias`` are returned
only where they require grad (``ctx.needs_input_grad``); the kernels compute
them in the same pass as dx either way.  The backward is not itself
differentiable (``once_differentiable``): double backward raises.

The modules subclass their ``torch.nn`` namesakes and replace only ``forward``,
so constructor arguments (``device``, ``dtype`` included), parameter names,
``reset_parameters``, ``extra_repr``, ``state_dict`` and ``isinstance`` checks
(weight-decay exclusions, say) are PyTorch's own.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.autograd.function import once_differentiable

import numbanorm as _nn

__all__ = [
    "layer_norm", "rms_norm", "group_norm", "add_layer_norm", "add_rms_norm",
    "LayerNorm", "RMSNorm", "GroupNorm", "replace_norms",
]


# ------------------------------------------------------------ crossing

def _arr(t):
    """A tensor as numbanorm takes it: NumPy view (CPU) or the detached tensor (CUDA)."""
    if t is None:
        return None
    t = t.detach()
    if t.device.type == "cuda":
        return t
    if t.device.type != "cpu":
        raise TypeError(f"numbanorm.torch runs CPU and CUDA tensors, got one on {t.device}")
    if t.dtype == torch.bfloat16:
        raise TypeError("bfloat16 runs on the GPU only: NumPy (and so numbanorm's CPU kernels) has no bfloat16")
    return t.resolve_conj().resolve_neg().numpy()


def _tensor(a):
    """A numbanorm result as a tensor, sharing memory."""
    if a is None or isinstance(a, torch.Tensor):
        return a
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a)
    return torch.as_tensor(a, device="cuda")  # a numba device array: CUDA array interface


def _grads(ctx, *grads):
    """``grads`` with None where the matching input does not need one."""
    return tuple(_tensor(g) if need else None for g, need in zip(grads, ctx.needs_input_grad))


# ------------------------------------------------------------ autograd functions

class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps):
        y, mean, rstd = _nn.layer_norm_forward(_arr(x), normalized_shape, _arr(weight), _arr(bias), eps)
        mean, rstd = _tensor(mean), _tensor(rstd)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.normalized_shape = normalized_shape
        return _tensor(y)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _nn.layer_norm_backward(_arr(dy), _arr(x), _arr(mean), _arr(rstd),
                                             ctx.normalized_shape, _arr(weight))
        return _grads(ctx, dx, None, dw, db, None)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        y, rstd = _nn.rms_norm_forward(_arr(x), normalized_shape, _arr(weight), eps)
        rstd = _tensor(rstd)
        ctx.save_for_backward(x, weight, rstd)
        ctx.normalized_shape = normalized_shape
        return _tensor(y)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _nn.rms_norm_backward(_arr(dy), _arr(x), _arr(rstd), ctx.normalized_shape, _arr(weight))
        return _grads(ctx, dx, None, dw, None)


class _GroupNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, num_groups, weight, bias, eps):
        y, mean, rstd = _nn.group_norm_forward(_arr(x), num_groups, _arr(weight), _arr(bias), eps)
        mean, rstd = _tensor(mean), _tensor(rstd)
        ctx.save_for_backward(x, weight, mean, rstd)
        return _tensor(y)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _nn.group_norm_backward(_arr(dy), _arr(x), _arr(mean), _arr(rstd), _arr(weight))
        return _grads(ctx, dx, None, dw, db, None)


class _AddLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, normalized_shape, weight, bias, eps):
        y, s, mean, rstd = _nn.add_layer_norm_forward(_arr(x), _arr(residual), normalized_shape,
                                                      _arr(weight), _arr(bias), eps)
        y, s, mean, rstd = map(_tensor, (y, s, mean, rstd))
        # s is an output too: saving it keeps autograd's check that nobody
        # modified it in place before the backward reads it
        ctx.save_for_backward(s, weight, mean, rstd)
        ctx.normalized_shape = normalized_shape
        ctx.set_materialize_grads(False)  # an unused y or s sends None, not zeros
        return y, s

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, ds):
        s, weight, mean, rstd = ctx.saved_tensors
        if dy is None:  # only s was used downstream: y's norm contributes nothing
            return _grads(ctx, ds, ds, None, None, None, None)
        dx, dw, db = _nn.add_layer_norm_backward(_arr(dy), _arr(ds), _arr(s), _arr(mean), _arr(rstd),
                                                 ctx.normalized_shape, _arr(weight))
        return _grads(ctx, dx, dx, None, dw, db, None)


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, normalized_shape, weight, eps):
        y, s, rstd = _nn.add_rms_norm_forward(_arr(x), _arr(residual), normalized_shape, _arr(weight), eps)
        y, s, rstd = map(_tensor, (y, s, rstd))
        ctx.save_for_backward(s, weight, rstd)
        ctx.normalized_shape = normalized_shape
        ctx.set_materialize_grads(False)
        return y, s

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, ds):
        s, weight, rstd = ctx.saved_tensors
        if dy is None:
            return _grads(ctx, ds, ds, None, None, None)
        dx, dw = _nn.add_rms_norm_backward(_arr(dy), _arr(ds), _arr(s), _arr(rstd),
                                           ctx.normalized_shape, _arr(weight))
        return _grads(ctx, dx, dx, None, dw, None)


# ------------------------------------------------------------ functional

def _shape(normalized_shape):
    """torch.Size, lists and ints alike, as the tuple numbanorm validates."""
    if isinstance(normalized_shape, (int, np.integer)):
        return (int(normalized_shape),)
    return tuple(normalized_shape)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``torch.nn.functional.layer_norm`` on numbanorm's kernels."""
    return _LayerNorm.apply(input, _shape(normalized_shape), weight, bias, eps)


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """``torch.nn.functional.rms_norm`` on numbanorm's kernels (``eps=None``: machine epsilon)."""
    return _RMSNorm.apply(input, _shape(normalized_shape), weight, eps)


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    """``torch.nn.functional.group_norm`` on numbanorm's kernels; input ``(N, C, *)``."""
    return _GroupNorm.apply(input, num_groups, weight, bias, eps)


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``s = x + residual; y = layer_norm(s)`` in one pass: ``(y, s)``, both differentiable."""
    return _AddLayerNorm.apply(x, residual, _shape(normalized_shape), weight, bias, eps)


def add_rms_norm(x, residual, normalized_shape, weight=None, eps=None):
    """``s = x + residual; y = rms_norm(s)`` in one pass: ``(y, s)``, both differentiable."""
    return _AddRMSNorm.apply(x, residual, _shape(normalized_shape), weight, eps)


# ------------------------------------------------------------ modules

class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` running numbanorm's kernels."""

    def forward(self, input):
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` running numbanorm's kernels."""

    def forward(self, input):
        return rms_norm(input, self.normalized_shape, self.weight, self.eps)


class GroupNorm(torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` running numbanorm's kernels."""

    def forward(self, input):
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps)


_SWAPS = ((torch.nn.LayerNorm, LayerNorm), (torch.nn.RMSNorm, RMSNorm), (torch.nn.GroupNorm, GroupNorm))


def replace_norms(module):
    """Swap every ``torch.nn`` LayerNorm/RMSNorm/GroupNorm in ``module`` for numbanorm's, in place.

    The replacements take over the originals' parameters and buffers (the same
    tensors, not copies), so an optimizer built before the swap keeps working.
    Subclasses of the torch modules other than numbanorm's are left alone: their
    ``forward`` may do more than normalize.  Returns ``module`` (swapped itself
    when it is one of the norms).
    """
    for torch_cls, ours in _SWAPS:
        if type(module) is torch_cls:
            new = ours.__new__(ours)
            new.__dict__.update(module.__dict__)  # the same parameters, buffers, hooks, settings
            return new
    for name, child in module.named_children():
        new = replace_norms(child)
        if new is not child:
            setattr(module, name, new)
    return module
