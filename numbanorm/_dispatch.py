"""numbanorm's top-level functions: one per function of the table, dispatching on the arrays' side.

Defined here rather than in ``numbanorm/__init__`` so that ``numbanorm.layers``
imports them without an import cycle through the package.
"""

import sys as _sys

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
                _load_gpu()
            return _GPU[0]  # kept here: an import statement per call costs more than this dispatch
    return _CPU


_GPU = []  # numbanorm.cuda's frontend for the top level, once imported
_REPLAYED = []  # (a generated function's namespace, its operation, direction): its _replay set on loading


def _load_gpu():
    """Import numbanorm.cuda, take its frontend and give each generated function its replays."""
    from . import cuda

    _GPU.append(cuda._frontend_sides_checked)
    for namespace, op, direction in _REPLAYED:
        namespace["_replay"] = _GPU[0].shortcut(op, direction) or _none


def _none(*args, **out):
    return None  # (no replays: the simulator's backend)


def _until_loaded(namespace):
    """``_replay`` until numbanorm.cuda is imported (by anyone: a call it learned is then
    replayed here too); no call on device arrays was learned before that."""
    def replay(*args, **out):
        if "numbanorm.cuda" not in _sys.modules:
            return None
        if not _GPU:
            _load_gpu()
        return namespace["_replay"](*args, **out)
    return replay


def _dispatching(op, kind):
    """The public function ``kind`` of ``op``: real parameters (``inspect.signature``
    and ``help`` show them), no per-call binding; it picks the backend from the
    array arguments, in signature order, and calls the frontend's method of the
    same name with the same arguments.

    Where the CPU backend has a shortcut of ``op`` (``cpu._backend.Plans``: a call seen before),
    the function asks it first, as the CPU frontend's full path does first thing; then,
    once numbanorm.cuda is imported, the CUDA backend's (``cuda._backend.Replays``: a call
    on device arrays seen before, whose key holds only device arrays, so no side is
    checked); a call neither has seen goes on as above.  The frontend's layers are a
    fifth of a small CPU call's time, and ``_pick`` a tenth of a replayed GPU call's.
    """
    name, sig = op.function(kind), op.signature(kind)
    arrays = ", ".join(f"{p.name}={p.name}" for p in sig.parameters.values() if p.name in _ops.ARRAY_ROLES)
    shortcut = _CPU.shortcut(op, kind)
    # either shortcut returns a call's outputs as a tuple (a plain call's without the statistics)
    body = _ops.asking(op, kind, ["_small", "_replay"] if shortcut is not None else ["_replay"],
                       f"_pick({arrays}).{name}")
    namespace = {"_pick": _pick, "_small": shortcut}  # (made at import, before numbanorm.cuda is)
    namespace["_replay"] = _until_loaded(namespace)
    _REPLAYED.append((namespace, op, kind))
    fn = _ops.generate(name, sig, body, namespace, op.doc(kind), "numbanorm")
    fn.__module__ = "numbanorm"
    return fn


for _op in _ops.OPERATIONS:
    for _kind in _ops.KINDS:
        globals()[_op.function(_kind)] = _dispatching(_op, _kind)
del _op, _kind


__all__ = list(_ops.FUNCTIONS)
