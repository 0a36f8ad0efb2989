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
backward from ``register_autograd``.  An eager call on plain tensors runs the
operator's implementation without the operator's dispatch (``_direct``), inside an
``autograd.Function`` with the operator's autograd formula where autograd records
a graph (``_recording``).  How tensors cross:

* CPU tensors are seen as NumPy arrays without a copy (through DLPack, which leaves
  the tensor's storage resizable: ``_validate.tensor_array``): a strided tensor becomes
  a strided view, which the frontend makes contiguous
  as it would any NumPy input; bfloat16 as an ``ml_dtypes.bfloat16`` view of
  the same bytes) and results come back with ``torch.from_numpy``, sharing memory;
* a small CPU call of a row norm (LayerNorm, RMSNorm, fused or not) with the shapes,
  dtypes and eps of an earlier call skips even the views: the row function runs on the
  tensors' addresses (``_torch_addressed``), into outputs that torch allocated;
* CUDA tensors are handed over as they are (detached): the GPU backend reads
  them through the CUDA array interface, queues the kernels on PyTorch's current
  stream and returns torch tensors.

Gradients for ``weight``/``bias`` are returned only where they require grad
(``ctx.needs_input_grad``); the kernels compute them in the same pass as dx
either way.  A backward that records its own graph (``create_graph=True``: a second
derivative) is the backward's formula in PyTorch's functions on the saved input, which
autograd differentiates again (``_differentiable``); the kernels have no derivative of
their own.  Under ``torch.func``'s transforms (``grad``, ``vjp``, ``jacrev``, ``jvp``,
``jacfwd``, ``hessian``, ``vmap``, ``functional_call``) and forward-mode AD, a call runs the
forward operator inside an ``autograd.Function`` that they take (``_transformable``): a
forward derivative of its own (``_tangent``), vmap rules that fold the mapped dimension
into the rows (``_register_vmap``), and the kernels' backward wherever no transform
differentiates it again (``_graph_needed``).  On DTensors (tensor and sequence
parallelism) each process normalizes its slice, as the operators' splits tell DTensor
(``_sharding``).

The modules subclass their ``torch.nn`` namesakes and replace only ``forward``,
so constructor arguments (``device``, ``dtype`` included), parameter names,
``reset_parameters``, ``extra_repr``, ``state_dict`` and ``isinstance`` checks
(weight-decay exclusions, say) are PyTorch's own.  ``replace_norms`` also
recognises the RMSNorm classes of Hugging Face ``transformers`` by what their
``forward`` computes (see there).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import inspect
import logging
import re
import sys
import warnings
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

import numbanorm as _numbanorm  # the top-level functions, dispatching on the arrays' side
from numbanorm import _api
from numbanorm import _torch_addressed as _addressed
from numbanorm import cpu as _cpu
from numbanorm import _validate as _V
from numbanorm.operations import ARRAY_ROLES, BY_NAME, OPERATIONS, generate

# the table's functions (generated below), then the classes written per norm
__all__ = [op.name for op in OPERATIONS] + ["LayerNorm", "RMSNorm", "GroupNorm", "replace_norms", "NormReport"]

_log = logging.getLogger(__name__)
_HALF = (torch.float16, torch.bfloat16)
# a scalar torch.compile traces as a symbol (dynamic=True): it has a value only when the operator runs
_SYMBOLIC = (torch.SymFloat, torch.SymInt)
_CPU = _cpu._frontend  # its shortcuts: the calls on host arrays it has seen before


# ------------------------------------------------------------ crossing

def _arr(t):
    """A tensor as numbanorm takes it: NumPy view (CPU) or the detached tensor (CUDA).

    Each test is the cheapest torch has for it (``is_cuda`` takes 0.1 us, ``device.type``
    0.4; the small calls of a decoder pay every one of them per tensor)."""
    if t is None:
        return None
    if t.is_cuda:
        return t.detach()
    if not t.is_cpu:
        raise TypeError(f"numbanorm.torch runs CPU and CUDA tensors, got one on {t.device}")
    return _V.tensor_array(t.detach() if t.requires_grad else t)


def _tensor(a):
    """A numbanorm result as a tensor, sharing memory."""
    if type(a) is np.ndarray:
        if a.dtype.kind == "f":  # (dtype.name, the test below, costs a microsecond a call)
            return torch.from_numpy(a)
        if a.dtype.name == "bfloat16":  # ml_dtypes: torch.from_numpy does not know it
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    if a is None or isinstance(a, torch.Tensor):
        return a
    return torch.as_tensor(a, device="cuda")  # a numba device array: CUDA array interface


def _tensors(results):
    return tuple(map(_tensor, results))


def _check_tensors(fn, optional, **args):
    """``TypeError`` for an argument that is neither a tensor nor None (None only where its
    name is ``optional``), or is a nested tensor (before any operator runs)."""
    for name, a in args.items():
        if a is None and name not in optional:
            raise TypeError(f"`{name}` must be a tensor, got None")
        if a is not None and not isinstance(a, torch.Tensor):
            kind = type(a).__name__ if type(a).__module__ == "builtins" else f"{type(a).__module__}.{type(a).__name__}"
            raise TypeError(f"`{name}` is a {kind}: numbanorm.torch.{fn} "
                            f"takes torch tensors (numbanorm.{fn} takes NumPy and CUDA arrays)")
        if a is not None and a.is_nested:
            raise TypeError(f"`{name}` is a nested tensor: numbanorm.torch.{fn} does not support nested tensors "
                            "(pad them into one tensor, or call it on each component)")
        if a is not None and a.layout is not torch.strided:
            raise TypeError(f"`{name}` is a torch.Tensor of layout {a.layout}: numbanorm.torch.{fn} takes "
                            f"strided tensors (`{name}.to_dense()`)")


def _shape(normalized_shape):
    """torch.Size, lists, tuples and ints alike, as the list of ints the operators' schema
    takes; anything else is numbanorm's ``TypeError`` here, on every path (the schema
    would refuse a float differently, or take a bool).  Sizes torch.compile traces as
    symbols pass as they are."""
    if isinstance(normalized_shape, _SYMBOLIC):
        return [normalized_shape]
    if isinstance(normalized_shape, (tuple, list)) and any(isinstance(d, _SYMBOLIC) for d in normalized_shape):
        return list(normalized_shape)
    if torch.compiler.is_compiling():  # (dynamo's sizes are plain ints here: an int check would pin each)
        shape = list(normalized_shape) if isinstance(normalized_shape, (tuple, list)) else [normalized_shape]
        if not any(type(d) is bool for d in shape):  # (a bool is a constant: its check pins nothing)
            return shape
    return list(_V._as_shape(normalized_shape))


def _ints(shape):
    """Whether ``shape`` is a tuple (a torch.Size too) of ints already, by type."""
    if not isinstance(shape, tuple):
        return False
    for d in shape:
        if type(d) is not int:
            return False
    return True


def _groups(num_groups):
    """``num_groups`` as an int, numbanorm's ``TypeError`` for anything else (a bool too)."""
    if isinstance(num_groups, _SYMBOLIC) or (torch.compiler.is_compiling() and type(num_groups) is not bool):
        return num_groups  # (as _shape's)
    return _V.integer("num_groups", num_groups)


# ------------------------------------------------------------ custom operators
#
# A forward and a backward operator for every operation of numbanorm's table
# (``numbanorm.operations``), made from its row.  The implementations call
# numbanorm's public functions and are the only place a tensor becomes a NumPy
# array; the fake implementations give torch.compile the outputs' shapes and
# dtypes as numbanorm's frontend makes them (fresh outputs in x's dtype, contiguous or
# in x's channels-last order: ``_like``; statistics in the accumulation dtype; dweight/dbias in the weight's
# dtype, or x's without a weight), after the errors numbanorm's validation finds in
# their shapes and dtypes (``_check_fake``).

# schema types of the roles that are not plain tensors (int lists are SymInt[]
# as torch infers them from ``list[int]``, so the schemas read as they always did)
_SCHEMA_TYPES = {"normalized_shape": "SymInt[]", "num_groups": "SymInt", "weight": "Tensor?",
                 "bias": "Tensor?", "ds": "Tensor?"}


def _schema(op, roles, outputs):
    types = dict(_SCHEMA_TYPES, eps="float" if op.eps is not None else "float?")  # None: machine epsilon
    args = ", ".join(f"{types.get(r, 'Tensor')} {r}" for r in roles)
    return f"({args}) -> ({', '.join(['Tensor'] * len(outputs))})"


def _acc(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _normalized(op):
    """The role a backward reads what was normalized from: x, or the fused norms' s = x + residual."""
    return "s" if op.fused else "x"


def _implementation(op, kind, roles):
    """The operator's kernel: numbanorm's public function of ``kind``, tensors crossing as
    views, ``normalized_shape`` as a tuple (a list, the schema's, cannot key the CPU
    backend's replay of a call seen before: every call took the full path).  A call the
    CPU backend has seen before goes to its shortcut (``cpu._backend.Plans``) without numbanorm's
    dispatch, which is the shortcut's own first step there too: the same bits.  Meta tensors
    get the fake implementation's outputs, as torch.nn's functions give meta outputs."""
    name = op.function(kind)
    arrays = tuple(i for i, r in enumerate(roles) if r in ARRAY_ROLES)
    shape = roles.index("normalized_shape") if "normalized_shape" in roles else None
    shortcut = _CPU.shortcut(op, kind)
    n = len(op.plain_outputs) if kind == "plain" else None
    optional = tuple(r for r in roles if _SCHEMA_TYPES.get(r) == "Tensor?")
    small = _addressed.Calls(op, kind, roles, optional) if _addressed.covers(op) else None
    fake = (_fake_backward if kind == "backward" else _fake_forward)(op)

    def full(key, given):
        """The call without a plan (``key``: its small-call key, learnt from it, or None)."""
        if given[0].is_meta:
            got = fake(*given)
            return got[0] if n == 1 else got[:n] if n else got
        args = list(given)
        for i in arrays:
            try:
                args[i] = _arr(args[i])
            except (BufferError, RuntimeError):  # DLPack's refusal (a sparse tensor's) names no argument
                called = _input_name(op, roles[i])
                _check_tensors(op.name, (called,), **{called: given[i]})  # the general path's TypeError
                _V.host_array(roles[i], given[i].detach())
                raise
        if shape is not None:
            args[shape] = tuple(args[shape])
        if shortcut is not None and type(args[0]) is np.ndarray:
            got = shortcut(*args)
            if got is not None:
                got = _tensor(got[0]) if n == 1 else _tensors(got[:n] if n else got)
        else:
            got = None
        if got is None:
            got = getattr(_numbanorm, name)(*args)  # looked up per call, as a written-out call would be
            got = _tensors(got) if isinstance(got, tuple) else _tensor(got)  # (a plain call's y alone)
        if key is not None:
            small.learn(key, given, got)
        return got

    if small is not None:  # a small CPU call seen before: by its tensors' addresses
        implementation = small.implementation(full)
    else:
        def implementation(*args):
            return full(None, args)
    implementation.__name__ = name
    implementation.small, implementation.full = small, full
    return implementation


class _Unviewed:
    """The frontend's validation (``Frontend._check_forward``/``_check_backward``: every
    contract error) on tensors as they are, for the operators' fake implementations: it reads
    shapes and dtypes only, which is all a meta or fake tensor has."""

    sides_checked = True  # (the devices: _check_fake's)
    _check_forward = _api.Frontend._check_forward
    _check_backward = _api.Frontend._check_backward

    @staticmethod
    def _native(roles, given):
        return {r: given[r] for r in roles}


_UNVIEWED = _Unviewed()


def _check_fake(op, kind, args):
    """The errors a call on real tensors would raise, raised by a fake implementation (meta
    tensors, FakeTensorMode, torch.compile's tracing) before it makes any output: numbanorm's
    validation on the shapes and dtypes, and the devices' check.  Sizes or an eps that
    torch.compile traces as symbols are checked by the operator on their values (validating
    them here would specialize them), their tensors' dtypes here."""
    roles, arrays = (op.backward_roles, op.backward_arrays) if kind == "backward" else (op.forward_roles,
                                                                                        op.forward_arrays)
    given = dict(zip(roles, args))
    first = _normalized(op) if kind == "backward" else "x"
    x = given[first]
    tensors = [(r, given[r]) for r in arrays if given[r] is not None]
    for name, t in tensors:
        if t.device != x.device:
            if t.device.type != x.device.type:  # as a CPU tensor with a CUDA one: common_side's TypeError
                raise TypeError(f"`{name}` is on {t.device} but `{first}` is on {x.device}: all tensors of one "
                                "call must be on the same device (nothing is copied between devices)")
            _V.one_device({first: x.device.index, name: t.device.index})
    scalars = [given.get(op.shape_role), given.get("eps")]
    if isinstance(scalars[0], (list, tuple)):
        scalars = [*scalars[0], scalars[1]]
    if any(isinstance(v, _SYMBOLIC) for v in scalars) or any(
            isinstance(d, _SYMBOLIC) for _, t in tensors for d in t.shape):
        for name, t in tensors:
            _V.float_dtype(name, t)
    elif kind == "backward":
        _UNVIEWED._check_backward(op, args)
    else:
        _UNVIEWED._check_forward(op, (*args, None))  # (no out=)


def _fake_forward(op):
    def fake(*args):
        _check_fake(op, "forward", args)
        given = dict(zip(op.forward_roles, args))
        x = given["x"]
        if op.layout == "rows":  # keep-dims statistics
            k = len(given["normalized_shape"])
            stat = tuple(x.shape[:x.dim() - k]) + (1,) * k
        else:
            stat = (x.shape[0], given["num_groups"])
        return (*(_like(op, x) for _ in op.plain_outputs),
                *(x.new_empty(stat, dtype=_acc(x)) for _ in op.stats))

    return fake


def _like(op, x):
    """An output of x's shape and dtype as numbanorm's frontend makes it: in channels-last
    order where the CPU backend takes x in it (``numbanorm.cpu._backend.order_of``: GroupNorm,
    4 or 5 dimensions, channels-last and not contiguous; torch's CPU group_norm keeps it too),
    else contiguous."""
    if (op.layout == "groups" and x.device.type == "cpu" and x.dim() in (4, 5) and not x.is_contiguous()
            and x.movedim(1, -1).is_contiguous()):
        return x.new_empty((x.shape[0], *x.shape[2:], x.shape[1])).movedim(-1, 1)
    return x.new_empty(x.shape)


def _fake_backward(op):
    def fake(*args):
        _check_fake(op, "backward", args)
        given = dict(zip(op.backward_roles, args))
        x, weight = given[_normalized(op)], given["weight"]
        shape = tuple(given["normalized_shape"]) if op.layout == "rows" else (x.shape[1],)
        dtype = weight.dtype if weight is not None else x.dtype
        return (_like(op, x), *(x.new_empty(shape, dtype=dtype) for _ in op.backward_outputs[1:]))

    return fake


def _saved(op):
    """The roles a forward saves for its backward: what was normalized, the weight, the
    statistics.  (The fused norms' s is an output: saving it keeps autograd's check that
    nobody modified it in place before the backward reads it.)"""
    return (_normalized(op), "weight", *op.stats)


def _register_autograd(op, forward):
    """The forward operator's gradient is the backward operator (:func:`_backward`), on the
    saved input and statistics; returns ``(setup_context, grad)``, which an eager call that
    records a graph uses too (:func:`_recording`)."""
    k = len(op.plain_outputs)
    si = op.forward_roles.index("normalized_shape") if op.layout == "rows" else None
    ei = op.forward_roles.index("eps")
    # each saved role's place: (1, its index) among the outputs, else (0, among the inputs)
    where = [(1, op.forward_outputs.index(r)) if r in op.forward_outputs else (0, op.forward_roles.index(r))
             for r in _saved(op)]

    # the recording Function's calls by their plan keep LayerNorm's two statistics on ctx, not
    # saved (_torch_addressed); its other calls do too, so that every call saves the same
    # tensors (activation checkpointing recomputes a forward and counts them)
    kept = len(op.stats) if len(op.stats) == 2 and _addressed.covers(op) else 0

    def setup_context(ctx, inputs, output, outputs_stats=True):
        stats = output[k:]
        saved = [(inputs, output)[side][i] for side, i in where]
        if outputs_stats:  # (the recording Function's outputs are the plain function's: _recording)
            ctx.mark_non_differentiable(*stats)
        elif kept:
            saved, ctx.stats = saved[:-kept], tuple(saved[-kept:])
        ctx.save_for_backward(*saved)
        ctx.normalized_shape = None if si is None else inputs[si]
        ctx.eps = inputs[ei]
        if op.fused:
            ctx.set_materialize_grads(False)  # an unused y or s sends None, not zeros

    # each forward input's gradient: 0 is dx (also d(residual)), 1 and 2 dweight and dbias
    source = tuple(0 if r in ("x", "residual") else 1 + op.params.index(r) if r in op.params else None
                   for r in op.forward_roles)

    def grad(ctx, *grads):
        x, weight, *stats = ctx.saved_tensors
        if len(stats) < len(op.stats):  # kept on ctx: one tensor where a call by its plan made both
            stats = ctx.stats if type(ctx.stats) is tuple else ctx.stats.unbind()
        recording = torch.is_grad_enabled()
        if op.fused and grads[0] is None:  # only s was used downstream: y's norm contributes nothing
            got = (grads[1],)
        elif recording and _graph_needed(x, weight, *grads):
            got = _differentiable(op, ctx, grads, x, weight, stats)
        else:
            values = {"dy": grads[0], "ds": grads[1] if op.fused else None, _normalized(op): x, "weight": weight,
                      "normalized_shape": ctx.normalized_shape, **dict(zip(op.stats, stats))}
            args = [values[r] for r in op.backward_roles]
            if recording:  # a graph of nothing: the operator outside autograd (torch.func's wrappers too)
                with torch.no_grad():
                    got = _backward(op, args)
            else:
                got = _backward(op, args)
        return tuple(None if i is None or not need or i >= len(got) else got[i]
                     for i, need in zip(source, ctx.needs_input_grad))

    forward.register_autograd(grad, setup_context=setup_context)
    return setup_context, grad


def _graph_needed(*tensors):
    """Whether a backward that runs in grad mode must record a graph of itself: in eager
    mode (``create_graph=True``), where one of its ``tensors`` needs a gradient; under
    torch.func, which asks every backward for a graph, where a transform outside this one
    differentiates (``grad``, ``jvp``: a second derivative), or plain autograd does (a
    tensor needs a gradient under every transform's wrapper).  Elsewhere the kernels: a
    ``torch.func.grad`` or a per-sample ``vmap(grad)`` takes a first derivative from them."""
    stack = _INTERPRETERS() if _INTERPRETERS is not None else None
    if stack:
        if any(i.key() in _DIFFERENTIATING for i in stack[:-1]):
            return True
        unwrapped = []
        for t in tensors:
            while t is not None and _WRAPPED(t):
                t = _UNWRAPPED(t)
            unwrapped.append(t)
        tensors = unwrapped
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def _functorch_stack():
    """``(interpreter stack, is wrapped, unwrapped, differentiating kinds)`` of torch.func,
    from torch's private API, or Nones where this torch lacks one (every backward in grad
    mode then records a graph)."""
    try:
        ft = torch._C._functorch
        return (ft.get_interpreter_stack, ft.is_functorch_wrapped_tensor, ft.get_unwrapped,
                (ft.TransformType.Grad, ft.TransformType.Jvp))
    except AttributeError:
        return None, None, None, ()


_INTERPRETERS, _WRAPPED, _UNWRAPPED, _DIFFERENTIATING = _functorch_stack()
# (torch._vmap_internals' batched tensors: a torch without the test has none to meet)
_LEGACY_BATCHED = getattr(getattr(torch._C, "_functorch", None), "is_legacy_batchedtensor", lambda t: False)


def _differentiable(op, ctx, grads, z, weight, stats):
    """``(dz, dweight[, dbias])`` of a backward whose own graph autograd records
    (``create_graph=True``: a second derivative, a gradient penalty; torch.func's
    transforms): the backward's formula written in PyTorch's functions, the statistics
    taken again from the saved input so that they too are functions of it, which autograd
    and every transform can differentiate again.  Not the kernels: they have no derivative
    of their own.  With ``wdy = weight * dy`` and ``xhat`` as :func:`_tangent`'s,
    ``dz = rstd * (wdy - mean(wdy) - xhat * mean(wdy * xhat))`` (RMSNorm without the
    ``mean(wdy)``), ``dweight = sum(dy * xhat)``, ``dbias = sum(dy)``."""
    dy, base = grads[0], op.name.removeprefix("add_")
    acc = _acc(z)
    eps = torch.finfo(acc).eps if ctx.eps is None else ctx.eps  # (numbanorm's default)
    zs, dys, ps, dims, summed = _grouped(z, dy.to(acc), ctx.normalized_shape, stats)
    if base == "rms_norm":
        rstd = torch.rsqrt((zs * zs).mean(dims, keepdim=True) + eps)
        xhat = zs * rstd
    else:
        centred = zs - zs.mean(dims, keepdim=True)
        rstd = torch.rsqrt((centred * centred).mean(dims, keepdim=True) + eps)
        xhat = centred * rstd
    wdy = dys if weight is None else (dys.reshape(z.shape) * weight.to(acc).reshape(ps)).reshape(zs.shape)
    inner = wdy - xhat * (wdy * xhat).mean(dims, keepdim=True)
    if base != "rms_norm":
        inner = inner - wdy.mean(dims, keepdim=True)
    dz = (rstd * inner).reshape(z.shape).to(z.dtype)
    if op.fused and grads[1] is not None:  # s's own gradient, added as the kernels add ds
        dz = dz + grads[1]
    dys = dys.reshape(z.shape)
    total = (lambda t: t.sum(summed)) if summed else (lambda t: t)  # (sum over no dimension: sum([]) sums all)
    grad_dtype = z.dtype if weight is None else weight.dtype  # the kernels' (Frontend._grad_dtype)
    dw = total(dys * xhat.reshape(z.shape)).to(grad_dtype)
    if "bias" not in op.params:
        return dz, dw
    return dz, dw, total(dys).to(grad_dtype)  # (not dy's: a 16-bit dy rounded a float32 bias's sums)


def _grouped(z, t, normalized_shape, stats):
    """``(zs, ts, ps, dims, summed)``: ``z`` in the accumulation dtype and ``t`` (of z's
    shape) as the normalized elements lie, the shape a parameter broadcasts to against z,
    the dimensions of zs that are normalized over, and those of z a parameter's gradient
    sums over.  Rows: z's own shape, its trailing ``normalized_shape``; groups (N, C, *):
    (N, G, C/G * spatial), the statistics' (N, G) saying G."""
    zs = z.to(_acc(z))
    if normalized_shape is None:
        n, groups = stats[0].shape
        ps = (1, z.shape[1]) + (1,) * (z.dim() - 2)
        return zs.reshape(n, groups, -1), t.reshape(n, groups, -1), ps, (2,), [d for d in range(z.dim()) if d != 1]
    k = len(normalized_shape)
    ps = (1,) * (z.dim() - k) + tuple(normalized_shape)
    return zs, t, ps, tuple(range(z.dim() - k, z.dim())), list(range(z.dim() - k))


def _saved_xhat(op, zs, stats):
    """``(xhat, rstd)`` of ``zs`` (laid out by :func:`_grouped`) from the saved statistics:
    ``(zs - mean) * rstd``, RMSNorm's ``zs * rstd``; GroupNorm's (N, G) broadcast over
    each group's elements."""
    if op.layout == "groups":
        stats = [t.unsqueeze(-1) for t in stats]
    rstd = stats[-1]
    return ((zs - stats[0]) * rstd if len(stats) == 2 else zs * rstd), rstd


def _recording(op, setup_context, grad):
    """``apply(*args)``: ``op``'s forward in an eager call that records an autograd graph,
    as an ``autograd.Function`` around the forward operator's implementation, with the
    operator's autograd formula.  The operator's dispatch, several times the whole call of
    torch's own LayerNorm, does nothing more for a plain tensor in eager mode.  It returns
    the plain function's outputs (y, or y and s): the statistics are saved for the
    backward, not returned (autograd pays for every output of a Function)."""
    forward_implementation = _IMPLEMENTATIONS[op.name, "forward"]
    k = len(op.plain_outputs)
    small = forward_implementation.small
    if small is not None:  # (its small calls, generated: their own ctx saves written out)
        forward = small.implementation(forward_implementation.full, (_saved(op), setup_context, k))
    else:
        def forward(ctx, *args):
            output = forward_implementation(*args)
            setup_context(ctx, args, output, outputs_stats=False)
            return output[0] if k == 1 else output[:k]

    # the class attributes that apply looks up by name on every call, in the class's own dict: found
    # on its bases, each lookup walked three dicts of its MRO
    base = getattr(torch.autograd.function, "_SingleLevelFunction", object).__dict__
    looked_up = {a: base[a] for a in ("setup_context", "clear_saved_tensors_on_access", "boxed_grads_call")
                 if a in base}
    function = type(f"{op.name}_graph", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(grad),
                     "__module__": __name__, **looked_up})
    try:  # the C apply: Function.apply's Python checks are for functorch's wrappers, which go to the operator
        return torch._C._FunctionBase.__dict__["apply"].__get__(None, function)
    except (AttributeError, KeyError):
        return function.apply


def _tangent(op, ctx, tangents):
    """The forward-mode derivative of ``op``'s forward (``jvp``): the tangent of each output
    from the tangents of the inputs (None where an input has none), in PyTorch's functions
    on the saved input and statistics, in the accumulation dtype.  With
    ``xhat = (z - mean) * rstd`` (RMSNorm: ``z * rstd``) over the normalized elements,
    ``d xhat = rstd * (dz - mean(dz) - xhat * mean(xhat * dz))`` (RMSNorm without the
    ``mean(dz)``), and ``dy = d xhat * weight + xhat * dweight + dbias``."""
    given = dict(zip(op.forward_roles, tangents))
    z, weight, *stats = ctx.saved_tensors  # (save_for_forward's, in a jvp)
    dz = given["x"]
    if op.fused:  # s = x + residual
        dz = given["residual"] if dz is None else dz if given["residual"] is None else dz + given["residual"]
    acc = _acc(z)
    zs, dzs, ps, dims, _ = _grouped(z, z if dz is None else dz, ctx.normalized_shape, stats)  # (dzs: dz's)
    xhat, rstd = _saved_xhat(op, zs, stats)
    dy = None
    if dz is not None:
        dzs = dzs.to(acc)
        centred = dzs - dzs.mean(dims, keepdim=True) if len(stats) == 2 else dzs
        dy = (rstd * (centred - xhat * (xhat * dzs).mean(dims, keepdim=True))).reshape(z.shape)
        if weight is not None:
            dy = dy * weight.to(acc).reshape(ps)
    for role, term in (("weight", lambda t: xhat.reshape(z.shape) * t.to(acc).reshape(ps)),
                       ("bias", lambda t: t.to(acc).reshape(ps).expand(z.shape))):
        if given.get(role) is not None:
            dy = term(given[role]) if dy is None else dy + term(given[role])
    dy = None if dy is None else dy.to(z.dtype)
    if op.fused and dz is None:  # s = x + residual is constant in the weight and bias: autograd takes no None
        dz = torch.zeros_like(z)
    return ((dy, dz) if op.fused else (dy,)) + (None,) * len(op.stats)


def _transformable(op, forward_operator, setup_context, grad):
    """``apply(*args)``: ``op``'s forward operator as an ``autograd.Function`` that
    torch.func's transforms take (``grad``, ``vjp``, ``jacrev``, ``jvp``, ``jacfwd``,
    ``hessian``, ``vmap`` of any of them) and forward-mode AD (``torch.autograd.forward_ad``):
    the operator's own autograd formula cannot be transformed (PyTorch's custom operators
    register it without ``setup_context``) and has no forward derivative.  Its vmap rule is
    generated from these functions, whose operator calls meet the operators' own vmap rules
    (:func:`_register_vmap`).  The backward is the operator's formula
    (:func:`_register_autograd`): the kernels, or PyTorch's functions where a transform
    differentiates it again (:func:`_graph_needed`); the forward derivative, :func:`_tangent`."""
    stats = len(op.stats)

    def forward(*args):
        return forward_operator(*args)

    def setup(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        z = output[1] if op.fused else inputs[0]
        ctx.save_for_forward(z, inputs[op.forward_roles.index("weight")], *output[len(output) - stats:])

    def jvp(ctx, *tangents):
        return _tangent(op, ctx, tangents)

    function = type(f"{op.name}_transformable", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "setup_context": staticmethod(setup),
                     "backward": staticmethod(grad), "jvp": staticmethod(jvp), "generate_vmap_rule": True,
                     "__module__": __name__})
    return function.apply


def _register_vmap(op, forward, backward):
    """``torch.func.vmap`` rules for ``op``'s operators: the mapped dimension folded into the
    rows (a row norm's leading dimensions; GroupNorm's samples), one call for the whole
    batch.  The backward's parameter gradients are per sample under vmap while the operator
    sums them over all its rows, so the rule takes dx from the operator and each sample's
    ``dweight = sum(dy * xhat)`` and ``dbias = sum(dy)`` with PyTorch's reductions, on the
    saved statistics.  Parameters that are themselves mapped (an ensemble's) take one call
    a sample."""
    rows_in = {"forward": ("x", "residual"), "backward": ("dy", "ds", _normalized(op), *op.stats)}
    groups = op.layout == "groups"

    def rule(kind, operator, roles):
        def vmap_rule(info, in_dims, *args):
            size = info.batch_size
            dims = dict(zip(roles, in_dims))
            if any(dims.get(r) is not None for r in op.params):
                return _per_sample(operator, args, in_dims, size)
            given = dict(zip(roles, args))
            for r in rows_in[kind]:  # each at dimension 0, of the batch's size
                t = given.get(r)
                if t is not None:
                    # (an unmapped one repeated, in memory of its own: the kernels read rows, not strides of 0)
                    t = t.expand(size, *t.shape).contiguous() if dims[r] is None else t.movedim(dims[r], 0)
                    given[r] = t.reshape(-1, *t.shape[2:]) if groups else t  # (B, N, ...) -> (B * N, ...)
            out = operator(*(given[r] for r in roles))
            if kind == "backward":
                out = (out[0], *_sample_param_grads(op, given, out, size))
            if groups:  # back to (B, N, ...): the outputs of a sample's shape
                out = tuple(t.reshape(size, -1, *t.shape[1:]) if k == 0 or kind == "forward" else t
                            for k, t in enumerate(out))
            return tuple(out), (0,) * len(out)
        return vmap_rule

    torch.library.register_vmap(forward, rule("forward", forward, op.forward_roles))
    torch.library.register_vmap(backward, rule("backward", backward, op.backward_roles))


def _per_sample(operator, args, in_dims, size):
    """A vmap rule's last resort: the operator on each sample, its outputs stacked."""
    outs = [operator(*(a.select(d, i) if isinstance(a, torch.Tensor) and d is not None else a
                       for a, d in zip(args, in_dims))) for i in range(size)]
    return tuple(torch.stack(ts) for ts in zip(*outs)), (0,) * len(outs[0])


def _sample_param_grads(op, given, out, size):
    """Each sample's ``(dweight[, dbias])`` of a vmapped backward (``_register_vmap``), its
    batch at dimension 0 of ``given``'s row tensors (GroupNorm's folded into its samples),
    in the dtype of the operator's own."""
    z, dy = given[_normalized(op)], given["dy"]
    stats = [given[r] for r in op.stats]
    shape = given.get("normalized_shape")
    zs, dys, _, _, _ = _grouped(z, dy.to(_acc(z)), shape, stats)
    xhat, _ = _saved_xhat(op, zs, stats)
    # each sample's elements of one parameter in a dimension: (B, rows, *normalized_shape)
    # or (B, N, C, spatial), summed over the others
    split, by = ((size, -1, *shape), 1) if shape is not None else ((size, -1, z.shape[1], z[0, 0].numel()), (1, 3))
    dys = dys.reshape(split)
    grads = [(dys * xhat.reshape(split)).sum(by).to(out[1].dtype)]
    if len(out) > 2:
        grads.append(dys.sum(by).to(out[2].dtype))
    return grads


def _refuse_tangents(custom):
    """An error, not a tangent of zero, where ``custom`` meets an input with a forward-mode
    tangent: PyTorch's custom operators have no forward derivative, and their autograd
    kernel drops the tangent without a word.  The public functions take forward-mode AD
    eagerly (:func:`_transformable`); calls that reach the operator with a tangent are
    ``torch.compile`` or ``torch.export`` tracing ``torch.func.jvp``/``jacfwd`` or a
    ``dual_level``, and ``torch.ops.numbanorm`` called directly.  The kernel wraps the
    operator's own (its backward formula, :func:`_register_autograd`) for the devices
    numbanorm runs on (a backend's Autograd key is taken before the alias, so nothing is
    overridden); where this torch lacks the function that makes it, calls go as before."""
    try:
        from torch._library.autograd import make_autograd_impl
        autograd_kernel = make_autograd_impl(custom._opoverload, custom)
    except (ImportError, AttributeError, TypeError):
        return
    name = custom._opoverload.__name__.split(".")[0]

    def kernel(keyset, *args):
        if _FORWARD_AD._current_level >= 0 and torch._C._is_fwd_grad_enabled():
            for a in args:
                if isinstance(a, Tensor) and _FORWARD_AD.unpack_dual(a).tangent is not None:
                    raise NotImplementedError(
                        f"torch.ops.numbanorm.{name} has no forward derivative (PyTorch's custom operators "
                        "have none): numbanorm.torch's public functions take torch.func.jvp, jacfwd and "
                        "forward-mode AD eagerly, but not traced by torch.compile or torch.export "
                        "(run the transform outside them, or under torch.compiler.disable)")
        return autograd_kernel(keyset, *args)

    for key in ("AutogradCPU", "AutogradCUDA"):
        _LIBRARY.impl(name, kernel, key, with_keyset=True)


_LIBRARY = torch.library.Library("numbanorm", "FRAGMENT")  # (_refuse_tangents's kernels)


def _operators(op):
    """``(forward, backward)`` custom operators of ``op``, ``torch.ops.numbanorm.<name>_forward`` and so on."""
    made = []
    for kind, roles, outputs, fake in (("forward", op.forward_roles, op.forward_outputs, _fake_forward(op)),
                                       ("backward", op.backward_roles, op.backward_outputs, _fake_backward(op))):
        implementation = _IMPLEMENTATIONS[op.name, kind] = _implementation(op, kind, roles)
        if kind == "forward":  # the plain function, for an eager call that needs no statistics
            _IMPLEMENTATIONS[op.name, "plain"] = _implementation(op, "plain", roles)
        custom = torch.library.custom_op(f"numbanorm::{op.function(kind)}", implementation,
                                         mutates_args=(), schema=_schema(op, roles, outputs))
        custom.register_fake(fake)
        made.append(custom)
    for custom in made:
        _refuse_tangents(custom)
    formula = _register_autograd(op, made[0])
    _RECORDING[op.name] = _recording(op, *formula)
    _TRANSFORMABLE[op.name] = _transformable(op, made[0], *formula)
    _register_vmap(op, *made)
    return tuple(made)


_IMPLEMENTATIONS = {}  # (name, kind) -> the operator's implementation, which _direct calls may run
_RECORDING = {}  # name -> the apply of the forward as an autograd.Function (_recording)
_TRANSFORMABLE = {}  # name -> the apply of the forward operator as torch.func takes it (_transformable)
_OPERATORS = {op.name: _operators(op) for op in OPERATIONS}


# ------------------------------------------------------------ DTensor

_SIZES = ("normalized_shape", "num_groups", "eps")


def _sharding(op, kind, names, outputs):
    """The shardings DTensor may run ``op``'s ``kind`` operator under, as ``(outputs'
    placements, arguments' placements)`` pairs: everything replicated, or every array
    split along one dimension its norm does not reduce over (any batch dimension of a row
    norm, the batch one of group norm; a row norm's statistics keep x's dimensions), with
    weight and bias replicated.  A backward's dweight and dbias are then partial sums,
    which DTensor adds across the shards (tensor and sequence parallelism)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    def shardings(*args):
        given = dict(zip(names, args))
        kept = 1 if op.layout == "groups" else args[0].ndim - len(given["normalized_shape"])
        split = [Replicate()] + [Shard(d) for d in range(kept)]
        return [([p] * outputs if kind == "forward" or p == Replicate() else [p] + [Partial()] * (outputs - 1),
                 [None if given[n] is None or n in _SIZES else Replicate() if n in op.params else p for n in names])
                for p in split]
    return shardings


def _register_sharding():
    """Register :func:`_sharding` for every operator with DTensor."""
    from torch.distributed.tensor.experimental import register_sharding

    for op in OPERATIONS:
        for custom in _OPERATORS[op.name]:
            schema = custom._opoverload._schema
            register_sharding(custom._opoverload)(_sharding(
                op, "forward" if custom is _OPERATORS[op.name][0] else "backward",
                [a.name for a in schema.arguments], len(schema.returns)))


class _ShardingOnImport(importlib.abc.MetaPathFinder):
    """Registers the operators' splits as ``torch.distributed.tensor`` is imported after this
    module: importing it takes most of a second, which a user without DTensors should not
    pay, and a call cannot register them where torch.compile traces it."""

    def find_spec(self, name, path, target=None):
        if name != "torch.distributed.tensor":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # (by the finders after this one)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister:
    """A module's loader that registers the splits once the module is executed."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self._loader  # (this one leaves no trace)
        try:
            _register_sharding()
        except Exception as e:  # (a torch whose DTensor API moved: DTensor calls raise torch's error)
            warnings.warn(f"numbanorm.torch could not register its operators' splits with DTensor: {e!r}",
                          RuntimeWarning, stacklevel=2)


if "torch.distributed.tensor" in sys.modules:
    _register_sharding()
elif torch.distributed.is_available():
    sys.meta_path.insert(0, _ShardingOnImport())


def _plain_eager_checks():
    """The checks of :func:`_direct` that read torch's private state, or None where this
    torch lacks one of them (every call then goes through its operator)."""
    try:
        torch.autograd.forward_ad._current_level  # (_FORWARD_AD's, read on every call)
        return (torch._C._is_torch_function_mode_enabled, torch._C._len_torch_dispatch_stack,
                torch._C._autograd._profiler_enabled, torch._C._functorch.is_functorch_wrapped_tensor,
                torch._C._are_functorch_transforms_active, torch._C._is_tracing)
    except AttributeError:
        return None


def _device_context_reader():
    """``(the function mode stack's depth, its mode at a depth, DeviceContext)``, or None
    where this torch lacks one of them."""
    try:
        from torch.utils._device import DeviceContext
        return torch._C._len_torch_function_stack, torch._C._get_function_stack_at, DeviceContext
    except (ImportError, AttributeError):
        return None


_CHECKS = _plain_eager_checks()
_DEVICE_CONTEXT = _device_context_reader() if _CHECKS is not None else None
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FORWARD_AD = torch.autograd.forward_ad  # its _current_level: -1 outside every dual_level


def _device_context_only():
    """Whether the one torch function mode on is a device context (``with torch.device(...)``,
    ``torch.set_default_device``).  It names a device for factory calls that name none,
    which the implementation does not make, so a call may skip the operator; it runs with
    torch functions off (:func:`_general`, :func:`_unmoded`), as the operator turns the
    mode off around its implementation, and as the mode's Python handler would otherwise
    run on each of its tensor calls (see the design log)."""
    return (_DEVICE_CONTEXT is not None and _CHECKS[0]() and _DEVICE_CONTEXT[0]() == 1
            and type(_DEVICE_CONTEXT[1](0)) is _DEVICE_CONTEXT[2])


def _unmoded(function, args):
    """``function(*args)``, with torch function modes off where one is on (a device
    context alone, where the call skips the operator: :func:`_device_context_only`)."""
    if _CHECKS[0]():
        with torch._C.DisableTorchFunction():
            return function(*args)
    return function(*args)


def _watched():
    """Whether every call now goes through its operator: see :func:`_direct`."""
    if _CHECKS is None or torch.compiler.is_compiling():
        return True
    function_modes, dispatch_modes, profiling, _, transforms, tracing = _CHECKS
    return bool((function_modes() and not _device_context_only()) or dispatch_modes() or profiling()
                or transforms() or tracing() or _FORWARD_AD._current_level >= 0)


def _transformed(args):
    """Whether a call runs under one of torch.func's transforms, on a tensor one of them
    wrapped, or where forward-mode AD may have given a tensor a tangent: the calls that
    :func:`_transformable`'s Function takes, which the operator's own autograd cannot
    (``torch.compile`` traces the operator, as before)."""
    if _CHECKS is None or torch.compiler.is_compiling():
        return False
    if _FORWARD_AD._current_level >= 0:
        return True
    if _CHECKS[4]():
        # vmap alone, with no gradient to record: the operator and its vmap rule, without
        # the Function's generated rule around them (which doubled a (32, 128, 768) forward)
        stack = _INTERPRETERS() if _INTERPRETERS is not None else None
        return not stack or any(i.key() in _DIFFERENTIATING for i in stack) or _records(args)
    wrapped = _CHECKS[3]
    for a in args:
        if isinstance(a, torch.Tensor) and wrapped(a):
            return True
    return False


def _direct(args):
    """Whether a call may run its operator's implementation without the operator.

    A custom operator's dispatch costs about 100 us a call (a (1, 768) forward took 110 us
    through it, 5.5 us on NumPy arrays), which is all of a decoder's per-token norm.  An
    eager call on plain tensors gets nothing from it: the same implementation runs either
    way, and where autograd records a graph, it records the operator's formula around the
    implementation (:func:`_recording`).  Anything else goes through the operator:
    ``torch.compile`` tracing, a tensor subclass or functorch wrapper (``vmap``), and
    a call that something watches for operators: an active torch function or dispatch
    mode (FlopCounterMode; not a device context alone: :func:`_device_context_only`) or
    torch's profiler, whose tables should show numbanorm's operators as they always did,
    and ``torch.jit.trace``, which records operators: a call without one would be traced
    as a constant output.
    """
    if _watched():
        return False
    wrapped = _CHECKS[3]
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN or wrapped(a)):
            return False
    return True


def _records(args):
    """Whether autograd records a call on ``args``: grad mode on and a tensor needing a gradient."""
    if torch.is_grad_enabled():
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                return True
    return False


def _backward(op, args):
    """``op``'s backward operator on ``args`` (its schema's order), or, where :func:`_direct`
    allows, the operator's implementation itself.  (A backward that records a graph of
    itself does not come here: :func:`_differentiable`.)"""
    if _direct(args):
        try:
            return _unmoded(_IMPLEMENTATIONS[op.name, "backward"], args)
        except RuntimeError:
            # a gradient batched by torch's legacy vmap (is_grads_batched, jacobian(vectorize=True),
            # gradcheck's batched check) has no memory to view: it goes to the operator, whose
            # batching fallback runs each sample; found by its failure (before any kernel runs),
            # which a check up front would have charged every backward
            if not any(isinstance(a, Tensor) and _LEGACY_BATCHED(a) for a in args):
                raise
    return _OPERATORS[op.name][1](*args)


#: every operator this module registers, for ``torch.library.opcheck`` and the curious
OPERATORS = tuple(custom for pair in _OPERATORS.values() for custom in pair)


# ------------------------------------------------------------ functional

def _input_name(op, role):
    """torch.nn.functional calls x ``input``; the fused functions keep numbanorm's names."""
    return "input" if role == "x" and not op.fused else role


def _general(op, args):
    """A public function's call (:func:`_functional_of`) on anything: every check of the
    arguments, then the operator, the recording Function or the plain implementation, as
    :func:`_direct` and :func:`_records` decide."""
    given = dict(zip(op.forward_roles, args))
    others = [given[r] for r in op.forward_arrays if given[r] is not None and not isinstance(given[r], Tensor)]
    if others and torch.overrides.has_torch_function(others):  # torch.fx's Proxy: traced as a call of this function
        return torch.overrides.handle_torch_function(_FUNCTIONS[op.name], others, *args)
    if (not torch.compiler.is_compiling() and _device_context_only()
            and all(given[r] is None or type(given[r]) in _PLAIN for r in op.forward_arrays)):
        return _unmoded(_FUNCTIONS[op.name], args)  # the whole call, its checks too, without the mode's handler
    _check_tensors(op.name, op.params, **{_input_name(op, r): given[r] for r in op.forward_arrays})
    if op.layout == "rows":
        given["normalized_shape"] = _shape(given["normalized_shape"])
    else:
        given["num_groups"] = _groups(given["num_groups"])
    eps = given["eps"]
    if isinstance(eps, Tensor) and eps.dim() == 0 and not eps.requires_grad:
        given["eps"] = eps.item()  # torch.nn.functional's parser takes such a tensor as its value
    if not isinstance(given["eps"], _SYMBOLIC):  # (symbolic: checked by the operator, on its value)
        given["eps"] = _V.real_eps(given["eps"], allow_none=op.eps is None)
    args = op.args("forward", given)
    if not op.fused and not torch.compiler.is_compiling() and given["x"].is_inference() and _records(args):
        given["x"] = given["x"].clone()  # autograd saves no inference tensor (_functional_of)
        args = op.args("forward", given)
    n = len(op.plain_outputs)
    if not _direct(args):
        results = (_TRANSFORMABLE[op.name] if _transformed(args) else _OPERATORS[op.name][0])(*args)
    elif _records(args):
        return _RECORDING[op.name](*args)
    else:  # no graph to record: the plain function, without the statistics
        return _IMPLEMENTATIONS[op.name, "plain"](*args)
    return results[0] if n == 1 else tuple(results[:n])


_X = re.compile(r"(?<![\w.])x(?![\w(])")


def _named_input(e):
    """``e``'s message with x, the checks' name for the input, as torch.nn.functional's
    parameter is named: ``input``.  (Not while Dynamo traces: it sets no exception's args.)"""
    if (type(e) in (TypeError, ValueError) and len(e.args) == 1 and isinstance(e.args[0], str)
            and not torch.compiler.is_compiling()):
        e.args = (_X.sub("input", e.args[0]),)


def _functional_of(op):
    """The public function of ``op`` with torch.nn.functional's parameter names.

    An eager call on plain tensors, its sizes and eps of the plain types (:func:`_direct`),
    runs the implementation -- the recording Function's where autograd records a graph --
    after no more than the checks of its arguments' types that the operator's schema would
    make, written out for its parameters (a decoder's per-token norm pays them on every
    call); anything else goes to :func:`_general`."""
    params = [p.replace(name=_input_name(op, p.name)) for p in op.signature("plain").parameters.values()
              if p.name != "out"]
    names = ", ".join(p.name for p in params)
    tensors = [_input_name(op, r) for r in op.forward_arrays]
    size = "normalized_shape" if op.layout == "rows" else "num_groups"
    pairs = list(zip(tensors, op.forward_arrays))
    # (a nested input's refusal is GENERAL's; a nested tensor is of a plain type when strided)
    plain = " or ".join(f"{t} is not None and type({t}) not in PLAIN" if r in op.params
                        else f"type({t}) not in PLAIN or {t}.is_nested" for t, r in pairs)
    grads = " or ".join(f"{t} is not None and {t}.requires_grad" if r in op.params
                        else f"{t}.requires_grad" for t, r in pairs)
    eps = "type(eps) is not float" + (" and eps is not None" if op.eps is None else "")
    general = f"return GENERAL(OP, ({names},))"
    if op.layout == "rows":
        one = f"type({size}) is tuple and len({size}) == 1 and type({size}[0]) is int"  # (INTS's commonest case)
        sizes = [f"if type({size}) is int:", f"    {size} = ({size},)", f"elif not ({one} or INTS({size})):",
                 f"    {general}"]
    else:
        sizes = [f"if type({size}) is not int:", f"    {general}"]
    # _watched(), written out: a frame less on every call
    watched = ("True" if _CHECKS is None
               else "IS_COMPILING() or FUNCTION_MODES() or DISPATCH_MODES() or PROFILING() or TRANSFORMS()"
                    " or TRACING() or FORWARD_AD._current_level >= 0")
    # autograd saves no inference tensor for a backward: a frozen model's features, made under
    # torch.inference_mode, normalized by a layer learning its weight get a copy that it can
    # save (torch's composite rms_norm saves none of its input there); a fused norm saves s
    saveable = [] if op.fused else ["    if input.is_inference():", "        input = input.clone()"]
    body = [f"if ({watched}", f"        or {plain}", f"        or {eps}):", f"    {general}", *sizes,
            f"if ({grads}) and GRAD_ENABLED():", *saveable, f"    return RECORD({names})", f"return PLAIN_CALL({names})"]
    if not op.fused:  # the checks' messages name x, which this function calls input
        body = ["try:", *(f"    {line}" for line in body), "except (TypeError, ValueError) as e:",
                "    NAMED_INPUT(e)", "    raise"]
    function_modes, dispatch_modes, profiling, _, transforms, tracing = _CHECKS or (None,) * 6
    env = {"IS_COMPILING": torch.compiler.is_compiling, "FUNCTION_MODES": function_modes,
           "DISPATCH_MODES": dispatch_modes, "PROFILING": profiling, "TRANSFORMS": transforms, "TRACING": tracing,
           "FORWARD_AD": _FORWARD_AD,
           "PLAIN": _PLAIN, "GENERAL": _general, "OP": op, "INTS": _ints, "GRAD_ENABLED": torch.is_grad_enabled,
           "RECORD": _RECORDING[op.name], "PLAIN_CALL": _IMPLEMENTATIONS[op.name, "plain"],
           "NAMED_INPUT": _named_input}
    fn = generate(op.name, inspect.Signature(params), body, env, op.doc("plain", "torch"), __name__)
    fn.__module__ = __name__
    return fn


_FUNCTIONS = {op.name: _functional_of(op) for op in OPERATIONS}
globals().update(_FUNCTIONS)


# ------------------------------------------------------------ modules
#
# One class per torch.nn norm, since that is what a user instantiates and what
# replace_norms swaps in; its forward comes from the table.

class _Unscriptable:
    """``torch.jit.script`` of a module holding one of numbanorm's: its error, not TorchScript's
    on the generated code (TorchScript compiles no call of a Python custom operator)."""

    def __prepare_scriptable__(self):
        raise RuntimeError(f"{type(self).__name__} is numbanorm's and cannot be scripted: TorchScript compiles "
                           "no Python custom operator; torch.jit.trace, torch.compile and torch.export take it")


class _TableModule(_Unscriptable):
    """The forward of a torch.nn norm on numbanorm's function ``_op``: its arguments
    after the input are the module's attributes of the table's role names
    (``normalized_shape`` or ``num_groups``, ``weight``, ``bias``, ``eps``), which
    are torch.nn's names too."""

    _op = None

    def forward(self, input):
        op = self._op
        return _FUNCTIONS[op.name](input, *(getattr(self, r) for r in op.forward_roles[1:]))


class LayerNorm(_TableModule, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` running numbanorm's kernels."""

    _op = BY_NAME["layer_norm"]

    def forward(self, input):  # (_TableModule.forward written out: a decoder calls it per token)
        """``layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)``."""
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(_TableModule, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` running numbanorm's kernels."""

    _op = BY_NAME["rms_norm"]

    def forward(self, x):  # (as LayerNorm.forward; x, torch.nn.RMSNorm's name for it)
        """``rms_norm(x, self.normalized_shape, self.weight, self.eps)``."""
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


class GroupNorm(_TableModule, torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` running numbanorm's kernels."""

    _op = BY_NAME["group_norm"]


_MODULES = (LayerNorm, RMSNorm, GroupNorm)


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
    "none": "float32 x*rstd, cast to x's dtype, no weight (Llama 4's query and key norm)",
}
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _hf_rms_norm(x, weight, eps, form):
    """``form``'s arithmetic with numbanorm's kernel for the float32 part.

    The kernel computes ``x * rstd`` (and, given a weight, ``* weight``) in float32
    and rounds once to x's dtype on the store, so each form's casts are placed
    where the original puts them; only float32 models get the weight fused into
    the kernel, since in 16 bits the original rounds before multiplying.
    """
    if weight is None:  # (a weightless class's: over the last dimension)
        if x.dtype in _KERNEL_DTYPES:
            return rms_norm(x, x.shape[-1:], None, eps)
        return rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)
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
    if weight is None:
        return (x32 * rstd).to(x.dtype)
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
    probe weight, on the weight's device: the CPU for a module on the meta device,
    whose tensors have no values) on rows with a non-zero mean (a LayerNorm fails), rows small
    enough for eps to matter and large ones, three to a sample (a norm over another axis
    than the last, whose every 2-D probe would pass, fails), in each of ``_PROBE_DTYPES``, and
    keeps the forms that agree within 8 ulps of the output dtype (float32's for
    float64 outputs: the classes compute in float32) with the same output dtype,
    in 16 bits bit for bit in all but 1 % of the elements; of those, the closest
    (the ``transformers`` classes match one bit for bit).
    """
    weight = module._parameters.get("weight")  # (None: a weightless class, probed on the CPU)
    device = "cpu" if weight is None or weight.is_meta else weight.device
    n = 48 if weight is None else weight.shape[0]
    g = torch.Generator().manual_seed(0)  # (the CPU's, as the probe's values: not a `with torch.device`'s)
    x = torch.randn(4, 3, n, generator=g, dtype=torch.float64, device="cpu") + 0.5
    x[1] *= 1e-3
    x[2] *= 50
    w = torch.rand(n, generator=g, dtype=torch.float64, device="cpu") * 1.5 + 0.25  # away from 0 and 1
    eps = getattr(module, eps_attr)
    if weight is None:
        # (each x dtype once, in _PROBE_DTYPES's order: a set's would name another in a refusal)
        dtypes = dict.fromkeys((xdt, None) for xdt, _ in _PROBE_DTYPES)
        errors = {_HFForm(eps_attr, 0, "none"): 0.0}
    else:
        errors, dtypes = {_HFForm(eps_attr, o, c): 0.0 for o in (0, 1) for c in _CASTS if c != "none"}, _PROBE_DTYPES
    for xdt, wdt in dtypes:
        xi, wi = x.to(device, xdt), None if wdt is None else w.to(device, wdt)
        probe = object.__new__(type(module))
        probe.__dict__.update(module.__dict__)
        probe.__dict__["_parameters"] = {} if wi is None else {"weight": wi}
        try:
            with torch.no_grad(), torch.device(device):  # (what forward makes, beside the probe's)
                got = type(module).forward(probe, xi)
            if not isinstance(got, Tensor) or got.shape != xi.shape:
                return None, "forward(x) does not return a tensor shaped like x"
            for form in list(errors):
                want = _hf_reference(xi, wi, eps, form)
                tol = 8 * torch.finfo(torch.float32 if want.dtype == torch.float64 else want.dtype).eps
                err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
                # in 16 bits, rounding where the class rounds matches it bit for bit but for a rare
                # float32 value at a 16-bit tie; a cast or a 1 + weight rounded elsewhere changes
                # many elements by an ulp, within the tolerance
                differ = (got != want).double().mean().item() if want.dtype in _HALF else 0.0
                if got.dtype != want.dtype or not err <= tol or differ > 0.01:  # NaN fails too
                    del errors[form]
                else:
                    errors[form] += err / tol
        except Exception as e:  # a forward that needs more than x, or another device's rules
            return None, f"forward(x) raised {type(e).__name__} on a {xdt} probe: {e}"
    if not errors:
        return None, ("its forward computes none of the RMSNorm forms numbanorm reproduces "
                      "(probed in float32, bfloat16, float16 and float64)")
    return min(errors, key=errors.get), None


class _HFRMSNorm(_Unscriptable, torch.nn.Module):
    """Forward of a replaced ``transformers`` RMSNorm (placed before the original class)."""

    _numbanorm_form = None  # an _HFForm, set on each generated class

    def forward(self, hidden_states):
        form = self._numbanorm_form
        weight = None if form.cast == "none" else self.weight
        return _hf_rms_norm(hidden_states, weight, getattr(self, form.eps_attr), form)


# ------------------------------------------------------------ replace_norms

_SWAPS = {ours.__bases__[-1]: ours for ours in _MODULES}  # torch.nn's class -> ours
_OURS = (*_MODULES, _HFRMSNorm)
_NOT_OURS = (torch.nn.modules.batchnorm._NormBase, torch.nn.LocalResponseNorm, torch.nn.CrossMapLRN2d)
_PARAMETRIZATIONS = torch.nn.utils.parametrize.ParametrizationList


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
    """``(new class, how)`` for a childless module, a parametrized torch norm or a norm holding
    modules (``_norm_holding_modules``), ``(None, why not)`` for a norm left alone, or None."""
    cls = type(m)
    if _parametrized(m):  # torch's parametrize made cls, a subclass of the module's own class
        inner, how = _plan_class(m, cls.__bases__[0])
        return (None, how) if inner is None else (_parametrized_class(inner, cls), f"{how}, parametrized")
    if torch.nn.utils.parametrize.is_parametrized(m):  # (named a norm: _norm_holding_modules)
        return None, ("parametrized (torch.nn.utils.parametrize): numbanorm keeps the parametrizations "
                      "of torch.nn's norms only")
    return _plan_class(m, cls)


def _called_otherwise(m):
    """Why a call of ``m`` would not run its class's forward, or None: a forward set on the
    instance (accelerate's hooks wrap the old one so) or ``Module.compile``'s compiled call,
    either bound to ``m`` and copied onto its replacement, where it would run ``m``'s forward."""
    if vars(m).get("_compiled_call_impl") is not None:
        return "Module.compile compiled its own forward: call replace_norms before compiling it"
    if "forward" in vars(m):
        return ("its forward is set on the instance (a hook's, as accelerate's), and would still run: "
                "call replace_norms before the hook is added")
    return None


_COMPILED_WHOLE = "torch.compile wraps it, and its compiled call runs its forward: call replace_norms before torch.compile"


def _parametrized(m):
    """Whether ``m`` is a torch norm with parametrized tensors (``torch.nn.utils.parametrize``),
    whose parametrizations are its children."""
    return isinstance(m, tuple(_SWAPS)) and torch.nn.utils.parametrize.is_parametrized(m)


def _norm_holding_modules(m):
    """Whether ``m``, which has submodules, is planned as a norm (and reported where left alone)
    rather than only walked into: a subclass of a torch norm (BiT's GroupNorm holding its
    activation), or a parametrized module named a norm (its parametrizations its children)."""
    return isinstance(m, tuple(_SWAPS)) or (torch.nn.utils.parametrize.is_parametrized(m)
                                            and bool(_NORM_NAME.search(type(m).__name__)))


def _parametrized_class(inner, cls):
    """The class ``cls`` that torch's parametrize made (its parametrized tensors as properties
    over the original class) made over ``inner`` instead, so that removing the last
    parametrization (which sets the class to the first base) leaves ``inner``; pickled as
    parametrize's own modules are (its ``__getstate__``: they are not).  One per module, as
    torch makes ``cls``: its properties' closures hold the module, which a class kept in
    :data:`_GENERATED` would keep alive with its parameters."""
    body = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    return type(cls.__name__, (inner,), {**body, "__reduce_ex__": object.__reduce_ex__})


def _extra_inputs(cls):
    """The parameters of ``cls.forward`` after the input, which a replacement's forward(x) would
    not take (a gated RMSNorm's gate); none where its signature cannot be read."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[2:]  # (self, the input)
    except (TypeError, ValueError):
        return []
    return [("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name for p in params]


def _plan_class(m, cls):
    """:func:`_plan` for a module ``m`` of class ``cls`` (parametrize's aside)."""
    if cls in _SWAPS:
        return _SWAPS[cls], f"numbanorm.torch.{cls.__name__}"
    for base, ours in _SWAPS.items():
        if isinstance(m, base):
            if cls.forward is base.forward:  # a subclass that only adds to the constructor
                return _swapped_class(ours, cls), f"torch.nn.{base.__name__}'s forward on numbanorm"
            return None, f"a subclass of torch.nn.{base.__name__} with a forward of its own"
    if isinstance(m, _NOT_OURS) or "BatchNorm" in cls.__name__:  # (a frozen batch norm: a Module of its own)
        return None, "numbanorm has no batch, instance or local-response norm"
    is_norm = bool(_NORM_NAME.search(cls.__name__))
    extra = _extra_inputs(cls)
    if extra:  # (a gated RMSNorm: the probe, calling forward(x), would find its form without the gate)
        return (None, f"its forward takes more than the input ({', '.join(extra)})") if is_norm else None
    eps_attr = _eps_attr(m)
    params = dict(m.named_parameters(recurse=False))
    if eps_attr is None:
        return (None, "no `variance_epsilon` or `eps` attribute") if is_norm else None
    # (a weightless one probed only where named a norm: any other module with an eps would be run)
    weightless = is_norm and not params and not any(True for _ in m.buffers())
    buffers = [n for n, _ in m.named_buffers(recurse=False)]
    if not weightless and buffers:
        return (None, f"it holds buffers ({', '.join(buffers)}), which a replacement's forward would not read"
                ) if is_norm else None
    if not weightless and (list(params) != ["weight"] or params["weight"].dim() != 1):
        return (None, "its parameters are not one 1-D `weight` or none") if is_norm else None
    form, why = _probe(m, eps_attr)
    if form is None:
        return (None, why) if is_norm else None  # not a norm at all: none of our business
    how = f"{_CASTS[form.cast]}{' with 1 + weight' if form.offset else ''}, eps = .{eps_attr}"
    return _swapped_class(_HFRMSNorm, cls, form), how


def replace_norms(module, strict=False, *, report=False):
    """Swap the norms in ``module`` for numbanorm's, in place; returns ``module`` (its
    replacement where ``module`` itself is a norm).

    Replaced: ``torch.nn`` LayerNorm/RMSNorm/GroupNorm (and subclasses that keep
    torch's forward; parametrized ones, ``torch.nn.utils.parametrize``, keep their
    parametrizations), and any childless module with a 1-D ``weight`` (or, named a
    norm, no parameters at all) and a ``variance_epsilon`` or ``eps`` whose forward
    takes x alone and is one of the RMSNorm forms of Hugging Face ``transformers``
    (Llama, Mistral, Qwen, Phi-3, Gemma's ``1 + weight``, T5's, OLMo-2's, Llama 4's
    weightless query and key norm), found by running that forward on a small probe
    (see ``_probe``) rather than by class name.  The replacement keeps each
    form's float32 upcast and casts, so outputs match the original's to float32
    rounding, and in 16 bits up to the ulp of the kernel's statistics.

    The replacements are instances of a subclass of the original class (still
    ``isinstance`` of it, its name kept after a "Numbanorm" prefix) holding the
    originals' parameters and buffers (the same tensors, not copies): parameter
    names, ``state_dict`` keys, optimizers built before the swap and
    ``save_pretrained``/``from_pretrained`` are unaffected.

    Every replacement is logged at INFO, every norm left alone (BatchNorm,
    a subclass with its own forward, an RMSNorm variant with a gate, a norm whose
    forward is set on the instance or compiled by ``Module.compile``) at WARNING
    with the reason.  ``strict=True`` raises ``ValueError`` listing those instead,
    before anything is swapped.  ``report=True`` returns ``(module, NormReport)``.
    """
    replaced, left_alone, edits, memo = [], [], [], {}
    frame = sys.modules.get("torch._dynamo.eval_frame")  # (not imported: nothing was compiled)
    compiled_module = getattr(frame, "OptimizedModule", ())

    def children(m, path):
        for name, child in m._modules.items():  # (named_children() names a module once: its first name)
            if child is None:
                continue
            new_child = visit(child, f"{path}.{name}" if path else name,
                              name == "_orig_mod" and isinstance(m, compiled_module))
            if new_child is not None:
                edits.append((m, name, new_child))

    def visit(m, path, compiled=False):
        if id(m) in memo:
            return memo[id(m)]
        new = None
        if not isinstance(m, (*_OURS, _PARAMETRIZATIONS)):  # (weight_norm's _WeightNorm: no norm of the model)
            holds = any(True for _ in m.children())
            if holds and not _parametrized(m) and not _norm_holding_modules(m):
                children(m, path)
            else:
                plan = _plan(m)
                if plan is not None and plan[0] is not None:
                    why = _called_otherwise(m) or (_COMPILED_WHOLE if compiled else None)
                    plan = plan if why is None else (None, why)
                if plan is not None and plan[0] is not None:
                    new = plan[0].__new__(plan[0])
                    new.__dict__.update(m.__dict__)  # the same parameters, buffers, hooks, settings
                    replaced.append((path, type(m).__name__, plan[1]))
                elif plan is not None:
                    left_alone.append((path, type(m).__name__, plan[1]))
                if new is None and holds and not _parametrized(m):
                    children(m, path)  # (a norm left alone holding a norm)
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
