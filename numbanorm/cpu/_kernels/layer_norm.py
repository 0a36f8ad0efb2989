"""LayerNorm on the CPU: forward and backward kernels with their launchers.

    mean = sum(x) / N
    rstd = 1 / sqrt(sum((x - mean)^2) / N + eps)
    y    = (x - mean) * rstd * weight + bias

The forward takes both sums in one pass over the deviations from the mean of the
row's first few elements, or in two (a corrected two-pass) where that shift is far
from the mean (``stats.row_stats``), and writes y in one more.  One row (up to tens of KiB)
stays in L1/L2 between the passes, so x is read from memory once; the extra
passes cost cache bandwidth only.  Where a row of x, y, weight and bias would not fit
L1 (streamed: a row of x, weight and bias), rows go in groups, their statistics first,
then their writes span by span (``spans.grouping``).  A large caller's ``out=`` is
written with streaming stores (``memory``).
"""

import numpy as np

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .common import (FASTMATH, RESCALE, STREAMING, acc_of, empty_row, finish, in_blocks, in_partials, launch,
                     n_chunks, param, row_block, scratch_for, weights, wide_vectors)
from .halves import kernel_view, like, narrow, widen
from .memory import (_itemsize, ahead_chunk, ask_ahead, put_streaming, should_stream, span_lines, store_fence,
                     stream_apart, stream_row, stream_span)
from .rescale import rescue_row, scaled_backward_row
from .spans import grouping, normalize_span
from .stats import overflowed, row_factors, row_is_finite, row_stats
from .sums import gradient_sums


# 'contract' here only: the forward has no difference that must come out exactly 0 (the
# backward's wdy - c2, common.FASTMATH), and the multiply-adds of its sums and of y's
# (t * r) * w + b make float16 rows in cache faster (the book's design log).  No
# 'reassoc' (common.FASTMATH): the sums are stats.row_stats's
@njit(cache=True, fastmath={"contract"}, nogil=True)
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
    _forward (a block a task) and the calling thread (all the rows) both call
    (common.in_blocks), so a row's bits never depend on which ran it.  Returns how
    many rows it left to its rescaling variant (common.RESCALE), their rstd -1."""
    wide_vectors(x)
    N = x.shape[1]
    # Every scalar is made in the accumulation dtype: a bare Python int or float
    # would promote float32 arithmetic to float64 (NumPy's scalar rules).
    zero = mean.dtype.type(0)
    one = mean.dtype.type(1)
    # y is x (out=x): vectorized stores into x need a row apart, so those rows are
    # staged in a scratch row and copied out; other rows are streamed as written.
    # (Streamed stores are compiled in the STREAMING variant alone: common.STREAMING)
    staged = STREAMING and stream and y.ctypes.data == x.ctypes.data
    if STREAMING:
        scratch = np.empty((1, N if staged else 0), y.dtype)
        chunk = ahead_chunk(x)
    # rows in groups, each group's statistics first, then its writes span by span, where
    # weight and bias would not stay in L1 (spans.grouping); else one whole row
    streamed = STREAMING and stream
    rows, span = grouping(N, _itemsize(w) + _itemsize(b), (1 if streamed else 2) * _itemsize(x), streamed, staged)
    kept = empty_row(3 * rows, mean)  # each row's mu, corr and rstd (-1: rescued), a third each
    left = 0
    for g in range(lo, hi, rows):
        ge = min(g + rows, hi)
        for i in range(g, ge):
            # one pass reads row i from memory (a second, from cache, where it cannot be trusted)
            mu, corr, var = row_stats(x, i, zero)
            r = one / np.sqrt(var + eps)
            if overflowed(mu, r) and row_is_finite(x, i):
                left += rescue_row(x, i, w, b, 0, 1, eps, y, i, mean, rstd, i)
                r = -one
            else:
                mean[i] = mu + corr
                rstd[i] = r
            kept[i - g] = mu
            kept[rows + i - g] = corr
            kept[2 * rows + i - g] = r
        for c in range(0, N, span):
            ce = min(c + span, N)
            for i in range(g, ge):
                mu, corr, r = kept[i - g], kept[rows + i - g], kept[2 * rows + i - g]
                if r == -one:
                    continue
                # streamed, a row's span (the whole row, or a group's span: never smaller tiles,
                # the CPU design log says why) has its whole lines written straight out with
                # streaming stores (memory) and the elements before and after them with plain
                # ones, in one inlined copy for both (an array chosen between y and the scratch
                # row there, Numba increfed x and y every row)
                if STREAMING and staged:
                    normalize_span(x, i, mu, corr, r, w, b, scratch, 0, 0, N, False)
                    stream_row(y, i, scratch, 0)
                else:
                    s0, s1 = span_lines(y, i, c, ce) if STREAMING and stream else (ce, ce)
                    a, e = c, s0
                    for part in range(2):
                        normalize_span(x, i, mu, corr, r, w, b, y, i, a, e, False)
                        if STREAMING:
                            # the next group's row (whole rows: the next row) asked for as this one is written
                            for t in range(s0 if part == 0 else s1, s1, chunk):
                                te = min(t + chunk, s1)
                                ask_ahead(x, i + rows - 1, hi, t, te)
                                normalize_span(x, i, mu, corr, r, w, b, y, i, t, te, True)
                        a, e = s1, ce
    if STREAMING and stream:
        store_fence()
    return left


@njit(cache=True, nogil=True)  # (no fastmath: the sums are backward_sums's, common.FASTMATH)
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
    lo,       # scalar: first row block, of B (block k: rows k * M // B to (k + 1) * M // B)
    hi,       # scalar: one past the last
):
    """Row blocks ``lo:hi`` of the backward, block ``k`` into row ``k`` of dw_part and
    db_part: one compiled function that the parallel kernel _backward (a block a task)
    and the calling thread (all of them) both call (common.in_partials), so a row's
    bits never depend on which ran it.  Returns how many rows it left to its
    rescaling variant (common.RESCALE)."""
    wide_vectors(dy)
    M, N = x.shape
    B = dw_part.shape[0]
    zero = mean.dtype.type(0)
    one = mean.dtype.type(1)
    n = mean.dtype.type(N)
    inv_n = one / n
    # a block's partials in a local array (in L1/L2), not a row of dw_part (faster: the CPU design log)
    dwp = empty_row(N, dw_part)
    dbp = empty_row(N, dw_part)
    if STREAMING:  # (the streamed stores: in the STREAMING variant alone, as forward_rows)
        chunk = ahead_chunk(x)
    left = 0
    for k in range(lo, hi):
        for j in range(N):
            dwp[j] = zero
            dbp[j] = zero
        end = (k + 1) * M // B
        for i in range(k * M // B, end):
            mu = mean[i]
            r = rstd[i]
            # pass 1: c1 = mean(xhat * wdy), c2 = mean(wdy), where
            # xhat = ((x - mu) - corr) * r and corr = mean(x - mu) corrects the
            # saved mean for its rounding to the float32 grid (at mean 1e4 the
            # grid is 1e-3, 5% of the std of the tests' large-offset case,
            # which left dweight 1.4e-2 off; with corr it is 5e-8 off).
            dsum, xw, c2 = backward_sums(dy, x, i, mu, r, w, zero)
            corr = dsum * inv_n
            c2 *= inv_n
            c1 = xw * inv_n - (corr * r) * c2
            # a sum past the range on a finite row, corr's in x's units or c1's in rstd's
            # (row_factors; a non-finite corr or c2 makes c1 so); a non-finite dy too, whose
            # c1 is rightly so, but whose xhat, from a corr past the range, would spoil every
            # column's dweight, not the dy's own
            if not np.isfinite(c1 * n) and row_is_finite(x, i):
                if RESCALE:  # as in forward_rows
                    scaled_backward_row(dy, x, i, mu, r, w, 0, 1, ds, dx, dwp, dbp)
                else:
                    left += 1
                continue
            f, rf = row_factors(r, one)
            c1 *= f
            c2 *= f
            # pass 2, from cache: dx and the partials, the whole row in one loop (as the forward)
            # with its whole lines streamed (as forward_rows), in spans whatever `stream`: the
            # spans inlined in two branches, Numba increfed each array per row (as forward_rows)
            s0, s1 = stream_span(dx, i) if STREAMING and stream else (N, N)
            a, e = 0, s0
            for part in range(2):  # the plain spans before and after, as forward_rows
                backward_span(dy, x, i, mu, corr, r, w, ds, f, c1, c2, rf, dx, dwp, dbp, a, e, False)
                if STREAMING:
                    for c in range(s0 if part == 0 else s1, s1, chunk):  # the next row asked for (forward_rows)
                        ce = min(c + chunk, s1)
                        ask_ahead(x, i, end, c, ce)
                        ask_ahead(dy, i, end, c, ce)
                        if ds is not None:
                            ask_ahead(ds, i, end, c, ce)
                        backward_span(dy, x, i, mu, corr, r, w, ds, f, c1, c2, rf, dx, dwp, dbp, c, ce, True)
                a, e = s1, N
        # element by element: an array assignment compiles a shape check whose error message
        # formats its shapes, and Numba compiled that string formatting with every kernel
        for j in range(N):
            dw_part[k, j] = dwp[j]
            db_part[k, j] = dbp[j]
    if STREAMING and stream:
        store_fence()
    return left


# Compiled on its own, not inlined: a reduction inlined into two variants of a row function
# (common.STREAMING) was vectorized apart, an ulp apart in some rows; a call is the same sums
@njit(cache=True, fastmath=FASTMATH, nogil=True)
def backward_sums(
    dy,     # (M, N) gradient of y
    x,      # (M, N) forward input
    i,      # scalar: the row
    mu,     # scalar: its saved mean
    r,      # scalar: its saved rstd
    w,      # (N,) weight or None
    zero,   # scalar 0 in the accumulation dtype
):
    """Row ``i``'s ``(sum(x - mu), sum((x - mu) * r * wdy), sum(wdy))``, wdy = w * dy,
    in the accumulation dtype (blocked: sums.gradient_sums)."""
    wide_vectors(dy)
    dsum, xw, wsum = gradient_sums(dy, x, i, mu, r, w, zero, 0.0)
    return like(dsum, zero), like(xw, zero), like(wsum, zero)


@njit(cache=True, nogil=True, inline="always")
def backward_span(
    dy,     # (M, N) gradient of y
    x,      # (M, N) forward input
    i,      # scalar: the row (dy[i], x[i] in cache)
    mu,     # scalar: row i's saved mean
    corr,   # scalar: its correction, mean(x - mu)
    r,      # scalar: row i's saved rstd
    w,      # (N,) weight or None
    ds,     # (M, N) fused residual gradient or None
    f,      # scalar: row i's factor of wdy (stats.row_factors: r or 1)
    c1,     # scalar: row i's mean(xhat * wdy), times f
    c2,     # scalar: row i's mean(wdy), times f
    rf,     # scalar: row i's r / f
    dx,     # (M, N) output
    dwp,    # (N,) this row block's dweight partial, accumulated into
    dbp,    # (N,) this row block's dbias partial, accumulated into
    lo,     # scalar: first element of the span
    hi,     # scalar: one past its last
    nt,     # constant bool: streaming stores (a span from memory.stream_span)
):
    """Elements ``lo:hi`` of row ``i`` of dx, and their terms of the partials; a
    streamed span and a plain one compute the same operations (spans.normalize_span).

    ``(x - mu) - corr`` stays in that order for the reason of spans.normalize_span.
    No 'contract' (FASTMATH): fused into a multiply-add, ``wdy - c2`` is not
    exactly 0 for a one-element row.  ``dx = (wdy * f - (xhat * c1 + c2)) * rf`` is
    ``(wdy - (xhat * c1 + c2)) * r`` with no intermediate past the range where dx is
    in it (stats.row_factors; c1 and c2 come times f).
    """
    for k in range(hi - lo):
        j = np.uint64(lo + k)  # unsigned, as in spans.normalize_span
        g = widen(dy[i, j])
        xhat = ((widen(x[i, j]) - mu) - corr) * r
        wdy = g * w[j] if w is not None else g
        v = (wdy * f - (xhat * c1 + c2)) * rf
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
    launch(_forward, x.size, row_block(x.shape[0]), kernel_view(x), *weights(x, acc, weight, bias),
           acc.type(eps), kernel_view(ys), mean, rstd, ys is y and should_stream(y))
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
    B = n_chunks(M, N)
    dw_part = np.empty((B, N), acc)
    db_part = np.empty((B, N), acc)
    launch(_backward, x.size, 1, kernel_view(dy), kernel_view(x), mean, rstd,
           param(weight, acc), kernel_view(ds), kernel_view(dx), dw_part, db_part, stream_apart(dx, dy, x, ds))
    # fixed-order sum of the block partials: bit-identical for any thread count (the method,
    # not np.sum: the same reduction without its Python wrapper, a share of a small call)
    dw_part.sum(axis=0, out=dweight)
    db_part.sum(axis=0, out=dbias)


# The row functions with their parallel kernels (common.launch)
_forward = in_blocks(forward_rows)
_backward = in_partials(backward_rows)
