"""numbanorm's functions pinned to the CPU kernels (NumPy arrays in and out)."""

from .. import _api
from ..operations import FUNCTIONS as _FUNCTIONS
from . import _backend

_frontend = _api.Frontend(_backend)

# the table's functions: the frontend's methods of those names
globals().update({name: getattr(_frontend, name) for name in _FUNCTIONS})

__all__ = list(_FUNCTIONS)
