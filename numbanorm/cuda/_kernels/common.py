"""What the three CUDA norm modules share: dtypes, the row-to-thread mapping, the
launch path (stream and cached specializations), and two small kernels (the
fixed-order column sums of partials, and an elementwise cast).

Row mapping
-----------
A row of ``N`` elements belongs to a *row group* of ``tpr`` threads (a power of
two).  Rows move in words of ``vec`` elements -- 16 bytes where the arrays and
the row length allow (8 float16/bfloat16, 4 float32: ``vec.load_pair``,
``LDG.E.128``), else 8 bytes, else single elements (float64, odd lengths,
offset views) -- and thread ``t`` of the group owns words ``t, t + tpr, t +
2*tpr, ...``, so each load instruction of a warp reads 512 consecutive bytes.
``tpr`` is picked so that each thread holds about ``REG_ELEMS`` (16) elements:
fewer warps per row, so the per-warp cost of a row (its reductions, its
barrier) is paid fewer times:

* short rows (``N <= 512``): groups of up to 32 threads -- a warp or part of one
  per row, several rows per block, reductions in registers by warp shuffles;
* long rows: ``tpr`` up to ``MAX_TPR`` threads -- a block per row, reductions
  through shared memory across the warps;
* rows up to ``MAX_TPR * MAX_VPT`` elements (8192; 4096 for float64) stay in
  registers (``vpt`` per thread, a compile-time constant, so the arrays are
  registers), so x is read from global memory once; longer rows take the loop
  path, which copies the row (x, s, or x and dy) into shared memory in its own
  dtype as it first reads it where the copies fit ``STAGE_BYTES`` (dynamic shared
  memory sized per call, up to sm_90's 227 KB per block: 16-bit forward rows to
  115712 elements, backward to 57856; float32 half as long), so later passes
  read shared memory; beyond, it re-reads the row (from L2) for each pass.

The grid is persistent: one wave of the blocks the launch bounds (and a staged row's
shared memory: ``blocks_per_sm``) keep resident on every SM, each striding over rows, so per-thread copies of weight/bias (and,
in the backward, of the dweight/dbias partial sums: one or two partial rows per
SM) are loaded or written once per block instead of once per row.  A row group holding
its rows in registers loads ``rows_in_flight`` of them at once, so that an SM keeps
``SM_BYTES_IN_FLIGHT`` of row data requested (``row_norm``).  Kernels are
compiled with launch bounds: ``ROW_RESIDENT`` (512) threads per SM for the row
kernels, whose 16 elements of x, dy, weight, bias and column sums per thread
take up to 128 registers (at 64 they spilled up to 740 bytes, sm_90),
``MIN_RESIDENT`` (1024: 64 registers) for the rest; ``numbanorm.cuda._ptx`` and
``benchmarks.gpu_model`` check the result.  They are specialized on
``RowConfig.code`` (the mapping, not the grid: a new row count compiles
nothing) and cached on disk by numba-cuda, keyed on the source of every module
here (``source_stamp``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections import namedtuple
from typing import NamedTuple

import numpy as np
from numba import cuda

from .reduce import SIMULATED, WARP
# the intrinsics by module attribute: a kernel's closure pickles a module by name, but an
# intrinsic by a per-process uuid, which would change numba-cuda's disk-cache key every run
from . import vec as _vec

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)

# numba-cuda types arrays of ml_dtypes' bfloat16 as its own bfloat16 (compute
# capability >= 8.0 on hardware); the kernels see them as uint16 bits (``kview``),
# so the simulator runs them too (with ``_simlibdevice``'s bit casts)
try:
    import ml_dtypes as _ml_dtypes

    BF16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    BF16 = None

# ---------------------------------------------------------------- tuning knobs
# (module constants so that tests can shrink them and reach every mapping with
# the simulator's tiny shapes; ``row_config.cache_clear()`` after changing them)
REG_ELEMS = 16         # elements per thread aimed at (halved for float64): fewer warps per row
MAX_VPT = 16           # elements per thread held in registers at most (halved for float64)
MAX_TPR = 512          # threads per row at most (x 16 elements: rows to 8192 in registers)
BLOCK_THREADS = 256    # threads per block for short rows (several rows per block)
MIN_RESIDENT = 1024    # threads per SM the launch bounds guarantee (64 regs/thread): sizes the grid
ROW_RESIDENT = 512     # ... for the row kernels (128 regs: 16 elements of x, dy, weight, bias, sums)
SUM_COLS = 32          # column-sum kernel: columns per block (one warp, coalesced)
SUM_SLICES = 32        # column-sum kernel: partial rows summed in parallel per column
SUM_ROWS_PER_SLICE = 16
CAST_BLOCK = 256       # elementwise cast kernel: threads per block
# shared memory (sm_90): a block gets 48 KB (static + dynamic) unless its kernel opts in
# (``allow_shared``) to the per-block maximum, cudaDevAttrMaxSharedMemoryPerBlockOptin =
# 232448 bytes (227 KB) on compute capability 9.0 (CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability"); an SM has 228 KB, 1 KB of it reserved per block
SHARED_DEFAULT = 48 * 1024
SHARED_OPTIN = 232448
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED = 1024
SCRATCH_BYTES = 1024   # static shared memory beside a row's copies: the reductions' scratch (<= 768 bytes)
# Bytes of row data an SM's threads have requested before they wait for any (Little's
# law: an SM streams memory at the bytes it keeps in flight over the latency; see
# benchmarks.gpu_model).  A row held in registers moves few bytes per thread (16 float16
# elements are 32), so such a thread loads the words of several rows of its row group
# at once (``rows_in_flight``), up to MAX_ROWS_IN_FLIGHT.
SM_BYTES_IN_FLIGHT = 40 * 1024
MAX_ROWS_IN_FLIGHT = 3
# All of it for a long row's staged copies: the row kernels' grid is one 512-thread block per
# SM anyway (ROW_RESIDENT), so even 227 KB costs no block the grid had, and the row is read
# from global memory once, not twice (the model's figures: the book's design log)
STAGE_BYTES = SHARED_OPTIN - SCRATCH_BYTES


def cdiv(a, b):
    return -(-a // b)


def pow2(n):
    """The smallest power of two >= n (n >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


# ---------------------------------------------------------------- devices

@functools.lru_cache(maxsize=None)
def device_count():
    """The GPUs this process sees (the simulator's one)."""
    return 1 if SIMULATED else len(cuda.gpus)


def current_device():
    """The ordinal of the current context's GPU (a call's: the backend makes its arrays'
    device current), asked of the driver only where there are several."""
    return 0 if device_count() == 1 else cuda.get_current_device().id


def n_sm():
    """The SMs of the current device."""
    return _n_sm(current_device())


@functools.lru_cache(maxsize=None)
def _n_sm(device):
    # the simulator's device has no attributes: it runs blocks one after another
    dev = cuda.get_current_device() if device_count() == 1 else cuda.gpus[device]
    return int(getattr(dev, "MULTIPROCESSOR_COUNT", 1))


def pointer_device(ptr):
    """The ordinal of the GPU whose memory ``ptr`` points into (the driver's pointer attribute)."""
    from numba.cuda.cudadrv.driver import binding, driver

    return int(driver.cuPointerGetAttribute(binding.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr))


class _Here:
    """A scope that changes nothing (a call already on its device)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_HERE = _Here()


def on_device(device):
    """A scope (``with``) in which ``device``'s context is current: where a call's kernels
    are loaded and launched and numba allocates (None, or the current device: no change)."""
    if device is None or device == current_device():
        return _HERE
    return cuda.gpus[device]


# What the generated code depends on: kernels are specialized (and cached) on this,
# never on the row count, the grid or the staged row's size, which are launch arguments
# ``stage``: the loop path copies its rows to (dynamic) shared memory (False: it re-reads global memory)
Mapping = namedtuple("Mapping", "tpr vpt rows loop block vec stage")


class RowConfig(namedtuple("RowConfig", "tpr vpt rows loop block grid vec stage shared")):
    """``stage``: kernel elements of each staged row's shared copy (0: none); ``shared``:
    the dynamic shared memory a block is launched with (bytes: every copy)."""
    __slots__ = ()

    @property
    def code(self):
        """The part of the configuration a kernel is compiled for (all but the grid and sizes)."""
        return Mapping(self.tpr, self.vpt, self.rows, self.loop, self.block, self.vec, self.stage > 0)


def stage_capacity(N, item, vec, staged):
    """Kernel elements of the shared copy of a long row (``staged`` copies of ``N``
    elements of ``item`` bytes, in uint64 words when ``vec > 1``); 0 when they do
    not fit ``STAGE_BYTES``."""
    if not staged:
        return 0
    size = 8 if vec > 1 else item              # bytes per kernel element
    cap = cdiv(N * item, size)
    return cap if cap * size * staged <= STAGE_BYTES else 0


def blocks_per_sm(block, resident, shared):
    """Blocks of ``block`` threads resident per SM: the launch bounds' ``resident`` threads,
    and the shared memory they take (``shared`` dynamic bytes, the scratch, the reserve)."""
    n = max(1, resident // block)
    if shared:
        n = min(n, SHARED_PER_SM // (shared + SCRATCH_BYTES + SHARED_RESERVED))
    return max(1, n)


def _load_without_refresh(cache):
    """numba-cuda's ``cache.load_overload`` without its ``target_context.refresh()`` first, as
    the CPU kernels' (``cpu/_kernels/cache.py``): the refresh registers every lowering, which
    a compile needs (and does itself) but a loaded kernel, a cubin, does not.  Where that
    finds nothing, numba-cuda's own load (refresh included) looks again."""
    def load_overload(sig, target_context):
        # the index key pickles the kernel's closure, types.float16 among it, to which this
        # module (imported by the refresh) adds attributes: a compile's key saw them
        import numba.cuda.fp16  # noqa: F401

        with cache._guard_against_spurious_io_errors():
            got = cache._load_overload(sig, target_context)
        return got if got is not None else type(cache).load_overload(cache, sig, target_context)
    return load_overload


def kernel_jit(block, resident=None):
    """``cuda.jit`` for a kernel launched with ``block`` threads per block.

    On hardware the launch bounds cap registers so that ``resident`` threads
    (default ``MIN_RESIDENT``) fit on an SM (ptxas spills rather than produce a
    kernel that cannot launch); the simulator's ``jit`` takes no such option.
    """
    if SIMULATED:
        return cuda.jit
    opts = dict(launch_bounds=(block, max(1, (resident or MIN_RESIDENT) // block)))

    def jit(fn):
        try:
            kern = cuda.jit(cache=True, **opts)(fn)
        except RuntimeError:  # no writable cache location (a read-only install): in memory
            return cuda.jit(**opts)(fn)
        # numba keys the cache on the kernel's own file; the kernels inline device
        # functions from every module here, so any of their sources invalidates it
        cache_file = getattr(getattr(kern, "_cache", None), "_cache_file", None)
        if cache_file is None or not hasattr(cache_file, "_source_stamp"):
            return cuda.jit(**opts)(fn)  # not the numba-cuda internals known here
        cache_file._source_stamp = source_stamp()
        if hasattr(kern._cache, "_load_overload"):
            kern._cache.load_overload = _load_without_refresh(kern._cache)
        return kern

    return jit


@functools.lru_cache(maxsize=None)
def source_stamp():
    """A hash of the source of every module the GPU kernels are compiled from."""
    import hashlib
    import os

    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def row_config(M, N, wide=False, vec=1, resident=None, item=0, staged=0):
    """How ``M`` rows of ``N`` elements map onto threads (see the module docstring), on
    the current device (its SMs size the grid)."""
    return _row_config(M, N, wide, vec, resident, item, staged, n_sm())


@functools.lru_cache(maxsize=4096)
def _row_config(M, N, wide, vec, resident, item, staged, sms):
    """``row_config`` on a device of ``sms`` SMs.

    ``wide``: float64 accumulation, whose values take two registers each, so
    half as many elements per thread fit the register budget.  ``vec``: the
    elements moved by one load (``vec_width``); a thread's ``vpt`` elements
    are then ``vpt // vec`` such words.  ``resident``: the threads per SM the
    kernel's launch bounds guarantee (``kernel_jit``; default ``MIN_RESIDENT``).
    ``item``, ``staged``: a long row's ``staged`` arrays of ``item``-byte elements
    are copied to shared memory once where they fit (``stage_capacity``), so the
    passes after the first read shared memory, not global memory.
    """
    elems, max_vpt = (REG_ELEMS // 2, MAX_VPT // 2) if wide else (REG_ELEMS, MAX_VPT)
    tpr = min(MAX_TPR, pow2(cdiv(N, elems)))
    per_thread = cdiv(N, tpr)
    loop = per_thread > max_vpt
    vpt = vec if loop else max(vec, pow2(per_thread))
    # several rows per block for short rows, where the blocks still cover every
    # SM; a few rows get blocks of a warp each instead, spread over many SMs --
    # two variants per row length, so a sweep over M compiles two kernels, not
    # one per power of two.  Never less than a whole warp: the shuffles name all
    # 32 lanes, and a lane that does not exist makes them undefined.  The loop
    # path keeps its partial sums per block in memory: one row group of at least a warp.
    if loop:
        tpr, rows = max(tpr, WARP), 1
    else:
        fewest, most = WARP // min(tpr, WARP), max(WARP // min(tpr, WARP), BLOCK_THREADS // tpr)
        rows = most if cdiv(M, most) >= sms else fewest
    block = tpr * rows
    # one wave: the blocks the launch bounds make resident on every SM at once (more
    # would queue a second wave, and the backward would write more partial rows)
    stage = stage_capacity(N, item, vec, staged) if loop else 0
    shared = stage * (8 if vec > 1 else item) * staged
    grid = max(1, min(cdiv(M, rows), sms * blocks_per_sm(block, resident or MIN_RESIDENT, shared)))
    return RowConfig(tpr, vpt, rows, loop, block, grid, vec, stage, shared)


row_config.cache_clear = _row_config.cache_clear  # (after changing the tuning knobs)


def rows_in_flight(code, row_bytes, wide=False, resident=None, item=4):
    """Rows a row group loads at once on the registers path: enough that the ``resident``
    threads of an SM, each loading ``row_bytes`` per row (its words of each row array),
    reach ``SM_BYTES_IN_FLIGHT``; one on the loop path, for float64 (``wide``: its
    accumulation takes the registers a second row would) and for 16-bit rows moved
    element by element (``item`` bytes each: a register per element, twice a word's)."""
    if code.loop or wide or (code.vec == 1 and item < 4):
        return 1
    return max(1, min(MAX_ROWS_IN_FLIGHT, cdiv(SM_BYTES_IN_FLIGHT, (resident or ROW_RESIDENT) * row_bytes)))


# ---------------------------------------------------------------- dtypes

def acc_type(dtype):
    """numba type of the accumulation: float64 for float64, float32 otherwise."""
    return cuda.float64 if dtype == F64 else cuda.float32


def kview(a):
    """``a`` as the kernels index it: bfloat16 arrays as their uint16 bit patterns.

    numba-cuda's own bfloat16 conversions are calls into a linked C++ shim that
    pass their operands through local memory (96 calls and a .local frame in
    the PTX of one LayerNorm forward, sm_90); shifting the bits is two integer
    instructions.
    """
    return a.view(np.uint16) if is_bfloat16(a.dtype) else a


WORD = np.dtype(np.uint64)  # the kernels' view of rows: numba's widest element (a 16-byte word is two)
_BITS = np.dtype(np.uint16)  # bfloat16 as the kernels index it


def _address(a):
    p = getattr(a, "device_ctypes_pointer", None)  # numba's device arrays
    if p is not None:
        return p.value or 0
    return a.__array_interface__["data"][0]  # the simulator's, which wrap NumPy arrays


WORD_BYTES = (16, 8)  # the word widths rows move in, widest first (an array's address decides)


def vec_width(n, *rows, max_bytes=16):
    """Elements per word (16 bytes, else 8) for row arrays of ``n`` elements, or 1.

    Words need rows that split into whole words (``n % vec == 0``) and arrays
    that start on a word boundary (any fresh allocation does; an offset view
    may not): 16-byte words where both hold (``vec.load_pair``; float16,
    bfloat16, float32), else 8-byte words (numba's uint64 loads), else single
    elements.  Loading 8 float16 at once instead of 1 cuts the load and store
    instructions per element by 8 and moves 8 times the bytes per request in
    flight -- what a bandwidth-bound kernel is short of with 2-byte loads.
    ``max_bytes=8``: 8-byte words at most (GroupNorm's kernels).
    """
    item = rows[0].dtype.itemsize
    for size in WORD_BYTES:
        vec = size // item
        if size > max_bytes or vec <= 1 or n % vec or (size == 16 and item > 4):
            continue
        if all(a is None or _address(a) % size == 0 for a in rows):
            return vec
    return 1


def u64_per_word(dtype, vec):
    """8-byte elements of the kernels' uint64 view per word of ``vec`` elements: 2 for
    16-byte words (``vec.load_pair``), else 1."""
    return 2 if vec * np.dtype(dtype).itemsize == 16 else 1


def words(a, vec):
    """A C-contiguous (..., n) array as the kernels index it: (..., n // k) uint64 of
    ``k = min(vec, 8 // itemsize)`` elements (a 16-byte word is two of them), or
    bfloat16's uint16 bits -- a :class:`Words` standing for the view, or ``a`` itself."""
    k = min(vec, WORD.itemsize // a.dtype.itemsize)
    return Words(a, k) if k > 1 or is_bfloat16(a.dtype) else a


class Words:
    """A C-contiguous array seen as ``vec``-element words, without the view.

    A numba view is another array object (~2-3 us of host time each); the direct
    launch marshals this one from the array's own fields, and only numba's
    dispatcher (first launch, simulator) gets the real view (``view``).
    """

    __slots__ = ("base", "dtype", "k")

    def __init__(self, base, vec):
        self.base = base                          # (..., n) the array itself
        self.dtype = WORD if vec > 1 else _BITS   # what the kernel is typed on (bfloat16: its bits)
        self.k = vec                              # elements per kernel element

    def view(self):
        return kview(self.base).view(self.dtype) if self.k > 1 else kview(self.base)

    def marshal(self):
        """The array's kernel arguments as ``_Kernel._prepare_args`` makes them from ``view()``."""
        b, k, item = self.base, self.k, self.dtype.itemsize
        return (0, 0, b.size // k, item, b.device_ctypes_pointer.value, *b.shape[:-1], b.shape[-1] // k,
                *b.strides[:-1], item)


def _elements(dtype):
    """(NumPy type, numba type) of one element of a ``dtype`` row as the kernels index it."""
    if is_bfloat16(dtype):
        return np.uint16, cuda.uint16
    return np.dtype(dtype).type, {F16: cuda.types.float16, F32: cuda.float32, F64: cuda.float64}[np.dtype(dtype)]


@functools.lru_cache(maxsize=None)
def raw_fns(dtype, acc_name, vec):
    """``(RAW, fetch, widen, narrow, put)``: a word of ``vec`` elements of ``dtype`` held
    as its bits, in word slots of a local array of ``RAW`` (two uint64 per 16-byte word,
    one per 8-byte word, or the element itself).  A load split in two, so that a thread
    can issue every load of its rows before it waits for the first (a load is waited for
    where its register is first read: the widening); a store likewise.

    ``fetch(row, q, raw, i)``: word q of ``row`` (as ``word_fns`` indexes it), its bits as
    they are, into slot ``i``; ``widen(raw, i, out, e)``: slot i -> out[e:e + vec] in the
    accumulation dtype (exact); ``narrow(vals, e, raw, i)``: vals[e:e + vec] rounded to
    ``dtype`` (``store_fn``'s rounding and NaN) into slot i; ``put(row, q, raw, i)``: slot i
    -> word q of ``row``.  A slot is read and written through a view of ``raw`` as the
    element type, which the compiler turns into register moves and the simulator runs
    as a NumPy view.
    """
    LOAD, STORE = load_fn(dtype, acc_name), store_fn(dtype)
    ELEM, ELEM_T = _elements(dtype)
    if vec == 1:
        @cuda.jit(device=True)
        def fetch1(row, q, raw, i):
            raw[i] = row[q]

        @cuda.jit(device=True)
        def widen1(raw, i, out, e):
            out[e] = LOAD(raw[i])

        @cuda.jit(device=True)
        def narrow1(vals, e, raw, i):
            raw[i] = STORE(vals[e])

        @cuda.jit(device=True)
        def put1(row, q, raw, i):
            row[q] = raw[i]

        return ELEM_T, fetch1, widen1, narrow1, put1
    KW = u64_per_word(dtype, vec)  # two uint64 moved at once (LDG.E.128) where 2
    # HADD2.F32 of each half; two elements per F2FP.F16.F32.PACK_AB, not an F2FP and PRMTs
    F16_PAIRS = np.dtype(dtype) == F16 and acc_name == "float32"
    # two elements per conversion (cvt.rn.bf16x2.f32), whose NaN is made store_fn's
    BF16_PAIRS = is_bfloat16(dtype) and acc_name == "float32"
    U32, PAIRS = cuda.uint32, max(1, vec // 2)
    NANS = U32(BF16_NAN | BF16_NAN << 16)  # cvt's NaN, 0x7FFF, is the one half above it as int16

    @cuda.jit(device=True)
    def fetch(row, q, raw, i):
        if KW == 2:
            lo, hi = _vec.load_pair(row, q)
            raw[2 * i] = lo
            raw[2 * i + 1] = hi
        else:
            raw[i] = row[q]

    @cuda.jit(device=True)
    def put(row, q, raw, i):
        if KW == 2:
            _vec.store_pair(row, q, raw[2 * i], raw[2 * i + 1])
        else:
            row[q] = raw[i]

    @cuda.jit(device=True)
    def widen(raw, i, out, e):
        if F16_PAIRS:
            h2 = raw.view(np.uint32)
            for v in range(PAIRS):
                out[e + 2 * v], out[e + 2 * v + 1] = _vec.unpack_f16x2(h2[i * PAIRS + v])
        else:
            h = raw.view(ELEM)
            for v in range(vec):
                out[e + v] = LOAD(h[i * vec + v])

    @cuda.jit(device=True)
    def narrow(vals, e, raw, i):
        if BF16_PAIRS:
            h2 = raw.view(np.uint32)
            for v in range(PAIRS):
                h2[i * PAIRS + v] = _vec.min_s16x2(_vec.pack_bf16x2(vals[e + 2 * v], vals[e + 2 * v + 1]), NANS)
        elif F16_PAIRS:
            h2 = raw.view(np.uint32)
            for v in range(PAIRS):
                h2[i * PAIRS + v] = _vec.pack_f16x2(vals[e + 2 * v], vals[e + 2 * v + 1])
        else:
            h = raw.view(ELEM)
            for v in range(vec):
                h[i * vec + v] = STORE(vals[e + v])

    return cuda.uint64, fetch, widen, narrow, put


@functools.lru_cache(maxsize=None)
def word_fns(dtype, acc_name, vec):
    """Device functions moving one word of ``vec`` elements between memory and registers.

    ``load_word(row, q, out, e)``: out[e:e + vec] = word q of row (16-byte words:
    ``row`` is the uint64 view and word q its elements 2q, 2q + 1), in the
    accumulation dtype; ``store_word(row, q, vals, e)``: word q of row = vals[e:e + vec]
    converted to ``dtype``: ``raw_fns``' fetch and widen, its narrow and put, through a
    one-word local array (register moves; no local memory in the PTX).
    """
    RAW, FETCH, WIDEN, NARROW, PUT = raw_fns(dtype, acc_name, vec)
    KW = u64_per_word(dtype, vec) if vec > 1 else 1

    @cuda.jit(device=True)
    def load_word(row, q, out, e):
        w = cuda.local.array(KW, RAW)
        FETCH(row, q, w, 0)
        WIDEN(w, 0, out, e)

    @cuda.jit(device=True)
    def store_word(row, q, vals, e):
        w = cuda.local.array(KW, RAW)
        NARROW(vals, e, w, 0)
        PUT(row, q, w, 0)

    return load_word, store_word


@functools.lru_cache(maxsize=None)
def load_fn(dtype, acc_name):
    """Device function: an element of an array of ``dtype`` (as ``kview`` shows it) -> acc."""
    ACC = getattr(cuda, acc_name)
    if is_bfloat16(dtype):
        from numba.cuda import libdevice

        I32, U32 = cuda.int32, cuda.uint32

        @cuda.jit(device=True)
        def load_bf16(u):
            # bfloat16 is the upper half of a float32
            return libdevice.int_as_float(I32(U32(u) << 16))

        return load_bf16

    @cuda.jit(device=True)
    def load(v):
        return ACC(v)

    return load


@functools.lru_cache(maxsize=None)
def store_fn(dtype):
    """Device function: an accumulation-dtype value -> what is stored into ``dtype``."""
    if is_bfloat16(dtype):
        from numba.cuda import libdevice

        U16, U32, F32T = cuda.uint16, cuda.uint32, cuda.float32

        @cuda.jit(device=True)
        def store_bf16(f):
            if f != f:
                return U16(BF16_NAN)
            bits = U32(libdevice.float_as_int(F32T(f)))
            # round to nearest, ties to even, as the hardware conversion does
            return U16((bits + (U32(0x7FFF) + ((bits >> U32(16)) & U32(1)))) >> U32(16))

        return store_bf16
    OUT = {F16: cuda.types.float16, F32: cuda.float32, F64: cuda.float64}[np.dtype(dtype)]

    @cuda.jit(device=True)
    def store(v):
        return OUT(v)

    return store


# the one bfloat16 NaN both store paths write: the quiet NaN PyTorch's CPU conversion
# (c10::BFloat16) and the CPU kernels (for a NaN of sign 0) store, not cvt.rn.bf16x2's 0x7FFF
BF16_NAN = 0x7FC0


def bfloat16_unsupported():
    """Why bfloat16 cannot run here, or '' when it can."""
    if BF16 is None:
        return "bfloat16 arrays need the ml_dtypes package (numba-cuda types them through it)"
    if not SIMULATED and not cuda.is_bfloat16_supported():
        return "bfloat16 needs a GPU of compute capability 8.0 or newer"
    return ""


def is_bfloat16(dtype):
    """``dtype`` (a NumPy dtype) is ml_dtypes' bfloat16 (a dtype comparison: fast)."""
    return BF16 is not None and dtype == BF16


# ---------------------------------------------------------------- launching

# Resolved kernel specializations.  A numba-cuda dispatcher call types every
# argument and looks the signature up each time, and its ``_Kernel.launch``
# wraps every array in a memory view: most of the host time of a call.  Our
# launchers know the specialization from a few dtypes, so after the first
# (ordinary) launch the compiled kernel is kept here with a plan of its
# arguments, and later launches marshal them as ``_Kernel._prepare_args`` does
# (arrays: meminfo, parent, size, itemsize, pointer, shape, strides; scalars as
# ctypes; rows as words straight from the array's fields, ``Words.marshal``) and
# call cuda.core's ``launch`` as ``_Kernel.launch`` does, on the stream
# converted as the dispatcher converts it (``driver._to_core_stream``).
# These are numba-cuda internals: pyproject pins the versions they are known
# in, and tests/test_cuda_launch.py checks, with only the driver stubbed, that
# the direct launch hands the driver what numba's own launch does.
_RESOLVED = {}


def _internals():
    if SIMULATED:
        return None
    try:
        from numba.cuda import dispatcher, types
        from numba.cuda.cudadrv import driver

        return driver._to_core_stream, dispatcher, types
    except (ImportError, AttributeError):  # pragma: no cover - another numba-cuda
        return None


# None: numba-cuda's internals are not the ones known here; every launch dispatches
_INTERNALS = _internals()


def _plan(compiled):
    """How to marshal each argument of ``compiled``: 'A' (array), a ctypes type, or
    None when an argument (or the kernel) needs numba's general path."""
    import ctypes

    _, dispatcher, types = _INTERNALS
    if compiled.debug or compiled.cooperative or compiled.extensions or not dispatcher.CUDA_CORE_GE_1_0:
        return None
    plan = []
    for ty in compiled.argument_types:
        if isinstance(ty, types.Array):
            plan.append("A")
        elif isinstance(ty, types.Integer):
            plan.append(getattr(ctypes, f"c_{ty}"))
        elif ty == types.float32:
            plan.append(ctypes.c_float)
        elif ty == types.float64:
            plan.append(ctypes.c_double)
        else:
            return None
    return tuple(plan)


def arrays(args):
    """Launch arguments with each :class:`Words` made the array view it stands for."""
    return tuple(a.view() if type(a) is Words else a for a in args)


# What one public call allocates and launches, while ``cuda._backend.Replays`` records
# it in this thread (``_RECORDING.log``, a list; None otherwise): ("alloc", numba view,
# the library's array: ``allocated``),
# ("launch", codelib, config, stream, kernel arguments, positions of their pointers),
# or None for work a replay cannot repeat (numba's dispatcher, a copy)
_RECORDING = threading.local()
_POINTER = 4  # where an array's pointer sits among its marshalled arguments
_DUMMIES = set()  # the pointers of ``dummy`` arrays: constants a recorded launch may keep


def unrecordable():
    """The call being recorded did something a replay would not repeat."""
    log = getattr(_RECORDING, "log", None)
    if log is not None:
        log.append(None)


def _direct_launch(compiled, plan, args, grid, block, stream, shared=0):
    to_core, dispatcher, _ = _INTERNALS
    kargs, pointers = [], []
    for how, a in zip(plan, args):
        if how == "A":
            pointers.append(len(kargs) + _POINTER)
            if type(a) is Words:
                kargs += a.marshal()
            else:
                kargs += (0, 0, a.size, a.dtype.itemsize, a.device_ctypes_pointer.value, *a.shape, *a.strides)
        else:
            kargs.append(how(a))
    config, lib = _launch_config(grid, block, shared), compiled._codelibrary
    log = getattr(_RECORDING, "log", None)
    if log is not None:
        log.append(("launch", lib, config, stream, kargs, pointers))
    dispatcher.launch(to_core(stream), config, _cufunc(lib, shared).kernel, *kargs)


def replay_launch(lib, config, core_stream, kargs):
    """A launch recorded by ``_direct_launch``, with the kernel arguments of this call
    (``core_stream``: the call's stream, converted by ``core_stream``; ``config`` carries
    the dynamic shared memory)."""
    _INTERNALS[1].launch(core_stream, config, _cufunc(lib, config.shmem_size).kernel, *kargs)


# cufunc id -> (cufunc, the dynamic shared bytes it is allowed): numba-cuda keeps one
# cufunc per code library and device (``CUDACodeLibrary.get_cufunc``)
_ALLOWED = {}


def allow_shared(f, nbytes):
    """Let the loaded kernel ``f`` (a cufunc) launch with ``nbytes`` of dynamic shared memory
    in its context: the driver refuses a launch whose static and dynamic shared memory
    together pass 48 KB unless the kernel's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    says so first (numba-cuda never sets it).  Once per kernel and context, and again only
    for a larger ``nbytes``."""
    seen = _ALLOWED.get(id(f))
    if seen is None or seen[0] is not f or seen[1] < nbytes:
        from numba.cuda.cudadrv.driver import binding, driver

        # numba-cuda loads kernels as a library's CUkernel; the attribute is set on its
        # CUfunction in the current context
        fn = driver.cuKernelGetFunction(f.handle)
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuFuncSetAttribute(fn, attr, nbytes)
        _ALLOWED[id(f)] = (f, nbytes)
    return f


# (code library, device) -> its cufunc, loaded: numba-cuda's ``get_cufunc`` keeps one per
# library and device for the process too, but asks the driver for the current context
# on every call (a lock and two driver calls per launch)
_LOADED = {}


def _cufunc(lib, shared):
    """The kernel of code library ``lib`` on the current device (its cufunc), allowed
    ``shared`` bytes of dynamic shared memory where they and the kernel's static shared
    memory (its reductions' scratch, as the driver reports it) pass the default 48 KB."""
    key = lib if device_count() == 1 else (lib, current_device())
    f = _LOADED.get(key)
    if f is None:
        f = _LOADED[key] = lib.get_cufunc()
    if shared and shared + f.attrs.shared > SHARED_DEFAULT:
        allow_shared(f, shared)
    return f


def core_stream(stream):
    """``stream`` as cuda.core's launch takes it (numba-cuda's own conversion)."""
    return _INTERNALS[0](stream)


@functools.lru_cache(maxsize=1024)
def _launch_config(grid, block, shared=0):
    return _INTERNALS[1].LaunchConfig(grid=(grid, 1, 1), block=(block, 1, 1), shmem_size=shared,
                                      is_cooperative=False)


# catch_warnings swaps the process's one filter list (before Python 3.14): two threads
# inside it at once restore each other's list, and the filter outlives both
_QUIET = threading.RLock()


@contextlib.contextmanager
def quiet_grids():
    """numba's launch without its warning of a grid under 128 blocks: numbanorm sizes its
    grids (a row's block, a persistent grid of the GPU's multiprocessors), and a decode
    step's one row is not a user's mistake.  (Around numba's own launches: a first call,
    a strided copy; direct launches never warn.)"""
    with _QUIET, warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"Grid size \d+ will likely result in GPU under-utilization")
        yield


def launch(kernel, grid, block, stream, *args, shared=0):
    """``kernel[grid, block, stream, shared](*args)``: ``stream`` is the call's (0: the
    default), ``shared`` the bytes of dynamic shared memory per block.

    Launchers pass C-contiguous arrays of fixed rank for every argument of a
    given kernel, so the arrays' dtypes (and scalars' types) identify the
    specialization.
    """
    key = (kernel, *(getattr(a, "dtype", type(a)) for a in args))
    resolved = _RESOLVED.get(key)
    if resolved is not None:
        compiled, plan = resolved
        if plan is None:
            unrecordable()
            if shared:
                _cufunc(compiled._codelibrary, shared)
            compiled.launch(arrays(args), (grid, 1, 1), (block, 1, 1), _INTERNALS[0](stream), shared)
        else:
            _direct_launch(compiled, plan, args, grid, block, stream, shared)
        return
    unrecordable()
    args = arrays(args)  # numba's own path: real views
    types = None
    if _INTERNALS is not None:
        types = tuple(kernel.typeof_pyval(a) for a in args)
        if shared:  # compiled (and loaded) first, to be allowed the memory before its launch
            _cufunc(kernel.compile(types)._codelibrary, shared)
    with quiet_grids():
        kernel[grid, block, stream, shared](*args)
    overloads = getattr(kernel, "overloads", None)  # None in the simulator
    if overloads and types is not None:
        compiled = overloads.get(types)
        if compiled is not None:
            _RESOLVED[key] = (compiled, _plan(compiled))


@functools.lru_cache(maxsize=None)
def _dummy_cached(dtype, ndim, size=1):
    shape = (size,) * ndim
    if SIMULATED:  # (the simulator indexes its arrays as NumPy does)
        d = cuda.device_array(shape, dtype)
    else:
        # no memory: a kernel never reads a dummy, so it takes no allocation (none inside a
        # call, none from the wrong allocator or device); a read would fault, not read garbage
        from numba.cuda.cudadrv import devicearray, driver

        null = driver.MemoryPointer(None, driver.binding.CUdeviceptr(0), 0)
        d = devicearray.DeviceNDArray(shape, (dtype.itemsize,) * ndim, dtype, gpu_data=null)
    _DUMMIES.add(_address(d))
    return d


def dummy(dtype, ndim):
    """A one-element device array of rank ``ndim`` standing for an absent argument.

    The kernels are specialized on which arguments exist and never read a
    dummy; numba-cuda cannot pass ``None`` to a kernel.  On a GPU it points at
    no memory (a null pointer, as an absent pointer argument is in CUDA C++).
    """
    return _dummy_cached(np.dtype(dtype), ndim)


def optional(a, like, ndim, vec=1):
    """What a kernel indexes for an optional array argument: ``a`` (as ``vec``-element
    words), or a dummy of ``like``'s dtype."""
    return _dummy_cached(like.dtype, ndim) if a is None else words(a, vec)  # (like.dtype: a NumPy dtype)


class Unkept(NamedTuple):
    """Statistics a call does not return (a plain forward's, ``cuda._backend.unkept``): their
    shape and dtype, which a launcher reads, and no memory; ``stored`` hands the kernel a
    zero-length stand-in, and the kernels store no statistics into one."""
    shape: tuple
    dtype: np.dtype

    def reshape(self, *shape):
        return Unkept(tuple(shape[0]) if len(shape) == 1 and type(shape[0]) is not int else shape, self.dtype)


def stored(a):
    """What a forward kernel stores statistics into: ``a``, or for ``Unkept`` statistics a
    zero-length array (the kernels store a row's statistics where ``row < rstd.shape[0]``)."""
    return _dummy_cached(a.dtype, 1, 0) if type(a) is Unkept else a


def dtype_or_none(a):
    """The dtype a kernel is specialized on for an optional argument."""
    return None if a is None else np.dtype(a.dtype)


def device_empty(shape, dtype, stream=0):
    """A numba device array bound to ``stream``: a result of a call on a stream goes on there."""
    a = cuda.device_array(shape, dtype, stream=stream)
    allocated(a, a)
    return a


def allocated(view, native):
    """The call being recorded allocated ``native`` (its library's array), seen as ``view``."""
    log = getattr(_RECORDING, "log", None)
    if log is not None:
        log.append(("alloc", view, native))


# ---------------------------------------------------------------- column sums

@functools.lru_cache(maxsize=None)
def _column_sums_kernel(K, COLS, SLICES, acc_name, out_dtype):
    ACC = getattr(cuda, acc_name)
    STORE = store_fn(out_dtype)  # the sums rounded once, into the parameters' dtype

    @kernel_jit(COLS * SLICES)
    def column_sums(
        part,  # (K, P, N) partial sums, one row per block of the kernel that made them
        out0,  # (N,) sum over P of part[0], any float dtype (bfloat16 as uint16 bits)
        out1,  # (N,) sum over P of part[1] (K == 2), else a dummy; out0's dtype
    ):
        P = part.shape[1]
        N = part.shape[2]
        c = cuda.threadIdx.x % COLS
        sl = cuda.threadIdx.x // COLS
        col = cuda.blockIdx.x * COLS + c
        a = ACC(0)
        b = ACC(0)
        if col < N:
            # fixed order: slice sl sums rows sl, sl + SLICES, ... in turn
            for p in range(sl, P, SLICES):
                a += part[0, p, col]
                if K == 2:
                    b += part[1, p, col]
        if SLICES > 1:
            sh = cuda.shared.array((2, SLICES, COLS), ACC)
            sh[0, sl, c] = a
            sh[1, sl, c] = b
            cuda.syncthreads()
            if sl == 0:
                for k in range(1, SLICES):
                    a += sh[0, k, c]
                    b += sh[1, k, c]
        if sl == 0 and col < N:
            out0[col] = STORE(a)
            if K == 2:
                out1[col] = STORE(b)

    return column_sums


def column_sums(part, out0, out1=None, stream=0):
    """out0[:] = part[0].sum(0) (and out1 from part[1]) in a fixed order: deterministic.

    The outputs may be of any float dtype (the same for both): the sums are
    converted as they are stored, so a backward with float16 parameters needs no
    cast kernels after it.
    """
    K, P, N = part.shape
    cols = min(SUM_COLS, pow2(N))
    # two variants only (a new row count must not compile a new kernel): one slice
    # for the few partial rows of small inputs, all of them otherwise
    slices = 1 if P <= SUM_ROWS_PER_SLICE else SUM_SLICES
    acc = "float64" if part.dtype == F64 else "float32"
    kern = _column_sums_kernel(K, cols, slices, acc, np.dtype(out0.dtype))
    out0 = kview(out0)
    launch(kern, cdiv(N, cols), cols * slices, stream, part, out0, out0 if out1 is None else kview(out1))


# ---------------------------------------------------------------- cast

@functools.lru_cache(maxsize=None)
def _cast_kernel(src_dtype, dst_dtype):
    LOAD = load_fn(src_dtype, "float64")
    STORE = store_fn(dst_dtype)

    @kernel_jit(CAST_BLOCK)
    def cast(
        src,  # (n,) values in any float dtype
        dst,  # (n,) the same values in dst's dtype
    ):
        i = cuda.grid(1)
        if i < src.shape[0]:
            dst[i] = STORE(LOAD(src[i]))

    return cast


def cast_into(src, dst, stream=0):
    """dst[:] = src (1-D, contiguous, same length) with conversion."""
    n = src.shape[0]
    if n:
        kern = _cast_kernel(np.dtype(src.dtype), np.dtype(dst.dtype))
        launch(kern, cdiv(n, CAST_BLOCK), CAST_BLOCK, stream, kview(src), kview(dst))
