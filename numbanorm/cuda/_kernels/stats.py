"""The statistics of one row, as a row group computes them: the device functions that
``row_norm`` (LayerNorm, RMSNorm, fused residual or not) and ``group_norm`` (a
(sample, group) is a row) share.

``row_sum``: pass 1 over the row's words -- each thread loads its words (into
registers where the row fits, ``xs``; word by word on the loop path), forms and
stores ``s = x + res`` once when fused, and sums its elements (or their squares,
RMSNorm).  ``centered``: the group's mean from that sum, then pass 2 over the
deviations from it, whose sum corrects the mean's rounding (the corrected
two-pass variance), and rstd.  Both take the row mapping's constants (threads
per row, elements per thread, word width, loop or registers) as closure
constants, like the kernels that inline them; ``reduce`` does the group sums.
"""

import functools
import math

from numba import cuda

from . import common as C
from . import vec as _vec
from .reduce import U32, group_sum, group_sum2


def stage_type(xdt, vec):
    """numba type of a staged row's elements: the kernels' view of the row (uint64
    words, or single elements: bfloat16 as its uint16 bits)."""
    if vec > 1:
        return cuda.uint64
    if C.is_bfloat16(xdt):
        return cuda.uint16
    return {C.F16: cuda.types.float16, C.F32: cuda.float32, C.F64: cuda.float64}[xdt]


@functools.lru_cache(maxsize=None)
def stage_fns(xdt, acc_name, vec):
    """Device functions moving word ``q`` of a row to and from its shared copy (a
    1-D array of the row's kernel elements, ``common.stage_capacity`` long).

    ``copy(row, q, stage)``: the word as it is, ``put(stage, q, vals, e)``: from
    accumulation values, ``get(stage, q, out, e)``: to them.  A shared uint64
    array is only 8-byte aligned (numba-cuda aligns a shared array to its
    element), so a 16-byte word moves there as its two 8-byte halves.
    """
    # shared indices as unsigned 32-bit: a signed one costs numba's negative-index
    # wraparound (a compare and a select per access)
    LOADW, STOREW = C.word_fns(xdt, acc_name, vec)
    if C.u64_per_word(xdt, vec) == 1:
        @cuda.jit(device=True)
        def copy(row, q, stage):
            stage[U32(q)] = row[q]

        @cuda.jit(device=True)
        def put1(stage, q, vals, e):
            STOREW(stage, U32(q), vals, e)

        @cuda.jit(device=True)
        def get1(stage, q, out, e):
            LOADW(stage, U32(q), out, e)

        return copy, put1, get1
    HALF = vec // 2
    LOADH, STOREH = C.word_fns(xdt, acc_name, HALF)

    @cuda.jit(device=True)
    def copy2(row, q, stage):
        lo, hi = _vec.load_pair(row, q)
        k = U32(q) << U32(1)
        stage[k] = lo
        stage[k + U32(1)] = hi

    @cuda.jit(device=True)
    def put(stage, q, vals, e):
        k = U32(q) << U32(1)
        STOREH(stage, k, vals, e)
        STOREH(stage, k + U32(1), vals, e + HALF)

    @cuda.jit(device=True)
    def get(stage, q, out, e):
        k = U32(q) << U32(1)
        LOADH(stage, k, out, e)
        LOADH(stage, k + U32(1), out, e + HALF)

    return copy2, put, get


@functools.lru_cache(maxsize=None)
def row_sum_fn(xdt, tpr, vpt, vec, loop, squares, has_r, staged=False):
    """``row_sum(xr, resr, sr, xs, tmp, live, t, NW, stage)``: this thread's part of the row's
    sum (of squares with ``squares``); ``has_r``: x + res, stored into sr and rounded
    to x's dtype, is what is summed (and left in ``xs``); ``staged`` (loop path): the
    row summed (x, or s) is also copied into ``stage``, for the later passes."""
    ACC = C.acc_type(xdt)
    LX, SX = C.load_fn(xdt, ACC.name), C.store_fn(xdt)
    LOADW, STOREW = C.word_fns(xdt, ACC.name, vec)
    COPY, PUT, GET = stage_fns(xdt, ACC.name, vec)
    TPR, V, LOOP, LAYER, STAGED = tpr, vec, loop, not squares, staged and loop
    WPT = vpt // vec                  # words per thread

    @cuda.jit(device=True)
    def row_sum(
        xr,     # (NW,) words of the row
        resr,   # (NW,) words of its residual (has_r), else unread
        sr,     # (NW,) output x + res (has_r), else unread
        xs,     # (VPT,) this thread's elements, filled here (registers path)
        tmp,    # (V,) one word in flight
        live,   # bool: the row exists (dead rows add zeros)
        t,      # int: thread within the row group
        NW,     # int: words per row
        stage,  # (>= NW words) shared copy of the row summed (staged), else unread
    ):
        total = ACC(0)
        if LOOP:
            if live:
                for q in range(t, NW, TPR):
                    if STAGED and not has_r:
                        # the word as it is (no conversions), then read back from shared memory
                        COPY(xr, q, stage)
                        GET(stage, q, xs, 0)
                    else:
                        LOADW(xr, q, xs, 0)
                    if has_r:
                        LOADW(resr, q, tmp, 0)
                        for v in range(V):
                            xs[v] += tmp[v]
                        STOREW(sr, q, xs, 0)
                        if STAGED:
                            PUT(stage, q, xs, 0)
                    for v in range(V):
                        # fused: normalize the s handed back, rounded
                        val = LX(SX(xs[v])) if has_r else xs[v]
                        total += val if LAYER else val * val
        else:
            for k in range(WPT):
                q = t + k * TPR
                if live and q < NW:
                    LOADW(xr, q, xs, k * V)
                    if has_r:
                        LOADW(resr, q, tmp, 0)
                        for v in range(V):
                            xs[k * V + v] += tmp[v]
                        STOREW(sr, q, xs, k * V)
                        for v in range(V):
                            xs[k * V + v] = LX(SX(xs[k * V + v]))
                else:
                    for v in range(V):
                        xs[k * V + v] = ACC(0)
                for v in range(V):
                    total += xs[k * V + v] if LAYER else xs[k * V + v] * xs[k * V + v]
        return total

    return row_sum


@functools.lru_cache(maxsize=None)
def centered_fn(xdt, tpr, vpt, vec, loop, staged=False):
    """``centered(src, xs, live, t, NW, total, inv_n, eps, scratch, tid)`` -> ``(mu, corr,
    rstd)``: mean = mu + corr, with ((x - mu) - corr) the deviations the kernels use.
    ``staged``: ``src`` is the row's shared copy (``stage_fns``)."""
    ACC = C.acc_type(xdt)
    LOADW = stage_fns(xdt, ACC.name, vec)[2] if staged else C.word_fns(xdt, ACC.name, vec)[0]
    TPR, V, LOOP = tpr, vec, loop
    WPT = vpt // vec

    @cuda.jit(device=True)
    def centered(
        src,      # (NW,) words of the row (x, or s when fused; its shared copy when staged), re-read on the loop path
        xs,       # (VPT,) this thread's elements from row_sum (registers path)
        live,     # bool: the row exists
        t,        # int: thread within the row group
        NW,       # int: words per row
        total,    # scalar: this thread's row_sum
        inv_n,    # scalar: 1 / elements per row, accumulation dtype
        eps,      # scalar, accumulation dtype
        scratch,  # (2, >= 2, slots) shared memory of the group sums (buffer 0, then 1)
        tid,      # int: thread within the block
    ):
        zero = ACC(0)
        mu = group_sum(total, scratch, 0, tid, TPR) * inv_n
        # pass 2: deviations from mu; their sum corrects mu's rounding
        dsum = zero
        sq = zero
        if LOOP:
            if live:
                for q in range(t, NW, TPR):
                    LOADW(src, q, xs, 0)
                    for v in range(V):
                        d = xs[v] - mu
                        dsum += d
                        sq += d * d
        else:
            for k in range(WPT):
                if live and t + k * TPR < NW:
                    for v in range(V):
                        d = xs[k * V + v] - mu
                        dsum += d
                        sq += d * d
        dsum, sq = group_sum2(dsum, sq, scratch, 1, tid, TPR)
        corr = dsum * inv_n
        var = sq * inv_n - corr * corr
        if var < zero:  # rounding on a constant row; NaN fails the test and stays NaN
            var = zero
        return mu, corr, ACC(1) / math.sqrt(var + eps)

    return centered
