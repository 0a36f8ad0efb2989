"""``out=`` overlapping an input on the GPU: the result is as if every input were read
before ``out`` is written (NumPy's rule, the API's), for device arrays that share memory.

Run in the CUDA simulator (conftest switches it on), which executes the kernels that
the GPU runs; ``tests/test_cuda_launch.py`` checks that a replayed call keeps to it too.
"""

import numpy as np
import pytest

import numbanorm.cuda as nc

if not nc.is_available():
    pytest.skip(f"numbanorm.cuda unavailable: {nc.why_unavailable()}", allow_module_level=True)

from numba import cuda  # noqa: E402

# rows over several blocks (BLOCK_THREADS below): in one block every row is read before the
# block's barrier, and an overlap could do no harm (6 rows were one block: the LayerNorm cases
# passed with the overlap check switched off).  The simulator runs blocks in order, so a
# shift of -1 (out one row before x) can only fail on a GPU.
M, N = 70, 8
NORMS = {  # name: (extra positional arguments, parameter roles)
    "layer_norm": ((N,), ("weight", "bias")),
    "rms_norm": ((N,), ("weight",)),
    "group_norm": ((2,), ("weight", "bias")),
}


@pytest.fixture(autouse=True)
def _several_blocks(knobs):
    knobs(BLOCK_THREADS=32)


def _fresh(name, x, args, params):
    """The result without any overlap: what an overlapping out= must equal, bit for bit."""
    dev = {r: cuda.to_device(v) for r, v in params.items()}
    return getattr(nc, name)(cuda.to_device(x), *args, **dev).copy_to_host()


def _case(rng, name):
    x = rng.standard_normal((M, 2, N // 2)).astype(np.float32) * 2 + 0.5
    width = 2 if name == "group_norm" else N  # group_norm's parameters are per channel
    params = {"weight": rng.uniform(0.5, 2, width).astype(np.float32),
              "bias": rng.standard_normal(width).astype(np.float32)}
    args, roles = NORMS[name]
    params = {r: params[r] for r in roles}
    x = x.reshape(M, N) if name != "group_norm" else x
    return x, args, params


@pytest.mark.parametrize("name", NORMS)
@pytest.mark.parametrize("shift", [-1, 1, 3])
def test_out_overlapping_x_by_rows(name, shift):
    rng = np.random.default_rng(0)
    x, args, params = _case(rng, name)
    want = _fresh(name, x, args, params)
    size = x.size
    buf = cuda.to_device(np.zeros(size + abs(shift) * x.shape[-1], np.float32))
    row = x.shape[-1]
    lo = 0 if shift > 0 else abs(shift) * row
    xd = buf[lo: lo + size].reshape(x.shape)
    xd.copy_to_device(x)
    od = buf[lo + shift * row: lo + shift * row + size].reshape(x.shape)  # rows of x, shifted
    dev = {r: cuda.to_device(v) for r, v in params.items()}
    got = getattr(nc, name)(xd, *args, **dev, out=od)
    np.testing.assert_array_equal(got.copy_to_host(), want)


@pytest.mark.parametrize("name, which", [("layer_norm", "weight"), ("layer_norm", "bias"),
                                         ("rms_norm", "weight"), ("group_norm", "weight"),
                                         ("group_norm", "bias")])
def test_out_overlapping_weight_or_bias_reads_them_first(name, which):
    rng = np.random.default_rng(1)
    x, args, params = _case(rng, name)
    want = _fresh(name, x, args, params)
    buf = cuda.to_device(rng.standard_normal(x.size).astype(np.float32))
    out = buf.reshape(x.shape)
    n = params[which].size
    dev = {r: cuda.to_device(v) for r, v in params.items()}
    dev[which] = buf[x.size // 2: x.size // 2 + n]  # inside out's later rows: overwritten as rows are written
    dev[which].copy_to_device(params[which])
    got = getattr(nc, name)(cuda.to_device(x), *args, **dev, out=out)
    np.testing.assert_array_equal(got.copy_to_host(), want)


@pytest.mark.parametrize("name", NORMS)
def test_out_is_x_in_place(name):
    rng = np.random.default_rng(2)
    x, args, params = _case(rng, name)
    want = _fresh(name, x, args, params)
    xd = cuda.to_device(x)
    dev = {r: cuda.to_device(v) for r, v in params.items()}
    got = getattr(nc, name)(xd, *args, **dev, out=xd)
    np.testing.assert_array_equal(got.copy_to_host(), want)
