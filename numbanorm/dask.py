"""numbanorm on Dask arrays: lazy LayerNorm, RMSNorm and GroupNorm, forward and backward.

    import dask.array as da
    import numbanorm.dask as nd
    x = da.random.standard_normal((1_000_000, 1024), chunks=(50_000, 256))
    y = nd.layer_norm(x, 1024, weight, bias)        # lazy; y.compute() on any scheduler

Same signatures as the top-level functions (``out=`` excepted: a lazy result has
nowhere to write).  How a call becomes a graph:

1. every argument is checked by ``numbanorm._validate`` from shapes and dtypes
   alone, so a bad call raises the top level's error when the graph is built,
   not when it is computed;
2. ``x`` (and ``dy``) are rechunked so each normalized row -- or each (sample,
   group) for group norm -- lies whole in one block: the normalized axes are
   merged into one chunk; for group norm the spatial axes are merged and the
   channel chunks moved to group boundaries, so channel-chunked inputs keep
   their parallelism.  Batch chunks are left as they are;
3. one task per block calls the top-level numbanorm function on it (NumPy
   blocks run the CPU kernels; CuPy blocks would run the GPU ones), returning
   all of its outputs at once; each output is a light ``getitem`` layer over
   those tasks;
4. ``dweight``/``dbias`` are summed from per-row-block partials with a tree
   reduction (``sum(split_every=...)``), in the accumulation dtype, then cast to
   the weight's dtype as the in-memory backward does.

Each block is a set of whole rows, so ``y``, ``mean``, ``rstd`` and ``dx`` are
bit-for-bit what numbanorm gives on the computed array; ``dweight``/``dbias``
add the same per-row terms in another order and agree to float tolerance.
"""

from __future__ import annotations

import math
import operator

import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

import numbanorm as _nn

from . import _validate as V

__all__ = [
    "layer_norm", "layer_norm_forward", "layer_norm_backward",
    "rms_norm", "rms_norm_forward", "rms_norm_backward",
    "group_norm", "group_norm_forward", "group_norm_backward",
]

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


# ------------------------------------------------------------ graph pieces

def _as_dask(name, a):
    """``a`` as a Dask array (NumPy arrays become one chunk); None stays None."""
    if a is None or isinstance(a, da.Array):
        if a is not None and any(math.isnan(d) for d in a.shape):
            raise ValueError(f"`{name}` has unknown chunk sizes {a.shape}; call "
                             f"{name}.compute_chunk_sizes() first")
        return a
    if not hasattr(a, "dtype"):
        a = np.asarray(a)  # a list of floats, as the top level takes it
    V.float_dtype(name, a)
    return da.from_array(np.asarray(a), chunks=-1) if isinstance(a, np.ndarray) else da.asarray(a)


def _no_out(out):
    if out is not None:
        raise TypeError("`out=` is not supported on Dask arrays: their results are lazy; "
                        "use dask.array.store to write them somewhere")


def _meta_side(**arrays):
    """The top level's host/device check, on the blocks' types (``_meta``)."""
    V.common_side(**{k: getattr(a, "_meta", a) for k, a in arrays.items()})


def _single(a, chunks=None):
    """A small parameter in one chunk (or ``chunks``); None stays None."""
    if a is None:
        return None
    return a.rechunk(-1 if chunks is None else chunks)


def _acc_param(a, xdt):
    """A weight as the partial backward sums want it: in the accumulation dtype.

    The kernels cast the weight to that dtype anyway, so dx is unchanged, and
    the per-block dweight comes back unrounded (float16 partials would each be
    rounded before the tree adds them).  Without a weight the partials come back
    in x's dtype: exact for float32/float64; for float16 each block's partial is
    rounded once to float16 before the float32 tree sum (passing ones instead
    would compile another kernel specialization and could change dx's last bit).
    """
    return None if a is None else a.astype(V.acc_dtype(xdt))


def _tuple_blocks(name, fn, ind, *arginds, **kwargs):
    """One task per block of ``ind``, each returning a tuple of NumPy arrays."""
    return da.blockwise(fn, ind, *arginds, name=name, meta=np.empty((0,) * len(ind), object),
                        concatenate=True, **kwargs)


def _leaf(tmp, i, chunks, dtype, name):
    """Output ``i`` of ``tmp``'s tuple blocks as an array of ``chunks``.

    The leaf's block index is the first ``len(chunks)`` entries of tmp's (the
    dropped trailing axes of tmp are single chunks).
    """
    nd = len(chunks)
    dsk = {(name,) + key[1:1 + nd]: (operator.getitem, key, i)
           for key in _flatten(tmp.__dask_keys__())}
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=[tmp])
    return da.Array(graph, name, chunks=chunks, dtype=dtype,
                    meta=np.empty((0,) * nd, dtype))


def _flatten(keys):
    for k in keys:
        if isinstance(k, list):
            yield from _flatten(k)
        else:
            yield k


def _tree_sum(partials, axes, dtype, acc):
    """Sum per-block partials over ``axes`` as a tree, in ``acc``, cast to ``dtype``."""
    return partials.astype(acc).sum(axis=axes, dtype=acc).astype(dtype)


# ------------------------------------------------------------ layer norm and RMS norm

def _rows_plan(x, normalized_shape):
    """Validate ``x`` and ``normalized_shape``; ``x`` rechunked to whole rows per block."""
    xdt = V.float_dtype("x", x)
    _, _, nshape = V.rows(x.shape, normalized_shape)
    nb = x.ndim - len(nshape)
    return xdt, nshape, nb, x.rechunk({ax: -1 for ax in range(nb, x.ndim)})


def _stats_rows(name, a, x, nb, k):
    """Saved statistics (keep-dims or plain batch shape) as plain batch-shaped, x's row chunks."""
    V.stats(name, a, x.shape, x.shape[:nb], k)
    if a.ndim != nb:
        a = a[(Ellipsis,) + (0,) * k]
    return a.rechunk(x.chunks[:nb])


def _ln_fwd_block(x, w, b, nshape, eps):
    return _nn.layer_norm_forward(x, nshape, w, b, eps)


def _rms_fwd_block(x, w, nshape, eps):
    return _nn.rms_norm_forward(x, nshape, w, eps)


def _ln_bwd_block(dy, x, mean, rstd, w, nshape):
    dx, dw, db = _nn.layer_norm_backward(dy, x, mean, rstd, nshape, w)
    one = (1,) * (x.ndim - len(nshape))
    return dx, dw.reshape(one + nshape), db.reshape(one + nshape)


def _rms_bwd_block(dy, x, rstd, w, nshape):
    dx, dw = _nn.rms_norm_backward(dy, x, rstd, nshape, w)
    return dx, dw.reshape((1,) * (x.ndim - len(nshape)) + nshape)


def layer_norm_forward(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Lazy ``(y, mean, rstd)``; statistics keep-dims, as the top level returns them."""
    x, weight, bias = _as_dask("x", x), _as_dask("weight", weight), _as_dask("bias", bias)
    _meta_side(x=x, weight=weight, bias=bias)
    xdt, nshape, nb, x = _rows_plan(x, normalized_shape)
    V.param("weight", weight, nshape)
    V.param("bias", bias, nshape)
    eps = V.check_eps(eps, xdt)
    k, acc = len(nshape), V.acc_dtype(xdt)
    ind = _LETTERS[: x.ndim]
    tok = tokenize(x, nshape, weight, bias, eps)
    tmp = _tuple_blocks(f"layer_norm_forward-{tok}", _ln_fwd_block, ind, x, ind,
                        _single(weight), ind[nb:] if weight is not None else None,
                        _single(bias), ind[nb:] if bias is not None else None,
                        nshape=nshape, eps=eps)
    stat_chunks = x.chunks[:nb] + ((1,),) * k
    return (_leaf(tmp, 0, x.chunks, xdt, f"layer_norm-y-{tok}"),
            _leaf(tmp, 1, stat_chunks, acc, f"layer_norm-mean-{tok}"),
            _leaf(tmp, 2, stat_chunks, acc, f"layer_norm-rstd-{tok}"))


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, out=None):
    """Lazy LayerNorm over the trailing ``normalized_shape`` of ``x``."""
    _no_out(out)
    return layer_norm_forward(x, normalized_shape, weight, bias, eps)[0]


def layer_norm_backward(dy, x, mean, rstd, normalized_shape, weight=None):
    """Lazy ``(dx, dweight, dbias)``; dweight/dbias are tree reductions over row blocks."""
    dy, x, mean, rstd, weight = (_as_dask(n, a) for n, a in
                                 (("dy", dy), ("x", x), ("mean", mean), ("rstd", rstd), ("weight", weight)))
    _meta_side(dy=dy, x=x, mean=mean, rstd=rstd, weight=weight)
    xdt, nshape, nb, x = _rows_plan(x, normalized_shape)
    V.same_as_x("dy", dy, x.shape, xdt, check_dtype=False)
    k, acc = len(nshape), V.acc_dtype(xdt)
    mean = _stats_rows("mean", mean, x, nb, k)
    rstd = _stats_rows("rstd", rstd, x, nb, k)
    V.param("weight", weight, nshape)
    dy = dy.rechunk(x.chunks)
    ind = _LETTERS[: x.ndim]
    tok = tokenize(dy, x, mean, rstd, nshape, weight)
    tmp = _tuple_blocks(f"layer_norm_backward-{tok}", _ln_bwd_block, ind, dy, ind, x, ind,
                        mean, ind[:nb], rstd, ind[:nb],
                        _single(_acc_param(weight, xdt)), ind[nb:] if weight is not None else None,
                        nshape=nshape)
    pdt = weight.dtype if weight is not None else xdt
    part_chunks = tuple((1,) * len(c) for c in x.chunks[:nb]) + x.chunks[nb:]
    batch = tuple(range(nb))
    dw = _leaf(tmp, 1, part_chunks, acc if weight is not None else xdt, f"layer_norm-dw-part-{tok}")
    db = _leaf(tmp, 2, part_chunks, acc if weight is not None else xdt, f"layer_norm-db-part-{tok}")
    return (_leaf(tmp, 0, x.chunks, xdt, f"layer_norm-dx-{tok}"),
            _tree_sum(dw, batch, pdt, acc), _tree_sum(db, batch, pdt, acc))


def rms_norm_forward(x, normalized_shape, weight=None, eps=None):
    """Lazy ``(y, rstd)``; rstd keep-dims."""
    x, weight = _as_dask("x", x), _as_dask("weight", weight)
    _meta_side(x=x, weight=weight)
    xdt, nshape, nb, x = _rows_plan(x, normalized_shape)
    V.param("weight", weight, nshape)
    eps = V.rms_eps(eps, xdt)
    k, acc = len(nshape), V.acc_dtype(xdt)
    ind = _LETTERS[: x.ndim]
    tok = tokenize(x, nshape, weight, eps)
    tmp = _tuple_blocks(f"rms_norm_forward-{tok}", _rms_fwd_block, ind, x, ind,
                        _single(weight), ind[nb:] if weight is not None else None,
                        nshape=nshape, eps=eps)
    return (_leaf(tmp, 0, x.chunks, xdt, f"rms_norm-y-{tok}"),
            _leaf(tmp, 1, x.chunks[:nb] + ((1,),) * k, acc, f"rms_norm-rstd-{tok}"))


def rms_norm(x, normalized_shape, weight=None, eps=None, *, out=None):
    """Lazy RMSNorm over the trailing ``normalized_shape`` of ``x``."""
    _no_out(out)
    return rms_norm_forward(x, normalized_shape, weight, eps)[0]


def rms_norm_backward(dy, x, rstd, normalized_shape, weight=None):
    """Lazy ``(dx, dweight)``; dweight is a tree reduction over row blocks."""
    dy, x, rstd, weight = (_as_dask(n, a) for n, a in
                           (("dy", dy), ("x", x), ("rstd", rstd), ("weight", weight)))
    _meta_side(dy=dy, x=x, rstd=rstd, weight=weight)
    xdt, nshape, nb, x = _rows_plan(x, normalized_shape)
    V.same_as_x("dy", dy, x.shape, xdt, check_dtype=False)
    k, acc = len(nshape), V.acc_dtype(xdt)
    rstd = _stats_rows("rstd", rstd, x, nb, k)
    V.param("weight", weight, nshape)
    dy = dy.rechunk(x.chunks)
    ind = _LETTERS[: x.ndim]
    tok = tokenize(dy, x, rstd, nshape, weight)
    tmp = _tuple_blocks(f"rms_norm_backward-{tok}", _rms_bwd_block, ind, dy, ind, x, ind, rstd, ind[:nb],
                        _single(_acc_param(weight, xdt)), ind[nb:] if weight is not None else None,
                        nshape=nshape)
    pdt = weight.dtype if weight is not None else xdt
    part_chunks = tuple((1,) * len(c) for c in x.chunks[:nb]) + x.chunks[nb:]
    dw = _leaf(tmp, 1, part_chunks, acc if weight is not None else xdt, f"rms_norm-dw-part-{tok}")
    return (_leaf(tmp, 0, x.chunks, xdt, f"rms_norm-dx-{tok}"),
            _tree_sum(dw, tuple(range(nb)), pdt, acc))


# ------------------------------------------------------------ group norm

def _group_chunks(chunks, cg, c):
    """Channel chunks moved to group boundaries (multiples of ``cg``), empty ones dropped."""
    ends = {min(c, -(-e // cg) * cg) for e in np.cumsum(chunks)} | {c}
    ends = sorted(e for e in ends if e > 0)
    return tuple(np.diff([0] + ends).tolist())


def _groups_plan(x, num_groups):
    xdt = V.float_dtype("x", x)
    n, c, s, g = V.groups(x.shape, num_groups)
    cg = c // g
    chunks = {1: _group_chunks(x.chunks[1], cg, c)}
    chunks.update({ax: -1 for ax in range(2, x.ndim)})
    return xdt, c, g, cg, x.rechunk(chunks)


def _gn_fwd_block(x, w, b, cg, eps):
    return _nn.group_norm_forward(x, x.shape[1] // cg, w, b, eps)


def _gn_bwd_block(dy, x, mean, rstd, w):
    dx, dw, db = _nn.group_norm_backward(dy, x, mean, rstd, w)
    return dx, dw[None], db[None]


def group_norm_forward(x, num_groups, weight=None, bias=None, eps=1e-5):
    """Lazy ``(y, mean, rstd)``, statistics of shape ``(N, num_groups)``."""
    x, weight, bias = _as_dask("x", x), _as_dask("weight", weight), _as_dask("bias", bias)
    _meta_side(x=x, weight=weight, bias=bias)
    xdt, c, g, cg, x = _groups_plan(x, num_groups)
    V.param("weight", weight, (c,))
    V.param("bias", bias, (c,))
    eps = V.check_eps(eps, xdt)
    acc = V.acc_dtype(xdt)
    ind = _LETTERS[: x.ndim]
    tok = tokenize(x, num_groups, weight, bias, eps)
    cch = x.chunks[1]
    tmp = _tuple_blocks(f"group_norm_forward-{tok}", _gn_fwd_block, ind, x, ind,
                        _single(weight, cch), "b" if weight is not None else None,
                        _single(bias, cch), "b" if bias is not None else None,
                        cg=cg, eps=eps)
    stat_chunks = (x.chunks[0], tuple(k // cg for k in cch))
    return (_leaf(tmp, 0, x.chunks, xdt, f"group_norm-y-{tok}"),
            _leaf(tmp, 1, stat_chunks, acc, f"group_norm-mean-{tok}"),
            _leaf(tmp, 2, stat_chunks, acc, f"group_norm-rstd-{tok}"))


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, *, out=None):
    """Lazy GroupNorm of ``x`` of shape ``(N, C, *spatial)``."""
    _no_out(out)
    return group_norm_forward(x, num_groups, weight, bias, eps)[0]


def group_norm_backward(dy, x, mean, rstd, weight=None):
    """Lazy ``(dx, dweight, dbias)``; dweight/dbias are tree reductions over sample blocks."""
    dy, x, mean, rstd, weight = (_as_dask(n, a) for n, a in
                                 (("dy", dy), ("x", x), ("mean", mean), ("rstd", rstd), ("weight", weight)))
    _meta_side(dy=dy, x=x, mean=mean, rstd=rstd, weight=weight)
    V.float_dtype("x", x)
    V.float_dtype("mean", mean)
    if mean.ndim != 2:
        raise ValueError(f"`mean` has shape {tuple(mean.shape)}, expected (N, num_groups)")
    xdt, c, g, cg, x = _groups_plan(x, mean.shape[1])
    V.same_as_x("dy", dy, x.shape, xdt, check_dtype=False)
    V.group_stats("mean", mean, x.shape[0], g, x.shape)
    V.group_stats("rstd", rstd, x.shape[0], g, x.shape)
    V.param("weight", weight, (c,))
    acc = V.acc_dtype(xdt)
    dy = dy.rechunk(x.chunks)
    cch = x.chunks[1]
    stat_chunks = (x.chunks[0], tuple(k // cg for k in cch))
    ind = _LETTERS[: x.ndim]
    tok = tokenize(dy, x, mean, rstd, weight)
    # the statistics' group axis gets its own index letter: its chunks are the
    # channel chunks divided by cg, so its blocks pair with x's channel blocks
    tmp = _tuple_blocks(f"group_norm_backward-{tok}", _gn_bwd_block, ind, dy, ind, x, ind,
                        mean.rechunk(stat_chunks), "ab", rstd.rechunk(stat_chunks), "ab",
                        _single(_acc_param(weight, xdt), cch), "b" if weight is not None else None,
                        align_arrays=False)
    pdt = weight.dtype if weight is not None else xdt
    part_chunks = ((1,) * len(x.chunks[0]), cch)
    pd = acc if weight is not None else xdt
    dw = _leaf(tmp, 1, part_chunks, pd, f"group_norm-dw-part-{tok}")
    db = _leaf(tmp, 2, part_chunks, pd, f"group_norm-db-part-{tok}")
    return (_leaf(tmp, 0, x.chunks, xdt, f"group_norm-dx-{tok}"),
            _tree_sum(dw, 0, pdt, acc), _tree_sum(db, 0, pdt, acc))
