"""RMSNorm on the GPU: forward and backward kernels with their launchers.

    rstd = 1 / sqrt(sum(x^2) / N + eps)
    y    = x * rstd * weight

    xhat = x * rstd,  wdy = weight * dy
    c1   = mean(xhat * wdy)
    dx   = (wdy - xhat * c1) * rstd  (+ ds, the fused residual's gradient)

The same row mapping, register/loop paths, specialization and deterministic
dweight partials as ``layer_norm`` (see there and ``common``), with one group
reduction per row instead of two.
"""

import functools
import math

import numpy as np
from numba import cuda

from . import common as C
from .reduce import group_sum, slots


@functools.lru_cache(maxsize=None)
def _forward_kernel(xdt, wdt, cfg, has_r):
    ACC = C.acc_type(xdt)
    LX, SX = C.load_fn(xdt, ACC.name), C.store_fn(xdt)
    LOADW, STOREW = C.word_fns(xdt, ACC.name, cfg.vec)
    has_w = wdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    TPR, VPT, V, R, LOOP, BLOCK = cfg.tpr, cfg.vpt, cfg.vec, cfg.rows, cfg.loop, cfg.block
    WPT = VPT // V
    SHIFT = TPR.bit_length() - 1
    SLOTS = slots(BLOCK)

    @C.kernel_jit(BLOCK)
    def forward(
        x,      # (M, NW) input rows, NW words of V elements
        res,    # (M, NW) residual added to x (fused add), or a dummy
        w,      # (N,) weight, or a dummy
        eps,    # scalar, accumulation dtype
        y,      # (M, NW) output, x's dtype
        s,      # (M, NW) output x + res in x's dtype (fused add), or a dummy
        rstd,   # (M,) per-row 1/sqrt(mean(x^2) + eps), accumulation dtype
    ):
        M = x.shape[0]
        NW = x.shape[1]
        N = NW * V
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        g = tid >> SHIFT
        zero = ACC(0)
        inv_n = ACC(1) / ACC(N)
        scratch = cuda.shared.array((2, 2, SLOTS), ACC)
        xs = cuda.local.array(VPT, ACC)
        ws = cuda.local.array(VPT, ACC)
        tmp = cuda.local.array(V, ACC)
        if not LOOP:
            for e in range(VPT):
                j = (t + (e // V) * TPR) * V + e % V
                ws[e] = LW(w[j]) if has_w and j < N else ACC(1)
        it = 0
        for row0 in range(cuda.blockIdx.x * R, M, cuda.gridDim.x * R):
            row = row0 + g
            live = row < M
            rr = min(row, M - 1)
            xr = x[rr]
            yr = y[rr]
            resr = res[rr if has_r else 0]
            sr = s[rr if has_r else 0]
            sq = zero
            if LOOP:
                if live:
                    for q in range(t, NW, TPR):
                        LOADW(xr, q, xs, 0)
                        if has_r:
                            LOADW(resr, q, tmp, 0)
                            for v in range(V):
                                xs[v] += tmp[v]
                            STOREW(sr, q, xs, 0)
                        for v in range(V):
                            val = LX(SX(xs[v])) if has_r else xs[v]  # the s handed back, rounded
                            sq += val * val
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
                            xs[k * V + v] = zero
                    for v in range(V):
                        sq += xs[k * V + v] * xs[k * V + v]
            sq = group_sum(sq, scratch, it & 1, tid, TPR)
            it += 1
            r = ACC(1) / math.sqrt(sq * inv_n + eps)
            if live and t == 0:
                rstd[row] = r
            if live:
                if LOOP:
                    for q in range(t, NW, TPR):
                        LOADW(sr if has_r else xr, q, xs, 0)
                        for v in range(V):
                            tmp[v] = xs[v] * r * LW(w[q * V + v]) if has_w else xs[v] * r
                        STOREW(yr, q, tmp, 0)
                else:
                    for k in range(WPT):
                        q = t + k * TPR
                        if q < NW:
                            for v in range(V):
                                tmp[v] = xs[k * V + v] * r * ws[k * V + v]
                            STOREW(yr, q, tmp, 0)

    return forward


@functools.lru_cache(maxsize=None)
def _backward_kernel(xdt, wdt, cfg, has_ds):
    ACC = C.acc_type(xdt)
    LOADW, STOREW = C.word_fns(xdt, ACC.name, cfg.vec)
    has_w = wdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    TPR, VPT, V, R, LOOP, BLOCK = cfg.tpr, cfg.vpt, cfg.vec, cfg.rows, cfg.loop, cfg.block
    WPT = VPT // V
    SHIFT = TPR.bit_length() - 1
    SLOTS = slots(BLOCK)
    COLS = TPR * VPT

    @C.kernel_jit(BLOCK)
    def backward(
        dy,     # (M, NW) gradient of y, x's dtype, NW words of V elements
        x,      # (M, NW) forward input
        rstd,   # (M,) saved rstd, accumulation dtype
        w,      # (N,) weight, or a dummy (ones)
        ds,     # (M, NW) gradient added to dx (fused residual), or a dummy
        dx,     # (M, NW) output: gradient of x, x's dtype
        part,   # (1, grid, N) output: per-block sums of dy * xhat
    ):
        M = x.shape[0]
        NW = x.shape[1]
        N = NW * V
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        g = tid >> SHIFT
        blk = cuda.blockIdx.x
        zero = ACC(0)
        inv_n = ACC(1) / ACC(N)
        scratch = cuda.shared.array((2, 2, SLOTS), ACC)
        xs = cuda.local.array(VPT, ACC)
        gs = cuda.local.array(VPT, ACC)
        ws = cuda.local.array(VPT, ACC)
        dwa = cuda.local.array(VPT, ACC)    # running sum of dy * xhat, per column
        tmp = cuda.local.array(V, ACC)
        dwp = part[0, blk]
        if LOOP:
            for j in range(t, N, TPR):
                dwp[j] = zero
        else:
            for e in range(VPT):
                j = (t + (e // V) * TPR) * V + e % V
                ws[e] = LW(w[j]) if has_w and j < N else ACC(1)
                dwa[e] = zero
        it = 0
        for row0 in range(blk * R, M, cuda.gridDim.x * R):
            row = row0 + g
            live = row < M
            rr = min(row, M - 1)
            xr = x[rr]
            dyr = dy[rr]
            dxr = dx[rr]
            dsr = ds[rr if has_ds else 0]
            r = rstd[rr]
            # c1 = mean(xhat * wdy)
            c1 = zero
            if LOOP:
                if live:
                    for q in range(t, NW, TPR):
                        LOADW(xr, q, xs, 0)
                        LOADW(dyr, q, gs, 0)
                        for v in range(V):
                            wdy = gs[v] * LW(w[q * V + v]) if has_w else gs[v]
                            c1 += xs[v] * r * wdy
            else:
                for k in range(WPT):
                    q = t + k * TPR
                    if live and q < NW:
                        LOADW(xr, q, xs, k * V)
                        LOADW(dyr, q, gs, k * V)
                    else:
                        for v in range(V):
                            xs[k * V + v] = zero
                            gs[k * V + v] = zero
                    for v in range(V):
                        e = k * V + v
                        c1 += xs[e] * r * (gs[e] * ws[e])
            c1 = group_sum(c1, scratch, it & 1, tid, TPR) * inv_n
            it += 1
            if live:
                if LOOP:
                    for q in range(t, NW, TPR):
                        LOADW(xr, q, xs, 0)
                        LOADW(dyr, q, gs, 0)
                        if has_ds:
                            LOADW(dsr, q, tmp, 0)
                        for v in range(V):
                            j = q * V + v
                            xhat = xs[v] * r
                            wdy = gs[v] * LW(w[j]) if has_w else gs[v]
                            val = (wdy - xhat * c1) * r
                            tmp[v] = tmp[v] + val if has_ds else val
                            dwp[j] += gs[v] * xhat
                        STOREW(dxr, q, tmp, 0)
                else:
                    for k in range(WPT):
                        q = t + k * TPR
                        if q < NW:
                            if has_ds:
                                LOADW(dsr, q, tmp, 0)
                            for v in range(V):
                                e = k * V + v
                                xhat = xs[e] * r
                                val = (gs[e] * ws[e] - xhat * c1) * r
                                tmp[v] = tmp[v] + val if has_ds else val
                                dwa[e] += gs[e] * xhat
                            STOREW(dxr, q, tmp, 0)
        if LOOP:
            return
        if R == 1:
            for e in range(VPT):
                j = (t + (e // V) * TPR) * V + e % V
                if j < N:
                    dwp[j] = dwa[e]
        else:
            sh = cuda.shared.array((R, COLS), ACC)
            for e in range(VPT):
                sh[g, (t + (e // V) * TPR) * V + e % V] = dwa[e]
            cuda.syncthreads()
            for j in range(tid, min(N, COLS), BLOCK):
                a = sh[0, j]
                for gg in range(1, R):
                    a += sh[gg, j]
                dwp[j] = a

    return backward


def forward(x, weight, eps, y, rstd, residual=None, s=None, y_mapped=False):
    """Fill ``y`` (M, N) and ``rstd`` (M,); arguments as in layer_norm.forward."""
    M, N = x.shape
    if M == 0:
        return
    vec = C.vec_width(N, x, y, residual, s)
    cfg = C.row_config(M, N, x.dtype == C.F64, vec)
    kern = _forward_kernel(np.dtype(x.dtype), C.dtype_or_none(weight), cfg.code, residual is not None)
    xe, xk = C.kview(x), C.words(x, vec)
    C.launch(kern, cfg.grid, cfg.block, xk, C.optional(residual, xk, 2, vec), C.optional(weight, xe, 1),
             np.dtype(rstd.dtype).type(eps), C.words(y, vec), C.optional(s, xk, 2, vec), rstd)


def backward(dy, x, rstd, weight, dx, dweight, ds=None):
    """Fill ``dx`` (M, N) and ``dweight`` (N,) in the accumulation dtype."""
    M, N = x.shape
    acc = np.dtype(dweight.dtype)
    if M == 0:
        C.column_sums(C.device_empty((1, 0, N), acc), dweight)
        return
    vec = C.vec_width(N, x, dy, dx, ds)
    cfg = C.row_config(M, N, x.dtype == C.F64, vec)
    part = C.device_empty((1, cfg.grid, N), acc)
    kern = _backward_kernel(np.dtype(x.dtype), C.dtype_or_none(weight), cfg.code, ds is not None)
    xe, xk = C.kview(x), C.words(x, vec)
    C.launch(kern, cfg.grid, cfg.block, C.words(dy, vec), xk, rstd, C.optional(weight, xe, 1),
             C.optional(ds, xk, 2, vec), C.words(dx, vec), part)
    C.column_sums(part, dweight)
