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

    def doc(self, kind, level="numbanorm"):
        """The numpydoc docstring of ``kind`` at ``level`` (a key of ``LEVELS``), from ``ROLES``."""
        return _docstring(self, kind, level)

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
            # (an isinstance test, not np.ndim: torch.compile traces NumPy calls as torch ops
            # and refuses np.ndim's int in a full graph)
            v["normalized_shape"] = (n,) if isinstance(n, (int, np.integer)) else tuple(n)
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
        1/64 (1/8 in bfloat16, whose significand has 8 bits), so that x + residual,
        below 32 in magnitude for these draws, is exact in every dtype and the
        oracle's float64 sum is the kernels' s.  ``backward`` adds dy (and ds).
        """
        x = 3.0 + 2.0 * rng.standard_normal(shape)
        n = shape[-1] if self.layout == "rows" else shape[1]
        v = {"x": x, self.shape_role: n if self.layout == "rows" else groups}
        if self.fused:
            q = 8 if np.dtype(dtype).name == "bfloat16" else 64
            v["residual"] = np.round(q * rng.standard_normal(shape)) / q
            v["x"] = np.round(q * x) / q
        v["weight"] = rng.uniform(0.5, 1.5, n)
        if self.bias:
            v["bias"] = 0.1 * rng.standard_normal(n)
        if backward:
            v["dy"] = rng.standard_normal(shape)
            if self.fused:
                v["ds"] = rng.standard_normal(shape)
        return {k: (np.asarray(a, dtype) if isinstance(a, np.ndarray) else a) for k, a in v.items()}


def asking(op, kind, asked, fallback):
    """The body of a public function of ``op``'s ``kind`` that returns the first answer of
    the shortcuts named in ``asked`` (each called with the table's roles, a forward's ``out``
    by keyword; an answer is the outputs as a tuple, or None) and else ``fallback``'s, a
    function of the same signature; a plain function of one output returns it alone."""
    roles = ", ".join(op.backward_roles if kind == "backward" else op.forward_roles)
    out = "" if kind == "backward" else ", out=out" if kind == "plain" and op.has_out else ", out=None"
    params = op.signature(kind).parameters.values()
    call = ", ".join(f"{p.name}={p.name}" if p.kind is p.KEYWORD_ONLY else p.name for p in params)
    tried = " or ".join(f"{a}({roles}{out})" for a in asked)
    if kind == "plain" and len(op.plain_outputs) == 1:  # y alone, the first output
        return f"({tried} or ({fallback}({call}),))[0]"
    return f"{tried} or {fallback}({call})"


def generate(name, signature, body, namespace, doc, where):
    """The function ``def name<signature>: return <body>``, compiled in ``namespace``
    (``body`` a list of lines: the function's body).

    Generated (as ``dataclasses`` generates ``__init__``) so that this table is the
    one place a function's parameters are written down: ``inspect.signature`` and
    ``help`` show real parameters, and no call binds its arguments at run time.
    ``where`` names the function in tracebacks.
    """
    lines = body if isinstance(body, list) else [f"return {body}"]
    src = f"def {name}{signature}:\n" + "".join(f"    {line}\n" for line in lines)
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
              kernels=("layer_norm.forward", "layer_norm.backward"), flops=(8, 13)),
    Operation("rms_norm", "rows", ("rstd",), bias=False, eps=None, fused=False, torch="rms_norm",
              kernels=("rms_norm.forward", "rms_norm.backward"), flops=(4, 9)),
    Operation("group_norm", "groups", ("mean", "rstd"), bias=True, eps=1e-5, fused=False, torch="group_norm",
              kernels=("group_norm.forward", "group_norm.backward"), flops=(8, 13)),
    Operation("add_layer_norm", "rows", ("mean", "rstd"), bias=True, eps=1e-5, fused=True, torch="layer_norm",
              kernels=("add_norm.layer_norm_forward", "layer_norm.backward"), flops=(9, 14)),
    Operation("add_rms_norm", "rows", ("rstd",), bias=False, eps=None, fused=True, torch="rms_norm",
              kernels=("add_norm.rms_norm_forward", "rms_norm.backward"), flops=(5, 10)),
)

BY_NAME = {op.name: op for op in OPERATIONS}
KINDS = ("plain", "forward", "backward")
# every public function name, in the table's order
FUNCTIONS = tuple(f for op in OPERATIONS for f in op.functions)


# ---------------------------------------------------------------- docstrings

# Every public parameter and result, by role: (numpydoc type, description), one entry for
# both directions.  ``{...}`` fields are the operation's (``_doc_fields``); ``array`` in a
# type becomes the level's array type (``LEVELS``).
ROLES = {
    "x": ("array", "The input{x_layout}: float16, float32, float64 or bfloat16.{x_backward}{x_order}"),
    "residual": ("array", "The residual branch, added to ``x`` before the norm (``s = x + residual``): "
                          "``x``'s shape and dtype."),
    "normalized_shape": ("int or sequence of int", "The trailing dimensions of ``x`` normalized together, "
                                                "as in PyTorch."),
    "num_groups": ("int", "The number of groups the ``C`` channels are split into; it divides ``C``. "
                          "``num_groups == C`` is instance normalization, ``1`` a layer normalization "
                          "over ``(C, *spatial)`` with a weight and bias per channel."),
    "weight": ("array or None", "The scale, of shape {param_shape} and any floating dtype; None: ones."),
    "bias": ("array or None", "The shift, of shape {param_shape} and any floating dtype; None: zeros."),
    "eps": ("{eps_type}", "Added to {eps_to} before the square root; finite and >= 0 in the "
                          "accumulation dtype. {eps_default}"),
    "out": ("array or None, keyword-only", "Filled with ``y`` and returned: ``x``'s shape and dtype, on "
                                          "``x``'s side. It may overlap the inputs: the result is as if "
                                          "every input were read before ``out`` is written."),
    "y": ("array", "The normalized input: ``x``'s shape and dtype."),
    "s": ("array", "``x + residual`` in ``x``'s dtype, the next residual branch's input: the fused "
                   "forward returns it and the backward takes it."),
    "mean": ("array", "The mean of each {unit}, of shape {stat_shape}, in float32 (float64 for "
                      "float64 inputs): the forward returns it and the backward takes it."),
    "rstd": ("array", "{rstd} of each {unit}, of shape {stat_shape}, in float32 (float64 for float64 "
                      "inputs): the forward returns it and the backward takes it."),
    "dy": ("array", "The gradient of the loss with respect to ``y``: ``{xs}``'s shape, any floating dtype "
                    "(read as ``{xs}``'s)."),
    "ds": ("array or None", "The gradient reaching ``s`` from later layers, added to ``dx``: ``s``'s "
                            "shape; None: zero."),
    "dx": ("array", "The gradient with respect to ``x``{dx_fused}: ``x``'s shape and dtype."),
    "dweight": ("array", "The gradient with respect to ``weight``, of shape {param_shape}, summed in "
                         "float32 (float64 for float64 inputs) and returned in ``weight``'s dtype (``x``'s "
                         "without a weight); returned whether or not a weight was given."),
    "dbias": ("array", "The gradient with respect to ``bias``, of shape {param_shape}, summed and "
                       "returned as ``dweight``."),
}

# How each level (numbanorm, numbanorm.cpu and numbanorm.cuda alike; numbanorm.dask;
# numbanorm.torch) differs: its array type, the names and roles it words its own way,
# whether it fills ``out``, and the errors it adds to the table's: exception -> (the
# kinds it concerns, condition).
LEVELS = {
    "numbanorm": {"array": "array", "raises": {}},
    "dask": {"array": "dask.array.Array", "lazy": True, "fills_out": False,
             "roles": {"out": ("None", "Must be None: a lazy result has nowhere to be written (see "
                                       "``dask.array.store``).")},
             "fields": {"x_order": " Every block is normalized in C order, and ``y`` and ``dx`` come back "
                                   "C-contiguous whatever ``x``'s layout."},
             "raises": {"TypeError": (("plain",), "``out`` given")}},
    "torch": {"array": "Tensor", "names": {"x": "input"}, "fills_out": False,
              "fields": {"x_backward": "",  # (autograd's: no backward function at this level)
                         "x_order": " A CPU tensor in ``torch.channels_last`` (or ``channels_last_3d``) "
                                    "is read in that order, and ``y`` and its gradient come back in it, as "
                                    "``torch.nn.functional.group_norm``'s do on the CPU; on CUDA they come "
                                    "back contiguous."},
              "note": "Differentiable through ``torch.autograd`` and traced by ``torch.compile`` (a "
                      "PyTorch custom operator) on CPU and CUDA tensors.",
              "raises": {"TypeError": (KINDS, "an array argument that is not a ``torch.Tensor``")}},
}

_NORMS = {"layer_norm": "LayerNorm", "rms_norm": "RMSNorm", "group_norm": "GroupNorm"}


def _doc_fields(op, level="numbanorm"):
    """The ``{...}`` fields of ``ROLES`` and of the summaries, for ``op`` at ``level``."""
    rows, centred = op.layout == "rows", "mean" in op.stats
    x = "s" if op.fused else "x"
    rstd = f"``1 / sqrt(var({x}) + eps)`` (the biased variance)" if centred else f"``1 / sqrt(mean({x}**2) + eps)``"
    fields = {
        "norm": _NORMS[op.torch],
        "xs": x,
        "x_backward": " The backward takes ``s`` in its place." if op.fused else " The backward takes the forward's.",
        "x_layout": ("; its trailing ``normalized_shape`` dimensions are normalized together" if rows else
                     " of shape ``(N, C, *spatial)``; each group of ``C // num_groups`` channels is "
                     "normalized together with the spatial dimensions, per sample"),
        "x_order": ("" if rows else
                    " On the CPU, an ``x`` of 4 or 5 dimensions in channels-last order (laid out as ``(N, "
                    "*spatial, C)``: torch's ``channels_last``) is read in that order, and ``y`` and ``dx`` "
                    "come back in it, as ``torch.nn.functional.group_norm``'s do on the CPU; on a GPU "
                    "(``numbanorm.cuda``, or device arrays) they come back C-contiguous."),
        "unit": "row" if rows else "(sample, group)",
        "param_shape": "``normalized_shape``" if rows else "``(C,)``",
        "stat_shape": ("``x.shape[:-k] + (1,) * k`` with ``k = len(normalized_shape)`` (keep-dims)" if rows
                       else "``(N, num_groups)``"),
        "rstd": rstd,
        "eps_to": "the variance" if centred else "the mean of squares",
        "eps_type": "float" if op.eps is not None else "float or None",
        "eps_default": (f"Default {op.eps:g}." if op.eps is not None else
                        "Default None: the machine epsilon of the accumulation dtype (float32's; "
                        "float64's for float64 inputs)."),
        "dx_fused": (" and ``residual`` (the two are equal): the norm's input gradient plus ``ds``"
                     if op.fused else ""),
        "formula": (("``s = x + residual``, then " if op.fused else "")
                    + f"``y = {'(' + x + ' - mean)' if centred else x} * rstd * weight{' + bias' if op.bias else ''}``"
                    + (" over each row" if rows else " over each (sample, group), weight and bias per channel")
                    + f", where ``rstd`` is {rstd}."),
    }
    fields.update(LEVELS[level].get("fields", {}))
    if rows:  # (a row's layout is its own: nothing to say of the order)
        fields["x_order"] = ""
    return fields


def _raises(op, kind, fills_out):
    """``{exception: [condition]}``: the API contract's errors that ``kind``'s arguments can meet."""
    types = ["a required array argument that is None",
             "an array argument of another dtype than float16, float32, float64 and bfloat16"]
    shape = ["``normalized_shape`` that is not an int or a sequence of ints"] if op.layout == "rows" else []
    matching = (f"``normalized_shape`` that is empty or does not match the trailing dimensions of "
                f"``{'s' if op.fused and kind == 'backward' else 'x'}``")
    if kind == "backward":
        like = ("dy", "ds") if op.fused else ("dy",)
        types += shape
        values = [matching] if op.layout == "rows" else []
        values += [f"{_listed(like)} not of ``{'s' if op.fused else 'x'}``'s shape",
                   "statistics that do not fit it", "``weight`` of the wrong shape"]
    else:
        types.append("``eps`` that is not a real number")
        if op.layout == "rows":
            types += shape
            values = [matching]
        else:
            types.append("``num_groups`` that is not an int")
            values = ["``x`` of fewer than 2 dimensions", "``num_groups`` not positive or not dividing ``C``"]
        values.append(f"{_listed(op.params)} of the wrong shape")
        like = ("residual",) * op.fused + ("out",) * (kind == "plain" and op.has_out and fills_out)
        if like:
            values.append(f"{_listed(like)} not of ``x``'s shape and dtype")
        values += ["``eps`` negative, NaN or infinite in the accumulation dtype",
                   f"a zero-sized {'normalized shape' if op.layout == 'rows' else 'group'}"]
    types.append("host and device arrays mixed in one call")
    return {"TypeError": types, "ValueError": values}


def _listed(roles):
    """``a``, ``b`` or ``c``."""
    names = [f"``{r}``" for r in roles]
    return " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))


def _wrapped(text, indent=""):
    """``text``'s words filled into lines of at most ``88 - len(indent)`` characters, the
    indent included: ``textwrap.wrap``'s lines for this prose with ``break_on_hyphens=False``
    (a test compares them), without its regular expressions, since every public function's
    docstring is made at import."""
    width = 88 - len(indent)
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = ""
        line = f"{line} {word}" if line else indent + word
    return lines + [line] if line else lines


def _docstring(op, kind, level):
    how, f = LEVELS[level], _doc_fields(op, level)
    outputs = {"plain": op.plain_outputs, "forward": op.forward_outputs, "backward": op.backward_outputs}[kind]
    shown = outputs[0] if len(outputs) == 1 else f"({', '.join(outputs)})"
    what = f"fused add + {f['norm']}" if op.fused else f["norm"]
    summary = {"plain": (f"``s = x + residual`` and its {f['norm']} in one pass over memory" if op.fused else
                         f"{f['norm']} over the trailing ``normalized_shape`` of ``x``" if op.layout == "rows"
                         else f"{f['norm']} of ``x`` of shape ``(N, C, *spatial)``") + f": ``{shown}``.",
               "forward": f"{what[0].upper()}{what[1:]} keeping what the backward needs: ``{shown}``.",
               "backward": f"Gradients of {what}: ``{shown}``."}[kind]
    names = {} if op.fused else how.get("names", {})  # the fused functions keep numbanorm's names everywhere
    params = [p.name for p in op.signature(kind).parameters.values() if p.name != "out" or level != "torch"]
    roles = {**ROLES, **how.get("roles", {})}

    def entries(shown):
        lines = []
        for role in shown:
            type_, text = roles[role]
            lines.append(f"{names.get(role, role)} : {type_.format(**f).replace('array', how['array'])}")
            lines += _wrapped(named(text.format(**f)), "    ")
        return lines

    def named(text):
        for old, new in names.items():
            text = text.replace(f"``{old}``", f"``{new}``")
        return text

    raises = _raises(op, kind, how.get("fills_out", True))
    for exc, (kinds, condition) in how["raises"].items():
        if kind in kinds:
            raises[exc].append(condition)
    summary = ("Lazy: " if how.get("lazy") else "") + named(summary)
    note = ["", *_wrapped(how["note"])] if "note" in how else []
    body = [summary, "", *_wrapped(f["formula"]), *note, "", "Parameters", "----------", *entries(params),
            "", "Returns", "-------", *entries(outputs), "", "Raises", "------"]
    for exc, conditions in raises.items():
        text = named("; ".join(conditions))
        body += [exc, *_wrapped(f"{text[0].upper()}{text[1:]}.", "    ")]
    return "\n".join(body) + "\n"


# ---------------------------------------------------------------- comparing with the oracle

# Tolerances of ``numbanorm check`` and the tests, relative to the largest magnitude
# of the oracle's array: 16-bit outputs are rounded once from float32 (half an ulp
# is 2**-11 = 4.9e-4 relative in float16, 2**-8 = 3.9e-3 in bfloat16: about four
# of them), float32 results carry a few ulps of a length-N reduction, float64 the
# same at 1e-16.
TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-5, "float64": 1e-11}


def tolerance(dtype):
    """The tolerance of results in ``dtype``: its name, or any spelling NumPy understands
    ("bfloat16" by name works without ml_dtypes imported)."""
    return TOLERANCE[dtype if isinstance(dtype, str) and dtype in TOLERANCE else np.dtype(dtype).name]


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
