"""The ``numbanorm`` command (also ``python -m numbanorm``).

    numbanorm            check, then a quick bench (the README's main job)
    numbanorm info       versions, threads, which implementations (CPU, GPU) can run here
    numbanorm check      every operation (numbanorm.operations), forward and backward, on
                         every usable implementation against the NumPy oracle; exit code 1
                         on a failure
    numbanorm bench      a quick sweep of representative shapes: time, GB/s, and the
                         ratios to the bandwidth floor and to PyTorch (when installed)
    numbanorm compile    compile every CPU operation, forward and backward, into numba's
                         on-disk cache (for an image or a CI job: later processes load them)

The timing lives in ``numbanorm.measure`` and the description of the machine in
``numbanorm.machine``; the full benchmark suite in the repository's ``benchmarks/``
folder builds on both.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

DTYPES = ("float16", "float32", "float64")  # what check runs unless --dtype says otherwise
# what --dtype offers: bfloat16 arrays on the host are ml_dtypes.bfloat16 (an optional package)
DTYPE_CHOICES = ("float16", "bfloat16", "float32", "float64")


# ------------------------------------------------------------------ info


# Optional packages a bug report should name: the GPU path, the integrations, bfloat16.
INFO_OPTIONAL = ("numba-cuda", "cuda-bindings", "ml_dtypes", "torch", "dask", "distributed")
# The vector features the CPU kernels' speed depends on: F16C converts float16 to and from
# float32 in vector registers; AVX2 and AVX-512 set how many floats one instruction handles.
INFO_X86_FEATURES = (("F16C", "f16c"), ("FMA", "fma"), ("AVX2", "avx2"), ("AVX-512", "avx512f"),
                     ("AVX-512 BW", "avx512bw"), ("AVX-512 FP16", "avx512fp16"))
INFO_ARM_FEATURES = (("NEON", "neon"), ("FP16", "fullfp16"), ("SVE", "sve"), ("BF16", "bf16"))


def info(out=None):
    """What a bug report needs: versions, threads, the kernel cache, the CPU target, the GPU."""
    import platform

    import numba

    from . import __file__ as pkg_file, __version__, machine, registry

    p = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    p(f"numbanorm      {__version__} ({os.path.dirname(pkg_file)})")
    p(f"python         {platform.python_version()} {platform.python_implementation()} ({sys.executable})")
    p(f"platform       {platform.platform()}")
    p(f"numba          {numba.__version__}, llvmlite {_info_version('llvmlite')}, numpy {np.__version__}")
    have = {n: _info_version(n) for n in INFO_OPTIONAL}
    p("optional       " + ", ".join(f"{n} {v or 'not installed'}" for n, v in have.items()))
    m = machine.machine_info(include_gpu=False)
    p(f"cpu            {m['cpu']}, {m['cores']} logical CPUs ({_info_usable_cpus()} usable here), "
      + (f"{m['mem_gib']} GiB" if m["mem_gib"] is not None else "memory not read from the OS"))
    p(f"cpu target     {_info_cpu_target()}")
    p(f"streaming      {_info_streaming()}")
    in_use, layers = _info_threading()  # first: numba.get_num_threads() raises without a layer
    threads = numba.get_num_threads() if in_use.endswith(" in use") else "none"
    p(f"threads        {threads} (numba.get_num_threads(); NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS})")
    p(f"threading      {in_use} (NUMBA_THREADING_LAYER={numba.config.THREADING_LAYER}); "
      + "; ".join(f"{name}: {state}" for name, state in layers))
    p(f"kernel cache   {_info_cache()}")
    p("implementations (numbanorm.registry):")
    for name in registry.IMPLEMENTATIONS:
        ok, why = registry.usable(name)
        if not ok:
            why = "see gpu below" if name == "cuda" else (why.splitlines() or ["?"])[0][:160]
        p(f"  {name:<8} {'usable' if ok else 'not usable: ' + why}")
    p(f"gpu            {_info_gpu()}")
    return 0


def _info_version(dist):
    """The installed version of a distribution, without importing it (torch takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _info_usable_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        return os.cpu_count()


def _info_cpu_target():
    """The CPU numba compiles for and its vector features, as numba's code generator sees them
    (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES override the host's, e.g. for portable caches)."""
    import llvmlite.binding as ll
    from numba.core import config

    # (the kernels' own choices beside the features: a VM may hide features its CPU has)
    from .cpu._kernels.halves import BFLOAT16_BY_INSTRUCTION, WIDE_HALVES, compiled_features

    name = config.CPU_NAME or ll.get_host_cpu_name()
    on = {f[1:] for f in compiled_features().split(",") if f.startswith("+")}
    known = INFO_ARM_FEATURES if {"neon", "fullfp16", "sve"} & on else INFO_X86_FEATURES
    where = "NUMBA_CPU_NAME/NUMBA_CPU_FEATURES" if config.CPU_NAME or config.CPU_FEATURES else "this host"
    if config.CPU_FEATURES is None and not config.ENABLE_AVX:
        where += ", AVX off: NUMBA_ENABLE_AVX=0 or this CPU's name"
    return (f"{name} ({where}): " + ", ".join(f"{label} {'yes' if key in on else 'no'}" for label, key in known)
            + f"; 16-bit rows 512 bits wide {'yes' if WIDE_HALVES else 'no'}"
            + f"; bfloat16 narrowed by {'vcvtneps2bf16' if BFLOAT16_BY_INSTRUCTION else 'integer code'}")


def _info_streaming():
    """From which output size the forward kernels write with streaming stores, and why there."""
    from .cpu._kernels import memory as m

    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    levels = {level for level, _, _ in m._data_caches(m._SYSFS_CACHE)}  # (none: the defaults)
    guessed = " (none read from the OS: a default)"
    return (f"outputs of {mib(m.STREAM_MIN_BYTES)} or more ({m.STREAM_FRACTION} x the {mib(m.CACHE_BYTES)} of "
            f"cache counted on: a {mib(m.LAST_LEVEL_CACHE)} last-level cache{'' if levels else guessed}, "
            f"{m.CACHE_CPUS} usable CPU(s) sharing it, at most {mib(m.CACHE_PER_CPU)} each); streamed rows in "
            f"groups where x, weight and bias take more than the {m.L1_DATA_BYTES // 1024} KiB L1 data cache"
            + ("" if 1 in levels else guessed))


def _info_threading():
    """(layer in use or why none, [(layer, 'available' or why not)]) -- numba's own checks."""
    import importlib

    import numba

    layers = []
    for name, module in (("tbb", "tbbpool"), ("omp", "omppool"), ("workqueue", "workqueue")):
        try:
            mod = importlib.import_module(f"numba.np.ufunc.{module}")
            if name == "tbb":  # numba refuses a TBB older than it was built for
                from numba.np.ufunc.parallel import _check_tbb_version_compatible

                _check_tbb_version_compatible()
            vendor = getattr(mod, "openmp_vendor", None)
            layers.append((name, f"available ({vendor})" if vendor else "available"))
        except Exception as e:  # a missing libtbb/libgomp: numba then picks another layer
            layers.append((name, f"not available ({type(e).__name__}: {str(e).splitlines()[0][:100]})"))
    try:
        from numba.np.ufunc.parallel import _launch_threads

        _launch_threads()  # what the first parallel kernel would do: pick and start the layer
        in_use = f"{numba.threading_layer()} in use"
    except Exception as e:  # e.g. NUMBA_THREADING_LAYER names a layer that is not available
        in_use = f"none could start ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    return in_use, layers


def _info_cache():
    """Where numba keeps the CPU kernels' compiled code (cache=True) and whether it can write there."""
    import importlib
    import pkgutil

    try:
        kernels = importlib.import_module("numbanorm.cpu._kernels")
        for mod_info in pkgutil.iter_modules(kernels.__path__):
            mod = importlib.import_module(f"{kernels.__name__}.{mod_info.name}")
            for obj in vars(mod).values():
                cache = getattr(obj, "_cache", None)
                if getattr(cache, "cache_path", None):
                    break
            else:
                continue
            break
        else:
            return "none: the kernels are compiled in memory in every process"
    except Exception as e:
        return f"unknown: the CPU kernels cannot be imported ({type(e).__name__}: {e})"
    locator = cache._impl.locator
    try:
        locator.ensure_cache_path()  # numba's own test: make the folder, write a temporary file
        state = "writable"
    except OSError as e:
        state = f"NOT writable ({type(e).__name__}: {e}): every process compiles the kernels again"
    how = type(locator).__name__.lstrip("_").replace("CacheLocator", "")
    override = os.environ.get("NUMBA_CACHE_DIR")
    if override and how != "UserProvided":  # numba skips a NUMBA_CACHE_DIR it cannot write to
        how += f"; NUMBA_CACHE_DIR={override} is not usable, numba fell back to this"
    else:
        how += f"; NUMBA_CACHE_DIR={override or 'unset'}"
    return f"{cache.cache_path} ({how}), {state}"


def _info_gpu():
    """Whether the GPU kernels run, on what: a GPU, numba's simulator, or why not."""
    from . import machine

    ok, desc = machine.gpu_status()
    if ok:
        return f"in use: {desc}"
    sim = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    return f"not in use: {desc.splitlines()[0][:200]}" + ("" if sim else " (NUMBA_ENABLE_CUDASIM unset)")


# ------------------------------------------------------------------ check


# The embedded inputs of ``check``, by layout: odd sizes (no multiple of a vector
# width); for group norm a spatial size that is not a power of two, one group per
# channel (instance norm), and one large enough for the parallel kernel (the others
# run serially: common.SERIAL_BELOW elements).
CHECK_SHAPES = {"rows": [((48, 769), None)],
                "groups": [((4, 32, 5, 7), 8), ((3, 12, 4, 5), 12), ((4, 32, 16, 17), 8)]}


def check_cases(dtype):
    """``[(operation, host inputs)]``: every operation of the table on each shape of its layout."""
    from .operations import OPERATIONS

    rng = np.random.default_rng(2024)
    return [(op, op.inputs(rng, shape, dtype, groups))
            for op in OPERATIONS for shape, groups in CHECK_SHAPES[op.layout]]


def check(impls=None, dtypes=DTYPES, out=None):
    """Every operation, forward and backward, of every usable implementation against the oracle.

    0 if all pass, else 1.
    """
    from . import machine, registry
    from .cpu._kernels import background

    p = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    oracle = registry.get("oracle")
    names = registry.available(include_oracle=False)
    if impls:
        if code := _impls_status(impls, p):
            return code
        names = [n for n in names if n in impls]
    if "cuda" in names and machine.cuda_simulated():
        p("note: 'cuda' runs in numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    p("numbanorm check: every operation against the NumPy oracle (numbanorm.reference), "
      "error relative to max(1, max |oracle|)")
    head = f"{'impl':<6} {'operation':<15} {'direction':<9} {'dtype':<8} {'shape':<15} {'worst':<8} {'rel. error':>10} {'tol':>8}  result"
    p(head)
    p("-" * len(head))
    with background.synchronous():  # the parallel kernels, compiled here, not their serial stand-ins
        total, failures = _check_all(names, dtypes, oracle, p)
    p(f"{total - failures} of {total} checks passed" + (f", {failures} FAILED" if failures else ""))
    return 1 if failures else 0


def _check_all(names, dtypes, oracle, p):
    """``check``'s rows, printed by ``p``: ``(checks, failures)``."""
    from . import registry
    from .operations import compare, tolerance

    total = failures = 0
    for name in names:
        impl = registry.get(name)
        for dtype in dtypes:
            tol = tolerance(dtype)
            for op, values in check_cases(dtype):
                shape = "x".join(map(str, values["x"].shape))
                if op.layout == "groups":
                    shape += f" G={values['num_groups']}"
                for direction in ("forward", "backward"):
                    try:
                        errs = compare(op, impl, oracle, direction, values)
                        what, err = max(errs, key=lambda e: (not e[1] <= tol, e[1]))
                        ok = all(e <= tol for _, e in errs)
                        note = ""
                    except Exception as e:  # a crash is a failure, reported and counted
                        first = str(e).strip().splitlines()[0] if str(e).strip() else ""  # (a row a check)
                        what, err, ok, note = "-", math.nan, False, f"  {type(e).__name__}: {first}"[:200]
                    total += 1
                    failures += not ok
                    p(f"{name:<6} {op.name:<15} {direction:<9} {dtype:<8} {shape:<15} {what:<8} "
                      f"{err:10.2e} {tol:8.1e}  {'pass' if ok else 'FAIL'}{note}")
    return total, failures


# ------------------------------------------------------------------ bench


# ``numbanorm bench``'s shapes by layout ((shape, groups)); the variants (instance
# norm) run on the tiny shapes only, where their groups are the channels.
QUICK_SHAPES = {"rows": [((256, 768), None), ((4096, 4096), None)], "groups": [((8, 64, 64, 64), 8)]}
TINY_SHAPES = {"rows": [((64, 256), None)], "groups": [((2, 16, 8, 8), 4)]}


def quick_cases(dtypes=("float32",), device="cpu", tiny=False):
    """The representative shapes of ``numbanorm bench`` (the full sweep is in benchmarks/)."""
    from .measure import DIRECTIONS, NORMS, VARIANTS, Case, layout_of

    table = TINY_SHAPES if tiny else QUICK_SHAPES
    norms = [n for n in NORMS if tiny or n not in VARIANTS]
    return [Case(norm, d, shape, dt, None if norm in VARIANTS else groups, device)
            for dt in dtypes for norm in norms for shape, groups in table[layout_of(norm)] for d in DIRECTIONS]


def bench(threads=None, repeats=None, budget=0.3, dtypes=("float32",), impls=None, torch=True,
          oracle=False, tiny=False, show_progress=True, allow_simulator=False, out=None):
    from . import machine, measure

    p = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    if impls and (code := _impls_status(impls, p)):
        return code
    threads = measure.set_threads(threads)
    peers = ["floor"] + (["torch"] if torch else []) + (["oracle"] if oracle else [])
    have_torch = machine.torch_or_none() is not None
    cases = quick_cases(dtypes, "cpu", tiny) if measure.kernel_impls("cpu", impls) else []
    gpu_ok, gpu_desc = machine.gpu_status()
    if measure.kernel_impls("gpu", impls, allow_simulator=allow_simulator):
        side = measure.side_for("gpu")
        gdt = ["float16", "float32"] + (["bfloat16"] if isinstance(side, measure.TorchCudaSide) else [])
        cases += quick_cases(gdt, "gpu", tiny or side.simulated)
    load0 = machine.loadavg()
    v = machine.versions()
    compared = torch and have_torch
    p(f"numbanorm bench: {threads} thread(s) for numba{' and torch' if compared else ''}; cpu: {machine.cpu_model()}; "
      f"gpu: {gpu_desc if gpu_ok else 'none'}")
    p(f"versions: numbanorm {v['numbanorm']}, numba {v['numba']}, numpy {v['numpy']}, "
      f"torch {v['torch'] or 'not installed'}")
    if torch and not have_torch:
        p("torch is not installed: no comparison with torch (pip install torch to compare)")
    if not cases:  # (only the GPU chosen, and it is numba's simulator: its times mean nothing)
        p(f"nothing to run: {gpu_desc} is not timed")
        return 1
    timing = {"budget_s": budget} if repeats is None else {"repeats": repeats}
    rows = measure.sweep(cases, impls, peers, threads, show_progress=show_progress,
                        allow_simulator=allow_simulator, **timing)
    p(measure.format_rows(rows))
    p(f"median of {'%d' % repeats if repeats else 'budgeted'} round-robin repeats; load average "
      f"{load0} before, {machine.loadavg()} after. x floor: time over np.copyto of the same bytes on "
      "one thread (forward: x to y; backward: x and dy copied, four arrays' bytes to the kernel's three)"
      + ("; x torch: time over torch.nn.functional's (backward via autograd)" if compared else "")
      + "; below 1 is faster.")
    return 0


# ------------------------------------------------------------------ compile


COMPILE_DTYPES = ("float32", "bfloat16", "float16", "float64")
# The calls that compile each operation: enough elements for the parallel kernel
# (cpu._kernels.common.SERIAL_BELOW), then a small call (its row function on this thread);
# groups in channels-last order too, which have kernels of their own
COMPILE_SHAPES = {"rows": (((64, 768), (2, 768)), None), "groups": (((4, 32, 16, 16), (1, 32, 4, 4)), 8)}


def compile_variants(op, dtype, everything=False):
    """``[(label, {role: dtype or None})]``: the affine parameters a call of ``op`` in
    ``dtype`` may have, each its own compiled kernel: in x's dtype (what a layer holds);
    with ``everything`` also none, and float32 beside 16-bit x (mixed precision)."""
    params = ("weight", "bias") if op.bias else ("weight",)
    out = [("weights", {p: dtype for p in params})]
    if everything:
        out.append(("no weights", {p: None for p in params}))
        if dtype in ("float16", "bfloat16"):
            out.append(("float32 weights", {p: "float32" for p in params}))
    return out


def compile_cpu(dtypes=("float32",), everything=False, show_progress=True, out=None):
    """Compile (or load) every CPU operation's kernels, forward and backward, in each of
    ``dtypes``: their row functions and parallel kernels, plain and with streaming stores
    (cpu._kernels.common.STREAMING), on this thread, into numba's cache; the variants
    that rescale rows whose sums overflowed are compiled when a row first needs one.
    0 when every call ran, else 1 (and 1, compiling nothing, where there is no writable cache on disk)."""
    import time

    from . import cpu, measure
    from .cpu._backend import plans as cpu_plans
    from .cpu._kernels import background, memory
    from .operations import OPERATIONS

    p = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    jobs = [(op, dt, label, params) for dt in dtypes for op in OPERATIONS
            for label, params in compile_variants(op, dt, everything)]
    where = _info_cache()
    p(f"numbanorm compile: {len(jobs) * 2} calls ({', '.join(dtypes)}), kernel cache: {where}")
    if where.startswith(("none", "unknown")) or "NOT writable" in where:
        # what compile is for (an image's or a job's cache) would silently not be there
        p("nothing compiled: no kernel cache on disk to fill; set NUMBA_CACHE_DIR to a writable folder")
        return 1
    if "is not usable" in where:  # (the folder asked for is not the one filled)
        p("nothing compiled: NUMBA_CACHE_DIR is not usable, and numba would fill another folder; "
          "set it to a writable folder")
        return 1
    bar = measure.progress(len(jobs) * 2, "compile", disable=not show_progress)
    failed = 0
    stream_threshold = memory.STREAM_MIN_BYTES
    t_all = time.perf_counter()
    rng = np.random.default_rng(0)
    for op, dt, label, params in jobs:
        shapes, groups = COMPILE_SHAPES[op.layout]
        calls = []
        for shape in shapes:
            values = op.inputs(rng, shape, np.float64, groups)
            values = {k: (v.astype(measure.host_dtype(dt)) if isinstance(v, np.ndarray) else v)
                      for k, v in values.items()}
            for role, pdt in params.items():
                values[role] = None if pdt is None else values[role].astype(measure.host_dtype(pdt))
            calls.append(values)
            if op.layout == "groups":  # and in channels-last order, which has kernels of its own
                calls.append({k: (np.moveaxis(np.ascontiguousarray(np.moveaxis(v, 1, -1)), -1, 1)
                                  if k in ("x", "dy") else v) for k, v in values.items()})
        for direction in ("forward", "backward"):
            bar.set_postfix_str(f"{op.name} {direction} {dt}, {label}")
            t0 = time.perf_counter()
            try:
                with background.synchronous():  # the parallel kernels too, here
                    for stream_min in (stream_threshold, 0):  # and with the streaming stores
                        memory.STREAM_MIN_BYTES = stream_min
                        cpu_plans._plans.clear()  # (a plan keeps its choice of stores)
                        for values in calls:
                            if direction == "forward":
                                values.update(zip(op.forward_outputs, op.call(cpu, "forward", values)))
                            else:
                                op.call(cpu, "backward", values)
                note = ""
            except Exception as e:  # reported and counted; the other operations still compile
                failed += 1
                note = f"  FAILED: {type(e).__name__}: {e}"[:200]
            finally:
                memory.STREAM_MIN_BYTES = stream_threshold
                cpu_plans._plans.clear()
            bar.update()
            if not show_progress or note:
                p(f"  {op.name:<15} {direction:<9} {dt:<9} {label:<16} {time.perf_counter() - t0:6.1f} s{note}")
    bar.close()
    p(f"{len(jobs) * 2 - failed} of {len(jobs) * 2} calls compiled or loaded in {time.perf_counter() - t_all:.1f} s"
      + (f", {failed} FAILED" if failed else ""))
    return 1 if failed else 0


# ------------------------------------------------------------------ command line


def _parser():
    ap = argparse.ArgumentParser(
        prog="numbanorm",
        description="Numba normalization kernels: check them against the NumPy oracle and "
                    "benchmark them. With no command: check, then a quick bench.")
    sub = ap.add_subparsers(dest="command", metavar="{info,check,bench,compile}")
    sub.add_parser("info", help="versions, threads, usable implementations and GPU")
    c = sub.add_parser("check", help="every operation against the oracle (exit code 1 on a failure)")
    c.add_argument("--impl", action="append", type=_kernel_name, metavar="NAME",
                   help="only this implementation (repeatable; default: every usable one)")
    c.add_argument("--dtype", action="append", type=_dtype_name, metavar="DTYPE",
                   help=f"only this dtype, one of {', '.join(DTYPE_CHOICES)} (repeatable; default: "
                        f"{', '.join(DTYPES)})")
    b = sub.add_parser("bench", help="a quick benchmark of representative shapes")
    _bench_args(b)
    ap.set_defaults(bench_parser=b)
    k = sub.add_parser("compile", help="compile every CPU operation into numba's on-disk cache",
                       description="Compile every CPU operation, forward and backward, into numba's on-disk "
                                   "cache, so that no later process compiles them (an image, a CI job). "
                                   "The cache is for this CPU; NUMBA_CPU_NAME=generic makes one any x86-64 "
                                   "CPU can load, at some speed.")
    k.add_argument("--dtypes", nargs="+", choices=COMPILE_DTYPES, default=["float32"], metavar="DTYPE",
                   help=f"of {', '.join(COMPILE_DTYPES)} (default float32; bfloat16 needs ml_dtypes)")
    k.add_argument("--all-variants", action="store_true",
                   help="also calls without weights, and float32 weights beside 16-bit x")
    k.add_argument("--no-progress", action="store_true", help="a line per call instead of a progress bar")
    return ap


# The arguments check and bench share are read by one function each, so that a bad value
# gets the same error from either: argparse's, naming the value and the valid ones, exit 2.

def _kernel_name(s):
    """An implementation of the registry that runs kernels (not the oracle they are checked against)."""
    from . import registry

    names = [n for n in registry.IMPLEMENTATIONS if n != "oracle"]
    if s not in names:
        why = "the NumPy reference the kernels are checked against, " if s == "oracle" else ""
        raise argparse.ArgumentTypeError(f"invalid choice: {s!r} ({why}choose from {', '.join(map(repr, names))})")
    return s


def _dtype_name(s):
    if s not in DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {s!r} (choose from {', '.join(map(repr, DTYPE_CHOICES))})")
    if s == "bfloat16":
        try:
            import ml_dtypes  # noqa: F401  (gives NumPy its bfloat16 dtype)
        except ImportError:
            raise argparse.ArgumentTypeError(
                "bfloat16 needs ml_dtypes, whose bfloat16 is NumPy's (pip install ml-dtypes)") from None
    return s


def _impls_status(impls, p):
    """0 if every implementation in ``impls`` is a kernel implementation usable here; else each
    one that is not is said with why, and the exit code: 2 for a name that is not one (the
    oracle included), 1 for one this machine cannot run (check and bench alike)."""
    from . import registry

    for name in impls:
        try:
            _kernel_name(name)
        except argparse.ArgumentTypeError as e:
            p(f"--impl: {e}")
            return 2
    code = 0
    for name in impls:
        usable, why = registry.usable(name)
        if not usable:
            p(f"{name}: not usable here: {why.splitlines()[0]}")
            code = 1
    return code


def _positive_int(s):
    try:
        v = int(s)
    except ValueError:  # (argparse would name this function in its message)
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s!r}")
    return v


def _positive_float(s):
    try:
        v = float(s)
    except ValueError:
        v = 0.0
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s!r}")
    return v


def _bench_args(b):
    b.add_argument("--threads", type=_positive_int, help="threads for numba and torch alike (default: all)")
    b.add_argument("--repeats", type=_positive_int, help="round-robin repeats per case (default: fit --budget)")
    b.add_argument("--budget", type=_positive_float, default=0.3,
                   help="seconds of timed repeats per case (default 0.3; at most 50 repeats)")
    b.add_argument("--dtype", action="append", type=_dtype_name, metavar="DTYPE",
                   help=f"CPU dtype, one of {', '.join(DTYPE_CHOICES)} (repeatable; default float32)")
    b.add_argument("--impl", action="append", type=_kernel_name, metavar="NAME",
                   help="only this implementation (repeatable; default: every usable one)")
    b.add_argument("--no-torch", action="store_true", help="leave PyTorch out")
    b.add_argument("--oracle", action="store_true", help="time the NumPy oracle too")
    b.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test, the numbers mean nothing")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")


def _bench_from(a):
    return bench(threads=a.threads, repeats=a.repeats, budget=a.budget, dtypes=tuple(a.dtype or ("float32",)),
                 impls=a.impl, torch=not a.no_torch, oracle=a.oracle, tiny=a.tiny,
                 show_progress=not a.no_progress)


def main(argv=None):
    try:
        return _main(argv)
    except BrokenPipeError:  # `numbanorm check | head`: stop quietly, as other commands do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except ValueError as e:  # numba's threads would not start: its message (and hint), not a traceback
        if not str(e).startswith("No threading layer could be loaded"):
            raise
        import numba

        print(f"numbanorm: {e} (NUMBA_THREADING_LAYER={numba.config.THREADING_LAYER})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: a line, and the shell's status for it
        print("numbanorm: interrupted", file=sys.stderr)
        return 130


def _main(argv):
    ap = _parser()
    a = ap.parse_args(argv)
    if a.command == "info":
        return info()
    if a.command == "check":
        return check(impls=a.impl, dtypes=tuple(a.dtype or DTYPES))
    if a.command == "bench":
        import numba

        limit = numba.config.NUMBA_NUM_THREADS
        if a.threads is not None and a.threads > limit:
            a.bench_parser.error(f"argument --threads: at most {limit} (NUMBA_NUM_THREADS), got {a.threads}")
        return _bench_from(a)
    if a.command == "compile":
        if "bfloat16" in a.dtypes:
            try:
                import ml_dtypes  # noqa: F401  (installed and importable, as check and bench ask)
            except ImportError as e:
                ap.error(f"bfloat16 needs ml_dtypes (pip install ml_dtypes): {e}")
        return compile_cpu(tuple(a.dtypes), a.all_variants, not a.no_progress)
    rc = check()
    print()
    if rc:
        print("bench skipped: a kernel failed its check")
        return rc
    return bench()


if __name__ == "__main__":
    sys.exit(main())
