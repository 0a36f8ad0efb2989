"""LayerNorm on the GPU: the launchers the backend calls (the kernels, shared with
RMSNorm, are ``row_norm``'s with ``kind='layer'``)."""

from . import row_norm


def forward(x, weight, bias, eps, y, mean, rstd, residual=None, s=None, *, stream=0):
    """Fill ``y``, ``mean``, ``rstd`` for the rows of ``x``.

    x, y: (M, N) C-contiguous device arrays of x's dtype; weight, bias: (N,) any
    float dtype or None; mean, rstd: (M,) float32 (float64 for float64 x).
    ``residual``/``s`` (both or neither, ``add_norm``): normalize
    ``s = x + residual``, stored into ``s``.  ``stream``: the numba stream the
    kernels run on (0: the default stream; the backend passes the call's).
    """
    row_norm.forward("layer", x, weight, bias, eps, y, mean, rstd, residual, s, stream)


def backward(dy, x, mean, rstd, weight, dx, dweight, dbias, ds=None, *, stream=0, empty=None):
    """Fill ``dx`` (M, N) and ``dweight``/``dbias`` (N,) of any float dtype (summed in
    the accumulation dtype, rounded once as stored).

    ``ds`` (M, N) or None is added to ``dx`` (the fused residual's gradient).  ``empty``:
    the allocator of the partial sums (``row_norm.backward``).
    """
    row_norm.backward("layer", dy, x, mean, rstd, weight, dx, dweight, dbias, ds, stream, empty)
