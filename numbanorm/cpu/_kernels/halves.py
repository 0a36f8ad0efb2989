"""16-bit floats inside the CPU kernels: widened to float32 on the load, narrowed on the store.

Numba has no float16 arithmetic on the CPU, and NumPy no bfloat16 (``ml_dtypes``
adds it as a user dtype that Numba cannot type).  So the launchers hand 16-bit
arrays to the kernels as integer views (:func:`kernel_view`), and the integer type
alone tells a kernel, at compile time, what its bits mean:

    uint16  -- IEEE float16 bits       int16 -- bfloat16 bits

The kernels read every element through :func:`widen` and write it through
:func:`narrow`; for float32/float64 arrays both are the identity, so one kernel
source serves every dtype, and no 16-bit array is ever staged through a float32 copy.

float16 is converted by LLVM's ``half`` type (``fpext``/``fptrunc``), which is
``vcvtph2ps``/``vcvtps2ph`` on x86 with F16C and a native instruction on AArch64.
Elsewhere LLVM would call a compiler-rt helper that Numba's JIT does not link
(the process crashes), so there the same conversions are done with integer code
(:func:`_half_to_f32_bits`, :func:`_f32_to_half_bits`).  bfloat16 is the top half
of a float32: a 16-bit shift widens it, and narrowing rounds to nearest even in
integer arithmetic; the forward's row writers narrow it by vcvtneps2bf16 where the CPU
has AVX512-BF16 (:func:`put_bfloat16`), to the same bits.  Every narrowing rounds to
nearest even, keeps a NaN a NaN and overflows to Inf, as IEEE does.
"""

import platform
import sys

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import config
from numba.extending import intrinsic

from .cache import njit  # numba.njit with a cache keyed on this package's source

F16 = np.dtype(np.float16)


def bfloat16_dtype():
    """``ml_dtypes.bfloat16`` if the caller's process has it, else None.

    An array of that dtype can exist only once ml_dtypes is imported, so the
    module is looked up, never imported: ml_dtypes is not a dependency.
    """
    mld = sys.modules.get("ml_dtypes")
    return None if mld is None else np.dtype(mld.bfloat16)


def is_bfloat16(dt):
    bf = bfloat16_dtype()
    return bf is not None and dt == bf


def kernel_view(a):
    """``a`` as the kernels read and write it: 16-bit floats as integer views (no copy)."""
    if a is None:
        return None
    if a.dtype == F16:
        return a.view(np.uint16)
    if a.dtype.itemsize == 2 and is_bfloat16(a.dtype):
        return a.view(np.int16)
    return a


def compiled_features():
    """The features Numba compiles for, as LLVM lists them (``"+f16c,-avx512f,..."``):
    ``NUMBA_CPU_FEATURES`` (none for ``NUMBA_CPU_NAME=generic``), else the host's as
    Numba's code generator takes them, without AVX where ``NUMBA_ENABLE_AVX`` is 0 or
    Numba turns it off for the CPU (an intrinsic of a feature Numba compiles without
    aborts the process in LLVM)."""
    from numba.core import codegen

    return config.CPU_FEATURES if config.CPU_FEATURES is not None else codegen.get_host_cpu_features()


# ``compiled_features`` as a list on x86, or None on another architecture (read once: LLVM's
# host query costs a fraction of a millisecond, and four module constants test it)
X86_FEATURES = compiled_features().split(",") if platform.machine().lower() in ("x86_64", "amd64") else None


def _native_half():
    """Whether LLVM lowers half <-> float to instructions for Numba's target CPU."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    return "+f16c" in (X86_FEATURES or ())


def host_cpu_name():
    """LLVM's name for the CPU this process runs on (``"emeraldrapids"``)."""
    from llvmlite import binding
    return binding.get_host_cpu_name()


def _cpu_name():
    """LLVM's name for the CPU Numba compiles for: the host's, or ``NUMBA_CPU_NAME``."""
    return host_cpu_name() if config.CPU_NAME in (None, "host") else config.CPU_NAME


# Intel's cores from Sapphire Rapids on, by LLVM's names: they run 512-bit vectors
# without the clock drop of the first AVX-512 CPUs
SPR_AND_LATER = ("sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d", "diamondrapids")


def wide_halves(features, cpu_name):
    """Whether the 16-bit row functions pay for 512-bit vectors (common.WIDE_VECTORS):
    on a CPU with AVX512-FP16, or one of SPR_AND_LATER with AVX512-BW.  By name too,
    because a VM may hide AVX512-FP16 from its guest: on one of ours that did, the
    bfloat16 LayerNorm forward into out= took 1.28x the copy at 256 bits and 0.98x at
    512 (book, chapter 9)."""
    features = features or ()
    return NATIVE_HALF and ("+avx512fp16" in features or
                            ("+avx512bw" in features and cpu_name in SPR_AND_LATER))


NATIVE_HALF = _native_half()
WIDE_HALVES = wide_halves(X86_FEATURES, _cpu_name())


# ---------------------------------------------------------------- bit casts

def _unary(name, restype, argtype, emit, doc):
    """An intrinsic ``restype(argtype)`` whose body is the LLVM code ``emit(builder, arg)``."""
    def typer(typingctx, v):
        return restype(argtype), lambda context, builder, signature, args: emit(builder, args[0])

    typer.__name__, typer.__doc__ = name, doc
    return intrinsic(typer)


_I16, _I32, _HALF, _FLOAT = ir.IntType(16), ir.IntType(32), ir.HalfType(), ir.FloatType()

_bits_of = _unary("_bits_of", types.uint32, types.float32, lambda b, v: b.bitcast(v, _I32),
                  "The uint32 bits of a float32.")
_float_of = _unary("_float_of", types.float32, types.uint32, lambda b, v: b.bitcast(v, _FLOAT),
                   "The float32 whose bits are the uint32 ``u``.")


# The conversions as LLVM code (``widen`` and ``narrow`` emit them into the caller)

def _half_to_f32(builder, h):
    """float16 bits (i16) -> float32 by LLVM's half type."""
    return builder.fpext(builder.bitcast(h, _HALF), _FLOAT)


def _f32_to_half(builder, f):
    """float32 -> float16 bits (i16) by LLVM's half type."""
    return builder.bitcast(builder.fptrunc(f, _HALF), _I16)


def _bf16_to_f32(builder, b):
    """bfloat16 bits (i16) -> float32: the bits become the top half of a float32."""
    return builder.bitcast(builder.shl(builder.zext(b, _I32), _I32(16)), _FLOAT)


def _f32_to_bf16(builder, f):
    """float32 -> bfloat16 bits (int16), rounded to nearest even; NaN stays a quiet NaN
    (``narrow``'s instructions)."""
    u = builder.bitcast(f, _I32)
    h = builder.lshr(u, _I32(16))
    nan = builder.or_(h, _I32(0x40))
    # the carry of a round up may ripple into the exponent: up to Inf, as IEEE rounds
    rounded = builder.lshr(builder.add(builder.add(u, _I32(0x7FFF)), builder.and_(h, _I32(1))), _I32(16))
    # one vector compare (vcmpunordps; the bits' |u| > 0x7F800000 took two), and one
    # narrowing after the select (a vector narrowing is two shuffles, vpmovdw)
    return builder.trunc(builder.select(builder.fcmp_unordered("uno", f, f), nan, rounded), _I16)


# ---------------------------------------------------------------- integer conversions

_TWO_112 = np.float32(2.0 ** 112)  # float32's exponent bias minus float16's, as a factor


@njit(cache=True, nogil=True, inline="always")
def _half_to_f32_bits(h):
    """float16 bits -> float32, in integer code: exact for every input, NaN payloads kept."""
    u = np.uint32(h)
    sign = (u & np.uint32(0x8000)) << np.uint32(16)
    body = (u & np.uint32(0x7FFF)) << np.uint32(13)
    if (u & np.uint32(0x7C00)) == np.uint32(0x7C00):  # Inf/NaN: all exponent bits set
        return _float_of(sign | np.uint32(0x7F800000) | body)
    # rebias the exponent by a multiply by 2^112: exact, and right for subnormals too
    return _float_of(sign | _bits_of(_float_of(body) * _TWO_112))


@njit(cache=True, nogil=True, inline="always")
def _f32_to_half_bits(f):
    """float32 -> float16 bits, rounded to nearest even (F. Giesen's float_to_half_fast3_rtne)."""
    u = _bits_of(f)
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x47800000):  # >= 2^16: Inf (or NaN, kept a quiet NaN)
        o = np.uint32(0x7E00) if a > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif a < np.uint32(0x38800000):  # below 2^-14: subnormal half, rounded by a float add
        magic = np.uint32(0x3F000000)  # 0.5: its ulp is the half's smallest subnormal
        o = _bits_of(_float_of(a) + _float_of(magic)) - magic
    else:
        odd = (a >> np.uint32(13)) & np.uint32(1)
        o = (a + np.uint32(0xC8000FFF) + odd) >> np.uint32(13)  # rebias by -112 << 23, round
    return np.uint16(o | sign)


# ---------------------------------------------------------------- what the kernels call
#
# Intrinsics, not overloads: an overload's implementation goes through Numba's whole
# pipeline once per type in every process, a share of every first call; an intrinsic
# emits its few instructions straight into the caller (the book's design log has the cost).


@intrinsic
def widen(typingctx, v):
    """An element as the kernels compute with it (float32 for 16-bit bits, else itself)."""
    if v == types.uint16:
        if NATIVE_HALF:
            return types.float32(v), lambda context, builder, sig, args: _half_to_f32(builder, args[0])
        return types.float32(v), lambda context, builder, sig, args: context.compile_internal(
            builder, _half_to_f32_bits.py_func, sig, args)
    if v == types.int16:
        return types.float32(v), lambda context, builder, sig, args: _bf16_to_f32(builder, args[0])
    if isinstance(v, types.Float):
        return v(v), lambda context, builder, sig, args: args[0]
    return None


@intrinsic
def narrow(typingctx, v, like):
    """``v`` (a float) as an element of the array ``like`` (16-bit bits, or the float itself)."""
    dt = getattr(like, "dtype", None)
    if not isinstance(v, (types.Float, types.Integer)):
        return None

    def as_float32(context, builder, sig, args):
        return context.cast(builder, args[0], sig.args[0], types.float32)

    if dt == types.uint16:
        if NATIVE_HALF:
            return types.uint16(v, like), lambda context, builder, sig, args: _f32_to_half(
                builder, as_float32(context, builder, sig, args))
        return types.uint16(v, like), lambda context, builder, sig, args: context.compile_internal(
            builder, _f32_to_half_bits.py_func, types.uint16(types.float32),
            [as_float32(context, builder, sig, args)])
    if dt == types.int16:
        return types.int16(v, like), lambda context, builder, sig, args: _f32_to_bf16(
            builder, as_float32(context, builder, sig, args))
    if isinstance(dt, types.Float):
        return v(v, like), lambda context, builder, sig, args: args[0]
    return None


# ---------------------------------------------------------------- bfloat16 by instruction
#
# On a CPU with AVX512-BF16, vcvtneps2bf16 narrows 16 float32 at once (nine instructions
# of integer code otherwise).  LLVM emits it for a vector fptrunc to its `bfloat` type, but
# its vectorizer's cost of that conversion sent some row loops to four-lane vectors, so
# the row writers leave their float32 results in a chunk on the stack (stack_chunk) and
# put_bfloat16 narrows it in a loop of its own.  The instruction flushes subnormal inputs to
# zero, so a chunk that had one is narrowed again by the integer code: every stored bit is
# the integer code's.


class _BFloat(ir.types._BaseFloatType):
    """LLVM's ``bfloat``, which llvmlite has no name for (it is only ever converted to)."""
    null = "0.0"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"

    def format_constant(self, value):
        raise NotImplementedError("no bfloat constant is ever emitted")


_BFloat._create_instance()
_BF16 = _BFloat()


def _llvm_major():
    from llvmlite import binding
    return binding.llvm_version_info[0]


# Whether bfloat16 rows are narrowed by vcvtneps2bf16: on x86 with AVX512-BF16 (vfpclassps,
# its subnormal test, is AVX512-DQ's, which every such CPU has unless a VM hides it), with
# the LLVM it was written and tested on (22: Numba 0.68; an older X86 backend may have no
# pattern for the conversion, and a missing one aborts the process)
BFLOAT16_BY_INSTRUCTION = ({"+avx512bf16", "+avx512dq"} <= set(X86_FEATURES or ())
                           and _llvm_major() >= 22)
CHUNK = 256  # float32 elements a row writer narrows at a time: 1 KiB of stack, in L1
_LANES = 16  # float32 elements one vcvtneps2bf16 takes (512 bits)


def _by_instruction(out):
    """Whether the elements of an array of Numba type ``out`` are narrowed by put_bfloat16."""
    return BFLOAT16_BY_INSTRUCTION and getattr(out, "dtype", None) == types.int16


@intrinsic
def by_instruction(typingctx, out):
    """Whether elements of ``out`` are narrowed by :func:`put_bfloat16` (a constant)."""
    yes = _by_instruction(out)
    return types.boolean(out), lambda context, builder, sig, args: ir.Constant(ir.IntType(1), int(yes))


@intrinsic
def stack_chunk(typingctx):
    """A (CHUNK,) float32 array on the calling function's stack: no allocation, no reference
    count (its entry block holds it, so a loop that asks again gets the same memory)."""
    arrty = types.Array(types.float32, 1, "C")

    def codegen(context, builder, signature, args):
        from numba.core import cgutils
        from numba.np.arrayobj import make_array, populate_array

        buf = cgutils.alloca_once(builder, ir.ArrayType(_FLOAT, CHUNK))
        buf.align = 64
        ary = make_array(arrty)(context, builder)
        size = context.get_constant(types.intp, 4)
        populate_array(ary, data=builder.bitcast(buf, _FLOAT.as_pointer()),
                       shape=[context.get_constant(types.intp, CHUNK)], strides=[size], itemsize=size, meminfo=None)
        return ary._getvalue()

    return arrty(), codegen


@intrinsic
def put_bfloat16(typingctx, out, o, lo, tmp, n, nt):
    """``out[o, lo:lo + n] = tmp[:n]`` narrowed to bfloat16: 16 at a time by vcvtneps2bf16,
    with streaming stores where ``nt`` (``lo`` then on a 32-byte boundary), the rest, and
    all of them again if any was subnormal (which the instruction makes 0), by the integer
    code, after a fence where streamed (streaming stores are not ordered with later ones).
    Where ``by_instruction(out)`` is False it emits nothing: a row writer's other branch
    stores its elements.  All of it emitted here, none typed by Numba: an inlined loop of
    the same in every row writer lengthened every first call's compile (the performance log)."""
    if not (isinstance(out, types.Array) and isinstance(tmp, types.Array)):
        return None
    sig = types.void(out, o, lo, tmp, n, nt)

    def codegen(context, builder, signature, args):
        from numba.core import cgutils

        from .memory import _opaque_zero  # (memory imports this module: not at import)

        if not (_by_instruction(out) and tmp.dtype == types.float32):
            return context.get_dummy_value()
        bit, intp = ir.IntType(1), context.get_value_type(types.intp)
        o_, lo_, n_ = (context.cast(builder, args[k], signature.args[k], types.intp) for k in (1, 2, 4))
        streamed = context.cast(builder, args[5], signature.args[5], types.boolean)
        dst = context.make_array(out)(context, builder, args[0])
        src = context.make_array(tmp)(context, builder, args[3])
        floats, halves = ir.VectorType(_FLOAT, _LANES), ir.VectorType(_I16, _LANES)
        # the instruction's own test (vfpclassps), one instruction: llvm.is.fpclass took three
        is_class = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VectorType(bit, _LANES), [floats, _I32]),
            "llvm.x86.avx512.fpclass.ps.512")
        # a zero LLVM cannot prove zero keeps the streamed store one of integers: a store of
        # bfloat vectors it emits with no streaming form (as memory.put_streaming's halves)
        zero = _opaque_zero(builder, dst, _I16)
        opaque = cgutils.get_null_value(halves)
        for lane in range(_LANES):
            opaque = builder.insert_element(opaque, zero, _I32(lane))
        nontemporal = builder.module.add_metadata([_I32(1)])

        def at(k):  # &out[o, lo + k]
            return cgutils.get_item_pointer(context, builder, out, dst, [o_, builder.add(lo_, k)])

        def exact(start, stop):  # the integer code, element by element
            with cgutils.for_range_slice(builder, start, stop, intp(1), intp) as (k, _):
                builder.store(_f32_to_bf16(builder, builder.load(builder.gep(src.data, [k]))), at(k))

        whole = builder.mul(builder.sdiv(n_, intp(_LANES)), intp(_LANES))
        seen = cgutils.alloca_once_value(builder, ir.IntType(_LANES)(0))
        with cgutils.for_range_slice(builder, intp(0), whole, intp(_LANES), intp) as (k, _):
            v = builder.load(builder.bitcast(builder.gep(src.data, [k]), floats.as_pointer()), align=4)
            bits = builder.bitcast(builder.fptrunc(v, ir.VectorType(_BF16, _LANES)), halves)
            ptr = builder.bitcast(at(k), halves.as_pointer())
            with builder.if_else(streamed) as (then, otherwise):
                with then:
                    builder.store(builder.or_(bits, opaque), ptr, align=32).set_metadata("nontemporal", nontemporal)
                with otherwise:
                    builder.store(bits, ptr, align=2)
            flushed = builder.bitcast(builder.call(is_class, [v, _I32(0x20)]), ir.IntType(_LANES))  # 0x20: subnormal
            builder.store(builder.or_(builder.load(seen), flushed), seen)
        # one loop for the tail and, after a subnormal, the whole chunk again
        again = builder.icmp_unsigned("!=", builder.load(seen), ir.IntType(_LANES)(0))
        with builder.if_then(builder.and_(again, streamed), likely=False):
            builder.fence("seq_cst")
        exact(builder.select(again, intp(0), whole), n_)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def like(typingctx, v, zero):
    """``v`` converted to the scalar type of ``zero`` (a float64 block total back to
    the accumulation dtype)."""
    if zero not in (types.float32, types.float64) or not isinstance(v, (types.Float, types.Integer)):
        return None
    return zero(v, zero), lambda context, builder, sig, args: context.cast(builder, args[0], v, zero)
