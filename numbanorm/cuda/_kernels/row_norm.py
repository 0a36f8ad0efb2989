"""LayerNorm and RMSNorm on the GPU: one forward and one backward kernel factory for
both (``kind`` 'layer' or 'rms'), with or without the fused residual, and their
launchers.

LayerNorm (``kind='layer'``):

    k = mean(x[:vec]),  m1 = sum(x - k) / N,  ms = sum((x - k)^2) / N
                                                   (pass 1, row in registers; one reduction)
    mean = mu + corr with mu = k, corr = m1,  var = ms - m1^2
                                                   where m1^2 <= ms / 2 (k near the mean)
    else mu = k + m1, corr = sum(x - mu) / N,  var = sum((x - mu)^2) / N - corr^2
                                                   (pass 2: corrected two-pass, for those rows)
    y    = ((x - mu) * rstd - corr * rstd) * weight + bias
                                                   (unfused, row in registers: x - mu is pass 1's
                                                   d = x - k, kept; after pass 2, d - m1)

RMSNorm (``kind='rms'``): ``rstd = 1 / sqrt(sum(x^2) / N + eps)`` in pass 1,
``y = x * rstd * weight``.

A row whose statistics leave the accumulation dtype's range (sums of squares that
overflow, or var + eps too small to keep its bits: rstd 0, NaN or huge) is redone
from memory on the row scaled by a power of two (``stats.rescue_fns``, ``_redo_fn``):
by the long-row kernel after a vote, as the fallback; by the registers path after its
rows, in the blocks whose vote found one (``_post_fn``), so that its row loop pays only
for noting it.

The row mapping (a thread group per row, the row in registers where it fits,
moved in 16- or 8-byte words of ``vec`` elements where the rows allow) is described in
``common``; the statistics passes are ``stats`` (shared with GroupNorm), the
group reductions ``reduce``.  Each kernel is a row loop around device functions: the
statistics pass, the normalize pass (the backward's pass 2), the epilogue.  Rows held in
registers are loaded several at a time: a thread issues the loads of all its words of
``common.rows_in_flight`` rows of its row group (x, and the residual, or x, dy and ds)
before it waits for the first, then works on the rows in turn -- so that it keeps
its share of ``common.SM_BYTES_IN_FLIGHT`` in flight, not one word.  Kernels are specialized by
closure constants (kind, dtypes, mapping, which optional arrays exist), so the
other kind's code, absent weight/bias/residual cost nothing (numba prunes the
branches on them); absent arrays are passed as one-element dummies that are
never read.  Where the two kinds' arithmetic differs, each keeps its own exact
expression (the bits of both are as they were before they shared a kernel).

Backward (RMSNorm: mean = corr = 0, c2 = 0, no dbias):

    corr = mean(x - mean)       the saved float32 mean's rounding (1e-3 at a mean
                                of 1e4: 5% of the std in the contract's
                                large-offset case), corrected as in the forward
    xhat = (x - mean) * rstd - corr * rstd,  wdy = weight * dy
    c1 = mean(xhat * wdy) = mean((x - mean) * rstd * wdy) - corr * rstd * c2
    c2 = mean(wdy)                                  (one 3-value group reduction;
                                                    sums in rstd's units, which stay in
                                                    range where those of x - mean do not)
    dx = (wdy * f - (xhat * c1 * f + c2 * f)) * rf   (+ ds, the fused residual's gradient)
         f, rf = rstd, 1 where rstd <= 1, else 1, rstd  (``stats.grad_factors_fn``: no term
                                                    out of range where dx is in it)

    (LayerNorm: corr * rstd, c1 * f and c2 * f taken once a row, so that xhat is one FFMA
    after the subtraction; corr * rstd is pass 1's sum (but in float16), never divided by
    rstd, which a caller may pass as 0; RMSNorm: xhat = x * rstd, dx = (wdy * f - xhat *
    c1 * f) * rf)

A row whose reduced c1 or c2 is not finite, its elements finite (x - mean itself
overflowing near the largest values, the sum of weight * dy, RMSNorm's of x * rstd * wdy),
is noted by pass 2 (rstd taken as 0: it adds nothing to dweight, and leaves dx NaN) and
redone from memory, x - mean halved and wdy scaled by a power of two (``_grad_redo_fn``):
by the long-row kernel after a vote, by the registers path after its rows
(``_grad_post_fn``), as the forward redoes its rows.

dweight/dbias: each thread keeps running sums of ``dy * xhat`` and ``dy`` for
its own columns over the rows its block visits, the row groups of a block are
combined in shared memory in group order, and each block writes one partial
row; ``common.column_sums`` adds the partial rows in a fixed order.  No atomics:
the same inputs give the same bits on the same GPU.
"""

import functools
import math

import numpy as np
from numba import cuda

from . import common as C
from . import stats
from .reduce import group_sum, group_sum2, group_sum3, group_sums_fn, slots
from .stats import U32, U64

KINDS = ("layer", "rms")


def _consts(kind, xdt, code):
    """What every piece of a kernel of ``kind`` for x of ``xdt`` and mapping ``code`` names."""
    assert kind in KINDS
    ACC = C.acc_type(xdt)
    KW = C.u64_per_word(xdt, code.vec)  # the kernels' uint64 (or elements) per word
    return kind == "layer", ACC, KW, code.vpt // code.vec, code.tpr.bit_length() - 1


@functools.lru_cache(maxsize=None)
def forward_kernel(kind, xdt, wdt, bdt, code, has_r):
    """The forward kernel of ``kind`` for x of ``xdt``, weight/bias of ``wdt``/``bdt``
    (None: absent), the mapping ``code`` (``RowConfig.code``), fused residual or not:
    rows held in registers, or (``code.loop``) long rows word by word."""
    make = forward_kernel_loop if code.loop else forward_kernel_held
    return make(kind, xdt, wdt, bdt, code, has_r)


@functools.lru_cache(maxsize=None)
def backward_kernel(kind, xdt, wdt, code, has_ds):
    """The backward kernel of ``kind`` (see ``forward_kernel``); ``has_ds``: the fused
    residual's gradient is added to dx."""
    make = backward_kernel_loop if code.loop else backward_kernel_held
    return make(kind, xdt, wdt, code, has_ds)


def _tag(kern, code, rows, loads):
    """``kern`` with what ``benchmarks.gpu_model`` checks its SASS against: its mapping,
    the rows a row group loads at once, and the bytes a thread requests for them
    before it waits for any (its row arrays' words)."""
    kern.mapping, kern.rows_in_flight, kern.loads_in_flight = code, rows, loads
    return kern


# ---------------------------------------------------------------- pieces of both paths

@functools.lru_cache(maxsize=None)
def _params_fn(xdt, wdt, bdt, code, biased):
    """``params(w, b, ws, bs, t, N)``: this thread's columns of weight and (``biased``)
    bias in the accumulation dtype (None: absent: ones and zeros), loaded once per block
    (registers path)."""
    ACC = C.acc_type(xdt)
    has_w, has_b = wdt is not None, bdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    LB = C.load_fn(xdt if bdt is None else bdt, ACC.name)
    TPR, VPT, V = code.tpr, code.vpt, code.vec

    @cuda.jit(device=True)
    def params(
        w,      # (N,) weight, or a dummy
        b,      # (N,) bias, or a dummy
        ws,     # (VPT,) output: the weight of each of the thread's elements
        bs,     # (VPT,) output: the bias of each (biased), else unwritten
        t,      # int: thread within the row group
        N,      # int: elements per row
    ):
        for e in range(VPT):
            j = (t + (e // V) * TPR) * V + e % V
            ws[e] = LW(w[j]) if has_w and j < N else ACC(1)
            if biased:
                bs[e] = LB(b[j]) if has_b and j < N else ACC(0)

    return params


@functools.lru_cache(maxsize=None)
def _weights_fn(xdt, wdt, code):
    """``(WS, WSN, load, word)``: the backward's copy of this thread's columns of the
    weight, in a local array of ``WSN`` ``WS``: 16-bit weights stay 16-bit (as the
    kernels' words, half the registers), widened word by word where they are used; other
    weights (or none: ones) in the accumulation dtype.  ``load(w, ws, t, N)`` fills it
    once per block; ``word(ws, k, wv)``: the weights of the thread's word k -> wv[0:vec]."""
    ACC = C.acc_type(xdt)
    TPR, VPT, V = code.tpr, code.vpt, code.vec
    packed = wdt is not None and V > 1 and np.dtype(wdt).itemsize == 2 and ACC == cuda.float32
    if not packed:
        PARAMS = _params_fn(xdt, wdt, None, code, False)

        @cuda.jit(device=True)
        def load(w, ws, t, N):
            PARAMS(w, w, ws, ws, t, N)

        @cuda.jit(device=True)
        def word(ws, k, wv):
            for v in range(V):
                wv[v] = ws[k * V + v]

        return ACC, VPT, load, word
    ELEM = C._elements(wdt)[0]
    WIDEN = C.raw_fns(wdt, ACC.name, V)[2]

    @cuda.jit(device=True)
    def load_packed(w, ws, t, N):
        h = ws.view(ELEM)
        for e in range(VPT):
            j = (t + (e // V) * TPR) * V + e % V
            h[e] = w[j] if j < N else w[0]   # (past the row: never used)

    @cuda.jit(device=True)
    def word_packed(ws, k, wv):
        WIDEN(ws, k, wv, 0)

    return cuda.uint64, VPT * 2 // 8, load_packed, word_packed


# ---------------------------------------------------------------- forward, rows in registers

@functools.lru_cache(maxsize=None)
def _normalize_held_fn(kind, xdt, code, from_raw, centered=False):
    """``normalize(yr, held, ws, bs, mu, corr, r, t, NW)``: y of a row held in registers:
    ``held`` its elements (VPT, the accumulation dtype), or (``from_raw``) its words as
    stored (the fused s, widened again word by word).  (x - mu) * r - corr * r, never
    (x - (mu + corr)) * r: mu + corr rounds to the float32 grid (a tenth of the std in the
    contract's large-offset case).  ``centered``: ``held`` is x - mu already (mu unread)."""
    LAYER, ACC, _, WPT, _ = _consts(kind, xdt, code)
    STOREW = C.word_fns(xdt, ACC.name, code.vec)[1]
    WIDEN = C.raw_fns(xdt, ACC.name, code.vec)[2]
    TPR, V = code.tpr, code.vec

    @cuda.jit(device=True)
    def normalize(
        yr,     # (NW,) output words of the row
        held,   # (VPT,) this thread's elements, or (from_raw) its raw words
        ws,     # (VPT,) their weights
        bs,     # (VPT,) their biases (LayerNorm)
        mu,     # scalar: the row's shift (mean = mu + corr)
        corr,   # scalar
        r,      # scalar: rstd
        t,      # int: thread within the row group
        NW,     # int: words per row
    ):
        xv = cuda.local.array(V, ACC)
        tmp = cuda.local.array(V, ACC)
        cr = corr * r  # once a row: (x - mu) * r - cr is one FFMA, ((x - mu) - corr) * r two instructions
        for k in range(WPT):
            q = t + k * TPR
            if q < NW:
                if from_raw:
                    WIDEN(held, k, xv, 0)
                else:
                    for v in range(V):
                        xv[v] = held[k * V + v]
                for v in range(V):
                    e = k * V + v
                    if LAYER and centered:
                        tmp[v] = (xv[v] * r - cr) * ws[e] + bs[e]
                    elif LAYER:
                        tmp[v] = ((xv[v] - mu) * r - cr) * ws[e] + bs[e]
                    else:
                        tmp[v] = xv[v] * r * ws[e]
                STOREW(yr, q, tmp, 0)

    return normalize


@functools.lru_cache(maxsize=None)
def _store_s_fn(xdt, code):
    """``store_s(sr, raw, t, NW)``: the fused forward's s = x + res, this thread's words of
    it as ``stats.held_sums_fn`` left them in ``raw``, stored -- after the row's group
    reduction: ptxas issues no load after a store it might alias, so a store in pass 1
    would hold the next rows' loads back until the first row's arithmetic."""
    PUT = C.raw_fns(xdt, C.acc_type(xdt).name, code.vec)[4]
    TPR, WPT = code.tpr, code.vpt // code.vec

    @cuda.jit(device=True)
    def store_s(sr, raw, t, NW):
        for k in range(WPT):
            q = t + k * TPR
            if q < NW:
                PUT(sr, q, raw, k)

    return store_s


@functools.lru_cache(maxsize=None)
def _normalize_words_fn(kind, xdt, wdt, bdt, code, staged=False):
    """``normalize(src, yr, w, b, mu, corr, r, sc, t, NW)``: y of a row word by word from
    ``src`` (its words in global memory, or its shared copy, ``staged``), this thread's
    words t, t + tpr, ...: ((x * sc - mu) * r - corr * r) * weight + bias (RMSNorm: x *
    sc * r * weight), weight and bias loaded as used.  ``sc``: 1 but for a row redone at
    a scale (``_redo_fn``; x * 1 is x, and the compiler knows it)."""
    LAYER, ACC = kind == "layer", C.acc_type(xdt)
    TPR, V = code.tpr, code.vec
    has_w, has_b = wdt is not None, bdt is not None and LAYER
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    LB = C.load_fn(xdt if bdt is None else bdt, ACC.name)
    STOREW = C.word_fns(xdt, ACC.name, V)[1]
    READW = stats.stage_fns(xdt, ACC.name, V)[2] if staged else C.word_fns(xdt, ACC.name, V)[0]

    @cuda.jit(device=True)
    def normalize(
        src,    # (NW,) words of the row: x, or s when fused (its shared copy when staged)
        yr,     # (NW,) output words of the row
        w,      # (N,) weight, or a dummy
        b,      # (N,) bias, or a dummy
        mu,     # scalar: the row's shift (mean = mu + corr), of x * sc
        corr,   # scalar
        r,      # scalar: rstd, of x * sc
        sc,     # scalar: the scale
        t,      # int: thread within the row group
        NW,     # int: words per row
    ):
        xs = cuda.local.array(V, ACC)
        tmp = cuda.local.array(V, ACC)
        cr = corr * r  # (x - mu) * r - cr: one FFMA (the registers path's normalize)
        for q in range(t, NW, TPR):
            READW(src, q, xs, 0)
            for v in range(V):
                val = (xs[v] * sc - mu) * r - cr if LAYER else xs[v] * sc * r
                if has_w:
                    val *= LW(w[q * V + v])
                if has_b:
                    val += LB(b[q * V + v])
                tmp[v] = val
            STOREW(yr, q, tmp, 0)

    return normalize


@functools.lru_cache(maxsize=None)
def _redo_fn(kind, xdt, wdt, bdt, code, staged=False):
    """``redo(src, yr, w, b, mean, rstd, row, out, t, NW, inv_n, eps, scratch, it, tid)`` ->
    ``it``: a row whose statistics left the range (``out``: its ``stats.rescue_fns`` code), normalized
    again after the vote, over what the normalize pass wrote: its statistics on the row
    scaled by a power of two s (``stats.rescue_fns``), stored as the row's own, and y from
    ``src`` (x, or s as stored; or its shared copy, ``staged``) as the scaled row
    normalizes, ((x * s - mu) * rstd - corr * rstd) * weight + bias (RMSNorm: x * s * rstd
    * weight), where (x - mean) * rstd may leave the range.  Every thread that voted calls
    it (its reductions); a row not ``out`` sums nothing and writes nothing.  The words
    are each thread's own (t, t + tpr, ...), as the normalize pass wrote them."""
    LAYER = kind == "layer"
    RESCUE = stats.rescue_fns(xdt, code.tpr, code.vec, staged, squares=not LAYER)[1]
    NORMALIZE = _normalize_words_fn(kind, xdt, wdt, bdt, code, staged)

    @cuda.jit(device=True)
    def redo(
        src, yr, w, b,  # NORMALIZE's (_normalize_words_fn): the row's words, its output words, weight, bias
        mean,     # (M,) per-row mean (LayerNorm), or a dummy
        rstd,     # (M,) per-row rstd; (0,): none stored
        row,      # int: the row (valid where ``out``)
        out, t, NW, inv_n, eps, scratch, it, tid,  # RESCUE's (stats.rescue_fns' ``rescue``)
    ):
        mu, corr, rs, own_rstd, sc, it = RESCUE(src, out, t, NW, inv_n, eps, scratch, it, tid)
        if out != 0:
            if t == 0 and row < rstd.shape[0]:
                if LAYER:
                    mean[row] = (mu + corr) / sc
                rstd[row] = own_rstd
            NORMALIZE(src, yr, w, b, mu, corr, rs, sc, t, NW)
        return it

    return redo


@functools.lru_cache(maxsize=None)
def _post_fn(kind, xdt, wdt, bdt, code, has_r):
    """``post(x, res, w, b, y, s, mean, rstd, row, eps, scratch, it, tid)`` -> ``it``: the
    registers path's pass after its rows, in a block where one left the range: ``row``'s
    code from the rstd the row pass stored, or where none is kept (a plain call not in
    place) from its statistics again from memory (x, or s as stored; ``stats.rescue_fns``'
    ``recheck``), and where it is out of range the row redone (``_redo_fn``).  Kept, such a
    row's y was left unwritten, so that x is still there to redo it from where y is x (in
    place).  Every thread of the block calls it for each of its row group's rows, one at a
    time."""
    OUT, _, RECHECK = stats.rescue_fns(xdt, code.tpr, code.vec, squares=kind == "rms")
    REDO = _redo_fn(kind, xdt, wdt, bdt, code)
    GEOMETRY = stats.geometry_fn(xdt, code)

    @cuda.jit(device=True)
    def post(x, res, w, b, y, s, mean, rstd, row, eps, scratch, it, tid):  # (REDO's)
        M, NW, t, inv_n = GEOMETRY(x, tid)
        u = U64(min(row, M - 1))
        src = s[u] if has_r else x[u]
        out, _, it = RECHECK(src, row < M, t, NW, inv_n, eps, scratch, it, tid)
        if rstd.shape[0] != 0:  # (kept: that code stands; the recheck's, of a row y may have overwritten, not)
            out = OUT(rstd[u], row < M)
        return REDO(src, y[u], w, b, mean, rstd, u, out, t, NW, inv_n, eps, scratch, it, tid)

    return post


@functools.lru_cache(maxsize=None)
def _layer_fallback_fn(xdt, code, has_r):
    """``fallback(x, raw, xs, live, t, NW, k, m1, bad, inv_n, eps, scratch, it, tid, st, at)``
    -> ``it``: ``_layer_rows_fn``'s row whose shifted sums cannot be trusted (``bad``), its
    statistics again by ``stats.shift_fns``' two-pass over its elements held in registers
    (fused: ``raw`` widened again; unfused: ``xs``, d = x - k, left as d - m1)."""
    _, ACC, _, WPT, _ = _consts("layer", xdt, code)
    TPR, VPT, V = code.tpr, code.vpt, code.vec
    FALLBACK = stats.shift_fns(xdt, TPR, VPT, V, False, groups=code.rows)[2]
    WIDEN = C.raw_fns(xdt, ACC.name, V)[2]

    @cuda.jit(device=True)
    def fallback(x, raw, xs, live, t, NW, k, m1, bad, inv_n, eps, scratch, it, tid, st, at):
        xf = cuda.local.array(VPT, ACC)  # the row's elements (fused: widened again; unfused: d = x - k)
        if has_r:
            for j in range(WPT):
                WIDEN(raw, j, xf, j * V)
            return FALLBACK(x[0], xf, live, t, NW, k, m1, bad, inv_n, eps, scratch, it, tid, st, at)
        for e in range(VPT):
            xf[e] = xs[e]
        # the deviations from k + m1 are d - m1: the pass about a shift of 0, then k added back
        it = FALLBACK(x[0], xf, live, t, NW, ACC(0), m1, bad, inv_n, eps, scratch, it, tid, st, at)
        if bad:
            st[at] += k  # mu = m1 + k
            for e in range(VPT):
                xs[e] -= m1
        return it

    return fallback


@functools.lru_cache(maxsize=None)
def _layer_rows_fn(xdt, code, has_r, rows):
    """``layer_rows(x, res, y, s, mean, rstd, row, step, raw0, raw1, raw2, ws, bs, eps, scratch,
    it, tid)`` -> ``(it, bad)`` (a row out of range, ``_post_fn``): LayerNorm's ``rows``
    (1-3) rows ``row, row + step, ...`` of a row group held in registers, from their fetched words: the statistics pass of every row
    (the shifted sums; fused: s stored), one group reduction for all of them
    (``stats.shift_fns``; the rare fallback's after it), then each row's normalize pass
    and statistics stored.  (Every row's words are used before the reduction's first
    barrier, so ptxas issues all their loads before the first wait.)  Unfused, the
    sums pass leaves d = x - k in the row's registers (k: the shift, ``stats.first_fn``),
    which the normalize pass takes as x - mu: an instruction an element fewer; a row the
    fallback takes keeps d - m1 there, its deviations from the new mu = k + m1."""
    GEOMETRY = stats.geometry_fn(xdt, code)
    ACC = C.acc_type(xdt)
    TPR, VPT, V = code.tpr, code.vpt, code.vec
    VPT1, VPT2, NV, NST = (VPT if rows > 1 else 1), (VPT if rows > 2 else 1), 2 * rows, 3 * rows
    KEPT = not has_r  # (fused: the normalize pass widens s as stored again, which holds fewer registers)
    SUMS = stats.held_sums_fn(xdt, TPR, VPT, V, False, has_r, shifted=True, keep=KEPT)
    FIRST = stats.first_fn(xdt, V, has_r)
    SETTLE, VOTE = stats.shift_fns(xdt, TPR, VPT, V, False, groups=code.rows)[:2]
    fallback = _layer_fallback_fn(xdt, code, has_r)
    GROUP = group_sums_fn(NV)
    NORMALIZE = _normalize_held_fn("layer", xdt, code, has_r, centered=KEPT)
    STORE_S = _store_s_fn(xdt, code)
    OUT = stats.rescue_fns(xdt, TPR, V, squares=False)[0]
    RESCUED = stats.can_leave_range(xdt)

    @cuda.jit(device=True)
    def sums(x, res, row, raw, xs, tmp, t, NW, v, at):
        M = x.shape[0]
        rr = U64(min(row, M - 1))        # a valid row for the views of dead rows (unsigned: no wraparound)
        ri = rr if has_r else U64(0)
        k = FIRST(x[rr], res[ri], tmp)
        v[at], v[at + 1] = SUMS(raw, xs, tmp, row < M, t, NW, k)
        return k

    @cuda.jit(device=True)
    def finish(y, s, mean, rstd, row, raw, xs, ws, bs, st, at, t, NW):  # -> the row left the range
        if row < y.shape[0]:
            u = U64(row)  # the index unsigned: no negative-index wraparound
            if has_r:
                STORE_S(s[u], raw, t, NW)
            kept = row < rstd.shape[0]  # (a plain call's statistics: unkept, (0,), none stored)
            if t == 0 and kept:
                mean[u] = st[at] + st[at + 1]
                rstd[u] = st[at + 2]
            bad = RESCUED and OUT(st[at + 2], True) != 0
            if has_r or not (bad and kept):  # (kept, such a row is written by ``_post_fn`` alone: x may be y)
                # fused: the row as stored (s), not held widened: two rows of x and the residual fit
                NORMALIZE(y[u], raw if has_r else xs, ws, bs, st[at], st[at + 1], st[at + 2], t, NW)
            return bad
        return False

    @cuda.jit(device=True)
    def layer_rows(x, res, y, s, mean, rstd, row, step, raw0, raw1, raw2, ws, bs, eps, scratch, it, tid):  # (kernel's)
        M, NW, t, inv_n = GEOMETRY(x, tid)
        xs0 = cuda.local.array(VPT, ACC)
        xs1 = cuda.local.array(VPT1, ACC)
        xs2 = cuda.local.array(VPT2, ACC)
        tmp = cuda.local.array(V, ACC)
        v = cuda.local.array(NV, ACC)     # the shifted sums of each row
        st = cuda.local.array(NST, ACC)   # mu, corr, rstd of each row
        k1 = k2 = ACC(0)
        b1 = b2 = False
        k0 = sums(x, res, row, raw0, xs0, tmp, t, NW, v, 0)
        if rows > 1:
            k1 = sums(x, res, row + step, raw1, xs1, tmp, t, NW, v, 2)
        if rows > 2:
            k2 = sums(x, res, row + 2 * step, raw2, xs2, tmp, t, NW, v, 4)
        GROUP(v, scratch, it & 1, tid, TPR)
        it += 1
        b0 = SETTLE(k0, v[0] * inv_n, v[1] * inv_n, row < M, eps, st, 0)
        if rows > 1:
            b1 = SETTLE(k1, v[2] * inv_n, v[3] * inv_n, row + step < M, eps, st, 3)
        if rows > 2:
            b2 = SETTLE(k2, v[4] * inv_n, v[5] * inv_n, row + 2 * step < M, eps, st, 6)
        if VOTE(b0 or b1 or b2):
            it = fallback(x, raw0, xs0, row < M, t, NW, k0, v[0] * inv_n, b0, inv_n, eps, scratch, it, tid, st, 0)
            if rows > 1:
                it = fallback(x, raw1, xs1, row + step < M, t, NW, k1, v[2] * inv_n, b1, inv_n, eps, scratch, it,
                              tid, st, 3)
            if rows > 2:
                it = fallback(x, raw2, xs2, row + 2 * step < M, t, NW, k2, v[4] * inv_n, b2, inv_n, eps, scratch,
                              it, tid, st, 6)
        # rows whose statistics left the range, rarer still: the kernel redoes them after its
        # rows (``_post_fn``), from memory, once the registers are free
        bad = finish(y, s, mean, rstd, row, raw0, xs0, ws, bs, st, 0, t, NW)
        if rows > 1:
            bad |= finish(y, s, mean, rstd, row + step, raw1, xs1, ws, bs, st, 3, t, NW)
        if rows > 2:
            bad |= finish(y, s, mean, rstd, row + 2 * step, raw2, xs2, ws, bs, st, 6, t, NW)
        return it, bad

    return layer_rows


@functools.lru_cache(maxsize=None)
def _rms_rows_fn(xdt, code, has_r, rows):
    """``rms_rows(...)`` (``_layer_rows_fn``'s arguments; mean and bs unread) -> ``(it, bad)``: RMSNorm's ``rows`` (1-3) rows ``row, row + step, ...`` of a row group held
    in registers, from their fetched words: the sums of squares of all of them, one
    group reduction for all, then each row's rstd, y and rstd stored.  (Every row's words
    are used before the reduction's first barrier, so ptxas issues all their loads
    before the first wait: a row at a time, it issued the next rows' loads after the
    first row's arithmetic.)"""
    GEOMETRY = stats.geometry_fn(xdt, code)
    ACC = C.acc_type(xdt)
    TPR, VPT, V = code.tpr, code.vpt, code.vec
    VPT1, VPT2 = (VPT if rows > 1 else 1), (VPT if rows > 2 else 1)
    SUMS = stats.held_sums_fn(xdt, TPR, VPT, V, True, has_r)
    NORMALIZE = _normalize_held_fn("rms", xdt, code, has_r)
    STORE_S = _store_s_fn(xdt, code)
    OUT = stats.rescue_fns(xdt, TPR, V, squares=True)[0]
    RESCUED = stats.can_leave_range(xdt)

    @cuda.jit(device=True)
    def finish(y, s, rstd, row, sq, raw, xs, ws, eps, t, NW):  # -> the row left the range (``layer_rows``')
        M = y.shape[0]
        r = ACC(1) / math.sqrt(sq / ACC(NW * V) + eps)
        if row < M:
            u = U64(row)  # the index unsigned: no negative-index wraparound
            if has_r:
                STORE_S(s[u], raw, t, NW)
            kept = row < rstd.shape[0]
            if t == 0 and kept:
                rstd[u] = r
            bad = RESCUED and OUT(r, True) != 0
            if has_r or not (bad and kept):  # (``layer_rows``' finish)
                NORMALIZE(y[u], raw if has_r else xs, ws, ws, ACC(0), ACC(0), r, t, NW)
            return bad
        return False

    @cuda.jit(device=True)
    def rms_rows(x, res, y, s, mean, rstd, row, step, raw0, raw1, raw2, ws, bs, eps, scratch, it, tid):  # (layer_rows')
        M, NW, t, _ = GEOMETRY(x, tid)
        xs0 = cuda.local.array(VPT, ACC)
        xs1 = cuda.local.array(VPT1, ACC)
        xs2 = cuda.local.array(VPT2, ACC)
        tmp = cuda.local.array(V, ACC)
        q1 = q2 = ACC(0)
        q0 = SUMS(raw0, xs0, tmp, row < M, t, NW, ACC(0))[0]
        if rows > 1:
            q1 = SUMS(raw1, xs1, tmp, row + step < M, t, NW, ACC(0))[0]
        if rows > 2:
            q2 = SUMS(raw2, xs2, tmp, row + 2 * step < M, t, NW, ACC(0))[0]
        if rows == 3:
            q0, q1, q2 = group_sum3(q0, q1, q2, scratch, it & 1, tid, TPR)
        elif rows == 2:
            q0, q1 = group_sum2(q0, q1, scratch, it & 1, tid, TPR)
        else:
            q0 = group_sum(q0, scratch, it & 1, tid, TPR)
        bad = finish(y, s, rstd, row, q0, raw0, xs0, ws, eps, t, NW)
        if rows > 1:
            bad |= finish(y, s, rstd, row + step, q1, raw1, xs1, ws, eps, t, NW)
        if rows > 2:
            bad |= finish(y, s, rstd, row + 2 * step, q2, raw2, xs2, ws, eps, t, NW)
        return it + 1, bad

    return rms_rows


def forward_kernel_held(kind, xdt, wdt, bdt, code, has_r):
    LAYER, ACC, KW, _, SHIFT = _consts(kind, xdt, code)
    TPR, V, R, BLOCK = code.tpr, code.vec, code.rows, code.block
    SLOTS = slots(BLOCK)
    ARRAYS = 2 if has_r else 1
    RAW, RAWN, D = stats.raw_rows(xdt, code, ARRAYS)
    RAWN1, RAWN2 = (RAWN if D > 1 else 1), (RAWN if D > 2 else 1)
    VPT, BS = code.vpt, code.vpt if LAYER else 1
    PARAMS = _params_fn(xdt, wdt, bdt if LAYER else None, code, LAYER)
    FETCH = stats.fetch_rows_fn(xdt, code, ARRAYS, D)
    ROWS = (_layer_rows_fn if LAYER else _rms_rows_fn)(xdt, code, has_r, D)
    POST = _post_fn(kind, xdt, wdt, bdt if LAYER else None, code, has_r)
    RESCUED = stats.can_leave_range(xdt)
    SUMS = 2 * D if LAYER else max(2, D)  # values a group reduction sums at once

    @C.kernel_jit(BLOCK, C.ROW_RESIDENT)
    def forward(
        x,      # (M, NW) input rows, NW words of V elements
        res,    # (M, NW) residual added to x (fused add), or a dummy
        w,      # (N,) weight, or a dummy
        b,      # (N,) bias, or a dummy (always for RMSNorm)
        eps,    # scalar, accumulation dtype
        y,      # (M, NW) output, x's dtype
        s,      # (M, NW) output x + res in x's dtype (fused add), or a dummy
        mean,   # (M,) per-row mean, accumulation dtype (LayerNorm), or a dummy
        rstd,   # (M,) per-row 1/sqrt(var + eps) (RMSNorm: 1/sqrt(mean(x^2) + eps)); (0,): none stored
    ):
        NW = x.shape[1] // KW
        tid = cuda.threadIdx.x
        # bit operations, not % and //: they let the compiler see that indices are never
        # negative, which drops numba's wraparound code and folds each word's address
        # into an immediate offset
        t = tid & (TPR - 1)
        g = tid >> SHIFT
        scratch = cuda.shared.array((2, SUMS, SLOTS), ACC)
        ws = cuda.local.array(VPT, ACC)  # this thread's columns of weight and bias, loaded once
        bs = cuda.local.array(BS, ACC)
        PARAMS(w, b, ws, bs, t, NW * V)
        raw0 = cuda.local.array(RAWN, RAW)   # the raw words of the D rows loaded at once
        raw1 = cuda.local.array(RAWN1, RAW)
        raw2 = cuda.local.array(RAWN2, RAW)
        step = cuda.gridDim.x * R
        it = 0
        for base in range(cuda.blockIdx.x * R, x.shape[0], step * D):
            row = base + g
            FETCH(x, res, res, row, step, raw0, raw1, raw2, t, NW)
            it, out = ROWS(x, res, y, s, mean, rstd, row, step, raw0, raw1, raw2, ws, bs, eps, scratch, it, tid)
            # a row out of range, noted in bit 30 of the reductions' count (whose parity,
            # bit 0, picks their buffer): a flag register of its own across the loop made
            # ptxas issue a row's last load after the first wait (the SASS model)
            if RESCUED:
                it |= out << 30
        # the block's rows again where one of them left the range (``_post_fn``): rare
        if RESCUED and cuda.syncthreads_or(U32(it >> 30)) != 0:
            for base in range(cuda.blockIdx.x * R, x.shape[0], step):
                it = POST(x, res, w, b, y, s, mean, rstd, base + g, eps, scratch, it, tid)

    return _tag(forward, code, D, D * ARRAYS * VPT * np.dtype(xdt).itemsize)


# ---------------------------------------------------------------- forward, long rows

@functools.lru_cache(maxsize=None)
def _forward_loop_row_fn(kind, xdt, wdt, bdt, code, has_r):
    """``row(x, res, w, b, y, s, mean, rstd, row, stage, eps, scratch, it, tid)`` -> ``it``:
    one long row word by word: pass 1 (sums; s stored; the row copied to ``stage`` where
    it fits), the statistics (a second pass only for rows the shifted sums cannot
    serve), pass 3 (y), each pass after the first reading the staged copy."""
    GEOMETRY = stats.geometry_fn(xdt, code)
    LAYER, ACC = kind == "layer", C.acc_type(xdt)
    TPR, V, STAGED = code.tpr, code.vec, code.stage
    NORMALIZE = _normalize_words_fn(kind, xdt, wdt, bdt, code, STAGED)
    ROW_SUM = stats.row_sum_fn(xdt, TPR, V, not LAYER, has_r, STAGED, shifted=LAYER)
    FIRST = stats.first_fn(xdt, V, has_r)
    SHIFTED = stats.shifted_fn(xdt, TPR, V, V, True, STAGED)
    OUT = stats.rescue_fns(xdt, TPR, V, STAGED, squares=not LAYER)[0]
    VOTE = stats.vote_fn(TPR, code.rows)
    REDO = _redo_fn(kind, xdt, wdt, bdt, code, STAGED)
    RESCUED = stats.can_leave_range(xdt)

    @cuda.jit(device=True)
    def forward_loop_row(x, res, w, b, y, s, mean, rstd, row, stage, eps, scratch, it, tid):  # (the kernel's)
        M, NW, t, inv_n = GEOMETRY(x, tid)
        live = row < M
        rr = min(row, M - 1)
        xr = x[rr]
        ri = rr if has_r else 0
        xs = cuda.local.array(V, ACC)
        tmp = cuda.local.array(V, ACC)
        src = stage if STAGED else (s[ri] if has_r else xr)  # what passes 2 and 3 read
        if LAYER:
            k = FIRST(xr, res[ri], tmp)
            s1, s2 = ROW_SUM(xr, res[ri], s[ri], xs, tmp, live, t, NW, stage, k)
            mu, corr, r, it = SHIFTED(src, xs, live, t, NW, k, s1, s2, inv_n, eps, scratch, it, tid)
        else:
            total = ROW_SUM(xr, res[ri], s[ri], xs, tmp, live, t, NW, stage, ACC(0))[0]
            mu = corr = ACC(0)
            r = ACC(1) / math.sqrt(group_sum(total, scratch, it & 1, tid, TPR) * inv_n + eps)
            it += 1
        if live and t == 0 and row < rstd.shape[0]:
            if LAYER:
                mean[row] = mu + corr
            rstd[row] = r
        out = OUT(r, live)
        if live and (out == 0 or not RESCUED):  # (a row out of range is written by REDO alone: x may be y)
            NORMALIZE(src, y[rr], w, b, mu, corr, r, ACC(1), t, NW)
        if RESCUED and VOTE(out != 0):  # (a row whose statistics left the range: ``_redo_fn``)
            it = REDO(src, y[rr], w, b, mean, rstd, rr, out, t, NW, inv_n, eps, scratch, it, tid)
        return it

    return forward_loop_row


def forward_kernel_loop(kind, xdt, wdt, bdt, code, has_r):
    _, ACC, _, _, SHIFT = _consts(kind, xdt, code)
    R, BLOCK = code.rows, code.block
    SLOTS = slots(BLOCK)
    ST, STAGE_LEN = stats.stage_type(xdt, code.vec), 0 if code.stage else 1
    ROW = _forward_loop_row_fn(kind, xdt, wdt, bdt, code, has_r)

    @C.kernel_jit(BLOCK, C.ROW_RESIDENT)
    def forward(x, res, w, b, eps, y, s, mean, rstd):  # (the arguments of forward_kernel_held's kernel)
        tid = cuda.threadIdx.x
        scratch = cuda.shared.array((2, 2, SLOTS), ACC)
        # a long row's copy (x, or s when fused) in dynamic shared memory (the launch sizes
        # it), or one element never read: passes 2 and 3 read it there instead of global
        # memory (each thread its own words: no barrier)
        stage = cuda.shared.array(STAGE_LEN, ST)
        it = 0
        for row0 in range(cuda.blockIdx.x * R, x.shape[0], cuda.gridDim.x * R):
            it = ROW(x, res, w, b, y, s, mean, rstd, row0 + (tid >> SHIFT), stage, eps, scratch, it, tid)

    return _tag(forward, code, 1, (2 if has_r else 1) * code.vec * np.dtype(xdt).itemsize)


# ---------------------------------------------------------------- backward, rows in registers

@functools.lru_cache(maxsize=None)
def _grad_sums_fn(kind, xdt):
    """``grad_sums(x, wdy, mu, r, acc)``: one element's part of the backward's pass 1, added
    to acc[0:3]: LayerNorm: d = (x - mean) * rstd, d * wdy and wdy; RMSNorm: x * rstd * wdy
    into acc[1].  d in rstd's units, as xhat is: the sums of x - mean itself leave float32's
    range for a row near its largest values, whose rstd brings them back (an instruction an
    element; float16 rows, which cannot, ``stats.can_leave_range``, sum x - mean)."""
    LAYER, UNITS = kind == "layer", stats.can_leave_range(xdt)

    @cuda.jit(device=True)
    def grad_sums(x, wdy, mu, r, acc):
        if LAYER:
            d = (x - mu) * r if UNITS else x - mu
            acc[0] += d
            acc[1] += d * wdy
            acc[2] += wdy
        else:
            acc[1] += x * r * wdy

    return grad_sums


@functools.lru_cache(maxsize=None)
def _grad_dx_fn(kind):
    """``grad_dx(x, wdy, mu, r, cr, f, rf, c1f, c2f)`` -> ``(xhat, dx)``: one element's
    part of the backward's pass 2 (``cr``: the row's corr * r; ``f``, ``rf``:
    ``stats.grad_factors_fn``'s, with ``c1f``, ``c2f`` = c1 * f, c2 * f, taken once a row;
    dx before the fused residual's ds is added)."""
    LAYER = kind == "layer"

    @cuda.jit(device=True)
    def grad_dx(x, wdy, mu, r, cr, f, rf, c1f, c2f):
        if LAYER:
            xhat = (x - mu) * r - cr
            return xhat, (wdy * f - (xhat * c1f + c2f)) * rf
        xhat = x * r
        return xhat, (wdy * f - xhat * c1f) * rf

    return grad_dx


@functools.lru_cache(maxsize=None)
def _grad_redo_fn(kind, xdt, wdt, code, has_ds):
    """``redo(dy, x, ds, dx, w, mu, r, row, out, t, NW, inv_n, dw, scratch, it, tid)`` -> ``it``:
    the backward of a row whose reduced sums were not finite (``out``; the row pass
    took its rstd as 0, which adds nothing to dw, and leaves its dx to this), again from memory:
    x - mu halved where it overflows (d = (x - mu) * rstd is in rstd's units anyway), wdy
    scaled by ``stats.GRAD_RANGE``'s DOWN where its magnitudes sum past LIM, and dx = (wdy -
    (xhat * c1 + c2)) * rstd scaled back (the CPU's ``scaled_backward_row``).  Inf or NaN
    in the row stays NaN.  Every thread that voted calls it (two group reductions); a row
    not ``out`` sums nothing and writes nothing.  ``dw``: this thread's running sums of dy *
    xhat (registers path: by element, words t + k * tpr) or the block's partial row (loop
    path: by column)."""
    LAYER, ACC, _, WPT, _ = _consts(kind, xdt, code)
    TPR, V, LOOP = code.tpr, code.vec, code.loop
    has_w = wdt is not None
    LW, LOADW, STOREW, DOWN, UP, LIM, dev = stats.grad_redo_consts(xdt, wdt, ACC.name, V)

    @cuda.jit(device=True)
    def word(xr, dyr, dsr, dxr, w, q, mu, r, cr, c1, c2, sg, dw, e0):  # (redo's): dx of word q
        xs = cuda.local.array(V, ACC)
        gs = cuda.local.array(V, ACC)
        tmp = cuda.local.array(V, ACC)
        LOADW(xr, q, xs, 0)
        LOADW(dyr, q, gs, 0)
        if has_ds:
            LOADW(dsr, q, tmp, 0)
        for v in range(V):
            wdy = gs[v] * sg * (LW(w[q * V + v]) if has_w else ACC(1))
            xhat = dev(xs[v], mu, r) - cr if LAYER else xs[v] * r
            val = (wdy - (xhat * c1 + c2)) * r
            if sg != ACC(1):
                val *= UP
            tmp[v] = tmp[v] + val if has_ds else val
            dw[e0 + v] += gs[v] * xhat
        STOREW(dxr, q, tmp, 0)

    @cuda.jit(device=True)
    def redo(
        dy,       # (M, NW) gradient of y
        x,        # (M, NW) forward input
        ds,       # (M, NW) gradient added to dx (fused), or a dummy
        dx,       # (M, NW) output
        w,        # (N,) weight, or a dummy
        mu,       # scalar: the row's saved mean (LayerNorm)
        r,        # scalar: its saved rstd
        row,      # int: the row (valid where ``out``)
        out,      # bool: the row's sums were not finite
        t,        # int: thread within the row group
        NW,       # int: words per row
        inv_n,    # scalar: 1 / elements per row
        dw,       # (VPT,) running sums of dy * xhat by element (registers path), or (N,) by column (loop)
        scratch,  # (2, >= 3, slots) shared memory of the group sums
        it,       # int: group reductions so far (the scratch buffer alternates)
        tid,      # int: thread within the block
    ):
        xs = cuda.local.array(V, ACC)
        gs = cuda.local.array(V, ACC)
        u = U64(min(row, x.shape[0] - 1))
        xr, dyr, dxr = x[u], dy[u], dx[u]
        mag = ACC(0)
        if out:
            for q in range(t, NW, TPR):
                LOADW(dyr, q, gs, 0)
                for v in range(V):
                    mag += abs(gs[v] * ACC(DOWN) * (LW(w[q * V + v]) if has_w else ACC(1)))
        sg = ACC(DOWN) if group_sum(mag, scratch, it & 1, tid, TPR) > ACC(LIM * DOWN) else ACC(1)
        a0 = a1 = a2 = ACC(0)
        if out:
            for q in range(t, NW, TPR):
                LOADW(xr, q, xs, 0)
                LOADW(dyr, q, gs, 0)
                for v in range(V):
                    wdy = gs[v] * sg * (LW(w[q * V + v]) if has_w else ACC(1))
                    if LAYER:
                        d = dev(xs[v], mu, r)
                        a0 += d
                        a1 += d * wdy
                        a2 += wdy
                    else:
                        a1 += xs[v] * r * wdy
        if LAYER:
            a0, a1, a2 = group_sum3(a0, a1, a2, scratch, (it + 1) & 1, tid, TPR)
        else:
            a1 = group_sum(a1, scratch, (it + 1) & 1, tid, TPR)
        cr = a0 * inv_n
        c2 = a2 * inv_n
        c1 = a1 * inv_n - cr * c2
        if out:
            if LOOP:
                for q in range(t, NW, TPR):
                    word(xr, dyr, ds[u if has_ds else 0], dxr, w, q, mu, r, cr, c1, c2, sg, dw, q * V)
            else:
                for k in range(WPT):  # (dw by element: its indices fixed, dw stays in registers)
                    q = t + k * TPR
                    if q < NW:
                        word(xr, dyr, ds[u if has_ds else 0], dxr, w, q, mu, r, cr, c1, c2, sg, dw, k * V)
        return it + 2

    return redo


@functools.lru_cache(maxsize=None)
def _backward_sums_fn(kind, xdt, wdt, code):
    """``sums(raw, ws, mu, r, live, t, NW, v, at)``: this thread's part of pass 1 of a row
    held as its fetched words (x, then dy; widened word by word, as they are used):
    LayerNorm: v[at:at + 3] = the sums of d = (x - mean) * rstd, d * wdy and wdy; RMSNorm:
    v[at] = the sum of x * rstd * wdy (wdy = weight * dy; ``ws``: ``_weights_fn``'s)."""
    LAYER, ACC, _, WPT, _ = _consts(kind, xdt, code)
    TPR, V = code.tpr, code.vec
    WIDEN = C.raw_fns(xdt, ACC.name, V)[2]
    WORD = _weights_fn(xdt, wdt, code)[3]
    GRAD_SUMS = _grad_sums_fn(kind, xdt)

    @cuda.jit(device=True)
    def backward_sums(
        raw,    # (slots,) the row's fetched words: x, then dy
        ws,     # the weights of this thread's elements (``_weights_fn``)
        mu,     # scalar: the saved mean (LayerNorm)
        r,      # scalar: the saved rstd
        live,   # bool: the row exists
        t,      # int: thread within the row group
        NW,     # int: words per row
        v,      # (values,) output: this thread's sums, to be reduced
        at,     # int: where this row's sums go in v
    ):
        acc = cuda.local.array(3, ACC)   # this row's sums
        for i in range(3):
            acc[i] = ACC(0)
        xs = cuda.local.array(V, ACC)
        gs = cuda.local.array(V, ACC)
        wv = cuda.local.array(V, ACC)
        for k in range(WPT):
            # the words as loaded (past the row: word 0 again, ``stats.fetch_fn``, not summed)
            WIDEN(raw, k, xs, 0)
            WIDEN(raw, WPT + k, gs, 0)
            WORD(ws, k, wv)
            if live and t + k * TPR < NW:
                for e in range(V):
                    GRAD_SUMS(xs[e], gs[e] * wv[e], mu, r, acc)
        if LAYER:
            v[at] = acc[0]
            v[at + 1] = acc[1]
            v[at + 2] = acc[2]
        else:
            v[at] = acc[1]

    return backward_sums


@functools.lru_cache(maxsize=None)
def _dx_held_fn(kind, xdt, wdt, code, has_ds):
    """``dx_pass(dxr, dsr, raw, ws, dwa, dba, mu, cr, r, c1, c2, t, NW)``: pass 2 of a row
    held as its fetched words (widened again, word by word: the row stays in registers as
    loaded, half the registers of 16-bit rows widened): dx (``_grad_dx_fn``, + ds), and
    this thread's running sums of dy * xhat and dy for its columns."""
    LAYER, ACC, _, WPT, _ = _consts(kind, xdt, code)
    TPR, V = code.tpr, code.vec
    LOADW, STOREW = C.word_fns(xdt, ACC.name, V)
    WIDEN = C.raw_fns(xdt, ACC.name, V)[2]
    WORD = _weights_fn(xdt, wdt, code)[3]
    GRAD_DX = _grad_dx_fn(kind)
    FACTORS = stats.grad_factors_fn(ACC.name)

    @cuda.jit(device=True)
    def dx_pass(
        dxr,    # (NW,) output words of the row's dx
        dsr,    # (NW,) words of ds (fused), else unread
        raw,    # (slots,) the row's fetched words: x, then dy
        ws,     # the weights of this thread's elements (``_weights_fn``)
        dwa,    # (VPT,) running sums of dy * xhat, per column
        dba,    # (VPT,) running sums of dy, per column (LayerNorm; a view of shared memory)
        mu,     # scalar: the saved mean (LayerNorm)
        cr,     # scalar: mean(x - mean) * rstd
        r,      # scalar: the saved rstd
        c1,     # scalar: mean(xhat * wdy)
        c2,     # scalar: mean(wdy) (LayerNorm)
        t,      # int: thread within the row group
        NW,     # int: words per row
    ):
        xs = cuda.local.array(V, ACC)
        gs = cuda.local.array(V, ACC)
        wv = cuda.local.array(V, ACC)
        tmp = cuda.local.array(V, ACC)
        f, rf = FACTORS(r)
        c1f, c2f = c1 * f, c2 * f  # once a row (``_grad_dx_fn``)
        for k in range(WPT):
            q = t + k * TPR
            if q < NW:
                WIDEN(raw, k, xs, 0)
                WIDEN(raw, WPT + k, gs, 0)
                WORD(ws, k, wv)
                if has_ds:
                    LOADW(dsr, q, tmp, 0)
                for v in range(V):
                    e = k * V + v
                    xhat, val = GRAD_DX(xs[v], gs[v] * wv[v], mu, r, cr, f, rf, c1f, c2f)
                    tmp[v] = tmp[v] + val if has_ds else val
                    dwa[e] += gs[v] * xhat
                    if LAYER:
                        dba[e] += gs[v]
                STOREW(dxr, q, tmp, 0)

    return dx_pass


@functools.lru_cache(maxsize=None)
def _grad_post_fn(kind, xdt, wdt, code, has_ds):
    """``post(dy, x, ds, dx, mean, rstd, w, row, dwa, scratch, it, tid)`` -> ``it``: the
    registers path's pass after its rows, in a block where one was noted (``stats.grad_noted_fn``):
    a row whose dx holds NaN (the note's mark: element 0 read back) and whose sums, taken
    again from memory as the row pass took them, are not finite, redone (``_grad_redo_fn``;
    a row whose dx is NaN for another reason is left as it is, its dw counted once).
    Every thread of the block calls it for each of its row group's rows, one at a time."""
    LAYER, ACC = kind == "layer", C.acc_type(xdt)
    TPR, V = code.tpr, code.vec
    has_w = wdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    LOADW = C.word_fns(xdt, ACC.name, V)[0]
    GEOMETRY = stats.geometry_fn(xdt, code)
    GRAD_SUMS = _grad_sums_fn(kind, xdt)
    NOTED = stats.grad_noted_fn(xdt)
    REDO = _grad_redo_fn(kind, xdt, wdt, code, has_ds)

    @cuda.jit(device=True)
    def post(dy, x, ds, dx, mean, rstd, w, row, dwa, scratch, it, tid):  # (the kernel's; dwa: REDO's dw)
        M, NW, t, inv_n = GEOMETRY(x, tid)
        u = U64(min(row, M - 1))
        xs = cuda.local.array(V, ACC)
        gs = cuda.local.array(V, ACC)
        acc = cuda.local.array(3, ACC)
        for i in range(3):
            acc[i] = ACC(0)
        LOADW(dx[u], 0, xs, 0)
        marked = row < M and xs[0] != xs[0]
        mu = mean[u] if LAYER else ACC(0)
        r = rstd[u]
        if marked:
            for q in range(t, NW, TPR):
                LOADW(x[u], q, xs, 0)
                LOADW(dy[u], q, gs, 0)
                for v in range(V):
                    GRAD_SUMS(xs[v], gs[v] * LW(w[q * V + v]) if has_w else gs[v], mu, r, acc)
        if LAYER:
            d0, d1, d2 = group_sum3(acc[0], acc[1], acc[2], scratch, it & 1, tid, TPR)
            c2 = d2 * inv_n
            c1 = d1 * inv_n - d0 * inv_n * c2   # (``_backward_rows_fn``'s finish)
        else:
            c1 = group_sum(acc[1], scratch, it & 1, tid, TPR) * inv_n
            c2 = ACC(0)
        return REDO(dy, x, ds, dx, w, mu, r, u, marked and NOTED(c1, c2), t, NW, inv_n, dwa, scratch, it + 1, tid)

    return post

@functools.lru_cache(maxsize=None)
def _backward_rows_fn(kind, xdt, wdt, code, has_ds, rows):
    """``backward_rows(dy, x, ds, dx, row, step, raw0, raw1, raw2, st, ws, dwa, dba, scratch,
    it, tid)`` -> ``it``: ``rows`` (1-3) rows ``row, row + step, ...`` of a row group, from
    their fetched words and saved statistics (``st``: mean, rstd of each): pass 1 of every
    row, one group reduction for all of them, then pass 2 of each.  (Every row's words
    are read before the reduction's first barrier, so ptxas issues all their loads before
    the first wait.)"""
    GEOMETRY = stats.geometry_fn(xdt, code)
    LAYER, ACC = kind == "layer", C.acc_type(xdt)
    TPR, V = code.tpr, code.vec
    NV = 3 if LAYER else 1  # values reduced per row
    NVALS = NV * rows
    SUMS = _backward_sums_fn(kind, xdt, wdt, code)
    GROUP = group_sums_fn(NVALS)
    DX = _dx_held_fn(kind, xdt, wdt, code, has_ds)
    UNITS = stats.can_leave_range(xdt)  # (``_grad_sums_fn``'s d in rstd's units)
    NOTED = stats.grad_noted_fn(xdt)

    @cuda.jit(device=True)
    def finish(dx, ds, row, raw, mu, r, v, at, ws, dwa, dba, t, NW):  # -> the row is to be redone
        if row < dx.shape[0]:
            inv_n = ACC(1) / ACC(NW * V)
            if LAYER:
                c2 = v[at + 2] * inv_n
                if UNITS:
                    cr = v[at] * inv_n   # corr * rstd, never recovered as cr / rstd (rstd may be 0)
                    c1 = v[at + 1] * inv_n - cr * c2
                else:
                    corr = v[at] * inv_n
                    c1 = (v[at + 1] * inv_n - corr * c2) * r
                    cr = corr * r
            else:
                cr = c2 = ACC(0)
                c1 = v[at] * inv_n
            bad = NOTED(c1, c2)
            if bad:  # (redone after the block's rows, ``_grad_post_fn``: xhat 0 here, dw unchanged)
                mu = r = cr = ACC(0)
            DX(dx[row], ds[row if has_ds else 0], raw, ws, dwa, dba, mu, cr, r, c1, c2, t, NW)
            return bad
        return False

    @cuda.jit(device=True)
    def backward_rows(dy, x, ds, dx, row, step, raw0, raw1, raw2, st, ws, dwa, dba, scratch, it, tid):  # (kernel's)
        M, NW, t, _ = GEOMETRY(x, tid)
        v = cuda.local.array(NVALS, ACC)
        SUMS(raw0, ws, st[0], st[1], row < M, t, NW, v, 0)
        if rows > 1:
            SUMS(raw1, ws, st[2], st[3], row + step < M, t, NW, v, NV)
        if rows > 2:
            SUMS(raw2, ws, st[4], st[5], row + 2 * step < M, t, NW, v, 2 * NV)
        GROUP(v, scratch, it & 1, tid, TPR)
        bad = finish(dx, ds, row, raw0, st[0], st[1], v, 0, ws, dwa, dba, t, NW)
        if rows > 1:
            bad |= finish(dx, ds, row + step, raw1, st[2], st[3], v, NV, ws, dwa, dba, t, NW)
        if rows > 2:
            bad |= finish(dx, ds, row + 2 * step, raw2, st[4], st[5], v, 2 * NV, ws, dwa, dba, t, NW)
        return it + 1, bad

    return backward_rows


@functools.lru_cache(maxsize=None)
def _saved_fn(kind, xdt):
    """``saved(mean, rstd, row, st, at)``: the loads of a row's saved mean (LayerNorm; else
    0) and rstd into st[at], st[at + 1], fetched with the row's words."""
    LAYER, ACC = kind == "layer", C.acc_type(xdt)

    @cuda.jit(device=True)
    def saved(mean, rstd, row, st, at):
        rr = min(row, rstd.shape[0] - 1)
        st[at] = mean[rr] if LAYER else ACC(0)
        st[at + 1] = rstd[rr]

    return saved


@functools.lru_cache(maxsize=None)
def _partials_fn(kind, xdt, code):
    """``partials(part, dwa, dbs, tid)``: the epilogue of the registers path: the block's
    partial rows of dweight (and dbias) from its threads' running sums (``dwa`` in
    registers; LayerNorm's sums of dy in shared memory, ``dbs[g, e, t]`` for element e
    of thread t of row group g); the R row groups of a block hold partials of the same
    columns, added in group order through shared memory (no atomics: the same bits
    every run)."""
    LAYER, ACC, _, _, SHIFT = _consts(kind, xdt, code)
    TPR, VPT, V, R, BLOCK = code.tpr, code.vpt, code.vec, code.rows, code.block
    COLS = TPR * VPT  # columns a row group holds
    SV, ST = V.bit_length() - 1, TPR.bit_length() - 1

    @cuda.jit(device=True)
    def partials(
        part,   # (K, grid, N) output: this block's row of each
        dwa,    # (VPT,) this thread's running sums of dy * xhat
        dbs,    # (R, VPT, TPR) the row groups' running sums of dy (LayerNorm), else unread
        tid,    # int: thread within the block
    ):
        N = part.shape[2]
        t = tid & (TPR - 1)
        g = tid >> SHIFT
        dwp = part[0, cuda.blockIdx.x]
        dbp = part[1 if LAYER else 0, cuda.blockIdx.x]
        if R == 1:
            for e in range(VPT):
                j = (t + (e // V) * TPR) * V + e % V
                if j < N:
                    dwp[j] = dwa[e]
                    if LAYER:
                        dbp[j] = dbs[0, e, t]
            return
        sh = cuda.shared.array((R, COLS), ACC)
        for e in range(VPT):
            sh[g, (t + (e // V) * TPR) * V + e % V] = dwa[e]
        cuda.syncthreads()
        for j in range(tid, min(N, COLS), BLOCK):
            a = sh[0, j]
            for gg in range(1, R):
                a += sh[gg, j]
            dwp[j] = a
            if LAYER:
                q = j >> SV                                   # the word of column j:
                e = ((q >> ST) << SV) + (j & (V - 1))         # element e of thread q mod TPR
                bb = dbs[0, e, q & (TPR - 1)]
                for gg in range(1, R):
                    bb += dbs[gg, e, q & (TPR - 1)]
                dbp[j] = bb

    return partials


def backward_kernel_held(kind, xdt, wdt, code, has_ds):
    LAYER, ACC, KW, _, SHIFT = _consts(kind, xdt, code)
    TPR, V, R, BLOCK, VPT = code.tpr, code.vec, code.rows, code.block, code.vpt
    SLOTS = slots(BLOCK)
    RAW, RAWN, D = stats.raw_rows(xdt, code, 2)   # x and dy (ds is read in pass 2)
    RAWN1, RAWN2 = (RAWN if D > 1 else 1), (RAWN if D > 2 else 1)
    SUMS = (3 if LAYER else 1) * D  # values a group reduction sums at once
    DBS = (R, VPT, TPR) if LAYER else (1, 1, 1)
    WS, WSN, WEIGHTS, _ = _weights_fn(xdt, wdt, code)
    FETCH = stats.fetch_rows_fn(xdt, code, 2, D)
    SAVED = _saved_fn(kind, xdt)
    ROWS = _backward_rows_fn(kind, xdt, wdt, code, has_ds, D)
    PARTIALS = _partials_fn(kind, xdt, code)
    POST = _grad_post_fn(kind, xdt, wdt, code, has_ds)
    RESCUED = stats.can_leave_range(xdt)

    @C.kernel_jit(BLOCK, C.ROW_RESIDENT)
    def backward(
        dy,     # (M, NW) gradient of y, x's dtype, NW words of V elements
        x,      # (M, NW) forward input
        mean,   # (M,) saved mean, accumulation dtype (LayerNorm), or a dummy
        rstd,   # (M,) saved rstd, accumulation dtype
        w,      # (N,) weight, or a dummy (ones)
        ds,     # (M, NW) gradient added to dx (fused residual), or a dummy
        dx,     # (M, NW) output: gradient of x, x's dtype
        part,   # (K, grid, N) output: per-block sums of dy * xhat (and of dy)
    ):
        NW = x.shape[1] // KW
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        g = tid >> SHIFT
        scratch = cuda.shared.array((2, SUMS, SLOTS), ACC)
        ws = cuda.local.array(WSN, WS)       # this thread's columns of the weight, loaded once
        dwa = cuda.local.array(VPT, ACC)    # running sum of dy * xhat, per column
        # the running sums of dy per column in shared memory (each thread its own: no
        # barrier), which leaves the registers to two rows of x and dy
        dbs = cuda.shared.array(DBS, ACC)
        dba = dbs[g if LAYER else 0, :, t if LAYER else 0]
        WEIGHTS(w, ws, t, NW * V)
        for e in range(VPT):
            dwa[e] = ACC(0)
            if LAYER:
                dba[e] = ACC(0)
        raw0 = cuda.local.array(RAWN, RAW)   # the raw words of the D rows loaded at once
        raw1 = cuda.local.array(RAWN1, RAW)
        raw2 = cuda.local.array(RAWN2, RAW)
        st = cuda.local.array(6, ACC)        # ... and their saved mean and rstd
        step = cuda.gridDim.x * R
        it = 0
        for base in range(cuda.blockIdx.x * R, x.shape[0], step * D):
            row = base + g
            FETCH(x, dy, dy, row, step, raw0, raw1, raw2, t, NW)
            for d in range(D):
                SAVED(mean, rstd, row + d * step, st, 2 * d)
            it, out = ROWS(dy, x, ds, dx, row, step, raw0, raw1, raw2, st, ws, dwa, dba, scratch, it, tid)
            # a row to redo, noted in bit 30 of the reductions' count (the forward's way)
            if RESCUED:
                it |= out << 30
        # the block's rows again where one of them left the range (``_grad_post_fn``): rare
        if RESCUED and cuda.syncthreads_or(U32(it >> 30)) != 0:
            for base in range(cuda.blockIdx.x * R, x.shape[0], step):
                it = POST(dy, x, ds, dx, mean, rstd, w, base + g, dwa, scratch, it, tid)
        PARTIALS(part, dwa, dbs, tid)

    return _tag(backward, code, D, D * 2 * VPT * np.dtype(xdt).itemsize)


# ---------------------------------------------------------------- backward, long rows

@functools.lru_cache(maxsize=None)
def _backward_loop_row_fn(kind, xdt, wdt, code, has_ds):
    """``row(dy, x, ds, dx, mean, rstd, w, dwp, dbp, row, sx, sdy, scratch, it, tid)`` ->
    ``it``: one long row word by word: pass 1 (x and dy copied to ``sx``/``sdy`` where
    they fit), the group reduction, pass 2 (dx, and this thread's columns of the block's
    partial rows ``dwp``/``dbp`` added to in place: the rows in order, one thread a column)."""
    GEOMETRY = stats.geometry_fn(xdt, code)
    LAYER, ACC = kind == "layer", C.acc_type(xdt)
    TPR, V, STAGED = code.tpr, code.vec, code.stage
    has_w = wdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    LOADW, STOREW = C.word_fns(xdt, ACC.name, V)
    COPY, _, GET = stats.stage_fns(xdt, ACC.name, V)
    GRAD_SUMS = _grad_sums_fn(kind, xdt)
    GRAD_DX = _grad_dx_fn(kind)
    FACTORS = stats.grad_factors_fn(ACC.name)
    UNITS = RESCUED = stats.can_leave_range(xdt)  # (``_grad_sums_fn``'s d in rstd's units)
    NOTED = stats.grad_noted_fn(xdt)
    VOTE = stats.vote_fn(TPR, code.rows)
    REDO = _grad_redo_fn(kind, xdt, wdt, code, has_ds)

    @cuda.jit(device=True)
    def backward_loop_row(dy, x, ds, dx, mean, rstd, w, dwp, dbp, row, sx, sdy, scratch, it, tid):  # (kernel's)
        M, NW, t, inv_n = GEOMETRY(x, tid)
        live = row < M
        rr = min(row, M - 1)
        xr = x[rr]
        dyr = dy[rr]
        mu = mean[rr] if LAYER else ACC(0)
        r = rstd[rr]
        xs = cuda.local.array(V, ACC)
        gs = cuda.local.array(V, ACC)
        tmp = cuda.local.array(V, ACC)
        acc = cuda.local.array(3, ACC)
        for i in range(3):
            acc[i] = ACC(0)
        if live:
            for q in range(t, NW, TPR):
                if STAGED:
                    COPY(xr, q, sx)
                    COPY(dyr, q, sdy)
                    GET(sx, q, xs, 0)
                    GET(sdy, q, gs, 0)
                else:
                    LOADW(xr, q, xs, 0)
                    LOADW(dyr, q, gs, 0)
                for v in range(V):
                    GRAD_SUMS(xs[v], gs[v] * LW(w[q * V + v]) if has_w else gs[v], mu, r, acc)
        dsum, xw, c2 = acc[0], acc[1], acc[2]
        if LAYER:
            dsum, xw, c2 = group_sum3(dsum, xw, c2, scratch, it & 1, tid, TPR)
            c2 *= inv_n
            if UNITS:
                cr = dsum * inv_n    # corr * rstd (``_grad_sums_fn``), never recovered as cr / rstd
                c1 = xw * inv_n - cr * c2
            else:
                corr = dsum * inv_n
                c1 = (xw * inv_n - corr * c2) * r
                cr = corr * r
        else:
            cr = c2 = ACC(0)
            c1 = group_sum(xw, scratch, it & 1, tid, TPR) * inv_n
        it += 1
        bad = NOTED(c1, c2)
        mu_s, r_s = mu, r
        if bad:  # (redone after pass 2, ``_grad_redo_fn``: xhat 0 here, dw unchanged)
            mu = r = cr = ACC(0)
        if live:
            dxr = dx[rr]
            dsr = ds[rr if has_ds else 0]
            f, rf = FACTORS(r)
            c1f, c2f = c1 * f, c2 * f  # once a row (``_grad_dx_fn``)
            for q in range(t, NW, TPR):
                if STAGED:
                    GET(sx, q, xs, 0)
                    GET(sdy, q, gs, 0)
                else:
                    LOADW(xr, q, xs, 0)
                    LOADW(dyr, q, gs, 0)
                if has_ds:
                    LOADW(dsr, q, tmp, 0)
                for v in range(V):
                    j = q * V + v
                    wdy = gs[v] * LW(w[j]) if has_w else gs[v]
                    xhat, val = GRAD_DX(xs[v], wdy, mu, r, cr, f, rf, c1f, c2f)
                    tmp[v] = tmp[v] + val if has_ds else val
                    dwp[j] += gs[v] * xhat
                    if LAYER:
                        dbp[j] += gs[v]
                STOREW(dxr, q, tmp, 0)
        if RESCUED and VOTE(bad):  # (a row whose sums left the range, or held Inf or NaN)
            it = REDO(dy, x, ds, dx, w, mu_s, r_s, rr, bad, t, NW, inv_n, dwp, scratch, it, tid)
        return it

    return backward_loop_row


def backward_kernel_loop(kind, xdt, wdt, code, has_ds):
    LAYER, ACC, _, _, SHIFT = _consts(kind, xdt, code)
    R, BLOCK, TPR = code.rows, code.block, code.tpr
    SLOTS = slots(BLOCK)
    K = 2 if LAYER else 1
    STAGED = code.stage
    ST, STAGE_LEN = stats.stage_type(xdt, code.vec), 0 if STAGED else 1
    ROW = _backward_loop_row_fn(kind, xdt, wdt, code, has_ds)

    @C.kernel_jit(BLOCK, C.ROW_RESIDENT)
    def backward(dy, x, mean, rstd, w, ds, dx, part):  # (the arguments of backward_kernel_held's kernel)
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        blk = cuda.blockIdx.x
        scratch = cuda.shared.array((2, 3, SLOTS), ACC)
        # a long row's x and dy in dynamic shared memory (the launch sizes it), or one element
        # never read: pass 2 reads them there (each thread its own words: no barrier)
        stage = cuda.shared.array(STAGE_LEN, ST)
        sx = stage[:x.shape[1]] if STAGED else stage
        sdy = stage[x.shape[1]:] if STAGED else stage
        # the block's partial rows live in `part` itself
        dwp = part[0, blk]
        dbp = part[K - 1, blk]
        for j in range(t, part.shape[2], TPR):
            dwp[j] = ACC(0)
            dbp[j] = ACC(0)
        # zeroed by element, added to by word (another thread's columns): with a warp per
        # row no barrier of the reductions orders the two (zeroing by word took more registers)
        cuda.syncthreads()
        it = 0
        for row0 in range(blk * R, x.shape[0], cuda.gridDim.x * R):
            it = ROW(dy, x, ds, dx, mean, rstd, w, dwp, dbp, row0 + (tid >> SHIFT), sx, sdy, scratch, it, tid)

    return _tag(backward, code, 1, 2 * code.vec * np.dtype(xdt).itemsize)


def forward(kind, x, weight, bias, eps, y, mean, rstd, residual=None, s=None, stream=0):
    """Fill ``y``, ``rstd`` (and ``mean``, LayerNorm) for the rows of ``x``.

    x, y: (M, N) C-contiguous device arrays of x's dtype; weight, bias: (N,) any
    float dtype or None (bias and mean: None for RMSNorm); mean, rstd: (M,)
    float32 (float64 for float64 x), or ``C.Unkept`` (a plain call's: not stored).
    ``residual``/``s`` (both or neither): normalize
    ``s = x + residual``, stored into ``s``.  ``stream``: where the kernel runs.
    """
    M, N = x.shape
    if M == 0:
        return
    vec = C.vec_width(N, x, y, residual, s)
    cfg = C.row_config(M, N, x.dtype == C.F64, vec, C.ROW_RESIDENT, x.dtype.itemsize, 1)  # x (or s) staged
    kern = forward_kernel(kind, np.dtype(x.dtype), C.dtype_or_none(weight), C.dtype_or_none(bias), cfg.code,
                          residual is not None)
    xe, xk = C.kview(x), C.words(x, vec)  # elements (dummy parameters), words (rows)
    C.launch(kern, cfg.grid, cfg.block, stream, xk, C.optional(residual, xk, 2, vec), C.optional(weight, xe, 1),
             C.optional(bias, xe, 1), np.dtype(rstd.dtype).type(eps), C.words(y, vec),
             C.optional(s, xk, 2, vec), C.optional(mean if mean is None else C.stored(mean), rstd, 1), C.stored(rstd),
             shared=cfg.shared)


def backward(kind, dy, x, mean, rstd, weight, dx, dweight, dbias, ds=None, stream=0, empty=None):
    """Fill ``dx`` (M, N) and ``dweight`` (and ``dbias``, LayerNorm) (N,), of any float
    dtype (summed in the accumulation dtype, rounded once as stored); ``mean``/``dbias``
    None for RMSNorm.

    ``ds`` (M, N) or None is added to ``dx`` (the fused residual's gradient).  ``empty``:
    the allocator of the partial sums, ``(shape, dtype) -> device array`` (the call's:
    the backend passes the caller's library's; None: numba's).
    """
    M, N = x.shape
    acc = C.F64 if x.dtype == C.F64 else C.F32
    K = 2 if kind == "layer" else 1
    empty = empty or C.device_empty
    if M == 0:
        C.column_sums(empty((K, 0, N), acc), dweight, dbias, stream)
        return
    vec = C.vec_width(N, x, dy, dx, ds)
    cfg = C.row_config(M, N, x.dtype == C.F64, vec, C.ROW_RESIDENT, x.dtype.itemsize, 2)  # x and dy staged
    part = empty((K, cfg.grid, N), acc)
    kern = backward_kernel(kind, np.dtype(x.dtype), C.dtype_or_none(weight), cfg.code, ds is not None)
    xe, xk = C.kview(x), C.words(x, vec)
    C.launch(kern, cfg.grid, cfg.block, stream, C.words(dy, vec), xk, C.optional(mean, rstd, 1), rstd,
             C.optional(weight, xe, 1), C.optional(ds, xk, 2, vec), C.words(dx, vec), part, shared=cfg.shared)
    C.column_sums(part, dweight, dbias, stream)
