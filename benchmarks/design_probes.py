"""Measurements behind the CPU kernel's design choices that chapter 5 of the book states.

    python -m benchmarks.design_probes [--quick]   # writes benchmarks/results/design-probes.json

Every figure is a ratio of two things timed round-robin in this one process (each round
runs every variant once, and a ratio is the median over rounds of the round's own ratio),
so that a slow moment of a shared machine slows both sides of a ratio alike.  Nothing
here re-implements a kernel: the variants are the package's own launchers and compiled
kernels called with different arguments.

- streaming: LayerNorm forward with float32 weight and bias, ordinary stores against
  streaming stores (the kernel's flag, whatever the size), over ``np.copyto`` of the same
  array; into a preallocated (mapped) ``out=`` and into a fresh array each call, float32
  and, fresh, the 16-bit types; float32 into ``out=`` also followed by a parallel loop
  reading ``y`` once (the next layer's reads: what a streamed line costs its consumer).
- backward_streaming: the LayerNorm backward's dx (float16, bfloat16, float32, weight
  float32), ordinary against streaming stores (the kernel's flag), over ``np.copyto`` of
  x and dy into two buffers; into a fresh dx each call and into a mapped one.
- small_calls: a (1, N) float32 forward with weight and bias through the public function
  (a call seen before: ``cpu._backend.Plans`` replays it), through the full path (the replay
  cache emptied before each call), through the kernel's launcher, and the row function
  alone (a small call's path); over ``torch.nn.functional.layer_norm`` when torch is installed.
- widen: float16 weights to float32, NumPy's ``astype`` over the launcher's ``param``.
- threading: the old small-call switch (``numba.set_num_threads(1)`` around the parallel
  kernel) over the row function on the calling thread (``serial_variant``); ``launch`` (the non-blocking lock) over the parallel
  kernel called directly; a forward in a child forked after the parent ran parallel
  kernels (which computes on one thread) over the same forward in the parent.
- row_costs: LayerNorm and RMSNorm forward into a large mapped ``out=`` (float16,
  bfloat16, float32) over the faster copy floor, beside the same rows' arithmetic alone
  (the row function on rows in cache, one thread) over the same floor: chapter 9's bound;
  row_costs_spread runs it in fresh processes (the threaded copy's pace moves between them),
  with ``--baseline DIR`` alternated with processes of another checkout's numbanorm.
- vector_width: the row functions of LayerNorm and RMSNorm, forward and backward,
  compiled twice from their own source, 512 bits wide (``common.wide_vectors``) and as
  LLVM chooses (256 bits on Intel's AVX-512 CPUs), on rows in cache, one thread.
- in_cache: LayerNorm into a mapped ``out=`` small enough to stay in cache (written with
  ordinary stores) with weight and bias, weight alone and neither, RMSNorm with its weight,
  GroupNorm (8 groups) and InstanceNorm on the same bytes as 64 channels, over ``np.copyto``
  of the same arrays; in_cache_spread runs it in fresh processes (where an
  array lands is drawn once a process) and gives each ratio's spread over them.
- row_groups: the forward row functions of LayerNorm (weight and bias, weight, neither)
  and RMSNorm compiled for each order of their writes (``spans.grouping``: whole rows, or
  groups of rows written span by span), over blocks of rows on every thread (a plain
  prange loop around them), on rows in cache, over ``np.copyto``.
- fresh_output: a large LayerNorm forward (16-bit and float32) into a mapped ``out=`` and
  into fresh arrays (in huge pages, NumPy's default, and in 4 KiB pages), beside PyTorch's
  allocating call and the threaded copy into a mapped and a fresh array (needs torch).
- group_passes: a GroupNorm forward whose arrays stay in cache, the public call, the
  launcher and its statistics pass alone, beside PyTorch's call and the threaded copy (needs torch).
- fresh_dx: a large GroupNorm and InstanceNorm backward into a mapped ``dx`` and allocating
  it (in huge pages and in 4 KiB pages), beside PyTorch's autograd backward and the threaded
  copy, in ``--processes`` fresh processes, every round kept (needs torch).
- channels_last: GroupNorm on ``torch.channels_last`` float32 tensors, forward and backward,
  through numbanorm.torch (its channels-last kernels) and ``torch.nn.functional``, the
  forward into ``out=`` with and without the paths past the streaming threshold, the
  backward's launcher into a touched ``dx``, beside both on the C-contiguous copy, the copy to
  C order and back a call in that order cost before, and the threaded copies of x and dy, each
  call timed warm, in ``--processes`` fresh processes (needs torch).
- backward_blocks: the LayerNorm and RMSNorm backward of a few long rows with the row blocks
  each smallest block of long rows gives (``common.BLOCK_ELEMENTS``), each in processes of
  its own, alternated ``--processes`` times; and a one-block call's kernel on the pool
  against the calling thread.

``--only NAME,...`` runs some of these; ``--out`` writes them elsewhere (a second machine).
"""

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numba
import numpy as np

import numbanorm
from numbanorm.cpu import _backend
from numbanorm.cpu._kernels import background, common, memory
from numbanorm.cpu._kernels.common import WIDE_VECTORS
from numbanorm.cpu._kernels import group_norm as gn
from numbanorm.cpu._kernels import layer_norm as ln
from numbanorm.cpu._kernels import rms_norm as rms
from numbanorm.cpu._kernels.halves import kernel_view
from numbanorm.cpu._kernels.stats import row_stats

from . import measure
from .harness import git_state, in_child, link_checkout, metadata

OUT = Path(__file__).parent / "results" / "design-probes.json"


def timed_rounds(variants, rounds, inner=1, warm=False):
    """``{name: array of per-round times}``; each round calls every variant ``inner`` times in a
    row, once more untimed before them where ``warm`` (each then finds its own arrays where its
    last call left them, not where the variant before it in the round left the cache)."""
    for f in variants.values():
        f()  # compile, fault in, warm up
    background.wait()  # the parallel kernels those calls handed to the compile thread
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, f in variants.items():
            if warm:
                f()
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            times[k].append((time.perf_counter() - t0) / inner)
    return {k: np.array(v) for k, v in times.items()}


def significant(v, digits=4):
    """``v`` to ``digits`` significant digits: a ratio of times far apart (a one-round run of
    a tiny case) kept, where rounding to decimals made it 0."""
    return float(f"{v:.{digits}g}")


def round_robin(variants, rounds, base, inner=1):
    """``{name: median over rounds of t(name) / t(base)}`` and the per-round minimum times.

    ``variants``: name -> callable; each round calls every one ``inner`` times in a row."""
    t = timed_rounds(variants, rounds, inner)
    return {
        "ratio_to_" + base: {k: round(float(np.median(t[k] / t[base])), 3) for k in t if k != base},
        "min_ratio_to_" + base: {k: round(float(t[k].min() / t[base].min()), 3) for k in t if k != base},
        "rounds": rounds,
        "inner": inner,
    }


def forward_args(M, N, rng):
    x = rng.standard_normal((M, N), dtype=np.float32)
    w = rng.uniform(0.5, 1.5, N).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    return x, w, b


@numba.njit(parallel=True)
def _read_rows(y, sums):
    """Read every element of ``y`` (M, N) once, on every thread: the next layer's reads."""
    for i in numba.prange(y.shape[0]):
        acc = np.float32(0)
        for j in range(y.shape[1]):
            acc += y[i, j]
        sums[i] = acc


def streaming(rounds_large, rounds_small):
    """Ordinary against streaming stores into a mapped out= and into fresh arrays."""
    threshold = memory.STREAM_MIN_BYTES
    rng = np.random.default_rng(0)
    cases = []
    # (shape, dtype, fresh): a fresh output is allocated by each call, as the launchers'
    # callers without out= do, and its pages are faulted in (and zeroed) by the kernel's stores
    float32 = [(16384, 4096), (65536, 768), (4096, 4096), (4096, 1024), (2048, 1024),
               (1024, 1024), (512, 1024)]
    shapes = ([(s, "float32", False) for s in float32] + [(s, "float32", True) for s in float32[:5]]
              + [((16384, 4096), "float16", True), ((16384, 4096), "bfloat16", True)])
    try:
        memory.STREAM_MIN_BYTES = 0  # let the flag decide alone, whatever the size
        for (M, N), dtype, fresh in shapes:
            x, w, b = forward_args(M, N, rng)
            x = x.astype(measure.host_dtype(dtype))
            y, floor = np.full_like(x, 1.0), np.full_like(x, 1.0)  # mapped: every page touched
            mean, rstd, sums = (np.empty(M, np.float32) for _ in range(3))

            def run(stream, then_read=False):
                out = np.empty_like(x) if fresh else y
                ln.launch(ln._forward, x.size, common.row_block(M), kernel_view(x), w, b,
                          np.float32(1e-5), kernel_view(out), mean, rstd, stream)
                if then_read:
                    _read_rows(out, sums)

            variants = {"copy": lambda: np.copyto(floor, x),
                        "ordinary": lambda: run(False),
                        "streaming": lambda: run(True)}
            if dtype == "float32" and not fresh:  # y read again right after, as by a next layer
                variants.update({"ordinary_then_read": lambda: run(False, True),
                                 "streaming_then_read": lambda: run(True, True)})
            r = round_robin(variants, rounds_large if x.nbytes >= threshold else rounds_small, "copy")
            r.update(shape=[M, N], dtype=dtype, y_mib=x.nbytes >> 20, fresh_output=fresh,
                     launcher_streams=x.nbytes >= threshold)
            cases.append(r)
            del x, y, floor
    finally:
        memory.STREAM_MIN_BYTES = threshold
    return {"stream_min_bytes": threshold, "cases": cases}


def backward_streaming(rounds, shapes=((16384, 4096), (65536, 768)),
                       dtypes=("float16", "bfloat16", "float32")):
    """The LayerNorm backward's dx, ordinary against streaming stores (the kernel's flag),
    over ``np.copyto`` of x and dy into two buffers; into a fresh dx each call (what the
    public backward does) and into a preallocated (mapped) one."""
    rng = np.random.default_rng(1)
    cases = []
    for M, N in shapes:
        for dtype in dtypes:
            try:
                dt = measure.host_dtype(dtype)
            except ValueError:  # bfloat16 without ml_dtypes
                continue
            x, w, b = forward_args(M, N, rng)
            x = x.astype(dt)
            dy = rng.standard_normal((M, N), dtype=np.float32).astype(dt)
            _, mean, rstd = numbanorm.layer_norm_forward(x, N, w, b)
            mean, rstd = mean.reshape(M), rstd.reshape(M)
            B = common.n_chunks(M, N)
            parts = [np.empty((B, N), np.float32) for _ in range(2)]
            mapped, fa, fb = (np.full_like(x, 1.0) for _ in range(3))
            for fresh in (True, False):
                def run(stream, fresh=fresh):
                    dx = np.empty_like(x) if fresh else mapped
                    ln.launch(ln._backward, x.size, 1, kernel_view(dy), kernel_view(x), mean, rstd, w, None,
                              kernel_view(dx), *parts, stream)

                def copy():
                    np.copyto(fa, x)
                    np.copyto(fb, dy)

                r = round_robin({"copy": copy, "ordinary": lambda: run(False), "streaming": lambda: run(True)},
                                rounds, "copy")
                r.update(shape=[M, N], dtype=dtype, dx_mib=x.nbytes >> 20, fresh_output=fresh,
                         launcher_streams=memory.should_stream(x))
                cases.append(r)
            del x, dy, mapped, fa, fb
    return {"stream_min_bytes": memory.STREAM_MIN_BYTES, "cases": cases}


def small_calls(rounds, inner):
    rng = np.random.default_rng(1)
    cases = []
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        torch = None
    for N in (768, 4096):
        x, w, b = forward_args(1, N, rng)
        y, mean, rstd = np.empty_like(x), np.empty(1, np.float32), np.empty(1, np.float32)
        serial = ln._forward.serial

        def full():
            _backend.plans._plans.clear()
            numbanorm.layer_norm(x, N, w, b)

        variants = {
            "replay": lambda: numbanorm.layer_norm(x, N, w, b),
            "full_path": full,
            "launcher": lambda: ln.forward(x, w, b, 1e-5, y, mean, rstd),
            "kernel": lambda: serial(1, x, w, b, np.float32(1e-5), y, mean, rstd, False),  # the row function
        }
        base = "full_path"
        if torch is not None:
            tx, tw, tb = (torch.from_numpy(a) for a in (x, w, b))
            variants["torch"] = lambda: F.layer_norm(tx, (N,), tw, tb, 1e-5)
            base = "torch"
        r = round_robin(variants, rounds, base, inner)
        if base == "torch":  # the same rounds' shares of the full path
            r["share_of_full_path"] = {k: round(v / r["ratio_to_torch"]["full_path"], 3)
                                       for k, v in r["ratio_to_torch"].items()}
        r.update(shape=[1, N])
        cases.append(r)
    return cases


def widen(rounds, inner):
    w16 = np.random.default_rng(2).uniform(0.5, 1.5, 4096).astype(np.float16)
    r = round_robin({"numba_param": lambda: common.param(w16, np.float32),
                     "numpy_astype": lambda: w16.astype(np.float32)}, rounds, "numba_param", inner)
    r.update(weights=4096)
    return r


def _forward_direct(kernel, M, N, rng):
    x, w, b = forward_args(M, N, rng)
    y, mean, rstd = np.empty_like(x), np.empty(M, np.float32), np.empty(M, np.float32)
    # a launch's arguments: the block size, then forward_rows's own (common.in_blocks)
    args = (ln.row_block(M), x, w, b, np.float32(1e-5), y, mean, rstd, False)
    with background.synchronous():  # the probes call the parallel kernel itself
        kernel.parallel(*args)
    return x, args


def threading(rounds, inner):
    rng = np.random.default_rng(3)
    threads = numba.get_num_threads()
    out = {"threads": threads, "switch": [], "lock": None, "fork": None}
    for M, N in ((2, 128), (1, 768)):
        _, args = _forward_direct(ln._forward, M, N, rng)

        def switch():  # the launcher before the serial variants
            numba.set_num_threads(1)
            try:
                ln._forward.parallel(*args)
            finally:
                numba.set_num_threads(threads)

        r = round_robin({"serial_variant": lambda: ln._forward.serial(*args),
                         "set_num_threads_switch": switch}, rounds, "serial_variant", inner)
        r.update(shape=[M, N])
        out["switch"].append(r)
    x, args = _forward_direct(ln._forward, 1024, 1024, rng)
    r = round_robin({"direct": lambda: ln._forward.parallel(*args),
                     "launch_with_lock": lambda: common.launch(ln._forward, x.size, *args)},
                    rounds, "direct", max(1, inner // 20))
    r.update(shape=[1024, 1024])
    out["lock"] = r
    out["fork"] = fork_cost(args, x.size)
    return out


def fork_cost(args, size, repeats=15):
    """Median time of a launched forward in a forked child over the same in the parent."""
    def med():
        common.launch(ln._forward, size, *args)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            common.launch(ln._forward, size, *args)
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    parent_before = med()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one thread (launch's fork hook), report and leave at once
        try:
            os.write(write, json.dumps(med()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        child = json.loads(f.read())
    os.waitpid(pid, 0)
    parent_after = med()
    parent = (parent_before + parent_after) / 2
    return {"shape": [1024, 1024], "child_over_parent": round(child / parent, 3),
            "repeats": repeats}


def row_costs(rounds, rows=16384, n=4096, cached=32):
    """A forward into a large mapped out= against the faster copy floor, and against the
    same rows' arithmetic alone: the row function over ``cached`` rows that stay in
    cache, called until it has done ``rows`` rows, its time over the threads.  Where
    that bound alone exceeds a target, no memory schedule can meet it on this CPU.
    Weight and bias in x's dtype, as the targets' inputs (``measure``)."""
    threads = numba.get_num_threads()
    rng = np.random.default_rng(4)
    cases = []
    for dtype in ("float16", "bfloat16", "float32"):
        try:
            dt = measure.host_dtype(dtype)
        except ValueError:  # bfloat16 without ml_dtypes
            continue
        x = (rng.standard_normal((rows, n), dtype=np.float32) + 0.5).astype(dt)
        w = rng.uniform(0.5, 1.5, n).astype(dt)
        b = (0.1 * rng.standard_normal(n)).astype(dt)
        wk, bk = common.weights(x, np.float32, w, b)  # as the launchers pass them to the row function
        y, floor = np.full_like(x, 1.0), np.full_like(x, 1.0)  # mapped: every page touched
        mean, rstd = np.empty(rows, np.float32), np.empty(rows, np.float32)
        xv, yv = kernel_view(x[:cached]), kernel_view(y[:cached])
        eps = np.float32(1e-5)
        for norm, module in (("layer_norm", ln), ("rms_norm", rms)):
            serial = module._forward.serial
            # a launch's arguments: the block size, then forward_rows's own
            if module is ln:
                out = lambda: ln.forward(x, w, b, 1e-5, y, mean, rstd)  # noqa: E731
                cache_args = (cached, xv, wk, bk, eps, yv, mean[:cached], rstd[:cached], False)
            else:
                out = lambda: rms.forward(x, w, 1e-5, y, rstd)  # noqa: E731
                cache_args = (cached, xv, wk, eps, yv, rstd[:cached], False)

            def arithmetic():
                for _ in range(rows // cached):
                    serial(*cache_args)

            t = timed_rounds({"copy": lambda: np.copyto(floor, x),
                              "copy_threads": lambda: measure.parallel_copy(floor, x),
                              "out": out, "arithmetic": arithmetic}, rounds)
            faster = np.minimum(t["copy"], t["copy_threads"])
            cases.append({
                "norm": norm, "dtype": dtype, "shape": [rows, n], "threads": threads, "weights": dtype,
                # the targets' measure: the streamed forward over the faster copy floor
                "out_over_faster_floor": round(float(np.median(t["out"] / faster)), 3),
                # its lower bound: the arithmetic alone, spread over the threads
                "arithmetic_over_faster_floor": round(float(np.median(t["arithmetic"] / threads / faster)), 3),
                "copy_threads_over_copy": round(float(np.median(t["copy_threads"] / t["copy"])), 3),
                # the rates behind the ratios: bytes of x and y over the threaded copy's
                # median time, and over the arithmetic's spread over the threads
                "copy_threads_gbps": round(2 * x.nbytes / float(np.median(t["copy_threads"])) / 1e9, 1),
                "arithmetic_gbps": round(2 * x.nbytes / (float(np.median(t["arithmetic"])) / threads) / 1e9, 1),
                # how far the machine's copy bandwidth moved between this case's rounds
                "copy_threads_slowest_over_fastest": round(float(t["copy_threads"].max() / t["copy_threads"].min()), 3),
                "rounds": rounds,
            })
        del x, y, floor
    return cases


def _child_code(call):
    """The source of a child (``harness.in_child``) that runs this module's ``call`` (its
    source text, ``"in_cache(15, 512, 4096)"``) on this process's thread count and writes
    what it returns as JSON."""
    return ("import sys, json, numba; from benchmarks import design_probes as p; "
            f"numba.set_num_threads({numba.get_num_threads()}); "
            f"json.dump(p.{call}, open(sys.argv[1], 'w'))")


def row_costs_spread(processes, rounds, baseline=None, **shape):
    """:func:`row_costs` in ``processes`` fresh processes, on this one's thread count: on a
    shared VM the threaded copy's pace moves between processes and within one, and with
    it whether a forward's arithmetic alone is under the faster floor (``processes``: each
    process's cases).  With ``baseline`` (another checkout's root) each process alternates
    with one running that checkout's ``numbanorm`` (this probe's code): ``baseline_processes``.
    ``shape``: row_costs's ``rows``, ``n`` and ``cached``."""
    import tempfile

    code = _child_code(f"row_costs({rounds}, **{shape!r})")
    out = {"rounds": rounds}
    with tempfile.TemporaryDirectory(prefix="numbanorm-row-costs-") as tmp:
        sides = {"processes": None}
        if baseline is not None:
            sides = {"baseline_processes": link_checkout(baseline, tmp), "processes": None}
            out["baseline"] = git_state(baseline)["commit"]
        for _ in range(processes):
            for key, first in sides.items():  # each side's kernels compiled once, in a cache of its own
                out.setdefault(key, []).append(in_child(code, first=first, cache=os.path.join(tmp, "cache-" + key)))
    return out


def vector_width(rounds, n=4096, cached=32, dtypes=("float16", "bfloat16", "float32")):
    """Each row function compiled for each dtype with ``common.WIDE_VECTORS`` holding its
    element type and empty (fresh, uncached compiles of the package's own functions),
    timed round-robin on ``cached`` rows in cache: the arithmetic alone, 512 bits over
    LLVM's own width."""
    from numba import njit

    rng = np.random.default_rng(5)
    eps = np.float32(1e-5)
    cases = []
    for dtype in dtypes:
        try:
            dt = measure.host_dtype(dtype)
        except ValueError:  # bfloat16 without ml_dtypes
            continue
        x = kernel_view((rng.standard_normal((cached, n), dtype=np.float32) + 0.5).astype(dt))
        dy = kernel_view(rng.standard_normal((cached, n), dtype=np.float32).astype(dt))
        y, dx = np.empty_like(x), np.empty_like(x)
        w = rng.uniform(0.5, 1.5, n).astype(np.float32)
        b = (0.1 * rng.standard_normal(n)).astype(np.float32)
        mean, rstd = np.empty(cached, np.float32), np.empty(cached, np.float32)
        part, part2 = np.empty((1, n), np.float32), np.empty((1, n), np.float32)
        ln.forward_rows(x, w, b, eps, y, mean, rstd, False, 0, cached)  # statistics the backward reads
        calls = {
            ("layer_norm", "forward"): (ln.forward_rows, (x, w, b, eps, y, mean, rstd, False, 0, cached)),
            ("layer_norm", "backward"): (ln.backward_rows, (dy, x, mean, rstd, w, None, dx, part, part2, False, 0, 1)),
            ("rms_norm", "forward"): (rms.forward_rows, (x, w, eps, y, rstd, False, 0, cached)),
            ("rms_norm", "backward"): (rms.backward_rows, (dy, x, rstd, w, None, dx, part, False, 0, 1)),
        }
        for (norm, direction), (rows_fn, args) in calls.items():
            options = {k: v for k, v in rows_fn.targetoptions.items() if k not in ("cache", "nopython")}
            compiled = {}
            for wide in (False, True):
                # read when the function is compiled, by its first call
                common.WIDE_VECTORS = (numba.from_dtype(x.dtype),) if wide else ()
                try:
                    f = njit(**options)(rows_fn.py_func)
                    f(*args)
                finally:
                    common.WIDE_VECTORS = WIDE_VECTORS
                compiled["512" if wide else "llvm"] = f
            t = timed_rounds({k: (lambda f=f: f(*args)) for k, f in compiled.items()}, rounds, inner=20)
            cases.append({
                "norm": norm, "direction": direction, "dtype": dtype, "n": n,
                "wide_over_llvm": round(float(np.median(t["512"] / t["llvm"])), 3),
                "llvm_ns_per_row": round(float(np.median(t["llvm"])) / cached * 1e9),
                "wide_ns_per_row": round(float(np.median(t["512"])) / cached * 1e9),
                "rounds": rounds,
            })
    return {"wide_vectors_here": [str(t) for t in WIDE_VECTORS], "cases": cases}


def row_groups(rounds, shapes=((512, 4096), (256, 8192)),
               orders=((1, 0), (8, 1024), (4, 1024), (16, 1024), (8, 512), (8, 2048))):
    """:func:`row_order` for each (rows, n) of ``shapes``: 8 MiB of float32 at N = 4096 and 8192."""
    return {"cases": [row_order(rounds, rows, n, orders) for rows, n in shapes]}


def row_order(rounds, rows, n, orders):
    """LayerNorm's and RMSNorm's forward row functions compiled once for each write order
    ``(GROUP_ROWS, SPAN)`` of ``spans.grouping`` ((1, 0): whole rows, one at a time), fresh
    uncached compiles of the package's own functions, each run over blocks of rows on
    every numba thread (``common.row_block``'s blocks, a plain prange loop: the package's
    generated kernel is cached under the row function's name, which a variant must not
    take), on (rows, n) float32 rows that stay in cache, over ``np.copyto`` of the same
    arrays: with weight and bias, the weight alone and neither (LayerNorm), the weight
    (RMSNorm)."""
    from numba import njit, prange

    from numbanorm.cpu._kernels import spans

    x, w, b = forward_args(rows, n, np.random.default_rng(6))
    y = np.empty_like(x)
    mean, rstd = np.empty(rows, np.float32), np.empty(rows, np.float32)
    eps, block = np.float32(1e-5), common.row_block(rows)

    def parallel(rows_fn):  # the row function over blocks of rows, as common.in_blocks's kernel
        @njit(parallel=True)
        def run(block, *args):  # args: the row function's own, x first, without the bounds
            m = args[0].shape[0]
            for k in prange(-(-m // block)):
                lo = np.int64(k) * block
                rows_fn(*args, lo, min(m, lo + block))
        return run

    calls = {"layer_norm": (ln.forward_rows, (x, w, b, eps, y, mean, rstd, False)),
             "layer_norm_weight": (ln.forward_rows, (x, w, None, eps, y, mean, rstd, False)),
             "layer_norm_plain": (ln.forward_rows, (x, None, None, eps, y, mean, rstd, False)),
             "rms_norm": (rms.forward_rows, (x, w, eps, y, rstd, False))}
    saved = spans.GROUP_FROM_BYTES, spans.GROUP_ROWS, spans.SPAN
    variants, first, same = {"copy": lambda: np.copyto(y, x)}, {}, True
    try:
        for group, span in orders:
            # read when the row function is compiled (grouping is inlined into it)
            spans.GROUP_FROM_BYTES = 1 << 62 if group == 1 else 0
            spans.GROUP_ROWS, spans.SPAN = group, span
            for name, (rows_fn, args) in calls.items():
                options = {k: v for k, v in rows_fn.targetoptions.items() if k not in ("cache", "nopython")}
                run = parallel(njit(**options)(rows_fn.py_func))
                run(block, *args)
                same = same and np.array_equal(first.setdefault(name, y.copy()), y)  # any order, the same bits
                variants[f"{name} {group}x{span}"] = lambda run=run, args=args: run(block, *args)
    finally:
        spans.GROUP_FROM_BYTES, spans.GROUP_ROWS, spans.SPAN = saved
    inner = max(1, int(0.02 / max(timed_rounds({"c": variants["copy"]}, 3)["c"].min(), 1e-6)))
    ratios = round_robin(variants, rounds, "copy", inner=inner)
    return {"shape": [rows, n], "orders": [list(o) for o in orders], "threads": numba.get_num_threads(),
            "same_bits": bool(same), **ratios}


def torch_small_calls(rounds, inner, shapes=((1, 768), (1, 4096), (8, 4096)), sizes=(4, 8, 16, 32, 64)):
    """numbanorm.torch's LayerNorm (float32, weight and bias) by its plan (a call seen before,
    by its tensors' addresses: ``numbanorm._torch_addressed``) and by the full path (no plan
    known, none learned), over torch's own call: a forward without a graph, one that records
    a graph (x, weight and bias need a gradient) and the backward of a graph recorded once
    (``torch.autograd.grad``).  Beside them, an ``autograd.Function`` that only allocates y
    and saves x and the weight: the floor of any forward recorded through one.  Then
    (M, 4096) forwards without a graph for each M of ``sizes``, by plan and by the full
    path, plans allowed at any size: where the calling thread stops beating the launcher's
    parallel kernel.  Each variant runs ``inner`` calls a round (the plans swapped out and
    back around the full path's, outside its calls)."""
    import torch
    import torch.nn.functional as F

    import numbanorm.torch as nt
    from numbanorm import _torch_addressed

    calls = [f.small for f in nt._IMPLEMENTATIONS.values() if getattr(f, "small", None) is not None]

    def many(f):
        def run():
            for _ in range(inner):
                f()
        return run

    def without_plans(f):
        def run():
            kept = [dict(c.plans) for c in calls]  # (emptied in place: the generated code holds each dict)
            for c in calls:
                c.plans.clear()
            try:
                f()
            finally:
                for c, p in zip(calls, kept):
                    c.plans.update(p)
        return run

    class _Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shape, w, b, eps):
            ctx.save_for_backward(x, w)
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, dy):
            return dy, None, None, None, None

    def measured(variants, base):
        for _ in range(3):  # the plans learned, their entries handed to the compile thread
            variants["plan"]()
        background.wait()
        for c in calls:
            c.learn = lambda key, args, results: None  # (the full path's calls learn nothing)
        try:
            timed = {k: many(f) for k, f in variants.items()}
            timed["full_path"] = without_plans(timed["plan"])
            return round_robin(timed, rounds, base)
        finally:
            for c in calls:
                del c.learn

    cases, sizes_out = [], []
    for M, N in shapes:
        g = torch.Generator().manual_seed(M * N)
        x, w, b = torch.randn(M, N, generator=g), torch.rand(N, generator=g) + 0.5, torch.randn(N, generator=g)
        xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
        dy = torch.randn(M, N, generator=g)
        ours, theirs = nt.layer_norm(xg, (N,), wg, bg), F.layer_norm(xg, (N,), wg, bg)
        for kind, variants in (
                ("forward, no graph", {"plan": lambda: nt.layer_norm(x, (N,), w, b),
                                       "torch": lambda: F.layer_norm(x, (N,), w, b)}),
                ("forward, graph", {"plan": lambda: nt.layer_norm(xg, (N,), wg, bg),
                                    "torch": lambda: F.layer_norm(xg, (N,), wg, bg),
                                    "function_floor": lambda: _Floor.apply(xg, (N,), wg, bg, 1e-5)}),
                ("backward", {"plan": lambda: torch.autograd.grad(ours, (xg, wg, bg), dy, retain_graph=True),
                              "torch": lambda: torch.autograd.grad(theirs, (xg, wg, bg), dy, retain_graph=True)})):
            cases.append(dict(measured(variants, "torch"), shape=[M, N], call=kind))
    most, _torch_addressed.MOST = _torch_addressed.MOST, 1 << 62
    try:
        for M in sizes:
            g = torch.Generator().manual_seed(M)
            x, w, b = torch.randn(M, 4096, generator=g), torch.rand(4096, generator=g), torch.randn(4096, generator=g)
            variants = {"plan": lambda: nt.layer_norm(x, (4096,), w, b),
                        "torch": lambda: F.layer_norm(x, (4096,), w, b)}
            sizes_out.append(dict(measured(variants, "full_path"), shape=[M, 4096], elements=M * 4096))
    finally:
        _torch_addressed.MOST = most
    return {"calls": cases, "sizes": sizes_out, "plans_up_to_elements": most, "inner": inner,
            "torch_threads": torch.get_num_threads()}


def in_cache(rounds, rows=512, n=4096):
    """One process's ratios over np.copyto: the forwards into a mapped (rows, n) float32 out=."""
    x, w, b = forward_args(rows, n, np.random.default_rng(0))
    y = np.empty_like(x)
    cx, cy = x.reshape(8, 64, -1), y.reshape(8, 64, -1)  # the same bytes as (N, C, HW): 64 channels
    cw, cb = w[:64], b[:64]
    variants = {"copy": lambda: np.copyto(y, x),
                "layer_norm": lambda: numbanorm.layer_norm(x, (n,), w, b, out=y),
                "layer_norm_weight": lambda: numbanorm.layer_norm(x, (n,), w, None, out=y),
                "layer_norm_plain": lambda: numbanorm.layer_norm(x, (n,), None, None, out=y),
                "rms_norm": lambda: numbanorm.rms_norm(x, (n,), w, out=y),
                "group_norm_8": lambda: numbanorm.group_norm(cx, 8, cw, cb, out=cy),
                "instance_norm": lambda: numbanorm.group_norm(cx, 64, cw, cb, out=cy)}
    ratios = round_robin(variants, rounds, "copy", inner=5)
    stat = Path("/proc/thread-self/stat")  # (Linux) the CPU the calling thread, the copy's, ran on last
    cpu = int(stat.read_text().rsplit(")", 1)[1].split()[36]) if stat.exists() else None
    return {"shape": [rows, n], "group_shape": list(cx.shape), "bytes_out": y.nbytes,
            "streamed": bool(memory.should_stream(y)), "copy_cpu": cpu, **ratios}


def in_cache_spread(processes, rounds, rows=512, n=4096):
    """:func:`in_cache` in ``processes`` fresh processes, on this one's thread count: each ratio
    per process and its least, median and greatest over them."""
    code = _child_code(f"in_cache({rounds}, {rows}, {n})")
    runs = [in_child(code) for _ in range(processes)]
    ratios = {k: [r["ratio_to_copy"][k] for r in runs] for k in runs[0]["ratio_to_copy"]}
    return {"shape": [rows, n], "processes": processes, "rounds": rounds, "streamed": runs[0]["streamed"],
            "ratio_to_copy": ratios, "copy_cpu": [r["copy_cpu"] for r in runs],
            "spread": {k: {"least": min(v), "median": float(np.median(v)), "greatest": max(v)}
                       for k, v in ratios.items()}}


def _torch_functional():
    """``torch.nn.functional`` with torch on numba's thread count (``measure.set_threads``)."""
    import torch

    measure.set_threads(numba.get_num_threads())
    return torch.nn.functional


def _small_pages(call):
    """``call`` with NumPy's huge-page advice off (it asks for huge pages for every large
    array), so that its fresh output is mapped in 4 KiB pages."""
    from numpy._core import multiarray

    def run():
        before = multiarray._get_madvise_hugepage()
        multiarray._set_madvise_hugepage(False)
        try:
            return call()
        finally:
            multiarray._set_madvise_hugepage(before)
    return run


def fresh_output(rounds, rows=16384, n=4096, dtypes=("float16", "bfloat16", "float32")):
    """What a fresh output costs a large forward: LayerNorm (weight and bias) into a mapped
    ``out=`` and into a fresh array (in huge pages, as NumPy asks for them, and in 4 KiB
    pages), beside PyTorch's allocating call and the threaded copy into a mapped and into a
    fresh array; milliseconds, medians over rounds, and the allocating call over torch's."""
    F = _torch_functional()
    rng = np.random.default_rng(5)
    cases = []
    for dtype in dtypes:
        dt = measure.host_dtype(dtype)
        x = rng.standard_normal((rows, n), dtype=np.float32).astype(dt)
        w, b = rng.uniform(0.5, 1.5, n).astype(dt), rng.standard_normal(n).astype(dt)
        y = np.full_like(x, 1.0)  # mapped: every page touched
        tx, tw, tb = (measure.HostSide().to_torch(a) for a in (x, w, b))
        fresh = lambda: numbanorm.layer_norm(x, (n,), w, b)  # noqa: E731
        t = timed_rounds({
            "out": lambda: numbanorm.layer_norm(x, (n,), w, b, out=y),
            "fresh": fresh,
            "fresh_small_pages": _small_pages(fresh),
            "torch": lambda: F.layer_norm(tx, (n,), tw, tb),
            "copy_threads": lambda: measure.parallel_copy(y, x),
            "copy_threads_fresh": lambda: measure.parallel_copy(np.empty_like(x), x),
        }, rounds)
        med = {k: float(np.median(v)) for k, v in t.items()}
        cases.append({
            "dtype": dtype, "shape": [rows, n], "bytes_out": x.nbytes, "rounds": rounds,
            "ms": {k: round(v * 1e3, 3) for k, v in med.items()},
            # the targets' ratio (the allocating call over torch's), and the same call into out=
            "fresh_over_torch": round(float(np.median(t["fresh"] / t["torch"])), 3),
            "out_over_torch": round(float(np.median(t["out"] / t["torch"])), 3),
            # the share of the allocating call that is the fresh pages (the call into out= the rest)
            "fresh_pages_share": round(1 - med["out"] / med["fresh"], 3),
            # what the same fresh pages cost the threaded copy
            "copy_fresh_over_copy": round(float(np.median(t["copy_threads_fresh"] / t["copy_threads"])), 3),
        })
        del x, y
    return {"cases": cases, "torch_threads": numba.get_num_threads()}


def fresh_dx(rounds, shape=(32, 256, 32, 32), groups=(32, 256)):
    """What a fresh ``dx`` costs a large GroupNorm backward (``groups``: 32 groups, and one a
    channel: InstanceNorm): the launcher into a mapped ``dx``, the public call (a fresh ``dx``
    in huge pages, as NumPy asks for them, and in 4 KiB pages), torch's autograd backward (its
    graph built once, as the targets' ``measure.torch_calls``) and the threaded copy of the same
    bytes; milliseconds a round (medians, and every round: the spread is the finding)."""
    import torch

    F = _torch_functional()
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape, dtype=np.float32)
    dy = rng.standard_normal(shape, dtype=np.float32)
    C = shape[1]
    w, b = rng.uniform(0.5, 1.5, C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    mapped = np.full_like(x, 1.0)  # every page touched
    dw, db = np.empty(C, np.float32), np.empty(C, np.float32)
    flat = (shape[0], C, -1)
    cases = []
    for g in groups:
        _, mean, rstd = numbanorm.group_norm_forward(x, g, w, b)
        fresh = lambda: numbanorm.group_norm_backward(dy, x, mean, rstd, w)  # noqa: E731
        leaves = [torch.from_numpy(a).requires_grad_(True) for a in (x, w, b)]
        ty = F.group_norm(leaves[0], g, leaves[1], leaves[2])
        tdy = torch.from_numpy(dy)
        t = timed_rounds({
            "mapped": lambda: gn.backward(dy.reshape(flat), x.reshape(flat), mean, rstd, w, mapped.reshape(flat),
                                          dw, db),
            "fresh": fresh,
            "fresh_small_pages": _small_pages(fresh),
            "torch": lambda: torch.autograd.grad(ty, leaves, tdy, retain_graph=True),
            "copy_threads": lambda: measure.parallel_copy(mapped, x),
        }, rounds)
        cases.append({
            "groups": g, "shape": list(shape), "bytes_dx": x.nbytes, "rounds": rounds,
            "ms": {k: round(float(np.median(v)) * 1e3, 3) for k, v in t.items()},
            # (to 0.1 us: a tiny shape's call under 5 us was kept as 0.0)
            "ms_rounds": {k: [round(float(r) * 1e3, 4) for r in v] for k, v in t.items()},
            # the targets' ratio (the public call over torch's), and each way of meeting dx over torch's
            "over_torch": {k: round(float(np.median(t[k] / t["torch"])), 3) for k in t if k != "torch"},
        })
    return {"cases": cases, "torch_threads": numba.get_num_threads()}


# glibc's malloc serves blocks under this many bytes from its heap, where the next array
# reuses a freed one's pages (by default it maps each 32 MiB array afresh and unmaps it when
# freed): one way a process skips the page faults of fresh arrays
KEEP_MAPPED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32)}


def fresh_dx_spread(processes, rounds):
    """:func:`fresh_dx` in ``processes`` fresh processes: whether the operating system finds
    huge pages for a fresh ``dx`` at once is drawn again in each (the first rounds of one
    can wait on it); and in two with glibc keeping freed arrays mapped (``KEEP_MAPPED``)."""
    code = _child_code(f"fresh_dx({rounds})")
    return {"rounds": rounds, "processes": [in_child(code) for _ in range(processes)],
            "kept_mapped": KEEP_MAPPED, "kept_mapped_processes": [in_child(code, env=KEEP_MAPPED) for _ in range(2)]}


# The backward's row blocks (common.n_chunks) by the smallest block of long rows they allow
# (common.BLOCK_ELEMENTS; None: 16 rows a block whatever their length, the rule before)
BLOCK_RULES = (None, 16384, 32768, 65536)
BLOCK_SHAPES = ((8, 4096), (16, 4096), (32, 4096), (64, 4096), (16, 8192), (8, 16384), (4, 32768))


def backward_blocks(rounds, rule, inner=40, shapes=BLOCK_SHAPES):
    """The LayerNorm and RMSNorm backward (float32, with weight) of a few long rows by the
    public call, their row blocks cut by ``rule`` (one of ``BLOCK_RULES``), round-robin over
    the shapes: microseconds a call (medians over rounds) and the block counts; and for a
    one-block call, its kernel on Numba's threads (what a launch did before it ran such a
    call on the calling thread) against the row function on the calling thread."""
    common.BLOCK_ELEMENTS = (1 << 62) if rule is None else rule
    rng = np.random.default_rng(11)
    calls, blocks = {}, {}
    for M, N in shapes:
        x = rng.standard_normal((M, N), dtype=np.float32)
        dy = rng.standard_normal((M, N), dtype=np.float32)
        w = rng.uniform(0.5, 1.5, N).astype(np.float32)
        _, mean, rstd = numbanorm.layer_norm_forward(x, N, w)
        _, rr = numbanorm.rms_norm_forward(x, N, w)
        key = f"{M}x{N}"
        calls["layer_norm " + key] = lambda a=(dy, x, mean, rstd, N, w): numbanorm.layer_norm_backward(*a)
        calls["rms_norm " + key] = lambda a=(dy, x, rr, N, w): numbanorm.rms_norm_backward(*a)
        blocks[key] = common.n_chunks(M, N)
    src = rng.standard_normal(1 << 18, dtype=np.float32)  # 1 MiB, in cache: the threads' pace, no memory's
    dst = np.empty_like(src)
    calls["copy_threads"] = lambda: measure.parallel_copy(dst, src)
    calls["copy"] = lambda: np.copyto(dst, src)
    t = timed_rounds(calls, rounds, inner)
    pace = float(np.median(t.pop("copy_threads") / t.pop("copy")))
    del calls["copy_threads"], calls["copy"]
    faults = {}  # the page faults of a call, after the timed rounds (the allocator's state)
    for k, call in calls.items():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(inner):
            call()
        faults[k] = round((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / inner, 1)
    M, N = 8, 4096  # a one-block backward (n_chunks), over common.SERIAL_BELOW
    x = rng.standard_normal((M, N), dtype=np.float32)
    w = rng.uniform(0.5, 1.5, N).astype(np.float32)
    _, mean, rstd = numbanorm.layer_norm_forward(x, N, w)
    dx, parts = np.empty_like(x), [np.empty((1, N), np.float32) for _ in range(2)]
    args = (x, x, mean.reshape(M), rstd.reshape(M), w, None, dx, *parts, False)
    with background.synchronous():
        ln._backward.parallel(1, *args)
    one = timed_rounds({"calling_thread": lambda: ln._backward.rows(*args, 0, 1),
                        "pool": lambda: ln._backward.parallel(1, *args)}, rounds, inner)
    return {"rule": rule, "blocks": blocks, "us": {k: round(float(np.median(v)) * 1e6, 2) for k, v in t.items()},
            "page_faults": faults, "copy_threads_over_one": round(pace, 3),
            "one_block": {"shape": [M, N], "pool_over_calling_thread":
                          round(float(np.median(one["pool"] / one["calling_thread"])), 3)}}


def backward_blocks_spread(processes, rounds):
    """:func:`backward_blocks` for each of ``BLOCK_RULES`` in a process of its own (the
    allocator's state follows the sizes of a process's partials), the rules alternated
    ``processes`` times; ``over_code``: each call's time over the code's rule's in the
    neighbouring process, medians and ranges over the alternations."""
    runs = [[in_child(_child_code(f"backward_blocks({rounds}, {r!r})")) for r in BLOCK_RULES]
            for _ in range(processes)]
    code = BLOCK_RULES.index(common.BLOCK_ELEMENTS)
    over = {}
    for k in runs[0][0]["us"]:
        for i, r in enumerate(BLOCK_RULES):
            ratios = [run[i]["us"][k] / run[code]["us"][k] for run in runs]
            over.setdefault(k, {})[str(r)] = [round(float(np.median(ratios)), 3), round(min(ratios), 3),
                                              round(max(ratios), 3)]
    return {"rounds": rounds, "rules": [str(r) for r in BLOCK_RULES], "code_rule": common.BLOCK_ELEMENTS,
            "blocks": {str(r): runs[0][i]["blocks"] for i, r in enumerate(BLOCK_RULES)},
            "over_code": over, "processes": runs}


@numba.njit(parallel=True)
def _group_statistics(xg, mean, block):
    """The GroupNorm forward's statistics pass alone: ``stats.row_stats`` over every group
    (a row of ``xg``), in the kernel's blocks of groups on every thread."""
    zero = mean.dtype.type(0)
    for k in numba.prange(-(-xg.shape[0] // block)):
        for g in range(k * block, min(xg.shape[0], (k + 1) * block)):
            mu, corr, var = row_stats(xg, g, zero)
            mean[g] = mu + corr + var  # (kept, so that the pass is not optimized away)


def group_passes(rounds, inner=20, shape=(8, 64, 64, 64), groups=8):
    """A GroupNorm forward whose arrays stay in cache, in its parts: the public call into
    ``out=`` and allocating, the launcher alone, its statistics pass alone, beside PyTorch's
    call and the threaded copy of the same bytes; microseconds, medians over rounds, and
    each over the copy's time."""
    F = _torch_functional()
    rng = np.random.default_rng(6)
    x = rng.standard_normal(shape, dtype=np.float32)
    C = shape[1]
    w, b = rng.uniform(0.5, 1.5, C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    y = np.full_like(x, 1.0)
    x3, y3 = x.reshape(shape[0], C, -1), y.reshape(shape[0], C, -1)
    mean, rstd = np.empty((shape[0], groups), np.float32), np.empty((shape[0], groups), np.float32)
    xg = x.reshape(shape[0] * groups, -1)
    block = common.row_block(mean.size)
    tx, tw, tb = (measure.HostSide().to_torch(a) for a in (x, w, b))
    t = timed_rounds({
        "copy_threads": lambda: measure.parallel_copy(y, x),
        "call_out": lambda: numbanorm.group_norm(x, groups, w, b, out=y),
        "call_fresh": lambda: numbanorm.group_norm(x, groups, w, b),
        "launcher": lambda: gn.forward(x3, w, b, 1e-5, y3, mean, rstd),
        "statistics": lambda: _group_statistics(xg, mean.reshape(-1), block),
        "torch": lambda: F.group_norm(tx, groups, tw, tb),
    }, rounds, inner)
    med = {k: float(np.median(v)) for k, v in t.items()}
    return {"shape": list(shape), "groups": groups, "rounds": rounds, "inner": inner,
            "us": {k: round(v * 1e6, 1) for k, v in med.items()},
            "over_copy": {k: round(float(np.median(t[k] / t["copy_threads"])), 3) for k in t if k != "copy_threads"},
            "call_fresh_over_torch": round(float(np.median(t["call_fresh"] / t["torch"])), 3),
            "torch_threads": numba.get_num_threads()}


def channels_last(rounds, shapes=(((8, 256, 64, 64), 32), ((32, 256, 32, 32), 32), ((8, 64, 64, 64), 8),
                                  ((2, 512, 32, 32), 32))):
    """GroupNorm on torch.channels_last float32 tensors, forward (no grad) and backward (dx,
    dweight, dbias of sum(y * g)), through numbanorm.torch and torch.nn.functional, and
    numbanorm's forward into an ``out=`` in x's order (no fresh output), and the same by the
    in-cache path whatever the size (``out_in_cache_path``: the four rows of a step read
    interleaved, y by ordinary stores, as every size before the STREAMING variants of
    ``last_sums`` and ``last_write``); beside them both on the C-contiguous copy (the same
    values, dy C-contiguous too), the copy in C order and back that a call in that order adds
    (``copied``: what a channels-last call cost before its kernels), and the threaded copy of
    x's bytes; the backward's launcher into a ``dx`` whose pages are touched (``_mapped``: no
    fresh dx, whose first touch a public call pays as torch's does), in x's order and on the
    C-contiguous copy; milliseconds, medians over rounds, each over torch's channels-last time,
    the forwards into ``out=`` over the threaded copy of x's bytes and the mapped backwards over
    that of x's and dy's (the targets' backward floor) too, round-robin in one process, three calls
    a sample right after an untimed one of their own (``warm``: in a round each variant would find
    x where the one before it left the cache, and at the small shapes the same call took up to
    1.5x as long after another variant on other arrays as after one on its own)."""
    import torch

    import numbanorm.torch as nt
    F = _torch_functional()
    out = []
    for shape, groups in shapes:
        g = torch.Generator().manual_seed(7)
        xc = torch.randn(shape, generator=g)
        xl = xc.to(memory_format=torch.channels_last)
        w, b = torch.rand(shape[1], generator=g) + 0.5, torch.randn(shape[1], generator=g)
        dyl = torch.randn(shape, generator=g).to(memory_format=torch.channels_last)
        y = np.empty(xc.numel(), np.float32)
        flat = xc.numpy().reshape(-1)
        dyc = dyl.contiguous()
        xn, wn, bn = xl.numpy(), w.numpy(), b.numpy()
        yn = np.empty_like(xn)  # (in x's order: empty_like keeps it)
        _, mean, rstd = numbanorm.group_norm_forward(xn, groups, wn, bn)
        dw, db = np.empty_like(wn), np.empty_like(wn)
        mapped = {}  # the launcher's arguments, (N, C, S) views, dx of every page touched
        for name, xa, dya in (("", xn, dyl.numpy()), ("_contiguous", xc.numpy(), dyc.numpy())):
            x3, dy3, dx3 = (a.reshape(shape[0], shape[1], -1) for a in (xa, dya, np.full_like(xa, 1.0)))
            assert np.shares_memory(x3, xa) and gn.last(x3) == (name == "")  # views, in the order meant
            mapped[name] = (dy3, x3, mean, rstd, wn, dx3, dw, db)
        dy_flat = dyc.numpy().reshape(-1)
        graphs = {}
        for name, f, x, dy in (("numbanorm", nt.group_norm, xl, dyl), ("torch", F.group_norm, xl, dyl),
                               ("numbanorm_contiguous", nt.group_norm, xc, dyc),
                               ("torch_contiguous", F.group_norm, xc, dyc)):
            xg, wg, bg = (a.detach().clone().requires_grad_() for a in (x, w, b))
            graphs[name] = (f(xg, groups, wg, bg), (xg, wg, bg), dy)

        def back(name):
            yg, inputs, dy = graphs[name]
            return lambda: torch.autograd.grad(yg, inputs, dy, retain_graph=True)

        t = timed_rounds({
            "copy_threads": lambda: measure.parallel_copy(y, flat),
            "forward_numbanorm": lambda: nt.group_norm(xl, groups, w, b),
            "forward_numbanorm_out": lambda: numbanorm.group_norm(xn, groups, wn, bn, out=yn),
            "forward_numbanorm_out_in_cache_path": lambda: _in_cache_path(
                numbanorm.group_norm, xn, groups, wn, bn, out=yn),
            "forward_torch": lambda: F.group_norm(xl, groups, w, b),
            "forward_copied": lambda: nt.group_norm(xl.contiguous(), groups, w, b).to(
                memory_format=torch.channels_last),
            "forward_numbanorm_contiguous": lambda: nt.group_norm(xc, groups, w, b),
            "forward_torch_contiguous": lambda: F.group_norm(xc, groups, w, b),
            **{f"backward_{k}": back(k) for k in graphs},
            "copy_threads_dy": lambda: measure.parallel_copy(y, dy_flat),  # (y: scratch, as for x's)
            "backward_numbanorm_mapped": lambda: gn.backward(*mapped[""]),
            "backward_numbanorm_contiguous_mapped": lambda: gn.backward(*mapped["_contiguous"]),
        }, rounds, inner=3, warm=True)
        copies = t["copy_threads"] + t["copy_threads_dy"]  # x's and dy's bytes, each round
        med = {k: float(np.median(v)) for k, v in t.items()}
        out.append({"shape": list(shape), "groups": groups, "dtype": "float32",
                    "ms": {k: significant(v * 1e3) for k, v in med.items()},
                    "over_torch": {k: significant(np.median(t[k] / t[f"{k.split('_')[0]}_torch"]))
                                   for k in t if k.split("_")[0] in ("forward", "backward")},
                    "over_copy": {**{k: significant(np.median(t[k] / t["copy_threads"]))
                                     for k in t if k.startswith("forward_numbanorm_out")},
                                  **{k: significant(np.median(t[k] / copies))
                                     for k in t if k.endswith("_mapped")}},
                    "far": bool(memory.should_stream(xn))})
    return {"rounds": rounds, "torch_threads": numba.get_num_threads(),
            "stream_min_bytes": memory.STREAM_MIN_BYTES, "cases": out}


def channels_last_spread(processes, rounds, shapes=None):
    """:func:`channels_last` (its ``shapes`` where given) in ``processes`` fresh processes, on
    this one's thread count: on this VM one run's ratios at the small shapes moved by up to
    1.8x between runs minutes apart.  Each case's ``ms``, ``over_torch`` and ``over_copy`` are
    the medians over the processes, ``spread[field]`` their [min, max]; ``processes``: every
    run whole."""
    call = f"channels_last({rounds})" if shapes is None else f"channels_last({rounds}, {shapes!r})"
    runs = [in_child(_child_code(call)) for _ in range(processes)]
    cases = []
    for i, case in enumerate(runs[0]["cases"]):
        every = [run["cases"][i] for run in runs]
        merged = dict(case, spread={})
        for field in ("ms", "over_torch", "over_copy"):
            merged[field] = {k: significant(np.median([c[field][k] for c in every])) for k in case[field]}
            if field != "ms":
                merged["spread"][field] = {k: [min(c[field][k] for c in every), max(c[field][k] for c in every)]
                                           for k in case[field]}
        cases.append(merged)
    return dict(runs[0], cases=cases, processes=runs)


def _in_cache_path(f, *args, **kwargs):
    """``f(*args, **kwargs)``, a GroupNorm, with no output streamed and no input taken as too
    large for the cache (memory.STREAM_MIN_BYTES out of reach: its launcher reads it at each
    call, a plan's call too)."""
    saved = memory.STREAM_MIN_BYTES
    memory.STREAM_MIN_BYTES = 1 << 62
    try:
        return f(*args, **kwargs)
    finally:
        memory.STREAM_MIN_BYTES = saved


PROBES = {
    "streaming": lambda q: streaming(30 // q, 60 // q),
    "backward_streaming": lambda q: backward_streaming(20 // q),
    "small_calls": lambda q: small_calls(15 // q, 200),
    "widen": lambda q: widen(15 // q, 200),
    "threading": lambda q: threading(15 // q, 200),
    "row_costs": lambda q: row_costs(15 // q),
    "row_costs_spread": None,  # (main: its --processes and --baseline)
    "vector_width": lambda q: vector_width(31 // q),
    "torch_small_calls": lambda q: torch_small_calls(15 // q, 100),
    "in_cache_spread": lambda q: in_cache_spread(24 // q, 25 // q),
    "row_groups": lambda q: row_groups(15 // q),
    "fresh_output": lambda q: fresh_output(15 // q),
    "group_passes": lambda q: group_passes(31 // q),
    "channels_last": None,  # (main: its --processes)
    "fresh_dx": None,  # (main: its --processes)
    "backward_blocks": None,  # (main: its --processes)
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few rounds (a smoke run, not for the book)")
    p.add_argument("--threads", type=int, default=min(2, numba.config.NUMBA_NUM_THREADS))
    p.add_argument("--note", default="")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--only", default=",".join(PROBES), help="comma-separated probes (default: all)")
    p.add_argument("--baseline", help="row_costs_spread: another checkout (a git worktree) whose numbanorm "
                                      "runs alternated with this one's, for a change's before and after")
    p.add_argument("--processes", type=int, default=8,
                   help="row_costs_spread: processes a side (8); fresh_dx, backward_blocks, channels_last: processes")
    a = p.parse_args(argv)
    PROBES["row_costs_spread"] = lambda q: row_costs_spread(max(1, a.processes // q), 15 // q, a.baseline)
    PROBES["fresh_dx"] = lambda q: fresh_dx_spread(max(1, a.processes // q), 20 // q)
    PROBES["backward_blocks"] = lambda q: backward_blocks_spread(max(1, a.processes // q), 15 // q)
    PROBES["channels_last"] = lambda q: channels_last_spread(max(1, a.processes // q), 31 // q)
    numba.set_num_threads(a.threads)
    q = 4 if a.quick else 1
    load_before = list(os.getloadavg())
    t0 = time.perf_counter()
    result = {name: PROBES[name](q) for name in a.only.split(",")}
    note = a.note or ("load average before/after in the meta; ratios of variants timed "
                      "round-robin in one process")
    result["meta"] = metadata(a.threads, note=note, load_before=load_before,
                              load_after=list(os.getloadavg()),
                              timing={"wall_s": round(time.perf_counter() - t0, 1)})
    result["meta"]["command"] = " ".join(["python", "-m", "benchmarks.design_probes", *sys.argv[1:]])
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
