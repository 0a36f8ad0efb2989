"""The statistics of one row, as every CPU row function takes them: the helpers that
``layer_norm``, ``rms_norm``, ``group_norm`` (a (sample, group) is a row) and
``add_norm`` share.

``shifted_stats`` and ``one_pass_ok``: LayerNorm's statistics in one pass, over the
deviations from a shift (the mean of the row's first elements), where that pass can
be trusted; ``deviation_stats``: the corrected two-pass for the rows where it cannot;
``row_sum``, ``row_sum_squares``: the sums of the two-pass and of RMSNorm; ``overflowed``
and ``row_is_finite``: whether a row's sums left the floating-point range on finite
inputs (those rows go to ``rescale``).  The sums themselves are ``sums``'s blocked loops.
"""

import numpy as np

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .common import FASTMATH
from .halves import like, widen
from .sums import deviation_sums


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
def row_sum_squares(
    x,      # (M, N) rows
    i,      # scalar: the row
    zero,   # scalar 0 in the accumulation dtype
):
    """``sum(x[i] ** 2)`` in the accumulation dtype (blocked: sums.deviation_sums)."""
    return like(deviation_sums(x, i, zero, zero)[1], zero)


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
