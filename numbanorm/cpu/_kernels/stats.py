"""The statistics of one row, as every CPU row function takes them: the helpers that
``layer_norm``, ``rms_norm``, ``group_norm`` (a (sample, group) is a row) and
``add_norm`` share.

``row_stats``: LayerNorm's statistics in one pass, over the deviations from a shift
(the mean of the row's first elements) where ``one_pass_ok`` says that pass can be
trusted, and in the corrected two-pass elsewhere; ``row_sum_squares``: RMSNorm's;
``overflowed`` and ``row_is_finite``: whether a row's sums left the floating-point
range on finite inputs (those rows go to ``rescale``); ``row_factors``: how a backward
row applies its rstd so that no product leaves the range before dx does.  The sums themselves are
``sums``'s blocked loops.
"""

import numpy as np

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .common import FASTMATH, least, smallest_normal, wide_vectors
from .halves import like, widen
from .sums import deviation_sums


# Elements whose mean is a row's shift: it misses the row's mean by more than a standard
# deviation with probability erfc(sqrt(16 / 2)) = 6e-5 on independent elements (one
# element: erfc(sqrt(1 / 2)) = 32%, and those rows pay a second statistics pass)
SHIFT_SAMPLE = 16


@njit(cache=True, nogil=True, inline="always")
def shift(
    x,      # (M, N) rows (of x, or of s = x + residual), never empty (_validate)
    i,      # scalar: the row
    zero,   # scalar 0 in the accumulation dtype
):
    """Row ``i``'s shift: the mean of its first ``SHIFT_SAMPLE`` elements, in the
    accumulation dtype."""
    m = least(x.shape[1], SHIFT_SAMPLE)
    total = 0.0  # float64: the sum of a float32 row near its largest values stays finite
    for j in range(m):
        total += widen(x[i, j])
    return like(total / m, zero)


# Compiled on its own, not inlined: a reduction inlined into two variants of a row function
# (common.STREAMING) could be vectorized apart (and inlined, it left increfs of x a row)
@njit(cache=True, fastmath=FASTMATH | {"contract"}, nogil=True)
def row_stats(
    x,      # (M, N) rows (of x, or of s = x + residual), never empty (_validate)
    i,      # scalar: the row
    zero,   # scalar 0 in the accumulation dtype
):
    """``(mu, corr, var)`` of row ``i`` in the accumulation dtype, its mean split as
    ``mu + corr`` (the split normalize_span keeps apart).

    One pass over the deviations ``d = x - k`` from its :func:`shift` ``k`` gives
    ``m1 = mean(d)`` and ``ms = mean(d^2)``; where ``k`` lies within a standard
    deviation of the mean (:func:`one_pass_ok`), ``var = ms - m1^2`` cancels at most
    half of ``ms`` (one bit), and ``mu = k``, ``corr = m1``: as good as the corrected
    two-pass, in one pass of the three a forward makes (float16 (16384, 4096) in L2:
    143 ns a row of 919).  Elsewhere a second pass over the deviations from the
    first's mean ``mu = k + m1``, whose sum corrects mu's rounding (Chan, Golub &
    LeVeque's corrected two-pass).  Both passes are one loop (the sums inlined once:
    a second copy cost a fifth of a forward's compile).  Blocked (sums).
    """
    wide_vectors(x)
    n = x.shape[1]
    mu = shift(x, i, zero)
    m1 = ms = 0.0
    for attempt in range(2):  # (a while loop here left two increfs of x a call)
        s1, s2 = deviation_sums(x, i, mu, zero)
        m1, ms = s1 / n, s2 / n
        if attempt == 1 or one_pass_ok(m1, ms):
            break
        mu = like(mu + m1, zero)
    var = ms - m1 * m1
    if var < 0.0:  # rounding on a constant row (a NaN fails the test and stays NaN)
        var = 0.0
    return mu, like(m1, zero), like(var, zero)


@njit(cache=True, nogil=True, inline="always")
def one_pass_ok(
    m1,     # scalar: mean(d), d = x - shift, float64
    ms,     # scalar: mean(d^2), float64
):
    """Whether a one-pass variance can be trusted (row_stats): ``m1^2 <= ms / 2``, so
    that ``ms - m1^2`` loses at most one bit.  Not for a row whose shift
    is an outlier, or with a NaN, an Inf or an overflow: those take the two-pass
    (the caller branches itself: a branch inside an inlined function that reads
    x kept a reference count of x per row, see memory.stream_row)."""
    return np.isfinite(ms) and m1 * m1 <= 0.5 * ms


@njit(cache=True, fastmath=FASTMATH | {"contract"}, nogil=True)  # on its own, as row_stats
def row_sum_squares(
    x,      # (M, N) rows
    i,      # scalar: the row
    zero,   # scalar 0 in the accumulation dtype
):
    """``sum(x[i] ** 2)`` in the accumulation dtype (blocked: sums.deviation_sums)."""
    wide_vectors(x)
    return like(deviation_sums(x, i, like(0.0, zero), zero)[1], zero)  # (a constant 0: x - 0 folds away)


@njit(cache=True, nogil=True, inline="always")
def overflowed(
    mu,     # scalar: a row's first-pass mean
    r,      # scalar: its rstd, 1/sqrt(var + eps)
):
    """Whether a row's sums left the floating-point range: a sum that overflowed to
    Inf (r = 0), or a variance that underflowed (eps = 0 or tinier) to 0 (r = Inf) or
    to a subnormal, whose lost bits r * r overflowing tells.  For a row with NaN or Inf
    inputs the caller's row_is_finite says no."""
    return not (np.isfinite(mu) and np.isfinite(r) and r > 0 and np.isfinite(r * r))


@njit(cache=True, nogil=True, inline="always")
def row_is_finite(
    x,      # (M, N) rows
    i,      # scalar: the row
):
    for j in range(x.shape[1]):
        if not np.isfinite(widen(x[i, j])):
            return False
    return True


@njit(cache=True, nogil=True, inline="always")
def row_factors(
    r,      # scalar: a row's rstd
    one,    # scalar 1 in the accumulation dtype
):
    """``(f, rf)`` with ``f * rf = r``: a backward writes dx as ``(wdy * f - (xhat * c1 + c2)
    * f) * rf``, so that no intermediate leaves the range where dx does not, given
    sum(xhat * wdy) and sum(wdy) in range (then ``xhat * c1 + c2`` is too).  r > 1: the
    difference first (f = 1; wdy * r could overflow); else each term times r first
    (f = r; wdy near the largest value less a term of the other sign could overflow)."""
    if r > one:
        return one, r
    return r, one


@njit(cache=True, nogil=True, inline="always")
def weight_factors(
    wc,     # scalar: a channel's weight (1 without weight), accumulation dtype
    f,      # scalar: its group's f (row_factors)
    one,    # scalar 1 in the accumulation dtype
):
    """``(p, q)``: a GroupNorm backward takes ``wdy * f`` as ``(dy * p) * q``.  ``(wc * f, 1)``
    (dy * weight may overflow where dy * (weight * f) does not), but ``(wc, f)`` where wc * f
    left the normal range below and 0 < |wc| <= 1: a tiny weight times f underflows where
    weight * dy times f does not, and dy * wc cannot overflow (a subnormal f with a larger
    weight keeps the product)."""
    wf = wc * f
    if abs(wf) < smallest_normal(wf) and wc != 0 and abs(wc) <= one:
        return wc, f
    return wf, one
