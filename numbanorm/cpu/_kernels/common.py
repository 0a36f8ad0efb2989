"""What the CPU norm modules share: output placement, the fastmath set, row blocks.

16-bit floats are converted inside the kernels, never staged (``halves``).
"""

import numba
import numpy as np

# 'reassoc' lets LLVM split each row reduction over several vector accumulators
# (a float32 row sum is otherwise one serial chain of dependent adds).
# No 'contract': fused multiply-adds computed wdy - c2 with wdy unrounded, which
# left 5e-5 (x rstd = 316) where the exact answer is 0 for one-element groups.
# No 'nnan'/'ninf': NaN and Inf must propagate exactly as IEEE says (the contract
# keeps a NaN inside its own row, and the tests check that it does get there).
FASTMATH = {"reassoc"}

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


def acc_of(dtype):
    """Accumulation dtype: float64 for float64 arrays, float32 otherwise."""
    return F64 if dtype == F64 else F32


def scratch_for(out, src=None):
    """Where a kernel writes ``out``: itself, or a fresh array that ``finish`` copies back.

    Fresh where ``out`` overlaps ``src`` without being the very same array: writing row i would overwrite elements of
    later rows of ``src`` before they are read, so the result is made apart and
    copied in, as NumPy's ufuncs do for overlapping operands.  An in-place
    ``out=x`` is written directly: each row's sums are taken in loops that store
    nothing before the row is overwritten element by element
    (``layer_norm.row_sum``), so it gives the bits of an out-of-place call.
    """
    if src is not None and np.may_share_memory(out, src) and not _same_memory(out, src):
        return np.empty_like(out)
    return out


def _same_memory(a, b):
    return (a.ctypes.data == b.ctypes.data and a.shape == b.shape and a.strides == b.strides
            and a.dtype == b.dtype)


def finish(scratch, out):
    if scratch is not out:
        np.copyto(out, scratch)


def param(a, dtype):
    """Affine parameters (tiny) in the accumulation dtype, contiguous."""
    return None if a is None else np.ascontiguousarray(a, dtype=dtype)


def n_chunks(rows):
    """How many row blocks the backward splits into for its dweight/dbias partials.

    Depends on the row count alone, never on the thread count, so the summation
    order of dweight/dbias (and so every bit of them) is the same on any machine
    with any ``NUMBA_NUM_THREADS``.  At least 64 blocks keeps up to 64 threads
    busy; at most 256 rows per block keeps each float32 partial sum short
    (its error grows with the number of rows summed serially).  At least 16 rows
    per block keeps the partials small for small inputs: with 64 blocks of 4 rows a
    (256, 768) backward zeroed and summed 64 partial rows and took 1.25x torch's time.
    """
    return min(rows, max(64, -(-rows // 256)), max(1, rows // 16))


def row_block(rows):
    """Rows per block of a forward kernel's parallel loop.

    Each block of a streamed forward allocates one scratch row (where a row is
    staged, ``layer_norm._forward``), so blocks are long, up to 64 rows; at least four
    per thread keeps the threads evenly loaded.  Rows are independent in the
    forward, so the blocking never changes a result (a test checks it bit for
    bit).
    """
    return max(1, min(64, -(-rows // (4 * numba.get_num_threads()))))


# Below this many elements a kernel runs on the calling thread alone.  A (2, 128)
# LayerNorm forward took 58 us with 2 threads and 6 us with one, measured here
# with a little Python between calls while other processes loaded both cores (the
# idle OpenMP worker spins against the caller); unloaded both took ~14 us.
# 32768 is PyTorch's grain size for its CPU parallel_for (at::internal::GRAIN_SIZE).
SERIAL_BELOW = 32768


def launch(kernel, size, *args):
    """``kernel(*args)``, on one thread when ``size`` elements are too few to share."""
    if size >= SERIAL_BELOW:
        return kernel(*args)
    threads = numba.get_num_threads()
    if threads == 1:
        return kernel(*args)
    numba.set_num_threads(1)
    try:
        return kernel(*args)
    finally:
        numba.set_num_threads(threads)
