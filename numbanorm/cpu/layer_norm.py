"""LayerNorm on the CPU: forward and backward kernels with their launchers.

    mean = sum(x) / N                 (first pass over the row)
    rstd = 1 / sqrt(sum((x - mean)^2) / N + eps)   (second pass: two-pass variance)
    y    = (x - mean) * rstd * weight + bias

One row (up to tens of KiB) stays in L1/L2 between the passes, so x is streamed
from memory once; the extra passes cost cache bandwidth only.
"""

import numpy as np
from numba import njit, prange

from ._common import FASTMATH, acc_of, compute_view, finish, launch, n_chunks, param, row_block, scratch_for
from ._stream import should_stream, store_fence, stream_row


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
    stream, # scalar bool: write y with streaming stores (_stream)
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
        # Software pipeline: the loop that writes row i also sums row i + 1, so
        # the core reads row i + 1 from memory while row i goes out.  One after
        # the other, a core's reads and writes do not overlap: (65536, 768)
        # float32 into out= took 1.04x np.copyto pipelined, 1.26x not (the
        # machine of _stream's docstring).
        #
        # One call site, so that one compiled loop makes every row's sum: two
        # inlined copies can be vectorized differently and sum in different
        # orders (the backward's did), and then a row's results would depend on
        # where it falls in a block.  The first iteration (i = lo - 1) only
        # needs the sum of row lo; it normalizes garbage into the row it is
        # about to overwrite.  The last sums row hi - 1 again, unused.
        #
        # Streaming stores go through a scratch row.  Which 2-D array the loop
        # writes into is chosen here, once: a row view chosen at run time inside
        # the loop keeps an atomically updated reference count, and an atomic
        # drains the write-combining buffers of streaming stores (one atomic
        # add per row took a streaming copy of (65536, 768) from 0.89x to 1.25x
        # np.copyto).  For the same reason the helpers are inlined.
        scratch = np.empty((1, N), y.dtype)
        dst = scratch if stream else y
        mu = corr = r = zero
        for i in range(lo - 1, hi):
            cur = max(i, lo)
            total = normalize_row_and_sum(x[cur], mu, corr, r, w, b, dst[0 if stream else cur],
                                          x[min(i + 1, hi - 1)], zero)
            if stream and i >= lo:
                stream_row(y[i], scratch[0])
            if i + 1 < hi:
                row = x[i + 1]  # in cache: the loop above has just summed it
                mu = total * inv_n
                corr, var = deviation_stats(row, mu, zero, inv_n)
                r = one / np.sqrt(var + eps)
                mean[i + 1] = mu + corr
                rstd[i + 1] = r
        if stream:
            store_fence()


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def normalize_row_and_sum(
    row,    # (N,) the row to write, in cache
    mu,     # scalar: its first-pass mean
    corr,   # scalar: the mean's correction, mean = mu + corr
    r,      # scalar: its rstd
    w,      # (N,) weight or None
    b,      # (N,) bias or None
    out,    # (N,) where the normalized row goes
    nxt,    # (N,) the next row, read from memory
    zero,   # scalar 0 in the accumulation dtype
):
    """Write ``row`` normalized into ``out``; return the sum of ``nxt``.

    ``((x - mu) - corr) * r`` must be evaluated in that order: folded into
    ``x - (mu + corr)``, the correction would round onto the float32 grid near
    the mean (1e-3 at a mean of 1e4, a tenth of the std of the contract's
    large-offset case) and shift every output by up to 0.05.  FASTMATH's
    'reassoc' alone does not let LLVM fold it -- its reassociation of
    subtractions also needs 'nsz', and with {'reassoc', 'nsz'} this loop
    compiles to ``x - (mu + corr)`` (inspected with ``inspect_llvm``) -- while
    it does let the sum of ``nxt`` run in vector lanes.  The large-offset tests
    against the oracle fail if a compiler ever folds it.
    """
    total = zero
    for j in range(row.shape[0]):
        total += nxt[j]
        v = ((row[j] - mu) - corr) * r
        if w is not None:
            v = v * w[j]
        if b is not None:
            v = v + b[j]
        out[j] = v
    return total


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def deviation_stats(
    row,    # (N,) one row (of x, or of s = x + residual)
    mu,     # scalar: its first-pass mean, accumulation dtype
    zero,   # scalar 0 in the accumulation dtype
    inv_n,  # scalar 1/N in the accumulation dtype
):
    """``(corr, var)`` from a second pass over the deviations from ``mu``.

    Their sum corrects the rounding error of mu itself (Chan, Golub & LeVeque's
    corrected two-pass), so the row's mean is ``mu + corr``.
    """
    dsum = zero
    sq = zero
    for j in range(row.shape[0]):
        d = row[j] - mu
        dsum += d
        sq += d * d
    corr = dsum * inv_n
    var = sq * inv_n - corr * corr
    if var < zero:  # rounding on a constant row (a NaN fails the test and stays NaN)
        var = zero
    return corr, var


@njit(cache=True, nogil=True)
def normalize_row(
    row,    # (N,) one input row
    mu,     # scalar: first-pass mean
    corr,   # scalar: its correction, mean = mu + corr
    r,      # scalar: rstd
    w,      # (N,) weight or None
    b,      # (N,) bias or None
    out,    # (N,) the output row
):
    # Compiled without fastmath on purpose: (x - mu) - corr must not be
    # reassociated into x - (mu + corr).  mu + corr rounds to the float32 grid,
    # which at a mean of 1e4 is 1e-3 -- a tenth of the std of the contract's
    # large-offset case -- and shifted every output by up to 0.05.  Elementwise
    # loops vectorize without fastmath, so this costs nothing.
    for j in range(row.shape[0]):
        v = ((row[j] - mu) - corr) * r
        if w is not None:
            v = v * w[j]
        if b is not None:
            v = v + b[j]
        out[j] = v


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
        # The forward's software pipeline, with one call site for the same
        # reason: the loop that writes dx for row i makes the sums of row i + 1
        # (1.15x instead of 1.38x the time of copying x and dy at (65536, 768)
        # float32, 2 threads).  At i = lo - 1 it writes garbage into dx[lo],
        # overwritten next, and its partials into row 0 of these, discarded.
        dwl = np.zeros((2, N), dw_part.dtype)
        dbl = np.zeros((2, N), dw_part.dtype)
        dsum = xw = c2 = c1 = corr = zero
        for i in range(lo - 1, hi):
            cur = max(i, lo)
            part = 1 if i >= lo else 0
            if i >= lo:
                # c1 = mean(xhat * wdy), c2 = mean(wdy), where
                # xhat = ((x - mu) - corr) * r and corr = mean(x - mu) corrects
                # the saved mean for its rounding to the float32 grid (at mean
                # 1e4 the grid is 1e-3, 5% of the std of the contract's
                # large-offset case, which left dweight 1.4e-2 off; with corr
                # it is 5e-8 off).
                corr = dsum * inv_n
                c2 *= inv_n
                c1 = (xw * inv_n - corr * c2) * rstd[i]
            k = min(i + 1, hi - 1)
            dsum, xw, c2 = backward_row_and_sums(
                dy[cur], x[cur], mean[cur], corr, rstd[cur], w, ds[cur] if ds is not None else None,
                c1, c2, dx[cur], dwl[part], dbl[part], dy[k], x[k], mean[k], zero)
        dw_part[blk] = dwl[1]
        db_part[blk] = dbl[1]


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def backward_row_and_sums(
    dy,     # (N,) gradient of y for this row, in cache
    x,      # (N,) this row of the input, in cache
    mu,     # scalar: saved mean
    corr,   # scalar: its correction, mean(x - mu)
    r,      # scalar: saved rstd
    w,      # (N,) weight or None
    ds,     # (N,) fused residual gradient or None
    c1,     # scalar: mean(xhat * wdy)
    c2,     # scalar: mean(wdy)
    dx,     # (N,) output row
    dwp,    # (N,) this row block's dweight partial, accumulated into
    dbp,    # (N,) this row block's dbias partial, accumulated into
    dyn,    # (N,) the next row's gradient, read from memory
    xn,     # (N,) the next row's input, read from memory
    mun,    # scalar: the next row's saved mean
    zero,   # scalar 0 in the accumulation dtype
):
    """Write this row's dx and add to the partials; return the next row's
    ``(sum(x - mu), sum((x - mu) * wdy), sum(wdy))``.

    ``(x - mu) - corr`` stays in that order for the reason of
    ``normalize_row_and_sum``.  No 'contract' (FASTMATH): fused into a
    multiply-add, ``wdy - c2`` is not exactly 0 for a one-element row.
    """
    dsum = zero
    xw = zero
    wsum = zero
    for j in range(x.shape[0]):
        d = xn[j] - mun
        wdyn = dyn[j] * w[j] if w is not None else dyn[j]
        dsum += d
        xw += d * wdyn
        wsum += wdyn
        g = dy[j]
        xhat = ((x[j] - mu) - corr) * r
        wdy = g * w[j] if w is not None else g
        v = (wdy - (xhat * c1 + c2)) * r
        if ds is not None:
            v = v + ds[j]
        dx[j] = v
        dwp[j] += g * xhat
        dbp[j] += g
    return dsum, xw, wsum


def forward(x, weight, bias, eps, y, mean, rstd, y_mapped=False):
    """Fill ``y``, ``mean``, ``rstd`` for the rows of ``x``.

    x, y: (M, N) C-contiguous of x's dtype; weight, bias: (N,) any float dtype or
    None; mean, rstd: (M,) C-contiguous, float32 (float64 for float64 x).
    ``y_mapped``: y is a caller's ``out=``, its pages already mapped, so a large
    y goes out through streaming stores (``_stream``).
    """
    acc = acc_of(x.dtype)
    ys = scratch_for(y, x)
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
