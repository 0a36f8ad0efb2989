"""The CUDA backend of the frontend in ``numbanorm._api``.

Arrays are seen as numba device arrays without copies: numba's own, anything
with ``__cuda_array_interface__`` (CuPy, CUDA torch tensors), and objects with a
CUDA ``__dlpack__``.  Host NumPy arrays are accepted too and copied in (by
``contiguous``, after validation) and out (by ``wrap``).

Each public call runs on its caller's stream: ``native`` notes, from the library
of the call's leading array (x, or dy in a backward), the stream (PyTorch's or
CuPy's current one; the array's own for numba arrays, the default stream for
host copies) and how outputs are allocated (PyTorch's caching allocator for
tensors, CuPy's pool for CuPy arrays, numba otherwise), so that ``wrap`` hands
back the caller's array type around the same memory.
"""

import functools
import sys

import numpy as np
from numba import cuda

from .. import _validate as V
from ._kernels import common as C
from ._kernels import add_norm, group_norm, layer_norm, rms_norm  # noqa: F401  (the launchers)

name = "cuda"
_CALL = C.CALL


def _module_type(module, attr):
    mod = sys.modules.get(module)  # never import a library the caller did not
    return getattr(mod, attr, None) if mod is not None else None


def _is_torch(a):
    t = _module_type("torch", "Tensor")
    return t is not None and isinstance(a, t)


def _is_cupy(a):
    t = _module_type("cupy", "ndarray")
    return t is not None and isinstance(a, t)


@functools.lru_cache(maxsize=64)
def _stream(ptr):
    # the legacy default stream is what numba calls stream 0
    return 0 if ptr == 0 else cuda.external_stream(ptr)


def _view_cai(obj, desc):
    """A numba view of a CUDA Array Interface, bound to no stream.

    No synchronization (we launch on the producer's stream anyway), and no
    stream recorded in the view, so that handing results back through the
    interface never makes the consumer synchronize either.
    """
    desc = dict(desc)
    desc.pop("stream", None)
    return cuda.from_cuda_array_interface(desc, owner=obj, sync=False)


def _torch_view(t):
    import torch

    if t.dtype == torch.bfloat16:  # torch exports no bfloat16 through the interface
        return _view_cai(t, t.view(torch.int16).__cuda_array_interface__).view(C.BF16)
    return _view_cai(t, t.__cuda_array_interface__)


def _cupy_view(a):
    if C.is_bfloat16(a.dtype):
        return _view_cai(a, a.view(np.uint16).__cuda_array_interface__).view(C.BF16)
    return _view_cai(a, a.__cuda_array_interface__)


def _dlpack_view(a):
    from cuda.core.utils import StridedMemoryView

    smv = StridedMemoryView.from_dlpack(a, stream_ptr=-1)
    strides = smv.strides
    desc = {
        "shape": tuple(smv.shape),
        "strides": None if strides is None else tuple(s * smv.dtype.itemsize for s in strides),
        "data": (smv.ptr, bool(smv.readonly)),
        "typestr": smv.dtype.str,
        "version": 3,
    }
    return cuda.from_cuda_array_interface(desc, owner=smv, sync=False)


def _check_dtype(name, a):
    dt = getattr(a, "dtype", None)
    if isinstance(dt, np.dtype):
        bf16 = C.is_bfloat16(dt)
    else:  # torch's dtypes, ml_dtypes missing, ...
        bf16 = dt is not None and str(dt).endswith("bfloat16")
    if bf16:
        why = C.bfloat16_unsupported()
        if why:
            raise TypeError(f"`{name}` is bfloat16: {why}")


# The call's stream and allocator follow its leading array -- x, or dy in a
# backward, which the frontend views first and whose type the results take.
_LEADING = ("x", "dy")


def _set_call(arg, stream, lib, like):
    if arg in _LEADING:
        _CALL.stream, _CALL.lib, _CALL.like = stream, lib, like


def native(arg, a):
    if a is None:
        return None
    _check_dtype(arg, a)
    if type(a) is np.ndarray or V.side_of(a) == V.HOST:
        _set_call(arg, 0, None, None)
        return a if type(a) is np.ndarray else np.asarray(a)
    if getattr(type(a), "__cuda_ndarray__", False):  # numba's (or the simulator's) own
        _set_call(arg, a.stream, None, None)
        return a
    if _is_torch(a):
        if arg in _LEADING:
            import torch

            _set_call(arg, _stream(torch.cuda.current_stream(a.device).cuda_stream), "torch", a)
        return _torch_view(a)
    if _is_cupy(a):
        if arg in _LEADING:
            import cupy

            _set_call(arg, _stream(cupy.cuda.get_current_stream().ptr), "cupy", a)
        return _cupy_view(a)
    desc = getattr(a, "__cuda_array_interface__", None)
    view = _dlpack_view(a) if desc is None else _view_cai(a, desc)
    producer = (desc or {}).get("stream")
    _set_call(arg, _stream(producer) if producer not in (None, 1, 2) else 0, None, None)
    return view


def contiguous(a, shape):
    if type(a) is np.ndarray:
        return cuda.to_device(np.ascontiguousarray(a).reshape(shape), stream=_CALL.stream)
    if not a.is_c_contiguous():
        b = empty(a.shape, a.dtype)
        copy_into(b, a)
        a = b
    return a.reshape(shape)


def empty(shape, dtype):
    shape = tuple(int(d) for d in shape)
    if _CALL.lib == "torch":
        import torch

        like = _CALL.like
        if C.is_bfloat16(dtype):
            return _torch_view(torch.empty(shape, dtype=torch.bfloat16, device=like.device))
        t = torch.empty(shape, dtype=getattr(torch, np.dtype(dtype).name), device=like.device)
        return _torch_view(t)
    if _CALL.lib == "cupy":
        import cupy

        with cupy.cuda.Device(_CALL.like.device.id):
            return _cupy_view(cupy.empty(shape, dtype))
    return cuda.device_array(shape, dtype)


def out_view(out, shape):
    if type(out) is np.ndarray:  # a host `out`: filled from a device result by copy_into
        if not out.flags.writeable:
            raise ValueError("`out` is read-only")
        return None
    return out.reshape(shape) if out.is_c_contiguous() else None


def copy_into(dst, src):
    if type(dst) is np.ndarray:
        np.copyto(dst, src.copy_to_host().reshape(dst.shape))
        return
    # bound to the call's stream, numba's strided assignment kernel runs there
    # (on stream 0 numba synchronizes after it)
    dst.bind(_CALL.stream)[...] = src


def cast(a, dtype):
    if type(a) is np.ndarray:
        return a.astype(dtype, copy=False)
    if np.dtype(a.dtype) == np.dtype(dtype):
        return a
    src = contiguous(a, (a.size,))
    out = empty((a.size,), dtype)
    C.cast_into(src, out)
    return out.reshape(a.shape)


def wrap(a, like):
    if type(like) is np.ndarray or V.side_of(like) == V.HOST:
        return a.copy_to_host()
    if _is_torch(like):
        import torch

        if C.is_bfloat16(a.dtype):
            return torch.as_tensor(a.view(np.int16), device=like.device).view(torch.bfloat16)
        return torch.as_tensor(a, device=like.device)
    if _is_cupy(like):
        import cupy

        if C.is_bfloat16(a.dtype):
            return cupy.asarray(a.view(np.uint16)).view(C.BF16)
        return cupy.asarray(a)
    return a
