"""RMSNorm on the CPU: forward and backward kernels with their launchers.

    rstd = 1 / sqrt(sum(x^2) / N + eps)
    y    = x * rstd * weight

No mean is subtracted, so one pass gives the statistic and a second, from
cache, writes y; a large caller's ``out=`` is streamed, as in LayerNorm's kernels.

The row functions follow LayerNorm's argument order and steps line for line
(``duplicates`` pairs them by shape) but not its arithmetic: no mean, no bias,
one sum fewer; one function for both would carry flags into the hot row loops.
"""

import numpy as np

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .common import (FASTMATH, RESCALE, STREAMING, acc_of, empty_row, finish, in_blocks, in_partials, launch,
                     n_chunks, param, row_block, scratch_for, weights, wide_vectors)
from .halves import kernel_view, like, narrow, widen
from .memory import (_itemsize, ahead_chunk, ask_ahead, put_streaming, should_stream, span_lines, store_fence,
                     stream_apart, stream_row, stream_span)
from .rescale import rescue_rms_row, scaled_backward_row
from .spans import grouping, scale_span
from .stats import overflowed, row_factors, row_is_finite, row_sum_squares
from .sums import gradient_sums


# 'contract', as layer_norm.forward_rows (whose comment says why the forward may): the
# sum of squares takes fused multiply-adds
@njit(cache=True, fastmath={"contract"}, nogil=True)
def forward_rows(
    x,      # (M, N) input rows, float32/float64, or 16-bit floats as integer bits (halves)
    w,      # (N,) weight in the accumulation dtype or as x's 16-bit bits (halves), or None
    eps,    # scalar in the accumulation dtype
    y,      # (M, N) output, x's dtype
    rstd,   # (M,) per-row 1/sqrt(mean(x^2) + eps), accumulation dtype
    stream, # scalar bool: write y with streaming stores (memory)
    lo,     # scalar: first row of the block
    hi,     # scalar: one past its last row
):
    """Rows ``lo:hi`` of the forward, called by _forward and by the calling thread
    (as layer_norm.forward_rows, whose return value it returns too)."""
    wide_vectors(x)
    N = x.shape[1]
    zero = rstd.dtype.type(0)
    one = rstd.dtype.type(1)
    inv_n = one / rstd.dtype.type(N)
    # a row apart for y is x where streamed, as layer_norm.forward_rows (whose comments say why)
    staged = STREAMING and stream and y.ctypes.data == x.ctypes.data
    if STREAMING:
        scratch = np.empty((1, N if staged else 0), y.dtype)
        chunk = ahead_chunk(x)
    # rows in groups where the weight would not stay in L1, as layer_norm.forward_rows
    streamed = STREAMING and stream
    rows, span = grouping(N, _itemsize(w), (1 if streamed else 2) * _itemsize(x), streamed, staged)
    kept = empty_row(rows, rstd)  # each row's rstd (-1: rescued)
    left = 0
    for g in range(lo, hi, rows):
        ge = min(g + rows, hi)
        for i in range(g, ge):
            r = one / np.sqrt(row_sum_squares(x, i, zero) * inv_n + eps)
            if overflowed(zero, r) and row_is_finite(x, i):  # as layer_norm.forward_rows
                left += rescue_rms_row(x, i, w, eps, y, i, rstd)
                r = -one
            else:
                rstd[i] = r
            kept[i - g] = r
        for c in range(0, N, span):
            ce = min(c + span, N)
            for i in range(g, ge):
                r = kept[i - g]
                if r == -one:
                    continue
                # streamed spans, as layer_norm.forward_rows (whose comments say why)
                if STREAMING and staged:
                    scale_span(x, i, r, w, scratch, 0, 0, N, False)
                    stream_row(y, i, scratch, 0)
                else:
                    s0, s1 = span_lines(y, i, c, ce) if STREAMING and stream else (ce, ce)  # (as layer_norm's)
                    a, e = c, s0
                    for part in range(2):
                        scale_span(x, i, r, w, y, i, a, e, False)
                        if STREAMING:
                            for t in range(s0 if part == 0 else s1, s1, chunk):  # the next group's row asked for
                                te = min(t + chunk, s1)
                                ask_ahead(x, i + rows - 1, hi, t, te)
                                scale_span(x, i, r, w, y, i, t, te, True)
                        a, e = s1, ce
    if STREAMING and stream:
        store_fence()
    return left


@njit(cache=True, nogil=True)  # (as layer_norm.backward_rows)
def backward_rows(
    dy,       # (M, N) gradient of y
    x,        # (M, N) forward input
    rstd,     # (M,) saved rstd
    w,        # (N,) weight in the accumulation dtype, or None (ones)
    ds,       # (M, N) gradient added straight to dx (fused residual), or None
    dx,       # (M, N) output: gradient of x
    dw_part,  # (B, N) per-row-block partial sums of dy * xhat, accumulation dtype
    stream,   # scalar bool: write dx with streaming stores (as layer_norm.backward_rows)
    lo,       # scalar: first row block, of B (as layer_norm.backward_rows)
    hi,       # scalar: one past the last
):
    """Row blocks ``lo:hi`` of the backward, called by _backward (a block a task) and by
    the calling thread (all of them), as layer_norm.backward_rows."""
    wide_vectors(dy)
    M, N = x.shape
    B = dw_part.shape[0]
    zero = rstd.dtype.type(0)
    one = rstd.dtype.type(1)
    inv_n = one / rstd.dtype.type(N)
    # local partial and whole rows in one loop, as layer_norm.backward_rows (whose
    # comments give the measurements)
    dwp = empty_row(N, dw_part)
    if STREAMING:
        chunk = ahead_chunk(x)
    left = 0
    for k in range(lo, hi):
        for j in range(N):
            dwp[j] = zero
        end = (k + 1) * M // B
        for i in range(k * M // B, end):
            r = rstd[i]
            # pass 1: c1 = mean(xhat * wdy); pass 2, from cache: dx and the partial
            c1 = backward_sum(dy, x, i, r, w, zero) * inv_n
            if not np.isfinite(c1) and row_is_finite(x, i) and row_is_finite(dy, i):
                if RESCALE:  # a sum past the range on a finite row: as layer_norm.backward_rows
                    scaled_backward_row(dy, x, i, None, r, w, 0, 1, ds, dx, dwp, None)
                else:
                    left += 1
                continue
            f, rf = row_factors(r, one)  # (as layer_norm.backward_rows)
            c1 *= f
            s0, s1 = stream_span(dx, i) if STREAMING and stream else (N, N)  # as layer_norm.backward_rows
            a, e = 0, s0
            for part in range(2):
                backward_span(dy, x, i, r, w, ds, f, c1, rf, dx, dwp, a, e, False)
                if STREAMING:
                    for c in range(s0 if part == 0 else s1, s1, chunk):  # the next row asked for
                        ce = min(c + chunk, s1)
                        ask_ahead(x, i, end, c, ce)
                        ask_ahead(dy, i, end, c, ce)
                        if ds is not None:
                            ask_ahead(ds, i, end, c, ce)
                        backward_span(dy, x, i, r, w, ds, f, c1, rf, dx, dwp, c, ce, True)
                a, e = s1, N
        for j in range(N):  # element by element, as layer_norm.backward_rows
            dw_part[k, j] = dwp[j]
    if STREAMING and stream:
        store_fence()
    return left


@njit(cache=True, fastmath=FASTMATH, nogil=True)  # on its own: as layer_norm.backward_sums
def backward_sum(
    dy,     # (M, N) gradient of y
    x,      # (M, N) forward input
    i,      # scalar: the row
    r,      # scalar: its saved rstd
    w,      # (N,) weight or None
    zero,   # scalar 0 in the accumulation dtype
):
    """Row ``i``'s ``sum(xhat * wdy)``, xhat = x * r, in the accumulation dtype
    (blocked: sums.gradient_sums)."""
    wide_vectors(dy)
    return like(gradient_sums(dy, x, i, like(0.0, zero), r, w, zero, 0.0)[1], zero)  # (0: folds away)


@njit(cache=True, nogil=True, inline="always")
def backward_span(
    dy,     # (M, N) gradient of y
    x,      # (M, N) forward input
    i,      # scalar: the row (dy[i], x[i] in cache)
    r,      # scalar: row i's saved rstd
    w,      # (N,) weight or None
    ds,     # (M, N) fused residual gradient or None
    f,      # scalar: row i's factor of wdy (stats.row_factors)
    c1,     # scalar: row i's mean(xhat * wdy), times f
    rf,     # scalar: row i's r / f
    dx,     # (M, N) output
    dwp,    # (N,) this row block's dweight partial, accumulated into
    lo,     # scalar: first element of the span
    hi,     # scalar: one past its last
    nt,     # constant bool: streaming stores (as layer_norm.backward_span)
):
    """Elements ``lo:hi`` of row ``i`` of dx, and their terms of the partial."""
    for k in range(hi - lo):
        j = np.uint64(lo + k)  # unsigned, as in spans.normalize_span
        g = widen(dy[i, j])
        xhat = widen(x[i, j]) * r
        wdy = g * w[j] if w is not None else g
        v = (wdy * f - xhat * c1) * rf  # (wdy - xhat * c1) * r, as layer_norm.backward_span
        if ds is not None:
            v = v + widen(ds[i, j])
        if nt:
            put_streaming(dx, i, j, narrow(v, dx))
        else:
            dx[i, j] = narrow(v, dx)
        dwp[j] += g * xhat


def forward(x, weight, eps, y, rstd):
    """Fill ``y`` (M, N) and ``rstd`` (M,); arguments as in layer_norm.forward."""
    acc = acc_of(x.dtype)
    ys = scratch_for(y, x, weight)
    launch(_forward, x.size, row_block(x.shape[0]), kernel_view(x), *weights(x, acc, weight),
           acc.type(eps), kernel_view(ys), rstd, ys is y and should_stream(y))
    finish(ys, y)


def backward(dy, x, rstd, weight, dx, dweight, ds=None):
    """Fill ``dx`` (M, N) and ``dweight`` (N,) in the accumulation dtype."""
    M, N = x.shape
    acc = acc_of(x.dtype)
    if M == 0:
        dweight[:] = 0
        return
    B = n_chunks(M, N)
    dw_part = np.empty((B, N), acc)
    launch(_backward, x.size, 1, kernel_view(dy), kernel_view(x), rstd, param(weight, acc),
           kernel_view(ds), kernel_view(dx), dw_part, stream_apart(dx, dy, x, ds))
    dw_part.sum(axis=0, out=dweight)


# The row functions with their parallel kernels (common.launch)
_forward = in_blocks(forward_rows)
_backward = in_partials(backward_rows)
