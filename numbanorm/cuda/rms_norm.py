"""RMSNorm on the GPU: forward and backward kernels with their launchers.

    rstd = 1 / sqrt(sum(x^2) / N + eps)
    y    = x * rstd * weight

    xhat = x * rstd,  wdy = weight * dy
    c1   = mean(xhat * wdy)
    dx   = (wdy - xhat * c1) * rstd  (+ ds, the fused residual's gradient)

The same row mapping, register/loop paths, specialization and deterministic
dweight partials as ``layer_norm`` (see there and ``_common``), with one group
reduction per row instead of two.
"""

import functools
import math

import numpy as np
from numba import cuda

from . import _common as C
from ._reduce import group_sum, slots


@functools.lru_cache(maxsize=None)
def _forward_kernel(xdt, wdt, cfg, has_r):
    ACC = C.acc_type(xdt)
    LX, SX = C.load_fn(xdt, ACC.name), C.store_fn(xdt)
    has_w = wdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    TPR, VPT, R, LOOP, BLOCK = cfg.tpr, cfg.vpt, cfg.rows, cfg.loop, cfg.block
    SHIFT = TPR.bit_length() - 1
    SLOTS = slots(BLOCK)

    @C.kernel_jit(BLOCK)
    def forward(
        x,      # (M, N) input rows
        res,    # (M, N) residual added to x (fused add), or a dummy
        w,      # (N,) weight, or a dummy
        eps,    # scalar, accumulation dtype
        y,      # (M, N) output, x's dtype
        s,      # (M, N) output x + res in x's dtype (fused add), or a dummy
        rstd,   # (M,) per-row 1/sqrt(mean(x^2) + eps), accumulation dtype
    ):
        M = x.shape[0]
        N = x.shape[1]
        tid = cuda.threadIdx.x
        t = tid & (TPR - 1)
        g = tid >> SHIFT
        zero = ACC(0)
        inv_n = ACC(1) / ACC(N)
        scratch = cuda.shared.array((2, 2, SLOTS), ACC)
        xs = cuda.local.array(VPT, ACC)
        ws = cuda.local.array(VPT, ACC)
        if not LOOP:
            for k in range(VPT):
                j = t + k * TPR
                ws[k] = LW(w[j]) if has_w and j < N else ACC(1)
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
                    for j in range(t, N, TPR):
                        v = LX(xr[j])
                        if has_r:
                            sv = SX(v + LX(resr[j]))
                            sr[j] = sv
                            v = LX(sv)      # normalize the s handed back, rounded
                        sq += v * v
            else:
                for k in range(VPT):
                    j = t + k * TPR
                    v = zero
                    if live and j < N:
                        v = LX(xr[j])
                        if has_r:
                            sv = SX(v + LX(resr[j]))
                            sr[j] = sv
                            v = LX(sv)
                    xs[k] = v
                    sq += v * v
            sq = group_sum(sq, scratch, it & 1, tid, TPR)
            it += 1
            r = ACC(1) / math.sqrt(sq * inv_n + eps)
            if live and t == 0:
                rstd[row] = r
            if live:
                if LOOP:
                    for j in range(t, N, TPR):
                        v = (LX(sr[j]) if has_r else LX(xr[j])) * r
                        if has_w:
                            v *= LW(w[j])
                        yr[j] = SX(v)
                else:
                    for k in range(VPT):
                        j = t + k * TPR
                        if j < N:
                            yr[j] = SX(xs[k] * r * ws[k])

    return forward


@functools.lru_cache(maxsize=None)
def _backward_kernel(xdt, wdt, cfg, has_ds):
    ACC = C.acc_type(xdt)
    LX, SX = C.load_fn(xdt, ACC.name), C.store_fn(xdt)
    has_w = wdt is not None
    LW = C.load_fn(xdt if wdt is None else wdt, ACC.name)
    TPR, VPT, R, LOOP, BLOCK = cfg.tpr, cfg.vpt, cfg.rows, cfg.loop, cfg.block
    SHIFT = TPR.bit_length() - 1
    SLOTS = slots(BLOCK)
    COLS = TPR * VPT

    @C.kernel_jit(BLOCK)
    def backward(
        dy,     # (M, N) gradient of y, x's dtype
        x,      # (M, N) forward input
        rstd,   # (M,) saved rstd, accumulation dtype
        w,      # (N,) weight, or a dummy (ones)
        ds,     # (M, N) gradient added to dx (fused residual), or a dummy
        dx,     # (M, N) output: gradient of x, x's dtype
        part,   # (1, grid, N) output: per-block sums of dy * xhat
    ):
        M = x.shape[0]
        N = x.shape[1]
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
        dwp = part[0, blk]
        if LOOP:
            for j in range(t, N, TPR):
                dwp[j] = zero
        else:
            for k in range(VPT):
                j = t + k * TPR
                ws[k] = LW(w[j]) if has_w and j < N else ACC(1)
                dwa[k] = zero
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
            c1 = zero
            if LOOP:
                if live:
                    for j in range(t, N, TPR):
                        wdy = LX(dyr[j]) * LW(w[j]) if has_w else LX(dyr[j])
                        c1 += LX(xr[j]) * r * wdy
            else:
                for k in range(VPT):
                    j = t + k * TPR
                    xv = zero
                    gv = zero
                    if live and j < N:
                        xv = LX(xr[j])
                        gv = LX(dyr[j])
                    xs[k] = xv
                    gs[k] = gv
                    c1 += xv * r * (gv * ws[k])
            c1 = group_sum(c1, scratch, it & 1, tid, TPR) * inv_n
            it += 1
            if live:
                if LOOP:
                    for j in range(t, N, TPR):
                        gv = LX(dyr[j])
                        xhat = LX(xr[j]) * r
                        wdy = gv * LW(w[j]) if has_w else gv
                        v = (wdy - xhat * c1) * r
                        if has_ds:
                            v += LX(dsr[j])
                        dxr[j] = SX(v)
                        dwp[j] += gv * xhat
                else:
                    for k in range(VPT):
                        j = t + k * TPR
                        if j < N:
                            xhat = xs[k] * r
                            v = (gs[k] * ws[k] - xhat * c1) * r
                            if has_ds:
                                v += LX(dsr[j])
                            dxr[j] = SX(v)
                            dwa[k] += gs[k] * xhat
        if LOOP:
            return
        if R == 1:
            for k in range(VPT):
                j = t + k * TPR
                if j < N:
                    dwp[j] = dwa[k]
        else:
            sh = cuda.shared.array((R, COLS), ACC)
            for k in range(VPT):
                sh[g, t + k * TPR] = dwa[k]
            cuda.syncthreads()
            for j in range(tid, min(N, COLS), BLOCK):
                a = sh[0, j]
                for gg in range(1, R):
                    a += sh[gg, j]
                dwp[j] = a

    return backward


def forward(x, weight, eps, y, rstd, residual=None, s=None):
    """Fill ``y`` (M, N) and ``rstd`` (M,); shapes and dtypes as in layer_norm.forward."""
    M, N = x.shape
    if M == 0:
        return
    cfg = C.row_config(M, N, x.dtype == C.F64)
    kern = _forward_kernel(np.dtype(x.dtype), C.dtype_or_none(weight), cfg, residual is not None)
    xk = C.kview(x)
    C.launch(kern, cfg.grid, cfg.block, xk, C.optional(residual, xk, 2), C.optional(weight, xk, 1),
             np.dtype(rstd.dtype).type(eps), C.kview(y), C.optional(s, xk, 2), rstd)


def backward(dy, x, rstd, weight, dx, dweight, ds=None):
    """Fill ``dx`` (M, N) and ``dweight`` (N,) in the accumulation dtype."""
    M, N = x.shape
    acc = np.dtype(dweight.dtype)
    if M == 0:
        C.column_sums(C.device_empty((1, 0, N), acc), dweight)
        return
    cfg = C.row_config(M, N, x.dtype == C.F64)
    part = C.device_empty((1, cfg.grid, N), acc)
    kern = _backward_kernel(np.dtype(x.dtype), C.dtype_or_none(weight), cfg, ds is not None)
    xk = C.kview(x)
    C.launch(kern, cfg.grid, cfg.block, C.kview(dy), xk, rstd, C.optional(weight, xk, 1),
             C.optional(ds, xk, 2), C.kview(dx), part)
    C.column_sums(part, dweight)
