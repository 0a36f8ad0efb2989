"""The forward's row writers: elements ``lo:hi`` of a row normalized from its statistics
(LayerNorm) or scaled by its rstd (RMSNorm), with ordinary or streaming stores
(``memory``), shared by the norms' row functions and their fused forms (``add_norm``);
and ``grouping``, the order in which the norms' row functions write their rows.
"""

import numpy as np

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .common import least
from .halves import BFLOAT16_BY_INSTRUCTION, CHUNK, by_instruction, narrow, put_bfloat16, stack_chunk, widen
from .memory import L1_DATA_BYTES, _itemsize, put_streaming

# A forward row function whose rows of x, y, weight and bias take more than GROUP_FROM_BYTES
# (the L1 data cache of Zen 5 and Emerald Rapids) takes the statistics of GROUP_ROWS rows,
# then writes them SPAN elements of each in turn, so that the spans of weight and bias
# stay in L1 for the group's rows (book, the CPU design log); streamed, y stays out of the
# cache, and rows of x, weight and bias go in groups where they take more than this CPU's
# L1 data cache (memory.L1_DATA_BYTES)
GROUP_FROM_BYTES = 48 << 10
GROUP_ROWS = 8
SPAN = 2048


@njit(cache=True, nogil=True, inline="always")
def grouping(
    n,        # scalar: elements in a row
    params,   # scalar: bytes an element of the weight and the bias the call has take together
    row,      # scalar: bytes an element takes in x, and in y where it is not streamed
    streamed, # scalar bool: y written with streaming stores
    whole,    # scalar bool: rows written whole (staged through a scratch row: out=x, streamed)
):
    """``(rows, span)``: the rows whose statistics a forward row function takes before
    their writes, and the elements of each it writes in turn (GROUP_FROM_BYTES).
    Scalars only: an inlined function's array arguments are increfed where it is called
    (memory.stream_row)."""
    if params > 0 and not whole and n * (row + params) > (L1_DATA_BYTES if streamed else GROUP_FROM_BYTES):
        return GROUP_ROWS, SPAN
    return 1, n


@njit(cache=True, fastmath={"contract"}, nogil=True, inline="always")
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
    the mean and be lost (no 'reassoc' here; with it alone LLVM did not fold it
    either, that also needs 'nsz'), and the large-offset tests fail
    if a compiler ever does.  16-bit rows are folded on purpose: the rounding of
    ``mu + corr`` is 2^-24 of the mean, far under a 16-bit output's half ulp, and one
    subtraction fewer an element is what an AVX2 loop's narrowing needs (book, the
    performance log).  Inlined, with rows as (array, index) rather than views,
    for the reason of memory.stream_row.  A streamed and a plain span compute
    the same operations, so an element's bits do not depend on which took it.

    bfloat16 narrowed by its instruction is computed into a float32 chunk on the stack
    that halves.put_bfloat16 narrows and stores (halves, "bfloat16 by instruction"), in
    a branch of its own: one loop for both slowed every short row in cache, and an
    inlined helper for the arithmetic they share lengthened every first call's compile
    (the performance design log).
    """
    m = mu + corr
    # (both constants; the first, a global, spares the other branch's compile where False)
    if BFLOAT16_BY_INSTRUCTION and by_instruction(out):
        tmp = stack_chunk()
        for c in range(lo, hi, CHUNK):
            n = least(CHUNK, hi - c)
            for k in range(n):
                j = np.uint64(c + k)
                v = (widen(x[i, j]) - m) * r  # (16-bit: the mean folded, as below)
                if w is not None:
                    v = v * widen(w[j])
                if b is not None:
                    v = v + widen(b[j])
                tmp[k] = v
            put_bfloat16(out, o, c, tmp, n, nt)
    else:
        for k in range(hi - lo):
            j = np.uint64(lo + k)  # unsigned: no wraparound select, which made every load a gather
            if _itemsize(x) == 2:  # (a constant: one of the two lines is compiled)
                v = (widen(x[i, j]) - m) * r
            else:
                v = ((widen(x[i, j]) - mu) - corr) * r
            if w is not None:
                v = v * widen(w[j])  # 16-bit weights of a small call are widened here (cpu._backend.Plans)
            if b is not None:
                v = v + widen(b[j])
            if nt:
                put_streaming(out, o, j, narrow(v, out))
            else:
                out[o, j] = narrow(v, out)


@njit(cache=True, fastmath={"contract"}, nogil=True, inline="always")
def scale_span(
    x,      # (M, N) input rows
    i,      # scalar: the row to write (in cache)
    r,      # scalar: row i's rstd
    w,      # (N,) weight or None
    out,    # (K, N) where the scaled row goes
    o,      # scalar: the row of `out`
    lo,     # scalar: first element of the span
    hi,     # scalar: one past its last
    nt,     # constant bool: streaming stores (as normalize_span)
):
    """Write elements ``lo:hi`` of row ``i`` times ``r * w`` into ``out[o]`` (as normalize_span)."""
    if BFLOAT16_BY_INSTRUCTION and by_instruction(out):  # (as normalize_span)
        tmp = stack_chunk()
        for c in range(lo, hi, CHUNK):
            n = least(CHUNK, hi - c)
            for k in range(n):
                j = np.uint64(c + k)
                v = widen(x[i, j]) * r
                if w is not None:
                    v = v * widen(w[j])
                tmp[k] = v
            put_bfloat16(out, o, c, tmp, n, nt)
    else:
        for k in range(hi - lo):
            j = np.uint64(lo + k)  # unsigned, as in normalize_span
            v = widen(x[i, j]) * r
            if w is not None:
                v = v * widen(w[j])  # 16-bit weights of a small call too (cpu._backend.Plans)
            if nt:
                put_streaming(out, o, j, narrow(v, out))
            else:
                out[o, j] = narrow(v, out)
