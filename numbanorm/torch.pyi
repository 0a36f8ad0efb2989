# Generated from numbanorm/operations.py by `python -m numbanorm._stubs`: do not edit.

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, TypeVar, overload

import torch
from torch import Tensor

_M = TypeVar("_M", bound=torch.nn.Module)

class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` running numbanorm's kernels."""

class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` running numbanorm's kernels."""

class GroupNorm(torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` running numbanorm's kernels."""

class NormReport(NamedTuple):
    """What ``replace_norms`` did: ``(path, class, how)`` per module replaced, ``(path, class, why)``
    per norm left alone."""

    replaced: list[tuple[str, str, str]]
    left_alone: list[tuple[str, str, str]]

@overload
def replace_norms(module: _M, strict: bool = False, *, report: Literal[False] = False) -> _M: ...
@overload
def replace_norms(module: _M, strict: bool = False, *, report: Literal[True]) -> tuple[_M, NormReport]: ...

OPERATORS: tuple[Any, ...]

__all__ = [
    "layer_norm",
    "rms_norm",
    "group_norm",
    "add_layer_norm",
    "add_rms_norm",
    "LayerNorm",
    "RMSNorm",
    "GroupNorm",
    "replace_norms",
    "NormReport",
]

def layer_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-05,
) -> Tensor:
    """LayerNorm over the trailing ``normalized_shape`` of ``input``: ``y``.

    ``y = (x - mean) * rstd * weight + bias`` over each row, where ``rstd`` is ``1 /
    sqrt(var(x) + eps)`` (the biased variance).

    Differentiable through ``torch.autograd`` and traced by ``torch.compile`` (a PyTorch
    custom operator) on CPU and CUDA tensors.

    Parameters
    ----------
    input : Tensor
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``input`` normalized together, as in PyTorch.
    weight : Tensor or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    bias : Tensor or None
        The shift, of shape ``normalized_shape`` and any floating dtype; None: zeros.
    eps : float
        Added to the variance before the square root; finite and >= 0 in the
        accumulation dtype. Default 1e-05.

    Returns
    -------
    y : Tensor
        The normalized input: ``input``'s shape and dtype.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``normalized_shape`` that is not an int or a sequence of ints; host and device
        arrays mixed in one call; an array argument that is not a ``torch.Tensor``.
    ValueError
        ``normalized_shape`` that is empty or does not match the trailing dimensions of
        ``input``; ``weight`` or ``bias`` of the wrong shape; ``eps`` negative, NaN or
        infinite in the accumulation dtype; a zero-sized normalized shape.
    """

def rms_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    """RMSNorm over the trailing ``normalized_shape`` of ``input``: ``y``.

    ``y = x * rstd * weight`` over each row, where ``rstd`` is ``1 / sqrt(mean(x**2) +
    eps)``.

    Differentiable through ``torch.autograd`` and traced by ``torch.compile`` (a PyTorch
    custom operator) on CPU and CUDA tensors.

    Parameters
    ----------
    input : Tensor
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``input`` normalized together, as in PyTorch.
    weight : Tensor or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    eps : float or None
        Added to the mean of squares before the square root; finite and >= 0 in the
        accumulation dtype. Default None: the machine epsilon of the accumulation dtype
        (float32's; float64's for float64 inputs).

    Returns
    -------
    y : Tensor
        The normalized input: ``input``'s shape and dtype.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``normalized_shape`` that is not an int or a sequence of ints; host and device
        arrays mixed in one call; an array argument that is not a ``torch.Tensor``.
    ValueError
        ``normalized_shape`` that is empty or does not match the trailing dimensions of
        ``input``; ``weight`` of the wrong shape; ``eps`` negative, NaN or infinite in
        the accumulation dtype; a zero-sized normalized shape.
    """

def group_norm(
    input: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-05,
) -> Tensor:
    """GroupNorm of ``input`` of shape ``(N, C, *spatial)``: ``y``.

    ``y = (x - mean) * rstd * weight + bias`` over each (sample, group), weight and bias per
    channel, where ``rstd`` is ``1 / sqrt(var(x) + eps)`` (the biased variance).

    Differentiable through ``torch.autograd`` and traced by ``torch.compile`` (a PyTorch
    custom operator) on CPU and CUDA tensors.

    Parameters
    ----------
    input : Tensor
        The input of shape ``(N, C, *spatial)``; each group of ``C // num_groups``
        channels is normalized together with the spatial dimensions, per sample:
        float16, float32, float64 or bfloat16. A CPU tensor in ``torch.channels_last``
        (or ``channels_last_3d``) is read in that order, and ``y`` and its gradient come
        back in it, as ``torch.nn.functional.group_norm``'s do on the CPU; on CUDA they
        come back contiguous.
    num_groups : int
        The number of groups the ``C`` channels are split into; it divides ``C``.
        ``num_groups == C`` is instance normalization, ``1`` a layer normalization over
        ``(C, *spatial)`` with a weight and bias per channel.
    weight : Tensor or None
        The scale, of shape ``(C,)`` and any floating dtype; None: ones.
    bias : Tensor or None
        The shift, of shape ``(C,)`` and any floating dtype; None: zeros.
    eps : float
        Added to the variance before the square root; finite and >= 0 in the
        accumulation dtype. Default 1e-05.

    Returns
    -------
    y : Tensor
        The normalized input: ``input``'s shape and dtype.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``num_groups`` that is not an int; host and device arrays mixed in one call; an
        array argument that is not a ``torch.Tensor``.
    ValueError
        ``input`` of fewer than 2 dimensions; ``num_groups`` not positive or not
        dividing ``C``; ``weight`` or ``bias`` of the wrong shape; ``eps`` negative, NaN
        or infinite in the accumulation dtype; a zero-sized group.
    """

def add_layer_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-05,
) -> tuple[Tensor, Tensor]:
    """``s = x + residual`` and its LayerNorm in one pass over memory: ``(y, s)``.

    ``s = x + residual``, then ``y = (s - mean) * rstd * weight + bias`` over each row,
    where ``rstd`` is ``1 / sqrt(var(s) + eps)`` (the biased variance).

    Differentiable through ``torch.autograd`` and traced by ``torch.compile`` (a PyTorch
    custom operator) on CPU and CUDA tensors.

    Parameters
    ----------
    x : Tensor
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16.
    residual : Tensor
        The residual branch, added to ``x`` before the norm (``s = x + residual``):
        ``x``'s shape and dtype.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : Tensor or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    bias : Tensor or None
        The shift, of shape ``normalized_shape`` and any floating dtype; None: zeros.
    eps : float
        Added to the variance before the square root; finite and >= 0 in the
        accumulation dtype. Default 1e-05.

    Returns
    -------
    y : Tensor
        The normalized input: ``x``'s shape and dtype.
    s : Tensor
        ``x + residual`` in ``x``'s dtype, the next residual branch's input: the fused
        forward returns it and the backward takes it.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``normalized_shape`` that is not an int or a sequence of ints; host and device
        arrays mixed in one call; an array argument that is not a ``torch.Tensor``.
    ValueError
        ``normalized_shape`` that is empty or does not match the trailing dimensions of
        ``x``; ``weight`` or ``bias`` of the wrong shape; ``residual`` not of ``x``'s
        shape and dtype; ``eps`` negative, NaN or infinite in the accumulation dtype; a
        zero-sized normalized shape.
    """

def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``s = x + residual`` and its RMSNorm in one pass over memory: ``(y, s)``.

    ``s = x + residual``, then ``y = s * rstd * weight`` over each row, where ``rstd`` is
    ``1 / sqrt(mean(s**2) + eps)``.

    Differentiable through ``torch.autograd`` and traced by ``torch.compile`` (a PyTorch
    custom operator) on CPU and CUDA tensors.

    Parameters
    ----------
    x : Tensor
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16.
    residual : Tensor
        The residual branch, added to ``x`` before the norm (``s = x + residual``):
        ``x``'s shape and dtype.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : Tensor or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    eps : float or None
        Added to the mean of squares before the square root; finite and >= 0 in the
        accumulation dtype. Default None: the machine epsilon of the accumulation dtype
        (float32's; float64's for float64 inputs).

    Returns
    -------
    y : Tensor
        The normalized input: ``x``'s shape and dtype.
    s : Tensor
        ``x + residual`` in ``x``'s dtype, the next residual branch's input: the fused
        forward returns it and the backward takes it.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``normalized_shape`` that is not an int or a sequence of ints; host and device
        arrays mixed in one call; an array argument that is not a ``torch.Tensor``.
    ValueError
        ``normalized_shape`` that is empty or does not match the trailing dimensions of
        ``x``; ``weight`` of the wrong shape; ``residual`` not of ``x``'s shape and
        dtype; ``eps`` negative, NaN or infinite in the accumulation dtype; a zero-sized
        normalized shape.
    """
