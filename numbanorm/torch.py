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

import logging
import re
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

import numbanorm as _nn

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
    """What ``replace_norms`` did: ``(path, class, how)`` per module replaced, ``(path, class, why)`` per norm left alone."""

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
