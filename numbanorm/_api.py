"""The public functions, written once for every backend.

A ``Frontend`` runs each call in the same order:

1. ``common_side`` looks at the arguments' types only and rejects host and device
   arrays mixed in one call (once: the top level, which has checked already,
   uses a frontend made with ``sides_checked=True``);
2. the backend's ``native`` views each argument as the backend's array type
   (no copy, no allocation);
3. ``numbanorm._validate`` checks dtypes, shapes and scalars and works out the
   flattened problem -- every contract error is raised here, before step 4;
4. the backend's ``call_context`` says where the call runs (on a GPU: the stream
   and allocator of the array whose type the results take, and the one GPU of all
   the arrays); within its ``on_device`` scope outputs are allocated, inputs made
   contiguous, and the backend launches the norm's launcher, which fills the outputs;
5. results are reshaped (statistics keep-dims) and handed back in the caller's
   array type.

A backend with ``replays`` (CUDA) records a call that went through these steps and
replays later calls of the same key -- everything steps 1-4 depend on: types, shapes,
strides, dtypes, pointer alignment, aliasing, scalars -- as that call's allocations
and launches with the new call's pointers and stream (``cuda._backend.Replays``).

The methods (``layer_norm``, ``layer_norm_forward``, ``layer_norm_backward``, ...)
are generated from ``numbanorm.operations``: each hands its arguments, in the
table's role order, to one forward or one backward path, which the operation's
row (roles, bias, statistics, fused or not) and layout (rows or groups) drive.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Protocol, runtime_checkable

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

    def contiguous(self, ctx: Any, a: Any, shape: tuple) -> Any:
        """C-contiguous array of ``shape`` with a's values."""

    def empty(self, ctx: Any, shape: tuple, dtype: Any) -> Any:
        """An uninitialised array."""

    def out_view(self, out: Any, shape: tuple, reads: list) -> Any:
        """``out`` seen as ``shape`` if the launcher can write it directly, else None (the
        result is then computed apart and copied in): it must be C-contiguous, and where
        the backend's launchers do not handle it, overlap none of ``reads`` (the inputs,
        x first; None for an absent one) but x itself."""

    def copy_into(self, ctx: Any, dst: Any, src: Any) -> None:
        """dst[...] = src (same size; dst may be strided)."""

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


# ------------------------------------------------------------ the frontend

class Frontend:
    def __init__(self, backend: Backend, sides_checked: bool = False, replay: bool = True):
        self.backend = backend
        self.sides_checked = sides_checked  # the caller has run common_side on these arguments
        # each operation's (forward, backward) launchers, found once
        self.launchers = {op.name: tuple(_launcher(backend, k) for k in op.kernels) for op in ops.OPERATIONS}
        # repeated small calls (cpu): the backend's shortcut of an operation's forward, if it has one
        self.small = getattr(backend, "small_calls", None)
        self.shortcuts = {op.name: getattr(self.small, op.name) for op in ops.OPERATIONS
                          if hasattr(self.small, op.name)}
        self.back_shortcuts = {op.name: getattr(self.small, op.name + "_backward") for op in ops.OPERATIONS
                               if hasattr(self.small, op.name + "_backward")}
        # calls seen before (cuda): the backend's record and replay of their launches
        self.replays = getattr(backend, "replays", None) if replay else None
        if self.replays is None:  # (cpu, simulator) the public methods go straight to the full paths
            self._forward, self._backward = self._forward_full, self._backward_full

    # ------------------------------------------------------------ the two paths

    def _forward(self, op, args, out):
        """``op``'s forward on ``args``, the public function's arguments in the table's role order."""
        return self._replayed((op.name, "forward"), (*args, out), self._forward_full, op, args, out)

    def _replayed(self, kind, key_args, full, *args):
        """A replay of the call (``kind``, ``key_args``) where the backend's ``replays`` has
        learned it; else ``full(*args, sig)``, which learns it if it can be keyed."""
        replays = self.replays
        sig = replays.signature(kind, key_args)
        if sig is None:
            return full(*args)
        hit = replays.replay(sig)
        if hit is not None:
            return hit
        try:
            return full(*args, sig)
        finally:
            replays.stop()

    def _forward_full(self, op, args, out, sig=None):
        """``_forward`` by the full path; ``sig``: a call the backend's ``replays`` learns."""
        shortcut = self.shortcuts.get(op.name)
        if shortcut is not None:
            hit = shortcut(*args, out=out)
            if hit is not None:
                return hit
        given = dict(zip(op.forward_roles, args))
        caller_x = given["x"]
        roles = op.forward_arrays + ("out",) if op.has_out else op.forward_arrays
        given["out"] = out
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
        out_native = a.get("out")
        V.same_as_x("out", out_native, x.shape, xdt, optional=True)
        # ---- everything below may allocate and write
        backend = self.backend
        ctx = backend.call_context(caller_x, given)
        with backend.on_device(ctx):
            if sig is not None:
                self.replays.record()
            acc = V.acc_dtype(xdt)
            y, copy_back = self._output(ctx, out_native, p.flat, xdt, [a[r] for r in op.forward_arrays])
            s = backend.empty(ctx, p.flat, xdt) if op.fused else None
            stats = [backend.empty(ctx, p.stats, acc) for _ in op.stats]
            if p.flat[0]:
                inputs = [backend.contiguous(ctx, x, p.flat)]
                if op.fused:
                    inputs.append(backend.contiguous(ctx, a["residual"], p.flat))
                for r in op.params:
                    inputs.append(self._param(ctx, a[r], p.width))
                outputs = (y, s) if op.fused else (y,)
                backend.launch(ctx, self.launchers[op.name][0], *inputs, eps, *outputs, *stats)
            if shortcut is not None:
                self.small.learn(op.name, caller_x, given[op.shape_role], given["weight"], given.get("bias"),
                                 given["eps"], eps, p.flat[0], out)
            results = [self._result(ctx, y, copy_back, out, out_native, x.shape, caller_x)]
            if op.fused:
                results.append(backend.wrap(s.reshape(x.shape), caller_x))
            results += [backend.wrap(st.reshape(p.kept), caller_x) for st in stats]
            if sig is not None:
                self.replays.learn(sig, caller_x, ctx, results)
            return tuple(results)

    def _backward(self, op, args):
        """``op``'s backward on ``args``, the public function's arguments in the table's role order."""
        return self._replayed((op.name, "backward"), args, self._backward_full, op, args)

    def _backward_full(self, op, args, sig=None):
        """``_backward`` by the full path; ``sig``: a call the backend's ``replays`` learns."""
        shortcut = self.back_shortcuts.get(op.name)
        if shortcut is not None:
            hit = shortcut(*args)
            if hit is not None:
                return hit
        given = dict(zip(op.backward_roles, args))
        x_name = "s" if op.fused else "x"  # what was normalized: the fused norms' s = x + residual
        caller_x = given[x_name]
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
        # ---- everything below may allocate and write
        backend = self.backend
        ctx = backend.call_context(caller_x, given)
        with backend.on_device(ctx):
            if sig is not None:
                self.replays.record()
            acc = V.acc_dtype(xdt)
            dx = backend.empty(ctx, p.flat, xdt)
            grads = [backend.empty(ctx, (p.width,), self._grads_in(a["weight"], xdt, acc))
                     for _ in op.backward_outputs[1:]]  # dweight[, dbias]
            backend.launch(
                ctx, self.launchers[op.name][1],
                self._rows_like(ctx, a["dy"], p.flat, xdt), backend.contiguous(ctx, x, p.flat),
                *[self._stat(ctx, a[r], p.stats, acc) for r in op.stats],
                self._param(ctx, a["weight"], p.width), dx, *grads,
                **({"ds": self._rows_or_none(ctx, a["ds"], p.flat, xdt)} if op.fused else {}))
            grad_dtype = self._grad_dtype(a["weight"], xdt)
            results = (backend.wrap(dx.reshape(x.shape), caller_x),
                       *[backend.wrap(backend.cast(ctx, g, grad_dtype).reshape(p.params), caller_x) for g in grads])
            if shortcut is not None:
                self.small.learn_backward(op.name, args, p.flat, p.params, acc)
            if sig is not None:
                self.replays.learn(sig, caller_x, ctx, results)
            return results

    # ------------------------------------------------------------ small pieces

    def _native(self, roles, given):
        """role -> the backend's view of ``given[role]``, for ``roles``."""
        if not self.sides_checked:
            V.common_side(**{r: given[r] for r in roles})
        native = self.backend.native
        return {r: native(r, given[r]) for r in roles}

    def _output(self, ctx, out_native, flat_shape, dtype, reads):
        """``(y, copy_back)``: the array a launcher fills, ``out`` itself when it can;
        ``reads``: the inputs the launcher reads."""
        if out_native is not None:
            view = self.backend.out_view(out_native, flat_shape, reads)
            if view is not None:
                return view, False
            return self.backend.empty(ctx, flat_shape, dtype), True
        return self.backend.empty(ctx, flat_shape, dtype), False

    def _result(self, ctx, y, copy_back, out, out_native, shape, like):
        if out is None:
            return self.backend.wrap(y.reshape(shape), like)
        if copy_back:
            self.backend.copy_into(ctx, out_native, y.reshape(shape))
        return out

    def _param(self, ctx, a, n):
        return None if a is None else self.backend.contiguous(ctx, a, (n,))

    def _rows_like(self, ctx, a, shape, dtype):
        """``dy``/``ds`` flattened and in x's dtype (the kernels read both as x's type)."""
        return self.backend.contiguous(ctx, self.backend.cast(ctx, a, dtype), shape)

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
        body = f"self._forward(_op, ({roles},), {out}){pick}"
    fn = ops.generate(op.function(kind), sig, body, {"_op": op}, op.doc(kind), "numbanorm._api.Frontend")
    fn.__module__, fn.__qualname__ = __name__, f"Frontend.{fn.__name__}"
    return fn


for _op in ops.OPERATIONS:
    for _kind in ops.KINDS:
        setattr(Frontend, _op.function(_kind), _method(_op, _kind))
del _op, _kind
