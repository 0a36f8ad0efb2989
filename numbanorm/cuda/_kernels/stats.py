"""The statistics of one row, as a row group computes them: the device functions that
``row_norm`` (LayerNorm, RMSNorm, fused residual or not) and ``group_norm`` (a
(sample, group) is a row) share.

``row_sum``: pass 1 over the row's words -- each thread loads its words (into
registers where the row fits, ``xs``; word by word on the loop path), forms and
stores ``s = x + res`` once when fused, and sums its elements (or their squares,
RMSNorm; or, ``shifted``, their deviations from a shift ``k``, the mean of the row's
first word (``first``), and the squares of those).  ``centered``: the group's mean from that
sum, then pass 2 over the deviations from it (``deviations``), whose sum corrects
the mean's rounding (the corrected two-pass variance), and rstd.  ``shifted``:
LayerNorm's statistics from the shifted sums in one group reduction, with
``deviations`` for the rows where they are not exact enough.  Both take the row mapping's constants (threads
per row, elements per thread, word width, loop or registers) as closure
constants, like the kernels that inline them; ``reduce`` does the group sums.
"""

import functools
import math

from numba import cuda

from . import common as C
from . import vec as _vec
from .reduce import U32, WARP, group_sum, group_sum2

_FULL_MASK = 0xFFFFFFFF


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
def first_fn(xdt, vec, has_r):
    """``first(xr, resr, tmp)``: the shift of LayerNorm's one-pass statistics: the mean of
    the row's first word (``vec`` elements, of x + res rounded to x's dtype with
    ``has_r``, as ``row_sum`` sums them), in the accumulation dtype.  The shifted sums
    need it within about a std of the row's mean: a single element is not for a third of
    Gaussian rows, the mean of 8 (16-bit words) for 0.5%, of 4 (float32) for 5%.  Summed
    as a tree (a constant row's shift is its value, exactly); every thread of the group
    loads the word itself (the same address: a broadcast from L1)."""
    ACC = C.acc_type(xdt)
    LX, SX = C.load_fn(xdt, ACC.name), C.store_fn(xdt)
    LOADW = C.word_fns(xdt, ACC.name, vec)[0]
    V, INV_V = vec, 1.0 / vec  # (a power of two: exact)

    @cuda.jit(device=True)
    def first(
        xr,     # (NW,) words of the row
        resr,   # (NW,) words of its residual (has_r), else unread
        tmp,    # (V,) one word in flight
    ):
        LOADW(xr, 0, tmp, 0)
        if has_r:
            r = cuda.local.array(V, ACC)
            LOADW(resr, 0, r, 0)
            for v in range(V):
                tmp[v] = LX(SX(tmp[v] + r[v]))
        h = V
        while h > 1:
            h >>= 1
            for v in range(h):
                tmp[v] = tmp[v] + tmp[v + h]
        return tmp[0] * ACC(INV_V)

    return first


@functools.lru_cache(maxsize=None)
def row_sum_fn(xdt, tpr, vpt, vec, loop, squares, has_r, staged=False, shifted=False):
    """``row_sum(xr, resr, sr, xs, tmp, live, t, NW, stage)``: this thread's part of the row's
    sum (of squares with ``squares``); ``has_r``: x + res, stored into sr and rounded
    to x's dtype, is what is summed (and left in ``xs``); ``staged`` (loop path): the
    row summed (x, or s) is also copied into ``stage``, for the later passes.
    ``shifted``: ``row_sum(..., stage, k)`` -> the sums of ``d = x - k`` and of ``d^2``."""
    ACC = C.acc_type(xdt)
    LX, SX = C.load_fn(xdt, ACC.name), C.store_fn(xdt)
    LOADW, STOREW = C.word_fns(xdt, ACC.name, vec)
    COPY, PUT, GET = stage_fns(xdt, ACC.name, vec)
    TPR, V, LOOP, LAYER, STAGED, SHIFTED = tpr, vec, loop, not squares, staged and loop, shifted and not squares
    WPT = vpt // vec                  # words per thread

    @cuda.jit(device=True)
    def row_sums(
        xr,     # (NW,) words of the row
        resr,   # (NW,) words of its residual (has_r), else unread
        sr,     # (NW,) output x + res (has_r), else unread
        xs,     # (VPT,) this thread's elements, filled here (registers path)
        tmp,    # (V,) one word in flight
        live,   # bool: the row exists (dead rows add zeros)
        t,      # int: thread within the row group
        NW,     # int: words per row
        stage,  # (>= NW words) shared copy of the row summed (staged), else unread
        k,      # scalar: the shift (shifted), else unread
    ):
        total = ACC(0)
        total2 = ACC(0)
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
                        if SHIFTED:
                            d = val - k
                            total += d
                            total2 += d * d
                        else:
                            total += val if LAYER else val * val
        else:
            for j in range(WPT):
                q = t + j * TPR
                if live and q < NW:
                    LOADW(xr, q, xs, j * V)
                    if has_r:
                        LOADW(resr, q, tmp, 0)
                        for v in range(V):
                            xs[j * V + v] += tmp[v]
                        STOREW(sr, q, xs, j * V)
                        for v in range(V):
                            xs[j * V + v] = LX(SX(xs[j * V + v]))
                else:
                    for v in range(V):
                        xs[j * V + v] = k if SHIFTED else ACC(0)   # (adds zeros)
                for v in range(V):
                    if SHIFTED:
                        d = xs[j * V + v] - k
                        total += d
                        total2 += d * d
                    else:
                        total += xs[j * V + v] if LAYER else xs[j * V + v] * xs[j * V + v]
        return total, total2

    if SHIFTED:
        return row_sums

    @cuda.jit(device=True)
    def row_sum(xr, resr, sr, xs, tmp, live, t, NW, stage):  # (the arguments as row_sums's)
        return row_sums(xr, resr, sr, xs, tmp, live, t, NW, stage, ACC(0))[0]

    return row_sum


@functools.lru_cache(maxsize=None)
def _rstd_fn(acc_name):
    ACC = getattr(cuda, acc_name)

    @cuda.jit(device=True)
    def rstd(var, eps):
        if var < ACC(0):  # rounding on a constant row; NaN fails the test and stays NaN
            var = ACC(0)
        return ACC(1) / math.sqrt(var + eps)

    return rstd


@functools.lru_cache(maxsize=None)
def deviations_fn(xdt, tpr, vpt, vec, loop, staged=False):
    """``deviations(src, xs, live, t, NW, mu, inv_n, eps, scratch, buf, tid)`` -> ``(corr,
    rstd)``: a pass over the row's deviations from ``mu``, whose mean ``corr`` corrects
    mu's rounding (the mean is mu + corr), and the variance about it.  ``staged``:
    ``src`` is the row's shared copy (``stage_fns``)."""
    ACC = C.acc_type(xdt)
    LOADW = stage_fns(xdt, ACC.name, vec)[2] if staged else C.word_fns(xdt, ACC.name, vec)[0]
    RSTD = _rstd_fn(ACC.name)
    TPR, V, LOOP = tpr, vec, loop
    WPT = vpt // vec

    @cuda.jit(device=True)
    def deviations(
        src,      # (NW,) words of the row (x, or s when fused; its shared copy when staged), re-read on the loop path
        xs,       # (VPT,) this thread's elements from row_sum (registers path)
        live,     # bool: the row exists
        t,        # int: thread within the row group
        NW,       # int: words per row
        mu,       # scalar: the mean the deviations are taken from
        inv_n,    # scalar: 1 / elements per row, accumulation dtype
        eps,      # scalar, accumulation dtype
        scratch,  # (2, >= 2, slots) shared memory of the group sums
        buf,      # int: the scratch buffer this reduction uses
        tid,      # int: thread within the block
    ):
        dsum = ACC(0)
        sq = ACC(0)
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
        dsum, sq = group_sum2(dsum, sq, scratch, buf, tid, TPR)
        corr = dsum * inv_n
        return corr, RSTD(sq * inv_n - corr * corr, eps)

    return deviations


@functools.lru_cache(maxsize=None)
def centered_fn(xdt, tpr, vpt, vec, loop, staged=False):
    """``centered(src, xs, live, t, NW, total, inv_n, eps, scratch, tid)`` -> ``(mu, corr,
    rstd)``: mean = mu + corr, with ((x - mu) - corr) the deviations the kernels use.
    ``staged``: ``src`` is the row's shared copy (``stage_fns``)."""
    ACC = C.acc_type(xdt)
    DEVIATIONS = deviations_fn(xdt, tpr, vpt, vec, loop, staged)
    TPR = tpr

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
        mu = group_sum(total, scratch, 0, tid, TPR) * inv_n
        # pass 2: deviations from mu; their sum corrects mu's rounding
        corr, r = DEVIATIONS(src, xs, live, t, NW, mu, inv_n, eps, scratch, 1, tid)
        return mu, corr, r

    return centered


@functools.lru_cache(maxsize=None)
def shifted_fn(xdt, tpr, vpt, vec, loop, staged=False):
    """``shifted(src, xs, live, t, NW, k, s1, s2, inv_n, eps, scratch, it, tid)`` -> ``(mu,
    corr, rstd, it)``: LayerNorm's statistics from ``row_sum``'s shifted sums (``s1``,
    ``s2``: of d = x - k and d^2, ``k`` from ``first``) in one group reduction:
    m1 = mean(d), ms = mean(d^2), mean = k + m1 split as mu = k, corr = m1, var = ms - m1^2.
    That is exact enough where m1^2 <= ms / 2 (k within about a std of the mean: the
    subtraction loses at most a bit, as the CPU's ``one_pass_ok``); other rows (an outlier
    first word, NaN, Inf) take a ``deviations`` pass from mu = k + m1, the corrected two-pass.
    ``it``: the group reductions made so far in this block (buffer ``it & 1``), counted on."""
    ACC = C.acc_type(xdt)
    DEVIATIONS = deviations_fn(xdt, tpr, vpt, vec, loop, staged)
    RSTD = _rstd_fn(ACC.name)
    TPR, BLOCKWIDE = tpr, tpr > WARP
    HALF, INF = ACC(0.5), ACC(math.inf)

    @cuda.jit(device=True)
    def shifted(
        src,      # (NW,) words of the row (x, or s when fused; its shared copy when staged), re-read on the loop path
        xs,       # (VPT,) this thread's elements from row_sum (registers path)
        live,     # bool: the row exists
        t,        # int: thread within the row group
        NW,       # int: words per row
        k,        # scalar: the shift, the mean of the row's first word (``first``)
        s1,       # scalar: this thread's sum of x - k
        s2,       # scalar: ... of (x - k)^2
        inv_n,    # scalar: 1 / elements per row, accumulation dtype
        eps,      # scalar, accumulation dtype
        scratch,  # (2, >= 2, slots) shared memory of the group sums
        it,       # int: group reductions so far (the scratch buffer alternates)
        tid,      # int: thread within the block
    ):
        m1, ms = group_sum2(s1, s2, scratch, it & 1, tid, TPR)
        it += 1
        m1 *= inv_n
        ms *= inv_n
        bad = live and not (m1 * m1 <= HALF * ms and ms < INF)   # (NaN compares false)
        mu = k
        corr = m1
        r = RSTD(ms - m1 * m1, eps)
        # the fallback's reduction meets every thread that shares a barrier (groups wider
        # than a warp) or a shuffle (narrower ones) with this row: all take it or none
        if BLOCKWIDE:
            anybad = cuda.syncthreads_or(U32(bad)) != 0
        else:
            anybad = cuda.any_sync(_FULL_MASK, bad)
        if anybad:
            mu2 = k + m1
            corr2, r2 = DEVIATIONS(src, xs, live, t, NW, mu2, inv_n, eps, scratch, it & 1, tid)
            it += 1
            if bad:
                mu = mu2
                corr = corr2
                r = r2
        return mu, corr, r, it

    return shifted
