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
   their parallelism.  Batch chunks are split where a block would otherwise grow past
   the larger of ``x``'s largest block and dask's ``array.chunk-size`` (``_bounded``);
3. one task per block calls the top-level numbanorm function on it (NumPy
   blocks run the CPU kernels; CuPy blocks would run the GPU ones), returning
   all of its outputs at once (a backward's ``dweight``/``dbias`` unrounded, in
   the accumulation dtype); each output is a light ``getitem`` layer over
   those tasks;
4. ``dweight``/``dbias`` are summed from per-row-block partials with a tree
   reduction (``sum(split_every=...)``), in the accumulation dtype, then cast to
   the weight's dtype as the in-memory backward does.

Each block is a set of whole rows, so ``y``, ``mean``, ``rstd`` and ``dx`` are
bit-for-bit what numbanorm gives on the computed array in C order (a group norm's
blocks are made C order, so its bits do not follow the blocks' memory order);
``dweight``/``dbias`` add the same per-row terms in another order and agree to float
tolerance.
"""

from __future__ import annotations

import functools
import math
import operator

import dask
import dask.array as da
import numpy as np
from dask.array.utils import meta_from_array
from dask.base import tokenize
from dask.utils import parse_bytes
from dask.highlevelgraph import HighLevelGraph

import numbanorm as _numbanorm  # the top-level functions: each block runs one

from . import _api
from . import _validate as V
from ._dispatch import _pick
from .cpu import _backend as _cpu_backend  # (its cast of a gradient, which the in-memory call makes)
from .operations import BY_NAME, KINDS, OPERATIONS, generate

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


# ------------------------------------------------------------ graph pieces

def _as_dask(name, a):
    """``a`` as a Dask array (NumPy arrays become one chunk); None stays None."""
    if a is None or isinstance(a, da.Array):
        if a is not None and any(math.isnan(d) for d in a.shape):
            raise ValueError(f"`{name}` has unknown chunk sizes {a.shape}; call "
                             f"{name}.compute_chunk_sizes() first")
        return a
    if isinstance(a, np.ndarray) or not hasattr(a, "dtype"):
        a = V.host_array(name, a)  # (a list of floats, as the top level takes it; a masked array refused)
    return da.from_array(a, chunks=-1) if isinstance(a, np.ndarray) else da.asarray(a)


def _no_out(out):
    if out is not None:
        raise TypeError("`out=` is not supported on Dask arrays: their results are lazy; "
                        "use dask.array.store to write them somewhere")


def _meta_side(**arrays):
    """The top level's host/device check, on the blocks' types (``_meta``), and its refusal
    of masked arrays, whose blocks' masked elements would be normalized as data."""
    for name, a in arrays.items():
        if isinstance(getattr(a, "_meta", None), np.ma.MaskedArray):
            raise TypeError(f"`{name}` is a masked Dask array, whose masked elements numbanorm would "
                            f"normalize as data: pass `dask.array.ma.filled({name}, ...)`, or the values to keep")
    V.common_side(**{k: getattr(a, "_meta", a) for k, a in arrays.items()})


def _single(a, chunks=None):
    """A small parameter in one chunk (or in ``chunks``, its one axis's); None stays None."""
    if a is None:
        return None
    # (chunks,): a bare tuple of a 1-D array's chunk sizes reads as one size per axis
    return a.rechunk(-1 if chunks is None else (chunks,))


def _tuple_blocks(name, fn, ind, *arginds, **kwargs):
    """One task per block of ``ind``, each returning a tuple of NumPy arrays."""
    return da.blockwise(fn, ind, *arginds, name=name, meta=np.empty((0,) * len(ind), object),
                        concatenate=True, **kwargs)


def _leaf(tmp, i, chunks, dtype, name, like):
    """Output ``i`` of ``tmp``'s tuple blocks as an array of ``chunks``, of the block type of
    ``like`` (x: a CuPy-backed x's results are CuPy blocks, which a backward takes with it).

    The leaf's block index is the first ``len(chunks)`` entries of tmp's (the
    dropped trailing axes of tmp are single chunks).
    """
    nd = len(chunks)
    dsk = {(name,) + key[1:1 + nd]: (operator.getitem, key, i)
           for key in _flatten(tmp.__dask_keys__())}
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=[tmp])
    return da.Array(graph, name, chunks=chunks, dtype=dtype, meta=meta_from_array(like, nd, dtype))


def _bounded(x, chunks, splittable):
    """``chunks`` (axis -> chunks, -1 for whole, as ``rechunk`` takes them) with the chunks of
    the ``splittable`` axes, ``(axis, quantum)`` pairs outermost first, split where a block
    would grow past the larger of ``x``'s largest block and dask's ``array.chunk-size``:
    merging the normalized axes of a thinly chunked array multiplies each block's memory
    (an array chunked 8 columns wide, by a row of 1024 over 8).  A quantum keeps a group
    whole; no block is split below one quantum of its axis."""
    itemsize = x.dtype.itemsize
    limit = max(itemsize * math.prod(max(c, default=0) for c in x.chunks),
                parse_bytes(dask.config.get("array.chunk-size")))
    sizes = [x.chunks[ax] if ax not in chunks else (x.shape[ax],) if chunks[ax] == -1 else chunks[ax]
             for ax in range(x.ndim)]
    out = dict(chunks)
    for ax, q in splittable:
        unit = itemsize * math.prod(max(c, default=0) for b, c in enumerate(sizes) if b != ax)
        if unit == 0:
            break
        most = max(q, limit // unit // q * q)
        if max(sizes[ax], default=0) > most:
            sizes[ax] = out[ax] = tuple(p for c in sizes[ax] for p in _split(c, most, q))
        if unit * q <= limit:
            break
    return out


def _split(c, most, q):
    """A chunk of ``c`` in near-equal parts of at most ``most``, each a multiple of ``q``."""
    units, per = c // q, most // q
    if units <= per:
        return (c,)
    n = -(-units // per)
    base, extra = divmod(units, n)
    return tuple((base + (i < extra)) * q for i in range(n))


def _flatten(keys):
    for k in keys:
        if isinstance(k, list):
            yield from _flatten(k)
        else:
            yield k


def _tree_sum(partials, axes, dtype, acc):
    """Sum per-block partials over ``axes`` as a tree, in ``acc``, cast to ``dtype`` as the
    in-memory call casts (a sum past ``dtype``'s largest value is inf, unwarned)."""
    summed = partials.astype(acc).sum(axis=axes, dtype=acc)
    return summed.map_blocks(_cpu_backend._cast, dtype, dtype=dtype, meta=meta_from_array(summed, summed.ndim, dtype))


# ------------------------------------------------------------ layouts
#
# How a layout of the table (``numbanorm.operations``) becomes blocks: which axes
# a block holds whole, how parameters and statistics are chunked alongside x,
# and over which axes the per-block dweight/dbias partials are summed.


class _Rows:
    """Each normalized row whole in one block: the normalized axes merged into one chunk."""

    align = True  # the blocks' arrays are chunked alike already; dask may align them

    def __init__(self, x, normalized_shape):
        self.xdt = V.float_dtype("x", x)
        _, _, nshape = V.rows(x.shape, normalized_shape)
        nb = x.ndim - len(nshape)
        self.x = x.rechunk(_bounded(x, {ax: -1 for ax in range(nb, x.ndim)}, [(ax, 1) for ax in range(nb)]))
        self.ind = _LETTERS[: x.ndim]
        self.params, self.key = nshape, nshape
        self.block_kwargs = {"shape": nshape, "group_size": None, "batch_dims": nb}
        self.param_ind = self.ind[nb:]
        self.stat_chunks = self.x.chunks[:nb] + ((1,),) * len(nshape)  # keep-dims, as the top level returns them
        self.part_chunks = tuple((1,) * len(c) for c in self.x.chunks[:nb]) + self.x.chunks[nb:]
        self.batch_axes = tuple(range(nb))
        self._nb = nb

    @classmethod
    def of_backward(cls, x, normalized_shape, stats):
        return cls(x, normalized_shape)

    def param(self, a):
        return _single(a)

    def stat(self, name, a):
        """Saved statistics (keep-dims or plain batch shape) as plain batch-shaped, x's row chunks."""
        nb, k = self._nb, len(self.params)
        V.stats(name, a, self.x.shape, self.x.shape[:nb], k)
        if a.ndim != nb:
            a = a[(Ellipsis,) + (0,) * k]
        return a.rechunk(self.x.chunks[:nb]), self.ind[:nb]


def _group_chunks(chunks, cg, c):
    """Channel chunks moved to group boundaries (multiples of ``cg``), empty ones dropped."""
    ends = {min(c, -(-e // cg) * cg) for e in np.cumsum(chunks)} | {c}
    ends = sorted(e for e in ends if e > 0)
    return tuple(np.diff([0] + ends).tolist())


class _Groups:
    """Each (sample, group) whole in one block: spatial axes merged, channel chunks moved to
    group boundaries, so channel-chunked inputs keep their parallelism."""

    # the statistics' group axis has its own index letter: its chunks are the channel
    # chunks divided by the group size, so its blocks pair with x's channel blocks
    align = False

    def __init__(self, x, num_groups):
        self.xdt = V.float_dtype("x", x)
        _, c, _, g = V.groups(x.shape, num_groups)
        cg = c // g
        chunks = {1: _group_chunks(x.chunks[1], cg, c)}
        chunks.update({ax: -1 for ax in range(2, x.ndim)})
        self.x = x.rechunk(_bounded(x, chunks, [(0, 1), (1, cg)]))
        self.ind = _LETTERS[: x.ndim]
        self.params, self.key = (c,), num_groups
        self.block_kwargs = {"shape": None, "group_size": cg, "batch_dims": 1}
        self.param_ind = "b"
        cch = self.x.chunks[1]
        self.stat_chunks = (self.x.chunks[0], tuple(k // cg for k in cch))
        self.part_chunks = ((1,) * len(self.x.chunks[0]), cch)
        self.batch_axes = 0
        self._g = g

    @classmethod
    def of_backward(cls, x, normalized_shape, stats):
        """The backward takes no num_groups: the first statistic's shape (N, G) tells it."""
        V.float_dtype("x", x)
        name, a = stats[0]
        V.float_dtype(name, a)
        if a.ndim != 2:
            raise ValueError(f"`{name}` has shape {tuple(a.shape)}, expected (N, num_groups)")
        return cls(x, a.shape[1])

    def param(self, a):
        return _single(a, self.x.chunks[1])

    def stat(self, name, a):
        V.group_stats(name, a, self.x.shape[0], self._g, self.x.shape)
        return a.rechunk(self.stat_chunks), "ab"


_LAYOUTS = {"rows": _Rows, "groups": _Groups}


# ------------------------------------------------------------ one task per block

def _c_order(a):
    """A group norm's host block in C order: a block that is a channels-last view (a
    transposed NHWC source) would take the channels-last kernels, whose sums agree with C
    order's to rounding only, and a block's order follows its chunking and its scheduler
    (a process scheduler's pickling makes it C order)."""
    return np.ascontiguousarray(a) if isinstance(a, np.ndarray) and not a.flags.c_contiguous else a


def _forward_block(x, *params, operation, shape, group_size, batch_dims, eps):
    """numbanorm's forward of ``operation`` on one block (a group norm block's
    num_groups from its channels)."""
    op = BY_NAME[operation]
    x = _c_order(x) if group_size is not None else x
    values = {"x": x, op.shape_role: shape if group_size is None else x.shape[1] // group_size,
              **dict(zip(op.params, params)), "eps": eps}
    return op.call(_numbanorm, "forward", values)


class _Partials(_api.Frontend):
    """A backend's front end whose backward returns dweight/dbias in the accumulation dtype:
    a block's partial sums, which the tree adds before the one rounding, as the in-memory
    call rounds its whole sums once (into a 16-bit x's dtype without a weight: a partial
    rounded there first could overflow, or lose a difference the other partials cancel).
    No plan cache: the backend's is shared with its public front end, whose results'
    dtypes differ."""

    @staticmethod
    def _grad_dtype(weight, xdt):
        return V.acc_dtype(xdt)


@functools.lru_cache(maxsize=None)
def _partials(backend):
    return _Partials(backend, plans=False)


def _backward_block(dy, x, *rest, operation, shape, group_size, batch_dims):
    """numbanorm's backward on one block; dweight/dbias as partials in the accumulation
    dtype with ``batch_dims`` axes of 1."""
    op = BY_NAME[operation]
    if group_size is not None:
        dy, x = _c_order(dy), _c_order(x)
    *stats, weight = rest
    values = {"dy": dy, "x": x, **dict(zip(op.stats, stats)), "normalized_shape": shape, "weight": weight}
    dx, *dparams = op.call(_partials(_pick(dy=dy, x=x).backend), "backward", values)  # (the top level's backend)
    return (dx, *(d.reshape((1,) * batch_dims + d.shape) for d in dparams))


# ------------------------------------------------------------ the two paths

def _forward(op, args):
    """Lazy forward of ``op``: ``args`` in the table's role order."""
    given = dict(zip(op.forward_roles, args))
    a = {r: _as_dask(r, given[r]) for r in op.forward_arrays}
    _meta_side(**a)
    plan = _LAYOUTS[op.layout](a["x"], given[op.shape_role])
    for r in op.params:
        V.param(r, a[r], plan.params)
    eps = V.rms_eps(given["eps"], plan.xdt) if op.eps is None else V.check_eps(given["eps"], plan.xdt)
    x, acc = plan.x, V.acc_dtype(plan.xdt)
    params = [a[r] for r in op.params]
    tok = tokenize(x, plan.key, *params, eps)
    param_args = [arg for p in params for arg in (plan.param(p), plan.param_ind if p is not None else None)]
    tmp = _tuple_blocks(f"{op.name}_forward-{tok}", _forward_block, plan.ind, x, plan.ind, *param_args,
                        operation=op.name, eps=eps, **plan.block_kwargs)
    return (_leaf(tmp, 0, x.chunks, plan.xdt, f"{op.name}-y-{tok}", x),
            *(_leaf(tmp, i, plan.stat_chunks, acc, f"{op.name}-{r}-{tok}", x) for i, r in enumerate(op.stats, 1)))


def _backward(op, args):
    """Lazy backward of ``op``; dweight/dbias are tree reductions over the blocks' partials."""
    given = dict(zip(op.backward_roles, args))
    a = {r: _as_dask(r, given[r]) for r in op.backward_arrays}
    _meta_side(**a)
    plan = _LAYOUTS[op.layout].of_backward(a["x"], given.get("normalized_shape"), [(r, a[r]) for r in op.stats])
    x, xdt, weight = plan.x, plan.xdt, a["weight"]
    V.same_as_x("dy", a["dy"], x.shape, xdt, check_dtype=False)
    stats = [plan.stat(r, a[r]) for r in op.stats]
    V.param("weight", weight, plan.params)
    acc = V.acc_dtype(xdt)
    dy = a["dy"].rechunk(x.chunks)
    tok = tokenize(dy, x, *(st for st, _ in stats), plan.key, weight)
    tmp = _tuple_blocks(f"{op.name}_backward-{tok}", _backward_block, plan.ind, dy, plan.ind, x, plan.ind,
                        *(arg for st in stats for arg in st),
                        plan.param(weight), plan.param_ind if weight is not None else None,
                        operation=op.name, align_arrays=plan.align, **plan.block_kwargs)
    pdt = weight.dtype if weight is not None else xdt  # as the in-memory backward returns them
    grads = (_leaf(tmp, i, plan.part_chunks, acc, f"{op.name}-d{r[0]}-part-{tok}", x)
             for i, r in enumerate(op.params, 1))
    return (_leaf(tmp, 0, x.chunks, xdt, f"{op.name}-dx-{tok}", x),
            *(_tree_sum(g, plan.batch_axes, pdt, acc) for g in grads))


def _plain(op, args, out):
    _no_out(out)
    return _forward(op, args)[0]


# ------------------------------------------------------------ the functions, from the table

def _function(op, kind):
    """The lazy public function ``kind`` of ``op``, with the top level's signature."""
    sig = op.signature(kind)
    roles = ", ".join(op.backward_roles if kind == "backward" else op.forward_roles)
    body = {"plain": f"_plain(_op, ({roles},), out)", "forward": f"_forward(_op, ({roles},))",
            "backward": f"_backward(_op, ({roles},))"}[kind]
    namespace = {"_op": op, "_plain": _plain, "_forward": _forward, "_backward": _backward}
    fn = generate(op.function(kind), sig, body, namespace, op.doc(kind, "dask"), __name__)
    fn.__module__ = __name__
    return fn


# the fused operations have no lazy form: s would be one more output of the same blocks, added when wanted
_OPERATIONS = [op for op in OPERATIONS if not op.fused]
for _op in _OPERATIONS:
    for _kind in KINDS:
        globals()[_op.function(_kind)] = _function(_op, _kind)
del _op, _kind

__all__ = [f for op in _OPERATIONS for f in op.functions]
