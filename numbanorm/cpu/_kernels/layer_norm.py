"""LayerNorm on the CPU: forward and backward kernels with their launchers.

    mean = sum(x) / N
    rstd = 1 / sqrt(sum((x - mean)^2) / N + eps)
    y    = (x - mean) * rstd * weight + bias

The forward takes both sums in one pass over the deviations from the mean of the
row's first few elements, or in two (a corrected two-pass) where that shift is far
from the mean (``shifted_stats``), and writes y in one more.  One row (up to tens of KiB)
stays in L1/L2 between the passes, so x is read from memory once; the extra
passes cost cache bandwidth only.  A large
caller's ``out=`` is written with streaming stores (``memory``).
"""

import math

import numpy as np

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .common import (FASTMATH, acc_of, finish, in_blocks, in_partials, launch, n_chunks, param, row_block,
                     scratch_for, wide_vectors)
from .halves import kernel_view, like, narrow, widen
from .memory import (ahead_chunk, ask_ahead, put_streaming, should_stream, store_fence, stream_apart, stream_row,
                     stream_span)
from .sums import deviation_sums, gradient_sums


# 'contract' here only: the forward has no difference that must come out exactly 0 (the
# backward's wdy - c2, common.FASTMATH), and the multiply-adds of its sums and of y's
# (t * r) * w + b cut float16 rows in cache from 877-922 to 730-790 ns a row
@njit(cache=True, fastmath=FASTMATH | {"contract"}, nogil=True)
def forward_rows(
    x,      # (M, N) input rows, float32/float64, or 16-bit floats as integer bits (halves)
    w,      # (N,) weight in the accumulation dtype or as x's 16-bit bits (halves), or None
    b,      # (N,) bias, as w
    eps,    # scalar in the accumulation dtype
    y,      # (M, N) output, x's dtype
    mean,   # (M,) per-row mean, accumulation dtype
    rstd,   # (M,) per-row 1/sqrt(var + eps), accumulation dtype
    stream, # scalar bool: write y with streaming stores (memory)
    lo,     # scalar: first row of the block
    hi,     # scalar: one past its last row
):
    """Rows ``lo:hi`` of the forward: one compiled function that the parallel kernel
    _forward and its serial twin both call (common.in_blocks), so a row's bits never
    depend on which ran it."""
    wide_vectors(x)
    N = x.shape[1]
    # Every scalar is made in the accumulation dtype: a bare Python int or float
    # would promote float32 arithmetic to float64 (NumPy's scalar rules).
    zero = mean.dtype.type(0)
    one = mean.dtype.type(1)
    inv_n = one / mean.dtype.type(N)
    # y is x (out=x): vectorized stores into x need a row apart, so those rows are
    # staged in a scratch row and copied out; other rows are streamed as written
    staged = stream and y.ctypes.data == x.ctypes.data
    scratch = np.empty((1, N if staged else 0), y.dtype)
    chunk = ahead_chunk(x)
    for i in range(lo, hi):
        # one pass reads row i from memory (a second, from cache, where it cannot be trusted)
        mu, m1, ms = shifted_stats(x, i, zero)
        if one_pass_ok(m1, ms):
            corr, var = like(m1, zero), like(ms - m1 * m1, zero)
        else:
            mu = like(mu + m1, zero)
            corr, var = deviation_stats(x, i, mu, zero, inv_n)
        r = one / np.sqrt(var + eps)
        if overflowed(mu, r) and row_is_finite(x, i):
            mean[i], rstd[i] = scaled_row(x, i, w, b, 0, 1, eps, y, i)
            continue
        mean[i] = mu + corr
        rstd[i] = r
        # pass 3 writes the row whole (tiled, it was 3-4x slower: book, chapter 5)
        if staged:
            normalize_span(x, i, mu, corr, r, w, b, scratch, 0, 0, N, False)
            stream_row(y, i, scratch, 0)
        elif stream:  # its whole lines straight out with streaming stores (memory)
            s0, s1 = stream_span(y, i)
            normalize_span(x, i, mu, corr, r, w, b, y, i, 0, s0, False)
            for c in range(s0, s1, chunk):  # the next row asked for as this one is written (memory)
                e = min(c + chunk, s1)
                ask_ahead(x, i, hi, c, e)
                normalize_span(x, i, mu, corr, r, w, b, y, i, c, e, True)
            normalize_span(x, i, mu, corr, r, w, b, y, i, s1, N, False)
        else:
            normalize_span(x, i, mu, corr, r, w, b, y, i, 0, N, False)
    if stream:
        store_fence()


# Elements whose mean is a row's shift: it misses the row's mean by more than a standard
# deviation with probability erfc(sqrt(16 / 2)) = 6e-5 on independent elements (one
# element: 32%, and those rows pay a second statistics pass; book, chapter 5)
SHIFT_SAMPLE = 16


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def shifted_stats(
    x,      # (M, N) rows (of x, or of s = x + residual), never empty (_validate)
    i,      # scalar: the row
    zero,   # scalar 0 in the accumulation dtype
):
    """``(k, m1, ms)``: row ``i``'s shift ``k``, the mean of its first
    ``SHIFT_SAMPLE`` elements in the accumulation dtype, and the float64
    ``mean(d)`` and ``mean(d^2)`` of its deviations ``d = x - k``, in one pass
    (blocked: sums).

    Where ``k`` lies within a standard deviation of the mean (:func:`one_pass_ok`),
    ``var = ms - m1^2`` cancels at most half of ``ms`` (one bit), and the mean
    split as ``mu = k``, ``corr = m1`` is the split normalize_span keeps apart:
    as good as the corrected two-pass of deviation_stats, in one pass of the
    three a forward makes (float16 (16384, 4096) in L2: 143 ns a row of 919).
    """
    n = x.shape[1]
    m = min(n, SHIFT_SAMPLE)
    total = 0.0  # float64: the sum of a float32 row near its largest values stays finite
    for j in range(m):
        total += widen(x[i, j])
    k = like(total / m, zero)
    s1, s2 = deviation_sums(x, i, k, zero)
    return k, s1 / n, s2 / n


@njit(cache=True, nogil=True, inline="always")
def one_pass_ok(
    m1,     # scalar: shifted_stats's mean(d), float64
    ms,     # scalar: its mean(d^2), float64
):
    """Whether shifted_stats's variance can be trusted: ``m1^2 <= ms / 2``, so
    that ``ms - m1^2`` loses at most one bit.  Not for a row whose shift
    is an outlier, or with a NaN, an Inf or an overflow: those take the two-pass
    (the caller branches itself: a branch inside an inlined function that reads
    x kept a reference count of x per row, see memory.stream_row)."""
    return np.isfinite(ms) and m1 * m1 <= 0.5 * ms


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def row_sum(
    x,      # (M, N) rows
    i,      # scalar: the row
    zero,   # scalar 0 in the accumulation dtype
):
    """``sum(x[i])`` in the accumulation dtype (blocked: sums.deviation_sums)."""
    return like(deviation_sums(x, i, zero, zero)[0], zero)


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
    corrected two-pass), so the row's mean is ``mu + corr``.  Blocked (sums).
    """
    n = x.shape[1]
    dsum, sq = deviation_sums(x, i, mu, zero)
    corr = dsum / n
    var = sq / n - corr * corr
    if var < 0.0:  # rounding on a constant row (a NaN fails the test and stays NaN)
        var = 0.0
    return like(corr, zero), like(var, zero)


@njit(cache=True, nogil=True, inline="always")
def overflowed(
    mu,     # scalar: a row's first-pass mean
    r,      # scalar: its rstd, 1/sqrt(var + eps)
):
    """Whether a row's sums left the floating-point range: a sum that overflowed to
    Inf (r = 0), or a variance that underflowed to 0 with eps = 0 (r = Inf).  For
    a row with NaN or Inf inputs the caller's row_is_finite says no."""
    return not (np.isfinite(mu) and np.isfinite(r) and r > 0)


@njit(cache=True, nogil=True, inline="always")
def row_is_finite(
    x,      # (M, N) rows
    i,      # scalar: the row
):
    for j in range(x.shape[1]):
        if not np.isfinite(widen(x[i, j])):
            return False
    return True


@njit(cache=True, nogil=True)
def _row_scale(
    x,      # (M, L) rows
    i,      # scalar: the row
):
    """``e`` with every ``|x[i]| * 2**-e`` at most 1: scaling by it is exact."""
    amax = 0.0
    for j in range(x.shape[1]):
        amax = max(amax, abs(np.float64(widen(x[i, j]))))
    return math.frexp(amax)[1]


@njit(cache=True, nogil=True)
def scaled_row(
    x,      # (M, L) rows, all elements finite
    i,      # scalar: the row
    w,      # (C,) weight in the accumulation dtype or as x's 16-bit bits (halves), or None
    b,      # (C,) bias, as w
    w0,     # scalar: weight index of the row's first element (group norm: its first channel)
    per,    # scalar: elements per weight (1 for layer norm, S for group norm)
    eps,    # scalar
    out,    # (K, L) where the normalized row goes
    o,      # scalar: the row of `out`
):
    """Normalize a finite row whose float sums overflowed, in float64 on the row
    scaled by a power of two (exact), and return its ``(mean, rstd)``.

    Rare (a row of magnitude ~1e19 in float32, ~1e154 in float64), so it is apart
    from the kernels' fast loops and costs them nothing: see their callers.
    """
    n = x.shape[1]
    e = _row_scale(x, i)
    total = 0.0
    for j in range(n):
        total += math.ldexp(np.float64(widen(x[i, j])), -e)
    mu = total / n
    dsum = 0.0
    sq = 0.0
    for j in range(n):
        d = math.ldexp(np.float64(widen(x[i, j])), -e) - mu
        dsum += d
        sq += d * d
    corr = dsum / n
    var_s = max(sq / n - corr * corr, 0.0)
    var = math.ldexp(var_s, 2 * e)
    big = not np.isfinite(var)  # only float64 rows near the float64 limit
    if big:
        r = 1.0 / math.sqrt(var_s)  # eps is below half an ulp of var
    else:
        r = 1.0 / math.sqrt(var + eps)
    for j in range(n):
        dev = (math.ldexp(np.float64(widen(x[i, j])), -e) - mu) - corr
        v = dev * r if big else math.ldexp(dev, e) * r
        c = w0 + j // per
        if w is not None:
            v = v * widen(w[c])
        if b is not None:
            v = v + widen(b[c])
        out[o, j] = narrow(v, out)
    return math.ldexp(mu + corr, e), (math.ldexp(r, -e) if big else r)


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def normalize_span(
    x,      # (M, N) input rows
    i,      # scalar: the row to write (in cache)
    mu,     # scalar: row i's first-pass mean
    corr,   # scalar: the mean's correction, mean = mu + corr
    r,      # scalar: row i's rstd
    w,      # (N,) weight or None
    b,      # (N,) bias or None
    out,    # (K, N) where the normalized row goes
    o,      # scalar: the row of `out`
    lo,     # scalar: first element of the span
    hi,     # scalar: one past its last
    nt,     # constant bool: streaming stores (a span from memory.stream_span)
):
    """Write elements ``lo:hi`` of row ``i``, normalized, into ``out[o]``.

    ``((x - mu) - corr) * r`` must stay in that order: folded into
    ``x - (mu + corr)``, the correction would round onto the float32 grid near
    the mean and be lost.  FASTMATH's 'reassoc' alone does not fold it (that
    also needs 'nsz'; book, chapter 5), and the large-offset tests fail if a
    compiler ever does.  Inlined, with rows as (array, index) rather than views,
    for the reason of memory.stream_row.  A streamed and a plain span compute
    the same operations, so an element's bits do not depend on which took it.
    """
    for k in range(hi - lo):
        j = np.uint64(lo + k)  # unsigned: no wraparound select, which made every load a gather
        v = ((widen(x[i, j]) - mu) - corr) * r
        if w is not None:
            v = v * widen(w[j])  # 16-bit weights of a small call are widened here (SmallCalls)
        if b is not None:
            v = v + widen(b[j])
        if nt:
            put_streaming(out, o, j, narrow(v, out))
        else:
            out[o, j] = narrow(v, out)


@njit(cache=True, fastmath=FASTMATH, nogil=True)
def backward_rows(
    dy,       # (M, N) gradient of y
    x,        # (M, N) forward input
    mean,     # (M,) saved mean
    rstd,     # (M,) saved rstd
    w,        # (N,) weight in the accumulation dtype, or None (ones)
    ds,       # (M, N) gradient added straight to dx (fused residual), or None
    dx,       # (M, N) output: gradient of x
    dw_part,  # (B, N) per-row-block partial sums of dy * xhat, accumulation dtype
    db_part,  # (B, N) per-row-block partial sums of dy, accumulation dtype
    stream,   # scalar bool: write dx with streaming stores (memory), as the forward its y
    blk,      # scalar: this block's row of dw_part and db_part
    lo,       # scalar: first row of the block
    hi,       # scalar: one past its last row
):
    """Row block ``blk`` of the backward, called by _backward and its serial twin
    (common.in_partials; see forward_rows)."""
    wide_vectors(dy)
    N = x.shape[1]
    zero = mean.dtype.type(0)
    inv_n = mean.dtype.type(1) / mean.dtype.type(N)
    # this block's partials in a local array (in L1/L2), not a row of dw_part (faster: book, ch. 5)
    dwp = np.zeros(N, dw_part.dtype)
    dbp = np.zeros(N, dw_part.dtype)
    chunk = ahead_chunk(x)
    for i in range(lo, hi):
        mu = mean[i]
        r = rstd[i]
        # pass 1: c1 = mean(xhat * wdy), c2 = mean(wdy), where
        # xhat = ((x - mu) - corr) * r and corr = mean(x - mu) corrects the
        # saved mean for its rounding to the float32 grid (at mean 1e4 the
        # grid is 1e-3, 5% of the std of the tests' large-offset case,
        # which left dweight 1.4e-2 off; with corr it is 5e-8 off).
        dsum, xw, c2 = backward_sums(dy, x, i, mu, w, zero)
        if (not (np.isfinite(dsum) and np.isfinite(xw) and np.isfinite(c2))
                and row_is_finite(x, i) and row_is_finite(dy, i)):
            scaled_backward_row(dy, x, i, mu, r, w, 0, 1, ds, dx, dwp, dbp)  # as in forward_rows
            continue
        corr = dsum * inv_n
        c2 *= inv_n
        c1 = (xw * inv_n - corr * c2) * r
        # pass 2, from cache: dx and the partials, the whole row in one loop (as the forward)
        # with its whole lines streamed (as forward_rows), in three spans whatever `stream`:
        # the spans inlined in two branches, Numba increfed each array per row (as forward_rows)
        s0, s1 = stream_span(dx, i) if stream else (N, N)
        backward_span(dy, x, i, mu, corr, r, w, ds, c1, c2, dx, dwp, dbp, 0, s0, False)
        for c in range(s0, s1, chunk):  # the next row asked for as this one is written (forward_rows)
            e = min(c + chunk, s1)
            ask_ahead(x, i, hi, c, e)
            ask_ahead(dy, i, hi, c, e)
            if ds is not None:
                ask_ahead(ds, i, hi, c, e)
            backward_span(dy, x, i, mu, corr, r, w, ds, c1, c2, dx, dwp, dbp, c, e, True)
        backward_span(dy, x, i, mu, corr, r, w, ds, c1, c2, dx, dwp, dbp, s1, N, False)
    dw_part[blk] = dwp
    db_part[blk] = dbp
    if stream:
        store_fence()


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def backward_sums(
    dy,     # (M, N) gradient of y
    x,      # (M, N) forward input
    i,      # scalar: the row
    mu,     # scalar: its saved mean
    w,      # (N,) weight or None
    zero,   # scalar 0 in the accumulation dtype
):
    """Row ``i``'s ``(sum(x - mu), sum((x - mu) * wdy), sum(wdy))``, wdy = w * dy,
    in the accumulation dtype (blocked: sums.gradient_sums)."""
    dsum, xw, wsum = gradient_sums(dy, x, i, mu, like(1.0, zero), w, zero, 0.0)
    return like(dsum, zero), like(xw, zero), like(wsum, zero)


@njit(cache=True, nogil=True)
def scaled_backward_row(
    dy,     # (M, N) gradient of y, row i finite
    x,      # (M, N) forward input, row i finite
    i,      # scalar: the row
    mu,     # scalar: its saved mean
    r,      # scalar: its saved rstd
    w,      # (C,) weight or None
    w0,     # scalar: weight index of the row's first element (group norm: its first channel)
    per,    # scalar: elements per weight (1 for layer norm, S for group norm)
    ds,     # (M, N) fused residual gradient or None
    dx,     # (M, N) output
    dwp,    # (C,) dweight partial, accumulated into at the weight's index
    dbp,    # (C,) dbias partial, the same
):
    """backward_sums and backward_span for a finite row whose float sums overflowed:
    in float64, x and dy each scaled by a power of two (exact), r split as
    ``fr * 2**er`` so that no intermediate leaves the range (see scaled_row)."""
    n = x.shape[1]
    ex = _row_scale(x, i)
    eg = _row_scale(dy, i)
    fr, er = math.frexp(np.float64(r))
    ms = math.ldexp(np.float64(mu), -ex)
    dsum = 0.0
    for j in range(n):
        dsum += math.ldexp(np.float64(widen(x[i, j])), -ex) - ms
    corr = dsum / n
    c1 = 0.0
    c2 = 0.0
    for j in range(n):
        xhat = math.ldexp(((math.ldexp(np.float64(widen(x[i, j])), -ex) - ms) - corr) * fr, ex + er)
        wdy = math.ldexp(np.float64(widen(dy[i, j])), -eg)
        if w is not None:
            wdy = wdy * w[w0 + j // per]
        c1 += xhat * wdy
        c2 += wdy
    c1 /= n
    c2 /= n
    for j in range(n):
        g = np.float64(widen(dy[i, j]))
        xhat = math.ldexp(((math.ldexp(np.float64(widen(x[i, j])), -ex) - ms) - corr) * fr, ex + er)
        wdy = math.ldexp(g, -eg)
        c = w0 + j // per
        if w is not None:
            wdy = wdy * w[c]
        v = math.ldexp((wdy - (xhat * c1 + c2)) * fr, eg + er)
        if ds is not None:
            v = v + widen(ds[i, j])
        dx[i, j] = narrow(v, dx)
        dwp[c] += g * xhat
        dbp[c] += g


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def backward_span(
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
    lo,     # scalar: first element of the span
    hi,     # scalar: one past its last
    nt,     # constant bool: streaming stores (a span from memory.stream_span)
):
    """Elements ``lo:hi`` of row ``i`` of dx, and their terms of the partials; a
    streamed span and a plain one compute the same operations (normalize_span).

    ``(x - mu) - corr`` stays in that order for the reason of normalize_span.
    No 'contract' (FASTMATH): fused into a multiply-add, ``wdy - c2`` is not
    exactly 0 for a one-element row.
    """
    for k in range(hi - lo):
        j = np.uint64(lo + k)  # unsigned, as in normalize_span
        g = widen(dy[i, j])
        xhat = ((widen(x[i, j]) - mu) - corr) * r
        wdy = g * w[j] if w is not None else g
        v = (wdy - (xhat * c1 + c2)) * r
        if ds is not None:
            v = v + widen(ds[i, j])
        if nt:
            put_streaming(dx, i, j, narrow(v, dx))
        else:
            dx[i, j] = narrow(v, dx)
        dwp[j] += g * xhat
        dbp[j] += g


def forward(x, weight, bias, eps, y, mean, rstd):
    """Fill ``y``, ``mean``, ``rstd`` for the rows of ``x``.

    x, y: (M, N) C-contiguous of x's dtype; weight, bias: (N,) any float dtype or
    None; mean, rstd: (M,) C-contiguous, float32 (float64 for float64 x).
    A y too large for the cache (``memory.STREAM_MIN_BYTES``) goes out through streaming stores
    (``memory.should_stream``); a scratch copy of it (``scratch_for``) does not.
    """
    acc = acc_of(x.dtype)
    ys = scratch_for(y, x, weight, bias)
    launch(_forward, x.size, row_block(x.shape[0]), kernel_view(x), param(weight, acc),
           param(bias, acc), acc.type(eps), kernel_view(ys), mean, rstd, ys is y and should_stream(y))
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
    launch(_backward, x.size, B, kernel_view(dy), kernel_view(x), mean, rstd,
           param(weight, acc), kernel_view(ds), kernel_view(dx), dw_part, db_part, stream_apart(dx, dy, x, ds))
    # fixed-order sum of the block partials: bit-identical for any thread count
    np.sum(dw_part, axis=0, out=dweight)
    np.sum(db_part, axis=0, out=dbias)


# The parallel kernels, with their serial twins (common.launch)
_forward = in_blocks(forward_rows)
_backward = in_partials(backward_rows)
