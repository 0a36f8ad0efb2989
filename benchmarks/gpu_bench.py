"""GPU bandwidth of numbanorm's CUDA kernels against PyTorch and a device copy.

    python benchmarks/gpu_bench.py [--rows 32768] [--cols 1024 2048 4096 8192]
                                   [--dtypes float16 bfloat16 float32] [--repeats 20]

For LayerNorm, RMSNorm and GroupNorm, forward and backward, at ``rows`` x
``cols`` (GroupNorm: x of shape (rows/256, 256 channels, cols) in 32 groups,
the same bytes), it times round-robin with ``numbanorm.measure.time_runners`` (the suite's one
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


def _cases(norm, rows, cols, tdtype, torch):
    """Inputs and the four (forward, backward) callables of one norm at one shape."""
    import numpy as np

    import numbanorm
    from numbanorm import measure
    from numbanorm.cuda import _backend as B

    group_norm = sys.modules["numbanorm.cuda._kernels.group_norm"]
    layer_norm = sys.modules["numbanorm.cuda._kernels.layer_norm"]
    rms_norm = sys.modules["numbanorm.cuda._kernels.rms_norm"]
    F = torch.nn.functional
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (rows // GN_CHANNELS, GN_CHANNELS, cols) if norm == "group_norm" else (rows, cols)
    nparam = GN_CHANNELS if norm == "group_norm" else cols
    x = torch.randn(shape, generator=g, device=dev, dtype=tdtype)
    dy = torch.randn(shape, generator=g, device=dev, dtype=tdtype)
    w = (torch.rand(nparam, generator=g, device=dev) + 0.5).to(tdtype)
    b = torch.randn(nparam, generator=g, device=dev, dtype=tdtype)
    acc = torch.float32
    nb = B._torch_view  # numba views of the same memory
    xv, dyv, wv, bv = nb(x), nb(dy), nb(w), nb(b)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    yv, dxv = nb(y), nb(dx)
    dw, db = torch.empty(nparam, device=dev, dtype=acc), torch.empty(nparam, device=dev, dtype=acc)
    dwv, dbv = nb(dw), nb(db)

    if norm == "layer_norm":
        mean, rstd = torch.empty(rows, device=dev, dtype=acc), torch.empty(rows, device=dev, dtype=acc)
        mv, rv = nb(mean), nb(rstd)
        kfwd = lambda: layer_norm.forward(xv, wv, bv, 1e-5, yv, mv, rv)  # noqa: E731
        kbwd = lambda: layer_norm.backward(dyv, xv, mv, rv, wv, dxv, dwv, dbv)  # noqa: E731
        _, m_, r_ = numbanorm.layer_norm_forward(x, cols, w, b)
        afwd = lambda: numbanorm.layer_norm(x, cols, w, b)  # noqa: E731
        abwd = lambda: numbanorm.layer_norm_backward(dy, x, m_, r_, cols, w)  # noqa: E731
        tfwd = lambda: F.layer_norm(x, (cols,), w, b)  # noqa: E731
        grads_of = lambda xr, wr, br: F.layer_norm(xr, (cols,), wr, br)  # noqa: E731
    elif norm == "rms_norm":
        rstd = torch.empty(rows, device=dev, dtype=acc)
        rv = nb(rstd)
        eps = float(np.finfo(np.float32).eps)
        kfwd = lambda: rms_norm.forward(xv, wv, eps, yv, rv)  # noqa: E731
        kbwd = lambda: rms_norm.backward(dyv, xv, rv, wv, dxv, dwv)  # noqa: E731
        _, r_ = numbanorm.rms_norm_forward(x, cols, w)
        afwd = lambda: numbanorm.rms_norm(x, cols, w)  # noqa: E731
        abwd = lambda: numbanorm.rms_norm_backward(dy, x, r_, cols, w)  # noqa: E731
        tfwd = lambda: F.rms_norm(x, (cols,), w, eps)  # noqa: E731
        grads_of = lambda xr, wr, br: F.rms_norm(xr, (cols,), wr, eps)  # noqa: E731
    else:
        n = shape[0]
        mean = torch.empty((n, GN_GROUPS), device=dev, dtype=acc)
        rstd = torch.empty((n, GN_GROUPS), device=dev, dtype=acc)
        mv, rv = nb(mean), nb(rstd)
        kfwd = lambda: group_norm.forward(xv, wv, bv, 1e-5, yv, mv, rv)  # noqa: E731
        kbwd = lambda: group_norm.backward(dyv, xv, mv, rv, wv, dxv, dwv, dbv)  # noqa: E731
        _, m_, r_ = numbanorm.group_norm_forward(x, GN_GROUPS, w, b)
        afwd = lambda: numbanorm.group_norm(x, GN_GROUPS, w, b)  # noqa: E731
        abwd = lambda: numbanorm.group_norm_backward(dy, x, m_, r_, w)  # noqa: E731
        tfwd = lambda: F.group_norm(x, GN_GROUPS, w, b)  # noqa: E731
        grads_of = lambda xr, wr, br: F.group_norm(xr, GN_GROUPS, wr, br)  # noqa: E731

    xr = x.detach().requires_grad_(True)
    wr = w.detach().requires_grad_(True)
    br = b.detach().requires_grad_(True)
    out = grads_of(xr, wr, br)
    ins = (xr, wr) if norm == "rms_norm" else (xr, wr, br)
    tbwd = lambda: torch.autograd.grad(out, ins, dy, retain_graph=True)  # noqa: E731

    side = measure.TorchCudaSide()
    cfwd, cbwd = measure.floor_call(side, x), measure.floor_call(side, x, dy)

    return {"kernel": (kfwd, kbwd), "api": (afwd, abwd), "torch": (tfwd, tbwd), "copy": (cfwd, cbwd)}, x


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--cols", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16", "float32"])
    p.add_argument("--norms", nargs="+", default=["layer_norm", "rms_norm", "group_norm"])
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
        tdtype = getattr(torch, dname)
        for norm in args.norms:
            for cols in args.cols:
                calls, x = _cases(norm, args.rows, cols, tdtype, torch)
                nbytes = x.numel() * x.element_size()
                row = {"norm": norm, "dtype": dname, "rows": args.rows, "cols": cols, "shape": list(x.shape)}
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
                del calls, x
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
