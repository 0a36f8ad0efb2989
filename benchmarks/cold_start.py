"""Cold start: what the first call of each CPU operation costs in a fresh Python process.

    python -m benchmarks.cold_start                   # all of it -> benchmarks/results/cold-start.json
    python -m benchmarks.cold_start --dtypes float32 --only first_calls,import
    python -m benchmarks.cold_start --main-job        # also the README's main job from a copy of the clone
    python -m benchmarks.cold_start --only "" --test-command --out test-command   # the README's test command
    python -m benchmarks.cold_start --baseline DIR --only first_calls   # and another checkout's, alternated
    python benchmarks/cold_start.py child '<case as JSON>' [--profile]   # one process's measurement
    python benchmarks/cold_start.py numba             # numba alone: a trivial cached function

Each measurement runs in new processes with a ``NUMBA_CACHE_DIR`` of its own:

* ``first_calls``: every operation of the table, forward and backward, in every dtype,
  on the calls' usual path (enough elements for the parallel kernel), weights in x's
  dtype.  With an empty cache (``fresh_cache``): the call's wall time, its thread's CPU
  time, the seconds until the parallel kernel it handed to the compile thread is
  compiled (``background_s``), and where the compile time went (``breakdown``: Numba's
  phases and LLVM's in CPU seconds, the functions compiled and the LLVM modules
  optimized).  With the cache filled by an earlier process (``cached``): the call's
  wall time.  Each is measured in ``REPEATS`` pairs of processes and the median kept
  (every sample in ``samples_s``).  Then the median of 20 more calls (steady state).
  Backward statistics come from the oracle, so that only the kernel under test is compiled.
* ``compile``: ``python -m numbanorm compile`` into an empty cache, float32 and bfloat16.
* ``main_job`` (``--main-job``): a copy of the repository's tracked files, a new venv,
  ``pip install .`` and ``python -m numbanorm`` there, each step timed; ``test_command``
  (``--test-command``): the same with ``pip install ".[test]"`` and ``python -m pytest``.
* ``numba_alone``: ``import numba`` and a trivial cached function's first call.

Where SciPy is installed, the first kernel a process compiles makes numba import
``scipy.linalg`` (its check for a BLAS, in ``numba.np.arraymath``), and so did the first
it loaded from the cache before numbanorm's cache skipped that registration (the CPU
design log).  So each measurement records ``scipy_installed``, and the
children can run another interpreter (``--python``: a venv of numbanorm's
dependencies alone, as ``pip install numbanorm`` leaves a user).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

DTYPES = ("float32", "bfloat16", "float16", "float64")
# processes a first call is measured in, from an empty cache and from a filled one (the median
# is the result): one process's first call on a 2-core VM ranged over 1.5x between runs
REPEATS = 3
# The calls' shapes: a transformer's (rows, hidden) and a U-Net's (N, C, H, W) with 8 groups
SHAPES = {"rows": ((256, 768), None), "groups": ((8, 64, 32, 32), 8)}
STEADY_CALLS = 20


# ------------------------------------------------------------------ the child's measurement


class Breakdown:
    """Where a process's compile time goes, from Numba's events and its LLVM code library,
    per thread: each compile pass, LLVM step and dispatcher compile is a frame; a frame's
    own CPU time (its thread's, less its nested frames') goes to its phase."""

    PHASES = {
        "nopython_type_inference": "typing", "partial_type_inference": "typing",
        "inline_inlinables": "numba inlining", "inline_overloads": "numba inlining",
        "inline_closure_likes": "numba inlining",
        "parfor_pass": "parfors", "parfor_fusion_pass": "parfors", "parfor_prelowering_pass": "parfors",
        "pre_parfor_pass": "parfors", "parfor_preparation_pass": "parfors",
        "native_lowering": "lowering", "native_parfor_lowering": "lowering",
    }
    LLVM = {"_optimize_functions": "LLVM function passes", "_optimize_final_module": "LLVM module passes",
            "_finalize_specific": "LLVM code generation"}

    def __init__(self):
        from numba.core import codegen, event

        self._local = threading.local()
        self.phases = collections.defaultdict(lambda: collections.defaultdict(float))
        self.functions = []   # (thread, depth, qualname, args, wall, cpu)
        self.modules = collections.Counter()   # thread -> LLVM modules optimized
        self.instructions = collections.Counter()  # thread -> their instructions before optimization
        me = self

        class Listener(event.Listener):
            def on_start(self, ev):
                if ev.kind == "numba:compile":
                    d = ev.data
                    me._push(("compile", d["dispatcher"].py_func.__qualname__, str(d["args"])))
                else:
                    me._push(("pass", ev.data["name"].split(" [")[0], ""))

            def on_end(self, ev):
                me._pop()

        event.register("numba:compile", Listener())
        event.register("numba:run_pass", Listener())
        for name, cls in (("_optimize_functions", codegen.CPUCodeLibrary),
                          ("_optimize_final_module", codegen.CPUCodeLibrary),
                          ("_finalize_specific", codegen.JITCodeLibrary)):
            setattr(cls, name, self._timed(getattr(cls, name), name))

    def _timed(self, method, name):
        me = self

        def timed(library, *args, **kwargs):
            if name == "_optimize_final_module":
                t = me._thread()
                me.modules[t] += 1
                me.instructions[t] += sum(len(list(b.instructions)) for f in library._final_module.functions
                                          for b in f.blocks)
            me._push(("llvm", name, ""))
            try:
                return method(library, *args, **kwargs)
            finally:
                me._pop()
        return timed

    def _stack(self):
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    @staticmethod
    def _thread():
        return "main" if threading.current_thread() is threading.main_thread() else "background"

    def _push(self, what):
        self._stack().append([what, time.perf_counter(), time.thread_time(), 0.0])

    def _pop(self):
        stack = self._stack()
        (kind, name, args), wall0, cpu0, nested = stack.pop()
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        if stack:
            stack[-1][3] += cpu
        t = self._thread()
        if kind == "compile":
            self.functions.append((t, sum(f[0][0] == "compile" for f in stack), name, args, wall, cpu))
            phase = "Numba, other"
        elif kind == "llvm":
            phase = self.LLVM[name]
        else:
            phase = self.PHASES.get(name, "Numba front end")
        self.phases[t][phase] += cpu - nested

    def summary(self):
        return {
            "phases_cpu_s": {t: {k: round(v, 3) for k, v in sorted(p.items(), key=lambda kv: -kv[1])}
                             for t, p in self.phases.items()},
            "llvm_modules": dict(self.modules),
            "llvm_instructions": dict(self.instructions),
            # outermost first: a function's time includes the functions it compiled
            "functions": [{"thread": t, "depth": d, "function": q, "args": a[:300], "wall_s": round(w, 3),
                           "cpu_s": round(c, 3)} for t, d, q, a, w, c in self.functions],
        }


def _case_call(nn, case):
    """The public call of ``case`` on its inputs (statistics of a backward from the oracle)."""
    import numpy as np

    from numbanorm import measure, reference
    from numbanorm.operations import BY_NAME

    op = BY_NAME[case["op"]]
    dt = measure.host_dtype(case["dtype"])
    values = op.inputs(np.random.default_rng(0), tuple(case["shape"]), np.float64, case["groups"])
    values = {k: (v.astype(dt) if isinstance(v, np.ndarray) else v) for k, v in values.items()}
    if case["direction"] == "forward":
        return lambda: op.call(nn, "forward", values)
    acc = np.float64 if case["dtype"] == "float64" else np.float32
    ref = op.call(reference, "forward", {k: (v.astype(np.float64) if isinstance(v, np.ndarray) else v)
                                         for k, v in values.items()})
    back = dict(values)
    for name, a in zip(op.forward_outputs, ref):
        back[name] = a.astype(acc if name in op.stats else dt)
    return lambda: op.call(nn, "backward", back)


def child(case_json, profile=False):
    """One case's first call in this new process (nothing of numbanorm imported before)."""
    case = json.loads(case_json)
    t0 = time.perf_counter()
    breakdown = Breakdown() if profile else None  # (imports numba)
    import numbanorm

    t_import = time.perf_counter() - t0
    from numbanorm import measure

    fn = _case_call(numbanorm.cpu, case)
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    t_first, cpu_first = time.perf_counter() - t0, time.thread_time() - c0
    getattr(measure, "compiled_in_background", lambda: None)()  # (a checkout from before it: --baseline)
    t_background = time.perf_counter() - t0 - t_first
    steady = []
    for _ in range(STEADY_CALLS):
        t0 = time.perf_counter()
        fn()
        steady.append(time.perf_counter() - t0)
    steady.sort()
    out = {"import_s": t_import, "first_call_s": t_first, "first_call_cpu_s": cpu_first,
           "background_s": t_background, "steady_s": steady[len(steady) // 2],
           "scipy_installed": importlib.util.find_spec("scipy") is not None}
    if breakdown is not None:
        out["breakdown"] = breakdown.summary()
    return out


def numba_child():
    """``import numba`` and the first call of a trivial cached function, in this new process."""
    t0 = time.perf_counter()
    import numba

    t_import = time.perf_counter() - t0

    @numba.njit(cache=True)  # cached in the parent's NUMBA_CACHE_DIR
    def plus_one(v):
        return v + 1

    t0 = time.perf_counter()
    plus_one(1)
    return {"import_s": t_import, "first_call_s": time.perf_counter() - t0,
            "scipy_installed": importlib.util.find_spec("scipy") is not None}


# ------------------------------------------------------------------ the parent


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(threads, cache_dir, tree=ROOT):
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    if threads is not None:
        env["NUMBA_NUM_THREADS"] = str(threads)
    env.pop("NUMBA_DISABLE_JIT", None)
    env.pop("NUMBANORM_COMPILE_IN_BACKGROUND", None)
    # the children import the numbanorm of ``tree`` (this repository's by default)
    env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def python_lacks(python, dtypes=DTYPES):
    """Why interpreter ``python`` (None: this one) cannot run the cold-start processes of
    ``dtypes``, or None: numba and NumPy, and ml_dtypes for bfloat16, must import there.
    Asked before a run measures anything (a run's cold starts come last)."""
    modules = ["numba", "numpy"] + (["ml_dtypes"] if "bfloat16" in dtypes else [])
    try:
        proc = subprocess.run([python or sys.executable, "-c", f"import {', '.join(modules)}"],
                              capture_output=True, text=True, timeout=300)
    except OSError as e:
        return f"the cold-start interpreter {python} does not run: {e}"
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return (f"the cold-start interpreter {python or sys.executable} cannot import {', '.join(modules)}"
                f" ({last}): install them there (ml_dtypes for the bfloat16 cases)")
    return None


def _run_child(python, args, env, timeout, what):
    proc = subprocess.run([python or sys.executable, os.path.abspath(__file__), *args], cwd=tempfile.gettempdir(),
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"cold-start process for {what} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cases(dtypes=DTYPES, ops=None):
    """Every operation of the table (or of ``ops``), forward and backward, in each of ``dtypes``."""
    from numbanorm.operations import OPERATIONS

    return [{"op": op.name, "direction": d, "dtype": dt, "shape": list(SHAPES[op.layout][0]),
             "groups": SHAPES[op.layout][1]}
            for op in OPERATIONS if ops is None or op.name in ops for d in ("forward", "backward") for dt in dtypes]


def label(case):
    return f"{case['op']} {case['direction']} {case['dtype']}"


def _fresh(python, case, threads, tree, timeout, profile):
    """One first call from an empty cache; with ``profile``, a second process's breakdown
    beside it (the profile's own bookkeeping is not in the timed call)."""
    with tempfile.TemporaryDirectory(prefix="numbanorm-cold-") as tmp:
        first = _run_child(python, ["child", json.dumps(case)], _env(threads, tmp, tree), timeout, label(case))
    if profile:
        with tempfile.TemporaryDirectory(prefix="numbanorm-cold-") as tmp:
            prof = _run_child(python, ["child", json.dumps(case), "--profile"], _env(threads, tmp, tree), timeout,
                              label(case))
        first["breakdown"] = dict(prof.pop("breakdown"), profiled_run={k: prof[k] for k in (
            "first_call_s", "first_call_cpu_s", "background_s")})
    return first


def _bytecode(python, tree):
    """Compile the bytecode of ``tree``'s numbanorm, as ``pip install`` does for the files it
    installs, so that an import measured here reads it as a user's does (a process that may
    not write bytecode, PYTHONDONTWRITEBYTECODE, would otherwise compile every module on
    every import).  Nothing to do where numbanorm is installed rather than in ``tree``."""
    package = os.path.join(tree, "numbanorm")
    if os.path.isdir(package):
        subprocess.run([python or sys.executable, "-m", "compileall", "-q", package], check=True,
                       capture_output=True)


def _median(samples):
    """The sample of median ``first_call_s`` (the lower of the middle two), with every
    sample's ``first_call_s`` beside it (``samples_s``)."""
    ranked = sorted(samples, key=lambda s: s["first_call_s"])
    return dict(ranked[(len(ranked) - 1) // 2], samples_s=[s["first_call_s"] for s in samples])


def _pairs(python, case, threads, tree, timeout, repeats):
    """``tree``'s first call of ``case`` in ``repeats`` pairs of new processes, each pair with a
    cache of its own: from the empty cache, then loading what the first cached; the two
    medians (:func:`_median`)."""
    firsts, cacheds = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="numbanorm-cold-") as tmp:
            env = _env(threads, tmp, tree)
            firsts.append(_run_child(python, ["child", json.dumps(case)], env, timeout, label(case)))
            cacheds.append(_run_child(python, ["child", json.dumps(case)], env, timeout, label(case)))
    return _median(firsts), _median(cacheds)


def first_calls(case_list, threads=None, python=None, tree=ROOT, fresh=True, baseline=None, profile=True,
                timeout=900, show=print, repeats=REPEATS):
    """``{"fresh_cache": [...], "cached": [...]}``: each case's first call in a new process
    with an empty cache (without ``fresh``, not kept), then in a second one that loads what
    the first cached, ``repeats`` times each (a pair of processes a time, each pair with a
    cache of its own): the sample of median first call (:func:`_median`), all of them
    beside it; with ``profile``, one more process breaks the first call's compile down.
    ``baseline``: another checkout's numbanorm, whose first calls from an empty cache and
    cached are measured before each case's, as many times (``baseline_fresh_cache``,
    ``baseline_cached``): alternated, a loaded machine slows both alike."""
    out = {"fresh_cache": [], "cached": []}
    for t in (tree, baseline) if baseline else (tree,):
        _bytecode(python, t)
    if baseline:
        out["baseline_fresh_cache"], out["baseline_cached"] = [], []
    for case in case_list:
        if baseline:  # (as many processes as this tree's, the median kept: the same estimate)
            before, before_cached = _pairs(python, case, threads, baseline, timeout, repeats)
            if profile:
                before["breakdown"] = _fresh(python, case, threads, baseline, timeout, True)["breakdown"]
            out["baseline_fresh_cache"].append(dict(case, **before))
            out["baseline_cached"].append(dict(case, **before_cached))
            show(f"{label(case):<32} baseline, empty cache: first call {before['first_call_s']:6.2f} s "
                 f"({before['first_call_cpu_s']:.2f} s CPU); cached: {before_cached['first_call_s']:.3f} s")
        first, cached = _pairs(python, case, threads, tree, timeout, repeats)
        if fresh and profile:
            first["breakdown"] = _fresh(python, case, threads, tree, timeout, True)["breakdown"]
        if fresh:
            out["fresh_cache"].append(dict(case, **first))
        out["cached"].append(dict(case, **cached))
        show(f"{label(case):<32} empty cache: first call {first['first_call_s']:6.2f} s "
             f"({first['first_call_cpu_s']:.2f} s CPU), parallel kernel {first['background_s']:5.2f} s later; "
             f"cached: {cached['first_call_s']:.3f} s; import {cached['import_s']:.2f} s")
    if not fresh:
        del out["fresh_cache"]
    return out


def numba_alone(threads=None, python=None, timeout=600):
    """:func:`numba_child` in a fresh process whose cache already holds the function."""
    with tempfile.TemporaryDirectory(prefix="numbanorm-cold-") as tmp:
        env = _env(threads, tmp)
        _run_child(python, ["numba"], env, timeout, "numba alone")  # compiles into the cache
        return _run_child(python, ["numba"], env, timeout, "numba alone")


def compile_command(dtypes=("float32", "bfloat16"), threads=None, python=None, tree=ROOT, timeout=3600):
    """``python -m numbanorm compile --dtypes ...`` into an empty cache: its wall time."""
    with tempfile.TemporaryDirectory(prefix="numbanorm-cold-") as tmp:
        env = _env(threads, tmp, tree)
        t0 = time.perf_counter()
        proc = subprocess.run([python or sys.executable, "-m", "numbanorm", "compile", "--dtypes", *dtypes,
                               "--no-progress"], cwd=tempfile.gettempdir(), env=env, capture_output=True,
                              text=True, timeout=timeout)
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"numbanorm compile failed:\n{proc.stderr[-2000:]}")
        files = sum(len(fs) for _, _, fs in os.walk(tmp))
    return {"dtypes": list(dtypes), "wall_s": wall, "cache_files": files, "output": proc.stdout[-2000:]}


# The README's two commands after the venv: (what pip installs, what then runs)
README_COMMANDS = {"main_job": (".", ["-m", "numbanorm"]), "tests": (".[test]", ["-m", "pytest", "-q"])}


def readme_command(command, python=None, timeout=7200):
    """One of the README's commands as a new user runs it: the repository's tracked files
    copied (a fresh clone's), a new venv, ``pip install .`` and ``python -m numbanorm``
    (``command`` "main_job"), or ``pip install ".[test]"`` and ``python -m pytest``
    ("tests"); each step's wall time.  pip's own download cache is used as it is (the
    network is not timed apart)."""
    steps = {}
    what, run_args = README_COMMANDS[command]
    with tempfile.TemporaryDirectory(prefix="numbanorm-main-job-") as tmp:
        clone = os.path.join(tmp, "clone")
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        for rel in filter(None, files.decode().split("\0")):
            src, dst = os.path.join(ROOT, rel), os.path.join(clone, rel)
            if os.path.isfile(src):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copy2(src, dst)
        venv = os.path.join(tmp, "venv")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NUMBA_CACHE_DIR", "VIRTUAL_ENV")}
        vpy = os.path.join(venv, "bin", "python")
        for name, cmd in (("venv", [python or sys.executable, "-m", "venv", venv]),
                          ("pip_install", [vpy, "-m", "pip", "install", "-q", what]),
                          (command, [vpy, *run_args])):
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True, timeout=timeout)
            steps[name + "_s"] = time.perf_counter() - t0
            if proc.returncode:
                raise RuntimeError(f"{command} step {name} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
            if name == command:
                steps["output_tail"] = proc.stdout[-1500:]
    steps["total_s"] = steps["venv_s"] + steps["pip_install_s"] + steps[command + "_s"]
    return steps


def run(dtypes=DTYPES, only=("first_calls", "compile", "numba_alone"), threads=None, python=None,
        with_main_job=False, fresh=True, baseline=None, profile=True, show=print, with_tests=False,
        repeats=REPEATS):
    """The cold-start measurements as one dict (``harness``'s ``cold_start`` section)."""
    out = {}
    if "first_calls" in only:
        out.update(first_calls(cases(dtypes), threads, python, fresh=fresh, baseline=baseline, profile=profile,
                               show=show, repeats=repeats))
    if "numba_alone" in only:
        out["numba_alone"] = numba_alone(threads, python)
    if "compile" in only:
        out["compile_command"] = compile_command(threads=threads, python=python)
        show(f"numbanorm compile --dtypes float32 bfloat16: {out['compile_command']['wall_s']:.1f} s")
    if with_main_job:
        out["main_job"] = readme_command("main_job", python)
        show(f"main job from a clone: {out['main_job']['total_s']:.1f} s "
             f"(pip install {out['main_job']['pip_install_s']:.1f} s)")
    if with_tests:
        out["test_command"] = readme_command("tests", python)
        show(f"test command from a clone: {out['test_command']['total_s']:.1f} s "
             f"(pip install {out['test_command']['pip_install_s']:.1f} s)")
    return out


def main(argv=None):
    from . import harness, targets

    ap = argparse.ArgumentParser(prog="python -m benchmarks.cold_start", description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--only", default="first_calls,compile,numba_alone",
                    help="comma-separated, of first_calls, compile, numba_alone")
    ap.add_argument("--main-job", action="store_true", help="also the README's main job from a copy of the clone")
    ap.add_argument("--test-command", action="store_true",
                    help="also the README's test command (its install and default set) from a copy of the clone")
    ap.add_argument("--threads", type=int, default=targets.THREADS)
    ap.add_argument("--python", help="interpreter of the measured processes (default: this one), e.g. a venv "
                                     "of numbanorm's dependencies alone")
    ap.add_argument("--baseline", metavar="DIR", help="a checkout whose numbanorm's first calls (empty cache and cached) "
                                                     "are measured too, alternated with this one's")
    ap.add_argument("--no-profile", action="store_true", help="no breakdown (one process fewer a case)")
    ap.add_argument("--repeats", type=int, default=REPEATS,
                    help=f"processes per first call, empty cache and cached: the median is kept (default {REPEATS})")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default="cold-start", help="results stem under benchmarks/results")
    a = ap.parse_args(argv)
    if "first_calls" in a.only and (lacks := python_lacks(a.python, tuple(a.dtypes))):
        ap.error(lacks)
    load_before = harness.measure.loadavg()
    cold = run(tuple(a.dtypes), tuple(filter(None, a.only.split(","))), a.threads, a.python, a.main_job,
               baseline=a.baseline and os.path.abspath(a.baseline), profile=not a.no_profile,
               with_tests=a.test_command, repeats=a.repeats)
    meta = harness.metadata(a.threads, a.note, load_before, harness.measure.loadavg(), (), {})
    meta["command"] = "python -m benchmarks.cold_start " + " ".join(argv if argv is not None else sys.argv[1:])
    path = harness.RESULTS / f"{a.out}.json"
    with open(path, "w") as f:
        json.dump(harness._clean({"meta": meta, "rows": [], "cold_start": cold}), f, indent=1)
        f.write("\n")
    print(f"wrote {path}")
    print(targets.summary({"meta": meta, "rows": [], "cold_start": cold}, cold_only=True))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], profile="--profile" in sys.argv[3:])))
        # (the interpreter then waits for nothing: the compile thread is done, compiled_in_background)
    elif len(sys.argv) > 1 and sys.argv[1] == "numba":
        print(json.dumps(numba_child()))
    else:
        sys.exit(main())
