"""The CUDA backend of the frontend in ``numbanorm._api``.

Arrays are seen as numba device arrays without copies: numba's own, anything
with ``__cuda_array_interface__`` (CuPy, CUDA torch tensors), and objects with a
CUDA ``__dlpack__``.  Host NumPy arrays are accepted too and copied in (by
``contiguous``, after validation) and out (by ``wrap``).

Each public call runs on its caller's stream: the frontend asks
``call_context`` once per call, after validation, for the :class:`CallContext` of
the array whose type the results take (x, or s in the fused backward): the
stream (PyTorch's or CuPy's current one; the array's own for numba arrays, the
default stream for host copies) and how outputs are allocated (PyTorch's caching
allocator for tensors, CuPy's pool for CuPy arrays, numba otherwise), so that
``wrap`` hands back the caller's array type around the same memory.  The
context is passed explicitly to every function that allocates, copies or
launches.
"""

import functools
import sys

import numpy as np
from numba import cuda

from .. import _validate as V
from ._kernels import common as C

name = "cuda"
# the column sums round dweight/dbias into any float dtype as they store them: the
# frontend allocates them in the parameters' dtype, and a backward is two launches
grads_in_any_dtype = True


class CallContext:
    """Where one public call runs."""

    __slots__ = ("stream", "lib", "like")

    def __init__(self, stream=0, lib=None, like=None):
        self.stream = stream  # numba stream (0: the default stream)
        self.lib = lib        # 'torch' or 'cupy' when the results' array comes from them
        self.like = like      # that array (allocation device)


_DEFAULT = CallContext()


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


def native(role, a):
    """A numba view of ``a`` (host NumPy arrays stay as they are), without copies."""
    if a is None:
        return None
    _check_dtype(role, a)
    if getattr(type(a), "__cuda_ndarray__", False):  # numba's (or the simulator's) own: asked first, the usual case
        return a
    if type(a) is np.ndarray or V.side_of(a) == V.HOST:
        return a if type(a) is np.ndarray else np.asarray(a)
    if _is_torch(a):
        return _torch_view(a)
    if _is_cupy(a):
        return _cupy_view(a)
    desc = getattr(a, "__cuda_array_interface__", None)
    return _dlpack_view(a) if desc is None else _view_cai(a, desc)


def call_context(leading):
    """The :class:`CallContext` of a call whose results take the array type of ``leading``."""
    if type(leading) is np.ndarray or V.side_of(leading) == V.HOST:
        return _DEFAULT
    if getattr(type(leading), "__cuda_ndarray__", False):
        stream = leading.stream
        return _DEFAULT if type(stream) is int and stream == 0 else CallContext(stream)
    if _is_torch(leading):
        import torch

        return CallContext(_stream(torch.cuda.current_stream(leading.device).cuda_stream), "torch", leading)
    if _is_cupy(leading):
        import cupy

        return CallContext(_stream(cupy.cuda.get_current_stream().ptr), "cupy", leading)
    producer = (getattr(leading, "__cuda_array_interface__", None) or {}).get("stream")
    return CallContext(_stream(producer) if producer not in (None, 1, 2) else 0)


def launch(ctx, launcher, *args, callers_out=False, **kwargs):
    """``launcher(*args, **kwargs)`` with its kernels on ``ctx.stream``, passed to it
    explicitly.

    ``callers_out`` (y is the caller's ``out=``) changes nothing on a device:
    no page faults to avoid, so no ``y_mapped`` hint for the launchers.
    """
    return launcher(*args, stream=ctx.stream, **kwargs)


def contiguous(ctx, a, shape):
    if type(a) is np.ndarray:
        return cuda.to_device(np.ascontiguousarray(a).reshape(shape), stream=ctx.stream)
    if not a.is_c_contiguous():
        b = empty(ctx, a.shape, a.dtype)
        copy_into(ctx, b, a)
        a = b
    # already that shape: no reshape, which would build another array object (~3 us of host time)
    return a if a.shape == shape else a.reshape(shape)


def empty(ctx, shape, dtype):
    shape = tuple(map(int, shape))
    if ctx.lib == "torch":
        import torch

        like = ctx.like
        if C.is_bfloat16(dtype):
            return _torch_view(torch.empty(shape, dtype=torch.bfloat16, device=like.device))
        t = torch.empty(shape, dtype=getattr(torch, np.dtype(dtype).name), device=like.device)
        return _torch_view(t)
    if ctx.lib == "cupy":
        import cupy

        with cupy.cuda.Device(ctx.like.device.id):
            return _cupy_view(cupy.empty(shape, dtype))
    return cuda.device_array(shape, dtype)


def out_view(out, shape):
    if type(out) is np.ndarray:  # a host `out`: filled from a device result by copy_into
        if not out.flags.writeable:
            raise ValueError("`out` is read-only")
        return None
    return out.reshape(shape) if out.is_c_contiguous() else None


def copy_into(ctx, dst, src):
    if type(dst) is np.ndarray:
        np.copyto(dst, src.copy_to_host().reshape(dst.shape))
        return
    # bound to the call's stream, numba's strided assignment kernel runs there
    # (on stream 0 numba synchronizes after it)
    dst.bind(ctx.stream)[...] = src


def cast(ctx, a, dtype):
    if type(a) is np.ndarray:
        return a.astype(dtype, copy=False)
    if np.dtype(a.dtype) == np.dtype(dtype):
        return a
    src = contiguous(ctx, a, (a.size,))
    out = empty(ctx, (a.size,), dtype)
    C.cast_into(src, out, ctx.stream)
    return out.reshape(a.shape)


def wrap(a, like):
    if getattr(type(like), "__cuda_ndarray__", False):  # numba's own: asked first, the usual case
        return a
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
