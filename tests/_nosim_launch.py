"""Run by tests/test_cuda_launch.py in a process without the CUDA simulator and without a
GPU: numbanorm's launchers drive numba-cuda's real dispatcher, compiler (NVVM, sm_90)
and argument marshalling down to the driver, and only the driver is stubbed:

* asking the device for its compute capability (an H100's 9.0) and the runtime
  for its version (the on-disk cache's key),
* loading the compiled module (``CUDACodeLibrary.get_cufunc``),
* making a cuda.core stream from a handle (``Stream.from_handle``: numba-cuda's
  ``driver.ExperimentalStream``),
* the launch itself (cuda.core's ``launch`` as numba-cuda's dispatcher calls it),
  which checks its stream as cuda.core does: "Stream or GraphBuilder expected".

Device arrays are numba's own, over fake device pointers.  Prints one JSON line.
"""

import json
import sys

import numpy as np


HITS = []
LENIENT = bool(__import__("os").environ.get("NN_LENIENT_STREAM"))  # to time code that passes raw streams


def main():
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

    class Function:
        module = Module()

        def __init__(self, name):
            self.name = name
            self.kernel = ("kernel", name)

    libraries = set()  # one per compiled kernel

    def get_cufunc(self):
        libraries.add(id(self))
        return Function(self.name)

    CUDACodeLibrary.get_cufunc = get_cufunc
    launches = []

    def launch(stream, config, kernel, *args):
        if not isinstance(stream, (CoreStream, GraphBuilder)) and not LENIENT:
            raise TypeError(f"Stream or GraphBuilder expected, got {type(stream).__name__}")
        launches.append({"stream": getattr(stream, "handle", stream), "grid": list(config.grid), "block": list(config.block),
                         "kernel": kernel[1], "args": [getattr(a, "value", a) for a in args]})

    dispatcher.launch = launch
    load = dispatcher.CUDACache.load_overload

    def load_overload(self, *args, **kwargs):  # count the kernels read from numba's disk cache
        kern = load(self, *args, **kwargs)
        if kern is not None:
            HITS.append(repr(self))
        return kern

    dispatcher.CUDACache.load_overload = load_overload

    class Memory:  # a device allocation that is only an address
        _next = [1 << 40]

        def __init__(self, size):
            self.device_ctypes_pointer = __import__("ctypes").c_void_p(Memory._next[0])
            Memory._next[0] += (size + 255) // 256 * 256

    def device_array(shape, dtype):
        dtype = np.dtype(dtype)
        shape = tuple(shape)
        strides, step = [], dtype.itemsize
        for d in reversed(shape):  # C order
            strides.insert(0, step)
            step *= d
        strides = tuple(strides)
        return devicearray.DeviceNDArray(shape, strides, dtype, gpu_data=Memory(int(np.prod(shape)) * dtype.itemsize))

    cuda.device_array = device_array  # allocation is the driver's too

    from numbanorm.cuda._kernels import common as C
    from numbanorm.cuda._kernels import group_norm as GN
    from numbanorm.cuda._kernels import layer_norm as LN
    try:
        from numbanorm.cuda._kernels import row_norm as RW
    except ImportError:  # an older layout, timed for comparison
        RW = None

    C.n_sm = lambda: 132  # an H100
    if sys.argv[1] == "host":
        return host(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), device_array, launches)
    if sys.argv[1] == "count":
        return count(int(sys.argv[2]), int(sys.argv[3]), device_array, launches)
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


def host(M, N, calls, device_array, launches):
    """Host time of public calls (frontend, backend, launchers, marshalling) with the
    driver stubbed: LayerNorm forward and backward, float16 x and weight.  Round-robin
    in one process between numba-cuda's own launch of the compiled kernel
    (``_Kernel.launch``) and numbanorm's direct launch; the best of the rounds."""
    import time

    from numbanorm import _api
    from numbanorm.cuda import _backend
    from numbanorm.cuda._kernels import common as C

    nc = _api.Frontend(_backend)
    f16 = np.float16
    x, w, b = device_array((M, N), f16), device_array((N,), f16), device_array((N,), f16)
    y, mean, rstd = nc.layer_norm_forward(x, N, w, b)
    nc.layer_norm_backward(x, x, mean, rstd, N, w)  # compiled, resolved
    plans = {k: v for k, v in C._RESOLVED.items()}
    modes = {"numba": {k: (v[0], None) for k, v in plans.items()}, "direct": plans}
    out = {}
    for name, call in (("forward", lambda: nc.layer_norm_forward(x, N, w, b)),
                       ("backward", lambda: nc.layer_norm_backward(x, x, mean, rstd, N, w))):
        n0 = len(launches)
        call()
        out[name + "_launches"] = len(launches) - n0
        best = dict.fromkeys(modes, float("inf"))
        cpu = dict.fromkeys(modes, float("inf"))
        for _ in range(7):
            for mode, table in modes.items():
                C._RESOLVED.update(table)
                t, c = time.perf_counter(), time.thread_time()
                for _ in range(calls):
                    call()
                best[mode] = min(best[mode], (time.perf_counter() - t) / calls)
                cpu[mode] = min(cpu[mode], (time.thread_time() - c) / calls)
        for mode in modes:
            out[f"{name}_us_{mode}"] = round(best[mode] * 1e6, 1)
            # this thread's CPU time: what the host path costs, less the waits for a
            # CPU that a loaded machine adds to the wall time
            out[f"{name}_cpu_us_{mode}"] = round(cpu[mode] * 1e6, 1)
    C._RESOLVED.update(plans)
    out.update(launch_level(C, M, N, calls, device_array, launches, lambda: nc.layer_norm_forward(x, N, w, b)))
    out["loadavg"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(out))


def launch_level(C, M, N, calls, device_array, launches, forward):
    """This thread's CPU time of one launch of the forward kernel with its arguments
    prepared: numbanorm's direct cached launch (``common.launch``), numba-cuda's
    dispatcher (``kernel[grid, block, stream](*args)``) and its ``_Kernel.launch``; and
    the harness's own share of a public call (the stubbed driver launch, one
    stubbed allocation), which a real driver replaces with its own."""
    import inspect
    import time

    from numba.cuda import dispatcher

    seen = []
    real = C.launch
    C.launch = lambda *a: seen.append(a) or real(*a)
    forward()
    C.launch = real
    kernel, grid, block, *rest = seen[0]
    with_stream = "stream" in inspect.signature(real).parameters  # (an older common.launch had none)
    stream, args = (rest[0], tuple(rest[1:])) if with_stream else (0, tuple(rest))
    views = getattr(C, "arrays", tuple)(args)  # numba's launch takes real arrays, not numbanorm's Words
    compiled = next(v[0] for k, v in C._RESOLVED.items() if k[0] is kernel)
    core = C._INTERNALS[0](stream)
    config = C._launch_config(grid, block)
    fn = compiled._codelibrary.get_cufunc().kernel
    paths = {
        "direct": (lambda: real(kernel, grid, block, stream, *args)) if with_stream
        else (lambda: real(kernel, grid, block, *args)),
        "dispatcher": lambda: kernel[grid, block, stream](*views),
        "kernel_launch": lambda: compiled.launch(views, (grid, 1, 1), (block, 1, 1), C._INTERNALS[0](stream), 0),
        "stub_driver": lambda: dispatcher.launch(core, config, fn, *range(4 + 7 * len(args))),
        "stub_alloc": lambda: device_array((M, N), np.float16),
    }
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(7):
        for name, call in paths.items():
            c = time.thread_time()
            for _ in range(calls):
                call()
            best[name] = min(best[name], (time.thread_time() - c) / calls)
    return {f"launch_cpu_us_{k}": round(v * 1e6, 1) for k, v in best.items()}


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
                      "cache_hits": len(HITS)}))


if __name__ == "__main__":
    main()
