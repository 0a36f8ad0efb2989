"""Chapter 5's measurement of the LayerNorm kernels against the copy floor, run by the
chapter in a Python process of its own, as the benchmarks run:

    python book/floor_probe.py M N      # prints one JSON object

A notebook kernel keeps threads of its own (the ZMQ and heartbeat threads, the
matplotlib backend) that compete with numba's for the cores, so a parallel loop timed
inside it measures the kernel's machine as much as the kernel.  float32 rows of N, the
median of 30 runs, into preallocated outputs (allocation is not timed), at one thread
and at every numba thread.
"""

import json
import os
import sys
import time

import numba
import numpy as np

import numbanorm


def median_time(f, repeats=30):
    f()  # compile / warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure(M, N):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, N), dtype=np.float32)
    dy = rng.standard_normal((M, N), dtype=np.float32)
    w = rng.uniform(0.5, 1.5, N).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    y, out = np.empty_like(x), np.empty_like(x)
    _, mean, rstd = numbanorm.layer_norm_forward(x, N, w, b)
    result = {
        "cores": os.cpu_count(),
        "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "bytes_per_array": x.nbytes,
        "copy_s": median_time(lambda: np.copyto(out, x)),  # 2 arrays moved
        "add_s": median_time(lambda: np.add(dy, x, out=out)),  # 3 arrays moved
        "threads": [],
    }
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(threads)
        result["threads"].append({
            "threads": threads,
            "forward_s": median_time(lambda: numbanorm.layer_norm(x, N, w, b, out=y)),
            "backward_s": median_time(
                lambda: numbanorm.layer_norm_backward(dy, x, mean, rstd, N, w)),
        })
    return result


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]))))
