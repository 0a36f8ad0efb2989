"""Sums over the threads of one row group.

A *row group* is ``tpr`` consecutive threads of a block (a power of two, at most
the block) that share one row; every thread of the block calls these functions
the same number of times, whether its row exists or not, because a group wider
than a warp meets at a ``syncthreads`` and the shuffles name every lane of the
warp.  Every thread of the group gets the same sum back, bit for bit.

An xor butterfly of warp shuffles inside each warp (both partners add the same
two numbers, so all lanes hold identical bits at every step), then, for groups
wider than a warp, the cross-warp step: lane 0 of each warp writes the warp's
partial to shared memory, and after the barrier lane ``l`` of every warp of the
group reads partial ``l mod W`` (``W`` = the group's warps) and a butterfly of
``log2 W`` shuffles finishes -- each aligned run of ``W`` lanes holds all ``W``
partials and sums them in the same tree, so every lane of the group ends with
the same bits.  (Before: every thread read all ``W`` partials in turn, with
signed 64-bit index arithmetic: ~1100 warp instructions per row for the
LayerNorm forward at N = 8192, float16, sm_90, a model from the SASS.)  Indices
are 32-bit unsigned.  Groups of up to 32 threads never touch shared memory or a
barrier.  The CUDA simulator runs this same code: ``numbanorm.cuda._simwarp``
gives it the warp shuffles.

``group_sum2``/``group_sum3`` reduce two/three values at once (one barrier, and
the shuffles of the values interleave).  Shared memory is
``scratch[buf, value, slot]`` (value < the number reduced) with two buffers: callers
alternate ``buf`` between consecutive reductions, so the one barrier inside a
reduction also separates the reads of the previous use of the other buffer from
the next writes to it (one barrier per reduction instead of two).
"""

import functools

from numba import cuda

SIMULATED = bool(cuda.config.ENABLE_CUDASIM)
WARP = 32
_FULL_MASK = 0xFFFFFFFF
U32 = cuda.uint32


def slots(block):
    """Scratch slots per buffer and value for a block of ``block`` threads."""
    return max(1, block // WARP)


@cuda.jit(device=True)
def _butterfly(v, width):
    """The sum over each aligned run of ``width`` lanes (a power of two <= 32), in every lane."""
    off = U32(width) >> U32(1)
    while off > U32(0):
        v += cuda.shfl_xor_sync(_FULL_MASK, v, off)
        off >>= U32(1)
    return v


@cuda.jit(device=True)
def _post(v, scratch, buf, k, tid):
    """Lane 0 of each warp writes its warp's partial of value ``k``."""
    u = U32(tid)
    if u & U32(WARP - 1) == U32(0):
        scratch[buf, k, u >> U32(5)] = v


@cuda.jit(device=True)
def _gather(scratch, buf, k, tid, tpr):
    """After the barrier: the group's sum of value ``k`` from its warps' partials."""
    u = U32(tid)
    nw = U32(tpr) >> U32(5)                        # warps in the group
    first = (u >> U32(5)) & ~(nw - U32(1))         # the group's first warp
    return _butterfly(scratch[buf, k, first + (u & (nw - U32(1)))], nw)


@cuda.jit(device=True)
def group_sum(v, scratch, buf, tid, tpr):
    v = _butterfly(v, min(tpr, WARP))
    if tpr > WARP:
        _post(v, scratch, buf, 0, tid)
        cuda.syncthreads()
        v = _gather(scratch, buf, 0, tid, tpr)
    return v


# group_sum2/group_sum3: fixed arity on purpose, every value's shuffles interleaved and
# one barrier for all of them (group_sum once per value would take a barrier each)
@cuda.jit(device=True)
def group_sum2(a, b, scratch, buf, tid, tpr):
    off = U32(min(tpr, WARP)) >> U32(1)
    while off > U32(0):
        a += cuda.shfl_xor_sync(_FULL_MASK, a, off)
        b += cuda.shfl_xor_sync(_FULL_MASK, b, off)
        off >>= U32(1)
    if tpr > WARP:
        _post(a, scratch, buf, 0, tid)
        _post(b, scratch, buf, 1, tid)
        cuda.syncthreads()
        a = _gather(scratch, buf, 0, tid, tpr)
        b = _gather(scratch, buf, 1, tid, tpr)
    return a, b


@cuda.jit(device=True)
def group_sum3(a, b, c, scratch, buf, tid, tpr):
    off = U32(min(tpr, WARP)) >> U32(1)
    while off > U32(0):
        a += cuda.shfl_xor_sync(_FULL_MASK, a, off)
        b += cuda.shfl_xor_sync(_FULL_MASK, b, off)
        c += cuda.shfl_xor_sync(_FULL_MASK, c, off)
        off >>= U32(1)
    if tpr > WARP:
        _post(a, scratch, buf, 0, tid)
        _post(b, scratch, buf, 1, tid)
        _post(c, scratch, buf, 2, tid)
        cuda.syncthreads()
        a = _gather(scratch, buf, 0, tid, tpr)
        b = _gather(scratch, buf, 1, tid, tpr)
        c = _gather(scratch, buf, 2, tid, tpr)
    return a, b, c



@functools.lru_cache(maxsize=None)
def group_sums_fn(n):
    """``group_sums(v, scratch, buf, tid, tpr)``: the group sums of the ``n`` values
    v[0:n] (a local array), in place: group_sum3's steps for any fixed ``n`` -- every
    value's shuffles interleaved, one barrier for all of them, the same tree (and bits)
    in every lane.  ``scratch``: (2, >= n, slots)."""

    @cuda.jit(device=True)
    def group_sums(v, scratch, buf, tid, tpr):
        off = U32(min(tpr, WARP)) >> U32(1)
        while off > U32(0):
            for k in range(n):
                v[k] += cuda.shfl_xor_sync(_FULL_MASK, v[k], off)
            off >>= U32(1)
        if tpr > WARP:
            for k in range(n):
                _post(v[k], scratch, buf, k, tid)
            cuda.syncthreads()
            for k in range(n):
                v[k] = _gather(scratch, buf, k, tid, tpr)

    return group_sums
