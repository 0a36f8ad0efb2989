"""Sums over the threads of one row group.

A *row group* is ``tpr`` consecutive threads of a block (a power of two, at most
the block) that share one row; every thread of the block calls these functions
the same number of times, whether its row exists or not, because a group wider
than a warp meets at a ``syncthreads`` and the shuffles name every lane of the
warp.  Every thread of the group gets the same sum back, bit for bit.

An xor butterfly of warp shuffles inside each warp (both partners add the same
two numbers, so all lanes hold identical bits at every step), then, for groups
wider than a warp, one value per warp through shared memory, summed by every
thread in warp order.  Groups of up to 32 threads never touch shared memory or a
barrier.  The CUDA simulator runs this same code: ``numbanorm.cuda._simwarp``
gives it the warp shuffles.

``group_sum2``/``group_sum3`` reduce two/three values at once (one barrier, and
the shuffles of the values interleave).  Shared memory is
``scratch[buf, value, slot]`` (value < the number reduced) with two buffers: callers
alternate ``buf`` between consecutive reductions, so the one barrier inside a
reduction also separates the reads of the previous use of the other buffer from
the next writes to it (one barrier per reduction instead of two).
"""

from numba import cuda

SIMULATED = bool(cuda.config.ENABLE_CUDASIM)
WARP = 32
_FULL_MASK = 0xFFFFFFFF


def slots(block):
    """Scratch slots per buffer and value for a block of ``block`` threads."""
    return max(1, block // WARP)


@cuda.jit(device=True)
def group_sum(v, scratch, buf, tid, tpr):
    off = min(tpr, WARP) // 2
    while off > 0:
        v += cuda.shfl_xor_sync(_FULL_MASK, v, off)
        off //= 2
    if tpr > WARP:
        if tid % WARP == 0:
            scratch[buf, 0, tid // WARP] = v
        cuda.syncthreads()
        first = (tid // tpr) * (tpr // WARP)
        v = scratch[buf, 0, first]
        for k in range(1, tpr // WARP):
            v += scratch[buf, 0, first + k]
    return v


@cuda.jit(device=True)
def group_sum2(a, b, scratch, buf, tid, tpr):
    off = min(tpr, WARP) // 2
    while off > 0:
        a += cuda.shfl_xor_sync(_FULL_MASK, a, off)
        b += cuda.shfl_xor_sync(_FULL_MASK, b, off)
        off //= 2
    if tpr > WARP:
        if tid % WARP == 0:
            scratch[buf, 0, tid // WARP] = a
            scratch[buf, 1, tid // WARP] = b
        cuda.syncthreads()
        first = (tid // tpr) * (tpr // WARP)
        a = scratch[buf, 0, first]
        b = scratch[buf, 1, first]
        for k in range(1, tpr // WARP):
            a += scratch[buf, 0, first + k]
            b += scratch[buf, 1, first + k]
    return a, b


@cuda.jit(device=True)
def group_sum3(a, b, c, scratch, buf, tid, tpr):
    off = min(tpr, WARP) // 2
    while off > 0:
        a += cuda.shfl_xor_sync(_FULL_MASK, a, off)
        b += cuda.shfl_xor_sync(_FULL_MASK, b, off)
        c += cuda.shfl_xor_sync(_FULL_MASK, c, off)
        off //= 2
    if tpr > WARP:
        if tid % WARP == 0:
            scratch[buf, 0, tid // WARP] = a
            scratch[buf, 1, tid // WARP] = b
            scratch[buf, 2, tid // WARP] = c
        cuda.syncthreads()
        first = (tid // tpr) * (tpr // WARP)
        a = scratch[buf, 0, first]
        b = scratch[buf, 1, first]
        c = scratch[buf, 2, first]
        for k in range(1, tpr // WARP):
            a += scratch[buf, 0, first + k]
            b += scratch[buf, 1, first + k]
            c += scratch[buf, 2, first + k]
    return a, b, c
