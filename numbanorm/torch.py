"""numbanorm inside PyTorch: differentiable functions and drop-in ``torch.nn`` modules.

    import numbanorm.torch as nt
    y = nt.layer_norm(x, (768,), weight, bias)          # torch.nn.functional's signature
    y, s = nt.add_layer_norm(x, residual, 768, w, b)    # fused residual add, returns (y, s)
    model = nt.replace_norms(model)                     # swap the model's norms in place

Each operation is a PyTorch custom operator (``torch.ops.numbanorm.*``: a
forward and a backward operator per norm) over numbanorm's public forward and
backward (``layer_norm_forward``/``layer_norm_backward`` and siblings), so the
kernels, validation and errors are the package's own, and ``torch.compile``
(``fullgraph=True`` included) sees one opaque node per call instead of tracing
into NumPy: shapes come from the operators' fake implementations, the
backward from ``register_autograd``.  How tensors cross:

* CPU tensors are seen as NumPy arrays without a copy (``tensor.detach().numpy()``:
  a strided tensor becomes a strided view, which the frontend makes contiguous
  as it would any NumPy input; bfloat16 as an ``ml_dtypes.bfloat16`` view of
  the same bytes) and results come back with ``torch.from_numpy``, sharing memory;
* CUDA tensors are handed over as they are (detached): the GPU backend reads
  them through the CUDA array interface, queues the kernels on PyTorch's current
  stream and returns torch tensors.

Gradients for ``weight``/``bias`` are returned only where they require grad
(``ctx.needs_input_grad``); the kernels compute them in the same pass as dx
either way.  The backward operators have no autograd formula: double backward
raises.

The modules subclass their ``torch.nn`` namesakes and replace only ``forward``,
so constructor arguments (``device``, ``dtype`` included), parameter names,
``reset_parameters``, ``extra_repr``, ``state_dict`` and ``isinstance`` checks
(weight-decay exclusions, say) are PyTorch's own.  ``replace_norms`` also
recognises the RMSNorm classes of Hugging Face ``transformers`` by what their
``forward`` computes (see there).
"""

from __future__ import annotations

import logging
import re
from typing import NamedTuple, Optional

import numpy as np
import torch
from torch import Tensor

import numbanorm as _nn
from numbanorm import _validate as _V

__all__ = [
    "layer_norm", "rms_norm", "group_norm", "add_layer_norm", "add_rms_norm",
    "LayerNorm", "RMSNorm", "GroupNorm", "replace_norms", "NormReport",
]

_log = logging.getLogger(__name__)
_HALF = (torch.float16, torch.bfloat16)


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
    t = t.resolve_conj().resolve_neg()
    if t.dtype == torch.bfloat16:
        # NumPy has no bfloat16 of its own: the same bytes, typed by ml_dtypes
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("bfloat16 CPU tensors reach numbanorm as NumPy ml_dtypes.bfloat16 "
                            "arrays: pip install ml-dtypes") from None
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _tensor(a):
    """A numbanorm result as a tensor, sharing memory."""
    if a is None or isinstance(a, torch.Tensor):
        return a
    if isinstance(a, np.ndarray):
        if a.dtype.name == "bfloat16":  # ml_dtypes: torch.from_numpy does not know it
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    return torch.as_tensor(a, device="cuda")  # a numba device array: CUDA array interface


def _tensors(results):
    return tuple(_tensor(a) for a in results)


def _check_tensors(fn, **args):
    """``TypeError`` for an argument that is neither a tensor nor None (before any operator runs)."""
    for name, a in args.items():
        if a is not None and not isinstance(a, torch.Tensor):
            kind = type(a).__name__ if type(a).__module__ == "builtins" else f"{type(a).__module__}.{type(a).__name__}"
            raise TypeError(f"`{name}` is a {kind}: numbanorm.torch.{fn} "
                            f"takes torch tensors (numbanorm.{fn} takes NumPy and CUDA arrays)")


def _shape(normalized_shape):
    """torch.Size, lists and ints alike, as the list the operators' schema takes."""
    if isinstance(normalized_shape, (int, np.integer)):
        return [int(normalized_shape)]
    return [int(d) if isinstance(d, np.integer) else d for d in normalized_shape]


def _needed(ctx, *grads):
    """``grads`` with None where the matching input does not need one."""
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))


# ------------------------------------------------------------ custom operators
#
# One forward and one backward operator per norm.  Their implementations are the
# only place a tensor becomes a NumPy array; the fake implementations give
# torch.compile the outputs' shapes and dtypes as numbanorm's frontend makes them
# (fresh contiguous outputs in x's dtype; statistics in the accumulation dtype;
# dweight/dbias in the weight's dtype, or x's without a weight).

def _acc(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _fake_stats(x, normalized_shape):
    k = len(normalized_shape)
    return x.new_empty(tuple(x.shape[:x.dim() - k]) + (1,) * k, dtype=_acc(x))


def _fake_param_grad(x, weight, shape):
    return x.new_empty(tuple(shape), dtype=weight.dtype if weight is not None else x.dtype)


@torch.library.custom_op("numbanorm::layer_norm_forward", mutates_args=())
def _layer_norm_forward(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                        bias: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _tensors(_nn.layer_norm_forward(_arr(x), normalized_shape, _arr(weight), _arr(bias), eps))


@_layer_norm_forward.register_fake
def _(x, normalized_shape, weight, bias, eps):
    return x.new_empty(x.shape), _fake_stats(x, normalized_shape), _fake_stats(x, normalized_shape)


@torch.library.custom_op("numbanorm::layer_norm_backward", mutates_args=())
def _layer_norm_backward(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, normalized_shape: list[int],
                         weight: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    return _tensors(_nn.layer_norm_backward(_arr(dy), _arr(x), _arr(mean), _arr(rstd), normalized_shape,
                                            _arr(weight)))


@_layer_norm_backward.register_fake
def _(dy, x, mean, rstd, normalized_shape, weight):
    return (x.new_empty(x.shape), _fake_param_grad(x, weight, normalized_shape),
            _fake_param_grad(x, weight, normalized_shape))


def _layer_norm_setup(ctx, inputs, output):
    x, normalized_shape, weight, _, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.normalized_shape = normalized_shape


def _layer_norm_grad(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_backward(dy, x, mean, rstd, ctx.normalized_shape, weight)
    return _needed(ctx, dx, None, dw, db, None)


_layer_norm_forward.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


@torch.library.custom_op("numbanorm::rms_norm_forward", mutates_args=())
def _rms_norm_forward(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                      eps: Optional[float]) -> tuple[Tensor, Tensor]:
    return _tensors(_nn.rms_norm_forward(_arr(x), normalized_shape, _arr(weight), eps))


@_rms_norm_forward.register_fake
def _(x, normalized_shape, weight, eps):
    return x.new_empty(x.shape), _fake_stats(x, normalized_shape)


@torch.library.custom_op("numbanorm::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: Tensor, x: Tensor, rstd: Tensor, normalized_shape: list[int],
                       weight: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return _tensors(_nn.rms_norm_backward(_arr(dy), _arr(x), _arr(rstd), normalized_shape, _arr(weight)))


@_rms_norm_backward.register_fake
def _(dy, x, rstd, normalized_shape, weight):
    return x.new_empty(x.shape), _fake_param_grad(x, weight, normalized_shape)


def _rms_norm_setup(ctx, inputs, output):
    x, normalized_shape, weight, _ = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])
    ctx.normalized_shape = normalized_shape


def _rms_norm_grad(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward(dy, x, rstd, ctx.normalized_shape, weight)
    return _needed(ctx, dx, None, dw, None)


_rms_norm_forward.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


@torch.library.custom_op("numbanorm::group_norm_forward", mutates_args=())
def _group_norm_forward(x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor],
                        eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _tensors(_nn.group_norm_forward(_arr(x), num_groups, _arr(weight), _arr(bias), eps))


@_group_norm_forward.register_fake
def _(x, num_groups, weight, bias, eps):
    stats = (x.shape[0], num_groups)
    return x.new_empty(x.shape), x.new_empty(stats, dtype=_acc(x)), x.new_empty(stats, dtype=_acc(x))


@torch.library.custom_op("numbanorm::group_norm_backward", mutates_args=())
def _group_norm_backward(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor,
                         weight: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    return _tensors(_nn.group_norm_backward(_arr(dy), _arr(x), _arr(mean), _arr(rstd), _arr(weight)))


@_group_norm_backward.register_fake
def _(dy, x, mean, rstd, weight):
    c = (x.shape[1],)
    return x.new_empty(x.shape), _fake_param_grad(x, weight, c), _fake_param_grad(x, weight, c)


def _group_norm_setup(ctx, inputs, output):
    x, _, weight, _, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)


def _group_norm_grad(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _group_norm_backward(dy, x, mean, rstd, weight)
    return _needed(ctx, dx, None, dw, db, None)


_group_norm_forward.register_autograd(_group_norm_grad, setup_context=_group_norm_setup)


@torch.library.custom_op("numbanorm::add_layer_norm_forward", mutates_args=())
def _add_layer_norm_forward(x: Tensor, residual: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                            bias: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _tensors(_nn.add_layer_norm_forward(_arr(x), _arr(residual), normalized_shape, _arr(weight),
                                               _arr(bias), eps))


@_add_layer_norm_forward.register_fake
def _(x, residual, normalized_shape, weight, bias, eps):
    return (x.new_empty(x.shape), x.new_empty(x.shape), _fake_stats(x, normalized_shape),
            _fake_stats(x, normalized_shape))


@torch.library.custom_op("numbanorm::add_layer_norm_backward", mutates_args=())
def _add_layer_norm_backward(dy: Tensor, ds: Optional[Tensor], s: Tensor, mean: Tensor, rstd: Tensor,
                             normalized_shape: list[int], weight: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    return _tensors(_nn.add_layer_norm_backward(_arr(dy), _arr(ds), _arr(s), _arr(mean), _arr(rstd),
                                                normalized_shape, _arr(weight)))


@_add_layer_norm_backward.register_fake
def _(dy, ds, s, mean, rstd, normalized_shape, weight):
    return (s.new_empty(s.shape), _fake_param_grad(s, weight, normalized_shape),
            _fake_param_grad(s, weight, normalized_shape))


def _add_layer_norm_setup(ctx, inputs, output):
    _, _, normalized_shape, weight, _, _ = inputs
    _, s, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    # s is an output too: saving it keeps autograd's check that nobody
    # modified it in place before the backward reads it
    ctx.save_for_backward(s, weight, mean, rstd)
    ctx.normalized_shape = normalized_shape
    ctx.set_materialize_grads(False)  # an unused y or s sends None, not zeros


def _add_layer_norm_grad(ctx, dy, ds, _dmean, _drstd):
    s, weight, mean, rstd = ctx.saved_tensors
    if dy is None:  # only s was used downstream: y's norm contributes nothing
        return _needed(ctx, ds, ds, None, None, None, None)
    dx, dw, db = _add_layer_norm_backward(dy, ds, s, mean, rstd, ctx.normalized_shape, weight)
    return _needed(ctx, dx, dx, None, dw, db, None)


_add_layer_norm_forward.register_autograd(_add_layer_norm_grad, setup_context=_add_layer_norm_setup)


@torch.library.custom_op("numbanorm::add_rms_norm_forward", mutates_args=())
def _add_rms_norm_forward(x: Tensor, residual: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                          eps: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    return _tensors(_nn.add_rms_norm_forward(_arr(x), _arr(residual), normalized_shape, _arr(weight), eps))


@_add_rms_norm_forward.register_fake
def _(x, residual, normalized_shape, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape), _fake_stats(x, normalized_shape)


@torch.library.custom_op("numbanorm::add_rms_norm_backward", mutates_args=())
def _add_rms_norm_backward(dy: Tensor, ds: Optional[Tensor], s: Tensor, rstd: Tensor, normalized_shape: list[int],
                           weight: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return _tensors(_nn.add_rms_norm_backward(_arr(dy), _arr(ds), _arr(s), _arr(rstd), normalized_shape,
                                              _arr(weight)))


@_add_rms_norm_backward.register_fake
def _(dy, ds, s, rstd, normalized_shape, weight):
    return s.new_empty(s.shape), _fake_param_grad(s, weight, normalized_shape)


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, normalized_shape, weight, _ = inputs
    _, s, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(s, weight, rstd)
    ctx.normalized_shape = normalized_shape
    ctx.set_materialize_grads(False)


def _add_rms_norm_grad(ctx, dy, ds, _drstd):
    s, weight, rstd = ctx.saved_tensors
    if dy is None:
        return _needed(ctx, ds, ds, None, None, None)
    dx, dw = _add_rms_norm_backward(dy, ds, s, rstd, ctx.normalized_shape, weight)
    return _needed(ctx, dx, dx, None, dw, None)


_add_rms_norm_forward.register_autograd(_add_rms_norm_grad, setup_context=_add_rms_norm_setup)

#: every operator this module registers, for ``torch.library.opcheck`` and the curious
OPERATORS = (_layer_norm_forward, _layer_norm_backward, _rms_norm_forward, _rms_norm_backward,
             _group_norm_forward, _group_norm_backward, _add_layer_norm_forward, _add_layer_norm_backward,
             _add_rms_norm_forward, _add_rms_norm_backward)


# ------------------------------------------------------------ functional

def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``torch.nn.functional.layer_norm`` on numbanorm's kernels."""
    _check_tensors("layer_norm", input=input, weight=weight, bias=bias)
    return _layer_norm_forward(input, _shape(normalized_shape), weight, bias, _V.check_eps(eps))[0]


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """``torch.nn.functional.rms_norm`` on numbanorm's kernels (``eps=None``: machine epsilon)."""
    _check_tensors("rms_norm", input=input, weight=weight)
    return _rms_norm_forward(input, _shape(normalized_shape), weight, _V.check_eps(eps, allow_none=True))[0]


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    """``torch.nn.functional.group_norm`` on numbanorm's kernels; input ``(N, C, *)``."""
    _check_tensors("group_norm", input=input, weight=weight, bias=bias)
    return _group_norm_forward(input, num_groups, weight, bias, _V.check_eps(eps))[0]


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``s = x + residual; y = layer_norm(s)`` in one pass: ``(y, s)``, both differentiable."""
    _check_tensors("add_layer_norm", x=x, residual=residual, weight=weight, bias=bias)
    y, s, _, _ = _add_layer_norm_forward(x, residual, _shape(normalized_shape), weight, bias, _V.check_eps(eps))
    return y, s


def add_rms_norm(x, residual, normalized_shape, weight=None, eps=None):
    """``s = x + residual; y = rms_norm(s)`` in one pass: ``(y, s)``, both differentiable."""
    _check_tensors("add_rms_norm", x=x, residual=residual, weight=weight)
    y, s, _ = _add_rms_norm_forward(x, residual, _shape(normalized_shape), weight,
                                    _V.check_eps(eps, allow_none=True))
    return y, s


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


# ------------------------------------------------------------ Hugging Face RMSNorm forms

class _HFForm(NamedTuple):
    """One RMSNorm arithmetic of the ``transformers`` classes (all compute in float32)."""

    eps_attr: str  # the attribute holding eps: "variance_epsilon" or "eps"
    offset: int    # 1: scales by (1 + weight), Gemma's zero-centred weight; 0: by weight
    cast: str      # where the float32 result meets the input's dtype, one of _CASTS


_CASTS = {
    "before": "float32 x*rstd cast to x's dtype, then *weight (Llama)",
    "after": "float32 x*rstd*weight, cast once to x's dtype (Gemma, OLMo-2)",
    "t5": "float32 x*rstd, cast to the weight's dtype if 16-bit, then *weight (T5)",
}
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _hf_rms_norm(x, weight, eps, form):
    """``form``'s arithmetic with numbanorm's kernel for the float32 part.

    The kernel computes ``x * rstd`` (and, given a weight, ``* weight``) in float32
    and rounds once to x's dtype on the store, so each form's casts are placed
    where the original puts them; only float32 models get the weight fused into
    the kernel, since in 16 bits the original rounds before multiplying.
    """
    shape = tuple(weight.shape)
    if form.cast == "after":
        scale = weight.float() + form.offset if form.offset else weight.float()
        if x.dtype in _KERNEL_DTYPES:
            return rms_norm(x, shape, scale, eps)
        return rms_norm(x.float(), shape, scale, eps).to(x.dtype)
    scale = weight + form.offset if form.offset else weight
    if form.cast == "before":
        n_dtype = x.dtype
    else:
        n_dtype = weight.dtype if weight.dtype in _HALF else torch.promote_types(x.dtype, torch.float32)
    if x.dtype == n_dtype == scale.dtype == torch.float32:
        return rms_norm(x, shape, scale, eps)  # both products in float32, as the original's
    if x.dtype == n_dtype and x.dtype in _KERNEL_DTYPES:
        return scale * rms_norm(x, shape, None, eps)
    return scale * rms_norm(x.float(), shape, None, eps).to(n_dtype)


def _hf_reference(x, weight, eps, form):
    """``form``'s arithmetic in plain torch, written as the ``transformers`` classes write it."""
    x32 = x.to(torch.float32)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if form.cast == "after":
        return (x32 * rstd * (weight.float() + form.offset)).to(x.dtype)
    scale = weight + form.offset if form.offset else weight
    if form.cast == "before":
        return scale * (x32 * rstd).to(x.dtype)
    n = x * rstd
    return scale * (n.to(weight.dtype) if weight.dtype in _HALF else n)


# (x dtype, weight dtype) pairs the probe runs: the 16-bit ones tell the forms apart
_PROBE_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                 (torch.bfloat16, torch.float32), (torch.float16, torch.float16), (torch.float64, torch.float64))


def _probe(module, eps_attr):
    """``(form, None)``: the RMSNorm form ``module.forward`` computes, or ``(None, why not)``.

    Runs the module's own forward (hooks bypassed, on a shallow copy holding a
    probe weight) on rows with a non-zero mean (a LayerNorm fails), rows small
    enough for eps to matter and a large one, in each of ``_PROBE_DTYPES``, and
    keeps the forms that agree within 8 ulps of the output dtype (float32's for
    float64 outputs: the classes compute in float32) with the same output dtype;
    of those, the closest (the ``transformers`` classes match one bit for bit).
    """
    weight = module.weight
    n = weight.shape[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, n, generator=g, dtype=torch.float64) + 0.5
    x[1] *= 1e-3
    x[2] *= 50
    w = torch.rand(n, generator=g, dtype=torch.float64) * 1.5 + 0.25  # away from 0 and 1
    eps = getattr(module, eps_attr)
    errors = {_HFForm(eps_attr, offset, cast): 0.0 for offset in (0, 1) for cast in _CASTS}
    for xdt, wdt in _PROBE_DTYPES:
        xi, wi = x.to(weight.device, xdt), w.to(weight.device, wdt)
        probe = object.__new__(type(module))
        probe.__dict__.update(module.__dict__)
        probe.__dict__["_parameters"] = {"weight": wi}
        try:
            with torch.no_grad():
                got = type(module).forward(probe, xi)
            if not isinstance(got, Tensor) or got.shape != xi.shape:
                return None, "forward(x) does not return a tensor shaped like x"
            for form in list(errors):
                want = _hf_reference(xi, wi, eps, form)
                tol = 8 * torch.finfo(torch.float32 if want.dtype == torch.float64 else want.dtype).eps
                err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
                if got.dtype != want.dtype or not err <= tol:  # NaN fails too
                    del errors[form]
                else:
                    errors[form] += err / tol
        except Exception as e:  # a forward that needs more than x, or another device's rules
            return None, f"forward(x) raised {type(e).__name__} on a {xdt} probe: {e}"
    if not errors:
        return None, ("its forward computes none of the RMSNorm forms numbanorm reproduces "
                      "(probed in float32, bfloat16, float16 and float64)")
    return min(errors, key=errors.get), None


class _HFRMSNorm(torch.nn.Module):
    """Forward of a replaced ``transformers`` RMSNorm (placed before the original class)."""

    _numbanorm_form = None  # an _HFForm, set on each generated class

    def forward(self, hidden_states):
        form = self._numbanorm_form
        return _hf_rms_norm(hidden_states, self.weight, getattr(self, form.eps_attr), form)


# ------------------------------------------------------------ replace_norms

_SWAPS = {torch.nn.LayerNorm: LayerNorm, torch.nn.RMSNorm: RMSNorm, torch.nn.GroupNorm: GroupNorm}
_OURS = (LayerNorm, RMSNorm, GroupNorm, _HFRMSNorm)
_NOT_OURS = (torch.nn.modules.batchnorm._NormBase, torch.nn.LocalResponseNorm, torch.nn.CrossMapLRN2d)


class _Swapped:
    """Base of the classes ``replace_norms`` makes on the fly: pickled by recipe."""

    _numbanorm_recipe = ()  # (our forward's class, the original class, form)

    def __reduce_ex__(self, protocol):
        return _rebuild, self._numbanorm_recipe, self.__dict__


_GENERATED = {}


def _swapped_class(ours, cls, form=None):
    """The original class ``cls`` with ``ours``'s forward; the name keeps cls's (HF matches on it)."""
    key = (ours, cls, form)
    if key not in _GENERATED:
        _GENERATED[key] = type("Numbanorm" + cls.__name__, (_Swapped, ours, cls),
                               {"_numbanorm_recipe": key, "_numbanorm_form": form, "__module__": __name__})
    return _GENERATED[key]


def _rebuild(ours, cls, form):
    new_cls = _swapped_class(ours, cls, form)
    return new_cls.__new__(new_cls)


class NormReport(NamedTuple):
    """What ``replace_norms`` did: ``(path, class, how)`` per module replaced, ``(path, class, why)``
    per norm left alone (paths as ``named_modules`` gives them, "" for the root)."""

    replaced: list
    left_alone: list

    def __str__(self):
        lines = [f"replaced {len(self.replaced)}, left alone {len(self.left_alone)}"]
        lines += [f"  replaced   {p or '(root)'}  {c}: {how}" for p, c, how in self.replaced]
        lines += [f"  left alone {p or '(root)'}  {c}: {why}" for p, c, why in self.left_alone]
        return "\n".join(lines)


_NORM_NAME = re.compile(r"(?i:norm)(?![a-z])")  # LayerNorm, RMSNormGated; not Normalize


def _eps_attr(m):
    for name in ("variance_epsilon", "eps"):
        v = m.__dict__.get(name)
        if isinstance(v, (float, int, np.floating)) and not isinstance(v, bool):
            return name
    return None


def _plan(m):
    """``(new class, how)`` for a childless module, ``(None, why not)`` for a norm left alone, or None."""
    cls = type(m)
    if cls in _SWAPS:
        return _SWAPS[cls], f"numbanorm.torch.{cls.__name__}"
    for base, ours in _SWAPS.items():
        if isinstance(m, base):
            if cls.forward is base.forward:  # a subclass that only adds to the constructor
                return _swapped_class(ours, cls), f"torch.nn.{base.__name__}'s forward on numbanorm"
            return None, f"a subclass of torch.nn.{base.__name__} with a forward of its own"
    if isinstance(m, _NOT_OURS):
        return None, "numbanorm has no batch, instance or local-response norm"
    is_norm = bool(_NORM_NAME.search(cls.__name__))
    eps_attr = _eps_attr(m)
    params = dict(m.named_parameters(recurse=False))
    if eps_attr is None:
        return (None, "no `variance_epsilon` or `eps` attribute") if is_norm else None
    if list(params) != ["weight"] or params["weight"].dim() != 1 or any(True for _ in m.buffers()):
        return (None, "its parameters are not one 1-D `weight` (and no buffers)") if is_norm else None
    form, why = _probe(m, eps_attr)
    if form is None:
        return (None, why) if is_norm else None  # not a norm at all: none of our business
    how = f"{_CASTS[form.cast]}{' with 1 + weight' if form.offset else ''}, eps = .{eps_attr}"
    return _swapped_class(_HFRMSNorm, cls, form), how


def replace_norms(module, strict=False, *, report=False):
    """Swap the norms in ``module`` for numbanorm's, in place; returns ``module``.

    Replaced: ``torch.nn`` LayerNorm/RMSNorm/GroupNorm (and subclasses that keep
    torch's forward), and any childless module with a 1-D ``weight`` and a
    ``variance_epsilon`` or ``eps`` whose forward is one of the RMSNorm forms of
    Hugging Face ``transformers`` (Llama, Mistral, Qwen, Phi-3, Gemma's ``1 +
    weight``, T5's, OLMo-2's), found by running that forward on a small probe
    (see ``_probe``) rather than by class name.  The replacement keeps each
    form's float32 upcast and casts, so outputs match the original's to float32
    rounding, and in 16 bits up to the ulp of the kernel's statistics.

    The replacements are instances of a subclass of the original class (still
    ``isinstance`` of it, its name kept after a "Numbanorm" prefix) holding the
    originals' parameters and buffers (the same tensors, not copies): parameter
    names, ``state_dict`` keys, optimizers built before the swap and
    ``save_pretrained``/``from_pretrained`` are unaffected.

    Every replacement is logged at INFO, every norm left alone (BatchNorm,
    a subclass with its own forward, an RMSNorm variant with a gate) at WARNING
    with the reason.  ``strict=True`` raises ``ValueError`` listing those instead,
    before anything is swapped.  ``report=True`` returns ``(module, NormReport)``.
    """
    replaced, left_alone, edits, memo = [], [], [], {}

    def visit(m, path):
        if id(m) in memo:
            return memo[id(m)]
        new = None
        if not isinstance(m, _OURS):
            if any(True for _ in m.children()):
                for name, child in m.named_children():
                    new_child = visit(child, f"{path}.{name}" if path else name)
                    if new_child is not None:
                        edits.append((m, name, new_child))
            else:
                plan = _plan(m)
                if plan is not None and plan[0] is not None:
                    new = plan[0].__new__(plan[0])
                    new.__dict__.update(m.__dict__)  # the same parameters, buffers, hooks, settings
                    replaced.append((path, type(m).__name__, plan[1]))
                elif plan is not None:
                    left_alone.append((path, type(m).__name__, plan[1]))
        memo[id(m)] = new
        return new

    root = visit(module, "")
    rep = NormReport(replaced, left_alone)
    if strict and left_alone:
        raise ValueError("replace_norms(strict=True) cannot replace every norm:\n"
                         + "\n".join(f"  {p or '(root)'} ({c}): {why}" for p, c, why in left_alone))
    for parent, name, new in edits:
        setattr(parent, name, new)
    for p, c, how in replaced:
        _log.info("replace_norms: %s (%s) -> %s", p or "(root)", c, how)
    for p, c, why in left_alone:
        _log.warning("replace_norms left %s (%s) alone: %s", p or "(root)", c, why)
    out = module if root is None else root
    return (out, rep) if report else out
