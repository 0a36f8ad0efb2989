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

import operator

import numpy as np
import torch

from .cpu._kernels import add_norm, addressed, background, common, halves, layer_norm, rms_norm
from .operations import ARRAY_ROLES

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


class Calls:
    """The learned small calls of one operator implementation: ``op``'s ``kind`` (forward,
    plain or backward; roles ``roles``, outputs ``outputs``, all as the implementation
    takes and returns them)."""

    def __init__(self, op, kind, roles):
        self.kind = kind
        self.rows = _ROWS[op.name, "backward" if kind == "backward" else "forward"]
        self.role = dict(_ROLE, x="s") if op.fused and kind == "backward" else _ROLE  # (a backward's x is s)
        self.roles = roles
        self.arrays = tuple(i for i, r in enumerate(roles) if r in ARRAY_ROLES)
        self.shape_at = roles.index("normalized_shape")
        self.eps_at = roles.index("eps") if "eps" in roles else None
        self.outputs = op.backward_outputs if kind == "backward" else op.forward_outputs
        self.returned = len(op.plain_outputs) if kind == "plain" else len(self.outputs)
        self.plans = {}

    def key(self, args):
        """What decides a call's validity and kernel: each tensor's shape and dtype, the
        normalized shape, eps; None where a tensor is not a plain C-contiguous CPU one."""
        key = list(args)
        for i in self.arrays:
            a = args[i]
            if a is not None:
                if type(a) not in _PLAIN or not a.is_cpu or not a.is_contiguous() or a.is_neg():
                    return None
                key[i] = (a.shape, a.dtype)
        key[self.shape_at] = tuple(key[self.shape_at])
        return tuple(key)

    def run(self, key, args):
        """The results of a call (its :meth:`key` made) by its plan, or None (the full
        path's).  (Loops written out, no comprehensions: a small call's Python is most of
        its time.)"""
        plan = self.plans.get(key)
        if plan is None:
            return None
        entry, outputs, pick, last = plan
        given = []  # every address, then the plan's eps and sizes: pick takes the entry's arguments from it
        for i in self.arrays:
            a = args[i]
            given.append(0 if a is None else a.data_ptr())
        made = []
        for like in outputs:  # torch.empty_like: half torch.empty's cost with a shape and a dtype
            t = torch.empty_like(args[like] if type(like) is int else like)
            made.append(t)
            given.append(t.data_ptr())
        given += last
        try:
            left = entry(*pick(given))
        except background.NotCompiled as e:
            background.compile_later(e.dispatcher, e.sig)
            return None
        if left:  # rows for the rescaling variant: the launcher's
            return None
        return made[0] if self.returned == 1 else tuple(made)

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
        made = dict(zip(self.outputs, results))
        dropped = tuple(_PARAM[r] for r in self.outputs if r not in made)  # the plain forward's statistics
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
        entry = addressed.entry(self.rows, acc, dropped, **{_PARTIAL.get(p, p): d for p, d in read.items()})
        eps = None
        if self.eps_at is not None:
            eps = given["eps"]
            eps = float(np.finfo(acc).eps) if eps is None else float(eps)
        # where each entry argument is in a call's list of addresses (arguments', outputs'),
        # followed by a null address (an array the operation does not have, ds of a plain norm),
        # then eps and the sizes
        index = {self.roles[i]: k for k, i in enumerate(self.arrays)}
        index.update({r: len(self.arrays) + k for k, r in enumerate(made)})
        null = len(self.arrays) + len(made)
        last = {"eps": eps, "m": m, "n": n, "blocks": common.n_chunks(m)}
        index.update({p: null + 1 + k for k, p in enumerate(last)})
        places = [index[p] if p in last else index.get(self.role[p], null)
                  for p in addressed.parameters(self.rows, dropped)]
        # each output made like x (its index in a call's arguments) or like a tensor kept here (small)
        like = self.roles.index(self.role["x"])
        outputs = [like if (t.shape, t.dtype) == (x.shape, x.dtype) else torch.empty_like(t) for t in results]
        return entry, outputs, operator.itemgetter(*places), (0, *last.values())
