"""RMSNorm on the CPU: forward and backward kernels with their launchers.

    rstd = 1 / sqrt(sum(x^2) / N + eps)
    y    = x * rstd * weight

No mean is subtracted, so one pass gives the statistic and a second, from
cache, writes y; a large caller's ``out=`` is streamed, as in LayerNorm's kernels.

The row functions follow LayerNorm's argument order and steps line for line
(``duplicates`` pairs them by shape) but not its arithmetic: no mean, no bias,
one sum fewer; one function for both would carry flags into the hot row loops.
"""

import math

import numpy as np

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .common import (FASTMATH, acc_of, finish, in_blocks, in_partials, launch, n_chunks, param, row_block,
                     scratch_for, wide_vectors)
from .halves import kernel_view, like, narrow, widen
from .layer_norm import _row_scale, overflowed, row_is_finite
from .memory import (ahead_chunk, ask_ahead, put_streaming, should_stream, store_fence, stream_apart, stream_row,
                     stream_span)
from .sums import deviation_sums, gradient_sums


# 'contract', as layer_norm.forward_rows (whose comment says why the forward may): the
# sum of squares takes fused multiply-adds
@njit(cache=True, fastmath=FASTMATH | {"contract"}, nogil=True)
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
    """Rows ``lo:hi`` of the forward, called by _forward and its serial twin
    (as layer_norm.forward_rows)."""
    wide_vectors(x)
    N = x.shape[1]
    zero = rstd.dtype.type(0)
    one = rstd.dtype.type(1)
    inv_n = one / rstd.dtype.type(N)
    # y is x (out=x): vectorized stores into x need a row apart, so those rows are
    # staged in a scratch row and copied out; other rows are streamed as written
    staged = stream and y.ctypes.data == x.ctypes.data
    scratch = np.empty((1, N if staged else 0), y.dtype)
    chunk = ahead_chunk(x)
    for i in range(lo, hi):
        r = one / np.sqrt(row_sum_squares(x, i, zero) * inv_n + eps)
        if overflowed(zero, r) and row_is_finite(x, i):  # as layer_norm.forward_rows
            rstd[i] = scaled_rms_row(x, i, w, eps, y, i)
            continue
        rstd[i] = r
        # whole rows, streamed or not, as layer_norm.forward_rows (whose comments say why)
        if staged:
            scale_span(x, i, r, w, scratch, 0, 0, N, False)
            stream_row(y, i, scratch, 0)
        elif stream:
            s0, s1 = stream_span(y, i)
            scale_span(x, i, r, w, y, i, 0, s0, False)
            for c in range(s0, s1, chunk):  # the next row asked for as this one is written (memory)
                e = min(c + chunk, s1)
                ask_ahead(x, i, hi, c, e)
                scale_span(x, i, r, w, y, i, c, e, True)
            scale_span(x, i, r, w, y, i, s1, N, False)
        else:
            scale_span(x, i, r, w, y, i, 0, N, False)
    if stream:
        store_fence()


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def row_sum_squares(
    x,      # (M, N) rows
    i,      # scalar: the row
    zero,   # scalar 0 in the accumulation dtype
):
    """``sum(x[i] ** 2)`` in the accumulation dtype (blocked: sums.deviation_sums)."""
    return like(deviation_sums(x, i, zero, zero)[1], zero)


@njit(cache=True, nogil=True)
def scaled_rms_row(
    x,      # (M, N) rows, all elements finite
    i,      # scalar: the row
    w,      # (N,) weight in the accumulation dtype or as x's 16-bit bits (halves), or None
    eps,    # scalar
    out,    # (K, N) where the scaled row goes
    o,      # scalar: the row of `out`
):
    """RMSNorm of a finite row whose sum of squares overflowed (or underflowed to 0
    with eps = 0), in float64 on the row scaled by a power of two; returns its rstd
    (as layer_norm.scaled_row)."""
    n = x.shape[1]
    e = _row_scale(x, i)
    sq = 0.0
    for j in range(n):
        v = math.ldexp(np.float64(widen(x[i, j])), -e)
        sq += v * v
    ms_s = sq / n
    ms = math.ldexp(ms_s, 2 * e)
    big = not np.isfinite(ms)
    r = 1.0 / math.sqrt(ms_s) if big else 1.0 / math.sqrt(ms + eps)
    for j in range(n):
        v = np.float64(widen(x[i, j]))
        v = math.ldexp(v, -e) * r if big else v * r
        if w is not None:
            v = v * widen(w[j])  # 16-bit weights of a small call too (SmallCalls)
        out[o, j] = narrow(v, out)
    return math.ldexp(r, -e) if big else r


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def scale_span(
    x,      # (M, N) input rows
    i,      # scalar: the row to write (in cache)
    r,      # scalar: row i's rstd
    w,      # (N,) weight or None
    out,    # (K, N) where the scaled row goes
    o,      # scalar: the row of `out`
    lo,     # scalar: first element of the span
    hi,     # scalar: one past its last
    nt,     # constant bool: streaming stores (as layer_norm.normalize_span)
):
    """Write elements ``lo:hi`` of row ``i`` times ``r * w`` into ``out[o]``."""
    for k in range(hi - lo):
        j = np.uint64(lo + k)  # unsigned, as in layer_norm.normalize_span
        v = widen(x[i, j]) * r
        if w is not None:
            v = v * widen(w[j])  # 16-bit weights of a small call too (SmallCalls)
        if nt:
            put_streaming(out, o, j, narrow(v, out))
        else:
            out[o, j] = narrow(v, out)


@njit(cache=True, fastmath=FASTMATH, nogil=True)
def backward_rows(
    dy,       # (M, N) gradient of y
    x,        # (M, N) forward input
    rstd,     # (M,) saved rstd
    w,        # (N,) weight in the accumulation dtype, or None (ones)
    ds,       # (M, N) gradient added straight to dx (fused residual), or None
    dx,       # (M, N) output: gradient of x
    dw_part,  # (B, N) per-row-block partial sums of dy * xhat, accumulation dtype
    stream,   # scalar bool: write dx with streaming stores (as layer_norm.backward_rows)
    blk,      # scalar: this block's row of dw_part
    lo,       # scalar: first row of the block
    hi,       # scalar: one past its last row
):
    """Row block ``blk`` of the backward, called by _backward and its serial twin
    (as layer_norm.forward_rows)."""
    wide_vectors(dy)
    N = x.shape[1]
    zero = rstd.dtype.type(0)
    inv_n = rstd.dtype.type(1) / rstd.dtype.type(N)
    # local partial and whole rows in one loop, as layer_norm.backward_rows (whose
    # comments give the measurements)
    dwp = np.zeros(N, dw_part.dtype)
    chunk = ahead_chunk(x)
    for i in range(lo, hi):
        r = rstd[i]
        # pass 1: c1 = mean(xhat * wdy); pass 2, from cache: dx and the partial
        c1 = backward_sum(dy, x, i, r, w, zero) * inv_n
        s0, s1 = stream_span(dx, i) if stream else (N, N)  # three spans, as layer_norm.backward_rows
        backward_span(dy, x, i, r, w, ds, c1, dx, dwp, 0, s0, False)
        for c in range(s0, s1, chunk):  # the next row asked for as this one is written
            e = min(c + chunk, s1)
            ask_ahead(x, i, hi, c, e)
            ask_ahead(dy, i, hi, c, e)
            if ds is not None:
                ask_ahead(ds, i, hi, c, e)
            backward_span(dy, x, i, r, w, ds, c1, dx, dwp, c, e, True)
        backward_span(dy, x, i, r, w, ds, c1, dx, dwp, s1, N, False)
    dw_part[blk] = dwp
    if stream:
        store_fence()


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
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
    return like(gradient_sums(dy, x, i, zero, r, w, zero, 0.0)[1], zero)


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def backward_span(
    dy,     # (M, N) gradient of y
    x,      # (M, N) forward input
    i,      # scalar: the row (dy[i], x[i] in cache)
    r,      # scalar: row i's saved rstd
    w,      # (N,) weight or None
    ds,     # (M, N) fused residual gradient or None
    c1,     # scalar: row i's mean(xhat * wdy)
    dx,     # (M, N) output
    dwp,    # (N,) this row block's dweight partial, accumulated into
    lo,     # scalar: first element of the span
    hi,     # scalar: one past its last
    nt,     # constant bool: streaming stores (as layer_norm.backward_span)
):
    """Elements ``lo:hi`` of row ``i`` of dx, and their terms of the partial."""
    for k in range(hi - lo):
        j = np.uint64(lo + k)  # unsigned, as in layer_norm.normalize_span
        g = widen(dy[i, j])
        xhat = widen(x[i, j]) * r
        wdy = g * w[j] if w is not None else g
        v = (wdy - xhat * c1) * r
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
    launch(_forward, x.size, row_block(x.shape[0]), kernel_view(x), param(weight, acc),
           acc.type(eps), kernel_view(ys), rstd, ys is y and should_stream(y))
    finish(ys, y)


def backward(dy, x, rstd, weight, dx, dweight, ds=None):
    """Fill ``dx`` (M, N) and ``dweight`` (N,) in the accumulation dtype."""
    M, N = x.shape
    acc = acc_of(x.dtype)
    if M == 0:
        dweight[:] = 0
        return
    B = n_chunks(M)
    dw_part = np.empty((B, N), acc)
    launch(_backward, x.size, B, kernel_view(dy), kernel_view(x), rstd, param(weight, acc),
           kernel_view(ds), kernel_view(dx), dw_part, stream_apart(dx, dy, x, ds))
    np.sum(dw_part, axis=0, out=dweight)


# The parallel kernels, with their serial twins (common.launch)
_forward = in_blocks(forward_rows)
_backward = in_partials(backward_rows)
