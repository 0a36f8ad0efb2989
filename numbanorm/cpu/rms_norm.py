"""RMSNorm on the CPU: forward and backward kernels with their launchers.

    rstd = 1 / sqrt(sum(x^2) / N + eps)
    y    = x * rstd * weight

No mean is subtracted, so one pass gives the statistic and a second writes y.
"""

import numpy as np
from numba import njit, prange

from ._common import FASTMATH, acc_of, compute_view, finish, launch, n_chunks, param, scratch_for


@njit(parallel=True, cache=True, fastmath=FASTMATH, nogil=True)
def _forward(
    x,      # (M, N) input rows, float32/float64
    w,      # (N,) weight in the accumulation dtype, or None
    eps,    # scalar in the accumulation dtype
    y,      # (M, N) output, x's dtype
    rstd,   # (M,) per-row 1/sqrt(mean(x^2) + eps), accumulation dtype
):
    M, N = x.shape
    zero = rstd.dtype.type(0)
    one = rstd.dtype.type(1)
    inv_n = one / rstd.dtype.type(N)
    for i in prange(M):
        row = x[i]
        sq = zero
        for j in range(N):
            sq += row[j] * row[j]
        r = one / np.sqrt(sq * inv_n + eps)
        rstd[i] = r
        out = y[i]
        for j in range(N):
            v = row[j] * r
            if w is not None:
                v = v * w[j]
            out[j] = v


@njit(parallel=True, cache=True, fastmath=FASTMATH, nogil=True)
def _backward(
    dy,       # (M, N) gradient of y
    x,        # (M, N) forward input
    rstd,     # (M,) saved rstd
    w,        # (N,) weight in the accumulation dtype, or None (ones)
    ds,       # (M, N) gradient added straight to dx (fused residual), or None
    dx,       # (M, N) output: gradient of x
    dw_part,  # (B, N) per-row-block partial sums of dy * xhat, accumulation dtype
):
    M, N = x.shape
    B = dw_part.shape[0]
    zero = rstd.dtype.type(0)
    inv_n = rstd.dtype.type(1) / rstd.dtype.type(N)
    for blk in prange(B):
        dwp = dw_part[blk]
        for j in range(N):
            dwp[j] = zero
        for i in range(blk * M // B, (blk + 1) * M // B):
            r = rstd[i]
            # pass 1: c1 = mean(xhat * wdy)
            c1 = zero
            for j in range(N):
                wdy = dy[i, j] * w[j] if w is not None else dy[i, j]
                c1 += x[i, j] * r * wdy
            c1 *= inv_n
            # pass 2 (row still in cache): dx and this block's dweight
            for j in range(N):
                g = dy[i, j]
                xhat = x[i, j] * r
                wdy = g * w[j] if w is not None else g
                v = (wdy - xhat * c1) * r
                if ds is not None:
                    v = v + ds[i, j]
                dx[i, j] = v
                dwp[j] += g * xhat


def forward(x, weight, eps, y, rstd):
    """Fill ``y`` (M, N) and ``rstd`` (M,); shapes and dtypes as in layer_norm.forward."""
    acc = acc_of(x.dtype)
    ys = scratch_for(y)
    launch(_forward, x.size, compute_view(x), param(weight, acc), acc.type(eps), ys, rstd)
    finish(ys, y)


def backward(dy, x, rstd, weight, dx, dweight, ds=None):
    """Fill ``dx`` (M, N) and ``dweight`` (N,) in the accumulation dtype."""
    M, N = x.shape
    acc = acc_of(x.dtype)
    if M == 0:
        dweight[:] = 0
        return
    dw_part = np.empty((n_chunks(M), N), acc)
    dxs = scratch_for(dx)
    launch(_backward, x.size, compute_view(dy), compute_view(x), rstd, param(weight, acc),
           compute_view(ds), dxs, dw_part)
    finish(dxs, dx)
    np.sum(dw_part, axis=0, out=dweight)
