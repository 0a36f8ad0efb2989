"""LayerNorm on the CPU: forward and backward kernels with their launchers.

    mean = sum(x) / N                 (first pass over the row)
    rstd = 1 / sqrt(sum((x - mean)^2) / N + eps)   (second pass: two-pass variance)
    y    = (x - mean) * rstd * weight + bias

One row (up to tens of KiB) stays in L1/L2 between the passes, so x is read
from memory once; the extra passes cost cache bandwidth only.  A large
caller's ``out=`` is written with streaming stores (``memory``).
"""

import numpy as np
from numba import prange

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .common import FASTMATH, acc_of, compute_view, finish, launch, n_chunks, param, row_block, scratch_for, serial_variant
from .memory import should_stream, store_fence, stream_row


@njit(parallel=True, cache=True, fastmath=FASTMATH, nogil=True)
def _forward(
    x,      # (M, N) input rows, float32/float64
    w,      # (N,) weight in the accumulation dtype, or None
    b,      # (N,) bias in the accumulation dtype, or None
    eps,    # scalar in the accumulation dtype
    y,      # (M, N) output, x's dtype
    mean,   # (M,) per-row mean, accumulation dtype
    rstd,   # (M,) per-row 1/sqrt(var + eps), accumulation dtype
    block,  # scalar: rows per block, the unit of parallel work
    stream, # scalar bool: write y with streaming stores (memory)
):
    M, N = x.shape
    # Every scalar is made in the accumulation dtype: a bare Python int or float
    # would promote float32 arithmetic to float64 (NumPy's scalar rules).
    zero = mean.dtype.type(0)
    one = mean.dtype.type(1)
    inv_n = one / mean.dtype.type(N)
    for blk in prange(-(-M // block)):
        lo = blk * block
        hi = min(M, lo + block)
        scratch = np.empty((1, N if stream else 0), y.dtype)  # a streamed row is staged here
        for i in range(lo, hi):
            # passes 1 and 2 read row i from memory, then from cache
            mu = row_sum(x, i, zero) * inv_n
            corr, var = deviation_stats(x, i, mu, zero, inv_n)
            r = one / np.sqrt(var + eps)
            mean[i] = mu + corr
            rstd[i] = r
            # pass 3 writes the row whole: in tiles of 256 columns (to stream
            # each tile out while in L1, prefetching row i + 1 between tiles)
            # this kernel took 3.3-3.6x np.copyto at (16384, 4096) and
            # (65536, 768), against 0.9x and 0.7x whole.  Prefetching the next
            # row whole, before the write, gained nothing (0.99x, 0.68x).
            if stream:
                normalize_row(x, i, mu, corr, r, w, b, scratch, 0)
                stream_row(y, i, scratch, 0)
            else:
                normalize_row(x, i, mu, corr, r, w, b, y, i)
        if stream:
            store_fence()


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def row_sum(
    x,      # (M, N) rows
    i,      # scalar: the row
    zero,   # scalar 0 in the accumulation dtype
):
    """``sum(x[i])``, in vector lanes ('reassoc').

    Every reduction of the row kernels is a loop of its own that stores
    nothing.  LLVM runs a vectorized loop that stores only after a run-time
    check that the stores do not overlap the loads, else its scalar copy, and
    the two add a reduction in different orders: a row sum made in the loop that
    wrote y came out different, by an ulp, for 14% of fresh outputs (the check
    is conservative and depends on where the arrays lie).  A loop that stores
    nothing has no such check.
    """
    total = zero
    for j in range(x.shape[1]):
        total += x[i, j]
    return total


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def deviation_stats(
    x,      # (M, N) rows (of x, or of s = x + residual)
    i,      # scalar: the row
    mu,     # scalar: its first-pass mean, accumulation dtype
    zero,   # scalar 0 in the accumulation dtype
    inv_n,  # scalar 1/N in the accumulation dtype
):
    """``(corr, var)`` of row ``i`` from a second pass over its deviations from ``mu``.

    Their sum corrects the rounding error of mu itself (Chan, Golub & LeVeque's
    corrected two-pass), so the row's mean is ``mu + corr``.
    """
    dsum = zero
    sq = zero
    for j in range(x.shape[1]):
        d = x[i, j] - mu
        dsum += d
        sq += d * d
    corr = dsum * inv_n
    var = sq * inv_n - corr * corr
    if var < zero:  # rounding on a constant row (a NaN fails the test and stays NaN)
        var = zero
    return corr, var


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def normalize_row(
    x,      # (M, N) input rows
    i,      # scalar: the row to write (in cache)
    mu,     # scalar: row i's first-pass mean
    corr,   # scalar: the mean's correction, mean = mu + corr
    r,      # scalar: row i's rstd
    w,      # (N,) weight or None
    b,      # (N,) bias or None
    out,    # (K, N) where the normalized row goes
    o,      # scalar: the row of `out`
):
    """Write row ``i``, normalized, into ``out[o]``.

    ``((x - mu) - corr) * r`` must be evaluated in that order: folded into
    ``x - (mu + corr)``, the correction would round onto the float32 grid near
    the mean (1e-3 at a mean of 1e4, a tenth of the std of the contract's
    large-offset case) and shift every output by up to 0.05.  FASTMATH's
    'reassoc' alone does not let LLVM fold it -- its reassociation of
    subtractions also needs 'nsz', and with {'reassoc', 'nsz'} this loop
    compiles to ``x - (mu + corr)`` (inspected with ``inspect_llvm``).  The
    large-offset tests against the oracle fail if a compiler ever folds it.

    Inlined, and given rows as (array, index) rather than as views: a call, or
    a view, costs an atomically counted reference per row, and atomics drain
    the write-combining buffers of streaming stores (one atomic add per row
    took a streaming copy of (65536, 768) float32 from 0.89x to 1.25x
    np.copyto; a non-inlined helper called per 256 columns made this kernel 3.6x).
    """
    for j in range(x.shape[1]):
        v = ((x[i, j] - mu) - corr) * r
        if w is not None:
            v = v * w[j]
        if b is not None:
            v = v + b[j]
        out[o, j] = v


@njit(parallel=True, cache=True, fastmath=FASTMATH, nogil=True)
def _backward(
    dy,       # (M, N) gradient of y
    x,        # (M, N) forward input
    mean,     # (M,) saved mean
    rstd,     # (M,) saved rstd
    w,        # (N,) weight in the accumulation dtype, or None (ones)
    ds,       # (M, N) gradient added straight to dx (fused residual), or None
    dx,       # (M, N) output: gradient of x
    dw_part,  # (B, N) per-row-block partial sums of dy * xhat, accumulation dtype
    db_part,  # (B, N) per-row-block partial sums of dy, accumulation dtype
):
    M, N = x.shape
    B = dw_part.shape[0]
    zero = mean.dtype.type(0)
    inv_n = mean.dtype.type(1) / mean.dtype.type(N)
    for blk in prange(B):
        lo = blk * M // B
        hi = (blk + 1) * M // B
        # This block's partials, in a local array (in L1/L2) rather than a row of
        # dw_part: 0.80x against 0.88x the copies of x and dy at (16384, 4096).
        dwp = np.zeros(N, dw_part.dtype)
        dbp = np.zeros(N, dw_part.dtype)
        for i in range(lo, hi):
            mu = mean[i]
            r = rstd[i]
            # pass 1: c1 = mean(xhat * wdy), c2 = mean(wdy), where
            # xhat = ((x - mu) - corr) * r and corr = mean(x - mu) corrects the
            # saved mean for its rounding to the float32 grid (at mean 1e4 the
            # grid is 1e-3, 5% of the std of the contract's large-offset case,
            # which left dweight 1.4e-2 off; with corr it is 5e-8 off).
            dsum, xw, c2 = backward_sums(dy, x, i, mu, w, zero)
            corr = dsum * inv_n
            c2 *= inv_n
            c1 = (xw * inv_n - corr * c2) * r
            # pass 2, from cache: dx and the partials, the whole row in one loop
            # (a 256-column tile at a time, with or without a prefetch of row
            # i + 1, it took 2.1-2.3x the copies of x and dy at (16384, 4096),
            # against 0.80-0.89x whole)
            backward_row(dy, x, i, mu, corr, r, w, ds, c1, c2, dx, dwp, dbp)
        dw_part[blk] = dwp
        db_part[blk] = dbp


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def backward_sums(
    dy,     # (M, N) gradient of y
    x,      # (M, N) forward input
    i,      # scalar: the row
    mu,     # scalar: its saved mean
    w,      # (N,) weight or None
    zero,   # scalar 0 in the accumulation dtype
):
    """Row ``i``'s ``(sum(x - mu), sum((x - mu) * wdy), sum(wdy))``, wdy = w * dy
    (a loop that stores nothing: see row_sum)."""
    dsum = zero
    xw = zero
    wsum = zero
    for j in range(x.shape[1]):
        d = x[i, j] - mu
        wdy = dy[i, j] * w[j] if w is not None else dy[i, j]
        dsum += d
        xw += d * wdy
        wsum += wdy
    return dsum, xw, wsum


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def backward_row(
    dy,     # (M, N) gradient of y
    x,      # (M, N) forward input
    i,      # scalar: the row (dy[i], x[i] in cache)
    mu,     # scalar: row i's saved mean
    corr,   # scalar: its correction, mean(x - mu)
    r,      # scalar: row i's saved rstd
    w,      # (N,) weight or None
    ds,     # (M, N) fused residual gradient or None
    c1,     # scalar: row i's mean(xhat * wdy)
    c2,     # scalar: row i's mean(wdy)
    dx,     # (M, N) output
    dwp,    # (N,) this row block's dweight partial, accumulated into
    dbp,    # (N,) this row block's dbias partial, accumulated into
):
    """Row ``i`` of dx, and its terms of the partials.

    ``(x - mu) - corr`` stays in that order for the reason of normalize_row.
    No 'contract' (FASTMATH): fused into a multiply-add, ``wdy - c2`` is not
    exactly 0 for a one-element row.
    """
    for j in range(x.shape[1]):
        g = dy[i, j]
        xhat = ((x[i, j] - mu) - corr) * r
        wdy = g * w[j] if w is not None else g
        v = (wdy - (xhat * c1 + c2)) * r
        if ds is not None:
            v = v + ds[i, j]
        dx[i, j] = v
        dwp[j] += g * xhat
        dbp[j] += g


def forward(x, weight, bias, eps, y, mean, rstd, y_mapped=False):
    """Fill ``y``, ``mean``, ``rstd`` for the rows of ``x``.

    x, y: (M, N) C-contiguous of x's dtype; weight, bias: (N,) any float dtype or
    None; mean, rstd: (M,) C-contiguous, float32 (float64 for float64 x).
    ``y_mapped``: y is a caller's ``out=``, its pages already mapped, so a large
    y goes out through streaming stores (``memory``).
    """
    acc = acc_of(x.dtype)
    ys = scratch_for(y, x, weight, bias)
    launch(_forward, x.size, compute_view(x), param(weight, acc), param(bias, acc),
           acc.type(eps), ys, mean, rstd, row_block(x.shape[0]), should_stream(ys, y_mapped and ys is y))
    finish(ys, y)


def backward(dy, x, mean, rstd, weight, dx, dweight, dbias, ds=None):
    """Fill ``dx`` (M, N) and ``dweight``/``dbias`` (N,) in the accumulation dtype.

    ``ds`` (M, N) or None is added to ``dx`` (the fused residual's gradient).
    """
    M, N = x.shape
    acc = acc_of(x.dtype)
    if M == 0:
        dweight[:] = 0
        dbias[:] = 0
        return
    B = n_chunks(M)
    dw_part = np.empty((B, N), acc)
    db_part = np.empty((B, N), acc)
    dxs = scratch_for(dx)
    launch(_backward, x.size, compute_view(dy), compute_view(x), mean, rstd,
           param(weight, acc), compute_view(ds), dxs, dw_part, db_part)
    finish(dxs, dx)
    # fixed-order sum of the block partials: bit-identical for any thread count
    np.sum(dw_part, axis=0, out=dweight)
    np.sum(db_part, axis=0, out=dbias)


# Serial twins of the parallel kernels (common.launch)
serial_variant(_forward)
serial_variant(_backward)
