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
import inspect
import sys
from typing import Any, NamedTuple

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

    __slots__ = ("stream", "lib", "like", "device")

    def __init__(self, stream=0, lib=None, like=None, device=None):
        self.stream = stream  # numba stream (0: the default stream)
        self.lib = lib        # 'torch' or 'cupy' when the results' array comes from them
        self.like = like      # that array (allocation device)
        self.device = device  # the GPU of the call's arrays where there are several, else None

    def empty(self, shape, dtype):
        """An uninitialised array from the call's allocator (``empty``): what a launcher's
        temporaries are allocated with."""
        return empty(self, shape, dtype)


_DEFAULT = CallContext()


def _module_type(module, attr):
    mod = sys.modules.get(module)  # never import a library the caller did not
    return getattr(mod, attr, None) if mod is not None else None


def _is_torch(a):
    return V._is_torch_type(type(a))  # (learned per type, as the side of an argument is)


def _is_cupy(a):
    t = _module_type("cupy", "ndarray")
    return t is not None and isinstance(a, t)


@functools.lru_cache(maxsize=64)
def _stream(ptr):
    # the legacy default stream is what numba calls stream 0
    return 0 if ptr == 0 else cuda.external_stream(ptr)


def _torch_stream(t):
    """The raw handle of PyTorch's current stream on tensor ``t``'s device."""
    raw = _raw_stream()
    return raw(t.get_device()) if raw is not None else sys.modules["torch"].cuda.current_stream(t.device).cuda_stream


@functools.lru_cache(maxsize=1)
def _raw_stream():
    # what torch.compile's generated code asks (no Stream object made); None in a torch without it
    return getattr(sys.modules["torch"]._C, "_cuda_getCurrentRawStream", None)


def _cupy_stream(device):
    """The raw handle of CuPy's current stream (on ``device``, where there are several)."""
    cupy = sys.modules["cupy"]
    if device is None:
        return cupy.cuda.get_current_stream().ptr
    with cupy.cuda.Device(device):
        return cupy.cuda.get_current_stream().ptr


@functools.lru_cache(maxsize=64)
def _core_stream(ptr):
    """The stream of raw handle ``ptr`` as cuda.core's launch takes it (a replay's)."""
    return C.core_stream(_stream(ptr))


def _torch_dtype(dtype):
    torch = sys.modules["torch"]
    return torch.bfloat16 if C.is_bfloat16(dtype) else getattr(torch, np.dtype(dtype).name)


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


def _dlpack_desc(a):
    """``(owner, a CUDA Array Interface)`` of a CUDA DLPack object, whose producer orders its
    pending writes before the legacy default stream (DLPack's 1), where a call led by such an
    array runs (it names no stream of its own: :func:`call_context`)."""
    from cuda.core.utils import StridedMemoryView

    smv = StridedMemoryView.from_dlpack(a, stream_ptr=1)
    strides = smv.strides
    return smv, {
        "shape": tuple(smv.shape),
        "strides": None if strides is None else tuple(s * smv.dtype.itemsize for s in strides),
        "data": (smv.ptr, bool(smv.readonly)),
        "typestr": smv.dtype.str,
        "version": 3,
    }


def _check_dtype(name, a):
    dt = getattr(a, "dtype", None)
    if isinstance(dt, np.dtype):
        bf16 = C.is_bfloat16(dt)
    else:  # torch's dtypes, ml_dtypes missing, ...
        bf16 = dt is not None and str(dt).endswith("bfloat16")
    if bf16:
        why = _bfloat16_unsupported(a)
        if why:
            raise TypeError(f"`{name}` is bfloat16: {why}")


_CAPABILITIES = {}  # GPU ordinal -> its compute capability, asked of the driver once


def _bfloat16_unsupported(a):
    """Why bfloat16 cannot run on the GPU holding ``a``, or '' where it can: that GPU's
    capability, not the current one's (a host array: the current GPU's, where it goes),
    asked of the driver only where there are several."""
    device = None if C.BF16 is None or C.device_count() == 1 else device_of(a)
    if device is None:
        return C.bfloat16_unsupported()
    cc = _CAPABILITIES.get(device)
    if cc is None:  # (the device's attribute: no context made on it)
        cc = _CAPABILITIES[device] = tuple(cuda.gpus[device].compute_capability)
    if cc >= (8, 0):
        return ""
    return f"bfloat16 needs a GPU of compute capability 8.0 or newer; GPU {device}'s is {cc[0]}.{cc[1]}"


def native(role, a):
    """A numba view of ``a`` (host NumPy arrays stay as they are), without copies."""
    if a is None:
        return None
    _check_dtype(role, a)
    if getattr(type(a), "__cuda_ndarray__", False):  # numba's (or the simulator's) own: asked first, the usual case
        return a
    if type(a) is np.ndarray or V.side_of(a) == V.HOST:
        return a if type(a) is np.ndarray else V.host_array(role, a)
    if _is_torch(a):
        V.refuse_gradient(role, a)
        V.float_dtype(role, a)  # (before its interface, which has no typestr for float8 and others)
        if a.is_neg():  # (a view such as z.conj().imag: its memory holds the values negated)
            if role == "out":
                raise TypeError("`out` is a torch.Tensor with the negative bit (`out.is_neg()`), "
                                 "whose memory holds its values negated: pass a tensor of its own")
            a = a.resolve_neg()  # (a copy on torch's current stream, from its allocator)
        return _torch_view(a)
    if _is_cupy(a):
        return _cupy_view(a)
    desc = getattr(a, "__cuda_array_interface__", None)
    owner, desc = _dlpack_desc(a) if desc is None else (a, desc)
    if role == "out" and desc["data"][1]:  # (numba's view would not say so)
        raise ValueError("`out` is read-only")
    if np.dtype(desc["typestr"]).kind == "V" and C.is_bfloat16(getattr(a, "dtype", None)):
        # (bfloat16 has no typestr of its own: ml_dtypes' and torch's export it as void)
        return _view_cai(owner, {**desc, "typestr": "<u2"}).view(C.BF16)
    return _view_cai(owner, desc)


def device_of(a):
    """The ordinal of the GPU holding the caller's array ``a`` (None for host arrays)."""
    if a is None or type(a) is np.ndarray or V.side_of(a) == V.HOST:
        return None
    if _is_torch(a):
        return a.get_device()
    if _is_cupy(a):
        return a.device.id
    if getattr(type(a), "__cuda_ndarray__", False):
        p = a.device_ctypes_pointer.value
    else:
        desc = getattr(a, "__cuda_array_interface__", None)
        if desc is None:
            return int(a.__dlpack_device__()[1])
        p = desc["data"][0]
    return C.pointer_device(p) if p else None  # (an empty array has no memory, anywhere)


def call_context(leading, arrays=None):
    """The :class:`CallContext` of a call whose results take the array type of ``leading``;
    ``arrays``: the call's arrays by role, which must be on one GPU where there are several
    (ValueError naming the odd one out, before anything is allocated)."""
    device = None
    if arrays is not None and C.device_count() > 1:
        device = V.one_device({r: device_of(a) for r, a in arrays.items()})
    if type(leading) is np.ndarray or V.side_of(leading) == V.HOST:
        return _DEFAULT if device is None else CallContext(device=device)
    if getattr(type(leading), "__cuda_ndarray__", False):
        stream = leading.stream
        if type(stream) is int and stream == 0 and device is None:
            return _DEFAULT
        return CallContext(stream, device=device)
    if _is_torch(leading):
        return CallContext(_stream(_torch_stream(leading)), "torch", leading, device)
    if _is_cupy(leading):
        return CallContext(_stream(_cupy_stream(device)), "cupy", leading, device)
    producer = (getattr(leading, "__cuda_array_interface__", None) or {}).get("stream")
    return CallContext(_stream(producer) if producer not in (None, 1, 2) else 0, device=device)


def on_device(ctx):
    """The scope in which a call allocates and launches: its arrays' GPU current."""
    return C.on_device(ctx.device)


@functools.lru_cache(maxsize=None)
def _takes_empty(launcher):
    return "empty" in inspect.signature(launcher).parameters


def launch(ctx, launcher, *args, **kwargs):
    """``launcher(*args, **kwargs)`` with its kernels on ``ctx.stream`` and, for a launcher
    with temporaries (a backward's partial sums), the call's allocator (``empty=``), both
    passed to it explicitly."""
    if _takes_empty(launcher):
        kwargs["empty"] = ctx.empty
    return launcher(*args, stream=ctx.stream, **kwargs)


def to_device(host, stream=0):
    """A host array copied to a new numba device array.  bfloat16 travels as its
    uint16 bits: numba's transfer takes the array as a buffer, and the buffer
    protocol has no format for ml_dtypes' bfloat16 ("cannot include dtype 'E'")."""
    if C.is_bfloat16(host.dtype):
        return cuda.to_device(host.view(np.uint16), stream=stream).view(host.dtype)
    return cuda.to_device(host, stream=stream)


def to_host(a):
    """A contiguous numba device array copied to a new host array (bfloat16 as its bits,
    as in ``to_device``)."""
    if C.is_bfloat16(np.dtype(a.dtype)):
        return a.view(np.uint16).copy_to_host().view(a.dtype)
    return a.copy_to_host()


def order_of(a):
    return "C"  # (no channels-last kernels here; torch's CUDA group_norm returns contiguous outputs too)


def contiguous(ctx, a, shape, order="C"):  # (order: "C", the only one order_of gives)
    if type(a) is np.ndarray:
        C.unrecordable()
        return to_device(np.ascontiguousarray(a).reshape(shape), stream=ctx.stream)
    if not a.is_c_contiguous():
        b = empty(ctx, a.shape, a.dtype)
        copy_into(ctx, b, a)
        a = b
    # already that shape: no reshape, which would build another array object
    return a if a.shape == shape else a.reshape(shape)


def empty(ctx, shape, dtype, order="C"):  # (order: as contiguous)
    shape = tuple(map(int, shape))
    if ctx.lib is None:
        return C.device_empty(shape, dtype, ctx.stream)
    lib = _LIBRARIES[ctx.lib]
    native = lib.empty(shape, lib.dtype(dtype), ctx.like.device if ctx.lib == "torch" else ctx.device)
    view = _torch_view(native) if ctx.lib == "torch" else _cupy_view(native)
    C.allocated(view, native)
    return view


def unkept(ctx, shape, dtype):
    return C.Unkept(tuple(shape), np.dtype(dtype))  # (no allocation: a plain call's statistics are not stored)


class _Torch:
    """What a call does with PyTorch's memory: ``empty`` (the caching allocator: a tensor
    on ``device``, on its current stream, of a torch ``dtype``), and ``allocate`` a replay's
    arrays ``(shape, dtype)`` of ``specs``: ``(arrays, their pointers)``."""

    dtype = staticmethod(_torch_dtype)

    @staticmethod
    def empty(shape, dtype, device):
        return sys.modules["torch"].empty(shape, dtype=dtype, device=device)

    @staticmethod
    def allocate(specs, device, stream):
        empty = sys.modules["torch"].empty
        arrays = [empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
        return arrays, [t.data_ptr() for t in arrays]


class _Cupy:
    """... with CuPy's: its memory pool on the current stream (of ``device``, where there
    are several)."""

    dtype = staticmethod(np.dtype)

    @staticmethod
    def empty(shape, dtype, device):
        cupy = sys.modules["cupy"]
        if device is None:
            return cupy.empty(shape, dtype)
        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype)

    @staticmethod
    def allocate(specs, device, stream):
        arrays = [_Cupy.empty(shape, dtype, device) for shape, dtype in specs]
        return arrays, [a.data.ptr for a in arrays]


class _Numba:
    """... with numba's (its allocator, or the EMM plugin installed), bound to the call's
    numba ``stream``, as the full path's results are."""

    dtype = staticmethod(np.dtype)

    @staticmethod
    def allocate(specs, device, stream):
        arrays = [cuda.device_array(shape, dtype, stream=stream) for shape, dtype in specs]
        return arrays, [a.device_ctypes_pointer.value for a in arrays]


_LIBRARIES = {"torch": _Torch, "cupy": _Cupy, None: _Numba}


def out_view(out, shape, reads, order="C"):  # (order: as contiguous)
    if type(out) is np.ndarray:  # a host `out`: filled from a device result by copy_into
        if not out.flags.writeable:
            raise ValueError("`out` is read-only")
        return None
    if not out.is_c_contiguous():
        return None
    # blocks run in any order, so an out= overlapping an input (but x itself: each row
    # is read before it is written, by the threads that write it) is computed apart
    lo, hi = _extent(out)
    for k, a in enumerate(reads):
        if a is None or k == 0 and same_array(a, out):
            continue
        a_lo, a_hi = _extent(a)
        if a_lo < hi and lo < a_hi:
            return None
    return out.reshape(shape)


def _extent(a):
    """The device bytes ``[lo, hi)`` that array ``a`` spans (empty for no elements)."""
    p = C._address(a)
    if a.size == 0:
        return p, p
    lo = hi = p
    for n, st in zip(a.shape, a.strides):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi + a.dtype.itemsize


def same_array(a, b):
    return C._address(a) == C._address(b) and a.shape == b.shape and a.strides == b.strides


@functools.lru_cache(maxsize=None)
def _default_stream():
    # (the simulator has no external streams, and nothing to synchronize)
    return cuda.stream() if C.SIMULATED else cuda.external_stream(0)


def copy_into(ctx, dst, src):
    C.unrecordable()  # numba's own kernel or a host copy
    if type(dst) is np.ndarray:
        np.copyto(dst, to_host(src).reshape(dst.shape))
        return
    # bound to the call's stream, numba's strided assignment kernel runs there; the
    # default stream as a stream object, not 0, after which numba would synchronize.
    # [:], not [...]: a numba device array's indexing takes no Ellipsis; bfloat16 moved
    # as its bits, as the kernels index it (kview)
    with C.quiet_grids():
        C.kview(dst).bind(ctx.stream or _default_stream())[:] = C.kview(src)


def copy(ctx, a):
    if _is_torch(a):
        return a.clone()  # on torch's current stream, from its caching allocator
    if _is_cupy(a):
        return a.copy()  # on CuPy's current stream and pool, on the current GPU: the call's
    # numba's own (the simulator's copy() is on the host), or a view of another library's array
    view = native("x", a)
    out = empty(ctx, view.shape, view.dtype)
    copy_into(ctx, out, view)  # numba's assignment kernel, which takes a strided view
    return out


def cast(ctx, a, dtype):
    if type(a) is np.ndarray:
        with np.errstate(over="ignore"):  # (inf past dtype's largest value, unwarned: the CPU's _cast)
            return a.astype(dtype, copy=False)
    if np.dtype(a.dtype) == np.dtype(dtype):
        return a
    src = contiguous(ctx, a, (a.size,))
    out = empty(ctx, (a.size,), dtype)
    C.cast_into(src, out, ctx.stream)
    return out.reshape(a.shape)


def wrap(a, like):
    if getattr(type(like), "__cuda_ndarray__", False):  # numba's own: asked first, the usual case
        return _bound(a, like.stream)
    if type(like) is np.ndarray or V.side_of(like) == V.HOST:
        C.unrecordable()  # copied: not what a replay returns
        return to_host(a)
    if _is_torch(like):
        import torch

        owner = getattr(getattr(a, "gpu_data", None), "owner", None)
        if _is_torch(owner) and owner.data_ptr() == C._address(a) and owner.numel() == a.size \
                and owner.is_contiguous() and a.is_c_contiguous():
            # the tensor the call allocated (empty): the caching allocator's own, whose
            # record_stream works, as a replay's results are (a wrapper's does nothing)
            return owner if tuple(owner.shape) == a.shape else owner.reshape(a.shape)
        if C.is_bfloat16(a.dtype):
            return torch.as_tensor(a.view(np.int16), device=like.device).view(torch.bfloat16)
        return torch.as_tensor(a, device=like.device)
    if _is_cupy(like):
        import cupy

        if C.is_bfloat16(a.dtype):
            return cupy.asarray(a.view(np.uint16)).view(C.BF16)
        return cupy.asarray(a)
    return _bound(a, call_context(like).stream)


def _bound(a, stream):
    """A numba result ``a`` bound to the call's ``stream``, as it was allocated (numba's
    ``reshape`` drops an array's stream), where a replay's results are too."""
    return a if a.stream is stream or not getattr(type(a), "__cuda_ndarray__", False) else a.bind(stream)


# how ``Replays.key`` keys an argument, by its type (``_kind``, learned per type); a NumPy
# array is never keyed (the top level asks the replays of every call the CPU's did not answer)
_NUMBA, _TORCH, _CUPY, _CAI, _FLOAT, _INT, _TUPLE, _OTHER = range(8)
_KINDS = {float: _FLOAT, int: _INT, tuple: _TUPLE, np.ndarray: _OTHER}


def _kind(t):
    kind = _KINDS.get(t)
    if kind is None:
        cupy_t = _module_type("cupy", "ndarray")
        if getattr(t, "__cuda_ndarray__", False):
            kind = _NUMBA
        elif V._is_torch_type(t):
            kind = _TORCH
        elif cupy_t is not None and issubclass(t, cupy_t):
            kind = _CUPY
        elif hasattr(t, "__cuda_array_interface__"):
            kind = _CAI
        else:
            return _OTHER  # (not kept: a library imported later may claim the type)
        _KINDS[t] = kind
    return kind


class Replay(NamedTuple):
    """The plan of a call seen before: what ``Replays.run`` repeats."""
    lead: int               # the argument whose stream the call runs on (its index among the arrays)
    lib: Any                # the library the results come from: 'torch', 'cupy' or None (numba)
    device: Any             # the GPU whose context is made current, None with one GPU
    where: Any              # where the library allocates (torch's device, else ``device``)
    specs: list             # each allocation's (shape, dtype), as returned
    launches: tuple         # (kernel, launch config, argument template, pointer slots) per launch
    results: tuple          # each result: an allocation's index, or ~(the caller's array's index)


class Replays:
    """The CUDA plan cache (``numbanorm._api.PlanCache``): a call seen before, replayed --
    its allocations and its kernel launches, without the frontend's and the launchers' work.

    What a call allocates and launches (kernels, grids, blocks, the marshalled
    kernel arguments but for the pointers) depends only on its arguments' types,
    shapes, strides, dtypes, the alignment of their pointers (words or elements,
    ``common.vec_width``), which of them are the same array, its scalars and, where
    there are several GPUs, the GPU of each array: the key.  The first validated call
    of a key that goes through cached direct launches only (``common._direct_launch``)
    is recorded (``begin``, ``learn``): each launch's arguments, and for each pointer
    among them the array it points into (a caller's array or one of the call's
    allocations, at an offset) or a dummy.  A later call of the key allocates the same
    arrays from the same library (numba's, PyTorch's caching allocator, CuPy's pool;
    in the results' shapes: no reshape), fills in its own pointers and launches on its
    own stream (the leading array's, or its library's current one) -- what the full
    path hands the driver for it (tests/test_cuda_launch.py compares them).  Numba
    device arrays, CUDA torch tensors, CuPy arrays and other ``__cuda_array_interface__``
    objects are replayed; a call that copies, dispatches through numba, or meets a
    tensor that requires grad is never learned.
    """

    MAX_PLANS = 256

    def __init__(self):
        self._plans = {}

    @staticmethod
    def key(kind, args):
        """``(key, pointers, arrays, places)`` of a call of ``kind`` (an operation's name and
        direction) on ``args`` (None, numba device arrays, CUDA torch tensors, CuPy arrays,
        other CUDA Array Interface objects, ints, floats, tuples of ints), ``places`` each
        array's position among ``args``; or None where a call cannot be keyed."""
        sig, pointers, arrays, places, spans, devices = [kind], [], [], [], [], []
        several = C.device_count() > 1
        for i, a in enumerate(args):
            if a is None:
                sig.append(None)
                continue
            t = type(a)
            how = _KINDS.get(t)
            if how is None:
                how = _kind(t)
            if how is _NUMBA:
                memory = a.gpu_data  # (not the device_ctypes_pointer property, which builds a ctypes object)
                p = None if memory is None else memory.device_ctypes_pointer.value
                if not p:  # (empty arrays have none: never replayed)
                    return None
                entry, nbytes = (t, a.shape, a.strides, a.dtype), a.size * a.dtype.itemsize
                if several:
                    devices.append((p,))  # (asked of the driver below)
            elif how is _FLOAT:
                if a == 0.0:  # (0.0 and -0.0 are one key but two kernel arguments)
                    return None
                sig.append((t, a))
                continue
            elif how is _INT or how is _TUPLE and all(type(d) is int for d in a):
                sig.append((t, a))
                continue
            elif how is _TORCH:
                if a.requires_grad or not a.is_cuda or a.is_neg():  # (the full path's to refuse or copy)
                    return None
                try:
                    p = a.data_ptr()
                except RuntimeError:  # (no storage: a sparse tensor's, the full path's to refuse)
                    return None
                if not p:
                    return None
                entry, nbytes = (t, a.shape, a.stride(), a.dtype), a.nbytes
                if several:
                    devices.append(a.get_device())
            elif how is _CUPY:
                p = a.data.ptr
                if not p:
                    return None
                entry, nbytes = (t, a.shape, a.strides, a.dtype), a.nbytes
                if several:
                    devices.append(a.device.id)
            elif how is _CAI:
                desc = a.__cuda_array_interface__
                p, readonly = desc["data"]
                if not p or desc.get("mask") is not None:
                    return None
                strides, shape = desc.get("strides"), tuple(desc["shape"])
                # (a read-only out= is the full path's to refuse)
                entry = (t, shape, strides and tuple(strides), desc["typestr"], bool(readonly))
                nbytes = int(np.prod(shape)) * int(desc["typestr"][2:])
                if several:
                    devices.append((p,))  # (asked of the driver below)
            else:
                return None
            # an array's alignment (the word width) and the first earlier argument it meets
            # (an out= that overlaps an input is written through a copy; dy given as x is one
            # array twice; only C-contiguous arrays are ever replayed, so ``nbytes`` from its
            # first byte is its extent) are part of the key
            end, meets = p + nbytes, None
            for k, (lo, hi) in enumerate(spans):
                if lo < end and p < hi:
                    meets = (k, lo == p)
                    break
            spans.append((p, end))
            sig.append((entry, p % C.WORD_BYTES[0], meets))
            pointers.append(p)
            arrays.append(a)
            places.append(i)
        if several:  # a plan serves one device's calls; the driver asked once no argument is a host array
            sig.append(tuple(C.pointer_device(d[0]) if type(d) is tuple else d for d in devices))
        return tuple(sig), pointers, arrays, places

    def run(self, key, args):
        """The results of the call ``key`` (``Replays.key``), or None if it is not one learned."""
        sig, pointers, arrays, _ = key
        plan = self._plans.get(sig)
        if plan is None:
            return None
        lead, lib, device, where, specs, launches, results = plan
        lead = arrays[lead]  # the call's stream: the leading array's own, or its library's current one
        bound = None  # (numba's results: the call's numba stream, which they are bound to)
        if lib == "torch":
            stream = _core_stream(_torch_stream(lead))
        elif lib == "cupy":
            stream = _core_stream(_cupy_stream(device))
        else:
            bound = lead.stream if getattr(type(lead), "__cuda_ndarray__", False) else call_context(lead).stream
            stream = C.core_stream(bound)
        if device is None:  # (one GPU: no context to choose)
            allocs = _run(_LIBRARIES[lib], specs, where, pointers, launches, stream, bound)
        else:
            with C.on_device(device):
                allocs = _run(_LIBRARIES[lib], specs, where, pointers, launches, stream, bound)
        return tuple([allocs[k] if k >= 0 else arrays[~k] for k in results])

    @staticmethod
    def begin(key):
        """Record what this thread allocates and launches from now on (after validation)."""
        C._RECORDING.log = []

    @staticmethod
    def end():
        log, C._RECORDING.log = getattr(C._RECORDING, "log", None), None
        return log

    def shortcut(self, kind):
        """``key`` and ``run`` as one function of the public arguments (a forward's ``out=``
        by keyword), for the top level, which asks it before ``_pick``: a learned key holds
        device arrays alone (a host array is never keyed), so no side needs checking."""
        key_of, run = self.key, self.run
        if kind[1] == "backward":
            def backward(*args):
                key = key_of(kind, args)
                return None if key is None else run(key, args)
            return backward

        def forward(*args, out=None):
            args = (*args, out)
            key = key_of(kind, args)
            return None if key is None else run(key, args)
        return forward

    def learn(self, key, call):
        """Keep the call just recorded (``begin``) as the plan of ``key``, if a replay can
        repeat it: it ran on the stream of ``call.ctx``, that of the array whose type the
        results take (``call.checked.leading``), and returned ``call.results``."""
        log = self.end()
        if log is None or None in log:
            return
        ctx, results, given = call.ctx, call.results, call.checked.given
        sig, pointers, arrays, places = key
        # the leading array and out= by their roles' places, not by identity: one learned
        # with dy given as x, or out= as x, would replay another call of the same memory on
        # dy's stream, or return x for its out=
        roles = list(given)  # (in the arguments' order: Checked.given's)
        lead_at, out_at = roles.index("x" if "x" in given else "s"), len(roles) - 1
        lead = places.index(lead_at) if lead_at in places else None
        out = places.index(out_at) if roles[-1] == "out" and out_at in places else None
        allocs = [e[1:] for e in log if e[0] == "alloc"]  # (numba view, the library's array)
        # where each pointer may point: the caller's arrays, then the call's allocations
        spans = [(p, native(None, a).nbytes) for p, a in zip(pointers, arrays)]
        spans += [(a.device_ctypes_pointer.value, a.nbytes) for a, _ in allocs]
        if lead is None or not all(p for p, _ in spans):
            return
        launches = []
        for _, code, config, stream, kargs, at in (e for e in log if e[0] == "launch"):
            if stream is not ctx.stream:
                return
            slots = []
            for i in at:
                inside = [k for k, (p, n) in enumerate(spans) if p <= kargs[i] < p + n]
                if not inside:
                    if kargs[i] not in C._DUMMIES:
                        return
                    continue  # a dummy: the same array every call
                if len({spans[k][0] for k in inside}) > 1:
                    return  # arrays that partly overlap: not one source
                slots.append((i, inside[0], kargs[i] - spans[inside[0]][0]))
            launches.append((code, config, tuple(kargs), tuple(slots)))
        specs = [(a.shape, made.dtype) for a, made in allocs]
        taken = []
        for r in results:
            if out is not None and r is arrays[out]:  # the caller's out=
                taken.append(~out)
                continue
            p, shape, size, contiguous = _result_layout(r)
            k = next((k for k, _ in enumerate(allocs) if spans[len(arrays) + k][0] == p), None)
            if k is None or k in taken or size != allocs[k][0].size or r.dtype != allocs[k][1].dtype \
                    or not contiguous:
                return
            specs[k] = (shape, r.dtype)  # allocated as returned
            taken.append(k)
        if len(self._plans) >= self.MAX_PLANS:
            self._plans.clear()
        where = ctx.like.device if ctx.lib == "torch" else ctx.device  # (what the library allocates on)
        self._plans[sig] = Replay(lead, ctx.lib, ctx.device, where, specs, tuple(launches), tuple(taken))


def _run(made, specs, where, pointers, launches, stream, bound):
    """A plan's allocations (``specs``, from library ``made``, on ``where``; numba's bound to
    ``bound``) and launches, with the call's ``pointers`` and then the allocations' in the
    slots; the allocations."""
    allocs, at = made.allocate(specs, where, bound)
    at = pointers + at
    for code, config, template, slots in launches:
        kargs = list(template)
        for i, source, offset in slots:
            kargs[i] = at[source] + offset
        C.replay_launch(code, config, stream, kargs)
    return allocs


def _result_layout(r):
    """``(pointer, shape, elements, C-contiguous)`` of a call's result ``r``."""
    if getattr(type(r), "__cuda_ndarray__", False):
        return r.device_ctypes_pointer.value, r.shape, r.size, r.is_c_contiguous()
    if _is_torch(r):
        return r.data_ptr(), tuple(r.shape), r.numel(), r.is_contiguous()
    view = native(None, r)  # (CuPy's)
    return view.device_ctypes_pointer.value, r.shape, view.size, view.is_c_contiguous()


# None in the simulator, or where numba-cuda's internals are not the known ones
plans = Replays() if C._INTERNALS is not None else None
