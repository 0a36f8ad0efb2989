"""GroupNorm (and InstanceNorm, one channel per group) on the CPU.

x is seen as (N, C, S) with S the product of the spatial dimensions; the C
channels split into G groups of C/G channels.  A group's C/G * S elements are
contiguous in memory, so each (sample, group) is a "row" for the statistics:

    mean, rstd over x[n, g*Cg:(g+1)*Cg, :]      (as a LayerNorm row's: one pass, shifted)
    y[n, c, :] = (x[n, c, :] - mean) * rstd * weight[c] + bias[c]

x in channels-last order, (N, S, C) in memory, has kernels of its own over blocks of
positions (the section "channels-last order" below); the launchers choose by x's strides.
"""

import functools

import numpy as np

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .common import (FASTMATH, RESCALE, STREAMING, acc_of, empty_row, finish, in_blocks, in_spans, launch, least,
                     param, row_block, scratch_for, smallest_normal, wide_vectors)
from .halves import kernel_view, like, narrow, widen
from .memory import (CACHE_BYTES, ahead_chunk, ask_ahead, put_streaming, should_stream, store_fence, stream_apart,
                     stream_span)
from .rescale import rescue_row, scaled_backward_row
from .stats import SHIFT_SAMPLE, one_pass_ok, overflowed, row_factors, row_is_finite, row_stats, weight_factors
from .sums import gradient_sums


@njit(cache=True, nogil=True, inline="always")
def folded_away(
    a,      # scalar: rstd * weight[c], the accumulation dtype
    wc,     # scalar: weight[c]
):
    """The product ``a`` left the normal range while ``wc`` is not 0: y = (x - mean) * a
    would lose what (x - mean) * rstd * weight[c] keeps, below the smallest normal number (a
    group whose standard deviation is 1e15 and a float32 weight near 2**-120) or past the
    largest (1e-15 and 1e24).  (A NaN factor, a NaN group's, is left to the folded form: the
    same y either way.)"""
    return wc != 0 and (abs(a) < smallest_normal(a) or abs(a) == np.inf)


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
    _, C, S, G, Cg, zero, one, _ = dims(xc, mean)
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
        if w is not None and folded_away(a, w[c]):  # (rare: the two factors in turn)
            for j in range(S):
                yc[ch, j] = narrow((((widen(xc[ch, j]) - mu) - corr) * r) * w[c] + bc, yc)
            continue
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
    _, C, S, G, Cg, zero, one, inv_n = dims(xc, mean)
    left = 0
    for ng in range(lo, hi):
        n, g, c0 = ng // G, ng % G, ng % G * Cg  # sample, group, the group's first channel
        mu = mean[n, g]
        r = rstd[n, g]
        # pass 1, per channel: A = sum(dy * (x - mu) * r) and dbias's sum(dy); over
        # the group, corr = mean(x - mu) corrects the saved mean's rounding (as
        # in layer_norm._backward), so that sum(dy * xhat) = A - corr * r * sum(dy)
        dsum = 0.0
        for c in range(c0, c0 + Cg):
            # dsum runs on over the group's channels, in float64 (sums.gradient_sums)
            dsum, a, dys = channel_sums(dyc, xc, n * C + c, mu, r, zero, dsum)
            dw_part[n, c] = a
            db_part[n, c] = dys
        corr = like(dsum, zero) * inv_n
        # c1 = mean(xhat * wdy), c2 = mean(wdy) over the group
        c1 = zero
        c2 = zero
        for c in range(c0, c0 + Cg):
            dyx = dw_part[n, c] - (corr * r) * db_part[n, c]
            dw_part[n, c] = dyx
            wc = w[c] if w is not None else one
            c1 += wc * dyx
            c2 += wc * db_part[n, c]
        c1 *= inv_n
        c2 *= inv_n
        # (a non-finite dy too: another channel's sum past the range spoils its dweight)
        if not (np.isfinite(corr) and np.isfinite(c1) and np.isfinite(c2)) and row_is_finite(x, ng):
            if RESCALE:  # as in layer_norm.backward_rows
                for c in range(c0, c0 + Cg):
                    dw_part[n, c] = zero
                    db_part[n, c] = zero
                scaled_backward_row(dy, x, ng, mu, r, w, c0, S, None, dx, dw_part[n], db_part[n])
            else:
                left += 1
            continue
        # pass 2: dx = (wdy - (xhat * c1 + c2)) * rstd, channel by channel (as row_factors writes it)
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
    r,      # scalar: saved group rstd
    zero,   # scalar 0 in the accumulation dtype
    d0,     # float64: the group's sum(x - mu) over its channels before this one
):
    """``(d0 + sum(x - mu), sum(dy * (x - mu) * r), sum(dy))`` over channel row ``i``
    (sums.gradient_sums)."""
    wide_vectors(dyc)
    return gradient_sums(dyc, xc, i, mu, r, None, zero, d0)


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
    f, rf = row_factors(r, one)  # (as layer_norm.backward_rows)
    c1f, c2f = c1 * f, c2 * f
    for ch in range(lo, hi):
        p, q = weight_factors(w[c0 + ch - lo] if w is not None else one, f, one)
        s0, s1 = stream_span(dxc, ch) if STREAMING and stream else (S, S)  # spans as write_channels's
        lo_e, hi_e = 0, s0
        for part in range(2):
            dx_span(dyc, xc, ch, mu, corr, r, p, q, c1f, c2f, rf, dxc, lo_e, hi_e, False)
            if STREAMING and part == 0:
                dx_span(dyc, xc, ch, mu, corr, r, p, q, c1f, c2f, rf, dxc, s0, s1, True)
            lo_e, hi_e = s1, S


@njit(cache=True, nogil=True, inline="always")
def dx_span(
    dy,     # (N * C, S) gradient of y, a channel a row
    x,      # (N * C, S) forward input, a channel a row
    i,      # scalar: the channel's row
    mu,     # scalar: saved group mean
    corr,   # scalar: its correction
    r,      # scalar: saved group rstd
    p,      # scalar: dy's first factor towards weight[c] (1 without weight) times the group's f
    q,      # scalar: its second (stats.weight_factors)
    c1,     # scalar: mean(xhat * wdy) over the group, times f
    c2,     # scalar: mean(wdy) over the group, times f
    rf,     # scalar: r / f
    dx,     # (N * C, S) output, a channel a row
    lo,     # scalar: first element of the span
    hi,     # scalar: one past its last
    nt,     # constant bool: streaming stores (a span from memory.stream_span)
):
    """Elements ``lo:hi`` of channel row ``i`` of dx; a streamed span and a plain one
    compute the same operations (layer_norm.backward_span, whose dx this is)."""
    for k in range(hi - lo):
        j = np.uint64(lo + k)  # unsigned, as in spans.normalize_span
        xhat = ((widen(x[i, j]) - mu) - corr) * r
        v = narrow(((widen(dy[i, j]) * p) * q - (xhat * c1 + c2)) * rf, dx)
        if nt:
            put_streaming(dx, i, j, v)
        else:
            dx[i, j] = v


# ---------------------------------------------------------------- channels-last order
#
# x (N, C, *spatial) in channels-last order (torch's channels_last, channels_last_3d) is
# (N, S, C) in memory: a group's elements lie in every position's run of C, so no group is
# a row.  Each kernel goes over blocks of positions of one sample (last_blocks), all the
# channels of a position in one vector loop, each channel's sums in its own accumulator: the
# statistics from per-block partial sums added in a fixed order (any thread count, the same
# bits), then a write pass with each channel's constants.

# Positions a block sums per channel in the accumulation dtype before its float64 partial:
# as long as a float32 lane of the rows' blocked sums (sums.SUM_BLOCK over 16 lanes)
POSITIONS = 256


@functools.lru_cache(maxsize=64)
def last_blocks(N, S):
    """(K, 3) int64, read only: each block's sample, first position and one past its last."""
    nb = -(-S // POSITIONS)
    q = np.arange(N * nb, dtype=np.int64)
    start = q % nb * POSITIONS
    blocks = np.stack([q // nb, start, np.minimum(start + POSITIONS, S)], axis=1)
    blocks.flags.writeable = False
    return blocks


@njit(cache=True, nogil=True, inline="always")
def by_channel(
    v,      # (N, G) a statistic or constant of each (sample, group)
    n,      # scalar: the sample
    out,    # (C,) output: its group's value for each channel of sample n
):
    """Sample ``n``'s values of ``v`` laid out by channel (a block's constants, once a block)."""
    Cg = out.shape[0] // v.shape[1]
    for g in range(v.shape[1]):
        vg = v[n, g]
        for c in range(g * Cg, (g + 1) * Cg):
            out[c] = vg


@njit(cache=True, nogil=True)
def last_shift(
    x,       # (N, S, C) input in channels-last order, float32/float64, or 16-bit floats as integer bits
    shift,   # (N, G) output: each group's shift, accumulation dtype
):
    """Each group's shift (stats.shift): the mean of its first channel's first positions."""
    N, S, C = x.shape
    G = shift.shape[1]
    m = least(S, SHIFT_SAMPLE)
    zero = shift.dtype.type(0)
    for n in range(N):
        for g in range(G):
            total = 0.0  # float64, as stats.shift
            for s in range(m):
                total += widen(x[n, s, g * (C // G)])
            shift[n, g] = like(total / m, zero)


@njit(cache=True, fastmath={"contract"}, nogil=True)
def last_sums(
    x,       # (N, S, C) input in channels-last order
    shift,   # (N, G) each group's shift, accumulation dtype
    parts,   # (K, 2, C) output: each block's sum(d) and sum(d * d) per channel, d = x - shift, float64
    stream,  # scalar bool: x past the streaming threshold, read from memory (the rows one after another)
    blocks,  # (K, 3) each block's sample, first position, one past its last (last_blocks)
    lo,      # scalar: first block
    hi,      # scalar: one past the last
):
    """Blocks ``lo:hi`` of the forward's sums, each channel's in a fixed order of its
    positions (no 'reassoc': the vector loop runs over channels, so it changes no order).

    Four positions a step, so that each channel's accumulators are loaded and stored once
    for four elements: (d0 + d1) + (d2 + d3).  Read from memory (the STREAMING variant, where
    ``stream``), the four rows are read one after another, the pairs kept in u, u2 and v, the
    same operations in the same order (the same bits); read interleaved, four rows from memory
    took up to twice as long, and in cache the extra loops cost a third to a half (the CPU
    design log).  A variant of its own, compiled on the compile thread as the streamed
    writers are, so that a first call in cache does not compile those loops."""
    wide_vectors(x)
    C = x.shape[2]
    zero = shift.dtype.type(0)
    k, s1, s2 = empty_row(C, shift), empty_row(C, shift), empty_row(C, shift)
    if STREAMING:  # (the plain variant allocates no rows it does not read)
        u, u2, v = empty_row(C, shift), empty_row(C, shift), empty_row(C, shift)
    for q in range(lo, hi):
        n, a, e = blocks[q, 0], blocks[q, 1], blocks[q, 2]
        by_channel(shift, n, k)
        for c in range(C):
            s1[c] = zero
            s2[c] = zero
        t = a + (e - a) // 4 * 4
        for s in range(a, t, 4):
            if STREAMING and stream:
                for c in range(C):
                    j = np.uint64(c)  # unsigned, as in spans.normalize_span
                    u[j] = widen(x[n, s, j]) - k[j]
                for c in range(C):
                    j = np.uint64(c)
                    d0, d1 = u[j], widen(x[n, s + 1, j]) - k[j]
                    u[j] = d0 + d1
                    u2[j] = d0 * d0 + d1 * d1
                for c in range(C):
                    j = np.uint64(c)
                    v[j] = widen(x[n, s + 2, j]) - k[j]
                for c in range(C):
                    j = np.uint64(c)
                    d2, d3 = v[j], widen(x[n, s + 3, j]) - k[j]
                    s1[j] += u[j] + (d2 + d3)
                    s2[j] += u2[j] + (d2 * d2 + d3 * d3)
                continue
            for c in range(C):
                j = np.uint64(c)
                d0 = widen(x[n, s, j]) - k[j]
                d1 = widen(x[n, s + 1, j]) - k[j]
                d2 = widen(x[n, s + 2, j]) - k[j]
                d3 = widen(x[n, s + 3, j]) - k[j]
                s1[j] += (d0 + d1) + (d2 + d3)
                s2[j] += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3)
        for s in range(t, e):
            for c in range(C):
                j = np.uint64(c)
                d = widen(x[n, s, j]) - k[j]
                s1[j] += d
                s2[j] += d * d
        for c in range(C):
            parts[q, 0, c] = s1[c]
            parts[q, 1, c] = s2[c]
    return 0


@njit(cache=True, nogil=True)
def last_statistics(
    parts,   # (K, 2, C) the blocks' sums (last_sums), float64
    shift,   # (N, G) each group's shift; where one pass cannot be trusted, replaced by its first mean
    corr,    # (N, G) output: mean(x - shift), accumulation dtype
    rstd,    # (N, G) output: 1/sqrt(var + eps)
    marked,  # (N, G) output, bool: the group's sums left the range (stats.overflowed)
    eps,     # scalar, accumulation dtype
    S,       # scalar: positions a sample
    final,   # scalar bool: the second pass, whose sums every group takes
):
    """Each group's statistics from its blocks' and channels' sums, added in one order, as
    stats.row_stats takes a row's; returns how many groups to sum again from their moved
    shift (their ``marked`` is the next pass's)."""
    K, _, C = parts.shape
    N, G = shift.shape
    Cg, per = C // G, K // N
    zero, one = rstd.dtype.type(0), rstd.dtype.type(1)
    again = 0
    for n in range(N):
        for g in range(G):
            s1 = s2 = 0.0
            for q in range(n * per, (n + 1) * per):
                for c in range(g * Cg, (g + 1) * Cg):
                    s1 += parts[q, 0, c]
                    s2 += parts[q, 1, c]
            m1, ms = s1 / (Cg * S), s2 / (Cg * S)
            if not final and not one_pass_ok(m1, ms):
                shift[n, g] = like(shift[n, g] + m1, zero)
                again += 1
                continue
            var = ms - m1 * m1
            if var < 0.0:  # (a NaN stays NaN)
                var = 0.0
            corr[n, g] = like(m1, zero)
            rstd[n, g] = one / np.sqrt(like(var, zero) + eps)
            marked[n, g] = overflowed(shift[n, g], rstd[n, g])
    return again


@njit(cache=True, fastmath={"contract"}, nogil=True)
def last_write(
    x,       # (N, S, C) input in channels-last order
    shift,   # (N, G) each group's shift (the mean's first part)
    corr,    # (N, G) its correction, mean = shift + corr
    rstd,    # (N, G) each group's rstd
    w,       # (C,) weight in the accumulation dtype, or None
    b,       # (C,) bias in the accumulation dtype, or None
    y,       # (N * S, C) output in channels-last order, a position a row, x's dtype
    stream,  # scalar bool: write y with streaming stores (memory), never where y is x
    blocks,  # (K, 3) as last_sums
    lo,      # scalar: first block
    hi,      # scalar: one past the last
):
    """Blocks ``lo:hi`` of the forward's y, as scale_shift_span writes a channel, each
    channel's constants laid out once a block."""
    wide_vectors(x)
    S, C = x.shape[1], x.shape[2]
    m, k, f, bc = empty_row(C, rstd), empty_row(C, rstd), empty_row(C, rstd), empty_row(C, rstd)
    for q in range(lo, hi):
        n, a, e = blocks[q, 0], blocks[q, 1], blocks[q, 2]
        by_channel(shift, n, m)
        by_channel(corr, n, k)
        by_channel(rstd, n, f)
        lost = False
        for c in range(C):
            if w is not None:
                f[c] *= w[c]
                lost |= folded_away(f[c], w[c])
            bc[c] = b[c] if b is not None else rstd.dtype.type(0)
        if lost:  # (rare: such channels with rstd and the weight in turn)
            last_unfolded(x, n, a, e, m, k, f, rstd, w, bc, y)
            continue
        if STREAMING and stream:
            # a position at a time: its row's whole lines streamed, the parts of lines at
            # its ends (shared with the rows beside it) by ordinary stores
            for s in range(a, e):
                p = n * S + s
                s0, s1 = stream_span(y, p)
                last_span(x, n, s, m, k, f, bc, y, p, 0, s0, False)
                last_span(x, n, s, m, k, f, bc, y, p, s0, s1, True)
                last_span(x, n, s, m, k, f, bc, y, p, s1, C, False)
            continue
        t = a + (e - a) // 4 * 4
        p = n * S
        for s in range(a, t, 4):  # four positions a step, as last_sums: the constants loaded once
            for c in range(C):
                j = np.uint64(c)
                mj, kj, fj, bj = m[j], k[j], f[j], bc[j]
                y[p + s, j] = narrow(((widen(x[n, s, j]) - mj) - kj) * fj + bj, y)
                y[p + s + 1, j] = narrow(((widen(x[n, s + 1, j]) - mj) - kj) * fj + bj, y)
                y[p + s + 2, j] = narrow(((widen(x[n, s + 2, j]) - mj) - kj) * fj + bj, y)
                y[p + s + 3, j] = narrow(((widen(x[n, s + 3, j]) - mj) - kj) * fj + bj, y)
        for s in range(t, e):
            last_span(x, n, s, m, k, f, bc, y, p + s, 0, C, False)
    if STREAMING and stream:
        store_fence()
    return 0


@njit(cache=True, fastmath={"contract"}, nogil=True)
def last_unfolded(
    x,      # (N, S, C) input in channels-last order
    n,      # scalar: the sample
    a,      # scalar: first position of the block
    e,      # scalar: one past its last
    m,      # (C,) each channel's shift
    k,      # (C,) its correction
    f,      # (C,) rstd * weight
    rstd,   # (N, G) each group's rstd
    w,      # (C,) weight in the accumulation dtype
    bc,     # (C,) bias
    y,      # (N * S, C) output, a position a row
):
    """last_write's block where a channel's rstd * weight left the range (``folded_away``):
    such a channel's ((x - shift) - corr) * rstd * weight + bias with the two factors in
    turn, every other channel's as last_span writes it (its bits do not depend on another
    group's)."""
    C = x.shape[2]
    r = empty_row(C, rstd)  # (here, not in last_write: only a block with such a channel needs it)
    by_channel(rstd, n, r)
    for s in range(a, e):
        for c in range(C):
            j = np.uint64(c)
            d = (widen(x[n, s, j]) - m[j]) - k[j]
            v = (d * r[j]) * w[j] + bc[j] if folded_away(f[j], w[j]) else d * f[j] + bc[j]
            y[n * x.shape[1] + s, j] = narrow(v, y)


@njit(cache=True, fastmath={"contract"}, nogil=True, inline="always")
def last_span(
    x,      # (N, S, C) input in channels-last order
    n,      # scalar: the sample
    s,      # scalar: the position
    m,      # (C,) each channel's shift
    k,      # (C,) its correction
    f,      # (C,) rstd * weight
    bc,     # (C,) bias
    y,      # (N * S, C) output, a position a row
    p,      # scalar: the position's row of y
    lo,     # scalar: first channel of the span
    hi,     # scalar: one past its last
    nt,     # constant bool: streaming stores (a span from memory.stream_span)
):
    """Channels ``lo:hi`` of position ``s`` of sample ``n``, normalized, into ``y[p]``;
    a streamed span and a plain one compute the same operations (scale_shift_span)."""
    for c in range(lo, hi):
        j = np.uint64(c)
        v = narrow(((widen(x[n, s, j]) - m[j]) - k[j]) * f[j] + bc[j], y)
        if nt:
            put_streaming(y, p, j, v)
        else:
            y[p, j] = v


@njit(cache=True, nogil=True)  # (as backward_groups)
def last_gradient_sums(
    dy,      # (N, S, C) gradient of y in channels-last order
    x,       # (N, S, C) forward input in channels-last order
    mean,    # (N, G) saved mean
    rstd,    # (N, G) saved rstd
    parts,   # (K, 3, C) output: each block's sum(dy * (x - mean) * rstd), sum(dy), sum(x - mean) per channel, float64
    blocks,  # (K, 3) as last_sums
    lo,      # scalar: first block
    hi,      # scalar: one past the last
):
    """Blocks ``lo:hi`` of the backward's per-channel sums (channel_sums's, per block)."""
    wide_vectors(dy)
    C = x.shape[2]
    zero = mean.dtype.type(0)
    mu, s1, s2, s3 = empty_row(C, mean), empty_row(C, mean), empty_row(C, mean), empty_row(C, mean)
    rs = empty_row(C, mean)
    for q in range(lo, hi):
        n = blocks[q, 0]
        by_channel(mean, n, mu)
        by_channel(rstd, n, rs)
        for c in range(C):
            s1[c] = zero
            s2[c] = zero
            s3[c] = zero
        for s in range(blocks[q, 1], blocks[q, 2]):
            for c in range(C):
                j = np.uint64(c)
                d = widen(x[n, s, j]) - mu[j]
                g = widen(dy[n, s, j])
                s1[j] += g * (d * rs[j])
                s2[j] += g
                s3[j] += d
        for c in range(C):
            parts[q, 0, c] = s1[c]
            parts[q, 1, c] = s2[c]
            parts[q, 2, c] = s3[c]
    return 0


@njit(cache=True, nogil=True)  # (no fastmath: backward_groups's arithmetic)
def last_gradient_constants(
    parts,   # (K, 3, C) the blocks' sums (last_gradient_sums), float64
    rstd,    # (N, G) saved rstd
    w,       # (C,) weight in the accumulation dtype, or None (ones)
    S,       # scalar: positions a sample
    corr,    # (N, G) output: mean(x - mean) over the group, accumulation dtype
    c1,      # (N, G) output: mean(xhat * wdy) over the group
    c2,      # (N, G) output: mean(wdy) over the group
    dw_part, # (N, C) output: each sample's sum(dy * xhat) per channel
    db_part, # (N, C) output: each sample's sum(dy) per channel
    marked,  # (N, G) output, bool: the group's constants left the range
):
    """backward_groups's per-group constants and per-sample partials, from the blocks' sums
    added in one order."""
    K, _, C = parts.shape
    N, G = rstd.shape
    Cg, per = C // G, K // N
    zero, one = rstd.dtype.type(0), rstd.dtype.type(1)
    inv_n = one / rstd.dtype.type(Cg * S)
    for n in range(N):
        for g in range(G):
            dsum = 0.0  # float64 over the group's channels, as backward_groups's
            for c in range(g * Cg, (g + 1) * Cg):
                a = dys = 0.0
                for q in range(n * per, (n + 1) * per):
                    a += parts[q, 0, c]
                    dys += parts[q, 1, c]
                    dsum += parts[q, 2, c]
                dw_part[n, c] = like(a, zero)
                db_part[n, c] = like(dys, zero)
            k = like(dsum, zero) * inv_n
            r = rstd[n, g]
            s1 = s2 = zero
            for c in range(g * Cg, (g + 1) * Cg):
                dyx = dw_part[n, c] - (k * r) * db_part[n, c]  # sum(dy * xhat) over the channel
                dw_part[n, c] = dyx
                wc = w[c] if w is not None else one
                s1 += wc * dyx
                s2 += wc * db_part[n, c]
            corr[n, g], c1[n, g], c2[n, g] = k, s1 * inv_n, s2 * inv_n
            marked[n, g] = not (np.isfinite(k) and np.isfinite(c1[n, g]) and np.isfinite(c2[n, g]))


@njit(cache=True, nogil=True)  # (no 'contract': as dx_channels)
def last_dx(
    dy,      # (N, S, C) gradient of y in channels-last order
    x,       # (N, S, C) forward input in channels-last order
    mean,    # (N, G) saved mean
    corr,    # (N, G) its correction, mean(x - mean) over the group
    rstd,    # (N, G) saved rstd
    w,       # (C,) weight in the accumulation dtype, or None (ones)
    c1,      # (N, G) mean(xhat * wdy) over the group
    c2,      # (N, G) mean(wdy) over the group
    dx,      # (N, S, C) output in channels-last order
    blocks,  # (K, 3) as last_sums
    lo,      # scalar: first block
    hi,      # scalar: one past the last
):
    """Blocks ``lo:hi`` of dx, as dx_span writes a channel, each channel's constants laid
    out once a block."""
    wide_vectors(dy)
    C = x.shape[2]
    one = rstd.dtype.type(1)
    mu, k, r, pc, qc, a1, a2, rf = (empty_row(C, rstd), empty_row(C, rstd), empty_row(C, rstd), empty_row(C, rstd),
                                    empty_row(C, rstd), empty_row(C, rstd), empty_row(C, rstd), empty_row(C, rstd))
    for q in range(lo, hi):
        n = blocks[q, 0]
        by_channel(mean, n, mu)
        by_channel(corr, n, k)
        by_channel(rstd, n, r)
        by_channel(c1, n, a1)
        by_channel(c2, n, a2)
        for c in range(C):  # (the factors of dx_channels)
            f, rf[c] = row_factors(r[c], one)
            pc[c], qc[c] = weight_factors(w[c] if w is not None else one, f, one)
            a1[c] *= f
            a2[c] *= f
        for s in range(blocks[q, 1], blocks[q, 2]):
            for c in range(C):
                j = np.uint64(c)
                xhat = ((widen(x[n, s, j]) - mu[j]) - k[j]) * r[j]
                dx[n, s, j] = narrow(((widen(dy[n, s, j]) * pc[j]) * qc[j] - (xhat * a1[j] + a2[j])) * rf[j], dx)
    return 0


def _views(a, mean):
    """``a`` (N, C, S) as the kernels read it, twice: a (sample, group) a row and a
    channel a row.  Explicit shapes: a batch of N = 0 does not reshape with -1."""
    N, C, S = a.shape
    G = mean.shape[1]
    v = kernel_view(a)
    return v.reshape(N * G, C // G * S), v.reshape(N * C, S)


def forward(x, weight, bias, eps, y, mean, rstd):
    """Fill ``y`` (N, C, S) and ``mean``/``rstd`` (N, G) for group norm; x and y both
    C-contiguous, or both in channels-last order (``last``)."""
    if last(x):
        _forward_last(x, weight, bias, eps, y, mean, rstd)
        return
    acc = acc_of(x.dtype)
    ys = scratch_for(y, x, weight, bias)
    stream = ys is y and stream_apart(y, x)  # never in place (memory.stream_apart says why)
    xg, xc = _views(x, mean)
    yg, yc = _views(ys, mean)
    launch(_forward, x.size, row_block(mean.size), xg, param(weight, acc), param(bias, acc), acc.type(eps),
           yg, xc, yc, mean, rstd, stream)
    finish(ys, y)


def backward(dy, x, mean, rstd, weight, dx, dweight, dbias):
    """Fill ``dx`` (N, C, S) and ``dweight``/``dbias`` (C,) in the accumulation dtype; dy, x
    and dx all C-contiguous, or all in channels-last order (``last``)."""
    if last(x):
        _backward_last(dy, x, mean, rstd, weight, dx, dweight, dbias)
        return
    N, C, _ = x.shape
    acc = acc_of(x.dtype)
    dw_part = np.empty((N, C), acc)
    db_part = np.empty((N, C), acc)
    (dyg, dyc), (xg, xc), (dxg, dxc) = (_views(a, mean) for a in (dy, x, dx))
    launch(_backward, x.size, row_block(mean.size), dyg, xg, mean, rstd, param(weight, acc), dxg, dyc, xc, dxc,
           dw_part, db_part, stream_apart(dx, dy, x))
    # per-sample partials summed in sample order: deterministic for any thread count
    dw_part.sum(axis=0, out=dweight)
    db_part.sum(axis=0, out=dbias)


def last(a):
    """Whether ``a`` (N, C, S) is in channels-last order: (N, S, C) in memory, and not
    C-contiguous as well (one channel, or one position, is both: the groups' kernels take it)."""
    return not a.flags.c_contiguous and a.transpose(0, 2, 1).flags.c_contiguous


def positions(a):
    """``a`` (N, C, S) in channels-last order as last_write writes it: (N * S, C),
    a position a row (a view: the transpose is C-contiguous), so that a position's whole
    lines are a row's (memory.stream_span)."""
    N, C, S = a.shape
    return kernel_view(a).transpose(0, 2, 1).reshape(N * S, C)


def samples_at_once(x, arrays):
    """How many samples of x (N, C, S) the channels-last kernels take a call: as many as
    ``arrays`` such arrays keep in the cache counted on (memory.CACHE_BYTES), so that a
    second pass finds them where the first left them, and one at least."""
    return max(1, CACHE_BYTES // max(1, arrays * x[0].nbytes))


def _forward_last(x, weight, bias, eps, y, mean, rstd):
    """``forward`` of x and y in channels-last order, a few samples a call (``samples_at_once``)."""
    acc = acc_of(x.dtype)
    w, b = param(weight, acc), param(bias, acc)
    ys = scratch_for(y, x, weight, bias)
    far = should_stream(x)  # too large for the cache: read from memory (last_sums' stream)
    stream = ys is y and stream_apart(y, x)  # by the whole y, as forward's
    per = samples_at_once(x, 2)
    for n in range(0, x.shape[0], per):
        k = slice(n, n + per)
        if not _forward_samples(x[k], w, b, acc.type(eps), ys[k], mean[k], rstd[k], far, stream):
            # sums out of range on finite inputs: the groups' kernels rescue them
            yc = np.empty(x[k].shape, x.dtype)
            forward(np.ascontiguousarray(x[k]), weight, bias, eps, yc, mean[k], rstd[k])
            np.copyto(ys[k], yc)
    finish(ys, y)


def _forward_samples(x, w, b, eps, y, mean, rstd, far, stream):
    """``_forward_last`` of a few samples, weight and bias in the accumulation dtype (or None):
    last_shift, last_sums (twice where a group's shift cannot be trusted), last_statistics,
    last_write; False, writing nothing, where a group's sums left the range on finite inputs."""
    N, C, S = x.shape
    blocks = last_blocks(N, S)
    xl = kernel_view(x).transpose(0, 2, 1)
    shift, corr = np.empty(mean.shape, eps.dtype), np.empty(mean.shape, eps.dtype)
    marked = np.empty(mean.shape, np.bool_)
    last_shift(xl, shift)
    parts = np.empty((blocks.shape[0], 2, C))
    for final in (False, True):
        launch(_last_sums, x.size, 1, xl, shift, parts, far, blocks)
        if not last_statistics(parts, shift, corr, rstd, marked, eps, S, final):
            break
    if marked.any() and _finite_group(x, marked):
        return False
    np.add(shift, corr, out=mean)
    launch(_last_write, x.size, 1, xl, shift, corr, rstd, w, b, positions(y), stream, blocks)
    return True


def _finite_group(x, marked):
    """Whether any group of x (N, C, S) that ``marked`` (N, G) marks holds only finite values
    (widened to float64, which every float dtype's finite values stay finite in)."""
    xg = x.reshape(x.shape[0], marked.shape[1], -1, x.shape[2])
    return any(np.isfinite(xg[n, g].astype(np.float64)).all() for n, g in zip(*np.nonzero(marked)))


def _backward_last(dy, x, mean, rstd, weight, dx, dweight, dbias):
    """``backward`` of dy, x and dx in channels-last order, a few samples a call (``samples_at_once``)."""
    acc = acc_of(x.dtype)
    w = param(weight, acc)
    per = samples_at_once(x, 3)
    partials = []
    for n in range(0, x.shape[0], per):
        k = slice(n, n + per)
        got = _backward_samples(dy[k], x[k], mean[k], rstd[k], w, dx[k])
        if got is None:  # sums out of range on finite inputs: the groups' kernels rescue them
            dxc, dwk, dbk = np.empty(x[k].shape, x.dtype), np.empty_like(dweight), np.empty_like(dbias)
            backward(np.ascontiguousarray(dy[k]), np.ascontiguousarray(x[k]), mean[k], rstd[k], weight, dxc,
                     dwk, dbk)
            np.copyto(dx[k], dxc)
            got = dwk[None], dbk[None]  # (their samples' sums, as one)
        partials.append(got)
    # samples in order, as backward's
    np.concatenate([d for d, _ in partials]).sum(axis=0, out=dweight)
    np.concatenate([d for _, d in partials]).sum(axis=0, out=dbias)


def _backward_samples(dy, x, mean, rstd, w, dx):
    """``_backward_last`` of a few samples, the weight in the accumulation dtype (or None):
    last_gradient_sums, last_gradient_constants, last_dx; their dweight and dbias partials,
    each (samples, C), or None, writing nothing, where a group's sums left the range on
    finite inputs."""
    N, C, S = x.shape
    blocks = last_blocks(N, S)
    dyl, xl, dxl = (kernel_view(a).transpose(0, 2, 1) for a in (dy, x, dx))
    parts = np.empty((blocks.shape[0], 3, C))
    launch(_last_gradient_sums, x.size, 1, dyl, xl, mean, rstd, parts, blocks)
    corr, c1, c2 = (np.empty(mean.shape, rstd.dtype) for _ in range(3))
    dw_part, db_part = np.empty((N, C), rstd.dtype), np.empty((N, C), rstd.dtype)
    marked = np.empty(mean.shape, np.bool_)
    last_gradient_constants(parts, rstd, w, S, corr, c1, c2, dw_part, db_part, marked)
    if marked.any() and _finite_group(x, marked):
        return None
    launch(_last_dx, x.size, 1, dyl, xl, mean, corr, rstd, w, c1, c2, dxl, blocks)
    return dw_part, db_part

# The row functions with their parallel kernels over blocks of groups (common.launch)
_forward = in_blocks(forward_groups)
_backward = in_blocks(backward_groups, marks=None)
# and over blocks of positions, in channels-last order
_last_sums = in_spans(last_sums)
_last_write = in_spans(last_write)
_last_gradient_sums = in_spans(last_gradient_sums)
_last_dx = in_spans(last_dx)
