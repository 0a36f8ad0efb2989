"""The CPU backend of the frontend in ``numbanorm._api``: NumPy arrays in and out.

It implements ``numbanorm._api.Backend``; a CPU call has no context (``None``).
"""

import contextlib
from typing import Any, NamedTuple

import numpy as np

from .. import _validate as V
from ._kernels import group_norm, layer_norm, rms_norm  # Plans launches these directly
from ._kernels.common import SERIAL_BELOW
from ._kernels.halves import kernel_view
from ._kernels.memory import apart, should_stream

name = "cpu"
# dweight/dbias are summed into float32 and cast after (the column sums store acc only)
grads_in_any_dtype = False


def native(role, a):
    if a is None or type(a) is np.ndarray:
        return a
    if V.side_of(a) == V.DEVICE:
        raise TypeError(
            f"`{role}` is a CUDA array, but numbanorm.cpu runs on host arrays: call "
            "numbanorm.cuda (or the top-level functions, which dispatch on the array type)"
        )
    return V.host_array(role, a)


def call_context(leading, arrays=None):
    return None


def on_device(ctx):
    return _ANYWHERE


_ANYWHERE = contextlib.nullcontext()  # (host arrays: no device to choose)


def launch(ctx, launcher, *args, **kwargs):
    return launcher(*args, **kwargs)


# (N, C, *spatial) <-> (N, *spatial, C) by ndim: transpose's axes (np.moveaxis checks its axes
# on every call, a share of a small call's time)
_TO_LAST = {4: (0, 2, 3, 1), 5: (0, 2, 3, 4, 1)}
_FROM_LAST = {4: (0, 3, 1, 2), 5: (0, 4, 1, 2, 3)}


def order_of(a):
    if a.ndim in (4, 5) and not a.flags.c_contiguous and a.transpose(_TO_LAST[a.ndim]).flags.c_contiguous:
        return "last"  # (one channel or one position: C-contiguous too, and "C")
    return "C"


def contiguous(ctx, a, shape, order="C"):
    if order == "C":
        return np.ascontiguousarray(a).reshape(shape)
    n, c, s = shape
    return np.ascontiguousarray(a.transpose(_TO_LAST[a.ndim])).reshape(n, s, c).transpose(0, 2, 1)


def empty(ctx, shape, dtype, order="C"):
    if order == "C":
        return np.empty(shape, dtype)
    return np.empty((shape[0], *shape[2:], shape[1]), dtype).transpose(_FROM_LAST[len(shape)])


def unkept(ctx, shape, dtype):
    return np.empty(shape, dtype)  # (the kernels store a row's statistics where they are computed: no branch)


def out_view(out, shape, reads, order="C"):
    # (an out= overlapping an input is the launchers' to handle: cpu/_kernels/common.py)
    if not out.flags.writeable:
        raise ValueError("`out` is read-only")
    if order == "C":
        return out.reshape(shape) if out.flags.c_contiguous else None
    return contiguous(None, out, shape, order) if order_of(out) == order else None


def same_array(a, b):
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.strides == b.strides)


def copy_into(ctx, dst, src):
    np.copyto(dst, src)


def copy(ctx, a):
    return np.array(native("x", a), copy=True)  # (the array the call read)


def cast(ctx, a, dtype):
    return _cast(a, dtype)


def _cast(a, dtype):
    """``a`` in ``dtype``: itself where it is, else a copy in which a value past ``dtype``'s
    largest is inf, as a kernel's store rounds it, without NumPy's overflow warning
    (numbanorm warns of nothing: pyproject's filterwarnings)."""
    if a.dtype == dtype:
        return a
    with np.errstate(over="ignore"):
        return a.astype(dtype)


def wrap(a, like):
    return a


class RowsForward(NamedTuple):
    """The plan of a LayerNorm or RMSNorm forward seen before."""
    rows: int               # M of the flattened problem (M, N)
    n: int                  # N
    stat_shape: tuple       # the statistics as returned (keep-dims)
    acc: np.dtype           # the accumulation dtype
    eps: Any                # eps as validated, in acc
    direct: bool            # weights in x's or acc's dtype: straight to the kernel (an out= apart from the inputs)
    half: Any               # 16-bit x: the integer dtypes of x and of weights in x's dtype, else None
    flat: bool              # x is (M, N) already: no reshape of x or y
    stream: bool            # stores streamed (``memory.should_stream``)


class GroupsForward(NamedTuple):
    """The plan of a GroupNorm forward seen before."""
    flat: tuple             # (N, C, spatial)
    stats: tuple            # (N, num_groups)
    eps: Any                # eps as validated, in the accumulation dtype
    order: str              # x's (and out='s) memory order, as order_of gave it: "C" or "last"


class Backward(NamedTuple):
    """The plan of a backward seen before."""
    flat: tuple             # (M, N) rows, or (N, C, spatial) groups
    params: tuple           # dweight's shape
    grads: np.dtype         # dweight/dbias's dtype


class Plans:
    """The CPU's plan cache (``numbanorm._api.PlanCache``): a call seen before, without
    the frontend's work per call.

    A (1, 768) float32 LayerNorm spent most of its time in validation and in the
    launcher's checks (``book/05_cpu_kernel.md``, "Threads, forks and small
    calls"), all of which depend only on the arguments' types, shapes,
    strides and dtypes and on ``eps``: the key.  A forward whose weights are in x's
    dtype or the accumulation dtype, and whose ``out=``, if any, shares no memory with
    the inputs (``apart``, asked on every call), goes straight to the kernel: 16-bit
    arrays as their integer views (``halves``), the kernel widening 16-bit weights as
    it reads them.  Every other forward seen before (weights of another dtype, an
    ``out=`` that overlaps an input) goes to the kernel's launcher, which converts the
    weights and writes through a scratch copy where it must (their contents and memory
    may change between calls; only their types and shapes are learned).  A
    backward is learned where it needs no conversion: dy in x's dtype, the statistics
    in the accumulation dtype, every array C-contiguous.
    """

    MAX_PLANS = 256
    FORWARD = ("layer_norm", "rms_norm", "group_norm")
    BACKWARD = ("layer_norm", "rms_norm", "group_norm")

    def __init__(self):
        self._plans = {}
        run = {"layer_norm": _layer_norm, "rms_norm": _rms_norm, "group_norm": _group_norm}
        back = {"layer_norm": _rows_backward, "rms_norm": _rows_backward, "group_norm": _groups_backward}
        self._run = {(k, "forward"): run[k] for k in self.FORWARD}
        self._run.update({(k, "backward"): back[k] for k in self.BACKWARD})

    def key(self, kind, args):
        """``(the plan's key, whether the call is plain)``, or None (a plain call: ``_planned``)."""
        kind, plain = _planned(kind)
        if kind not in self._run:
            return None
        k = (_forward_key if kind[1] == "forward" else _backward_key)(kind, args)
        return None if k is None else (k, plain)

    def run(self, key, args):
        k, plain = key
        plan = self._plans.get(k)
        if plan is None:
            return None
        return self._run[k[0]](plan, args, True) if plain else self._run[k[0]](plan, args)

    def begin(self, key):
        pass

    def end(self):
        pass

    def shortcut(self, kind):
        """``kind``'s key and run as one function, or None where no plan can learn it: a forward
        returns every output, a plain call ``(y,)`` (its statistics in one scratch allocation)."""
        kind, plain = _planned(kind)
        run = self._run.get(kind)
        if run is None:
            return None
        plans = self._plans
        if kind[1] == "forward":
            def forward(*args, out=None):
                args = (*args, out)
                plan = plans.get(_forward_key(kind, args))
                return None if plan is None else run(plan, args, plain)
            return forward

        def backward(*args):
            plan = plans.get(_backward_key(kind, args))
            return None if plan is None else run(plan, args)
        return backward

    def learn(self, key, call):
        c = call.checked
        if call.kind[1] == "backward":
            plan = _learn_backward(c, call.acc)
        else:
            plan = _learn_forward(call.kind[0], c, call.acc)
        if plan is None:
            return
        if len(self._plans) >= self.MAX_PLANS:
            self._plans.clear()
        self._plans[key[0]] = plan


def _planned(kind):
    """``(the kind whose plan a call of kind runs, whether it is plain)``: a plain call shares
    its forward's plan (the kernels fill the statistics either way) and returns ``(y,)``."""
    plain = kind[1] == "plain"
    return ((kind[0], "forward") if plain else kind), plain


def _learn_forward(name, c, acc):
    """The plan of the forward ``c`` (validated), or None where the full path did more
    than a plan repeats (a copy of x, of out, of the weights)."""
    g, (rows, *_) = c.given, c.problem.flat
    x, out, weight, bias = g["x"], g["out"], g["weight"], g.get("bias")
    order = order_of(x) if name == "group_norm" else "C"
    if rows == 0 or order == "C" and not x.flags.c_contiguous:
        return None
    if out is not None and not (out.shape == x.shape and out.dtype == x.dtype and
                                (out.flags.c_contiguous if order == "C" else order_of(out) == order)):
        return None  # the full path wrote it through a copy
    if any(a is not None and (a.ndim != 1 or not a.flags.c_contiguous) for a in (weight, bias)):
        return None  # the full path flattens it
    if name == "group_norm":  # the launcher converts the weights
        return GroupsForward(c.problem.flat, c.problem.stats, acc.type(c.eps), order)
    direct = all(a is None or a.dtype in (acc, x.dtype) for a in (weight, bias))
    n = x.size // rows
    return RowsForward(rows, n, c.problem.kept, acc, acc.type(c.eps), direct, _views(x, weight, bias),
                       x.shape == (rows, n), should_stream(x))


def _learn_backward(c, acc):
    """The plan of the backward ``c`` (validated), or None where the full path converted
    something (dy not in x's dtype, statistics not in ``acc``, an array not C-contiguous)."""
    g = c.given
    dy, x, weight = g["dy"], g["x"], g["weight"]
    stats = [g[r] for r in ("mean", "rstd") if r in g]
    if c.problem.flat[0] == 0 or dy.dtype != x.dtype:
        return None
    if not all(a.flags.c_contiguous for a in (dy, x, *stats)) or any(s.dtype != acc for s in stats):
        return None
    if weight is not None and not weight.flags.c_contiguous:
        return None
    return Backward(c.problem.flat, c.problem.params, np.dtype(weight.dtype if weight is not None else x.dtype))


def _forward_key(kind, args):
    """The key of a forward call ``args`` (the public arguments in order, out last), or None:
    x a NumPy array, every other array one or None, eps a float or None and the shape or
    group count an int or a tuple of ints, by type (``_exact``)."""
    x, nshape, eps = args[0], args[1], args[-2]
    if type(x) is not np.ndarray or (type(eps) is not float and eps is not None):
        return None
    if type(nshape) is not int and not _exact(nshape):
        return None
    try:  # (written out per arity: a small call's key is a share of its time)
        if len(args) == 6:  # x, shape or groups, weight, bias, eps, out
            return (kind, x.shape, x.strides, x.dtype, nshape, eps, _layout(args[2]), _layout(args[3]),
                    _layout(args[5]))
        return (kind, x.shape, x.strides, x.dtype, nshape, eps, _layout(args[2]), _layout(args[4]))  # (no bias)
    except TypeError:  # an array argument of another type
        return None


def _backward_key(kind, args):
    """The key of a backward call ``args`` (its public arguments in order), or None: every
    array a NumPy array, the normalized shape an int or a tuple of ints."""
    sig = [kind]
    for a in args:
        if a is None or type(a) is int:
            sig.append(a)
        elif type(a) is np.ndarray:
            sig.append((a.shape, a.strides, a.dtype))
        elif _exact(a):
            sig.append(("shape", a))
        else:
            return None
    return tuple(sig)


def _block(size, rows):
    """Rows per block of the parallel kernel, as the thread count asks now (it may have
    changed since the plan was learned); 0 where the call runs on the calling thread
    (``launch`` reads no block there)."""
    return 0 if size < SERIAL_BELOW else layer_norm.row_block(rows)


def _layer_norm(plan, args, plain=False):
    """``(y, mean, rstd)`` of a LayerNorm forward by its plan, ``(y,)`` of a ``plain`` call,
    or None (the full path's)."""
    x, _, weight, bias, _, out = args
    if out is not None and not out.flags.writeable:
        return None  # (the full path says why a read-only out= is refused)
    m, n, stat, acc, e, direct, half, flat, stream = plan
    block = _block(x.size, m)
    y = np.empty(x.shape, x.dtype) if out is None else out
    if plain:  # the statistics, unreturned, in one allocation (two cost a share of a small call)
        kept = np.empty((2, m), acc)
        mean1, rstd1 = kept[0], kept[1]
    else:
        mean, rstd = np.empty(stat, acc), np.empty(stat, acc)
        mean1, rstd1 = mean.reshape(m), rstd.reshape(m)
    x2, y2 = (x, y) if flat else (x.reshape(m, n), y.reshape(m, n))
    if direct and (out is None or apart(out, x, weight, bias)):  # (else the launcher: scratch_for)
        if half:  # (kernel_view's own tests skipped: the plan checked the arrays)
            bits, wbits, bbits = half
            x2, y2 = x2.view(bits), y2.view(bits)
            weight = weight.view(wbits) if wbits else weight
            bias = bias.view(bbits) if bbits else bias
        layer_norm.launch(layer_norm._forward, x.size, block, x2, weight, bias, e, y2, mean1, rstd1, stream)
    else:
        layer_norm.forward(x2, weight, bias, e, y2, mean1, rstd1)
    return (y,) if plain else (y, mean, rstd)


def _rms_norm(plan, args, plain=False):
    """``(y, rstd)`` of an RMSNorm forward by its plan, ``(y,)`` of a ``plain`` call, or None."""
    x, _, weight, _, out = args
    if out is not None and not out.flags.writeable:
        return None  # (the full path says why a read-only out= is refused)
    m, n, stat, acc, e, direct, half, flat, stream = plan
    block = _block(x.size, m)
    y = np.empty(x.shape, x.dtype) if out is None else out
    rstd = np.empty(m if plain else stat, acc)
    x2, y2 = (x, y) if flat else (x.reshape(m, n), y.reshape(m, n))
    rstd1 = rstd if plain else rstd.reshape(m)
    if direct and (out is None or apart(out, x, weight)):
        if half:
            bits, wbits, _ = half
            x2, y2 = x2.view(bits), y2.view(bits)
            weight = weight.view(wbits) if wbits else weight
        rms_norm.launch(rms_norm._forward, x.size, block, x2, weight, e, y2, rstd1, stream)
    else:
        rms_norm.forward(x2, weight, e, y2, rstd1)
    return (y,) if plain else (y, rstd)


def _group_norm(plan, args, plain=False):
    """``(y, mean, rstd)`` of a GroupNorm forward by its plan (through the launcher, which
    converts the weights and checks ``out`` against the inputs), ``(y,)`` of a ``plain`` call, or None."""
    x, _, weight, bias, _, out = args
    if out is not None and not out.flags.writeable:
        return None  # (the full path says why a read-only out= is refused)
    y = empty(None, x.shape, x.dtype, plan.order) if out is None else out
    mean, rstd = np.empty(plan.stats, plan.eps.dtype), np.empty(plan.stats, plan.eps.dtype)
    x3, y3 = (contiguous(None, a, plan.flat, plan.order) for a in (x, y))  # (views: the key holds the strides)
    group_norm.forward(x3, weight, bias, plan.eps, y3, mean, rstd)
    return (y,) if plain else (y, mean, rstd)


def _rows_backward(plan, args):
    """``(dx, dweight[, dbias])`` of a LayerNorm (``args``: dy, x, mean, rstd, shape, weight)
    or RMSNorm (dy, x, rstd, shape, weight) backward by its plan."""
    dy, x, *stats, _, weight = args
    (m, n), params, grads = plan
    acc = stats[0].dtype
    dx = np.empty(x.shape, x.dtype)
    w = None if weight is None else weight.reshape(n)
    sums = [np.empty(n, acc) for _ in stats]  # dweight (and dbias: one per statistic)
    kernel = layer_norm if len(stats) == 2 else rms_norm
    kernel.backward(dy.reshape(m, n), x.reshape(m, n), *[s.reshape(m) for s in stats], w, dx.reshape(m, n), *sums)
    return (dx, *[_cast(s, grads).reshape(params) for s in sums])


def _groups_backward(plan, args):
    """``(dx, dweight, dbias)`` of a GroupNorm backward (``args``: dy, x, mean, rstd, weight)
    by its plan: the launcher converts the weight, as the full path's."""
    dy, x, mean, rstd, weight = args
    flat, params, grads = plan
    acc = mean.dtype
    dx = np.empty(x.shape, x.dtype)
    dweight, dbias = np.empty(params, acc), np.empty(params, acc)
    group_norm.backward(dy.reshape(flat), x.reshape(flat), mean, rstd, weight, dx.reshape(flat), dweight, dbias)
    return dx, _cast(dweight, grads), _cast(dbias, grads)


def _layout(a):
    """What a key holds of an array argument: None, or its (shape, strides, dtype);
    ``TypeError`` for anything but a NumPy array (a call that is never learned)."""
    if a is None:
        return None
    if type(a) is not np.ndarray:
        raise TypeError
    return a.shape, a.strides, a.dtype


def _exact(n):
    """Whether ``n`` is an int or a tuple of ints, by type: a key holding it matches only
    calls the full path answers alike (``64.0 == 64`` and ``True == 1``, which it refuses
    for a shape or a group count, would otherwise find the call learned for 64 or 1)."""
    if type(n) is int:
        return True
    if type(n) is not tuple:
        return False
    for d in n:
        if type(d) is not int:
            return False
    return True


def _views(x, weight, bias):
    """For a 16-bit ``x``: the integer dtype the kernels read it as (``halves.kernel_view``),
    and the same for each weight in x's dtype (None: passed as it is); else None."""
    if x.dtype.itemsize != 2:
        return None
    bits = kernel_view(x[:0]).dtype
    return (bits,) + tuple(bits if a is not None and a.dtype == x.dtype else None for a in (weight, bias))


plans = Plans()
