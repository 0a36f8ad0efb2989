"""RMSNorm on the CPU: forward and backward kernels with their launchers.

    rstd = 1 / sqrt(sum(x^2) / N + eps)
    y    = x * rstd * weight

No mean is subtracted, so one pass gives the statistic and a second writes y;
the forward overlaps them across rows as LayerNorm's does.
"""

import numpy as np
from numba import njit, prange

from ._common import FASTMATH, acc_of, compute_view, finish, launch, n_chunks, param, row_block, scratch_for
from ._stream import should_stream, store_fence, stream_row


@njit(parallel=True, cache=True, fastmath=FASTMATH, nogil=True)
def _forward(
    x,      # (M, N) input rows, float32/float64
    w,      # (N,) weight in the accumulation dtype, or None
    eps,    # scalar in the accumulation dtype
    y,      # (M, N) output, x's dtype
    rstd,   # (M,) per-row 1/sqrt(mean(x^2) + eps), accumulation dtype
    block,  # scalar: rows per block, the unit of parallel work
    stream, # scalar bool: write y with streaming stores (_stream)
):
    M, N = x.shape
    zero = rstd.dtype.type(0)
    one = rstd.dtype.type(1)
    inv_n = one / rstd.dtype.type(N)
    for blk in prange(-(-M // block)):
        lo = blk * block
        hi = min(M, lo + block)
        # the software pipeline of layer_norm._forward: one call site, the
        # loop that writes row i sums the squares of row i + 1
        scratch = np.empty((1, N), y.dtype)
        dst = scratch if stream else y
        r = zero
        for i in range(lo - 1, hi):
            cur = max(i, lo)
            sq = scale_row_and_sum_squares(x[cur], r, w, dst[0 if stream else cur],
                                           x[min(i + 1, hi - 1)], zero)
            if stream and i >= lo:
                stream_row(y[i], scratch[0])
            if i + 1 < hi:
                r = one / np.sqrt(sq * inv_n + eps)
                rstd[i + 1] = r
        if stream:
            store_fence()


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def scale_row_and_sum_squares(
    row,    # (N,) the row to write, in cache
    r,      # scalar: its rstd
    w,      # (N,) weight or None
    out,    # (N,) where the scaled row goes
    nxt,    # (N,) the next row, read from memory
    zero,   # scalar 0 in the accumulation dtype
):
    """Write ``row * r * w`` into ``out``; return the sum of squares of ``nxt``."""
    sq = zero
    for j in range(row.shape[0]):
        sq += nxt[j] * nxt[j]
        v = row[j] * r
        if w is not None:
            v = v * w[j]
        out[j] = v
    return sq


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
        lo = blk * M // B
        hi = (blk + 1) * M // B
        # the software pipeline of layer_norm._backward
        dwl = np.zeros((2, N), dw_part.dtype)
        c1 = zero
        for i in range(lo - 1, hi):
            cur = max(i, lo)
            k = min(i + 1, hi - 1)
            c1 = backward_row_and_sum(dy[cur], x[cur], rstd[cur], w, ds[cur] if ds is not None else None,
                                      c1 * inv_n, dx[cur], dwl[1 if i >= lo else 0],
                                      dy[k], x[k], rstd[k], zero)
        dw_part[blk] = dwl[1]


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def backward_row_and_sum(
    dy,     # (N,) gradient of y for this row, in cache
    x,      # (N,) this row of the input, in cache
    r,      # scalar: saved rstd
    w,      # (N,) weight or None
    ds,     # (N,) fused residual gradient or None
    c1,     # scalar: mean(xhat * wdy)
    dx,     # (N,) output row
    dwp,    # (N,) this row block's dweight partial, accumulated into
    dyn,    # (N,) the next row's gradient, read from memory
    xn,     # (N,) the next row's input, read from memory
    rn,     # scalar: the next row's saved rstd
    zero,   # scalar 0 in the accumulation dtype
):
    """Write this row's dx and add to the partial; return the next row's sum(xhat * wdy)."""
    c1n = zero
    for j in range(x.shape[0]):
        wdyn = dyn[j] * w[j] if w is not None else dyn[j]
        c1n += xn[j] * rn * wdyn
        g = dy[j]
        xhat = x[j] * r
        wdy = g * w[j] if w is not None else g
        v = (wdy - xhat * c1) * r
        if ds is not None:
            v = v + ds[j]
        dx[j] = v
        dwp[j] += g * xhat
    return c1n


def forward(x, weight, eps, y, rstd, y_mapped=False):
    """Fill ``y`` (M, N) and ``rstd`` (M,); arguments as in layer_norm.forward."""
    acc = acc_of(x.dtype)
    ys = scratch_for(y, x)
    launch(_forward, x.size, compute_view(x), param(weight, acc), acc.type(eps), ys, rstd,
           row_block(x.shape[0]), should_stream(ys, y_mapped and ys is y))
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
