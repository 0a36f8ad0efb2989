# Generated from numbanorm/operations.py by `python -m numbanorm._stubs`: do not edit.

from collections.abc import Sequence
from typing import Any, SupportsFloat, SupportsIndex, TypeAlias

import dask.array as da
from numpy.typing import NDArray

_Shape: TypeAlias = SupportsIndex | Sequence[SupportsIndex]

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
]

def layer_norm(
    x: da.Array | NDArray[Any],
    normalized_shape: _Shape,
    weight: da.Array | NDArray[Any] | None = None,
    bias: da.Array | NDArray[Any] | None = None,
    eps: SupportsFloat = 1e-05,
    *,
    out: None = None,
) -> da.Array:
    """Lazy: LayerNorm over the trailing ``normalized_shape`` of ``x``: ``y``.

    ``y = (x - mean) * rstd * weight + bias`` over each row, where ``rstd`` is ``1 /
    sqrt(var(x) + eps)`` (the biased variance).

    Parameters
    ----------
    x : dask.array.Array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes the forward's.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : dask.array.Array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    bias : dask.array.Array or None
        The shift, of shape ``normalized_shape`` and any floating dtype; None: zeros.
    eps : float
        Added to the variance before the square root; finite and >= 0 in the
        accumulation dtype. Default 1e-05.
    out : None
        Must be None: a lazy result has nowhere to be written (see
        ``dask.array.store``).

    Returns
    -------
    y : dask.array.Array
        The normalized input: ``x``'s shape and dtype.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``normalized_shape`` that is not an int or a sequence of ints; host and device
        arrays mixed in one call; ``out`` given.
    ValueError
        ``normalized_shape`` that is empty or does not match the trailing dimensions of
        ``x``; ``weight`` or ``bias`` of the wrong shape; ``eps`` negative, NaN or
        infinite in the accumulation dtype; a zero-sized normalized shape.
    """

def layer_norm_forward(
    x: da.Array | NDArray[Any],
    normalized_shape: _Shape,
    weight: da.Array | NDArray[Any] | None = None,
    bias: da.Array | NDArray[Any] | None = None,
    eps: SupportsFloat = 1e-05,
) -> tuple[da.Array, da.Array, da.Array]:
    """Lazy: LayerNorm keeping what the backward needs: ``(y, mean, rstd)``.

    ``y = (x - mean) * rstd * weight + bias`` over each row, where ``rstd`` is ``1 /
    sqrt(var(x) + eps)`` (the biased variance).

    Parameters
    ----------
    x : dask.array.Array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes the forward's.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : dask.array.Array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    bias : dask.array.Array or None
        The shift, of shape ``normalized_shape`` and any floating dtype; None: zeros.
    eps : float
        Added to the variance before the square root; finite and >= 0 in the
        accumulation dtype. Default 1e-05.

    Returns
    -------
    y : dask.array.Array
        The normalized input: ``x``'s shape and dtype.
    mean : dask.array.Array
        The mean of each row, of shape ``x.shape[:-k] + (1,) * k`` with ``k =
        len(normalized_shape)`` (keep-dims), in float32 (float64 for float64 inputs):
        the forward returns it and the backward takes it.
    rstd : dask.array.Array
        ``1 / sqrt(var(x) + eps)`` (the biased variance) of each row, of shape
        ``x.shape[:-k] + (1,) * k`` with ``k = len(normalized_shape)`` (keep-dims), in
        float32 (float64 for float64 inputs): the forward returns it and the backward
        takes it.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``normalized_shape`` that is not an int or a sequence of ints; host and device
        arrays mixed in one call.
    ValueError
        ``normalized_shape`` that is empty or does not match the trailing dimensions of
        ``x``; ``weight`` or ``bias`` of the wrong shape; ``eps`` negative, NaN or
        infinite in the accumulation dtype; a zero-sized normalized shape.
    """

def layer_norm_backward(
    dy: da.Array | NDArray[Any],
    x: da.Array | NDArray[Any],
    mean: da.Array | NDArray[Any],
    rstd: da.Array | NDArray[Any],
    normalized_shape: _Shape,
    weight: da.Array | NDArray[Any] | None = None,
) -> tuple[da.Array, da.Array, da.Array]:
    """Lazy: Gradients of LayerNorm: ``(dx, dweight, dbias)``.

    ``y = (x - mean) * rstd * weight + bias`` over each row, where ``rstd`` is ``1 /
    sqrt(var(x) + eps)`` (the biased variance).

    Parameters
    ----------
    dy : dask.array.Array
        The gradient of the loss with respect to ``y``: ``x``'s shape, any floating
        dtype (read as ``x``'s).
    x : dask.array.Array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes the forward's.
    mean : dask.array.Array
        The mean of each row, of shape ``x.shape[:-k] + (1,) * k`` with ``k =
        len(normalized_shape)`` (keep-dims), in float32 (float64 for float64 inputs):
        the forward returns it and the backward takes it.
    rstd : dask.array.Array
        ``1 / sqrt(var(x) + eps)`` (the biased variance) of each row, of shape
        ``x.shape[:-k] + (1,) * k`` with ``k = len(normalized_shape)`` (keep-dims), in
        float32 (float64 for float64 inputs): the forward returns it and the backward
        takes it.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : dask.array.Array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.

    Returns
    -------
    dx : dask.array.Array
        The gradient with respect to ``x``: ``x``'s shape and dtype.
    dweight : dask.array.Array
        The gradient with respect to ``weight``, of shape ``normalized_shape``, summed
        in float32 (float64 for float64 inputs) and returned in ``weight``'s dtype
        (``x``'s without a weight); returned whether or not a weight was given.
    dbias : dask.array.Array
        The gradient with respect to ``bias``, of shape ``normalized_shape``, summed and
        returned as ``dweight``.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``normalized_shape`` that is not an int
        or a sequence of ints; host and device arrays mixed in one call.
    ValueError
        ``normalized_shape`` that is empty or does not match the trailing dimensions of
        ``x``; ``dy`` not of ``x``'s shape; statistics that do not fit it; ``weight`` of
        the wrong shape.
    """

def rms_norm(
    x: da.Array | NDArray[Any],
    normalized_shape: _Shape,
    weight: da.Array | NDArray[Any] | None = None,
    eps: SupportsFloat | None = None,
    *,
    out: None = None,
) -> da.Array:
    """Lazy: RMSNorm over the trailing ``normalized_shape`` of ``x``: ``y``.

    ``y = x * rstd * weight`` over each row, where ``rstd`` is ``1 / sqrt(mean(x**2) +
    eps)``.

    Parameters
    ----------
    x : dask.array.Array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes the forward's.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : dask.array.Array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    eps : float or None
        Added to the mean of squares before the square root; finite and >= 0 in the
        accumulation dtype. Default None: the machine epsilon of the accumulation dtype
        (float32's; float64's for float64 inputs).
    out : None
        Must be None: a lazy result has nowhere to be written (see
        ``dask.array.store``).

    Returns
    -------
    y : dask.array.Array
        The normalized input: ``x``'s shape and dtype.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``normalized_shape`` that is not an int or a sequence of ints; host and device
        arrays mixed in one call; ``out`` given.
    ValueError
        ``normalized_shape`` that is empty or does not match the trailing dimensions of
        ``x``; ``weight`` of the wrong shape; ``eps`` negative, NaN or infinite in the
        accumulation dtype; a zero-sized normalized shape.
    """

def rms_norm_forward(
    x: da.Array | NDArray[Any],
    normalized_shape: _Shape,
    weight: da.Array | NDArray[Any] | None = None,
    eps: SupportsFloat | None = None,
) -> tuple[da.Array, da.Array]:
    """Lazy: RMSNorm keeping what the backward needs: ``(y, rstd)``.

    ``y = x * rstd * weight`` over each row, where ``rstd`` is ``1 / sqrt(mean(x**2) +
    eps)``.

    Parameters
    ----------
    x : dask.array.Array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes the forward's.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : dask.array.Array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    eps : float or None
        Added to the mean of squares before the square root; finite and >= 0 in the
        accumulation dtype. Default None: the machine epsilon of the accumulation dtype
        (float32's; float64's for float64 inputs).

    Returns
    -------
    y : dask.array.Array
        The normalized input: ``x``'s shape and dtype.
    rstd : dask.array.Array
        ``1 / sqrt(mean(x**2) + eps)`` of each row, of shape ``x.shape[:-k] + (1,) * k``
        with ``k = len(normalized_shape)`` (keep-dims), in float32 (float64 for float64
        inputs): the forward returns it and the backward takes it.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``normalized_shape`` that is not an int or a sequence of ints; host and device
        arrays mixed in one call.
    ValueError
        ``normalized_shape`` that is empty or does not match the trailing dimensions of
        ``x``; ``weight`` of the wrong shape; ``eps`` negative, NaN or infinite in the
        accumulation dtype; a zero-sized normalized shape.
    """

def rms_norm_backward(
    dy: da.Array | NDArray[Any],
    x: da.Array | NDArray[Any],
    rstd: da.Array | NDArray[Any],
    normalized_shape: _Shape,
    weight: da.Array | NDArray[Any] | None = None,
) -> tuple[da.Array, da.Array]:
    """Lazy: Gradients of RMSNorm: ``(dx, dweight)``.

    ``y = x * rstd * weight`` over each row, where ``rstd`` is ``1 / sqrt(mean(x**2) +
    eps)``.

    Parameters
    ----------
    dy : dask.array.Array
        The gradient of the loss with respect to ``y``: ``x``'s shape, any floating
        dtype (read as ``x``'s).
    x : dask.array.Array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes the forward's.
    rstd : dask.array.Array
        ``1 / sqrt(mean(x**2) + eps)`` of each row, of shape ``x.shape[:-k] + (1,) * k``
        with ``k = len(normalized_shape)`` (keep-dims), in float32 (float64 for float64
        inputs): the forward returns it and the backward takes it.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : dask.array.Array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.

    Returns
    -------
    dx : dask.array.Array
        The gradient with respect to ``x``: ``x``'s shape and dtype.
    dweight : dask.array.Array
        The gradient with respect to ``weight``, of shape ``normalized_shape``, summed
        in float32 (float64 for float64 inputs) and returned in ``weight``'s dtype
        (``x``'s without a weight); returned whether or not a weight was given.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``normalized_shape`` that is not an int
        or a sequence of ints; host and device arrays mixed in one call.
    ValueError
        ``normalized_shape`` that is empty or does not match the trailing dimensions of
        ``x``; ``dy`` not of ``x``'s shape; statistics that do not fit it; ``weight`` of
        the wrong shape.
    """

def group_norm(
    x: da.Array | NDArray[Any],
    num_groups: int,
    weight: da.Array | NDArray[Any] | None = None,
    bias: da.Array | NDArray[Any] | None = None,
    eps: SupportsFloat = 1e-05,
    *,
    out: None = None,
) -> da.Array:
    """Lazy: GroupNorm of ``x`` of shape ``(N, C, *spatial)``: ``y``.

    ``y = (x - mean) * rstd * weight + bias`` over each (sample, group), weight and bias per
    channel, where ``rstd`` is ``1 / sqrt(var(x) + eps)`` (the biased variance).

    Parameters
    ----------
    x : dask.array.Array
        The input of shape ``(N, C, *spatial)``; each group of ``C // num_groups``
        channels is normalized together with the spatial dimensions, per sample:
        float16, float32, float64 or bfloat16. The backward takes the forward's. Every
        block is normalized in C order, and ``y`` and ``dx`` come back C-contiguous
        whatever ``x``'s layout.
    num_groups : int
        The number of groups the ``C`` channels are split into; it divides ``C``.
        ``num_groups == C`` is instance normalization, ``1`` a layer normalization over
        ``(C, *spatial)`` with a weight and bias per channel.
    weight : dask.array.Array or None
        The scale, of shape ``(C,)`` and any floating dtype; None: ones.
    bias : dask.array.Array or None
        The shift, of shape ``(C,)`` and any floating dtype; None: zeros.
    eps : float
        Added to the variance before the square root; finite and >= 0 in the
        accumulation dtype. Default 1e-05.
    out : None
        Must be None: a lazy result has nowhere to be written (see
        ``dask.array.store``).

    Returns
    -------
    y : dask.array.Array
        The normalized input: ``x``'s shape and dtype.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``num_groups`` that is not an int; host and device arrays mixed in one call;
        ``out`` given.
    ValueError
        ``x`` of fewer than 2 dimensions; ``num_groups`` not positive or not dividing
        ``C``; ``weight`` or ``bias`` of the wrong shape; ``eps`` negative, NaN or
        infinite in the accumulation dtype; a zero-sized group.
    """

def group_norm_forward(
    x: da.Array | NDArray[Any],
    num_groups: int,
    weight: da.Array | NDArray[Any] | None = None,
    bias: da.Array | NDArray[Any] | None = None,
    eps: SupportsFloat = 1e-05,
) -> tuple[da.Array, da.Array, da.Array]:
    """Lazy: GroupNorm keeping what the backward needs: ``(y, mean, rstd)``.

    ``y = (x - mean) * rstd * weight + bias`` over each (sample, group), weight and bias per
    channel, where ``rstd`` is ``1 / sqrt(var(x) + eps)`` (the biased variance).

    Parameters
    ----------
    x : dask.array.Array
        The input of shape ``(N, C, *spatial)``; each group of ``C // num_groups``
        channels is normalized together with the spatial dimensions, per sample:
        float16, float32, float64 or bfloat16. The backward takes the forward's. Every
        block is normalized in C order, and ``y`` and ``dx`` come back C-contiguous
        whatever ``x``'s layout.
    num_groups : int
        The number of groups the ``C`` channels are split into; it divides ``C``.
        ``num_groups == C`` is instance normalization, ``1`` a layer normalization over
        ``(C, *spatial)`` with a weight and bias per channel.
    weight : dask.array.Array or None
        The scale, of shape ``(C,)`` and any floating dtype; None: ones.
    bias : dask.array.Array or None
        The shift, of shape ``(C,)`` and any floating dtype; None: zeros.
    eps : float
        Added to the variance before the square root; finite and >= 0 in the
        accumulation dtype. Default 1e-05.

    Returns
    -------
    y : dask.array.Array
        The normalized input: ``x``'s shape and dtype.
    mean : dask.array.Array
        The mean of each (sample, group), of shape ``(N, num_groups)``, in float32
        (float64 for float64 inputs): the forward returns it and the backward takes it.
    rstd : dask.array.Array
        ``1 / sqrt(var(x) + eps)`` (the biased variance) of each (sample, group), of
        shape ``(N, num_groups)``, in float32 (float64 for float64 inputs): the forward
        returns it and the backward takes it.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``num_groups`` that is not an int; host and device arrays mixed in one call.
    ValueError
        ``x`` of fewer than 2 dimensions; ``num_groups`` not positive or not dividing
        ``C``; ``weight`` or ``bias`` of the wrong shape; ``eps`` negative, NaN or
        infinite in the accumulation dtype; a zero-sized group.
    """

def group_norm_backward(
    dy: da.Array | NDArray[Any],
    x: da.Array | NDArray[Any],
    mean: da.Array | NDArray[Any],
    rstd: da.Array | NDArray[Any],
    weight: da.Array | NDArray[Any] | None = None,
) -> tuple[da.Array, da.Array, da.Array]:
    """Lazy: Gradients of GroupNorm: ``(dx, dweight, dbias)``.

    ``y = (x - mean) * rstd * weight + bias`` over each (sample, group), weight and bias per
    channel, where ``rstd`` is ``1 / sqrt(var(x) + eps)`` (the biased variance).

    Parameters
    ----------
    dy : dask.array.Array
        The gradient of the loss with respect to ``y``: ``x``'s shape, any floating
        dtype (read as ``x``'s).
    x : dask.array.Array
        The input of shape ``(N, C, *spatial)``; each group of ``C // num_groups``
        channels is normalized together with the spatial dimensions, per sample:
        float16, float32, float64 or bfloat16. The backward takes the forward's. Every
        block is normalized in C order, and ``y`` and ``dx`` come back C-contiguous
        whatever ``x``'s layout.
    mean : dask.array.Array
        The mean of each (sample, group), of shape ``(N, num_groups)``, in float32
        (float64 for float64 inputs): the forward returns it and the backward takes it.
    rstd : dask.array.Array
        ``1 / sqrt(var(x) + eps)`` (the biased variance) of each (sample, group), of
        shape ``(N, num_groups)``, in float32 (float64 for float64 inputs): the forward
        returns it and the backward takes it.
    weight : dask.array.Array or None
        The scale, of shape ``(C,)`` and any floating dtype; None: ones.

    Returns
    -------
    dx : dask.array.Array
        The gradient with respect to ``x``: ``x``'s shape and dtype.
    dweight : dask.array.Array
        The gradient with respect to ``weight``, of shape ``(C,)``, summed in float32
        (float64 for float64 inputs) and returned in ``weight``'s dtype (``x``'s without
        a weight); returned whether or not a weight was given.
    dbias : dask.array.Array
        The gradient with respect to ``bias``, of shape ``(C,)``, summed and returned as
        ``dweight``.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; host and device arrays mixed in one
        call.
    ValueError
        ``dy`` not of ``x``'s shape; statistics that do not fit it; ``weight`` of the
        wrong shape.
    """
