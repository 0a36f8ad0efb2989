"""How numbanorm.dask's throughput scales from 1 to 2 (or more) Dask workers.

    python -m benchmarks.dask_scaling                    # (131072, 1024) float32, 1 and 2 workers
    python -m benchmarks.dask_scaling --rows 262144 --workers 1 2 4 --chunk-rows 16384

For each block size (rows per chunk) and worker count a ``LocalCluster`` of
worker processes with one thread each is started (``NUMBA_NUM_THREADS=1`` in
the workers: the parallelism is Dask's, one block per worker at a time), ``x``
and ``dy`` are generated on the workers and persisted, and then, round after
round:

* forward: ``numbanorm.dask.layer_norm_forward`` persisted (y, mean, rstd stay
  on the workers; nothing large travels to the client);
* backward: ``layer_norm_backward`` persisted, dweight/dbias tree-reduced.

It prints the fastest and the median round and the speed-up for both: the
fastest round is the one other jobs on the machine disturbed least.  The block
size is swept because the cost Dask adds per block is what keeps one worker
below the in-memory run.  On the 2-core EPYC a 1-worker forward round took 2.2x
the in-memory time in 32 MiB blocks and 1.5x in 128 MiB blocks
(results/dask-scaling-cpu.json), while the kernel on one 128 MiB block took the
same time inside a worker as in a plain process (0.98x, in a separate check with
``client.run``): the scheduler and the workers' event loops share the two cores
with the kernels.

Throughput counts the bytes the kernels must move: forward reads x and writes
y, backward reads x and dy and writes dx (statistics and weights are O(rows)
and O(hidden)).  For reference the same work runs in memory in this process on
one Numba thread.  On a machine shared with other jobs the medians move with
their load: the script prints the 20-80 % range of every figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time

import numpy as np


def summary(times):
    """(fastest, 20 %, median, 80 %) of a list of seconds."""
    return (min(times), *np.quantile(times, [0.2, 0.5, 0.8]))


def timed(fn, rounds):
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return summary(times)


def on_cluster(n_workers, shape, chunk_rows, dtype, rounds):
    import dask.array as da
    import distributed

    import numbanorm.dask as nd

    with distributed.LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                                  dashboard_address=None, silence_logs=logging.ERROR,
                                  env={"NUMBA_NUM_THREADS": "1"}) as cluster, \
            distributed.Client(cluster) as client:
        threads = client.run(lambda: __import__("numba").get_num_threads())
        assert set(threads.values()) == {1}, threads
        rng = da.random.default_rng(0)
        chunks = (chunk_rows, shape[1])
        x = client.persist(rng.standard_normal(shape, dtype=dtype, chunks=chunks))
        dy = client.persist(rng.standard_normal(shape, dtype=dtype, chunks=chunks))
        w = np.linspace(0.5, 1.5, shape[1], dtype=dtype)
        b = np.zeros(shape[1], dtype)
        distributed.wait([x, dy])
        # Dask names results by a hash of their inputs, so persisting the same
        # call twice would find the first result still in memory: every round
        # changes eps by 1e-12 (far below any effect on the output) to make it
        # new work, and drops the previous round's results first.
        state = {"round": 0}

        def forward():
            state.pop("bwd", None)
            state["round"] += 1
            eps = 1e-5 + 1e-12 * state["round"]
            state["fwd"] = client.persist(list(nd.layer_norm_forward(x, shape[1], w, b, eps)))
            distributed.wait(state["fwd"])

        def backward():
            _, mean, rstd = state["fwd"]
            state["bwd"] = client.persist(list(nd.layer_norm_backward(dy, x, mean, rstd, shape[1], w)))
            distributed.wait(state["bwd"])

        forward()  # first calls: numba's cache load in each worker, the scheduler's warm-up
        backward()
        fwd, bwd = [], []
        for _ in range(rounds):  # interleaved, so the machine's load hits both alike
            fwd.append(timed(forward, 1)[0])
            bwd.append(timed(backward, 1)[0])
        return summary(fwd), summary(bwd)


def in_memory(shape, dtype, rounds):
    import numba

    import numbanorm

    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float64).astype(dtype)
    w = np.linspace(0.5, 1.5, shape[1], dtype=dtype)
    b = np.zeros(shape[1], dtype)
    keep = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        y, mean, rstd = numbanorm.layer_norm_forward(x, shape[1], w, b)
        fwd = timed(lambda: numbanorm.layer_norm_forward(x, shape[1], w, b), rounds)
        bwd = timed(lambda: numbanorm.layer_norm_backward(x, x, mean, rstd, shape[1], w), rounds)
    finally:
        numba.set_num_threads(keep)
    return fwd, bwd


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=131072)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--chunk-rows", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    shape, dt = (a.rows, a.hidden), np.dtype(a.dtype)
    nbytes = a.rows * a.hidden * dt.itemsize
    moved = {"forward": 2 * nbytes, "backward": 3 * nbytes}
    print(f"# {shape} {dt} ({nbytes / 2**20:.0f} MiB per array), {os.cpu_count()} logical CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    load_before = [round(v, 2) for v in os.getloadavg()]
    rows = []

    def report(label, chunk_rows, workers, stats):
        for direction, (best, q20, med, q80) in zip(("forward", "backward"), stats):
            rows.append({"setup": label, "chunk_rows": chunk_rows, "workers": workers, "direction": direction,
                         "min_s": best, "median_s": med, "q20_s": q20, "q80_s": q80,
                         "GB/s (min)": moved[direction] / best / 1e9})
            print(f"{label:40s} {direction:8s} min {best * 1e3:7.1f} ms  median {med * 1e3:7.1f} ms "
                  f"[{q20 * 1e3:.1f}-{q80 * 1e3:.1f}]  {moved[direction] / best / 1e9:5.2f} GB/s (min)")

    report("in memory, 1 thread", None, None, in_memory(shape, dt, a.rounds))
    for c in a.chunk_rows:
        for n in a.workers:
            label = f"{n} worker(s), blocks of {c} rows ({c * a.hidden * dt.itemsize / 2**20:.0f} MiB)"
            report(label, c, n, on_cluster(n, shape, c, dt, a.rounds))
    for r in rows:
        base = [b for b in rows if b["workers"] == a.workers[0] and b["chunk_rows"] == r["chunk_rows"]
                and b["direction"] == r["direction"]]
        if r["workers"] is not None and r["workers"] != a.workers[0] and base:
            b = base[0]
            r["speed-up (min)"] = b["min_s"] / r["min_s"]
            r["speed-up (median)"] = b["median_s"] / r["median_s"]
            print(f"speed-up, {r['workers']} over {a.workers[0]} worker(s), blocks of {r['chunk_rows']} rows, "
                  f"{r['direction']}: {r['speed-up (min)']:.2f}x (min), {r['speed-up (median)']:.2f}x (median)")
    print(f"# load average after: {os.getloadavg()[0]:.1f}")
    if a.json:
        import dask
        import distributed

        from . import measure

        versions = dict(measure.versions(), dask=dask.__version__, distributed=distributed.__version__)
        meta = {"date": datetime.date.today().isoformat(), "machine": measure.machine_info(include_gpu=False),
                "versions": versions, "rounds": a.rounds, "loadavg_before": load_before,
                "loadavg_after": measure.loadavg()}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "shape": shape, "dtype": str(dt), "workers": a.workers,
                       "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
