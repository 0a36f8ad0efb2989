"""What the CPU norm modules share: output placement, the fastmath set, row blocks.

16-bit floats are converted inside the kernels, never staged (``halves``).
"""

import inspect
import os
import threading
import types as pytypes

import numba
import numpy as np
from numba import prange, types
from numba.extending import intrinsic
from numba.np.ufunc import parallel as _numba_parallel

from .cache import njit
from .halves import WIDE_HALVES, kernel_view, widen

# 'reassoc' lets LLVM split each row reduction over several vector accumulators
# (a float32 row sum is otherwise one serial chain of dependent adds).
# No 'contract': fused multiply-adds computed wdy - c2 with wdy unrounded, which
# left 5e-5 (x rstd = 316) where the exact answer is 0 for one-element groups.
# No 'nnan'/'ninf': NaN and Inf must propagate exactly as IEEE says (the contract
# keeps a NaN inside its own row, and the tests check that it does get there).
FASTMATH = {"reassoc"}

# LLVM vectorizes 256 bits wide on every Intel AVX-512 CPU (the clock drop of 512-bit
# code on the first ones).  From Sapphire Rapids, 512 bits pay for the 16-bit row
# functions, not for float32's (halves.wide_halves; measured: book, chapter 9): the
# element types whose row functions ask for them.
WIDE_VECTORS = (types.uint16, types.int16) if WIDE_HALVES else ()


@intrinsic
def wide_vectors(typingctx, x):
    """Vectorize the calling function's loops 512 bits wide where ``x``'s element type
    is in WIDE_VECTORS: every row function (and every function of its own that it
    calls with a hot loop) calls it first, on its input."""
    def codegen(context, builder, signature, args):
        # decided here, at each compile: Numba keeps a typer's result per argument type
        if signature.args[0].dtype in WIDE_VECTORS:
            # a string attribute: llvmlite's attribute set admits only its own list of names
            set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.void(x), codegen


F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


def acc_of(dtype):
    """Accumulation dtype: float64 for float64 arrays, float32 otherwise."""
    return F64 if dtype == F64 else F32


def scratch_for(out, src=None, *params):
    """Where a kernel writes ``out``: itself, or a fresh array that ``finish`` copies back.

    Fresh where ``out`` overlaps ``src`` without being the very same array: writing row i would overwrite elements of
    later rows of ``src`` before they are read, so the result is made apart and
    copied in, as NumPy's ufuncs do for overlapping operands.  An in-place
    ``out=x`` is written directly: each row's sums are taken in loops that store
    nothing before the row is overwritten element by element
    (``layer_norm.row_sum``), so it gives the bits of an out-of-place call.
    Fresh too where ``out`` overlaps any of ``params`` (weight, bias: every row
    reads all of them, so no overlap is safe).
    """
    if src is not None and np.may_share_memory(out, src) and not _same_memory(out, src):
        return np.empty_like(out)
    if any(p is not None and np.may_share_memory(out, p) for p in params):
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
    if a is None:
        return None
    bits = kernel_view(a) if a.dtype.itemsize == 2 and a.ndim == 1 else a
    if bits is not a:  # float16/bfloat16: NumPy's own cast took 10 us for 4096 weights
        wide = np.empty(a.shape, dtype)
        _widen_into(bits, wide)
        return wide
    return np.ascontiguousarray(a, dtype=dtype)


@njit(cache=True, nogil=True)
def _widen_into(
    src,    # (N,) 16-bit floats as integer bits (halves)
    dst,    # (N,) the accumulation dtype
):
    for j in range(src.shape[0]):
        dst[j] = widen(src[j])


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
    staged, ``layer_norm.forward_rows``), so blocks are long, up to 64 rows; at least four
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

# kernel -> the same Python function compiled without parallel=True
_SERIAL = {}


def serial_variant(kernel):
    """Compile ``kernel``'s Python function again without ``parallel=True``
    (``prange`` runs as ``range``, on the caller's thread) for :func:`launch`.

    A kernel's body must be only its loop over rows (or groups) calling a
    separately compiled njit function that does all the arithmetic: compiled
    twice, the arithmetic itself was vectorized differently by LLVM (the reduction
    order of 'reassoc' sums), an ulp apart on many row lengths.  The kernels of
    :func:`in_blocks` and :func:`in_partials` are such loops.
    """
    f = kernel.py_func
    g = pytypes.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    # a cache file of its own: Numba names cache files by qualname and does
    # not key them on the compile flags
    g.__qualname__ = f.__qualname__ + "_serial"
    g.__module__ = f.__module__
    options = dict(kernel.targetoptions)
    options.pop("parallel", None)
    options.pop("nopython", None)
    # parallel=True implies NumPy's error model (1/0 is inf); njit's default raises
    options["error_model"] = "numpy"
    _SERIAL[kernel] = njit(cache=True, **options)(g)
    return _SERIAL[kernel]


# The two parallel loops every CPU kernel is, around a row function ROWS that does all
# the arithmetic of rows lo:hi (its own arguments first, the block's bounds last) of
# n = rstd.size rows (one statistic a row, or a group): the kernel's block argument,
# the loop, the bounds it passes, and their names in ROWS.
_LOOPS = {
    # n rows (or groups) in blocks of `block`: rows are independent, so the blocking never changes a bit
    "blocks": ("block", "prange(-(-n // block))", "blk * block, min(n, blk * block + block)", ("lo", "hi")),
    # n rows in `blocks` blocks fixed by n alone (n_chunks); block blk writes row blk of its partials
    "partials": ("blocks", "prange(blocks)", "blk, blk * n // blocks, (blk + 1) * n // blocks", ("blk", "lo", "hi")),
}


def _kernel_of(rows, loop):
    """The ``parallel=True`` kernel ``kernel(size, *rows' arguments)`` of ``loop``
    around ``rows``, and its serial twin.

    Written out with ``rows``' own parameters rather than ``*args``: Numba's dispatcher
    took 0.15-0.2 us more per call of a ``*args`` kernel (the serial LayerNorm forward
    at (1, 768) float32, one thread: 1.10 against 0.89 us, 4% of a repeated public
    call), and the row count is read from ``rstd`` rather than passed (one int
    argument more took 0.02 us, 3% of that kernel call).  ``rows`` is a global of the kernel, not a closure cell or an argument:
    Numba keys a cached function on its closure's pickled contents, and a dispatcher
    pickles with a fresh id per process (a recompile on every import).  The source
    is said to be this file (the cache's locator wants a real one), the qualname is
    the row function's (Numba names cache files by qualname).
    """
    size, prange_of, bounds, tail = _LOOPS[loop]
    params = list(inspect.signature(rows.py_func).parameters)
    # the bounds last, the statistics there, and no argument named as the kernel's own
    lead = params[: -len(tail)]
    assert tuple(params[-len(tail):]) == tail and "rstd" in lead and not {"n", size, "blk"} & set(lead), params
    args = ", ".join(lead)
    src = (f"def kernel({size}, {args}):\n"
           f"    n = rstd.size\n"
           f"    for blk in {prange_of}:\n"
           f"        ROWS({args}, {bounds})\n")
    namespace = {"prange": prange, "ROWS": rows}
    exec(compile(src, __file__, "exec"), namespace)
    f = namespace["kernel"]
    f.__qualname__ = f"{rows.__module__.rsplit('.', 1)[-1]}.{rows.__qualname__}.parallel"
    f.__module__ = rows.__module__
    kernel = njit(parallel=True, cache=True, nogil=True)(f)
    serial_variant(kernel)
    return kernel


def in_blocks(rows):
    """The kernel ``kernel(block, *args)`` that runs ``rows(*args, lo, hi)`` over the
    ``rstd.size`` rows (or groups) of ``args`` in blocks of ``block`` (:func:`row_block`),
    on Numba's threads, and its serial twin (:func:`launch` picks)."""
    return _kernel_of(rows, "blocks")


def in_partials(rows):
    """The kernel ``kernel(blocks, *args)`` that runs ``rows(*args, blk, lo, hi)``
    over the ``rstd.size`` rows of ``args`` in ``blocks`` blocks (:func:`n_chunks`),
    block ``blk`` writing row ``blk`` of its dweight/dbias partials, and its serial twin."""
    return _kernel_of(rows, "partials")


# Held while a parallel kernel runs.  The workqueue layer aborts the process when
# two threads enter it at once, and OpenMP/TBB would only oversubscribe the
# cores, so a second caller does not wait for the pool: it runs the serial
# variant on its own thread.
_pool = threading.Lock()
# False in a child forked after this process ran a parallel kernel: GNU OpenMP
# kills such a child at its first parallel region, and the workqueue's threads
# are not copied by fork.
_parallel_ok = True


def launch(kernel, size, *args):
    """``kernel(*args)`` on Numba's threads, or its serial variant on the calling
    thread: for ``size`` elements too few to share, in a forked child, or while
    another thread has the pool.  Both give the same bits: a kernel is a loop over
    row blocks that calls one compiled function doing all the arithmetic
    (``layer_norm.forward_rows``), and only that loop is compiled twice."""
    if size >= SERIAL_BELOW and _parallel_ok and _pool.acquire(blocking=False):
        try:
            return kernel(*args)
        finally:
            _pool.release()
    return _SERIAL[kernel](*args)


def _after_fork_in_child():
    global _pool, _parallel_ok
    _pool = threading.Lock()  # a parent thread may have held it at the fork
    if getattr(_numba_parallel, "_is_initialized", True):  # Numba started its threads
        _parallel_ok = False


os.register_at_fork(after_in_child=_after_fork_in_child)
