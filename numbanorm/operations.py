"""The table of operations: what numbanorm computes, written down once.

Every row names one normalization; its three public functions (``name``,
``name_forward``, ``name_backward``), their parameters, defaults, results and
docstrings follow from the row.  The table drives:

* the public functions of ``numbanorm`` (generated from the signatures here),
  ``numbanorm.cpu`` and ``numbanorm.cuda`` (the frontend's methods of those names);
* the registry's promise (every implementation has every function of the table);
* ``numbanorm check`` and the tests (inputs made by :meth:`Operation.inputs`,
  calls built by :meth:`Operation.call`, results named by the ``*_outputs``);
* the benchmarks (``numbanorm.measure``: calls, the oracle and PyTorch peers).

Adding a norm: a row here, its kernel module in each backend's ``_kernels``
package (the row's ``kernels`` name its launchers) and its oracle in
``numbanorm.reference``.  The frontend, ``numbanorm.torch``, ``numbanorm.dask``
and ``numbanorm.layers`` are driven by the row's roles and layout.
"""

from __future__ import annotations

import inspect
import linecache
from dataclasses import dataclass
from functools import cached_property

import numpy as np

_P = inspect.Parameter
_REQUIRED = _P.empty

# The argument roles that are arrays (the rest are shapes, counts and scalars):
# the top level picks the backend from these.
ARRAY_ROLES = ("x", "residual", "weight", "bias", "out", "dy", "ds", "s", "mean", "rstd")


@dataclass(frozen=True)
class Operation:
    name: str          # the plain forward's public name; ``_forward`` and ``_backward`` follow it
    layout: str        # 'rows': x's trailing ``normalized_shape``; 'groups': x (N, C, *spatial), ``num_groups``
    stats: tuple       # what the forward keeps for the backward: ('mean', 'rstd') or ('rstd',)
    bias: bool         # takes a bias (and the backward returns dbias)
    eps: float | None  # eps default (None: the accumulation dtype's machine epsilon)
    fused: bool        # s = x + residual is normalized (and returned); backward takes ds and s
    torch: str         # the torch.nn.functional counterpart (of x + residual when fused)
    kernels: tuple     # forward and backward launchers, 'module.function' in each backend's _kernels
    flops: tuple       # floating-point operations per element, forward and backward (the roofline's; below)
    docs: tuple        # docstrings of the plain, forward and backward functions

    # ---------------------------------------------------------------- names and signatures

    @property
    def functions(self):
        """``(plain, forward, backward)`` public names."""
        return (self.name, f"{self.name}_forward", f"{self.name}_backward")

    def __post_init__(self):
        # every cached property filled now, not at its first read: that read may fall inside
        # torch.compile's traced region, which cannot enter cached_property's lock (Python < 3.12)
        for attr in vars(Operation).values():
            if isinstance(attr, cached_property):
                attr.__get__(self, Operation)

    @cached_property  # read on every call by the frontend
    def shape_role(self):
        return "normalized_shape" if self.layout == "rows" else "num_groups"

    @cached_property  # read on every call by the frontend
    def forward_roles(self):
        return (("x",) + (("residual",) if self.fused else ()) + (self.shape_role, "weight")
                + (("bias",) if self.bias else ()) + ("eps",))

    @cached_property  # read on every call by the frontend
    def backward_roles(self):
        return (("dy",) + (("ds", "s") if self.fused else ("x",)) + self.stats
                + (("normalized_shape",) if self.layout == "rows" else ()) + ("weight",))

    @cached_property
    def forward_arrays(self):
        """The forward's array roles, in signature order."""
        return tuple(r for r in self.forward_roles if r in ARRAY_ROLES)

    @cached_property
    def backward_arrays(self):
        """The backward's array roles, in signature order."""
        return tuple(r for r in self.backward_roles if r in ARRAY_ROLES)

    @cached_property
    def params(self):
        """The affine parameters' roles."""
        return ("weight", "bias") if self.bias else ("weight",)

    @property
    def has_out(self):
        """The plain function takes ``out=`` (the fused ones return two arrays and take none)."""
        return not self.fused

    @property
    def plain_outputs(self):
        return ("y", "s") if self.fused else ("y",)

    @property
    def forward_outputs(self):
        return self.plain_outputs + self.stats

    @property
    def backward_outputs(self):
        return ("dx", "dweight") + (("dbias",) if self.bias else ())

    def signature(self, kind):
        """The public ``inspect.Signature`` of ``kind`` in ('plain', 'forward', 'backward')."""
        roles = self.backward_roles if kind == "backward" else self.forward_roles
        defaults = {"weight": None, "bias": None, "eps": self.eps}
        params = [_P(r, _P.POSITIONAL_OR_KEYWORD, default=defaults.get(r, _REQUIRED)) for r in roles]
        if kind == "plain" and self.has_out:
            params.append(_P("out", _P.KEYWORD_ONLY, default=None))
        return inspect.Signature(params)

    def doc(self, kind):
        return self.docs[("plain", "forward", "backward").index(kind)]

    def function(self, kind):
        return self.functions[("plain", "forward", "backward").index(kind)]

    # ---------------------------------------------------------------- calling an implementation

    def args(self, kind, values):
        """Positional arguments of ``kind`` from ``values`` (role -> value), up to the first role missing.

        A missing ``eps`` (or weight, bias) takes the function's default.
        """
        roles = self.backward_roles if kind == "backward" else self.forward_roles
        out = []
        for r in roles:
            if r not in values:
                break
            out.append(values[r])
        return out

    def call(self, impl, kind, values, **kwargs):
        """``impl.<function of kind>(*args)``; ``impl`` is any implementation (module or frontend)."""
        return getattr(impl, self.function(kind))(*self.args(kind, values), **kwargs)

    def call_torch(self, F, values):
        """The ``torch.nn.functional`` counterpart of the forward on tensors in ``values`` (y only).

        F's norms take (input, shape or groups, weight[, bias], eps) in this table's order;
        the shape goes as a tuple, as F requires.
        """
        v = dict(values)
        if self.fused:
            v["x"] = v["x"] + v.pop("residual")
        if self.layout == "rows":
            n = v["normalized_shape"]
            v["normalized_shape"] = (n,) if np.ndim(n) == 0 else tuple(n)
        roles = [r for r in self.forward_roles if r != "residual"]
        args = []
        for r in roles:
            if r not in v:
                break
            args.append(v[r])
        return getattr(F, self.torch)(*args)

    # ---------------------------------------------------------------- inputs

    def inputs(self, rng, shape, dtype, groups=None, backward=True):
        """Host inputs of every role for ``shape`` and ``dtype``: role -> value.

        x has a common offset (mean 3, std 2), as activations do; weight and bias
        are not trivial.  For the fused operations x and residual are multiples of
        1/64 below 32 in magnitude, so that x + residual is exact in every dtype and
        the oracle's float64 sum is the kernels' s.  ``backward`` adds dy (and ds).
        """
        x = 3.0 + 2.0 * rng.standard_normal(shape)
        n = shape[-1] if self.layout == "rows" else shape[1]
        v = {"x": x, self.shape_role: n if self.layout == "rows" else groups}
        if self.fused:
            v["residual"] = np.round(64 * rng.standard_normal(shape)) / 64
            v["x"] = np.round(64 * x) / 64
        v["weight"] = rng.uniform(0.5, 1.5, n)
        if self.bias:
            v["bias"] = 0.1 * rng.standard_normal(n)
        if backward:
            v["dy"] = rng.standard_normal(shape)
            if self.fused:
                v["ds"] = rng.standard_normal(shape)
        return {k: (np.asarray(a, dtype) if isinstance(a, np.ndarray) else a) for k, a in v.items()}


def generate(name, signature, body, namespace, doc, where):
    """The function ``def name<signature>: return <body>``, compiled in ``namespace``.

    Generated (as ``dataclasses`` generates ``__init__``) so that this table is the
    one place a function's parameters are written down: ``inspect.signature`` and
    ``help`` show real parameters, and no call binds its arguments at run time.
    ``where`` names the function in tracebacks.
    """
    src = f"def {name}{signature}:\n    return {body}\n"
    filename = f"<{where}.{name}, generated from numbanorm.operations>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # tracebacks show the line
    exec(compile(src, filename, "exec"), namespace)
    fn = namespace[name]
    fn.__doc__ = doc
    return fn


# One row per norm: data, alike in shape by design.  ``flops`` are counted from the
# formulas as the CPU kernels evaluate them (an add, a multiply or a subtract is 1, a
# fused multiply-add 2), for the roofline (benchmarks/roofline.py):
#   LayerNorm forward:  mean (1) + centred sum of squares (3) + (x - mean) * rstd * w + b (4)
#   RMSNorm forward:    sum of squares (2) + x * rstd * w (2)
#   LayerNorm backward: xhat (2), g = dy * w (1), the sums of g and g * xhat (3),
#                       dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) (4),
#                       dweight and dbias partials (3)
#   RMSNorm backward:   xhat (1), g (1), sum of g * xhat (2), dx (3), dweight partial (2)
#   GroupNorm as LayerNorm (the same sums over a group instead of a row); the fused
#   operations one add more each way (s = x + residual; dx + ds)
OPERATIONS = (
    Operation("layer_norm", "rows", ("mean", "rstd"), bias=True, eps=1e-5, fused=False, torch="layer_norm",
              kernels=("layer_norm.forward", "layer_norm.backward"),
              flops=(8, 13),
              docs=("LayerNorm over the trailing ``normalized_shape`` of ``x``: ``y``.",
                    "LayerNorm keeping what the backward needs: ``(y, mean, rstd)``.",
                    "Gradients of LayerNorm: ``(dx, dweight, dbias)``.")),
    Operation("rms_norm", "rows", ("rstd",), bias=False, eps=None, fused=False, torch="rms_norm",
              kernels=("rms_norm.forward", "rms_norm.backward"),
              flops=(4, 9),
              docs=("RMSNorm over the trailing ``normalized_shape`` of ``x``: ``y``.",
                    "RMSNorm keeping what the backward needs: ``(y, rstd)``.",
                    "Gradients of RMSNorm: ``(dx, dweight)``.")),
    Operation("group_norm", "groups", ("mean", "rstd"), bias=True, eps=1e-5, fused=False, torch="group_norm",
              kernels=("group_norm.forward", "group_norm.backward"),
              flops=(8, 13),
              docs=("GroupNorm of ``x`` of shape ``(N, C, *spatial)``: ``y``.",
                    "GroupNorm keeping what the backward needs: ``(y, mean, rstd)``, stats ``(N, G)``.",
                    "Gradients of GroupNorm: ``(dx, dweight, dbias)``.")),
    Operation("add_layer_norm", "rows", ("mean", "rstd"), bias=True, eps=1e-5, fused=True, torch="layer_norm",
              kernels=("add_norm.layer_norm_forward", "layer_norm.backward"),
              flops=(9, 14),
              docs=("``s = x + residual`` and its LayerNorm in one pass over memory: ``(y, s)``.",
                    "Fused add + LayerNorm keeping what the backward needs: ``(y, s, mean, rstd)``.",
                    "Gradients of fused add + LayerNorm: ``(dx, dweight, dbias)``; dx is also d(residual).")),
    Operation("add_rms_norm", "rows", ("rstd",), bias=False, eps=None, fused=True, torch="rms_norm",
              kernels=("add_norm.rms_norm_forward", "rms_norm.backward"),
              flops=(5, 10),
              docs=("``s = x + residual`` and its RMSNorm in one pass over memory: ``(y, s)``.",
                    "Fused add + RMSNorm keeping what the backward needs: ``(y, s, rstd)``.",
                    "Gradients of fused add + RMSNorm: ``(dx, dweight)``; dx is also d(residual).")),
)

BY_NAME = {op.name: op for op in OPERATIONS}
KINDS = ("plain", "forward", "backward")
# every public function name, in the table's order
FUNCTIONS = tuple(f for op in OPERATIONS for f in op.functions)


# ---------------------------------------------------------------- comparing with the oracle

# Tolerances of ``numbanorm check`` and the tests, relative to the largest magnitude
# of the oracle's array: float16 outputs are rounded once from float32 (half an ulp
# is 2**-11 = 4.9e-4 relative), float32 results carry a few ulps of a length-N
# reduction, float64 the same at 1e-16.
TOLERANCE = {"float16": 2e-3, "float32": 2e-5, "float64": 1e-11}


def tolerance(dtype):
    """The tolerance of results in ``dtype`` (any spelling NumPy understands)."""
    return TOLERANCE[np.dtype(dtype).name]


def to_host(a):
    """A result of any implementation as a NumPy array (None stays None)."""
    if a is None or isinstance(a, np.ndarray):
        return a
    if hasattr(a, "copy_to_host"):
        return a.copy_to_host()
    return np.asarray(a)


def relative_error(got, want):
    """max |got - want| relative to max(1, max |want|); inf on a shape mismatch, NaN stays NaN."""
    got = np.asarray(to_host(got), dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return np.inf
    if not want.size:
        return 0.0
    scale = max(1.0, float(np.max(np.abs(want))))
    return float(np.max(np.abs(got - want))) / scale


def compare(op, impl, oracle, direction, values):
    """``[(output name, relative error)]`` of ``impl`` against ``oracle`` on host ``values``.

    The backward runs on the oracle forward's statistics (in the accumulation
    dtype) and its ``s`` (in x's dtype), so it is checked on its own.
    """
    ref = op.call(oracle, "forward", values)
    if direction == "forward":
        got = op.call(impl, "forward", values)
        return list(zip(op.forward_outputs, map(relative_error, got, ref)))
    xdt = values["x"].dtype
    acc = np.float64 if xdt == np.float64 else np.float32
    back = dict(values)
    for name, a in zip(op.forward_outputs, ref):
        back[name] = a.astype(acc if name in op.stats else xdt)
    want = op.call(oracle, "backward", back)
    got = op.call(impl, "backward", back)
    return list(zip(op.backward_outputs, map(relative_error, got, want)))
