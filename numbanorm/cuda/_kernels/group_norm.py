"""GroupNorm (and InstanceNorm, one channel per group) on the GPU.

x is seen as (N, C, S) with S the product of the spatial dimensions and the C
channels split into G groups of Cg = C/G channels.  A group's L = Cg*S elements
are contiguous, so the forward treats each (sample, group) as a row of length L,
maps it onto a thread group exactly like ``layer_norm`` (``common``) and takes
its statistics with LayerNorm's own device functions (``stats``): the
group in registers when it fits (several groups' words loaded at once, as
``row_norm`` does; each thread's words lie in one channel each, whose weight and bias
it loads once per group), a loop (per channel, so no division per element) when it
does not -- in typical convolutional nets L is tens of thousands and one block works
on each group, which is copied to shared memory as it is first read where it fits,
so that its y pass does not read global memory again.

    mean, rstd over x[n, g*Cg:(g+1)*Cg, :]      (held: the corrected two-pass over
                                                 registers; loop: sums shifted by the
                                                 mean of the group's first word, the
                                                 two-pass where they cannot serve, as
                                                 ``row_norm``'s long rows; a group whose
                                                 statistics leave the range again on
                                                 the group scaled, ``stats.rescue_fns``)
    y[n, c, :] = ((x[n, c, :] - mean) - corr) * (rstd * weight[c]) + bias[c]

never ``x * a + (bias - mean * a)``: folding the mean into the offset cancels
catastrophically when |mean| >> std.  Where rstd * weight[c] underflows (tiny weights,
a wide group) or overflows (huge weights, a narrow group), the group is redone with the
two factors in turn (``_fold_fns``).

Backward, in three kernels (the dx of a group needs sums over all its channels):

1. per (n, c) row of S elements: A = sum(dy * (x - mean) * rstd), B = sum(dy) and
   D = sum((x - mean) * rstd) (in rstd's units, each deviation before it is summed: a
   group's sums are summed over its channels, a huge row's would overflow and a tiny
   one's products with dy underflow; a row whose sum of dy overflowed is summed again
   with dy scaled down, ``stats.rescue_fns``' counterpart);
2. per (n, c) row, from its group's Cg rows of sums (one 3-value reduction):
   cr = sum(D) / L = corr * rstd corrects the saved float32 mean's rounding (as in
   ``layer_norm``), dyx = A - cr * B = sum(dy * xhat) is this row's
   dweight partial, c1 = sum(weight * dyx) / L, c2 = sum(weight * B) / L, and
   dx = (weight * dy - (xhat * c1 + c2)) * rstd with xhat = ((x - mean) - corr) * rstd,
   evaluated as (weight * dy - ((x - mean) * rstd * c1 + (c2 - cr * c1))) * rstd;
3. dweight/dbias = the fixed-order column sums of dyx/B over the samples.

A group whose reduced sums in kernel 2 are not finite, its elements finite (x - mean
itself overflowing, or the sums of weight * dy), is noted there and its rows redone after
the block's rows, from memory, x - mean halved and weight * dy scaled by a power of two
(``_grad_post_fn``, ``_grad_redo_fn``; ``row_norm``'s backward does the same).

x and dy are read twice (kernels 1 and 2): five passes over memory where three
would do if a whole group fitted on chip -- a fused version is future work.  A
(sample, channel) row of up to 8192 elements is held in registers: each thread loads
all its words of x and dy before it uses any.
"""

import functools
import math

import numpy as np
from numba import cuda

from . import common as C
from . import stats
from .reduce import _FULL_MASK, group_sum, group_sum3, group_sums_fn, slots


def _consts(xdt, code):
    ACC = C.acc_type(xdt)
    return ACC, C.u64_per_word(xdt, code.vec), code.vpt // code.vec, code.tpr.bit_length() - 1


def _tag(kern, code, rows, loads, weights_loop=False):
    """``kern`` with what ``benchmarks.gpu_model`` checks its SASS against (``row_norm._tag``);
    ``weights_loop``: the kernel's first loop, before its rows, goes over the weights
    (argument 1: ``_weight_range_fn``), not over a row's words."""
    kern.mapping, kern.rows_in_flight, kern.loads_in_flight = code, rows, loads
    kern.weights_loop = weights_loop
    return kern


@functools.lru_cache(maxsize=None)
def _forward_kernel(xdt, wdt, bdt, code):
    """The forward kernel for x of ``xdt``, weight/bias of ``wdt``/``bdt`` (None: absent)
    and the mapping ``code`` of a (sample, group) row: held in registers, or a loop."""
    return (_forward_loop if code.loop else _forward_held)(xdt, wdt, bdt, code)


@functools.lru_cache(maxsize=None)
def _fold_fns(acc):
    """``(lost, factors)`` for the per-channel factor a = rstd * weight, which leaves the
    normal range where y itself need not: below the smallest normal number (a group of
    standard deviation 1e15, a float32 weight near 2**-120) or past the largest (1e-15 and
    1e24); ``acc``: the accumulation dtype's name.  ``lost(r, rlim)``: a group of rstd
    ``r`` may have such a channel (``rlim``: ``(lo, lim)``, the rstd under which and, in
    ``lim[0]``, over which one may, ``_weight_range_fn``) -- uniform where ``r`` is, so
    such a group takes the rescue (code 3: at scale 1), whose redo takes each channel's
    ``factors(r, wv)``: ``(r * wv, 1)``, or ``(r, wv)``, the two in turn, where that
    product left the range and the weight ``wv`` is not 0."""
    ACC = getattr(cuda, acc)
    TINY, HUGE = float(np.finfo(np.dtype(acc)).tiny), float(np.finfo(np.dtype(acc)).max)

    @cuda.jit(device=True)
    def lost(r, rlim):
        return r < rlim[0] or r > rlim[1][0]

    @cuda.jit(device=True)
    def factors(r, wv):
        a = r * wv
        if wv != ACC(0) and (abs(a) < ACC(TINY) or abs(a) > ACC(HUGE)):
            return r, wv
        return a, ACC(1)

    return lost, factors


@functools.lru_cache(maxsize=None)
def _weight_range_fn(xdt, wdt, block):
    """``bounds(w, scratch, lim, tid)``: ``(lo, lim)``, the rstd under which a channel's rstd
    * weight may underflow, the smallest normal number over the least nonzero |weight| (0:
    none), and ``lim`` (a shared array of one) holding the rstd over which it may overflow,
    the largest finite number over the greatest |weight| (inf: none) (``_fold_fns``); the
    same bits in every thread of a block of ``block`` threads, once a kernel.  (``hi`` in a
    register beside ``lo`` moved float32 row loads after the first wait: the GPU design log.)"""
    ACC = C.acc_type(xdt)
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    WARPS = max(1, block // 32)
    TINY, HUGE = float(np.finfo(np.dtype(ACC.name)).tiny), float(np.finfo(np.dtype(ACC.name)).max)

    @cuda.jit(device=True)
    def bounds(w, scratch, lim, tid):
        m, g = ACC(math.inf), ACC(0)
        for c in range(tid, w.shape[0], block):
            v = abs(LW(w[c]))
            g = max(g, v)
            if v != ACC(0):
                m = min(m, v)
        off = _U32(16)
        while off > _U32(0):
            m = min(m, cuda.shfl_xor_sync(_FULL_MASK, m, off))
            g = max(g, cuda.shfl_xor_sync(_FULL_MASK, g, off))
            off >>= _U32(1)
        if WARPS > 1:
            if tid & 31 == 0:
                scratch[0, 0, tid >> 5] = m
                scratch[0, 1, tid >> 5] = g
            cuda.syncthreads()
            # each thread reads every warp's partial: reduce.py's second butterfly here moved
            # float32 row loads after the first wait (the GPU design log)
            for k in range(WARPS):
                m = min(m, scratch[0, 0, k])
                g = max(g, scratch[0, 1, k])
        if tid == 0:
            lim[0] = ACC(HUGE) / g if g > ACC(0) else ACC(math.inf)
        cuda.syncthreads()  # (lim read by every thread; the rows' first reduction writes scratch)
        return ACC(TINY) / m, lim

    return bounds


@functools.lru_cache(maxsize=None)
def _word_fn(xdt, code, staged=False):
    """``word(src, yr, q, a, wa, bc, mu, corr, sc)``: y of word ``q`` of a group, ((x * sc -
    mu) - corr) * a * wa + bc, read from ``src`` (x, or its shared copy, ``staged``); ``a``
    = rstd * weight and ``wa`` = 1, or ``a`` = rstd and ``wa`` = weight where that product
    leaves the range (``_fold_fns``), and ``bc`` = bias of the word's channel (``sc``: 1, or the
    scale of a group redone, ``_rescue_fn``; x * 1 is x, and the compiler knows it)."""
    ACC, V = C.acc_type(xdt), code.vec
    STOREW = C.word_fns(xdt, ACC.name, V)[1]
    READW = stats.stage_fns(xdt, ACC.name, V)[2] if staged else C.word_fns(xdt, ACC.name, V)[0]

    @cuda.jit(device=True)
    def word(src, yr, q, a, wa, bc, mu, corr, sc):
        xs = cuda.local.array(V, ACC)
        tmp = cuda.local.array(V, ACC)
        READW(src, q, xs, 0)
        for v in range(V):
            tmp[v] = ((xs[v] * sc - mu) - corr) * a * wa + bc
        STOREW(yr, q, tmp, 0)

    return word


@functools.lru_cache(maxsize=None)
def _rescue_fn(xdt, code, staged=False):
    """``rescue(src, mean, rstd, row, out, t, NW, inv_n, eps, scratch, it, tid)`` -> ``(mu, corr,
    rstd_s, sc, it)``: a group whose statistics left the range (``out``: its
    ``stats.rescue_fns`` code), after the vote: its statistics again on the group scaled
    by a power of two ``sc``, stored as its own; the caller writes y again as the scaled
    group normalizes (``_word_fn``, each word by the thread that wrote it).  Every thread
    that voted calls it (its reductions); a group not ``out`` sums and stores nothing."""
    RESCUE = stats.rescue_fns(xdt, code.tpr, code.vec, staged, squares=False)[1]

    @cuda.jit(device=True)
    def rescue(src, mean, rstd, row, out, t, NW, inv_n, eps, scratch, it, tid):
        mu, corr, rs, own_rstd, sc, it = RESCUE(src, out, t, NW, inv_n, eps, scratch, it, tid)
        if out != 0 and t == 0 and row < rstd.shape[0]:
            mean[row] = (mu + corr) / sc
            rstd[row] = own_rstd
        return mu, corr, rs, sc, it

    return rescue


@functools.lru_cache(maxsize=None)
def _post_fn(xdt, wdt, bdt, code):
    """``post(x, w, b, y, mean, rstd, row, chw, Cg, G, eps, scratch, it, tid)`` -> ``it``: the
    registers path's pass after its groups, in a block where one left the range: ``row``'s
    code from the rstd the group pass stored, or where none is kept from its statistics
    again from memory (``stats.rescue_fns``' ``recheck``), and where it is out of range the
    group redone (``_rescue_fn``), each of this thread's words t + k * tpr (channel
    ``chw[k]``) written (kept, the group pass left them unwritten: x may be y, in place;
    ``row_norm._post_fn``); every thread of the block calls it for each of its row group's
    rows, one at a time."""
    ACC, _, WPT, _ = _consts(xdt, code)
    TPR = code.tpr
    has_w, has_b = wdt is not None, bdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    LB = C.load_fn(xdt if bdt is None else bdt, ACC.name)
    OUT, _, RECHECK = stats.rescue_fns(xdt, TPR, code.vec, squares=False)
    RESCUE = _rescue_fn(xdt, code)
    WORD = _word_fn(xdt, code)
    LOST, FACTORS = _fold_fns(ACC.name)
    GEOMETRY = stats.geometry_fn(xdt, code)

    @cuda.jit(device=True)
    def post(x, w, b, y, mean, rstd, row, chw, Cg, G, eps, rlim, scratch, it, tid):  # (the kernel's)
        M, NW, t, inv_n = GEOMETRY(x, tid)
        u = min(row, M - 1)
        out, r, it = RECHECK(x[u], row < M, t, NW, inv_n, eps, scratch, it, tid)
        if rstd.shape[0] != 0:  # (kept: that code stands, as ``row_norm._post_fn``'s)
            r = rstd[u]
            out = OUT(r, row < M)
        if has_w and out == 0 and row < M and LOST(r, rlim):
            out = _U32(3)
        c0 = (u % G) * Cg
        mu, corr, rs, sc, it = RESCUE(x[u], mean, rstd, u, out, t, NW, inv_n, eps, scratch, it, tid)
        if out != 0:
            for k in range(WPT):
                if t + k * TPR < NW:
                    a, wa = FACTORS(rs, LW(w[c0 + chw[k]])) if has_w else (rs, ACC(1))
                    bc = LB(b[c0 + chw[k]]) if has_b else ACC(0)
                    WORD(x[u], y[u], t + k * TPR, a, wa, bc, mu, corr, sc)
        return it

    return post


@functools.lru_cache(maxsize=None)
def _group_rows_fn(xdt, wdt, bdt, code, rows):
    """``group_rows(x, w, b, y, mean, rstd, row, step, raw0, raw1, raw2, chw, Cg, grp, eps, rlim,
    scratch, tid)`` -> ``bad`` (a group to redo, ``_post_fn``): ``rows`` (1-3) (sample, group)
    rows ``row, row + step, ...`` (``grp``: their groups
    within the sample, a (rows,) local array) of a row group held
    in registers, from their fetched words: the corrected two-pass statistics of all of
    them in two group reductions (the sums, then the deviations from their means), then
    each row's y and statistics stored.  Each thread's words lie in one channel each
    (``chw``), whose weight and bias it loads once per row and word."""
    GEOMETRY = stats.geometry_fn(xdt, code)
    ACC, _, WPT, _ = _consts(xdt, code)
    TPR, VPT, V = code.tpr, code.vpt, code.vec
    VPT1, VPT2, NV, NW2 = (VPT if rows > 1 else 1), (VPT if rows > 2 else 1), rows, 2 * rows
    has_w, has_b = wdt is not None, bdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    LB = C.load_fn(xdt if bdt is None else bdt, ACC.name)
    STOREW = C.word_fns(xdt, ACC.name, V)[1]
    SUMS = stats.held_sums_fn(xdt, TPR, VPT, V, False, False)
    DEVIATIONS = stats.deviation_sums_fn(xdt, TPR, VPT, V, False, keep=True)  # xs: x - mean
    RSTD = stats.rstd_fn(ACC.name)
    MEANS, SPREADS = group_sums_fn(NV), group_sums_fn(NW2)
    OUT = stats.rescue_fns(xdt, TPR, V, squares=False)[0]
    RESCUED = stats.can_leave_range(xdt)
    LOST = _fold_fns(ACC.name)[0]

    @cuda.jit(device=True)
    def finish(y, w, b, mean, rstd, row, ds, grp, chw, Cg, mu, corr, r, t, NW, rlim):  # -> it is redone
        if row < y.shape[0]:
            kept = row < rstd.shape[0]  # (a plain call's statistics: unkept, (0,), none stored)
            if t == 0 and kept:
                mean[row] = mu + corr
                rstd[row] = r
            # out of range, or a channel's rstd * weight may leave the range (``_fold_fns``)
            bad = RESCUED and (OUT(r, True) != 0 or has_w and LOST(r, rlim))
            skip = bad and kept  # (kept, such a group is written by ``_post_fn`` alone: x may be y)
            tmp = cuda.local.array(V, ACC)
            c0 = grp * Cg                 # the group's first channel
            for k in range(WPT):
                q = t + k * TPR
                if q < NW:
                    # each word lies in one channel: its weight and bias, once
                    a = r * LW(w[c0 + chw[k]]) if has_w else r
                    bc = LB(b[c0 + chw[k]]) if has_b else ACC(0)
                    for v in range(V):
                        tmp[v] = (ds[k * V + v] - corr) * a + bc  # ((x - mu) - corr) * a + b
                    if not skip:
                        STOREW(y[row], q, tmp, 0)
            return bad
        return False

    @cuda.jit(device=True)
    def group_rows(x, w, b, y, mean, rstd, row, step, raw0, raw1, raw2, chw, Cg, grp, eps, rlim, scratch,
                   tid):  # (the kernel's)
        M, NW, t, inv_n = GEOMETRY(x, tid)
        v = cuda.local.array(NW2, ACC)              # each row's sums, then its deviations' sums
        xs0 = cuda.local.array(VPT, ACC)            # each row's elements
        xs1 = cuda.local.array(VPT1, ACC)
        xs2 = cuda.local.array(VPT2, ACC)
        tmp = cuda.local.array(V, ACC)
        v[0] = SUMS(raw0, xs0, tmp, row < M, t, NW, ACC(0))[0]
        if rows > 1:
            v[1] = SUMS(raw1, xs1, tmp, row + step < M, t, NW, ACC(0))[0]
        if rows > 2:
            v[2] = SUMS(raw2, xs2, tmp, row + 2 * step < M, t, NW, ACC(0))[0]
        MEANS(v, scratch, 0, tid, TPR)
        m0 = v[0] * inv_n
        m1 = v[1] * inv_n if rows > 1 else ACC(0)
        m2 = v[2] * inv_n if rows > 2 else ACC(0)
        # pass 2: the deviations from each mean; their sum corrects the mean's rounding
        v[0], v[1] = DEVIATIONS(x[0], xs0, row < M, t, NW, m0)
        if rows > 1:
            v[2], v[3] = DEVIATIONS(x[0], xs1, row + step < M, t, NW, m1)
        if rows > 2:
            v[4], v[5] = DEVIATIONS(x[0], xs2, row + 2 * step < M, t, NW, m2)
        SPREADS(v, scratch, 1, tid, TPR)
        # groups whose statistics left the range: the kernel redoes them after its rows
        # (``_post_fn``), from memory
        bad = finish(y, w, b, mean, rstd, row, xs0, grp[0], chw, Cg, m0, v[0] * inv_n,
                     RSTD(v[0] * inv_n, v[1], inv_n, eps), t, NW, rlim)
        if rows > 1:
            bad |= finish(y, w, b, mean, rstd, row + step, xs1, grp[1], chw, Cg, m1, v[2] * inv_n,
                          RSTD(v[2] * inv_n, v[3], inv_n, eps), t, NW, rlim)
        if rows > 2:
            bad |= finish(y, w, b, mean, rstd, row + 2 * step, xs2, grp[2], chw, Cg, m2, v[4] * inv_n,
                          RSTD(v[4] * inv_n, v[5], inv_n, eps), t, NW, rlim)
        return bad

    return group_rows


def _forward_held(xdt, wdt, bdt, code):
    ACC, KW, WPT, SHIFT = _consts(xdt, code)
    TPR, V, R, BLOCK = code.tpr, code.vec, code.rows, code.block
    SLOTS = slots(BLOCK)
    RAW, RAWN, D = stats.raw_rows(xdt, code, 1)
    NSUMS = max(2, 2 * D)  # values a group reduction sums at once
    RAWN1, RAWN2 = (RAWN if D > 1 else 1), (RAWN if D > 2 else 1)
    I32, U32 = cuda.int32, cuda.uint32
    FETCH = stats.fetch_rows_fn(xdt, code, 1, D)
    ROWS = _group_rows_fn(xdt, wdt, bdt, code, D)
    POST = _post_fn(xdt, wdt, bdt, code)
    RESCUED = stats.can_leave_range(xdt)
    FOLDS = RESCUED and wdt is not None  # (float16: rstd * weight stays a float32 normal)
    BOUNDS = _weight_range_fn(xdt, wdt, BLOCK)

    @C.kernel_jit(BLOCK, C.ROW_RESIDENT)  # the row mapping's 16 elements per thread
    def forward(
        x,      # (N*G, LW) input, one row of LW words of V elements per (sample, group)
        w,      # (C,) per-channel weight, or a dummy
        b,      # (C,) per-channel bias, or a dummy
        eps,    # scalar, accumulation dtype
        S,      # int: elements per channel (product of the spatial dims), a multiple of V
        G,      # int: groups per sample
        y,      # (N*G, LW) output, x's dtype
        mean,   # (N*G,) per-(sample, group) mean, accumulation dtype
        rstd,   # (N*G,) per-(sample, group) 1/sqrt(var + eps), accumulation dtype; (0,): none stored
    ):
        NW = x.shape[1] // KW
        Cg = (NW * V) // S
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        scratch = cuda.shared.array((2, NSUMS, SLOTS), ACC)
        chw = cuda.local.array(WPT, I32)  # channel within the group of each of the thread's words
        for k in range(WPT):
            chw[k] = ((t + k * TPR) * V) // S
        raw0 = cuda.local.array(RAWN, RAW)   # the raw words of the D rows loaded at once
        raw1 = cuda.local.array(RAWN1, RAW)
        raw2 = cuda.local.array(RAWN2, RAW)
        step = cuda.gridDim.x * R
        # each row's group within its sample (row mod G), kept by additions: no division per row
        G32 = U32(G)
        grp = cuda.local.array(3, U32)
        grp[0] = U32(cuda.blockIdx.x * R + (tid >> SHIFT)) % G32
        by_step, by_batch = U32(step) % G32, U32(step * D) % G32
        lim = cuda.shared.array(1, ACC)
        rlim = BOUNDS(w, scratch, lim, tid) if FOLDS else (ACC(0), lim)  # (lim read only where FOLDS)
        bad = False
        for base in range(cuda.blockIdx.x * R, x.shape[0], step * D):
            row = base + (tid >> SHIFT)
            FETCH(x, x, x, row, step, raw0, raw1, raw2, t, NW)
            for d in range(1, D):
                grp[d] = grp[d - 1] + by_step
                if grp[d] >= G32:
                    grp[d] -= G32
            bad |= ROWS(x, w, b, y, mean, rstd, row, step, raw0, raw1, raw2, chw, Cg, grp, eps, rlim, scratch, tid)
            grp[0] += by_batch
            if grp[0] >= G32:
                grp[0] -= G32
        # the block's groups again where one of them left the range (``_post_fn``): rare
        if RESCUED and cuda.syncthreads_or(U32(bad)) != 0:
            it = 0  # (the last reduction's buffer was 1, SPREADS')
            for base in range(cuda.blockIdx.x * R, x.shape[0], step):
                it = POST(x, w, b, y, mean, rstd, base + (tid >> SHIFT), chw, Cg, G, eps, rlim, scratch, it, tid)

    return _tag(forward, code, D, D * code.vpt * np.dtype(xdt).itemsize, FOLDS)


@functools.lru_cache(maxsize=None)
def _group_loop_row_fn(xdt, wdt, bdt, code):
    """``row(x, w, b, y, mean, rstd, row, stage, Cg, G, eps, rlim, scratch, it, tid)`` -> ``it``:
    one long (sample, group) row: pass 1 (shifted sums; the row copied to ``stage`` where
    it fits), the statistics (a second pass only for groups the shifted sums cannot serve),
    and y per channel from the staged copy, or from global memory again; a group out of
    range, or one whose rstd * weight may leave the range (``rlim``: ``_fold_fns``), after a vote
    by its redo alone."""
    GEOMETRY = stats.geometry_fn(xdt, code)
    ACC = C.acc_type(xdt)
    TPR, V, STAGED = code.tpr, code.vec, code.stage
    has_w, has_b = wdt is not None, bdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    LB = C.load_fn(xdt if bdt is None else bdt, ACC.name)
    FIRST = stats.first_fn(xdt, V, False)
    # 16-bit: the shifted sums' registers leave ptxas two words in flight a thread; four
    ROW_SUM = stats.row_sum_fn(xdt, TPR, V, False, False, STAGED, shifted=True,
                               unroll=4 if np.dtype(xdt).itemsize == 2 else 1)
    SHIFTED = stats.shifted_fn(xdt, TPR, V, V, True, STAGED)
    OUT = stats.rescue_fns(xdt, TPR, V, STAGED, squares=False)[0]
    VOTE = stats.vote_fn(TPR, code.rows)
    RESCUE = _rescue_fn(xdt, code, STAGED)
    WORD = _word_fn(xdt, code, STAGED)
    RESCUED = stats.can_leave_range(xdt)
    LOST, FACTORS = _fold_fns(ACC.name)

    @cuda.jit(device=True)
    def channels(src, yr, w, b, c0, Cg, mu, corr, r, sc, t, NW):  # y channel by channel: no division per element
        SW = NW // Cg                 # words per channel
        for cc in range(Cg):
            a = r * LW(w[c0 + cc]) if has_w else r
            bc = LB(b[c0 + cc]) if has_b else ACC(0)
            for qs in range(t, SW, TPR):
                WORD(src, yr, cc * SW + qs, a, ACC(1), bc, mu, corr, sc)

    @cuda.jit(device=True)
    def channels_redo(src, yr, w, b, c0, Cg, mu, corr, r, sc, t, NW):  # (channels' after the rescue)
        SW = NW // Cg
        for cc in range(Cg):
            a, wa = FACTORS(r, LW(w[c0 + cc])) if has_w else (r, ACC(1))
            bc = LB(b[c0 + cc]) if has_b else ACC(0)
            for qs in range(t, SW, TPR):
                WORD(src, yr, cc * SW + qs, a, wa, bc, mu, corr, sc)

    @cuda.jit(device=True)
    def group_loop_row(x, w, b, y, mean, rstd, row, stage, Cg, G, eps, rlim, scratch, it, tid):  # (the kernel's)
        M, NW, t, inv_n = GEOMETRY(x, tid)
        live = row < M
        rr = min(row, M - 1)
        xr = x[rr]
        xs = cuda.local.array(V, ACC)
        tmp = cuda.local.array(V, ACC)
        # one pass of sums shifted by the mean of the group's first word (a second, the
        # deviations', only for a group it cannot serve: ``stats.shift_fns``)
        k = FIRST(xr, xr, tmp)
        s1, s2 = ROW_SUM(xr, xr, xr, xs, tmp, live, t, NW, stage, k)
        if STAGED:
            # the y pass reads words by channel, which other threads copied (with a warp
            # per row, no barrier of the reductions orders them)
            cuda.syncthreads()
        src = stage if STAGED else xr
        mu, corr, r, it = SHIFTED(src, xs, live, t, NW, k, s1, s2, inv_n, eps, scratch, it, tid)
        if live and t == 0 and row < rstd.shape[0]:
            mean[row] = mu + corr
            rstd[row] = r
        c0 = (rr % G) * Cg
        out = OUT(r, live)
        if RESCUED and has_w and out == 0 and live and LOST(r, rlim):
            out = _U32(3)  # (redone at scale 1, channel by channel: ``_fold_fns``)
        if live and (out == 0 or not RESCUED):  # (a group out of range is written by RESCUE's alone: x may be y)
            channels(src, y[rr], w, b, c0, Cg, mu, corr, r, ACC(1), t, NW)
        if RESCUED and VOTE(out != 0):  # (a group whose statistics left the range: ``_rescue_fn``)
            mu, corr, rs, sc, it = RESCUE(src, mean, rstd, rr, out, t, NW, inv_n, eps, scratch, it, tid)
            if out != 0:
                channels_redo(src, y[rr], w, b, c0, Cg, mu, corr, rs, sc, t, NW)
        if STAGED:
            cuda.syncthreads()  # every read of this row's copy before the next row's copy
        return it

    return group_loop_row


def _forward_loop(xdt, wdt, bdt, code):
    ACC, KW, _, SHIFT = _consts(xdt, code)
    V, R, BLOCK, STAGED = code.vec, code.rows, code.block, code.stage
    SLOTS = slots(BLOCK)
    ST, STAGE_LEN = stats.stage_type(xdt, code.vec), 0 if STAGED else 1
    ROW = _group_loop_row_fn(xdt, wdt, bdt, code)
    FOLDS = stats.can_leave_range(xdt) and wdt is not None  # (as _forward_held's)
    BOUNDS = _weight_range_fn(xdt, wdt, BLOCK)

    @C.kernel_jit(BLOCK, C.ROW_RESIDENT)
    def forward(x, w, b, eps, S, G, y, mean, rstd):  # (the arguments of _forward_held's kernel)
        Cg = ((x.shape[1] // KW) * V) // S
        tid = cuda.threadIdx.x
        scratch = cuda.shared.array((2, 2, SLOTS), ACC)
        # a long group's copy in dynamic shared memory (the launch sizes it), or one element never read
        stage = cuda.shared.array(STAGE_LEN, ST)
        lim = cuda.shared.array(1, ACC)
        rlim = BOUNDS(w, scratch, lim, tid) if FOLDS else (ACC(0), lim)  # (lim read only where FOLDS)
        it = 0
        for row0 in range(cuda.blockIdx.x * R, x.shape[0], cuda.gridDim.x * R):
            it = ROW(x, w, b, y, mean, rstd, row0 + (tid >> SHIFT), stage, Cg, G, eps, rlim, scratch, it, tid)

    return _tag(forward, code, 1, code.vec * np.dtype(xdt).itemsize, FOLDS)


# ---------------------------------------------------------------- backward

def _backward_raw(xdt, code):
    """(RAW, RAWN, D): a backward kernel's raw words of x and dy per row and the rows a
    row group loads at once (``stats.raw_rows``; none, and one row, on the loop path)."""
    RAW, RAWN, D = stats.raw_rows(xdt, code, 2)
    return (RAW, 1, 1) if code.loop else (RAW, RAWN, D)


_U32 = cuda.uint32


@cuda.jit(device=True)
def _locate(row, Cg, C_, pos, at):
    """pos[at:at + 3] = the group of (sample, channel) row ``row`` (row // Cg, its (sample,
    group) index), the row's place in it (row % Cg) and its channel (row % C_)."""
    u = _U32(row)
    pos[at] = u // _U32(Cg)
    pos[at + 1] = u % _U32(Cg)
    pos[at + 2] = u % _U32(C_)


@cuda.jit(device=True)
def _advance(pos, src, dst, by, Cg, C_):
    """pos[dst:dst + 3] = the position (``_locate``) of the row ``by`` (``_locate``'s of the
    stride) after the one at pos[src]: additions, where a division per row cost more than
    a row's arithmetic."""
    rem = pos[src + 1] + by[1]
    grp = pos[src] + by[0]
    if rem >= _U32(Cg):
        rem -= _U32(Cg)
        grp += _U32(1)
    c = pos[src + 2] + by[2]
    if c >= _U32(C_):
        c -= _U32(C_)
    pos[dst] = grp
    pos[dst + 1] = rem
    pos[dst + 2] = c


@functools.lru_cache(maxsize=None)
def _channel_row_sums_fn(xdt, code, down=False):
    """``sums(xr, dyr, raw, mu, r, sg, live, t, NW, v, at)``: this thread's sum(dy), sum(dy * (x -
    mu) * r), sum((x - mu) * r) over a (sample, channel) row into v[at:at + 3]: from its
    fetched words (registers path), or loaded word by word.  The deviations in rstd's units
    before they meet dy (with eps 0 a tiny group's dy * (x - mu) underflowed, where dx is of
    order one); ``down``: dy times ``sg`` too (unread otherwise), for a row whose sum of dy
    overflowed."""
    ACC, _, WPT, _ = _consts(xdt, code)
    TPR, V, LOOP, VPT = code.tpr, code.vec, code.loop, code.vpt
    LOADW = C.word_fns(xdt, ACC.name, V)[0]
    WIDEN = C.raw_fns(xdt, ACC.name, V)[2]

    @cuda.jit(device=True)
    def word_sums(xs, gs, e0, mu, r, sg, f, v, at):
        for e in range(e0, e0 + V):
            d = (xs[e] - mu) * r
            fg = f * gs[e] * sg if down else f * gs[e]
            v[at] += fg
            v[at + 1] += fg * d
            v[at + 2] += f * d

    @cuda.jit(device=True)
    def channel_row_sums(
        xr,     # (SW,) words of x's row (loop path), else unread
        dyr,    # (SW,) ... of dy
        raw,    # (slots,) the row's fetched words, x then dy (registers path)
        mu,     # scalar: the group's saved mean
        r,      # scalar: its saved rstd
        sg,     # scalar: dy's scale (down), else unread
        live,   # bool: the row exists
        t,      # int: thread within the row group
        NW,     # int: words per row
        v,      # (values,) output: this thread's sums, to be reduced
        at,     # int: where this row's go
    ):
        xs = cuda.local.array(VPT, ACC)
        gs = cuda.local.array(VPT, ACC)
        for i in range(3):
            v[at + i] = ACC(0)
        if LOOP:
            if live:
                for q in range(t, NW, TPR):
                    LOADW(xr, q, xs, 0)
                    LOADW(dyr, q, gs, 0)
                    word_sums(xs, gs, 0, mu, r, sg, ACC(1), v, at)
        else:
            # a word past the row (word 0 again) weighs 0, not a branch around its sums:
            # ptxas moves a load into the only branch that uses it, after the first wait
            for k in range(WPT):
                WIDEN(raw, k, xs, k * V)
                WIDEN(raw, WPT + k, gs, k * V)
                word_sums(xs, gs, k * V, mu, r, sg, ACC(1) if t + k * TPR < NW else ACC(0), v, at)

    return channel_row_sums


@functools.lru_cache(maxsize=None)
def _channel_rescue_fns(xdt, code):
    """``(overflowed, rescaled)``, kernel 1's steps after a row's sums are reduced: whether
    they left the range; out of it, summed again with dy scaled down (``rescaled(x, dy, row,
    raw, mu, r, out, t, NW, v, again, at, scratch, it, tid)`` -> ``it``)."""
    ACC = C.acc_type(xdt)
    TPR = code.tpr
    SUMS_DOWN = _channel_row_sums_fn(xdt, code, down=True)
    DOWN = stats.GRAD_RANGE[ACC.name][0]
    INF = ACC(math.inf)

    @cuda.jit(device=True)
    def overflowed(v, at, live):  # (NaN compares false)
        return live and not (abs(v[at]) < INF and abs(v[at + 1]) < INF and abs(v[at + 2]) < INF)

    @cuda.jit(device=True)
    def rescaled(x, dy, row, raw, mu, r, out, t, NW, v, again, at, scratch, it, tid):  # -> it
        # the sums of a row whose sums overflowed, again with dy times DOWN where its sum
        # overflowed (a thread's part may where the row's does not; its elements stay far
        # above the subnormals), scaled back: every row of the vote reduces (zeros where not
        # ``out``), only ``out`` rows adopt
        rr = min(row, x.shape[0] - 1)
        sg = ACC(1) if abs(v[at]) < INF else ACC(DOWN)
        SUMS_DOWN(x[rr], dy[rr], raw, mu, r, sg, out, t, NW, again, 0)
        again[0], again[1], again[2] = group_sum3(again[0], again[1], again[2], scratch, it & 1, tid, TPR)
        if out:
            up = ACC(1) if sg == ACC(1) else ACC(1 / DOWN)
            v[at] = again[0] * up
            v[at + 1] = again[1] * up
            v[at + 2] = again[2]
        return it + 1

    return overflowed, rescaled


@functools.lru_cache(maxsize=None)
def _channel_sums_kernel(xdt, code):
    """Kernel 1: the sums of each (sample, channel) row: held in registers (a row group
    loads ``stats.raw_rows``' rows at once and reduces all of them in one go) or word by
    word."""
    ACC, KW, _, SHIFT = _consts(xdt, code)
    TPR, R, BLOCK, LOOP = code.tpr, code.rows, code.block, code.loop
    SLOTS = slots(BLOCK)
    RAW, RAWN, D = _backward_raw(xdt, code)
    RAWN1, RAWN2, NV = (RAWN if D > 1 else 1), (RAWN if D > 2 else 1), 3 * D
    SUMS = _channel_row_sums_fn(xdt, code)
    overflowed, rescaled = _channel_rescue_fns(xdt, code)
    FETCH = stats.fetch_rows_fn(xdt, code, 2, D)
    GROUP = group_sums_fn(NV)
    VOTE = stats.vote_fn(TPR, R)
    RESCUED = stats.can_leave_range(xdt)
    U32 = cuda.uint32

    @cuda.jit(device=True)
    def saved(a, pos, at):
        return a[min(pos[at], U32(a.shape[0] - 1))]  # group n * G + g, as row = n * C + g * Cg + c

    @cuda.jit(device=True)
    def row_sums(x, dy, row, raw, mu, r, t, NW, v, at):
        rr = min(row, x.shape[0] - 1)
        SUMS(x[rr], dy[rr], raw, mu, r, ACC(1), row < x.shape[0], t, NW, v, at)

    @C.kernel_jit(BLOCK, C.ROW_RESIDENT)
    def channel_sums(
        dy,     # (N*C, SW) gradient of y, one row of SW words per (sample, channel)
        x,      # (N*C, SW) forward input
        mean,   # (N*G,) saved mean
        rstd,   # (N*G,) saved rstd
        Cg,     # int: channels per group
        part,   # (4, N*C) output rows 1-3: sum(dy), sum(dy * (x - mean) * rstd), sum((x - mean) * rstd)
    ):
        M = x.shape[0]
        NW = x.shape[1] // KW
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        scratch = cuda.shared.array((2, NV, SLOTS), ACC)
        raw0 = cuda.local.array(RAWN, RAW)   # the raw words of the D rows loaded at once
        raw1 = cuda.local.array(RAWN1, RAW)
        raw2 = cuda.local.array(RAWN2, RAW)
        v = cuda.local.array(NV, ACC)
        again = cuda.local.array(3, ACC)     # a rescaled row's sums
        step = cuda.gridDim.x * R
        pos = cuda.local.array(9, U32)       # each row's group (``_locate``), kept by additions
        by = cuda.local.array(3, U32)
        _locate(step, Cg, Cg, by, 0)
        _locate(cuda.blockIdx.x * R + (tid >> SHIFT), Cg, Cg, pos, 0)
        it = 0
        for base in range(cuda.blockIdx.x * R, M, step * D):
            row = base + (tid >> SHIFT)
            for d in range(1, D):
                _advance(pos, 3 * d - 3, 3 * d, by, Cg, Cg)
            # each row's words and mean loaded before any is used
            if not LOOP:
                FETCH(x, dy, dy, row, step, raw0, raw1, raw2, t, NW)
            mu0, r0 = saved(mean, pos, 0), saved(rstd, pos, 0)
            mu1 = saved(mean, pos, 3) if D > 1 else ACC(0)
            mu2 = saved(mean, pos, 6) if D > 2 else ACC(0)
            r1 = saved(rstd, pos, 3) if D > 1 else ACC(0)
            r2 = saved(rstd, pos, 6) if D > 2 else ACC(0)
            _advance(pos, 3 * D - 3, 0, by, Cg, Cg)
            row_sums(x, dy, row, raw0, mu0, r0, t, NW, v, 0)
            if D > 1:
                row_sums(x, dy, row + step, raw1, mu1, r1, t, NW, v, 3)
            if D > 2:
                row_sums(x, dy, row + 2 * step, raw2, mu2, r2, t, NW, v, 6)
            GROUP(v, scratch, it & 1, tid, TPR)
            it += 1
            o0 = overflowed(v, 0, row < M)
            o1 = D > 1 and overflowed(v, 3, row + step < M)
            o2 = D > 2 and overflowed(v, 6, row + 2 * step < M)
            if RESCUED and VOTE(o0 or o1 or o2):
                it = rescaled(x, dy, row, raw0, mu0, r0, o0, t, NW, v, again, 0, scratch, it, tid)
                if D > 1:
                    it = rescaled(x, dy, row + step, raw1, mu1, r1, o1, t, NW, v, again, 3, scratch, it, tid)
                if D > 2:
                    it = rescaled(x, dy, row + 2 * step, raw2, mu2, r2, o2, t, NW, v, again, 6, scratch, it, tid)
            for d in range(D):
                if t == 0 and row + d * step < M:
                    for i in range(3):
                        part[1 + i, U32(row + d * step)] = v[3 * d + i]

    return _tag(channel_sums, code, D, D * 2 * code.vpt * np.dtype(xdt).itemsize)


@functools.lru_cache(maxsize=None)
def _channels_fn(xdt, wdt, code):
    """``channels(w, part, grp, c0, Cg, t, v, at)``: this thread's part of the sums over the
    channels of a (sample, group) ``grp`` (its first channel ``c0``) of kernel 1's sums:
    v[at:at + 3] = sum(w * A), sum(w * B), sum(D)."""
    ACC = C.acc_type(xdt)
    TPR = code.tpr
    has_w = wdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    U32 = cuda.uint32

    @cuda.jit(device=True)
    def channels(w, part, grp, c0, Cg, t, v, at):
        # indices as unsigned 32-bit: a signed one costs numba's negative-index wraparound
        first = grp * U32(Cg)              # the row of the group's first channel
        v[at] = ACC(0)
        v[at + 1] = ACC(0)
        v[at + 2] = ACC(0)
        for cc in range(U32(t), U32(Cg), U32(TPR)):
            wc = LW(w[c0 + cc]) if has_w else ACC(1)
            v[at] += wc * part[2, first + cc]
            v[at + 1] += wc * part[1, first + cc]
            v[at + 2] += part[3, first + cc]

    return channels


@functools.lru_cache(maxsize=None)
def _dx_row_fn(xdt, wdt, code):
    """``dx_row(x, dy, dx, w, part, row, c, raw, mu, r, inv_n, v, at, t, NW)``: the rest of one
    (sample, channel ``c``) row from its group's reduced sums v[at:at + 3]: corr =
    sum(D) / L, c1, c2, this row's dweight partial, and dx -- from its fetched words
    (registers path) or loaded word by word."""
    ACC, _, WPT, _ = _consts(xdt, code)
    TPR, V, LOOP = code.tpr, code.vec, code.loop
    has_w = wdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    LOADW, STOREW = C.word_fns(xdt, ACC.name, V)
    WIDEN = C.raw_fns(xdt, ACC.name, V)[2]
    U32 = cuda.uint32
    from numba.cuda import libdevice

    # weight * dy rounded on its own, never fused into the subtraction: c2 sums the same
    # rounded products, so a group of one element (xhat = 0) gives dx = 0, not their
    # rounding difference times rstd = 1/sqrt(eps)
    MUL = libdevice.dmul_rn if ACC == cuda.float64 else libdevice.fmul_rn
    NOTED = stats.grad_noted_fn(xdt)

    FACTORS = stats.grad_factors_fn(ACC.name)
    WEIGHT_FACTORS = stats.weight_factors_fn(ACC.name)

    @cuda.jit(device=True)
    def word_dx(xs, gs, mu, rf, p, q, r, c1f, c2f):  # (c1f, c2f: c1 and c2 - corr * rstd * c1,
        for e in range(V):                            # times f; rf: grad_factors_fn; p, q:
            # weight_factors_fn) (xhat before c1: rstd * c1 leaves the range where dy runs
            # along xhat with a large rstd, where f = 1, xhat * c1 does not)
            gs[e] = (MUL(gs[e], p) * q - ((xs[e] - mu) * r * c1f + c2f)) * rf

    @cuda.jit(device=True)
    def dx_row(x, dy, dx, w, part, row, c, raw, mu, r, inv_n, v, at, t, NW):  # (kernel's; c: channel; v: sums) -> noted
        if row >= x.shape[0]:
            return False
        swa, swb, sd = v[at], v[at + 1], v[at + 2]   # (kernel 1's sums of x - mean in rstd's units)
        cr = sd * inv_n                              # corr * rstd
        c1 = (swa - cr * swb) * inv_n
        c2 = swb * inv_n
        bad = NOTED(c1, c2)  # (redone after the block's rows, ``_grad_post_fn``: dx is not finite here, the mark)
        ur = U32(row)
        if t == 0:  # this row's own slot: no other row group reads it
            part[0, ur] = part[2, ur] - cr * part[1, ur]
        wc = LW(w[c]) if has_w else ACC(1)
        xs = cuda.local.array(V, ACC)
        gs = cuda.local.array(V, ACC)
        # once a row: ((x - mu - corr) * r * c1 + c2) * f = (x - mu) * r * c1f + c2f, an instruction
        # an element fewer (the rows' ``_grad_dx_fn`` likewise); a group of one element has
        # corr = 0 and f = 1 (rstd > 1), so c2f = c2 and dx stays exactly 0
        f, rf = FACTORS(r)
        c1f, c2f = c1 * f, (c2 - cr * c1) * f
        wp, wq = WEIGHT_FACTORS(wc, f)
        if LOOP:
            for q in range(t, NW, TPR):
                LOADW(x[row], q, xs, 0)
                LOADW(dy[row], q, gs, 0)
                word_dx(xs, gs, mu, rf, wp, wq, r, c1f, c2f)
                STOREW(dx[row], q, gs, 0)
        else:
            for k in range(WPT):
                q = t + k * TPR
                if q < NW:
                    WIDEN(raw, k, xs, 0)
                    WIDEN(raw, WPT + k, gs, 0)
                    word_dx(xs, gs, mu, rf, wp, wq, r, c1f, c2f)
                    STOREW(dx[row], q, gs, 0)
        return bad

    return dx_row


@functools.lru_cache(maxsize=None)
def _grad_redo_fn(xdt, wdt, code):
    """``redo(x, dy, dx, w, part, row, first, c0, Cg, mu, r, out, t, NW, inv_n, scratch, it, tid)``
    -> ``it``: dx and the dweight partial (part[0]) of a (sample, channel) row ``row`` of a
    group whose sums were not finite (``out``; its rows ``first .. first + Cg``, channels
    ``c0 ..``), again from memory: the group's sums with x - mean halved where it overflows
    and weight * dy scaled by ``stats.GRAD_RANGE``'s DOWN where its magnitudes sum past LIM,
    then the row's dx = (wdy - (xhat * c1 + c2)) * rstd scaled back (``row_norm``'s redo,
    over the group's channels: each of its rows sums the group again, rare).  Inf or NaN
    stays NaN.  Every thread that voted calls it (three group reductions); a row not
    ``out`` sums nothing and writes nothing."""
    ACC = C.acc_type(xdt)
    TPR, V = code.tpr, code.vec
    has_w = wdt is not None
    LW, LOADW, STOREW, DOWN, UP, LIM, DEV = stats.grad_redo_consts(xdt, wdt, ACC.name, V)

    @cuda.jit(device=True)
    def redo(
        x,        # (N*C, SW) forward input
        dy,       # (N*C, SW) gradient of y
        dx,       # (N*C, SW) output
        w,        # (C,) weight, or a dummy
        part,     # (4, N*C) row 0 output: this row's sum(dy * xhat)
        row,      # int: the (sample, channel) row (valid where ``out``)
        first,    # int: the row of its group's first channel
        c0,       # int: that channel
        Cg,       # int: channels per group
        mu,       # scalar: the group's saved mean
        r,        # scalar: its saved rstd
        out,      # bool: the group's sums were not finite
        t,        # int: thread within the row group
        NW,       # int: words per row
        inv_n,    # scalar: 1 / the group's elements
        scratch,  # (2, >= 3, slots) shared memory of the group sums
        it,       # int: group reductions so far (the scratch buffer alternates)
        tid,      # int: thread within the block
    ):
        xs = cuda.local.array(V, ACC)
        gs = cuda.local.array(V, ACC)
        mag = ACC(0)
        if out:
            for cc in range(Cg):
                wc = LW(w[c0 + cc]) if has_w else ACC(1)
                for q in range(t, NW, TPR):
                    LOADW(dy[first + cc], q, gs, 0)
                    for v in range(V):
                        mag += abs(gs[v] * ACC(DOWN) * wc)
        sg = ACC(DOWN) if group_sum(mag, scratch, it & 1, tid, TPR) > ACC(LIM * DOWN) else ACC(1)
        a0 = a1 = a2 = ACC(0)
        if out:
            for cc in range(Cg):
                wc = LW(w[c0 + cc]) if has_w else ACC(1)
                for q in range(t, NW, TPR):
                    LOADW(x[first + cc], q, xs, 0)
                    LOADW(dy[first + cc], q, gs, 0)
                    for v in range(V):
                        d = DEV(xs[v], mu, r)
                        wdy = gs[v] * sg * wc
                        a0 += d
                        a1 += d * wdy
                        a2 += wdy
        a0, a1, a2 = group_sum3(a0, a1, a2, scratch, (it + 1) & 1, tid, TPR)
        cr = a0 * inv_n
        c2 = a2 * inv_n
        c1 = a1 * inv_n - cr * c2
        dyx = ACC(0)
        if out:
            wc = LW(w[c0 + row - first]) if has_w else ACC(1)
            for q in range(t, NW, TPR):
                LOADW(x[row], q, xs, 0)
                LOADW(dy[row], q, gs, 0)
                for v in range(V):
                    xhat = DEV(xs[v], mu, r) - cr
                    val = (gs[v] * sg * wc - (xhat * c1 + c2)) * r
                    if sg != ACC(1):
                        val *= UP
                    dyx += gs[v] * xhat
                    gs[v] = val
                STOREW(dx[row], q, gs, 0)
        dyx = group_sum(dyx, scratch, it & 1, tid, TPR)
        if out and t == 0:
            part[0, _U32(row)] = dyx
        return it + 3

    return redo


@functools.lru_cache(maxsize=None)
def _grad_post_fn(xdt, wdt, code):
    """``post(x, dy, dx, w, mean, rstd, part, row, Cg, C_, inv_n, scratch, it, tid)`` -> ``it``:
    the dx kernel's pass after its rows, in a block where one was noted
    (``stats.grad_noted_fn``): a row whose dx is not finite (the mark: with c1 or c2 not
    finite, c1 * rstd or c2 - corr * rstd * c1 is not, nor is any element of dx; element 0
    read back) and whose group's sums, reduced again from kernel 1's as the row pass
    reduced them, are not finite, redone (``_grad_redo_fn``; a row whose dx overflowed for
    another reason is left as it is).  Every thread of the block calls it for each of its row
    group's rows, one at a time."""
    ACC = C.acc_type(xdt)
    LOADW = C.word_fns(xdt, ACC.name, code.vec)[0]
    CHANNELS = _channels_fn(xdt, wdt, code)
    GROUP = group_sums_fn(3)
    NOTED = stats.grad_noted_fn(xdt)
    REDO = _grad_redo_fn(xdt, wdt, code)
    TPR, V, KW = code.tpr, code.vec, C.u64_per_word(xdt, code.vec)
    INF = ACC(math.inf)

    @cuda.jit(device=True)
    def post(x, dy, dx, w, mean, rstd, part, row, Cg, C_, inv_n, scratch, it, tid):  # (the kernel's)
        M, NW, t = x.shape[0], x.shape[1] // KW, tid & (TPR - 1)
        u = min(row, M - 1)
        pos = cuda.local.array(3, _U32)
        _locate(u, Cg, C_, pos, 0)
        grp = min(pos[0], _U32(mean.shape[0] - 1))
        place = pos[1]
        xs = cuda.local.array(V, ACC)
        LOADW(dx[u], 0, xs, 0)
        marked = row < M and not (abs(xs[0]) < INF)
        v = cuda.local.array(3, ACC)
        CHANNELS(w, part, grp, pos[2] - place, Cg, t, v, 0)   # (``_dx_kernel``'s start)
        GROUP(v, scratch, it & 1, tid, TPR)
        cr = v[2] * inv_n
        c1 = (v[0] - cr * v[1]) * inv_n                        # (``_dx_row_fn``'s)
        out = marked and NOTED(c1, v[1] * inv_n)
        return REDO(x, dy, dx, w, part, u, u - place, pos[2] - place, Cg, mean[grp], rstd[grp], out, t, NW,
                    inv_n, scratch, it + 1, tid)

    return post

@functools.lru_cache(maxsize=None)
def _dx_kernel(xdt, wdt, code):
    """Kernel 2: dx (and this row's dweight partial) of each (sample, channel) row: a row
    group loads its rows' words (``stats.raw_rows``), then sums the channels of their
    groups (one reduction for all of them), then finishes each."""
    ACC, KW, _, SHIFT = _consts(xdt, code)
    TPR, V, R, BLOCK, LOOP = code.tpr, code.vec, code.rows, code.block, code.loop
    SLOTS = slots(BLOCK)
    has_w = wdt is not None
    RAW, RAWN, D = _backward_raw(xdt, code)
    RAWN1, RAWN2, NV = (RAWN if D > 1 else 1), (RAWN if D > 2 else 1), 3 * D
    FETCH = stats.fetch_rows_fn(xdt, code, 2, D)
    CHANNELS = _channels_fn(xdt, wdt, code)
    GROUP = group_sums_fn(NV)
    DX = _dx_row_fn(xdt, wdt, code)
    POST = _grad_post_fn(xdt, wdt, code)
    RESCUED = stats.can_leave_range(xdt)
    U32 = cuda.uint32

    @cuda.jit(device=True)
    def start(w, mean, rstd, part, pos, at, Cg, st, t, v):
        grp = min(pos[3 * at], U32(mean.shape[0] - 1))  # (a dead row's: the last group)
        st[2 * at] = mean[grp]
        st[2 * at + 1] = rstd[grp]
        CHANNELS(w, part, grp, pos[3 * at + 2] - pos[3 * at + 1], Cg, t, v, 3 * at)

    @C.kernel_jit(BLOCK, C.ROW_RESIDENT)
    def dx_kernel(
        dy,     # (N*C, SW) gradient of y, one row of SW words per (sample, channel)
        x,      # (N*C, SW) forward input
        mean,   # (N*G,) saved mean
        rstd,   # (N*G,) saved rstd
        w,      # (C,) weight, or a dummy (ones)
        Cg,     # int: channels per group
        part,   # (4, N*C) rows 1-3 from channel_sums (in rstd's units); row 0 output: sum(dy * xhat)
        dx,     # (N*C, SW) output: gradient of x
    ):
        M = x.shape[0]
        NW = x.shape[1] // KW
        C_ = w.shape[0] if has_w else Cg  # channels (only used with a weight)
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        inv_n = ACC(1) / ACC(Cg * NW * V)
        scratch = cuda.shared.array((2, NV, SLOTS), ACC)
        raw0 = cuda.local.array(RAWN, RAW)   # the raw words of the D rows loaded at once
        raw1 = cuda.local.array(RAWN1, RAW)
        raw2 = cuda.local.array(RAWN2, RAW)
        st = cuda.local.array(6, ACC)        # each row's saved mean and rstd
        v = cuda.local.array(NV, ACC)
        step = cuda.gridDim.x * R
        pos = cuda.local.array(9, U32)       # each row's group and channel (``_locate``), kept by additions
        by = cuda.local.array(3, U32)
        _locate(step, Cg, C_, by, 0)
        _locate(cuda.blockIdx.x * R + (tid >> SHIFT), Cg, C_, pos, 0)
        it = 0
        for base in range(cuda.blockIdx.x * R, M, step * D):
            row = base + (tid >> SHIFT)
            if not LOOP:
                FETCH(x, dy, dy, row, step, raw0, raw1, raw2, t, NW)
            for d in range(1, D):
                _advance(pos, 3 * d - 3, 3 * d, by, Cg, C_)
            for d in range(D):
                start(w, mean, rstd, part, pos, d, Cg, st, t, v)
            GROUP(v, scratch, it & 1, tid, TPR)
            it += 1
            bad = DX(x, dy, dx, w, part, row, pos[2], raw0, st[0], st[1], inv_n, v, 0, t, NW)
            if D > 1:
                bad |= DX(x, dy, dx, w, part, row + step, pos[5], raw1, st[2], st[3], inv_n, v, 3, t, NW)
            if D > 2:
                bad |= DX(x, dy, dx, w, part, row + 2 * step, pos[8], raw2, st[4], st[5], inv_n, v, 6, t, NW)
            _advance(pos, 3 * D - 3, 0, by, Cg, C_)
            # a row of a group whose sums left the range, noted in bit 30 of the reductions'
            # count (``row_norm``'s backward does the same)
            if RESCUED:
                it |= bad << 30
        # the block's rows again where one was noted (``_grad_post_fn``): rare
        if RESCUED and cuda.syncthreads_or(U32(it >> 30)) != 0:
            for base in range(cuda.blockIdx.x * R, M, step):
                it = POST(x, dy, dx, w, mean, rstd, part, base + (tid >> SHIFT), Cg, C_, inv_n, scratch, it, tid)

    return _tag(dx_kernel, code, D, D * 2 * code.vpt * np.dtype(xdt).itemsize)


def forward(x, weight, bias, eps, y, mean, rstd, *, stream=0):
    """Fill ``y`` (N, C, S) and ``mean``/``rstd`` (N, G) for group norm, on ``stream``
    (``C.Unkept`` statistics, a plain call's: not stored)."""
    n, c, S = x.shape
    G = mean.shape[1]
    if n == 0:
        return
    L = (c // G) * S
    # words must not straddle channels: the per-channel loop steps over S
    vec = C.vec_width(S, x, y)
    cfg = C.row_config(n * G, L, x.dtype == C.F64, vec, C.ROW_RESIDENT, x.dtype.itemsize, 1)  # x staged
    kern = _forward_kernel(np.dtype(x.dtype), C.dtype_or_none(weight), C.dtype_or_none(bias), cfg.code)
    xe = C.kview(x)
    shared = {"shared": cfg.shared} if cfg.shared else {}
    C.launch(kern, cfg.grid, cfg.block, stream, C.words(x.reshape(n * G, L), vec), C.optional(weight, xe, 1),
             C.optional(bias, xe, 1), np.dtype(mean.dtype).type(eps), S, G,
             C.words(y.reshape(n * G, L), vec), C.stored(mean.reshape(n * G)), C.stored(rstd.reshape(n * G)),
             **shared)


def backward(dy, x, mean, rstd, weight, dx, dweight, dbias, *, stream=0, empty=None):
    """Fill ``dx`` (N, C, S) and ``dweight``/``dbias`` (C,) of any float dtype, on ``stream``;
    the partial sums from ``empty`` (as ``row_norm.backward``'s)."""
    n, c, S = x.shape
    G = mean.shape[1]
    acc = C.F64 if x.dtype == C.F64 else C.F32  # dweight/dbias: any float dtype (column_sums)
    # rows: sum(dy * xhat) and sum(dy) (the dweight/dbias partials, summed over
    # samples at the end), then sum(dy * (x - mean) * rstd) and sum((x - mean) * rstd)
    part = (empty or C.device_empty)((4, n, c), acc)
    if n:
        xdt = np.dtype(x.dtype)
        vec = C.vec_width(S, x, dy, dx)
        cfg = C.row_config(n * c, S, xdt == C.F64, vec, C.ROW_RESIDENT)
        xk = C.words(x.reshape(n * c, S), vec)
        dyk = C.words(dy.reshape(n * c, S), vec)
        m1, p1 = mean.reshape(n * G), part.reshape(4, n * c)
        r1 = rstd.reshape(n * G)
        C.launch(_channel_sums_kernel(xdt, cfg.code), cfg.grid, cfg.block, stream, dyk, xk, m1, r1, c // G, p1)
        C.launch(_dx_kernel(xdt, C.dtype_or_none(weight), cfg.code), cfg.grid, cfg.block, stream, dyk, xk, m1,
                 r1, C.optional(weight, C.kview(x), 1), c // G, p1,
                 C.words(dx.reshape(n * c, S), vec))
    C.column_sums(part[0:2], dweight, dbias, stream)
