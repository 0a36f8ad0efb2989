"""The one validation layer every public function passes through first.

Everything here looks only at types, shapes and dtypes: it never allocates an
output, never launches a kernel and never makes a CUDA call, so a bad argument is
reported before anything is written (contract, "Errors").

Two checks return the flattened problem the kernels see: ``rows`` gives
``(rows, cols, normalized_shape)`` for layer/RMS norm (``normalized_shape`` as a
tuple), ``groups`` gives ``(N, C, spatial, num_groups)`` for group norm (ints).
The dtype and scalar checks return the value checked (the dtype, the eps as a
float); the array checks return the array (or None).
"""

from __future__ import annotations

import math
import numbers
import operator
import sys

import numpy as np
# at import, not at a first call (Numba's typing asks for it too): a fork from another
# thread inside that import would copy its import lock held, and hang the child's first call
from numpy.ma import MaskedArray

HOST = "host"
DEVICE = "device"

_DLPACK_CUDA_DEVICES = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


_TORCH_TYPES = {}  # type -> whether it is torch.Tensor or a subclass, learned per type


def _is_torch_type(t):
    known = _TORCH_TYPES.get(t)
    if known is None:
        torch = sys.modules.get("torch")  # (a type seen before torch was imported is not torch's)
        known = _TORCH_TYPES[t] = torch is not None and issubclass(t, torch.Tensor)
    return known


def side_of(a):
    """``HOST``, ``DEVICE`` or ``None`` for one argument, from its type alone (a torch
    tensor's, from its type and ``is_cuda``)."""
    if a is None:
        return None
    t = type(a)
    if t is np.ndarray:  # the common case, decided without attribute probing
        return HOST
    # numba's device arrays, and the CUDA simulator's (which have no
    # __cuda_array_interface__ and would otherwise pass for NumPy arrays)
    if getattr(t, "__cuda_ndarray__", False):
        return DEVICE
    # a torch tensor without its interface, which PyTorch builds whole on every access
    # (the costliest part of a repeated GPU call on an H200's host)
    if _is_torch_type(t):
        return DEVICE if a.is_cuda else HOST
    if hasattr(a, "__cuda_array_interface__"):
        return DEVICE
    dev = getattr(a, "__dlpack_device__", None)
    if dev is not None:
        try:
            kind = dev()[0]
        except Exception:  # a library that cannot say: treat as host memory
            return HOST
        return DEVICE if int(kind) in _DLPACK_CUDA_DEVICES else HOST
    return HOST


def common_side(**arrays):
    """The side all given arrays live on; ``TypeError`` naming the odd one out."""
    first_name = side = None
    for name, a in arrays.items():
        if name == "out" and a is not None and not hasattr(a, "dtype"):
            raise TypeError(f"`out` must be an array to write the result into, got {type(a).__name__}")
        s = side_of(a)
        if s is None:
            continue
        if side is None:
            first_name, side = name, s
        elif s != side:
            raise TypeError(
                f"`{name}` is a {s} array but `{first_name}` is a {side} array: all "
                "arrays of one call must live on the same side (nothing is copied "
                "silently: move them to one; numbanorm.cuda runs a call of host arrays "
                "on the GPU, copying them in and out)"
            )
    return side or HOST


def host_array(name, a):
    """A host argument (not None, not a NumPy array itself) as the NumPy array the kernels
    read, without a copy: an ndarray subclass's data, a CPU torch tensor's memory (bfloat16
    as ``ml_dtypes.bfloat16``), anything else as ``np.asarray`` makes it (a list, ...);
    ``TypeError`` naming ``name`` where that would hide something: a masked array's mask,
    a tensor's gradient, a Dask array's laziness."""
    dask_array = sys.modules.get("dask.array")  # (not imported: no Dask array exists)
    if dask_array is not None and isinstance(a, dask_array.Array):
        raise TypeError(
            f"`{name}` is a Dask array, which numbanorm's functions would compute whole into memory: "
            f"numbanorm.dask's take it and stay lazy (`{name}.compute()` for a NumPy array)"
        )
    if isinstance(a, MaskedArray):
        if name == "out":
            raise TypeError("`out` is a masked array: numbanorm writes every element; pass its data (`out.data`)")
        raise TypeError(
            f"`{name}` is a masked array, whose masked elements numbanorm would normalize as "
            f"data: pass `{name}.filled(...)`, or the values to keep"
        )
    if _is_torch_type(type(a)):
        refuse_gradient(name, a)
        if a.device.type != "cpu":  # (a meta tensor, ...: torch's own refusal names no argument)
            raise TypeError(f"`{name}` is a torch.Tensor on {a.device}: numbanorm's host functions take CPU tensors")
        float_dtype(name, a)  # (before DLPack, whose refusal of float8 and others names no argument)
        if a.layout != sys.modules["torch"].strided or a.is_quantized or a.is_nested:
            raise TypeError(f"`{name}` is a torch.Tensor of layout {a.layout}"
                            f"{' (quantized)' if a.is_quantized else ' (nested)' if a.is_nested else ''}: "
                            "numbanorm takes strided tensors of floats")
        if name == "out" and a.is_neg():  # (its NumPy view would be a copy, which the call would fill)
            raise TypeError("`out` is a torch.Tensor with the negative bit (`out.is_neg()`), whose memory "
                            "holds its values negated: pass a tensor of its own")
        return tensor_array(a)
    if name == "out" and not isinstance(a, np.ndarray):  # (np.asarray of another may be a copy, filled unseen)
        raise TypeError(f"`out` must be a NumPy array or a CPU torch.Tensor, got {type(a).__name__}")
    return np.asarray(a)


def refuse_gradient(name, t):
    """``TypeError`` for a torch tensor ``t`` that requires grad, which numbanorm's functions
    would neither record nor keep (torch refuses its NumPy view and its CUDA Array Interface
    with a RuntimeError of its own)."""
    if t.requires_grad:
        raise TypeError(
            f"`{name}` is a torch.Tensor that requires grad: numbanorm.torch's functions take "
            f"tensors and record the gradient; numbanorm's take arrays (`{name}.detach()` "
            "drops the gradient)"
        )


def tensor_array(t):
    """A CPU tensor ``t`` (no gradient) as a NumPy array over its memory, its negative bit
    resolved; bfloat16 as ``ml_dtypes.bfloat16`` (NumPy has none of its own: ``TypeError``
    without ml_dtypes).  Through DLPack, not ``Tensor.numpy()``, which marks the tensor's
    storage unresizable for good: FSDP frees a parameter's unsharded storage by resizing it."""
    torch = sys.modules["torch"]
    if t.is_neg() or t.is_conj():  # (DLPack takes neither bit)
        t = t.resolve_neg().resolve_conj()
    if t.dtype is torch.bfloat16:
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("bfloat16 CPU tensors reach numbanorm as NumPy ml_dtypes.bfloat16 "
                            "arrays: pip install ml-dtypes") from None
        return np.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)
    return np.from_dlpack(t)


def one_device(devices):
    """The GPU of a call's arrays (``devices``: role -> GPU ordinal, None for an absent or
    host array); ``ValueError`` naming the odd one out when they are on two."""
    on = [(name, d) for name, d in devices.items() if d is not None]
    if not on:
        return None
    first_name, first = on[0]
    odd = next(((name, d) for name, d in on if d != first), None)
    if odd is not None:
        raise ValueError(
            f"`{odd[0]}` is on GPU {odd[1]} but `{first_name}` is on GPU {first}: all arrays of one "
            "call must be on the same GPU (nothing is copied between devices)"
        )
    return first


def float_dtype(name, a):
    """The NumPy dtype of ``a``; ``TypeError`` naming it unless numbanorm computes in it.

    float16, float32, float64 in native byte order, and bfloat16 (``ml_dtypes``'
    NumPy dtype, or a torch dtype).  Everything else -- ints, complex,
    ``longdouble``, the other ``ml_dtypes`` types (float8 variants, int4), and
    byte-swapped floats -- is refused here, before any kernel is compiled.
    """
    dt = getattr(a, "dtype", None)
    if dt is None:
        raise TypeError(f"`{name}` must be an array, got {type(a).__name__}")
    try:
        dt = np.dtype(dt)
    except TypeError:
        # torch dtypes and other non-NumPy dtype objects
        dt = _foreign_dtype(dt)
    if dt is _BF16 or (isinstance(dt, np.dtype) and (dt in _FLOATS or _is_bfloat16(dt))):
        return dt
    shown = getattr(a, "dtype", type(a).__name__)
    if isinstance(dt, np.dtype) and dt.kind == "f" and dt.itemsize in (2, 4, 8) and not dt.isnative:
        raise TypeError(
            f"`{name}` has the byte-swapped dtype {dt.str!r}; numbanorm computes in native "
            f"byte order only: pass `{name}.astype({dt.newbyteorder('=').name})`"
        )
    raise TypeError(
        f"`{name}` has dtype {shown}; numbanorm normalizes float16, float32, float64 and "
        "bfloat16 arrays only"
    )


def layer_dtype(dtype):
    """A layer's ``dtype=`` as a NumPy dtype (None: float32, as torch's default dtype, not
    NumPy's float64): :func:`float_dtype`'s ``TypeError``, naming it, unless numbanorm
    computes in it (at construction, not at the first forward)."""
    try:
        dt = np.dtype(np.float32 if dtype is None else dtype)
    except TypeError:
        raise TypeError(f"`dtype` must be a NumPy dtype, got {dtype!r}") from None
    if dt.kind == "f" and not dt.isnative:  # (float_dtype's advice is an array's astype)
        raise TypeError(f"`dtype` is the byte-swapped {dt.str!r}; numbanorm computes in native byte "
                        f"order only: pass dtype={dt.newbyteorder('=').name}")
    return float_dtype("dtype", np.empty(0, dt))


_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _is_bfloat16(dt):
    """``ml_dtypes.bfloat16``, by dtype comparison (never imported: such an array can
    exist only once its caller has imported ml_dtypes)."""
    mld = sys.modules.get("ml_dtypes")
    return mld is not None and dt == np.dtype(mld.bfloat16)


def _foreign_dtype(dt):
    s = str(dt).replace("torch.", "")
    if s in ("float16", "half"):
        return np.dtype(np.float16)
    if s in ("float32", "float"):
        return np.dtype(np.float32)
    if s in ("float64", "double"):
        return np.dtype(np.float64)
    if s == "bfloat16":
        try:
            import ml_dtypes  # noqa: F401  (gives NumPy a bfloat16 dtype)

            return np.dtype("bfloat16")
        except Exception:
            return _BF16
    return None


class _BFloat16Marker:
    """Stands for bfloat16 where NumPy has no such dtype (no ml_dtypes)."""

    kind = "f"
    name = "bfloat16"
    itemsize = 2


_BF16 = _BFloat16Marker()


def acc_dtype(dt):
    """Accumulation/statistics dtype: float64 for float64, float32 otherwise."""
    return np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)


def real_eps(eps, *, allow_none=False):
    """``eps`` as a Python float, its type checked (a real number, not a bool, not a string;
    None where ``allow_none``); its value is :func:`check_eps`'s to check.  An int beyond
    any float is inf."""
    if eps is None and allow_none:
        return None
    if isinstance(eps, (bool, np.bool_)) or not (isinstance(eps, numbers.Real) or _bfloat16_scalar(eps)):
        raise TypeError(f"`eps` must be a real number, got {eps!r} of type {type(eps).__name__}")
    try:
        return float(eps)
    except OverflowError:
        return math.inf


def _bfloat16_scalar(v):
    """An ``ml_dtypes.bfloat16`` scalar: a real number that ``numbers.Real`` does not know."""
    return isinstance(v, np.generic) and _is_bfloat16(v.dtype)


def check_eps(eps, dt=None, *, allow_none=False):
    """``eps`` as a Python float: a real number (not a bool, not a string) that is
    finite and >= 0 once converted to the accumulation dtype of ``dt`` (float64
    when ``dt`` is None): 1e39 passes as a float but is inf in float32."""
    e = real_eps(eps, allow_none=allow_none)
    if e is None:
        return None
    acc = acc_dtype(dt) if dt is not None else np.dtype(np.float64)
    if acc != np.float64 and math.isfinite(e):
        with np.errstate(over="ignore", invalid="ignore"):
            e = float(acc.type(e))
    if not math.isfinite(e) or e < 0:
        raise ValueError(f"`eps` must be finite and >= 0 in {acc} (the accumulation dtype), got {eps!r}")
    return e


def rms_eps(eps, dt):
    """``eps=None`` means the machine epsilon of the accumulation dtype."""
    e = check_eps(eps, dt, allow_none=True)
    return float(np.finfo(acc_dtype(dt)).eps) if e is None else e


def integer(name, value):
    """``value`` as an int; ``TypeError`` naming ``name`` for anything else (a bool too, and
    a 0-d array, which ``operator.index`` takes: a ``normalized_shape`` of one is refused)."""
    try:
        if isinstance(value, (bool, np.bool_, np.ndarray)):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"`{name}` must be an int, got {value!r}") from None


def _as_shape(normalized_shape):
    try:
        if isinstance(normalized_shape, (int, np.integer)):
            return (integer("normalized_shape", normalized_shape),)
        return tuple(integer("normalized_shape", d) for d in normalized_shape)
    except TypeError:  # (a bool too: operator.index takes True as 1, torch refuses it)
        raise TypeError(
            f"`normalized_shape` must be an int or a tuple of ints, got {normalized_shape!r}"
        ) from None


def rows(x_shape, normalized_shape):
    """``(rows, cols, nshape)`` for normalizing the trailing ``nshape`` of ``x``."""
    nshape = _as_shape(normalized_shape)
    k = len(nshape)
    x_shape = tuple(x_shape)
    if k == 0:  # (() matches any x's zero trailing dimensions: torch refuses it too)
        raise ValueError(f"normalized_shape must have at least one dimension, got () for x of shape {x_shape}")
    if k > len(x_shape) or x_shape[len(x_shape) - k :] != nshape:
        raise ValueError(
            f"normalized_shape {nshape} does not match the trailing dimensions of "
            f"x of shape {x_shape}"
        )
    cols = math.prod(nshape)
    if cols == 0:
        raise ValueError(
            f"normalized_shape {nshape} has no elements: a norm over zero elements is undefined"
        )
    return math.prod(x_shape[: len(x_shape) - k]), cols, nshape


def param(name, a, shape):
    """Check an affine parameter (or ``None``) against its expected shape."""
    if a is None:
        return None
    float_dtype(name, a)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"`{name}` has shape {tuple(a.shape)}, expected {tuple(shape)}")
    return a


def same_as_x(name, a, x_shape, x_dt, *, check_dtype=True, optional=False):
    """``dy``, ``ds``, ``residual`` and ``out`` must be shaped like ``x``
    (``ds`` and ``out`` may be None: ``optional``)."""
    if a is None:
        if optional:
            return None
        raise TypeError(f"`{name}` must be an array shaped like x {tuple(x_shape)}, got None")
    dt = float_dtype(name, a)
    if tuple(a.shape) != tuple(x_shape):
        raise ValueError(f"`{name}` has shape {tuple(a.shape)}, expected x's shape {tuple(x_shape)}")
    if check_dtype and dt != x_dt:
        raise ValueError(f"`{name}` has dtype {dt}, expected x's dtype {x_dt}")
    return a


def stats(name, a, x_shape, batch_shape, k):
    """Statistics fit ``x`` in the keep-dims shape or the plain batch shape."""
    float_dtype(name, a)
    keep = tuple(batch_shape) + (1,) * k
    if tuple(a.shape) not in (keep, tuple(batch_shape)):
        raise ValueError(
            f"`{name}` has shape {tuple(a.shape)}, which does not fit x of shape "
            f"{tuple(x_shape)} normalized over its last {k} dimension(s): expected {keep}"
        )
    return a


def groups(x_shape, num_groups):
    """``(N, C, spatial)`` for group norm, with all the contract's checks."""
    x_shape = tuple(x_shape)
    if len(x_shape) < 2:
        raise ValueError(f"group_norm expects x of shape (N, C, *spatial), got {x_shape}")
    g = integer("num_groups", num_groups)
    n, c = x_shape[0], x_shape[1]
    if g <= 0:
        raise ValueError(f"num_groups must be positive, got {g}")
    if c % g != 0:
        raise ValueError(f"num_groups={g} does not divide the {c} channels of x of shape {x_shape}")
    spatial = math.prod(x_shape[2:])
    if c == 0 or spatial == 0:
        raise ValueError(f"x of shape {x_shape} has empty groups: a norm over zero elements is undefined")
    return n, c, spatial, g


def group_stats(name, a, n, g, x_shape):
    float_dtype(name, a)
    if tuple(a.shape) != (n, g):
        raise ValueError(
            f"`{name}` has shape {tuple(a.shape)}, expected (N, num_groups) = ({n}, {g}) "
            f"for x of shape {tuple(x_shape)}"
        )
    return a
