"""Every kernel against the NumPy oracle: odd shapes, all dtypes, every affine combination."""

import itertools

import numpy as np
import pytest
from _marks import EXHAUSTIVE

from conftest import DTYPES, ORACLE, SIMULATED, assert_close, channels_last, to_host

# (x shape, number of trailing dims normalized): 1x1, 1x1023, a row count that is
# not a multiple of any block size, rows of 4099 (prime-ish, > 4096), 1-3 dims, a
# transformer's hidden size.  All under common.SERIAL_BELOW elements: one call of a
# specialization runs the row function on the calling thread, which is what the
# parallel kernels run too (their bits: test_cpu_kernels.py), and a larger shape would
# only hand the compile thread a parallel kernel no test here waits for
ROW_CASES = [
    ((1, 1), 1), ((1, 1023), 1), ((3, 5, 33), 1), ((3, 5, 33), 2),
    ((2, 3, 4, 5), 1), ((2, 3, 4, 5), 2), ((2, 3, 4, 5), 3),
    ((5, 4099), 1), ((40, 768), 1), ((7,), 1),
]
# (x shape, num_groups): instance norm (G == C), layer-norm-like (G == 1), odd spatial sizes
GROUP_CASES = [
    ((1, 1, 1), 1), ((2, 6, 4, 5), 3), ((2, 6, 7), 6), ((2, 6, 7), 1),
    ((3, 4, 1023), 2), ((4, 32, 8, 8), 8), ((2, 64, 33), 32), ((1, 3), 3),
]
# the simulator runs one Python thread per CUDA thread: keep its shapes tiny, yet
# covering partial blocks, 1-3 normalized dims and both row mappings
SIM_ROW_CASES = [((1, 1), 1), ((3, 33), 1), ((2, 3, 4, 5), 2), ((2, 3, 4, 5), 3), ((5, 70), 1)]
SIM_GROUP_CASES = [((1, 1, 1), 1), ((2, 6, 4, 5), 3), ((2, 6, 7), 6), ((2, 4, 9), 1)]

AFFINE = ["none", "weight", "bias", "both"]


def by_dtype(names, *axes, keep):
    """A parametrize of ``names`` ("a,b,dtype"): every combination of the ``axes`` in
    float32, and in the other dtypes those in ``keep`` (the rest exhaustive, ``-m slow``):
    each dtype still meets the kernels without and with parameters, and the default set
    compiles a few specializations of each fewer."""
    cases = [pytest.param(*combo, dt, id="-".join(map(str, combo)) + f"-{np.dtype(dt).name}",
                          marks=EXHAUSTIVE if dt != np.float32 and combo not in keep else ())
             for dt in DTYPES for combo in itertools.product(*axes)]
    return pytest.mark.parametrize(names, cases)


# LayerNorm's and GroupNorm's weight and bias; RMSNorm's weight and eps
BY_AFFINE = by_dtype("affine,dtype", AFFINE, keep={("none",), ("both",)})
BY_WEIGHT_EPS = by_dtype("eps,affine,dtype", [None, 1e-6], ["none", "weight"],
                         keep={(None, "none"), (1e-6, "weight")})


def row_cases(impl_name):
    return SIM_ROW_CASES if impl_name == "cuda" and SIMULATED else ROW_CASES


def group_cases(impl_name):
    return SIM_GROUP_CASES if impl_name == "cuda" and SIMULATED else GROUP_CASES


def params(rng, shape, affine, dtype):
    w = rng.uniform(0.5, 1.5, shape).astype(dtype) if affine in ("weight", "both") else None
    b = rng.standard_normal(shape).astype(dtype) if affine in ("bias", "both") else None
    return w, b


def inputs(rng, shape, dtype):
    return (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)


@BY_AFFINE
def test_layer_norm(impl, impl_name, rng, dtype, affine):
    for shape, k in row_cases(impl_name):
        ns = shape[len(shape) - k:]
        x = inputs(rng, shape, dtype)
        w, b = params(rng, ns, affine, dtype)
        y, mean, rstd = map(to_host, impl.layer_norm_forward(x, ns, w, b, 1e-5))
        yr, mr, rr = ORACLE.layer_norm_forward(x, ns, w, b, 1e-5)
        assert y.dtype == dtype and mean.dtype == (np.float64 if dtype == np.float64 else np.float32)
        assert_close(y, yr, dtype, f"y {shape} {k}")
        assert_close(mean, mr, np.float32 if dtype == np.float16 else dtype, "mean")
        assert_close(rstd, rr, np.float32 if dtype == np.float16 else dtype, "rstd")
        np.testing.assert_array_equal(to_host(impl.layer_norm(x, ns, w, b)), y)

        dy = inputs(rng, shape, dtype)
        dx, dw, db = map(to_host, impl.layer_norm_backward(dy, x, mean, rstd, ns, w))
        dxr, dwr, dbr = ORACLE.layer_norm_backward(dy, x, mr, rr, ns, w)
        assert dx.dtype == dtype and dw.dtype == dtype and dw.shape == ns and db.shape == ns
        assert_close(dx, dxr, dtype, f"dx {shape} {k}")
        assert_close(dw, dwr, dtype, "dweight")
        assert_close(db, dbr, dtype, "dbias")


@BY_WEIGHT_EPS
def test_rms_norm(impl, impl_name, rng, dtype, affine, eps):
    for shape, k in row_cases(impl_name):
        ns = shape[len(shape) - k:]
        x = inputs(rng, shape, dtype)
        w, _ = params(rng, ns, affine, dtype)
        y, rstd = map(to_host, impl.rms_norm_forward(x, ns, w, eps))
        yr, rr = ORACLE.rms_norm_forward(x, ns, w, eps)
        assert y.dtype == dtype
        assert_close(y, yr, dtype, f"y {shape} {k}")
        assert_close(rstd, rr, np.float32 if dtype == np.float16 else dtype, "rstd")

        dy = inputs(rng, shape, dtype)
        dx, dw = map(to_host, impl.rms_norm_backward(dy, x, rstd, ns, w))
        dxr, dwr = ORACLE.rms_norm_backward(dy, x, rr, ns, w)
        assert dx.dtype == dtype and dw.shape == ns
        assert_close(dx, dxr, dtype, f"dx {shape} {k}")
        assert_close(dw, dwr, dtype, "dweight")


@BY_AFFINE
def test_group_norm(impl, impl_name, rng, dtype, affine):
    for shape, g in group_cases(impl_name):
        x = inputs(rng, shape, dtype)
        w, b = params(rng, (shape[1],), affine, dtype)
        y, mean, rstd = map(to_host, impl.group_norm_forward(x, g, w, b, 1e-5))
        yr, mr, rr = ORACLE.group_norm_forward(x, g, w, b, 1e-5)
        assert y.dtype == dtype and mean.shape == (shape[0], g)
        assert_close(y, yr, dtype, f"y {shape} G={g}")
        assert_close(mean, mr, np.float32 if dtype == np.float16 else dtype, "mean")
        assert_close(rstd, rr, np.float32 if dtype == np.float16 else dtype, "rstd")

        dy = inputs(rng, shape, dtype)
        dx, dw, db = map(to_host, impl.group_norm_backward(dy, x, mean, rstd, w))
        dxr, dwr, dbr = ORACLE.group_norm_backward(dy, x, mr, rr, w)
        assert dx.dtype == dtype and dw.shape == (shape[1],)
        assert_close(dx, dxr, dtype, f"dx {shape} G={g}")
        assert_close(dw, dwr, dtype, "dweight")
        assert_close(db, dbr, dtype, "dbias")


# GroupNorm's x in channels-last order, (N, C, *spatial) laid out as (N, *spatial, C): the CPU
# has kernels for it and returns y and dx in it (torch's CPU rule), the GPU copies it.  Blocks
# of positions whole and cut short (cpu group_norm.POSITIONS, 4 a step), 4 and 5 dimensions
LAST_CASES = [((2, 6, 4, 5), 3), ((3, 8, 16, 17), 4), ((1, 12, 3, 4, 5), 12), ((2, 4, 301, 3), 1)]
SIM_LAST_CASES = [((2, 6, 4, 5), 3), ((1, 4, 2, 2, 3), 2)]


def in_channels_last_order(a):
    """Whether ``a`` (N, C, *spatial) is laid out as (N, *spatial, C) (a size-1 dimension's
    stride aside, as NumPy's and torch's contiguity flags have it)."""
    return np.moveaxis(a, 1, -1).flags.c_contiguous


@BY_AFFINE
def test_group_norm_channels_last(impl, impl_name, rng, dtype, affine):
    for shape, g in SIM_LAST_CASES if impl_name == "cuda" and SIMULATED else LAST_CASES:
        x = channels_last(inputs(rng, shape, dtype))
        w, b = params(rng, (shape[1],), affine, dtype)
        y, mean, rstd = impl.group_norm_forward(x, g, w, b, 1e-5)
        yr, mr, rr = ORACLE.group_norm_forward(x, g, w, b, 1e-5)
        assert_close(to_host(y), yr, dtype, f"y {shape} G={g}")
        assert_close(to_host(mean), mr, np.float32 if dtype == np.float16 else dtype, "mean")
        assert_close(to_host(rstd), rr, np.float32 if dtype == np.float16 else dtype, "rstd")
        dy = inputs(rng, shape, dtype)  # C-contiguous: the call takes it in x's order
        dx, dw, db = impl.group_norm_backward(dy, x, mean, rstd, w)
        dxr, dwr, dbr = ORACLE.group_norm_backward(dy, x, mr, rr, w)
        assert_close(to_host(dx), dxr, dtype, f"dx {shape} G={g}")
        assert_close(to_host(dw), dwr, dtype, "dweight")
        assert_close(to_host(db), dbr, dtype, "dbias")
        if impl_name == "cpu":
            assert in_channels_last_order(y) and in_channels_last_order(dx), (shape, y.strides, dx.strides)


@pytest.mark.parametrize("pdtype", [np.float32, np.float64])
def test_parameters_of_another_dtype(impl, rng, pdtype):
    """float32 parameters with float16 activations: outputs take x's dtype, grads the weight's."""
    x = inputs(rng, (4, 40), np.float16)
    w = rng.uniform(0.5, 1.5, 40).astype(pdtype)
    b = rng.standard_normal(40).astype(pdtype)
    y, mean, rstd = map(to_host, impl.layer_norm_forward(x, 40, w, b))
    assert y.dtype == np.float16
    assert_close(y, ORACLE.layer_norm(x, 40, w, b), np.float16)
    dx, dw, db = map(to_host, impl.layer_norm_backward(x, x, mean, rstd, 40, w))
    assert dx.dtype == np.float16 and dw.dtype == pdtype and db.dtype == pdtype
    dxr, dwr, dbr = ORACLE.layer_norm_backward(x, x, mean, rstd, 40, w)
    assert_close(dx, dxr, np.float16)
    assert_close(dw, dwr, np.float32)
