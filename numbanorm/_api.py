"""The public functions, written once for every backend.

A ``Frontend`` answers each call in three named steps:

0. **plan cache** (``PlanCache``, the backend's ``plans``): a call whose key was
   learned -- everything steps 1 and 2 decide on: types, shapes, strides, dtypes,
   scalars, and on a GPU pointer alignment, aliasing and the device -- is answered
   by its plan (``cpu._backend.Plans``: the kernel called on the call's arrays;
   ``cuda._backend.Replays``: the recorded allocations and launches, with the new
   call's pointers and stream); nothing else runs;
1. **validation** (``_check_forward``/``_check_backward``): ``common_side`` looks at
   the arguments' types only and rejects host and device arrays mixed in one call
   (the top level, which has checked already, uses a frontend made with
   ``sides_checked=True``); the backend's ``native`` views each argument as the
   backend's array type (no copy, no allocation); ``numbanorm._validate`` checks
   dtypes, shapes and scalars and works out the flattened problem.  Every contract
   error is raised here, before anything is allocated;
2. **launch** (``_launch_forward``/``_launch_backward``): the backend's
   ``call_context`` says where the call runs (on a GPU: the stream and allocator of
   the array whose type the results take, and the one GPU of all the arrays); within
   its ``on_device`` scope outputs are allocated, inputs made contiguous, the backend
   launches the norm's launcher, which fills the outputs, and the results are
   reshaped (statistics keep-dims) and handed back in the caller's array type; the
   plan cache learns the call (``Call``) where it was keyed.

The methods (``layer_norm``, ``layer_norm_forward``, ``layer_norm_backward``, ...)
are generated from ``numbanorm.operations``: each hands its arguments, in the
table's role order, to one forward or one backward path, which the operation's
row (roles, bias, statistics, fused or not) and layout (rows or groups) drive.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Any, NamedTuple, Protocol, runtime_checkable

from . import _validate as V
from . import operations as ops


@runtime_checkable
class Backend(Protocol):
    """What a backend provides (``numbanorm.cpu._backend`` and ``numbanorm.cuda._backend``).

    ``ctx`` is the backend's context of one call (``call_context``), passed
    explicitly to everything that allocates, copies or launches.

    A backend is a module; its package's ``_kernels`` holds the launchers the
    table's ``kernels`` name (``layer_norm.forward``, ...).  A forward launcher
    takes ``(x[, residual], weight[, bias], eps, y[, s], *stats)``, a backward one
    ``(dy, x, *stats, weight, dx, dweight[, dbias])`` and, for the fused norms,
    ``ds=`` (a gradient added to dx); all arrays C-contiguous and flattened.
    """

    name: str                                   # 'cpu' or 'cuda'
    grads_in_any_dtype: bool                    # the column sums store dweight/dbias in any dtype
    plans: Any                                  # its PlanCache, or None (the simulator's)


    def native(self, role: str, a: Any) -> Any:
        """A zero-copy view of ``a`` in the backend's array type (None stays None)."""

    def call_context(self, leading: Any, arrays: dict = None) -> Any:
        """Where a call whose results take ``leading``'s array type runs; ``arrays`` (the
        call's arguments by role) must be on one device where there are several
        (``ValueError`` before anything is allocated)."""

    def on_device(self, ctx: Any) -> Any:
        """The scope (``with``) in which the call allocates, launches and wraps its results."""

    def launch(self, ctx: Any, launcher: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``launcher(*args, **kwargs)`` in ``ctx``."""

    def order_of(self, a: Any) -> str:
        """The memory order in which the backend's GroupNorm launchers take ``a`` (a GroupNorm
        call's x, (N, C, *spatial)), and every other array of the call with it: ``"last"``
        where ``a`` has 4 or 5 dimensions in channels-last order and the backend has kernels
        for that order (its outputs then come back in it, as torch.nn.functional.group_norm's
        do on the CPU), else ``"C"``."""

    def contiguous(self, ctx: Any, a: Any, shape: tuple, order: str = "C") -> Any:
        """An array of ``shape`` with a's values, C-contiguous; or in ``order`` ``"last"`` (an
        ``order`` this backend's ``order_of`` gave), ``shape`` (N, C, S) in channels-last order.
        A copy only where ``a`` is not in that order already."""

    def empty(self, ctx: Any, shape: tuple, dtype: Any, order: str = "C") -> Any:
        """An uninitialised array of ``shape``, C-contiguous, or in ``order`` ``"last"`` (as
        ``contiguous``) one of ``shape`` (N, C, *spatial) in channels-last order."""

    def unkept(self, ctx: Any, shape: tuple, dtype: Any) -> Any:
        """What a forward launcher gets for statistics the call does not return (a plain
        call's): an array the kernels fill anyway (CPU), or a stand-in of that shape and
        dtype over no memory, into which the kernels store nothing (CUDA: nothing to
        allocate)."""

    def out_view(self, out: Any, shape: tuple, reads: list, order: str = "C") -> Any:
        """``out`` seen as ``shape`` if the launcher can write it directly, else None (the
        result is then computed apart and copied in): it must be in ``order`` (as
        ``contiguous``; ``"C"``: C-contiguous), and where
        the backend's launchers do not handle it, overlap none of ``reads`` (the inputs,
        x first; None for an absent one) but x itself."""

    def same_array(self, a: Any, b: Any) -> bool:
        """``a`` and ``b`` are one array: the same memory, shape and strides (an ``out`` given
        as x itself)."""

    def copy_into(self, ctx: Any, dst: Any, src: Any) -> None:
        """dst[...] = src (same size; dst may be strided)."""

    def copy(self, ctx: Any, a: Any) -> Any:
        """A new array with ``a``'s values, shape and dtype, in ``a``'s array type (``ctx``:
        ``call_context(a)``): what a layer keeps of its input for the backward."""

    def cast(self, ctx: Any, a: Any, dtype: Any) -> Any:
        """``a`` in ``dtype`` (no copy when it already is)."""

    def wrap(self, a: Any, like: Any) -> Any:
        """``a`` in the array type of the caller's ``like``."""



# ------------------------------------------------------------ layouts
#
# What differs between normalizing rows and normalizing groups: how x flattens,
# the shape of the parameters and of the statistics, and how a backward learns
# the problem (from normalized_shape, or from the statistics' group count).


class _Rows:
    """x's trailing ``normalized_shape`` normalized: x flattens to (M, N)."""

    def __init__(self, x_shape, normalized_shape):
        M, N, nshape = V.rows(x_shape, normalized_shape)
        self.flat = (M, N)                          # what the launchers see
        self.width = N                              # elements of a parameter
        self.params = nshape                        # weight's (and dweight's) shape
        self.stats = (M,)                           # statistics as the launchers see them
        self.kept = _stat_shape(x_shape, len(nshape))  # statistics as returned: keep-dims
        self._batch = tuple(x_shape[: len(x_shape) - len(nshape)])

    @classmethod
    def of_backward(cls, x_shape, normalized_shape, stats):
        return cls(x_shape, normalized_shape)

    def check_stat(self, name, a, x_shape):
        V.stats(name, a, x_shape, self._batch, len(self.params))


class _Groups:
    """x of shape (N, C, *spatial) normalized by (sample, group): x flattens to (N, C, spatial)."""

    def __init__(self, x_shape, num_groups):
        n, c, s, g = V.groups(x_shape, num_groups)
        self.flat = (n, c, s)
        self.width = c
        self.params = (c,)
        self.stats = self.kept = (n, g)

    @classmethod
    def of_backward(cls, x_shape, normalized_shape, stats):
        """The backward takes no num_groups: the first statistic's shape (N, G) tells it."""
        name, a = stats[0]
        V.float_dtype(name, a)
        if len(a.shape) != 2:
            raise ValueError(f"`{name}` has shape {tuple(a.shape)}, expected (N, num_groups)")
        return cls(x_shape, a.shape[1])

    def check_stat(self, name, a, x_shape):
        V.group_stats(name, a, self.stats[0], self.stats[1], x_shape)


LAYOUTS = {"rows": _Rows, "groups": _Groups}


def _launcher(backend, qualified):
    """The launcher ``'module.function'`` of ``backend``'s ``_kernels`` package."""
    module, function = qualified.split(".")
    return getattr(importlib.import_module(f"{backend.__package__}._kernels.{module}"), function)


# ------------------------------------------------------------ what a plan cache sees

class Checked(NamedTuple):
    """A call after validation (step 1): everything the launch depends on."""
    given: dict             # role -> the caller's argument, in the arguments' order (a forward's out= last)
    arrays: dict            # role -> the backend's view of that argument (``native``)
    x: Any                  # the view of what is normalized: x, or the fused backward's s
    dtype: Any              # x's dtype
    problem: Any            # the layout (``_Rows``/``_Groups``): flat shape, parameters, statistics
    eps: Any                # eps as validated (a forward's; None for a backward)
    leading: Any            # the caller's array whose type the results take


class Call(NamedTuple):
    """A call the full path has answered, as a plan cache learns it (``PlanCache.learn``)."""
    kind: tuple             # (operation name, 'plain', 'forward' or 'backward')
    checked: Checked        # what validation found
    acc: Any                # the accumulation dtype (statistics, column sums)
    ctx: Any                # the backend's context of the call
    results: tuple          # what the call returned


@runtime_checkable
class PlanCache(Protocol):
    """A backend's fast path for a call seen before (its ``plans``; a backend without one
    has ``plans = None``): ``numbanorm.cpu._backend.Plans`` (small calls on host arrays)
    and ``numbanorm.cuda._backend.Replays`` (recorded launches).

    ``kind`` is ``(operation name, 'plain', 'forward' or 'backward')`` (a plain call's
    results leave out the statistics); ``args`` the public
    function's arguments in the table's role order, a forward's ``out`` last.  A key
    holds everything validation and the launch's choices depend on, so a call with a
    learned key is answered by its plan alone, with the same results as the full path.
    """

    def key(self, kind: tuple, args: tuple) -> Any:
        """The call's key, or None where it cannot be keyed (the full path answers it and
        nothing is learned).  Never raises: a bad argument is validation's to report."""

    def run(self, key: Any, args: tuple) -> Any:
        """The results of a call whose key was learned (its plan run on ``args``), else None."""

    def begin(self, key: Any) -> None:
        """The full path of a keyed call has validated it and is about to allocate."""

    def learn(self, key: Any, call: Call) -> None:
        """Keep a plan of ``call`` under ``key`` if the cache can repeat it."""

    def end(self) -> None:
        """The full path of a keyed call is over (returned or raised)."""

    def shortcut(self, kind: tuple) -> Any:
        """``f(*args[, out=])`` -> ``key`` and ``run`` in one call, for a caller that asks
        before choosing a backend (the top level and numbanorm.torch ask the CPU's); None
        where the cache has no plans of ``kind``."""


# ------------------------------------------------------------ the frontend

class Frontend:
    """The public functions of one backend (``numbanorm.cpu``, ``numbanorm.cuda``).

    Each call: the backend's plan cache first (a call seen before); otherwise
    ``_check_forward``/``_check_backward`` (every contract error, nothing allocated),
    then ``_launch_forward``/``_launch_backward`` (allocation, launch, results), which
    hands the answered call to the plan cache to learn."""

    def __init__(self, backend: Backend, sides_checked: bool = False, plans: bool = True, serial: Any = None):
        self.backend = backend
        # a lock every call without a plan holds (numbanorm.cuda's in the simulator), or none
        self.serial = serial if serial is not None else contextlib.nullcontext()
        self.sides_checked = sides_checked  # the caller has run common_side on these arguments
        # each operation's (forward, backward) launchers, found once
        self.launchers = {op.name: tuple(_launcher(backend, k) for k in op.kernels) for op in ops.OPERATIONS}
        self.plans = getattr(backend, "plans", None) if plans else None

    def copy(self, a):
        """``Backend.copy`` of ``a`` in its call context: on a GPU its stream and allocator."""
        with self.serial:
            ctx = self.backend.call_context(a, {"x": a})  # (its GPU, where there are several)
            with self.backend.on_device(ctx):
                return self.backend.copy(ctx, a)

    def shortcut(self, op, direction):
        """The plan cache's ``key`` and ``run`` of ``op``'s ``direction`` as one function
        (``PlanCache.shortcut``), for a caller that asks before choosing a backend; or None."""
        return None if self.plans is None else self.plans.shortcut((op.name, direction))

    # ------------------------------------------------------------ the two paths

    def _forward(self, op, args, out, stats=True):
        """``op``'s forward on ``args``, the public function's arguments in the table's role
        order; ``stats``: the statistics are returned (a plain call's are not, and
        ``Backend.unkept`` stands for them)."""
        if stats:
            return self._answer(op, "forward", (*args, out), self._check_forward, self._launch_forward)
        return self._answer(op, "plain", (*args, out), self._check_forward, self._launch_plain)

    def _backward(self, op, args):
        """``op``'s backward on ``args``, the public function's arguments in the table's role order."""
        return self._answer(op, "backward", args, self._check_backward, self._launch_backward)

    def _answer(self, op, direction, args, check, launch):
        """The results of ``op``'s ``direction`` on ``args`` (a forward's ``out`` last): the
        plan cache's where it learned the call, else ``launch(op, check(op, args), key)``."""
        plans = self.plans
        if plans is not None:
            key = plans.key((op.name, direction), args)
            if key is not None:
                hit = plans.run(key, args)
                if hit is not None:
                    return hit
                try:
                    return launch(op, check(op, args), key)
                finally:
                    plans.end()
        with self.serial:  # (a lock only in the simulator, which has no plan cache)
            return launch(op, check(op, args), None)

    # ------------------------------------------------------------ step 1: validation

    def _check_forward(self, op, args):
        """Every contract error of a forward call (``args``: the roles', then out), before
        anything is allocated."""
        given = dict(zip(op.forward_roles, args))
        given["out"] = args[-1]
        roles = op.forward_arrays + ("out",) if op.has_out else op.forward_arrays
        a = self._native(roles, given)
        x = a["x"]
        xdt = V.float_dtype("x", x)
        if op.fused:
            V.float_dtype("residual", a["residual"])
        p = LAYOUTS[op.layout](x.shape, given[op.shape_role])
        if op.fused:
            V.same_as_x("residual", a["residual"], x.shape, xdt)
        for r in op.params:
            V.param(r, a[r], p.params)
        eps = V.rms_eps(given["eps"], xdt) if op.eps is None else V.check_eps(given["eps"], xdt)
        V.same_as_x("out", a.get("out"), x.shape, xdt, optional=True)
        return Checked(given, a, x, xdt, p, eps, given["x"])

    def _check_backward(self, op, args):
        """Every contract error of a backward call, before anything is allocated."""
        given = dict(zip(op.backward_roles, args))
        x_name = "s" if op.fused else "x"  # what was normalized: the fused norms' s = x + residual
        a = self._native(op.backward_arrays, given)
        x = a[x_name]
        xdt = V.float_dtype(x_name, x)
        p = LAYOUTS[op.layout].of_backward(x.shape, given.get("normalized_shape"),
                                           [(r, a[r]) for r in op.stats])
        V.same_as_x("dy", a["dy"], x.shape, xdt, check_dtype=False)
        if op.fused:
            V.same_as_x("ds", a["ds"], x.shape, xdt, check_dtype=False, optional=True)
        for r in op.stats:
            p.check_stat(r, a[r], x.shape)
        V.param("weight", a["weight"], p.params)
        return Checked(given, a, x, xdt, p, None, given[x_name])

    # ------------------------------------------------------------ step 2: allocation and launch

    def _launch_plain(self, op, c, key):
        return self._launch_forward(op, c, key, stats=False)

    def _launch_forward(self, op, c, key, stats=True):
        """The forward of the validated call ``c``; ``key``: a call the plan cache learns;
        ``stats``: the statistics are returned."""
        backend, a, p, x = self.backend, c.arrays, c.problem, c.x
        ctx = backend.call_context(c.leading, c.given)
        with backend.on_device(ctx):
            if key is not None:
                self.plans.begin(key)
            acc = V.acc_dtype(c.dtype)
            out, out_native = c.given["out"], a.get("out")
            order = backend.order_of(x) if op.layout == "groups" else "C"
            y, copy_back = self._output(ctx, out_native, p.flat, c.dtype, [a[r] for r in op.forward_arrays], order,
                                        x.shape)
            s = backend.empty(ctx, p.flat, c.dtype) if op.fused else None
            # in place, the statistics are kept all the same: a GPU kernel finds by them a
            # row it normalizes again from x, which y has not overwritten (``row_norm._post_fn``)
            in_place = (not stats and out_native is not None and not copy_back
                        and backend.same_array(out_native, x))
            made = backend.empty if stats or in_place else backend.unkept
            kept = [made(ctx, p.stats, acc) for _ in op.stats]
            if p.flat[0]:
                inputs = [backend.contiguous(ctx, x, p.flat, order)]
                if op.fused:
                    inputs.append(backend.contiguous(ctx, a["residual"], p.flat))
                for r in op.params:
                    inputs.append(self._param(ctx, a[r], p.width))
                outputs = (y, s) if op.fused else (y,)
                backend.launch(ctx, self.launchers[op.name][0], *inputs, c.eps, *outputs, *kept)
            results = [self._result(ctx, y, copy_back, out, out_native, x.shape, c.leading)]
            if op.fused:
                results.append(backend.wrap(s.reshape(x.shape), c.leading))
            if stats:
                results += [backend.wrap(st.reshape(p.kept), c.leading) for st in kept]
            results = tuple(results)
            if key is not None:
                self.plans.learn(key, Call((op.name, "forward" if stats else "plain"), c, acc, ctx, results))
            return results

    def _launch_backward(self, op, c, key):
        """The backward of the validated call ``c``; ``key``: a call the plan cache learns."""
        backend, a, p, x, xdt = self.backend, c.arrays, c.problem, c.x, c.dtype
        ctx = backend.call_context(c.leading, c.given)
        with backend.on_device(ctx):
            if key is not None:
                self.plans.begin(key)
            acc = V.acc_dtype(xdt)
            order = backend.order_of(x) if op.layout == "groups" else "C"
            dx = self._empty(ctx, p.flat, xdt, order, x.shape)
            grads = [backend.empty(ctx, (p.width,), self._grads_in(a["weight"], xdt, acc))
                     for _ in op.backward_outputs[1:]]  # dweight[, dbias]
            backend.launch(
                ctx, self.launchers[op.name][1],
                self._rows_like(ctx, a["dy"], p.flat, xdt, order), backend.contiguous(ctx, x, p.flat, order),
                *[self._stat(ctx, a[r], p.stats, acc) for r in op.stats],
                self._param(ctx, a["weight"], p.width), dx, *grads,
                **({"ds": self._rows_or_none(ctx, a["ds"], p.flat, xdt)} if op.fused else {}))
            grad_dtype = self._grad_dtype(a["weight"], xdt)
            results = (backend.wrap(dx.reshape(x.shape), c.leading),
                       *[backend.wrap(backend.cast(ctx, g, grad_dtype).reshape(p.params), c.leading)
                         for g in grads])
            if key is not None:
                self.plans.learn(key, Call((op.name, "backward"), c, acc, ctx, results))
            return results

    # ------------------------------------------------------------ small pieces

    def _native(self, roles, given):
        """role -> the backend's view of ``given[role]``, for ``roles``."""
        if not self.sides_checked:
            V.common_side(**{r: given[r] for r in roles})
        native = self.backend.native
        return {r: native(r, given[r]) for r in roles}

    def _output(self, ctx, out_native, flat_shape, dtype, reads, order, shape):
        """``(y, copy_back)``: the array a launcher fills, ``out`` itself when it can;
        ``reads``: the inputs the launcher reads; ``order``, ``shape``: as ``_empty``."""
        if out_native is not None:
            view = self.backend.out_view(out_native, flat_shape, reads, order)
            if view is not None:
                return view, False
            return self._empty(ctx, flat_shape, dtype, order, shape), True
        return self._empty(ctx, flat_shape, dtype, order, shape), False

    def _empty(self, ctx, flat_shape, dtype, order, shape):
        """An output as the launcher sees it (``flat_shape``), in ``order``: a channels-last
        one made in the caller's ``shape`` (its strides are then those of torch's
        channels_last), seen as ``flat_shape``."""
        if order == "C":
            return self.backend.empty(ctx, flat_shape, dtype)
        return self.backend.empty(ctx, shape, dtype, order).reshape(flat_shape)

    def _result(self, ctx, y, copy_back, out, out_native, shape, like):
        if out is None:
            return self.backend.wrap(y.reshape(shape), like)
        if copy_back:
            self.backend.copy_into(ctx, out_native, y.reshape(shape))
        return out

    def _param(self, ctx, a, n):
        return None if a is None else self.backend.contiguous(ctx, a, (n,))

    def _rows_like(self, ctx, a, shape, dtype, order="C"):
        """``dy``/``ds`` flattened, in x's dtype (the kernels read both as x's type) and order."""
        return self.backend.contiguous(ctx, self.backend.cast(ctx, a, dtype), shape, order)

    def _rows_or_none(self, ctx, a, shape, dtype):
        return None if a is None else self._rows_like(ctx, a, shape, dtype)

    def _stat(self, ctx, a, shape, acc):
        return self.backend.contiguous(ctx, self.backend.cast(ctx, a, acc), shape)

    def _grads_in(self, weight, xdt, acc):
        """dweight/dbias are allocated in their own dtype where the backend's kernels round the
        sums into it as they store them (the cast after is then a no-op), else in ``acc``."""
        return self._grad_dtype(weight, xdt) if self.backend.grads_in_any_dtype else acc

    @staticmethod
    def _grad_dtype(weight, xdt):
        """dweight/dbias come back in the weight's dtype, or x's without a weight."""
        return weight.dtype if weight is not None else xdt


def _stat_shape(x_shape, k):
    return tuple(x_shape[: len(x_shape) - k]) + (1,) * k


# ------------------------------------------------------------ the methods, from the table

def _method(op, kind):
    """``Frontend``'s method ``kind`` of ``op``: the public signature, handing the arguments
    to one path."""
    params = list(op.signature(kind).parameters.values())
    sig = inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params])
    roles = ", ".join(op.backward_roles if kind == "backward" else op.forward_roles)
    if kind == "backward":
        body = f"self._backward(_op, ({roles},))"
    else:
        out = "out" if kind == "plain" and op.has_out else "None"
        n = len(op.plain_outputs)
        pick = "" if kind == "forward" else "[0]" if n == 1 else f"[:{n}]"
        body = f"self._forward(_op, ({roles},), {out}, {kind == 'forward'}){pick}"
    fn = ops.generate(op.function(kind), sig, body, {"_op": op}, op.doc(kind), "numbanorm._api.Frontend")
    fn.__module__, fn.__qualname__ = __name__, f"Frontend.{fn.__name__}"
    return fn


for _op in ops.OPERATIONS:
    for _kind in ops.KINDS:
        setattr(Frontend, _op.function(_kind), _method(_op, _kind))
del _op, _kind
