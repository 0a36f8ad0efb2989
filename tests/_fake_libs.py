"""Stand-ins for CUDA PyTorch and CuPy in ``tests/_nosim_launch.py``'s stubbed-driver process
(this machine's torch has no CUDA, and CuPy is not installed).

They are installed as the ``torch`` and ``cupy`` modules, and give numbanorm's CUDA backend
what the real libraries give it, by the same calls:

* ``torch``: ``Tensor`` (``shape``, ``dtype``, ``device``, ``stride()``, ``data_ptr()``,
  ``numel()``, ``element_size()``, ``nbytes``, ``is_contiguous()``, ``is_cuda``,
  ``get_device()``, ``requires_grad``, ``view(dtype)``
  and ``__cuda_array_interface__`` as torch 2.13 exports it: version 2, bfloat16 as
  ``<V2``, refused for a tensor that requires grad); ``torch.empty(..., device=...)`` served by the
  caching allocator (``torch.cuda.caching_allocator_alloc``, on the device's current
  stream; a tensor's memory goes back to it with ``caching_allocator_delete`` when the
  tensor dies); ``torch.as_tensor`` of a CUDA Array Interface (no copy);
  ``torch.cuda.current_stream(device).cuda_stream`` and
  ``torch._C._cuda_getCurrentRawStream(index)``; ``torch.cuda.stream`` to change it.
* ``cupy``: ``ndarray`` (``shape``, ``dtype``, ``strides``, ``data.ptr``, ``device.id``,
  ``nbytes``, ``view(dtype)``, ``__cuda_array_interface__`` version 3 with the current
  stream, as CuPy exports it); ``cupy.empty`` served by the memory pool
  (``cupy.cuda.alloc``, on the current device and stream); ``cupy.asarray`` of a CUDA
  Array Interface (no copy); ``cupy.cuda.get_current_stream().ptr``;
  ``cupy.cuda.Device(id)`` (the current device, as a context manager).

Every allocation and release is logged in ``LOG`` (``("torch alloc" | "cupy alloc",
address, bytes, device, stream)``, ``("torch free" | "cupy free", address)``); their
memory lies in address ranges of its own (``POOL``), apart from numba's allocations.
Nothing here calls the CUDA driver: the real caching allocator and memory pool call
``cudaMalloc`` only when their cache cannot serve a request, which is theirs to do.
"""

import functools
import math
import sys
import types

import numpy as np

LOG = []
POOL = {"torch": 3 << 40, "cupy": 5 << 40}  # the first address of each library's memory (device 0)
DEVICE_SPAN = 1 << 38  # device d's memory starts d spans higher


class _Bump:
    """A library's device memory: addresses handed out in order, 256-byte aligned."""

    def __init__(self, base):
        self.next = {}
        self.base = base

    def take(self, nbytes, device):
        at = self.next.get(device, self.base + device * DEVICE_SPAN)
        self.next[device] = at + max(256, (nbytes + 255) // 256 * 256)
        return at


@functools.lru_cache(maxsize=256)
def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for d in reversed(shape):
        strides.insert(0, step)
        step *= d
    return tuple(strides)


# ---------------------------------------------------------------- torch

def make_torch():
    torch = types.ModuleType("torch")
    torch.__fake__ = True
    memory = _Bump(POOL["torch"])
    streams = {}  # device -> its current stream (the default stream: 0)

    class dtype:
        def __init__(self, name, np_name):
            self.name, self.np = name, np.dtype(np_name) if np_name else None
            self.itemsize = 2 if name == "bfloat16" else 1 if name.startswith("float8") else self.np.itemsize

        def __repr__(self):
            return f"torch.{self.name}"

        __str__ = __repr__

    for name, np_name in (("float16", "float16"), ("float32", "float32"), ("float64", "float64"),
                          ("bfloat16", None), ("int16", "int16"), ("float8_e4m3fn", None)):
        setattr(torch, name, dtype(name, np_name))
    typestr = {torch.float16: "<f2", torch.float32: "<f4", torch.float64: "<f8", torch.int16: "<i2",
               torch.bfloat16: "<V2"}  # (torch 2.13's: bfloat16 as ml_dtypes' typestr)

    class device:
        def __init__(self, spec, index=None):
            if isinstance(spec, device):
                spec, index = spec.type, spec.index
            elif isinstance(spec, str) and ":" in spec:
                spec, index = spec.split(":")[0], int(spec.split(":")[1])
            self.type, self.index = spec, (0 if index is None and spec == "cuda" else index)

        def __eq__(self, other):
            return isinstance(other, device) and (self.type, self.index) == (other.type, other.index)

        def __hash__(self):
            return hash((self.type, self.index))

        def __repr__(self):
            return f"device(type='{self.type}', index={self.index})"

    class Tensor:
        __slots__ = ("_ptr", "shape", "dtype", "device", "_strides", "_owner", "requires_grad", "is_cuda",
                     "_neg", "__weakref__")

        def __init__(self, ptr, shape, dt, dev, strides=None, owner=None):
            self._ptr, self.shape, self.dtype, self.device = ptr, tuple(shape), dt, dev
            self._strides = strides or _c_strides(self.shape, 1)  # (in elements, as torch's)
            self._owner = owner  # what keeps the memory alive (another tensor, an array; None: its own)
            self.requires_grad = False
            self.is_cuda = True
            self._neg = False  # torch's negative bit: the memory holds the values negated

        def __del__(self):
            if self._owner is None:
                caching_allocator_delete(self._ptr)  # the memory back to the cache when it dies

        def stride(self):
            return self._strides

        def data_ptr(self):
            return self._ptr

        def numel(self):
            return math.prod(self.shape)

        def element_size(self):
            return self.dtype.itemsize

        @property
        def nbytes(self):
            return math.prod(self.shape) * self.dtype.itemsize

        def is_contiguous(self):
            return self._strides == _c_strides(self.shape, 1)

        def get_device(self):
            return self.device.index

        def clone(self):  # (a new tensor on this one's device, whichever is current: torch's)
            return empty(self.shape, dtype=self.dtype, device=self.device)

        def view(self, dt):
            assert dt.itemsize == self.dtype.itemsize
            return Tensor(self._ptr, self.shape, dt, self.device, self._strides, owner=self)

        def reshape(self, shape):  # (of a contiguous tensor: a view)
            assert self.is_contiguous() and math.prod(shape) == self.numel()
            return Tensor(self._ptr, shape, self.dtype, self.device, owner=self)

        def is_neg(self):
            return self._neg

        def resolve_neg(self):  # (a copy with the values as they read, from the allocator)
            LOG.append(("torch resolve_neg", self._ptr))
            return empty(self.shape, dtype=self.dtype, device=self.device) if self._neg else self

        def owns_memory(self):  # (the stand-in's: the allocator's tensor, or a view of one)
            t = self
            while isinstance(t._owner, Tensor):
                t = t._owner
            return t._owner is None

        def __getitem__(self, key):  # rows and column slices: enough for strided views
            rows, cols = key if isinstance(key, tuple) else (key, slice(None))
            r0, _, rs = rows.indices(self.shape[0])
            c0, c1, cs = cols.indices(self.shape[1])
            shape = (len(range(*rows.indices(self.shape[0]))), len(range(c0, c1, cs)))
            ptr = self._ptr + (r0 * self._strides[0] + c0 * self._strides[1]) * self.dtype.itemsize
            return Tensor(ptr, shape, self.dtype, self.device,
                          (self._strides[0] * rs, self._strides[1] * cs), owner=self)

        @property
        def __cuda_array_interface__(self):
            if self.requires_grad:
                raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad. "
                                   "If gradients aren't required, use var.detach() to get Variable that "
                                   "doesn't require grad.")
            if self.dtype not in typestr:
                raise KeyError(self.dtype)  # (torch 2.13's _dtype_to_typestr: a dict lookup)
            item = self.element_size()
            strides = None if self.is_contiguous() else tuple(s * item for s in self._strides)
            return {"typestr": typestr[self.dtype], "shape": self.shape, "strides": strides,
                    "data": (self._ptr if self.numel() else 0, False), "version": 2}

    def _stream_of(index):
        return streams.get(index, 0)

    def caching_allocator_alloc(size, device=None, stream=None):
        index = device.index if type(device) is torch.device else (device or 0)
        stream = _stream_of(index) if stream is None else stream
        ptr = memory.take(size, index)
        LOG.append(("torch alloc", ptr, size, index, stream))
        return ptr

    def caching_allocator_delete(ptr):
        LOG.append(("torch free", ptr))

    def empty(*shape, dtype=None, device=None):
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        dev = device if type(device) is torch.device else torch.device(device if device is not None else "cpu")
        assert dev.type == "cuda", "a CUDA stand-in: CUDA tensors only"
        dt = dtype or torch.float32
        nbytes = math.prod(shape) * dt.itemsize
        return Tensor(caching_allocator_alloc(nbytes, dev), shape, dt, dev)

    def as_tensor(obj, device=None):
        desc = obj.__cuda_array_interface__
        by_str = {np.dtype(v).str: k for k, v in typestr.items() if k is not torch.bfloat16}
        dt = by_str[np.dtype(desc["typestr"]).str]
        item = dt.itemsize
        strides = desc.get("strides")
        strides = None if strides is None else tuple(s // item for s in strides)
        dev = torch.device(device) if device is not None else torch.device("cuda", 0)
        return Tensor(desc["data"][0], desc["shape"], dt, dev, strides, owner=obj)

    class Stream:
        def __init__(self, cuda_stream, index=0):
            self.cuda_stream, self.device_index = cuda_stream, index

    class stream:  # torch.cuda.stream(s): s current on its device within the block
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            self.prev = streams.get(self.s.device_index, 0)
            streams[self.s.device_index] = self.s.cuda_stream

        def __exit__(self, *exc):
            streams[self.s.device_index] = self.prev

    def current_stream(device=None):
        index = torch.device(device).index if device is not None else 0
        return Stream(_stream_of(index), index)

    cuda = types.ModuleType("torch.cuda")
    cuda.is_available = lambda: True
    cuda.current_stream = current_stream
    cuda.Stream = Stream
    cuda.stream = stream
    cuda.caching_allocator_alloc = caching_allocator_alloc
    cuda.caching_allocator_delete = caching_allocator_delete
    _C = types.ModuleType("torch._C")
    _C._cuda_getCurrentRawStream = _stream_of
    torch.Tensor, torch.device, torch.empty, torch.as_tensor = Tensor, device, empty, as_tensor
    torch.cuda, torch._C = cuda, _C
    return torch


# ---------------------------------------------------------------- cupy

def make_cupy():
    cupy = types.ModuleType("cupy")
    cupy.__fake__ = True
    memory = _Bump(POOL["cupy"])
    state = {"device": 0, "stream": {}}

    class Device:
        def __init__(self, id=None):
            self.id = state["device"] if id is None else id

        def __enter__(self):
            self.prev = state["device"]
            state["device"] = self.id
            return self

        def __exit__(self, *exc):
            state["device"] = self.prev

    class MemoryPointer:
        def __init__(self, ptr, device):
            self.ptr, self.device = ptr, device

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

        def __enter__(self):
            self.prev = state["stream"].get(state["device"], 0)
            state["stream"][state["device"]] = self.ptr

        def __exit__(self, *exc):
            state["stream"][state["device"]] = self.prev

    def get_current_stream():
        return Stream(state["stream"].get(state["device"], 0))

    def alloc(nbytes):  # the memory pool: on the current device, for the current stream
        ptr = memory.take(nbytes, state["device"])
        LOG.append(("cupy alloc", ptr, nbytes, state["device"], get_current_stream().ptr))
        return MemoryPointer(ptr, Device(state["device"]))

    class ndarray:
        def __init__(self, shape, dtype, memptr, strides=None, owner=None, owns=False):
            self.shape, self.dtype = tuple(shape), np.dtype(dtype)
            self.strides = strides or _c_strides(self.shape, self.dtype.itemsize)
            self.data, self.device, self._owner, self._owns = memptr, memptr.device, owner, owns
            self.size = math.prod(self.shape)
            self.nbytes = self.size * self.dtype.itemsize

        def __del__(self):
            if self._owns:
                LOG.append(("cupy free", self.data.ptr))  # back to the pool when it dies

        def view(self, dtype):
            assert np.dtype(dtype).itemsize == self.dtype.itemsize
            return ndarray(self.shape, dtype, self.data, self.strides, owner=self)

        @property
        def __cuda_array_interface__(self):
            c = self.strides == _c_strides(self.shape, self.dtype.itemsize)
            stream = get_current_stream().ptr
            return {"shape": self.shape, "typestr": self.dtype.str, "strides": None if c else self.strides,
                    "data": (self.data.ptr if self.size else 0, False), "version": 3,
                    "stream": stream or 1}  # (CuPy exports the legacy default stream as 1)

    def empty(shape, dtype=np.float32):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        return ndarray(shape, dtype, alloc(nbytes), owns=True)

    def asarray(obj):
        desc = obj.__cuda_array_interface__
        return ndarray(desc["shape"], np.dtype(desc["typestr"]), MemoryPointer(desc["data"][0], Device()),
                       desc.get("strides"), owner=obj)

    cuda = types.ModuleType("cupy.cuda")
    cuda.Device, cuda.Stream, cuda.MemoryPointer = Device, Stream, MemoryPointer
    cuda.get_current_stream, cuda.alloc = get_current_stream, alloc
    cupy.ndarray, cupy.empty, cupy.asarray, cupy.cuda = ndarray, empty, asarray, cuda
    return cupy


def install():
    """Install both as ``torch`` and ``cupy`` (before numbanorm sees an array of theirs)."""
    sys.modules["torch"] = torch = make_torch()
    sys.modules["torch.cuda"] = torch.cuda
    sys.modules["cupy"] = cupy = make_cupy()
    sys.modules["cupy.cuda"] = cupy.cuda
    return torch, cupy
