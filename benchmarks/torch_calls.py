"""numbanorm.torch's cost per call against PyTorch's own eager call, on small inputs (CPU).

    python -m benchmarks.torch_calls                    # print the table (every thread numba sees)
    python -m benchmarks.torch_calls --threads 2 --out torch-calls   # and write results/torch-calls.json
    python -m benchmarks.torch_calls --threads 2 --budget 2 --merge targets-epyc-znver5
                                            # these rows re-measured into a targets file

A decoder calls its norms once per layer per token on a few rows, so what such a call
costs is Python's and PyTorch's work around the kernel.  Each case times numbanorm.torch
and its PyTorch peer in alternated rounds (``numbanorm.measure.time_runners``):

* ``no_grad`` forward: the function on tensors that need no gradient
  (``F.layer_norm``), the module under ``torch.no_grad()`` (``torch.nn.LayerNorm``);
* ``grad`` forward: x (and the function's weight and bias, the module's parameters)
  need a gradient, so each call records a graph;
* ``grad`` backward: ``torch.autograd.grad`` of a graph recorded once, as the sweep's
  backward rows are timed.

Rows: impl ``numbanorm.torch`` and ``torch``; mode ``no_grad`` or ``grad`` for the
functions, ``module_no_grad`` or ``module_grad`` for the modules; ``x_torch`` is the
ratio to torch's row of the same case.  ``benchmarks.targets`` states the
limits and ``python -m benchmarks.run --targets`` measures these cases with the others.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from numbanorm import machine, measure
from numbanorm.measure import Case, Runner

SHAPES = ((1, 768), (1, 4096), (8, 4096))
IMPLS = ("numbanorm.torch", "torch")
# (direction, mode) of every case: the functions', then the modules'
PASSES = tuple((d, f"{kind}{m}") for kind in ("", "module_")
               for d, m in (("forward", "no_grad"), ("forward", "grad"), ("backward", "grad")))


def _calls(shape, direction, mode, seed=0):
    """``{impl: fn}`` of one case: numbanorm.torch's function or module, and torch's."""
    import torch

    import numbanorm.torch as nt

    inp = measure.Inputs(Case("layer_norm", "forward", shape), measure.HostSide(), seed)
    x, w, b = (torch.from_numpy(a) for a in (inp.x, inp.w, inp.b))
    n = shape[-1]
    grad = mode in ("grad", "module_grad")
    xg = x.detach().clone().requires_grad_(grad)
    if mode.startswith("module_"):
        modules = {}
        for impl, cls in zip(IMPLS, (nt.LayerNorm, torch.nn.LayerNorm)):
            m = modules[impl] = cls(n)
            with torch.no_grad():
                m.weight.copy_(w)
                m.bias.copy_(b)
        calls = {impl: (lambda m=m: m(xg)) if grad else _no_grad(m, xg) for impl, m in modules.items()}
        wrt = {impl: [xg, *m.parameters()] for impl, m in modules.items()}
    else:
        wg, bg = (t.detach().clone().requires_grad_(grad) for t in (w, b))
        calls = {impl: (lambda f=f: f(xg, (n,), wg, bg)) for impl, f in zip(IMPLS, (nt.layer_norm,
                                                                                    torch.nn.functional.layer_norm))}
        wrt = {impl: [xg, wg, bg] for impl in IMPLS}
    if direction == "forward":
        return calls
    dy = torch.from_numpy(inp.dy)
    graphs = {impl: f() for impl, f in calls.items()}  # each graph recorded once
    return {impl: (lambda y=y, v=wrt[impl]: torch.autograd.grad(y, v, dy, retain_graph=True))
            for impl, y in graphs.items()}


def _no_grad(module, x):
    import torch

    def call():
        with torch.no_grad():
            return module(x)

    return call


def rows(threads=None, shapes=SHAPES, **timing):
    """The result rows of every case (``benchmarks.harness``'s row format); ``timing`` goes
    to ``numbanorm.measure.time_runners``."""
    threads = measure.set_threads(threads)
    out = []
    for shape in shapes:
        case = Case("layer_norm", "forward", shape)
        for direction, mode in PASSES:
            runners = [Runner(impl, mode, fn) for impl, fn in _calls(shape, direction, mode).items()]
            measure.time_runners(runners, **timing)
            torch_median = next(r.quantiles()[1] for r in runners if r.impl == "torch")
            for r in runners:
                q20, m, q80 = r.quantiles()
                out.append({
                    "norm": "layer_norm", "direction": direction, "mode": mode, "dtype": "float32",
                    "shape": list(shape), "groups": None, "device": "cpu", "impl": r.impl, "threads": threads,
                    "elements": case.elements, "bytes": Case("layer_norm", direction, shape).bytes,
                    "median_s": m, "q20_s": q20, "q80_s": q80, "repeats": len(r.samples), "number": r.number,
                    "first_call_s": r.first_call_s, "gbps": None, "x_floor": None, "x_floor_threads": None,
                    "x_torch": m / torch_median, "x_oracle": None})
    return out


def table(rows_):
    """The rows as text: one line per case, numbanorm.torch's time, torch's, the ratio."""
    lines = [f"{'case':<36} {'numbanorm.torch':>16} {'torch':>10} {'ratio':>7}"]
    by = {(r["impl"], r["direction"], r["mode"], tuple(r["shape"])): r for r in rows_}
    for (impl, direction, mode, shape), r in by.items():
        if impl != "numbanorm.torch":
            continue
        p = by[("torch", direction, mode, shape)]
        label = f"{'x'.join(map(str, shape))} {direction} {mode}"
        lines.append(f"{label:<36} {r['median_s'] * 1e6:>13.1f} us {p['median_s'] * 1e6:>7.1f} us "
                     f"{r['x_torch']:>6.2f}x")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.torch_calls", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, help="threads for numba and torch (default: all)")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds of timed rounds per case (default 0.5)")
    ap.add_argument("--min-repeats", type=int, default=15)
    ap.add_argument("--out", help="also write benchmarks/results/<stem>.json and .csv")
    ap.add_argument("--merge", metavar="STEM", help="replace these rows in benchmarks/results/<STEM>.json "
                                                    "(a targets file: the rest of it is kept)")
    ap.add_argument("--dir", help="results folder (default benchmarks/results)")
    a = ap.parse_args(argv)
    if machine.torch_or_none() is None:
        print("torch is not installed", file=sys.stderr)
        return 1
    got = rows(a.threads, budget_s=a.budget, min_repeats=a.min_repeats)
    print(table(got))
    if a.out or a.merge:
        from . import harness

        res = {"meta": harness.metadata(measure.set_threads(a.threads), timing={"budget_s": a.budget}),
               "rows": got, "cold_start": {}}
        folder = Path(a.dir) if a.dir else harness.RESULTS
        if a.out:
            print("wrote", *harness.write_results(res, a.out, folder))
        if a.merge:
            # (by implementation and mode: the kernel's own rows of the same case stay)
            res = harness.merge(harness.load_results(folder / f"{a.merge}.json"), res,
                                key=lambda r: (*harness.case_key(r), r["impl"], r["mode"]))
            print("wrote", *harness.write_results(res, a.merge, folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
