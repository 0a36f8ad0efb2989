"""GroupNorm (and InstanceNorm, one channel per group) on the GPU.

x is seen as (N, C, S) with S the product of the spatial dimensions and the C
channels split into G groups of Cg = C/G channels.  A group's L = Cg*S elements
are contiguous, so the forward treats each (sample, group) as a row of length L
and maps it onto a thread group exactly like ``layer_norm`` (``_common``): the
group in registers when it fits, a loop (per channel, so no division per
element) when it does not -- in typical convolutional nets L is tens of
thousands and one block works on each group.

    mean, rstd over x[n, g*Cg:(g+1)*Cg, :]      (corrected two-pass)
    y[n, c, :] = ((x[n, c, :] - mean) - corr) * (rstd * weight[c]) + bias[c]

never ``x * a + (bias - mean * a)``: folding the mean into the offset cancels
catastrophically when |mean| >> std.

Backward, in three kernels (the dx of a group needs sums over all its channels):

1. per (n, c) row of S elements: dyx[n, c] = sum(dy * xhat), dys[n, c] = sum(dy);
   these are also the per-sample partials of dweight/dbias;
2. per (n, c) row: c1 = sum over the group's channels of weight * dyx / L,
   c2 likewise from dys (a group-wide reduction over Cg values), then
   dx = (weight * dy - (xhat * c1 + c2)) * rstd;
3. dweight/dbias = the fixed-order column sums of dyx/dys over the samples.

x and dy are read twice (kernels 1 and 2): five passes over memory where three
would do if a whole group fitted on chip -- a fused version is future work.
"""

import functools
import math

import numpy as np
from numba import cuda

from . import _common as C
from ._reduce import group_sum, group_sum2, slots


@functools.lru_cache(maxsize=None)
def _forward_kernel(xdt, wdt, bdt, cfg):
    ACC = C.acc_type(xdt)
    LX, SX = C.load_fn(xdt, ACC.name), C.store_fn(xdt)
    has_w, has_b = wdt is not None, bdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    LB = C.load_fn(xdt if bdt is None else bdt, ACC.name)
    TPR, VPT, R, LOOP, BLOCK = cfg.tpr, cfg.vpt, cfg.rows, cfg.loop, cfg.block
    SHIFT = TPR.bit_length() - 1
    SLOTS = slots(BLOCK)
    I32 = cuda.int32

    @C.kernel_jit(BLOCK)
    def forward(
        x,      # (N*G, L) input, one row per (sample, group)
        w,      # (C,) per-channel weight, or a dummy
        b,      # (C,) per-channel bias, or a dummy
        eps,    # scalar, accumulation dtype
        S,      # int: elements per channel (product of the spatial dims)
        G,      # int: groups per sample
        y,      # (N*G, L) output, x's dtype
        mean,   # (N*G,) per-(sample, group) mean, accumulation dtype
        rstd,   # (N*G,) per-(sample, group) 1/sqrt(var + eps), accumulation dtype
    ):
        M = x.shape[0]
        L = x.shape[1]
        Cg = L // S
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        g = tid >> SHIFT
        zero = ACC(0)
        inv_n = ACC(1) / ACC(L)
        scratch = cuda.shared.array((2, 2, SLOTS), ACC)
        xs = cuda.local.array(VPT, ACC)
        ch = cuda.local.array(VPT, I32)  # channel within the group of each element
        if not LOOP:
            for k in range(VPT):
                ch[k] = (t + k * TPR) // S
        for row0 in range(cuda.blockIdx.x * R, M, cuda.gridDim.x * R):
            row = row0 + g
            live = row < M
            rr = min(row, M - 1)
            xr = x[rr]
            yr = y[rr]
            c0 = (rr % G) * Cg           # first channel of this group
            total = zero
            if LOOP:
                if live:
                    for j in range(t, L, TPR):
                        total += LX(xr[j])
            else:
                for k in range(VPT):
                    j = t + k * TPR
                    v = zero
                    if live and j < L:
                        v = LX(xr[j])
                    xs[k] = v
                    total += v
            mu = group_sum(total, scratch, 0, tid, TPR) * inv_n
            dsum = zero
            sq = zero
            if LOOP:
                if live:
                    for j in range(t, L, TPR):
                        d = LX(xr[j]) - mu
                        dsum += d
                        sq += d * d
            else:
                for k in range(VPT):
                    if live and t + k * TPR < L:
                        d = xs[k] - mu
                        dsum += d
                        sq += d * d
            dsum, sq = group_sum2(dsum, sq, scratch, 1, tid, TPR)
            corr = dsum * inv_n
            var = sq * inv_n - corr * corr
            if var < zero:
                var = zero
            r = ACC(1) / math.sqrt(var + eps)
            if live and t == 0:
                mean[row] = mu + corr
                rstd[row] = r
            if live:
                if LOOP:
                    for cc in range(Cg):
                        c = c0 + cc
                        a = r * LW(w[c]) if has_w else r
                        bc = LB(b[c]) if has_b else zero
                        for k in range(t, S, TPR):
                            j = cc * S + k
                            yr[j] = SX(((LX(xr[j]) - mu) - corr) * a + bc)
                else:
                    for k in range(VPT):
                        j = t + k * TPR
                        if j < L:
                            c = c0 + ch[k]
                            a = r * LW(w[c]) if has_w else r
                            bc = LB(b[c]) if has_b else zero
                            yr[j] = SX(((xs[k] - mu) - corr) * a + bc)

    return forward


@functools.lru_cache(maxsize=None)
def _channel_sums_kernel(xdt, cfg):
    ACC = C.acc_type(xdt)
    LX = C.load_fn(xdt, ACC.name)
    TPR, R, BLOCK = cfg.tpr, cfg.rows, cfg.block
    SHIFT = TPR.bit_length() - 1
    SLOTS = slots(BLOCK)

    @C.kernel_jit(BLOCK)
    def channel_sums(
        dy,     # (N*C, S) gradient of y, one row per (sample, channel)
        x,      # (N*C, S) forward input
        mean,   # (N*G,) saved mean
        rstd,   # (N*G,) saved rstd
        Cg,     # int: channels per group
        part,   # (2, N*C) output: sum(dy * xhat) and sum(dy) per (sample, channel)
    ):
        M = x.shape[0]
        S = x.shape[1]
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        zero = ACC(0)
        scratch = cuda.shared.array((2, 2, SLOTS), ACC)
        it = 0
        for row0 in range(cuda.blockIdx.x * R, M, cuda.gridDim.x * R):
            row = row0 + (tid >> SHIFT)
            live = row < M
            rr = min(row, M - 1)
            xr = x[rr]
            dyr = dy[rr]
            grp = rr // Cg               # n * G + g, as row = n * C + g * Cg + c
            mu = mean[grp]
            r = rstd[grp]
            dyx = zero
            dys = zero
            if live:
                for j in range(t, S, TPR):
                    gv = LX(dyr[j])
                    dyx += gv * ((LX(xr[j]) - mu) * r)
                    dys += gv
            dyx, dys = group_sum2(dyx, dys, scratch, it & 1, tid, TPR)
            it += 1
            if live and t == 0:
                part[0, row] = dyx
                part[1, row] = dys

    return channel_sums


@functools.lru_cache(maxsize=None)
def _dx_kernel(xdt, wdt, cfg):
    ACC = C.acc_type(xdt)
    LX, SX = C.load_fn(xdt, ACC.name), C.store_fn(xdt)
    has_w = wdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    TPR, R, BLOCK = cfg.tpr, cfg.rows, cfg.block
    SHIFT = TPR.bit_length() - 1
    SLOTS = slots(BLOCK)

    @C.kernel_jit(BLOCK)
    def dx_kernel(
        dy,     # (N*C, S) gradient of y, one row per (sample, channel)
        x,      # (N*C, S) forward input
        mean,   # (N*G,) saved mean
        rstd,   # (N*G,) saved rstd
        w,      # (C,) weight, or a dummy (ones)
        part,   # (2, N*C) sum(dy * xhat), sum(dy) per (sample, channel), from channel_sums
        Cg,     # int: channels per group
        dx,     # (N*C, S) output: gradient of x
    ):
        M = x.shape[0]
        S = x.shape[1]
        C_ = w.shape[0] if has_w else Cg  # channels (only used with a weight)
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        zero = ACC(0)
        inv_n = ACC(1) / ACC(Cg * S)
        scratch = cuda.shared.array((2, 2, SLOTS), ACC)
        it = 0
        for row0 in range(cuda.blockIdx.x * R, M, cuda.gridDim.x * R):
            row = row0 + (tid >> SHIFT)
            live = row < M
            rr = min(row, M - 1)
            grp = rr // Cg
            first = grp * Cg             # the row of the group's first channel
            c = rr % C_                  # this row's channel
            c0 = c - (rr - first)        # the group's first channel
            # c1 = mean(xhat * wdy), c2 = mean(wdy) over the group, from the
            # per-channel sums: sum over the group's channels of w * dyx, w * dys
            c1 = zero
            c2 = zero
            for cc in range(t, Cg, TPR):
                wc = LW(w[c0 + cc]) if has_w else ACC(1)
                c1 += wc * part[0, first + cc]
                c2 += wc * part[1, first + cc]
            c1, c2 = group_sum2(c1, c2, scratch, it & 1, tid, TPR)
            it += 1
            c1 *= inv_n
            c2 *= inv_n
            if live:
                xr = x[rr]
                dyr = dy[rr]
                dxr = dx[rr]
                mu = mean[grp]
                r = rstd[grp]
                wr = (LW(w[c]) if has_w else ACC(1)) * r
                for j in range(t, S, TPR):
                    xhat = (LX(xr[j]) - mu) * r
                    dxr[j] = SX(LX(dyr[j]) * wr - (xhat * c1 + c2) * r)

    return dx_kernel


def forward(x, weight, bias, eps, y, mean, rstd):
    """Fill ``y`` (N, C, S) and ``mean``/``rstd`` (N, G) for group norm."""
    n, c, S = x.shape
    G = mean.shape[1]
    if n == 0:
        return
    L = (c // G) * S
    cfg = C.row_config(n * G, L, x.dtype == C.F64)
    kern = _forward_kernel(np.dtype(x.dtype), C.dtype_or_none(weight), C.dtype_or_none(bias), cfg)
    xk = C.kview(x)
    C.launch(kern, cfg.grid, cfg.block, xk.reshape(n * G, L), C.optional(weight, xk, 1),
             C.optional(bias, xk, 1), np.dtype(mean.dtype).type(eps), S, G,
             C.kview(y).reshape(n * G, L), mean.reshape(n * G), rstd.reshape(n * G))


def backward(dy, x, mean, rstd, weight, dx, dweight, dbias):
    """Fill ``dx`` (N, C, S) and ``dweight``/``dbias`` (C,) in the accumulation dtype."""
    n, c, S = x.shape
    G = mean.shape[1]
    acc = np.dtype(dweight.dtype)
    part = C.device_empty((2, n, c), acc)
    if n:
        xdt = np.dtype(x.dtype)
        cfg = C.row_config(n * c, S, xdt == C.F64)
        xk = C.kview(x).reshape(n * c, S)
        dyk = C.kview(dy).reshape(n * c, S)
        m1, r1, p1 = mean.reshape(n * G), rstd.reshape(n * G), part.reshape(2, n * c)
        C.launch(_channel_sums_kernel(xdt, cfg), cfg.grid, cfg.block, dyk, xk, m1, r1, c // G, p1)
        C.launch(_dx_kernel(xdt, C.dtype_or_none(weight), cfg), cfg.grid, cfg.block, dyk, xk, m1, r1,
                 C.optional(weight, xk, 1), p1, c // G, C.kview(dx).reshape(n * c, S))
    C.column_sums(part, dweight, dbias)
