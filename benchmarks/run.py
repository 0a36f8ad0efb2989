"""Run the benchmark sweep and write ``benchmarks/results/<stem>.{json,csv}`` (and plots).

    python -m benchmarks.run                       # the full CPU sweep (float32, float64)
    python -m benchmarks.run --targets             # only the cases of the speed targets + summary,
                                                   # into results/targets-<cpu kind>.json (xeon, epyc)
    python -m benchmarks.run --half                # float16/bfloat16 (and float32) large shapes
    python -m benchmarks.run --small               # rows 1, 8, 64 at hidden 768, 4096, every dtype
    python -m benchmarks.run --norm layer_norm --dtype float32 --hidden 4096 --merge
                                                   # re-run a subset into the existing file
    python -m benchmarks.run --device gpu          # float16/bfloat16/float32 on a CUDA GPU
    python -m benchmarks.run --list                # print the cases and exit

Run from the repository root.  Threads default to every core numba sees, the same
count for numba and torch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import harness, measure, targets


def _ints(s):
    return tuple(int(v) for v in s.split(","))


def _strs(s):
    return tuple(v.strip() for v in s.split(",") if v.strip())


def parser():
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--targets", action="store_true", help="only the cases of the speed targets (float32, cpu)")
    ap.add_argument("--half", action="store_true", help="the 16-bit sweep (results stem cpu-half)")
    ap.add_argument("--small", action="store_true", help="the small-call sweep (results stem cpu-small)")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--norm", type=_strs, help=f"comma-separated, of {','.join(harness.ALL_NORMS)}")
    ap.add_argument("--dtype", type=_strs, help="comma-separated (default float32,float64 on cpu; "
                                                "float16,bfloat16,float32 on gpu)")
    ap.add_argument("--rows", type=_ints, default=harness.ROWS, help="layer/rms norm rows, comma-separated")
    ap.add_argument("--hidden", type=_ints, default=harness.HIDDEN, help="layer/rms norm hidden sizes")
    ap.add_argument("--direction", type=_strs, default=measure.DIRECTIONS, help="forward,backward")
    ap.add_argument("--threads", type=int, help="threads for numba and torch (default: all)")
    ap.add_argument("--impl", type=_strs, help="registry implementations (default: all that run on --device)")
    ap.add_argument("--peers", type=_strs, default=measure.PEERS, help="of torch,floor,oracle")
    ap.add_argument("--budget", type=float, default=0.5,
                    help="seconds of timed rounds per case (default 0.5; at least 3 rounds, "
                         "at least --min-repeats unless a case passes 5x the budget)")
    ap.add_argument("--min-repeats", type=int, default=5)
    ap.add_argument("--max-repeats", type=int, default=50)
    ap.add_argument("--mem-gib", type=float, help="skip cases whose buffers exceed this (default: half the memory)")
    ap.add_argument("--no-cold-start", action="store_true", help="skip the fresh-process first-call measurements")
    ap.add_argument("--no-compile-times", action="store_true", help="skip compiling from an empty cache")
    ap.add_argument("--cold-python", help="interpreter of the cold-start processes (default: this one), e.g. "
                                          "a venv of numbanorm's dependencies alone: with SciPy installed, "
                                          "numba imports it on its first compile")
    ap.add_argument("--out", help="result file stem under benchmarks/results (default: cpu, gpu or "
                                       "targets-<cpu kind>)")
    ap.add_argument("--merge", action="store_true", help="replace the re-run cases in an existing <stem> file")
    ap.add_argument("--dir", default=str(harness.RESULTS), help="results folder (default benchmarks/results)")
    ap.add_argument("--note", default="", help="a note stored in the metadata (e.g. 'shared machine, noisy')")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    return ap


def targets_stem():
    """``targets-<cpu kind>``: one targets file per CPU kind, side by side in the README."""
    return f"targets-{harness.cpu_kind()}"


def main(argv=None):
    ap = parser()
    a = ap.parse_args(argv)
    if a.targets:
        cases, skipped = targets.target_cases(), []
        stem = a.out or targets_stem()
    elif a.half or a.small:
        cases, skipped = (harness.half_cases(a.device) if a.half else []) + (
            harness.small_cases(a.device) if a.small else []), []
        stem = a.out or f"{a.device}-{'half' if a.half else 'small'}{'-small' if a.half and a.small else ''}"
    else:
        dtypes = a.dtype or (harness.CPU_DTYPES if a.device == "cpu" else harness.GPU_DTYPES)
        if a.device == "gpu" and "bfloat16" in dtypes and not isinstance(measure.side_for("gpu"),
                                                                         measure.TorchCudaSide):
            print("bfloat16 skipped: GPU arrays of it need a CUDA build of torch", file=sys.stderr)
            dtypes = tuple(d for d in dtypes if d != "bfloat16")
        limit = None if a.mem_gib is None else int(a.mem_gib * 2**30)
        try:
            cases, skipped = harness.sweep_cases(a.norm or harness.ALL_NORMS, dtypes, a.rows, a.hidden,
                                                 a.direction, a.device, limit)
        except ValueError as e:
            ap.error(str(e))
        stem = a.out or a.device
    if a.list:
        for c in cases:
            print(f"{c.label}   ({harness.BUFFERS[c.direction] * c.nbytes / 2**30:.2f} GiB of buffers)")
        for c in skipped:
            print(f"skipped (memory): {c.label}")
        return 0
    if not cases:
        ap.error("no case selected")
    try:
        threads = measure.set_threads(a.threads)
    except ValueError as e:
        ap.error(str(e))
    cold = a.device == "cpu" and not (a.no_cold_start or a.half or a.small)
    if cold:  # (they run last: an interpreter that cannot run them would lose the whole run)
        from . import cold_start

        if lacks := cold_start.python_lacks(a.cold_python):
            ap.error(lacks)
    timing = {"budget_s": a.budget, "min_repeats": a.min_repeats, "max_repeats": a.max_repeats}
    t0 = time.perf_counter()
    print(f"{len(cases)} cases on {a.device}, {threads} thread(s); {len(skipped)} skipped for memory",
          file=sys.stderr)
    res = harness.run(cases, threads, a.impl, a.peers, a.note, skipped,
                      cold=cold,
                      compile_times=not a.no_compile_times, show_progress=not a.no_progress,
                      cold_python=a.cold_python, draws=targets.draws if a.targets else None,
                      drawn_timing=targets.DRAWN_TIMING, **timing)
    if a.targets and measure.torch_or_none() is not None:  # numbanorm.torch's cost per call
        from . import torch_calls

        res["rows"] += torch_calls.rows(threads, shapes=targets.TORCH_CALLS, **timing)
    res["meta"]["wall_s"] = round(time.perf_counter() - t0, 1)
    if a.merge:
        path = Path(a.dir) / f"{stem}.json"
        if path.exists():
            res = harness.merge(harness.load_results(path), res)
    jpath, cpath = harness.write_results(res, stem, a.dir)
    print(f"wrote {jpath} and {cpath} ({res['meta']['wall_s']} s)")
    if not a.no_plot:
        try:
            from . import plot
        except ImportError as e:  # matplotlib missing
            print(f"no plots: {e}")
        else:
            for p in plot.plot_results(res, stem, a.dir):
                print(f"wrote {p}")
    if any(targets._find(res["rows"], t) for t in targets.TARGETS):
        print(targets.summary(res))
    print(f"README table: python -m benchmarks.readme_table {jpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
