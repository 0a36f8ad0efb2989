"""The statistics of one row, as a row group computes them: the device functions that
``row_norm`` (LayerNorm, RMSNorm, fused residual or not) and ``group_norm`` (a
(sample, group) is a row) share.

A row held in registers is fetched first (``fetch_fn``, ``fetch_rows_fn``: the loads of
the thread's words of one or several rows, as raw bits, ``common.raw_fns``), then summed
(``held_sums_fn``: widened into ``xs``; fused, s = x + res formed, rounded as stored);
a long row is summed word by word as it is loaded (``row_sum_fn``, the loop path,
copying it to shared memory where it fits, ``stage_fns``).  The sums are of the
elements (or their squares, RMSNorm; or, ``shifted``, of their deviations from a shift
``k``, the mean of the row's first word (``first_fn``), and their squares).
``shift_fns``/``shifted_fn``: LayerNorm's (and GroupNorm's long groups') statistics from
the shifted sums in one group reduction, with a pass over the deviations from their mean
(``deviations_fn``, ``deviation_sums_fn``: the corrected two-pass, whose sum of deviations
corrects the mean's rounding) for the rows where they are not exact enough.
``rescue_fns``: the statistics again, from memory, on the row scaled by a power of two,
for the rare rows whose sums over- or underflowed the accumulation dtype (``vote_fn``:
whether the threads that meet in a reduction take such a branch).  All take the row
mapping's constants (threads per row, elements per thread, word width, loop or
registers) as closure constants, like the kernels that inline them; ``reduce`` does the
group sums.
"""

import functools
import math

import numpy as np

from numba import cuda

from . import common as C
from . import vec as _vec
from .reduce import U32, WARP, group_sum, group_sum2

U64 = cuda.uint64

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
    ``has_r``, as ``row_sums`` sums them), in the accumulation dtype.  The shifted sums
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
def geometry_fn(xdt, code):
    """``geometry(x, tid)`` -> ``(M, NW, t, inv_n)``: a row kernel's rows, words per row (of
    ``code.vec`` elements), thread within the row group, and 1 / elements per row."""
    ACC, TPR, V = C.acc_type(xdt), code.tpr, code.vec
    KW = C.u64_per_word(xdt, V)

    @cuda.jit(device=True)
    def geometry(x, tid):
        NW = x.shape[1] // KW
        return x.shape[0], NW, tid & (TPR - 1), ACC(1) / ACC(NW * V)

    return geometry


@functools.lru_cache(maxsize=None)
def fetch_fn(xdt, tpr, vpt, vec):
    """``fetch(row, raw, at, t, NW)``: the loads of this thread's words of ``row``
    (registers path: words t, t + tpr, ...), into word slots ``at ... at + vpt / vec``
    of ``raw`` (``common.raw_fns``), and nothing that waits for them: a kernel fetches
    every array of its rows first, then works on them (``held_sums_fn``).  The loads are
    not conditional (a word past the row loads word 0 again; a dead row is a valid one
    too, ``min(row, M - 1)``), and whoever widens them skips those: ptxas schedules a
    predicated load late, after the first rows' arithmetic, where an unconditional one
    is issued with the others."""
    FETCH = C.raw_fns(xdt, C.acc_type(xdt).name, vec)[1]
    TPR, WPT = tpr, vpt // vec

    @cuda.jit(device=True)
    def fetch(
        row,    # (NW,) words of one row (a valid one)
        raw,    # (slots,) the thread's raw words (``common.raw_fns``' RAW)
        at,     # int: the first slot of this row's words
        t,      # int: thread within the row group
        NW,     # int: words per row
    ):
        for j in range(WPT):
            q = t + j * TPR
            FETCH(row, q if q < NW else 0, raw, at + j)

    return fetch


@functools.lru_cache(maxsize=None)
def fetch_rows_fn(xdt, code, arrays, rows=1):
    """``fetch(a, b, c, row, step, raw0, raw1, raw2, t, NW)``: the loads of this thread's words
    of ``rows`` (1-3) rows ``row, row + step, ...`` of the first ``arrays`` of a, b, c (each
    (M, NW)), row d's into consecutive slots of ``raw<d>``; nothing waits for them
    (``fetch_fn``).  A row past M loads row M - 1, unused."""
    FETCH = fetch_fn(xdt, code.tpr, code.vpt, code.vec)
    WPT = code.vpt // code.vec

    @cuda.jit(device=True)
    def fetch_row(a, b, c, row, raw, t, NW):
        rr = U64(min(row, a.shape[0] - 1))  # unsigned: no negative-index wraparound
        FETCH(a[rr], raw, 0, t, NW)
        if arrays > 1:
            FETCH(b[rr], raw, WPT, t, NW)
        if arrays > 2:
            FETCH(c[rr], raw, 2 * WPT, t, NW)

    @cuda.jit(device=True)
    def fetch(a, b, c, row, step, raw0, raw1, raw2, t, NW):
        fetch_row(a, b, c, row, raw0, t, NW)
        if rows > 1:
            fetch_row(a, b, c, row + step, raw1, t, NW)
        if rows > 2:
            fetch_row(a, b, c, row + 2 * step, raw2, t, NW)

    return fetch


@functools.lru_cache(maxsize=None)
def raw_rows(xdt, code, arrays, resident=None):
    """(numba type, length per row, rows in flight): the raw words a thread holds for the
    rows it loads at once (``common.rows_in_flight``, for ``resident`` threads per SM),
    ``arrays`` row arrays each."""
    raw_t = C.raw_fns(xdt, C.acc_type(xdt).name, code.vec)[0]
    per_word = C.u64_per_word(xdt, code.vec) if code.vec > 1 else 1
    item = np.dtype(xdt).itemsize
    rows = C.rows_in_flight(code, arrays * code.vpt * item, xdt == C.F64, resident, item)
    return raw_t, arrays * (code.vpt // code.vec) * per_word, rows


@functools.lru_cache(maxsize=None)
def held_sums_fn(xdt, tpr, vpt, vec, squares, has_r, shifted=False, keep=False):
    """``sums(raw, xs, tmp, live, t, NW, k)`` -> ``(total, total2)``: pass 1 of a row held
    in registers, from its words ``fetch_fn`` loaded into ``raw`` (x in slots
    0 .. vpt / vec, the residual after them with ``has_r``).  The words are widened into
    ``xs``; with ``has_r``, s = x + res rounded to x's dtype replaces x in ``raw`` (the row
    as it is to be stored, which the kernel stores and may widen again), and ``xs`` holds
    s.  ``total`` is the sum of ``xs`` (of squares with ``squares``;
    ``shifted``: of d = x - k, and ``total2`` of d^2; else 0) over the row's words.
    ``keep`` (shifted): d replaces x in ``xs`` for the row's words (the normalize pass
    takes d, not x - k again)."""
    ACC = C.acc_type(xdt)
    _, _, WIDEN, NARROW, _ = C.raw_fns(xdt, ACC.name, vec)
    TPR, V, LAYER, SHIFTED = tpr, vec, not squares, shifted and not squares
    KEEP = SHIFTED and keep
    WPT = vpt // vec

    @cuda.jit(device=True)
    def sums(
        raw,    # (slots,) the row's raw words (``fetch_fn``): x, then the residual
        xs,     # (VPT,) this thread's elements, filled here
        tmp,    # (V,) one word of the residual
        live,   # bool: the row exists
        t,      # int: thread within the row group
        NW,     # int: words per row
        k,      # scalar: the shift (shifted), else unread
    ):
        total = ACC(0)
        total2 = ACC(0)
        for j in range(WPT):
            # the words as loaded (no select on them: a select would be a new register,
            # and ptxas would load the next word into the one it frees, after the wait)
            WIDEN(raw, j, xs, j * V)
            if has_r:
                WIDEN(raw, WPT + j, tmp, 0)
                for v in range(V):
                    tmp[v] += xs[j * V + v]
                NARROW(tmp, 0, raw, j)     # fused: s as stored, and normalized as stored
                WIDEN(raw, j, xs, j * V)
        for j in range(WPT):
            q = t + j * TPR
            if live and q < NW:
                for v in range(V):
                    if SHIFTED:
                        d = xs[j * V + v] - k
                        if KEEP:
                            xs[j * V + v] = d
                        total += d
                        total2 += d * d
                    else:
                        total += xs[j * V + v] if LAYER else xs[j * V + v] * xs[j * V + v]
        return total, total2

    return sums


@functools.lru_cache(maxsize=None)
def row_sum_fn(xdt, tpr, vec, squares, has_r, staged=False, shifted=False, unroll=1):
    """``row_sums(xr, resr, sr, xs, tmp, live, t, NW, stage, k)`` -> ``(total, total2)``:
    pass 1 of a long row (the loop path), word by word, as ``held_sums_fn`` sums a row
    held in registers; ``xs`` holds one word.  ``staged``: the row summed (x, or s) is
    also copied into ``stage``, for the later passes.  ``unroll`` (without a residual):
    that many words' loads a thread issues before it uses the first, as their bits."""
    ACC = C.acc_type(xdt)
    LX, SX = C.load_fn(xdt, ACC.name), C.store_fn(xdt)
    LOADW, STOREW = C.word_fns(xdt, ACC.name, vec)
    COPY, PUT, GET = stage_fns(xdt, ACC.name, vec)
    RAW, FETCH, WIDEN, _, _ = C.raw_fns(xdt, ACC.name, vec)
    TPR, V, LAYER, STAGED, SHIFTED = tpr, vec, not squares, staged, shifted and not squares
    U = 1 if has_r else unroll
    KW = C.u64_per_word(xdt, vec) if vec > 1 else 1   # a word's slots in ``raw``
    RAWN = KW * U

    @cuda.jit(device=True)
    def add(xs, k, total, total2):
        for v in range(V):
            # fused: normalize the s handed back, rounded
            val = LX(SX(xs[v])) if has_r else xs[v]
            if SHIFTED:
                d = val - k
                total += d
                total2 += d * d
            else:
                total += val if LAYER else val * val
        return total, total2

    @cuda.jit(device=True)
    def row_sums(
        xr,     # (NW,) words of the row
        resr,   # (NW,) words of its residual (has_r), else unread
        sr,     # (NW,) output x + res (has_r), else unread
        xs,     # (V,) one word in flight
        tmp,    # (V,) one word of the residual
        live,   # bool: the row exists (dead rows add zeros)
        t,      # int: thread within the row group
        NW,     # int: words per row
        stage,  # (>= NW words) shared copy of the row summed (staged), else unread
        k,      # scalar: the shift (shifted), else unread
    ):
        total = ACC(0)
        total2 = ACC(0)
        q0 = t
        if live and U > 1:
            raw = cuda.local.array(RAWN, RAW)   # U words' bits
            while q0 + (U - 1) * TPR < NW:
                for u in range(U):
                    FETCH(xr, q0 + u * TPR, raw, u)
                for u in range(U):
                    if STAGED:  # the bits as they are
                        for h in range(KW):
                            stage[U32((q0 + u * TPR) * KW + h)] = raw[u * KW + h]
                    WIDEN(raw, u, xs, 0)
                    total, total2 = add(xs, k, total, total2)
                q0 += U * TPR
        if live:
            for q in range(q0, NW, TPR):
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
                total, total2 = add(xs, k, total, total2)
        return total, total2

    return row_sums


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
def deviation_sums_fn(xdt, tpr, vpt, vec, loop, staged=False, keep=False):
    """``deviation_sums(src, xs, live, t, NW, mu)`` -> ``(dsum, sq)``: this thread's part of a
    pass over the row's deviations from ``mu``: their sum and the sum of their squares.
    ``staged``: ``src`` is the row's shared copy (``stage_fns``).  ``keep`` (registers
    path): the deviations x - mu replace x in ``xs`` (the normalize pass takes them)."""
    ACC = C.acc_type(xdt)
    LOADW = stage_fns(xdt, ACC.name, vec)[2] if staged else C.word_fns(xdt, ACC.name, vec)[0]
    TPR, V, LOOP = tpr, vec, loop
    WPT = vpt // vec

    @cuda.jit(device=True)
    def deviation_sums(
        src,      # (NW,) words of the row (x, or s when fused; its shared copy when staged), re-read on the loop path
        xs,       # (VPT,) this thread's elements (registers path; one word's on the loop path)
        live,     # bool: the row exists
        t,        # int: thread within the row group
        NW,       # int: words per row
        mu,       # scalar: the mean the deviations are taken from
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
                        if keep:
                            xs[k * V + v] = d
                        dsum += d
                        sq += d * d
        return dsum, sq

    return deviation_sums


@functools.lru_cache(maxsize=None)
def rstd_fn(acc_name):
    """``rstd(corr, sq, inv_n, eps)``: 1 / sqrt(var + eps) of the deviations whose sum over
    n is corr * n and whose squares' sum is ``sq`` (var = mean(d^2) - corr^2)."""
    RSTD = _rstd_fn(acc_name)

    @cuda.jit(device=True)
    def rstd(corr, sq, inv_n, eps):
        return RSTD(sq * inv_n - corr * corr, eps)

    return rstd


@functools.lru_cache(maxsize=None)
def deviations_fn(xdt, tpr, vpt, vec, loop, staged=False):
    """``deviations(src, xs, live, t, NW, mu, inv_n, eps, scratch, buf, tid)`` -> ``(corr,
    rstd)``: a pass over the row's deviations from ``mu`` (``deviation_sums_fn``) and a
    group reduction: their mean ``corr`` corrects mu's rounding (the mean is mu + corr),
    and the variance about it gives rstd."""
    ACC = C.acc_type(xdt)
    SUMS = deviation_sums_fn(xdt, tpr, vpt, vec, loop, staged)
    RSTD = rstd_fn(ACC.name)
    TPR = tpr

    @cuda.jit(device=True)
    def deviations(src, xs, live, t, NW, mu, inv_n, eps, scratch, buf, tid):  # (deviation_sums', and the reduction's)
        dsum, sq = SUMS(src, xs, live, t, NW, mu)
        dsum, sq = group_sum2(dsum, sq, scratch, buf, tid, TPR)
        corr = dsum * inv_n
        return corr, RSTD(corr, sq, inv_n, eps)

    return deviations


@functools.lru_cache(maxsize=None)
def vote_fn(tpr, groups):
    """``vote(bad)``: whether any row of the threads that share a barrier (row groups wider
    than a warp, ``groups`` of them a block) or a shuffle (narrower ones) is ``bad``, for a
    branch whose group reductions all of them must meet (``shift_fns``, ``rescue_fns``)."""
    BLOCKWIDE = tpr > WARP

    @cuda.jit(device=True)
    def vote(bad):
        if BLOCKWIDE and groups > 1:
            return cuda.syncthreads_or(U32(bad)) != 0
        # the branch's shuffles meet the warp (its rows, where groups are narrower); the
        # vote also shows ptxas (and the SASS model) a branch uniform across the warp
        return cuda.any_sync(_FULL_MASK, bad)

    return vote


@functools.lru_cache(maxsize=None)
def shift_fns(xdt, tpr, vpt, vec, loop, staged=False, *, groups):
    """``(settle, vote, fallback)``: LayerNorm's statistics from the shifted sums of a row
    (``row_sums``/``held_sums_fn``: of d = x - k and d^2, ``k`` from ``first``), reduced:
    m1 = mean(d), ms = mean(d^2), mean = k + m1 split as mu = k, corr = m1, var = ms - m1^2.
    That is exact enough where m1^2 <= ms / 2 (k within about a std of the mean: the
    subtraction loses at most a bit, as the CPU's ``one_pass_ok``); other rows (an outlier
    first word, NaN, Inf) take a ``deviations`` pass from mu = k + m1, the corrected two-pass.

    ``settle(k, m1, ms, live, eps, st, at)`` -> ``bad``: mu, corr, rstd into st[at:at + 3];
    ``vote(bad)``: whether any row of the threads that share a barrier (groups wider than
    a warp) or a shuffle (narrower ones) is bad -- the fallback's reduction meets all of
    them, so all take it or none.  Where the block is one row group (``groups``, the row
    groups of a block, is 1) every thread holds the same bits of the same rows' sums
    (``reduce``), so ``bad`` is already the block's: a warp's vote, no second barrier a
    row group.  ``fallback(src, xs, live, t, NW, k, m1, bad, inv_n, eps,
    scratch, it, tid, st, at)`` -> ``it``: the deviations pass, whose statistics replace
    st[at:at + 3] for a bad row (``it``: the group reductions so far, counted on)."""
    ACC = C.acc_type(xdt)
    DEVIATIONS = deviations_fn(xdt, tpr, vpt, vec, loop, staged)
    RSTD = _rstd_fn(ACC.name)
    HALF, INF = ACC(0.5), ACC(math.inf)

    @cuda.jit(device=True)
    def settle(k, m1, ms, live, eps, st, at):
        st[at] = k
        st[at + 1] = m1
        st[at + 2] = RSTD(ms - m1 * m1, eps)
        return live and not (m1 * m1 <= HALF * ms and ms < INF)   # (NaN compares false)

    @cuda.jit(device=True)
    def fallback(
        src,      # (NW,) words of the row (x, or s when fused; its shared copy when staged), re-read on the loop path
        xs,       # (VPT,) this thread's elements (registers path)
        live,     # bool: the row exists
        t,        # int: thread within the row group
        NW,       # int: words per row
        k,        # scalar: the shift
        m1,       # scalar: the mean of x - k
        bad,      # bool: this row takes the deviations' statistics
        inv_n,    # scalar: 1 / elements per row, accumulation dtype
        eps,      # scalar, accumulation dtype
        scratch,  # (2, >= 2, slots) shared memory of the group sums
        it,       # int: group reductions so far (the scratch buffer alternates)
        tid,      # int: thread within the block
        st,       # (>= at + 3,) mu, corr, rstd of the row (``settle``'s)
        at,       # int: where
    ):
        corr, r = DEVIATIONS(src, xs, live, t, NW, k + m1, inv_n, eps, scratch, it & 1, tid)
        if bad:
            st[at] = k + m1
            st[at + 1] = corr
            st[at + 2] = r
        return it + 1

    return settle, vote_fn(tpr, groups), fallback


@functools.lru_cache(maxsize=None)
def shifted_fn(xdt, tpr, vpt, vec, loop, staged=False):
    """``shifted(src, xs, live, t, NW, k, s1, s2, inv_n, eps, scratch, it, tid)`` -> ``(mu,
    corr, rstd, it)``: one row's statistics (``shift_fns``) from this thread's shifted
    sums, in one group reduction (a second one for rows the fallback takes)."""
    ACC = C.acc_type(xdt)
    SETTLE, VOTE, FALLBACK = shift_fns(xdt, tpr, vpt, vec, loop, staged, groups=1)  # (a long row: its block's)
    TPR = tpr

    @cuda.jit(device=True)
    def shifted(src, xs, live, t, NW, k, s1, s2, inv_n, eps, scratch, it, tid):  # (fallback's, and the sums)
        m1, ms = group_sum2(s1, s2, scratch, it & 1, tid, TPR)
        it += 1
        st = cuda.local.array(3, ACC)
        bad = SETTLE(k, m1 * inv_n, ms * inv_n, live, eps, st, 0)
        if VOTE(bad):
            it = FALLBACK(src, xs, live, t, NW, k, m1 * inv_n, bad, inv_n, eps, scratch, it, tid, st, 0)
        return st[0], st[1], st[2], it

    return shifted


# A row whose statistics leave the accumulation dtype's range (API.md: every finite input
# gives a finite, correct output): (RMAX, DOWN, UP).  rstd above RMAX is var + eps below
# 2^-102 (float32; 2^-970 float64), where the squared deviations have lost bits to
# underflow; such a row is summed again scaled UP.  rstd 0 or NaN from finite input is a
# sum that overflowed; scaled DOWN, deviations stay under 2^47 (2^495), their squares'
# sum under the largest float for rows of up to 2^31 elements.
_RANGE = {"float32": (2.0 ** 51, 2.0 ** -82, 2.0 ** 100), "float64": (2.0 ** 485, 2.0 ** -530, 2.0 ** 600)}


def can_leave_range(xdt):
    """Whether a row of ``xdt`` can leave its accumulation dtype's range: not float16's,
    whose squares (at most 65504^2) summed over 2^31 elements stay under float32's largest
    value and whose smallest are float32 normals; the kernels of float16 rows carry no
    rescue (``rescue_fns``)."""
    return np.dtype(xdt) != C.F16


@functools.lru_cache(maxsize=None)
def rescue_fns(xdt, tpr, vec, staged=False, *, squares):
    """``(out_of_range, rescue, recheck)``, for the rows whose sums left the range
    (``_RANGE``; the CPU's counterpart is ``cpu/_kernels/rescale``).

    ``out_of_range(r, live)`` -> a uint32 code: 0 where rstd ``r`` of a live row is in
    range, 1 where it is 0 or NaN (the sums overflowed; Inf or NaN input too, which stays
    NaN through the rescue), 2 where it is above RMAX (they underflowed); 3, a caller's
    own (GroupNorm: its factor per channel underflowed), is a row redone at scale 1.
    ``rescue(src, out, t, NW, inv_n, eps, scratch, it, tid)`` -> ``(mu, corr, rs, rstd, s,
    it)``: the statistics of the row x * s, for s a power of two (DOWN or UP, by the code
    ``out``; 0: a row that sums nothing, whose thread meets the reductions all the same):
    LayerNorm's corrected two-pass (two group reductions, so that the scratch buffers
    keep alternating), mean(x * s) = mu + corr; RMSNorm's (``squares``) in one, mu = corr
    = 0.  rs = 1 / sqrt(var(x * s) + eps * s^2) = rstd / s, so the row's own mean is (mu +
    corr) / s, its rstd ``rstd``, and y = ((x * s - mu) - corr) * rs: the caller
    normalizes the scaled row, where (x - mean) * rstd may leave the range.
    ``recheck(src, live, t, NW, inv_n, eps, scratch, it, tid)`` -> ``(code, rstd, it)``: the
    code of a row's rstd taken again from memory (plainly: RMSNorm's, or LayerNorm's
    corrected two-pass), for a pass over rows whose codes were not kept.
    The words are read as the loop path reads them (``src``: the row in global memory,
    or its shared copy, ``staged``; this thread's words t, t + tpr, ...): by then the
    registers hold other things, and the rescue is rare."""
    ACC = C.acc_type(xdt)
    RMAX, DOWN, UP = _RANGE[ACC.name]
    LOADW = stage_fns(xdt, ACC.name, vec)[2] if staged else C.word_fns(xdt, ACC.name, vec)[0]
    RSTD = _rstd_fn(ACC.name)
    TPR, V = tpr, vec

    @cuda.jit(device=True)
    def out_of_range(r, live):
        if not live or (r > ACC(0) and r <= ACC(RMAX)):
            return U32(0)
        return U32(2) if r > ACC(RMAX) else U32(1)

    @cuda.jit(device=True)
    def scaled_sums(src, live, t, NW, s, mu):
        # this thread's sums of d = x * s - mu and d^2
        a = ACC(0)
        b = ACC(0)
        buf = cuda.local.array(V, ACC)
        if live:
            for q in range(t, NW, TPR):
                LOADW(src, q, buf, 0)
                for v in range(V):
                    d = buf[v] * s - mu
                    a += d
                    b += d * d
        return a, b

    @cuda.jit(device=True)
    def two_pass(src, live, t, NW, s, inv_n, scratch, it, tid):  # (rescue's) -> (mu, corr, var, it)
        # the statistics of the row x * s: RMSNorm's mean square in one group reduction,
        # LayerNorm's corrected two-pass in two (the scratch buffers keep alternating)
        if squares:
            var = group_sum(scaled_sums(src, live, t, NW, s, ACC(0))[1], scratch, it & 1, tid, TPR) * inv_n
            return ACC(0), ACC(0), var, it + 1
        m = group_sum(scaled_sums(src, live, t, NW, s, ACC(0))[0], scratch, it & 1, tid, TPR) * inv_n
        dsum, sq = scaled_sums(src, live, t, NW, s, m)
        dsum, sq = group_sum2(dsum, sq, scratch, (it + 1) & 1, tid, TPR)
        corr = dsum * inv_n
        return m, corr, sq * inv_n - corr * corr, it + 2

    @cuda.jit(device=True)
    def rescue(
        src,      # (NW,) words of the row (x, or s when fused; its shared copy when staged)
        out,      # uint32: ``out_of_range``'s code for the row
        t,        # int: thread within the row group
        NW,       # int: words per row
        inv_n,    # scalar: 1 / elements per row
        eps,      # scalar, accumulation dtype
        scratch,  # (2, >= 2, slots) shared memory of the group sums
        it,       # int: group reductions so far (the scratch buffer alternates)
        tid,      # int: thread within the block
    ):
        s = ACC(UP) if out == U32(2) else ACC(1) if out == U32(3) else ACC(DOWN)
        m, corr, var, it = two_pass(src, out != U32(0), t, NW, s, inv_n, scratch, it, tid)
        rs = RSTD(var, eps * s * s)
        rstd = rs * s
        # scaled down, eps * s^2 underflows: where var is in range, rstd from it and eps (a
        # constant row of huge values: 1 / sqrt(eps), not Inf)
        unscaled = var / s / s
        if s < ACC(1) and unscaled < ACC(math.inf):
            rstd = RSTD(unscaled, eps)
            rs = rstd / s
        return m, corr, rs, rstd, s, it

    @cuda.jit(device=True)
    def recheck(src, live, t, NW, inv_n, eps, scratch, it, tid):  # (rescue's) -> (code, rstd, it)
        # for a pass over rows whose codes were not kept
        var, it = two_pass(src, live, t, NW, ACC(1), inv_n, scratch, it, tid)[2:]
        r = RSTD(var, eps)
        return out_of_range(r, live), r, it

    return out_of_range, rescue, recheck


# A backward row (or group) whose sums left the range: (DOWN, LIM): wdy = weight * dy is
# summed scaled by DOWN where the sum of its magnitudes passes LIM, which leaves the sums of
# wdy and of xhat * wdy (|xhat| <= sqrt(N) <= 2^16) and each element's dx in range
# (``row_norm._grad_redo_fn``, ``group_norm._grad_redo_fn``).
GRAD_RANGE = {"float32": (2.0 ** -82, 2.0 ** 100), "float64": (2.0 ** -530, 2.0 ** 1000)}


@functools.lru_cache(maxsize=None)
def grad_redo_consts(xdt, wdt, acc_name, vec):
    """``(LW, LOADW, STOREW, DOWN, UP, LIM, dev)``, what a backward's redo of a row or a group
    (``row_norm._grad_redo_fn``, ``group_norm._grad_redo_fn``) builds on: the weight's loader
    (x's dtype's without a weight), the loader and storer of ``vec``-element words, GRAD_RANGE's
    scale DOWN (a Python float), its inverse UP (the accumulation dtype's), its limit LIM, and
    ``grad_deviation_fn``'s ``dev``."""
    DOWN, LIM = GRAD_RANGE[acc_name]
    LOADW, STOREW = C.word_fns(xdt, acc_name, vec)
    return (C.load_fn(xdt if wdt is None else wdt, acc_name), LOADW, STOREW, DOWN,
            getattr(cuda, acc_name)(1 / DOWN), LIM, grad_deviation_fn(acc_name))


@functools.lru_cache(maxsize=None)
def grad_factors_fn(acc_name):
    """``factors(r)`` -> ``(f, rf)``, ``f * rf = r``: a backward writes dx as ``(wdy * f -
    (xhat * c1 + c2) * f) * rf`` (c1, c2 taken times f once a row), so that no term leaves
    the range where dx is in it, given sums in range (``grad_noted_fn``'s; the CPU's
    ``stats.row_factors``): r > 1, the difference first (f = 1: wdy * r could overflow);
    else each term times r first (f = r: wdy near the largest value less a term of the
    other sign could).  A row taken as rstd 0 keeps its mark (0 times a non-finite c1 or c2)."""
    ACC = getattr(cuda, acc_name)

    @cuda.jit(device=True)
    def factors(r):
        if r > ACC(1):
            return ACC(1), r
        return r, ACC(1)

    return factors


@functools.lru_cache(maxsize=None)
def weight_factors_fn(acc_name):
    """``weight_factors(wc, f)`` -> ``(p, q)``: GroupNorm's dx takes ``wdy * f`` as ``(dy * p) *
    q`` (the CPU's ``stats.weight_factors``).  ``(wc * f, 1)`` (dy * weight may overflow where
    dy * (weight * f) does not), but ``(wc, f)`` where wc * f left the normal range below and
    0 < |wc| <= 1: a tiny weight times f underflows where weight * dy times f does not, and
    dy * wc cannot overflow (a subnormal f with a larger weight keeps the product)."""
    ACC = getattr(cuda, acc_name)
    TINY = float(np.finfo(np.dtype(acc_name)).tiny)

    @cuda.jit(device=True)
    def weight_factors(wc, f):
        wf = wc * f
        if abs(wf) < ACC(TINY) and wc != ACC(0) and abs(wc) <= ACC(1):
            return wc, f
        return wf, ACC(1)

    return weight_factors


@functools.lru_cache(maxsize=None)
def grad_noted_fn(xdt):
    """``noted(c1, c2)``: a backward row's reduced c1, c2 (c1 = mean(xhat * wdy), c2 =
    mean(wdy)) are not both finite: its sums left the range, or it holds Inf or NaN; False
    for rows that cannot leave it (``can_leave_range``).  Uniform across the row group.
    The pass that writes dx of such a row with mean and rstd taken as 0 adds nothing to
    dweight and writes NaN into every element of dx (0 * c1, or 0 times a bracket holding
    c2), which a pass after the rows reads back as the mark of a row to redo."""
    RESCUED, INF = can_leave_range(xdt), C.acc_type(xdt)(math.inf)

    @cuda.jit(device=True)
    def noted(c1, c2):
        return RESCUED and not (abs(c1) < INF and abs(c2) < INF)  # (NaN compares false)

    return noted


@functools.lru_cache(maxsize=None)
def grad_deviation_fn(acc_name):
    """``dev(x, mu, r)``: (x - mu) * r, from x / 2 - mu / 2 and 2 r where x - mu overflows
    (the rows the backward redoes; r is then tiny, the product in range)."""
    ACC = getattr(cuda, acc_name)
    HALF, INF = ACC(0.5), ACC(math.inf)

    @cuda.jit(device=True)
    def dev(x, mu, r):
        h = x - mu
        return h * r if abs(h) < INF else (x * HALF - mu * HALF) * (r + r)

    return dev
