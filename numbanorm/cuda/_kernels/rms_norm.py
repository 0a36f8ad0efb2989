"""RMSNorm on the GPU: the launchers the backend calls (the kernels, shared with
LayerNorm, are ``row_norm``'s with ``kind='rms'``)."""

from . import row_norm


def forward(x, weight, eps, y, rstd, residual=None, s=None, *, stream=0):
    """Fill ``y`` (M, N) and ``rstd`` (M,); arguments as in layer_norm.forward."""
    row_norm.forward("rms", x, weight, None, eps, y, None, rstd, residual, s, stream)


def backward(dy, x, rstd, weight, dx, dweight, ds=None, *, stream=0, empty=None):
    """Fill ``dx`` (M, N) and ``dweight`` (N,) of any float dtype (as layer_norm.backward)."""
    row_norm.backward("rms", dy, x, None, rstd, weight, dx, dweight, None, ds, stream, empty)
