"""LayerNorm on the GPU: the launchers the backend calls (the kernels, shared with
RMSNorm, are ``row_norm``'s with ``kind='layer'``)."""

from . import row_norm


def forward(x, weight, bias, eps, y, mean, rstd, residual=None, s=None, y_mapped=False):
    """Fill ``y``, ``mean``, ``rstd`` for the rows of ``x``.

    x, y: (M, N) C-contiguous device arrays of x's dtype; weight, bias: (N,) any
    float dtype or None; mean, rstd: (M,) float32 (float64 for float64 x).
    ``residual``/``s`` (both or neither, ``numbanorm.cuda.add_norm``): normalize
    ``s = x + residual``, stored into ``s``.  ``y_mapped`` (the frontend's hint
    that y is a caller's ``out=``) chooses CPU store instructions; device memory
    has no page faults to avoid, and it is unused here.
    """
    row_norm.forward("layer", x, weight, bias, eps, y, mean, rstd, residual, s)


def backward(dy, x, mean, rstd, weight, dx, dweight, dbias, ds=None):
    """Fill ``dx`` (M, N) and ``dweight``/``dbias`` (N,) in the accumulation dtype.

    ``ds`` (M, N) or None is added to ``dx`` (the fused residual's gradient).
    """
    row_norm.backward("layer", dy, x, mean, rstd, weight, dx, dweight, dbias, ds)
