"""numbanorm's functions pinned to the CPU kernels (NumPy arrays in and out)."""

from .. import _api
from .. import operations as _ops
from ..operations import FUNCTIONS as _FUNCTIONS
from . import _backend

_frontend = _api.Frontend(_backend)


def _asking_first(op, kind):
    """The table's function ``kind`` of ``op``: a call the plan cache has seen goes to its
    shortcut, as the top level's does (the frontend's own way into the plans is a few
    Python frames longer, a share of a small call), any other to the frontend's method."""
    method = getattr(_frontend, op.function(kind))
    shortcut = _frontend.shortcut(op, kind)
    if shortcut is None:
        return method
    fn = _ops.generate(op.function(kind), op.signature(kind), _ops.asking(op, kind, ["_small"], "_method"),
                       {"_small": shortcut, "_method": method}, op.doc(kind), __name__)
    fn.__module__ = __name__
    return fn


globals().update({op.function(kind): _asking_first(op, kind) for op in _ops.OPERATIONS for kind in _ops.KINDS})

__all__ = list(_FUNCTIONS)
