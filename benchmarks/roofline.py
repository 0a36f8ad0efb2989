"""The CPU's two roofs, measured: peak float32 FLOP/s and copy bandwidth on every thread.

    python -m benchmarks.roofline                 # writes benchmarks/results/roofline-<cpu kind>.json
    python -m benchmarks.roofline --print         # only print

A roofline bounds a kernel's FLOP/s by ``min(peak FLOP/s, intensity * bandwidth)``, where
the intensity is its floating-point operations per byte moved.  Both roofs are measured
here, on the same thread counts as the benchmarks, and not quoted from a data sheet:

* **compute**: an in-cache loop of 16 dependent fused multiply-adds per element, over one
  4 KiB float32 row per thread (independent across elements, so the core's vector FMA
  pipes stay full and nothing waits for memory); 2 FLOP per FMA;
* **bandwidth**: ``measure.parallel_copy`` (the benchmarks' threaded floor) and
  ``np.copyto`` of a 256 MiB array, counted as read plus write.

The kernels' own points come from the benchmark results (their GB/s) and the operation
counts of :data:`FLOPS_PER_ELEMENT` (the table of operations'); the book's performance chapter draws them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

from . import measure

RESULTS = Path(__file__).resolve().parent / "results"

# Floating-point operations per element of each benchmarked norm: the table's counts
# (numbanorm.operations, where they are derived)
FLOPS_PER_ELEMENT = {(norm, d): measure.operation_of(norm).flops[k]
                     for norm in measure.NORMS for k, d in enumerate(measure.DIRECTIONS)}
FMAS_PER_ELEMENT = 16


def intensity(norm, direction, dtype):
    """FLOP per byte a kernel must move (``measure.KERNEL_ARRAYS`` arrays of ``dtype``)."""
    return FLOPS_PER_ELEMENT[(norm, direction)] / (measure.KERNEL_ARRAYS[direction] * measure.ITEMSIZE[dtype])


_FMA_LOOP = None


def fma_loop():
    global _FMA_LOOP
    if _FMA_LOOP is None:
        import numba

        @numba.njit(parallel=True, fastmath=True)
        def loop(x, a, b, reps):  # x: (tasks, 1024) float32, a row per task, in L1
            for t in numba.prange(x.shape[0]):
                row = x[t]
                for _ in range(reps):
                    for j in range(row.shape[0]):
                        v = row[j]
                        v = v * a + b; v = v * a + b; v = v * a + b; v = v * a + b  # noqa: E702
                        v = v * a + b; v = v * a + b; v = v * a + b; v = v * a + b  # noqa: E702
                        v = v * a + b; v = v * a + b; v = v * a + b; v = v * a + b  # noqa: E702
                        v = v * a + b; v = v * a + b; v = v * a + b; v = v * a + b  # noqa: E702
                        row[j] = v

        _FMA_LOOP = loop
    return _FMA_LOOP


def peak_gflops(threads, reps=4000, rounds=7):
    """Median GFLOP/s of the FMA loop with one 4 KiB row per thread."""
    measure.set_threads(threads)
    x = np.ones((threads, 1024), np.float32)
    a, b = np.float32(0.999), np.float32(0.001)
    loop = fma_loop()
    loop(x, a, b, 1)
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        loop(x, a, b, reps)
        rates.append(2 * FMAS_PER_ELEMENT * x.size * reps / (time.perf_counter() - t0) / 1e9)
    return float(np.median(rates)), float(max(rates))


def copy_gbps(threads, nbytes=256 << 20, rounds=7):
    """Median GB/s (read + write) of the threaded copy and of ``np.copyto``."""
    measure.set_threads(threads)
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    out = {}
    for name, fn in (("parallel_copy", measure.parallel_copy), ("np.copyto", np.copyto)):
        fn(dst, src)
        ts = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn(dst, src)
            ts.append(time.perf_counter() - t0)
        out[name] = {"median": 2 * nbytes / float(np.median(ts)) / 1e9, "fastest": 2 * nbytes / min(ts) / 1e9}
    return out


def run(threads=None):
    threads = measure.set_threads(threads)
    load0 = measure.loadavg()
    med, best = peak_gflops(threads)
    one_med, one_best = peak_gflops(1)
    copies = copy_gbps(threads)
    measure.set_threads(threads)
    return {
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "machine": measure.machine_info(include_gpu=False), "versions": measure.versions(),
                 "threads": threads, "loadavg_before": load0, "loadavg_after": measure.loadavg(),
                 "method": __doc__.split("\n\n")[2].strip()},
        "peak_gflops": {"threads": threads, "median": med, "fastest": best,
                        "one_thread_median": one_med, "one_thread_fastest": one_best},
        "copy_gbps": copies,
        "flops_per_element": {f"{n} {d}": v for (n, d), v in FLOPS_PER_ELEMENT.items()},
    }


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.roofline", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int)
    ap.add_argument("--print", action="store_true", help="print, write no file")
    ap.add_argument("--out", help="default results/roofline-<cpu kind>.json (one file per CPU kind, as the targets)")
    a = ap.parse_args(argv)
    if a.out is None:
        from .harness import cpu_kind

        a.out = str(RESULTS / f"roofline-{cpu_kind()}.json")
    res = run(a.threads)
    print(json.dumps({k: res[k] for k in ("peak_gflops", "copy_gbps")}, indent=1))
    if not a.print:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
