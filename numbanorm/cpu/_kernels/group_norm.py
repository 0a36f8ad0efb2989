"""GroupNorm (and InstanceNorm, one channel per group) on the CPU.

x is seen as (N, C, S) with S the product of the spatial dimensions; the C
channels split into G groups of C/G channels.  A group's C/G * S elements are
contiguous in memory, so each (sample, group) is a "row" for the statistics:

    mean, rstd over x[n, g*Cg:(g+1)*Cg, :]      (as a LayerNorm row's: one pass, shifted)
    y[n, c, :] = (x[n, c, :] - mean) * rstd * weight[c] + bias[c]
"""

import numpy as np

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .common import (FASTMATH, RESCALE, STREAMING, acc_of, finish, in_blocks, launch, param, row_block,
                     scratch_for, wide_vectors)
from .halves import kernel_view, like, narrow, widen
from .memory import ahead_chunk, ask_ahead, put_streaming, store_fence, stream_apart, stream_span
from .rescale import rescue_row, scaled_backward_row
from .stats import overflowed, row_is_finite, row_stats
from .sums import gradient_sums


@njit(cache=True, nogil=True, inline="always")
def dims(
    xc,     # (N * C, S) input, a channel a row
    mean,   # (N, G) statistics, accumulation dtype
):
    """``(N, C, S, G, Cg, zero, one, inv_n)``: the shape, groups, channels per group,
    and 0, 1 and 1/(Cg * S) in the accumulation dtype (a bare Python number would
    promote float32 arithmetic to float64, layer_norm.forward_rows)."""
    N, G = mean.shape
    C, S = xc.shape[0] // N, xc.shape[1]
    Cg = C // G
    one = mean.dtype.type(1)
    return N, C, S, G, Cg, mean.dtype.type(0), one, one / mean.dtype.type(Cg * S)


@njit(cache=True, fastmath={"contract"}, nogil=True)  # (as layer_norm.forward_rows)
def forward_groups(
    x,      # (N * G, Cg * S) input, a group a row, float32/float64, or 16-bit floats as integer bits (halves)
    w,      # (C,) per-channel weight in the accumulation dtype, or None
    b,      # (C,) per-channel bias in the accumulation dtype, or None
    eps,    # scalar in the accumulation dtype
    y,      # (N * G, Cg * S) output, x's dtype
    xc,     # (N * C, S) the same input, a channel a row
    yc,     # (N * C, S) the same output, a channel a row
    mean,   # (N, G) per-(sample, group) mean, accumulation dtype
    rstd,   # (N, G) per-(sample, group) 1/sqrt(var + eps), accumulation dtype
    stream, # scalar bool: write y with streaming stores (memory), never where y is x
    lo,     # scalar: first group of the block, n * G + g
    hi,     # scalar: one past its last group
):
    """Groups ``lo:hi`` of the forward, called by _forward and by the calling thread
    (as layer_norm.forward_rows, whose return value it returns too); a call per
    block, not per group, keeps the reference counts of its arrays out of the loop
    over groups.

    A group's Cg * S elements are contiguous, so its statistics are a LayerNorm row's
    (of x); its write pass goes channel by channel (rows of xc, yc, as (array, row):
    memory.stream_row).  Both views come in as arguments: made here by reshapes,
    Numba increfed them in the loop over channels (an atomic each, which drains the
    write-combining buffers of the streaming stores).
    """
    wide_vectors(x)
    N, C, S, G, Cg, zero, one, inv_n = dims(xc, mean)
    left = 0
    for ng in range(lo, hi):
        n, g, c0 = ng // G, ng % G, ng % G * Cg  # sample, group, the group's first channel
        # one pass over the group where its shift can be trusted, as layer_norm.forward_rows
        mu, corr, var = row_stats(x, ng, zero)
        r = one / np.sqrt(var + eps)
        if overflowed(mu, r) and row_is_finite(x, ng):  # as layer_norm.forward_rows
            left += rescue_row(x, ng, w, b, c0, S, eps, y, ng, mean, rstd, (n, g))
            continue
        mean[n, g] = mu + corr
        rstd[n, g] = r
        write_channels(xc, yc, n * C + c0, n * C + c0 + Cg, c0, mu, corr, r, w, b, zero, stream, x, ng, hi)
    if STREAMING and stream:  # (streamed stores: the STREAMING variant's, as layer_norm.forward_rows)
        store_fence()
    return left


@njit(cache=True, fastmath={"contract"}, nogil=True)
def write_channels(
    xc,       # (N * C, S) input, a channel a row
    yc,       # (N * C, S) output, a channel a row
    lo,       # scalar: first channel row of the group, n * C + c0
    hi,       # scalar: one past its last
    c0,       # scalar: the group's first channel
    mu,       # scalar: the group's first-pass mean
    corr,     # scalar: its correction, mean = mu + corr
    r,        # scalar: the group's rstd
    w,        # (C,) weight in the accumulation dtype, or None
    b,        # (C,) bias in the accumulation dtype, or None
    zero,     # scalar 0 in the accumulation dtype
    stream,   # scalar bool: streaming stores
    xg,       # (N * G, Cg * S) the same input, a group a row
    ng,       # scalar: the group's row of xg
    end,      # scalar: one past the last group of the block
):
    """The write pass of one group, channel row by channel row.  A function of its own,
    called once a group: inlined in forward_groups's loop over groups, its spans
    increfed xc and yc on every channel (an atomic each, which drains the
    write-combining buffers of the streaming stores).  Streamed, it asks for the next
    group of the block as it writes this one (memory.ask_ahead, as layer_norm.forward_rows)."""
    wide_vectors(xc)
    S = xc.shape[1]
    if STREAMING:
        chunk = ahead_chunk(xc)
    for ch in range(lo, hi):
        c = c0 + ch - lo
        # per channel, the affine folds into the scale: (x - mean) * (r * w[c]) + b[c]
        a = r * w[c] if w is not None else r
        bc = b[c] if b is not None else zero
        # its whole lines with streaming stores where `stream`, the plain spans before and
        # after them one inlined copy, as layer_norm.forward_rows
        s0, s1 = stream_span(yc, ch) if STREAMING and stream else (S, S)
        lo_e, hi_e = 0, s0
        for part in range(2):
            scale_shift_span(xc, ch, mu, corr, a, bc, yc, ch, lo_e, hi_e, False)
            if STREAMING and part == 0:
                at = (ch - lo) * S  # the channel's first element in its group's row
                for t in range(s0, s1, chunk):
                    te = min(t + chunk, s1)
                    ask_ahead(xg, ng, end, at + t, at + te)
                    scale_shift_span(xc, ch, mu, corr, a, bc, yc, ch, t, te, True)
            lo_e, hi_e = s1, S


@njit(cache=True, fastmath={"contract"}, nogil=True, inline="always")
def scale_shift_span(
    x,      # (N * C, S) input, a channel a row
    i,      # scalar: the channel's row
    mu,     # scalar: first-pass group mean
    corr,   # scalar: its correction, mean = mu + corr
    a,      # scalar: rstd * weight[c]
    bc,     # scalar: bias[c]
    out,    # (K, S) where the channel goes
    o,      # scalar: its row of `out`
    lo,     # scalar: first element of the span
    hi,     # scalar: one past its last
    nt,     # constant bool: streaming stores (a span from memory.stream_span)
):
    """Write elements ``lo:hi`` of channel row ``i``, normalized, into ``out[o]``; a
    streamed span and a plain one compute the same operations (spans.normalize_span).

    (x - mu) - corr stays in that order: 'reassoc' alone does not fold it
    (spans.normalize_span).  Never x * a + (bc - mean * a) either: that folding
    cancels catastrophically when |mean| >> std (two digits lost in float32 at mean
    1e4, std 1e-2).
    """
    for k in range(hi - lo):
        j = np.uint64(lo + k)  # unsigned, as in normalize_span
        v = narrow(((widen(x[i, j]) - mu) - corr) * a + bc, out)
        if nt:
            put_streaming(out, o, j, v)
        else:
            out[o, j] = v


@njit(cache=True, nogil=True)  # (as layer_norm.backward_rows)
def backward_groups(
    dy,       # (N * G, Cg * S) gradient of y, a group a row
    x,        # (N * G, Cg * S) forward input, a group a row
    mean,     # (N, G) saved mean
    rstd,     # (N, G) saved rstd
    w,        # (C,) weight in the accumulation dtype, or None (ones)
    dx,       # (N * G, Cg * S) output: gradient of x, a group a row
    dyc,      # (N * C, S) the same gradient, a channel a row
    xc,       # (N * C, S) the same input, a channel a row
    dxc,      # (N * C, S) the same output, a channel a row
    dw_part,  # (N, C) per-sample partial sums of dy * xhat, accumulation dtype
    db_part,  # (N, C) per-sample partial sums of dy, accumulation dtype
    stream,   # scalar bool: write dx with streaming stores (memory)
    lo,       # scalar: first group of the block, n * G + g
    hi,       # scalar: one past its last group
):
    """Groups ``lo:hi`` of the backward, called by _backward and by the calling thread
    (as forward_groups, whose two views of each array it takes for the same reason);
    returns how many groups it left to its rescaling variant (layer_norm.backward_rows)."""
    wide_vectors(dy)
    N, C, S, G, Cg, zero, one, inv_n = dims(xc, mean)
    left = 0
    for ng in range(lo, hi):
        n, g, c0 = ng // G, ng % G, ng % G * Cg  # sample, group, the group's first channel
        mu = mean[n, g]
        r = rstd[n, g]
        # pass 1, per channel: A = sum(dy * (x - mu)) and dbias's sum(dy); over
        # the group, corr = mean(x - mu) corrects the saved mean's rounding (as
        # in layer_norm._backward), so that sum(dy * xhat) = r * (A - corr * sum(dy))
        dsum = 0.0
        for c in range(c0, c0 + Cg):
            # dsum runs on over the group's channels, in float64 (sums.gradient_sums)
            dsum, a, dys = channel_sums(dyc, xc, n * C + c, mu, zero, dsum)
            dw_part[n, c] = a
            db_part[n, c] = dys
        corr = like(dsum, zero) * inv_n
        # c1 = mean(xhat * wdy), c2 = mean(wdy) over the group
        c1 = zero
        c2 = zero
        for c in range(c0, c0 + Cg):
            dyx = r * (dw_part[n, c] - corr * db_part[n, c])
            dw_part[n, c] = dyx
            wc = w[c] if w is not None else one
            c1 += wc * dyx
            c2 += wc * db_part[n, c]
        c1 *= inv_n
        c2 *= inv_n
        if (not (np.isfinite(corr) and np.isfinite(c1) and np.isfinite(c2))
                and row_is_finite(x, ng) and row_is_finite(dy, ng)):
            if RESCALE:  # as in layer_norm.backward_rows
                for c in range(c0, c0 + Cg):
                    dw_part[n, c] = zero
                    db_part[n, c] = zero
                scaled_backward_row(dy, x, ng, mu, r, w, c0, S, None, dx, dw_part[n], db_part[n])
            else:
                left += 1
            continue
        # pass 2: dx = (wdy - (xhat * c1 + c2)) * rstd, channel by channel
        dx_channels(dyc, xc, n * C + c0, n * C + c0 + Cg, c0, mu, corr, r, w, c1, c2, one, dxc, stream)
    if STREAMING and stream:
        store_fence()
    return left


@njit(cache=True, fastmath=FASTMATH, nogil=True)  # on its own: as layer_norm.backward_sums
def channel_sums(
    dyc,    # (N * C, S) gradient of y, a channel a row
    xc,     # (N * C, S) forward input, a channel a row
    i,      # scalar: the channel's row
    mu,     # scalar: saved group mean
    zero,   # scalar 0 in the accumulation dtype
    d0,     # float64: the group's sum(x - mu) over its channels before this one
):
    """``(d0 + sum(x - mu), sum(dy * (x - mu)), sum(dy))`` over channel row ``i``
    (sums.gradient_sums)."""
    wide_vectors(dyc)
    return gradient_sums(dyc, xc, i, mu, like(1.0, zero), None, zero, d0)


@njit(cache=True, nogil=True)
def dx_channels(
    dyc,      # (N * C, S) gradient of y, a channel a row
    xc,       # (N * C, S) forward input, a channel a row
    lo,       # scalar: first channel row of the group, n * C + c0
    hi,       # scalar: one past its last
    c0,       # scalar: the group's first channel
    mu,       # scalar: saved group mean
    corr,     # scalar: its correction, mean(x - mu) over the group
    r,        # scalar: saved group rstd
    w,        # (C,) weight in the accumulation dtype, or None (ones)
    c1,       # scalar: mean(xhat * wdy) over the group
    c2,       # scalar: mean(wdy) over the group
    one,      # scalar 1 in the accumulation dtype
    dxc,      # (N * C, S) output, a channel a row
    stream,   # scalar bool: streaming stores
):
    """The dx pass of one group, channel row by channel row, each in spans (its whole
    lines streamed where ``stream``), called once a group as write_channels.  It asks
    for no next group as it writes (write_channels does): that made the large streamed
    backward slower (the performance design log).
    Not FASTMATH (inlined here, the spans compile with this function's flags): the
    loop has no reduction for 'reassoc' to vectorize."""
    wide_vectors(dyc)
    S = xc.shape[1]
    for ch in range(lo, hi):
        wc = w[c0 + ch - lo] if w is not None else one
        s0, s1 = stream_span(dxc, ch) if STREAMING and stream else (S, S)  # spans as write_channels's
        lo_e, hi_e = 0, s0
        for part in range(2):
            dx_span(dyc, xc, ch, mu, corr, r, wc, c1, c2, dxc, lo_e, hi_e, False)
            if STREAMING and part == 0:
                dx_span(dyc, xc, ch, mu, corr, r, wc, c1, c2, dxc, s0, s1, True)
            lo_e, hi_e = s1, S


@njit(cache=True, nogil=True, inline="always")
def dx_span(
    dy,     # (N * C, S) gradient of y, a channel a row
    x,      # (N * C, S) forward input, a channel a row
    i,      # scalar: the channel's row
    mu,     # scalar: saved group mean
    corr,   # scalar: its correction
    r,      # scalar: saved group rstd
    wc,     # scalar: weight[c] (1 without weight)
    c1,     # scalar: mean(xhat * wdy) over the group
    c2,     # scalar: mean(wdy) over the group
    dx,     # (N * C, S) output, a channel a row
    lo,     # scalar: first element of the span
    hi,     # scalar: one past its last
    nt,     # constant bool: streaming stores (a span from memory.stream_span)
):
    """Elements ``lo:hi`` of channel row ``i`` of dx; a streamed span and a plain one
    compute the same operations (layer_norm.backward_span)."""
    for k in range(hi - lo):
        j = np.uint64(lo + k)  # unsigned, as in spans.normalize_span
        xhat = ((widen(x[i, j]) - mu) - corr) * r
        v = narrow((widen(dy[i, j]) * wc - (xhat * c1 + c2)) * r, dx)
        if nt:
            put_streaming(dx, i, j, v)
        else:
            dx[i, j] = v


def _views(a, mean):
    """``a`` (N, C, S) as the kernels read it, twice: a (sample, group) a row and a
    channel a row.  Explicit shapes: a batch of N = 0 does not reshape with -1."""
    N, C, S = a.shape
    G = mean.shape[1]
    v = kernel_view(a)
    return v.reshape(N * G, C // G * S), v.reshape(N * C, S)


def forward(x, weight, bias, eps, y, mean, rstd):
    """Fill ``y`` (N, C, S) and ``mean``/``rstd`` (N, G) for group norm."""
    acc = acc_of(x.dtype)
    ys = scratch_for(y, x, weight, bias)
    stream = ys is y and stream_apart(y, x)  # never in place (memory.stream_apart says why)
    xg, xc = _views(x, mean)
    yg, yc = _views(ys, mean)
    launch(_forward, x.size, row_block(mean.size), xg, param(weight, acc), param(bias, acc), acc.type(eps),
           yg, xc, yc, mean, rstd, stream)
    finish(ys, y)


def backward(dy, x, mean, rstd, weight, dx, dweight, dbias):
    """Fill ``dx`` (N, C, S) and ``dweight``/``dbias`` (C,) in the accumulation dtype."""
    N, C, S = x.shape
    acc = acc_of(x.dtype)
    dw_part = np.empty((N, C), acc)
    db_part = np.empty((N, C), acc)
    (dyg, dyc), (xg, xc), (dxg, dxc) = (_views(a, mean) for a in (dy, x, dx))
    launch(_backward, x.size, row_block(mean.size), dyg, xg, mean, rstd, param(weight, acc), dxg, dyc, xc, dxc,
           dw_part, db_part, stream_apart(dx, dy, x))
    # per-sample partials summed in sample order: deterministic for any thread count
    dw_part.sum(axis=0, out=dweight)
    db_part.sum(axis=0, out=dbias)


# The row functions with their parallel kernels over blocks of groups (common.launch)
_forward = in_blocks(forward_groups)
_backward = in_blocks(backward_groups, marks=None)
