"""Fused residual add + LayerNorm / RMSNorm on the CPU: the forward kernels and launchers.

    s = x + residual                  (written once, returned for the next residual branch)
    y = layer_norm(s) or rms_norm(s)

Unfused, ``np.add`` streams x and residual in and s out, then the norm streams s in
again and y out.  Here each row's s is formed and stored, then reduced and
normalized while it is still in L1/L2 (a 4096-wide float32 row of x, residual
and s is 48 KiB), so s is never read back from memory: the row's later passes
cost cache bandwidth only.

What is normalized is the *returned* s, rounded to x's dtype: ``(y, mean, rstd)``
are exactly what ``layer_norm_forward(s)`` would give for the s handed back.  That
keeps the forward consistent with the backward, which reads that same s, and
makes the fused call a drop-in for ``s = x + r; y = norm(s)`` in every dtype
(PyTorch's unfused composition and vLLM's fused_add_rms_norm do the same; Triton
kernels that keep s in float32 normalize the unrounded sum instead, which differs
for 16-bit dtypes only, by at most half an ulp of s per element).  16-bit rows are
added in float32 and rounded once on the store of s (``halves``), which is what
``np.add`` gives; the later passes read that stored s back.

There are no fused backward kernels: the backward of ``y = norm(x + residual)`` is
the norm's backward evaluated at s with the gradient reaching s added to dx, which
the ``layer_norm``/``rms_norm`` backward launchers do through their ``ds`` argument.
"""

import numpy as np

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .common import acc_of, in_blocks, launch, param, row_block, wide_vectors
from .halves import kernel_view, narrow, widen
from .rescale import rescue_rms_row, rescue_row
from .spans import normalize_span, scale_span
from .stats import overflowed, row_is_finite, row_stats, row_sum_squares

# s and y are always fresh allocations here (the fused functions have no out=), and
# fresh outputs are faster with ordinary stores than with streaming ones, so nothing
# is streamed (staged and streamed was slower, measured: the book's design log).


# 'contract', as the norms' own forwards (layer_norm.forward_rows says why a forward may):
# the fused rows are the bits of the norm's forward of the s they return
@njit(cache=True, fastmath={"contract"}, nogil=True)
def layer_norm_rows(
    x,      # (M, N) input rows, float32/float64, or 16-bit floats as integer bits (halves)
    r,      # (M, N) residual rows, x's dtype
    w,      # (N,) weight in the accumulation dtype, or None
    b,      # (N,) bias in the accumulation dtype, or None
    eps,    # scalar in the accumulation dtype
    y,      # (M, N) output, x's dtype
    s,      # (M, N) output x + r, x's dtype
    mean,   # (M,) per-row mean of s, accumulation dtype
    rstd,   # (M,) per-row 1/sqrt(var(s) + eps), accumulation dtype
    lo,     # scalar: first row of the block
    hi,     # scalar: one past its last row
):
    """Rows ``lo:hi``, called by _layer_norm_forward and by the calling thread
    (common.in_blocks, as layer_norm.forward_rows, whose return value it returns too)."""
    wide_vectors(x)
    N = x.shape[1]
    zero = mean.dtype.type(0)
    one = mean.dtype.type(1)
    left = 0
    for i in range(lo, hi):
        # pass 1: s = x + r, stored once; passes 2 to 4 read s back from cache
        add_row(x, r, i, s)
        mu, corr, var = row_stats(s, i, zero)  # as layer_norm_forward(s): the same bits
        rs = one / np.sqrt(var + eps)
        if overflowed(mu, rs) and row_is_finite(s, i):  # as layer_norm.forward_rows
            left += rescue_row(s, i, w, b, 0, 1, eps, y, i, mean, rstd, i)
            continue
        mean[i] = mu + corr
        rstd[i] = rs
        # pass 4: y, by LayerNorm's own row writer
        normalize_span(s, i, mu, corr, rs, w, b, y, i, 0, N, False)
    return left


# Alike in shape to layer_norm_rows by design (the norm's own steps after add_row), as
# rms_norm's row functions are to layer_norm's (rms_norm's docstring)
@njit(cache=True, fastmath={"contract"}, nogil=True)
def rms_norm_rows(
    x,      # (M, N) input rows, float32/float64, or 16-bit floats as integer bits (halves)
    r,      # (M, N) residual rows, x's dtype
    w,      # (N,) weight in the accumulation dtype, or None
    eps,    # scalar in the accumulation dtype
    y,      # (M, N) output, x's dtype
    s,      # (M, N) output x + r, x's dtype
    rstd,   # (M,) per-row 1/sqrt(mean(s^2) + eps), accumulation dtype
    lo,     # scalar: first row of the block
    hi,     # scalar: one past its last row
):
    """Rows ``lo:hi``, called by _rms_norm_forward and by the calling thread
    (common.in_blocks, as layer_norm_rows)."""
    wide_vectors(x)
    N = x.shape[1]
    zero = rstd.dtype.type(0)
    one = rstd.dtype.type(1)
    inv_n = one / rstd.dtype.type(N)
    left = 0
    for i in range(lo, hi):
        add_row(x, r, i, s)
        rs = one / np.sqrt(row_sum_squares(s, i, zero) * inv_n + eps)
        if overflowed(zero, rs) and row_is_finite(s, i):  # as rms_norm.forward_rows
            left += rescue_rms_row(s, i, w, eps, y, i, rstd)
            continue
        rstd[i] = rs
        scale_span(s, i, rs, w, y, i, 0, N, False)
    return left


@njit(cache=True, nogil=True, inline="always")
def add_row(
    x,      # (M, N) input rows
    r,      # (M, N) residual rows
    i,      # scalar: the row
    s,      # (M, N) output x + r
):
    """``s[i] = x[i] + r[i]``.  Its sum is made afterwards, from cache, by a loop
    that stores nothing (stats.row_stats)."""
    for j in range(x.shape[1]):
        s[i, j] = narrow(widen(x[i, j]) + widen(r[i, j]), s)


def layer_norm_forward(x, residual, weight, bias, eps, y, s, mean, rstd):
    """Fill ``y``, ``s``, ``mean``, ``rstd`` for the rows of ``x + residual``.

    x, residual, y, s: (M, N) C-contiguous of x's dtype; weight, bias: (N,) any
    float dtype or None; mean, rstd: (M,) C-contiguous, float32 (float64 for
    float64 x).
    """
    acc = acc_of(x.dtype)
    launch(_layer_norm_forward, x.size, row_block(x.shape[0]), kernel_view(x),
           kernel_view(residual), param(weight, acc), param(bias, acc), acc.type(eps), kernel_view(y),
           kernel_view(s), mean, rstd)


def rms_norm_forward(x, residual, weight, eps, y, s, rstd):
    """Fill ``y``, ``s`` (M, N) and ``rstd`` (M,); shapes and dtypes as in layer_norm_forward."""
    acc = acc_of(x.dtype)
    launch(_rms_norm_forward, x.size, row_block(x.shape[0]), kernel_view(x),
           kernel_view(residual), param(weight, acc), acc.type(eps), kernel_view(y), kernel_view(s), rstd)


# The row functions with their parallel kernels (common.launch)
_layer_norm_forward = in_blocks(layer_norm_rows)
_rms_norm_forward = in_blocks(rms_norm_rows)
