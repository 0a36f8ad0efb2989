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
    y    = ((x - mu) - corr) * rstd * weight + bias

RMSNorm (``kind='rms'``): ``rstd = 1 / sqrt(sum(x^2) / N + eps)`` in pass 1,
``y = x * rstd * weight``.

The row mapping (a thread group per row, the row in registers where it fits,
moved in 16- or 8-byte words of ``vec`` elements where the rows allow) is described in
``common``; the statistics passes are ``stats`` (shared with GroupNorm), the
group reductions ``reduce``.  Kernels are specialized by
closure constants (kind, dtypes, mapping, which optional arrays exist), so the
other kind's code, absent weight/bias/residual cost nothing (numba prunes the
branches on them); absent arrays are passed as one-element dummies that are
never read.  Where the two kinds' arithmetic differs, each keeps its own exact
expression (the bits of both are as they were before they shared a kernel).

Backward (RMSNorm: mean = corr = 0, c2 = 0, no dbias):

    corr = mean(x - mean)       the saved float32 mean's rounding (1e-3 at a mean
                                of 1e4: 5% of the std in the contract's
                                large-offset case), corrected as in the forward
    xhat = ((x - mean) - corr) * rstd,  wdy = weight * dy
    c1 = mean(xhat * wdy) = (mean((x - mean) * wdy) - corr * c2) * rstd
    c2 = mean(wdy)                                  (one 3-value group reduction)
    dx = (wdy - (xhat * c1 + c2)) * rstd  (+ ds, the fused residual's gradient)

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
from .reduce import group_sum, group_sum3, slots

KINDS = ("layer", "rms")


@functools.lru_cache(maxsize=None)
def forward_kernel(kind, xdt, wdt, bdt, code, has_r):
    """The forward kernel of ``kind`` for x of ``xdt``, weight/bias of ``wdt``/``bdt``
    (None: absent), the mapping ``code`` (``RowConfig.code``), fused residual or not."""
    assert kind in KINDS
    LAYER = kind == "layer"
    ACC = C.acc_type(xdt)
    LOADW, STOREW = C.word_fns(xdt, ACC.name, code.vec)
    has_w, has_b = wdt is not None, bdt is not None and LAYER
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    LB = C.load_fn(xdt if bdt is None else bdt, ACC.name)
    TPR, VPT, V, R, LOOP, BLOCK = code.tpr, code.vpt, code.vec, code.rows, code.loop, code.block
    WPT = VPT // V                    # words per thread
    KW = C.u64_per_word(xdt, V)
    SHIFT = TPR.bit_length() - 1
    SLOTS = slots(BLOCK)
    STAGED = code.stage
    ST = stats.stage_type(xdt, V)
    ROW_SUM = stats.row_sum_fn(xdt, TPR, VPT, V, LOOP, not LAYER, has_r, STAGED, shifted=LAYER)
    FIRST = stats.first_fn(xdt, V, has_r)
    SHIFTED = stats.shifted_fn(xdt, TPR, VPT, V, LOOP, STAGED)
    READW = stats.stage_fns(xdt, ACC.name, V)[2] if STAGED else LOADW  # passes 2 and 3 of a long row

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
        rstd,   # (M,) per-row 1/sqrt(var + eps) (RMSNorm: 1/sqrt(mean(x^2) + eps))
    ):
        M = x.shape[0]
        NW = x.shape[1] // KW          # words per row (KW uint64 each)
        N = NW * V
        tid = cuda.threadIdx.x
        # bit operations, not % and //: they let the compiler see that indices
        # are never negative, which drops numba's wraparound code and folds each
        # word's address into an immediate offset (107 -> 55 registers for the
        # N=1024 float16 forward, sm_90, before the launch bounds)
        t = tid & (TPR - 1)            # thread within the row group
        g = tid >> SHIFT               # row group within the block
        zero = ACC(0)
        inv_n = ACC(1) / ACC(N)
        scratch = cuda.shared.array((2, 2, SLOTS), ACC)
        xs = cuda.local.array(VPT, ACC)     # this thread's elements of the row
        ws = cuda.local.array(VPT, ACC)     # ... of weight and bias, loaded once
        bs = cuda.local.array(VPT, ACC)
        tmp = cuda.local.array(V, ACC)      # one word in flight
        # a long row's copy (x, or s when fused) in dynamic shared memory (the launch
        # sizes it: a row's kernel elements, or none): passes 2 and 3 read it there
        # instead of global memory (each thread its own words: no barrier)
        if STAGED:
            stage = cuda.shared.array(0, ST)
        else:
            stage = cuda.shared.array(1, ST)  # never read
        if not LOOP:
            for e in range(VPT):
                j = (t + (e // V) * TPR) * V + e % V
                ws[e] = LW(w[j]) if has_w and j < N else ACC(1)
                bs[e] = LB(b[j]) if has_b and j < N else zero
        it = 0
        for row0 in range(cuda.blockIdx.x * R, M, cuda.gridDim.x * R):
            row = row0 + g
            live = row < M
            rr = min(row, M - 1)       # a valid row for the views of dead rows
            xr = x[rr]
            yr = y[rr]
            resr = res[rr if has_r else 0]
            sr = s[rr if has_r else 0]
            # pass 1: the sums of x - k and their squares, k the mean of the row's first
            # word (RMSNorm: of x^2), and, fused, s = x + res stored once
            src = stage if STAGED else (sr if has_r else xr)   # what passes 2 and 3 read
            if LAYER:
                k = FIRST(xr, resr, tmp)
                s1, s2 = ROW_SUM(xr, resr, sr, xs, tmp, live, t, NW, stage, k)
                # one group reduction (a second pass only for rows it cannot serve)
                mu, corr, r, it = SHIFTED(src, xs, live, t, NW, k, s1, s2, inv_n, eps, scratch, it, tid)
                if live and t == 0:
                    mean[row] = mu + corr
                    rstd[row] = r
            else:
                total = ROW_SUM(xr, resr, sr, xs, tmp, live, t, NW, stage)
                mu = zero
                corr = zero
                sq = group_sum(total, scratch, it & 1, tid, TPR)
                it += 1
                r = ACC(1) / math.sqrt(sq * inv_n + eps)
                if live and t == 0:
                    rstd[row] = r
            # pass 3: y.  (x - mu) - corr, never x - (mu + corr): mu + corr rounds
            # to the float32 grid, 1e-3 at a mean of 1e4 (a tenth of the std in
            # the contract's large-offset case)
            if live:
                if LOOP:
                    for q in range(t, NW, TPR):
                        READW(src, q, xs, 0)
                        for v in range(V):
                            val = ((xs[v] - mu) - corr) * r if LAYER else xs[v] * r
                            if has_w:
                                val *= LW(w[q * V + v])
                            if has_b:
                                val += LB(b[q * V + v])
                            tmp[v] = val
                        STOREW(yr, q, tmp, 0)
                else:
                    for k in range(WPT):
                        q = t + k * TPR
                        if q < NW:
                            for v in range(V):
                                e = k * V + v
                                if LAYER:
                                    tmp[v] = ((xs[e] - mu) - corr) * r * ws[e] + bs[e]
                                else:
                                    tmp[v] = xs[e] * r * ws[e]
                            STOREW(yr, q, tmp, 0)

    return forward


@functools.lru_cache(maxsize=None)
def backward_kernel(kind, xdt, wdt, code, has_ds):
    """The backward kernel of ``kind`` (see ``forward_kernel``); ``has_ds``: the fused
    residual's gradient is added to dx."""
    assert kind in KINDS
    LAYER = kind == "layer"
    ACC = C.acc_type(xdt)
    LOADW, STOREW = C.word_fns(xdt, ACC.name, code.vec)
    has_w = wdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    TPR, VPT, V, R, LOOP, BLOCK = code.tpr, code.vpt, code.vec, code.rows, code.loop, code.block
    WPT = VPT // V
    KW = C.u64_per_word(xdt, V)
    SHIFT = TPR.bit_length() - 1
    SLOTS = slots(BLOCK)
    COLS = TPR * VPT  # columns a row group holds in registers
    K = 2 if LAYER else 1  # partial rows: dweight (and dbias)
    STAGED = code.stage
    ST = stats.stage_type(xdt, V)
    COPY, _, GET = stats.stage_fns(xdt, ACC.name, V)

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
        M = x.shape[0]
        NW = x.shape[1] // KW          # words per row (KW uint64 each)
        N = NW * V
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        g = tid >> SHIFT
        blk = cuda.blockIdx.x
        zero = ACC(0)
        inv_n = ACC(1) / ACC(N)
        scratch = cuda.shared.array((2, 3, SLOTS), ACC)
        xs = cuda.local.array(VPT, ACC)
        gs = cuda.local.array(VPT, ACC)
        ws = cuda.local.array(VPT, ACC)
        dwa = cuda.local.array(VPT, ACC)    # running sum of dy * xhat, per column
        dba = cuda.local.array(VPT, ACC)    # running sum of dy, per column (LayerNorm)
        tmp = cuda.local.array(V, ACC)
        # a long row's x and dy in dynamic shared memory (the launch sizes it: two rows'
        # kernel elements, or none): pass 2 reads them there (each thread its own words: no barrier)
        if STAGED:
            stage = cuda.shared.array(0, ST)
            sx = stage[:x.shape[1]]
            sdy = stage[x.shape[1]:]
        else:
            sx = sdy = cuda.shared.array(1, ST)  # never read
        dwp = part[0, blk]
        dbp = part[K - 1, blk]
        if LOOP:
            # long rows: the block's partial row lives in `part` itself
            for j in range(t, N, TPR):
                dwp[j] = zero
                dbp[j] = zero
        else:
            for e in range(VPT):
                j = (t + (e // V) * TPR) * V + e % V
                ws[e] = LW(w[j]) if has_w and j < N else ACC(1)
                dwa[e] = zero
                dba[e] = zero
        it = 0
        for row0 in range(blk * R, M, cuda.gridDim.x * R):
            row = row0 + g
            live = row < M
            rr = min(row, M - 1)
            xr = x[rr]
            dyr = dy[rr]
            dxr = dx[rr]
            dsr = ds[rr if has_ds else 0]
            mu = mean[rr] if LAYER else zero
            r = rstd[rr]
            # pass 1: corr = mean(x - mean), c1 = mean(xhat * wdy), c2 = mean(wdy)
            dsum = zero
            xw = zero
            c2 = zero
            if LOOP:
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
                            wdy = gs[v] * LW(w[q * V + v]) if has_w else gs[v]
                            if LAYER:
                                d = xs[v] - mu
                                dsum += d
                                xw += d * wdy
                                c2 += wdy
                            else:
                                xw += xs[v] * r * wdy
            else:
                for k in range(WPT):
                    q = t + k * TPR
                    if live and q < NW:
                        LOADW(xr, q, xs, k * V)
                        LOADW(dyr, q, gs, k * V)
                        if LAYER:
                            for v in range(V):
                                e = k * V + v
                                wdy = gs[e] * ws[e]
                                d = xs[e] - mu
                                dsum += d
                                xw += d * wdy
                                c2 += wdy
                    elif not LAYER:
                        for v in range(V):
                            xs[k * V + v] = zero
                            gs[k * V + v] = zero
                    if not LAYER:
                        for v in range(V):
                            e = k * V + v
                            xw += xs[e] * r * (gs[e] * ws[e])
            if LAYER:
                dsum, xw, c2 = group_sum3(dsum, xw, c2, scratch, it & 1, tid, TPR)
                corr = dsum * inv_n
                c2 *= inv_n
                c1 = (xw * inv_n - corr * c2) * r
            else:
                corr = zero
                c1 = group_sum(xw, scratch, it & 1, tid, TPR) * inv_n
            it += 1
            # pass 2: dx, and this thread's columns of dweight/dbias
            if live:
                if LOOP:
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
                            xhat = ((xs[v] - mu) - corr) * r if LAYER else xs[v] * r
                            wdy = gs[v] * LW(w[j]) if has_w else gs[v]
                            val = (wdy - (xhat * c1 + c2)) * r if LAYER else (wdy - xhat * c1) * r
                            tmp[v] = tmp[v] + val if has_ds else val
                            # the block's rows are visited in order by the one
                            # thread owning column j: a deterministic running sum
                            dwp[j] += gs[v] * xhat
                            if LAYER:
                                dbp[j] += gs[v]
                        STOREW(dxr, q, tmp, 0)
                else:
                    for k in range(WPT):
                        q = t + k * TPR
                        if q < NW:
                            if has_ds:
                                LOADW(dsr, q, tmp, 0)
                            for v in range(V):
                                e = k * V + v
                                if LAYER:
                                    xhat = ((xs[e] - mu) - corr) * r
                                    wdy = gs[e] * ws[e]
                                    val = (wdy - (xhat * c1 + c2)) * r
                                else:
                                    xhat = xs[e] * r
                                    val = (gs[e] * ws[e] - xhat * c1) * r
                                tmp[v] = tmp[v] + val if has_ds else val
                                dwa[e] += gs[e] * xhat
                                dba[e] += gs[e]
                            STOREW(dxr, q, tmp, 0)
        if LOOP:
            return
        if R == 1:
            for e in range(VPT):
                j = (t + (e // V) * TPR) * V + e % V
                if j < N:
                    dwp[j] = dwa[e]
                    if LAYER:
                        dbp[j] = dba[e]
        else:
            # the R row groups of the block hold partials of the same columns:
            # add them in group order through shared memory
            sh = cuda.shared.array((K, R, COLS), ACC)
            for e in range(VPT):
                j = (t + (e // V) * TPR) * V + e % V
                sh[0, g, j] = dwa[e]
                sh[K - 1, g, j] = dba[e] if LAYER else dwa[e]
            cuda.syncthreads()
            for j in range(tid, min(N, COLS), BLOCK):
                a = sh[0, 0, j]
                bb = sh[K - 1, 0, j]
                for gg in range(1, R):
                    a += sh[0, gg, j]
                    bb += sh[K - 1, gg, j]
                dwp[j] = a
                if LAYER:
                    dbp[j] = bb

    return backward


def forward(kind, x, weight, bias, eps, y, mean, rstd, residual=None, s=None, stream=0):
    """Fill ``y``, ``rstd`` (and ``mean``, LayerNorm) for the rows of ``x``.

    x, y: (M, N) C-contiguous device arrays of x's dtype; weight, bias: (N,) any
    float dtype or None (bias and mean: None for RMSNorm); mean, rstd: (M,)
    float32 (float64 for float64 x).  ``residual``/``s`` (both or neither): normalize
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
             C.optional(s, xk, 2, vec), C.optional(mean, rstd, 1), rstd, shared=cfg.shared)


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
