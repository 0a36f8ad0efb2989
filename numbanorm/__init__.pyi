# Generated from numbanorm/operations.py by `python -m numbanorm._stubs`: do not edit.

from collections.abc import Sequence
from typing import Any, Protocol, SupportsFloat, SupportsIndex, TypeAlias, overload

from numpy.typing import NDArray

from . import cpu as cpu, cuda as cuda
from .layers import GroupNorm as GroupNorm, LayerNorm as LayerNorm, RMSNorm as RMSNorm

__version__: str


class _CudaArray(Protocol):
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...

class _DLPackArray(Protocol):
    def __dlpack_device__(self) -> tuple[int, int]: ...

# what the top level dispatches on: NumPy arrays to the CPU, CUDA arrays to the GPU
_Array: TypeAlias = NDArray[Any] | _CudaArray | _DLPackArray
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
    "add_layer_norm",
    "add_layer_norm_forward",
    "add_layer_norm_backward",
    "add_rms_norm",
    "add_rms_norm_forward",
    "add_rms_norm_backward",
    "LayerNorm",
    "RMSNorm",
    "GroupNorm",
]

@overload
def layer_norm(
    x: NDArray[Any],
    normalized_shape: _Shape,
    weight: NDArray[Any] | None = None,
    bias: NDArray[Any] | None = None,
    eps: SupportsFloat = 1e-05,
    *,
    out: NDArray[Any] | None = None,
) -> NDArray[Any]:
    """LayerNorm over the trailing ``normalized_shape`` of ``x``: ``y``.

    ``y = (x - mean) * rstd * weight + bias`` over each row, where ``rstd`` is ``1 /
    sqrt(var(x) + eps)`` (the biased variance).

    Parameters
    ----------
    x : array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes the forward's.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    bias : array or None
        The shift, of shape ``normalized_shape`` and any floating dtype; None: zeros.
    eps : float
        Added to the variance before the square root; finite and >= 0 in the
        accumulation dtype. Default 1e-05.
    out : array or None, keyword-only
        Filled with ``y`` and returned: ``x``'s shape and dtype, on ``x``'s side. It may
        overlap the inputs: the result is as if every input were read before ``out`` is
        written.

    Returns
    -------
    y : array
        The normalized input: ``x``'s shape and dtype.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``normalized_shape`` that is not an int or a sequence of ints; host and device
        arrays mixed in one call.
    ValueError
        ``normalized_shape`` that is empty or does not match the trailing dimensions of
        ``x``; ``weight`` or ``bias`` of the wrong shape; ``out`` not of ``x``'s shape
        and dtype; ``eps`` negative, NaN or infinite in the accumulation dtype; a
        zero-sized normalized shape.
    """
@overload
def layer_norm(
    x: _Array,
    normalized_shape: _Shape,
    weight: _Array | None = None,
    bias: _Array | None = None,
    eps: SupportsFloat = 1e-05,
    *,
    out: _Array | None = None,
) -> Any: ...

@overload
def layer_norm_forward(
    x: NDArray[Any],
    normalized_shape: _Shape,
    weight: NDArray[Any] | None = None,
    bias: NDArray[Any] | None = None,
    eps: SupportsFloat = 1e-05,
) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
    """LayerNorm keeping what the backward needs: ``(y, mean, rstd)``.

    ``y = (x - mean) * rstd * weight + bias`` over each row, where ``rstd`` is ``1 /
    sqrt(var(x) + eps)`` (the biased variance).

    Parameters
    ----------
    x : array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes the forward's.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    bias : array or None
        The shift, of shape ``normalized_shape`` and any floating dtype; None: zeros.
    eps : float
        Added to the variance before the square root; finite and >= 0 in the
        accumulation dtype. Default 1e-05.

    Returns
    -------
    y : array
        The normalized input: ``x``'s shape and dtype.
    mean : array
        The mean of each row, of shape ``x.shape[:-k] + (1,) * k`` with ``k =
        len(normalized_shape)`` (keep-dims), in float32 (float64 for float64 inputs):
        the forward returns it and the backward takes it.
    rstd : array
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
@overload
def layer_norm_forward(
    x: _Array,
    normalized_shape: _Shape,
    weight: _Array | None = None,
    bias: _Array | None = None,
    eps: SupportsFloat = 1e-05,
) -> tuple[Any, Any, Any]: ...

@overload
def layer_norm_backward(
    dy: NDArray[Any],
    x: NDArray[Any],
    mean: NDArray[Any],
    rstd: NDArray[Any],
    normalized_shape: _Shape,
    weight: NDArray[Any] | None = None,
) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
    """Gradients of LayerNorm: ``(dx, dweight, dbias)``.

    ``y = (x - mean) * rstd * weight + bias`` over each row, where ``rstd`` is ``1 /
    sqrt(var(x) + eps)`` (the biased variance).

    Parameters
    ----------
    dy : array
        The gradient of the loss with respect to ``y``: ``x``'s shape, any floating
        dtype (read as ``x``'s).
    x : array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes the forward's.
    mean : array
        The mean of each row, of shape ``x.shape[:-k] + (1,) * k`` with ``k =
        len(normalized_shape)`` (keep-dims), in float32 (float64 for float64 inputs):
        the forward returns it and the backward takes it.
    rstd : array
        ``1 / sqrt(var(x) + eps)`` (the biased variance) of each row, of shape
        ``x.shape[:-k] + (1,) * k`` with ``k = len(normalized_shape)`` (keep-dims), in
        float32 (float64 for float64 inputs): the forward returns it and the backward
        takes it.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.

    Returns
    -------
    dx : array
        The gradient with respect to ``x``: ``x``'s shape and dtype.
    dweight : array
        The gradient with respect to ``weight``, of shape ``normalized_shape``, summed
        in float32 (float64 for float64 inputs) and returned in ``weight``'s dtype
        (``x``'s without a weight); returned whether or not a weight was given.
    dbias : array
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
@overload
def layer_norm_backward(
    dy: _Array,
    x: _Array,
    mean: _Array,
    rstd: _Array,
    normalized_shape: _Shape,
    weight: _Array | None = None,
) -> tuple[Any, Any, Any]: ...

@overload
def rms_norm(
    x: NDArray[Any],
    normalized_shape: _Shape,
    weight: NDArray[Any] | None = None,
    eps: SupportsFloat | None = None,
    *,
    out: NDArray[Any] | None = None,
) -> NDArray[Any]:
    """RMSNorm over the trailing ``normalized_shape`` of ``x``: ``y``.

    ``y = x * rstd * weight`` over each row, where ``rstd`` is ``1 / sqrt(mean(x**2) +
    eps)``.

    Parameters
    ----------
    x : array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes the forward's.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    eps : float or None
        Added to the mean of squares before the square root; finite and >= 0 in the
        accumulation dtype. Default None: the machine epsilon of the accumulation dtype
        (float32's; float64's for float64 inputs).
    out : array or None, keyword-only
        Filled with ``y`` and returned: ``x``'s shape and dtype, on ``x``'s side. It may
        overlap the inputs: the result is as if every input were read before ``out`` is
        written.

    Returns
    -------
    y : array
        The normalized input: ``x``'s shape and dtype.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``normalized_shape`` that is not an int or a sequence of ints; host and device
        arrays mixed in one call.
    ValueError
        ``normalized_shape`` that is empty or does not match the trailing dimensions of
        ``x``; ``weight`` of the wrong shape; ``out`` not of ``x``'s shape and dtype;
        ``eps`` negative, NaN or infinite in the accumulation dtype; a zero-sized
        normalized shape.
    """
@overload
def rms_norm(
    x: _Array,
    normalized_shape: _Shape,
    weight: _Array | None = None,
    eps: SupportsFloat | None = None,
    *,
    out: _Array | None = None,
) -> Any: ...

@overload
def rms_norm_forward(
    x: NDArray[Any],
    normalized_shape: _Shape,
    weight: NDArray[Any] | None = None,
    eps: SupportsFloat | None = None,
) -> tuple[NDArray[Any], NDArray[Any]]:
    """RMSNorm keeping what the backward needs: ``(y, rstd)``.

    ``y = x * rstd * weight`` over each row, where ``rstd`` is ``1 / sqrt(mean(x**2) +
    eps)``.

    Parameters
    ----------
    x : array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes the forward's.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    eps : float or None
        Added to the mean of squares before the square root; finite and >= 0 in the
        accumulation dtype. Default None: the machine epsilon of the accumulation dtype
        (float32's; float64's for float64 inputs).

    Returns
    -------
    y : array
        The normalized input: ``x``'s shape and dtype.
    rstd : array
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
@overload
def rms_norm_forward(
    x: _Array,
    normalized_shape: _Shape,
    weight: _Array | None = None,
    eps: SupportsFloat | None = None,
) -> tuple[Any, Any]: ...

@overload
def rms_norm_backward(
    dy: NDArray[Any],
    x: NDArray[Any],
    rstd: NDArray[Any],
    normalized_shape: _Shape,
    weight: NDArray[Any] | None = None,
) -> tuple[NDArray[Any], NDArray[Any]]:
    """Gradients of RMSNorm: ``(dx, dweight)``.

    ``y = x * rstd * weight`` over each row, where ``rstd`` is ``1 / sqrt(mean(x**2) +
    eps)``.

    Parameters
    ----------
    dy : array
        The gradient of the loss with respect to ``y``: ``x``'s shape, any floating
        dtype (read as ``x``'s).
    x : array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes the forward's.
    rstd : array
        ``1 / sqrt(mean(x**2) + eps)`` of each row, of shape ``x.shape[:-k] + (1,) * k``
        with ``k = len(normalized_shape)`` (keep-dims), in float32 (float64 for float64
        inputs): the forward returns it and the backward takes it.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.

    Returns
    -------
    dx : array
        The gradient with respect to ``x``: ``x``'s shape and dtype.
    dweight : array
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
@overload
def rms_norm_backward(
    dy: _Array,
    x: _Array,
    rstd: _Array,
    normalized_shape: _Shape,
    weight: _Array | None = None,
) -> tuple[Any, Any]: ...

@overload
def group_norm(
    x: NDArray[Any],
    num_groups: int,
    weight: NDArray[Any] | None = None,
    bias: NDArray[Any] | None = None,
    eps: SupportsFloat = 1e-05,
    *,
    out: NDArray[Any] | None = None,
) -> NDArray[Any]:
    """GroupNorm of ``x`` of shape ``(N, C, *spatial)``: ``y``.

    ``y = (x - mean) * rstd * weight + bias`` over each (sample, group), weight and bias per
    channel, where ``rstd`` is ``1 / sqrt(var(x) + eps)`` (the biased variance).

    Parameters
    ----------
    x : array
        The input of shape ``(N, C, *spatial)``; each group of ``C // num_groups``
        channels is normalized together with the spatial dimensions, per sample:
        float16, float32, float64 or bfloat16. The backward takes the forward's. On the
        CPU, an ``x`` of 4 or 5 dimensions in channels-last order (laid out as ``(N,
        *spatial, C)``: torch's ``channels_last``) is read in that order, and ``y`` and
        ``dx`` come back in it, as ``torch.nn.functional.group_norm``'s do on the CPU;
        on a GPU (``numbanorm.cuda``, or device arrays) they come back C-contiguous.
    num_groups : int
        The number of groups the ``C`` channels are split into; it divides ``C``.
        ``num_groups == C`` is instance normalization, ``1`` a layer normalization over
        ``(C, *spatial)`` with a weight and bias per channel.
    weight : array or None
        The scale, of shape ``(C,)`` and any floating dtype; None: ones.
    bias : array or None
        The shift, of shape ``(C,)`` and any floating dtype; None: zeros.
    eps : float
        Added to the variance before the square root; finite and >= 0 in the
        accumulation dtype. Default 1e-05.
    out : array or None, keyword-only
        Filled with ``y`` and returned: ``x``'s shape and dtype, on ``x``'s side. It may
        overlap the inputs: the result is as if every input were read before ``out`` is
        written.

    Returns
    -------
    y : array
        The normalized input: ``x``'s shape and dtype.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``num_groups`` that is not an int; host and device arrays mixed in one call.
    ValueError
        ``x`` of fewer than 2 dimensions; ``num_groups`` not positive or not dividing
        ``C``; ``weight`` or ``bias`` of the wrong shape; ``out`` not of ``x``'s shape
        and dtype; ``eps`` negative, NaN or infinite in the accumulation dtype; a
        zero-sized group.
    """
@overload
def group_norm(
    x: _Array,
    num_groups: int,
    weight: _Array | None = None,
    bias: _Array | None = None,
    eps: SupportsFloat = 1e-05,
    *,
    out: _Array | None = None,
) -> Any: ...

@overload
def group_norm_forward(
    x: NDArray[Any],
    num_groups: int,
    weight: NDArray[Any] | None = None,
    bias: NDArray[Any] | None = None,
    eps: SupportsFloat = 1e-05,
) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
    """GroupNorm keeping what the backward needs: ``(y, mean, rstd)``.

    ``y = (x - mean) * rstd * weight + bias`` over each (sample, group), weight and bias per
    channel, where ``rstd`` is ``1 / sqrt(var(x) + eps)`` (the biased variance).

    Parameters
    ----------
    x : array
        The input of shape ``(N, C, *spatial)``; each group of ``C // num_groups``
        channels is normalized together with the spatial dimensions, per sample:
        float16, float32, float64 or bfloat16. The backward takes the forward's. On the
        CPU, an ``x`` of 4 or 5 dimensions in channels-last order (laid out as ``(N,
        *spatial, C)``: torch's ``channels_last``) is read in that order, and ``y`` and
        ``dx`` come back in it, as ``torch.nn.functional.group_norm``'s do on the CPU;
        on a GPU (``numbanorm.cuda``, or device arrays) they come back C-contiguous.
    num_groups : int
        The number of groups the ``C`` channels are split into; it divides ``C``.
        ``num_groups == C`` is instance normalization, ``1`` a layer normalization over
        ``(C, *spatial)`` with a weight and bias per channel.
    weight : array or None
        The scale, of shape ``(C,)`` and any floating dtype; None: ones.
    bias : array or None
        The shift, of shape ``(C,)`` and any floating dtype; None: zeros.
    eps : float
        Added to the variance before the square root; finite and >= 0 in the
        accumulation dtype. Default 1e-05.

    Returns
    -------
    y : array
        The normalized input: ``x``'s shape and dtype.
    mean : array
        The mean of each (sample, group), of shape ``(N, num_groups)``, in float32
        (float64 for float64 inputs): the forward returns it and the backward takes it.
    rstd : array
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
@overload
def group_norm_forward(
    x: _Array,
    num_groups: int,
    weight: _Array | None = None,
    bias: _Array | None = None,
    eps: SupportsFloat = 1e-05,
) -> tuple[Any, Any, Any]: ...

@overload
def group_norm_backward(
    dy: NDArray[Any],
    x: NDArray[Any],
    mean: NDArray[Any],
    rstd: NDArray[Any],
    weight: NDArray[Any] | None = None,
) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
    """Gradients of GroupNorm: ``(dx, dweight, dbias)``.

    ``y = (x - mean) * rstd * weight + bias`` over each (sample, group), weight and bias per
    channel, where ``rstd`` is ``1 / sqrt(var(x) + eps)`` (the biased variance).

    Parameters
    ----------
    dy : array
        The gradient of the loss with respect to ``y``: ``x``'s shape, any floating
        dtype (read as ``x``'s).
    x : array
        The input of shape ``(N, C, *spatial)``; each group of ``C // num_groups``
        channels is normalized together with the spatial dimensions, per sample:
        float16, float32, float64 or bfloat16. The backward takes the forward's. On the
        CPU, an ``x`` of 4 or 5 dimensions in channels-last order (laid out as ``(N,
        *spatial, C)``: torch's ``channels_last``) is read in that order, and ``y`` and
        ``dx`` come back in it, as ``torch.nn.functional.group_norm``'s do on the CPU;
        on a GPU (``numbanorm.cuda``, or device arrays) they come back C-contiguous.
    mean : array
        The mean of each (sample, group), of shape ``(N, num_groups)``, in float32
        (float64 for float64 inputs): the forward returns it and the backward takes it.
    rstd : array
        ``1 / sqrt(var(x) + eps)`` (the biased variance) of each (sample, group), of
        shape ``(N, num_groups)``, in float32 (float64 for float64 inputs): the forward
        returns it and the backward takes it.
    weight : array or None
        The scale, of shape ``(C,)`` and any floating dtype; None: ones.

    Returns
    -------
    dx : array
        The gradient with respect to ``x``: ``x``'s shape and dtype.
    dweight : array
        The gradient with respect to ``weight``, of shape ``(C,)``, summed in float32
        (float64 for float64 inputs) and returned in ``weight``'s dtype (``x``'s without
        a weight); returned whether or not a weight was given.
    dbias : array
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
@overload
def group_norm_backward(
    dy: _Array,
    x: _Array,
    mean: _Array,
    rstd: _Array,
    weight: _Array | None = None,
) -> tuple[Any, Any, Any]: ...

@overload
def add_layer_norm(
    x: NDArray[Any],
    residual: NDArray[Any],
    normalized_shape: _Shape,
    weight: NDArray[Any] | None = None,
    bias: NDArray[Any] | None = None,
    eps: SupportsFloat = 1e-05,
) -> tuple[NDArray[Any], NDArray[Any]]:
    """``s = x + residual`` and its LayerNorm in one pass over memory: ``(y, s)``.

    ``s = x + residual``, then ``y = (s - mean) * rstd * weight + bias`` over each row,
    where ``rstd`` is ``1 / sqrt(var(s) + eps)`` (the biased variance).

    Parameters
    ----------
    x : array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes ``s`` in its place.
    residual : array
        The residual branch, added to ``x`` before the norm (``s = x + residual``):
        ``x``'s shape and dtype.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    bias : array or None
        The shift, of shape ``normalized_shape`` and any floating dtype; None: zeros.
    eps : float
        Added to the variance before the square root; finite and >= 0 in the
        accumulation dtype. Default 1e-05.

    Returns
    -------
    y : array
        The normalized input: ``x``'s shape and dtype.
    s : array
        ``x + residual`` in ``x``'s dtype, the next residual branch's input: the fused
        forward returns it and the backward takes it.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``normalized_shape`` that is not an int or a sequence of ints; host and device
        arrays mixed in one call.
    ValueError
        ``normalized_shape`` that is empty or does not match the trailing dimensions of
        ``x``; ``weight`` or ``bias`` of the wrong shape; ``residual`` not of ``x``'s
        shape and dtype; ``eps`` negative, NaN or infinite in the accumulation dtype; a
        zero-sized normalized shape.
    """
@overload
def add_layer_norm(
    x: _Array,
    residual: _Array,
    normalized_shape: _Shape,
    weight: _Array | None = None,
    bias: _Array | None = None,
    eps: SupportsFloat = 1e-05,
) -> tuple[Any, Any]: ...

@overload
def add_layer_norm_forward(
    x: NDArray[Any],
    residual: NDArray[Any],
    normalized_shape: _Shape,
    weight: NDArray[Any] | None = None,
    bias: NDArray[Any] | None = None,
    eps: SupportsFloat = 1e-05,
) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any], NDArray[Any]]:
    """Fused add + LayerNorm keeping what the backward needs: ``(y, s, mean, rstd)``.

    ``s = x + residual``, then ``y = (s - mean) * rstd * weight + bias`` over each row,
    where ``rstd`` is ``1 / sqrt(var(s) + eps)`` (the biased variance).

    Parameters
    ----------
    x : array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes ``s`` in its place.
    residual : array
        The residual branch, added to ``x`` before the norm (``s = x + residual``):
        ``x``'s shape and dtype.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    bias : array or None
        The shift, of shape ``normalized_shape`` and any floating dtype; None: zeros.
    eps : float
        Added to the variance before the square root; finite and >= 0 in the
        accumulation dtype. Default 1e-05.

    Returns
    -------
    y : array
        The normalized input: ``x``'s shape and dtype.
    s : array
        ``x + residual`` in ``x``'s dtype, the next residual branch's input: the fused
        forward returns it and the backward takes it.
    mean : array
        The mean of each row, of shape ``x.shape[:-k] + (1,) * k`` with ``k =
        len(normalized_shape)`` (keep-dims), in float32 (float64 for float64 inputs):
        the forward returns it and the backward takes it.
    rstd : array
        ``1 / sqrt(var(s) + eps)`` (the biased variance) of each row, of shape
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
        ``x``; ``weight`` or ``bias`` of the wrong shape; ``residual`` not of ``x``'s
        shape and dtype; ``eps`` negative, NaN or infinite in the accumulation dtype; a
        zero-sized normalized shape.
    """
@overload
def add_layer_norm_forward(
    x: _Array,
    residual: _Array,
    normalized_shape: _Shape,
    weight: _Array | None = None,
    bias: _Array | None = None,
    eps: SupportsFloat = 1e-05,
) -> tuple[Any, Any, Any, Any]: ...

@overload
def add_layer_norm_backward(
    dy: NDArray[Any],
    ds: NDArray[Any] | None,
    s: NDArray[Any],
    mean: NDArray[Any],
    rstd: NDArray[Any],
    normalized_shape: _Shape,
    weight: NDArray[Any] | None = None,
) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
    """Gradients of fused add + LayerNorm: ``(dx, dweight, dbias)``.

    ``s = x + residual``, then ``y = (s - mean) * rstd * weight + bias`` over each row,
    where ``rstd`` is ``1 / sqrt(var(s) + eps)`` (the biased variance).

    Parameters
    ----------
    dy : array
        The gradient of the loss with respect to ``y``: ``s``'s shape, any floating
        dtype (read as ``s``'s).
    ds : array or None
        The gradient reaching ``s`` from later layers, added to ``dx``: ``s``'s shape;
        None: zero.
    s : array
        ``x + residual`` in ``x``'s dtype, the next residual branch's input: the fused
        forward returns it and the backward takes it.
    mean : array
        The mean of each row, of shape ``x.shape[:-k] + (1,) * k`` with ``k =
        len(normalized_shape)`` (keep-dims), in float32 (float64 for float64 inputs):
        the forward returns it and the backward takes it.
    rstd : array
        ``1 / sqrt(var(s) + eps)`` (the biased variance) of each row, of shape
        ``x.shape[:-k] + (1,) * k`` with ``k = len(normalized_shape)`` (keep-dims), in
        float32 (float64 for float64 inputs): the forward returns it and the backward
        takes it.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.

    Returns
    -------
    dx : array
        The gradient with respect to ``x`` and ``residual`` (the two are equal): the
        norm's input gradient plus ``ds``: ``x``'s shape and dtype.
    dweight : array
        The gradient with respect to ``weight``, of shape ``normalized_shape``, summed
        in float32 (float64 for float64 inputs) and returned in ``weight``'s dtype
        (``x``'s without a weight); returned whether or not a weight was given.
    dbias : array
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
        ``s``; ``dy`` or ``ds`` not of ``s``'s shape; statistics that do not fit it;
        ``weight`` of the wrong shape.
    """
@overload
def add_layer_norm_backward(
    dy: _Array,
    ds: _Array | None,
    s: _Array,
    mean: _Array,
    rstd: _Array,
    normalized_shape: _Shape,
    weight: _Array | None = None,
) -> tuple[Any, Any, Any]: ...

@overload
def add_rms_norm(
    x: NDArray[Any],
    residual: NDArray[Any],
    normalized_shape: _Shape,
    weight: NDArray[Any] | None = None,
    eps: SupportsFloat | None = None,
) -> tuple[NDArray[Any], NDArray[Any]]:
    """``s = x + residual`` and its RMSNorm in one pass over memory: ``(y, s)``.

    ``s = x + residual``, then ``y = s * rstd * weight`` over each row, where ``rstd`` is
    ``1 / sqrt(mean(s**2) + eps)``.

    Parameters
    ----------
    x : array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes ``s`` in its place.
    residual : array
        The residual branch, added to ``x`` before the norm (``s = x + residual``):
        ``x``'s shape and dtype.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    eps : float or None
        Added to the mean of squares before the square root; finite and >= 0 in the
        accumulation dtype. Default None: the machine epsilon of the accumulation dtype
        (float32's; float64's for float64 inputs).

    Returns
    -------
    y : array
        The normalized input: ``x``'s shape and dtype.
    s : array
        ``x + residual`` in ``x``'s dtype, the next residual branch's input: the fused
        forward returns it and the backward takes it.

    Raises
    ------
    TypeError
        A required array argument that is None; an array argument of another dtype than
        float16, float32, float64 and bfloat16; ``eps`` that is not a real number;
        ``normalized_shape`` that is not an int or a sequence of ints; host and device
        arrays mixed in one call.
    ValueError
        ``normalized_shape`` that is empty or does not match the trailing dimensions of
        ``x``; ``weight`` of the wrong shape; ``residual`` not of ``x``'s shape and
        dtype; ``eps`` negative, NaN or infinite in the accumulation dtype; a zero-sized
        normalized shape.
    """
@overload
def add_rms_norm(
    x: _Array,
    residual: _Array,
    normalized_shape: _Shape,
    weight: _Array | None = None,
    eps: SupportsFloat | None = None,
) -> tuple[Any, Any]: ...

@overload
def add_rms_norm_forward(
    x: NDArray[Any],
    residual: NDArray[Any],
    normalized_shape: _Shape,
    weight: NDArray[Any] | None = None,
    eps: SupportsFloat | None = None,
) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
    """Fused add + RMSNorm keeping what the backward needs: ``(y, s, rstd)``.

    ``s = x + residual``, then ``y = s * rstd * weight`` over each row, where ``rstd`` is
    ``1 / sqrt(mean(s**2) + eps)``.

    Parameters
    ----------
    x : array
        The input; its trailing ``normalized_shape`` dimensions are normalized together:
        float16, float32, float64 or bfloat16. The backward takes ``s`` in its place.
    residual : array
        The residual branch, added to ``x`` before the norm (``s = x + residual``):
        ``x``'s shape and dtype.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.
    eps : float or None
        Added to the mean of squares before the square root; finite and >= 0 in the
        accumulation dtype. Default None: the machine epsilon of the accumulation dtype
        (float32's; float64's for float64 inputs).

    Returns
    -------
    y : array
        The normalized input: ``x``'s shape and dtype.
    s : array
        ``x + residual`` in ``x``'s dtype, the next residual branch's input: the fused
        forward returns it and the backward takes it.
    rstd : array
        ``1 / sqrt(mean(s**2) + eps)`` of each row, of shape ``x.shape[:-k] + (1,) * k``
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
        ``x``; ``weight`` of the wrong shape; ``residual`` not of ``x``'s shape and
        dtype; ``eps`` negative, NaN or infinite in the accumulation dtype; a zero-sized
        normalized shape.
    """
@overload
def add_rms_norm_forward(
    x: _Array,
    residual: _Array,
    normalized_shape: _Shape,
    weight: _Array | None = None,
    eps: SupportsFloat | None = None,
) -> tuple[Any, Any, Any]: ...

@overload
def add_rms_norm_backward(
    dy: NDArray[Any],
    ds: NDArray[Any] | None,
    s: NDArray[Any],
    rstd: NDArray[Any],
    normalized_shape: _Shape,
    weight: NDArray[Any] | None = None,
) -> tuple[NDArray[Any], NDArray[Any]]:
    """Gradients of fused add + RMSNorm: ``(dx, dweight)``.

    ``s = x + residual``, then ``y = s * rstd * weight`` over each row, where ``rstd`` is
    ``1 / sqrt(mean(s**2) + eps)``.

    Parameters
    ----------
    dy : array
        The gradient of the loss with respect to ``y``: ``s``'s shape, any floating
        dtype (read as ``s``'s).
    ds : array or None
        The gradient reaching ``s`` from later layers, added to ``dx``: ``s``'s shape;
        None: zero.
    s : array
        ``x + residual`` in ``x``'s dtype, the next residual branch's input: the fused
        forward returns it and the backward takes it.
    rstd : array
        ``1 / sqrt(mean(s**2) + eps)`` of each row, of shape ``x.shape[:-k] + (1,) * k``
        with ``k = len(normalized_shape)`` (keep-dims), in float32 (float64 for float64
        inputs): the forward returns it and the backward takes it.
    normalized_shape : int or sequence of int
        The trailing dimensions of ``x`` normalized together, as in PyTorch.
    weight : array or None
        The scale, of shape ``normalized_shape`` and any floating dtype; None: ones.

    Returns
    -------
    dx : array
        The gradient with respect to ``x`` and ``residual`` (the two are equal): the
        norm's input gradient plus ``ds``: ``x``'s shape and dtype.
    dweight : array
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
        ``s``; ``dy`` or ``ds`` not of ``s``'s shape; statistics that do not fit it;
        ``weight`` of the wrong shape.
    """
@overload
def add_rms_norm_backward(
    dy: _Array,
    ds: _Array | None,
    s: _Array,
    rstd: _Array,
    normalized_shape: _Shape,
    weight: _Array | None = None,
) -> tuple[Any, Any]: ...
