"""Run by tests/test_cuda_launch.py in a process without the CUDA simulator and without a
GPU: numbanorm's launchers drive numba-cuda's real dispatcher, compiler (NVVM, sm_90)
and argument marshalling down to the driver, and only the driver is stubbed:

* asking the device for its compute capability (an H100's 9.0) and the runtime
  for its version (the on-disk cache's key),
* loading the compiled module (``CUDACodeLibrary.get_cufunc``),
* making a cuda.core stream from a handle (``Stream.from_handle``: numba-cuda's
  ``driver.ExperimentalStream``),
* the launch itself (cuda.core's ``launch`` as numba-cuda's dispatcher calls it),
  which checks its stream as cuda.core does: "Stream or GraphBuilder expected",
* allocation (``cuda.device_array``: numba arrays over fake device pointers), the
  context that slicing an array asks for, numba's own copy into a strided array
  (recorded as a launch), and ``cuda.is_available`` (so that ``numbanorm.cuda``'s
  public functions and the top level's choice of them run).

* giving a kernel more than 48 KB of dynamic shared memory (``cuKernelGetFunction``,
  ``cuFuncSetAttribute``: recorded among the launches, in order).

Modes: ``M N`` (launches of the direct path against numba's), ``count``, ``sweep``,
``replay`` (public frontend against full path, call by call; ``every``: each operation in
one dtype), ``shared`` (long rows staged in over 48 KB of shared memory), ``optin`` (the
opt-in at the 48 KB boundary), ``alloc`` (what torch and CuPy calls allocate and wait
for), ``devices`` (two GPUs), ``host`` (host cost per call: ``benchmarks/gpu_host.py``).
``alloc``, ``devices``, ``replay``, ``every`` and ``host`` run with the CUDA torch and
CuPy stand-ins of ``tests/_fake_libs.py``.  Prints one JSON line.
"""

import contextlib
import json
import sys

import numpy as np


HITS = []
CURRENT = [0]  # the stack of current devices (their contexts): device 0's at the start
DEVICE_SPAN = 1 << 38  # as tests/_fake_libs.py's
SYNCS = []  # what waited for the device or copied between host and device, in order
# the modes that run with the CUDA torch and CuPy stand-ins (tests/_fake_libs.py)
FAKE_LIBS = ("alloc", "devices", "replay", "host", "every", "edges")
LENIENT = bool(__import__("os").environ.get("NN_LENIENT_STREAM"))  # to time code that passes raw streams


def main():
    if sys.argv[1] in FAKE_LIBS:  # CUDA torch and CuPy stand-ins, before anything imports the real ones
        import _fake_libs

        _fake_libs.install()
    from numba import cuda
    from numba.cuda import dispatcher
    from numba.cuda.codegen import CUDACodeLibrary, JITCUDACodegen
    from numba.cuda.cudadrv import devicearray, driver

    class Device:  # what the compiler asks the current device
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: Device()
    # the code library asks the current context's device too
    CUDACodeLibrary._ensure_cc = lambda self, cc: cc if cc is not None else (9, 0, "a")
    # the on-disk cache keys kernels on the runtime's version and the device
    JITCUDACodegen.magic_tuple = lambda self: ((13, 0), (9, 0))

    class CoreStream:  # cuda.core's Stream, minus the driver
        def __init__(self, handle):
            self.handle = handle

        @classmethod
        def from_handle(cls, handle):
            return cls(int(handle))

    class GraphBuilder:
        pass

    driver.ExperimentalStream = CoreStream
    driver.GraphBuilder = GraphBuilder

    class Module:
        initialized = True  # (numba sets up a module's globals once, through the driver)

    statics = {}  # code library (its id) -> its kernel's static shared memory, as ptxas -v reports it for sm_90

    class Function:
        module = Module()

        def __init__(self, lib):
            self.name = lib.name
            self.kernel = ("kernel", lib.name, id(lib))
            self.handle = ("CUkernel", lib.name, id(lib))
            self._lib = lib

        @property
        def attrs(self):  # what the driver reports for the loaded kernel: its cubin's, as ptxas makes it
            return driver.FuncAttr(regs=0, shared=statics[id(self._lib)], local=0, const=0, maxthreads=1024)

    class Statics(dict):
        def __missing__(self, key):
            from numbanorm.cuda._ptx import static_shared

            self[key] = static_shared(loaded[key].get_asm_str())
            return self[key]

    statics = Statics()  # code library (its id) -> its kernel's static shared memory, as ptxas -v reports it for sm_90
    loaded = {}  # code library (its id) -> the library
    libraries = set()  # one per compiled kernel
    cufuncs = {}  # the loaded kernel of each library, as numba-cuda keeps it (per device)

    def get_cufunc(self):  # loaded per library and device, as numba-cuda does
        libraries.add(id(self))
        loaded[id(self)] = self
        key = (id(self), CURRENT[-1])
        if key not in cufuncs:
            cufuncs[key] = Function(self)
        return cufuncs[key]

    class Gpu:  # an entry of numba's device list: its context current within ``with``
        compute_capability = (9, 0)

        def __init__(self, ordinal, sms):
            self.id, self.MULTIPROCESSOR_COUNT = ordinal, sms

        def __enter__(self):
            CURRENT.append(self.id)

        def __exit__(self, *exc):
            CURRENT.pop()

    # an H100 SXM (132 SMs), and for the two-device mode an H100 PCIe (114) beside it
    cuda.gpus = [Gpu(k, sms) for k, sms in enumerate((132, 114) if sys.argv[1] == "devices" else (132,))]
    cuda.get_current_device = lambda: cuda.gpus[CURRENT[-1]]
    # the device of a pointer: every allocator here hands device d the addresses d spans up
    driver.driver.cuPointerGetAttribute = lambda attr, ptr: (ptr % (1 << 40)) // DEVICE_SPAN

    CUDACodeLibrary.get_cufunc = get_cufunc
    launches = []

    def launch(stream, config, kernel, *args):
        if not isinstance(stream, (CoreStream, GraphBuilder)) and not LENIENT:
            raise TypeError(f"Stream or GraphBuilder expected, got {type(stream).__name__}")
        launches.append({"stream": getattr(stream, "handle", stream), "device": CURRENT[-1],
                         "grid": list(config.grid), "block": list(config.block),
                         "shared": config.shmem_size, "kernel": kernel[1], "lib": kernel[2],
                         "args": [getattr(a, "value", a) for a in args]})
        launch.last = (stream, config, kernel, *args)  # (to time the stub itself)

    dispatcher.launch = launch

    def get_function(kernel):  # a library's CUkernel -> its CUfunction in the current context
        return ("CUfunction", *kernel[1:])

    def set_attribute(fn, attr, value):
        launches.append({"attribute": attr.name, "value": value, "kernel": fn[1], "lib": fn[2], "device": CURRENT[-1]})

    driver.driver.cuKernelGetFunction = get_function
    driver.driver.cuFuncSetAttribute = set_attribute
    load = dispatcher.CUDACache._load_overload  # (under load_overload, numba-cuda's and numbanorm's)

    def load_overload(self, *args, **kwargs):  # count the kernels read from numba's disk cache
        kern = load(self, *args, **kwargs)
        if kern is not None:
            HITS.append(repr(self))
        return kern

    dispatcher.CUDACache._load_overload = load_overload

    class Memory:  # a device allocation that is only an address (device d's: d spans up)
        _next = {}

        def __init__(self, size, at=None):
            if at is None:
                device = CURRENT[-1]
                at = Memory._next.get(device, (1 << 40) + device * DEVICE_SPAN)
                Memory._next[device] = at + (size + 255) // 256 * 256
            self.device_ctypes_pointer = __import__("ctypes").c_void_p(at)

        def view(self, start, stop=None):  # a slice of an array: the same memory, later
            return Memory(0, self.device_ctypes_pointer.value + start)

    def device_array(shape, dtype, stream=0):
        device_array.count[0] += 1
        dtype = np.dtype(dtype)
        shape = tuple(shape)
        strides, step = [], dtype.itemsize
        for d in reversed(shape):  # C order
            strides.insert(0, step)
            step *= d
        a = devicearray.DeviceNDArray(shape, tuple(strides), dtype, gpu_data=Memory(step), stream=stream)
        device_array.log.append(a.device_ctypes_pointer.value)
        device_array.sizes.append(step)
        return a

    device_array.count = [0]
    device_array.log = []  # the address of each allocation, in order
    device_array.sizes = []  # ... and its bytes

    cuda.device_array = device_array  # allocation is the driver's too
    cuda.is_available = lambda: True  # (numbanorm.cuda's public functions, and the top level's choice of them)
    # (numba-cuda asks the current context's device)
    cuda.is_bfloat16_supported = lambda: cuda.gpus[CURRENT[-1]].compute_capability >= (8, 0)
    from contextlib import nullcontext

    from numba.cuda.cudadrv import devices

    devices._runtime.ensure_context = nullcontext  # (slicing a device array asks for a context)

    class Context:  # what an allocation by numba's own transfers (cuda.to_device) asks
        def memalloc(self, size):
            return Memory(size)

    devices.get_context = lambda devnum=None: Context()

    def setitem(self, key, value):  # numba's copy into a strided array: a kernel of its own
        self._dummy.__getitem__(key)  # the index as numba reads it (no Ellipsis there)
        if not self.stream:
            SYNCS.append("setitem on stream 0")  # (numba synchronizes after it there)
        launches.append({"stream": getattr(self.stream, "handle", self.stream), "kernel": "numba setitem",
                         "device": CURRENT[-1], "args": [self.device_ctypes_pointer.value, value.device_ctypes_pointer.value,
                                  list(self.shape), list(self.strides), list(value.strides)]})

    devicearray.DeviceNDArray.__setitem__ = setitem
    # what waits for the device or copies between host and device: recorded
    for owner, name in ((driver.Stream, "synchronize"), (driver.driver, "cuCtxSynchronize"),
                        (driver.driver, "cuStreamSynchronize"), (cuda, "synchronize")):
        setattr(owner, name, (lambda name: lambda *a, **k: SYNCS.append(name))(name))
    host_pointer = driver.host_pointer  # (a C extension's buffer request: no driver in it)

    def host_to_device(dst, src, size, stream=0):
        host_pointer(src, readonly=True)  # the host array as the copy takes it: a buffer
        SYNCS.append("host_to_device")

    def device_to_host(dst, src, size, stream=0):
        host_pointer(dst)
        SYNCS.append("device_to_host")

    driver.host_to_device, driver.device_to_host = host_to_device, device_to_host
    from numba.cuda import api

    api.current_context = lambda: None  # (a view of another library's memory records its context)
    cuda.external_stream = lambda ptr: driver.Stream(ptr, external=True)  # a producer's stream

    from numbanorm.cuda._kernels import common as C
    from numbanorm.cuda._kernels import group_norm as GN
    from numbanorm.cuda._kernels import layer_norm as LN
    try:
        from numbanorm.cuda._kernels import row_norm as RW
    except ImportError:  # an older layout, timed for comparison
        RW = None

    if sys.argv[1] == "host":
        return host(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), device_array, launches)
    if sys.argv[1] == "replay":
        return replay(int(sys.argv[2]), int(sys.argv[3]), device_array, launches)
    if sys.argv[1] == "shared":
        return shared(int(sys.argv[2]), int(sys.argv[3]), device_array, launches, cufuncs)
    if sys.argv[1] == "optin":
        return optin(sys.argv[2], device_array, launches, cufuncs, statics)
    if sys.argv[1] == "devices":
        return two_devices(int(sys.argv[2]), int(sys.argv[3]), device_array, launches)
    if sys.argv[1] == "every":
        return every(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], device_array, launches)
    if sys.argv[1] == "alloc":
        return allocators(int(sys.argv[2]), int(sys.argv[3]), device_array, launches)
    if sys.argv[1] == "edges":
        return edges(int(sys.argv[2]), int(sys.argv[3]), device_array)
    if sys.argv[1] == "transfers":
        return transfers(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], device_array)
    if sys.argv[1] == "count":
        return count(int(sys.argv[2]), int(sys.argv[3]), device_array, launches)
    if sys.argv[1] == "aliases":
        return aliases(int(sys.argv[2]), int(sys.argv[3]), device_array, launches)
    if sys.argv[1] == "sweep":
        return sweep(int(sys.argv[2]), int(sys.argv[3]), device_array, libraries, launches, C, LN, RW)
    M, N = int(sys.argv[1]), int(sys.argv[2])
    x, y = device_array((M, N), np.float16), device_array((M, N), np.float16)
    w, b = device_array((N,), np.float16), device_array((N,), np.float16)
    mean, rstd = device_array((M,), np.float32), device_array((M,), np.float32)
    errors = []
    for _ in range(3):
        try:
            LN.forward(x, w, b, 1e-5, y, mean, rstd)
        except TypeError as e:
            errors.append(str(e))
    out = {"launches": launches[:], "errors": errors, "resolved": len(C._RESOLVED)}
    # more argument kinds, each launched three times (dispatcher, then direct): a
    # backward (row kernel, column sums into float16), bfloat16 rows element by
    # element (odd N: uint16 bits, no words), a GroupNorm forward (reshaped rows)
    bf16 = C.BF16
    xb, yb = device_array((M, N - 1), bf16), device_array((M, N - 1), bf16)
    wb = device_array((N - 1,), bf16)
    x3, y3 = device_array((M, 8, N // 8), np.float16), device_array((M, 8, N // 8), np.float16)
    m3, r3 = device_array((M, 2), np.float32), device_array((M, 2), np.float32)
    w8 = device_array((8,), np.float16)
    others = {"backward": lambda: LN.backward(y, x, mean, rstd, w, x, w, b),
              "bfloat16": lambda: LN.forward(xb, wb, wb, 1e-5, yb, mean, rstd),
              "group": lambda: GN.forward(x3, w8, w8, 1e-5, y3, m3, r3)}
    fresh = set()  # the addresses of each call's own partial sums, which differ call to call
    empty = C.device_empty
    C.device_empty = lambda *a: (lambda d: fresh.add(d.device_ctypes_pointer.value) or d)(empty(*a))
    for name, call in others.items():
        out[name] = []
        for _ in range(3):
            del launches[:]
            call()
            for la in launches:
                la["args"] = ["partials" if a in fresh else a for a in la["args"]]
            out[name] += launches
    print(json.dumps(out))


def count(M, N, device_array, launches):
    """Launches that reach the driver per public call, by weight dtype (x float16)."""
    from numbanorm import _api
    from numbanorm.cuda import _backend

    nc = _api.Frontend(_backend)
    x = device_array((M, N), np.float16)
    out = {}
    for wname in ("float32", "float16"):
        w = device_array((N,), wname)
        calls = {"layer_forward": lambda: nc.layer_norm_forward(x, N, w, w),
                 "layer_backward": lambda: nc.layer_norm_backward(x, x, *nc.layer_norm_forward(x, N, w, w)[1:], N, w),
                 "rms_backward": lambda: nc.rms_norm_backward(x, x, nc.rms_norm_forward(x, N, w)[1], N, w)}
        for name, call in calls.items():
            call()  # compiled, resolved: the counted call takes the direct launch
            n0 = len(launches)
            res = call()
            # the backward's own launches (its forward, for the statistics, runs first)
            out[f"{name}_{wname}"] = len(launches) - n0 - (name != "layer_forward")
            out[f"{name}_{wname}_dtypes"] = [str(a.dtype) for a in res] if "backward" in name else []
    print(json.dumps(out))


def aliases(M, N, device_array, launches):
    """Plans learned where two arguments are one object (dy given as x, out= as x), then
    asked by a call of the same memory through other objects (``x.bind(stream)``): the
    launches' streams and the results' streams, and whether out= comes back, by the public
    frontend and by the full path; a sparse CPU tensor's error with numbanorm.cuda loaded."""
    from numba.cuda.cudadrv import driver
    import torch

    import numbanorm

    nc, full, seen = _seer(device_array, launches)
    f16 = np.float16
    x, w, xb = device_array((M, N), f16), device_array((N,), f16), device_array((M, N), f16)
    st = full.layer_norm_forward(x, N, w)[1:]
    other = driver.Stream(0x5EED)
    xs, alias = x.bind(other), xb.bind(other)  # the same memory as x and xb, on another stream

    def streams(res):
        return sorted({la["stream"] for la in res["launches"]})

    def bound(arrays):
        return [getattr(a.stream, "handle", a.stream) for a in arrays]

    out = {}
    for _ in range(4):  # learned with dy given as x, and out= as x
        nc.layer_norm_backward(x, x, *st, N, w)
        nc.rms_norm(xb, N, w, out=xb)
    ask = lambda fe: fe.layer_norm_backward(x, xs, *st, N, w)  # noqa: E731
    for name, fe in (("public", nc), ("full", full)):
        res = seen(ask, fe)
        out[name] = {"launch_streams": streams(res), "result_streams": bound(ask(fe)),
                     "out_returned": fe.rms_norm(xb, N, w, out=alias) is alias}
    out["replayed"] = seen(ask, nc)["replayed"]
    try:
        numbanorm.layer_norm(torch.randn(4, 64).to_sparse(), 64)
    except Exception as e:
        out["sparse"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))


def transfers(M, N, name, device_array):
    """What a call copies between host and device, and into strided device arrays, as
    numba's transfers take it (a buffer) and its indexing reads it, in dtype ``name``:
    host x and weights (copied in, the result copied out), a host ``out=`` and device
    inputs that are not contiguous.  Prints each case's error, or None."""
    import ml_dtypes

    import numbanorm.cuda as nc

    dtype = ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)
    host = np.ones((M, N), dtype)
    wide = device_array((M, N + 8), dtype)  # rows padded: a view of their first N
    tall = device_array((2 * M, N), dtype)  # every other row
    calls = {"host x": lambda: nc.layer_norm(host, (N,), np.ones(N, dtype), np.zeros(N, dtype)),
             "host out": lambda: nc.rms_norm(host, (N,), out=np.empty((M, N), dtype)),
             "padded rows": lambda: nc.layer_norm(wide[:, :N], (N,)),
             "strided rows": lambda: nc.rms_norm(tall[::2], (N,)),
             "padded groups": lambda: nc.group_norm(wide[:, :N], 2)}  # (M, N channels)
    out = {}
    for case, call in calls.items():
        try:
            call()
            out[f"{name} {case}"] = None
        except Exception as e:
            out[f"{name} {case}"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(out))


def cases(M, N, device_array, forward, f16=np.float16):
    """Public calls of each operation's forward and backward, float16 x and weights: name ->
    a function of a frontend.  The backward calls take statistics made by ``forward`` (a
    frontend) once, here."""
    x, dy, res = (device_array((M, N), f16) for _ in range(3))
    w, b = device_array((N,), f16), device_array((N,), f16)
    xg = device_array((M // 8, 64, N // 8), f16)  # GroupNorm: (N, C, spatial), 8 groups
    wg = device_array((64,), f16)
    ln = forward.layer_norm_forward(x, N, w, b)[1:]
    rms = forward.rms_norm_forward(x, N, w)[1:]
    gn = forward.group_norm_forward(xg, 8, wg, wg)[1:]
    add = forward.add_layer_norm_forward(x, res, N, w, b)[1:]
    return {
        "layer_norm_forward": lambda nc: nc.layer_norm_forward(x, N, w, b),
        "layer_norm_backward": lambda nc: nc.layer_norm_backward(dy, x, *ln, N, w),
        "rms_norm_forward": lambda nc: nc.rms_norm_forward(x, N, w),
        "rms_norm_backward": lambda nc: nc.rms_norm_backward(dy, x, *rms, N, w),
        "group_norm_forward": lambda nc: nc.group_norm_forward(xg, 8, wg, wg),
        "group_norm_backward": lambda nc: nc.group_norm_backward(xg, xg, *gn, wg),
        "add_layer_norm_forward": lambda nc: nc.add_layer_norm_forward(x, res, N, w, b),
        "add_layer_norm_backward": lambda nc: nc.add_layer_norm_backward(dy, dy, *add, N, w),
    }


def _library_arrays(lib, dtype):
    """``(make(shape, dtype), stream context, stream handle)``: the arrays of the CUDA torch
    or CuPy stand-in (``dtype``: float16 in ``cases`` means this one), made and used on a
    stream of the library's own (``side``) or its default stream."""
    import torch

    if lib.startswith("cupy"):
        import cupy

        make = lambda shape, dt: cupy.empty(shape, dtype)  # noqa: E731
        if lib.endswith("default stream"):
            return make, contextlib.nullcontext(), 0
        return make, cupy.cuda.Stream(0xC0B1), 0xC0B1
    tdt = getattr(torch, np.dtype(dtype).name if dtype != "bfloat16" else "bfloat16")
    make = lambda shape, dt: torch.empty(shape, dtype=tdt, device="cuda:0")  # noqa: E731
    if lib.endswith("default stream"):
        return make, contextlib.nullcontext(), 0
    return make, torch.cuda.stream(torch.cuda.Stream(0x70C4)), 0x70C4


def allocators(M, N, device_array, launches):
    """Each operation's public forward and backward (``cases``) and three plain forwards on
    CUDA torch tensors and CuPy arrays (the stand-ins of ``_fake_libs``), by ``numbanorm.cuda``
    three times and by the top level once, inside the library's stream: per call, what
    reached the driver (launches and their streams; numba's allocations, which are
    cuMemAlloc, and their frees; synchronizations and host-device copies), what the
    library's allocator served (bytes, device, stream) and how often the top level checked
    the arrays' sides; a strided x (copied first) and a float32 dy beside float16 x (cast
    first) too."""
    import _fake_libs

    import numbanorm
    import numbanorm.cuda
    from numbanorm import _validate

    from numbanorm.cuda._kernels import common as C

    sides = []
    common_side = _validate.common_side
    _validate.common_side = lambda **arrays: sides.append(1) or common_side(**arrays)
    out = {}
    for lib, dtype in (("torch", "float16"), ("torch", "bfloat16"), ("torch default stream", "float16"),
                       ("cupy", "float32")):
        make, on_stream, handle = _library_arrays(lib, dtype if dtype != "bfloat16" else "bfloat16")
        with on_stream:
            calls = cases(M, N, make, numbanorm.cuda)
            px, pw, pr = make((M, N), None), make((N,), None), make((M, N), None)
            pxg, pwg = make((M // 8, 64, N // 8), None), make((64,), None)
            calls["layer_norm"] = lambda nc: nc.layer_norm(px, N, pw, pw)  # plain: y alone
            calls["group_norm"] = lambda nc: nc.group_norm(pxg, 8, pwg, pwg)
            calls["add_rms_norm"] = lambda nc: nc.add_rms_norm(px, pr, N, pw)  # plain: y and s
            if lib.startswith("torch"):
                x, w, dy32 = make((M, N), None), make((N,), None), __import__("torch").empty(
                    (M, N), dtype=__import__("torch").float32, device="cuda:0")
                wide = make((M, N + 8), None)
                stats = numbanorm.cuda.layer_norm_forward(x, N, w)[1:]
                calls["strided_x"] = lambda nc: nc.layer_norm_forward(wide[:, :N], N, w)
                calls["float32_dy"] = lambda nc: nc.layer_norm_backward(dy32, x, *stats, N, w)
            for name, call in calls.items():
                per = []
                for fe in (numbanorm.cuda, numbanorm.cuda, numbanorm.cuda, numbanorm):
                    del launches[:], SYNCS[:], _fake_libs.LOG[:], sides[:]
                    n0 = device_array.count[0]
                    res = call(fe)
                    res = res if type(res) is tuple else (res,)
                    per.append({"numba_allocs": device_array.count[0] - n0, "syncs": SYNCS[:], "sides": len(sides),
                                "launch_streams": sorted({la["stream"] for la in launches if "stream" in la}),
                                "kernels": [la["kernel"] for la in launches if "stream" in la],
                                "lib_allocs": [e[2:] for e in _fake_libs.LOG if e[0].endswith("alloc")],
                                "results": sorted({type(r).__module__ + "." + type(r).__name__ for r in res}),
                                "owned": [r.owns_memory() for r in res if hasattr(r, "owns_memory")],
                                "n_results": len(res)})
                    del res
                out[f"{lib} {dtype} {name}"] = {"stream": handle, "calls": per}
    print(json.dumps(out))


def two_devices(M, N, device_array, launches):
    """Two GPUs (an H100 SXM, 132 SMs, and an H100 PCIe, 114): the same public calls on
    arrays of device 0 and of device 1 (numba's, torch's, another library's through the
    CUDA Array Interface), each four times (numba's dispatcher, the direct launch, learned,
    replayed), the current device 0 throughout; a long row staged in 64 KB of shared
    memory on each; and calls whose arrays are on both.  Per call: each launch's device
    (the current one when the driver got it), grid and stream, the devices of what numba
    and the library allocated, whether it was replayed, and the error raised."""
    import _fake_libs
    import torch

    from numba import cuda

    import numbanorm

    nc, _ = _frontends()
    replayed = []
    real = nc.plans.run
    nc.plans.run = lambda key, args: (lambda r: replayed.append(r is not None) or r)(real(key, args))

    def seen(call):
        del launches[:], device_array.log[:], _fake_libs.LOG[:]
        n = len(replayed)
        try:
            call()
            error = None
        except Exception as e:  # (the calls on two devices)
            error = f"{type(e).__name__}: {e}"
        return {"launches": [[la["device"], la.get("grid", [0])[0], la["stream"], la["kernel"]] for la in launches
                             if "stream" in la],
                "attributes": [[la["device"], la["value"]] for la in launches if "attribute" in la],
                "numba_allocs": [(a % (1 << 40)) // DEVICE_SPAN for a in device_array.log],
                "lib_allocs": [e[3] for e in _fake_libs.LOG if e[0].endswith("alloc")],
                "replayed": any(replayed[n:]), "error": error}

    f16 = np.float16

    def layer(x, w, b):  # a stateful layer's forward and backward: it copies x (and w) for the backward
        norm = numbanorm.LayerNorm(N, dtype=f16)
        norm.weight, norm.bias = w, b
        norm(x)
        norm.backward(x)

    arrays = {}
    for d in (0, 1):
        with cuda.gpus[d]:  # (numba allocates on the current device)
            x, w, b = device_array((M, N), f16), device_array((N,), f16), device_array((N,), f16)
            xl, wl = device_array((4, 32768), f16), device_array((32768,), f16)
        t = {k: torch.empty(shape, dtype=torch.float16, device=f"cuda:{d}")
             for k, shape in (("x", (M, N)), ("w", (N,)), ("b", (N,)))}
        arrays[d] = dict(x=x, w=w, b=b, xl=xl, wl=wl, t=t)
    out = {}
    for d in (0, 1):
        a = arrays[d]
        st = nc.layer_norm_forward(a["x"], N, a["w"], a["b"])[1:]
        tst = nc.layer_norm_forward(a["t"]["x"], N, a["t"]["w"])[1:]
        calls = {"numba_forward": lambda: nc.layer_norm_forward(a["x"], N, a["w"], a["b"]),
                 "numba_backward": lambda: nc.layer_norm_backward(a["x"], a["x"], *st, N, a["w"]),
                 "foreign_forward": lambda: nc.layer_norm_forward(Foreign(a["x"]), N, Foreign(a["w"])),
                 "torch_forward": lambda: nc.layer_norm_forward(a["t"]["x"], N, a["t"]["w"], a["t"]["b"]),
                 "torch_backward": lambda: nc.layer_norm_backward(a["t"]["x"], a["t"]["x"], *tst, N, a["t"]["w"]),
                 "top_level": lambda: numbanorm.rms_norm(a["t"]["x"], N, a["t"]["w"]),
                 "staged": lambda: nc.layer_norm_forward(a["xl"], 32768, a["wl"]),
                 "numba_layer": lambda: layer(a["x"], a["w"], a["b"]),
                 "torch_layer": lambda: layer(a["t"]["x"], a["t"]["w"], a["t"]["b"]),
                 "foreign_layer": lambda: layer(Foreign(a["x"]), Foreign(a["w"]), Foreign(a["b"]))}
        for name, call in calls.items():
            out[f"{name} {d}"] = [seen(call) for _ in range(4)]
    a0, a1 = arrays[0], arrays[1]
    with cuda.gpus[1]:
        out1 = device_array((M, N), f16)
    tst0 = nc.layer_norm_forward(a0["t"]["x"], N)[1:]
    mixed = {"numba_weight": lambda: nc.layer_norm_forward(a0["x"], N, a1["w"]),
             "numba_out": lambda: nc.layer_norm(a0["x"], N, a0["w"], out=out1),
             "torch_bias": lambda: numbanorm.layer_norm(a1["t"]["x"], N, a1["t"]["w"], a0["t"]["b"]),
             "torch_backward_x": lambda: nc.layer_norm_backward(a1["t"]["x"], a0["t"]["x"], *tst0, N)}
    for name, call in mixed.items():
        out[f"mixed {name}"] = [seen(call) for _ in range(2)]
    from numba.cuda.cudadrv import driver

    asked, ask = [], driver.driver.cuPointerGetAttribute
    driver.driver.cuPointerGetAttribute = lambda attr, ptr: asked.append(ptr) or ask(attr, ptr)
    for name, call in (("numba", lambda: nc.layer_norm(a1["x"], N, np.ones(N, f16))),
                       ("top_level", lambda: numbanorm.layer_norm(a1["x"], N, np.ones(N, f16)))):
        out[f"host {name}"] = dict(seen(call), driver=len(asked))  # (the driver asked nothing)
    driver.driver.cuPointerGetAttribute = ask
    graded = a1["t"]["w"].view(torch.float16)
    graded.requires_grad = True  # (torch refuses its interface with a RuntimeError of its own)
    out["requires_grad"] = seen(lambda: nc.layer_norm(a1["t"]["x"], N, graded))
    # bfloat16 where device 1 is of compute capability 7.5 (a T4's): refused on its arrays,
    # run on device 0's with device 1 current, each by its own GPU's capability
    cuda.gpus[1].compute_capability = (7, 5)
    bf16 = {d: torch.empty((M, N), dtype=torch.bfloat16, device=f"cuda:{d}") for d in (0, 1)}
    out["bfloat16 on 1"] = seen(lambda: nc.rms_norm(bf16[1], N))
    with cuda.gpus[1]:
        out["bfloat16 on 0, 1 current"] = seen(lambda: nc.rms_norm(bf16[0], N))
    out["current"] = CURRENT  # (every call's device scope closed)
    print(json.dumps(out))


def _error(call):
    """``call()``'s exception as ``"Type: message"``, or None."""
    try:
        call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def edges(M, N, device_array):
    """The arrays a review of the launch code found mishandled, each called three times (the
    full path, then replays where a call can be replayed): a CUDA torch tensor with the
    negative bit as x (how often its values were resolved into a copy: once a call) and as
    ``out``; a float8 tensor; the results' streams of a call on a numba array bound to a
    stream; bfloat16 through another library's interface (typestr ``<V2``); the warnings of
    a first call of one row."""
    import _fake_libs
    import ml_dtypes
    import torch
    from numba.cuda.cudadrv import driver

    import numbanorm.cuda as nc

    out = {}
    make, on_stream, _ = _library_arrays("torch", "float16")
    with on_stream:
        x, w = make((M, N), None), make((N,), None)
        neg = make((M, N), None)
        neg._neg = True
        out["neg_resolved"] = []
        for _ in range(3):
            del _fake_libs.LOG[:]
            nc.layer_norm(neg, N, w)
            out["neg_resolved"].append(sum(e == ("torch resolve_neg", neg.data_ptr()) for e in _fake_libs.LOG))
        out["neg_out"] = _error(lambda: nc.layer_norm(x, N, w, out=neg))
        f8 = torch.empty((M, N), dtype=torch.float8_e4m3fn, device="cuda:0")
        out["float8"] = _error(lambda: nc.layer_norm(f8, N))
    stream = driver.Stream(0x5EED)
    xs, ws = device_array((M, N), np.float16).bind(stream), device_array((N,), np.float16)
    out["numba_result_streams"] = [[r.stream is stream for r in nc.layer_norm_forward(xs, N, ws)] for _ in range(3)]
    xb = device_array((M, N), ml_dtypes.bfloat16)
    out["bfloat16_interface"] = [_error(lambda: nc.rms_norm(Foreign(xb), N)) for _ in range(3)]
    import warnings

    with warnings.catch_warnings(record=True) as seen:  # a first call's launches on a grid of 1 and more
        warnings.simplefilter("always")
        x64 = device_array((1, N), np.float64)
        nc.layer_norm_backward(x64, x64, *nc.layer_norm_forward(x64, N)[1:], N)
    out["first_call_warnings"] = [str(w.message) for w in seen]
    print(json.dumps(out))


class Foreign:
    """Another library's CUDA array (CuPy-like, but neither CuPy nor torch): a
    ``__cuda_array_interface__`` over a numba array's memory, made anew on each access
    as CuPy's is, with its producer's stream (``stream``; None: no stream)."""

    def __init__(self, a, stream=None, readonly=False):
        self.a, self.stream, self.readonly = a, stream, readonly
        self.shape, self.dtype = a.shape, a.dtype

    @property
    def __cuda_array_interface__(self):
        a = self.a
        return {"shape": a.shape, "strides": None, "typestr": a.dtype.str, "version": 3,
                "data": (a.device_ctypes_pointer.value, self.readonly), "stream": self.stream}


def _frontends():
    """The CUDA frontend as the public functions use it, and one without replays (the full path)."""
    from numbanorm import _api
    from numbanorm.cuda import _backend

    return _api.Frontend(_backend), _api.Frontend(_backend, plans=False)


def _region(fn, calls):
    """``fn`` ``calls`` times inside ``math.fsum`` (C, called by nothing else here): callgrind
    run with ``--toggle-collect=math_fsum --dump-after=math_fsum`` counts this region only."""
    import math

    math.fsum((fn(), 0.0)[1] for _ in range(calls))


def host(M, N, calls, device_array, launches):
    """Host cost of public calls (frontend, backend, launchers, marshalling) with the driver
    stubbed, float16 x and weights, per call: this thread's CPU time (best of 7 rounds,
    round-robin between the paths in one process) -- or, with ``NN_CALLGRIND=1`` under
    callgrind, each path once in its own ``_region`` (one dump each, in the order printed).

    Paths: ``full`` (the frontend's full path, cached direct launches), ``numba`` (the
    full path launching through numba-cuda's ``_Kernel.launch``), ``replay`` (the
    public functions: a call seen before replayed); and the harness's own share:
    ``stub_driver`` (one stubbed launch), ``stub_alloc`` (one stubbed allocation), of
    which ``numba_array`` (the numba array object over it) is numba's part."""
    import time

    from numba.cuda.cudadrv import devicearray

    from numbanorm.cuda._kernels import common as C

    nc, full = _frontends()
    calls_of = cases(M, N, device_array, full)
    for call in calls_of.values():
        for _ in range(3):  # compiled, resolved, learned
            call(nc), call(full)
    resolved = dict(C._RESOLVED)
    through_numba = {k: (v[0], None) for k, v in resolved.items()}
    paths, out = {}, {"order": []}

    def counted(name, call, allocations=lambda: device_array.count[0]):
        """One more ``call``: its launches and allocations (``allocations()``, a running count)
        as ``out``'s ``<name>_launches`` and ``<name>_allocs``."""
        n0, a0 = len(launches), allocations()
        call()
        out[name + "_launches"], out[name + "_allocs"] = len(launches) - n0, allocations() - a0

    for name, call in calls_of.items():
        counted(name, lambda call=call: call(nc))
        paths[name + "_full"] = (lambda call=call: call(full), resolved)
        paths[name + "_numba"] = (lambda call=call: call(full), through_numba)
        paths[name + "_replay"] = (lambda call=call: call(nc), resolved)
    import numbanorm
    import numbanorm.cuda

    x, w, b = device_array((M, N), np.float16), device_array((N,), np.float16), device_array((N,), np.float16)
    public = {"layer_norm_cuda": lambda: numbanorm.cuda.layer_norm(x, N, w, b),  # y only
              "layer_norm_top": lambda: numbanorm.layer_norm(x, N, w, b)}  # the top level picks the GPU
    for name, call in public.items():
        call(), call()
        counted(name, call)
        paths[name + "_replay"] = (call, resolved)
    from numba.cuda import dispatcher

    calls_of["layer_norm_forward"](nc)
    last = dispatcher.launch.last  # a LayerNorm forward's launch, as the stub got it
    mem = type(device_array((1,), np.float16).gpu_data)(2048)
    paths["stub_driver"] = (lambda: dispatcher.launch(*last), resolved)
    fx, fw, fb = Foreign(x), Foreign(w), Foreign(b)  # the same forward on another library's arrays
    for name, frontend in (("layer_norm_foreign_full", full), ("layer_norm_foreign_replay", nc)):
        for _ in range(3):
            frontend.layer_norm_forward(fx, N, fw, fb)
        paths[name] = (lambda frontend=frontend: frontend.layer_norm_forward(fx, N, fw, fb), resolved)
    # the same calls on CUDA torch tensors and CuPy arrays (the stand-ins of _fake_libs), on
    # their default streams: the public functions (replayed) and the full path; and the
    # stand-ins' own share: one allocation, one current-stream query
    import _fake_libs
    import cupy
    import torch

    def lib_allocations():
        return sum(e[0].endswith("alloc") for e in _fake_libs.LOG)

    for lib in ("torch", "cupy"):
        make, _, _ = _library_arrays(f"{lib} default stream", "float16")
        for name, call in cases(M, N, make, full).items():
            for _ in range(3):  # compiled, resolved, learned
                call(nc), call(full)
            counted(f"{name}_{lib}", lambda call=call: call(nc), lib_allocations)
            paths[f"{name}_{lib}"] = (lambda call=call: call(nc), resolved)
            paths[f"{name}_{lib}_full"] = (lambda call=call: call(full), resolved)
        lx, lw, lb = make((M, N), None), make((N,), None), make((N,), None)
        top = lambda lx=lx, lw=lw, lb=lb: numbanorm.layer_norm(lx, N, lw, lb)  # noqa: E731 (plain, the top level)
        top(), top()
        counted(f"layer_norm_top_{lib}", top, lib_allocations)
        paths[f"layer_norm_top_{lib}"] = (top, resolved)
    paths["torch_alloc"] = (lambda: torch.empty((M, N), dtype=torch.float16, device="cuda:0"), resolved)
    paths["torch_stream"] = (lambda: torch._C._cuda_getCurrentRawStream(0), resolved)
    paths["cupy_alloc"] = (lambda: cupy.empty((M, N), np.float16), resolved)
    paths["cupy_stream"] = (lambda: cupy.cuda.get_current_stream().ptr, resolved)
    paths["stub_alloc"] = (lambda: device_array((M, N), np.float16), resolved)
    paths["numba_array"] = (lambda: devicearray.DeviceNDArray((M, N), (2 * N, 2), np.dtype(np.float16), gpu_data=mem),
                            resolved)
    only = __import__("os").environ.get("NN_PATHS")  # (a comma-separated few of them, to look closer)
    if only:
        paths = {k: v for k, v in paths.items() if k in only.split(",")}
    import gc

    gc.collect()
    gc.disable()  # as timeit does: a collection landing in one path's region is not its cost
    if __import__("os").environ.get("NN_CALLGRIND"):
        for name, (call, table) in paths.items():
            C._RESOLVED.update(table)
            del launches[:], _fake_libs.LOG[:]
            _region(call, calls)
            out["order"].append(name)
        C._RESOLVED.update(resolved)
        print(json.dumps(out))
        return
    cpu = dict.fromkeys(paths, float("inf"))
    for _ in range(7):
        for name, (call, table) in paths.items():
            C._RESOLVED.update(table)
            del launches[:], _fake_libs.LOG[:]
            c = time.thread_time()
            for _ in range(calls):
                call()
            cpu[name] = min(cpu[name], (time.thread_time() - c) / calls)
    C._RESOLVED.update(resolved)
    out.update({f"{k}_cpu_us": round(v * 1e6, 2) for k, v in cpu.items()})
    out["loadavg"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(out))


def _seer(device_array, launches):
    """``(nc, full, seen)``: the public frontend (replays on) and the full path, and
    ``seen(call, frontend)``: what reached the driver and what came back from ``call`` made
    through one of them, with the addresses the call allocated named by allocation order
    (``new<k>+<offset>``); whether it was replayed; the error it raised."""
    import _fake_libs

    from numbanorm.cuda._kernels import common as C

    nc, full = _frontends()
    replayed = []
    real = nc.plans.run
    nc.plans.run = lambda key, args: (lambda r: replayed.append(r is not None) or r)(real(key, args))

    def seen(call, nc):
        del launches[:], device_array.log[:], device_array.sizes[:], _fake_libs.LOG[:]
        n = len(replayed)
        try:
            res, error = call(nc), None
            res = res if type(res) is tuple else (res,)  # (layer_norm returns y alone)
        except Exception as e:  # (refused alike by both paths, or not)
            res, error = (), f"{type(e).__name__}: {e}"
        # what the call allocated (numba's arrays, the libraries'), by address
        fresh = sorted([*zip(device_array.log, device_array.sizes),
                        *((e[1], e[2]) for e in _fake_libs.LOG if e[0].endswith("alloc"))])

        def label(v):
            if type(v) is int and v in C._DUMMIES:
                return "dummy"
            for k, (at, size) in enumerate(fresh):
                if type(v) is int and at <= v < at + max(size, 1):
                    return f"new{k}+{v - at}"
            return v  # a scalar, or the caller's arrays: the same every call

        sent = [dict(la, args=[label(a) for a in la["args"]]) for la in launches]
        got = [(type(r).__name__, *_layout(r.a if type(r) is Foreign else r, label)) for r in res]
        return {"launches": sent, "results": got, "replayed": any(replayed[n:]), "error": error}

    return nc, full, seen


def every(M, N, dtype, device_array, launches):
    """Each operation's forward and backward (``cases``) on numba arrays of ``dtype`` (x,
    weight, bias), and LayerNorm's and RMSNorm's without a weight (absent arguments as
    dummies), each four times through the public frontend and the full path (``_seer``)."""
    from numbanorm.cuda._kernels import common as C

    nc, full, seen = _seer(device_array, launches)
    dt = C.BF16 if dtype == "bfloat16" else np.dtype(dtype)
    calls = cases(M, N, device_array, full, dt)
    x, dy = device_array((M, N), dt), device_array((M, N), dt)
    ln, rms = full.layer_norm_forward(x, N)[1:], full.rms_norm_forward(x, N)[1:]
    calls.update({"layer_norm_forward_no_weight": lambda nc: nc.layer_norm_forward(x, N),
                  "layer_norm_backward_no_weight": lambda nc: nc.layer_norm_backward(dy, x, *ln, N),
                  "rms_norm_forward_no_weight": lambda nc: nc.rms_norm_forward(x, N),
                  "rms_norm_backward_no_weight": lambda nc: nc.rms_norm_backward(dy, x, *rms, N)})
    print(json.dumps({name: [(seen(call, nc), seen(call, full)) for _ in range(4)] for name, call in calls.items()}))


def replay(M, N, device_array, launches):
    """Each case's calls, and calls that differ from them in one thing, through the public
    frontend (replays on) and through the full path (``_seer``), each four times: compiled,
    resolved, learned, replayed."""
    from numba.cuda.cudadrv import driver

    nc, full, seen = _seer(device_array, launches)
    f16, f32 = np.float16, np.float32
    x = device_array((M, N), f16)
    w, b = device_array((N,), f16), device_array((N,), f16)
    wide = device_array((M, N + 4), f16)
    stream = driver.Stream(0x5EED)
    other = {  # one thing changed from layer_norm_forward(x, N, w, b)
        "shape": lambda nc: nc.layer_norm_forward(device_array((2 * M, N), f16), N, w, b),
        "rows": lambda nc: nc.layer_norm_forward(device_array((M, 2, N // 2), f16), (2, N // 2), w2, b2),
        "dtype": lambda nc: nc.layer_norm_forward(device_array((M, N), f32), N, w, b),
        "weight_dtype": lambda nc: nc.layer_norm_forward(x, N, device_array((N,), f32), b),
        "no_bias": lambda nc: nc.layer_norm_forward(x, N, w, None),
        "strided": lambda nc: nc.layer_norm_forward(wide[:, :N], N, w, b),
        "unaligned": lambda nc: nc.layer_norm_forward(x_off, N, w, b),
        "unaligned16": lambda nc: nc.layer_norm_forward(x_off8, N, w, b),  # 8-byte words, not 16
        "out_overlaps_x": lambda nc: nc.layer_norm(x_in, N, w, b, out=out_shifted),
        "out_overlaps_weight": lambda nc: nc.layer_norm(x, N, w_in_out, b, out=out),
        "eps": lambda nc: nc.layer_norm_forward(x, N, w, b, 1e-3),
        "eps_int": lambda nc: nc.layer_norm_forward(x, N, w, b, 1),
        "stream": lambda nc: nc.layer_norm_forward(x.bind(stream), N, w, b),
        "out": lambda nc: nc.layer_norm(x, N, w, b, out=out),  # the plain forward: same path and key
        "same_dy_and_x": lambda nc: nc.layer_norm_backward(x, x, *st, N, w),
        "foreign": lambda nc: nc.layer_norm_forward(Foreign(x, 0x5EED), N, Foreign(w), Foreign(b)),
        "foreign_stream": lambda nc: nc.layer_norm_forward(Foreign(x, 0xBEEF), N, Foreign(w), Foreign(b)),
        "foreign_out": lambda nc: nc.layer_norm(Foreign(x, 0x5EED), N, Foreign(w), Foreign(b), out=Foreign(out)),
        "foreign_readonly_out": lambda nc: nc.layer_norm(Foreign(x, 0x5EED), N, Foreign(w), Foreign(b),
                                                         out=Foreign(out, readonly=True)),
        "foreign_readonly_x": lambda nc: nc.layer_norm(Foreign(x, 0x5EED, readonly=True), N, Foreign(w),
                                                       Foreign(b), out=Foreign(out)),
        "other_dy": lambda nc: nc.layer_norm_backward(dy, x, *st, N, w),
    }
    w2, b2 = w.reshape(2, N // 2), b.reshape(2, N // 2)  # normalized_shape (2, N / 2)
    flat = device_array((M * N + 4,), f16)
    x_off = flat[1:M * N + 1].reshape(M, N)  # C-contiguous, 2 bytes off a word boundary
    x_off8 = flat[4:M * N + 4].reshape(M, N)  # 8 bytes off a 16-byte boundary
    out = device_array((M, N), f16)
    shared = device_array(((M + 1) * N,), f16)  # out= one row after x, in the same memory
    x_in, out_shifted = shared[:M * N].reshape(M, N), shared[N:].reshape(M, N)
    w_in_out = out.reshape(M * N)[N:2 * N]  # a weight inside out's second row
    dy = device_array((M, N), f16)
    st = full.layer_norm_forward(x, N, w, b)[1:]
    calls = dict(cases(M, N, device_array, full))
    calls.update(other)
    for lib, dtype in (("torch", "float16"), ("torch", "bfloat16"), ("torch default stream", "float16"),
                       ("cupy", "float32")):  # the stand-ins of CUDA torch and CuPy
        make, on_stream, _ = _library_arrays(lib, dtype)
        with on_stream:
            calls.update({f"{lib} {dtype} {k}": _within(on_stream, c)
                          for k, c in cases(M, N, make, full, None).items()})
    make, on_stream, _ = _library_arrays("torch", "float16")
    import torch

    tx, tw, tout, twide = make((M, N), None), make((N,), None), make((M, N), None), make((M, N + 8), None)
    tdy32 = torch.empty((M, N), dtype=torch.float32, device="cuda:0")
    tgrad = make((M, N), None)
    tgrad.requires_grad = True
    with on_stream:
        tst = full.layer_norm_forward(tx, N, tw)[1:]
    calls.update({f"torch {k}": _within(on_stream, c) for k, c in {
        "out": lambda nc: nc.layer_norm(tx, N, tw, out=tout),
        "out_is_x": lambda nc: nc.rms_norm(tx, N, tw, out=tx),
        "float32_dy": lambda nc: nc.layer_norm_backward(tdy32, tx, *tst, N, tw),
        "strided": lambda nc: nc.layer_norm_forward(twide[:, :N], N, tw),
        "requires_grad": lambda nc: nc.layer_norm_forward(tgrad, N, tw),
        "eps": lambda nc: nc.layer_norm_forward(tx, N, tw, None, 1e-3)}.items()})
    res = {}
    for name, call in calls.items():  # each call four times: compiled, resolved, learned, replayed
        res[name] = [(seen(call, nc), seen(call, full)) for _ in range(4)]
    # then the first case again, and each changed call once more after it: still its own
    base = calls["layer_norm_forward"]
    res["again"] = [(seen(base, nc), seen(base, full))]
    for name in other:
        res["again"].append((seen(calls[name], nc), seen(calls[name], full)))
    print(json.dumps(res))


def _within(scope, call):
    """``call`` made inside ``scope`` (a library's stream) each time."""
    def within(nc):
        with scope:
            return call(nc)

    return within


def _layout(r, label):
    """``[shape, strides in bytes, dtype, labelled address]`` of a result of any array type."""
    if hasattr(r, "data_ptr"):  # torch's
        item = r.element_size()
        return [list(r.shape), [s * item for s in r.stride()], str(r.dtype), label(r.data_ptr())]
    if hasattr(r, "device_ctypes_pointer"):
        return [list(r.shape), list(r.strides), str(r.dtype), label(r.device_ctypes_pointer.value)]
    return [list(r.shape), list(r.strides), str(r.dtype), label(r.data.ptr)]  # CuPy's


def shared(M, N, device_array, launches, cufuncs):
    """LayerNorm forward (x staged: 2N bytes) and backward (x and dy: 4N) of float16 rows of
    N elements, through the full path three times (numba's dispatcher, then the direct
    launch), then the public frontend four times (learned, then replayed), the last time
    in a new context (the loaded kernels forgotten, as numba-cuda loads them per device):
    per call, what reached the driver, in order; and the staged bytes the row mapping gives."""
    from numbanorm.cuda._kernels import common as C

    nc, full = _frontends()
    f16 = np.float16
    x, dy, w = device_array((M, N), f16), device_array((M, N), f16), device_array((N,), f16)
    st = (device_array((M, 1), np.float32), device_array((M, 1), np.float32))  # (mean, rstd: no forward run yet)
    calls = {"forward": lambda fe: fe.layer_norm_forward(x, N, w, w),
             "backward": lambda fe: fe.layer_norm_backward(dy, x, *st, N, w)}
    replayed = []
    real = nc.plans.run
    nc.plans.run = lambda key, args: (lambda r: replayed.append(r is not None) or r)(real(key, args))
    out = {"bytes": {"forward": C.row_config(M, N, False, 8, C.ROW_RESIDENT, 2, 1).shared,
                     "backward": C.row_config(M, N, False, 8, C.ROW_RESIDENT, 2, 2).shared}}
    for name, call in calls.items():
        out[name] = []
        for k, fe in enumerate((full, full, full, nc, nc, nc, nc)):
            if k == 6:
                cufuncs.clear(), C._LOADED.clear()  # a new context: the kernel loaded anew, not allowed there
            del launches[:]
            n = len(replayed)
            call(fe)
            out[name].append({"events": [{k: v for k, v in la.items() if k != "args"} for la in launches],
                              "replayed": any(replayed[n:])})
    print(json.dumps(out))


def optin(which, device_array, launches, cufuncs, statics):
    """LayerNorm forward (x staged) and backward (x and dy) of 4 rows of each length in
    ``BOUNDARIES[which]``, each call in a new context (the loaded kernels forgotten): the
    full path twice (numba's dispatcher, the direct launch), then the public frontend three
    times (learned, replayed): per call, what reached the driver, and the static shared
    memory ptxas gives each kernel launched with dynamic shared memory."""
    from numbanorm.cuda._kernels import common as C

    nc, full = _frontends()
    replayed = []
    real = nc.plans.run
    nc.plans.run = lambda key, args: (lambda r: replayed.append(r is not None) or r)(real(key, args))
    out = {}
    for direction, dtype, N in BOUNDARIES[which]:
        dt = C.BF16 if dtype == "bfloat16" else np.dtype(dtype)
        x, dy, w = device_array((4, N), dt), device_array((4, N), dt), device_array((N,), dt)
        acc = np.float64 if dtype == "float64" else np.float32
        st = (device_array((4, 1), acc), device_array((4, 1), acc))
        if direction == "forward":
            call = lambda fe: fe.layer_norm_forward(x, N, w, w)  # noqa: E731
        else:
            call = lambda fe: fe.layer_norm_backward(dy, x, *st, N, w)  # noqa: E731
        calls = []
        for fe in (full, full, nc, nc, nc):
            cufuncs.clear(), C._LOADED.clear()  # a new context: the kernel loaded anew, not allowed there
            del launches[:]
            n = len(replayed)
            call(fe)
            calls.append({"events": [{k: v for k, v in la.items() if k != "args"} for la in launches],
                          "replayed": any(replayed[n:])})
        staged = {la["lib"] for c in calls for la in c["events"] if la.get("shared")}
        out[f"{direction} {dtype} {N}"] = {"calls": calls, "static": {str(k): statics[k] for k in staged}}
    print(json.dumps(out))


# (direction, dtype, N): each side of the 48 KB boundary of static (the reductions' scratch) and
# dynamic shared memory (the staged row: x, or x and dy) together; 16-byte words (N a multiple
# of 8 or 4) and elements (odd N) compile two kernels
BOUNDARIES = {
    "forward": [("forward", "float16", n) for n in (24448, 24449, 24576, 24577)]
    + [("forward", "bfloat16", n) for n in (24448, 24449, 24576)]
    + [("forward", "float32", n) for n in (12224, 12225, 12288)]
    + [("forward", "float64", n) for n in (6080, 6081, 6144)],
    "backward": [("backward", "float16", n) for n in (12192, 12193, 12288, 12289)]
    + [("backward", "bfloat16", n) for n in (12192, 12193, 12288)],
}


def sweep(N, M_max, device_array, libraries, launches, C, LN, RW):
    """LayerNorm forward and backward for every row count 1..M_max at N (float16)."""
    f16, f32 = np.float16, np.float32
    w, b = device_array((N,), f16), device_array((N,), f16)
    dw, db = device_array((N,), f32), device_array((N,), f32)
    configs = set()
    for M in range(1, M_max + 1):
        x, y = device_array((M, N), f16), device_array((M, N), f16)
        mean, rstd = device_array((M,), f32), device_array((M,), f32)
        LN.forward(x, w, b, 1e-5, y, mean, rstd)
        LN.backward(y, x, mean, rstd, w, x, dw, db)
        configs.add(C.row_config(M, N, False, 4))
    stamps = {k._cache._cache_file._source_stamp for k in (RW.forward_kernel("layer", f16, f16, f16, C.row_config(1, N, False, 4).code, False),)}
    print(json.dumps({"kernels": len(libraries), "launches": len(launches), "configs": len(configs),
                      "grids": len({la["grid"][0] for la in launches}), "stamps": sorted(stamps),
                      "cache_hits": len(HITS),
                      # imported by numba-cuda's registration of its lowerings alone
                      "lowerings_registered": "numba.cuda.libdevicedecl" in sys.modules}))


if __name__ == "__main__":
    main()
