"""numbanorm.dask against numbanorm on the computed array: threaded scheduler and a real LocalCluster.

Forward outputs and dx are compared bit for bit (each block is a set of whole
rows, run by the same kernels); dweight/dbias, summed over row blocks in
another order, to the dtype's tolerance.
"""

import logging
import re

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")

import numbanorm  # noqa: E402
import numbanorm.dask as nd  # noqa: E402
from conftest import assert_close  # noqa: E402

DTYPES = [np.float16, np.float32, np.float64]


def data(rng, shape, dtype, low=None):
    if low is not None:
        return rng.uniform(low, low + 1, shape).astype(dtype)
    return (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)


def check(lazy, eager, dtype, exact, what):
    """``lazy`` (computed) against ``eager``: bit for bit, or to ``dtype``'s tolerance."""
    assert isinstance(lazy, np.ndarray) and lazy.dtype == eager.dtype and lazy.shape == eager.shape, what
    if exact:
        np.testing.assert_array_equal(lazy, eager, err_msg=what)
    else:
        assert_close(lazy, eager, dtype, what)


# (shape, normalized dims, chunks): along rows only, along the normalized axes
# too (merged by the function), several batch axes, one block
ROW_CASES = [
    ((37, 64), 1, (10, 64)),
    ((37, 64), 1, (9, 20)),
    ((6, 5, 48), 2, (4, 2, 16)),
    ((3, 4, 5, 6), 1, (2, 3, 5, 4)),
    ((11, 30), 1, -1),
]
# (shape, groups, chunks): channels split inside groups, spatial axes chunked, instance norm,
# channel chunks of unequal sizes on group boundaries (the weight's chunks follow them)
GROUP_CASES = [
    ((2, 6, 3), 3, (2, (1, 4, 1), 3)),
    ((7, 12, 5, 4), 4, (3, 5, 2, 4)),
    ((5, 8, 33), 8, (2, 3, 10)),
    ((6, 6, 9), 1, (4, 2, 9)),
    ((4, 6, 10), 3, (1, 2, 10)),
]


def _compute(*arrays, **kw):
    return dask.compute(*arrays, **kw)


def run_layer_norm(rng, dtype, shape, k, chunks, weight_kind, **compute_kw):
    ns = shape[len(shape) - k:]
    x, dy = data(rng, shape, dtype), data(rng, shape, dtype)
    w = data(rng, ns, dtype, low=0.5) if weight_kind != "none" else None
    b = data(rng, ns, dtype) if weight_kind != "none" else None
    X, DY = da.from_array(x, chunks=chunks), da.from_array(dy, chunks=chunks)
    W = da.from_array(w, chunks=tuple(max(1, d // 2) for d in ns)) if weight_kind == "dask" else w
    y, mean, rstd = nd.layer_norm_forward(X, ns, W, b, 1e-5)
    assert all(isinstance(a, da.Array) for a in (y, mean, rstd))
    dx, dw, db = nd.layer_norm_backward(DY, X, mean, rstd, ns, W)
    got = _compute(y, mean, rstd, dx, dw, db, **compute_kw)
    ye, me, re_ = numbanorm.layer_norm_forward(x, ns, w, b, 1e-5)
    dxe, dwe, dbe = numbanorm.layer_norm_backward(dy, x, me, re_, ns, w)
    for g, e, exact, what in zip(got, (ye, me, re_, dxe, dwe, dbe), (1, 1, 1, 1, 0, 0),
                                 ("y", "mean", "rstd", "dx", "dweight", "dbias")):
        check(g, e, dtype, exact, f"{what} {shape} {chunks}")
    np.testing.assert_array_equal(nd.layer_norm(X, ns, W, b).compute(**compute_kw), ye)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_kind", ["none", "numpy", "dask"])
def test_layer_norm(rng, dtype, weight_kind):
    for shape, k, chunks in ROW_CASES:
        run_layer_norm(rng, dtype, shape, k, chunks, weight_kind, scheduler="threads")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_kind", ["none", "numpy", "dask"])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rms_norm(rng, dtype, weight_kind, eps):
    for shape, k, chunks in ROW_CASES:
        ns = shape[len(shape) - k:]
        x, dy = data(rng, shape, dtype), data(rng, shape, dtype)
        w = data(rng, ns, dtype, low=0.5) if weight_kind != "none" else None
        W = da.from_array(w, chunks=1) if weight_kind == "dask" else w
        X = da.from_array(x, chunks=chunks)
        y, rstd = nd.rms_norm_forward(X, ns, W, eps)
        # statistics may come back in the plain batch shape too (the contract accepts both)
        dx, dw = nd.rms_norm_backward(da.from_array(dy, chunks=chunks), X, rstd.reshape(shape[: len(shape) - k]),
                                      ns, W)
        got = _compute(y, rstd, dx, dw, scheduler="threads")
        ye, re_ = numbanorm.rms_norm_forward(x, ns, w, eps)
        dxe, dwe = numbanorm.rms_norm_backward(dy, x, re_, ns, w)
        for g, e, exact, what in zip(got, (ye, re_, dxe, dwe), (1, 1, 1, 0), ("y", "rstd", "dx", "dweight")):
            check(g, e, dtype, exact, f"{what} {shape} {chunks}")
        np.testing.assert_array_equal(nd.rms_norm(X, ns, W, eps).compute(scheduler="threads"), ye)


def run_group_norm(rng, dtype, shape, g, chunks, weight_kind, **compute_kw):
    c = shape[1]
    x, dy = data(rng, shape, dtype), data(rng, shape, dtype)
    w = data(rng, (c,), dtype, low=0.5) if weight_kind != "none" else None
    b = data(rng, (c,), dtype) if weight_kind != "none" else None
    W = da.from_array(w, chunks=max(1, c // 3)) if weight_kind == "dask" else w
    X = da.from_array(x, chunks=chunks)
    y, mean, rstd = nd.group_norm_forward(X, g, W, b)
    assert mean.shape == (shape[0], g)
    # channel chunks land on group boundaries, spatial axes are whole
    assert all(ch % (c // g) == 0 for ch in y.chunks[1]) and all(len(ch) == 1 for ch in y.chunks[2:])
    dx, dw, db = nd.group_norm_backward(da.from_array(dy, chunks=chunks), X, mean, rstd, W)
    got = _compute(y, mean, rstd, dx, dw, db, **compute_kw)
    ye, me, re_ = numbanorm.group_norm_forward(x, g, w, b)
    dxe, dwe, dbe = numbanorm.group_norm_backward(dy, x, me, re_, w)
    for gv, e, exact, what in zip(got, (ye, me, re_, dxe, dwe, dbe), (1, 1, 1, 1, 0, 0),
                                  ("y", "mean", "rstd", "dx", "dweight", "dbias")):
        check(gv, e, dtype, exact, f"{what} {shape} G={g} {chunks}")
    np.testing.assert_array_equal(nd.group_norm(X, g, W, b).compute(**compute_kw), ye)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_kind", ["none", "numpy", "dask"])
def test_group_norm(rng, dtype, weight_kind):
    for shape, g, chunks in GROUP_CASES:
        run_group_norm(rng, dtype, shape, g, chunks, weight_kind, scheduler="threads")


def test_numpy_inputs_and_empty_batch(rng):
    x = data(rng, (5, 16), np.float32)
    np.testing.assert_array_equal(nd.layer_norm(x, 16).compute(), numbanorm.layer_norm(x, 16))
    e = da.zeros((0, 16), np.float32, chunks=(4, 8))
    y, mean, rstd = dask.compute(*nd.layer_norm_forward(e, 16))
    assert y.shape == (0, 16) and mean.shape == (0, 1)
    dx, dw, db = dask.compute(*nd.layer_norm_backward(e, e, mean, rstd, 16))
    assert dx.shape == (0, 16) and dw.shape == (16,)
    np.testing.assert_array_equal(dw, 0)


def test_lazy_until_computed(rng):
    calls = []

    def source(block):
        calls.append(block.shape)
        return block

    x = da.from_array(data(rng, (20, 12), np.float32), chunks=(5, 6)).map_blocks(source, meta=np.empty((0, 0), np.float32))
    outs = [*nd.layer_norm_forward(x, 12), nd.rms_norm(x, 12), nd.group_norm(x.reshape(20, 3, 4), 3)]
    y, mean, rstd = outs[:3]
    outs += list(nd.layer_norm_backward(x, x, mean, rstd, 12, np.ones(12, np.float32)))
    assert calls == [] and all(isinstance(o, da.Array) for o in outs)
    outs[-1].compute(scheduler="sync")
    assert calls


# ------------------------------------------------------------ errors at graph construction

def _same_error(lazy, eager):
    with pytest.raises(Exception) as want:
        eager()
    with pytest.raises(want.type, match=re.escape(str(want.value))):
        lazy()


def test_errors_at_graph_construction(rng):
    x = data(rng, (6, 8), np.float32)
    X = da.from_array(x, chunks=(3, 4))
    xi = np.ones((6, 8), np.int32)
    g = data(rng, (4, 6, 5), np.float32)
    G = da.from_array(g, chunks=(2, 2, 5))
    m, r = numbanorm.layer_norm_forward(x, 8)[1:]
    gm, gr = numbanorm.group_norm_forward(g, 3)[1:]
    cases = [
        (lambda: nd.layer_norm(X, 7), lambda: numbanorm.layer_norm(x, 7)),
        (lambda: nd.layer_norm(X, (2, 8)), lambda: numbanorm.layer_norm(x, (2, 8))),
        (lambda: nd.layer_norm(da.from_array(xi), 8), lambda: numbanorm.layer_norm(xi, 8)),
        (lambda: nd.layer_norm(X, 8, np.ones(7, np.float32)), lambda: numbanorm.layer_norm(x, 8, np.ones(7, np.float32))),
        (lambda: nd.layer_norm(X, 8, None, da.ones(9, chunks=3)), lambda: numbanorm.layer_norm(x, 8, None, np.ones(9))),
        (lambda: nd.layer_norm(X, 8, eps=-1.0), lambda: numbanorm.layer_norm(x, 8, eps=-1.0)),
        (lambda: nd.rms_norm(X, 8, eps=float("nan")), lambda: numbanorm.rms_norm(x, 8, eps=float("nan"))),
        (lambda: nd.rms_norm_forward(X, 0), lambda: numbanorm.rms_norm_forward(x, 0)),
        (lambda: nd.layer_norm_backward(X[:5], X, m, r, 8), lambda: numbanorm.layer_norm_backward(x[:5], x, m, r, 8)),
        (lambda: nd.layer_norm_backward(X, X, m[:3], r, 8), lambda: numbanorm.layer_norm_backward(x, x, m[:3], r, 8)),
        (lambda: nd.rms_norm_backward(X, X, r.reshape(3, 2), 8),
         lambda: numbanorm.rms_norm_backward(x, x, r.reshape(3, 2), 8)),
        (lambda: nd.group_norm(G, 4), lambda: numbanorm.group_norm(g, 4)),
        (lambda: nd.group_norm(G, 0), lambda: numbanorm.group_norm(g, 0)),
        (lambda: nd.group_norm(G, 3, np.ones(5)), lambda: numbanorm.group_norm(g, 3, np.ones(5))),
        (lambda: nd.group_norm(G[0, 0], 1), lambda: numbanorm.group_norm(g[0, 0], 1)),
        (lambda: nd.group_norm_backward(G, G, gm[:, :2], gr), lambda: numbanorm.group_norm_backward(g, g, gm[:, :2], gr)),
        (lambda: nd.group_norm_backward(G[:3], G, gm, gr), lambda: numbanorm.group_norm_backward(g[:3], g, gm, gr)),
        # x's checks before the weight's, as at the top level (the weight's dtype came first)
        (lambda: nd.layer_norm(X, 7, np.ones(8, np.int64)), lambda: numbanorm.layer_norm(x, 7, np.ones(8, np.int64))),
        # a masked array's masked elements would be normalized as data (its mask was dropped)
        (lambda: nd.layer_norm(np.ma.masked_greater(x, 1), 8), lambda: numbanorm.layer_norm(np.ma.masked_greater(x, 1), 8)),
        (lambda: nd.rms_norm(X, 8, np.ma.masked_equal(np.ones(8), 1)),
         lambda: numbanorm.rms_norm(x, 8, np.ma.masked_equal(np.ones(8), 1))),
    ]
    for lazy, eager in cases:
        _same_error(lazy, eager)
    with pytest.raises(TypeError, match="out="):
        nd.layer_norm(X, 8, out=np.empty((6, 8), np.float32))
    with pytest.raises(ValueError, match="unknown chunk sizes"):
        nd.layer_norm(X[X[:, 0] > 0], 8)
    with pytest.raises(TypeError, match="`x` is a masked Dask array"):  # (its blocks refused at compute only)
        nd.layer_norm(da.ma.masked_greater(X, 1), 8)
    with pytest.raises(TypeError, match="`dy` is a masked Dask array"):
        nd.rms_norm_backward(da.ma.masked_greater(X, 1), X, r, 8)


class _DeviceBlocks(np.ndarray):
    """Blocks numbanorm takes for GPU memory (a CUDA Array Interface), as CuPy's are: the type
    of a Dask array's ``_meta``, which is all a graph is built from (never computed here)."""

    __cuda_array_interface__ = {}


def test_results_of_gpu_blocks_are_gpu_blocks_and_their_backward_builds():
    """A CuPy-backed x's results had NumPy metas: Dask took them for host arrays, and the
    backward of that forward was refused as host statistics among GPU arrays.  Every result
    (y, the statistics, dx, the summed dweight/dbias) has x's block type now."""
    def dev(a, chunks):
        return da.from_array(np.asarray(a).view(_DeviceBlocks), chunks=chunks, asarray=False)

    X, W = dev(np.ones((6, 8), np.float32), (3, 4)), dev(np.ones(8, np.float32), 4)
    G = dev(np.ones((2, 6, 5), np.float32), (1, 2, 5))
    fwd = {"layer": nd.layer_norm_forward(X, 8, W, W), "rms": nd.rms_norm_forward(X, 8, W),
           "group": nd.group_norm_forward(G, 3, W[:6], W[:6])}
    bwd = {"layer": nd.layer_norm_backward(X, X, *fwd["layer"][1:], 8, W),
           "rms": nd.rms_norm_backward(X, X, *fwd["rms"][1:], 8, W),
           "group": nd.group_norm_backward(G, G, *fwd["group"][1:], W[:6])}
    for name in fwd:
        for a in (*fwd[name], *bwd[name]):
            assert type(a._meta) is _DeviceBlocks, (name, a.name)
    assert [a.dtype for a in bwd["layer"]] == [np.float32] * 3


@pytest.mark.parametrize("chunks", [(1, 9, 7, 32), (2, 9, 7, 8)])
def test_group_norm_bits_do_not_follow_the_blocks_memory_order(rng, chunks):
    """NHWC data made NCHW lazily (a transpose: every block a channels-last view) gives the
    bits of numbanorm on the computed array in C order, forward and backward, as the same
    values stored in C order do; the blocks took the channels-last kernels, which agree to
    rounding only (half of y's elements differed in float32)."""
    nhwc = data(rng, (4, 9, 7, 32), np.float32)
    dy = data(rng, (4, 32, 9, 7), np.float32)
    X = da.from_array(nhwc, chunks=chunks).transpose(0, 3, 1, 2)
    y, m, r = nd.group_norm_forward(X, 4)
    got = dask.compute(y, m, r, nd.group_norm_backward(dy, X, m, r)[0])
    xc = np.ascontiguousarray(nhwc.transpose(0, 3, 1, 2))
    want = numbanorm.group_norm_forward(xc, 4)
    want += numbanorm.group_norm_backward(dy, xc, want[1], want[2])[:1]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


# (shape, chunks, dask's array.chunk-size, name, size argument)
BOUNDED_CASES = {
    "rows": ((512, 1024), (512, 8), "64KiB", "layer_norm", 1024),
    "rows over two batch axes": ((3, 5, 64), (3, 5, 2), "1KiB", "rms_norm", 64),
    "groups": ((8, 16, 8, 8), (8, 16, 2, 2), "8KiB", "group_norm", 4),
    "groups split inside a sample": ((2, 16, 8, 8), (2, 16, 2, 2), "2KiB", "group_norm", 4),
}


@pytest.mark.parametrize("case", BOUNDED_CASES)
def test_merged_blocks_stay_within_the_chunk_size(rng, case):
    """Merging the normalized axes of a thinly chunked array multiplied each block's memory
    (8 columns of 1024 became whole rows: 128 times the block); batch chunks, and group
    norm's channel chunks at group boundaries, are now split to keep each block within the
    larger of x's largest block and dask's array.chunk-size, with the same bits forward and
    backward."""
    shape, chunks, limit, name, size = BOUNDED_CASES[case]
    x, dy = data(rng, shape, np.float64), data(rng, shape, np.float64)
    X = da.from_array(x, chunks=chunks)
    with dask.config.set({"array.chunk-size": limit}):
        y, *stats = getattr(nd, f"{name}_forward")(X, size)
        args = (size,) if name != "group_norm" else ()
        dx = getattr(nd, f"{name}_backward")(dy, X, *stats, *args)[0]
    bound = max(dask.utils.parse_bytes(limit), 8 * np.prod(chunks))
    for a in (y, dx):
        assert 8 * np.prod([max(c) for c in a.chunks]) <= bound, a.chunks
    assert y.numblocks[0] > 1 or y.numblocks[1] > 1
    if name == "group_norm":
        assert all(c % (shape[1] // size) == 0 for c in y.chunks[1])  # (groups whole)
    want = getattr(numbanorm, f"{name}_forward")(x, size)
    want += getattr(numbanorm, f"{name}_backward")(dy, x, *want[1:], *args)[:1]
    for a, b in zip(dask.compute(y, *stats, dx), want):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------ on a real cluster

@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=None, silence_logs=logging.ERROR,
                                       timeout="60s")
    try:
        c = distributed.Client(cluster, timeout="60s")
        try:
            c.wait_for_workers(2, timeout=60)
            yield c
        finally:
            c.close(timeout=30)
    finally:
        cluster.close(timeout=30)


@pytest.mark.slow
def test_on_local_cluster(client):
    """Blocks computed in two worker processes give the same results as in memory."""
    import distributed

    rng = np.random.default_rng(99)
    workers = set()
    for shape, k, chunks in ROW_CASES[:3]:
        for dtype in (np.float32, np.float64):
            run_layer_norm(rng, dtype, shape, k, chunks, "dask", scheduler=client.get)
    for shape, g, chunks in GROUP_CASES[:2]:
        run_group_norm(rng, np.float32, shape, g, chunks, "numpy", scheduler=client.get)
    x = da.from_array(data(rng, (64, 32), np.float32), chunks=(8, 16))
    y = client.persist(nd.rms_norm(x, 32))
    distributed.wait(y, timeout=60)
    held = client.who_has(y)
    for ws in held.values():
        workers.update(ws)
    # every block lives in a worker process (which of the two is the scheduler's choice)
    assert len(held) == 8 and all(held.values()) and workers <= set(client.scheduler_info()["workers"])
    np.testing.assert_array_equal(y.compute(), numbanorm.rms_norm(x.compute(), 32))


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "group_norm"])
def test_weightless_half_gradients_are_summed_before_they_are_rounded(name):
    """float16 without a weight: dweight/dbias come back in x's dtype, rounded once from the
    float32 sums, as in memory.  Each block's partial was rounded into float16 first: partials
    past its range gave inf or NaN (+-80000 here), and cancelling ones lost their difference
    (4001 - 4000: 4001 is not a float16)."""
    x = np.tile(np.array([[1, 2], [3, 5], [2, 7], [4, 1]], np.float16), (2, 1))
    dy = np.array([[20000, 1001]] + [[20000, 1000]] * 3 + [[-20000, -1000]] * 4, np.float16)
    shape, chunks = ((8, 2, 1), (4, 2, 1)) if name == "group_norm" else ((8, 2), (4, 2))
    x, dy = x.reshape(shape), dy.reshape(shape)
    X, DY = da.from_array(x, chunks=chunks), da.from_array(dy, chunks=chunks)
    op = "group_norm" if name == "group_norm" else name
    args = (1,) if name == "group_norm" else (2,)
    stats = getattr(numbanorm, f"{op}_forward")(x, *args)[1:]
    shape_arg = () if name == "group_norm" else args
    want = getattr(numbanorm, f"{op}_backward")(dy, x, *stats, *shape_arg)
    got = _compute(*getattr(nd, f"{op}_backward")(DY, X, *stats, *shape_arg), scheduler="threads")
    np.testing.assert_array_equal(got[0], want[0])
    # the sums' terms: dy * xhat, |xhat| <= sqrt(2) in rows of two; their float32 sums in
    # another order differ by their rounding, up to a few ulps of the terms' total
    terms = np.abs(dy.astype(np.float64)).reshape(8, 2).sum(axis=0) * 2
    for g, w, what in zip(got[1:], want[1:], ("dweight", "dbias")):
        assert g.dtype == w.dtype == np.float16 and np.isfinite(g).all(), (what, g)
        bound = 2.0 ** -10 * np.abs(w.astype(np.float64)) + 4 * np.finfo(np.float32).eps * terms
        assert (np.abs(g.astype(np.float64) - w) <= bound).all(), (what, g, w, bound)
    if name != "rms_norm":
        assert got[2][1] == want[2][1] == 1  # the bias's sums are integers: exact


@pytest.mark.parametrize("name", ["layer_norm", "group_norm"])
def test_a_gradient_past_the_half_range_is_inf_without_a_warning(name):
    """float16 without a weight: a dbias past float16's largest value is inf, as in memory,
    and the cast of the summed partials warns of nothing, as the in-memory call's does."""
    import warnings

    x = np.tile(np.array([[1, 2], [3, 5]], np.float16), (4, 1))
    dy = np.full((8, 2), 60000, np.float16)
    shape, chunks, args = ((8, 2, 1), (4, 2, 1), (1,)) if name == "group_norm" else ((8, 2), (4, 2), (2,))
    x, dy = x.reshape(shape), dy.reshape(shape)
    stats = getattr(numbanorm, f"{name}_forward")(x, *args)[1:]
    shape_arg = () if name == "group_norm" else args
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = getattr(numbanorm, f"{name}_backward")(dy, x, *stats, *shape_arg)
        got = _compute(*getattr(nd, f"{name}_backward")(da.from_array(dy, chunks=chunks), da.from_array(
            x, chunks=chunks), *stats, *shape_arg), scheduler="sync")
    assert np.isinf(want[2]).all() and got[2].dtype == np.float16
    np.testing.assert_array_equal(got[2], want[2])


def test_the_top_level_refuses_a_dask_array_by_name():
    """numbanorm's functions would compute a Dask array whole into memory (np.asarray does):
    a TypeError naming the argument points to numbanorm.dask, and nothing is computed."""
    rng = np.random.default_rng(0)
    computed = []
    x = da.from_array(data(rng, (6, 8), np.float32), chunks=(3, 8)).map_blocks(
        lambda b: computed.append(b.size) or b, dtype=np.float32, meta=np.empty((0, 0), np.float32))
    w = np.ones(8, np.float32)
    with pytest.raises(TypeError, match=r"`x` is a Dask array.*numbanorm\.dask"):
        numbanorm.layer_norm(x, 8, w)
    with pytest.raises(TypeError, match="`weight` is a Dask array"):
        numbanorm.rms_norm(w[None], 8, da.from_array(w))
    assert not computed
    xs = x.compute()
    y, mean, rstd = numbanorm.layer_norm_forward(xs, 8)
    computed.clear()
    with pytest.raises(TypeError, match="`dy` is a Dask array"):
        numbanorm.layer_norm_backward(x, xs, mean, rstd, 8)
    assert not computed
    assert_close(nd.layer_norm(x, 8, w).compute(), numbanorm.layer_norm(x.compute(), 8, w), np.float32)
