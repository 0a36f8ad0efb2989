"""Rows whose float sums overflowed (or, with eps = 0, underflowed): normalized again in
float64, on the row scaled by a power of two (exact).

Rare (a row of magnitude ~1e19 in float32, ~1e154 in float64; with eps = 0, ~1e-19 and
~1e-154), so a row function does not compile these: it leaves such a row to a variant of
itself compiled with ``common.RESCALE`` set, which calls them (``common.Kernel.rescue``).
"""

import math

import numpy as np

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .common import RESCALE
from .halves import narrow, widen


@njit(cache=True, nogil=True, inline="always")
def rescue_row(
    x,      # (M, L) rows, row i finite with overflowed statistics
    i,      # scalar: the row
    w,      # (C,) weight, or None (w to o: scaled_row's arguments)
    b,      # (C,) bias, or None
    w0,     # scalar: the weight index of the row's first element
    per,    # scalar: elements per weight
    eps,    # scalar
    out,    # (K, L) where the normalized row goes
    o,      # scalar: its row of `out`
    mean,   # (M,) or (N, G) statistics, accumulation dtype
    rstd,   # as mean
    at,     # scalar, or (n, g): the row's place in mean and rstd
):
    """What a forward row function does with such a row: in its RESCALE variant, the
    row normalized by scaled_row, 0; else the row marked for that variant (rstd -1,
    common.Kernel.rescue), 1 (the rows it left).  Inlined, and its RESCALE branch pruned
    before typing, so the row function compiles no scaled_row."""
    if RESCALE:
        mean[at], rstd[at] = scaled_row(x, i, w, b, w0, per, eps, out, o)
        return 0
    mean[at] = 0
    rstd[at] = -1
    return 1


@njit(cache=True, nogil=True, inline="always")
def rescue_rms_row(
    x,      # (M, N) rows, row i finite with an overflowed (or vanished) sum of squares
    i,      # scalar: the row
    w,      # (N,) weight, as scaled_rms_row's, or None
    eps,    # scalar
    out,    # (K, N) where the scaled row goes
    o,      # scalar: the row of `out`
    rstd,   # (M,) per-row rstd, accumulation dtype
):
    """rescue_row for RMSNorm's rows (no mean)."""
    if RESCALE:
        rstd[i] = scaled_rms_row(x, i, w, eps, out, o)
        return 0
    rstd[i] = -1
    return 1


@njit(cache=True, nogil=True)
def row_scale(
    x,      # (M, L) rows
    i,      # scalar: the row
):
    """``e`` with every finite ``|x[i]| * 2**-e`` at most 1: scaling by it is exact (a
    gradient's NaN or inf, which stays one, does not set it)."""
    amax = 0.0
    for j in range(x.shape[1]):
        v = abs(np.float64(widen(x[i, j])))
        if amax < v < np.inf:
            amax = v
    return math.frexp(amax)[1]


# float64's smallest normal number: a variance under it has lost bits
_TINY = float(np.finfo(np.float64).tiny)


@njit(cache=True, nogil=True, inline="always")
def rstd_of(
    var_s,  # scalar: a row's variance (RMSNorm: mean square) on the row scaled by 2**-e, float64
    e,      # scalar: that scale's exponent (row_scale)
    eps,    # scalar
):
    """``(r, r_s)``: the row's rstd ``1 / sqrt(var + eps)``, and 0, where ``var + eps`` is
    in float64's range at the row's own scale; else that rstd and the one of the scaled
    row (nonzero), which then normalizes it: back at the row's own scale a huge row's
    variance overflows and a tiny one's (eps = 0) underflows."""
    var = math.ldexp(var_s, 2 * e)
    if np.isfinite(var) and var + eps >= _TINY:
        return 1.0 / math.sqrt(var + eps), 0.0
    r_s = 1.0 / math.sqrt(var_s + math.ldexp(np.float64(eps), -2 * e))
    return math.ldexp(r_s, -e), r_s


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
    """Normalize a finite row whose float sums overflowed (or underflowed), in float64 on
    the row scaled by a power of two (exact), and return its ``(mean, rstd)``: rstd at
    the row's own scale may be Inf (a float32 row under ~1e-38), y is exact anyway.

    Rare (the module's magnitudes), so it is apart from the kernels' fast loops and
    costs them nothing: see their callers.
    """
    n = x.shape[1]
    e = row_scale(x, i)
    total = 0.0
    for j in range(n):
        total += math.ldexp(np.float64(widen(x[i, j])), -e)
    mu = total / n
    dsum = 0.0
    for j in range(n):
        dsum += math.ldexp(np.float64(widen(x[i, j])), -e) - mu
    corr = dsum / n
    # the squares of the corrected deviations, a pass of their own: mean(d * d) - corr**2
    # cancelled where the first mean's rounding passed the row's spread (70000 copies of
    # 1e300, one an ulp above: its y was 5e-4 off)
    sq = 0.0
    for j in range(n):
        dev = (math.ldexp(np.float64(widen(x[i, j])), -e) - mu) - corr
        sq += dev * dev
    var_s = sq / n
    r, r_s = rstd_of(var_s, e, eps)
    for j in range(n):
        dev = (math.ldexp(np.float64(widen(x[i, j])), -e) - mu) - corr
        v = dev * r_s if r_s > 0 else math.ldexp(dev, e) * r
        c = w0 + j // per
        if w is not None:
            v = v * widen(w[c])
        if b is not None:
            v = v + widen(b[c])
        out[o, j] = narrow(v, out)
    return math.ldexp(mu + corr, e), r


@njit(cache=True, nogil=True)
def scaled_rms_row(
    x,      # (M, N) rows, all elements finite
    i,      # scalar: the row
    w,      # (N,) weight in the accumulation dtype or as x's 16-bit bits (halves), or None
    eps,    # scalar
    out,    # (K, N) where the scaled row goes
    o,      # scalar: the row of `out`
):
    """RMSNorm of a finite row whose sum of squares overflowed (or underflowed, with
    eps = 0), in float64 on the row scaled by a power of two; returns its rstd
    (as scaled_row)."""
    n = x.shape[1]
    e = row_scale(x, i)
    sq = 0.0
    for j in range(n):
        v = math.ldexp(np.float64(widen(x[i, j])), -e)
        sq += v * v
    r, r_s = rstd_of(sq / n, e, eps)
    for j in range(n):
        v = np.float64(widen(x[i, j]))
        v = math.ldexp(v, -e) * r_s if r_s > 0 else v * r
        if w is not None:
            v = v * widen(w[j])  # 16-bit weights of a small call too (cpu._backend.Plans)
        out[o, j] = narrow(v, out)
    return r


@njit(cache=True, nogil=True)
def scaled_backward_row(
    dy,     # (M, N) gradient of y (its non-finite elements' own results non-finite)
    x,      # (M, N) forward input, row i finite
    i,      # scalar: the row
    mu,     # scalar: its saved mean, or None (RMSNorm: not centered)
    r,      # scalar: its saved rstd
    w,      # (C,) weight or None
    w0,     # scalar: weight index of the row's first element (group norm: its first channel)
    per,    # scalar: elements per weight (1 for layer norm, S for group norm)
    ds,     # (M, N) fused residual gradient or None
    dx,     # (M, N) output
    dwp,    # (C,) dweight partial, accumulated into at the weight's index
    dbp,    # (C,) dbias partial, the same, or None (RMSNorm)
):
    """backward_sums and backward_span for a finite row whose float sums overflowed:
    in float64, x and dy each scaled by a power of two (exact), r split as
    ``fr * 2**er`` so that no intermediate leaves the range (see scaled_row)."""
    n = x.shape[1]
    ex = row_scale(x, i)
    eg = row_scale(dy, i)
    fr, er = math.frexp(np.float64(r))
    ms = corr = 0.0
    if mu is not None:
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
    c2 = c2 / n if mu is not None else 0.0
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
        if dbp is not None:
            dbp[c] += g
