"""numbanorm's top-level functions: one per function of the table, dispatching on the arrays' side.

Defined here rather than in ``numbanorm/__init__`` so that ``numbanorm.layers``
imports them without an import cycle through the package.
"""

import numpy as _np

from . import _validate as _V
from . import cpu
from . import operations as _ops

_CPU = cpu._frontend  # checks the sides itself: on the host path nothing has yet


def _pick(**arrays):
    """The CPU frontend unless some argument is a CUDA array (decided by type alone).

    Host and device arrays mixed in one call are rejected here, before
    ``numbanorm.cuda`` (and so numba.cuda) is even imported; the CUDA frontend
    returned then does not check them again.
    """
    for a in arrays.values():
        if a is not None and type(a) is not _np.ndarray and _V.side_of(a) == _V.DEVICE:
            _V.common_side(**arrays)
            if not _GPU:
                from . import cuda

                _GPU.append(cuda._frontend_sides_checked)
            return _GPU[0]  # kept here: an import statement per call costs more than this dispatch
    return _CPU


_GPU = []  # numbanorm.cuda's frontend for the top level, once imported


def _dispatching(op, kind):
    """The public function ``kind`` of ``op``: real parameters (``inspect.signature``
    and ``help`` show them), no per-call binding; it picks the backend from the
    array arguments, in signature order, and calls the frontend's method of the
    same name with the same arguments.

    Where the CPU backend has a shortcut of ``op`` (``cpu._backend.Plans``: a call seen before),
    the function asks it first, as the CPU frontend's full path does first thing: a
    call it has not seen (host arrays or not) goes on as above.  The frontend's layers
    are a fifth of such a call's time.
    """
    name, sig = op.function(kind), op.signature(kind)
    params = sig.parameters.values()
    arrays = ", ".join(f"{p.name}={p.name}" for p in params if p.name in _ops.ARRAY_ROLES)
    call = ", ".join(f"{p.name}={p.name}" if p.kind is p.KEYWORD_ONLY else p.name for p in params)
    body = f"_pick({arrays}).{name}({call})"
    shortcut = _CPU.shortcut(op, "backward" if kind == "backward" else "forward")
    if shortcut is not None:
        roles = ", ".join(op.backward_roles if kind == "backward" else op.forward_roles)
        out = "" if kind == "backward" else ", out=out" if kind == "plain" else ", out=None"
        # the shortcut returns every output, and the plain function y, the first
        body = f"(_small({roles}{out}) or ({body},))[0]" if kind == "plain" else f"_small({roles}{out}) or {body}"
    fn = _ops.generate(name, sig, body, {"_pick": _pick, "_small": shortcut}, op.doc(kind), "numbanorm")
    fn.__module__ = "numbanorm"
    return fn


for _op in _ops.OPERATIONS:
    for _kind in _ops.KINDS:
        globals()[_op.function(_kind)] = _dispatching(_op, _kind)
del _op, _kind


__all__ = list(_ops.FUNCTIONS)
