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


@pytest.mark.parametrize("x", [X, np.float32(1.0)])
def test_an_empty_normalized_shape_is_refused_as_empty(x):
    """torch refuses normalized_shape () too; the message said it did not match x's
    trailing dimensions, which () always matches."""
    for call in (lambda: nn.layer_norm(x, ()), lambda: nn.rms_norm_forward(x, []),
                 lambda: nn.add_layer_norm(x, x, ())):
        with pytest.raises(ValueError, match=r"at least one dimension, got \(\)"):
            call()


@pytest.mark.parametrize("ns", ["4", True, np.bool_(True), (True,), 4.0])
def test_normalized_shape_of_wrong_type(ns):
    """A bool is no length (torch refuses True; operator.index took it as 1)."""
    x = X[..., :1]
    with pytest.raises(TypeError, match="normalized_shape"):
        nn.layer_norm(x, ns)
    with pytest.raises(TypeError, match="normalized_shape"):
        nn.rms_norm(x, ns)
    with pytest.raises(TypeError, match="normalized_shape"):
        nn.LayerNorm(ns)


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


def _bfloat16_eps():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return ml_dtypes.bfloat16(0.25)


@pytest.mark.parametrize("eps", [0, 1e-5, np.float32(1e-5), np.float64(1e-6), np.int64(0), np.float16(0.25),
                                 "bfloat16"])
def test_eps_of_any_real_type(eps):
    """Every real scalar, an ml_dtypes.bfloat16 one too (not a numbers.Real: it was a TypeError)."""
    eps = _bfloat16_eps() if eps == "bfloat16" else eps
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


class _Subclass(np.ndarray):
    pass


def test_an_out_whose_array_would_be_a_copy_is_refused():
    """An ``out`` whose NumPy array is a copy was filled unseen and returned unwritten: a
    CPU tensor with the negative bit (its memory holds the values negated; torch writes
    through it), an object whose ``__array__`` makes a new array; a masked ``out`` is
    refused with words for an output.  An ndarray subclass is filled."""
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)

    class Copied:
        dtype, shape = np.dtype(np.float32), (3, 8)

        def __array__(self, dtype=None, copy=None):
            return np.zeros(self.shape, self.dtype)

    for fn in (lambda out: nn.layer_norm(x, 8, out=out), lambda out: nn.rms_norm(x, 8, out=out),
               lambda out: nn.group_norm(x, 2, out=out)):
        with pytest.raises(TypeError, match="`out` is a torch.Tensor with the negative bit"):
            fn(torch.zeros(3, 8, dtype=torch.complex64).conj().imag)
        with pytest.raises(TypeError, match="`out` must be a NumPy array or a CPU torch.Tensor, got Copied"):
            fn(Copied())
        with pytest.raises(TypeError, match="`out` is a masked array: numbanorm writes every element"):
            fn(np.ma.masked_array(np.zeros((3, 8), np.float32)))
        want = fn(None)
        for out in (np.zeros((3, 8), np.float32).view(_Subclass), torch.zeros(3, 8)):
            assert fn(out) is out
            np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental", "ignore:torch.quantize_per_tensor")
def test_a_torch_tensor_numbanorm_cannot_read_is_a_type_error_naming_it():
    """float8 and complex32 CPU tensors, sparse, MKL-DNN and quantized ones got DLPack's
    RuntimeError or BufferError, naming no argument."""
    torch = pytest.importorskip("torch")
    made = (lambda t: t.to(torch.float8_e4m3fn), lambda t: t.to(torch.complex32), lambda t: t.to_sparse(),
            lambda t: t.to_mkldnn(), lambda t: torch.quantize_per_tensor(t, 0.1, 0, torch.qint8))
    x, w = torch.randn(3, 8), torch.ones(8)
    for make in made:
        with pytest.raises(TypeError, match="`x`"):
            nn.layer_norm(make(x), 8)
        with pytest.raises(TypeError, match="`weight`"):
            nn.layer_norm(x.numpy(), 8, make(w))


def test_a_size_given_as_a_0d_array_is_refused_as_for_every_size():
    """``num_groups=np.array(2)`` ran (operator.index takes a 0-d array) where
    ``normalized_shape=np.array(4)`` was refused; torch refuses both."""
    x = np.ones((2, 4, 3), np.float32)
    with pytest.raises(TypeError, match="num_groups"):
        nn.group_norm(x, np.array(2))
    with pytest.raises(TypeError, match="normalized_shape"):
        nn.layer_norm(x, np.array(3))
    with pytest.raises(TypeError, match="num_groups"):
        nn.GroupNorm(np.array(2), 4)
    np.testing.assert_array_equal(nn.group_norm(x, np.int64(2)), nn.group_norm(x, 2))  # (a NumPy int is an int)


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


def test_a_masked_array_is_refused_by_name():
    """A masked array's masked elements would be normalized as data (np.asarray keeps the
    data, drops the mask): refused, naming the argument, on the first call and after."""
    x = np.ones((2, 4), np.float32)
    masked = np.ma.masked_array(x, mask=[[False, True, False, False]] * 2)
    for _ in range(2):  # (the second call past the plan cache's shortcut)
        nn.layer_norm(x, 4)
        with pytest.raises(TypeError, match="`x` is a masked array"):
            nn.layer_norm(masked, 4)
        with pytest.raises(TypeError, match="`weight` is a masked array"):
            nn.rms_norm(x, 4, np.ma.masked_array(np.ones(4, np.float32)))
        _, m, r = nn.layer_norm_forward(x, 4)
        with pytest.raises(TypeError, match="`dy` is a masked array"):
            nn.layer_norm_backward(masked, x, m, r, 4)


def test_cpu_tensors_at_the_top_level_are_read_as_numpy_arrays():
    """numbanorm's functions read a CPU torch tensor's memory as a NumPy array and return NumPy
    arrays, bfloat16 included (it was torch's "unsupported ScalarType BFloat16"); a tensor
    that requires grad is refused by name, pointing to numbanorm.torch (it was torch's
    RuntimeError from .numpy())."""
    torch = pytest.importorskip("torch")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    t = torch.linspace(-3, 5, 24).reshape(3, 8)
    for tensor, array in ((t, t.numpy()),
                          (t.bfloat16(), t.bfloat16().view(torch.int16).numpy().view(ml_dtypes.bfloat16)),
                          (t.t().contiguous().t(), t.numpy())):
        y = nn.layer_norm(tensor, 8, tensor[0])
        assert type(y) is np.ndarray and y.dtype == array.dtype
        np.testing.assert_array_equal(y, nn.layer_norm(array, 8, array[0]))
    with pytest.raises(TypeError, match="`x` is a torch.Tensor that requires grad: numbanorm.torch"):
        nn.layer_norm(t.clone().requires_grad_(), 8)
    with pytest.raises(TypeError, match="`weight` is a torch.Tensor that requires grad"):
        nn.rms_norm(t, 8, torch.ones(8, requires_grad=True))
