"""Fused residual add + LayerNorm / RMSNorm on the GPU: the forward launchers.

``s = x + residual`` is formed in the norm kernel's first pass, stored once and
normalized as stored (rounded to x's dtype, like the CPU's ``cpu._kernels.add_norm``), so
the unfused ``add`` kernel's extra read of s is saved.  The kernels are the
``row_norm`` forward kernels specialized with a residual; the
backward is their backward at s with ``ds`` added to dx.
"""

from . import layer_norm as _layer_norm
from . import rms_norm as _rms_norm


def layer_norm_forward(x, residual, weight, bias, eps, y, s, mean, rstd, *, stream=0):
    """Fill ``y``, ``s``, ``mean``, ``rstd`` for the rows of ``x + residual`` (all (M, N) / (M,))."""
    _layer_norm.forward(x, weight, bias, eps, y, mean, rstd, residual=residual, s=s, stream=stream)


def rms_norm_forward(x, residual, weight, eps, y, s, rstd, *, stream=0):
    """Fill ``y``, ``s``, ``rstd`` for the rows of ``x + residual``."""
    _rms_norm.forward(x, weight, eps, y, rstd, residual=residual, s=s, stream=stream)
