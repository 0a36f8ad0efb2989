"""Generate the README's benchmark tables from results files (never typed by hand).

    python -m benchmarks.readme_table benchmarks/results/cpu.json            # rewrite README.md
    python -m benchmarks.readme_table benchmarks/results/cpu.json --print    # only print it
    python -m benchmarks.readme_table --fused benchmarks/results/fused-cpu-*.json \
        --dask benchmarks/results/dask-scaling-cpu.json                      # the other two tables
    python -m benchmarks.readme_table --e2e benchmarks/results/e2e-cpu.json  # the end-to-end model
    python -m benchmarks.readme_table --half benchmarks/results/cpu-half.json \
        benchmarks/results/cpu-small.json                                    # 16-bit and small calls
    python -m benchmarks.readme_table --targets benchmarks/results/targets-*.json \
        --cold benchmarks/results/cold-start.json  # targets per CPU, the cold start under them

Each table goes between its markers (``<!-- bench-table:start -->`` and
``<!-- bench-table:end -->``; ``fused-table``, ``dask-table`` and ``e2e-table`` for the
results of ``benchmarks/fused.py``, ``benchmarks/dask_scaling.py`` and ``benchmarks/e2e.py``,
``half-table`` for ``--half``/``--small`` runs, ``targets-table`` for the ``--targets`` runs,
one column per CPU kind);
everything else in the README is left byte for byte.  The output depends on
the results files alone, so running it twice changes nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import numpy as np

from numbanorm.measure import ITEMSIZE

START = "<!-- bench-table:start -->"
END = "<!-- bench-table:end -->"
FUSED_START, FUSED_END = "<!-- fused-table:start -->", "<!-- fused-table:end -->"
DASK_START, DASK_END = "<!-- dask-table:start -->", "<!-- dask-table:end -->"
E2E_START, E2E_END = "<!-- e2e-table:start -->", "<!-- e2e-table:end -->"
HALF_START, HALF_END = "<!-- half-table:start -->", "<!-- half-table:end -->"
TARGETS_START, TARGETS_END = "<!-- targets-table:start -->", "<!-- targets-table:end -->"
GPU_START, GPU_END = "<!-- gpu-table:start -->", "<!-- gpu-table:end -->"
README = Path(__file__).resolve().parent.parent / "README.md"

# The shapes the README shows (float32 on the CPU), in this order; the rest is in the files.
SHOWN = (("layer_norm", (256, 768)), ("layer_norm", (16384, 4096)), ("layer_norm", (65536, 768)),
         ("rms_norm", (256, 768)), ("rms_norm", (16384, 4096)), ("rms_norm", (65536, 768)),
         ("group_norm", (32, 256, 32, 32)), ("group_norm", (8, 64, 64, 64)),
         ("instance_norm", (32, 256, 32, 32)), ("instance_norm", (8, 64, 64, 64)))
PASSES = (("forward", "out", "forward, out="), ("forward", "alloc", "forward"), ("backward", "alloc", "backward"))
HEADER = ("norm", "shape", "pass", "numbanorm", "GB/s", "x copy floor", "x torch")


def _time(s):
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _ratio(v):
    return "-" if v is None else f"{v:.2f}x"


def _find(rows, norm, shape, direction, mode, dtype, device, impl):
    for r in rows:
        if (r["norm"], tuple(r["shape"]), r["direction"], r["mode"], r["dtype"], r["device"], r["impl"]) == (
                norm, shape, direction, mode, dtype, device, impl):
            return r
    return None


def large_over_torch(results, dtype="float32", device="cpu"):
    """(least, greatest) of numbanorm's time over torch's for LayerNorm and RMSNorm at the
    shown shapes of a million elements or more (allocating forward and backward), or None."""
    impl = "numbanorm.cpu" if device == "cpu" else "numbanorm.cuda"
    found = (_find(results["rows"], norm, shape, direction, mode, dtype, device, impl)
             for norm, shape in SHOWN if norm in ("layer_norm", "rms_norm") and np.prod(shape) >= 1 << 20
             for direction, mode, _ in PASSES if mode == "alloc")
    ratios = [r["x_torch"] for r in found if r is not None and r.get("x_torch") is not None]
    return (min(ratios), max(ratios)) if ratios else None


LOOSE_SPREAD = 1.3  # q80 / q20 of a row's rounds past which its median is marked
LOOSE_ROUNDS = 5   # ... and fewer rounds than this (a large case stopped at its time limit)


def _loose(r):
    """Whether a row's median is a loose one: few rounds, or rounds far apart."""
    q20, q80 = r.get("q20_s"), r.get("q80_s")
    return r.get("repeats", LOOSE_ROUNDS) < LOOSE_ROUNDS or bool(q20 and q80 and q80 / q20 > LOOSE_SPREAD)


def table_rows(results, dtype="float32", device="cpu"):
    """The cells of the table, as strings, in order."""
    impl = "numbanorm.cpu" if device == "cpu" else "numbanorm.cuda"
    out = []
    for norm, shape in SHOWN:
        for direction, mode, label in PASSES:
            r = _find(results["rows"], norm, shape, direction, mode, dtype, device, impl)
            if r is None:
                continue
            shp = "x".join(map(str, shape)) + (f", G={r['groups']}" if norm == "group_norm" else "")
            floors = [v for v in (r.get("x_floor"), r.get("x_floor_threads")) if v is not None]
            out.append((norm, shp, label, _time(r["median_s"]) + ("*" if _loose(r) else ""), f"{r['gbps']:.1f}",
                        _ratio(max(floors)) if floors else "-", _ratio(r.get("x_torch"))))
    return out


def render(results, source="benchmarks/results/cpu.json", dtype="float32", device="cpu"):
    """The markdown block (without the markers)."""
    meta = results["meta"]
    m, v = meta["machine"], meta["versions"]
    lines = [
        f"{dtype} on {m['cpu'] if device == 'cpu' else m['gpu']} ({m['cores']} cores), "
        f"{meta['threads']} thread(s) for numba and torch, {meta['date'][:10]}, at commit "
        f"`{_commit(meta)}`; numbanorm "
        f"{v['numbanorm']}, numba {v['numba']}, NumPy {v['numpy']}, torch {v['torch']}. Median of "
        "round-robin repeats. *x copy floor*: time over the faster of `np.copyto` on one thread and "
        "the same copy on every numba thread (forward: x into y, the kernel's bytes; backward: x and "
        "dy into two buffers, four arrays' bytes where the kernel moves three), into buffers the "
        "copy reuses, so a row that allocates its output also pays the fresh output's page faults "
        "against it; *x torch*: time over `torch.nn.functional` (backward through autograd); below "
        "1.00x is faster. GB/s counts x read and y written (backward: x and dy read, dx written).",
    ]
    if meta.get("note"):
        lines.append("")
        lines.append(f"Note: {meta['note']}")
    rows = table_rows(results, dtype, device)
    lines += ["", *_markdown_table(HEADER, rows, 3)]
    if any(r[3].endswith("*") for r in rows):
        lines += ["", f"\\* a median of fewer than {LOOSE_ROUNDS} rounds (a large case stops at its time "
                      f"limit) or of rounds more than {LOOSE_SPREAD}x apart (80th over 20th percentile): "
                      "a loose figure on a shared machine."]
    if span := large_over_torch(results, dtype, device):
        lines += ["", f"LayerNorm and RMSNorm at the large shapes above, allocating forward and backward: "
                      f"{span[0]:.2f}x to {span[1]:.2f}x the time of `torch.nn.functional`."]
    lines += ["", f"Generated by `python -m benchmarks.readme_table {source}`; plots and every "
                  "other shape and dtype are in `benchmarks/results/`."]
    return "\n".join(lines)


FUSED_HEADER = ("norm", "shape", "fused vs unfused, fastest", "median", "vs parallel add, median",
                "into preallocated, fastest", "median", "fused vs torch, median")


def _versions(meta, extra=()):
    v = meta["versions"]
    names = ("numbanorm", "numba", "numpy", "torch") + tuple(extra)
    shown = {"numpy": "NumPy", "dask": "Dask"}
    return ", ".join(f"{shown.get(k, k)} {v[k]}" for k in names if v.get(k))


def fused_rows(runs):
    """The cells of the fused table, one row per norm and results file of benchmarks/fused.py."""
    out = []
    for run in runs:
        res = run["results"]
        for norm in dict.fromkeys(r["norm"] for r in res):
            v = {r["variant"]: r for r in res if r["norm"] == norm}
            f, u = v["fused"], v["unfused"]
            fi, ui, t, par = v.get("fused-into"), v.get("unfused-into"), v.get("torch"), v.get("unfused-par")
            into = (_ratio(ui["min_s"] / fi["min_s"]), _ratio(ui["median_s"] / fi["median_s"])) if fi and ui \
                else ("-", "-")
            out.append((norm, "x".join(map(str, f["shape"])), _ratio(u["min_s"] / f["min_s"]),
                        _ratio(u["median_s"] / f["median_s"]),
                        _ratio(par["median_s"] / f["median_s"]) if par else "-", *into,
                        _ratio(t["median_s"] / f["median_s"]) if t else "-"))
    return out


def render_fused(runs, sources):
    """The markdown block of the fused-add speed-ups (without the markers)."""
    meta = runs[0]["meta"]
    m = meta["machine"]
    dtypes = sorted({r["dtype"] for run in runs for r in run["results"]})
    dates = sorted({run["meta"]["date"][:10] for run in runs})
    lines = [
        f"{', '.join(dtypes)} on {m['cpu']} ({m['cores']} cores), {meta['threads']} thread(s), "
        f"{', '.join(dates)}; {_versions(meta)}. Speed-up of `add_<norm>(x, r)` over the unfused pair "
        "`<norm>(np.add(x, r))`, both allocating their outputs (the fastest and the median of "
        "round-robin repeats); *vs parallel add*: over the unfused pair with the add on every thread "
        "(NumPy's runs on one); *into preallocated*: the same kernels into reused outputs "
        "(`np.add(out=)`, `out=`), without the page faults of fresh ones; *fused vs torch*: "
        "`torch.nn.functional.<norm>(x + r)` on the same threads. Above 1.00x the fused call is faster.",
        "", *_markdown_table(FUSED_HEADER, fused_rows(runs), 2)]
    lines += ["", "Generated by `python -m benchmarks.readme_table --fused " + " ".join(sources) + "`."]
    return "\n".join(lines)


def dask_header(run):
    return ("blocks", "pass", *(f"{n} worker{'s' if n > 1 else ''}" for n in run["workers"]),
            "speed-up, fastest", "median")


def dask_rows(run):
    """The cells of the Dask scaling table (GB/s of the fastest round per worker count)."""
    rows = [r for r in run["results"] if r.get("workers") is not None]
    out = []
    for c in dict.fromkeys(r["chunk_rows"] for r in rows):
        for direction in ("forward", "backward"):
            by = {r["workers"]: r for r in rows if r["chunk_rows"] == c and r["direction"] == direction}
            last = by[run["workers"][-1]]
            mib = c * run["shape"][1] * ITEMSIZE[run["dtype"]] / 2**20
            out.append((f"{c} rows ({mib:.0f} MiB)", direction,
                        *(f"{by[n]['GB/s (min)']:.1f} GB/s" for n in run["workers"]),
                        _ratio(last.get("speed-up (min)")), _ratio(last.get("speed-up (median)"))))
    return out


def render_dask(run, source):
    """The markdown block of the Dask scaling (without the markers)."""
    meta, m = run["meta"], run["meta"]["machine"]
    mem = {r["direction"]: r for r in run["results"] if r.get("workers") is None}
    shape = "x".join(map(str, run["shape"]))
    lines = [
        f"`layer_norm_forward` / `layer_norm_backward` on a {shape} {run['dtype']} Dask array, persisted "
        f"on a `LocalCluster` of worker processes with one thread each, on {m['cpu']} ({m['cores']} cores), "
        f"{meta['date'][:10]}; {_versions(meta, ('dask', 'distributed'))}. GB/s of the fastest of "
        f"{meta['rounds']} rounds (forward: x read, y written; backward: x, dy read, dx written); the "
        f"speed-up is {run['workers'][0]} worker's time over {run['workers'][-1]} workers'. In memory on "
        f"one Numba thread, for reference: forward {mem['forward']['GB/s (min)']:.1f} GB/s, backward "
        f"{mem['backward']['GB/s (min)']:.1f} GB/s.",
        "", *_markdown_table(dask_header(run), dask_rows(run), 2)]
    lines += ["", f"Generated by `python -m benchmarks.readme_table --dask {source}`."]
    return "\n".join(lines)


E2E_HEADER = ("dtype", "workload", "PyTorch's norms", "numbanorm's", "speed-up, median", "fastest",
              "time in PyTorch's norms", "in numbanorm's ops")


def _pct(v):
    return "-" if v is None else f"{100 * v:.1f} %"


def e2e_rows(run):
    """The cells of the end-to-end table: one row per dtype and workload of benchmarks/e2e.py."""
    out = []
    res = run["results"]
    for dtype, wl in dict.fromkeys((r["dtype"], r["workload"]) for r in res):
        v = {r["variant"]: r for r in res if (r["dtype"], r["workload"]) == (dtype, wl)}
        t, n = v["torch"], v["numbanorm"]
        out.append((dtype, wl, f"{t['tokens_per_s']:.1f} tok/s", f"{n['tokens_per_s']:.1f} tok/s",
                    _ratio(n["torch/this (median)"]), _ratio(n["torch/this (min)"]),
                    _pct(t["norm share (ablation, median)"]), _pct(n["numbanorm op share (profile)"])))
    return out


def e2e_beyond_noise(run):
    """``{(dtype, workload): bool}``: every numbanorm sample faster than every PyTorch-norm sample."""
    res = run["results"]
    out = {}
    for dtype, wl in dict.fromkeys((r["dtype"], r["workload"]) for r in res):
        v = {r["variant"]: r for r in res if (r["dtype"], r["workload"]) == (dtype, wl)}
        out[(dtype, wl)] = max(v["numbanorm"]["samples_s"]) < min(v["torch"]["samples_s"])
    return out


def render_e2e(run, source):
    """The markdown block of the end-to-end model (without the markers)."""
    meta, m, c = run["meta"], run["meta"]["machine"], run["meta"]["config"]
    lines = [
        f"`transformers.LlamaForCausalLM` with random weights: hidden {c['hidden']}, {c['layers']} layers, "
        f"intermediate {c['intermediate']}, {c['heads']} heads ({c['kv_heads']} key/value), vocabulary "
        f"{c['vocab']}; on {m['cpu']} ({m['cores']} cores), {meta['threads']} thread(s) for numba and torch, "
        f"{meta['date'][:10]}; {_versions(meta, ('transformers',))}; load average "
        f"{meta['loadavg_before'][0]:.1f} before, {meta['loadavg_after'][0]:.1f} after. Tokens per second "
        f"(median of {meta['rounds']} round-robin rounds) of a {c['prefill']}-token prefill, of "
        f"{c['decode']} single-token decode steps after it and of one training step (forward, backward and "
        f"SGD over {c['train']} tokens); *speed-up*: PyTorch-norm time over numbanorm-norm time, above "
        "1.00x numbanorm is faster; *time in PyTorch's norms*: the step's time minus that of the same "
        "model with its norms replaced by the identity, as a share; *in numbanorm's ops*: profiled share "
        "of the numbanorm variant inside numbanorm's operators."]
    if meta.get("note"):
        lines += ["", f"Note: {meta['note']}"]
    for dtype, why in meta.get("skipped", {}).items():
        lines += ["", f"{dtype}: not measured ({why})."]
    lines += ["", *_markdown_table(E2E_HEADER, e2e_rows(run), 2)]
    verdict = e2e_beyond_noise(run)
    faster = [f"{d} {w}" for (d, w), v in verdict.items() if v]
    within = [f"{d} {w}" for (d, w), v in verdict.items() if not v]
    lines += ["", f"Faster beyond the noise (every numbanorm sample faster than every PyTorch one): "
                  f"{', '.join(faster) or 'none'}; within the noise: {', '.join(within) or 'none'}. Where the "
                  "norms take a share p of a step, no norm kernel can speed it up by more than 1/(1-p); the "
                  "matrix products take the rest. p is measured (the same model with identity norms) and "
                  "as noisy as the rest."]
    lines += ["", f"Generated by `python -m benchmarks.readme_table --e2e {source}`."]
    return "\n".join(lines)


# 16-bit at the sizes of the speed targets, then the small calls a decoder makes per token
HALF_SHOWN = tuple((n, (16384, 4096), dt) for n in ("layer_norm", "rms_norm")
                   for dt in ("float16", "bfloat16", "float32")) + (
    ("layer_norm", (65536, 768), "float16"), ("layer_norm", (65536, 768), "bfloat16"))
SMALL_SHOWN = tuple(("layer_norm", s, dt) for dt in ("float32", "float16", "bfloat16")
                    for s in ((1, 768), (1, 4096), (8, 4096), (64, 4096)))
HALF_HEADER = ("norm", "shape", "dtype", "pass", "numbanorm", "x faster copy floor", "x torch",
               "via numbanorm.torch, x torch")


def half_rows(rows):
    """The cells of the 16-bit and small-call table (numbanorm.cpu on NumPy arrays, and the
    same kernels on torch tensors through numbanorm.torch)."""
    out = []
    for norm, shape, dtype in HALF_SHOWN + SMALL_SHOWN:
        passes = PASSES if shape[0] > 64 else (("forward", "alloc", "forward"), ("backward", "alloc", "backward"))
        for direction, mode, label in passes:
            r = _find(rows, norm, shape, direction, mode, dtype, "cpu", "numbanorm.cpu")
            if r is None:
                continue
            a = _find(rows, norm, shape, direction, mode, dtype, "cpu", "numbanorm.torch")
            floors = [v for v in (r.get("x_floor"), r.get("x_floor_threads")) if v is not None]
            out.append((norm, "x".join(map(str, shape)), dtype, label, _time(r["median_s"]),
                        _ratio(max(floors)) if mode == "out" and floors else "-",
                        _ratio(r.get("x_torch")), _ratio(a.get("x_torch")) if a else "-"))
    return out


def render_half(runs, sources):
    """The markdown block of the 16-bit and small-call runs (without the markers)."""
    meta = runs[0]["meta"]
    m = meta["machine"]
    dates = sorted({run["meta"]["date"][:10] for run in runs})
    loads = ", ".join(f"{run['meta']['loadavg_before'][0]:.1f}" for run in runs if run["meta"].get("loadavg_before"))
    lines = [
        f"On {m['cpu']} ({m['cores']} cores), {meta['threads']} thread(s) for numba and torch, "
        f"{', '.join(dates)}; {_versions(meta)}; load average before each run: {loads}. Median of "
        "round-robin repeats. float16 as NumPy's, bfloat16 as `ml_dtypes.bfloat16` arrays, and the same "
        "memory as torch tensors for the two torch columns. *x faster copy floor*: time over the faster of "
        "`np.copyto` (one thread) and the same copy over every numba thread, into a preallocated `out=`; "
        "*x torch*: over `torch.nn.functional` on the same dtype (backward through autograd); *via "
        "numbanorm.torch*: numbanorm's kernels called through its PyTorch functions, over the same torch "
        "time. Below 1.00x is faster.",
        "", *_markdown_table(HALF_HEADER, half_rows([r for run in runs for r in run["rows"]]), 4)]
    lines += ["", "Generated by `python -m benchmarks.readme_table --half " + " ".join(sources) + "`."]
    return "\n".join(lines)


def _target_cell(e):
    if e is None or e["value"] is None:
        return "not measured"
    v = f"{e['value']:.2f}x" if e["unit"].startswith("x") else f"{e['value']:.3f} s"
    if e.get("detail"):  # (what the row's case leaves to each run: the slowest dtype, SciPy, a count)
        v += f" ({e['detail']})"
    return v if e["status"] == "PASS" else f"**{v} {e['status']}**"


def _limit(e):
    return f"{e['limit']}{e['unit']}" if e["unit"].startswith("x") else f"{e['limit']} s"


def targets_rows(runs):
    """The cells of the targets table: one row per target and case of any run, one column
    per run (its value, FAIL in bold, or "not measured")."""
    from . import targets

    # (a cold-start row by operation and direction; each run's slowest dtype goes in its cell)
    evs = [{(e["rule"], e.get("row", e["case"])): e for e in targets.evaluate(run)} for run in runs]
    keys = list(dict.fromkeys(k for ev in evs for k in ev))
    return [(rule, case, _limit(next(ev[(rule, case)] for ev in evs if (rule, case) in ev)),
             *(_target_cell(ev.get((rule, case))) for ev in evs)) for rule, case in keys]


def _listed(words):
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(filter(None, (", ".join(words[:-1]), words[-1])))


def _run_line(kind, run, source, newest):
    """What a column was measured on, when and at which commit; how much older than the newest run."""
    from . import targets

    meta, m = run["meta"], run["meta"]["machine"]
    t = m.get("cpu_target")
    target = (f"LLVM's {t['llvm_cpu']}, 16-bit rows {'512' if t['wide_16bit_rows'] else '256'} bits wide"
              if t else "CPU target not recorded")
    if t and t.get("bfloat16_by_instruction"):  # (older runs did not record it)
        target += ", bfloat16 narrowed by vcvtneps2bf16"
    commit = _commit(meta)
    n = {s: sum(e["status"] == s for e in targets.evaluate(run)) for s in ("PASS", "FAIL", "MISSING")}
    line = (f"- *{kind}*: {m['cpu']} ({m['cores']} cores; {target}), {meta['threads']} threads, measured "
            f"{meta['date'][:10]} at commit `{commit}` (`{source}`): {n['PASS']} pass, {n['FAIL']} fail, "
            f"{n['MISSING']} not measured.")
    for earlier in meta.get("merged", []):  # (benchmarks.harness.merge: a subset re-run into the file)
        line += (f" The rows that run did not re-measure: {earlier['date'][:10]} at commit "
                 f"`{_commit(earlier)}`.")
    cold = run.get("cold_start") or {}
    if cold.get("numba_alone"):
        line += f" {_numba_alone(cold)}."
    line += _compile_and_main_job(cold)
    days = (_date(newest) - _date(meta["date"])).days
    if days > 0:
        line += (f" **{days} day(s) older than the newest file here: what changed since is not measured "
                 f"on this CPU**; its 'not measured' rows are targets added after it.")
    return line


def _date(iso):
    import datetime as dt

    return dt.date.fromisoformat(iso[:10])


def _by_sample(kinds, runs):
    """``{sample length in s: [kinds]}`` of the runs that timed their drawn cases in samples
    of a set length (one sentence names every kind that shares one)."""
    out = {}
    for k, r in zip(kinds, runs):
        if s := r["meta"].get("timing", {}).get("drawn", {}).get("min_sample_s"):
            out.setdefault(s, []).append(k)
    return out


def render_targets(runs, sources, cold=None):
    """The markdown block of the speed targets per CPU kind (without the markers); ``cold``:
    ``(results, source)`` of a ``benchmarks.cold_start`` run, stated under the table."""
    from .harness import cpu_kind

    # the kind a file is named by (targets-<kind>.json), else what its metadata says
    named = [re.fullmatch(r"(?:.*/)?targets-(.+)\.json", s) for s in sources]
    kinds = [m[1] if m else cpu_kind(r["meta"]["machine"]["cpu"], (r["meta"]["machine"].get("cpu_target") or {}).get("llvm_cpu"))
             for r, m in zip(runs, named)]
    newest = max(r["meta"]["date"] for r in runs)
    lines = ["The speed targets (`benchmarks/targets.py`) as measured by `python -m benchmarks.run --targets` "
             "on each CPU kind the project runs on, one results file per kind; a ratio is numbanorm's median "
             "time over the peer's, on 2 threads for numba and torch. A run holds for the code at its commit."
             + (" Where a run measured a case in several processes, each on arrays of its own "
                "(`targets.DRAWN`: the cases whose arrays stay in cache), a ratio is the median of theirs"
                + "".join(f"; {_listed([f'*{k}*' for k in ks])} timed those in samples of {1e3 * s:g} ms"
                          for s, ks in _by_sample(kinds, runs).items())
                + "." if any(r.get("draws") for run in runs for r in run["rows"]) else ""),
             "", *(_run_line(k, r, s, newest) for k, r, s in zip(kinds, runs, sources)),
             "", *_markdown_table(("target", "case", "limit", *kinds), targets_rows(runs), 3),
             ""]
    command = "python -m benchmarks.readme_table --targets " + " ".join(sources)
    if cold:
        lines += [_cold_line(*cold), ""]
        command += f" --cold {cold[1]}"
    lines.append(f"Generated by `{command}`.")
    return "\n".join(lines)


def _cold_line(run, source):
    """The first calls of a cold-start run (``benchmarks/cold_start.py``), its compile command and main job."""
    meta, c = run["meta"], run["cold_start"]
    fresh = [e["first_call_s"] for e in c.get("fresh_cache") or []]
    cached = [e["first_call_s"] for e in c.get("cached") or []]
    imports = [e["import_s"] for e in c.get("cached") or []]
    line = f"Cold start (`{source}`, {meta['machine']['cpu']}, {meta['date'][:10]}, commit `{_commit(meta)}`): "
    if fresh:
        line += f"the first call of each of {len(fresh)} operation, direction and dtype from an empty cache, {min(fresh):.2f}-{max(fresh):.2f} s; "
    if cached:
        line += f"from a filled cache at most {max(cached):.2f} s; `import numbanorm` {statistics.median(imports):.2f} s (median)"
    if c.get("numba_alone"):
        line += "; " + _numba_alone(c)
    return line + "." + _compile_and_main_job(c)


def _numba_alone(cold):
    """The machine's pace that day, which the cold-start limits sit on: Numba's own import and
    the first call of a cached trivial function, each in a new process."""
    a = cold["numba_alone"]
    return f"Numba alone beside it: import {a['import_s']:.2f} s, a cached trivial function {a['first_call_s']:.2f} s"


def _compile_and_main_job(cold):
    """What a run's ``cold_start`` section says of ``python -m numbanorm compile`` (from an
    empty cache) and of the README's main job, as sentences (empty where it has neither)."""
    out = ""
    if cold.get("compile_command"):
        c = cold["compile_command"]
        out += f" `python -m numbanorm compile --dtypes {' '.join(c['dtypes'])}`: {c['wall_s']:.0f} s."
    if cold.get("main_job"):
        j = cold["main_job"]
        out += (f" The README's main job from a copy of the clone: {j['total_s']:.0f} s (venv {j['venv_s']:.0f} s, "
                f"pip install {j['pip_install_s']:.0f} s, `python -m numbanorm` {j['main_job_s']:.0f} s).")
    if cold.get("test_command"):
        j = cold["test_command"]
        out += (f" The README's test command from a copy of the clone: {j['total_s']:.0f} s (venv {j['venv_s']:.0f} s, "
                f"pip install {j['pip_install_s']:.0f} s, `python -m pytest` {j['tests_s']:.0f} s).")
    return out


def _commit(meta):
    """A run's commit, short."""
    return ((meta.get("git") or {}).get("commit") or "?")[:7]


GPU_PEERS = ("torch", "torch.compile", "liger")


def gpu_checks(run):
    """Rows (check, result) of one ``benchmarks.gpu_check`` run: the sections it ran."""
    out, c = [], run["correctness"]
    if c["cases"]:
        not_run = sum(x["status"] == "not run" for x in c["cases"])
        resumed = run.get("resumed") or {}
        carried = f" ({resumed['carried']} of them carried from `{resumed['from']}`)" if resumed.get("carried") else ""
        out.append(("correctness", f"{c['passed']} passed{carried}, {c['failed']} failed, {not_run} not reached"))
    tools = run["sanitizer"].get("tools") or {}
    if tools:
        out.append(("compute-sanitizer", ", ".join(
            f"{k} {'-' if v['errors'] is None else v['errors']} errors ({v['cases_run']}/{v['cases']} cases)"
            for k, v in tools.items())))
    host = run["host_us"]
    if host.get("numbanorm"):
        shapes = " / ".join("x".join(map(str, s)) for s in host["shape"])
        out.append((f"host us per call, {host.get('dtype', '')} {shapes}", "; ".join(
            f"{k} {'/'.join(f'{v:.0f}' for v in host['numbanorm'][k])} (torch "
            f"{'/'.join(f'{v:.0f}' for v in host['torch'][k])})" for k in host["numbanorm"])))
    g = run["cuda_graph"]
    if g.get("max_abs_diff") is not None:  # (a run that captured)
        out.append(("CUDA graph", f"captured {g['captured']}, max abs difference from torch eager "
                                  f"{g['max_abs_diff']:.1e}, training step captured {g.get('train_step_captured')}"))
    for r in run["cpu_scaling"]:
        if (r["norm"], r["pass"], r["mode"], r["dtype"], r["threads"]) == ("layer_norm", "forward", "out",
                                                                           "float32", 16):
            out.append(("CPU, 16 threads", f"LayerNorm forward out= float32 {'x'.join(map(str, r['shape']))}: "
                                           f"{r['vs_copy']:.2f}x the copy's time on 16 threads"))
    return out


def gpu_speed_rows(run):
    """One row per timed case: numbanorm's GB/s, its fraction of the copy's, the model's
    prediction of it, and its time over each peer's (below 1.00x: faster)."""
    by = {}
    for r in run["speed"]:
        by.setdefault((r["norm"], r["pass"], r["dtype"], tuple(r["shape"])), {})[r["impl"]] = r
    from . import gpu_model

    model = {(m["norm"], m["pass"], m["dtype"], tuple(m["shape"])): m for m in run.get("model") or []}
    cal = gpu_model.calibration(run)
    rows = []
    for (norm, p, dtype, shape), impls in sorted(by.items()):
        ours, copy = impls.get("numbanorm"), impls.get("copy")
        if not ours or not copy:
            continue
        m = model.get((norm, p, dtype, shape), {})
        ratio = m.get("model_issue_memory_ratio")
        rows.append((norm, p, dtype, "x".join(map(str, shape)), f"{ours['gbps']:.0f}",
                     f"{copy['ms'] / ours['ms']:.2f}",
                     "-" if m.get("model_fraction") is None else f"{m['model_fraction']:.2f}",
                     "-" if ratio is None or not cal or not m.get("single_launch", True)
                     else f"{gpu_model.calibrated_fraction(ratio, cal['a']):.2f}",
                     *(_ratio(ours["ms"] / impls[k]["ms"]) if k in impls else "-" for k in GPU_PEERS)))
    return rows


def render_gpu(runs, sources):
    """The markdown block of the GPU runs (``benchmarks.gpu_check``), without the markers."""
    first = runs[0]
    v = first["versions"]
    lines = [f"**Measured** on an {first['device']} (driver {first['driver']}) by `benchmarks.gpu_check`; "
             f"numba-cuda {v['numba-cuda']}, numba {v['numba']}, NumPy {v['numpy']}, torch {v['torch']}, "
             f"Triton {v['triton']}, Liger-Kernel {v['liger-kernel']}. Each run's sections:", ""]
    rows = [(f"`{src}`", check, result) for run, src in zip(runs, sources) for check, result in gpu_checks(run)]
    lines += _markdown_table(("run", "check", "result"), rows, 3)
    # one speed table: the run that timed the most cases (the others' rows stay in their JSON)
    speeds = [gpu_speed_rows(run) for run in runs]
    best = max(range(len(runs)), key=lambda k: (len(speeds[k]), -k))
    if speeds[best]:
        run, src, speed = runs[best], sources[best], speeds[best]
        from . import gpu_model

        cal = gpu_model.calibration(run)
        fit = (f"*calibrated*: 1 / (1 + a x the model's issue/memory ratio), a = {cal['a']:.2f} fitted on "
               f"these {cal['rows']} rows (in-sample: RMS error {cal['rms']:.2f}, worst {cal['worst']:.2f})"
               if cal else "*calibrated*: no row to fit")
        lines += ["", f"Speed in `{src}` (CUDA events, round-robin in one process): *of copy* is a "
                      "device-to-device copy's time over numbanorm's for the same bytes; *model* is the "
                      "static SASS model's prediction of that fraction (`benchmarks.gpu_model`); "
                      f"{fit}; *x peer* is numbanorm's time over the peer's, below 1.00x faster.", ""]
        lines += _markdown_table(("norm", "pass", "dtype", "shape", "GB/s", "of copy", "model", "calibrated",
                                  *(f"x {k}" for k in GPU_PEERS)), speed, 4)
        lines += _gpu_later_speed(speeds, sources, best)
    lines += ["", f"Generated by `python -m benchmarks.readme_table --gpu {' '.join(sources)}`."]
    return "\n".join(lines)


def _gpu_later_speed(speeds, sources, best):
    """Lines of a table of the last run with speed rows (``speeds``: each run's
    ``gpu_speed_rows``) after ``best`` (newer kernels timed in a shorter run): each of its
    rows beside the same case in ``best``."""
    later = [k for k in range(best + 1, len(speeds)) if speeds[k]]
    if not later:
        return []
    k = later[-1]
    before = {r[:4]: r for r in speeds[best]}
    rows = [(*r[:4], before[r[:4]][5] if r[:4] in before else "-", r[5], *r[8:]) for r in speeds[k]]
    return ["", f"Speed in `{sources[k]}`, a later run of newer kernels, beside the same cases in "
                f"`{sources[best]}` (*of copy*, *x peer* as above):", "",
            *_markdown_table(("norm", "pass", "dtype", "shape", "of copy, before", "of copy",
                              *(f"x {p}" for p in GPU_PEERS)), rows, 4)]


def _markdown_table(header, rows, text_cols):
    """Lines of a markdown table: the first ``text_cols`` columns left-aligned, the rest right."""
    return (["| " + " | ".join(header) + " |",
             "|" + "|".join(["---"] * text_cols + ["---:"] * (len(header) - text_cols)) + "|"]
            + ["| " + " | ".join(cells) + " |" for cells in rows])


def update(text, block, start=START, end=END):
    """``text`` with the part between the markers replaced by ``block``; ValueError without markers."""
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"README has no {start} ... {end} markers")
    return text[: i + len(start)] + "\n" + block + "\n" + text[j:]


def parse(text, start=START, end=END):
    """The table cells between the markers (for checking a README against its results file)."""
    i, j = text.find(start), text.find(end)
    body = text[i + len(start):j]
    rows = []
    for line in body.splitlines():
        if line.startswith("| ") and not re.match(r"^\|\s*(norm|blocks|dtype|target)\s*\|", line):
            rows.append(tuple(c.strip() for c in line.strip().strip("|").split("|")))
    return rows


def _source(path):
    try:
        return Path(path).resolve().relative_to(README.parent).as_posix()
    except ValueError:
        return str(path)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.readme_table", description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", help="a results JSON file of benchmarks.run (the main table)")
    ap.add_argument("--fused", nargs="+", metavar="JSON", help="results of benchmarks/fused.py")
    ap.add_argument("--dask", metavar="JSON", help="results of benchmarks/dask_scaling.py")
    ap.add_argument("--e2e", metavar="JSON", help="results of benchmarks/e2e.py")
    ap.add_argument("--half", nargs="+", metavar="JSON", help="results of benchmarks.run --half and --small")
    ap.add_argument("--targets", nargs="+", metavar="JSON", help="results of benchmarks.run --targets, one per CPU kind")
    ap.add_argument("--cold", metavar="JSON", help="with --targets: results of benchmarks.cold_start, "
                    "whose first calls, compile command and main job are stated under the table")
    ap.add_argument("--gpu", nargs="+", metavar="JSON", help="results of benchmarks.gpu_check, one per run")
    ap.add_argument("--readme", default=str(README), help="the README to update (default: the repository's)")
    ap.add_argument("--print", action="store_true", help="print the blocks instead of writing the README")
    a = ap.parse_args(argv)
    from .harness import load_results

    blocks = []
    if a.results:
        blocks.append((render(load_results(a.results), _source(a.results)), START, END))
    if a.fused:
        sources = [_source(p) for p in a.fused]
        blocks.append((render_fused([load_results(p) for p in a.fused], sources), FUSED_START, FUSED_END))
    if a.dask:
        blocks.append((render_dask(load_results(a.dask), _source(a.dask)), DASK_START, DASK_END))
    if a.e2e:
        blocks.append((render_e2e(load_results(a.e2e), _source(a.e2e)), E2E_START, E2E_END))
    if a.half:
        sources = [_source(p) for p in a.half]
        blocks.append((render_half([load_results(p) for p in a.half], sources), HALF_START, HALF_END))
    if a.targets:
        sources = [_source(p) for p in a.targets]
        cold = (load_results(a.cold), _source(a.cold)) if a.cold else None
        blocks.append((render_targets([load_results(p) for p in a.targets], sources, cold), TARGETS_START,
                       TARGETS_END))
    if a.gpu:
        runs = [json.loads(Path(p).read_text()) for p in a.gpu]
        blocks.append((render_gpu(runs, [_source(p) for p in a.gpu]), GPU_START, GPU_END))
    if not blocks:
        ap.error("give a results file, --fused, --dask, --e2e, --half, --targets or --gpu")
    if a.print:
        print("\n\n".join(b for b, _, _ in blocks))
        return 0
    path = Path(a.readme)
    text = path.read_text()
    new = text
    for block, start, end in blocks:
        new = update(new, block, start, end)
    if new != text:
        path.write_text(new)
        print(f"updated {path}")
    else:
        print(f"{path} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
