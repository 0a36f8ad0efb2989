"""The contract's promises beyond single values: determinism, non-contiguous
inputs, untouched inputs, NaN/Inf isolation, large offsets, ``out=``, layers."""

import numba
import numpy as np
import pytest

import numbanorm as nn
from conftest import ORACLE, assert_close, channels_last, to_host
from numbanorm.operations import OPERATIONS


def _all_calls(impl, x, x4, w, b, dy, dy4):
    """Every operation of the table, forward then backward, on one implementation, as a list of arrays.

    Row layouts run on x (residual dy, ds x), group layouts on x4 in 2 groups.
    """
    res = []
    for op in OPERATIONS:
        rows = op.layout == "rows"
        xx, dd = (x, dy) if rows else (x4, dy4)
        n = xx.shape[-1] if rows else xx.shape[1]
        values = {"x": xx, "residual": dd, op.shape_role: n if rows else 2, "weight": w[:n], "bias": b[:n],
                  "dy": dd, "ds": xx}
        fwd = op.call(impl, "forward", values)
        values.update(zip(op.forward_outputs, fwd))
        res += [*fwd, *op.call(impl, "backward", values)]
    return [to_host(a) for a in res]


def _named(*runs):
    """``{(operation, role): (each run's array)}`` of lists made by :func:`_all_calls`."""
    roles = [(op.name, r) for op in OPERATIONS for r in (*op.forward_outputs, *op.backward_outputs)]
    assert all(len(run) == len(roles) for run in runs)
    return {key: tuple(run[k] for run in runs) for k, key in enumerate(roles)}


def _inputs(rng, rows=9, cols=37, dtype=np.float32):
    x = rng.standard_normal((rows, cols)).astype(dtype)
    dy = rng.standard_normal((rows, cols)).astype(dtype)
    x4 = rng.standard_normal((3, 4, 2, 5)).astype(dtype)
    dy4 = rng.standard_normal((3, 4, 2, 5)).astype(dtype)
    w = rng.uniform(0.5, 1.5, cols).astype(dtype)
    b = rng.standard_normal(cols).astype(dtype)
    return x, x4, w, b, dy, dy4


def test_deterministic_run_to_run(impl, rng):
    args = _inputs(rng)
    first = _all_calls(impl, *args)
    second = _all_calls(impl, *args)
    for a, c in zip(first, second):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parallel_kernels
def test_cpu_backward_bit_identical_for_any_thread_count(rng):
    """dweight/dbias partials are split by rows, never by threads (on Numba's threads: the
    parallel kernel compiled by the first call)."""
    x = rng.standard_normal((1000, 96)).astype(np.float32)
    dy = rng.standard_normal((1000, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    _, m, r = nn.layer_norm_forward(x, 96, w)
    _same_bits_on_one_thread_and_all(lambda: nn.layer_norm_backward(dy, x, m, r, 96, w))


def _same_bits_on_one_thread_and_all(call):
    """``call()``'s arrays on one of Numba's threads and on all of them (each call's parallel
    kernel compiled in it), bit for bit."""
    from numbanorm.cpu._kernels import background
    before, most = numba.get_num_threads(), numba.config.NUMBA_NUM_THREADS
    if most < 2:  # (one thread and "all" would be one call compared with itself)
        pytest.skip("one Numba thread here (NUMBA_NUM_THREADS=1 or one core): no thread count to compare")
    try:
        results = []
        for t in (1, most):  # (all of them: the thread's current count may have been set lower)
            numba.set_num_threads(t)
            with background.synchronous():
                results.append(call())
    finally:
        numba.set_num_threads(before)
    assert len(results) == 2
    for a, c in zip(results[0], results[-1]):
        np.testing.assert_array_equal(a, c)


def test_inputs_are_never_modified(impl, rng):
    args = _inputs(rng)
    copies = [a.copy() for a in args]
    _all_calls(impl, *args)
    for a, c in zip(args, copies):
        np.testing.assert_array_equal(a, c)


def test_non_contiguous_inputs_equal_their_contiguous_copies(impl, rng):
    big = rng.standard_normal((9, 80)).astype(np.float32)
    big4 = rng.standard_normal((3, 4, 4, 10)).astype(np.float32)
    x, dy = big[:, ::2], big[::-1, 1::2]           # strided and reversed
    x4, dy4 = big4[:, :, ::2, ::2], big4[:, :, 1::2, 1::2][..., ::-1]
    w = rng.uniform(0.5, 1.5, 80).astype(np.float32)[::2]
    b = rng.standard_normal(40).astype(np.float32)
    strided = _all_calls(impl, x, x4, w, b, dy, dy4)
    dense = _all_calls(impl, *(np.ascontiguousarray(a) for a in (x, x4, w, b, dy, dy4)))
    for a, c in zip(strided, dense):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_stay_in_their_row(impl, rng, bad):
    x, x4, w, b, dy, dy4 = _inputs(rng)
    clean = _all_calls(impl, x, x4, w, b, dy, dy4)
    x, x4 = x.copy(), x4.copy()
    x[4, 7] = bad
    x4[1, 2, 1, 3] = bad    # sample 1, group 1 (channels 2-3)
    dirty = _all_calls(impl, x, x4, w, b, dy, dy4)
    rows = [i for i in range(9) if i != 4]
    # every row norm's arrays of one value a row (all but dweight and dbias, sums over the
    # rows), the fused ones' s and their backward (ds = x, its NaN in row 4) too: the fused
    # norms' were computed and never compared
    named = _named(dirty, clean)
    row_ops = [op for op in OPERATIONS if op.layout == "rows"]
    assert {op.name for op in row_ops} == {"layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"}
    for op in row_ops:
        for role in (*op.forward_outputs, "dx"):
            got, want = named[op.name, role]
            np.testing.assert_array_equal(got[rows], want[rows], err_msg=f"{op.name} {role}")
            if role != "rstd" or op.stats == ("mean", "rstd"):  # (RMS rstd of a row holding +-inf: 0, as torch's)
                assert not np.all(np.isfinite(got[4])), (op.name, role)
    # group norm: y, mean, rstd, dx; the other (sample, group) pairs are exact
    (gy, cy), (gm, cm), (gr, cr), (gdx, cdx) = (named["group_norm", r] for r in ("y", "mean", "rstd", "dx"))
    keep = np.ones((3, 2), bool)
    keep[1, 1] = False
    np.testing.assert_array_equal(gm[keep], cm[keep])
    np.testing.assert_array_equal(gr[keep], cr[keep])
    yg, cyg = gy.reshape(3, 2, -1), cy.reshape(3, 2, -1)
    np.testing.assert_array_equal(yg[keep], cyg[keep])
    np.testing.assert_array_equal(gdx.reshape(3, 2, -1)[keep], cdx.reshape(3, 2, -1)[keep])
    assert not np.all(np.isfinite(yg[1, 1]))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_channels_last_group_norm_keeps_nan_in_its_group_and_inputs_untouched(rng, bad):
    """The CPU's channels-last kernels (a group's elements spread over every position): a NaN
    or an Inf in one (sample, group) leaves every other one's results as they were."""
    x = channels_last(rng.standard_normal((3, 8, 5, 7)).astype(np.float32))
    dy = channels_last(rng.standard_normal(x.shape).astype(np.float32))
    w, b = rng.uniform(0.5, 1.5, 8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    clean = [*nn.group_norm_forward(x, 4, w, b)]
    clean += nn.group_norm_backward(dy, x, clean[1], clean[2], w)[:1]
    dirty_x = x.copy(order="K")
    dirty_x[1, 2, 3, 4] = bad  # sample 1, group 1 (channels 2-3)
    copies = [a.copy(order="K") for a in (dirty_x, dy, w, b)]
    dirty = [*nn.group_norm_forward(dirty_x, 4, w, b)]
    dirty += nn.group_norm_backward(dy, dirty_x, dirty[1], dirty[2], w)[:1]
    for a, c in zip((dirty_x, dy, w, b), copies):
        np.testing.assert_array_equal(a, c)
    keep = np.ones((3, 4), bool)
    keep[1, 1] = False
    for k in (1, 2):
        np.testing.assert_array_equal(dirty[k][keep], clean[k][keep])
    for k in (0, 3):
        by_group = [a.reshape(3, 4, 2, 35)[keep] for a in (dirty[k], clean[k])]
        np.testing.assert_array_equal(*by_group)
        assert not np.isfinite(dirty[k].reshape(3, 4, 2, 35)[1, 1]).any()


def test_channels_last_group_norm_out(rng):
    """out= in x's channels-last order is written directly, as is out=x; any other out= gets
    the same values through a copy."""
    x = channels_last(rng.standard_normal((2, 6, 4, 9)).astype(np.float32))
    w = rng.uniform(0.5, 1.5, 6).astype(np.float32)
    y = nn.group_norm(x, 3, w)
    last = np.empty_like(x)  # (empty_like keeps the order)
    assert nn.group_norm(x, 3, w, out=last) is last
    np.testing.assert_array_equal(last, y)
    for out in (np.empty(x.shape, np.float32), np.empty((2, 9, 6, 4), np.float32).transpose(0, 2, 3, 1)):
        nn.group_norm(x, 3, w, out=out)
        np.testing.assert_array_equal(out, y)
    inplace = x.copy(order="K")
    nn.group_norm(inplace, 3, w, out=inplace)
    np.testing.assert_array_equal(inplace, y)


def test_channels_last_group_norm_same_bits_a_sample_at_a_time(monkeypatch, rng):
    """Large inputs go a few samples a call (group_norm.samples_at_once): the same bits as all at once."""
    from numbanorm.cpu._kernels import group_norm
    x = channels_last(rng.standard_normal((5, 6, 3, 7)).astype(np.float32))
    dy = channels_last(rng.standard_normal(x.shape).astype(np.float32))
    w = rng.standard_normal(6).astype(np.float32)

    def calls():
        y, m, r = nn.group_norm_forward(x, 3, w, w)
        return y, m, r, *nn.group_norm_backward(dy, x, m, r, w)

    together = calls()
    monkeypatch.setattr(group_norm, "CACHE_BYTES", 1)
    assert group_norm.samples_at_once(x, 2) == 1
    for a, c in zip(calls(), together):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parallel_kernels
def test_channels_last_group_norm_bit_identical_for_any_thread_count(rng):
    """The statistics' per-block partial sums are added in one order whatever ran the blocks."""
    x = channels_last(rng.standard_normal((2, 32, 33, 35)).astype(np.float32))
    dy = channels_last(rng.standard_normal(x.shape).astype(np.float32))
    w = rng.standard_normal(32).astype(np.float32)

    def calls():
        y, m, r = nn.group_norm_forward(x, 8, w)
        return y, m, r, *nn.group_norm_backward(dy, x, m, r, w)

    _same_bits_on_one_thread_and_all(calls)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_the_oracle_keeps_nan_and_inf_in_their_row_silently(rng, bad):
    """As the kernels do, and with no RuntimeWarning from NumPy's arithmetic on the bad
    row (pyproject.toml's filterwarnings makes one from numbanorm an error)."""
    test_nan_and_inf_stay_in_their_row(ORACLE, rng, bad)


def test_large_common_offset(impl, rng):
    """mean 1e4, std 1e-2 in float32 still normalizes to unit variance within 1e-3.

    With eps=0: the default eps=1e-5 is a tenth of this row's variance (1e-4),
    so any correct kernel gives variance 1e-4 / (1e-4 + 1e-5) = 0.909 there;
    with eps the check is against the oracle instead.
    """
    x = (1e4 + 1e-2 * rng.standard_normal((4, 1024))).astype(np.float32)
    y = to_host(impl.layer_norm(x, 1024, eps=0.0)).astype(np.float64)
    np.testing.assert_allclose(y.var(axis=1), 1.0, atol=1e-3)
    np.testing.assert_allclose(y.mean(axis=1), 0.0, atol=1e-3)
    assert_close(to_host(impl.layer_norm(x, 1024)), ORACLE.layer_norm(x, 1024), np.float32)
    # the backward recomputes xhat from the saved float32 mean, which the
    # float32 grid at 1e4 (1e-3) rounds to 5% of this std: it must correct for it
    dy = rng.standard_normal((4, 1024)).astype(np.float32)
    w1 = rng.uniform(0.5, 1.5, 1024).astype(np.float32)
    _, m, r = impl.layer_norm_forward(x, 1024, w1)
    _, mr, rr = ORACLE.layer_norm_forward(x, 1024, w1)
    for got, want in zip(impl.layer_norm_backward(dy, x, m, r, 1024, w1),
                         ORACLE.layer_norm_backward(dy, x, mr, rr, 1024, w1)):
        assert_close(to_host(got), want, np.float32)
    x4 = (1e4 + 1e-2 * rng.standard_normal((2, 4, 16, 16))).astype(np.float32)
    w = np.full(4, 2.0, np.float32)
    y4 = to_host(impl.group_norm(x4, 2, w, eps=0.0)).astype(np.float64).reshape(2, 2, -1)
    np.testing.assert_allclose(y4.var(axis=2), 4.0, atol=4e-3)
    assert_close(to_host(impl.group_norm(x4, 2, w)), ORACLE.group_norm(x4, 2, w), np.float32)
    dy4 = rng.standard_normal(x4.shape).astype(np.float32)
    _, m, r = impl.group_norm_forward(x4, 2, w)
    _, mr, rr = ORACLE.group_norm_forward(x4, 2, w)
    for got, want in zip(impl.group_norm_backward(dy4, x4, m, r, w),
                         ORACLE.group_norm_backward(dy4, x4, mr, rr, w)):
        assert_close(to_host(got), want, np.float32)


@pytest.mark.parametrize("first", [1e4, 0.0], ids=["first-channel-apart", "common-offset"])
def test_channels_last_group_norm_offsets(monkeypatch, rng, first):
    """The CPU's channels-last statistics as exact as the rows': at a common offset of 1e4
    (std 1e-2), and with each group's first channel, whose first positions are its shift,
    1e4 from the others (its groups summed again from their first mean, as a row is)."""
    from numbanorm.cpu._kernels import group_norm
    passes, statistics = [], group_norm.last_statistics
    monkeypatch.setattr(group_norm, "last_statistics", lambda *a: passes.append(a[-1]) or statistics(*a))
    x = (1e4 + 1e-2 * rng.standard_normal((2, 5, 7, 8))).astype(np.float32)
    x[..., ::4] -= np.float32(first)  # channels 0 and 4, the groups' first ones, apart
    x = channels_last(np.moveaxis(x, -1, 1))
    w = rng.uniform(0.5, 1.5, 8).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    y, m, r = nn.group_norm_forward(x, 2, w, w)
    yr, mr, rr = ORACLE.group_norm_forward(x, 2, w, w)
    for got, want in zip((y, m, r, *nn.group_norm_backward(dy, x, m, r, w)),
                         (yr, mr, rr, *ORACLE.group_norm_backward(dy, x, mr, rr, w))):
        assert_close(got, want, np.float32)
    assert passes == ([False, True] if first else [False])


def test_out_is_filled_and_returned(rng):
    x = rng.standard_normal((6, 10)).astype(np.float32)
    for out in (np.empty_like(x), np.empty((10, 6), np.float32).T):   # C-contiguous and strided
        got = nn.layer_norm(x, 10, out=out)
        assert got is out
        np.testing.assert_array_equal(out, nn.layer_norm(x, 10))
        assert nn.rms_norm(x, 10, out=out) is out
        np.testing.assert_array_equal(out, nn.rms_norm(x, 10))
    x4 = x.reshape(3, 4, 5)
    out = np.empty_like(x4)
    assert nn.group_norm(x4, 2, out=out) is out
    np.testing.assert_array_equal(out, nn.group_norm(x4, 2))


def test_out_float16(rng):
    x = rng.standard_normal((6, 10)).astype(np.float16)
    out = np.empty_like(x)
    assert nn.layer_norm(x, 10, out=out) is out
    assert_close(out, ORACLE.layer_norm(x, 10), np.float16)


def test_statistics_dtypes_and_shapes():
    for dt, acc in [(np.float16, np.float32), (np.float32, np.float32), (np.float64, np.float64)]:
        x = np.ones((2, 3, 4), dt)
        y, m, r = nn.layer_norm_forward(x, (3, 4))
        assert m.shape == (2, 1, 1) and m.dtype == acc and r.dtype == acc and y.dtype == dt
        y, r = nn.rms_norm_forward(x, 4)
        assert r.shape == (2, 3, 1) and r.dtype == acc
        y, m, r = nn.group_norm_forward(x, 3)
        assert m.shape == (2, 3) and r.dtype == acc


def test_rms_eps_none_is_machine_epsilon_of_accumulation():
    x = np.zeros((1, 4), np.float32)
    _, r = nn.rms_norm_forward(x, 4)
    assert r[0, 0] == np.float32(1 / np.sqrt(np.finfo(np.float32).eps))
    _, r = nn.rms_norm_forward(x.astype(np.float64), 4)
    assert r[0, 0] == 1 / np.sqrt(np.finfo(np.float64).eps)


def test_dweight_dtype_follows_weight_or_x():
    x = np.ones((3, 4), np.float16)
    _, m, r = nn.layer_norm_forward(x, 4)
    dx, dw, db = nn.layer_norm_backward(x, x, m, r, 4)
    assert dx.dtype == dw.dtype == db.dtype == np.float16
    dx, dw, db = nn.layer_norm_backward(x, x, m, r, 4, np.ones(4, np.float64))
    assert dx.dtype == np.float16 and dw.dtype == db.dtype == np.float64


def test_host_array_likes_run_on_the_cpu():
    y = nn.layer_norm([[1.0, 2.0, 3.0]], 3)
    assert isinstance(y, np.ndarray) and y.dtype == np.float64


# ---------------------------------------------------------------- layers

def test_layer_norm_layer_trains_like_the_functions(rng):
    layer = nn.LayerNorm((3, 8), dtype=np.float64)
    assert layer.weight.shape == (3, 8) and np.all(layer.weight == 1) and np.all(layer.bias == 0)
    layer.weight = rng.uniform(0.5, 1.5, (3, 8))
    x = rng.standard_normal((5, 3, 8))
    dy = rng.standard_normal((5, 3, 8))
    y = layer(x)
    dx = layer.backward(dy)
    yr, m, r = ORACLE.layer_norm_forward(x, (3, 8), layer.weight, layer.bias)
    dxr, dwr, dbr = ORACLE.layer_norm_backward(dy, x, m, r, (3, 8), layer.weight)
    for a, c in [(y, yr), (dx, dxr), (layer.grad_weight, dwr), (layer.grad_bias, dbr)]:
        assert_close(a, c, np.float64)


def test_layers_without_affine_have_no_parameters_or_grads(rng):
    x = rng.standard_normal((2, 4, 3)).astype(np.float32)
    for layer in (nn.LayerNorm(3, elementwise_affine=False), nn.RMSNorm(3, elementwise_affine=False),
                  nn.GroupNorm(2, 4, affine=False)):
        layer(x)
        dx = layer.backward(np.ones_like(x))
        assert dx.shape == x.shape
        assert layer.weight is None and layer.bias is None
        assert layer.grad_weight is None and layer.grad_bias is None
    layer = nn.LayerNorm(3, bias=False)
    layer(x)
    layer.backward(x)
    assert layer.bias is None and layer.grad_bias is None and layer.grad_weight.shape == (3,)


def test_rms_and_group_norm_layers(rng):
    x = rng.standard_normal((2, 4, 3)).astype(np.float32)
    rms = nn.RMSNorm(3)
    np.testing.assert_array_equal(rms(x), nn.rms_norm(x, 3, rms.weight))
    rms.backward(x)
    assert rms.grad_weight.shape == (3,) and rms.grad_bias is None
    gn = nn.GroupNorm(2, 4)
    np.testing.assert_array_equal(gn(x), nn.group_norm(x, 2, gn.weight, gn.bias))
    gn.backward(x)
    assert gn.grad_weight.shape == (4,) and gn.grad_bias.shape == (4,)
    with pytest.raises(ValueError):
        nn.GroupNorm(3, 4)
