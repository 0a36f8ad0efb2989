"""What is specific to the GPU kernels: the row mapping, the reduction,
array interop, determinism, availability -- and, ``gpu``-marked, what needs a
real GPU (large shapes, bfloat16, CuPy/PyTorch arrays and streams, and the
compiled kernels' register budget).

The unmarked tests run the kernels in numba's CUDA simulator (conftest switches
it on); the ``gpu`` ones run with ``NUMBANORM_TEST_GPU=1`` on a machine with a
CUDA GPU and skip elsewhere.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import numbanorm
import numbanorm.cuda as nc
from _marks import EXHAUSTIVE, slow_where
from conftest import ORACLE, SIMULATED, assert_close, to_host

if not nc.is_available():
    pytest.skip(f"numbanorm.cuda unavailable: {nc.why_unavailable()}", allow_module_level=True)

from numba import cuda  # noqa: E402

from numbanorm.cuda._kernels import common as C  # noqa: E402
from numbanorm.cuda._kernels import reduce as _reduce  # noqa: E402

ON_GPU = not SIMULATED
gpu = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a real CUDA GPU (NUMBANORM_TEST_GPU=1)")]
HERE = os.path.dirname(os.path.abspath(__file__))


def _numba_array(a):
    """A numba device array (the simulator's included)."""
    return bool(getattr(type(a), "__cuda_ndarray__", False))


def _rows(rng, shape, dtype=np.float32):
    return (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)


# ---------------------------------------------------------------- the mapping

def test_row_mapping_by_row_length(knobs, monkeypatch):
    """Short rows share a warp or a block; long rows get a block; longer still, the loop."""
    monkeypatch.setattr(C, "n_sm", lambda: 132)  # an H100
    knobs()
    cfg = C.row_config(32768, 64)
    assert (cfg.tpr, cfg.vpt, cfg.rows, cfg.loop) == (4, 16, 64, False)  # 8 rows per warp
    cfg = C.row_config(32768, 512)
    assert (cfg.tpr, cfg.rows) == (32, 8)                                # a warp per row
    cfg = C.row_config(32768, 1024)
    assert (cfg.tpr, cfg.vpt, cfg.rows) == (64, 16, 4)
    for n, tpr in ((4096, 256), (8192, 512)):
        cfg = C.row_config(32768, n)                                     # a block per row
        assert (cfg.tpr, cfg.vpt, cfg.rows, cfg.loop) == (tpr, 16, 1, False)
        # persistent grid: one wave of the blocks the launch bounds keep resident
        assert cfg.block == tpr and cfg.grid == 132 * max(1, 1024 // tpr)
        assert C.row_config(32768, n, resident=512).grid == 132 * max(1, 512 // tpr)
    assert C.row_config(32768, 8193).loop                                # past the registers
    assert C.row_config(32768, 4096, True)[:4] == (512, 8, 1, False)     # float64: half per thread
    assert C.row_config(32768, 4097, True).loop
    # long rows staged in (dynamic) shared memory in their own dtype where the copies fit
    # sm_90's 227 KB per block beside the reductions' static scratch: float16 forward (one
    # copy) to 115712 elements, backward (x and dy) to 57856
    assert C.STAGE_BYTES + C.SCRATCH_BYTES == C.SHARED_OPTIN == 232448
    assert _reduce.slots(C.MAX_TPR) * 2 * 3 * 8 <= C.SCRATCH_BYTES
    f16 = dict(wide=False, vec=8, resident=512, item=2)
    assert C.row_config(32768, 8192, staged=1, **f16)[-2:] == (0, 0)          # registers: nothing staged
    assert C.row_config(32768, 16384, staged=1, **f16)[-2:] == (4096, 32768)  # 32 KB of uint64
    assert C.row_config(32768, 32768, staged=1, **f16)[-2:] == (8192, 65536)  # 64 KB: over 48, opted in
    assert C.row_config(32768, 115712, staged=1, **f16)[-2:] == (28928, 231424)
    assert C.row_config(32768, 115720, staged=1, **f16).stage == 0            # more than 227 KB: the loop path
    assert C.row_config(32768, 57856, staged=2, **f16)[-2:] == (14464, 231424)
    assert C.row_config(32768, 57864, staged=2, **f16).stage == 0
    assert C.row_config(32768, 9001, False, 1, 512, 4, 1)[-2:] == (9001, 36004)  # elements (odd length): float32
    # the size is the launch's, not the kernel's: every staged row length compiles one kernel
    assert len({C.row_config(1, n, staged=1, **f16).code for n in range(8200, 115712, 8)}) == 1
    # the grid: one block per SM either way (ROW_RESIDENT threads of 512), and what shared memory allows
    assert C.row_config(32768, 115712, staged=1, **f16).grid == 132
    assert C.blocks_per_sm(128, 1024, 0) == 8
    assert C.blocks_per_sm(128, 1024, 64 * 1024) == 3                         # 228 KB / (64 + 1 + 1) KB
    assert C.blocks_per_sm(128, 1024, 200 * 1024) == 1
    # a few short rows spread over SMs instead of filling one block (a warp of rows each)
    assert C.row_config(100, 64).rows == 8 and C.row_config(100, 64).grid == 13
    assert C.row_config(100, 1024).rows == 1 and C.row_config(100, 1024).grid == 100


@pytest.mark.parametrize("n", [1, 2, 3, 31, 33, 255, 257, 1000, 4095, 8192, 8193, 100000])
@pytest.mark.parametrize("m", [1, 7, 5000])
def test_row_mapping_invariants(n, m):
    for wide in (False, True):
        cfg = C.row_config(m, n, wide)
        assert cfg.tpr & (cfg.tpr - 1) == 0 and cfg.vpt & (cfg.vpt - 1) == 0
        assert cfg.block == cfg.tpr * cfg.rows <= 1024
        assert cfg.block % 32 == 0                                      # whole warps: shuffles
        assert cfg.loop or cfg.tpr * cfg.vpt >= n                       # every element owned
        assert not cfg.loop or cfg.rows == 1
        assert 1 <= cfg.grid <= m


# (the word widths: tests/test_cuda_vec.py)


# ---------------------------------------------------------------- both mappings, all paths

# (mapping knobs, shapes): the default mapping; rows forced onto the loop path, staged
# in shared memory (they fit), not staged (nothing fits), or the forward staged and
# the backward not (float32; float16 both, float64 neither); a grid of one block
# striding over all rows (several rows per block, partial last block); 16 threads
# per row with 4 rows per block
LONG = {"MAX_TPR": 16, "MAX_VPT": 2}
# one resident 32-thread block per SM, on the simulator's one SM: a grid of one block (the row
# kernels' launch bounds are ROW_RESIDENT threads; MIN_RESIDENT alone left 7 blocks for 100 rows)
ONE_BLOCK = {"MIN_RESIDENT": 1, "BLOCK_THREADS": 32, "ROW_RESIDENT": 32}
MAPPINGS = {
    "default": ({}, [(5, 70), (2, 300), (3, 96)]),  # elements or 8-byte words; 16-byte words
    "loop": (LONG, [(3, 70), (2, 33), (2, 64)]),
    "loop_unstaged": ({**LONG, "STAGE_BYTES": 0}, [(3, 70), (2, 33), (2, 64)]),
    "stage_edge": ({**LONG, "STAGE_BYTES": 256}, [(3, 64), (2, 33)]),
    "one_block": (ONE_BLOCK, [(100, 20), (5, 9)]),  # (100: see _strides)
    "subwarp": ({"REG_ELEMS": 2, "BLOCK_THREADS": 64}, [(6, 30)]),
}


# the simulator runs every thread of a block in Python: the default set keeps every mapping
# in float32 and one long-row mapping each in float16 (staged) and float64 (not staged)
# (slow_where), the slow set the rest
@pytest.mark.cudasim
@pytest.mark.parametrize("dtype,mapping", slow_where(
    [(dt, m) for dt in (np.float16, np.float32, np.float64) for m in MAPPINGS],
    lambda dt, m: dt != np.float32 and (np.dtype(dt).name, m) not in {("float16", "loop"),
                                                                      ("float64", "loop_unstaged")}))
def test_every_mapping_against_the_oracle(knobs, rng, mapping, dtype):
    kw, shapes = MAPPINGS[mapping]
    knobs(**kw)
    tol = np.float32 if dtype == np.float16 else dtype
    for shape in shapes:
        n = shape[-1]
        x, dy, ds = _rows(rng, shape, dtype), _rows(rng, shape, dtype), _rows(rng, shape, dtype)
        w = rng.uniform(0.5, 1.5, n).astype(dtype)
        b = rng.standard_normal(n).astype(dtype)
        y, m, r = nc.layer_norm_forward(x, n, w, b)
        yr, mr, rr = ORACLE.layer_norm_forward(x, n, w, b)
        assert_close(y, yr, dtype, f"LN y {mapping} {shape}")
        np.testing.assert_array_equal(nc.layer_norm(x, n, w, b), y)  # plain: the same y, no statistics stored
        assert_close(m, mr, tol, "LN mean")
        assert_close(r, rr, tol, "LN rstd")
        dxr, dwr, dbr = ORACLE.add_layer_norm_backward(dy, ds, x, mr, rr, n, w)
        for got, ref in zip(nc.add_layer_norm_backward(dy, ds, x, m, r, n, w), (dxr, dwr, dbr)):
            assert_close(got, ref, dtype, f"LN backward {mapping} {shape}")
        y, s, m, r = nc.add_layer_norm_forward(x, ds, n, w, b)
        np.testing.assert_array_equal(s, x + ds)
        for got, want in zip(nc.add_layer_norm(x, ds, n, w, b), (y, s)):
            np.testing.assert_array_equal(got, want)
        assert_close(y, ORACLE.layer_norm_forward(s, n, w, b)[0], dtype, f"LN y (fused) {mapping} {shape}")
        y, s = nc.add_rms_norm(x, dy, n, w)
        np.testing.assert_array_equal(s, x + dy)
        yr, rr = ORACLE.rms_norm_forward(s, n, w)
        assert_close(y, yr, dtype, f"RMS y {mapping} {shape}")
        _, r = nc.rms_norm_forward(x, n, w)
        for got, ref in zip(nc.rms_norm_backward(dy, x, r, n, w),
                            ORACLE.rms_norm_backward(dy, x, ORACLE.rms_norm_forward(x, n, w)[1], n, w)):
            assert_close(got, ref, dtype, f"RMS backward {mapping} {shape}")
        # group norm over (rows, 2 groups of channels, spatial)
        if n % 2 == 0:
            x4, dy4 = x.reshape(shape[0], 2, -1), dy.reshape(shape[0], 2, -1)
            w4, b4 = w[:2], b[:2]
            y, m, r = nc.group_norm_forward(x4, 1, w4, b4)
            yr, mr, rr = ORACLE.group_norm_forward(x4, 1, w4, b4)
            assert_close(y, yr, dtype, f"GN y {mapping} {shape}")
            np.testing.assert_array_equal(nc.group_norm(x4, 1, w4, b4), y)
            for got, ref in zip(nc.group_norm_backward(dy4, x4, m, r, w4),
                                ORACLE.group_norm_backward(dy4, x4, mr, rr, w4)):
                assert_close(got, ref, dtype, f"GN backward {mapping} {shape}")


def _strides(M, N):
    """Whether a row kernel's grid is one block that strides over ``M`` rows of ``N``: more
    rows than it takes in one step of every row group's rows in flight (9 rows of 24 were
    one step of a grid of one block per row group: the grid-stride tests passed with the
    loops cut to their first step)."""
    cfg = C.row_config(M, N, resident=C.ROW_RESIDENT)
    return cfg.grid == 1 and C.cdiv(M, cfg.rows * C.MAX_ROWS_IN_FLIGHT) > cfg.grid


@pytest.mark.cudasim
def test_grid_stride_backward_is_deterministic(knobs, rng):
    """One block strides over every row: partial sums across rows, bit for bit again."""
    knobs(**ONE_BLOCK)
    assert _strides(100, 24) and _strides(*MAPPINGS["one_block"][1][0])
    x, dy = _rows(rng, (100, 24)), _rows(rng, (100, 24))
    w = rng.uniform(0.5, 1.5, 24).astype(np.float32)
    _, m, r = nc.layer_norm_forward(x, 24, w)
    first = nc.layer_norm_backward(dy, x, m, r, 24, w)
    again = nc.layer_norm_backward(dy, x, m, r, 24, w)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert_close(first[1], ORACLE.layer_norm_backward(dy, x, m, r, 24, w)[1], np.float32)


def test_column_sums_in_fixed_order(knobs, rng):
    """The partial-row reduction: exact on integers, identical on every run."""
    knobs(SUM_SLICES=4, SUM_ROWS_PER_SLICE=2, SUM_COLS=8)
    part = rng.integers(-50, 50, (2, 37, 11)).astype(np.float32)
    out0, out1 = cuda.device_array(11, np.float32), cuda.device_array(11, np.float32)
    C.column_sums(cuda.to_device(part), out0, out1)
    np.testing.assert_array_equal(out0.copy_to_host(), part[0].sum(0))
    np.testing.assert_array_equal(out1.copy_to_host(), part[1].sum(0))
    zero = cuda.device_array(11, np.float32)
    C.column_sums(cuda.to_device(np.zeros((1, 0, 11), np.float32)), zero)  # no rows: zeros
    np.testing.assert_array_equal(zero.copy_to_host(), 0)


# ---------------------------------------------------------------- the reductions

def _reduce_kernel(tpr, block):
    from numba.cuda import float64

    slots = _reduce.slots(block)

    @cuda.jit
    def kernel(vals, sums, pairs):
        tid = cuda.threadIdx.x
        scratch = cuda.shared.array((2, 2, slots), float64)
        v = vals[tid]
        a, b = _reduce.group_sum2(v, -2 * v, scratch, 0, tid, tpr)
        s = _reduce.group_sum(v, scratch, 1, tid, tpr)
        s2 = _reduce.group_sum(3 * v, scratch, 0, tid, tpr)  # buffer 0 again
        sums[tid, 0] = s
        sums[tid, 1] = s2
        pairs[tid, 0] = a
        pairs[tid, 1] = b

    return kernel


def _check_group_sums(tpr, block):
    vals = np.arange(block, dtype=np.float64) * 3 - 7  # integers: every order sums exactly
    sums, pairs = cuda.device_array((block, 2)), cuda.device_array((block, 2))
    _reduce_kernel(tpr, block)[1, block](cuda.to_device(vals), sums, pairs)
    want = np.repeat(vals.reshape(-1, tpr).sum(1), tpr)
    np.testing.assert_array_equal(sums.copy_to_host(), np.stack([want, 3 * want], 1))
    np.testing.assert_array_equal(pairs.copy_to_host(), np.stack([want, -2 * want], 1))


@pytest.mark.cudasim
@pytest.mark.parametrize("tpr,block", slow_where([(1, 32), (8, 64), (32, 64), (64, 256), (128, 128), (256, 512),
                                                    (1024, 1024)], lambda tpr, block: block > 512))
def test_shuffle_reduction(tpr, block):
    """The one reduction path, on a GPU and in the simulator (its warp shuffles from _simwarp)."""
    assert _reduce.slots(block) == max(1, block // 32)
    _check_group_sums(tpr, block)


@pytest.mark.cudasim
@pytest.mark.parametrize("tpr,block", slow_where([(64, 256), (256, 256), (512, 1024)],
                                                   lambda tpr, block: block > 512))
def test_cross_warp_sum_is_bit_identical_in_every_lane(rng, tpr, block):
    """Values whose sum depends on the order: every thread of a group still gets the same
    bits (the lane-parallel cross-warp step sums the warps' partials in one tree for all)."""
    vals = rng.standard_normal(block) * 10.0 ** rng.integers(-8, 8, block)
    sums, pairs = cuda.device_array((block, 2)), cuda.device_array((block, 2))
    _reduce_kernel(tpr, block)[1, block](cuda.to_device(vals), sums, pairs)
    got = sums.copy_to_host()[:, 0].reshape(-1, tpr)
    assert (got == got[:, :1]).all()
    np.testing.assert_allclose(got[:, 0], vals.reshape(-1, tpr).sum(1), rtol=1e-12, atol=1e-12 * abs(vals).sum())


@pytest.mark.cudasim
@pytest.mark.parametrize("tpr,block", [(16, 64), (256, 256)])
def test_group_sums_of_n_values_are_group_sum3s_bits(rng, tpr, block):
    """``group_sums_fn(n)`` (the batched reductions: n values at once) gives every value the
    bits ``group_sum3`` gives it, in every lane."""
    slots = _reduce.slots(block)
    six = _reduce.group_sums_fn(6)
    float64 = cuda.float64

    @cuda.jit
    def kernel(vals, got, want):
        tid = cuda.threadIdx.x
        scratch = cuda.shared.array((2, 6, slots), float64)
        v = cuda.local.array(6, float64)
        for k in range(6):
            v[k] = vals[k, tid]
        six(v, scratch, 0, tid, tpr)
        a, b, c = _reduce.group_sum3(vals[0, tid], vals[1, tid], vals[2, tid], scratch, 1, tid, tpr)
        d, e, f = _reduce.group_sum3(vals[3, tid], vals[4, tid], vals[5, tid], scratch, 0, tid, tpr)
        for k in range(6):
            got[k, tid] = v[k]
        want[0, tid], want[1, tid], want[2, tid] = a, b, c
        want[3, tid], want[4, tid], want[5, tid] = d, e, f

    vals = rng.standard_normal((6, block)) * 10.0 ** rng.integers(-8, 8, (6, block))
    got, want = cuda.device_array((6, block)), cuda.device_array((6, block))
    kernel[1, block](cuda.to_device(vals), got, want)
    np.testing.assert_array_equal(got.copy_to_host(), want.copy_to_host())


# ---------------------------------------------------------------- arrays in and out

def test_device_arrays_in_device_arrays_out(rng):
    x, dy = _rows(rng, (4, 3, 10)), _rows(rng, (4, 3, 10))
    w = rng.uniform(0.5, 1.5, 10).astype(np.float32)
    xd, dyd, wd = cuda.to_device(x), cuda.to_device(dy), cuda.to_device(w)
    y, m, r = numbanorm.layer_norm_forward(xd, 10, wd)  # the top level dispatches on the type
    assert all(_numba_array(a) for a in (y, m, r))
    assert y.shape == x.shape and m.shape == (4, 3, 1) and y.dtype == np.float32
    yh, mh, rh = nc.layer_norm_forward(x, 10, w)  # host in, host out
    assert type(yh) is np.ndarray and type(mh) is np.ndarray
    np.testing.assert_array_equal(to_host(y), yh)
    dx, dw, db = numbanorm.layer_norm_backward(dyd, xd, m, r, 10, wd)
    assert _numba_array(dx) and _numba_array(dw) and dw.shape == (10,)
    np.testing.assert_array_equal(to_host(dw), nc.layer_norm_backward(dy, x, mh, rh, 10, w)[1])
    g, mg, rg = numbanorm.group_norm_forward(xd, 3)
    assert _numba_array(g) and mg.shape == (4, 3)


def test_host_arrays_and_out(rng):
    x = _rows(rng, (6, 16), np.float16)
    out = np.full_like(x, np.nan)
    res = nc.rms_norm(x, 16, out=out)
    assert res is out and type(out) is np.ndarray
    assert_close(out, ORACLE.rms_norm(x, 16), np.float16)
    xd = cuda.to_device(x)
    outd = cuda.device_array(x.shape, x.dtype)
    assert nc.rms_norm(xd, 16, out=outd) is outd
    np.testing.assert_array_equal(outd.copy_to_host(), out)
    # a strided device `out` is filled through a temporary
    big = cuda.device_array((6, 32), x.dtype)
    strided = big[:, ::2]
    nc.rms_norm(xd, 16, out=strided)
    np.testing.assert_array_equal(strided.copy_to_host(), out)


def test_quiet_grids_in_two_threads_at_once_leaves_the_warning_filters_as_they_were():
    """quiet_grids swaps the process's warning filters (catch_warnings): two threads inside
    it at once restored each other's list, leaving its filter installed for good (numba's
    warnings of the user's own launches, and any other filter set meanwhile, lost).  One
    thread at a time now: the second waits for the first to leave."""
    import threading
    import warnings

    before = list(warnings.filters)
    inside, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with C.quiet_grids():
            inside.set()
            second_in.wait(0.5)  # without the lock the second is inside by now
        first_out.set()

    def second():  # in first, out last: the order that left the filter behind
        inside.wait(5)
        with C.quiet_grids():
            second_in.set()
            first_out.wait(5)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert second_in.is_set() and warnings.filters == before


def test_non_contiguous_device_input(rng):
    x = _rows(rng, (5, 40))
    xd = cuda.to_device(x)[:, ::2]
    np.testing.assert_array_equal(to_host(nc.layer_norm(xd, 20)), nc.layer_norm(x[:, ::2], 20))


def test_a_dlpack_only_array_is_ordered_before_the_stream_its_call_runs_on():
    """An array known only through DLPack names no stream: its call runs on the legacy default
    stream, so its producer is asked to order its pending writes before that one (DLPack's
    stream 1); -1, no ordering at all, let a kernel read what the producer had not written."""
    asked = []

    class DLPackOnly:
        shape, dtype = (2, 4), np.dtype(np.float32)

        def __dlpack_device__(self):
            return (2, 0)  # (kDLCUDA, device 0)

        def __dlpack__(self, stream=None, **kw):
            asked.append(stream)
            raise BufferError("the stream it was asked for is all this test reads")

    with pytest.raises(BufferError):
        numbanorm.layer_norm(DLPackOnly(), 4)
    assert asked == [1]


def test_mixed_host_and_device_raise_before_any_kernel(rng, monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(C, "launch", no_launch)
    xd = cuda.to_device(_rows(rng, (2, 8)))
    with pytest.raises(TypeError, match="`weight` is a host array"):
        nc.layer_norm(xd, 8, np.ones(8, np.float32))
    with pytest.raises(TypeError, match="`dy` is a host array"):
        numbanorm.rms_norm_backward(np.ones((2, 8), np.float32), xd, cuda.to_device(np.ones(2, np.float32)), 8)


def test_mixed_sides_rejected_without_importing_numba_cuda():
    """The top level checks the arrays' types before numbanorm.cuda is imported."""
    code = textwrap.dedent("""
        import sys, numpy as np, numbanorm
        class Dev:  # looks like a CUDA array, is none
            __cuda_array_interface__ = {"shape": (2, 4), "typestr": "<f4", "data": (0, False), "version": 3}
            shape, dtype = (2, 4), np.dtype(np.float32)
        try:
            numbanorm.layer_norm(Dev(), 4, np.ones(4, np.float32))
        except TypeError as e:
            assert "`weight` is a host array" in str(e), e
        else:
            raise SystemExit("no TypeError")
        assert "numba.cuda" not in sys.modules and "numbanorm.cuda" not in sys.modules
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("setup, says", [
    ('sys.modules["numba.cuda"] = None  # as if numba-cuda were not installed', "numba-cuda"),
    # numba-cuda 0.30 registers np.row_stack when a kernel first compiles, and NumPy 2.5
    # removed it: on an H200 with NumPy 2.5.2 every launch raised AttributeError
    ("del np.row_stack  # as NumPy 2.5 is", "numpy<2.5"),
], ids=["no numba-cuda", "NumPy 2.5"])
def test_unavailable_says_why(setup, says):
    """Where the GPU kernels cannot run, importing works, is_available() is False, every
    function says why (naming the fix) and keeps its signature, and the top level's
    functions still run NumPy arrays on the CPU."""
    code = textwrap.dedent(f"""
        import inspect, sys
        import numpy as np
        {setup}
        import numbanorm, numbanorm.cuda as nc
        from numbanorm import registry
        assert not nc.is_available() and {says!r} in nc.why_unavailable(), nc.why_unavailable()
        assert inspect.signature(nc.layer_norm_forward) == inspect.signature(numbanorm.layer_norm_forward)
        assert registry.usable("cuda")[0] is False and "cuda" not in registry.available()
        try:
            nc.rms_norm(np.ones((2, 4), np.float32), 4)
        except RuntimeError as e:
            assert {says!r} in str(e)
        else:
            raise SystemExit("no RuntimeError")
        # the top level goes on running NumPy arrays on the CPU once numbanorm.cuda is imported
        x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
        for _ in range(2):  # (the second call: the plans' and replays' shortcuts)
            assert np.array_equal(numbanorm.layer_norm(x, 4), numbanorm.cpu.layer_norm(x, 4))
            y, mean, rstd = numbanorm.layer_norm_forward(x, 4)
            dx = numbanorm.layer_norm_backward(np.ones_like(x), x, mean, rstd, 4)[0]
            assert np.array_equal(dx, numbanorm.cpu.layer_norm_backward(np.ones_like(x), x, mean, rstd, 4)[0])
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_bfloat16_refused_clearly_where_unsupported():
    why = C.bfloat16_unsupported()
    if not why:
        pytest.skip("bfloat16 runs here")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.ones((2, 4), ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        nc.layer_norm(x, 4)


# ---------------------------------------------------------------- bfloat16

def _bf16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if C.bfloat16_unsupported():
        pytest.skip(C.bfloat16_unsupported())
    return ml_dtypes.bfloat16


def ml_dtypes_finfo(dt):
    import ml_dtypes

    return ml_dtypes.finfo(dt)


def _bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.cudasim
def test_bfloat16_store_rounds_to_nearest_even():
    """float32 -> bfloat16 through the kernels' store (the cast kernel): ml_dtypes' rounding,
    bit for bit, at ties, NaN, infinities, overflow, subnormals and signed zeros."""
    bf16 = _bf16()
    one = np.float32(1)
    ulp = np.float32(2.0 ** -7)  # bfloat16's spacing at 1
    f32max = np.finfo(np.float32).max
    bfmax = float(ml_dtypes_finfo(bf16).max)
    vals = np.array([
        one + ulp / 2,            # a tie: to the even 1.0
        one + 3 * ulp / 2,        # a tie: to the even 1 + 2 ulp
        one + ulp / 2 + 2.0 ** -20,  # just above a tie: up
        -(one + ulp / 2),         # ties are symmetric
        np.inf, -np.inf, f32max, -f32max,  # float32's largest rounds past bfloat16's: inf
        bfmax,                    # bfloat16's largest stays
        bfmax * (1 + 2.0 ** -9),  # below the halfway point to 2**128: stays finite
        1e-40, -1e-40, 0.0, -0.0,  # subnormals, signed zeros
        3.14159, -2.71828, 65504.0,
    ], np.float32)
    from numbanorm.cuda import _backend as B  # its cast: what the frontend converts with

    ctx = B.CallContext()
    got = B.cast(ctx, cuda.to_device(vals), bf16).copy_to_host()
    np.testing.assert_array_equal(_bits(got), _bits(vals.astype(bf16)))
    assert np.isinf(got[4]) and np.isinf(got[6]) and got[6] > 0 and got[7] < 0
    nan = B.cast(ctx, cuda.to_device(np.array([np.nan, -np.nan], np.float32)), bf16).copy_to_host()
    assert np.isnan(nan.astype(np.float32)).all()
    # and back: bfloat16 -> float32 is exact, NaN and infinities included
    back = B.cast(ctx, cuda.to_device(vals.astype(bf16)), np.float32).copy_to_host()
    np.testing.assert_array_equal(back, vals.astype(bf16).astype(np.float32))


@pytest.mark.cudasim
@pytest.mark.parametrize("mapping", ["default", "loop", "loop_unstaged"])
@pytest.mark.parametrize("shape", [(5, 64), (3, 70)])  # rows in words; element by element
def test_bfloat16_kernels_match_the_oracle_rounded(knobs, rng, shape, mapping):
    """LayerNorm, RMSNorm (fused add included) and GroupNorm in bfloat16: the float32
    oracle on the same bfloat16 inputs, rounded to bfloat16 (an ulp of slack: the
    kernels and the oracle sum in different orders)."""
    bf16 = _bf16()
    knobs(**MAPPINGS[mapping][0])
    n = shape[-1]
    x, dy = _rows(rng, shape).astype(bf16), _rows(rng, shape).astype(bf16)
    w = rng.uniform(0.5, 1.5, n).astype(bf16)
    b = rng.standard_normal(n).astype(bf16)
    f = np.float32

    def close(got, ref, what):
        assert got.dtype == bf16, what
        got, ref = got.astype(np.float64), ref.astype(bf16).astype(np.float64)
        # bfloat16 keeps 8 significant bits: one ulp is 2**-7 relative
        np.testing.assert_allclose(got, ref, rtol=2.0 ** -7, atol=2.0 ** -7 * np.abs(ref).max(), err_msg=what)

    y, m, r = nc.layer_norm_forward(x, n, w, b)
    yr, mr, rr = ORACLE.layer_norm_forward(x.astype(f), n, w.astype(f), b.astype(f))
    close(y, yr, "LN y")
    assert m.dtype == np.float32
    assert_close(m, mr, np.float32)
    assert_close(r, rr, np.float32)
    dx, dw, db = nc.layer_norm_backward(dy, x, m, r, n, w)
    dxr, dwr, dbr = ORACLE.layer_norm_backward(dy.astype(f), x.astype(f), mr, rr, n, w.astype(f))
    close(dx, dxr, "LN dx")
    assert dw.dtype == bf16  # the weight's dtype, as torch
    close(dw, dwr, "LN dw")
    close(db, dbr, "LN db")
    y, s = nc.add_rms_norm(x, dy, n, w)
    np.testing.assert_array_equal(_bits(s), _bits((x.astype(f) + dy.astype(f)).astype(bf16)))
    close(y, ORACLE.rms_norm(s.astype(f), n, w.astype(f)), "RMS y (fused)")
    _, r = nc.rms_norm_forward(x, n, w)
    rr = ORACLE.rms_norm_forward(x.astype(f), n, w.astype(f))[1]
    for got, ref, what in zip(nc.rms_norm_backward(dy, x, r, n, w),
                              ORACLE.rms_norm_backward(dy.astype(f), x.astype(f), rr, n, w.astype(f)),
                              ("RMS dx", "RMS dw")):
        close(got, ref, what)
    x4, w4 = x.reshape(shape[0], 2, -1), w[:2]
    y, m, r = nc.group_norm_forward(x4, 1, w4, w4)
    close(y, ORACLE.group_norm_forward(x4.astype(f), 1, w4.astype(f), w4.astype(f))[0], "GN y")


@pytest.mark.cudasim
def test_bfloat16_non_finite_inputs_propagate():
    bf16 = _bf16()
    x = np.array([[1, 2, 3, 4], [1, np.inf, 3, 4], [1, np.nan, 3, 4]], np.float32).astype(bf16)
    for norm in (nc.rms_norm, nc.layer_norm):
        y = norm(x, 4).astype(np.float32)
        ref = getattr(ORACLE, norm.__name__)(x.astype(np.float32), 4).astype(bf16).astype(np.float32)
        assert np.isnan(ref[2]).all()  # NaN rows stay NaN, inf rows as the oracle has them
        np.testing.assert_allclose(y, ref, rtol=2.0 ** -7, atol=2.0 ** -7 * 4, equal_nan=True)


@pytest.mark.cudasim
def test_bfloat16_nan_is_one_bit_pattern_on_both_store_paths():
    """A NaN result is stored as 0x7FC0 -- what PyTorch's CPU conversion (c10::BFloat16) and
    the CPU kernels store for a NaN of sign 0 -- whether the row moves in 16-byte words (two
    elements per cvt.rn.bf16x2, whose NaN is 0x7FFF) or element by element (``store_fn``)."""
    bf16 = _bf16()
    x = (np.arange(3 * 64, dtype=np.float32).reshape(3, 64) % 7).astype(bf16)
    x[1, 5] = np.nan                              # row 1's statistics, and so all its y, NaN
    for offset, vec in ((0, 8), (1, 1)):
        flat = cuda.to_device(np.concatenate([np.zeros(offset, bf16), x.ravel()]))
        xd = flat[offset:].reshape(3, 64)
        assert C.vec_width(64, xd) == vec
        for y in (nc.layer_norm(xd, 64).copy_to_host(), nc.rms_norm(xd, 64).copy_to_host()):
            bits = y.view(np.uint16)
            assert (bits[1] == C.BF16_NAN).all(), (vec, sorted({hex(b) for b in bits[1]}))
            assert not np.isnan(y[[0, 2]].astype(np.float32)).any()
    # what the CPU kernels and PyTorch's CPU conversion store
    assert (numbanorm.layer_norm(x, 64).view(np.uint16)[1] == C.BF16_NAN).all()
    torch = pytest.importorskip("torch")
    assert torch.tensor(float("nan")).to(torch.bfloat16).view(torch.int16).item() == C.BF16_NAN


def _kernel_factories():
    from numbanorm.cuda._kernels import group_norm as GN, row_norm as RW

    return RW.forward_kernel, RW.backward_kernel, GN._forward_kernel, GN._channel_sums_kernel, GN._dx_kernel


def _every_kernel(rng, dt, m, n):
    """Outputs of every row and group kernel (forward, backward, fused) for (m, n) rows of ``dt``."""
    x, dy, res = _rows(rng, (m, n), dt), _rows(rng, (m, n), dt), _rows(rng, (m, n), dt)
    w, b = rng.uniform(0.5, 1.5, n).astype(dt), rng.standard_normal(n).astype(dt)
    out = list(nc.layer_norm_forward(x, n, w, b))
    out += nc.layer_norm_backward(dy, x, out[1], out[2], n, w)
    out += nc.add_layer_norm_forward(x, res, n, w, b)
    out += nc.add_layer_norm_backward(dy, res, x, out[1], out[2], n, w)
    _, r = nc.rms_norm_forward(x, n, w)
    out += [r, *nc.rms_norm_backward(dy, x, r, n, w), *nc.add_rms_norm(x, res, n, w)]
    out += nc.add_rms_norm_backward(dy, res, x, r, n, w)
    x4, dy4 = x.reshape(m, 4, n // 4), dy.reshape(m, 4, n // 4)
    gy, gm, gr = nc.group_norm_forward(x4, 2, w[:4], b[:4])
    return out + [gy, gm, gr, *nc.group_norm_backward(dy4, x4, gm, gr, w[:4])]


@pytest.mark.cudasim
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param(np.float16, marks=EXHAUSTIVE),
                                   pytest.param(np.float32, marks=EXHAUSTIVE)])
def test_rows_in_flight_change_no_bits(knobs, rng, dtype):
    """A row group loads ``common.rows_in_flight`` rows at once (to keep its SM's share of
    ``SM_BYTES_IN_FLIGHT`` requested) and reduces them together; the rows are independent
    and every sum keeps its order, so one row at a time or three give the same bits --
    forward, backward, fused, GroupNorm -- with the last batch of a block partly past M
    (one block of 8 row groups striding over 37 rows: batches of 24, the second 13 live)."""
    dt = _bf16() if dtype == "bfloat16" else np.dtype(dtype)
    outs = []
    for budget in (1, 10 ** 9):                     # one row in flight; the most (3)
        knobs(BLOCK_THREADS=32, ROW_RESIDENT=32, SM_BYTES_IN_FLIGHT=budget)
        for f in _kernel_factories():
            f.cache_clear()
        C._RESOLVED.clear()
        cfg = C.row_config(37, 64, False, 16 // np.dtype(dt).itemsize, C.ROW_RESIDENT)
        code = cfg.code
        assert (cfg.grid, cfg.rows) == (1, 8)
        assert C.rows_in_flight(code, 32) == (1 if budget == 1 else 3)
        outs.append([to_host(a) for a in _every_kernel(np.random.default_rng(7), dt, 37, 64)])
    for f in _kernel_factories():
        f.cache_clear()
    for a, b in zip(*outs):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.cudasim
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_group_norm_long_groups_staged_at_the_boundary(knobs, rng, dtype):
    """GroupNorm's long groups are copied to shared memory as they are first read where the
    copy fits ``STAGE_BYTES``, and read again from global memory where it does not: a group
    of exactly the capacity, and one word more, against the oracle."""
    item = np.dtype(dtype).itemsize
    knobs(**LONG, STAGE_BYTES=256)
    shared, real = [], C.launch
    knobs(launch=lambda *a, **k: shared.append(k.get("shared", 0)) or real(*a, **k))
    cap = 256 // item                             # elements of one staged copy
    for L, staged in ((cap, True), (cap + 16 // item, False)):
        x = _rows(rng, (3, 2, L // 2), dtype)     # 3 samples, one group of 2 channels
        w, b = rng.uniform(0.5, 1.5, 2).astype(dtype), rng.standard_normal(2).astype(dtype)
        del shared[:]
        y, m, r = nc.group_norm_forward(x, 1, w, b)
        assert (shared[0] > 0) == staged, (L, shared)
        yr, mr, rr = ORACLE.group_norm_forward(x, 1, w, b)
        assert_close(y, yr, dtype, f"GN y L={L}")
        assert_close(m, mr, np.float32, "GN mean")
        assert_close(r, rr, np.float32, "GN rstd")


@pytest.mark.cudasim
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_group_norm_staged_groups_a_block_loops_over_against_the_oracle(knobs, rng, dtype):
    """One block loops over every (sample, group) row of the staged loop path, with
    channels of 10 words among a warp: the y pass reads, channel by channel, words other
    threads copied, so the copy and every read of one row come before the next row's copy
    (threads with no word in the y pass went on to copy the next row over the one still
    read: y off by up to 4.8 in float32 before the barriers)."""
    knobs(**LONG, ROW_RESIDENT=32)                # the loop path, one block of a warp
    vec = 16 // np.dtype(dtype).itemsize
    S = 10 * vec                                  # a channel: 10 words
    n, G, Cn = 4, 2, 4
    L = Cn // G * S
    cfg = C.row_config(n * G, L, False, vec, C.ROW_RESIDENT, np.dtype(dtype).itemsize, 1)
    assert cfg.loop and cfg.stage and cfg.grid == 1 and cfg.tpr == 32, cfg
    x = _rows(rng, (n, Cn, S), dtype)
    w, b = rng.uniform(0.5, 1.5, Cn).astype(dtype), rng.standard_normal(Cn).astype(dtype)
    y, m, r = nc.group_norm_forward(x, G, w, b)
    yr, mr, rr = ORACLE.group_norm_forward(x, G, w, b)
    assert_close(y, yr, dtype, "GN y")
    assert_close(m, mr, np.float32, "GN mean")
    assert_close(r, rr, np.float32, "GN rstd")


@pytest.mark.cudasim
@pytest.mark.parametrize("staged", [True, False], ids=["staged", "unstaged"])
def test_group_norm_long_group_with_an_outlier_first_word_takes_the_two_pass(knobs, rng, staged):
    """The long groups' statistics come from one pass of sums shifted by the mean of the
    group's first word; a group whose first word is 64 std from the rest (mean 1, std 1e-2:
    var = ms - m1^2 keeps about 11 of float32's 24 bits) must take the two-pass (the test
    fails with the fallback switched off), and the group beside it, ordinary, keeps the one
    pass -- a warp per group, the group copied to shared memory or read again."""
    knobs(**LONG, **({} if staged else {"STAGE_BYTES": 0}))
    S, dtype = 4096, np.float32                   # a group: 2 channels of S
    cfg = C.row_config(2, 2 * S, False, 4, C.ROW_RESIDENT, 4, 1)
    assert cfg.loop and (cfg.stage > 0) == staged and cfg.tpr == 32, cfg
    x = 1 + 1e-2 * rng.standard_normal((2, 2 * S))   # (the layer_norm test's rows, as groups)
    x[0, :4] = x[0, 4:].mean() + 64 * x[0, 4:].std()
    x = x.reshape(2, 2, S).astype(dtype)
    w, b = rng.uniform(0.5, 1.5, 2).astype(dtype), rng.standard_normal(2).astype(dtype)
    y, m, r = nc.group_norm_forward(x, 1, w, b)
    yr, mr, rr = ORACLE.group_norm_forward(x, 1, w, b)
    for g in range(2):
        assert_close(r[g], rr[g], dtype, f"rstd group {g}")
        assert_close(m[g], mr[g], dtype, f"mean group {g}")
        assert_close(y[g, :, 4:], yr[g, :, 4:], dtype, f"y group {g} (beside the outliers)")


@pytest.mark.cudasim
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("staged", [True, False], ids=["staged", "unstaged"])
def test_group_norm_long_16bit_groups_words_in_flight_and_the_tail(knobs, rng, dtype, staged):
    """A long 16-bit group's pass 1 fetches four words a thread before it sums the first
    (``stats.row_sum_fn``'s ``unroll``), copying their bits to shared memory where the group
    is staged, and the words past the last four a thread takes one by one: groups of 2.1
    rounds of four words a thread, at a mean 100 std from 0 and ordinary, against the oracle."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    knobs(**LONG, **({} if staged else {"STAGE_BYTES": 0}))
    S = 8 * 135                                   # a channel: 135 words of 8
    cfg = C.row_config(4, 2 * S, False, 8, C.ROW_RESIDENT, 2, 1)
    NW = 2 * S // 8
    assert cfg.loop and (cfg.stage > 0) == staged and NW > 8 * cfg.tpr and NW % (4 * cfg.tpr), cfg
    x = rng.standard_normal((4, 2, S))
    x[1::2] += 100                                # groups 1 and 3 at a large offset
    x = x.astype(dtype)
    w, b = rng.uniform(0.5, 1.5, 2).astype(dtype), rng.standard_normal(2).astype(dtype)
    y, m, r = nc.group_norm_forward(x, 1, w, b)
    yr, mr, rr = ORACLE.group_norm_forward(x.astype(np.float64), 1, w.astype(np.float64), b.astype(np.float64))
    assert_close(m, mr, np.float32, "GN mean")
    assert_close(r, rr, np.float32, "GN rstd")
    assert_close(y, yr, dtype, "GN y")


# ---------------------------------------------------------------- real hardware only

@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n", [64, 1024, 4096, 8192, 12288])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a real CUDA GPU")
def test_large_shapes_against_the_oracle(rng, dtype, n):
    m = 4096 if n <= 1024 else 256
    x, dy = _rows(rng, (m, n), dtype), _rows(rng, (m, n), dtype)
    w = rng.uniform(0.5, 1.5, n).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    y, mean, rstd = nc.layer_norm_forward(x, n, w, b)
    yr, mr, rr = ORACLE.layer_norm_forward(x, n, w, b)
    assert_close(y, yr, dtype, f"y {m}x{n}")
    for got, ref in zip(nc.layer_norm_backward(dy, x, mean, rstd, n, w),
                        ORACLE.layer_norm_backward(dy, x, mr, rr, n, w)):
        assert_close(got, ref, dtype, f"backward {m}x{n}")
    y, rstd = nc.rms_norm_forward(x, n, w)
    assert_close(y, ORACLE.rms_norm(x, n, w), dtype)
    for got, ref in zip(nc.rms_norm_backward(dy, x, rstd, n, w),
                        ORACLE.rms_norm_backward(dy, x, ORACLE.rms_norm_forward(x, n, w)[1], n, w)):
        assert_close(got, ref, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a real CUDA GPU")
def test_group_norm_large(rng):
    x, dy = _rows(rng, (4, 64, 32, 32)), _rows(rng, (4, 64, 32, 32))
    w = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    y, m, r = nc.group_norm_forward(x, 8, w, w)
    yr, mr, rr = ORACLE.group_norm_forward(x, 8, w, w)
    assert_close(y, yr, np.float32)
    for got, ref in zip(nc.group_norm_backward(dy, x, m, r, w), ORACLE.group_norm_backward(dy, x, mr, rr, w)):
        assert_close(got, ref, np.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a real CUDA GPU")
def test_bfloat16_on_gpu(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if C.bfloat16_unsupported():
        pytest.skip(C.bfloat16_unsupported())
    bf16 = ml_dtypes.bfloat16
    x32 = _rows(rng, (300, 2048))
    x = x32.astype(bf16)
    w = rng.uniform(0.5, 1.5, 2048).astype(np.float32)
    y, m, r = nc.layer_norm_forward(x, 2048, w, w)
    assert y.dtype == bf16 and m.dtype == np.float32
    # bfloat16 has 8 bits of mantissa: one rounding of the output is 2**-9 relative
    yr = ORACLE.layer_norm(x.astype(np.float32), 2048, w, w)
    np.testing.assert_allclose(y.astype(np.float32), yr, rtol=8e-3, atol=8e-3 * np.abs(yr).max())
    dx, dw, db = nc.layer_norm_backward(x, x, m, r, 2048, w)
    assert dx.dtype == bf16 and dw.dtype == np.float32
    dxr, dwr, _ = ORACLE.layer_norm_backward(x.astype(np.float32), x.astype(np.float32), m, r, 2048, w)
    np.testing.assert_allclose(dw, dwr, rtol=1e-3, atol=1e-3 * np.abs(dwr).max())
    y, s = nc.add_rms_norm(x, x, 2048, w)
    np.testing.assert_array_equal(s.astype(np.float32), (x.astype(np.float32) * 2).astype(bf16).astype(np.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a real CUDA GPU")
def test_torch_tensors_in_and_out_on_the_current_stream(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    x = torch.randn(512, 1024, device="cuda", dtype=torch.float16)
    w = torch.rand(1024, device="cuda", dtype=torch.float16) + 0.5
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # results are queued on torch's current stream
        x2 = x * 2
        y = numbanorm.layer_norm(x2, 1024, w)
        z = y.float().sum()
    side.synchronize()
    assert isinstance(y, torch.Tensor) and y.device.type == "cuda" and y.dtype == torch.float16
    ref = torch.nn.functional.layer_norm(x2.float(), (1024,), w.float()).half()
    torch.testing.assert_close(y, ref, rtol=2e-3, atol=2e-3)
    assert torch.isfinite(z)
    xb = x.to(torch.bfloat16)
    yb = numbanorm.rms_norm(xb, 1024, w.to(torch.bfloat16))
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), torch.nn.functional.rms_norm(xb.float(), (1024,), w.float()),
                               rtol=1e-2, atol=1e-2)

    class DLPackOnly:  # an array known only through DLPack
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, **kw):
            return self.t.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    torch.cuda.synchronize()
    yd = numbanorm.layer_norm(DLPackOnly(x), 1024)
    assert _numba_array(yd)
    torch.testing.assert_close(torch.as_tensor(yd, device="cuda"), torch.nn.functional.layer_norm(x, (1024,)),
                               rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a real CUDA GPU")
def test_cupy_arrays_in_and_out():
    cupy = pytest.importorskip("cupy")
    x = cupy.random.standard_normal((256, 512), dtype=cupy.float32)
    with cupy.cuda.Stream(non_blocking=True):
        y, m, r = numbanorm.layer_norm_forward(x, 512)
        assert isinstance(y, cupy.ndarray) and isinstance(m, cupy.ndarray)
        dx, dw, db = numbanorm.layer_norm_backward(x, x, m, r, 512)
        assert isinstance(dx, cupy.ndarray)
    cupy.cuda.get_current_stream().synchronize()
    ref = ORACLE.layer_norm(cupy.asnumpy(x), 512)
    assert_close(cupy.asnumpy(y), ref, np.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a real CUDA GPU")
def test_resolved_specialization_is_the_dispatched_one(rng):
    """The second launch goes straight to the compiled kernel; same bits as the first."""
    x = _rows(rng, (333, 777))
    C._RESOLVED.clear()
    first = nc.layer_norm_forward(x, 777)
    assert C._RESOLVED, "the compiled specialization was not kept"
    for a, b in zip(first, nc.layer_norm_forward(x, 777)):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- the compiled kernels


def test_a_kernel_found_only_after_numba_cudas_refresh_still_loads(monkeypatch):
    """A kernel's disk-cache load looks without numba-cuda's refresh first; where that finds
    nothing, numba-cuda's own load (refresh included) looks again, so a cached kernel is never
    compiled twice (tests/test_cuda_launch.py loads real kernels without the refresh)."""
    import contextlib
    import types

    monkeypatch.setitem(sys.modules, "numba.cuda.fp16", types.ModuleType("numba.cuda.fp16"))  # (the simulator's)

    class Cache:
        looks = 0

        def _guard_against_spurious_io_errors(self):
            return contextlib.nullcontext()

        def _load_overload(self, sig, target_context):
            self.looks += 1
            return None

        def load_overload(self, sig, target_context):  # numba-cuda's, refresh first
            return ("after the refresh", sig)

    cache = Cache()
    assert C._load_without_refresh(cache)("sig", None) == ("after the refresh", "sig") and cache.looks == 1


_PTX_CMD = [sys.executable, "-m", "numbanorm.cuda._ptx", "--check"]


def test_the_register_checks_shards_take_every_kernel_once_in_runs():
    """The register check's processes (``--shard i/n``) split the kernels into runs of
    neighbours, together every kernel once, for any count of processes."""
    from numbanorm.cuda._ptx import shard_of

    for count in (0, 1, 5, 175):
        cases = list(range(count))
        for shards in (1, 2, 3, 4, 7):
            parts = [shard_of(cases, i, shards) for i in range(shards)]
            assert [c for p in parts for c in p] == cases, (count, shards)  # (every n-th: another order)
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.slow
@pytest.mark.exhaustive
def test_kernels_compile_for_sm90_within_the_register_budget():
    """Compile every LayerNorm/RMSNorm/GroupNorm kernel to sm_90 PTX (NVVM; no GPU needed)
    and, where ptxas is installed, check that registers x threads fit the SM and nothing
    spills past the budget for float16/float32.

    Skips where the CUDA toolkit's NVVM/NVRTC libraries are not installed (CI)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    n = max(1, min(4, os.cpu_count() or 1))  # NVVM compiles on one thread: a process per core
    procs = [subprocess.Popen(_PTX_CMD + ["--shard", f"{i}/{n}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for i in range(n)]
    outs = []
    for p in procs:
        o, e = p.communicate(timeout=1200)
        outs.append((p.returncode, o, e))
    if any(rc == 3 for rc, _, _ in outs):
        pytest.skip(next(o for rc, o, _ in outs if rc == 3).strip().splitlines()[-1])
    checked = sum(o.count("block=") for _, o, _ in outs)
    assert checked > 100, checked  # every kernel of _cases(), across the shards
    for rc, o, e in outs:
        assert rc == 0, o[-4000:] + e[-4000:]


# ---------------------------------------------------------------- the GPU benchmark

_BENCH = os.path.join(HERE, "..", "benchmarks", "gpu_bench.py")


@pytest.mark.skipif(ON_GPU, reason="checks the refusal without a GPU")
def test_gpu_bench_refuses_clearly_without_a_gpu():
    out = subprocess.run([sys.executable, _BENCH], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "gpu_bench:" in out.stderr, out.stderr


@pytest.mark.cudasim
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm", "group_norm", "instance_norm"])
def test_gpu_bench_cases_compute_what_the_public_functions_do(norm):
    """gpu_bench's callables, built from the table with no branch on the norm, run in the
    simulator (numba device arrays; torch's column needs a CUDA torch): its ``kernel``
    launchers write what the public functions return, bit for bit, forward and backward,
    and its copy floor runs."""
    sys.path.insert(0, os.path.join(HERE, ".."))
    try:
        from benchmarks import gpu_bench
    finally:
        sys.path.pop(0)
    from numbanorm import measure

    calls, case = gpu_bench._cases(norm, gpu_bench.GN_CHANNELS, 4, "float32", measure.NumbaCudaSide())
    assert set(calls) == {"kernel", "api", "copy"} and case.shape[-1] == 4
    for k, direction in enumerate(measure.DIRECTIONS):
        got = [to_host(a) for a in calls["kernel"][k]()]
        want = calls["api"][k]()
        # the api's plain forward returns y alone: the statistics the kernel wrote are
        # checked by the backward, which the api runs on its own forward's
        want = (want,) if direction == "forward" else want
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.reshape(np.shape(w)), to_host(w), err_msg=f"{norm} {direction}")
        calls["copy"][k]()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a real CUDA GPU")
def test_gpu_bench_runs(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "bench.json"
    out = subprocess.run([sys.executable, _BENCH, "--rows", "512", "--cols", "256", "1024", "--repeats", "2",
                          "--iters", "1", "--out", str(path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    import json

    data = json.loads(path.read_text())
    assert data["meta"]["device"] and len(data["results"]) >= 6


@pytest.mark.cudasim
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_parameter_gradients_stored_in_the_parameters_dtype(rng, monkeypatch, kind):
    """The column sums round straight into float16 parameters: the backward is two
    launches (kernel, column sums) with the same bits as float32 sums cast after."""
    from numbanorm.cuda._kernels import row_norm

    M, N = 300, 40  # several blocks: several partial rows per column
    x, dy = _rows(rng, (M, N), np.float16), _rows(rng, (M, N), np.float16)
    w = cuda.to_device(rng.uniform(0.5, 1.5, N).astype(np.float16))
    xd, dyd = cuda.to_device(x), cuda.to_device(dy)
    mean = cuda.to_device(x.astype(np.float32).mean(1))
    rstd = cuda.to_device((1 / x.astype(np.float32).std(1)).astype(np.float32))
    layer = kind == "layer"

    def run(dtype):
        dx = cuda.device_array((M, N), np.float16)
        dw, db = cuda.device_array(N, dtype), cuda.device_array(N, dtype) if layer else None
        row_norm.backward(kind, dyd, xd, mean if layer else None, rstd, w, dx, dw, db)
        return dx.copy_to_host(), dw.copy_to_host(), None if db is None else db.copy_to_host()

    wide = run(np.float32)
    launches = []
    real = C.launch
    monkeypatch.setattr(C, "launch", lambda *a, **k: launches.append(a[0]) or real(*a, **k))
    narrow = run(np.float16)
    assert len(launches) == 2 and C.row_config(M, N).grid > 1
    np.testing.assert_array_equal(narrow[0], wide[0])
    np.testing.assert_array_equal(narrow[1], wide[1].astype(np.float16))
    if layer:
        np.testing.assert_array_equal(narrow[2], wide[2].astype(np.float16))


@pytest.mark.cudasim
@pytest.mark.parametrize("xdt,wname", slow_where(
    [(xdt, w) for xdt in (np.float32, np.float16) for w in ("float16", "bfloat16", "float32")],
    lambda xdt, w: (np.dtype(xdt).name, w) not in {("float32", "float16"), ("float16", "bfloat16")}))
def test_public_backward_is_two_launches_for_any_weight_dtype(rng, monkeypatch, xdt, wname):
    """The public backward: the row kernel and the column sums, which round dweight/dbias
    straight into the weight's dtype (no cast launches after: there were two for 16-bit
    weights), with the bits of float32 sums cast after, and the oracle's values."""
    from numbanorm.cuda import _backend

    wdt = _bf16() if wname == "bfloat16" else np.dtype(wname)
    M, N = 48, 40  # several blocks: several partial rows per column
    x, dy = _rows(rng, (M, N), xdt), _rows(rng, (M, N), xdt)
    w = rng.uniform(0.5, 1.5, N).astype(wdt)
    x4, dy4, w4 = x.reshape(M, 4, -1), dy.reshape(M, 4, -1), w[:4]
    xd, dyd, wd, x4d, dy4d, w4d = (cuda.to_device(a) for a in (x, dy, w, x4, dy4, w4))
    f = np.float32
    _, m, r = nc.layer_norm_forward(xd, N, wd, wd)
    _, rr = nc.rms_norm_forward(xd, N, wd)
    _, gm, gr = nc.group_norm_forward(x4d, 2, w4d, w4d)
    calls = {
        "layer": (lambda: nc.layer_norm_backward(dyd, xd, m, r, N, wd), 2,
                  ORACLE.layer_norm_backward(dy.astype(f), x.astype(f), to_host(m), to_host(r), N, w.astype(f))),
        "rms": (lambda: nc.rms_norm_backward(dyd, xd, rr, N, wd), 2,
                ORACLE.rms_norm_backward(dy.astype(f), x.astype(f), to_host(rr), N, w.astype(f))),
        "group": (lambda: nc.group_norm_backward(dy4d, x4d, gm, gr, w4d), 3,  # + the channel sums
                  ORACLE.group_norm_backward(dy4.astype(f), x4.astype(f), to_host(gm), to_host(gr), w4.astype(f))),
    }
    launches = []
    real = C.launch
    monkeypatch.setattr(C, "launch", lambda *a, **k: launches.append(a[0]) or real(*a, **k))
    for name, (call, n_launches, ref) in calls.items():
        del launches[:]
        got = [to_host(a) for a in call()]
        assert len(launches) == n_launches, (name, len(launches))
        for k, (g, want) in enumerate(zip(got[1:], ref[1:])):
            assert g.dtype == w.dtype, name
            if wname == "bfloat16":  # one bfloat16 ulp (2**-7) of the oracle rounded to it
                want = want.astype(wdt).astype(np.float64)
                np.testing.assert_allclose(g.astype(np.float64), want, rtol=2.0 ** -7,
                                           atol=2.0 ** -7 * np.abs(want).max(), err_msg=name)
            else:  # the sums' dtype (float32 for 16-bit x: the oracle widens alike), or the weight's if narrower
                acc = np.dtype(np.float64 if np.dtype(xdt) == np.float64 else np.float32)
                assert_close(g, want, wdt if np.dtype(wdt).itemsize < acc.itemsize else acc, name)
        # the sums in float32 and a cast after, as before: the same bits
        monkeypatch.setattr(_backend, "grads_in_any_dtype", False)
        wide = [to_host(a) for a in call()]
        monkeypatch.setattr(_backend, "grads_in_any_dtype", True)
        for g, h in zip(got, wide):
            np.testing.assert_array_equal(g.view(np.uint8), h.view(np.uint8), err_msg=name)


@pytest.mark.cudasim
@pytest.mark.parametrize("shape", [(3, 1024), (4, 96), (2, 70)])  # 16-byte words, several rows a block, elements
def test_large_offset_rows_against_the_oracle(rng, shape):
    """The contract's large-offset rows (mean 1e4, std 1e-2) through the GPU forward: the
    mean's float32 rounding (1e-3, a tenth of the std) must not reach y or rstd."""
    n = shape[1]
    x = (1e4 + 1e-2 * rng.standard_normal(shape)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    y, m, r = nc.layer_norm_forward(x, n, w, b)
    yr, mr, rr = ORACLE.layer_norm_forward(x, n, w, b)
    for got, ref, what in ((y, yr, "y"), (m, mr, "mean"), (r, rr, "rstd")):
        assert_close(got, ref, np.float32, f"large offset {what} {shape}")
    y, s, m, r = nc.add_layer_norm_forward(x, np.full_like(x, 0.5), n, w, b)
    yr, mr, rr = ORACLE.layer_norm_forward(s, n, w, b)
    assert_close(y, yr, np.float32, f"large offset fused y {shape}")
    assert_close(r, rr, np.float32, f"large offset fused rstd {shape}")


@pytest.mark.cudasim
@pytest.mark.parametrize("mapping", ["loop", "loop_unstaged"])
@pytest.mark.parametrize("offset", [0, 4, 1])  # float16 elements: 16-byte, 8-byte words, elements
def test_long_rows_of_offset_views_against_the_oracle(knobs, rng, mapping, offset):
    """Long rows in every word width (an offset view falls back to narrower words),
    staged in shared memory or re-read, forward and backward."""
    knobs(**MAPPINGS[mapping][0])
    n = 64
    x, dy = _rows(rng, (3, n), np.float16), _rows(rng, (3, n), np.float16)
    w = rng.uniform(0.5, 1.5, n).astype(np.float16)
    b = rng.standard_normal(n).astype(np.float16)

    def view(a):
        flat = cuda.to_device(np.concatenate([np.zeros(offset, a.dtype), a.ravel()]))
        return flat[offset:].reshape(a.shape)

    xd, dyd = view(x), view(dy)
    vec = C.vec_width(n, xd)
    assert vec == {0: 8, 4: 4, 1: 1}[offset]
    staged = C.row_config(3, n, False, vec, C.ROW_RESIDENT, 2, 2).stage > 0
    assert staged == (mapping == "loop")
    y, m, r = (a.copy_to_host() for a in nc.layer_norm_forward(xd, n, cuda.to_device(w), cuda.to_device(b)))
    yr, mr, rr = ORACLE.layer_norm_forward(x, n, w, b)
    assert_close(y, yr, np.float16, f"y {mapping} {offset}")
    assert_close(r, rr, np.float32, f"rstd {mapping} {offset}")
    got = nc.layer_norm_backward(dyd, xd, cuda.to_device(m), cuda.to_device(r), n, cuda.to_device(w))
    for g, ref, what in zip(got, ORACLE.layer_norm_backward(dy, x, mr, rr, n, w), ("dx", "dw", "db")):
        assert_close(g.copy_to_host(), ref, np.float16, f"{what} {mapping} {offset}")


# ---------------------------------------------------------------- long rows past the default shared memory

def _close16(got, ref, dt, what):
    """assert_close, and for bfloat16 (no tolerance of its own there) one bfloat16 ulp of
    the largest magnitude (2**-8: float16's 2e-3 is four of its half ulps)."""
    if not C.is_bfloat16(np.dtype(dt)):
        return assert_close(got, ref, dt, what)
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    scale = max(1.0, float(np.max(np.abs(ref))))
    np.testing.assert_allclose(got, ref, rtol=2.0 ** -8, atol=2.0 ** -8 * scale, err_msg=what)


# each dtype one forward and one backward, fused in one and not in the other
OVER_DEFAULT = {"float16": (False, True), "bfloat16": (True, False), "float32": (True, False)}


@pytest.mark.cudasim
@pytest.mark.parametrize("dtype", list(OVER_DEFAULT))
def test_long_rows_staged_past_the_default_shared_memory_against_the_oracle(knobs, rng, dtype):
    """Rows whose staged copies take more dynamic shared memory than a kernel gets without
    opting in (``SHARED_DEFAULT``; the forward's x or s at N, the backward's x and dy at
    N / 2), forward and backward, fused (s = x + res; dx + ds) and not, in the simulator
    against the oracle.  The threshold is lowered to 1 KB and the rows are 1.5 KB: one
    kernel serves every staged length (the size is the launch's), the simulator has no
    48 KB limit to cross, and it took over 7 minutes for one float16 row of 49 KB.  The
    driver's side of the opt-in (the attribute set before the launch) is
    tests/test_cuda_launch.py's, at 64 and 128 KB."""
    dt = _bf16() if dtype == "bfloat16" else np.dtype(dtype)
    fused_forward, fused_backward = OVER_DEFAULT[dtype]
    knobs(**LONG, SHARED_DEFAULT=1024)
    item = np.dtype(dt).itemsize
    n = 1536 // item                              # the forward's row: one 1.5 KB copy
    for rows, staged in ((n, 1), (n // 2, 2)):
        cfg = C.row_config(1, rows, False, 16 // item, C.ROW_RESIDENT, item, staged)
        assert cfg.loop and cfg.shared == 1536 > C.SHARED_DEFAULT, cfg
    shared, real = [], C.launch  # each launch's dynamic shared bytes
    knobs(launch=lambda *a, **k: shared.append(k.get("shared", 0)) or real(*a, **k))

    def data(shape):
        return _rows(rng, shape).astype(dt)

    x, res = data((1, n)), data((1, n))
    w, b = rng.uniform(0.5, 1.5, n).astype(dt), rng.standard_normal(n).astype(dt)
    if fused_forward:
        y, s, m, r = nc.add_layer_norm_forward(x, res, n, w, b)
        np.testing.assert_array_equal(s, x + res)
        x = s
    else:
        y, m, r = nc.layer_norm_forward(x, n, w, b)
    yr, mr, rr = ORACLE.layer_norm_forward(x, n, w, b)
    _close16(y, yr, dt, f"LN y (fused: {fused_forward})")
    assert_close(m, mr, np.float32, "LN mean")
    assert_close(r, rr, np.float32, "LN rstd")
    assert shared == [1536]
    h = n // 2                                     # the backward's row: x and dy, 1.5 KB
    x, dy, ds, w = data((1, h)), data((1, h)), data((1, h)), w[:h]
    _, mr, rr = ORACLE.layer_norm_forward(x, h, w, None)
    m, r = mr.astype(np.float32), rr.astype(np.float32)
    if fused_backward:
        got, ref = nc.add_layer_norm_backward(dy, ds, x, m, r, h, w), ORACLE.add_layer_norm_backward(dy, ds, x, m, r, h, w)
    else:
        got, ref = nc.layer_norm_backward(dy, x, m, r, h, w), ORACLE.layer_norm_backward(dy, x, m, r, h, w)
    for g, e, what in zip(got, ref, ("dx", "dw", "db")):
        _close16(g, e, dt, f"LN backward {what} (fused: {fused_backward})")
    assert shared == [1536, 1536, 0]  # (the backward's column sums take none)


# ---------------------------------------------------------------- LayerNorm statistics in one reduction

def _edge_rows(rng, m, n, dtype):
    """Rows 0 and 5 ordinary; 1 large-offset (mean 1e4, std 1e-2: the contract's); 2 its
    first 8 elements 64 std out (the shift, the mean of the first word, is: the shifted
    one-pass cannot serve it, the two-pass fallback does); 3 constant; 4 a NaN in the
    middle (which must not leak into the rows beside it)."""
    x = rng.standard_normal((m, n)) * 2 + 0.5
    x[1] = 1e4 + 1e-2 * rng.standard_normal(n)
    x[2] = 0.5 + 1e-2 * rng.standard_normal(n)    # (a small std: rstd ~ 100, compared to 2e-5 of it)
    x[2, :8] = x[2, 8:].mean() + 64 * x[2, 8:].std()
    x[3] = 3.25
    x[4, n // 2] = np.nan
    return x.astype(dtype)


def _exact_layer_norm_row(row, w, b, eps):
    """y of one row computed exactly (fractions; the square root to 40 digits), rounded to
    float64 once: the float64 oracle's own mean rounding is 3.6e-11 of y at a mean of 1e4
    and a std of 1e-2, over float64's tolerance."""
    import decimal
    from fractions import Fraction

    def dec(f):
        return decimal.Decimal(f.numerator) / decimal.Decimal(f.denominator)

    with decimal.localcontext() as ctx:
        ctx.prec = 40
        vals = [Fraction(float(v)) for v in row]
        mean = sum(vals) / len(vals)
        var = sum((v - mean) ** 2 for v in vals) / len(vals)
        rstd = 1 / (dec(var) + dec(Fraction(eps))).sqrt()
        return np.array([float(dec(v - mean) * rstd * dec(Fraction(float(wi))) + dec(Fraction(float(bi))))
                         for v, wi, bi in zip(vals, w, b)])


# mapping -> (knobs, the row config it gives): where the two-pass's reduction meets other
# row groups at a barrier (several groups wider than a warp in a block) the block votes at
# one; elsewhere (a block of one group, groups of a warp or narrower) the warp votes
_EDGE_MAPPINGS = {
    "default": ({}, lambda c, n: c.rows > 1 and (c.tpr < 32) == (n == 70)),
    "one group": ({"BLOCK_THREADS": 64}, lambda c, n: not c.loop and c.rows == 1 and c.tpr > 32),
    "warp groups": ({}, lambda c, n: not c.loop and c.rows > 1 and c.tpr == 32),
    "loop": (LONG, lambda c, n: c.loop),
    "loop64": ({"MAX_TPR": 64, "MAX_VPT": 2}, lambda c, n: c.loop and c.tpr == 64),
}


@pytest.mark.cudasim
@pytest.mark.parametrize("dtype,mapping,n", slow_where(
    [(dt, m, n) for dt in (np.float32, np.float64)
     for m, n in (("default", 70), ("default", 1024), ("one group", 1024),
                  ("warp groups", 512 if dt == np.float32 else 256), ("loop", 70), ("loop64", 2000))],
    lambda dt, m, n: dt != np.float32 and m != "loop"))
def test_layer_norm_statistics_edge_rows_side_by_side(knobs, rng, mapping, n, dtype):
    """The forward's statistics come from one group reduction of the sums of x - x[0] and
    their squares; a row where that is not exact enough (x[0] an outlier, NaN) takes the
    corrected two-pass, while its neighbours in the same warp (N = 70: groups of 8 or 16
    threads; N = 512: a warp each) or block (N = 1024: groups of 64 or 128 threads; loop64: a
    block of 64 per row) keep their one pass, and a row with a block to itself (one
    group: 64 threads) takes it alone -- all against the oracle, fused or not."""
    setting, expected = _EDGE_MAPPINGS[mapping]
    knobs(**setting)
    cfg = C.row_config(6, n, dtype == np.float64)
    assert expected(cfg, n), cfg
    x = _edge_rows(rng, 6, n, dtype)
    w = rng.uniform(0.5, 1.5, n).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    y, m, r = nc.layer_norm_forward(x, n, w, b)
    yr, mr, rr = ORACLE.layer_norm_forward(x, n, w, b)
    assert np.isnan(y[4]).all() and np.isnan(m[4]).all() and np.isnan(r[4]).all()
    assert not np.isnan(y[[0, 1, 2, 3, 5]]).any()
    if dtype == np.float64:
        yr[1] = _exact_layer_norm_row(x[1], w, b, 1e-5)
    for row in range(6):
        assert_close(y[row], yr[row], dtype, f"y row {row}")
        assert_close(m[row], mr[row], dtype, f"mean row {row}")
        assert_close(r[row], rr[row], dtype, f"rstd row {row}")
    assert_close(y[2, 8:], yr[2, 8:], dtype, "y row 2 beside its outliers")  # (the outliers' 64 set y's scale)
    np.testing.assert_array_equal(y[3], b)  # a constant row: its deviations are exactly 0
    res = np.zeros_like(x)
    res[:, 0] = 0.5  # s = x + res: the shift is s's first element, not x's
    y, s, m, r = nc.add_layer_norm_forward(x, res, n, w, b)
    yr, mr, rr = ORACLE.layer_norm_forward(s, n, w, b)
    for row in (0, 2, 5):
        assert_close(y[row, 8:], yr[row, 8:], dtype, f"fused y row {row}")
        assert_close(r[row], rr[row], dtype, f"fused rstd row {row}")


# mapping -> (knobs, its (loop, tpr, rows) at N = 8192): elements per thread raised so that
# the simulator runs few threads
_OUTLIER_MAPPINGS = {
    "loop": (LONG, (True, 32, 1)),  # the simulator's cheapest long row
    "one group": ({"REG_ELEMS": 128, "MAX_VPT": 128, "BLOCK_THREADS": 64}, (False, 64, 1)),
    "warp groups": ({"REG_ELEMS": 256, "MAX_VPT": 256, "BLOCK_THREADS": 64}, (False, 32, 2)),
    "shared block": ({"REG_ELEMS": 128, "MAX_VPT": 128, "BLOCK_THREADS": 128}, (False, 64, 2)),
}


@pytest.mark.cudasim
@pytest.mark.parametrize("mapping", list(_OUTLIER_MAPPINGS))
def test_layer_norm_outlier_first_word_takes_the_two_pass(knobs, rng, mapping):
    """A first word (the shift's 4 float32) 64 std away from the rest: the shifted sums'
    var = ms - m1^2 cancels all but ~4 / N of ms (11 of float32's 24 bits at N = 8192:
    rstd outside float32's tolerance on every mapping here, checked with the fallback
    switched off; at N = 4096 one mapping's rounding came within it), so that row must take
    the two-pass; the other row (an ordinary one) keeps the one pass.  On the long rows'
    loop path (a warp per row) and held in registers: a 64-thread group with a block to
    itself and warp-wide groups (a warp's vote), two 64-thread groups sharing a block (the
    block's vote, at a barrier)."""
    setting, layout = _OUTLIER_MAPPINGS[mapping]
    knobs(**setting)
    n = 8192
    cfg = C.row_config(2, n, False)
    assert (cfg.loop, cfg.tpr, cfg.rows) == layout
    x = 1 + 1e-2 * rng.standard_normal((2, n))
    x[0, :4] = x[0, 4:].mean() + 64 * x[0, 4:].std()
    x = x.astype(np.float32)
    assert C.vec_width(n, x) == 4
    y, m, r = nc.layer_norm_forward(x, n)
    yr, mr, rr = ORACLE.layer_norm_forward(x, n)
    for row in range(2):
        assert_close(r[row], rr[row], np.float32, f"rstd row {row}")
        assert_close(m[row], mr[row], np.float32, f"mean row {row}")
        assert_close(y[row, 4:], yr[row, 4:], np.float32, f"y row {row} (beside the outliers)")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_group_norm_backward_of_one_element_groups_is_exactly_zero(dtype):
    """A group of one element has xhat = 0 and dx = rstd * (w*dy - c2) with c2 the group's
    mean of w*dy: exactly 0 when w*dy is rounded alike in both.  The kernel multiplied
    dy by w*rstd instead, so dx was the products' rounding difference times
    rstd = 1/sqrt(eps): 3e-5 here in float32, 2.0e-5 on an H200 (over the 2e-5 tolerance)."""
    rng = np.random.default_rng(7)
    x, dy = (rng.standard_normal((3, 6, 1, 1)).astype(dtype) for _ in range(2))
    w, b = (rng.standard_normal(6).astype(dtype) for _ in range(2))
    _, mean, rstd = nc.group_norm_forward(x, 6, w, b)
    dx = nc.group_norm_backward(dy, x, mean, rstd, w)[0]
    assert np.array_equal(to_host(dx), np.zeros_like(x))
