"""``numbanorm.torch``'s small CPU calls of the row norms (LayerNorm, RMSNorm, fused or not),
by their tensors' addresses.

A call of an operator's implementation (``numbanorm.torch._implementation``) whose key
-- every tensor's shape and dtype, the normalized shape, eps -- was seen before on
a call that the full path answered runs the row function's addressed entry
(``cpu._kernels.addressed``) on the tensors' ``data_ptr()`` and on outputs that torch
allocates, shaped and typed as that call's results were: no NumPy view of a tensor and
no tensor of a NumPy result, which cost a one-row call several times its kernel's time
(the book's design log).  The full path validated that key and chose the kernel; the entry is the row
function it ran, compiled for the same argument types, so the bits are the same.

Only what the row function reads as it is gets a plan: C-contiguous CPU tensors
(no negative bit), every array in x's dtype or the accumulation dtype as the row
function takes it, at most :data:`MOST` elements: a plan runs on the calling thread, and
below twice the launcher's own bound for that (``common.SERIAL_BELOW``) the launcher's
parallel kernel, started from the full path, lost to it (the book's design log).
Anything else, a plan whose entry is not compiled yet (``background``: compiled
meanwhile) or a call with a row left to the rescaling variant takes the full path.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np
import torch

from .cpu._kernels import add_norm, addressed, background, common, halves, layer_norm, rms_norm
from .operations import ARRAY_ROLES, generate

# the row function each (operation, direction) runs (the fused norms' backward is the norm's, at s)
_ROWS = {("layer_norm", "forward"): layer_norm.forward_rows, ("layer_norm", "backward"): layer_norm.backward_rows,
         ("rms_norm", "forward"): rms_norm.forward_rows, ("rms_norm", "backward"): rms_norm.backward_rows,
         ("add_layer_norm", "forward"): add_norm.layer_norm_rows, ("add_layer_norm", "backward"): layer_norm.backward_rows,
         ("add_rms_norm", "forward"): add_norm.rms_norm_rows, ("add_rms_norm", "backward"): rms_norm.backward_rows}
# the row functions that read weights in x's 16-bit dtype as their bits (common.weights); the
# others read them in the accumulation dtype alone (the launcher converts: no plan)
_BITS_WEIGHTS = (layer_norm.forward_rows, rms_norm.forward_rows)
# an entry's array parameter -> the operator's role (argument or output) it is
_ROLE = {"x": "x", "r": "residual", "w": "weight", "b": "bias", "y": "y", "s": "s", "mean": "mean", "rstd": "rstd",
         "dy": "dy", "ds": "ds", "dx": "dx", "dweight": "dweight", "dbias": "dbias"}
_X_LIKE = ("x", "residual", "y", "s", "dy", "ds", "dx")  # the roles in x's dtype (16-bit: as bits)
_STATS = ("mean", "rstd")  # a LayerNorm forward's statistics: one tensor where a recorded call makes them


def _free_count():
    """``sys.getrefcount`` of an object held by one local variable alone, as the generated
    code takes a spare statistics tensor (``stats = spare.pop()``)."""
    spare = [object()]
    stats = spare.pop()
    return sys.getrefcount(stats)


# A recorded LayerNorm forward by its plan keeps its statistics tensor in the plan's list
# ``spare`` as well as on ctx; the next call takes it (``list.pop``: no two threads take
# the same one) and writes into it only where nothing else holds it, this count (ctx
# gone: the graph freed), else makes a new one.  The tensor's allocation was a tenth of
# such a call (the book's performance design log).
FREE = _free_count()
# the most elements a plan runs (on the calling thread): see the module's docstring
MOST = 2 * common.SERIAL_BELOW
_PARAM = {r: p for p, r in _ROLE.items()}
_SIZES = ("m", "n", "blocks")  # an entry's size arguments (addressed.parameters)
_PARTIAL = {s: p for p, s in addressed.PARTIALS.items()}  # dweight -> dw_part: the row function's name
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _numpy_dtypes():
    """torch dtype -> the NumPy dtype of its values and the one a row function reads them as
    (``halves.kernel_view``: 16-bit floats as integer bits)."""
    pairs = [(torch.float32, np.float32), (torch.float64, np.float64), (torch.float16, np.float16)]
    try:  # (NumPy knows the name "bfloat16" only once ml_dtypes is imported)
        import ml_dtypes
        pairs.append((torch.bfloat16, ml_dtypes.bfloat16))
    except ImportError:  # no bfloat16 plans: the full path says what to install
        pass
    return {t: (np.dtype(d), halves.kernel_view(np.empty(0, d)).dtype) for t, d in pairs}


_DTYPES = _numpy_dtypes()


def covers(op):
    """Whether ``op``'s calls may have plans."""
    return (op.name, "forward") in _ROWS


class Plan(NamedTuple):
    """How a learned call runs: its entry and what the entry takes besides the tensors' addresses."""

    entry: object   # the addressed entry (a Numba dispatcher)
    likes: tuple    # per output: None (made like the normalized input) or the small tensor it is made like
    eps: object     # eps as the entry takes it (None where it takes none)
    m: int          # rows
    n: int          # row length
    blocks: int     # a backward's partial rows (common.n_chunks(m, n)); 0 for a forward
    stacked: object  # a forward's two statistics as one tensor (made like this one), or None
    step: int       # bytes from the first statistic to the second in it
    spare: list     # a recorded forward's statistics tensors that a call may take again (FREE)


class Calls:
    """The learned small calls of one operator implementation: ``op``'s ``kind`` (forward,
    plain or backward; roles ``roles``, outputs ``outputs``, all as the implementation
    takes and returns them).

    :meth:`implementation` generates the implementation itself: one function of the
    roles, its checks, key and entry call written out for them (a small call's Python
    is most of its time: a loop over the roles cost more than the kernel), compiled by
    ``operations.generate`` as the public functions are (its source in ``linecache`` for
    tracebacks and ``inspect``).  For LayerNorm's plain forward it reads
    (the entry's arguments one to a line there)::

        def layer_norm_plain(x, normalized_shape, weight, bias, eps):
            key = plan = None
            try:
                if (type(x) in PLAIN and x.is_cpu
                        and x.is_contiguous() and not x.is_neg()
                        and (weight is None or type(weight) in PLAIN and weight.is_cpu
                             and weight.is_contiguous() and not weight.is_neg())
                        and (bias is None or ...)):
                    key = (x.shape, x.dtype,
                           tuple(normalized_shape),
                           None if weight is None else weight.shape,
                           None if weight is None else weight.dtype,
                           ...,
                           eps,)
                    plan = PLANS.get(key)
            except RuntimeError:  # (a nested or sparse tensor's: the full path's)
                key = None
            if plan is not None:
                entry, likes, eps_, m, n, blocks, stacked, step, spare = plan
                y = empty_like(x)
                try:
                    left = entry(x.data_ptr(), 0 if weight is None else weight.data_ptr(),
                                 0 if bias is None else bias.data_ptr(), eps_, y.data_ptr(), m, n)
                except NotCompiled as e:
                    compile_later(e.dispatcher, e.sig)
                else:
                    if not left:
                        return y
            return FULL(key, (x, normalized_shape, weight, bias, eps,))

    A key is each tensor's shape and dtype (None for an optional one that is None), the
    normalized shape, eps: what decides a call's validity and kernel; None where a tensor
    is not a plain C-contiguous CPU one.  ``FULL(key, args)`` is the full path, which learns the key's plan
    (:meth:`learn`).  A nonzero ``left`` is rows for the rescaling variant: the launcher's.
    """

    def __init__(self, op, kind, roles, optional):
        self.optional = optional  # the roles that may be None (the schema's Tensor?)
        self.name = f"{op.name}_{kind}"
        self.kind = kind
        self.rows = _ROWS[op.name, "backward" if kind == "backward" else "forward"]
        self.role = dict(_ROLE, x="s") if op.fused and kind == "backward" else _ROLE  # (a backward's x is s)
        self.roles = roles
        self.outputs = op.backward_outputs if kind == "backward" else op.forward_outputs
        # the outputs a call makes: a plain forward drops the statistics (its entry makes them)
        self.made = op.plain_outputs if kind == "plain" else self.outputs
        self.plans = {}  # key -> Plan, or None: refused (never rebound: the generated code holds it)

    def implementation(self, full, recorded=None):
        """The operator's implementation: a call by its plan, else ``full(key, args)``.

        ``recorded``: ``(saved, setup_context, k)`` makes the forward of an ``autograd.Function``
        instead (``ctx`` first): a call by its plan saves the roles ``saved`` and the normalized
        shape on ``ctx``, anything else runs ``setup_context(ctx, args, output, False)`` on
        the full path's output; either returns the first ``k`` outputs.  Two statistics (the
        LayerNorms') are made as one tensor, ``ctx.stats`` (an allocation cost as much as the
        kernel of a one-row call; an attribute, less than a saved tensor), not saved; or one
        is taken again from the plan's ``spare`` (:data:`FREE`)."""
        arrays = [r for r in self.roles if r in ARRAY_ROLES]
        checks, key = [], []
        for r in self.roles:
            if r in ARRAY_ROLES:  # (two lines a tensor: the source stays readable in the book)
                first = f"{r}.is_cpu" if recorded else f"type({r}) in PLAIN and {r}.is_cpu"
                second = f"{r}.is_contiguous() and not {r}.is_neg()"
                # (a recorded call's caller checked its tensors' types: _direct)
                checks.append(f"({r} is None or {first}\n                     and {second})" if r in self.optional
                              else f"{first}\n                and {second}")
                key += ([f"None if {r} is None else {r}.shape", f"None if {r} is None else {r}.dtype"]
                        if r in self.optional else [f"{r}.shape, {r}.dtype"])
            elif r == "normalized_shape":
                key.append(f"tuple({r})")  # (a tuple's own tuple() is itself)
            else:
                key.append(r)
        x = self.role["x"]
        made = [f"{r} = empty_like({x if r in _X_LIKE else f'likes[{k}]'})" for k, r in enumerate(self.made)]
        address = {r: f"{r}.data_ptr()" for r in self.made}
        saved, setup, k = recorded or (None, None, None)
        stacked = recorded is not None and self.made[-2:] == _STATS
        if stacked:
            # the statistics tensor of a call whose graph is gone, else a new one (FREE)
            first, second = _STATS
            made[-2:] = ["try:", "    stats = spare.pop()", "    if REFS(stats) != FREE:",
                         "        stats = empty_like(stacked)", "except IndexError:",
                         "    stats = empty_like(stacked)", f"{first} = stats.data_ptr()",
                         f"{second} = {first} + step"]
            address.update({first: first, second: second})
        given = []
        for p in addressed.parameters(self.rows, self.dropped):
            role = self.role.get(p)
            if p in _SIZES or p == "eps":
                given.append("eps_" if p == "eps" else p)
            elif role in self.made:
                given.append(address[role])
            elif role in arrays:
                given.append(f"0 if {role} is None else {role}.data_ptr()" if role in self.optional
                             else f"{role}.data_ptr()")
            else:  # an array the operation does not have (a plain norm's ds)
                given.append("0")
        assert not set(self.made) & set(self.roles), (self.made, self.roles)
        returned = self.made[0] if len(self.made) == 1 else ", ".join(self.made)
        params, args = ", ".join(self.roles), f"({', '.join(self.roles)},)"
        name, hit, miss = self.name, [f"return {returned}"], [f"return FULL(key, {args})"]
        if recorded is not None:
            name, params = f"{name}_recorded", f"ctx, {params}"
            saved = saved[:-2] if stacked else saved
            hit = [f"ctx.save_for_backward({', '.join(saved)})",
                   *(["ctx.stats = stats", "spare.append(stats)"] if stacked else []),
                   "ctx.normalized_shape = normalized_shape", "ctx.eps = eps",
                   *(["ctx.set_materialize_grads(False)"] if "s" in saved else []),
                   f"return {returned if k == len(self.made) else ', '.join(self.made[:k])}"]
            miss = [f"output = FULL(key, {args})", f"SETUP(ctx, {args}, output, False)",
                    "return output[0]" if k == 1 else f"return output[:{k}]"]
        cond, keys = "\n                and ".join(checks), ",\n                   ".join(key)
        given = ",\n                         ".join(given)
        body = [
            "key = plan = None",
            "try:",
            f"    if ({cond}):",
            f"        key = ({keys},)",
            "        plan = PLANS.get(key)",
            "except RuntimeError:  # (a nested or sparse tensor's: the full path's)",
            "    key = None",
            "if plan is not None:",
            "    entry, likes, eps_, m, n, blocks, stacked, step, spare = plan",
            *(f"    {line}" for line in made),
            "    try:",
            f"        left = entry({given})",
            "    except NotCompiled as e:",
            "        compile_later(e.dispatcher, e.sig)",
            "    else:",
            "        if not left:",
            *(f"            {line}" for line in hit),
            *miss]
        env = {"PLAIN": _PLAIN, "PLANS": self.plans, "FULL": full, "empty_like": torch.empty_like,
               "NotCompiled": background.NotCompiled, "compile_later": background.compile_later,
               "SETUP": setup, "REFS": sys.getrefcount, "FREE": FREE}
        return generate(name, f"({params})", body, env, None, "numbanorm.torch small calls")

    @property
    def dropped(self):
        """The entry parameters of the outputs a call does not make (a plain forward's statistics)."""
        return tuple(_PARAM[r] for r in self.outputs if r not in self.made)

    def learn(self, key, args, results):
        """Keep the plan of ``args`` (key ``key``), whose results the full path returned, or
        None where it has none: a key decides that too, so its next calls take the full path
        without asking again."""
        if key is None or key in self.plans:
            return
        results = results if isinstance(results, tuple) else (results,)
        plan = None
        if all(isinstance(t, torch.Tensor) and type(t) in _PLAIN for t in results):
            plan = self._plan(dict(zip(self.roles, args)), results)
        if len(self.plans) >= 256:
            self.plans.clear()
        self.plans[key] = plan

    def _plan(self, given, results):
        x = given[self.role["x"]]
        if x.dtype not in _DTYPES or not 0 < x.numel() <= MOST:
            return None
        dt, bits = _DTYPES[x.dtype]
        acc = common.acc_of(dt)
        n = int(np.prod(given["normalized_shape"]))
        m = x.numel() // n
        made = dict(zip(self.made, results))
        dropped = self.dropped
        read = {}  # entry parameter -> the dtype the row function reads it as
        for p in addressed.parameters(self.rows):
            if p in _SIZES:
                continue
            role = self.role.get(p)
            t = made[role] if role in made else given.get(role)
            if role is None:  # eps
                continue
            if p in dropped:
                read[p] = acc
            elif t is None:
                read[p] = None
            elif t.dtype not in _DTYPES:
                return None
            elif t.dtype == x.dtype and (role in _X_LIKE or (role in ("weight", "bias")
                                                              and self.rows in _BITS_WEIGHTS)):
                read[p] = bits  # (16-bit weights as bits, flattened: as common.weights passes them)
            elif _DTYPES[t.dtype][0] == acc and role not in _X_LIKE:
                read[p] = acc
            else:  # a conversion the launcher makes
                return None
        likes = []  # the outputs in x's role made like x (as they must be), the others like a small copy
        for role, t in made.items():
            if role in _X_LIKE:
                if (t.shape, t.dtype) != (x.shape, x.dtype):
                    return None
                likes.append(None)
            else:
                likes.append(torch.empty_like(t))
        entry = addressed.entry(self.rows, acc, dropped, **{_PARTIAL.get(p, p): d for p, d in read.items()})
        eps = None
        if "eps" in self.roles:
            eps = given["eps"]
            eps = float(np.finfo(acc).eps) if eps is None else float(eps)
        stats = [t for r, t in made.items() if r in _STATS]
        stacked = torch.empty((2, *stats[0].shape), dtype=stats[0].dtype) if len(stats) == 2 else None
        return Plan(entry, tuple(likes), eps, m, n, common.n_chunks(m, n) if self.kind == "backward" else 0,
                    stacked, stats[0].nbytes if stacked is not None else 0, [])
