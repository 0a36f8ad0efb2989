"""Cold start: the first call of a CPU kernel in a fresh Python process.

    python benchmarks/cold_start.py '<case as JSON>'    # one measurement, printed as JSON
    python benchmarks/cold_start.py --numba             # numba alone: a trivial cached function

:func:`cold_start` (used by ``harness.cold_start_runs``) runs this file once per
case in a new process (after an untimed one that makes sure the cache holds the
kernel, unless ``fresh_cache``): ``import numbanorm`` is timed, then the first
call (numba's type dispatch, cache load -- or, with ``fresh_cache``, the whole
compile into an empty ``NUMBA_CACHE_DIR`` -- and the start of the threading
layer), then the median of 20 more calls (steady state).  Backward statistics
come from the oracle so that only the kernel under test is compiled.

Where SciPy is installed, the first call includes numba importing ``scipy.linalg``:
the first kernel a process loads makes numba import ``numba.np.arraymath``, which
checks for a BLAS that way.  On the Xeon VM that is 0.19 s of a 0.38 s first call
(measured with scipy importable and with it blocked, same cached kernel), so each
measurement records ``scipy_installed``, and the children can run another
interpreter (``python``: a venv of numbanorm's dependencies alone, as a user's
``pip install numbanorm`` makes it).  :func:`numba_alone` measures the same in a
process that calls one trivial cached numba function instead: what any numba
program pays before its first kernel runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time


def child(case_json):
    """The child process's measurement (nothing of numbanorm is imported before it starts)."""
    t0 = time.perf_counter()
    import numbanorm

    t_import = time.perf_counter() - t0
    from numbanorm import measure, reference

    case = measure.Case.from_dict(json.loads(case_json))
    inp = measure.Inputs(case, measure.HostSide())
    stats = None
    if case.direction == "backward":
        acc = "float64" if case.dtype == "float64" else "float32"
        stats = tuple(inp.side.array(s, acc) for s in measure.forward_stats(reference, case, inp))
    fn = measure.numbanorm_calls(numbanorm.cpu, case, inp, stats)["alloc"]
    t0 = time.perf_counter()
    fn()
    t_first = time.perf_counter() - t0
    steady = []
    for _ in range(20):
        t0 = time.perf_counter()
        fn()
        steady.append(time.perf_counter() - t0)
    steady.sort()
    return {"import_s": t_import, "first_call_s": t_first, "steady_s": steady[len(steady) // 2],
            "scipy_installed": importlib.util.find_spec("scipy") is not None}


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


def _env(threads):
    env = dict(os.environ)
    if threads is not None:
        env["NUMBA_NUM_THREADS"] = str(threads)
    env.pop("NUMBA_DISABLE_JIT", None)
    return env


def _run_child(python, args, env, timeout, what):
    proc = subprocess.run([python or sys.executable, os.path.abspath(__file__), *args],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"cold-start process for {what} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def numba_alone(threads=None, python=None, timeout=600):
    """:func:`numba_child` in a fresh process whose cache already holds the function."""
    env = _env(threads)
    with tempfile.TemporaryDirectory(prefix="numbanorm-cold-") as tmp:
        env["NUMBA_CACHE_DIR"] = tmp
        _run_child(python, ["--numba"], env, timeout, "numba alone")  # compiles into the cache
        return _run_child(python, ["--numba"], env, timeout, "numba alone")


def cold_start(cases, threads=None, fresh_cache=False, python=None, timeout=600):
    """One dict per case (``measure.Case``): import, first-call and steady-state seconds."""
    env = _env(threads)
    # the child imports the numbanorm this process measures (the repository's, when run from its root)
    import numbanorm

    root = os.path.dirname(os.path.dirname(os.path.abspath(numbanorm.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    out = []

    def one(case):
        return _run_child(python, [json.dumps(case.to_dict())], env, timeout, case.label)

    for case in cases:
        with tempfile.TemporaryDirectory(prefix="numbanorm-cold-") as tmp:
            if fresh_cache:
                env["NUMBA_CACHE_DIR"] = tmp
            else:
                one(case)  # a first process fills the cache if the kernel's source changed since
            res = one(case)
        res.update(case.to_dict(), fresh_cache=bool(fresh_cache))
        res["shape"] = list(case.shape)
        out.append(res)
    return out


if __name__ == "__main__":
    print(json.dumps(numba_child() if sys.argv[1] == "--numba" else child(sys.argv[1])))
