"""The benchmark harness: byte accounting, ratio arithmetic, result files, README table, targets.

Everything here runs on tiny shapes (or on synthetic timings, where the
arithmetic is the point), so it takes seconds.
"""

import csv
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repository's benchmarks/ package (not installed)

from benchmarks import compare, harness, measure, readme_table, targets  # noqa: E402
from benchmarks.measure import Case, Runner  # noqa: E402


# ------------------------------------------------------------------ byte accounting


def test_bytes_forward_backward_and_floor():
    c = Case("layer_norm", "forward", (4, 8), "float32")
    assert c.elements == 32 and c.nbytes == 128
    assert c.bytes == 2 * 128          # x read + y written
    assert c.floor_bytes == 2 * 128    # np.copyto(y, x) reads x, writes y
    b = Case("layer_norm", "backward", (4, 8), "float64")
    assert b.nbytes == 256
    assert b.bytes == 3 * 256          # x, dy read + dx written
    assert b.floor_bytes == 4 * 256    # x and dy each copied: 2 reads + 2 writes
    h = Case("rms_norm", "backward", (3, 5), "bfloat16", device="gpu")
    assert h.bytes == 3 * 15 * 2


def test_group_and_instance_cases():
    g = Case("group_norm", "forward", (2, 6, 3, 4), "float32", groups=3)
    assert g.params == 6 and g.nbytes == 2 * 6 * 12 * 4
    i = Case("instance_norm", "forward", (2, 6, 3, 4))
    assert i.groups == 6
    with pytest.raises(ValueError, match="dividing C"):
        Case("group_norm", "forward", (2, 6, 3), groups=4)
    with pytest.raises(ValueError, match="one group per channel"):
        Case("instance_norm", "forward", (2, 6, 3), groups=3)
    with pytest.raises(ValueError, match="norm must be"):
        Case("batch_norm", "forward", (2, 6))


def _runner(impl, mode, samples):
    r = Runner(impl, mode, fn=lambda: None)
    r.samples = list(samples)
    return r


def test_ratio_arithmetic_on_synthetic_timings():
    case = Case("layer_norm", "forward", (256, 768), "float32")
    runners = [
        _runner("numbanorm.cpu", "out", [1.0e-3, 1.1e-3, 1.2e-3, 0.9e-3, 5e-3]),  # median 1.1e-3
        _runner("numbanorm.cpu", "alloc", [2e-3] * 5),
        _runner("torch", "alloc", [4e-3] * 5),
        _runner("floor", "out", [0.5e-3] * 5),
    ]
    rows = {(r["impl"], r["mode"]): r for r in measure.result_rows(case, runners, threads=2)}
    out = rows[("numbanorm.cpu", "out")]
    assert out["median_s"] == pytest.approx(1.1e-3)
    assert out["q20_s"] == pytest.approx(np.quantile([1.0, 1.1, 1.2, 0.9, 5.0], 0.2) * 1e-3)
    assert out["x_floor"] == pytest.approx(1.1e-3 / 0.5e-3)
    assert out["x_torch"] is None             # torch has no out=: no like-for-like ratio
    assert out["gbps"] == pytest.approx(case.bytes / 1.1e-3 / 1e9)
    alloc = rows[("numbanorm.cpu", "alloc")]
    assert alloc["x_torch"] == pytest.approx(0.5)
    assert alloc["x_floor"] == pytest.approx(4.0)
    assert alloc["x_oracle"] is None          # not measured
    floor = rows[("floor", "out")]
    assert floor["x_floor"] == pytest.approx(1.0)
    assert floor["bytes"] == case.floor_bytes
    assert all(r["threads"] == 2 and r["repeats"] == 5 for r in rows.values())


def test_round_robin_timing_counts_and_order():
    calls = []
    runners = [Runner(name, "out", fn=(lambda n=name: calls.append(n))) for name in "abc"]
    rounds = measure.time_runners(runners, repeats=4, min_sample_s=0, max_number=1)
    assert rounds == 4
    assert all(len(r.samples) == 4 and r.number == 1 and r.first_call_s >= 0 for r in runners)
    timed = calls[6:]  # a first call and a warm-up call each
    assert timed == list("abc" "bca" "cab" "abc")  # each round starts one runner later


def test_a_slow_first_warm_call_does_not_set_the_calls_per_sample():
    """A repeated 16-bit small call loads a kernel specialization of its own on its
    second call (the first warm one): timed alone, its 10 ms set one call a sample,
    and every sample of a 5 us call was then one call, 13 us with the timer and the
    other runners' cache traffic between (the README showed them 2x slow).  A second
    warm call sets it."""
    import time as _time

    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= 2:  # the first call and the first warm call: a "kernel load"
            _time.sleep(0.01)

    r = Runner("a", "out", fn=fn)
    measure.time_runners([r], repeats=2, min_sample_s=2e-3)
    assert r.number > 5  # (the slow call sets 1; a fast one ~1000, fewer where a busy machine stalls it)
    assert len(calls) == 3 + 2 * r.number  # first, two warm calls, two rounds


def test_a_first_warm_call_shorter_than_a_sample_does_not_set_the_calls_per_sample():
    """The first warm call of an allocating 8 MiB forward faulted in its output's pages
    (5 ms of a 0.2 ms call): under a sample of 20 ms it set 4 calls a sample, and the
    first call of each, after the other runners' arrays had passed through the cache,
    weighed a quarter of every sample.  The faster of two warm calls sets it."""
    import time as _time

    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= 2:  # the first call and the first warm call
            _time.sleep(0.005)

    r = Runner("a", "out", fn=fn)
    measure.time_runners([r], repeats=1, min_sample_s=0.02)
    assert r.number > 20
    assert len(calls) == 3 + r.number


def test_no_sample_is_timed_before_what_the_warm_calls_handed_to_the_compile_thread(monkeypatch):
    """A small numbanorm.torch call learns its plan on its first call and asks for the plan's
    entry on its second (the first warm call), which hands it to the compile thread.  Timed
    at once, every sample took the full path while that compile shared the two cores: with
    an empty Numba cache the (1, 768) forward took 267 us, 50x torch, and the backward 11x.
    The wait comes after the first warm call as well as after the first call."""
    from numbanorm import measure as core

    events = []
    monkeypatch.setattr(core, "compiled_in_background", lambda: events.append("wait"))
    runners = [Runner(name, "out", fn=(lambda n=name: events.append(n))) for name in "ab"]
    measure.time_runners(runners, repeats=1, min_sample_s=2e-3, max_number=3)
    # first calls, a wait, first warm calls, a wait, second warm calls, then the samples
    assert events[:8] == ["a", "b", "wait", "a", "b", "wait", "a", "b"]
    assert "wait" not in events[8:]


@pytest.mark.slow
def test_a_small_torch_call_is_timed_on_its_plan_with_an_empty_numba_cache(tmp_path):
    """The real case of the test above, in a fresh process with nothing cached: every timed
    call of numbanorm.torch's (1, 768) forward runs by its plan, none by the full path."""
    pytest.importorskip("torch")
    code = """
import torch
import numbanorm.torch as nt
from numbanorm import measure
plain = nt._IMPLEMENTATIONS["layer_norm", "plain"]
namespace = plain.__globals__  # the generated function's: FULL is the full path
full, hits = namespace["FULL"], []
def counted(*args):
    hits.append(1)
    return full(*args)
namespace["FULL"] = counted
x, w, b = torch.randn(1, 768), torch.rand(768), torch.rand(768)
r = measure.Runner("numbanorm.torch", "no_grad", lambda: nt.layer_norm(x, (768,), w, b))
calls = []
def fn():
    calls.append(len(hits))
    r_fn()
r_fn, r.fn = r.fn, fn
measure.time_runners([r], repeats=5, min_sample_s=0)
timed = calls[-5:]  # one call a sample: the full path's calls before each
assert timed[0] == len(hits), (calls, len(hits))
"""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_budget_bounds_the_rounds():
    r = [Runner("a", "out", fn=lambda: None)]
    assert measure.time_runners(r, budget_s=0.0, min_repeats=3) == 3
    r = [Runner("a", "out", fn=lambda: None)]
    assert measure.time_runners(r, budget_s=10.0, min_repeats=1, max_repeats=7) == 7


def test_run_case_on_a_tiny_shape():
    pytest.importorskip("numba")
    case = Case("layer_norm", "backward", (8, 32), "float32")
    rows = measure.run_case(case, impls=["cpu"], peers=("floor", "oracle"), threads=1, repeats=3)
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"numbanorm.cpu", "floor", "oracle"}
    for r in rows:
        assert r["repeats"] == 3 and r["median_s"] > 0 and r["q20_s"] <= r["median_s"] <= r["q80_s"]
        assert r["threads"] == 1
    assert by["floor"]["x_floor"] == 1.0
    assert by["numbanorm.cpu"]["x_floor"] == pytest.approx(by["numbanorm.cpu"]["median_s"] / by["floor"]["median_s"])


def test_torch_peer_forward_and_autograd_backward():
    torch = pytest.importorskip("torch")
    import numbanorm.cpu as cpu

    for norm, shape, g in (("layer_norm", (4, 16), None), ("rms_norm", (4, 16), None),
                           ("group_norm", (2, 4, 3), 2)):
        case = Case(norm, "backward", shape, "float64", g)
        inp = measure.Inputs(case, measure.HostSide())
        fn = measure.torch_calls(case, inp)["alloc"]
        grads = fn()
        ours = measure.numbanorm_calls(cpu, case, inp)["alloc"]()
        # the same gradients (dx, dweight[, dbias]): the peer computes what numbanorm computes
        assert len(grads) == len(ours)
        for t, a in zip(grads, ours):
            np.testing.assert_allclose(t.numpy(), a, rtol=1e-9, atol=1e-9)
        again = fn()  # the graph is retained: every repeat is a full backward, no accumulation
        for t, u in zip(grads, again):
            assert torch.equal(t, u)
        fwd = measure.torch_calls(Case(norm, "forward", shape, "float64", g), inp)["alloc"]()
        assert not fwd.requires_grad  # the forward peer records no graph


def test_threads_are_set_alike_and_checked():
    import numba

    n = measure.set_threads(1)
    assert n == 1 and numba.get_num_threads() == 1
    torch = sys.modules.get("torch")
    if torch is not None:
        assert torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="threads must be"):
        measure.set_threads(numba.config.NUMBA_NUM_THREADS + 1)
    measure.set_threads(None)


# ------------------------------------------------------------------ progress bar


def test_progress_without_tqdm_is_a_line_per_case(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    for disable in (False, True):
        bar = measure.progress(4, "sweep", disable=disable)
        for i in range(4):
            bar.set_postfix_str(f"case {i}")
            bar.update()
        bar.close()
        err = capsys.readouterr().err.splitlines()
        assert err == ([] if disable else [f"sweep {i + 1}/4 case {i}" for i in range(4)])


# ------------------------------------------------------------------ results files


@pytest.fixture
def tiny_results():
    cases = [Case("rms_norm", d, (8, 64), "float32") for d in measure.DIRECTIONS]
    return harness.run(cases, threads=1, impls=["cpu"], peers=("floor",), note="test", cold=False,
                       show_progress=False, repeats=2)


def test_results_files_carry_machine_and_versions(tiny_results, tmp_path):
    jpath, cpath = harness.write_results(tiny_results, "t", tmp_path)
    res = harness.load_results(jpath)
    meta = res["meta"]
    assert meta["machine"]["cpu"] and meta["machine"]["cores"] >= 1
    assert "gpu" in meta["machine"]
    for k in ("numbanorm", "numba", "numpy", "torch", "python"):
        assert k in meta["versions"]
    assert meta["versions"]["numbanorm"] and meta["versions"]["numba"]
    assert meta["threads"] == 1 and meta["date"][:2] == "20"
    assert meta["note"] == "test" and "loadavg_before" in meta and "loadavg_after" in meta
    assert len(res["rows"]) == 5  # forward: out, alloc, floor; backward: alloc, floor
    with open(cpath) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5
    for k in ("date", "cpu", "cores", "threads", "numbanorm", "numba", "numpy", "torch", "python",
              "median_s", "gbps", "x_floor", "x_torch"):
        assert k in rows[0]
    assert rows[0]["shape"] == "8x64" and rows[0]["threads"] == "1"


def test_merge_replaces_only_rerun_cases(tiny_results):
    new = json.loads(json.dumps(tiny_results))
    new["rows"] = [dict(r, median_s=1.0) for r in new["rows"] if r["direction"] == "forward"]
    merged = harness.merge(json.loads(json.dumps(tiny_results)), new)
    fwd = [r for r in merged["rows"] if r["direction"] == "forward"]
    bwd = [r for r in merged["rows"] if r["direction"] == "backward"]
    assert len(fwd) == 3 and all(r["median_s"] == 1.0 for r in fwd)
    assert len(bwd) == 2 and all(r["median_s"] != 1.0 for r in bwd)
    assert merged["meta"]["merged"][0]["rows_kept"] == 2


def test_a_drawn_case_keeps_the_median_of_its_draws_in_place(monkeypatch):
    """A case measured on several allocations (targets.DRAWN) keeps its place among the rows,
    one row per implementation and mode, each measured field the median of the draws' and the
    draws' own ratios beside it; the other cases are measured once."""
    cases = [Case("rms_norm", "forward", (8, 64), "float32"), Case("layer_norm", "forward", (8, 64), "float32")]
    sweep = measure.sweep
    ratios = iter([0.5, 3.0, 1.5, 9.0])  # the drawn case's own draws, then anything
    samples = []  # (norm, the sample's least length) of every sweep

    def fake(cs, *a, **k):
        samples.extend((c.norm, k.get("min_sample_s")) for c in cs)
        rows = sweep(cs, *a, **k)
        for r in rows:
            if r["norm"] == "layer_norm" and r["impl"] != "floor" and r["mode"] == "out":
                r["x_floor"] = next(ratios)
        return rows

    monkeypatch.setattr(measure, "sweep", fake)
    # (the draws after the first in this process: sweep_apart's fresh processes, tested below)
    monkeypatch.setattr(harness, "sweep_apart", lambda case, impls, peers, threads, timing: fake(
        [case], impls, peers, threads, show_progress=False, **timing))
    res = harness.run(cases, threads=1, impls=["cpu"], peers=("floor",), cold=False, show_progress=False,
                      draws=lambda c: 3 if c.norm == "layer_norm" else 1, drawn_timing={"min_sample_s": 1e-4},
                      repeats=2)
    # the drawn case in samples of its own length, three times, and not once more besides
    assert samples == [("rms_norm", None)] + [("layer_norm", 1e-4)] * 3
    assert res["meta"]["timing"] == {"repeats": 2, "drawn": {"min_sample_s": 1e-4}}
    assert [r["norm"] for r in res["rows"]] == ["rms_norm"] * 3 + ["layer_norm"] * 3
    out = [r for r in res["rows"] if r["norm"] == "layer_norm" and r["mode"] == "out" and r["impl"] != "floor"]
    assert len(out) == 1 and out[0]["draws"] == 3 and out[0]["x_floor_draws"] == [0.5, 3.0, 1.5]
    assert out[0]["x_floor"] == 1.5
    assert all("draws" not in r for r in res["rows"] if r["norm"] == "rms_norm")
    assert targets.draws(Case("group_norm", "forward", (8, 64, 64, 64), "float32", 8)) == targets.DRAWS > 1
    assert targets.draws(Case("layer_norm", "forward", (16384, 4096), "float32")) == 1
    text = readme_table.render_targets([res], ["targets-x.json"])
    assert "a ratio is the median of theirs; *x* timed those in samples of 0.1 ms." in text
    # two kinds that share a sample length share one clause
    both = readme_table.render_targets([res, res], ["targets-x.json", "targets-y.json"])
    assert "; *x* and *y* timed those in samples of 0.1 ms." in both
    three = readme_table.render_targets([res] * 3, ["targets-x.json", "targets-y.json", "targets-z.json"])
    assert "; *x*, *y* and *z* timed those in samples of 0.1 ms." in three
    once = dict(res, rows=[r for r in res["rows"] if "draws" not in r])
    assert "median of theirs" not in readme_table.render_targets([once], ["targets-x.json"])


@pytest.mark.slow  # a fresh process
def test_a_case_swept_apart_comes_back_from_a_fresh_process():
    """The suite's sweep in the child, its peers too: the first run of drawn cases measured
    the suite's own peers (floor_threads, numbanorm.torch) in the parent alone."""
    case = Case("group_norm", "forward", (2, 4, 8), "float32", 2)
    peers = ("floor", "floor_threads")
    rows = harness.sweep_apart(case, ["cpu"], peers, 1, {"repeats": 2})
    here = measure.sweep([case], ["cpu"], peers, 1, show_progress=False, repeats=2)
    assert {(r["impl"], r["mode"]) for r in rows} == {(r["impl"], r["mode"]) for r in here} >= {
        ("numbanorm.cpu", "out"), ("numbanorm.cpu", "alloc"), ("floor", "out"), ("floor_threads", "out")}
    assert all(r["norm"] == "group_norm" and r["groups"] == 2 and r["median_s"] > 0 for r in rows)


def test_sweep_grid_and_memory_bound():
    cases, skipped = harness.sweep_cases(norms=("layer_norm",), dtypes=("float32",), rows=(256, 65536),
                                         hidden=(768, 8192), mem_limit=harness.BUFFERS["backward"] * 2**30)
    big = Case("layer_norm", "backward", (65536, 8192), "float32")  # 2 GiB per array
    assert big in skipped and big not in cases
    assert Case("layer_norm", "forward", (256, 768), "float32") in cases
    assert len(cases) + len(skipped) == 8
    # forward and backward of one shape run back to back (they share inputs)
    assert [c.direction for c in cases[:2]] == ["forward", "backward"]


# ------------------------------------------------------------------ README table and targets


def _synthetic_results(tmp_path):
    """A results file with every shape the README shows, timings made up (deterministic)."""
    rows = []
    for k, (norm, shape) in enumerate(readme_table.SHOWN):
        g = {"group_norm": 8 if shape[1] == 64 else 32, "instance_norm": shape[1]}.get(norm)
        for d in measure.DIRECTIONS:
            case = Case(norm, d, shape, "float32", g)
            t = 1e-3 * (k + 1)
            runners = [_runner("numbanorm.cpu", "alloc", [t] * 3), _runner("torch", "alloc", [2 * t] * 3),
                       _runner("floor", "out", [t / 2] * 3)]
            if d == "forward":
                runners.append(_runner("numbanorm.cpu", "out", [0.6 * t] * 3))
            rows += measure.result_rows(case, runners, threads=2)
    res = {"meta": harness.metadata(2, "synthetic", [0.1, 0.1, 0.1], [0.2, 0.2, 0.2]),
           "rows": rows, "cold_start": {}}
    res["meta"]["date"] = "2026-01-01T00:00:00+00:00"
    path, _ = harness.write_results(res, "synthetic", tmp_path)
    return path


def test_the_readme_range_against_torch_counts_the_large_layer_and_rms_norm_calls(tmp_path):
    res = harness.load_results(_synthetic_results(tmp_path))

    def row(norm, shape, direction):
        return readme_table._find(res["rows"], norm, shape, direction, "alloc", "float32", "cpu", "numbanorm.cpu")
    row("layer_norm", (256, 768), "forward")["x_torch"] = 0.01     # small: left out
    row("group_norm", (32, 256, 32, 32), "forward")["x_torch"] = 0.02  # not a row norm: left out
    row("rms_norm", (65536, 768), "backward")["x_torch"] = 0.9
    assert readme_table.large_over_torch(res) == (0.5, 0.9)
    assert "forward and backward: 0.50x to 0.90x the time of" in readme_table.render(res, "x.json")


def test_readme_table_is_deterministic_and_round_trips(tmp_path):
    path = _synthetic_results(tmp_path)
    res = harness.load_results(path)
    block = readme_table.render(res, "x.json")
    assert block == readme_table.render(harness.load_results(path), "x.json")
    readme = f"# t\n\nintro\n\n{readme_table.START}\nold stuff\n{readme_table.END}\n\nafter\n"
    once = readme_table.update(readme, block)
    assert readme_table.update(once, block) == once             # idempotent
    assert once.startswith("# t\n\nintro\n\n") and once.endswith(f"{readme_table.END}\n\nafter\n")
    assert "old stuff" not in once
    cells = readme_table.parse(once)
    assert cells == readme_table.table_rows(res)                # what is shown is what the file says
    assert len(cells) == 3 * len(readme_table.SHOWN)
    first = dict(zip(readme_table.HEADER, cells[0]))
    assert first["norm"] == "layer_norm" and first["shape"] == "256x768" and first["pass"] == "forward, out="
    # (3 rounds a case: a loose median, marked, with the mark's footnote)
    assert first["numbanorm"] == "600.0 us*" and first["x copy floor"] == "1.20x" and first["x torch"] == "-"
    assert "\\* a median of fewer than 5 rounds" in block
    fwd = dict(zip(readme_table.HEADER, cells[1]))
    assert fwd["x torch"] == "0.50x" and fwd["x copy floor"] == "2.00x"
    with pytest.raises(ValueError, match="markers"):
        readme_table.update("no markers", block)


def test_readme_table_cli_writes_between_markers(tmp_path):
    path = _synthetic_results(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{readme_table.START}\n{readme_table.END}\nb\n")
    assert readme_table.main([str(path), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert readme_table.main([str(path), "--readme", str(readme)]) == 0
    assert readme.read_text() == text and "| layer_norm | 16384x4096 |" in text


def test_every_results_file_is_in_the_results_readme():
    """benchmarks/results/README.md names every file there (archive/ too) and no file that is gone."""

    folder = ROOT / "benchmarks" / "results"
    named = set(re.findall(r"`([^`/ ]+\.(?:json|csv|png))`", (folder / "README.md").read_text()))
    files = {p.name for p in folder.rglob("*") if p.is_file() and p.name != "README.md"}
    assert files - named == set(), "files the results README does not list"
    assert named - files == set(), "the results README lists files that are not there"


def test_the_results_readme_dates_each_file_as_its_metadata_does():
    """A row's "Machine, date, commit" cell starts with the date and commit its JSON files'
    own metadata record (a re-run that kept the old row, or a row naming the commit that
    committed the file instead of the one measured, fails here)."""

    folder = ROOT / "benchmarks" / "results"
    wrong = []
    for line in (folder / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) < 4:
            continue
        hashes = re.findall(r"`([0-9a-f]{7,40})`", cells[2])
        dates = re.findall(r"\d{4}-\d\d-\d\d", cells[2])
        for name in re.findall(r"`([^`/ ]+\.json)`", cells[0]):
            path = folder / name if (folder / name).exists() else folder / "archive" / name
            meta = json.loads(path.read_text()).get("meta", {})
            git = meta.get("git")
            commit = git.get("commit") if isinstance(git, dict) else git
            date = (meta.get("date") or "")[:10]
            if date and dates[:1] != [date] or commit and not (hashes and commit.startswith(hashes[0])):
                wrong.append(f"{name}: meta {date} {str(commit)[:7]}, README {dates[:1]} {hashes[:1]}")
    assert wrong == []


def test_targets_pass_fail_and_missing(tmp_path):
    res = harness.load_results(_synthetic_results(tmp_path))
    ev = targets.evaluate(res)
    by = {(e["rule"], e["case"]): e for e in ev}
    e = by[("forward out= <= 1.15x np.copyto", "layer_norm 16384x4096")]
    assert e["value"] == pytest.approx(1.2) and e["status"] == "FAIL"  # 0.6 t / 0.5 t
    e = by[("forward <= 0.7x torch (large)", "layer_norm 16384x4096")]
    assert e["value"] == pytest.approx(0.5) and e["status"] == "PASS"
    assert by[("import numbanorm <= 0.5 s (new process, median)", "0 imports")]["status"] == "MISSING"
    assert by[(targets.COLD_RULES["fresh_cache"], "-")]["status"] == "MISSING"
    from benchmarks import cold_start

    made = cold_start.cases(("float32", "bfloat16"), ops=("layer_norm",))
    res["cold_start"] = {
        "cached": [dict(c, import_s=0.5, first_call_s=0.2 + 0.1 * (c["direction"] == "backward") * i)
                   for i, c in enumerate(made)],
        "fresh_cache": [dict(c, import_s=0.5, first_call_s=1.5 + i / 5) for i, c in enumerate(made)]}
    ev = {(e["rule"], e["case"]): e for e in targets.evaluate(res)}
    assert ev[("import numbanorm <= 0.5 s (new process, median)", "4 imports")]["status"] == "PASS"
    cached, fresh = targets.COLD_RULES["cached"], targets.COLD_RULES["fresh_cache"]
    # each operation and direction, its slowest dtype: 0.2 s, and 0.2 + 0.1 * 3 s
    assert ev[(cached, "layer_norm forward, float32")]["status"] == "PASS"
    assert ev[(cached, "layer_norm backward, bfloat16")]["status"] == "FAIL"
    assert ev[(fresh, "layer_norm forward, bfloat16")]["value"] == pytest.approx(1.7)
    assert ev[(fresh, "layer_norm forward, bfloat16")]["status"] == "PASS"
    assert ev[(fresh, "layer_norm backward, bfloat16")]["status"] == "FAIL"  # 2.1 s
    text = targets.summary(res)
    assert "FAIL" in text and "PASS" in text and "targets" in text.splitlines()[-1]
    # every target's case is one the --targets run measures
    needed = set(targets.target_cases())
    assert all(t.case() in needed for t in targets.TARGETS)


# ------------------------------------------------------------------ the GPU path, in the simulator


def _stand_in_cuda():
    """A 'cuda' implementation for the harness test when numbanorm.cuda is not usable:
    device arrays in and out, the arithmetic done by numbanorm.cpu."""
    from numba import cuda

    import numbanorm.cpu as cpu

    mod = types.ModuleType("numbanorm_test_fake_cuda")
    mod._frontend = types.SimpleNamespace(be=types.SimpleNamespace(name="cuda"))

    def wrap(name):
        def f(*args, out=None, **kw):
            host = [a.copy_to_host() if hasattr(a, "copy_to_host") else a for a in args]
            res = getattr(cpu, name)(*host, **kw)
            if out is not None:
                out.copy_to_device(res)
                return out
            return tuple(cuda.to_device(r) for r in res) if isinstance(res, tuple) else cuda.to_device(res)
        return f

    for name in cpu.__all__:
        setattr(mod, name, wrap(name))
    return mod


@pytest.mark.cudasim
def test_compare_counts_a_case_slower_only_when_floor_ratio_time_and_spread_agree(tmp_path):
    def row(median, x_floor, impl="numbanorm.cpu", spread=0.05):
        return {"impl": impl, "mode": "alloc", "threads": 2, "norm": "layer_norm", "direction": "forward",
                "shape": [8, 16], "dtype": "float32", "groups": None, "device": "cpu",
                "median_s": median, "q20_s": median * (1 - spread), "q80_s": median * (1 + spread),
                "x_floor": x_floor}

    old = [row(1.0, 1.0), row(1.0, None, impl="torch")]
    assert compare.compare(old, [row(1.3, 1.3)], 1.1) == ([(compare.key(old[0]), 1.3, 1.3)], 1)
    # the floor was as much slower in that run: the machine, not the code
    assert compare.compare(old, [row(1.3, 1.0)], 1.1)[0] == []
    # spreads that overlap are noise
    assert compare.compare(old, [row(1.3, 1.3, spread=0.2)], 1.1)[0] == []
    # only numbanorm's rows are compared
    assert compare.compare(old, [row(3.0, None, impl="torch")], 1.1) == ([], 0)
    meta = {"date": "2026-01-01T00:00:00"}
    for name, rows in (("old", old), ("new", [row(1.3, 1.3)])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    assert compare.main([str(tmp_path / "old.json"), str(tmp_path / "new.json")]) == 1
    assert compare.main([str(tmp_path / "old.json"), str(tmp_path / "old.json")]) == 0


def test_gpu_path_in_the_cuda_simulator(monkeypatch):
    pytest.importorskip("numba.cuda")
    if not measure.cuda_simulated():
        pytest.skip("runs the GPU path in numba's CUDA simulator only")
    from numbanorm import registry

    if not registry.usable("cuda")[0] or measure.backend_name(registry.get("cuda")) != "cuda":
        fake = _stand_in_cuda()
        monkeypatch.setitem(sys.modules, fake.__name__, fake)
        monkeypatch.setitem(registry.IMPLEMENTATIONS, "cuda", fake.__name__)
    assert not measure.kernel_impls("gpu", ["cuda"])                      # the simulator only when asked
    side = measure.side_for("gpu")
    assert isinstance(side, measure.NumbaCudaSide) and side.simulated
    rows = []
    for d in measure.DIRECTIONS:
        case = Case("layer_norm", d, (4, 32), "float32", device="gpu")
        rows += measure.run_case(case, impls=["cuda"], peers=("floor", "oracle"), threads=1,
                                allow_simulator=True, repeats=2, max_number=1)
    impls = {(r["direction"], r["impl"], r["mode"]) for r in rows}
    assert impls == {("forward", "numbanorm.cuda", "out"), ("forward", "numbanorm.cuda", "alloc"),
                     ("forward", "floor", "out"), ("backward", "numbanorm.cuda", "alloc"),
                     ("backward", "floor", "out")}  # no oracle on the device
    assert all(r["device"] == "gpu" and r["repeats"] == 2 and math.isfinite(r["median_s"]) for r in rows)


# ------------------------------------------------------------------ the sweep's command line


def test_run_command_writes_and_merges_a_subset(tmp_path, capsys):
    from benchmarks import run

    base = ["--norm", "rms_norm", "--dtype", "float32", "--rows", "8", "--hidden", "64", "--threads", "1",
            "--peers", "floor", "--no-cold-start", "--budget", "0", "--min-repeats", "2", "--no-plot",
            "--no-progress", "--dir", str(tmp_path), "--out", "sub"]
    assert run.main(base) == 0
    first = harness.load_results(tmp_path / "sub.json")
    assert len(first["rows"]) == 5 and (tmp_path / "sub.csv").exists()
    assert first["meta"]["threads"] == 1 and "commit" in first["meta"]["git"]
    assert run.main(base + ["--direction", "backward", "--merge"]) == 0
    merged = harness.load_results(tmp_path / "sub.json")
    assert len(merged["rows"]) == 5 and len(merged["meta"]["merged"]) == 1
    assert run.main(base + ["--list"]) == 0
    assert "rms_norm forward 8x64 float32 cpu" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        run.main(base + ["--dtype", "float8"])
    assert e.value.code == 2
    assert run.main(base + ["--dtype", "bfloat16", "--list"]) == 0  # the CPU takes bfloat16 now
    assert "rms_norm forward 8x64 bfloat16 cpu" in capsys.readouterr().out


def test_plots_from_a_results_file(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import plot

    res = harness.load_results(_synthetic_results(tmp_path))
    paths = plot.plot_results(res, "syn", tmp_path)
    names = sorted(p.name for p in paths)
    assert names == sorted(f"syn-{n}-{d}.png" for n in harness.ALL_NORMS for d in measure.DIRECTIONS)
    assert all(p.stat().st_size > 10_000 for p in paths)


@pytest.mark.slow
def test_cold_start_imports_the_trees_bytecode(tmp_path):
    """A measured tree's numbanorm gets its bytecode compiled first, as pip compiles what it
    installs (an import that compiled every module would be measured slower than a user's);
    a tree without numbanorm (an installed package measured) is left alone."""
    from benchmarks import cold_start

    (tmp_path / "numbanorm").mkdir()
    (tmp_path / "numbanorm" / "mod.py").write_text("X = 1\n")
    cold_start._bytecode(None, str(tmp_path))
    assert list((tmp_path / "numbanorm" / "__pycache__").glob("mod.*.pyc"))
    cold_start._bytecode(None, str(tmp_path / "elsewhere"))  # no numbanorm there: nothing to do


def test_a_first_call_is_the_median_of_its_processes():
    """Of several processes' first calls the one of median time is kept, every time beside it;
    of an even count the lower middle (no mean of two processes' other fields)."""
    from benchmarks.cold_start import _median

    got = _median([{"first_call_s": 3.0, "import_s": 1}, {"first_call_s": 1.0, "import_s": 2},
                   {"first_call_s": 2.0, "import_s": 3}])
    assert got == {"first_call_s": 2.0, "import_s": 3, "samples_s": [3.0, 1.0, 2.0]}
    assert _median([{"first_call_s": 2.0}, {"first_call_s": 1.0}])["first_call_s"] == 1.0


def test_a_baseline_first_call_is_the_median_of_as_many_processes(monkeypatch):
    """With --baseline, the other checkout's first calls (empty cache, then cached) are
    measured as many times as this tree's and their medians kept: the same estimate on both
    sides (no processes run here)."""
    from benchmarks import cold_start

    times = {"B": iter([5.0, 0.5, 1.0, 0.7, 3.0, 0.6]),  # (empty cache, then cached) x 3, each tree
             "T": iter([2.0, 0.1, 4.0, 0.2, 3.0, 0.3])}

    def child(python, args, env, timeout, what):
        tree = env["PYTHONPATH"].split(os.pathsep)[0]
        return {"first_call_s": next(times[tree]), "first_call_cpu_s": 0.0, "background_s": 0.0, "import_s": 0.3}

    monkeypatch.setattr(cold_start, "_run_child", child)
    monkeypatch.setattr(cold_start, "_bytecode", lambda python, tree: None)
    case = cold_start.cases(("float32",), ops=("rms_norm",))[0]
    out = cold_start.first_calls([case], tree="T", baseline="B", profile=False, repeats=3, show=lambda s: None)
    (before,), (before_cached,) = out["baseline_fresh_cache"], out["baseline_cached"]
    (first,), (cached,) = out["fresh_cache"], out["cached"]
    assert before["first_call_s"] == 3.0 and before["samples_s"] == [5.0, 1.0, 3.0]
    assert before_cached["first_call_s"] == 0.6 and before_cached["samples_s"] == [0.5, 0.7, 0.6]
    assert first["first_call_s"] == 3.0 and first["samples_s"] == [2.0, 4.0, 3.0]
    assert cached["first_call_s"] == 0.2
    assert all(next(t, None) is None for t in times.values())  # as many processes each


@pytest.mark.slow  # fresh processes, each compiling
def test_cold_start_in_a_fresh_process():
    """A first call in a new process with an empty cache, its compile broken down (the
    row function on the calling thread, the parallel kernel on the compile thread), then
    in a second process loading what the first cached."""
    from benchmarks import cold_start

    case = dict(cold_start.cases(("float32",), ops=("rms_norm",))[0], shape=[256, 256])
    out = cold_start.first_calls([case], threads=1, show=lambda s: None, repeats=1)
    (fresh,), (cached,) = out["fresh_cache"], out["cached"]
    assert fresh["op"] == "rms_norm" and fresh["direction"] == "forward" and fresh["shape"] == [256, 256]
    for res in (fresh, cached):
        assert 0 < res["import_s"] < 60 and 0 < res["steady_s"] <= res["first_call_s"] < 600
        # the child runs this interpreter: it sees the SciPy this process sees
        assert res["scipy_installed"] is (importlib.util.find_spec("scipy") is not None)
    assert cached["first_call_s"] < fresh["first_call_s"] and "breakdown" not in cached
    compiled = {(f["thread"], f["function"]) for f in fresh["breakdown"]["functions"] if f["depth"] == 0}
    assert ("main", "forward_rows") in compiled and ("background", "forward_rows.parallel") in compiled
    assert ("main", "forward_rows.parallel") not in compiled
    phases = fresh["breakdown"]["phases_cpu_s"]
    assert phases["main"]["typing"] > 0 and phases["background"]["LLVM code generation"] > 0


@pytest.mark.slow
def test_numba_alone_in_a_fresh_process_and_in_the_targets_summary(tmp_path):
    """numba's own first call (a trivial cached function) is measured in a new process
    and printed above the targets: the part of numbanorm's first call no kernel can cut."""
    from benchmarks.cold_start import numba_alone

    alone = numba_alone(threads=1)
    assert set(alone) == {"import_s", "first_call_s", "scipy_installed"}
    assert 0 < alone["import_s"] < 60 and 0 < alone["first_call_s"] < 60
    assert alone["scipy_installed"] is (importlib.util.find_spec("scipy") is not None)
    res = harness.load_results(_synthetic_results(tmp_path))
    res["cold_start"] = {"cached": [], "numba_alone": dict(alone, first_call_s=0.123, scipy_installed=False)}
    assert "first call of a cached trivial function 0.123 s, no scipy" in targets.summary(res)


def test_cold_start_processes_can_run_another_interpreter(monkeypatch):
    """--cold-python reaches every cold-start process (a venv without the book extra's SciPy)."""
    from benchmarks import cold_start as cs, run

    seen = []
    monkeypatch.setattr(cs, "_run_child", lambda python, args, env, timeout, what: seen.append(python) or dict(
        {"import_s": 0.1, "first_call_s": 0.1, "first_call_cpu_s": 0.1, "background_s": 0.1, "steady_s": 0.1,
         "scipy_installed": False}, **({"breakdown": {}} if "--profile" in args else {})))
    monkeypatch.setattr(cs, "compile_command", lambda **kw: seen.append(kw["python"]) or {"wall_s": 1.0})
    monkeypatch.setattr(cs, "_bytecode", lambda python, tree: seen.append(python))  # (the checkout's compileall)
    out = harness.cold_start_runs(1, compile_times=True, python="/elsewhere/python")
    assert set(out) == {"cached", "numba_alone", "fresh_cache", "compile_command"}
    assert len(out["cached"]) == len(cs.cases())  # every operation, direction and dtype
    assert seen and set(seen) == {"/elsewhere/python"}
    assert run.parser().parse_args(["--cold-python", "/elsewhere/python"]).cold_python == "/elsewhere/python"


def test_a_cold_start_interpreter_that_cannot_run_them_is_refused_before_anything_is_measured(tmp_path, monkeypatch,
                                                                                                capsys):
    """A targets run measures its cold starts last: an interpreter without ml_dtypes (its
    bfloat16 first calls) lost a whole run's measurements at its end.  run and cold_start
    now ask it first and refuse it by name."""
    import os

    from benchmarks import cold_start as cs, run

    fake = tmp_path / "python"  # (an interpreter with numba and NumPy but no ml_dtypes)
    fake.write_text('#!/bin/sh\ncase "$2" in *ml_dtypes*) echo "ModuleNotFoundError: No module named '
                    "'ml_dtypes'\" >&2; exit 1;; esac\nexit 0\n")
    os.chmod(fake, 0o755)
    assert "ml_dtypes" in cs.python_lacks(str(fake)) and str(fake) in cs.python_lacks(str(fake))
    assert cs.python_lacks(str(fake), ("float32", "float16")) is None
    assert cs.python_lacks(None) is None  # (this interpreter has them all)
    assert "does not run" in cs.python_lacks(str(tmp_path / "missing"))
    monkeypatch.setattr(harness, "run", lambda *a, **k: pytest.fail("measured before the check"))
    with pytest.raises(SystemExit) as e:
        run.main(["--norm", "rms_norm", "--dtype", "float32", "--rows", "8", "--hidden", "64", "--no-plot",
                  "--dir", str(tmp_path), "--cold-python", str(fake)])
    assert e.value.code == 2 and "No module named 'ml_dtypes'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cs.main(["--python", str(fake), "--out", str(tmp_path / "never")])
    assert e.value.code == 2


# ------------------------------------------------------------------ fused-add and Dask tables


def _fused_run(ratio):
    """A benchmarks/fused.py results dict: unfused takes ``ratio`` times the fused time."""
    rows = []
    for norm in ("layer_norm", "rms_norm"):
        for variant, t in (("unfused", ratio), ("fused", 1.0), ("unfused-into", 1.5), ("fused-into", 1.0),
                           ("torch", 4.0), ("unfused-par", 1.25)):
            base = 1.5 if variant.endswith("-into") else ratio  # the unfused time of the same mode
            rows.append({"norm": norm, "variant": variant, "shape": [16384, 4096], "dtype": "float32",
                         "threads": 2, "min_s": 0.9 * t, "median_s": t, "q20_s": t, "q80_s": t,
                         "unfused/this (min)": base / t, "unfused/this (median)": base / t})
    meta = {"date": "2026-01-01", "machine": {"cpu": "CPU", "cores": 2}, "threads": 2,
            "versions": {"numbanorm": "0", "numba": "0", "numpy": "0", "torch": None}}
    return {"meta": meta, "results": rows}


@pytest.mark.slow
def test_fused_benchmark_times_every_fused_operation_of_the_table(tmp_path):
    """benchmarks/fused.py, driven by the table (no branch on the norm), runs each fused
    operation's variants, and the ones that return y return the oracle's y."""
    from benchmarks import fused

    out = tmp_path / "fused.json"
    assert fused.main(["--shape", "16", "40", "--budget", "0.01", "--no-torch", "--json", str(out)]) == 0
    got = {(r["norm"], r["variant"]) for r in json.loads(out.read_text())["results"]}
    variants = ("unfused", "fused", "unfused-par", "unfused-into", "fused-into")
    assert set(fused.FUSED) == {"layer_norm", "rms_norm"}
    assert got == {(n, v) for n in fused.FUSED for v in variants}
    rng = np.random.default_rng(0)
    x, r = rng.standard_normal((2, 16, 40))
    w, b = rng.uniform(0.5, 1.5, 40), rng.standard_normal(40)
    from numbanorm import reference

    for norm, op in fused.FUSED.items():
        want = op.call(reference, "plain", {"x": x, "residual": r, "normalized_shape": 40, "weight": w, "bias": b})[0]
        for runner in fused.runners(norm, x, r, w, b, None):
            y = runner.fn()
            if runner.impl != "fused-into":  # (the launcher returns nothing)
                np.testing.assert_allclose(y[0] if runner.impl == "fused" else y, want, rtol=1e-12, atol=1e-12,
                                           err_msg=f"{norm} {runner.impl}")


def test_fused_table_and_target():
    runs = [_fused_run(1.5)]
    cells = readme_table.fused_rows(runs)
    assert cells[0] == ("layer_norm", "16384x4096", "1.50x", "1.50x", "1.25x", "1.50x", "1.50x", "4.00x")
    block = readme_table.render_fused(runs, ["f.json"])
    text = readme_table.update(f"a\n{readme_table.FUSED_START}\n{readme_table.FUSED_END}\n", block,
                               readme_table.FUSED_START, readme_table.FUSED_END)
    assert readme_table.parse(text, readme_table.FUSED_START, readme_table.FUSED_END) == cells
    ev = targets.evaluate_fused(runs + [_fused_run(1.2)])
    assert [e["status"] for e in ev] == ["PASS", "PASS", "FAIL", "FAIL"]
    assert ev[0]["value"] == pytest.approx(1.5) and ev[2]["value"] == pytest.approx(1.2)


def test_dask_table():
    res = [{"setup": "in memory", "chunk_rows": None, "workers": None, "direction": d, "min_s": 1.0,
            "median_s": 1.0, "GB/s (min)": 2.0} for d in ("forward", "backward")]
    for n in (1, 2):
        for d in ("forward", "backward"):
            r = {"setup": f"{n}", "chunk_rows": 64, "workers": n, "direction": d, "min_s": 2.0 / n,
                 "median_s": 3.0 / n, "GB/s (min)": 1.0 * n}
            if n == 2:
                r.update({"speed-up (min)": 2.0, "speed-up (median)": 2.0})
            res.append(r)
    run = {"meta": {"date": "2026-01-01", "machine": {"cpu": "CPU", "cores": 2}, "rounds": 3,
                    "versions": {"numbanorm": "0", "numba": "0", "numpy": "0", "dask": "1", "distributed": "1"}},
           "shape": [256, 1024], "dtype": "float32", "workers": [1, 2], "results": res}
    cells = readme_table.dask_rows(run)
    assert cells == [("64 rows (0 MiB)", "forward", "1.0 GB/s", "2.0 GB/s", "2.00x", "2.00x"),
                     ("64 rows (0 MiB)", "backward", "1.0 GB/s", "2.0 GB/s", "2.00x", "2.00x")]
    block = readme_table.render_dask(run, "d.json")
    assert "forward 2.0 GB/s" in block
    text = readme_table.update(f"{readme_table.DASK_START}\n{readme_table.DASK_END}", block,
                               readme_table.DASK_START, readme_table.DASK_END)
    assert readme_table.parse(text, readme_table.DASK_START, readme_table.DASK_END) == cells


def test_repository_readme_tables_are_the_committed_results():
    """Every table in the README is what its committed results file generates (never typed)."""
    text = (ROOT / "README.md").read_text()
    res = ROOT / "benchmarks" / "results"
    assert readme_table.parse(text) == readme_table.table_rows(harness.load_results(res / "cpu.json"))
    fused = [harness.load_results(p) for p in sorted(res.glob("fused-cpu-*.json"))]
    assert fused and readme_table.parse(text, readme_table.FUSED_START, readme_table.FUSED_END) == \
        readme_table.fused_rows(fused)
    dask_run = harness.load_results(res / "dask-scaling-cpu.json")
    assert readme_table.parse(text, readme_table.DASK_START, readme_table.DASK_END) == readme_table.dask_rows(dask_run)


def test_repository_targets_table_shows_every_cpu_kinds_file():
    """The README's targets table is what readme_table makes of the committed targets-<kind>.json
    files, one column per CPU kind, and no file is left out."""
    files = sorted((ROOT / "benchmarks" / "results").glob("targets-*.json"))
    runs = [harness.load_results(p) for p in files]
    text = (ROOT / "README.md").read_text()
    assert {p.name for p in files} >= {"targets-epyc-znver3.json", "targets-xeon-emeraldrapids.json"}
    cells = readme_table.parse(text, readme_table.TARGETS_START, readme_table.TARGETS_END)
    assert cells and cells == readme_table.targets_rows(runs)
    assert all(f"`benchmarks/results/{p.name}`" in text for p in files)


def test_targets_side_by_side_say_which_run_is_older_and_what_it_lacks(tmp_path):
    old, new = (harness.load_results(_synthetic_results(tmp_path / d)) for d in ("a", "b"))
    old["meta"]["machine"].update(cpu="AMD EPYC", cpu_target=None)
    old["meta"]["git"] = {"commit": "ad014739d528", "uncommitted": []}
    new["meta"]["machine"].update(cpu="Intel(R) Xeon(R) Processor", cpu_target={"llvm_cpu": "emeraldrapids", "wide_16bit_rows": True})
    new["meta"]["date"] = "2026-01-04T00:00:00+00:00"
    old["rows"] = [r for r in old["rows"] if r["norm"] != "rms_norm"]
    # a column is named by its file's kind (targets-<kind>.json), else by what its metadata says
    block = readme_table.render_targets([old, new], ["results/targets-epyc-znver3.json", "x.json"])
    assert "| target | case | limit | epyc-znver3 | xeon-emeraldrapids |" in block
    epyc, xeon = (ln for ln in block.splitlines() if ln.startswith("- *"))
    assert "measured 2026-01-01 at commit `ad01473`" in epyc and "3 day(s) older than the newest" in epyc
    assert "older" not in xeon and "CPU target not recorded" in epyc
    assert "did not re-measure" not in epyc
    # a file a subset was re-run into (harness.merge) says where its other rows come from
    merged = harness.merge(old, {"meta": dict(new["meta"], git={"commit": "1d8e12c0ffee", "uncommitted": []}),
                                 "rows": [], "cold_start": {}})
    line = next(ln for ln in readme_table.render_targets([merged], ["t.json"]).splitlines() if ln.startswith("- *"))
    assert "at commit `1d8e12c`" in line
    assert "The rows that run did not re-measure: 2026-01-01 at commit `ad01473`." in line
    rows = {(r[0], r[1]): r[3:] for r in readme_table.targets_rows([old, new])}
    assert rows[("forward <= 0.7x torch (large)", "rms_norm 16384x4096")] == ("not measured", "0.50x")
    assert rows[("forward out= <= 1.15x np.copyto", "layer_norm 16384x4096")] == ("**1.20x FAIL**",) * 2
    text = readme_table.update(f"{readme_table.TARGETS_START}\n{readme_table.TARGETS_END}", block,
                               readme_table.TARGETS_START, readme_table.TARGETS_END)
    assert readme_table.parse(text, readme_table.TARGETS_START, readme_table.TARGETS_END) == \
        readme_table.targets_rows([old, new])


def test_the_targets_block_states_a_cold_start_run_under_the_table(tmp_path):
    """``--cold``: the first calls, Numba's own pace beside them, the compile command and the
    README's main job of a benchmarks/cold_start.py run, from its file, under the table (none
    without it)."""
    run = harness.load_results(_synthetic_results(tmp_path))
    meta = dict(run["meta"], git={"commit": "4f7119349414", "uncommitted": []})
    first = [{"first_call_s": s, "import_s": 0.3} for s in (0.91, 1.93)]
    cold = {"meta": meta, "cold_start": {
        "fresh_cache": first, "cached": [{"first_call_s": s, "import_s": i} for s, i in ((0.2, 0.3), (0.28, 0.5))],
        "compile_command": {"dtypes": ["float32", "bfloat16"], "wall_s": 89.3},
        "numba_alone": {"import_s": 0.209, "first_call_s": 0.156},
        "main_job": {"total_s": 106.4, "venv_s": 4.1, "pip_install_s": 11.5, "main_job_s": 90.8},
        "test_command": {"total_s": 351.2, "venv_s": 3.9, "pip_install_s": 52.4, "tests_s": 294.9}}}
    assert "Cold start" not in readme_table.render_targets([run], ["x.json"])
    block = readme_table.render_targets([run], ["x.json"], (cold, "c.json"))
    line = next(ln for ln in block.splitlines() if ln.startswith("Cold start"))
    assert "commit `4f71193`" in line and "0.91-1.93 s" in line and "at most 0.28 s" in line
    assert "`import numbanorm` 0.40 s (median)" in line and "float32 bfloat16`: 89 s" in line
    assert "106 s (venv 4 s, pip install 12 s, `python -m numbanorm` 91 s)" in line
    assert "test command from a copy of the clone: 351 s (venv 4 s, pip install 52 s, `python -m pytest` 295 s)" in line
    assert "Numba alone beside it: import 0.21 s, a cached trivial function 0.16 s." in line
    assert block.rstrip().endswith("--targets x.json --cold c.json`.")


def test_a_targets_column_states_numba_alone_beside_its_cold_starts(tmp_path):
    """A targets run with cold starts says, in its column's line, what Numba alone took on that
    machine that day: the floor the cold-start limits sit on (a slow CPU's own import of
    Numba can be over numbanorm's import limit)."""
    run = harness.load_results(_synthetic_results(tmp_path))
    assert "Numba alone" not in readme_table.render_targets([run], ["x.json"])
    run["cold_start"] = {"cached": [], "numba_alone": {"import_s": 0.685, "first_call_s": 0.545}}
    line = next(ln for ln in readme_table.render_targets([run], ["x.json"]).splitlines() if "(`x.json`)" in ln)
    assert "Numba alone beside it: import 0.69 s, a cached trivial function 0.55 s." in line


def test_the_readme_commands_run_from_a_copy_of_the_clone_in_a_venv_of_their_own(monkeypatch):
    """cold_start.readme_command: the README's main job installs the package and runs it; its test
    command installs the test extra and runs the default set; each in the copied clone,
    with the new venv's interpreter, each step timed."""
    from benchmarks import cold_start

    ran = []

    def fake_run(cmd, cwd=None, env=None, **kw):
        if cmd[0] == "git":  # the tracked files (the tests may run where there is no git checkout)
            return subprocess.CompletedProcess(cmd, 0, b"pyproject.toml\0", b"")
        ran.append((cmd, cwd, env))
        return subprocess.CompletedProcess(cmd, 0, "tail\n", "")

    monkeypatch.setattr(cold_start.subprocess, "run", fake_run)
    for command, install, args in (("main_job", ".", ["-m", "numbanorm"]), ("tests", ".[test]", ["-m", "pytest", "-q"])):
        del ran[:]
        out = cold_start.readme_command(command)
        (venv, _, _), (pip, cwd, env), (job, cwd2, _) = ran
        assert venv[1:3] == ["-m", "venv"] and pip[1:] == ["-m", "pip", "install", "-q", install]
        assert job[1:] == args and pip[0] == job[0] and job[0].startswith(venv[3]) and cwd == cwd2
        assert "PYTHONPATH" not in env and "NUMBA_CACHE_DIR" not in env
        assert out["total_s"] == out["venv_s"] + out["pip_install_s"] + out[command + "_s"]
        assert out["output_tail"] == "tail\n"


def test_the_test_command_target_reads_a_run_that_timed_it():
    """The README's test command, install included, within six minutes: judged where a
    cold-start run timed it, alone (no first-call rules MISSING) or beside first calls."""
    from benchmarks import targets

    alone = targets.evaluate_cold({"test_command": {"total_s": 310.6}})
    assert [(r["status"], r["value"]) for r in alone] == [("PASS", 310.6)]
    over = targets.evaluate_cold({"test_command": {"total_s": 361.0}, "cached": [
        {"op": "layer_norm", "direction": "forward", "first_call_s": 0.2, "import_s": 0.3}]})
    assert over[0]["status"] == "FAIL" and {r["rule"] for r in over} >= set(targets.COLD_RULES.values())
    assert not [r for r in targets.evaluate_cold({}) if "test command" in r["rule"]]


def test_a_targets_run_is_named_by_its_cpu_kind(monkeypatch):
    from benchmarks import run

    assert harness.cpu_kind("AMD EPYC", "znver5") == "epyc-znver5"  # a VM's bare model name
    assert harness.cpu_kind("AMD EPYC", "znver3") == "epyc-znver3"  # the same name, another kind
    assert harness.cpu_kind("Intel(R) Xeon(R) Platinum 8592+", "emeraldrapids") == "xeon-emeraldrapids"
    assert harness.cpu_kind("AMD EPYC 7B13 64-Core Processor", "") == "epyc"  # LLVM's name unknown
    assert harness.cpu_kind("Some New Chip", "znver5") == "znver5"  # no brand word: LLVM's name
    monkeypatch.setattr(harness, "cpu_kind", lambda *a: "xeon")
    assert run.targets_stem() == "targets-xeon"


def _script(name):
    return importlib.import_module(f"benchmarks.{name}")


def test_fused_benchmark_runs_on_a_tiny_shape(tmp_path, capsys):
    out = tmp_path / "fused.json"
    assert _script("fused").main(["--shape", "64", "128", "--budget", "0.05", "--threads", "1",
                                  "--json", str(out)]) == 0
    run = harness.load_results(out)
    variants = {(r["norm"], r["variant"]) for r in run["results"]}
    assert {("layer_norm", "fused"), ("rms_norm", "unfused-into")} <= variants
    assert run["meta"]["threads"] == 1 and readme_table.fused_rows([run])[0][:2] == ("layer_norm", "64x128")
    assert len(targets.evaluate_fused([run])) == 2


@pytest.mark.slow
def test_dask_scaling_runs_on_a_tiny_array(tmp_path, capsys):
    pytest.importorskip("distributed")
    out = tmp_path / "dask.json"
    assert _script("dask_scaling").main(["--rows", "256", "--hidden", "64", "--chunk-rows", "64",
                                         "--workers", "1", "--rounds", "1", "--json", str(out)]) == 0
    run = harness.load_results(out)
    assert run["workers"] == [1] and {r["direction"] for r in run["results"]} == {"forward", "backward"}
    assert len(readme_table.dask_rows(run)) == 2


# ------------------------------------------------------------------ 16-bit cases, the threaded floor, the adapter


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_parallel_copy_is_a_copy_of_any_dtype_and_length(dtype):
    side = measure.HostSide()
    for n in (1, 7, measure.COPY_BLOCK_BYTES // 2 + 3, 3 * measure.COPY_BLOCK_BYTES + 5):
        src = side.array(np.random.default_rng(n).standard_normal((n, 1)), dtype)
        dst = np.zeros_like(src)
        measure.parallel_copy(dst, src)
        assert dst.dtype == src.dtype and dst.tobytes() == src.tobytes()


def test_bfloat16_host_arrays_and_their_torch_view_share_memory():
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    side = measure.HostSide()
    a = side.array(np.array([1.0, -2.5, 3.0e38]), "bfloat16")
    assert a.dtype.name == "bfloat16"
    t = side.to_torch(a)
    assert t.dtype == torch.bfloat16 and t.tolist() == [1.0, -2.5, float(a[2])]
    t[0] = 4.0  # the same memory: what torch writes, the array holds
    assert float(a[0]) == 4.0


def test_a_16_bit_case_times_every_peer_and_both_floors():
    pytest.importorskip("ml_dtypes")
    torch = pytest.importorskip("torch")  # noqa: F841
    rows = measure.run_case(Case("layer_norm", "forward", (4, 64), "bfloat16"), impls=["cpu"], threads=1,
                            repeats=2, number=1)
    by = {(r["impl"], r["mode"]): r for r in rows}
    assert set(by) == {("numbanorm.cpu", "out"), ("numbanorm.cpu", "alloc"), ("torch", "alloc"),
                       ("numbanorm.torch", "alloc"), ("oracle", "alloc"), ("floor", "out"),
                       ("floor_threads", "out")}
    r = by[("numbanorm.cpu", "out")]
    assert r["x_floor_threads"] == pytest.approx(r["median_s"] / by[("floor_threads", "out")]["median_s"])
    assert by[("floor_threads", "out")]["bytes"] == by[("floor", "out")]["bytes"] == 2 * 4 * 64 * 2
    back = measure.run_case(Case("layer_norm", "backward", (4, 64), "bfloat16"), impls=["cpu"], threads=1,
                            peers=("torch", "adapter"), repeats=2, number=1)
    assert {r["impl"] for r in back} == {"numbanorm.cpu", "torch", "numbanorm.torch"}


def test_the_faster_floor_is_the_larger_ratio_and_the_16_bit_targets_are_measured():
    t = next(t for t in targets.TARGETS if t.versus == "floors" and t.dtype == "float16")
    row = {"impl": "numbanorm.cpu", "device": "cpu", "dtype": "float16", "norm": t.norm, "shape": list(t.shape),
           "direction": "forward", "mode": "out", "groups": None, "x_floor": 1.1, "x_floor_threads": 1.3}
    ev = {(e["rule"], e["case"]): e for e in targets.evaluate({"rows": [row]})}
    e = ev[(t.rule, f"{t.norm} 16384x4096 float16")]
    assert e["value"] == 1.3 and e["status"] == "FAIL"  # 1.3x the faster floor is over 1.25x
    rules = {t.rule for t in targets.TARGETS}
    assert {"forward <= 0.5x torch, same dtype", "backward <= 0.5x torch, same dtype",
            "small forward <= 1.0x torch"} <= rules
    assert {t.impl for t in targets.TARGETS} == {"numbanorm.cpu", "numbanorm.torch"}
    swept = set(harness.half_cases()) | set(harness.small_cases())
    assert all(t.case() in swept for t in targets.TARGETS if t.dtype != "float32" or t.versus == "floors"
               or t.rule.startswith("small"))


def test_half_table_round_trips(tmp_path):
    rows = []
    for k, (norm, shape, dtype) in enumerate(readme_table.HALF_SHOWN + readme_table.SMALL_SHOWN):
        for d in measure.DIRECTIONS:
            case, t = Case(norm, d, shape, dtype), 1e-4 * (k + 1)
            runners = [_runner("numbanorm.cpu", "alloc", [t] * 3), _runner("torch", "alloc", [2 * t] * 3),
                       _runner("numbanorm.torch", "alloc", [3 * t] * 3), _runner("floor", "out", [t / 2] * 3),
                       _runner("floor_threads", "out", [t / 4] * 3)]
            if d == "forward":
                runners.append(_runner("numbanorm.cpu", "out", [0.6 * t] * 3))
            rows += measure.result_rows(case, runners, threads=2)
    res = {"meta": harness.metadata(2, "", [0.1, 0.1, 0.1], [0.2, 0.2, 0.2]), "rows": rows, "cold_start": {}}
    cells = readme_table.half_rows(rows)
    block = readme_table.render_half([res], ["h.json"])
    text = readme_table.update(f"{readme_table.HALF_START}\n{readme_table.HALF_END}\n", block,
                               readme_table.HALF_START, readme_table.HALF_END)
    assert readme_table.parse(text, readme_table.HALF_START, readme_table.HALF_END) == cells
    first = dict(zip(readme_table.HALF_HEADER, cells[0]))
    assert first["pass"] == "forward, out=" and first["x faster copy floor"] == "2.40x"  # 0.6 t over t / 4
    fwd = dict(zip(readme_table.HALF_HEADER, cells[1]))
    assert fwd["x torch"] == "0.50x" and fwd["via numbanorm.torch, x torch"] == "1.50x"


def test_roofline_counts_the_operations_flops_over_their_bytes():
    from benchmarks import roofline

    # LayerNorm forward: 8 FLOP per element over x read and y written
    assert roofline.intensity("layer_norm", "forward", "float32") == 8 / (2 * 4)
    assert roofline.intensity("rms_norm", "backward", "bfloat16") == 9 / (3 * 2)
    assert set(roofline.FLOPS_PER_ELEMENT) == {(n, d) for n in measure.NORMS for d in measure.DIRECTIONS}


def test_repository_half_table_is_the_committed_results():
    """The README's 16-bit table is what readme_table makes of the committed files."""
    files = [ROOT / "benchmarks" / "results" / n for n in ("cpu-half.json", "cpu-small.json")]
    runs = [harness.load_results(p) for p in files]
    text = (ROOT / "README.md").read_text()
    cells = readme_table.parse(text, readme_table.HALF_START, readme_table.HALF_END)
    assert cells and cells == readme_table.half_rows([r for run in runs for r in run["rows"]])


# ------------------------------------------------------------------ the book's design probes


@pytest.mark.slow
def test_design_probes_call_the_kernels_with_their_current_arguments():
    """benchmarks/design_probes.py (chapter 5's figures) calls the package's own launchers and
    generated kernels; a change of their arguments broke it silently once (the block size
    moved first when the shells were generated).  The cheap probes, one round each."""
    from benchmarks import design_probes

    threading = design_probes.threading(1, 1)
    assert threading["lock"]["ratio_to_direct"]["launch_with_lock"] > 0
    assert all(r["ratio_to_serial_variant"]["set_num_threads_switch"] > 0 for r in threading["switch"])
    assert threading["fork"] is not None
    assert all(c["shape"][0] == 1 for c in design_probes.small_calls(1, 1))
    widen = design_probes.widen(1, 1)
    assert widen
    costs = design_probes.row_costs(1, rows=64, n=256, cached=32)
    assert {(c["norm"], c["dtype"]) for c in costs} >= {("layer_norm", "float16"), ("rms_norm", "float32")}
    assert all(c["out_over_faster_floor"] > 0 and c["arithmetic_over_faster_floor"] > 0 for c in costs)
    assert all(c["weights"] == c["dtype"] for c in costs)  # as the targets' inputs
    common = importlib.import_module("numbanorm.cpu._kernels.common")
    flag = common.WIDE_VECTORS
    width = design_probes.vector_width(1, n=64, cached=2, dtypes=("bfloat16",))
    assert common.WIDE_VECTORS == flag  # the probe's compiles set it and put it back
    assert {(c["norm"], c["direction"]) for c in width["cases"]} == {
        (norm, d) for norm in ("layer_norm", "rms_norm") for d in ("forward", "backward")}
    assert all(c["wide_over_llvm"] > 0 for c in width["cases"])
    back = design_probes.backward_streaming(1, shapes=((8, 96),), dtypes=("float32",))
    assert [c["fresh_output"] for c in back["cases"]] == [True, False]
    assert all(c["ratio_to_copy"]["streaming"] > 0 and c["ratio_to_copy"]["ordinary"] > 0 for c in back["cases"])
    spread = design_probes.in_cache_spread(1, 1, rows=8, n=64)  # (a fresh process of its own)
    assert not spread["streamed"] and set(spread["ratio_to_copy"]) == {
        "layer_norm", "layer_norm_weight", "layer_norm_plain", "rms_norm", "group_norm_8", "instance_norm"}
    assert all(len(v) == 1 and v[0] > 0 for v in spread["ratio_to_copy"].values())
    spans = importlib.import_module("numbanorm.cpu._kernels.spans")
    before = spans.GROUP_FROM_BYTES, spans.GROUP_ROWS, spans.SPAN
    groups = design_probes.row_groups(1, shapes=((5, 70),), orders=((1, 0), (2, 32)))["cases"]
    assert (spans.GROUP_FROM_BYTES, spans.GROUP_ROWS, spans.SPAN) == before  # set and put back
    assert len(groups) == 1 and groups[0]["same_bits"] and len(groups[0]["ratio_to_copy"]) == 8
    assert all(v > 0 for v in groups[0]["ratio_to_copy"].values())


@pytest.mark.slow
def test_the_channels_last_probe_merges_its_processes():
    """design_probes.channels_last_spread (the CPU design log's channels-last table): each
    ratio the median of the processes', with its range, and every process kept."""
    pytest.importorskip("torch")
    from benchmarks import design_probes

    got = design_probes.channels_last_spread(2, 1, shapes=(((2, 8, 4, 4), 4),))
    assert len(got["processes"]) == 2 and len(got["cases"]) == 1
    case = got["cases"][0]
    assert case["shape"] == [2, 8, 4, 4] and not case["far"]
    for field in ("over_torch", "over_copy"):
        for k, v in case[field].items():
            lo, hi = case["spread"][field][k]
            assert 0 < lo <= v <= hi, (field, k)
            assert sorted(run["cases"][0][field][k] for run in got["processes"]) == [lo, hi]
    assert set(case["over_copy"]) == {"forward_numbanorm_out", "forward_numbanorm_out_in_cache_path",
                                      "backward_numbanorm_mapped", "backward_numbanorm_contiguous_mapped"}


@pytest.mark.slow
def test_the_channels_last_probe_keeps_a_ratio_of_times_far_apart(monkeypatch):
    """A one-round run of a tiny case can time torch's call thousands of times numbanorm's
    (a CI run drew one): the ratio is kept to significant digits, where rounding it to
    decimals made it 0 and the test above failed."""
    pytest.importorskip("torch")
    from benchmarks import design_probes

    def timed(variants, rounds, inner=1, warm=False):
        return {k: np.array([1e-2 if "torch" in k else 2e-6]) for k in variants}

    monkeypatch.setattr(design_probes, "timed_rounds", timed)
    case = design_probes.channels_last(1, shapes=(((2, 8, 4, 4), 4),))["cases"][0]
    assert case["over_torch"]["forward_numbanorm"] == 2e-4
    assert case["over_copy"]["backward_numbanorm_mapped"] == 0.5  # over x's and dy's copies
    assert all(v > 0 for field in ("over_torch", "over_copy") for v in case[field].values())


@pytest.mark.slow
def test_the_row_costs_spread_alternates_with_a_baseline_checkout():
    """row_costs_spread in fresh processes, each alternated with one whose numbanorm is a
    baseline checkout's (here this one, linked in: the mechanism, not a second commit)."""
    from benchmarks import design_probes
    from benchmarks.harness import git_state

    root = Path(design_probes.__file__).parents[1]
    got = design_probes.row_costs_spread(1, 1, baseline=root, rows=64, n=256, cached=32)
    assert len(got["processes"]) == len(got["baseline_processes"]) == 1
    assert got["baseline"] == git_state(root)["commit"]  # (None where the tests run outside a checkout, as in CI)
    for side in ("processes", "baseline_processes"):
        assert {(c["norm"], c["dtype"]) for c in got[side][0]} >= {("layer_norm", "float16"), ("rms_norm", "float32")}
        assert all(c["shape"] == [64, 256] and c["out_over_faster_floor"] > 0 for c in got[side][0])


def test_the_fresh_output_and_group_passes_probes():
    """design_probes.fresh_output times the allocating forward in 4 KiB pages with NumPy's
    huge-page advice off for that call alone; group_passes's statistics pass computes the
    groups' real statistics (it stands for the kernel's first pass)."""
    pytest.importorskip("torch")
    from numpy._core import multiarray

    from benchmarks import design_probes

    before = multiarray._get_madvise_hugepage()
    seen = []
    design_probes._small_pages(lambda: seen.append(multiarray._get_madvise_hugepage()))()
    assert seen == [False] and multiarray._get_madvise_hugepage() == before
    fresh = design_probes.fresh_output(1, rows=16, n=64, dtypes=("bfloat16",))["cases"]
    assert [c["dtype"] for c in fresh] == ["bfloat16"]
    c = fresh[0]
    assert set(c["ms"]) == {"out", "fresh", "fresh_small_pages", "torch", "copy_threads", "copy_threads_fresh"}
    assert all(v > 0 for v in c["ms"].values()) and c["fresh_over_torch"] > 0
    gp = design_probes.group_passes(1, 1, shape=(2, 8, 4, 4), groups=4)
    assert set(gp["over_copy"]) == {"call_out", "call_fresh", "launcher", "statistics", "torch"}
    x = np.random.default_rng(1).standard_normal((2 * 4, 2 * 16), dtype=np.float32)
    got = np.empty(8, np.float32)
    design_probes._group_statistics(x, got, 3)
    np.testing.assert_allclose(got, x.mean(axis=1) + x.var(axis=1), rtol=1e-5, atol=1e-6)


def test_the_fresh_dx_probe_keeps_every_round_and_its_children_get_their_environment():
    """design_probes.fresh_dx times each backward's ways of meeting dx and keeps every round
    (the spread is its finding); fresh_dx_spread's kept-mapped children run with glibc's
    variable set (harness.in_child's env)."""
    pytest.importorskip("torch")
    from benchmarks import design_probes, harness

    fd = design_probes.fresh_dx(2, shape=(2, 8, 4, 4), groups=(2, 8))
    assert [c["groups"] for c in fd["cases"]] == [2, 8]
    for c in fd["cases"]:
        assert set(c["ms"]) == {"mapped", "fresh", "fresh_small_pages", "torch", "copy_threads"}
        assert all(len(r) == 2 and min(r) > 0 for r in c["ms_rounds"].values())
        assert set(c["over_torch"]) == set(c["ms"]) - {"torch"}
    code = "import os, sys, json; json.dump(os.environ.get('MALLOC_MMAP_THRESHOLD_'), open(sys.argv[1], 'w'))"
    assert harness.in_child(code, env=design_probes.KEEP_MAPPED) == design_probes.KEEP_MAPPED["MALLOC_MMAP_THRESHOLD_"]


def test_the_fresh_dx_probe_keeps_a_round_of_a_few_microseconds(monkeypatch):
    """A round kept to 0.01 ms was 0.0 where a tiny shape's call took under 5 us (the test
    above failed so on a fast day, its 4 KiB-page call at 0.01 ms)."""
    pytest.importorskip("torch")
    from benchmarks import design_probes

    monkeypatch.setattr(design_probes, "timed_rounds",
                        lambda variants, rounds, **kw: {k: np.full(rounds, 3e-6) for k in variants})
    fd = design_probes.fresh_dx(2, shape=(2, 8, 4, 4), groups=(2,))
    assert all(r == [0.003, 0.003] for r in fd["cases"][0]["ms_rounds"].values())


def test_the_streaming_sweep_spans_its_range_of_the_cache_in_whole_mib():
    from fractions import Fraction

    from benchmarks import streaming

    got = streaming.sizes(16 << 20, Fraction(1, 8), Fraction(8))
    assert [s >> 20 for s in got] == [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    assert [s >> 20 for s in streaming.sizes(300 << 20, Fraction(1, 8), Fraction(1, 4))] == [38, 56, 75]
    assert streaming.shape_of("layer_norm", 16 << 20) == (1024, 4096)
    assert streaming.shape_of("group_norm", 8 << 20) == (8, 64, 64, 64)


def test_the_streaming_crossover_is_where_streaming_wins_from_there_up():
    from benchmarks import streaming

    def cases(wins):  # {mib: [streaming/ordinary per norm]}
        return [{"mib": m, "streaming_over_ordinary": r} for m, rs in wins.items() for r in rs]

    assert streaming.crossover(cases({4: [1.2, 0.9], 8: [0.9, 0.8], 16: [0.7, 0.6]})) == 8 << 20
    # a size where one norm loses again moves it above that size
    assert streaming.crossover(cases({4: [0.9, 0.9], 8: [1.1, 0.8], 16: [0.7, 0.6]})) == 16 << 20
    assert streaming.crossover(cases({4: [0.9], 8: [1.1]})) is None


@pytest.mark.slow
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_the_streaming_sweep_times_each_store_kind_and_restores_the_threshold(backward):
    from benchmarks import streaming
    from numbanorm.cpu._kernels import memory

    before = memory.STREAM_MIN_BYTES
    for norm in streaming.NORMS:
        c = streaming.case(norm, 1 << 20, rounds=1, then_read=norm == "layer_norm", budget_s=0, backward=backward)
        assert set(c["ratio_to_copy"]) >= {"copy_threads", "ordinary", "streaming"}
        assert all(v > 0 for v in c["ratio_to_copy"].values()) and c["mib"] == 1
        assert ("streaming_over_ordinary_then_read" in c) == (norm == "layer_norm")
        assert c["direction"] == ("backward" if backward else "forward")
    assert memory.STREAM_MIN_BYTES == before


def test_the_streaming_sweep_writes_each_variant_with_its_own_stores(monkeypatch):
    """A CPU plan keeps the store kind it learned on its first call, so after the first
    variant of the sweep every LayerNorm and RMSNorm forward into out= replayed it: the
    sweep compared ordinary stores with ordinary stores.  Each variant's launches now get
    the stores it asks for."""
    from benchmarks import streaming
    from numbanorm.cpu._kernels import layer_norm, memory, rms_norm

    got = []
    for module in (layer_norm, rms_norm):
        launch = module.launch

        def spy(*args, _launch=launch, _name=module.__name__.rsplit(".", 1)[-1], **kwargs):
            got.append((_name, memory.STREAM_MIN_BYTES == 0, bool(args[-1])))  # (asked, its stream flag)
            return _launch(*args, **kwargs)

        monkeypatch.setattr(module, "launch", spy)
    for norm in ("layer_norm", "rms_norm"):
        streaming.case(norm, 1 << 20, rounds=2, budget_s=0)
    asked = {(name, want) for name, want, _ in got}
    assert asked == {(n, w) for n in ("layer_norm", "rms_norm") for w in (False, True)}, got
    assert all(want == flag for _, want, flag in got), got


@pytest.mark.slow
def test_the_backward_sweep_compares_one_gradient_under_both_store_kinds(monkeypatch):
    """benchmarks.streaming --backward: the public backward's launcher takes its streamed
    kernel exactly where the sweep's switch says, and its dx is the same bits whichever
    stores write it (the streamed kernels compiled here, not left to the compile thread)."""
    from benchmarks import streaming
    from numbanorm.cpu._kernels import background, common, memory

    taken = []
    streamed = common.Kernel.streaming
    monkeypatch.setattr(common.Kernel, "streaming", lambda k: taken.append(k) or streamed(k))
    before = memory.STREAM_MIN_BYTES
    rng = np.random.default_rng(0)
    shapes = {"layer_norm": (3, streaming.HIDDEN), "rms_norm": (3, streaming.HIDDEN), "group_norm": (2, 64, 4, 4)}
    try:
        for norm in streaming.NORMS:
            x, dy = (rng.standard_normal(shapes[norm], dtype=np.float32) for _ in range(2))
            grad = streaming._backward_call(norm, x, dy, np.linspace(0.5, 1.5, shapes[norm][1], dtype=np.float32))
            dx = {}
            for stream in (False, True):
                streaming._stores(stream)
                taken.clear()
                with background.synchronous():
                    dx[stream] = grad()
                assert bool(taken) == stream == memory.stream_apart(dx[stream], dy, x), norm
            np.testing.assert_array_equal(dx[True], dx[False])
            assert np.isfinite(dx[True]).all() and np.abs(dx[True]).max() > 0
    finally:
        memory.STREAM_MIN_BYTES = before


def test_the_narrowing_probe_counts_the_streamed_loop_per_16_elements():
    from benchmarks import narrowing

    asm = """
.LBB0_3:
\tvmovups\t(%rax), %ymm0
\tvmovntps\t%ymm0, (%rbx)
\tjne\t.LBB0_3
.LBB0_7:
\tvpmovzxwd\t(%r9,%rdi,2), %ymm6
\tvpsrld\t$16, %ymm7, %ymm6
\tvcmpunordps\t%ymm7, %ymm12, %ymm8
\tvblendvps\t%ymm8, %ymm6, %ymm7, %ymm6
\tvextractf128\t$1, %ymm6, %xmm7
\tvpackusdw\t%xmm7, %xmm6, %xmm6
\tvmovntdq\t%xmm6, (%r10,%rdi,2)
\taddq\t$8, %rdi
\tjne\t.LBB0_7
"""
    loop = narrowing.streamed_loop(asm)
    assert loop[0].startswith("vpmovzxwd") and loop[-1].startswith("jne")  # not the staged copy's loop
    c = narrowing.count(loop)
    assert c["elements_per_iteration"] == 8  # one 16-byte store of 16-bit bits
    assert c["vector_per_16"] == 14 and c["narrowing_per_16"] == 10
    # narrowed by the instruction: the writer's loop into the stack chunk, then put_bfloat16's
    asm = """
.LBB0_48:
\tvpmovzxwd\t(%r11,%r15,2), %zmm4
\tvpslld\t$16, %zmm4, %zmm4
\tvmulps\t%zmm4, %zmm3, %zmm4
\tvmovaps\t%zmm4, 896(%rsp,%r15,4)
\taddq\t$16, %r15
\tjne\t.LBB0_48
.LBB0_50:
\tvmovaps\t%zmm5, 64(%rsp,%r15,4)
\tjne\t.LBB0_50
.LBB0_57:
\tvmovaps\t896(%rsp,%r9,4), %zmm4
\tvcvtneps2bf16\t%zmm4, %ymm5
\tvfpclassps\t$32, %zmm4, %k0
\tkmovd\t%k0, %esi
\tvpor\t%ymm5, %ymm14, %ymm5
\tvmovntdq\t%ymm5, (%r14,%r9,2)
\taddq\t$16, %r9
\tjb\t.LBB0_57
"""
    loop = narrowing.streamed_loop(asm)
    assert loop[0].startswith("vpmovzxwd") and loop[-1] == "jb\t.LBB0_57"  # the writer (896), not the other
    c = narrowing.count(loop)
    assert c["elements_per_iteration"] == 16
    assert c["vector_per_16"] == 4 + 5 and c["narrowing_per_16"] == 3
    assert narrowing.cpu_env("host") == {}
    env = narrowing.cpu_env("znver3")
    assert env["NUMBA_CPU_NAME"] == "znver3"
    feats = env["NUMBA_CPU_FEATURES"].split(",")
    assert "+avx2" in feats and "+f16c" in feats and not any(f.startswith("+avx512") for f in feats)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 code")
def test_the_narrowing_probe_reads_the_streamed_row_function_of_a_real_call(monkeypatch):
    """The probe finds the bfloat16 row function's types after a real call (the row
    function's own, or a parallel kernel's) and reads its streaming variant's loop."""
    import ml_dtypes

    import numbanorm
    from benchmarks import narrowing
    from numbanorm.cpu._kernels import layer_norm, memory

    monkeypatch.setattr(memory, "STREAM_MIN_BYTES", 0)
    x = np.ones((4, 256), ml_dtypes.bfloat16)
    numbanorm.layer_norm(x, 256, np.ones(256, np.float32), np.zeros(256, np.float32), out=np.empty_like(x))
    loop = narrowing.streamed_loop(narrowing._rows_asm(layer_norm))
    assert any(ln.startswith("vmovntdq") for ln in loop)
    assert narrowing.count(loop)["elements_per_iteration"] >= 8


def test_readme_gpu_block_is_generated_from_the_committed_device_runs():
    """The README's GPU table is what ``readme_table --gpu`` makes of the committed
    ``benchmarks/results/gpu-h200*.json`` (measured on the device, never typed), and a
    speed row's ratios are the JSON's times divided."""
    import json
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = [f"benchmarks/results/gpu-h200{s}.json"
             for s in ("", "-b", "-c", "-f1b0c72", "-f1b0c72-b", "-f1b0c72-c")]
    runs = [json.load(open(os.path.join(root, n))) for n in names]
    block = readme_table.render_gpu(runs, names)
    readme = open(os.path.join(root, "README.md")).read()
    assert readme_table.update(readme, block, readme_table.GPU_START, readme_table.GPU_END) == readme
    # the one speed table is the run that timed the most cases: the second, whose kernels the first compiled
    shown = runs[1]
    assert f"Speed in `{names[1]}` (" in block and block.count("Speed in `") == 2
    # and the later lease's rows (newer kernels, one row length) beside the same cases in it
    later = readme_table.gpu_speed_rows(runs[3])
    assert f"Speed in `{names[3]}`, a later run" in block and len(later) == 22

    def times(run, norm, p, dtype):
        """Each impl's ms at (norm, pass, dtype) on 32768 x 4096 in ``run``."""
        return {r["impl"]: r["ms"] for r in run["speed"]
                if (r["norm"], r["pass"], r["dtype"], tuple(r["shape"])) == (norm, p, dtype, (32768, 4096))}

    def of_copy(run):
        t = times(run, "layer_norm", "forward", "float16")
        return f"{t['copy'] / t['numbanorm']:.2f}"

    assert f"| layer_norm | forward | float16 | 32768x4096 | {of_copy(runs[1])} | {of_copy(runs[3])} | " in block
    rows = readme_table.gpu_speed_rows(shown)
    t = times(shown, "rms_norm", "backward", "float32")
    row = next(r for r in rows if r[:4] == ("rms_norm", "backward", "float32", "32768x4096"))
    assert row[5] == f"{t['copy'] / t['numbanorm']:.2f}"
    assert row[8] == f"{t['numbanorm'] / t['torch']:.2f}x"
    timed = {}
    for r in shown["speed"]:
        timed.setdefault((r["norm"], r["pass"], r["dtype"], tuple(r["shape"])), set()).add(r["impl"])
    assert len(rows) == sum({"numbanorm", "copy"} <= impls for impls in timed.values())  # (the budget cut the last)


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy on an imported module
def test_every_command_in_the_benchmarks_readme_parses(monkeypatch):
    """Each ``python -m benchmarks.X ...`` line of benchmarks/README.md's command block
    parses with that module's own arguments, globs expanded as a shell would (its
    gpu_model line once lacked the --sass-dir the module requires)."""
    import argparse
    import glob
    import runpy
    import shlex

    class Parsed(Exception):
        pass

    real = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        real(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.chdir(ROOT)
    block = (ROOT / "benchmarks" / "README.md").read_text().split("```bash\n")[1].split("```")[0]
    commands = [shlex.split(c, comments=True) for c in block.replace("\\\n", " ").splitlines()]
    commands = [c for c in commands if c[:2] == ["python", "-m"] and c[2].startswith("benchmarks.")]
    assert len(commands) >= 30
    bad = []
    for argv in commands:
        args = [m for a in argv[3:] for m in (sorted(glob.glob(a)) if "*" in a else [a])]
        monkeypatch.setattr(sys, "argv", [argv[2], *args])
        try:
            runpy.run_module(argv[2], run_name="__main__")
            bad.append((" ".join(argv), "ran without parsing its arguments"))
        except Parsed:
            pass
        except SystemExit as e:
            bad.append((" ".join(argv), f"exit {e.code}"))
        except ModuleNotFoundError as e:  # a module that needs an extra (bench: matplotlib; torch)
            if e.name not in ("torch", "matplotlib", "transformers", "tqdm"):
                raise
    assert not bad, bad


def test_the_readme_numpy_snippets_run_as_written_one_after_another():
    """The README's usage snippet and the fused one after it, pasted in order into one Python
    session, run (the fused one named a residual, dy and ds no snippet had made)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    numpy_blocks = [b for b in blocks if "numbanorm.torch" not in b and "numbanorm.dask" not in b]
    assert len(numpy_blocks) == 2 and "add_layer_norm" in numpy_blocks[1]
    namespace = {}
    for block in numpy_blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["dx"].shape == namespace["x"].shape


# where each third-party module that benchmarks/ imports comes from: numbanorm's own
# dependencies, an extra of pyproject.toml (by its distribution's name), or None: the GPU
# machine's own (benchmarks/gpu_check.py's peers, installed there, in no extra)
_BENCH_IMPORTS = {"numpy": ("dependencies", "numpy"), "numba": ("dependencies", "numba"),
                  "llvmlite": ("dependencies", "numba"),  # (numba's own dependency)
                  "matplotlib": ("bench", "matplotlib"), "ml_dtypes": ("bench", "ml-dtypes"),
                  "tqdm": ("bench", "tqdm"), "torch": ("torch", "torch"),
                  "transformers": ("hf", "transformers"), "dask": ("dask", "dask"),
                  "distributed": ("dask", "distributed"), "_numba_cuda_redirector": ("cuda", "numba-cuda"),
                  "cupy": None, "liger_kernel": None}


def test_every_module_the_benchmarks_import_comes_with_an_extra():
    """Each third-party module imported anywhere in benchmarks/ (or by numbanorm.measure, the
    harness's base) is installed by the dependency or extra ``_BENCH_IMPORTS`` names for it:
    the bench extra once lacked ml_dtypes, which every bfloat16 case needs."""
    import ast
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    from numbanorm import measure as base  # (the installed package's, in CI)

    files = [*ROOT.glob("benchmarks/*.py"), Path(base.__file__)]
    imported = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"benchmarks", "numbanorm"}
    assert third_party <= set(_BENCH_IMPORTS), f"say where these come from: {third_party - set(_BENCH_IMPORTS)}"
    for module in sorted(third_party):
        if _BENCH_IMPORTS[module] is None:
            continue
        extra, dist = _BENCH_IMPORTS[module]
        names = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower() for r in extras[extra]}
        assert dist in names, f"{module}: {dist} is not in {extra} ({extras[extra]})"
