"""The blocked row sums every CPU kernel takes: one loop each, inlined where it is used.

A row is summed over blocks of :data:`SUM_BLOCK` elements, each block in the
accumulation dtype (in vector lanes: FASTMATH's 'reassoc') and the block totals
in float64, so that the rounding error of a sum does not grow with the row's
length (book, chapter 4).  The helpers return the float64 totals; a caller
narrows them with ``halves.like`` where its statistic is in the accumulation dtype.

Each is a loop that stores nothing: a vectorized loop that stores runs behind a
run-time overlap check whose scalar fallback adds in another order, so a sum
taken there would depend on where the arrays lie (book, chapter 5).  A sum a
caller does not use (``deviation_sums(...)[0]`` alone) is dropped by LLVM,
and ``x - 0`` or ``d * 1`` fold away, so a caller pays only for what it uses.
"""

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .common import FASTMATH, least
from .halves import widen

SUM_BLOCK = 4096


@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def deviation_sums(
    x,      # (M, N) rows
    i,      # scalar: the row
    mu,     # scalar subtracted from every element, accumulation dtype (zero: none)
    zero,   # scalar 0 in the accumulation dtype
):
    """float64 ``(sum(d), sum(d * d))`` over row ``i``, ``d = x - mu``."""
    n = x.shape[1]
    dsum = 0.0
    sq = 0.0
    for k in range((n + SUM_BLOCK - 1) // SUM_BLOCK):
        lo = k * SUM_BLOCK
        dpart = zero
        sqpart = zero
        # range(m) from 0: LLVM did not vectorize range(lo, min(n, lo + SUM_BLOCK))
        for j in range(least(n - lo, SUM_BLOCK)):
            d = widen(x[i, lo + j]) - mu
            dpart += d
            sqpart += d * d
        dsum += dpart
        sq += sqpart
    return dsum, sq


# deviation_sums's blocking again, written out: a shared loop would take an element
# function and a tuple of accumulators into the hottest loops LLVM must vectorize
@njit(cache=True, fastmath=FASTMATH, nogil=True, inline="always")
def gradient_sums(
    dy,     # (M, N) gradient rows
    x,      # (M, N) forward input rows
    i,      # scalar: the row
    mu,     # scalar subtracted from x, accumulation dtype (zero: none)
    s,      # scalar x - mu is multiplied by, accumulation dtype (one: none)
    w,      # (N,) weight, or None (ones)
    zero,   # scalar 0 in the accumulation dtype
    d0,     # float64 the first total starts from (group norm carries it across channels)
):
    """float64 ``(d0 + sum(d), sum(d * s * wdy), sum(wdy))`` over row ``i``,
    ``d = x - mu`` and ``wdy = dy * w`` (``s`` the row's rstd: d * wdy of a tiny row with eps
    0 underflowed, each d * s is of order 1)."""
    n = x.shape[1]
    dsum = d0
    xw = 0.0
    wsum = 0.0
    for k in range((n + SUM_BLOCK - 1) // SUM_BLOCK):
        lo = k * SUM_BLOCK
        dpart = zero
        xwpart = zero
        wpart = zero
        for j in range(least(n - lo, SUM_BLOCK)):  # from 0, as in deviation_sums
            d = widen(x[i, lo + j]) - mu
            g = widen(dy[i, lo + j])
            wdy = g * w[lo + j] if w is not None else g
            dpart += d
            xwpart += (d * s) * wdy
            wpart += wdy
        dsum += dpart
        xw += xwpart
        wsum += wpart
    return dsum, xw, wsum
