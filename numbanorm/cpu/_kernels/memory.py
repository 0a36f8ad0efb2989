"""Streaming stores: how a forward kernel writes a large ``out=`` at copy speed.

An ordinary store to a line not in cache first reads it (a read-for-ownership):
writing ``y`` costs two array passes of memory traffic.  A non-temporal store
writes whole lines without reading them, as ``np.copyto`` does for large arrays,
so it costs one.  A row writer stores the whole lines of a row
(:func:`stream_span`) with :func:`put_streaming` straight from its loop; a row
written in place (``out=x``) is normalized into a scratch row and copied out by
:func:`stream_row`.  It pays into an output too large to stay in the cache the
kernels can count on (``should_stream``, :data:`STREAM_MIN_BYTES`), a caller's ``out=``
or a fresh array: below it, ordinary stores leave ``y`` in cache for its next reader.
``python -m benchmarks.streaming`` measures where it starts to pay on a CPU; the book,
chapter 5 ("Writing a large out="), has the measurements.
"""

import os
from fractions import Fraction

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .cache import njit  # numba.njit with a cache keyed on this package's source
from .halves import X86_FEATURES, host_cpu_name

_VEC = 32  # bytes per streaming store: one AVX register; LLVM splits it on narrower machines


@intrinsic
def _stream_vec(typingctx, dst, src):
    """Copy ``_VEC`` bytes from address ``src`` (any alignment) to address ``dst``
    (``_VEC``-aligned) with a non-temporal store."""
    sig = types.void(types.intp, types.intp)

    def codegen(context, builder, signature, args):
        vec = ir.VectorType(ir.IntType(64), _VEC // 8)
        d = builder.inttoptr(args[0], vec.as_pointer())
        s = builder.inttoptr(args[1], vec.as_pointer())
        store = builder.store(builder.load(s, align=1), d, align=_VEC)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))
        return context.get_dummy_value()

    return sig, codegen


_LINE = 64  # bytes of a cache line, and of the widest vector store (AVX-512)


@intrinsic
def put_streaming(typingctx, arr, o, j, v):
    """``arr[o, j] = v`` with a non-temporal store that claims ``_LINE``-byte alignment.

    For the loops of a row writer over the span :func:`stream_span` gives: LLVM
    vectorizes such a loop as it would ``arr[o, j] = v`` and keeps the
    ``!nontemporal`` mark on the vector stores (``vmovntps``/``vmovntdq``),
    which need the alignment claimed, so the span must start on a line and hold
    whole lines; an element left to a scalar store is stored as usual (x86 has
    no unaligned 16-bit streaming store; AMD's 32-bit one, ``movntss``, takes
    any address).

    16-bit floats are stored OR-ed with a zero LLVM cannot prove zero
    (:func:`_opaque_zero`), which keeps the stored value an integer vector that
    goes out as ``vmovntdq``, for one ``vpor`` a vector.  Without it, InstCombine
    turns a store of float16 bits into a store of LLVM's half (the bits are
    ``bitcast(fptrunc(v))``, halves), and a non-temporal store of half vectors is
    one LLVM does not vectorize (``vmovsh``, element by element); and a bfloat16
    narrowing, which ends in a truncation, is folded with its store into a
    truncating store (``vpmovdw`` to memory), which has no non-temporal form --
    where there is one: an x86 CPU without AVX-512 has no truncating store, and
    there bfloat16 bits go out without the ``vpor`` (:data:`TRUNCATING_STORES`).
    """
    sig = types.void(arr, o, j, v)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1], args[2]])
        val = context.cast(builder, args[3], signature.args[3], aryty.dtype)
        if aryty.dtype == types.uint16 or (aryty.dtype == types.int16 and TRUNCATING_STORES):
            val = builder.or_(val, _opaque_zero(builder, ary, val.type))
        store = builder.store(val, ptr, align=_LINE)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))
        return context.get_dummy_value()

    return sig, codegen


# Whether the CPU compiled for may fold a truncation into its store (vpmovdw: AVX-512F);
# any CPU not known to be x86 is taken to
TRUNCATING_STORES = "+avx512f" in (X86_FEATURES or ("+avx512f",))


def _opaque_zero(builder, ary, ty):
    """0 of integer type ``ty`` that LLVM cannot prove 0: the array's row count >> 62."""
    n = cgutils.unpack_tuple(builder, ary.shape)[0]
    return builder.trunc(builder.lshr(n, ir.Constant(n.type, 62)), ty)


@intrinsic
def _itemsize(typingctx, arr):
    """``arr.itemsize`` as a compile-time constant (the attribute is read at run
    time, and the divisions by it cost an integer divide each); 0 for None (an absent
    weight or bias)."""
    size = 0 if isinstance(arr, (types.NoneType, types.Omitted)) else arr.dtype.bitwidth // 8
    sig = types.intp(arr)

    def codegen(context, builder, signature, args):
        return context.get_constant(types.intp, size)

    return sig, codegen


@intrinsic
def _prefetch_l2(typingctx, addr):
    """Ask for the cache line at address ``addr`` into L2 (``prefetcht1``; a hint, never faults)."""
    sig = types.void(types.intp)

    def codegen(context, builder, signature, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0")
        # read, locality 2 (into L2; into L1, prefetcht0, it was slower in a one-thread probe), data
        builder.call(fn, [builder.inttoptr(args[0], i8p), i32(0), i32(2), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


AHEAD_BYTES = 1024  # of the next row asked for before each 1 KiB of this one is written


@njit(cache=True, nogil=True, inline="always")
def ahead_chunk(
    x,      # (M, N) rows in memory
):
    """Elements of a row a streamed row writer writes between two :func:`ask_ahead`."""
    return max(1, AHEAD_BYTES // _itemsize(x))


@njit(cache=True, nogil=True, inline="always")
def ask_ahead(
    x,      # (M, N) rows in memory, C-contiguous
    i,      # scalar: the row being written
    hi,     # scalar: one past the last row of the block
    lo_el,  # scalar: first element of the chunk about to be written
    hi_el,  # scalar: one past its last
):
    """Ask for elements ``lo_el:hi_el`` of row ``i + 1``, if the block has it.

    A row's statistics read it from memory and its write pass computes from cache, so
    without this the reads of a row and the arithmetic of the one before it do not
    overlap; asked for chunk by chunk, the next row arrives while this one is written
    (asked for whole before the write, it did not: book, chapter 9).
    """
    if i + 1 < hi:
        size = _itemsize(x)
        d = x.ctypes.data + (i + 1) * x.strides[0]
        for off in range(lo_el * size, hi_el * size, _LINE):
            _prefetch_l2(d + off)


@intrinsic
def store_fence(typingctx):
    """Order this thread's streaming stores before anything it does next.

    Non-temporal stores are weakly ordered: without a fence, the thread could
    signal "done" to the caller before its last write-combining buffers drain.
    A sequentially consistent fence is ``mfence`` on x86-64, ``dmb ish`` on ARM.
    """
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def stream_row(
    dst,    # (M, N) destination, in memory, C-contiguous
    i,      # scalar: its row to write
    src,    # (K, N) the values, same dtype (a scratch row in cache)
    k,      # scalar: its row to read
):
    """``dst[i] = src[k]``, streaming stores for the ``_VEC``-aligned middle.

    The unaligned head and tail (under ``_VEC`` bytes each) take ordinary
    stores, and so does a row whose address is not a multiple of its item size
    (a NumPy array can be unaligned).  Call :func:`store_fence` after the last
    row.  Rows are passed as (array, index), not as views: a view keeps an
    atomically counted reference, and an atomic drains the write-combining
    buffers (measured: the book's CPU design log).
    """
    n = dst.shape[1]
    size = _itemsize(dst)
    d = dst.ctypes.data + i * dst.strides[0]
    head = n
    if d % size == 0:
        head = min(n, ((_VEC - d % _VEC) % _VEC) // size)
    for j in range(head):
        dst[i, j] = src[k, j]
    mid = head + (n - head) * size // _VEC * _VEC // size
    stream_lines(dst, i, src, k, head, mid)
    for j in range(mid, n):
        dst[i, j] = src[k, j]


@njit(cache=True, nogil=True, inline="always")
def stream_lines(
    dst, i, src, k,  # stream_row's: the destination and its row, the values and theirs
    lo,     # scalar: first element, on a _VEC-aligned address of dst's row
    hi,     # scalar: one past the last, (hi - lo) items a multiple of _VEC bytes
):
    """``dst[i, lo:hi] = src[k, lo:hi]``, every store a streaming one (see stream_row)."""
    size = _itemsize(dst)
    d = dst.ctypes.data + i * dst.strides[0]
    s = src.ctypes.data + k * src.strides[0]
    for off in range(lo * size, hi * size, _VEC):
        _stream_vec(d + off, s + off)


@njit(cache=True, nogil=True, inline="always")
def stream_span(
    dst,    # (M, N) destination, in memory, C-contiguous
    i,      # scalar: its row to write
):
    """``(lo, hi)``: the elements of row ``i`` from its first ``_LINE``-aligned address
    to its last whole line, which a row writer stores with :func:`put_streaming`;
    ``(N, N)`` for a row whose address is not a multiple of its item size."""
    return span_lines(dst, i, 0, dst.shape[1])


@njit(cache=True, nogil=True, inline="always")
def span_lines(
    dst,    # (M, N) destination, in memory, C-contiguous
    i,      # scalar: its row to write
    lo,     # scalar: first element of a span of the row
    hi,     # scalar: one past its last
):
    """``(a, e)``: the elements of ``lo:hi`` of row ``i`` that fill whole ``_LINE``-aligned
    lines, the part of a span a row writer streams (:func:`stream_span`: the whole row);
    ``(hi, hi)`` where none does, and for a row whose address is not a multiple of its
    item size."""
    size = _itemsize(dst)
    d = dst.ctypes.data + i * dst.strides[0] + lo * size
    if d % size != 0:
        return hi, hi
    a = min(hi, lo + ((_LINE - d % _LINE) % _LINE) // size)
    return a, a + (hi - a) * size // _LINE * _LINE // size


_SYSFS_CACHE = "/sys/devices/system/cpu/cpu0/cache"
_DEFAULT_CACHE = (32 << 20, None)  # where no size can be read: the L3 of a Zen 3 CCX, sharers unknown


def cpu_list(text):
    """The CPU numbers of a Linux CPU list (``"0-3,8"``)."""
    out = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _data_caches(folder):
    """``[(level, bytes, CPUs sharing it)]`` of cpu0's data (and unified) caches, from Linux's
    ``index*/{level,type,size,shared_cpu_list}`` under ``folder``; sharers None where the
    list is missing, an entry that cannot be read left out."""
    try:
        names = [n for n in os.listdir(folder) if n.startswith("index")]
    except OSError:
        names = []
    caches = []
    for name in names:

        def read(field):
            with open(os.path.join(folder, name, field)) as f:
                return f.read().strip()

        try:
            if read("type") == "Instruction":
                continue
            level, text = int(read("level")), read("size").upper()
            size = int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        except (OSError, ValueError):
            continue
        try:
            sharing = cpu_list(read("shared_cpu_list"))
        except (OSError, ValueError):
            sharing = None
        if size > 0:
            caches.append((level, size, sharing))
    return caches


def last_level_cache(folder=_SYSFS_CACHE):
    """``(bytes, CPUs sharing it)`` of cpu0's highest data cache level (:func:`_data_caches`);
    :data:`_DEFAULT_CACHE` where none can be read (another OS)."""
    caches = _data_caches(folder)
    return max(caches, key=lambda c: c[:2])[1:] if caches else _DEFAULT_CACHE


# where no size can be read: the L1 data cache of Zen 5 and Emerald Rapids (spans.GROUP_FROM_BYTES's)
_DEFAULT_L1 = 48 << 10


def first_level_cache(folder=_SYSFS_CACHE):
    """Bytes of cpu0's level-1 data cache (:func:`_data_caches`); :data:`_DEFAULT_L1` where
    none can be read."""
    sizes = [size for level, size, _ in _data_caches(folder) if level == 1]
    return min(sizes) if sizes else _DEFAULT_L1


# The cache one CPU can count on: its slice of a shared L3 and its own L2 are under this on
# every x86 part but AMD's 3D V-Cache ones (Zen 3: 4 + 0.5 MiB, Emerald Rapids: 5 + 2 MiB).
# A VM can show a few vCPUs the whole L3 of a host whose other tenants use it too.
CACHE_PER_CPU = 8 << 20


def cache_share(cache_bytes, cpus, per_cpu=CACHE_PER_CPU):
    """The part of a last-level cache of ``cache_bytes`` that ``cpus`` of its CPUs (the
    ones this process may run on) can count on: all of it, or ``per_cpu`` bytes each."""
    return min(cache_bytes, max(1, cpus) * per_cpu)


def stream_min_bytes(cache_bytes, fraction):
    """The smallest output written with streaming stores: ``fraction`` of the cache the
    kernels can count on (:func:`cache_share`), in whole cache lines."""
    return int(cache_bytes * fraction) // _LINE * _LINE


def _usable_cpus():
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # no affinity call (macOS, Windows)
        return set(range(os.cpu_count() or 1))


def _cache_here():
    """``(last-level cache bytes, usable CPUs sharing it, the share they can count on)``."""
    size, sharing = last_level_cache()
    usable = _usable_cpus()
    cpus = len(usable if sharing is None else usable & sharing) or len(usable)
    return size, cpus, cache_share(size, cpus)


# By LLVM's name for the host CPU: the fraction of CACHE_BYTES from which a forward and a read
# of its y right after are no slower streamed (benchmarks/streaming.py --then-read), where a
# sweep found it under the whole cache; a test checks it against each stream-sweep-<cpu>.json
STREAM_FRACTIONS = {"znver1": Fraction(3, 4)}


def stream_fraction(cpu_name):
    """The fraction of the cache from which outputs are streamed on the CPU LLVM names
    ``cpu_name``: :data:`STREAM_FRACTIONS`'s, or the whole cache (a CPU no sweep measured)."""
    return STREAM_FRACTIONS.get(cpu_name, Fraction(1))


LAST_LEVEL_CACHE, CACHE_CPUS, CACHE_BYTES = _cache_here()
L1_DATA_BYTES = first_level_cache()  # read by spans.grouping when a row function compiles
# Outputs smaller than this take ordinary stores (see the module docstring)
STREAM_FRACTION = stream_fraction(host_cpu_name())  # the host's memory system, whatever Numba compiles for
STREAM_MIN_BYTES = stream_min_bytes(CACHE_BYTES, STREAM_FRACTION)


def should_stream(y):
    """Whether a forward launcher writes ``y`` with streaming stores: a caller's
    ``out=`` or a fresh array alike."""
    return y.nbytes >= STREAM_MIN_BYTES


def apart(y, *reads):
    """Whether ``y`` shares no memory with any of ``reads`` (arrays, or None)."""
    for r in reads:  # (a loop, not any() over a generator: a share of a small call's time)
        if r is not None and np.may_share_memory(y, r):
            return False
    return True


def stream_apart(y, *reads):
    """:func:`should_stream` for an output ``y`` that must also share no memory with
    ``reads`` (:func:`apart`): where a span's stores may overlap its loads, LLVM runs
    the span's scalar loop, whose stores cannot keep put_streaming's claimed alignment.
    The backwards' dx streams by this threshold too (the CPU design log: their sweep)."""
    return should_stream(y) and apart(y, *reads)
