"""The 16-byte row loads and stores (``_kernels.vec``) for numba's CUDA simulator.

On hardware ``load_pair``/``store_pair``/``pack_bf16x2``/``pack_f16x2``/``unpack_f16x2``/
``min_s16x2`` are LLVM intrinsics (one ``<2 x i64>`` access, align 16:
``LDG.E.128``/``STG.E.128``), which the simulator cannot run; these are the same
operations in Python on the array the simulator hands the kernel, with the hardware's
requirement made an error: a 16-byte access to an address that is not a multiple of 16
faults on a GPU (misaligned address), and raises here, so a launcher that picks 16-byte
words for a misaligned row fails in the simulator too.
"""

import numpy as np


class MisalignedAccess(RuntimeError):
    """A 16-byte access to an address that is not a multiple of 16 (a GPU faults)."""


def _words(row):
    a = getattr(row, "_ary", row)  # the simulator's FakeCUDAArray wraps a NumPy array
    if a.dtype != np.uint64 or a.ndim != 1:
        raise TypeError(f"16-byte words move through 1-D uint64 arrays, not {a.dtype} of rank {a.ndim}")
    return a


def _check(a, q):
    if not 0 <= 2 * q + 1 < a.shape[0]:
        raise IndexError(f"16-byte word {q} outside a row of {a.shape[0]} 8-byte words")
    address = a.__array_interface__["data"][0] + 2 * q * a.strides[0]
    if address % 16 or a.strides[0] != 8:
        raise MisalignedAccess(f"16-byte access at address {address:#x} (stride {a.strides[0]})")


def load_pair(row, q):
    """(row[2q], row[2q + 1]): 16 bytes of a uint64 row, read at once."""
    a = _words(row)
    q = int(q)
    _check(a, q)
    return a[2 * q], a[2 * q + 1]


def store_pair(row, q, lo, hi):
    """row[2q], row[2q + 1] = lo, hi: 16 bytes written at once."""
    a = _words(row)
    q = int(q)
    _check(a, q)
    a[2 * q] = np.uint64(lo)
    a[2 * q + 1] = np.uint64(hi)


def _bf16_bits(f):
    """float32 -> bfloat16 bits as ``cvt.rn.bf16`` rounds: nearest, ties to even; NaN -> 0x7FFF."""
    f = np.float32(f)
    if f != f:
        return 0x7FFF
    bits = int(f.view(np.uint32))
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def pack_bf16x2(lo, hi):
    """Two float32 as bfloat16 in one uint32, ``lo`` in the low half (``cvt.rn.bf16x2.f32``)."""
    return np.uint32(_bf16_bits(lo) | (_bf16_bits(hi) << 16))


def pack_f16x2(lo, hi):
    """Two float32 as float16 in one uint32, ``lo`` in the low half (two ``cvt.rn.f16.f32``)."""
    with np.errstate(over="ignore"):  # overflow is infinity, as cvt makes it
        return np.array([lo, hi], np.float32).astype(np.float16).view(np.uint32)[0]


def unpack_f16x2(u):
    """The two float16 of a uint32, low half first, as float32 (exact)."""
    h = np.array([np.uint32(u)], np.uint32).view(np.float16)
    return np.float32(h[0]), np.float32(h[1])


def min_s16x2(a, b):
    """The two halves' minima as signed 16-bit integers (``min.s16x2``), as a uint32."""
    x = np.array([np.uint32(a), np.uint32(b)], np.uint32).view(np.int16).reshape(2, 2)
    return np.minimum(x[0], x[1]).view(np.uint32)[0]
