"""Every error case of the contract: the right exception, a message naming the
shapes involved, raised before anything is written (``out`` stays untouched)."""

from fractions import Fraction

import numpy as np
import pytest

import numbanorm as nn

X = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
W4 = np.ones(4, np.float32)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex64, object])
def test_non_floating_dtype_is_a_type_error_naming_it(dtype):
    x = np.ones((2, 4), dtype=dtype)
    for call in (lambda: nn.layer_norm(x, 4), lambda: nn.rms_norm(x, 4),
                 lambda: nn.group_norm(x.reshape(2, 4, 1), 2)):
        with pytest.raises(TypeError, match=np.dtype(dtype).name):
            call()


def test_non_floating_weight_is_a_type_error():
    with pytest.raises(TypeError, match="weight"):
        nn.layer_norm(X, 4, np.ones(4, np.int32))


@pytest.mark.parametrize("ns", [5, (3, 5), (2, 3, 4, 1), (4, 3), ()])
def test_normalized_shape_must_match_trailing_dims(ns):
    with pytest.raises(ValueError, match=r"\(2, 3, 4\)"):
        nn.layer_norm(X, ns)
    with pytest.raises(ValueError, match=r"\(2, 3, 4\)"):
        nn.rms_norm_forward(X, ns)


def test_normalized_shape_of_wrong_type():
    with pytest.raises(TypeError):
        nn.layer_norm(X, "4")


@pytest.mark.parametrize("wshape", [(3,), (1, 4), (4, 1), ()])
def test_weight_and_bias_of_the_wrong_shape(wshape):
    w = np.ones(wshape, np.float32)
    with pytest.raises(ValueError, match=r"weight.*expected \(4,\)"):
        nn.layer_norm(X, 4, w)
    with pytest.raises(ValueError, match="bias"):
        nn.layer_norm(X, 4, None, w)
    with pytest.raises(ValueError, match="weight"):
        nn.rms_norm(X, 4, w)
    with pytest.raises(ValueError, match="weight"):
        nn.group_norm(X, 3, np.ones((4,) + wshape, np.float32))


@pytest.mark.parametrize("g", [0, -1, 2, 4])
def test_num_groups_not_positive_or_not_dividing_c(g):
    with pytest.raises(ValueError, match="num_groups"):
        nn.group_norm(X, g)


def test_group_norm_needs_a_channel_axis():
    with pytest.raises(ValueError, match=r"\(N, C, \*spatial\)"):
        nn.group_norm(np.ones(4, np.float32), 1)


@pytest.mark.parametrize("eps", [-1e-5, float("nan"), float("inf"), -float("inf")])
def test_bad_eps(eps):
    with pytest.raises(ValueError, match="eps"):
        nn.layer_norm(X, 4, eps=eps)
    with pytest.raises(ValueError, match="eps"):
        nn.rms_norm(X, 4, eps=eps)
    with pytest.raises(ValueError, match="eps"):
        nn.group_norm(X, 3, eps=eps)


def test_eps_zero_is_allowed():
    y = nn.layer_norm(X, 4, eps=0.0)
    assert np.all(np.isfinite(y))


@pytest.mark.parametrize("out", [np.empty((2, 3, 5), np.float32), np.empty((2, 3, 4), np.float64),
                                 np.empty((24,), np.float32)])
def test_out_of_wrong_shape_or_dtype(out):
    before = out.copy()
    with pytest.raises(ValueError, match="out"):
        nn.layer_norm(X, 4, out=out)
    with pytest.raises(ValueError, match="out"):
        nn.rms_norm(X, 4, out=out)
    with pytest.raises(ValueError, match="out"):
        nn.group_norm(X, 3, out=out)
    np.testing.assert_array_equal(out, before)


def test_read_only_out():
    out = np.zeros_like(X)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        nn.layer_norm(X, 4, out=out)


def test_dy_not_shaped_like_x():
    y, mean, rstd = nn.layer_norm_forward(X, 4)
    with pytest.raises(ValueError, match=r"dy.*\(2, 3, 4\)"):
        nn.layer_norm_backward(np.ones((2, 3, 5), np.float32), X, mean, rstd, 4)
    _, r = nn.rms_norm_forward(X, 4)
    with pytest.raises(ValueError, match="dy"):
        nn.rms_norm_backward(np.ones((3, 4), np.float32), X, r, 4)
    _, gm, gr = nn.group_norm_forward(X, 3)
    with pytest.raises(ValueError, match="dy"):
        nn.group_norm_backward(np.ones((2, 3), np.float32), X, gm, gr)


def test_statistics_that_do_not_fit_x():
    y, mean, rstd = nn.layer_norm_forward(X, 4)
    with pytest.raises(ValueError, match="mean"):
        nn.layer_norm_backward(y, X, mean[:1], rstd, 4)
    with pytest.raises(ValueError, match="rstd"):
        nn.layer_norm_backward(y, X, mean, rstd.reshape(6), 4)
    with pytest.raises(ValueError, match="rstd"):
        nn.rms_norm_backward(y, X, np.ones((2, 3, 4), np.float32), 4)
    _, gm, gr = nn.group_norm_forward(X, 3)
    with pytest.raises(ValueError, match="rstd"):
        nn.group_norm_backward(X, X, gm, gr[:, :1])
    with pytest.raises(ValueError, match="num_groups|mean"):
        nn.group_norm_backward(X, X, np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))


def test_statistics_in_the_plain_batch_shape_are_accepted():
    y, mean, rstd = nn.layer_norm_forward(X, 4)
    a = nn.layer_norm_backward(y, X, mean, rstd, 4)
    b = nn.layer_norm_backward(y, X, mean.reshape(2, 3), rstd.reshape(2, 3), 4)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("shape,ns", [((3, 0), 0), ((2, 3, 0), (3, 0))])
def test_zero_sized_normalized_shape(shape, ns):
    with pytest.raises(ValueError, match="zero elements"):
        nn.layer_norm(np.ones(shape, np.float32), ns)
    with pytest.raises(ValueError, match="zero elements"):
        nn.rms_norm(np.ones(shape, np.float32), ns)


def test_zero_sized_group():
    with pytest.raises(ValueError, match="zero elements"):
        nn.group_norm(np.ones((2, 4, 0), np.float32), 2)


def test_zero_sized_batch_returns_empty_outputs():
    x = np.ones((0, 3, 8), np.float32)
    y, mean, rstd = nn.layer_norm_forward(x, 8)
    assert y.shape == (0, 3, 8) and mean.shape == (0, 3, 1) and rstd.dtype == np.float32
    dx, dw, db = nn.layer_norm_backward(x, x, mean, rstd, 8, np.ones(8))
    assert dx.shape == x.shape and dw.shape == (8,) and np.all(dw == 0) and np.all(db == 0)
    y, r = nn.rms_norm_forward(x, (3, 8))
    assert y.shape == x.shape and r.shape == (0, 1, 1)
    dx, dw = nn.rms_norm_backward(x, x, r, (3, 8))
    assert dx.shape == x.shape and np.all(dw == 0)
    y, m, r = nn.group_norm_forward(x, 3)
    assert y.shape == x.shape and m.shape == (0, 3)
    dx, dw, db = nn.group_norm_backward(x, x, m, r)
    assert dx.shape == x.shape and dw.shape == (3,) and np.all(db == 0)


class _FakeDeviceArray:
    """Looks like a CUDA array by its type alone; its data pointer is NULL, so any
    CUDA use of it (a copy, a kernel launch) would fail rather than pass silently."""

    shape = (4,)
    dtype = np.dtype(np.float32)
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}


def test_mixed_host_and_device_is_a_type_error_before_any_cuda_call():
    dev = _FakeDeviceArray()
    with pytest.raises(TypeError, match="weight"):
        nn.cpu.layer_norm(X, 4, dev)
    with pytest.raises(TypeError, match="device"):
        nn.layer_norm(X, 4, None, dev)


def test_weight_none_with_bias_works_as_in_torch():
    b = np.full(4, 3.0, np.float32)
    y = nn.layer_norm(X, 4, None, b)
    np.testing.assert_allclose(y.mean(axis=-1), 3.0, atol=1e-6)


def test_layers_backward_before_forward():
    for layer in (nn.LayerNorm(4), nn.RMSNorm(4), nn.GroupNorm(1, 3)):
        with pytest.raises(RuntimeError, match="before"):
            layer.backward(X)


# ---------------------------------------------------------------- eps

@pytest.mark.parametrize("eps", ["1e-5", True, np.bool_(False), [1e-5], 1j, np.complex64(1)])
def test_eps_that_is_not_a_real_number_is_a_type_error(eps):
    for call in (lambda: nn.layer_norm(X, 4, eps=eps), lambda: nn.rms_norm(X, 4, eps=eps),
                 lambda: nn.group_norm(X, 3, eps=eps), lambda: nn.add_layer_norm(X, X, 4, eps=eps),
                 lambda: nn.LayerNorm(4, eps=eps), lambda: nn.RMSNorm(4, eps=eps),
                 lambda: nn.GroupNorm(1, 3, eps=eps)):
        with pytest.raises(TypeError, match="eps"):
            call()


def test_eps_is_checked_in_the_accumulation_dtype():
    # 1e39 is a finite Python float but inf in float32: it zeroed every output
    for call in (lambda: nn.layer_norm(X, 4, eps=1e39), lambda: nn.rms_norm(X, 4, eps=1e39),
                 lambda: nn.group_norm(X, 3, eps=1e39), lambda: nn.add_rms_norm(X, X, 4, eps=1e39),
                 lambda: nn.LayerNorm(4, eps=1e39), lambda: nn.GroupNorm(1, 3, eps=1e39)):
        with pytest.raises(ValueError, match="eps"):
            call()
    # float64 holds it; float16 x accumulates in float32, so 1e39 is refused there too
    assert np.all(np.isfinite(nn.layer_norm(X.astype(np.float64), 4, eps=1e39)))
    with pytest.raises(ValueError, match="eps"):
        nn.layer_norm(X.astype(np.float16), 4, eps=1e39)


@pytest.mark.parametrize("eps", [0, 1e-5, np.float32(1e-5), np.float64(1e-6), np.int64(0)])
def test_eps_of_any_real_type(eps):
    want = nn.layer_norm(X, 4, eps=float(eps))
    np.testing.assert_array_equal(nn.layer_norm(X, 4, eps=eps), want)


# ---------------------------------------------------------------- out= overlapping an input

def _overlap_case(fn, which):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 3, 8)).astype(np.float32)
    n = 3 if fn == "group_norm" else 8
    args = (3,) if fn == "group_norm" else (8,)
    buf = rng.standard_normal(x.size).astype(np.float32)
    out = buf.reshape(x.shape)
    params = {"weight": rng.uniform(0.5, 2, n).astype(np.float32),
              "bias": rng.standard_normal(n).astype(np.float32)}
    if fn == "rms_norm":
        del params["bias"]
    want = getattr(nn, fn)(x, *args, **params)
    # the same parameter, lying inside out's later rows: overwritten while rows still read it
    alias = buf[x.size // 2: x.size // 2 + n]
    alias[:] = params[which]
    params[which] = alias
    return getattr(nn, fn)(x, *args, **params, out=out), want


@pytest.mark.parametrize("fn, which", [("layer_norm", "weight"), ("layer_norm", "bias"),
                                       ("rms_norm", "weight"), ("group_norm", "weight"),
                                       ("group_norm", "bias")])
def test_out_overlapping_weight_or_bias_reads_them_first(fn, which):
    got, want = _overlap_case(fn, which)
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- unclear exceptions

def test_missing_gradient_or_residual_is_a_type_error_naming_it():
    y, mean, rstd = nn.layer_norm_forward(X, 4)
    with pytest.raises(TypeError, match="dy"):
        nn.layer_norm_backward(None, X, mean, rstd, 4)
    _, rs = nn.rms_norm_forward(X, 4)
    with pytest.raises(TypeError, match="dy"):
        nn.rms_norm_backward(None, X, rs, 4)
    _, gm, gr = nn.group_norm_forward(X, 3)
    with pytest.raises(TypeError, match="dy"):
        nn.group_norm_backward(None, X, gm, gr)
    with pytest.raises(TypeError, match="residual"):
        nn.add_layer_norm(X, None, 4)
    with pytest.raises(TypeError, match="residual"):
        nn.add_rms_norm(X, None, 4)


def test_out_that_is_not_an_array_is_a_type_error():
    for call in (lambda: nn.layer_norm(X, 4, out=X.tolist()), lambda: nn.rms_norm(X, 4, out=[0.0]),
                 lambda: nn.group_norm(X, 3, out=(1.0,))):
        with pytest.raises(TypeError, match="out.*array"):
            call()


@pytest.mark.parametrize("args", [("2", 4), (2, "4"), (2.0, 4), (True, 4), (None, 4)])
def test_group_norm_layer_with_non_integer_sizes(args):
    with pytest.raises(TypeError, match="num_"):
        nn.GroupNorm(*args)


def test_dask_takes_the_lists_the_top_level_takes():
    nd = pytest.importorskip("numbanorm.dask")
    x = [[1.0, 2.0, 4.0, 8.0], [0.5, -1.0, 3.0, 2.0]]
    w = [1.0, 2.0, 3.0, 4.0]
    np.testing.assert_array_equal(nd.layer_norm(x, 4, w, w).compute(), nn.layer_norm(x, 4, w, w))
    np.testing.assert_array_equal(nd.rms_norm(x, 4, w).compute(), nn.rms_norm(x, 4, w))
    with pytest.raises(TypeError, match="int64"):
        nd.layer_norm([[1, 2]], 2)


def test_check_of_the_oracle_says_what_it_is():
    import io

    from numbanorm.__main__ import check

    buf = io.StringIO()
    assert check(impls=["oracle"], out=buf) == 2
    assert "reference" in buf.getvalue()


# ---------------------------------------------------------------- repeated small calls

@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_repeated_16_bit_and_out_calls_take_the_small_call_path_with_the_full_paths_bits(dtype):
    from numbanorm.cpu import _backend
    from numbanorm.measure import host_dtype

    dt = host_dtype(dtype)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 2, 16)).astype(dt)
    x[1, 0, 3] = np.nan  # stays in its row
    w = rng.standard_normal(16).astype(dt)
    w32 = w.astype(np.float32)  # weights of another dtype than x
    plans = _backend.small_calls._plans
    before = x.copy()
    # the statistics too: the forward functions (no out=) replay as well
    for fwd in (lambda: nn.layer_norm_forward(x, 16, w, w32, 1e-4), lambda: nn.rms_norm_forward(x, 16, w)):
        plans.clear()
        want = [a.copy() for a in fwd()]
        for a, b in zip(fwd(), want):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    for call in (lambda out=None: nn.layer_norm(x, 16, w, w32, 1e-4, out=out),
                 lambda out=None: nn.rms_norm(x, 16, w, out=out)):
        plans.clear()
        want = call().copy()                 # the full path, which learns the call
        assert len(plans) == 1
        out = np.empty_like(x)
        assert call(out) is out and len(plans) == 2  # full path again (another key: out=)
        for got in (call(), call(out)):     # both replayed
            assert len(plans) == 2 and got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        assert call(out) is out
        f32 = out.astype(np.float32)
        assert np.isnan(f32[1, 0]).all() and not np.isnan(f32[[0, 2]]).any()
        w[0] = w[0] * 2                      # contents changed in place: seen by the replay
        assert not np.array_equal(call(out).astype(np.float32), want.astype(np.float32))
        w[0] = w[0] / 2
        # what the replay cannot learn is checked on every call
        out.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            call(out)
        out.flags.writeable = True
        np.testing.assert_array_equal(call(x.copy()).view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(x.view(np.uint8), before.view(np.uint8))  # inputs unchanged
    # out= overlapping x: the launcher computes apart on a replayed call too
    buf = rng.standard_normal((5, 16)).astype(dt)
    want = nn.layer_norm(buf[:-1].copy(), 16, w)
    nn.layer_norm(buf[:-1], 16, w, out=buf[1:].copy())  # learn the key of (4, 16) x and out
    nn.layer_norm(buf[:-1], 16, w, out=buf[1:])
    np.testing.assert_array_equal(buf[1:].view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_a_repeated_group_norm_takes_the_small_call_path_with_the_full_paths_bits(dtype):
    """GroupNorm's frontend took 22 of a 29 us (1, 8, 4, 4) call; a call seen before goes
    to the launcher, with the full path's bits, and what differs is validated again."""
    from numbanorm.cpu import _backend
    from numbanorm.measure import host_dtype

    dt = host_dtype(dtype)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 6, 5, 3)).astype(dt)
    x[1, 2, 0, 1] = np.nan  # stays in its (sample, group)
    w = rng.standard_normal(6).astype(dt)
    b32 = rng.standard_normal(6).astype(np.float32)
    small = _backend.small_calls
    before = x.copy()

    def same(got, want):
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))

    small._plans.clear()
    want = [a.copy() for a in nn.group_norm_forward(x, 3)]  # the full path, which learns it
    assert small.group_norm(x, 3, None, None, 1e-5) is not None  # (eps as the public default)
    same(nn.group_norm_forward(x, 3), want)
    y = np.asarray(want[0], np.float64)
    assert np.isnan(y[1, 2:4]).all() and not np.isnan(y[0]).any() and not np.isnan(y[1, :2]).any()

    small._plans.clear()
    want = nn.group_norm(x, 3, w, b32, 1e-4).copy()
    out = np.empty_like(x)
    assert nn.group_norm(x, 3, w, b32, 1e-4, out=out) is out  # learned as another key
    for got in (nn.group_norm(x, 3, w, b32, 1e-4), nn.group_norm(x, 3, w, b32, 1e-4, out=out), out):
        same((got,), (want,))
    assert small.group_norm(x, 3, w, b32, 1e-4, out=out) is not None
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        nn.group_norm(x, 3, w, b32, 1e-4, out=out)
    xc = x.copy()  # in place, on a key seen before (as out=): the launcher sees that out is x
    nn.group_norm(xc, 3, w, b32, 1e-4, out=xc)
    same((xc,), (want,))
    w[0] = w[0] * 2  # contents changed in place: seen by the replay
    assert not np.array_equal(nn.group_norm(x, 3, w, b32, 1e-4)[0], want[0], equal_nan=True)
    w[0] = w[0] / 2
    with pytest.raises(ValueError, match="num_groups"):
        nn.group_norm(x, 4, w, b32, 1e-4)  # another key: validated
    np.testing.assert_array_equal(x.view(np.uint8), before.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_a_repeated_backward_takes_the_small_call_path_with_the_full_paths_bits(dtype):
    """A backward seen before skips the frontend (its validation and conversions: 33 of a
    134 us (256, 768) float32 call) and gives the full path's bits; a call that needs a
    conversion is never learned, and one that differs from a learned call is validated."""
    from numbanorm.cpu import _backend
    from numbanorm.measure import host_dtype

    dt = host_dtype(dtype)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 2, 16)).astype(dt)
    x[1, 0, 3] = np.nan  # stays in its row
    dy = rng.standard_normal(x.shape).astype(dt)
    small = _backend.small_calls
    plans = small._plans
    before = [x.copy(), dy.copy()]
    for w in (rng.standard_normal(16).astype(dt), rng.standard_normal(16).astype(np.float32), None):
        _, mean, rstd = nn.layer_norm_forward(x, 16, w)
        for name, stats, shortcut in (("layer_norm", (mean, rstd), small.layer_norm_backward),
                                      ("rms_norm", nn.rms_norm_forward(x, 16, w)[1:], small.rms_norm_backward)):
            bwd = getattr(nn, name + "_backward")
            plans.clear()
            assert shortcut(dy, x, *stats, 16, w) is None  # not seen yet
            want = [a.copy() for a in bwd(dy, x, *stats, 16, w)]  # the full path, which learns it
            assert shortcut(dy, x, *stats, 16, w) is not None
            for got in (bwd(dy, x, *stats, 16, w), shortcut(dy, x, *stats, 16, w)):
                for a, b in zip(got, want):
                    assert a.dtype == b.dtype and a.shape == b.shape
                    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
            dx = np.asarray(want[0], np.float64)
            assert np.isnan(dx[1, 0]).all() and not np.isnan(dx[[0, 2]]).any()
            if w is not None:  # contents changed in place: seen by the replay
                w[0] = w[0] * 2
                assert not np.array_equal(np.asarray(bwd(dy, x, *stats, 16, w)[0], np.float64), dx,
                                          equal_nan=True)
                w[0] = w[0] / 2
            # dy in another dtype is cast by the full path: never learned, the same result
            plans.clear()
            dy2 = dy.astype(np.float32 if dt == np.float64 else np.float64)
            got = bwd(dy2, x, *stats, 16, w)
            assert not plans and shortcut(dy2, x, *stats, 16, w) is None
            np.testing.assert_array_equal(got[0].view(np.uint8),
                                          bwd(dy2.astype(dt), x, *stats, 16, w)[0].view(np.uint8))
            # a call that differs from a learned one is validated again
            bwd(dy, x, *stats, 16, w)
            with pytest.raises(ValueError, match="rstd"):
                bwd(dy, x, *stats[:-1], stats[-1][:2], 16, w)
    for a, b in zip((x, dy), before):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_repeated_16_bit_call_goes_straight_to_the_kernel(dtype, monkeypatch):
    """No launcher (which widened the weights with two Numba calls and two
    allocations on every call) for a 16-bit call without out= seen before: the
    kernel reads x, y and 16-bit weights as their integer views."""
    from numbanorm.cpu import _backend
    from numbanorm.cpu._kernels import layer_norm as ln_cpu, rms_norm as rms_cpu
    from numbanorm.measure import host_dtype

    dt = host_dtype(dtype)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 64)).astype(dt)
    w = rng.standard_normal(64).astype(dt)
    b32 = rng.standard_normal(64).astype(np.float32)
    _backend.small_calls._plans.clear()
    want = (nn.layer_norm(x, 64, w, b32), nn.rms_norm(x, 64, w))  # learned by the full path

    def launcher_called(*args, **kwargs):
        raise AssertionError("a repeated 16-bit call went through the launcher")

    monkeypatch.setattr(ln_cpu, "forward", launcher_called)
    monkeypatch.setattr(rms_cpu, "forward", launcher_called)
    for got, w_ in zip((nn.layer_norm(x, 64, w, b32), nn.rms_norm(x, 64, w)), want):
        np.testing.assert_array_equal(got.view(np.uint8), w_.view(np.uint8))


@pytest.mark.parametrize("shape, nshape", [((4, 8), (8,)), ((3, 8), (3, 8)), ((1, 24), (24,)), ((2, 3, 8), (3, 8))])
def test_a_repeated_call_returns_what_the_first_did_for_every_layout_of_x(shape, nshape):
    """The small-call path passes an x already of (rows, N) to the kernel as it is,
    and reshapes every other x (a 2-D x over two normalized dimensions too)."""
    from numbanorm.cpu import _backend

    rng = np.random.default_rng(6)
    x = rng.standard_normal(shape).astype(np.float32)
    # a weight over two dimensions is not learned (the full path flattens it): none there
    w = rng.standard_normal(nshape).astype(np.float32) if len(nshape) == 1 else None
    _backend.small_calls._plans.clear()
    for fwd in (lambda: nn.layer_norm_forward(x, nshape, w, w), lambda: nn.rms_norm_forward(x, nshape, w)):
        first = fwd()
        assert len(_backend.small_calls._plans) >= 1
        for a, b in zip(first, fwd()):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
        assert first[0].shape == shape


def test_a_repeated_call_takes_the_small_call_path_and_still_validates():
    from numbanorm.cpu import _backend

    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    w = rng.standard_normal(8).astype(np.float32)
    plans = _backend.small_calls._plans
    first = nn.layer_norm_forward(x, (8,), w, w, 1e-3)
    assert any(k[0] == "layer_norm" and k[1] == x.shape for k in plans)  # learned from the full path
    again = nn.layer_norm_forward(x, (8,), w, w, 1e-3)
    for a, b in zip(first, again):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    y, r = nn.rms_norm_forward(x, 8, w)
    y2, r2 = nn.rms_norm_forward(x, 8, w)
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(r, r2)
    # anything that differs from a learned call is validated again
    with pytest.raises(ValueError, match="eps"):
        nn.layer_norm(x, (8,), w, w, -1e-3)
    with pytest.raises(ValueError, match="weight"):
        nn.layer_norm(x, (8,), w[:4], w, 1e-3)
    with pytest.raises(TypeError, match="eps"):
        nn.rms_norm(x, 8, w, True)
    with pytest.raises(ValueError, match="out"):
        nn.layer_norm(x, (8,), w, w, 1e-3, out=np.empty((2, 3, 7), np.float32))
    # a weight over two normalized dimensions is flattened by the full path
    w2 = rng.standard_normal((3, 8)).astype(np.float32)
    first2 = nn.layer_norm(x, (3, 8), w2, None)
    np.testing.assert_array_equal(nn.layer_norm(x, (3, 8), w2, None), first2)
    # a strided x of the same shape is a different call: same values
    xs = np.repeat(x, 2, axis=-1)[..., ::2]
    np.testing.assert_array_equal(nn.layer_norm(xs, (8,), w, w, 1e-3), first[0])


def _outcome(call):
    """What a call gives: its results' bytes, or its exception's type and message."""
    try:
        got = call()
    except Exception as e:  # noqa: BLE001  (the outcome is the exception)
        return type(e), str(e)
    return tuple(np.asarray(a).tobytes() for a in (got if isinstance(got, tuple) else (got,)))


_X64 = np.random.default_rng(9).standard_normal((4, 64)).astype(np.float32)
_D64 = np.random.default_rng(10).standard_normal((4, 64)).astype(np.float32)


def _stats():
    return nn.layer_norm_forward(_X64, 64)[1:]


@pytest.mark.parametrize("learned, asked", [
    (lambda: nn.layer_norm(_X64, 64), lambda: nn.layer_norm(_X64, 64.0)),
    (lambda: nn.layer_norm(_X64, (64,)), lambda: nn.layer_norm(_X64, (64.0,))),
    (lambda: nn.layer_norm(_X64, 64), lambda: nn.layer_norm(_X64, Fraction(64))),
    (lambda: nn.layer_norm(_X64, (64,)), lambda: nn.layer_norm(_X64, (Fraction(64),))),
    (lambda: nn.rms_norm(_X64, 64), lambda: nn.rms_norm(_X64, 64.0)),
    (lambda: nn.rms_norm(_X64, (64,)), lambda: nn.rms_norm(_X64, (64.0,))),
    (lambda: nn.group_norm(_X64.reshape(4, 8, 8), 2), lambda: nn.group_norm(_X64.reshape(4, 8, 8), 2.0)),
    (lambda: nn.group_norm(_X64.reshape(4, 8, 8), 1), lambda: nn.group_norm(_X64.reshape(4, 8, 8), True)),
    (lambda: nn.layer_norm_backward(_D64, _X64, *_stats(), (64,), None),
     lambda: nn.layer_norm_backward(_D64, _X64, *_stats(), (64.0,), None)),
    (lambda: nn.rms_norm_backward(_D64, _X64, _stats()[1], (64,), None),
     lambda: nn.rms_norm_backward(_D64, _X64, _stats()[1], (64.0,), None)),
], ids=["64.0", "(64.0,)", "Fraction", "(Fraction,)", "rms 64.0", "rms (64.0,)", "groups 2.0", "groups True",
        "backward (64.0,)", "rms backward (64.0,)"])
def test_a_call_gets_one_answer_whatever_was_called_before(learned, asked):
    """The small-call path keys a call by what the full path decides on: a call equal to a
    learned one (64.0 == 64, True == 1) but of another type gets the full path's answer."""
    from numbanorm.cpu import _backend

    _backend.small_calls._plans.clear()
    first = _outcome(asked)
    assert first[0] is TypeError, first  # what the full path says of it
    learned()
    learned()  # (the second call is the small-call path's)
    assert _backend.small_calls._plans
    assert _outcome(asked) == first
