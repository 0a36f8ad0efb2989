"""16-byte row words: the ``load_pair``/``store_pair`` intrinsics (their simulator
counterparts, known answers), ``vec_width``'s choice of word, the word functions built
on them, and -- compiled for sm_90 through ``benchmarks.gpu_model`` -- the 128-bit
global loads and stores they put on the row path."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from numbanorm.cuda._kernels.reduce import SIMULATED

cuda = pytest.importorskip("numba.cuda")
from numbanorm.cuda import _simvec  # noqa: E402
from numbanorm.cuda._kernels import common as C  # noqa: E402
from numbanorm.cuda._kernels import vec as V  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sim = pytest.mark.skipif(not SIMULATED, reason="the simulator's counterpart of the intrinsics")


@cuda.jit
def _swap_pairs(src, dst):
    # dst's 16-byte word q = src's word q with its two halves swapped
    q = cuda.grid(1)
    if q < src.shape[0] // 2:
        lo, hi = V.load_pair(src, q)
        V.store_pair(dst, q, hi, lo)


@pytest.mark.cudasim
def test_load_store_pair_known_answer():
    src = np.arange(10, dtype=np.uint64) * np.uint64(0x0101010101010101) + np.uint64(7)
    d_src, d_dst = cuda.to_device(src), cuda.to_device(np.zeros(10, np.uint64))
    _swap_pairs[1, 32](d_src, d_dst)
    np.testing.assert_array_equal(d_dst.copy_to_host(), src.reshape(5, 2)[:, ::-1].ravel())
    assert d_src.copy_to_host().tolist() == src.tolist()  # the input is untouched


@sim
def test_misaligned_pair_access_raises_as_the_gpu_faults():
    base = cuda.to_device(np.zeros(11, np.uint64))
    src = base[1:]                                  # 8 bytes past a 16-byte boundary
    assert C._address(src) % 16 == 8
    with pytest.raises(_simvec.MisalignedAccess):
        _swap_pairs[1, 32](src, cuda.to_device(np.zeros(10, np.uint64)))
    with pytest.raises(IndexError):
        _simvec.load_pair(np.zeros(4, np.uint64), 2)
    with pytest.raises(TypeError):
        _simvec.load_pair(np.zeros(4, np.float64), 0)


def _roundtrip_kernel(dtype, vec):
    load_word, store_word = C.word_fns(dtype, "float32", vec)
    F32 = cuda.float32

    @cuda.jit
    def k(src, dst, vals):
        # every thread: its word of src -> float32 values (vals) -> dst's word, doubled
        q = cuda.grid(1)
        if q < vals.shape[0] // vec:
            tmp = cuda.local.array(vec, F32)
            load_word(src, q, tmp, 0)
            for v in range(vec):
                vals[q * vec + v] = tmp[v]
                tmp[v] = tmp[v] * 2
            store_word(dst, q, tmp, 0)

    return k


@pytest.mark.cudasim
@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32"])
def test_16_byte_word_functions_known_answer(rng, name):
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    vec = 16 // dt.itemsize
    assert C.u64_per_word(dt, vec) == 2
    x = (rng.standard_normal(4 * vec) * 3).astype(dt)
    dx, dout = cuda.to_device(x), cuda.to_device(np.zeros_like(x))
    vals = cuda.device_array(4 * vec, np.float32)
    _roundtrip_kernel(dt, vec)[1, 32](C.words(dx, vec).view(), C.words(dout, vec).view(), vals)
    np.testing.assert_array_equal(vals.copy_to_host(), x.astype(np.float32))
    np.testing.assert_array_equal(dout.copy_to_host(), (x.astype(np.float32) * 2).astype(dt))


def test_vec_width_prefers_16_byte_words():
    a16 = cuda.to_device(np.zeros((3, 64), np.float16))
    a32 = cuda.to_device(np.zeros((3, 64), np.float32))
    assert C.vec_width(64, a16) == 8 and C.vec_width(64, a32) == 4       # 16-byte words
    assert C.vec_width(64, a16, max_bytes=8) == 4                         # GroupNorm's limit
    assert C.vec_width(68, cuda.to_device(np.zeros((3, 68), np.float16))) == 4  # 8-byte words
    assert C.vec_width(64, cuda.to_device(np.zeros((3, 64)))) == 1        # float64: elements
    flat = cuda.to_device(np.zeros(3 * 64 + 4, np.float16))
    assert C.vec_width(64, flat[4:].reshape(3, 64)) == 4                  # 8 bytes past 16
    assert C.vec_width(64, a16, flat[4:].reshape(3, 64)) == 4             # any array decides
    assert C.vec_width(64, flat[1:193].reshape(3, 64)) == 1              # 2 bytes past
    w = C.words(a16, 8).view()
    assert w.shape == (3, 16) and w.dtype == np.uint64                    # 8 words of two uint64


@pytest.mark.cudasim
@pytest.mark.parametrize("offset", [0, 4, 1])  # float16 elements: 16-byte, 8-byte words, elements
def test_same_bits_through_every_word_width(rng, offset):
    import numbanorm.cuda as nc

    x = (rng.standard_normal((4, 64)) * 2 + 0.5).astype(np.float16)
    w = rng.uniform(0.5, 1.5, 64).astype(np.float16)
    flat = cuda.to_device(np.concatenate([np.zeros(offset, np.float16), x.ravel()]))
    xd = flat[offset:].reshape(4, 64)
    assert C.vec_width(64, xd) == {0: 8, 4: 4, 1: 1}[offset]
    wd = cuda.to_device(w)
    np.testing.assert_array_equal(nc.layer_norm(xd, 64, wd).copy_to_host(), nc.layer_norm(x, 64, w))


@pytest.mark.slow
def test_row_kernels_load_and_store_128_bits_in_the_sass(tmp_path):
    """Compiled for sm_90 (no GPU): the row loop of the float16 LayerNorm forward and
    backward moves 128 bits per instruction (a model's SASS reading, not a run)."""
    out = tmp_path / "m.json"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_model", "--quick", "--kernels",
                          "layer_norm_forward,layer_norm_backward", "--json", str(out), "--sass-dir",
                          str(tmp_path / "sass")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode in (0, 1), run.stdout + run.stderr
    mains = [r for r in json.loads(out.read_text())["records"] if r["launch"] == "main"]
    assert len(mains) == 2
    for r in mains:
        assert (r["global_load_bits"], r["global_store_bits"]) == (128, 128), r


_PACK_PTX = """
import numpy as np
from numba import cuda, types
from numbanorm.cuda._kernels import vec as V

def k(out):
    out[0] = V.pack_bf16x2(np.float32(1.0), np.float32(2.0))
    out[1] = V.pack_f16x2(np.float32(1.0), np.float32(2.0))

try:
    cuda.compile_ptx(lambda a: None, (types.float32[::1],), cc=(9, 0))
except Exception as e:
    print(f"cannot compile without the CUDA toolkit's NVVM: {e!r}"[:300])
    raise SystemExit(3)
print(cuda.compile_ptx(k, (types.uint32[::1],), cc=(9, 0))[0])
"""


def test_the_pack_intrinsics_round_to_nearest_low_half_first_in_the_ptx():
    """The simulator's known answers of the pack intrinsics (below) run ``_simvec``'s NumPy
    rounding, not the inline PTX a GPU runs, which round-toward-zero or swapped halves left
    passing: compiled for sm_90 (no GPU), pack_bf16x2(1.0, 2.0) is one ``cvt.rn.bf16x2.f32``
    whose first source (the upper half, per the PTX ISA) is 2.0's register, and pack_f16x2
    two ``cvt.rn.f16.f32`` joined low half first."""
    import re

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", _PACK_PTX], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    ptx = run.stdout
    reg = {v: re.search(rf"mov\.f32\s+(%f\d+), {bits};", ptx).group(1)
           for v, bits in (("lo", "0f3F800000"), ("hi", "0f40000000"))}
    assert re.search(rf"cvt\.rn\.bf16x2\.f32 %r\d+, {reg['hi']}, {reg['lo']};", ptx), ptx
    assert re.search(rf"cvt\.rn\.f16\.f32 l, {reg['lo']}; cvt\.rn\.f16\.f32 h, {reg['hi']}; "
                     rf"mov\.b32 %r\d+, {{l, h}};", ptx), ptx


def _pack_kernel(pack):
    """A kernel packing ``vals`` in pairs into ``out`` with ``pack`` (pack_bf16x2, pack_f16x2)."""
    @cuda.jit
    def pack_pairs(vals, out):
        i = cuda.grid(1)
        if i < out.shape[0]:
            out[i] = pack(vals[2 * i], vals[2 * i + 1])

    return pack_pairs


_pack_pairs = _pack_kernel(V.pack_bf16x2)


@pytest.mark.cudasim
def test_pack_bf16x2_rounds_as_ml_dtypes():
    """Two float32 -> two bfloat16 in one uint32 (low half first): nearest, ties to even, at
    ties, infinities, overflow, subnormals, signed zeros; NaN stays NaN."""
    import ml_dtypes

    one, ulp = np.float32(1), np.float32(2.0 ** -7)
    vals = np.array([one + ulp / 2, one + 3 * ulp / 2, one + ulp / 2 + 2.0 ** -20, -(one + ulp / 2),
                     np.inf, -np.inf, np.finfo(np.float32).max, -np.finfo(np.float32).max,
                     1e-40, -1e-40, 0.0, -0.0, 3.14159, -2.71828, np.nan, 65504.0], np.float32)
    out = cuda.device_array(len(vals) // 2, np.uint32)
    _pack_pairs[1, 32](cuda.to_device(vals), out)
    got = out.copy_to_host().view(np.uint16)        # little-endian: low half first
    want = vals.astype(ml_dtypes.bfloat16).view(np.uint16)
    finite = ~np.isnan(vals)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan(got.view(ml_dtypes.bfloat16).astype(np.float32)[~finite]).all()


_pack_f16_pairs = _pack_kernel(V.pack_f16x2)


@pytest.mark.cudasim
def test_pack_f16x2_rounds_as_numpy():
    """Two float32 -> two float16 in one uint32 (low half first), as NumPy rounds them:
    nearest, ties to even, overflow to infinity, subnormals, signed zeros; NaN stays NaN.
    (In the simulator that is ``_simvec``'s NumPy rounding, and this checks its lane order;
    the PTX a GPU runs is read by the test of the intrinsics in the PTX, above.)"""
    one, ulp = np.float32(1), np.float32(2.0 ** -10)
    vals = np.array([one + ulp / 2, one + 3 * ulp / 2, one + ulp / 2 + 2.0 ** -20, -(one + ulp / 2),
                     np.inf, -np.inf, 65520.0, -1e6, 1e-7, -3e-8, 0.0, -0.0, 3.14159, -2.71828, np.nan,
                     65504.0], np.float32)
    out = cuda.device_array(len(vals) // 2, np.uint32)
    _pack_f16_pairs[1, 32](cuda.to_device(vals), out)
    got = out.copy_to_host().view(np.float16)        # little-endian: low half first
    with np.errstate(over="ignore"):
        want = vals.astype(np.float16)
    finite = ~np.isnan(vals)
    np.testing.assert_array_equal(got.view(np.uint16)[finite], want.view(np.uint16)[finite])
    assert np.isnan(got[~finite]).all()


@cuda.jit
def _unpack_and_min(words, others, lo, hi, mins):
    i = cuda.grid(1)
    if i < words.shape[0]:
        lo[i], hi[i] = V.unpack_f16x2(words[i])
        mins[i] = V.min_s16x2(words[i], others[i])


@pytest.mark.cudasim
def test_unpack_f16x2_and_min_s16x2_known_answers(rng):
    """``unpack_f16x2``: the two float16 of a uint32 (low half first) as float32, exactly (NaN,
    infinities, subnormals, signed zeros); ``min_s16x2``: the halves' minima as int16 -- which
    makes cvt's bfloat16 NaN 0x7FFF the stores' 0x7FC0 and leaves every other bfloat16 alone."""
    import ml_dtypes

    halves = np.concatenate([np.array([np.nan, np.inf, -np.inf, 6e-8, -6e-8, 0.0, -0.0, 65504.0, 1.0, -2.5],
                                      np.float16), (rng.standard_normal(22) * 100).astype(np.float16)])
    words = halves.view(np.uint32)
    others = rng.integers(0, 2 ** 32, words.size, dtype=np.uint64).astype(np.uint32)
    lo, hi, mins = (cuda.device_array(words.size, t) for t in (np.float32, np.float32, np.uint32))
    _unpack_and_min[1, 32](cuda.to_device(words), cuda.to_device(others), lo, hi, mins)
    got = np.stack([lo.copy_to_host(), hi.copy_to_host()], 1).ravel()
    want = halves.astype(np.float32)
    np.testing.assert_array_equal(got[1:], want[1:])
    assert np.isnan(got[0])
    m = np.minimum(words.view(np.int16), others.view(np.int16))
    np.testing.assert_array_equal(mins.copy_to_host().view(np.int16), m)
    # every bfloat16 but NaN is at most 0x7FC0 as an int16: min with it changes only cvt's NaN
    bits = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16)
    values = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    assert (bits.view(np.int16)[~np.isnan(values)] <= C.BF16_NAN).all()
