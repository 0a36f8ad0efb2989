"""The stateful layers keep what the backward needs, not the caller's buffer
(contract, "Where it runs"), and do not pickle it."""

import pickle

import numpy as np
import pytest

import numbanorm as nn


def _layers():
    return [(nn.LayerNorm(16), (32, 16)), (nn.RMSNorm(16), (32, 16)),
            (nn.GroupNorm(2, 4), (8, 4, 4))]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["LayerNorm", "RMSNorm", "GroupNorm"])
def test_reusing_the_input_buffer_before_backward_changes_nothing(which):
    rng = np.random.default_rng(0)
    layer, shape = _layers()[which]
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    layer.weight[:] = rng.uniform(0.5, 2, layer.weight.shape)
    reference, _ = _layers()[which]
    reference.weight[:] = layer.weight
    reference(x.copy())
    want = (reference.backward(dy), reference.grad_weight)

    buf = x.copy()
    layer(buf)
    buf[:] = rng.standard_normal(shape)  # the next batch, loaded into the same buffer
    got = (layer.backward(dy), layer.grad_weight)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["LayerNorm", "RMSNorm", "GroupNorm"])
def test_the_backward_reads_the_weight_its_forward_read(which):
    """An update of the weight in place (or a new weight) between forward and backward
    leaves the backward's dx and grad_weight those of the forward that ran, as autograd's
    graph keeps them (torch refuses an in-place update; NumPy cannot tell)."""
    rng = np.random.default_rng(1)
    layer, shape = _layers()[which]
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    layer.weight[:] = rng.uniform(0.5, 2, layer.weight.shape)
    layer(x)
    want = (layer.backward(dy), layer.grad_weight, layer.grad_bias)
    layer(x)
    layer.weight *= 2
    got = (layer.backward(dy), layer.grad_weight, layer.grad_bias)
    layer.weight /= 2
    layer(x)
    layer.weight, layer.bias = layer.weight * 3, None
    again = (layer.backward(dy), layer.grad_weight, layer.grad_bias)
    for g, a, w in zip(got, again, want):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(a, w)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["LayerNorm", "RMSNorm", "GroupNorm"])
def test_a_layer_shared_by_threads_pairs_each_backward_with_its_threads_forward(which):
    """Two threads each run forward, then backward, on one layer, interleaved: each dx is its
    own forward's (the state of a single last forward gave thread A the dx of B's input)."""
    import threading

    rng = np.random.default_rng(2)
    layer, shape = _layers()[which]
    xs = [rng.standard_normal(shape).astype(np.float32) * (1 + 3 * i) for i in range(2)]
    dy = rng.standard_normal(shape).astype(np.float32)
    want = []
    for x in xs:
        layer(x)
        want.append(layer.backward(dy))
    order = [threading.Event() for _ in range(3)]
    got = [None, None]

    def run(i, forward_after, backward_after, done):
        if forward_after is not None:
            forward_after.wait()
        layer(xs[i])
        done[0].set()
        if backward_after is not None:
            backward_after.wait()
        got[i] = layer.backward(dy)
        done[1].set()

    a = threading.Thread(target=run, args=(0, None, order[1], (order[0], order[2])))  # forward, then B's forward
    b = threading.Thread(target=run, args=(1, order[0], None, (order[1], threading.Event())))
    a.start(), b.start()
    a.join(), b.join()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(RuntimeError, match="before a forward"):  # (the main thread's last forward was taken)
        layer.backward(dy)
    fresh, _ = _layers()[which]
    t = threading.Thread(target=fresh, args=(xs[0],))
    t.start(), t.join()
    with pytest.raises(RuntimeError, match="before a forward"):
        fresh.backward(dy)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["LayerNorm", "RMSNorm", "GroupNorm"])
def test_a_refused_forward_leaves_no_backward_of_an_earlier_one(which):
    rng = np.random.default_rng(3)
    layer, shape = _layers()[which]
    x = rng.standard_normal(shape).astype(np.float32)
    layer(x)
    with pytest.raises(TypeError):
        layer(x.astype(np.int32))
    with pytest.raises(RuntimeError, match="before a forward"):
        layer.backward(np.ones_like(x))


@pytest.mark.parametrize("which", [0, 1, 2], ids=["LayerNorm", "RMSNorm", "GroupNorm"])
def test_a_layer_takes_the_host_arrays_its_function_takes(which):
    """A CPU torch tensor (bfloat16 too, read as ml_dtypes.bfloat16) and a list: the layer's
    saved copy is of the array the call read (np.array refused a bfloat16 tensor after the
    forward had run)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(4)
    layer, shape = _layers()[which]
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    for given in (torch.from_numpy(x).bfloat16(), torch.from_numpy(x), x.tolist()):
        y = layer(given)
        read = given.float().numpy().astype(y.dtype) if isinstance(given, torch.Tensor) else np.asarray(given)
        np.testing.assert_array_equal(y, layer(read))
        want = layer.backward(dy.astype(y.dtype))
        layer(given)
        np.testing.assert_array_equal(layer.backward(dy.astype(y.dtype)), want)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["LayerNorm", "RMSNorm", "GroupNorm"])
def test_a_pickled_layer_carries_its_parameters_not_its_last_input(which):
    layer, shape = _layers()[which]
    layer.weight[:] = np.arange(layer.weight.size).reshape(layer.weight.shape)
    x = np.ones((64,) + shape[1:], np.float32) * np.arange(shape[-1], dtype=np.float32)
    layer(x)
    blob = pickle.dumps(layer)
    assert len(blob) < x.nbytes // 4, len(blob)
    copy = pickle.loads(blob)
    np.testing.assert_array_equal(copy.weight, layer.weight)
    with pytest.raises(RuntimeError, match="before"):
        copy.backward(np.ones_like(x))
    layer.backward(np.ones_like(x))  # the original still has its forward's state


_MAKERS = {"LayerNorm": lambda dt: nn.LayerNorm(4, dtype=dt), "RMSNorm": lambda dt: nn.RMSNorm(4, dtype=dt),
           "GroupNorm": lambda dt: nn.GroupNorm(2, 4, dtype=dt)}


@pytest.mark.parametrize("dtype", [np.int32, np.complex64, np.bool_, object, ">f4"])
@pytest.mark.parametrize("name", list(_MAKERS))
def test_a_dtype_numbanorm_does_not_compute_in_is_refused_at_construction(name, dtype):
    """The contract's TypeError naming the dtype, from the constructor (not the first forward)."""
    advice = r"byte-swapped '>f4'.*pass dtype=float32$" if dtype == ">f4" else np.dtype(dtype).name
    with pytest.raises(TypeError, match=r"`dtype`.*" + advice):
        _MAKERS[name](dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, "bfloat16"])
@pytest.mark.parametrize("name", list(_MAKERS))
def test_every_float_dtype_makes_a_layer(name, dtype):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    layer = _MAKERS[name](dtype)
    assert layer.weight.dtype == np.dtype(dtype)
    x = np.ones((2, 4, 3) if name == "GroupNorm" else (2, 4), dtype) * np.arange(4).reshape(1, 4, *(
        (1,) if name == "GroupNorm" else ())).astype(dtype)
    y = layer(x)
    assert y.dtype == np.dtype(dtype) and np.isfinite(y.astype(np.float32)).all()


_WITH_EPS = {"LayerNorm": lambda eps, dt=np.float32: nn.LayerNorm(8, eps=eps, dtype=dt),
             "RMSNorm": lambda eps, dt=np.float32: nn.RMSNorm(8, eps=eps, dtype=dt),
             "GroupNorm": lambda eps, dt=np.float32: nn.GroupNorm(2, 8, eps=eps, dtype=dt)}


@pytest.mark.parametrize("name", list(_WITH_EPS))
def test_a_layer_keeps_eps_as_given(name):
    """float32 parameters check eps in float32 but keep it as given: a float64 input
    normalizes with the functional call's eps (it was rounded to float32, 5e-9 off)."""
    layer = _WITH_EPS[name](1e-6)
    assert layer.eps == 1e-6 and "eps=1e-06" in repr(layer)
    x = np.random.default_rng(0).standard_normal((2, 8, 3) if name == "GroupNorm" else (2, 8)) * 1e-3
    want = {"LayerNorm": lambda: nn.layer_norm(x, 8, layer.weight, layer.bias, 1e-6),
            "RMSNorm": lambda: nn.rms_norm(x, 8, layer.weight, 1e-6),
            "GroupNorm": lambda: nn.group_norm(x, 2, layer.weight, layer.bias, 1e-6)}[name]()
    np.testing.assert_array_equal(layer(x), want)
    with pytest.raises(ValueError, match="eps"):  # still checked in the parameters' dtype
        _WITH_EPS[name](1e39, np.float16)


@pytest.mark.cudasim
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("which", [0, 1, 2], ids=["LayerNorm", "RMSNorm", "GroupNorm"])
def test_layers_on_cuda_arrays_keep_their_input_on_the_device(which, affine, strided):
    """A layer called on numba device arrays (its parameters moved there too) keeps a device
    copy of x for the backward, whose dx and gradients are those of the same layer on the
    host (the copy was a host array in the simulator: the backward refused a host x with a
    device dy); x a strided view too, which the forward takes (the copy refused it, after
    the forward had run)."""
    from numba import cuda

    rng = np.random.default_rng(3)
    layer, shape = _layers()[which]
    host, _ = _layers()[which]
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    for lay in (layer, host):
        if not affine:
            lay.weight = lay.bias = None
    if affine:
        layer.weight = cuda.to_device(host.weight)
        if host.bias is not None:
            layer.bias = cuda.to_device(host.bias)
    xd = cuda.to_device(np.stack([x, -x], axis=-1))[..., 0] if strided else cuda.to_device(x)
    assert xd.is_c_contiguous() != strided
    y = layer(xd)
    xd[:] = cuda.to_device(np.zeros_like(x))  # the caller reuses its buffer
    dx = layer.backward(cuda.to_device(dy))
    np.testing.assert_allclose(y.copy_to_host(), host(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx.copy_to_host(), host.backward(dy), rtol=1e-5, atol=1e-5)
    if affine:
        np.testing.assert_allclose(layer.grad_weight.copy_to_host(), host.grad_weight, rtol=1e-4, atol=1e-4)


def test_layers_document_their_arguments_attributes_and_methods():
    """help() of a layer shows its constructor's parameters in order, its attributes, and
    the Parameters/Returns/Raises of the forward and the backward (the classes had none)."""
    import inspect

    from test_operations import _sections

    for cls in (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm):
        sections = _sections(inspect.cleandoc(cls.__doc__))
        assert sections["Parameters"] == list(inspect.signature(cls).parameters), cls
        assert sections["Attributes"] == ["weight", "bias", "grad_weight", "grad_bias", "training"], cls
        for method, args, result in ((cls.__call__, ["x"], ["y"]), (cls.backward, ["dy"], ["dx"])):
            sections = _sections(inspect.cleandoc(method.__doc__))
            assert sections["Parameters"] == args and sections["Returns"] == result, (cls, method)
            assert sections["Raises"][:2] == ["TypeError", "ValueError"], (cls, method)


def test_layer_constructors_as_torchs():
    """dtype=None is float32 (torch's default dtype; NumPy's would be float64), a negative
    dimension is refused naming normalized_shape, and LayerNorm's repr shows its bias."""
    assert nn.LayerNorm(4, dtype=None).weight.dtype == np.float32
    assert nn.GroupNorm(2, 4, dtype=None).weight.dtype == np.float32
    for cls in (nn.LayerNorm, nn.RMSNorm):
        with pytest.raises(ValueError, match="normalized_shape"):
            cls((3, -1))
    assert repr(nn.LayerNorm(5, bias=False)) == "LayerNorm((5,), eps=1e-05, elementwise_affine=True, bias=False)"
    assert repr(nn.LayerNorm(5)).endswith("bias=True)")


@pytest.mark.parametrize("which", [0, 1, 2], ids=["LayerNorm", "RMSNorm", "GroupNorm"])
def test_a_backward_takes_its_forward(which):
    """A layer applied twice before its backwards (forward x1, forward x2, backward,
    backward) gave the second backward x2's dx without a word, and the copy of x lived as
    long as the layer; a backward now takes its forward: the copy is freed, and a second
    backward is refused, as autograd refuses one without retain_graph."""
    rng = np.random.default_rng(4)
    layer, shape = _layers()[which]
    x1, x2 = (rng.standard_normal(shape).astype(np.float32) * s for s in (1, 5))
    dy = rng.standard_normal(shape).astype(np.float32)
    layer(x2)
    want = layer.backward(dy)
    layer(x1)
    layer(x2)
    np.testing.assert_array_equal(layer.backward(dy), want)
    assert layer._thread().saved is None
    with pytest.raises(RuntimeError, match="each forward takes one backward"):
        layer.backward(dy)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["LayerNorm", "RMSNorm", "GroupNorm"])
def test_eval_mode_keeps_nothing(which):
    """``layer.eval()`` forwards for inference: the function's y, no copy of x kept (every
    forward copied x, whether or not a backward followed), no backward; ``train()`` turns
    the record back on."""
    rng = np.random.default_rng(5)
    layer, shape = _layers()[which]
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    want_y = layer(x)
    want_dx = layer.backward(dy)
    assert layer.eval() is layer and not layer.training
    np.testing.assert_array_equal(layer(x), want_y)
    assert getattr(layer._thread(), "saved", None) is None
    with pytest.raises(RuntimeError, match="training mode"):
        layer.backward(dy)
    assert layer.train() is layer and layer.training
    layer(x)
    np.testing.assert_array_equal(layer.backward(dy), want_dx)


def test_reprs_and_group_norms_bias_as_torchs():
    """The repr says whether a bias exists (LayerNorm without affine printed bias=True), and
    GroupNorm takes torch's keyword-only ``bias`` (it refused it)."""
    torch = pytest.importorskip("torch")
    for ours, theirs in ((nn.LayerNorm(6, elementwise_affine=False), torch.nn.LayerNorm(6, elementwise_affine=False)),
                         (nn.LayerNorm(6, bias=False), torch.nn.LayerNorm(6, bias=False)),
                         (nn.LayerNorm((2, 3)), torch.nn.LayerNorm((2, 3))),
                         (nn.GroupNorm(2, 4), torch.nn.GroupNorm(2, 4)),
                         (nn.GroupNorm(2, 4, bias=False), torch.nn.GroupNorm(2, 4, bias=False)),
                         (nn.GroupNorm(2, 4, affine=False), torch.nn.GroupNorm(2, 4, affine=False))):
        assert repr(ours) == repr(theirs)
    layer = nn.GroupNorm(2, 4, bias=False)
    assert layer.bias is None and layer.weight.shape == (4,)
    rng = np.random.default_rng(6)
    x, dy = rng.standard_normal((3, 4, 5)).astype(np.float32), rng.standard_normal((3, 4, 5)).astype(np.float32)
    layer.weight[:] = rng.uniform(0.5, 2, 4)
    np.testing.assert_array_equal(layer(x), nn.group_norm(x, 2, layer.weight))
    layer.backward(dy)
    assert layer.grad_bias is None and layer.grad_weight.shape == (4,)
