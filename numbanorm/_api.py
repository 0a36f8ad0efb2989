"""The public functions, written once for every backend.

A ``Frontend`` runs each call in the same order:

1. ``common_side`` looks at the arguments' types only and rejects host and device
   arrays mixed in one call;
2. the backend's ``native`` views each argument as the backend's array type
   (no copy, no allocation);
3. ``numbanorm._validate`` checks dtypes, shapes and scalars and works out the
   flattened problem -- every contract error is raised here, before step 4;
4. outputs are allocated, inputs made contiguous, and the backend's launcher for
   the norm fills the outputs;
5. results are reshaped (statistics keep-dims) and handed back in the caller's
   array type.

A backend is an object with these members (``numbanorm.cpu._backend`` and
``numbanorm.cuda._backend`` are the two):

    name                          'cpu' or 'cuda'
    native(name, a)               a zero-copy view of ``a`` (None stays None)
    contiguous(a, shape)          C-contiguous array of ``shape`` with a's values
    empty(shape, dtype)           uninitialised array
    out_view(out, shape)          ``out`` seen as ``shape`` if it is C-contiguous, else None
    copy_into(dst, src)           dst[...] = src (same size; dst may be strided)
    cast(a, dtype)                ``a`` in ``dtype`` (no copy when it already is)
    wrap(a, like)                 ``a`` in the array type of the caller's ``like``
    layer_norm, rms_norm, group_norm
                                  modules with the ``forward``/``backward`` launchers
                                  of ``numbanorm.cpu.layer_norm`` and its siblings
                                  (the row forward launchers take ``y_mapped``: y is
                                  the caller's ``out=``, not a fresh allocation; the
                                  row backward launchers take ``ds=None``, a
                                  gradient added to dx: the fused residual's)
    add_norm                      module with the fused residual-add forward
                                  launchers of ``numbanorm.cpu.add_norm``
"""

from __future__ import annotations

from . import _validate as V


class Frontend:
    def __init__(self, backend):
        self.be = backend

    # ------------------------------------------------------------ helpers

    def _native(self, **arrays):
        V.common_side(**arrays)
        nat = self.be.native
        return [nat(k, a) for k, a in arrays.items()]

    def _output(self, out_n, flat_shape, dtype):
        """``(y, copy_back)``: the array a launcher fills, ``out`` itself when it can."""
        if out_n is not None:
            view = self.be.out_view(out_n, flat_shape)
            if view is not None:
                return view, False
            return self.be.empty(flat_shape, dtype), True
        return self.be.empty(flat_shape, dtype), False

    def _result(self, y, copy_back, out, out_n, shape, like):
        if out is None:
            return self.be.wrap(y.reshape(shape), like)
        if copy_back:
            self.be.copy_into(out_n, y.reshape(shape))
        return out

    def _param(self, a, n):
        return None if a is None else self.be.contiguous(a, (n,))

    # ------------------------------------------------------------ LayerNorm

    def layer_norm_forward(self, x, normalized_shape, weight=None, bias=None, eps=1e-5, *, out=None):
        ox = x
        x, weight, bias, out_n = self._native(x=x, weight=weight, bias=bias, out=out)
        xdt = V.float_dtype("x", x)
        M, N, nshape = V.rows(x.shape, normalized_shape)
        V.param("weight", weight, nshape)
        V.param("bias", bias, nshape)
        eps = V.check_eps(eps)
        V.same_as_x("out", out_n, x.shape, xdt)
        # ---- everything below may allocate and write
        be = self.be
        acc = V.acc_dtype(xdt)
        y, copy_back = self._output(out_n, (M, N), xdt)
        mean = be.empty((M,), acc)
        rstd = be.empty((M,), acc)
        if M:
            be.layer_norm.forward(be.contiguous(x, (M, N)), self._param(weight, N),
                                  self._param(bias, N), eps, y, mean, rstd,
                                  y_mapped=out_n is not None and not copy_back)
        stat_shape = _stat_shape(x.shape, len(nshape))
        return (self._result(y, copy_back, out, out_n, x.shape, ox),
                be.wrap(mean.reshape(stat_shape), ox), be.wrap(rstd.reshape(stat_shape), ox))

    def layer_norm(self, x, normalized_shape, weight=None, bias=None, eps=1e-5, *, out=None):
        return self.layer_norm_forward(x, normalized_shape, weight, bias, eps, out=out)[0]

    def layer_norm_backward(self, dy, x, mean, rstd, normalized_shape, weight=None):
        return self._layer_norm_backward(dy, None, x, mean, rstd, normalized_shape, weight, "x")

    def _layer_norm_backward(self, dy, ds, x, mean, rstd, normalized_shape, weight, x_name):
        """LayerNorm backward with ``ds`` (None or like x) added to dx; ``x_name`` for errors."""
        ox = x
        dy, ds, x, mean, rstd, weight = self._native(
            dy=dy, ds=ds, **{x_name: x}, mean=mean, rstd=rstd, weight=weight)
        xdt = V.float_dtype(x_name, x)
        M, N, nshape = V.rows(x.shape, normalized_shape)
        V.same_as_x("dy", dy, x.shape, xdt, check_dtype=False)
        V.same_as_x("ds", ds, x.shape, xdt, check_dtype=False)
        batch = x.shape[: len(x.shape) - len(nshape)]
        V.stats("mean", mean, x.shape, batch, len(nshape))
        V.stats("rstd", rstd, x.shape, batch, len(nshape))
        V.param("weight", weight, nshape)
        # ----
        be = self.be
        acc = V.acc_dtype(xdt)
        dx = be.empty((M, N), xdt)
        dw = be.empty((N,), acc)
        db = be.empty((N,), acc)
        be.layer_norm.backward(
            self._rows_like(dy, (M, N), xdt), be.contiguous(x, (M, N)),
            self._stat(mean, (M,), acc), self._stat(rstd, (M,), acc),
            self._param(weight, N), dx, dw, db, ds=self._rows_or_none(ds, (M, N), xdt))
        pdt = self._param_dtype(weight, xdt)
        return (be.wrap(dx.reshape(x.shape), ox),
                be.wrap(be.cast(dw, pdt).reshape(nshape), ox),
                be.wrap(be.cast(db, pdt).reshape(nshape), ox))

    # ------------------------------------------------------------ RMSNorm

    def rms_norm_forward(self, x, normalized_shape, weight=None, eps=None, *, out=None):
        ox = x
        x, weight, out_n = self._native(x=x, weight=weight, out=out)
        xdt = V.float_dtype("x", x)
        M, N, nshape = V.rows(x.shape, normalized_shape)
        V.param("weight", weight, nshape)
        eps = V.rms_eps(eps, xdt)
        V.same_as_x("out", out_n, x.shape, xdt)
        # ----
        be = self.be
        acc = V.acc_dtype(xdt)
        y, copy_back = self._output(out_n, (M, N), xdt)
        rstd = be.empty((M,), acc)
        if M:
            be.rms_norm.forward(be.contiguous(x, (M, N)), self._param(weight, N), eps, y, rstd,
                                y_mapped=out_n is not None and not copy_back)
        stat_shape = _stat_shape(x.shape, len(nshape))
        return (self._result(y, copy_back, out, out_n, x.shape, ox),
                be.wrap(rstd.reshape(stat_shape), ox))

    def rms_norm(self, x, normalized_shape, weight=None, eps=None, *, out=None):
        return self.rms_norm_forward(x, normalized_shape, weight, eps, out=out)[0]

    def rms_norm_backward(self, dy, x, rstd, normalized_shape, weight=None):
        return self._rms_norm_backward(dy, None, x, rstd, normalized_shape, weight, "x")

    def _rms_norm_backward(self, dy, ds, x, rstd, normalized_shape, weight, x_name):
        """RMSNorm backward with ``ds`` (None or like x) added to dx; ``x_name`` for errors."""
        ox = x
        dy, ds, x, rstd, weight = self._native(dy=dy, ds=ds, **{x_name: x}, rstd=rstd, weight=weight)
        xdt = V.float_dtype(x_name, x)
        M, N, nshape = V.rows(x.shape, normalized_shape)
        V.same_as_x("dy", dy, x.shape, xdt, check_dtype=False)
        V.same_as_x("ds", ds, x.shape, xdt, check_dtype=False)
        batch = x.shape[: len(x.shape) - len(nshape)]
        V.stats("rstd", rstd, x.shape, batch, len(nshape))
        V.param("weight", weight, nshape)
        # ----
        be = self.be
        acc = V.acc_dtype(xdt)
        dx = be.empty((M, N), xdt)
        dw = be.empty((N,), acc)
        be.rms_norm.backward(
            self._rows_like(dy, (M, N), xdt), be.contiguous(x, (M, N)),
            self._stat(rstd, (M,), acc), self._param(weight, N), dx, dw,
            ds=self._rows_or_none(ds, (M, N), xdt))
        pdt = self._param_dtype(weight, xdt)
        return (be.wrap(dx.reshape(x.shape), ox), be.wrap(be.cast(dw, pdt).reshape(nshape), ox))

    # ------------------------------------------------------------ GroupNorm

    def group_norm_forward(self, x, num_groups, weight=None, bias=None, eps=1e-5, *, out=None):
        ox = x
        x, weight, bias, out_n = self._native(x=x, weight=weight, bias=bias, out=out)
        xdt = V.float_dtype("x", x)
        n, c, s, g = V.groups(x.shape, num_groups)
        V.param("weight", weight, (c,))
        V.param("bias", bias, (c,))
        eps = V.check_eps(eps)
        V.same_as_x("out", out_n, x.shape, xdt)
        # ----
        be = self.be
        acc = V.acc_dtype(xdt)
        y, copy_back = self._output(out_n, (n, c, s), xdt)
        mean = be.empty((n, g), acc)
        rstd = be.empty((n, g), acc)
        if n:
            be.group_norm.forward(be.contiguous(x, (n, c, s)), self._param(weight, c),
                                  self._param(bias, c), eps, y, mean, rstd)
        return (self._result(y, copy_back, out, out_n, x.shape, ox),
                be.wrap(mean, ox), be.wrap(rstd, ox))

    def group_norm(self, x, num_groups, weight=None, bias=None, eps=1e-5, *, out=None):
        return self.group_norm_forward(x, num_groups, weight, bias, eps, out=out)[0]

    def group_norm_backward(self, dy, x, mean, rstd, weight=None):
        ox = x
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
        be = self.be
        acc = V.acc_dtype(xdt)
        dx = be.empty((n, c, s), xdt)
        dw = be.empty((c,), acc)
        db = be.empty((c,), acc)
        be.group_norm.backward(
            self._rows_like(dy, (n, c, s), xdt), be.contiguous(x, (n, c, s)),
            self._stat(mean, (n, g), acc), self._stat(rstd, (n, g), acc),
            self._param(weight, c), dx, dw, db)
        pdt = self._param_dtype(weight, xdt)
        return (be.wrap(dx.reshape(x.shape), ox),
                be.wrap(be.cast(dw, pdt), ox), be.wrap(be.cast(db, pdt), ox))

    # ------------------------------------------------------------ fused residual add

    def add_layer_norm_forward(self, x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
        ox = x
        x, residual, weight, bias = self._native(x=x, residual=residual, weight=weight, bias=bias)
        xdt = V.float_dtype("x", x)
        V.float_dtype("residual", residual)
        M, N, nshape = V.rows(x.shape, normalized_shape)
        V.same_as_x("residual", residual, x.shape, xdt)
        V.param("weight", weight, nshape)
        V.param("bias", bias, nshape)
        eps = V.check_eps(eps)
        # ----
        be = self.be
        acc = V.acc_dtype(xdt)
        y = be.empty((M, N), xdt)
        s = be.empty((M, N), xdt)
        mean = be.empty((M,), acc)
        rstd = be.empty((M,), acc)
        if M:
            be.add_norm.layer_norm_forward(
                be.contiguous(x, (M, N)), be.contiguous(residual, (M, N)),
                self._param(weight, N), self._param(bias, N), eps, y, s, mean, rstd)
        stat_shape = _stat_shape(x.shape, len(nshape))
        return (be.wrap(y.reshape(x.shape), ox), be.wrap(s.reshape(x.shape), ox),
                be.wrap(mean.reshape(stat_shape), ox), be.wrap(rstd.reshape(stat_shape), ox))

    def add_layer_norm(self, x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
        return self.add_layer_norm_forward(x, residual, normalized_shape, weight, bias, eps)[:2]

    def add_layer_norm_backward(self, dy, ds, s, mean, rstd, normalized_shape, weight=None):
        return self._layer_norm_backward(dy, ds, s, mean, rstd, normalized_shape, weight, "s")

    def add_rms_norm_forward(self, x, residual, normalized_shape, weight=None, eps=None):
        ox = x
        x, residual, weight = self._native(x=x, residual=residual, weight=weight)
        xdt = V.float_dtype("x", x)
        V.float_dtype("residual", residual)
        M, N, nshape = V.rows(x.shape, normalized_shape)
        V.same_as_x("residual", residual, x.shape, xdt)
        V.param("weight", weight, nshape)
        eps = V.rms_eps(eps, xdt)
        # ----
        be = self.be
        acc = V.acc_dtype(xdt)
        y = be.empty((M, N), xdt)
        s = be.empty((M, N), xdt)
        rstd = be.empty((M,), acc)
        if M:
            be.add_norm.rms_norm_forward(
                be.contiguous(x, (M, N)), be.contiguous(residual, (M, N)),
                self._param(weight, N), eps, y, s, rstd)
        stat_shape = _stat_shape(x.shape, len(nshape))
        return (be.wrap(y.reshape(x.shape), ox), be.wrap(s.reshape(x.shape), ox),
                be.wrap(rstd.reshape(stat_shape), ox))

    def add_rms_norm(self, x, residual, normalized_shape, weight=None, eps=None):
        return self.add_rms_norm_forward(x, residual, normalized_shape, weight, eps)[:2]

    def add_rms_norm_backward(self, dy, ds, s, rstd, normalized_shape, weight=None):
        return self._rms_norm_backward(dy, ds, s, rstd, normalized_shape, weight, "s")

    # ------------------------------------------------------------ small pieces

    def _rows_like(self, a, shape, dtype):
        """``dy``/``ds`` flattened and in x's dtype (the kernels read both as x's type)."""
        return self.be.contiguous(self.be.cast(a, dtype), shape)

    def _rows_or_none(self, a, shape, dtype):
        return None if a is None else self._rows_like(a, shape, dtype)

    def _stat(self, a, shape, acc):
        return self.be.contiguous(self.be.cast(a, acc), shape)

    @staticmethod
    def _param_dtype(weight, xdt):
        return weight.dtype if weight is not None else xdt


def _stat_shape(x_shape, k):
    return tuple(x_shape[: len(x_shape) - k]) + (1,) * k
