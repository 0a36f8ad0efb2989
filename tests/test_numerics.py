"""The contract's numerics at their edges, on the CPU: long rows with a large offset
and huge finite values, every function, forward and backward, against the oracle."""

import numpy as np
import pytest

import numbanorm as nn
from _marks import EXHAUSTIVE
from conftest import ORACLE, assert_close, channels_last, to_host

LONG = 1 << 22


def _offset_rows(rng, rows, n, mean=1e4, std=1e-2):
    return (mean + std * rng.standard_normal((rows, n))).astype(np.float32)


def _rel(got, want):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


# ---------------------------------------------------------------- long rows

@pytest.fixture(scope="module")
def long_row():
    return _offset_rows(np.random.default_rng(5), 1, LONG)


@pytest.fixture(scope="module")
def long_dy():
    return np.random.default_rng(6).standard_normal((1, LONG)).astype(np.float32)


def _float32_close(pairs):
    """Each ``(kernel's, oracle's, name)`` within float32's tolerance of the oracle: the kernels'
    errors on these rows are under 3e-7 of max(1, |oracle|); the 1e-3 these tests allowed
    passed with the last element of every 4096-element sum block dropped."""
    for got, want, what in pairs:
        assert_close(got, want, np.float32, what)


def test_layer_norm_long_row(long_row, long_dy):
    x, dy = long_row, long_dy
    y, mean, rstd = nn.layer_norm_forward(x, LONG)
    yr, mr, rr = ORACLE.layer_norm_forward(x, LONG)
    _float32_close([(y, yr, "y"), (mean, mr, "mean"), (rstd, rr, "rstd")])
    # the contract's words: unit variance within 1e-3 (eps=0, else eps shrinks it)
    y0 = nn.layer_norm(x, LONG, eps=0.0)
    assert np.isfinite(y0).all() and abs(float(np.std(y0.astype(np.float64))) - 1) < 1e-3
    dx, dw, db = nn.layer_norm_backward(dy, x, mean, rstd, LONG)
    dxr, dwr, dbr = ORACLE.layer_norm_backward(dy, x, mean, rstd, LONG)
    _float32_close([(dx, dxr, "dx"), (dw, dwr, "dweight"), (db, dbr, "dbias")])


def test_add_layer_norm_long_row(long_row, long_dy):
    res = np.full_like(long_row, 0.5)
    y, s, mean, rstd = nn.add_layer_norm_forward(long_row, res, LONG)
    yr, mr, rr = ORACLE.layer_norm_forward(s, LONG)
    dx = nn.add_layer_norm_backward(long_dy, long_dy, s, mean, rstd, LONG)[0]
    dxr = ORACLE.add_layer_norm_backward(long_dy, long_dy, s, mean, rstd, LONG)[0]
    _float32_close([(y, yr, "y"), (rstd, rr, "rstd"), (dx, dxr, "dx")])


def test_rms_norm_long_row(long_row, long_dy):
    # RMSNorm has no mean to subtract: its sum of squares is the long reduction
    x, dy = long_row, long_dy
    y, rstd = nn.rms_norm_forward(x, LONG)
    yr, rr = ORACLE.rms_norm_forward(x, LONG)
    assert _rel(rstd, rr) < 1e-5 and _rel(y, yr) < 1e-5
    dx, dw = nn.rms_norm_backward(dy, x, rstd, LONG)
    dxr, dwr = ORACLE.rms_norm_backward(dy, x, rstd, LONG)
    assert _rel(dx, dxr) < 1e-3 and _rel(dw, dwr) < 1e-4
    y, s, rstd = nn.add_rms_norm_forward(x, np.zeros_like(x), LONG)
    assert _rel(rstd, rr) < 1e-5


def test_group_norm_long_group(long_row, long_dy):
    x = long_row.reshape(1, 4, LONG // 4)
    dy = long_dy.reshape(1, 4, LONG // 4)
    w = np.array([0.5, 1.0, 1.5, 2.0], np.float32)
    y, mean, rstd = nn.group_norm_forward(x, 1, w)
    yr, mr, rr = ORACLE.group_norm_forward(x, 1, w)
    dx, dw, db = nn.group_norm_backward(dy, x, mean, rstd, w)
    dxr, dwr, dbr = ORACLE.group_norm_backward(dy, x, mean, rstd, w)
    _float32_close([(y, yr, "y"), (mean, mr, "mean"), (rstd, rr, "rstd"), (dx, dxr, "dx"), (dw, dwr, "dweight"),
                    (db, dbr, "dbias")])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_group_norm_group_whose_first_channel_is_an_outlier(dtype):
    """A group's one-pass statistics shift by the mean of its first elements, all in
    channel 0; where that channel sits far from the group's mean the shift cannot be
    trusted and the group takes the corrected two-pass.  Both groups here do."""
    import importlib
    stats = importlib.import_module("numbanorm.cpu._kernels.stats")
    sums = importlib.import_module("numbanorm.cpu._kernels.sums")
    rng = np.random.default_rng(11)
    x = (1e-2 * rng.standard_normal((2, 8, 300))).astype(dtype)
    x[:, 0] += dtype(50.0)  # channel 0 of group 0
    x[:, 4] -= dtype(3e3)   # channel 4, the first of group 1
    groups = x.reshape(4, -1)
    for i in range(4):
        s1, s2 = sums.deviation_sums(groups, i, stats.shift(groups, i, dtype(0)), dtype(0))
        assert not stats.one_pass_ok(s1 / groups.shape[1], s2 / groups.shape[1]), i
    w = np.linspace(0.5, 2.0, 8).astype(dtype)
    b = np.linspace(-1.0, 1.0, 8).astype(dtype)
    y, mean, rstd = nn.group_norm_forward(x, 2, w, b)
    yr, mr, rr = ORACLE.group_norm_forward(x, 2, w, b)
    tol = 1e-5 if dtype == np.float32 else 1e-13
    assert _rel(mean, mr) < tol and _rel(rstd, rr) < tol
    assert np.max(np.abs(y - yr)) < 10 * tol * np.max(np.abs(yr))


@pytest.mark.parametrize("head", [1e2, 1e4, "zeros"])
def test_rows_whose_first_elements_are_far_from_their_mean(head):
    """The one-pass statistics shift by the mean of a row's first elements; where those sit
    far from the row's mean the one-pass sums lose digits and the row takes the corrected
    two-pass (stats.one_pass_ok).  With that check loosened fourfold, y was 3e-4 to 9e-4 off
    and rstd 1.5e-5 to 4e-5 (relative) on these rows, against 2e-6 and 1.5e-7; only a slow
    GroupNorm test saw it."""
    n = 8192
    rng = np.random.default_rng(4)
    if head == "zeros":  # mean 1e4, the first 16 elements 0
        x = (1e4 + rng.standard_normal((4, n))).astype(np.float32)
        x[:, :16] = 0
    else:
        x = rng.standard_normal((4, n)).astype(np.float32)
        x[:, :16] += np.float32(head)
    y, mean, rstd = nn.layer_norm_forward(x, n)
    yr, mr, rr = ORACLE.layer_norm_forward(x, n)
    np.testing.assert_allclose(y, yr, rtol=0, atol=2e-5)
    np.testing.assert_allclose(rstd, rr, rtol=2e-6)
    fused_y = nn.add_layer_norm(x, np.zeros_like(x), n)[0]
    np.testing.assert_allclose(fused_y, yr, rtol=0, atol=2e-5)


@pytest.mark.parametrize("n", [1, 7, 4095, 4096, 4097, 3 * 4096 + 5])
def test_block_edges(n):
    """Rows just around the accumulation block, offset: every block boundary case."""
    x = _offset_rows(np.random.default_rng(n), 3, n)
    y, mean, rstd = nn.layer_norm_forward(x, n)
    yr, mr, rr = ORACLE.layer_norm_forward(x, n)
    _float32_close([(y, yr, "y"), (rstd, rr, "rstd")])
    np.testing.assert_allclose(mean, mr, rtol=1e-7)


# ---------------------------------------------------------------- huge finite values

def test_oracle_does_not_overflow():
    y = ORACLE.layer_norm(np.array([[1.5e308, -1.5e308, 1.0, 2.0]]), 4)
    np.testing.assert_allclose(y[0, :2], [np.sqrt(2), -np.sqrt(2)], rtol=1e-12)
    assert np.isfinite(ORACLE.rms_norm(np.array([[1.5e308, 1e308]]), 2)).all()


def test_the_oracle_is_exact_on_a_row_whose_mean_dwarfs_its_std():
    """The float64 oracle against exact rational arithmetic on a row of mean 1e8 and std 1e-6
    (and its GroupNorm form): a mean rounded to float64 is off by half an ulp, 1 % of that
    std, which the oracle's y and dx once carried; the kernels' corrected two-pass did not."""
    import math
    from fractions import Fraction

    rng = np.random.default_rng(3)
    x = 1e8 + rng.standard_normal((1, 64)) * 1e-6
    dy = rng.standard_normal((1, 64))
    fx, fdy = [Fraction(float(v)) for v in x[0]], [Fraction(float(v)) for v in dy[0]]
    mu = sum(fx) / 64
    r = 1 / math.sqrt(sum((v - mu) ** 2 for v in fx) / 64)
    xhat = [float(v - mu) * r for v in fx]
    c1 = sum(Fraction(h) * g for h, g in zip(xhat, fdy)) / 64
    c2 = sum(fdy) / 64
    dx = [float(r * (g - c2 - Fraction(h) * c1)) for h, g in zip(xhat, fdy)]
    for y, (g_dx, *_) in (
            (ORACLE.layer_norm_forward(x, 64, eps=0.0),
             ORACLE.layer_norm_backward(dy, x, *ORACLE.layer_norm_forward(x, 64, eps=0.0)[1:], 64)),
            (ORACLE.group_norm_forward(x[:, None], 1, eps=0.0),
             ORACLE.group_norm_backward(dy[:, None], x[:, None], *ORACLE.group_norm_forward(x[:, None], 1, eps=0.0)[1:]))):
        np.testing.assert_allclose(np.ravel(y[0]), xhat, rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.ravel(g_dx), dx, rtol=1e-9, atol=1e-12 * max(map(abs, dx)))


def test_a_row_at_the_float32_limit():
    y = nn.layer_norm(np.array([[3e38, -3e38, 1, 2]], np.float32), 4)
    np.testing.assert_allclose(y, [[np.sqrt(2), -np.sqrt(2), 0, 0]], atol=1e-6)


def _huge_rows(dt):
    """Rows of float32 magnitude 1e19-3e38 (float64: 1e160-1e308), with a normal row,
    a constant row at the top of the range, and a row whose sums underflow (eps=0)."""
    rng = np.random.default_rng(3)
    top = float(np.finfo(dt).max) / 2
    rows = [rng.standard_normal(33) * 1e20 if dt == np.float32 else rng.standard_normal(33) * 1e160,
            rng.uniform(-top, top, 33),
            rng.standard_normal(33),
            np.full(33, top),
            rng.standard_normal(33) * 1e20 + (1e21 if dt == np.float32 else 0)]
    return np.array(rows).astype(dt)


@pytest.mark.slow  # (the rescaling variant of every forward: LayerNorm's in the default set, test_a_row_at_the_float32_limit)
@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_huge_finite_rows_forward(dt):
    x = _huge_rows(dt)
    w = np.linspace(0.5, 1.5, 33).astype(dt)
    b = np.linspace(-1, 1, 33).astype(dt)
    tol = 1e-5 if dt == np.float32 else 1e-12
    for got, want in [
        (nn.layer_norm_forward(x, 33, w, b), ORACLE.layer_norm_forward(x, 33, w, b)),
        (nn.rms_norm_forward(x, 33, w), ORACLE.rms_norm_forward(x, 33, w, eps=float(np.finfo(dt).eps))),
        (nn.group_norm_forward(x.reshape(5, 3, 11), 1, w[:3], b[:3]),
         ORACLE.group_norm_forward(x.reshape(5, 3, 11), 1, w[:3], b[:3])),
        ([a for k, a in enumerate(nn.add_layer_norm_forward(x, np.zeros_like(x), 33, w, b)) if k != 1],
         ORACLE.layer_norm_forward(x, 33, w, b)),
        (nn.add_rms_norm_forward(x, np.zeros_like(x), 33, w)[::2],
         ORACLE.rms_norm_forward(x, 33, w, eps=float(np.finfo(dt).eps))),
    ]:
        for g, r in zip(got, want):
            assert np.isfinite(g).all()
            np.testing.assert_allclose(g, r, rtol=tol, atol=tol * max(1.0, np.abs(r[np.abs(r) < 1e3]).max()))
    # the normal row (2) is the bits of its own call: the huge rows' rescaling leaves it alone
    # (this compared y's row 2 with itself)
    zeros = np.zeros_like
    for y_of in (lambda x: nn.layer_norm_forward(x, 33, w, b)[0], lambda x: nn.rms_norm_forward(x, 33, w)[0],
                 lambda x: nn.group_norm_forward(x.reshape(-1, 3, 11), 1, w[:3], b[:3])[0].reshape(len(x), 33),
                 lambda x: nn.add_layer_norm_forward(x, zeros(x), 33, w, b)[0],
                 lambda x: nn.add_rms_norm_forward(x, zeros(x), 33, w)[0]):
        np.testing.assert_array_equal(y_of(x)[2], y_of(x[2:3])[0])


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_huge_groups_in_channels_last_order(dt):
    """A group whose sums overflow on finite values, in channels-last order: the call goes to
    the groups' kernels, which rescale it (the bits of its C-contiguous copy's call); so does
    a backward whose dy's sums overflow.  (float64 groups beyond float32's range were once
    taken for groups holding inf, and gave zeros or NaN.)  The first backward's sums stay in
    range (each x - mean taken to rstd's units first): its channels-last kernels' dx, the
    oracle's to rounding."""
    x = _huge_rows(dt).reshape(5, 3, 11)[:, :, :10].reshape(5, 3, 2, 5)
    x = channels_last(x)
    dy = np.random.default_rng(5).standard_normal(x.shape).astype(dt)
    w = np.linspace(0.5, 1.5, 3).astype(dt)
    got = nn.group_norm_forward(x, 1, w, w)
    want = nn.group_norm_forward(np.ascontiguousarray(x), 1, w, w)
    for g, r in zip(got, want):
        assert np.isfinite(g).all()
        np.testing.assert_array_equal(g, r)
    dx = nn.group_norm_backward(dy, x, *got[1:], w)[0]
    assert np.isfinite(dx).all()
    assert_close(dx, ORACLE.group_norm_backward(dy, x, *got[1:], w)[0], dt, "dx")
    # each sample's dy of one sign: its group's sums overflow, the gradients do not
    rng = np.random.default_rng(6)
    x = channels_last(rng.standard_normal(x.shape).astype(dt))
    sign = np.where(np.arange(x.shape[0]) % 2, -1.0, 1.0)[:, None, None, None]
    dy = channels_last((sign * rng.uniform(0.5, 1, x.shape) * (np.finfo(dt).max / 16)).astype(dt))
    stats = nn.group_norm_forward(x, 1, w)[1:]
    got = nn.group_norm_backward(dy, x, *stats, w)
    want = nn.group_norm_backward(np.ascontiguousarray(dy), np.ascontiguousarray(x), *stats, w)
    for g, r in zip(got, want):
        assert np.isfinite(r).all()
        np.testing.assert_array_equal(g, r)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("side", ["under", "over"])
def test_group_norm_weights_whose_product_with_rstd_leaves_the_range(impl, side, layout, bias):
    """float32 groups whose y is normal where rstd * w, GroupNorm's factor per channel, is
    not: standard deviation 1e15 and weights near 2**-120 (y about 1e-36, the factor 1e-51:
    y was 0), or 1e-15 with eps 0 and weights near 2**100 (y about 1e30, the factor 1e45: y
    was inf); a bias of y's size, which the factors-in-turn form adds too.
    ``test_cuda_range.py`` has each GPU path."""
    rng = np.random.default_rng(23)
    std, at, eps = (1e15, -120, 1e-5) if side == "under" else (1e-15, 100, 0.0)
    x = (rng.standard_normal((2, 4, 4, 4)) * std).astype(np.float32)
    w = np.ldexp(rng.uniform(0.5, 1.5, 4), at).astype(np.float32)
    b = (w * rng.standard_normal(4)).astype(np.float32) if bias else None
    if layout == "channels_last":
        x = channels_last(x)
    y = to_host(impl.group_norm(x, 2, w, b, eps))
    want = ORACLE.group_norm_forward(x.astype(np.float64), 2, w.astype(np.float64),
                                     None if b is None else b.astype(np.float64), eps)[0]
    per = w.astype(np.float64)[None, :, None, None]
    assert _rel(y / per, want / per) < 1e-5


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_a_nan_in_dy_spoils_its_own_dweight_column_not_the_others(impl, dtype):
    """A row of finite values near the float32 range's end (a sum of x - mean past it) whose
    dy holds one NaN: every column's dweight was NaN (the row's xhat from a corr past the
    range, the rescue skipped for the NaN), where the NaN's own column alone is.  GroupNorm
    likewise: the other channel's sum of dy * (x - mean) past the range left its dweight
    inf, where it is 64.  Its dx row is NaN, its dbias column NaN, the other rows untouched."""
    from numbanorm.measure import host_dtype

    dt = host_dtype(dtype)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 256))
    x[0] = np.clip(x[0], -6, 6) * 5e37
    x, dy = x.astype(dt), rng.standard_normal((2, 256)).astype(dt)
    _, mean, rstd = nn.layer_norm_forward(x, 256)
    dy[0, 0] = np.nan
    dx, dw, db = (to_host(a).astype(np.float64) for a in impl.layer_norm_backward(dy, x, mean, rstd, 256))
    want = ORACLE.layer_norm_backward(dy, x, mean, rstd, 256)
    assert np.isnan(dw[0]) and np.isnan(db[0]) and np.isnan(dx[0]).all()
    assert_close(dw[1:], want[1][1:], dt, "dweight")
    assert_close(dx[1], want[0][1], dt, "dx")
    alt = np.tile([1.0, -1.0], 32)
    xg = (np.stack([alt, alt])[None] * 1e37).astype(dt)  # one group of two channels
    dyg = np.stack([alt, alt])[None].astype(dt)
    dyg[0, 0, 0] = np.nan
    _, m, r = nn.group_norm_forward(xg, 1)
    for layout in (lambda a: a, channels_last):
        dw = to_host(impl.group_norm_backward(layout(dyg), layout(xg), m, r)[1]).astype(np.float64)
        assert np.isnan(dw[0]) and abs(dw[1] - 64) < 64 * 4e-3, dw


@pytest.mark.parametrize("dtype, scale", [(np.float32, 1e-25), ("bfloat16", 1e-25), (np.float64, 1e-170)])
def test_the_backward_of_a_tiny_row_with_eps_0_is_the_scaled_up_rows(impl, dtype, scale):
    """eps 0 makes LayerNorm and GroupNorm scale-free: dx of (x, dy) * 1e-25 is dx of (x, dy).
    The CPU's sum of (x - mean) * dy underflowed there (1e-50 in float32), as the GPU's
    GroupNorm's did, and dx came back finite and 6-50 % off; each (x - mean) is now taken to
    rstd's units first."""
    from numbanorm.measure import host_dtype

    dt = host_dtype(dtype)
    x, dy = np.array([[1.0, 2, 3, 4]]), np.array([[1.0, -2, 3, -4]])
    tiny_x, tiny_dy = (x * scale).astype(dt), (dy * scale).astype(dt)

    def dx(x, dy):
        return to_host(impl.layer_norm_backward(dy, x, *impl.layer_norm_forward(x, 4, eps=0.0)[1:], 4)[0])

    want = dx(x.astype(dt), dy.astype(dt)).astype(np.float64)
    assert_close(dx(tiny_x, tiny_dy), want, dt, "dx")
    for layout in (lambda a: a, channels_last):
        g = layout(tiny_x.reshape(1, 2, 2))
        stats = impl.group_norm_forward(g, 1, eps=0.0)[1:]
        got = to_host(impl.group_norm_backward(layout(tiny_dy.reshape(1, 2, 2)), g, *stats)[0])
        assert_close(got.reshape(1, 4), want, dt, "group dx")


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
@pytest.mark.parametrize("scale, eps, along", [(1e-30, 0.0, 1e9), (1e-2, 1e-5, 5e36)])
def test_a_group_whose_dy_runs_along_xhat_with_a_large_rstd_has_a_finite_dx(impl, dtype, scale, eps, along):
    """rstd * c1 leaves the range where dy runs along xhat (c1 about |weight * dy|) and rstd is
    large, while xhat * c1 and dx stay in it: the GPU's GroupNorm backward formed rstd * c1
    once a group and wrote dx as +-inf where the oracle's is about 1e37."""
    from numbanorm.measure import host_dtype

    dt = host_dtype(dtype)
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((1, 2, 4)) * scale).astype(dt)  # one group of 8
    _, mean, rstd = impl.group_norm_forward(x, 1, None, None, eps)
    y = ORACLE.group_norm_forward(x, 1, None, None, eps)[0]
    # (a tenth across: dx a tenth of dy's terms, which it is the difference of)
    dy = (y.astype(np.float64) * along + rng.standard_normal(x.shape) * along * 0.1).astype(dt)
    got = to_host(impl.group_norm_backward(dy, x, mean, rstd)[0])
    want = ORACLE.group_norm_backward(dy, x, to_host(mean), to_host(rstd))[0]
    assert np.isfinite(want.astype(np.float64)).all() and np.isfinite(got.astype(np.float64)).all()
    assert_close(got, want.astype(np.float64), dt, "dx")


@pytest.mark.parametrize("dtype, tiny, large", [(np.float32, 1e-30, 1e25), (np.float64, 1e-300, 1e290)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_a_tiny_weight_in_a_group_with_a_small_rstd_keeps_its_channels_dx(impl, impl_name, dtype, tiny, large, layout):
    """weight * rstd underflows (a tiny weight, x about 1e20), weight * dy does not (dy
    large in that channel): the GroupNorm backwards formed weight * rstd once a channel
    and gave that channel's dx a wrong sign and size (7.7e-27 where the oracle has -6.3e-26)."""
    if layout == "channels_last" and impl_name != "cpu":
        pytest.skip("channels-last order is the CPU kernels' own path")
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((1, 2, 8)) * 1e20).astype(dtype)
    w = np.array([tiny, 1], dtype)
    dy = rng.standard_normal(x.shape)
    dy[0, 0] *= large  # weight * dy about 1e-5 in channel 0, and 1e-8 in channel 1
    dy[0, 1] *= 1e-8
    dy = dy.astype(dtype)
    if layout == "channels_last":
        x, dy = channels_last(x), channels_last(dy)
    _, mean, rstd = impl.group_norm_forward(x, 1, w, None, 0.0)
    got = to_host(impl.group_norm_backward(dy, x, mean, rstd, w)[0]).astype(np.float64)
    want = ORACLE.group_norm_backward(dy, x, to_host(mean), to_host(rstd), w)[0].astype(np.float64)
    for c in range(2):  # each channel at its own scale: channel 0's dx is about 1e-26
        assert_close(got[0, c] / np.abs(want[0, c]).max(), want[0, c] / np.abs(want[0, c]).max(), dtype, f"dx[:, {c}]")


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_a_group_with_a_subnormal_rstd_keeps_its_dx_finite(impl, impl_name, layout):
    """rstd subnormal (x near +-1.7e38, float32) with a weight above 1: weight * f is
    subnormal, and taking dy * weight first (as for a tiny weight) overflowed where dy
    (3e38) times the weight passes the largest float; dx is about 3.5 there."""
    if layout == "channels_last" and impl_name != "cpu":
        pytest.skip("channels-last order is the CPU kernels' own path")
    x = np.tile(np.array([1.7e38, -1.7e38, 1.7e38, -1.7e38, 0, 0, 0, 0], np.float32), (1, 2, 1))
    w = np.array([1.4, 1.0], np.float32)
    dy = np.random.default_rng(4).standard_normal(x.shape).astype(np.float32)
    dy[0, 0, 6], dy[0, 0, 7] = 3e38, -3e38
    if layout == "channels_last":
        x, dy = channels_last(x), channels_last(dy)
    _, mean, rstd = impl.group_norm_forward(x, 1, w, None, 1e-5)
    assert 0 < float(to_host(rstd)[0, 0]) < np.finfo(np.float32).tiny
    got = to_host(impl.group_norm_backward(dy, x, mean, rstd, w)[0]).astype(np.float64)
    want = ORACLE.group_norm_backward(dy, x, to_host(mean), to_host(rstd), w)[0].astype(np.float64)
    assert np.isfinite(got).all()
    assert_close(got, want, np.float32, "dx")


@pytest.mark.parametrize("base", [1e300, 1e-300])
def test_a_nearly_constant_float64_row_past_the_range_keeps_its_spread(base):
    """70000 copies of 1e300 (or 1e-300, eps 0), one an ulp above: float64 rows that the
    rescaling path normalizes.  Its variance was mean(d * d) - corr**2 about a first mean
    whose rounding passed the row's spread, and the odd element's y, sqrt(69999), came back
    5e-4 off (tolerance 1e-11); LayerNorm and GroupNorm alike."""
    x = np.full((1, 70000), base)
    x[0, 0] = np.nextafter(base, np.inf)
    want = np.sqrt(69999.0)
    assert abs(nn.layer_norm(x, 70000, eps=0.0)[0, 0] - want) < want * 1e-11
    assert abs(nn.group_norm(x.reshape(1, 2, 35000), 1, eps=0.0)[0, 0, 0] - want) < want * 1e-11


def test_the_oracle_normalizes_tiny_float64_rows():
    """The oracle's variance at the rows' own scale underflowed for float64 rows under
    about 1e-160 with eps 0: y was inf and NaN where the kernels' (right) y is finite."""
    x = np.array([[5e-324, 0, 0, 0]])
    third = 1 / np.sqrt(3)
    np.testing.assert_allclose(ORACLE.layer_norm(x, 4, eps=0.0), [[3 * third, -third, -third, -third]], rtol=1e-15)
    x = np.array([[1.0, 2, 3, 4]])
    for tiny in (x * 1e-170, x * 1e-300):
        np.testing.assert_allclose(ORACLE.layer_norm(tiny, 4, eps=0.0), ORACLE.layer_norm(x, 4, eps=0.0), rtol=1e-14)
        np.testing.assert_allclose(ORACLE.rms_norm(tiny, 4, eps=0.0), ORACLE.rms_norm(x, 4, eps=0.0), rtol=1e-14)
        np.testing.assert_allclose(ORACLE.group_norm(tiny.reshape(1, 2, 2), 1, eps=0.0),
                                   ORACLE.group_norm(x.reshape(1, 2, 2), 1, eps=0.0), rtol=1e-14)
    # where eps counts, it counts at its own scale: a tiny row's y is the row over sqrt(eps)
    np.testing.assert_allclose(ORACLE.layer_norm(x * 1e-170, 4, eps=1e-5), (x - 2.5) * 1e-170 / np.sqrt(1e-5),
                               rtol=1e-14)


@pytest.mark.parametrize("side", ["under", "over"])
def test_a_channel_whose_factor_leaves_the_range_leaves_the_others_bits_alone(side):
    """Channels-last, the CPU: a block of positions holding a channel whose rstd * weight
    leaves the range writes that channel with the two factors in turn and every other one
    as before, to the bit (the whole block was written in turn: last bits moved)."""
    rng = np.random.default_rng(31)
    x = rng.standard_normal((2, 8, 6, 5)).astype(np.float32)
    x[:, :2] *= np.float32(1e15 if side == "under" else 1e-15)  # group 0: channels 0 and 1
    w = rng.uniform(0.5, 1.5, 8).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    x = channels_last(x)
    plain = nn.group_norm(x, 4, w, b, 0.0)
    w[0] = np.ldexp(np.float32(1), -120 if side == "under" else 100)
    y = nn.group_norm(x, 4, w, b, 0.0)
    np.testing.assert_array_equal(y[:, 1:], plain[:, 1:])
    want = ORACLE.group_norm_forward(x.astype(np.float64), 4, w.astype(np.float64), b.astype(np.float64), 0.0)[0]
    assert np.isfinite(y).all() and _rel(y[:, 0] / w[0], want[:, 0] / w[0]) < 1e-5


@pytest.mark.parametrize("dt", [np.float32, pytest.param(np.float64, marks=EXHAUSTIVE)])
def test_huge_rows_leave_others_alone(dt):
    x = _huge_rows(dt)
    alone = nn.layer_norm(x[2:3], 33)
    np.testing.assert_array_equal(nn.layer_norm(x, 33)[2:3], alone)
    np.testing.assert_array_equal(nn.rms_norm(x, 33)[2:3], nn.rms_norm(x[2:3], 33))


def test_constant_top_row_and_tiny_row_with_eps_zero():
    top = np.full((1, 16), 3e38, np.float32)
    y, mean, rstd = nn.layer_norm_forward(top, 16)
    np.testing.assert_array_equal(y, 0)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(1e-5), rtol=1e-6)
    np.testing.assert_allclose(mean, 3e38, rtol=1e-7)
    tiny = (np.random.default_rng(2).standard_normal((1, 64)) * 1e-30).astype(np.float32)
    for got, want in [(nn.layer_norm(tiny, 64, eps=0.0), ORACLE.layer_norm(tiny, 64, eps=0.0)),
                      (nn.rms_norm(tiny, 64, eps=0.0), ORACLE.rms_norm(tiny, 64, eps=0.0))]:
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["layer_norm", "group_norm"])
def test_a_row_of_one_value_with_eps_zero_gives_nan_dweight_as_torch(impl, op):
    """A row (a group) of one value with eps 0: rstd inf, y NaN, and its terms of dweight
    NaN (0 * inf), the other row's (the other channel's) finite, as torch's; the oracle
    took that xhat as 0 and gave dweight 0 there."""
    x = np.array([[2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 2.0, 4.0]], np.float32)
    w = np.array([1.5, 2.0, 0.5, 1.0], np.float32)
    dy = np.ones_like(x)
    for side in (impl, ORACLE):
        if op == "layer_norm":
            _, mean, rstd = side.layer_norm_forward(x, 4, w, None, 0.0)
            dw = to_host(side.layer_norm_backward(dy, x, to_host(mean), to_host(rstd), 4, w)[1])
            assert np.isnan(dw).all()  # (every column has a term of the constant row)
        else:
            xg, wg = x.reshape(1, 2, 4), w[:2]
            _, mean, rstd = side.group_norm_forward(xg, 2, wg, None, 0.0)
            dw = to_host(side.group_norm_backward(np.ones_like(xg), xg, to_host(mean), to_host(rstd), wg)[1])
            assert np.isnan(dw[0]) and abs(dw[1]) < 1e-6  # (sum(xhat) over the spread channel: 0)


def test_torch_gives_a_row_of_one_value_with_eps_zero_nan_dweight_too():
    """The rule above is torch's: its LayerNorm and GroupNorm backwards give the same NaN
    terms of dweight there (numbanorm.torch's calls, which run numbanorm's kernels, aside)."""
    torch = pytest.importorskip("torch")
    x = torch.tensor([[2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 2.0, 4.0]], requires_grad=True)
    w = torch.tensor([1.5, 2.0, 0.5, 1.0], requires_grad=True)
    torch.nn.functional.layer_norm(x, (4,), w, None, 0.0).sum().backward()
    assert torch.isnan(w.grad).all()
    wg = torch.tensor([1.5, 2.0], requires_grad=True)
    torch.nn.functional.group_norm(x.detach().reshape(1, 2, 4), 2, wg, None, 0.0).sum().backward()
    assert torch.isnan(wg.grad[0]) and abs(float(wg.grad[1])) < 1e-6


_TINY_CALLS = {
    "layer_norm": lambda x: nn.layer_norm_forward(x, 8, eps=0.0),
    "rms_norm": lambda x: nn.rms_norm_forward(x, 8, eps=0.0),
    "group_norm": lambda x: [a.reshape(len(x), -1) for a in nn.group_norm_forward(x.reshape(-1, 2, 4), 1, eps=0.0)],
    "add_layer_norm": lambda x: [a for k, a in enumerate(nn.add_layer_norm_forward(x, 0 * x, 8, eps=0.0)) if k != 1],
    "add_rms_norm": lambda x: nn.add_rms_norm_forward(x, 0 * x, 8, eps=0.0)[::2],
}


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("name", [n if n == "layer_norm" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in _TINY_CALLS])
def test_tiny_rows_with_eps_zero_are_the_unit_rows_scaled(name, dt):
    """With eps = 0 a normalization does not see a row's scale: a finite row of magnitude
    1e-19 to 1e-36 (float32) or 1e-150 to 1e-300 (float64), whose sum of squares is
    subnormal or 0, gives the unit row's y, and its rstd times its scale is the unit
    row's.  (float64 1e-162 was Inf, float32 1e-22 0.6% off: the variance's lost bits
    went unnoticed, or the rescued row's variance underflowed again on its way back to
    the row's scale.)"""
    unit = np.array([[1, 2, 3, 4, -2.5, 0.5, 7, 1.25], [0.5, -1, 2, 3, 4, 5, 6, 8]], dt)
    y1, *_, r1 = _TINY_CALLS[name](unit)
    ulp = float(np.finfo(dt).eps)
    for s in ((2.0 ** -63, 1e-22, 1e-30, 1e-36) if dt == np.float32 else (1e-150, 1e-162, 1e-170, 1e-300)):
        x = (unit * s).astype(dt)
        y, *_, r = _TINY_CALLS[name](x)
        np.testing.assert_allclose(y, y1, rtol=0, atol=4 * ulp * np.abs(y1).max(), err_msg=f"{name} {s}")
        np.testing.assert_allclose(r * dt(s), r1, rtol=4 * ulp, err_msg=f"{name} {s}")


@pytest.mark.slow
@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_huge_finite_rows_backward(dt):
    x = _huge_rows(dt)
    rng = np.random.default_rng(4)
    dy = rng.standard_normal(x.shape).astype(dt)
    w = np.linspace(0.5, 1.5, 33).astype(dt)
    tol = 1e-5 if dt == np.float32 else 1e-12

    def close(got, want):
        for g, r in zip(got, want):
            assert np.isfinite(g).all()
            np.testing.assert_allclose(g, r, rtol=tol, atol=tol * max(1.0, np.abs(r).max()))

    _, mean, rstd = nn.layer_norm_forward(x, 33, w)
    close(nn.layer_norm_backward(dy, x, mean, rstd, 33, w), ORACLE.layer_norm_backward(dy, x, mean, rstd, 33, w))
    close(nn.add_layer_norm_backward(dy, dy, x, mean, rstd, 33, w),
          ORACLE.add_layer_norm_backward(dy, dy, x, mean, rstd, 33, w))
    _, rstd = nn.rms_norm_forward(x, 33, w)
    close(nn.rms_norm_backward(dy, x, rstd, 33, w), ORACLE.rms_norm_backward(dy, x, rstd, 33, w))
    xg, dyg = x.reshape(5, 3, 11), dy.reshape(5, 3, 11)
    _, mean, rstd = nn.group_norm_forward(xg, 1, w[:3])
    close(nn.group_norm_backward(dyg, xg, mean, rstd, w[:3]), ORACLE.group_norm_backward(dyg, xg, mean, rstd, w[:3]))


def test_a_row_at_the_float32_limit_backward():
    x = np.array([[3e38, -3e38, 1, 2]], np.float32)
    dy = np.array([[3, -3, 1, 1]], np.float32)
    w = np.array([2, 2, 1, 1], np.float32)
    _, mean, rstd = nn.layer_norm_forward(x, 4, w)
    for got, want in [(nn.layer_norm_backward(dy, x, mean, rstd, 4, w),
                       ORACLE.layer_norm_backward(dy, x, mean, rstd, 4, w)),
                      (nn.group_norm_backward(dy.reshape(1, 2, 2), x.reshape(1, 2, 2), mean.reshape(1, 1),
                                              rstd.reshape(1, 1), w[1:3]),
                       ORACLE.group_norm_backward(dy.reshape(1, 2, 2), x.reshape(1, 2, 2), mean.reshape(1, 1),
                                                  rstd.reshape(1, 1), w[1:3]))]:
        for g, r in zip(got, want):
            assert np.isfinite(g).all(), g
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())


# Rows (x, dy / 2**k) whose dy, times 2**k, is near the dtype's largest value: the first
# two sums of xhat * wdy past the range; the next one's c1, in x's units, in range but not
# its sum in rstd's (LayerNorm, rstd > 1); the next two a difference wdy - (xhat * c1 + c2)
# past the range where dx, times rstd < 1, is in it (RMSNorm's first element; LayerNorm's
# and GroupNorm's second, whose neighbours keep sum((x - mean) * wdy) in range); the last
# a dy in the span of 1 and xhat (dx about 0), whose wdy * rstd (> 1) alone is past it.
_NEAR_TOP = [
    ([0, 1, 2, 3], [1.75, 1.75, 1.75, 1.75]),
    ([1, -2, 0.5, 4], [1.75, -0.4375, 0.875, 1.75]),
    ([0.0899, -0.2081, 0.1666, 0.0133], [0.45, -1.98, 1.6, 0.1]),
    ([10, 10, 10, -10], [1.95, -0.975, -0.975, 0.975]),
    ([-0.5, 0, 0.5, -6, 6, 0], [-1.9, 1.98, -1.9, 0, 0, 0]),
    ([-0.1, 0, 0.1, 0], [-0.4, 0.2, 0.8, 0.2]),
]


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("row, grad", _NEAR_TOP)
def test_a_gradient_near_the_largest_float(dt, sign, row, grad):
    """dy near the dtype's largest value on ordinary rows: where a sum leaves the range
    the row is summed again, scaled; elsewhere dx is formed so that no intermediate leaves
    it where dx does not (rescale, stats.row_factors).  (RMSNorm's backward gave NaN and
    Inf on the first row; every backward Inf on the last two.)  The gradients are linear
    in (dy, ds), so the expected values are the oracle's at dy * 2**-k, times 2**k; dweight
    and dbias may overflow the dtype itself."""
    k = np.finfo(dt).maxexp - 1
    N = len(row)
    ordinary = np.random.default_rng(7).standard_normal((4, N))
    # ordinary rows around it (one near-top row a call: dweight adds the rows' terms)
    x = np.array([ordinary[0], row, ordinary[1]], dt)
    unit = sign * np.array([np.ldexp(ordinary[2], -k), grad, np.ldexp(ordinary[3], -k)])
    dy, ds = np.ldexp(unit, k).astype(dt), np.ldexp(unit / 4, k).astype(dt)
    w = np.resize(np.array([1, 0.5, 0.75, 1], dt), N)
    tol = 1e-5 if dt == np.float32 else 1e-12

    def close(got, want, rstd, name):  # compared in units of 2**k, in float64
        scale = np.abs(unit[1]).max() * max(float(np.ravel(rstd)[1]), 1.0)  # the near-top row's dx terms'
        for g, r in zip(got, want):
            r = np.asarray(r)
            g = np.asarray(g, np.float64).reshape(r.shape)
            with np.errstate(over="ignore"):
                past = ~np.isfinite(np.ldexp(r, k).astype(dt))  # past the dtype's range: Inf there
            np.testing.assert_array_equal(g[past], np.sign(r[past]) * np.inf, err_msg=name)
            np.testing.assert_allclose(np.ldexp(g[~past], -k), r[~past], rtol=tol, atol=tol * scale, err_msg=name)

    rows = len(x)
    for wt in (None, w):
        _, mean, rstd = nn.layer_norm_forward(x, N, wt)
        close(nn.layer_norm_backward(dy, x, mean, rstd, N, wt),
              ORACLE.layer_norm_backward(unit, x, mean, rstd, N, wt), rstd, "layer_norm")
        close(nn.add_layer_norm_backward(dy, ds, x, mean, rstd, N, wt),
              ORACLE.add_layer_norm_backward(unit, unit / 4, x, mean, rstd, N, wt), rstd, "add_layer_norm")
        _, rstd = nn.rms_norm_forward(x, N, wt)
        close(nn.rms_norm_backward(dy, x, rstd, N, wt), ORACLE.rms_norm_backward(unit, x, rstd, N, wt), rstd, "rms_norm")
        close(nn.add_rms_norm_backward(dy, ds, x, rstd, N, wt),
              ORACLE.add_rms_norm_backward(unit, unit / 4, x, rstd, N, wt), rstd, "add_rms_norm")
        # the ordinary rows' dx as in a call without the others
        np.testing.assert_array_equal(nn.rms_norm_backward(dy, x, rstd, N, wt)[0][[0, -1]],
                                      nn.rms_norm_backward(dy[[0, -1]], x[[0, -1]], rstd[[0, -1]], N, wt)[0])
        # GroupNorm, a row a sample of one group (its weight per channel: two channels)
        wg = None if wt is None else wt[1:3]
        for xg, dyg in [(x.reshape(rows, 2, N // 2), dy.reshape(rows, 2, N // 2)),
                        (channels_last(x.reshape(rows, 2, N // 2, 1)), channels_last(dy.reshape(rows, 2, N // 2, 1)))]:
            _, mean, rstd = nn.group_norm_forward(xg, 1, wg)
            close(nn.group_norm_backward(dyg, xg, mean, rstd, wg),
                  ORACLE.group_norm_backward(unit.reshape(dyg.shape), xg, mean, rstd, wg), rstd, "group_norm")


def test_a_parameter_gradient_past_the_weights_dtype_is_inf_without_a_warning():
    """dweight and dbias summed in float32 and returned in a float16 weight's dtype: past its
    largest value they are inf, as a kernel's store would round them, and NumPy's cast says
    nothing (numbanorm warns of nothing: it warned 'overflow encountered in cast'), on the
    full path and on a call's plan alike; dx, in x's float32, stays finite."""
    import warnings

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    dy = (3e4 * np.sign(x)).astype(np.float32)
    w = np.ones(4, np.float16)
    xg, dyg = x.reshape(64, 4, 1), dy.reshape(64, 4, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # (the second call by its plan)
            _, m, r = nn.layer_norm_forward(x, 4, w)
            dx, dw, db = nn.layer_norm_backward(dy, x, m, r, 4, w)
            assert np.isfinite(dx).all() and np.isinf(dw).all() and np.isinf(db).any()
            _, r = nn.rms_norm_forward(x, 4, w)
            dx, dw = nn.rms_norm_backward(dy, x, r, 4, w)
            assert np.isfinite(dx).all() and np.isinf(dw).all()
            _, m, r = nn.group_norm_forward(xg, 2, w)
            dx, dw, db = nn.group_norm_backward(dyg, xg, m, r, w)
            assert np.isfinite(dx).all() and np.isinf(db).all()
