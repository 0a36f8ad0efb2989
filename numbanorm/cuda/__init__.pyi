# Generated from numbanorm/operations.py by `python -m numbanorm._stubs`: do not edit.

from numbanorm import (
    layer_norm as layer_norm,
    layer_norm_forward as layer_norm_forward,
    layer_norm_backward as layer_norm_backward,
    rms_norm as rms_norm,
    rms_norm_forward as rms_norm_forward,
    rms_norm_backward as rms_norm_backward,
    group_norm as group_norm,
    group_norm_forward as group_norm_forward,
    group_norm_backward as group_norm_backward,
    add_layer_norm as add_layer_norm,
    add_layer_norm_forward as add_layer_norm_forward,
    add_layer_norm_backward as add_layer_norm_backward,
    add_rms_norm as add_rms_norm,
    add_rms_norm_forward as add_rms_norm_forward,
    add_rms_norm_backward as add_rms_norm_backward,
)

def is_available() -> bool:
    """True where the GPU kernels can run (a CUDA GPU, or numba's simulator)."""

def why_unavailable() -> str:
    """Why the GPU kernels cannot run here ('' where they can)."""

__all__ = [
    "layer_norm",
    "layer_norm_forward",
    "layer_norm_backward",
    "rms_norm",
    "rms_norm_forward",
    "rms_norm_backward",
    "group_norm",
    "group_norm_forward",
    "group_norm_backward",
    "add_layer_norm",
    "add_layer_norm_forward",
    "add_layer_norm_backward",
    "add_rms_norm",
    "add_rms_norm_forward",
    "add_rms_norm_backward",
    "is_available",
    "why_unavailable",
]

