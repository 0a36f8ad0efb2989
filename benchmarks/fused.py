"""Fused residual add + norm against the unfused pair, on the CPU.

    python -m benchmarks.fused                       # (16384, 4096) float32, all threads
    python -m benchmarks.fused --shape 4096 1024 --dtype float64 --threads 1

For each norm it times, round-robin with ``numbanorm.measure.time_runners`` (the
suite's one timing function, so machine noise hits every variant alike):

* ``unfused``   ``s = np.add(x, r); y = numbanorm.<norm>(s, ...)``
* ``fused``     ``y, s = numbanorm.add_<norm>(x, r, ...)``
* ``unfused-par`` the unfused pair with the add on every thread (a Numba
  ``prange`` loop into a fresh array): ``np.add`` runs on one thread, and
  PyTorch's ``torch.add`` into a fresh tensor was slower still on the 2-core EPYC
  (about twice np.add's time at both default shapes), so no library add uses both
  cores; this one says how much of the fused call's gain is the fusion itself
* ``unfused-into`` and ``fused-into``: the same into preallocated ``s`` and ``y``
  (``np.add(out=)`` and ``out=``; the fused CPU launcher, as the public fused
  functions have no ``out=``): the kernels without the page faults of two
  fresh outputs, which both variants pay alike and which, on this machine, vary
  with the kernel's huge-page zeroing and compaction from run to run
* ``torch``     ``torch.nn.functional.<norm>(x + r, ...)`` on the same thread
  count (when PyTorch is installed), for context

and prints the fastest and the median sample per call, the effective bandwidth
of the fastest (fused traffic: x and r read, s and y written) and ``unfused /
variant`` for both statistics.  On a machine shared with other jobs their load
only adds time: the fastest sample is the least disturbed one, the median shows
how much the load moved things.  The ``-into`` variants are compared with
``unfused-into``, the others (torch included) with ``unfused``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import numpy as np
from numba import njit, prange

import numbanorm
from numbanorm import _api, _validate
from numbanorm.cpu import _backend
from numbanorm.operations import BY_NAME, OPERATIONS

from . import measure

# the table's fused operations by the norm they fuse: the API names them add_<norm>
FUSED = {op.name.removeprefix("add_"): op for op in OPERATIONS if op.fused}


@njit(parallel=True)  # (not cache=True: a script's helper, compiled once per run)
def parallel_add(x, r, s):
    for i in prange(x.shape[0]):
        for j in range(x.shape[1]):
            s[i, j] = x[i, j] + r[i, j]


def _par_add(x, r):
    s = np.empty_like(x)
    parallel_add(x, r, s)
    return s


def runners(norm, x, r, w, b, torch):
    """The variants for ``norm``, through the table: its fused operation and the plain one."""
    op, plain = FUSED[norm], BY_NAME[norm]
    s, y = np.ones_like(x), np.ones_like(x)  # touched: their pages are mapped
    acc = np.float64 if x.dtype == np.float64 else np.float32
    stats = [np.empty(x.shape[0], acc) for _ in op.stats]
    values = {"x": x, "residual": r, "normalized_shape": x.shape[-1], "weight": w, "bias": b}
    params = [values[p] for p in op.params]
    eps = _validate.rms_eps(op.eps, x.dtype)  # the frontend's own default (None: machine eps)
    launcher = _api._launcher(_backend, op.kernels[0])  # the fused CPU launcher, frontend's argument order

    def unfused_of(add, **out):  # the plain norm of add() = x + r, the add timed with it
        return lambda: plain.call(numbanorm, "plain", dict(values, x=add()), **out)

    out = [measure.Runner("unfused", "alloc", unfused_of(lambda: np.add(x, r))),
           measure.Runner("fused", "alloc", lambda: op.call(numbanorm, "plain", values)),
           measure.Runner("unfused-par", "alloc", unfused_of(lambda: _par_add(x, r))),
           measure.Runner("unfused-into", "out", unfused_of(lambda: np.add(x, r, out=s), out=y)),
           measure.Runner("fused-into", "out", lambda: launcher(x, r, *params, eps, y, s, *stats))]
    if torch is not None:
        tvalues = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in values.items()}
        out.append(measure.Runner("torch", "alloc", lambda: op.call_torch(torch.nn.functional, tvalues)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=2, default=(16384, 4096), metavar=("ROWS", "HIDDEN"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--norms", nargs="+", default=list(FUSED), choices=list(FUSED))
    ap.add_argument("--budget", type=float, default=10.0, help="seconds of round-robin rounds per norm")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)

    threads = measure.set_threads(a.threads)
    torch = None if a.no_torch else measure.torch_or_none()
    rng = np.random.default_rng(0)
    shape, dt = tuple(a.shape), np.dtype(a.dtype)
    x = rng.standard_normal(shape, dtype=np.float64).astype(dt)
    r = rng.standard_normal(shape, dtype=np.float64).astype(dt)
    w = rng.uniform(0.5, 1.5, shape[1]).astype(dt)
    b = rng.standard_normal(shape[1]).astype(dt)
    fused_bytes = 4 * x.nbytes

    load_before = measure.loadavg()
    print(f"# {measure.cpu_model()}, {threads} thread(s), {shape} {dt}, "
          f"load average {os.getloadavg()[0]:.1f}")
    results = []
    for norm in a.norms:
        rs = runners(norm, x, r, w, b, torch)
        rounds = measure.time_runners(rs, budget_s=a.budget, min_repeats=7, max_repeats=40)
        med = {q.impl: q.quantiles()[1] for q in rs}
        best = {q.impl: min(q.samples) for q in rs}
        for q in rs:
            base = "unfused-into" if q.mode == "out" else "unfused"
            q20, m, q80 = q.quantiles()
            row = {"norm": norm, "variant": q.impl, "shape": shape, "dtype": str(dt), "threads": threads,
                   "min_s": best[q.impl], "median_s": m, "q20_s": q20, "q80_s": q80, "rounds": rounds,
                   "GB/s": fused_bytes / best[q.impl] / 1e9,
                   "unfused/this (min)": best[base] / best[q.impl],
                   "unfused/this (median)": med[base] / m}
            results.append(row)
            print(f"{norm:11s} {q.impl:13s} min {best[q.impl] * 1e3:7.1f} ms  median {m * 1e3:7.1f} ms "
                  f"[{q20 * 1e3:.1f}-{q80 * 1e3:.1f}]  {row['GB/s']:5.1f} GB/s  unfused/this: "
                  f"{row['unfused/this (min)']:.2f}x (min) {row['unfused/this (median)']:.2f}x (median)")
    if a.json:
        with open(a.json, "w") as f:
            meta = {"date": datetime.date.today().isoformat(), "machine": measure.machine_info(include_gpu=False),
                    "versions": measure.versions(), "threads": threads, "loadavg_before": load_before,
                    "loadavg_after": measure.loadavg(), "budget_s": a.budget}
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
