"""Where streaming stores start to pay: forward into ``out=`` over output sizes around the cache.

    python -m benchmarks.streaming                    # 1/8 to 8x the last-level cache the code reads
    python -m benchmarks.streaming --lo 1/128 --hi 8  # from further down (a VM's shared L3)
    python -m benchmarks.streaming --then-read        # also with y read once right after each call
    python -m benchmarks.streaming --backward --then-read  # the backward's dx instead of y

writes ``benchmarks/results/stream-sweep-<cpu>.json``, with ``--backward``
``benchmarks/results/backward-stream-sweep-<cpu>.json`` (``--out`` names another file).

For each output size (a fraction of the last-level cache ``memory`` reads, float32) and
each of LayerNorm and RMSNorm (rows of 4096) and GroupNorm ((n, 64, 64, 64), 8 groups),
the public forward into a preallocated ``out=`` is timed with every output written by
streaming stores, then by ordinary stores (``memory.STREAM_MIN_BYTES`` set to 0, then
past any size), round-robin against ``np.copyto`` of the same array and the same copy on
every numba thread.  A ratio is the median over rounds of the round's own ratio, so a
slow moment of a shared machine slows both sides alike.  The threshold this CPU wants is
the smallest size from which streaming is faster than ordinary stores for every norm at
every larger size (:func:`crossover`), as a fraction of the cache read.

``--backward`` times the public backward instead (a fresh dx each call, as every caller
gets it; the launchers stream dx by the same threshold), against ``np.copyto`` of x and
dy into two buffers, and with ``--then-read`` followed by a read of dx, the previous
layer's backward reading it as its dy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

import numbanorm
from numbanorm import machine, measure
from numbanorm.cpu import _backend
from numbanorm.cpu._kernels import memory
from numbanorm.operations import BY_NAME

from .design_probes import _read_rows, timed_rounds
from .harness import RESULTS, cpu_kind, metadata
from .measure import parallel_copy

NORMS = ("layer_norm", "rms_norm", "group_norm")
HIDDEN = 4096                      # row length of LayerNorm and RMSNorm
CONV = (64, 64, 64)                # GroupNorm's (C, H, W) per sample: 1 MiB of float32
GROUPS = 8
VARIANTS = ("copy", "copy_threads", "ordinary", "streaming")


def sizes(llc, lo=Fraction(1, 8), hi=Fraction(8)):
    """Output sizes in bytes from ``lo`` to ``hi`` times ``llc``: powers of two of it and
    the midpoints 1.5x between them, each a whole number of MiB (a GroupNorm sample)."""
    out = []
    f = Fraction(2) ** math.floor(math.log2(lo))
    while f <= hi:
        for g in (f, f * Fraction(3, 2)):
            mib = round(llc * g / 2**20)
            if lo <= g <= hi and mib >= 1 and mib << 20 not in out:
                out.append(mib << 20)
        f *= 2
    return out


def shape_of(norm, nbytes):
    """The float32 input of ``nbytes`` (whole rows, or whole samples) for ``norm``."""
    if norm == "group_norm":
        return (max(1, nbytes // (4 * math.prod(CONV))),) + CONV
    return max(1, nbytes // (4 * HIDDEN)), HIDDEN


def _call(norm, x, w, b, y):
    if norm == "group_norm":
        return numbanorm.group_norm(x, GROUPS, w, b, out=y)
    return getattr(numbanorm, norm)(x, (HIDDEN,), w, *([b] if norm == "layer_norm" else []), out=y)


def _backward_call(norm, x, dy, w):
    """``f() -> dx``: the public backward of ``norm`` on ``x`` and ``dy`` with weight ``w``
    and the forward's statistics, called by the table of operations, allocating its dx as
    every caller's does."""
    op = BY_NAME[norm]
    values = {"x": x, op.shape_role: GROUPS if norm == "group_norm" else HIDDEN, "weight": w, "dy": dy}
    values.update(zip(op.forward_outputs, op.call(numbanorm, "forward", values)))
    return lambda: op.call(numbanorm, "backward", values)[0]


def _stores(stream):
    """Every ``out=`` from now on written with streaming stores (True) or ordinary ones.  A
    CPU plan keeps the choice it learned (``memory.should_stream``, asked once), so the
    plans are forgotten when the choice changes: without that, every forward after the
    first variant's replayed its stores (LayerNorm's and RMSNorm's compared ordinary
    stores with ordinary stores)."""
    want = 0 if stream else 1 << 62
    if memory.STREAM_MIN_BYTES != want:
        memory.STREAM_MIN_BYTES = want
        _backend.plans._plans.clear()


def case(norm, nbytes, rounds, then_read=False, budget_s=0.02, rng=None, backward=False):
    """One norm at one size: ``{ratio: {variant: median over rounds of t / t(copy)},
    streaming_over_ordinary, ...}``; ``backward``: its backward's dx instead of its y."""
    rng = rng or np.random.default_rng(0)
    shape = shape_of(norm, nbytes)
    x = rng.standard_normal(shape, dtype=np.float32)
    c = shape[1] if norm == "group_norm" else HIDDEN
    w, b = rng.uniform(0.5, 1.5, c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    dst = np.full_like(x, 1.0)  # mapped: every page touched once (as y and dst2)
    sums = np.empty(x.size // shape[-1], np.float32)
    if backward:
        dy, dst2 = rng.standard_normal(shape, dtype=np.float32), np.full_like(x, 1.0)
        grad = _backward_call(norm, x, dy, w)
    else:
        y = np.full_like(x, 1.0)

    def run(stream, read=False):
        def f():
            _stores(stream)
            out = grad() if backward else _call(norm, x, w, b, y)
            if read:  # the next layer's reads of its output
                _read_rows(out.reshape(-1, shape[-1]), sums)
        return f

    if backward:  # the backward's floor: x and dy each copied once
        variants = {"copy": lambda: (np.copyto(dst, x), np.copyto(dst2, dy)),
                    "copy_threads": lambda: (parallel_copy(dst, x), parallel_copy(dst2, dy))}
    else:
        variants = {"copy": lambda: np.copyto(dst, x), "copy_threads": lambda: parallel_copy(dst, x)}
    variants.update(ordinary=run(False), streaming=run(True))
    if then_read:
        variants.update(ordinary_then_read=run(False, True), streaming_then_read=run(True, True))
    saved = memory.STREAM_MIN_BYTES
    try:
        one = timed_rounds({"copy": variants["copy"]}, 1)["copy"][0]
        inner = max(1, math.ceil(budget_s / max(one, 1e-7)))  # rounds of at least budget_s each
        t = timed_rounds(variants, rounds, inner)
    finally:
        memory.STREAM_MIN_BYTES = saved
        _backend.plans._plans.clear()
    return {"norm": norm, "direction": "backward" if backward else "forward", "shape": list(shape),
            "mib": x.nbytes / 2**20,
            "ratio_to_copy": {k: round(float(np.median(t[k] / t["copy"])), 3) for k in t if k != "copy"},
            "streaming_over_ordinary": round(float(np.median(t["streaming"] / t["ordinary"])), 3),
            **({"streaming_over_ordinary_then_read": round(float(np.median(
                t["streaming_then_read"] / t["ordinary_then_read"])), 3)} if then_read else {}),
            "copy_ms": round(float(np.median(t["copy"])) * 1e3, 3), "rounds": rounds, "inner": inner}


def crossover(cases, key="streaming_over_ordinary"):
    """The smallest size (bytes) from which streaming beats ordinary stores (``key``: the
    ratio compared, with or without y's next reader) for every norm at every size measured
    from there up; None where it never does at the largest."""
    by_size = {}
    for c in cases:
        by_size.setdefault(round(c["mib"] * 2**20), []).append(c[key] < 1)
    best = None
    for size in sorted(by_size, reverse=True):
        if not all(by_size[size]):
            break
        best = size
    return best


def _fraction(s):
    return Fraction(s)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.streaming", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--lo", type=_fraction, default=Fraction(1, 8), help="smallest size, times the cache (1/8)")
    ap.add_argument("--hi", type=_fraction, default=Fraction(8), help="largest size, times the cache (8)")
    ap.add_argument("--norm", default=",".join(NORMS), help=f"comma-separated, of {','.join(NORMS)}")
    ap.add_argument("--rounds", type=int, default=9, help="round-robin rounds per case (9)")
    ap.add_argument("--then-read", action="store_true",
                    help="also time each store kind followed by a read of its output")
    ap.add_argument("--backward", action="store_true", help="the backward's dx instead of the forward's y")
    ap.add_argument("--threads", type=int, help="numba threads (default: all)")
    ap.add_argument("--mem-gib", type=float,
                    help="skip sizes whose arrays (3, backward 5) exceed this (default: half the memory)")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", help="results file (default benchmarks/results/stream-sweep-<cpu>.json)")
    a = ap.parse_args(argv)
    threads = measure.set_threads(a.threads)
    llc = memory.CACHE_BYTES
    limit = int(a.mem_gib * 2**30) if a.mem_gib else (machine.mem_total_bytes() or 8 << 30) // 2
    arrays = 5 if a.backward else 3  # x, dy, dx and the copies' two buffers; x, y and the copy's
    todo = [s for s in sizes(llc, a.lo, a.hi) if arrays * s <= limit]
    load_before = list(os.getloadavg())
    t0 = time.perf_counter()
    cases = []
    for s in todo:
        for norm in a.norm.split(","):
            c = case(norm, s, a.rounds, a.then_read, backward=a.backward)
            c["of_cache"] = round(s / llc, 4)
            cases.append(c)
            r = c["ratio_to_copy"]
            print(f"{norm:<10} {c['mib']:>8.1f} MiB ({c['of_cache']:.3g} of the cache): ordinary "
                  f"{r['ordinary']:.2f}x, streaming {r['streaming']:.2f}x np.copyto; streaming/ordinary "
                  f"{c['streaming_over_ordinary']:.2f}", file=sys.stderr, flush=True)
    first = crossover(cases)
    res = {"cache_bytes": llc, "last_level_cache_bytes": memory.LAST_LEVEL_CACHE, "cache_cpus": memory.CACHE_CPUS,
           "stream_min_bytes": memory.STREAM_MIN_BYTES,
           "stream_fraction": str(memory.STREAM_FRACTION),
           "skipped_for_memory_mib": [s >> 20 for s in sizes(llc, a.lo, a.hi) if s not in todo],
           "crossover_bytes": first, "crossover_of_cache": None if first is None else round(first / llc, 4),
           "cases": cases}
    if a.then_read:
        read = crossover(cases, "streaming_over_ordinary_then_read")
        res.update(crossover_then_read_bytes=read,
                   crossover_then_read_of_cache=None if read is None else round(read / llc, 4))
    res["meta"] = metadata(threads, note=a.note, load_before=load_before, load_after=list(os.getloadavg()),
                           timing={"wall_s": round(time.perf_counter() - t0, 1), "rounds": a.rounds})
    res["meta"]["command"] = " ".join(["python", "-m", "benchmarks.streaming", *sys.argv[1:]])
    path = Path(a.out) if a.out else RESULTS / f"{'backward-' if a.backward else ''}stream-sweep-{cpu_kind()}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    then = f", {res['crossover_then_read_of_cache']} with its output read next" if a.then_read else ""
    print(f"streaming wins from {first and first / 2**20} MiB "
          f"({res['crossover_of_cache']} of the {llc / 2**20:.1f} MiB of cache counted on{then}); "
          f"the code streams from {memory.STREAM_MIN_BYTES / 2**20:.1f} MiB; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
