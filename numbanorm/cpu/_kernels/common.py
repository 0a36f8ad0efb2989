"""What the CPU norm modules share: output placement, the fastmath set, row blocks.

16-bit floats are converted inside the kernels, never staged (``halves``).
"""

import inspect
import linecache
import os
import sys
import threading
import types as pytypes

import numba
import numpy as np
from numba import prange, types
from numba.extending import intrinsic
from numba.np.ufunc import parallel as _numba_parallel

from . import background
from .cache import GENERATED, njit
from .halves import F16, WIDE_HALVES, kernel_view, widen
from .memory import apart

# 'reassoc' lets LLVM split each row reduction over several vector accumulators
# (a float32 row sum is otherwise one serial chain of dependent adds).
# No 'contract': fused multiply-adds computed wdy - c2 with wdy unrounded, which
# left 5e-5 (x rstd = 316) where the exact answer is 0 for one-element groups.
# No 'nnan'/'ninf': NaN and Inf must propagate exactly as IEEE says (the contract
# keeps a NaN inside its own row, and the tests check that it does get there).
# For the sums alone (functions of their own: stats.row_stats): a row function's own loops
# reduce nothing, and with 'reassoc' LLVM ordered a span's arithmetic differently in a row
# function's two variants (STREAMING), an ulp apart.
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


@intrinsic
def least(typingctx, a, b):
    """``min(a, b)`` of two integers, as an intp: one select (Numba's ``min`` is an overload,
    compiled through its pipeline on a first call)."""
    if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        x, y = (context.cast(builder, v, t, types.intp) for v, t in zip(args, (a, b)))
        return builder.select(builder.icmp_signed("<", x, y), x, y)

    return types.intp(a, b), codegen


@intrinsic
def smallest_normal(typingctx, a):
    """The smallest normal number of ``a``'s float type, a constant (np.finfo's overload
    compiles through Numba's pipeline, and a kernel that used it loaded ``numba.np.linalg``
    with it from the cache)."""
    if not isinstance(a, types.Float):
        return None

    def codegen(context, builder, signature, args):
        return context.get_constant(a, float(np.finfo(str(a)).tiny))

    return a(a), codegen


@intrinsic
def empty_row(typingctx, n, like):
    """``np.empty(n, like.dtype)``: a new (n,) C-contiguous array from Numba's runtime.
    Written as an intrinsic because np.empty's overload, and the allocator it calls, go
    through Numba's pipeline on a first call (the CPU design log); a row's length cannot
    overflow the size NumPy's check guards."""
    if not isinstance(n, types.Integer) or not isinstance(like, types.Array):
        return None
    arrty = types.Array(like.dtype, 1, "C")

    def codegen(context, builder, signature, args):
        # (imported here, not at import, where it is a share of `import numbanorm`: Numba
        # has loaded it by the time anything compiles)
        from numba.np.arrayobj import make_array, populate_array

        length = context.cast(builder, args[0], n, types.intp)
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(like.dtype)))
        align = context.get_constant(types.uint32, context.get_preferred_array_alignment(like.dtype))
        meminfo = context.nrt.meminfo_alloc_aligned(builder, builder.mul(length, itemsize), align)
        ary = make_array(arrty)(context, builder)
        data = builder.bitcast(context.nrt.meminfo_data(builder, meminfo),
                               context.get_data_type(like.dtype).as_pointer())
        populate_array(ary, data=data, shape=[length], strides=[itemsize], itemsize=itemsize, meminfo=meminfo)
        return ary._getvalue()

    return arrty(n, like), codegen


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
    (``sums``), so it gives the bits of an out-of-place call.
    Fresh too where ``out`` overlaps any of ``params`` (weight, bias: every row
    reads all of them, so no overlap is safe).
    """
    if src is not None and np.may_share_memory(out, src) and not _same_memory(out, src):
        return np.empty_like(out)
    if not apart(out, *params):
        return np.empty_like(out)
    return out


def _same_memory(a, b):
    return (a.ctypes.data == b.ctypes.data and a.shape == b.shape and a.strides == b.strides
            and a.dtype == b.dtype)


def finish(scratch, out):
    if scratch is not out:
        np.copyto(out, scratch)


def weights(x, acc, *params):
    """A forward's affine parameters as its row function reads them: those in x's 16-bit
    dtype as their integer bits, widened as they are read (as ``cpu._backend.Plans`` passes them,
    so that its calls and the launcher's run one compiled function), the others
    converted to the accumulation dtype ``acc`` (:func:`param`)."""
    return tuple(kernel_view(a) if a is not None and a.dtype == x.dtype and a.dtype.itemsize == 2
                 and a.ndim == 1 and a.flags.c_contiguous else param(a, acc) for a in params)


def param(a, dtype):
    """Affine parameters (tiny) in the accumulation dtype, contiguous."""
    if a is None:
        return None
    if a.dtype == F16 and a.ndim == 1:  # our widening loop: NumPy's float16 cast is slower (book, log)
        wide = np.empty(a.shape, dtype)
        try:
            _widen_into(kernel_view(a), wide)
        except background.NotCompiled as e:  # NumPy's cast (the same values) until the loop is compiled
            np.copyto(wide, a)
            background.compile_after_launch(e.dispatcher, e.sig)
        return wide
    return np.ascontiguousarray(a, dtype=dtype)  # (bfloat16: ml_dtypes' cast, exact and as fast)


# compiled on the compile thread (background): a first call widens with NumPy meanwhile
@njit(cache=True, nogil=True, dispatcher=background.Dispatcher)
def _widen_into(
    src,    # (N,) 16-bit floats as integer bits (halves)
    dst,    # (N,) the accumulation dtype
):
    for j in range(src.shape[0]):
        dst[j] = widen(src[j])


# A backward's smallest block of rows longer than 4096, and its smallest call of two blocks,
# in elements (n_chunks): blocks of fewer such rows cost more than they shared (CPU design log)
BLOCK_ELEMENTS = 65536


def n_chunks(rows, n):
    """How many row blocks the backward splits ``rows`` rows of ``n`` into for its
    dweight/dbias partials.

    Depends on the shape alone, never on the thread count, so the summation
    order of dweight/dbias (and so every bit of them) is the same with any
    ``NUMBA_NUM_THREADS`` on one machine (another CPU may get other vector code from
    LLVM, hence other bits).  At least 64 blocks keeps up to 64 threads busy; at most
    256 rows per block keeps each float32 partial sum short (its error grows with
    the number of rows summed serially); at least 16 rows per block, or as few long
    rows as hold ``BLOCK_ELEMENTS``, keeps the partials few for small inputs, whose
    zeroing and summing would cost more than their rows; and a call of that many
    elements or more is two blocks at least, for two threads to share.
    """
    least = 2 if rows * n >= BLOCK_ELEMENTS else 1
    return min(rows, max(64, -(-rows // 256)), max(least, rows // min(16, -(-BLOCK_ELEMENTS // n))))


def row_block(rows):
    """Rows per block of a forward kernel's parallel loop.

    Each block of a streamed forward allocates one scratch row (where a row is
    staged, ``layer_norm.forward_rows``), so blocks are long, up to 64 rows; at least four
    per thread keeps the threads evenly loaded.  Rows are independent in the
    forward, so the blocking never changes a result (a test checks it bit for
    bit).
    """
    return max(1, min(64, -(-rows // (4 * num_threads()))))


# numba.get_num_threads() takes a process-wide semaphore and a thread lock at every call,
# and starts Numba's threads under them at the first: a child forked while another thread
# held them hung at its first call.  Once the threads run, the count is Numba's lock-free C
# call; the one start is made under _starting, which a fork waits for (_before_fork).
_starting = threading.Lock()


def num_threads():
    """``numba.get_num_threads()``: the calling thread's count of Numba's threads."""
    if _numba_parallel._is_initialized:
        return _numba_parallel._get_num_threads()
    with _starting:
        torch = sys.modules.get("torch")
        kept = torch.get_num_threads() if torch is not None else None
        n = numba.get_num_threads()
        # the OpenMP layer's start sets this thread's OpenMP count, which torch shares: its
        # ops would take Numba's count, and torch.compile recompiles on the change
        if kept is not None and torch.get_num_threads() != kept:
            torch.set_num_threads(kept)
        return n


# Below this many elements a kernel runs on the calling thread alone: waking the
# pool costs more than such a call's work, and on a loaded machine the idle OpenMP
# worker spins against the caller (the book's design log).  32768 is PyTorch's
# grain size for its CPU parallel_for (at::internal::GRAIN_SIZE).
SERIAL_BELOW = 32768


# Two paths of the row functions that a call rarely takes, each compiled into a variant of
# its own (variant(), from the first call that takes it), so that a first call compiles
# neither: STREAMING, the streaming stores into a large output (memory), whose bits
# are the plain stores' (a row function without them runs meanwhile: launch); RESCALE,
# what a row whose sums overflowed on finite inputs gets: False, it is left (a forward
# marks its rstd -1) and counted; True, it is normalized in float64 (rescale).  A row
# function (or a helper it calls: with_flags) reads them as ``if STREAMING and stream:``,
# ``if RESCALE:`` (Numba prunes a branch on a False global before typing it).
STREAMING = False
RESCALE = False
FLAGS = ("STREAMING", "RESCALE")


def with_flags(fn, **flags):
    """The Python function of dispatcher ``fn`` with the module ``flags`` set in its globals,
    and in those of each function of this package it calls that reads one of them."""
    f = fn.py_func
    env = dict(f.__globals__, **flags)
    for name in f.__code__.co_names:
        callee = env.get(name)
        if hasattr(callee, "py_func") and set(FLAGS) & set(callee.py_func.__code__.co_names):
            env[name] = variant(callee, **flags)
    g = pytypes.FunctionType(f.__code__, env, f.__name__, f.__defaults__, f.__closure__)
    g.__qualname__ = ".".join([f.__qualname__] + [k.lower() for k in FLAGS if flags.get(k)])  # its cache file's
    g.__module__ = f.__module__
    return g


_VARIANTS = {}


def variant(fn, dispatcher=None, **flags):
    """``fn`` compiled again with the module ``flags`` (STREAMING, RESCALE) set: made once,
    compiled when first called; ``dispatcher``: the class of dispatcher to make."""
    key = (fn, dispatcher, tuple(sorted(flags.items())))
    if key not in _VARIANTS:
        options = {k: v for k, v in fn.targetoptions.items() if k not in ("nopython", "boundscheck")}
        _VARIANTS[key] = njit(cache=True, dispatcher=dispatcher, **options)(with_flags(fn, **flags))
    return _VARIANTS[key]


class Kernel:
    """A row function ``rows(*args, lo, hi)`` and the two ways :func:`launch` runs it over
    all of its ``n`` items (rows, groups, or row blocks of partials): its
    ``parallel=True`` kernel ``parallel(block, *args)``, blocks of ``block`` items on
    Numba's threads, or ``rows(*args, 0, n)``, one call on the calling thread.

    The same compiled row function does every item's arithmetic either way, and an
    item's arithmetic does not depend on the block it falls in, so both give the
    same bits.  (A kernel body compiled twice -- a serial copy of the parallel loop
    with the arithmetic in it -- was vectorized differently by LLVM, an ulp apart on
    many row lengths.)
    """

    __slots__ = ("rows", "parallel", "_counted", "_count_at", "_by_size", "_marks", "_stream_at", "_streaming")

    def __init__(self, rows, counted, marks, dispatcher=None):
        self.rows = rows
        self.parallel = _parallel_kernel(rows, counted, dispatcher)
        lead = list(inspect.signature(rows.py_func).parameters)[:-2]
        self._counted = counted
        self._count_at = lead.index(counted)  # n: that argument's size or its rows (_COUNTS)
        self._by_size = _COUNTS[counted] == "size"
        self._marks = None if marks is None else lead.index(marks)  # (see rescue)
        self._stream_at = lead.index("stream") + 1 if "stream" in lead else None  # in a launch's arguments
        self._streaming = None

    @property
    def signatures(self):
        """The argument types the row function is compiled (or loaded) for."""
        return self.rows.signatures

    @property
    def stats(self):
        """Numba's counts of the row function's cache hits and misses."""
        return self.rows.stats

    def _count(self, args):
        """n, the items of rows' arguments ``args``."""
        a = args[self._count_at]
        return a.size if self._by_size else a.shape[0]

    def serial(self, block, *args):
        """Every item in one call of the row function, on the calling thread."""
        return self.rows(*args, 0, self._count(args))

    def streaming(self):
        """The Kernel of the row function's STREAMING variant, whose row function and
        parallel kernel are compiled on the compile thread (``background``)."""
        if self._streaming is None:
            rows = variant(self.rows, background.Dispatcher, STREAMING=True)
            self._streaming = Kernel(rows, self._counted, None, background.Dispatcher)
        return self._streaming

    def rescue(self, block, *args):
        """Run again, by the RESCALE variant of the row function (compiled when first
        needed), what the row function left: a forward's rows marked by a negative rstd,
        each alone (the others are written, maybe over x); a backward's, everything (it
        reads no array it writes)."""
        rescaling = variant(self.rows, RESCALE=True)
        if self._marks is None:
            rescaling(*args, 0, self._count(args))
            return
        for i in np.flatnonzero(args[self._marks].ravel() < 0):
            rescaling(*args, i, i + 1)


# The parallel loops every CPU kernel is, around a row function ROWS that does all the
# arithmetic of its items lo:hi (its own arguments first, the bounds last), told apart by
# the argument that counts the items: a statistic a row (or group) for a loop over rows,
# a partial row for a loop over row blocks, a row of the block table for a loop over spans
# of positions (channels-last GroupNorm)
_COUNTS = {"rstd": "size", "dw_part": "shape[0]", "blocks": "shape[0]"}


def _parallel_kernel(rows, counted, dispatcher=None):
    """The ``parallel=True`` kernel ``kernel(block, *rows' arguments)`` that runs ``rows``
    over the items counted by its argument ``counted``, ``block`` items a task.

    Written out with ``rows``' own parameters rather than ``*args``: Numba's dispatcher
    took 0.15-0.2 us more per call of a ``*args`` kernel.  ``rows`` is a global of the
    kernel, not a closure cell or an argument: Numba keys a cached function on its
    closure's pickled contents, and a dispatcher pickles with a fresh id per process (a
    recompile on every import).  The source is compiled under a file name of its own (a
    traceback shows it, from ``linecache``), cached beside the row function's module
    (``cache.GENERATED``).  The block index is made an int64: parfors types a prange
    index unsigned, and a row function called with it was compiled a second time for
    that type.  The kernel returns the sum of ``rows``' returns (rows left: Kernel.rescue).
    """
    params = list(inspect.signature(rows.py_func).parameters)
    lead = params[:-2]
    # the bounds last, the counted argument there, and no argument named as the kernel's own
    assert params[-2:] == ["lo", "hi"] and counted in lead and not {"n", "k", "block", "left"} & set(lead), params
    args = ", ".join(lead)
    src = (f"def kernel(block, {args}):\n"
           f"    n = {counted}.{_COUNTS[counted]}\n"
           f"    left = 0\n"
           f"    for k in prange(-(-n // block)):\n"
           f"        lo = int64(k) * block\n"
           f"        left += ROWS({args}, lo, LEAST(n, lo + block))\n"
           f"    return left\n")
    source = rows.py_func.__code__.co_filename
    filename = f"{source} <parallel kernel of {rows.py_func.__qualname__}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    GENERATED[filename] = source
    namespace = {"prange": prange, "int64": np.int64, "ROWS": rows, "LEAST": least}
    exec(compile(src, filename, "exec"), namespace)
    f = namespace["kernel"]
    f.__qualname__ = f"{rows.py_func.__qualname__}.parallel"
    f.__module__ = rows.py_func.__module__
    return njit(parallel=True, cache=True, nogil=True, dispatcher=dispatcher or background.Dispatcher)(f)


def in_blocks(rows, marks="rstd"):
    """The :class:`Kernel` that runs ``rows(*args, lo, hi)`` over the ``rstd.size`` rows (or
    groups) of ``args``, in blocks of ``block`` (:func:`row_block`) on Numba's threads.
    ``marks``: the output where ``rows`` marks a row it leaves (a forward's rstd), or None
    (a backward, whose rstd is an input)."""
    return Kernel(rows, "rstd", marks)


def in_partials(rows):
    """The :class:`Kernel` that runs ``rows(*args, lo, hi)`` over row blocks ``lo:hi`` of the
    ``dw_part.shape[0]`` blocks (:func:`n_chunks`) of ``args``' rows, one block a task on
    Numba's threads; block ``k`` writes row ``k`` of its dweight/dbias partials."""
    return Kernel(rows, "dw_part", None)


def in_spans(rows):
    """The :class:`Kernel` that runs ``rows(*args, lo, hi)`` over blocks ``lo:hi`` of the
    ``blocks.shape[0]`` rows of its block table (each a sample and a span of its positions:
    ``group_norm.last_blocks``), one block a task on Numba's threads."""
    return Kernel(rows, "blocks", None)


# Held while a parallel kernel runs.  The workqueue layer aborts the process when
# two threads enter it at once, and OpenMP/TBB would only oversubscribe the
# cores, so a second caller does not wait for the pool: it runs the row function
# on its own thread.
_pool = threading.Lock()
# False in a child forked after this process ran a parallel kernel: GNU OpenMP
# kills such a child at its first parallel region, and the workqueue's threads
# are not copied by fork.
_parallel_ok = True


def launch(kernel, size, *args):
    """``kernel``'s parallel kernel on ``args`` on Numba's threads, or its row function over
    all the items on the calling thread: for ``size`` elements too few to share, items
    that make one block (the pool's wake-up for one thread's work), in a forked child,
    while another thread has the pool, or while the parallel kernel is not compiled yet
    (it is then compiled on a thread of its own: ``background``).
    Both give the same bits (:class:`Kernel`).  A call that streams its output takes
    the STREAMING variant once it is compiled, the plain row function (the same bits)
    until then.  The compiles handed to the compile thread meanwhile start as it returns
    (``background.compile_after_launch``)."""
    try:
        if kernel._stream_at is not None and args[kernel._stream_at]:
            left = _run(kernel.streaming(), size, args, True)
            if left is None:
                left = _run(kernel, size, args, False)
        elif size < SERIAL_BELOW:  # a small call: the row function here, written out (each Python
            a = args[kernel._count_at + 1]  # call more is a share of a small call's time)
            left = kernel.rows(*args[1:], 0, a.size if kernel._by_size else a.shape[0])
        else:
            left = _run(kernel, size, args, False)
        if left:
            kernel.rescue(*args)
    finally:
        if background.waiting:
            background.launched()


def _run(kernel, size, args, optional):
    """What ``kernel`` returns for ``args`` (launch), or None where ``optional`` and its
    parallel kernel or row function is not compiled yet (handed to ``background``)."""
    later = None
    # (args[0], the block, under the item count: two blocks at least, else one thread does it all)
    if size >= SERIAL_BELOW and args[0] < kernel._count(args[1:]) and _parallel_ok and _pool.acquire(blocking=False):
        try:
            return kernel.parallel(*args)
        except background.NotCompiled as e:
            later = e
        finally:
            _pool.release()
        if optional:  # a variant's row function alone on one thread would be slower
            background.compile_after_launch(later.dispatcher, later.sig)
            return None
    try:
        left = kernel.serial(*args)
    except background.NotCompiled as e:  # (a variant's row function)
        background.compile_after_launch(e.dispatcher, e.sig)
        return None
    if later is not None:  # after the row function's compile, which the kernel's needs
        background.compile_after_launch(later.dispatcher, later.sig)
    return left


def _before_fork():
    _starting.acquire()  # (before the compiler lock: background's handler runs after this one)


def _after_fork_in_parent():
    _starting.release()


def _after_fork_in_child():
    global _pool, _parallel_ok, _starting
    _pool = threading.Lock()  # a parent thread may have held it at the fork
    _starting = threading.Lock()  # (held by this thread, the one that forked)
    # a lock of the child's own for Numba's start: the parent's is a semaphore shared with
    # every child, and one that died inside Numba's start left it held, for the parent's
    # next compile of a parallel kernel to wait on forever
    _numba_parallel._backend_init_process_lock = None
    if getattr(_numba_parallel, "_is_initialized", True):  # Numba started its threads
        _parallel_ok = False


if hasattr(os, "register_at_fork"):  # (where fork exists: not on Windows)
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
