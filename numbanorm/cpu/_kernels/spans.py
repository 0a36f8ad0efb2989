"""The forward's row writers: elements ``lo:hi`` of a row normalized from its statistics
(LayerNorm) or scaled by its rstd (RMSNorm), with ordinary or streaming stores
(``memory``), shared by the norms' row functions and their fused forms (``add_norm``);
two streamed 16-bit rows at once (``write_pair``); and ``grouping``, the order in which
the norms' row functions write their rows.
"""

import numpy as np

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .common import least
from .halves import BFLOAT16_BY_INSTRUCTION, CHUNK, by_instruction, narrow, put_bfloat16, stack_chunk, widen
from .memory import L1_DATA_BYTES, _itemsize, ahead_chunk, ask_ahead, put_streaming, span_lines

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
    either, that also needs 'nsz': book, chapter 5), and the large-offset tests fail
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
def pair_at(
    x,      # (M, N) input rows, 16-bit floats as integer bits (halves)
    i,      # scalar: the first of the two rows, i and i + 1
    j,      # scalar (unsigned): the element
    m1,     # scalar: row i's mean
    r1,     # scalar: row i's rstd
    m2,     # scalar: row i + 1's mean
    r2,     # scalar: row i + 1's rstd
    w,      # (N,) weight or None
    b,      # (N,) bias or None
):
    """Element ``j`` of rows ``i`` and ``i + 1``, normalized as normalize_span normalizes a
    16-bit row's (the mean folded, the same operations, so the same bits; scale_span's
    where the means are 0 and there is no bias, since x - 0 is x), an element of the weight
    and the bias widened once for both rows: two of a LayerNorm row's three widenings."""
    v1 = (widen(x[i, j]) - m1) * r1
    v2 = (widen(x[i + 1, j]) - m2) * r2
    if w is not None:
        wj = widen(w[j])
        v1 = v1 * wj
        v2 = v2 * wj
    if b is not None:
        bj = widen(b[j])
        v1 = v1 + bj
        v2 = v2 + bj
    return v1, v2


@njit(cache=True, fastmath={"contract"}, nogil=True, inline="always")
def normalize_pair(
    x,      # (M, N) input rows, 16-bit floats as integer bits (halves)
    i,      # scalar: the first of the two rows to write, i and i + 1 (in cache)
    m1,     # scalar: row i's mean
    r1,     # scalar: row i's rstd
    m2,     # scalar: row i + 1's mean
    r2,     # scalar: row i + 1's rstd
    w,      # (N,) weight or None
    b,      # (N,) bias or None
    out,    # (M, N) where the rows go, as rows i and i + 1
    lo,     # scalar: first element of the span of both rows
    hi,     # scalar: one past its last
    nt,     # constant bool: streaming stores (the span's whole lines in both rows)
):
    """normalize_span for rows ``i`` and ``i + 1`` of a 16-bit ``x`` at once (pair_at), its
    two branches normalize_span's: bfloat16 narrowed by its instruction from float32 chunks,
    everything else element by element."""
    if BFLOAT16_BY_INSTRUCTION and by_instruction(out):  # (as normalize_span)
        t1 = stack_chunk()
        t2 = stack_chunk()
        for c in range(lo, hi, CHUNK):
            n = least(CHUNK, hi - c)
            for k in range(n):
                j = np.uint64(c + k)
                v1, v2 = pair_at(x, i, j, m1, r1, m2, r2, w, b)
                t1[k] = v1
                t2[k] = v2
            put_bfloat16(out, i, c, t1, n, nt)
            put_bfloat16(out, i + 1, c, t2, n, nt)
    else:
        for k in range(hi - lo):
            j = np.uint64(lo + k)  # unsigned, as in normalize_span
            v1, v2 = pair_at(x, i, j, m1, r1, m2, r2, w, b)
            if nt:
                put_streaming(out, i, j, narrow(v1, out))
                put_streaming(out, i + 1, j, narrow(v2, out))
            else:
                out[i, j] = narrow(v1, out)
                out[i + 1, j] = narrow(v2, out)


@njit(cache=True, fastmath={"contract"}, nogil=True, inline="always")
def write_pair(
    x,      # (M, N) input rows, 16-bit floats as integer bits (halves)
    i,      # scalar: the first of the two rows, i and i + 1
    m1,     # scalar: row i's mean (mu + corr, folded as normalize_span folds it; 0: RMSNorm)
    r1,     # scalar: row i's rstd
    m2,     # scalar: row i + 1's mean
    r2,     # scalar: row i + 1's rstd
    w,      # (N,) weight as the row function's, or None
    b,      # (N,) bias, as w
    y,      # (M, N) output, x's dtype, apart from x (the row functions stage rows written in place)
    hi,     # scalar: one past the last row of the block
):
    """Streamed rows ``i`` and ``i + 1`` of a 16-bit forward written together
    (normalize_pair), for LayerNorm's and RMSNorm's row functions: their whole lines go
    out with streaming stores (the same lines in both rows: the caller checks), the next
    pair asked for as they are written, as a row function writes a streamed row."""
    N = x.shape[1]
    chunk = ahead_chunk(x)
    s0, s1 = span_lines(y, i, 0, N)
    normalize_pair(x, i, m1, r1, m2, r2, w, b, y, 0, s0, False)
    for t in range(s0, s1, chunk):
        te = min(t + chunk, s1)
        ask_ahead(x, i + 1, hi, t, te)  # rows i + 2 and i + 3
        ask_ahead(x, i + 2, hi, t, te)
        normalize_pair(x, i, m1, r1, m2, r2, w, b, y, t, te, True)
    normalize_pair(x, i, m1, r1, m2, r2, w, b, y, s1, N, False)


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
