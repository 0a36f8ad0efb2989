"""GroupNorm (and InstanceNorm, one channel per group) on the GPU.

x is seen as (N, C, S) with S the product of the spatial dimensions and the C
channels split into G groups of Cg = C/G channels.  A group's L = Cg*S elements
are contiguous, so the forward treats each (sample, group) as a row of length L,
maps it onto a thread group exactly like ``layer_norm`` (``common``) and takes
its statistics with LayerNorm's own device functions (``stats``): the
group in registers when it fits, a loop (per channel, so no division per
element) when it does not -- in typical convolutional nets L is tens of
thousands and one block works on each group.

    mean, rstd over x[n, g*Cg:(g+1)*Cg, :]      (corrected two-pass)
    y[n, c, :] = ((x[n, c, :] - mean) - corr) * (rstd * weight[c]) + bias[c]

never ``x * a + (bias - mean * a)``: folding the mean into the offset cancels
catastrophically when |mean| >> std.

Backward, in three kernels (the dx of a group needs sums over all its channels):

1. per (n, c) row of S elements: A = sum(dy * (x - mean)), B = sum(dy) and
   D = sum(x - mean);
2. per (n, c) row, from its group's Cg rows of sums (one 3-value reduction):
   corr = sum(D) / L corrects the saved float32 mean's rounding (as in
   ``layer_norm``), dyx = rstd * (A - corr * B) = sum(dy * xhat) is this row's
   dweight partial, c1 = sum(weight * dyx) / L, c2 = sum(weight * B) / L, and
   dx = (weight * dy - (xhat * c1 + c2)) * rstd with xhat = ((x - mean) - corr) * rstd;
3. dweight/dbias = the fixed-order column sums of dyx/B over the samples.

x and dy are read twice (kernels 1 and 2): five passes over memory where three
would do if a whole group fitted on chip -- a fused version is future work.
"""

import functools

import numpy as np
from numba import cuda

from . import common as C
from . import stats
from .reduce import group_sum3, slots


@functools.lru_cache(maxsize=None)
def _forward_kernel(xdt, wdt, bdt, cfg):
    ACC = C.acc_type(xdt)
    LOADW, STOREW = C.word_fns(xdt, ACC.name, cfg.vec)
    has_w, has_b = wdt is not None, bdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    LB = C.load_fn(xdt if bdt is None else bdt, ACC.name)
    TPR, VPT, V, R, LOOP, BLOCK = cfg.tpr, cfg.vpt, cfg.vec, cfg.rows, cfg.loop, cfg.block
    WPT = VPT // V
    SHIFT = TPR.bit_length() - 1
    SLOTS = slots(BLOCK)
    I32 = cuda.int32
    # the statistics of a (sample, group) are a LayerNorm row's
    ROW_SUM = stats.row_sum_fn(xdt, TPR, VPT, V, LOOP, False, False)
    CENTERED = stats.centered_fn(xdt, TPR, VPT, V, LOOP)

    @C.kernel_jit(BLOCK, C.ROW_RESIDENT)  # the row mapping's 16 elements, weight and bias per thread
    def forward(
        x,      # (N*G, LW) input, one row of LW words of V elements per (sample, group)
        w,      # (C,) per-channel weight, or a dummy
        b,      # (C,) per-channel bias, or a dummy
        eps,    # scalar, accumulation dtype
        S,      # int: elements per channel (product of the spatial dims), a multiple of V
        G,      # int: groups per sample
        y,      # (N*G, LW) output, x's dtype
        mean,   # (N*G,) per-(sample, group) mean, accumulation dtype
        rstd,   # (N*G,) per-(sample, group) 1/sqrt(var + eps), accumulation dtype
    ):
        M = x.shape[0]
        NW = x.shape[1]
        L = NW * V
        Cg = L // S
        SW = S // V                      # words per channel
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        g = tid >> SHIFT
        zero = ACC(0)
        inv_n = ACC(1) / ACC(L)
        scratch = cuda.shared.array((2, 2, SLOTS), ACC)
        xs = cuda.local.array(VPT, ACC)
        tmp = cuda.local.array(V, ACC)
        ch = cuda.local.array(VPT, I32)  # channel within the group of each element
        if not LOOP:
            for e in range(VPT):
                ch[e] = ((t + (e // V) * TPR) * V + e % V) // S
        for row0 in range(cuda.blockIdx.x * R, M, cuda.gridDim.x * R):
            row = row0 + g
            live = row < M
            rr = min(row, M - 1)
            xr = x[rr]
            yr = y[rr]
            c0 = (rr % G) * Cg           # first channel of this group
            total = ROW_SUM(xr, xr, xr, xs, tmp, live, t, NW, xr)
            mu, corr, r = CENTERED(xr, xs, live, t, NW, total, inv_n, eps, scratch, tid)
            if live and t == 0:
                mean[row] = mu + corr
                rstd[row] = r
            if live:
                if LOOP:
                    for cc in range(Cg):
                        c = c0 + cc
                        a = r * LW(w[c]) if has_w else r
                        bc = LB(b[c]) if has_b else zero
                        for qs in range(t, SW, TPR):
                            q = cc * SW + qs
                            LOADW(xr, q, xs, 0)
                            for v in range(V):
                                tmp[v] = ((xs[v] - mu) - corr) * a + bc
                            STOREW(yr, q, tmp, 0)
                else:
                    # the row mapping's resident-word loop, as row_norm's; the body differs (weight by channel)
                    for k in range(WPT):
                        q = t + k * TPR
                        if q < NW:
                            for v in range(V):
                                e = k * V + v
                                c = c0 + ch[e]
                                a = r * LW(w[c]) if has_w else r
                                bc = LB(b[c]) if has_b else zero
                                tmp[v] = ((xs[e] - mu) - corr) * a + bc
                            STOREW(yr, q, tmp, 0)

    return forward


# The two backward kernels open alike (thread group, scratch, word buffers, row loop):
# a kernel allocates its own shared and local arrays, so each keeps its preamble.
@functools.lru_cache(maxsize=None)
def _channel_sums_kernel(xdt, cfg):
    ACC = C.acc_type(xdt)
    LOADW = C.word_fns(xdt, ACC.name, cfg.vec)[0]
    TPR, V, R, BLOCK = cfg.tpr, cfg.vec, cfg.rows, cfg.block
    SHIFT = TPR.bit_length() - 1
    SLOTS = slots(BLOCK)

    @C.kernel_jit(BLOCK)
    def channel_sums(
        dy,     # (N*C, SW) gradient of y, one row of SW words per (sample, channel)
        x,      # (N*C, SW) forward input
        mean,   # (N*G,) saved mean
        Cg,     # int: channels per group
        part,   # (4, N*C) output rows 1-3: sum(dy), sum(dy * (x - mean)), sum(x - mean)
    ):
        M = x.shape[0]
        SW = x.shape[1]
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        zero = ACC(0)
        scratch = cuda.shared.array((2, 3, SLOTS), ACC)
        xs = cuda.local.array(V, ACC)
        gs = cuda.local.array(V, ACC)
        it = 0
        for row0 in range(cuda.blockIdx.x * R, M, cuda.gridDim.x * R):
            row = row0 + (tid >> SHIFT)
            live = row < M
            rr = min(row, M - 1)
            xr = x[rr]
            dyr = dy[rr]
            mu = mean[rr // Cg]          # group n * G + g, as row = n * C + g * Cg + c
            dys = zero
            dyd = zero
            dsum = zero
            if live:
                for q in range(t, SW, TPR):
                    LOADW(xr, q, xs, 0)
                    LOADW(dyr, q, gs, 0)
                    for v in range(V):
                        d = xs[v] - mu
                        dys += gs[v]
                        dyd += gs[v] * d
                        dsum += d
            dys, dyd, dsum = group_sum3(dys, dyd, dsum, scratch, it & 1, tid, TPR)
            it += 1
            if live and t == 0:
                part[1, row] = dys
                part[2, row] = dyd
                part[3, row] = dsum

    return channel_sums


@functools.lru_cache(maxsize=None)
def _dx_kernel(xdt, wdt, cfg):
    ACC = C.acc_type(xdt)
    LOADW, STOREW = C.word_fns(xdt, ACC.name, cfg.vec)
    has_w = wdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    TPR, V, R, BLOCK = cfg.tpr, cfg.vec, cfg.rows, cfg.block
    SHIFT = TPR.bit_length() - 1
    SLOTS = slots(BLOCK)

    @C.kernel_jit(BLOCK)
    def dx_kernel(
        dy,     # (N*C, SW) gradient of y, one row of SW words per (sample, channel)
        x,      # (N*C, SW) forward input
        mean,   # (N*G,) saved mean
        rstd,   # (N*G,) saved rstd
        w,      # (C,) weight, or a dummy (ones)
        Cg,     # int: channels per group
        part,   # (4, N*C) rows 1-3 from channel_sums; row 0 output: sum(dy * xhat)
        dx,     # (N*C, SW) output: gradient of x
    ):
        M = x.shape[0]
        SW = x.shape[1]
        C_ = w.shape[0] if has_w else Cg  # channels (only used with a weight)
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        zero = ACC(0)
        inv_n = ACC(1) / ACC(Cg * SW * V)
        scratch = cuda.shared.array((2, 3, SLOTS), ACC)
        xs = cuda.local.array(V, ACC)
        gs = cuda.local.array(V, ACC)
        it = 0
        for row0 in range(cuda.blockIdx.x * R, M, cuda.gridDim.x * R):
            row = row0 + (tid >> SHIFT)
            live = row < M
            rr = min(row, M - 1)
            grp = rr // Cg
            first = grp * Cg             # the row of the group's first channel
            c = rr % C_                  # this row's channel
            c0 = c - (rr - first)        # the group's first channel
            mu = mean[grp]
            r = rstd[grp]
            # over the group's channels: sum(w * A), sum(w * B), sum(D)
            swa = zero
            swb = zero
            sd = zero
            for cc in range(t, Cg, TPR):
                wc = LW(w[c0 + cc]) if has_w else ACC(1)
                swb += wc * part[1, first + cc]
                swa += wc * part[2, first + cc]
                sd += part[3, first + cc]
            swa, swb, sd = group_sum3(swa, swb, sd, scratch, it & 1, tid, TPR)
            it += 1
            corr = sd * inv_n
            c2 = swb * inv_n
            c1 = (swa - corr * swb) * r * inv_n
            if live:
                if t == 0:  # this row's own slot: no other row group reads it
                    part[0, rr] = r * (part[2, rr] - corr * part[1, rr])
                xr = x[rr]
                dyr = dy[rr]
                dxr = dx[rr]
                wr = (LW(w[c]) if has_w else ACC(1)) * r
                for q in range(t, SW, TPR):
                    LOADW(xr, q, xs, 0)
                    LOADW(dyr, q, gs, 0)
                    for v in range(V):
                        xhat = ((xs[v] - mu) - corr) * r
                        gs[v] = gs[v] * wr - (xhat * c1 + c2) * r
                    STOREW(dxr, q, gs, 0)

    return dx_kernel


def forward(x, weight, bias, eps, y, mean, rstd, *, stream=0):
    """Fill ``y`` (N, C, S) and ``mean``/``rstd`` (N, G) for group norm, on ``stream``."""
    n, c, S = x.shape
    G = mean.shape[1]
    if n == 0:
        return
    L = (c // G) * S
    # words must not straddle channels: the per-channel loop steps over S
    vec = C.vec_width(S, x, y, max_bytes=8)
    cfg = C.row_config(n * G, L, x.dtype == C.F64, vec, C.ROW_RESIDENT)
    kern = _forward_kernel(np.dtype(x.dtype), C.dtype_or_none(weight), C.dtype_or_none(bias), cfg.code)
    xe = C.kview(x)
    C.launch(kern, cfg.grid, cfg.block, stream, C.words(x.reshape(n * G, L), vec), C.optional(weight, xe, 1),
             C.optional(bias, xe, 1), np.dtype(mean.dtype).type(eps), S, G,
             C.words(y.reshape(n * G, L), vec), mean.reshape(n * G), rstd.reshape(n * G))


def backward(dy, x, mean, rstd, weight, dx, dweight, dbias, *, stream=0, empty=None):
    """Fill ``dx`` (N, C, S) and ``dweight``/``dbias`` (C,) of any float dtype, on ``stream``;
    the partial sums from ``empty`` (as ``row_norm.backward``'s)."""
    n, c, S = x.shape
    G = mean.shape[1]
    acc = C.F64 if x.dtype == C.F64 else C.F32  # dweight/dbias: any float dtype (column_sums)
    # rows: sum(dy * xhat) and sum(dy) (the dweight/dbias partials, summed over
    # samples at the end), then sum(dy * (x - mean)) and sum(x - mean)
    part = (empty or C.device_empty)((4, n, c), acc)
    if n:
        xdt = np.dtype(x.dtype)
        vec = C.vec_width(S, x, dy, dx, max_bytes=8)
        cfg = C.row_config(n * c, S, xdt == C.F64, vec)
        xk = C.words(x.reshape(n * c, S), vec)
        dyk = C.words(dy.reshape(n * c, S), vec)
        m1, p1 = mean.reshape(n * G), part.reshape(4, n * c)
        C.launch(_channel_sums_kernel(xdt, cfg.code), cfg.grid, cfg.block, stream, dyk, xk, m1, c // G, p1)
        C.launch(_dx_kernel(xdt, C.dtype_or_none(weight), cfg.code), cfg.grid, cfg.block, stream, dyk, xk, m1,
                 rstd.reshape(n * G), C.optional(weight, C.kview(x), 1), c // G, p1,
                 C.words(dx.reshape(n * c, S), vec))
    C.column_sums(part[0:2], dweight, dbias, stream)
