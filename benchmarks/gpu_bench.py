"""GPU bandwidth of numbanorm's CUDA kernels against PyTorch and a device copy.

    python benchmarks/gpu_bench.py [--rows 32768] [--cols 1024 2048 4096 8192]
                                   [--dtypes float16 bfloat16 float32] [--repeats 20]

For every benchmarked norm of the table (``numbanorm.measure.NORMS``: LayerNorm,
RMSNorm, GroupNorm, InstanceNorm), forward and backward, at ``rows`` x ``cols``
(GroupNorm: x of shape (rows/256, 256 channels, cols) in 32 groups, InstanceNorm
in 256; the same bytes), it times round-robin with ``numbanorm.measure.time_runners`` (the suite's one
timing core; every sample ends with a device synchronisation):

* ``kernel``: numbanorm's launchers on preallocated arrays -- the kernels
  (including the dweight/dbias column-sum kernel), numba-cuda's launch path
  included, the public frontend's validation and allocation left out;
* ``api``: the public function on torch tensors, as a user calls it
  (allocation through PyTorch's caching allocator, current stream);
* ``torch``: ``torch.nn.functional`` forward, and its backward through
  ``torch.autograd.grad`` on a retained graph;
* ``copy``: the bandwidth floor of ``numbanorm.measure.floor_call``, device to
  device: forward copies x (2 arrays of traffic), backward x and dy (4).

GB/s counts the arrays each moves once (``measure.KERNEL_ARRAYS``: forward x
and y, backward x, dy and dx; the copy ``measure.FLOOR_ARRAYS``); weight/bias/
statistics traffic, below 1/rows of it, is left out.  Results go to ``benchmarks/results/gpu-<date>.json``
with the device, driver and library versions.

Needs a CUDA GPU, PyTorch with CUDA, and numba-cuda (with NVVM/NVRTC);
without them it says which is missing and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata as _md
import json
import os
import platform
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
GN_CHANNELS, GN_GROUPS = 256, 32


def _refuse(why):
    print(f"gpu_bench: {why}", file=sys.stderr)
    sys.exit(2)


def _version(dist):
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def _driver_version(cuda):
    try:
        return ".".join(map(str, cuda.cudadrv.driver.driver.get_version()))
    except Exception:  # an older or newer numba-cuda without that call
        return None


def _cases(norm, rows, cols, dtype, side):
    """The four ``(forward, backward)`` callables of one norm at one shape on ``side``
    (``measure.TorchCudaSide``; the tests pass the simulator's ``NumbaCudaSide``), and
    the forward's ``measure.Case``.  Built from the table of operations, with no branch
    on the norm: ``api`` and ``torch`` are the suite's own calls (``torch`` only where
    the side holds torch tensors), ``copy`` its floor, ``kernel`` the launchers."""
    from numbanorm import measure

    op = measure.operation_of(norm)
    shape = (rows // GN_CHANNELS, GN_CHANNELS, cols) if op.layout == "groups" else (rows, cols)
    # GN_GROUPS for a groups-layout operation of the table; its variants (instance norm)
    # take their own count in measure.Case
    groups = GN_GROUPS if op.layout == "groups" and norm == op.name else None
    fwd, bwd = (measure.Case(norm, d, shape, dtype, groups, device="gpu") for d in measure.DIRECTIONS)
    inp = measure.Inputs(fwd, side)
    import numbanorm

    calls = {"kernel": _kernel_calls(op, fwd, inp),
             "api": (measure.numbanorm_calls(numbanorm, fwd, inp)["alloc"],
                     measure.numbanorm_calls(numbanorm, bwd, inp)["alloc"])}
    torch_f, torch_b = measure.torch_calls(fwd, inp), measure.torch_calls(bwd, inp)
    if torch_f:
        calls["torch"] = (torch_f["alloc"], torch_b["alloc"])
    calls["copy"] = (measure.floor_calls(fwd, inp)["out"], measure.floor_calls(bwd, inp)["out"])
    return calls, fwd


def _kernel_calls(op, case, inp):
    """``(forward, backward)``: ``op``'s launchers on arrays allocated here, in the
    frontend's argument order (forward: x, parameters, eps, y, statistics; backward:
    dy, x, statistics, weight, dx, parameter gradients), so the timing leaves out
    validation and allocation.  Each returns what it wrote; the forward runs once
    here, so the backward's statistics are real."""
    import numpy as np
    from numba import cuda

    from numbanorm import _api, _validate, measure
    from numbanorm.cuda import _backend as B

    fwd, bwd = (_api._launcher(B, k) for k in op.kernels)
    values = measure.arguments(case, inp.x, inp.w, inp.b)
    p = _api.LAYOUTS[op.layout](case.shape, values[op.shape_role])
    acc = np.float64 if case.dtype == "float64" else np.float32
    eps = _validate.rms_eps(op.eps, acc)  # the frontend's own default (None: machine eps)

    def view(a, shape):  # a numba view of the side's array, as the launchers see it
        return B.native("x", a).reshape(shape)

    x, dy = view(inp.x, p.flat), view(inp.dy, p.flat)
    params = [view(values[r], (p.width,)) for r in op.params]
    # y and dx as the side allocates x (bfloat16 included; a view owns its array)
    y, dx = view(inp.side.empty_like(inp.x), p.flat), view(inp.side.empty_like(inp.x), p.flat)
    stats = [cuda.device_array(p.stats, acc) for _ in op.stats]
    grads = [cuda.device_array(p.width, acc) for _ in op.backward_outputs[1:]]

    def forward():
        fwd(x, *params, eps, y, *stats)
        return (y, *stats)

    def backward():
        bwd(dy, x, *stats, params[0], dx, *grads)
        return (dx, *grads)

    forward()
    return forward, backward


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--cols", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16", "float32"])
    p.add_argument("--norms", nargs="+", default=None,
                   help="default: every benchmarked norm of the table (numbanorm.measure.NORMS)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--iters", type=int, default=10, help="calls per timed sample")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu-<date>.json)")
    args = p.parse_args(argv)

    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        _refuse("NUMBA_ENABLE_CUDASIM=1: the simulator has no meaningful timings; unset it on a GPU machine")
    import numbanorm.cuda as nc

    if not nc.is_available():
        _refuse(f"needs a CUDA GPU: {nc.why_unavailable()}")
    try:
        import torch
    except ImportError:
        _refuse("needs PyTorch with CUDA for the comparison (pip install torch)")
    if not torch.cuda.is_available():
        _refuse("PyTorch sees no CUDA GPU")
    if args.rows % GN_CHANNELS:
        _refuse(f"--rows must be a multiple of {GN_CHANNELS} (the GroupNorm shape)")
    from numba import cuda

    from numbanorm import measure
    from numbanorm.cuda._kernels import common as C

    results = []
    for dname in args.dtypes:
        if dname == "bfloat16" and C.bfloat16_unsupported():
            print(f"skipping bfloat16: {C.bfloat16_unsupported()}")
            continue
        for norm in args.norms or measure.NORMS:
            for cols in args.cols:
                calls, case = _cases(norm, args.rows, cols, dname, measure.TorchCudaSide())
                nbytes = case.nbytes
                row = {"norm": norm, "dtype": dname, "rows": args.rows, "cols": cols, "shape": list(case.shape)}
                for k, direction in enumerate(measure.DIRECTIONS):
                    runners = [measure.Runner(who, "alloc", fns[k]) for who, fns in calls.items()]
                    measure.time_runners(runners, torch.cuda.synchronize, repeats=args.repeats, number=args.iters)
                    for r in runners:
                        arrays = (measure.FLOOR_ARRAYS if r.impl == "copy" else measure.KERNEL_ARRAYS)[direction]
                        ms = r.quantiles()[1] * 1e3
                        row[f"{direction}_{r.impl}_ms"] = ms
                        row[f"{direction}_{r.impl}_GBps"] = arrays * nbytes / ms / 1e6
                    row[f"{direction}_kernel_vs_torch"] = row[f"{direction}_torch_ms"] / row[f"{direction}_kernel_ms"]
                    row[f"{direction}_kernel_vs_copy"] = row[f"{direction}_copy_ms"] / row[f"{direction}_kernel_ms"]
                results.append(row)
                print(f"{norm:<11} {dname:<9} {args.rows}x{cols:<5} "
                      f"fwd {row['forward_kernel_GBps']:7.0f} GB/s (api {row['forward_api_GBps']:6.0f}, "
                      f"torch {row['forward_torch_GBps']:6.0f}, copy {row['forward_copy_GBps']:6.0f})  "
                      f"bwd {row['backward_kernel_GBps']:7.0f} GB/s (api {row['backward_api_GBps']:6.0f}, "
                      f"torch {row['backward_torch_GBps']:6.0f}, copy {row['backward_copy_GBps']:6.0f})", flush=True)
                del calls
                torch.cuda.empty_cache()

    dev = cuda.get_current_device()
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "compute_capability": list(dev.compute_capability),
        "sms": C.n_sm(),
        "driver": _driver_version(cuda),
        "cuda_runtime_torch": torch.version.cuda,
        "versions": {d: _version(d) for d in ("numbanorm", "numba", "numba-cuda", "torch", "numpy",
                                              "cuda-bindings", "ml_dtypes")},
        "python": platform.python_version(),
        "timing": f"numbanorm.measure.time_runners: median of {args.repeats} round-robin samples "
                  f"of {args.iters} calls, each ending with a device synchronisation",
    }
    os.makedirs(RESULTS, exist_ok=True)
    path = args.out or os.path.join(RESULTS, f"gpu-{meta['date'][:10]}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
