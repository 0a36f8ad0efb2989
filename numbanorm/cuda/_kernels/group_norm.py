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
so that its second and third passes do not read global memory again.

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
would do if a whole group fitted on chip -- a fused version is future work.  A
(sample, channel) row of up to 8192 elements is held in registers: each thread loads
all its words of x and dy before it uses any.
"""

import functools

import numpy as np
from numba import cuda

from . import common as C
from . import stats
from .reduce import group_sum3, slots


def _consts(xdt, code):
    ACC = C.acc_type(xdt)
    return ACC, C.u64_per_word(xdt, code.vec), code.vpt // code.vec, code.tpr.bit_length() - 1


def _tag(kern, code, rows, loads):
    """``kern`` with what ``benchmarks.gpu_model`` checks its SASS against (``row_norm._tag``)."""
    kern.mapping, kern.rows_in_flight, kern.loads_in_flight = code, rows, loads
    return kern


@functools.lru_cache(maxsize=None)
def _forward_kernel(xdt, wdt, bdt, code):
    """The forward kernel for x of ``xdt``, weight/bias of ``wdt``/``bdt`` (None: absent)
    and the mapping ``code`` of a (sample, group) row: held in registers, or a loop."""
    return (_forward_loop if code.loop else _forward_held)(xdt, wdt, bdt, code)


@functools.lru_cache(maxsize=None)
def _group_row_fn(xdt, wdt, bdt, code):
    """``row(x, w, b, y, mean, rstd, row, raw, chw, Cg, G, eps, scratch, tid)``: one (sample,
    group) row held in registers from its fetched words: the statistics (corrected
    two-pass), y, and the statistics stored."""
    ACC, KW, WPT, _ = _consts(xdt, code)
    TPR, VPT, V = code.tpr, code.vpt, code.vec
    has_w, has_b = wdt is not None, bdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    LB = C.load_fn(xdt if bdt is None else bdt, ACC.name)
    STOREW = C.word_fns(xdt, ACC.name, V)[1]
    SUMS = stats.held_sums_fn(xdt, TPR, VPT, V, False, False)
    CENTERED = stats.centered_fn(xdt, TPR, VPT, V, False)

    @cuda.jit(device=True)
    def group_row(x, w, b, y, mean, rstd, row, raw, chw, Cg, G, eps, scratch, tid):  # (the kernel's; chw: channel of each word)
        M = x.shape[0]
        NW = x.shape[1] // KW
        t = tid & (TPR - 1)
        live = row < M
        rr = min(row, M - 1)
        xs = cuda.local.array(VPT, ACC)
        tmp = cuda.local.array(V, ACC)
        aw = cuda.local.array(WPT, ACC)   # the weight and bias of each word's channel
        bw = cuda.local.array(WPT, ACC)
        total = SUMS(raw, xs, tmp, live, t, NW, ACC(0))[0]
        c0 = (rr % G) * Cg                # the group's first channel
        for k in range(WPT):              # (loaded before the reductions wait)
            inside = t + k * TPR < NW
            aw[k] = LW(w[c0 + chw[k]]) if has_w and inside else ACC(1)
            bw[k] = LB(b[c0 + chw[k]]) if has_b and inside else ACC(0)
        mu, corr, r = CENTERED(x[rr], xs, live, t, NW, total, ACC(1) / ACC(NW * V), eps, scratch, tid)
        if live and t == 0:
            mean[row] = mu + corr
            rstd[row] = r
        if live:
            for k in range(WPT):
                q = t + k * TPR
                if q < NW:
                    a = r * aw[k]
                    for v in range(V):
                        tmp[v] = ((xs[k * V + v] - mu) - corr) * a + bw[k]
                    STOREW(y[rr], q, tmp, 0)

    return group_row


def _forward_held(xdt, wdt, bdt, code):
    ACC, KW, WPT, SHIFT = _consts(xdt, code)
    TPR, V, R, BLOCK = code.tpr, code.vec, code.rows, code.block
    SLOTS = slots(BLOCK)
    RAW, RAWN, D = stats.raw_rows(xdt, code, 1)
    RAWN1, RAWN2 = (RAWN if D > 1 else 1), (RAWN if D > 2 else 1)
    I32 = cuda.int32
    FETCH = stats.fetch_rows_fn(xdt, code, 1)
    ROW = _group_row_fn(xdt, wdt, bdt, code)

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
        rstd,   # (N*G,) per-(sample, group) 1/sqrt(var + eps), accumulation dtype
    ):
        NW = x.shape[1] // KW
        Cg = (NW * V) // S
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        scratch = cuda.shared.array((2, 2, SLOTS), ACC)
        chw = cuda.local.array(WPT, I32)  # channel within the group of each of the thread's words
        for k in range(WPT):
            chw[k] = ((t + k * TPR) * V) // S
        raw0 = cuda.local.array(RAWN, RAW)   # the raw words of the D rows loaded at once
        raw1 = cuda.local.array(RAWN1, RAW)
        raw2 = cuda.local.array(RAWN2, RAW)
        step = cuda.gridDim.x * R
        for base in range(cuda.blockIdx.x * R, x.shape[0], step * D):
            row = base + (tid >> SHIFT)
            FETCH(x, x, x, row, raw0, t, NW)
            if D > 1:
                FETCH(x, x, x, row + step, raw1, t, NW)
            if D > 2:
                FETCH(x, x, x, row + 2 * step, raw2, t, NW)
            ROW(x, w, b, y, mean, rstd, row, raw0, chw, Cg, G, eps, scratch, tid)
            if D > 1:
                ROW(x, w, b, y, mean, rstd, row + step, raw1, chw, Cg, G, eps, scratch, tid)
            if D > 2:
                ROW(x, w, b, y, mean, rstd, row + 2 * step, raw2, chw, Cg, G, eps, scratch, tid)

    return _tag(forward, code, D, D * code.vpt * np.dtype(xdt).itemsize)


@functools.lru_cache(maxsize=None)
def _group_loop_row_fn(xdt, wdt, bdt, code):
    """``row(x, w, b, y, mean, rstd, row, stage, Cg, G, eps, scratch, tid)``: one long
    (sample, group) row, per channel: pass 1 (the row copied to ``stage`` where it fits),
    pass 2 (deviations) and y from the staged copy, or from global memory again."""
    ACC, KW, WPT, _ = _consts(xdt, code)
    TPR, V, STAGED = code.tpr, code.vec, code.stage
    has_w, has_b = wdt is not None, bdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    LB = C.load_fn(xdt if bdt is None else bdt, ACC.name)
    STOREW = C.word_fns(xdt, ACC.name, V)[1]
    READW = stats.stage_fns(xdt, ACC.name, V)[2] if STAGED else C.word_fns(xdt, ACC.name, V)[0]
    ROW_SUM = stats.row_sum_fn(xdt, TPR, V, False, False, STAGED)
    CENTERED = stats.centered_fn(xdt, TPR, V, V, True, STAGED)

    @cuda.jit(device=True)
    def group_loop_row(x, w, b, y, mean, rstd, row, stage, Cg, G, eps, scratch, tid):  # (the kernel's)
        M = x.shape[0]
        NW = x.shape[1] // KW
        t = tid & (TPR - 1)
        live = row < M
        rr = min(row, M - 1)
        xr = x[rr]
        xs = cuda.local.array(V, ACC)
        tmp = cuda.local.array(V, ACC)
        total = ROW_SUM(xr, xr, xr, xs, tmp, live, t, NW, stage, ACC(0))[0]
        src = stage if STAGED else xr
        mu, corr, r = CENTERED(src, xs, live, t, NW, total, ACC(1) / ACC(NW * V), eps, scratch, tid)
        if live and t == 0:
            mean[row] = mu + corr
            rstd[row] = r
        if live:
            yr = y[rr]
            SW = NW // Cg                 # words per channel
            c0 = (rr % G) * Cg
            for cc in range(Cg):
                a = r * LW(w[c0 + cc]) if has_w else r
                bc = LB(b[c0 + cc]) if has_b else ACC(0)
                for qs in range(t, SW, TPR):
                    q = cc * SW + qs
                    READW(src, q, xs, 0)
                    for v in range(V):
                        tmp[v] = ((xs[v] - mu) - corr) * a + bc
                    STOREW(yr, q, tmp, 0)

    return group_loop_row


def _forward_loop(xdt, wdt, bdt, code):
    ACC, KW, WPT, SHIFT = _consts(xdt, code)
    V, R, BLOCK, STAGED = code.vec, code.rows, code.block, code.stage
    SLOTS = slots(BLOCK)
    ST = stats.stage_type(xdt, code.vec)
    ROW = _group_loop_row_fn(xdt, wdt, bdt, code)

    @C.kernel_jit(BLOCK, C.ROW_RESIDENT)
    def forward(x, w, b, eps, S, G, y, mean, rstd):  # (the arguments of _forward_held's kernel)
        Cg = ((x.shape[1] // KW) * V) // S
        tid = cuda.threadIdx.x
        scratch = cuda.shared.array((2, 2, SLOTS), ACC)
        # a long group's copy in dynamic shared memory (the launch sizes it, or none)
        if STAGED:
            stage = cuda.shared.array(0, ST)
        else:
            stage = cuda.shared.array(1, ST)  # never read
        for row0 in range(cuda.blockIdx.x * R, x.shape[0], cuda.gridDim.x * R):
            ROW(x, w, b, y, mean, rstd, row0 + (tid >> SHIFT), stage, Cg, G, eps, scratch, tid)

    return _tag(forward, code, 1, code.vec * np.dtype(xdt).itemsize)


# ---------------------------------------------------------------- backward

@functools.lru_cache(maxsize=None)
def _channel_sums_kernel(xdt, code):
    """Kernel 1: the sums of each (sample, channel) row, held in registers (each thread
    loads all its words of x and dy first) or word by word."""
    ACC, KW, WPT, SHIFT = _consts(xdt, code)
    TPR, V, R, BLOCK, LOOP = code.tpr, code.vec, code.rows, code.block, code.loop
    SLOTS = slots(BLOCK)
    SUMS = _channel_row_sums_fn(xdt, code)
    RAW, RAWN, _ = stats.raw_rows(xdt, code, 2, C.MIN_RESIDENT)
    RAWN = 1 if LOOP else RAWN
    FETCH = stats.fetch_rows_fn(xdt, code, 2)

    @C.kernel_jit(BLOCK)
    def channel_sums(
        dy,     # (N*C, SW) gradient of y, one row of SW words per (sample, channel)
        x,      # (N*C, SW) forward input
        mean,   # (N*G,) saved mean
        Cg,     # int: channels per group
        part,   # (4, N*C) output rows 1-3: sum(dy), sum(dy * (x - mean)), sum(x - mean)
    ):
        M = x.shape[0]
        NW = x.shape[1] // KW
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        scratch = cuda.shared.array((2, 3, SLOTS), ACC)
        raw = cuda.local.array(RAWN, RAW)
        it = 0
        for row0 in range(cuda.blockIdx.x * R, M, cuda.gridDim.x * R):
            row = row0 + (tid >> SHIFT)
            live = row < M
            rr = min(row, M - 1)
            if not LOOP:
                FETCH(x, dy, dy, row, raw, t, NW)
            mu = mean[rr // Cg]          # group n * G + g, as row = n * C + g * Cg + c
            dys, dyd, dsum = SUMS(x[rr], dy[rr], raw, mu, live, t, NW)
            dys, dyd, dsum = group_sum3(dys, dyd, dsum, scratch, it & 1, tid, TPR)
            it += 1
            if live and t == 0:
                part[1, row] = dys
                part[2, row] = dyd
                part[3, row] = dsum

    return _tag(channel_sums, code, 1, 2 * code.vpt * np.dtype(xdt).itemsize)


@functools.lru_cache(maxsize=None)
def _channel_row_sums_fn(xdt, code):
    """``sums(xr, dyr, raw, mu, live, t, NW)`` -> this thread's sum(dy), sum(dy * (x - mu)),
    sum(x - mu) over a (sample, channel) row: from its fetched words (registers path),
    or loaded word by word."""
    ACC, KW, WPT, _ = _consts(xdt, code)
    TPR, V, LOOP = code.tpr, code.vec, code.loop
    LOADW = C.word_fns(xdt, ACC.name, V)[0]
    WIDEN = C.raw_fns(xdt, ACC.name, V)[2]

    @cuda.jit(device=True)
    def word_sums(xs, gs, mu, acc):
        for v in range(V):
            d = xs[v] - mu
            acc[0] += gs[v]
            acc[1] += gs[v] * d
            acc[2] += d

    @cuda.jit(device=True)
    def channel_row_sums(
        xr,     # (SW,) words of x's row (loop path), else unread
        dyr,    # (SW,) ... of dy
        raw,    # (slots,) the row's fetched words, x then dy (registers path)
        mu,     # scalar: the group's saved mean
        live,   # bool: the row exists
        t,      # int: thread within the row group
        NW,     # int: words per row
    ):
        xs = cuda.local.array(V, ACC)
        gs = cuda.local.array(V, ACC)
        acc = cuda.local.array(3, ACC)
        for i in range(3):
            acc[i] = ACC(0)
        if LOOP:
            if live:
                for q in range(t, NW, TPR):
                    LOADW(xr, q, xs, 0)
                    LOADW(dyr, q, gs, 0)
                    word_sums(xs, gs, mu, acc)
        else:
            for k in range(WPT):
                if live and t + k * TPR < NW:
                    WIDEN(raw, k, xs, 0)
                    WIDEN(raw, WPT + k, gs, 0)
                    word_sums(xs, gs, mu, acc)
        return acc[0], acc[1], acc[2]

    return channel_row_sums


@functools.lru_cache(maxsize=None)
def _group_sums_fn(xdt, wdt, code):
    """``group(w, part, rr, Cg, C_, r, inv_n, scratch, it, tid)`` -> ``(corr, c1, c2, it)``:
    from the channel sums of row ``rr``'s group (kernel 1), in one 3-value reduction."""
    ACC, KW, WPT, _ = _consts(xdt, code)
    TPR = code.tpr
    has_w = wdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)

    @cuda.jit(device=True)
    def group_sums(
        w,        # (C,) weight, or a dummy (ones)
        part,     # (4, N*C) rows 1-3 from channel_sums
        rr,       # int: the (sample, channel) row
        Cg,       # int: channels per group
        C_,       # int: channels (with a weight)
        r,        # scalar: the group's saved rstd
        inv_n,    # scalar: 1 / elements per group
        scratch,  # (2, 3, slots) shared memory of the group sums
        it,       # int: group reductions so far (the scratch buffer alternates)
        tid,      # int: thread within the block
    ):
        t = tid & (TPR - 1)
        first = (rr // Cg) * Cg          # the row of the group's first channel
        c0 = rr % C_ - (rr - first)      # the group's first channel
        # over the group's channels: sum(w * A), sum(w * B), sum(D)
        swa = ACC(0)
        swb = ACC(0)
        sd = ACC(0)
        for cc in range(t, Cg, TPR):
            wc = LW(w[c0 + cc]) if has_w else ACC(1)
            swb += wc * part[1, first + cc]
            swa += wc * part[2, first + cc]
            sd += part[3, first + cc]
        swa, swb, sd = group_sum3(swa, swb, sd, scratch, it & 1, tid, TPR)
        corr = sd * inv_n
        return corr, (swa - corr * swb) * r * inv_n, swb * inv_n, it + 1

    return group_sums


@functools.lru_cache(maxsize=None)
def _dx_row_fn(xdt, code):
    """``dx_row(xr, dyr, dxr, raw, mu, corr, r, wr, c1, c2, live, t, NW)``: dx of one (sample,
    channel) row, from its fetched words (registers path) or loaded word by word."""
    ACC, KW, WPT, _ = _consts(xdt, code)
    TPR, V, LOOP = code.tpr, code.vec, code.loop
    LOADW, STOREW = C.word_fns(xdt, ACC.name, V)
    WIDEN = C.raw_fns(xdt, ACC.name, V)[2]

    @cuda.jit(device=True)
    def word_dx(xs, gs, mu, corr, r, wr, c1, c2):
        for v in range(V):
            xhat = ((xs[v] - mu) - corr) * r
            gs[v] = gs[v] * wr - (xhat * c1 + c2) * r

    @cuda.jit(device=True)
    def dx_row(
        xr,     # (SW,) words of x's row (loop path), else unread
        dyr,    # (SW,) ... of dy
        dxr,    # (SW,) output words of dx's row
        raw,    # (slots,) the row's fetched words, x then dy (registers path)
        mu,     # scalar: the group's saved mean
        corr,   # scalar: mean(x - mean) over the group
        r,      # scalar: the group's saved rstd
        wr,     # scalar: the channel's weight times r
        c1,     # scalar
        c2,     # scalar
        t,      # int: thread within the row group
        NW,     # int: words per row
    ):
        xs = cuda.local.array(V, ACC)
        gs = cuda.local.array(V, ACC)
        if LOOP:
            for q in range(t, NW, TPR):
                LOADW(xr, q, xs, 0)
                LOADW(dyr, q, gs, 0)
                word_dx(xs, gs, mu, corr, r, wr, c1, c2)
                STOREW(dxr, q, gs, 0)
        else:
            for k in range(WPT):
                q = t + k * TPR
                if q < NW:
                    WIDEN(raw, k, xs, 0)
                    WIDEN(raw, WPT + k, gs, 0)
                    word_dx(xs, gs, mu, corr, r, wr, c1, c2)
                    STOREW(dxr, q, gs, 0)

    return dx_row


@functools.lru_cache(maxsize=None)
def _dx_kernel(xdt, wdt, code):
    """Kernel 2: dx (and this row's dweight partial) of each (sample, channel) row, its
    words fetched before its group's sums are reduced (registers path)."""
    ACC, KW, WPT, SHIFT = _consts(xdt, code)
    TPR, V, R, BLOCK, LOOP = code.tpr, code.vec, code.rows, code.block, code.loop
    SLOTS = slots(BLOCK)
    has_w = wdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    RAW, RAWN, _ = stats.raw_rows(xdt, code, 2, C.MIN_RESIDENT)
    RAWN = 1 if LOOP else RAWN
    FETCH = stats.fetch_rows_fn(xdt, code, 2)
    GROUP = _group_sums_fn(xdt, wdt, code)
    DX = _dx_row_fn(xdt, code)

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
        NW = x.shape[1] // KW
        C_ = w.shape[0] if has_w else Cg  # channels (only used with a weight)
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        inv_n = ACC(1) / ACC(Cg * NW * V)
        scratch = cuda.shared.array((2, 3, SLOTS), ACC)
        raw = cuda.local.array(RAWN, RAW)
        it = 0
        for row0 in range(cuda.blockIdx.x * R, M, cuda.gridDim.x * R):
            row = row0 + (tid >> SHIFT)
            live = row < M
            rr = min(row, M - 1)
            if not LOOP:
                FETCH(x, dy, dy, row, raw, t, NW)
            mu = mean[rr // Cg]
            r = rstd[rr // Cg]
            corr, c1, c2, it = GROUP(w, part, rr, Cg, C_, r, inv_n, scratch, it, tid)
            if live:
                if t == 0:  # this row's own slot: no other row group reads it
                    part[0, rr] = r * (part[2, rr] - corr * part[1, rr])
                wr = (LW(w[rr % C_]) if has_w else ACC(1)) * r
                DX(x[rr], dy[rr], dx[rr], raw, mu, corr, r, wr, c1, c2, t, NW)

    return _tag(dx_kernel, code, 1, 2 * code.vpt * np.dtype(xdt).itemsize)


def forward(x, weight, bias, eps, y, mean, rstd, *, stream=0):
    """Fill ``y`` (N, C, S) and ``mean``/``rstd`` (N, G) for group norm, on ``stream``."""
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
             C.words(y.reshape(n * G, L), vec), mean.reshape(n * G), rstd.reshape(n * G), **shared)


def backward(dy, x, mean, rstd, weight, dx, dweight, dbias, *, stream=0):
    """Fill ``dx`` (N, C, S) and ``dweight``/``dbias`` (C,) of any float dtype, on ``stream``."""
    n, c, S = x.shape
    G = mean.shape[1]
    acc = C.F64 if x.dtype == C.F64 else C.F32  # dweight/dbias: any float dtype (column_sums)
    # rows: sum(dy * xhat) and sum(dy) (the dweight/dbias partials, summed over
    # samples at the end), then sum(dy * (x - mean)) and sum(x - mean)
    part = C.device_empty((4, n, c), acc)
    if n:
        xdt = np.dtype(x.dtype)
        vec = C.vec_width(S, x, dy, dx)
        cfg = C.row_config(n * c, S, xdt == C.F64, vec)
        xk = C.words(x.reshape(n * c, S), vec)
        dyk = C.words(dy.reshape(n * c, S), vec)
        m1, p1 = mean.reshape(n * G), part.reshape(4, n * c)
        C.launch(_channel_sums_kernel(xdt, cfg.code), cfg.grid, cfg.block, stream, dyk, xk, m1, c // G, p1)
        C.launch(_dx_kernel(xdt, C.dtype_or_none(weight), cfg.code), cfg.grid, cfg.block, stream, dyk, xk, m1,
                 rstd.reshape(n * G), C.optional(weight, C.kview(x), 1), c // G, p1,
                 C.words(dx.reshape(n * c, S), vec))
    C.column_sums(part[0:2], dweight, dbias, stream)
