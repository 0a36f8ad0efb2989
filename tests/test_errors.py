"""Every error case of the contract: the right exception, a message naming the
shapes involved, raised before anything is written (``out`` stays untouched)."""

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
