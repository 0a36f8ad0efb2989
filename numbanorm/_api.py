"""The public functions, written once for every backend.

A ``Frontend`` runs each call in the same order:

1. ``common_side`` looks at the arguments' types only and rejects host and device
   arrays mixed in one call (once: the top level, which has checked already,
   uses a frontend made with ``sides_checked=True``);
2. the backend's ``native`` views each argument as the backend's array type
   (no copy, no allocation);
3. ``numbanorm._validate`` checks dtypes, shapes and scalars and works out the
   flattened problem -- every contract error is raised here, before step 4;
4. the backend's ``call_context`` says where the call runs (on a GPU: the stream
   and allocator of the array whose type the results take); outputs are
   allocated, inputs made contiguous, and the backend launches the norm's
   launcher, which fills the outputs;
5. results are reshaped (statistics keep-dims) and handed back in the caller's
   array type.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from . import _validate as V


@runtime_checkable
class Backend(Protocol):
    """What a backend provides (``numbanorm.cpu._backend`` and ``numbanorm.cuda._backend``).

    ``ctx`` is the backend's context of one call (``call_context``), passed
    explicitly to everything that allocates, copies or launches.
    """

    name: str                                   # 'cpu' or 'cuda'
    layer_norm: Any                             # modules of launchers: ``forward``/``backward``
    rms_norm: Any                               # (the row backward launchers take ``ds=None``,
    group_norm: Any                             # a gradient added to dx: the fused residual's)
    add_norm: Any                               # the fused residual-add forward launchers

    def native(self, role: str, a: Any) -> Any:
        """A zero-copy view of ``a`` in the backend's array type (None stays None)."""

    def call_context(self, leading: Any) -> Any:
        """Where a call whose results take ``leading``'s array type runs."""

    def launch(self, ctx: Any, launcher: Any, *args: Any, callers_out: bool = False, **kwargs: Any) -> Any:
        """Run ``launcher(*args, **kwargs)`` in ``ctx``.  ``callers_out``: y is the caller's
        ``out=`` rather than a fresh allocation (the CPU streams large stores into it)."""

    def contiguous(self, ctx: Any, a: Any, shape: tuple) -> Any:
        """C-contiguous array of ``shape`` with a's values."""

    def empty(self, ctx: Any, shape: tuple, dtype: Any) -> Any:
        """An uninitialised array."""

    def out_view(self, out: Any, shape: tuple) -> Any:
        """``out`` seen as ``shape`` if it is C-contiguous, else None."""

    def copy_into(self, ctx: Any, dst: Any, src: Any) -> None:
        """dst[...] = src (same size; dst may be strided)."""

    def cast(self, ctx: Any, a: Any, dtype: Any) -> Any:
        """``a`` in ``dtype`` (no copy when it already is)."""

    def wrap(self, a: Any, like: Any) -> Any:
        """``a`` in the array type of the caller's ``like``."""


class Frontend:
    def __init__(self, backend: Backend, sides_checked: bool = False):
        self.backend = backend
        self.sides_checked = sides_checked  # the caller has run common_side on these arguments
        self.small = getattr(backend, "small_calls", None)  # repeated small calls (cpu)

    # ------------------------------------------------------------ helpers

    def _native(self, **arrays):
        if not self.sides_checked:
            V.common_side(**arrays)
        native = self.backend.native
        return [native(k, a) for k, a in arrays.items()]

    def _output(self, ctx, out_native, flat_shape, dtype):
        """``(y, copy_back)``: the array a launcher fills, ``out`` itself when it can."""
        if out_native is not None:
            view = self.backend.out_view(out_native, flat_shape)
            if view is not None:
                return view, False
            return self.backend.empty(ctx, flat_shape, dtype), True
        return self.backend.empty(ctx, flat_shape, dtype), False

    def _result(self, ctx, y, copy_back, out, out_native, shape, like):
        if out is None:
            return self.backend.wrap(y.reshape(shape), like)
        if copy_back:
            self.backend.copy_into(ctx, out_native, y.reshape(shape))
        return out

    def _param(self, ctx, a, n):
        return None if a is None else self.backend.contiguous(ctx, a, (n,))

    # ------------------------------------------------------------ LayerNorm

    def layer_norm_forward(self, x, normalized_shape, weight=None, bias=None, eps=1e-5, *, out=None):
        if out is None and self.small is not None:
            hit = self.small.layer_norm(x, normalized_shape, weight, bias, eps)
            if hit is not None:
                return hit
        caller_x, eps_in = x, eps
        x, weight, bias, out_native = self._native(x=x, weight=weight, bias=bias, out=out)
        xdt = V.float_dtype("x", x)
        M, N, nshape = V.rows(x.shape, normalized_shape)
        V.param("weight", weight, nshape)
        V.param("bias", bias, nshape)
        eps = V.check_eps(eps, xdt)
        V.same_as_x("out", out_native, x.shape, xdt, optional=True)
        # ---- everything below may allocate and write
        backend = self.backend
        ctx = backend.call_context(caller_x)
        acc = V.acc_dtype(xdt)
        y, copy_back = self._output(ctx, out_native, (M, N), xdt)
        mean = backend.empty(ctx, (M,), acc)
        rstd = backend.empty(ctx, (M,), acc)
        if M:
            backend.launch(ctx, backend.layer_norm.forward, backend.contiguous(ctx, x, (M, N)),
                           self._param(ctx, weight, N), self._param(ctx, bias, N), eps, y, mean, rstd,
                           callers_out=out_native is not None and not copy_back)
        if out is None and self.small is not None:
            self.small.learn("ln", caller_x, normalized_shape, weight, bias, eps_in, eps, M)
        stat_shape = _stat_shape(x.shape, len(nshape))
        return (self._result(ctx, y, copy_back, out, out_native, x.shape, caller_x),
                backend.wrap(mean.reshape(stat_shape), caller_x),
                backend.wrap(rstd.reshape(stat_shape), caller_x))

    def layer_norm(self, x, normalized_shape, weight=None, bias=None, eps=1e-5, *, out=None):
        return self.layer_norm_forward(x, normalized_shape, weight, bias, eps, out=out)[0]

    def layer_norm_backward(self, dy, x, mean, rstd, normalized_shape, weight=None):
        return self._layer_norm_backward(dy, None, x, mean, rstd, normalized_shape, weight, "x")

    def _layer_norm_backward(self, dy, ds, x, mean, rstd, normalized_shape, weight, x_name):
        """LayerNorm backward with ``ds`` (None or like x) added to dx; ``x_name`` for errors."""
        caller_x = x
        dy, ds, x, mean, rstd, weight = self._native(
            dy=dy, ds=ds, **{x_name: x}, mean=mean, rstd=rstd, weight=weight)
        xdt = V.float_dtype(x_name, x)
        M, N, nshape = V.rows(x.shape, normalized_shape)
        V.same_as_x("dy", dy, x.shape, xdt, check_dtype=False)
        V.same_as_x("ds", ds, x.shape, xdt, check_dtype=False, optional=True)
        batch = x.shape[: len(x.shape) - len(nshape)]
        V.stats("mean", mean, x.shape, batch, len(nshape))
        V.stats("rstd", rstd, x.shape, batch, len(nshape))
        V.param("weight", weight, nshape)
        # ----
        backend = self.backend
        ctx = backend.call_context(caller_x)
        acc = V.acc_dtype(xdt)
        dx = backend.empty(ctx, (M, N), xdt)
        dw = backend.empty(ctx, (N,), self._grads_in(weight, xdt, acc))
        db = backend.empty(ctx, (N,), self._grads_in(weight, xdt, acc))
        backend.launch(
            ctx, backend.layer_norm.backward,
            self._rows_like(ctx, dy, (M, N), xdt), backend.contiguous(ctx, x, (M, N)),
            self._stat(ctx, mean, (M,), acc), self._stat(ctx, rstd, (M,), acc),
            self._param(ctx, weight, N), dx, dw, db, ds=self._rows_or_none(ctx, ds, (M, N), xdt))
        grad_dtype = self._grad_dtype(weight, xdt)
        return (backend.wrap(dx.reshape(x.shape), caller_x),
                backend.wrap(backend.cast(ctx, dw, grad_dtype).reshape(nshape), caller_x),
                backend.wrap(backend.cast(ctx, db, grad_dtype).reshape(nshape), caller_x))

    # ------------------------------------------------------------ RMSNorm

    def rms_norm_forward(self, x, normalized_shape, weight=None, eps=None, *, out=None):
        if out is None and self.small is not None:
            hit = self.small.rms_norm(x, normalized_shape, weight, eps)
            if hit is not None:
                return hit
        caller_x, eps_in = x, eps
        x, weight, out_native = self._native(x=x, weight=weight, out=out)
        xdt = V.float_dtype("x", x)
        M, N, nshape = V.rows(x.shape, normalized_shape)
        V.param("weight", weight, nshape)
        eps = V.rms_eps(eps, xdt)
        V.same_as_x("out", out_native, x.shape, xdt, optional=True)
        # ----
        backend = self.backend
        ctx = backend.call_context(caller_x)
        acc = V.acc_dtype(xdt)
        y, copy_back = self._output(ctx, out_native, (M, N), xdt)
        rstd = backend.empty(ctx, (M,), acc)
        if M:
            backend.launch(ctx, backend.rms_norm.forward, backend.contiguous(ctx, x, (M, N)),
                           self._param(ctx, weight, N), eps, y, rstd,
                           callers_out=out_native is not None and not copy_back)
        if out is None and self.small is not None:
            self.small.learn("rms", caller_x, normalized_shape, weight, None, eps_in, eps, M)
        stat_shape = _stat_shape(x.shape, len(nshape))
        return (self._result(ctx, y, copy_back, out, out_native, x.shape, caller_x),
                backend.wrap(rstd.reshape(stat_shape), caller_x))

    def rms_norm(self, x, normalized_shape, weight=None, eps=None, *, out=None):
        return self.rms_norm_forward(x, normalized_shape, weight, eps, out=out)[0]

    def rms_norm_backward(self, dy, x, rstd, normalized_shape, weight=None):
        return self._rms_norm_backward(dy, None, x, rstd, normalized_shape, weight, "x")

    def _rms_norm_backward(self, dy, ds, x, rstd, normalized_shape, weight, x_name):
        """RMSNorm backward with ``ds`` (None or like x) added to dx; ``x_name`` for errors."""
        caller_x = x
        dy, ds, x, rstd, weight = self._native(dy=dy, ds=ds, **{x_name: x}, rstd=rstd, weight=weight)
        xdt = V.float_dtype(x_name, x)
        M, N, nshape = V.rows(x.shape, normalized_shape)
        V.same_as_x("dy", dy, x.shape, xdt, check_dtype=False)
        V.same_as_x("ds", ds, x.shape, xdt, check_dtype=False, optional=True)
        batch = x.shape[: len(x.shape) - len(nshape)]
        V.stats("rstd", rstd, x.shape, batch, len(nshape))
        V.param("weight", weight, nshape)
        # ----
        backend = self.backend
        ctx = backend.call_context(caller_x)
        acc = V.acc_dtype(xdt)
        dx = backend.empty(ctx, (M, N), xdt)
        dw = backend.empty(ctx, (N,), self._grads_in(weight, xdt, acc))
        backend.launch(
            ctx, backend.rms_norm.backward,
            self._rows_like(ctx, dy, (M, N), xdt), backend.contiguous(ctx, x, (M, N)),
            self._stat(ctx, rstd, (M,), acc), self._param(ctx, weight, N), dx, dw,
            ds=self._rows_or_none(ctx, ds, (M, N), xdt))
        grad_dtype = self._grad_dtype(weight, xdt)
        return (backend.wrap(dx.reshape(x.shape), caller_x),
                backend.wrap(backend.cast(ctx, dw, grad_dtype).reshape(nshape), caller_x))

    # ------------------------------------------------------------ GroupNorm

    def group_norm_forward(self, x, num_groups, weight=None, bias=None, eps=1e-5, *, out=None):
        caller_x = x
        x, weight, bias, out_native = self._native(x=x, weight=weight, bias=bias, out=out)
        xdt = V.float_dtype("x", x)
        n, c, s, g = V.groups(x.shape, num_groups)
        V.param("weight", weight, (c,))
        V.param("bias", bias, (c,))
        eps = V.check_eps(eps, xdt)
        V.same_as_x("out", out_native, x.shape, xdt, optional=True)
        # ----
        backend = self.backend
        ctx = backend.call_context(caller_x)
        acc = V.acc_dtype(xdt)
        y, copy_back = self._output(ctx, out_native, (n, c, s), xdt)
        mean = backend.empty(ctx, (n, g), acc)
        rstd = backend.empty(ctx, (n, g), acc)
        if n:
            backend.launch(ctx, backend.group_norm.forward, backend.contiguous(ctx, x, (n, c, s)),
                           self._param(ctx, weight, c), self._param(ctx, bias, c), eps, y, mean, rstd)
        return (self._result(ctx, y, copy_back, out, out_native, x.shape, caller_x),
                backend.wrap(mean, caller_x), backend.wrap(rstd, caller_x))

    def group_norm(self, x, num_groups, weight=None, bias=None, eps=1e-5, *, out=None):
        return self.group_norm_forward(x, num_groups, weight, bias, eps, out=out)[0]

    def group_norm_backward(self, dy, x, mean, rstd, weight=None):
        caller_x = x
        dy, x, mean, rstd, weight = self._native(dy=dy, x=x, mean=mean, rstd=rstd, weight=weight)
        xdt = V.float_dtype("x", x)
        V.float_dtype("mean", mean)
        if len(mean.shape) != 2:
            raise ValueError(f"`mean` has shape {tuple(mean.shape)}, expected (N, num_groups)")
        n, c, s, g = V.groups(x.shape, mean.shape[1])
        V.same_as_x("dy", dy, x.shape, xdt, check_dtype=False)
        V.group_stats("mean", mean, n, g, x.shape)
        V.group_stats("rstd", rstd, n, g, x.shape)
        V.param("weight", weight, (c,))
        # ----
        backend = self.backend
        ctx = backend.call_context(caller_x)
        acc = V.acc_dtype(xdt)
        dx = backend.empty(ctx, (n, c, s), xdt)
        dw = backend.empty(ctx, (c,), self._grads_in(weight, xdt, acc))
        db = backend.empty(ctx, (c,), self._grads_in(weight, xdt, acc))
        backend.launch(
            ctx, backend.group_norm.backward,
            self._rows_like(ctx, dy, (n, c, s), xdt), backend.contiguous(ctx, x, (n, c, s)),
            self._stat(ctx, mean, (n, g), acc), self._stat(ctx, rstd, (n, g), acc),
            self._param(ctx, weight, c), dx, dw, db)
        grad_dtype = self._grad_dtype(weight, xdt)
        return (backend.wrap(dx.reshape(x.shape), caller_x),
                backend.wrap(backend.cast(ctx, dw, grad_dtype), caller_x),
                backend.wrap(backend.cast(ctx, db, grad_dtype), caller_x))

    # ------------------------------------------------------------ fused residual add

    def add_layer_norm_forward(self, x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
        caller_x = x
        x, residual, weight, bias = self._native(x=x, residual=residual, weight=weight, bias=bias)
        xdt = V.float_dtype("x", x)
        V.float_dtype("residual", residual)
        M, N, nshape = V.rows(x.shape, normalized_shape)
        V.same_as_x("residual", residual, x.shape, xdt)
        V.param("weight", weight, nshape)
        V.param("bias", bias, nshape)
        eps = V.check_eps(eps, xdt)
        # ----
        backend = self.backend
        ctx = backend.call_context(caller_x)
        acc = V.acc_dtype(xdt)
        y = backend.empty(ctx, (M, N), xdt)
        s = backend.empty(ctx, (M, N), xdt)
        mean = backend.empty(ctx, (M,), acc)
        rstd = backend.empty(ctx, (M,), acc)
        if M:
            backend.launch(
                ctx, backend.add_norm.layer_norm_forward,
                backend.contiguous(ctx, x, (M, N)), backend.contiguous(ctx, residual, (M, N)),
                self._param(ctx, weight, N), self._param(ctx, bias, N), eps, y, s, mean, rstd)
        stat_shape = _stat_shape(x.shape, len(nshape))
        return (backend.wrap(y.reshape(x.shape), caller_x), backend.wrap(s.reshape(x.shape), caller_x),
                backend.wrap(mean.reshape(stat_shape), caller_x),
                backend.wrap(rstd.reshape(stat_shape), caller_x))

    def add_layer_norm(self, x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
        return self.add_layer_norm_forward(x, residual, normalized_shape, weight, bias, eps)[:2]

    def add_layer_norm_backward(self, dy, ds, s, mean, rstd, normalized_shape, weight=None):
        return self._layer_norm_backward(dy, ds, s, mean, rstd, normalized_shape, weight, "s")

    def add_rms_norm_forward(self, x, residual, normalized_shape, weight=None, eps=None):
        caller_x = x
        x, residual, weight = self._native(x=x, residual=residual, weight=weight)
        xdt = V.float_dtype("x", x)
        V.float_dtype("residual", residual)
        M, N, nshape = V.rows(x.shape, normalized_shape)
        V.same_as_x("residual", residual, x.shape, xdt)
        V.param("weight", weight, nshape)
        eps = V.rms_eps(eps, xdt)
        # ----
        backend = self.backend
        ctx = backend.call_context(caller_x)
        acc = V.acc_dtype(xdt)
        y = backend.empty(ctx, (M, N), xdt)
        s = backend.empty(ctx, (M, N), xdt)
        rstd = backend.empty(ctx, (M,), acc)
        if M:
            backend.launch(
                ctx, backend.add_norm.rms_norm_forward,
                backend.contiguous(ctx, x, (M, N)), backend.contiguous(ctx, residual, (M, N)),
                self._param(ctx, weight, N), eps, y, s, rstd)
        stat_shape = _stat_shape(x.shape, len(nshape))
        return (backend.wrap(y.reshape(x.shape), caller_x), backend.wrap(s.reshape(x.shape), caller_x),
                backend.wrap(rstd.reshape(stat_shape), caller_x))

    def add_rms_norm(self, x, residual, normalized_shape, weight=None, eps=None):
        return self.add_rms_norm_forward(x, residual, normalized_shape, weight, eps)[:2]

    def add_rms_norm_backward(self, dy, ds, s, rstd, normalized_shape, weight=None):
        return self._rms_norm_backward(dy, ds, s, rstd, normalized_shape, weight, "s")

    # ------------------------------------------------------------ small pieces

    def _rows_like(self, ctx, a, shape, dtype):
        """``dy``/``ds`` flattened and in x's dtype (the kernels read both as x's type)."""
        return self.backend.contiguous(ctx, self.backend.cast(ctx, a, dtype), shape)

    def _rows_or_none(self, ctx, a, shape, dtype):
        return None if a is None else self._rows_like(ctx, a, shape, dtype)

    def _stat(self, ctx, a, shape, acc):
        return self.backend.contiguous(ctx, self.backend.cast(ctx, a, acc), shape)

    def _grads_in(self, weight, xdt, acc):
        """dweight/dbias are allocated in their own dtype where the backend's kernels round the
        sums into it as they store them (the cast after is then a no-op), else in ``acc``."""
        return self._grad_dtype(weight, xdt) if getattr(self.backend, "grads_in_any_dtype", False) else acc

    @staticmethod
    def _grad_dtype(weight, xdt):
        """dweight/dbias come back in the weight's dtype, or x's without a weight."""
        return weight.dtype if weight is not None else xdt


def _stat_shape(x_shape, k):
    return tuple(x_shape[: len(x_shape) - k]) + (1,) * k
