"""The benchmark sweep: which shapes, how big, and where the results go.

The timing itself is ``numbanorm.measure`` (the same code ``numbanorm bench``
runs); this module adds the full grid of shapes, the memory bound, the
metadata of a run and the result files (the cold-start runs are ``cold_start.py``):

    benchmarks/results/<stem>.json   {"meta": ..., "rows": [...], "cold_start": {...}}
    benchmarks/results/<stem>.csv    one line per row, the main metadata repeated as columns

Run it with ``python -m benchmarks.run`` (see ``--help``).
"""

from __future__ import annotations

import csv
import datetime as _dt
import itertools
import json
import math
import os
import statistics
import sys
from pathlib import Path

from numbanorm.measure import Case

from . import measure

RESULTS = Path(__file__).resolve().parent / "results"

# The shapes people use: transformer hidden sizes by batch*sequence rows, and the
# GroupNorm/InstanceNorm shapes of convolutional nets (diffusion U-Nets use 32 groups).
ROWS = (256, 1024, 4096, 16384, 65536)
HIDDEN = (768, 1024, 4096, 8192)
GROUP_SHAPES = (((32, 256, 32, 32), 32), ((8, 64, 64, 64), 8))
INSTANCE_SHAPES = ((32, 256, 32, 32), (8, 64, 64, 64))
CPU_DTYPES = ("float32", "float64")
HALF_DTYPES = ("float16", "bfloat16")
GPU_DTYPES = ("float16", "bfloat16", "float32")
ALL_NORMS = measure.NORMS  # the table's unfused norms and instance norm

# Arrays of x's size alive at once while a case runs: forward x, y (out=), the
# allocating forward's y, torch's y, the floor's copy = 5; backward x, dy,
# numbanorm's dx, torch's y and dx, the floor's two copies = 7; one more each
# for a transient (an output being freed while the next is allocated).
BUFFERS = {"forward": 6, "backward": 8}
MEM_FRACTION = 0.5  # "fits comfortably": all buffers in half of the machine's memory


def mem_limit_bytes(device="cpu"):
    """Half the memory of ``device`` (host RAM, or the GPU's)."""
    if device == "cpu":
        total = measure.mem_total_bytes() or 8 * 2**30
    else:
        total = _gpu_mem_bytes() or 8 * 2**30
    return int(MEM_FRACTION * total)


def _gpu_mem_bytes():
    try:
        from numba import cuda

        return int(cuda.current_context().get_memory_info()[1])
    except Exception:
        return None


def fits(case, limit):
    return BUFFERS[case.direction] * case.nbytes <= limit


def sweep_cases(norms=ALL_NORMS, dtypes=CPU_DTYPES, rows=ROWS, hidden=HIDDEN,
                directions=measure.DIRECTIONS, device="cpu", mem_limit=None, groups_shapes=GROUP_SHAPES,
                instance_shapes=INSTANCE_SHAPES):
    """``(cases, skipped)``: the grid in run order (shape by shape, forward then backward)."""
    limit = mem_limit_bytes(device) if mem_limit is None else mem_limit
    cases, skipped = [], []
    for dtype in dtypes:
        for norm in norms:
            if measure.layout_of(norm) == "rows":
                shapes = [((m, n), None) for n in hidden for m in rows]
            elif norm in measure.VARIANTS:  # instance norm: its groups are its channels
                shapes = [(s, None) for s in instance_shapes]
            else:
                shapes = list(groups_shapes)
            for shape, groups in shapes:
                for d in directions:
                    c = Case(norm, d, shape, dtype, groups, device)
                    (cases if fits(c, limit) else skipped).append(c)
    return cases, skipped


def half_cases(device="cpu"):
    """The 16-bit targets' sweep: each norm's large shapes in float16 and bfloat16, with float32
    for comparison (its own target is against the faster of the two copy floors)."""
    cases = []
    for dtype in HALF_DTYPES + ("float32",):
        for norm, shape, groups in (("layer_norm", (16384, 4096), None), ("rms_norm", (16384, 4096), None),
                                    ("layer_norm", (65536, 768), None), ("group_norm", (32, 256, 32, 32), 32)):
            cases += [Case(norm, d, shape, dtype, groups, device) for d in measure.DIRECTIONS]
    return cases


SMALL_ROWS = (1, 8, 64)
ROW_NORMS = tuple(n for n in ALL_NORMS if measure.layout_of(n) == "rows")  # the norms of a decoder's token
SMALL_HIDDEN = (768, 4096)


def small_cases(device="cpu"):
    """The calls a decoder makes per token: rows 1, 8, 64 at hidden 768 and 4096, every dtype."""
    return [Case(norm, d, (m, n), dtype, None, device)
            for dtype in ("float32",) + HALF_DTYPES for norm in ROW_NORMS
            for n in SMALL_HIDDEN for m in SMALL_ROWS for d in measure.DIRECTIONS]


def metadata(threads, note="", load_before=None, load_after=None, skipped=(), timing=None):
    import numba

    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel region has run yet
        layer = None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": measure.machine_info(),
        "versions": measure.versions(),
        "threads": threads,
        "threading_layer": layer,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "note": note,
        "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.run", *sys.argv[1:]]),
        "git": git_state(),
        "timing": timing or {},
        "skipped_for_memory": [c.label for c in skipped],
        "bytes": "forward: x read + y written; backward: x and dy read + dx written "
                 "(weight, bias and statistics left out); floor rows: the bytes their copies move",
        "floor": "np.copyto (one thread) of the same arrays: forward x into y; backward x and dy "
                 "into two buffers; on a GPU a device-to-device copy",
        "floor_threads": "the same copies split in blocks over numba's prange (every numba thread); "
                         "host only",
        "adapter": "numbanorm.torch's functions on torch tensors over the same memory, backward "
                   "through autograd as torch's",
        "torch_backward": "torch.autograd.grad(y, (x, weight, bias), dy, retain_graph=True) on a graph "
                          "built once outside the timing",
    }


# brand words of /proc/cpuinfo's model name that name a CPU kind for results files
CPU_KINDS = ("epyc", "xeon", "ryzen", "threadripper", "core", "graviton", "neoverse", "apple")


def cpu_kind(model=None, llvm_cpu=None):
    """The CPU kind that names a results file per machine (``targets-<kind>.json``): the
    first brand word of the model name and LLVM's name for the CPU, what the kernels are
    compiled for (``epyc-znver5``, ``xeon-emeraldrapids``: a VM's model name often says
    "AMD EPYC" alone, and Zen 3 and Zen 5 differ in vector width), or either alone."""
    words = (model if model is not None else measure.cpu_model()).lower().replace("(r)", " ").split()
    brand = next((w for w in words if w in CPU_KINDS), None)
    if llvm_cpu is None and model is None:
        llvm_cpu = measure.cpu_target()["llvm_cpu"]
    return "-".join(filter(None, (brand, (llvm_cpu or "").lower()))) or "cpu"


def git_state(root=None):
    """The commit measured, and the package files that differed from it (kernels being
    edited), of this checkout or of the one at ``root``."""
    import subprocess

    root = root or Path(__file__).resolve().parent.parent

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD").strip() or None
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "numbanorm").splitlines()]
    return {"commit": commit, "uncommitted": dirty}


def run(cases, threads=None, impls=None, peers=measure.PEERS, note="", skipped=(), cold=True,
        compile_times=True, show_progress=True, cold_python=None, draws=None, drawn_timing=None, **timing):
    """Run ``cases`` (and the cold-start measurements, their processes on ``cold_python``
    if given); returns the results dict.  ``draws``: case -> how many times to measure it,
    each further time in a fresh process (:func:`sweep_apart`, :func:`drawn`); None, once each.
    ``drawn_timing``: what replaces ``timing``'s entries for the cases measured more than once."""
    threads = measure.set_threads(threads)
    load_before = measure.loadavg()
    rows = []
    # cases in their order, each run of them measured once swept as one (consecutive cases
    # share their arrays), each case drawn more than once on its own
    for times, group in itertools.groupby(cases, key=lambda c: draws(c) if draws else 1):
        group = list(group)
        if times == 1:
            rows += measure.sweep(group, impls, peers, threads, show_progress=show_progress, desc="sweep", **timing)
            continue
        t = {**timing, **(drawn_timing or {})}
        for case in group:
            first = measure.sweep([case], impls, peers, threads, show_progress=False, **t)
            rows += drawn([first, *(sweep_apart(case, impls, peers, threads, t) for _ in range(times - 1))])
    cold_start = {}
    if cold:
        cold_start = cold_start_runs(threads, compile_times, cold_python)
    drawn_at = {"drawn": drawn_timing} if drawn_timing and draws and any(draws(c) > 1 for c in cases) else {}
    meta = metadata(threads, note, load_before, measure.loadavg(), skipped, {**timing, **drawn_at})
    return {"meta": meta, "rows": rows, "cold_start": cold_start}


# the fields of a row that are a measurement: the median of a case's draws (drawn)
MEASURED = ("median_s", "q20_s", "q80_s", "gbps", "x_floor", "x_floor_threads", "x_torch", "x_oracle")


def sweep_apart(case, impls, peers, threads, timing):
    """``measure.sweep([case], ...)``'s rows from a fresh process on this interpreter: another
    allocation of the case's arrays, at another moment, in another process (each has been a
    draw of its own on a shared VM: ``design_probes.in_cache_spread``)."""
    import dataclasses

    args = json.dumps([dataclasses.asdict(case), impls, list(peers), threads, timing])
    return in_child("import json, sys; from numbanorm.measure import Case; from benchmarks import measure; "
                    "c, impls, peers, threads, timing = json.loads(sys.argv[1]); "
                    "c['shape'] = tuple(c['shape']); "
                    "json.dump(measure.sweep([Case(**c)], impls, tuple(peers), threads, show_progress=False, "
                    "**timing), open(sys.argv[2], 'w'))", args)


def link_checkout(checkout, folder):
    """``folder`` with another checkout's ``numbanorm`` linked into it: first on a child's
    path (:func:`child_env`), that package runs under this one's ``benchmarks``, for a
    change's before and after."""
    import os

    os.symlink(Path(checkout).resolve() / "numbanorm", os.path.join(folder, "numbanorm"))
    return Path(folder)


def child_env(first=None, cache=None, **extra):
    """This process's environment for a measuring child: ``first`` (a folder of
    :func:`link_checkout`) before the repository's root on its path, ``cache`` its
    ``NUMBA_CACHE_DIR``, and ``extra`` variables."""
    import os

    env = {**os.environ, **extra}
    if first is not None:
        root = Path(__file__).parents[1]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(first), str(root), os.environ.get("PYTHONPATH"))))
    if cache is not None:
        env["NUMBA_CACHE_DIR"] = str(cache)
    return env


def in_child(code, *args, first=None, cache=None, env=None):
    """The JSON that ``python -c code *args PATH`` writes to PATH (its last argument), run on
    this interpreter from the repository's root: a measurement in a fresh process; ``first``
    and ``cache`` as :func:`child_env`'s (run from ``first`` where given), ``env`` its extra variables."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        subprocess.run([sys.executable, "-c", code, *args, str(out)], check=True,
                       cwd=first or Path(__file__).parents[1], env=child_env(first, cache, **(env or {})))
        return json.loads(out.read_text())


def drawn(draws):
    """One case's rows measured ``len(draws)`` times, each draw on arrays of its own in a process
    of its own (:func:`sweep_apart`): each row's measured fields the median of its draws',
    every ratio the median of the draws' own ratios; ``draws`` the count, ``x_floor_draws``
    the draws' ratios to np.copyto.  (Where a case's arrays stay in the cache, one draw's
    ratio is one of a wide spread on a shared VM: ``design_probes.in_cache_spread``.)"""
    out = []
    for row in draws[0]:
        same = [r for d in draws for r in d if (r["impl"], r["mode"]) == (row["impl"], row["mode"])]
        merged = dict(row, draws=len(same), x_floor_draws=[r["x_floor"] for r in same],
                      case_wall_s=round(sum(r["case_wall_s"] for r in same), 3))
        for f in MEASURED:
            values = [r[f] for r in same if r.get(f) is not None]
            merged[f] = statistics.median(values) if values else None
        out.append(merged)
    return out


def cold_start_runs(threads, compile_times=True, python=None):
    """Every operation's first call in new processes, each dtype (on interpreter ``python``):
    cached, and compiled from nothing with ``python -m numbanorm compile`` timed too
    (``compile_times``); and numba's own first call beside them (cold_start.py)."""
    from . import cold_start

    only = ("first_calls", "numba_alone") + (("compile",) if compile_times else ())
    return cold_start.run(only=only, threads=threads, python=python, fresh=compile_times, show=lambda s: None)


# ------------------------------------------------------------------ files

CSV_META = ("date", "cpu", "cores", "gpu", "threads", "numbanorm", "numba", "numpy", "torch", "python",
            "loadavg_before", "loadavg_after")
CSV_FIELDS = ("norm", "direction", "mode", "dtype", "shape", "groups", "device", "impl", "threads",
              "elements", "bytes", "median_s", "q20_s", "q80_s", "repeats", "number", "first_call_s",
              "gbps", "x_floor", "x_floor_threads", "x_torch", "x_oracle", "case_wall_s")


def _csv_meta(meta):
    m, v = meta["machine"], meta["versions"]
    la = lambda x: "" if not x else " ".join(map(str, x))  # noqa: E731
    return {"date": meta["date"], "cpu": m["cpu"], "cores": m["cores"], "gpu": m["gpu"] or "",
            "threads": meta["threads"], "numbanorm": v["numbanorm"], "numba": v["numba"],
            "numpy": v["numpy"], "torch": v["torch"] or "", "python": v["python"],
            "loadavg_before": la(meta["loadavg_before"]), "loadavg_after": la(meta["loadavg_after"])}


def write_results(results, stem, folder=RESULTS):
    """Write ``<stem>.json`` and ``<stem>.csv``; returns both paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    jpath, cpath = folder / f"{stem}.json", folder / f"{stem}.csv"
    with open(jpath, "w") as f:
        json.dump(_clean(results), f, indent=1, sort_keys=False)
        f.write("\n")
    extra = _csv_meta(results["meta"])
    with open(cpath, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(CSV_FIELDS) + [k for k in CSV_META if k not in CSV_FIELDS])
        w.writeheader()
        for r in results["rows"]:
            row = {k: r.get(k) for k in CSV_FIELDS}
            row["shape"] = "x".join(map(str, r["shape"]))
            row.update({k: v for k, v in extra.items() if k not in CSV_FIELDS})
            w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return jpath, cpath


def _clean(o):
    """JSON without NaN/Infinity (not JSON): they become null."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def load_results(path):
    with open(path) as f:
        return json.load(f)


def case_key(row):
    return (row["norm"], row["direction"], tuple(row["shape"]), row["dtype"], row["groups"], row["device"])


def merge(old, new, key=case_key):
    """``old`` with every case that ``new`` measured replaced by ``new``'s rows.

    For re-running a subset into an existing results file; the metadata of each
    run is kept (``meta`` is the newest, earlier ones under ``meta['merged']``).
    ``key``: what a re-run replaces (by default a case, with all its implementations).
    """
    redone = {key(r) for r in new["rows"]}
    rows = [r for r in old["rows"] if key(r) not in redone] + new["rows"]
    earlier = old["meta"].pop("merged", [])
    meta = dict(new["meta"], merged=earlier + [dict(old["meta"], rows_kept=len(old["rows"]) -
                                                     sum(key(r) in redone for r in old["rows"]))])
    cold = new.get("cold_start") or old.get("cold_start") or {}
    return {"meta": meta, "rows": rows, "cold_start": cold}
