"""The CPU backend of the frontend in ``numbanorm._api``: NumPy arrays in and out.

It implements ``numbanorm._api.Backend``; a CPU call has no context (``None``).
"""

import contextlib

import numpy as np

from .. import _validate as V
from ._kernels import group_norm, layer_norm, rms_norm  # SmallCalls launches these directly
from ._kernels.halves import kernel_view
from ._kernels.memory import should_stream

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
    return np.asarray(a)


def call_context(leading, arrays=None):
    return None


def on_device(ctx):
    return _ANYWHERE


_ANYWHERE = contextlib.nullcontext()  # (host arrays: no device to choose)


def launch(ctx, launcher, *args, **kwargs):
    return launcher(*args, **kwargs)


def contiguous(ctx, a, shape):
    return np.ascontiguousarray(a).reshape(shape)


def empty(ctx, shape, dtype):
    return np.empty(shape, dtype)


def out_view(out, shape, reads):
    # (an out= overlapping an input is the launchers' to handle: cpu/_kernels/common.py)
    if not out.flags.writeable:
        raise ValueError("`out` is read-only")
    return out.reshape(shape) if out.flags.c_contiguous else None


def copy_into(ctx, dst, src):
    np.copyto(dst, src)


def cast(ctx, a, dtype):
    return a.astype(dtype, copy=False)


def wrap(a, like):
    return a


class SmallCalls:
    """The forward of a call seen before, without the frontend's work per call.

    A (1, 768) float32 LayerNorm spent most of its time in validation and in the
    launcher's checks (``book/05_cpu_kernel.md``, "Threads, forks, read-only installs
    and small calls"), all of which depend only on the arguments' types, shapes,
    strides and dtypes and on ``eps``.  ``learn`` records a call that the full path
    has validated; a later call with the same key skips the frontend.  A call
    without ``out=`` whose weights are in x's dtype or the accumulation dtype goes
    straight to the kernel: 16-bit arrays as their integer views (``halves``), the
    kernel widening 16-bit weights as it reads them (widened by the launcher, two
    Numba calls and two allocations, a float16 (1, 4096) call took 2.9x torch's
    time against 1.3x for float32).  Every other call seen before (weights of
    another dtype, a C-contiguous ``out=``) goes to the kernel's launcher, which
    converts the weights and checks ``out`` against the inputs on every call (their
    contents and memory may change between calls; only their types and shapes are
    learned).
    """

    MAX_PLANS = 256

    def __init__(self):
        self._plans = {}

    @staticmethod
    def _key(kind, x, nshape, weight, bias, eps, out):
        """The key of a forward call, or None where it has none; ``TypeError`` where an
        array argument is not a NumPy array (``_layout``) or the shape cannot be hashed."""
        if type(x) is not np.ndarray or (type(eps) is not float and eps is not None):
            return None
        if type(nshape) is not int and not _exact(nshape):
            return None
        return (kind, x.shape, x.strides, x.dtype, nshape, eps, _layout(weight), _layout(bias), _layout(out))

    def learn(self, kind, x, nshape, weight, bias, eps, checked_eps, rows, out=None):
        """Record a call of the operation ``kind`` (its name: ``layer_norm``, ``rms_norm``,
        ``group_norm``, whose ``nshape`` is num_groups) the full path has validated:
        ``eps`` as given, ``checked_eps``
        as validated, ``rows`` of the flattened problem, the caller's ``out`` or None."""
        try:
            key = self._key(kind, x, nshape, weight, bias, eps, out)
        except TypeError:
            return
        if key is None or rows == 0 or not x.flags.c_contiguous:
            return
        if out is not None and not (out.flags.c_contiguous and out.shape == x.shape and out.dtype == x.dtype):
            return  # the full path wrote it through a copy
        if any(a is not None and (a.ndim != 1 or not a.flags.c_contiguous) for a in (weight, bias)):
            return  # the full path flattens it
        acc = layer_norm.acc_of(x.dtype)
        if kind == "group_norm":  # nshape is num_groups; the launcher converts the weights
            n, c = x.shape[:2]
            self._keep(key, ((n, c, x.size // (n * c)), (n, nshape), acc.type(checked_eps)))
            return
        direct = out is None and all(a is None or a.dtype in (acc, x.dtype) for a in (weight, bias))
        k = len(nshape) if isinstance(nshape, tuple) else 1
        stat_shape = x.shape[: x.ndim - k] + (1,) * k
        # x already (rows, N): no reshape of it or of y (each a share of a small call's time)
        flat = x.shape == (rows, x.size // rows)
        self._keep(key, (rows, x.size // rows, stat_shape, acc, acc.type(checked_eps),
                         layer_norm.row_block(rows), direct, _views(x, weight, bias), flat,
                         should_stream(x)))

    def _keep(self, key, plan):
        """Learn ``plan`` under ``key``, emptying the table when it is full; a key that
        cannot be hashed (a normalized_shape holding a list) is not learned."""
        try:
            hash(key)
        except TypeError:
            return
        if len(self._plans) >= self.MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan

    def _plan(self, kind, x, nshape, weight, bias, eps, out):
        """The plan learned for this call, or None."""
        try:
            plan = self._plans.get(self._key(kind, x, nshape, weight, bias, eps, out))
        except TypeError:  # an array argument of another type, an unhashable normalized_shape
            return None
        if out is not None and not out.flags.writeable:
            return None  # (the full path says why a read-only out= is refused)
        return plan

    def layer_norm(self, x, nshape, weight, bias, eps, out=None):
        """``(y, mean, rstd)``, or None where the call is not one seen before."""
        plan = self._plan("layer_norm", x, nshape, weight, bias, eps, out)
        if plan is None:
            return None
        m, n, stat, acc, e, block, direct, half, flat, stream = plan
        y = np.empty(x.shape, x.dtype) if out is None else out
        mean, rstd = np.empty(stat, acc), np.empty(stat, acc)
        x2, y2 = (x, y) if flat else (x.reshape(m, n), y.reshape(m, n))
        mean1, rstd1 = mean.reshape(m), rstd.reshape(m)
        if direct:
            if half:  # (kernel_view's own tests skipped: the plan checked the arrays)
                bits, wbits, bbits = half
                x2, y2 = x2.view(bits), y2.view(bits)
                weight = weight.view(wbits) if wbits else weight
                bias = bias.view(bbits) if bbits else bias
            layer_norm.launch(layer_norm._forward, x.size, block, x2, weight, bias, e, y2, mean1, rstd1, stream)
        else:
            layer_norm.forward(x2, weight, bias, e, y2, mean1, rstd1)
        return y, mean, rstd

    def group_norm(self, x, num_groups, weight, bias, eps, out=None):
        """``(y, mean, rstd)``, or None where the call is not one seen before: through the
        launcher, which converts the weights and checks ``out`` against the inputs."""
        plan = self._plan("group_norm", x, num_groups, weight, bias, eps, out)
        if plan is None:
            return None
        flat, stats, e = plan
        y = np.empty(x.shape, x.dtype) if out is None else out
        mean, rstd = np.empty(stats, e.dtype), np.empty(stats, e.dtype)
        group_norm.forward(x.reshape(flat), weight, bias, e, y.reshape(flat), mean, rstd)
        return y, mean, rstd

    def rms_norm(self, x, nshape, weight, eps, out=None):
        """``(y, rstd)``, or None where the call is not one seen before."""
        plan = self._plan("rms_norm", x, nshape, weight, None, eps, out)
        if plan is None:
            return None
        m, n, stat, acc, e, block, direct, half, flat, stream = plan
        y = np.empty(x.shape, x.dtype) if out is None else out
        rstd = np.empty(stat, acc)
        x2, y2 = (x, y) if flat else (x.reshape(m, n), y.reshape(m, n))
        rstd1 = rstd.reshape(m)
        if direct:
            if half:
                bits, wbits, _ = half
                x2, y2 = x2.view(bits), y2.view(bits)
                weight = weight.view(wbits) if wbits else weight
            rms_norm.launch(rms_norm._forward, x.size, block, x2, weight, e, y2, rstd1, stream)
        else:
            rms_norm.forward(x2, weight, e, y2, rstd1)
        return y, rstd

    # ---- the backward of a call seen before

    @staticmethod
    def _backward_key(kind, args):
        """The key of a backward call ``args`` (its public arguments in order), or None:
        every array a NumPy array, the normalized shape hashable."""
        sig = [kind + "_backward"]
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

    def learn_backward(self, kind, args, flat, params, acc):
        """Record a backward call that the full path has validated: ``args`` its public
        arguments in order (dy, x, stats..., normalized_shape, weight), ``flat`` = (M, N),
        ``params`` dweight's shape, ``acc`` the accumulation dtype.  Only the call that
        needs no conversion is learned: dy in x's dtype, the statistics in ``acc``, every
        array C-contiguous (the full path would copy or cast them)."""
        dy, x, *stats, _, weight = args
        key = self._backward_key(kind, args)
        if key is None or flat[0] == 0 or dy.dtype != x.dtype:
            return
        if not all(a.flags.c_contiguous for a in (dy, x, *stats)) or any(s.dtype != acc for s in stats):
            return
        if weight is not None and not weight.flags.c_contiguous:
            return
        self._keep(key, (flat, params, np.dtype(weight.dtype if weight is not None else x.dtype)))

    def _backward_plan(self, kind, args):
        try:
            return self._plans.get(self._backward_key(kind, args))
        except TypeError:
            return None

    def layer_norm_backward(self, dy, x, mean, rstd, nshape, weight):
        """``(dx, dweight, dbias)``, or None where the call is not one seen before."""
        plan = self._backward_plan("layer_norm", (dy, x, mean, rstd, nshape, weight))
        if plan is None:
            return None
        (m, n), params, grads = plan
        acc = mean.dtype
        dx, dw, db = np.empty(x.shape, x.dtype), np.empty(n, acc), np.empty(n, acc)
        layer_norm.backward(dy.reshape(m, n), x.reshape(m, n), mean.reshape(m), rstd.reshape(m),
                            None if weight is None else weight.reshape(n), dx.reshape(m, n), dw, db)
        return dx, dw.astype(grads, copy=False).reshape(params), db.astype(grads, copy=False).reshape(params)

    def rms_norm_backward(self, dy, x, rstd, nshape, weight):
        """``(dx, dweight)``, or None where the call is not one seen before."""
        plan = self._backward_plan("rms_norm", (dy, x, rstd, nshape, weight))
        if plan is None:
            return None
        (m, n), params, grads = plan
        dx, dw = np.empty(x.shape, x.dtype), np.empty(n, rstd.dtype)
        rms_norm.backward(dy.reshape(m, n), x.reshape(m, n), rstd.reshape(m),
                          None if weight is None else weight.reshape(n), dx.reshape(m, n), dw)
        return dx, dw.astype(grads, copy=False).reshape(params)


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


small_calls = SmallCalls()
