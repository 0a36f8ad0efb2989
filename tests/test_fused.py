"""Fused residual add + LayerNorm/RMSNorm against the oracle, PyTorch autograd and the contract's errors.

What is normalized is the returned ``s`` (rounded to x's dtype), so the forward is
checked against ``reference.layer_norm_forward(s)`` at the dtype's tolerance, and
``s`` itself bit for bit against NumPy's ``x + residual``.  For float32/float64
that is also within tolerance of the oracle's unrounded ``reference.add_*`` (one
rounding of s is far below the tolerance); for float16 it is not the same thing,
which ``test_float16_normalizes_the_rounded_sum`` pins down.
"""

import numpy as np
import pytest

from conftest import FUSED, ORACLE, assert_close, to_host
from test_against_oracle import BY_AFFINE, BY_WEIGHT_EPS, inputs, params, row_cases


def stat_dtype(dtype):
    return np.float64 if dtype == np.float64 else np.float32


@BY_AFFINE
def test_add_layer_norm(impl, impl_name, rng, dtype, affine):
    for shape, k in row_cases(impl_name):
        ns = shape[len(shape) - k:]
        x, r = inputs(rng, shape, dtype), inputs(rng, shape, dtype)
        w, b = params(rng, ns, affine, dtype)
        y, s, mean, rstd = map(to_host, impl.add_layer_norm_forward(x, r, ns, w, b, 1e-5))
        assert y.dtype == dtype and s.dtype == dtype and mean.dtype == stat_dtype(dtype)
        assert mean.shape == rstd.shape == shape[: len(shape) - k] + (1,) * k
        np.testing.assert_array_equal(s, x + r)
        yr, mr, rr = ORACLE.layer_norm_forward(s, ns, w, b, 1e-5)
        assert_close(y, yr, dtype, f"y {shape} {k}")
        assert_close(mean, mr, stat_dtype(dtype), "mean")
        assert_close(rstd, rr, stat_dtype(dtype), "rstd")
        if dtype != np.float16:
            yo, so, mo, ro = ORACLE.add_layer_norm_forward(x, r, ns, w, b, 1e-5)
            assert_close(y, yo, dtype, "y against reference.add_layer_norm_forward")
            assert_close(s, so, dtype, "s against reference.add_layer_norm_forward")
        y2, s2 = map(to_host, impl.add_layer_norm(x, r, ns, w, b))
        np.testing.assert_array_equal(y2, y)
        np.testing.assert_array_equal(s2, s)

        dy = inputs(rng, shape, dtype)
        for ds in (None, inputs(rng, shape, dtype)):
            dx, dw, db = map(to_host, impl.add_layer_norm_backward(dy, ds, s, mean, rstd, ns, w))
            dxr, dwr, dbr = ORACLE.add_layer_norm_backward(dy, ds, s, mr, rr, ns, w)
            assert dx.dtype == dtype and dw.shape == db.shape == ns
            assert_close(dx, dxr, dtype, f"dx {shape} {k} ds={ds is not None}")
            assert_close(dw, dwr, dtype, "dweight")
            assert_close(db, dbr, dtype, "dbias")


@BY_WEIGHT_EPS
def test_add_rms_norm(impl, impl_name, rng, dtype, affine, eps):
    for shape, k in row_cases(impl_name):
        ns = shape[len(shape) - k:]
        x, r = inputs(rng, shape, dtype), inputs(rng, shape, dtype)
        w, _ = params(rng, ns, affine, dtype)
        y, s, rstd = map(to_host, impl.add_rms_norm_forward(x, r, ns, w, eps))
        assert y.dtype == dtype and s.dtype == dtype and rstd.dtype == stat_dtype(dtype)
        assert rstd.shape == shape[: len(shape) - k] + (1,) * k
        np.testing.assert_array_equal(s, x + r)
        # eps=None is the machine epsilon of x's accumulation dtype, not of float64 s
        e = eps if eps is not None else float(np.finfo(stat_dtype(dtype)).eps)
        yr, rr = ORACLE.rms_norm_forward(s, ns, w, e)
        assert_close(y, yr, dtype, f"y {shape} {k}")
        assert_close(rstd, rr, stat_dtype(dtype), "rstd")
        if dtype != np.float16:
            yo, so, ro = ORACLE.add_rms_norm_forward(x, r, ns, w, eps)
            assert_close(y, yo, dtype, "y against reference.add_rms_norm_forward")
        y2, s2 = map(to_host, impl.add_rms_norm(x, r, ns, w, eps))
        np.testing.assert_array_equal(y2, y)
        np.testing.assert_array_equal(s2, s)

        dy = inputs(rng, shape, dtype)
        for ds in (None, inputs(rng, shape, dtype)):
            dx, dw = map(to_host, impl.add_rms_norm_backward(dy, ds, s, rstd, ns, w))
            dxr, dwr = ORACLE.add_rms_norm_backward(dy, ds, s, rr, ns, w)
            assert dx.dtype == dtype and dw.shape == ns
            assert_close(dx, dxr, dtype, f"dx {shape} {k} ds={ds is not None}")
            assert_close(dw, dwr, dtype, "dweight")


def test_float16_normalizes_the_rounded_sum(impl):
    """2048 + 0.5 rounds to 2048 in float16: the returned s is a constant row, so y is 0.

    Normalizing the unrounded float32 sum instead would give y = +-1 here.
    """
    x = np.full((2, 8), 2048, np.float16)
    r = np.tile(np.array([0.5, -0.5], np.float16), (2, 4))
    y, s, mean, rstd = map(to_host, impl.add_layer_norm_forward(x, r, 8))
    np.testing.assert_array_equal(s, x)
    np.testing.assert_array_equal(mean, 2048)
    np.testing.assert_array_equal(y, 0)
    y, s = map(to_host, impl.add_rms_norm(x, r, 8))
    np.testing.assert_array_equal(y, 1)


def test_large_offset_keeps_unit_variance(impl):
    """The contract's mean 1e4, std 1e-2 float32 rows, arriving through the residual add."""
    rng = np.random.default_rng(7)
    x = (1e4 + 1e-2 * rng.standard_normal((4, 1024))).astype(np.float32)
    r = np.zeros_like(x)
    y, s = map(to_host, impl.add_layer_norm(x, r, 1024, eps=0.0))
    np.testing.assert_allclose(y.astype(np.float64).var(axis=1), 1.0, atol=1e-3)


@pytest.mark.parametrize("op", FUSED)
def test_nan_stays_in_its_row(impl, rng, op):
    fn = op.function("forward")
    x, r = inputs(rng, (4, 67), np.float32), inputs(rng, (4, 67), np.float32)
    clean = [to_host(a) for a in getattr(impl, fn)(x, r, 67)]
    x[2, 5] = np.nan
    dirty = [to_host(a) for a in getattr(impl, fn)(x, r, 67)]
    assert np.isnan(dirty[0][2]).all() and np.isnan(dirty[1][2, 5])
    for a, b in zip(clean, dirty):
        np.testing.assert_array_equal(np.delete(a, 2, axis=0), np.delete(b, 2, axis=0))


def test_noncontiguous_inputs_and_inputs_untouched(impl, rng):
    big_x, big_r = inputs(rng, (6, 80), np.float32), inputs(rng, (80, 6), np.float32)
    x, r = big_x[::2, ::2], big_r.T[::2, ::2]  # strided, and a transposed view
    keep_x, keep_r = x.copy(), r.copy()
    w, b = params(rng, (40,), "both", np.float32)
    got = [to_host(a) for a in impl.add_layer_norm_forward(x, r, 40, w, b)]
    want = [to_host(a) for a in impl.add_layer_norm_forward(x.copy(), r.copy(), 40, w, b)]
    for a, e in zip(got, want):
        np.testing.assert_array_equal(a, e)
    np.testing.assert_array_equal(x, keep_x)
    np.testing.assert_array_equal(r, keep_r)
    y, s, rstd = map(to_host, impl.add_rms_norm_forward(x, r, 40, w))
    np.testing.assert_array_equal(y, to_host(impl.add_rms_norm(x.copy(), r.copy(), 40, w)[0]))


def test_empty_batch(impl):
    x = np.empty((0, 3, 7), np.float32)
    y, s, mean, rstd = map(to_host, impl.add_layer_norm_forward(x, x, 7))
    assert y.shape == s.shape == (0, 3, 7) and mean.shape == (0, 3, 1)
    dx, dw, db = map(to_host, impl.add_layer_norm_backward(x, x, s, mean, rstd, 7))
    assert dx.shape == (0, 3, 7)
    np.testing.assert_array_equal(dw, 0)
    np.testing.assert_array_equal(db, 0)
    y, s, rstd = map(to_host, impl.add_rms_norm_forward(x, x, 7))
    assert y.shape == (0, 3, 7) and rstd.shape == (0, 3, 1)


def test_deterministic(impl, rng):
    x, r = inputs(rng, (33, 100), np.float32), inputs(rng, (33, 100), np.float32)
    w = params(rng, (100,), "weight", np.float32)[0]
    y, s, mean, rstd = map(to_host, impl.add_layer_norm_forward(x, r, 100, w))
    dy = inputs(rng, (33, 100), np.float32)
    first = [to_host(a) for a in impl.add_layer_norm_backward(dy, dy, s, mean, rstd, 100, w)]
    again = [to_host(a) for a in impl.add_layer_norm_backward(dy, dy, s, mean, rstd, 100, w)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------ errors (before anything runs)

@pytest.mark.parametrize("kind", ["plain", "forward"])
@pytest.mark.parametrize("op", FUSED)
def test_bad_residual(impl, op, kind):
    fn = op.function(kind)
    f = getattr(impl, fn)
    x = np.ones((3, 8), np.float32)
    with pytest.raises(ValueError, match=r"residual.*shape \(3, 9\).*\(3, 8\)"):
        f(x, np.ones((3, 9), np.float32), 8)
    with pytest.raises(ValueError, match=r"residual.*\(8,\).*\(3, 8\)"):
        f(x, np.ones(8, np.float32), 8)  # broadcastable is not enough: s has x's shape
    with pytest.raises(ValueError, match="residual.*float64.*float32"):
        f(x, np.ones((3, 8), np.float64), 8)
    with pytest.raises(TypeError, match="residual.*int64"):
        f(x, np.ones((3, 8), np.int64), 8)
    with pytest.raises(TypeError, match="residual"):
        f(x, None, 8)
    with pytest.raises(TypeError, match="int32"):
        f(np.ones((3, 8), np.int32), np.ones((3, 8), np.int32), 8)
    with pytest.raises(ValueError, match="normalized_shape"):
        f(x, x, 7)
    with pytest.raises(ValueError, match="weight"):
        f(x, x, 8, np.ones(7, np.float32))
    with pytest.raises(ValueError, match="eps"):
        f(x, x, 8, None, *([None] if "layer" in fn else []), eps=-1.0)


def test_bad_backward_arguments(impl):
    x = np.ones((3, 8), np.float32)
    y, s, mean, rstd = impl.add_layer_norm_forward(x, x, 8)
    with pytest.raises(ValueError, match=r"ds.*\(3, 7\)"):
        impl.add_layer_norm_backward(x, np.ones((3, 7), np.float32), s, mean, rstd, 8)
    with pytest.raises(ValueError, match=r"dy.*\(2, 8\)"):
        impl.add_layer_norm_backward(x[:2], None, s, mean, rstd, 8)
    with pytest.raises(ValueError, match="mean"):
        impl.add_layer_norm_backward(x, None, s, mean[:2], rstd, 8)
    with pytest.raises(TypeError, match="`s`.*int64"):
        impl.add_layer_norm_backward(x, None, np.ones((3, 8), np.int64), mean, rstd, 8)
    y, s, rstd = impl.add_rms_norm_forward(x, x, 8)
    with pytest.raises(ValueError, match=r"ds.*\(3, 9\)"):
        impl.add_rms_norm_backward(x, np.ones((3, 9), np.float32), s, rstd, 8)
    with pytest.raises(ValueError, match="rstd"):
        impl.add_rms_norm_backward(x, None, s, rstd[:1], 8)


# ------------------------------------------------------------ against PyTorch autograd

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("with_ds", [False, True])
def test_against_torch_autograd_of_the_unfused_composition(dtype, norm, with_ds):
    """numbanorm's fused forward/backward vs autograd through ``F.layer_norm(x + r)``."""
    torch = pytest.importorskip("torch")
    import numbanorm

    rng = np.random.default_rng(3)
    shape, ns = (3, 5, 48), (5, 48)
    x, r, dy, ds = (inputs(rng, shape, dtype) for _ in range(4))
    w, b = params(rng, ns, "both", dtype)
    tx, tr, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, r, w, b))
    ts = tx + tr
    if norm == "layer":
        ty = torch.nn.functional.layer_norm(ts, ns, tw, tb, 1e-5)
        y, s, mean, rstd = numbanorm.add_layer_norm_forward(x, r, ns, w, b, 1e-5)
    else:
        ty = torch.nn.functional.rms_norm(ts, ns, tw, 1e-6)
        y, s, rstd = numbanorm.add_rms_norm_forward(x, r, ns, w, 1e-6)
    loss = (ty * torch.from_numpy(dy)).sum()
    if with_ds:
        loss = loss + (ts * torch.from_numpy(ds)).sum()
    loss.backward()
    assert_close(y, ty.detach().numpy(), dtype, "y")
    np.testing.assert_array_equal(s, ts.detach().numpy())
    gds = ds if with_ds else None
    if norm == "layer":
        dx, dw, db = numbanorm.add_layer_norm_backward(dy, gds, s, mean, rstd, ns, w)
        assert_close(db, tb.grad.numpy(), dtype, "dbias")
    else:
        dx, dw = numbanorm.add_rms_norm_backward(dy, gds, s, rstd, ns, w)
    assert_close(dx, tx.grad.numpy(), dtype, "dx")
    assert_close(dx, tr.grad.numpy(), dtype, "dresidual")
    assert_close(dw, tw.grad.numpy(), dtype, "dweight")
