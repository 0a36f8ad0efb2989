"""numbanorm's functions pinned to the CPU kernels (NumPy arrays in and out)."""

from .. import _api
from . import _backend

_frontend = _api.Frontend(_backend)

layer_norm = _frontend.layer_norm
layer_norm_forward = _frontend.layer_norm_forward
layer_norm_backward = _frontend.layer_norm_backward
rms_norm = _frontend.rms_norm
rms_norm_forward = _frontend.rms_norm_forward
rms_norm_backward = _frontend.rms_norm_backward
group_norm = _frontend.group_norm
group_norm_forward = _frontend.group_norm_forward
group_norm_backward = _frontend.group_norm_backward
add_layer_norm = _frontend.add_layer_norm
add_layer_norm_forward = _frontend.add_layer_norm_forward
add_layer_norm_backward = _frontend.add_layer_norm_backward
add_rms_norm = _frontend.add_rms_norm
add_rms_norm_forward = _frontend.add_rms_norm_forward
add_rms_norm_backward = _frontend.add_rms_norm_backward

__all__ = [n for n in dir(_frontend) if not n.startswith("_") and n != "be"]
