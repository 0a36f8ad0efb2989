"""benchmarks/gpu_check.py without a GPU, so that the prepared device run cannot rot.

Runs here, in numba's CUDA simulator on numba device arrays: the correctness section's
cases (every kind of case: N = 1, odd N, every boundary kind the launch code has, long
rows, rows striding over the grid, views off alignment, non-contiguous inputs, out=
overlapping x or the weight, parameters of other dtypes), with the kernels' mapping knobs
shrunk as tests/test_cuda.py shrinks them, so that the boundaries the script finds by
recording the launch code fall at rows of a few dozen elements; the boundary finder
itself; the worker pool (two spawned workers); the JSON's shape against the issue's; the
sections that need a GPU skipping with their reasons; the targets' arithmetic and the
model's pairing on a made-up run.

Does not run here (the device run is their test): CuPy and CUDA torch arrays (torch's
CPU build cannot stand in for CUDA tensors), torch's side stream, the inputs over 2**31
elements, compute-sanitizer, every timing (speed, host cost, CPU scaling), CUDA graphs,
and the pool's timed phase; bfloat16 non-contiguous inputs and out= overlaps (numbanorm's
copy path for them fails in the simulator: numpy cannot cast a simulator array to
ml_dtypes' bfloat16).
"""

import json
import math
import time
import types

import pytest

import numbanorm.cuda as nc
from benchmarks import gpu_check as G
from conftest import SIMULATED

if not nc.is_available():
    pytest.skip(f"numbanorm.cuda unavailable: {nc.why_unavailable()}", allow_module_level=True)
if not SIMULATED:
    pytest.skip("these run in the simulator; on a GPU run benchmarks/gpu_check.py itself",
                allow_module_level=True)

from numbanorm.operations import BY_NAME  # noqa: E402
from _simrace import racecheck  # noqa: E402

pytestmark = pytest.mark.slow  # (the default test set leaves this file out: tests/README.md)

# rows in registers to 32 elements, staged copies to 256 bytes, 128 bytes of shared memory
# without opting in (32 of them the reductions' scratch), grids of a block or two
SMALL = dict(MAX_TPR=16, MAX_VPT=2, STAGE_BYTES=256, SHARED_DEFAULT=128, SCRATCH_BYTES=32,
             ROW_RESIDENT=32, MIN_RESIDENT=32)


def _found(op, dtype, tiny=True):
    """label -> n of every boundary found (an n found for several reasons has each)."""
    with G.recording() as launches:
        found = G.boundaries(G.frontend(), launches, BY_NAME[op], dtype, tiny=tiny)
    return {label: n for n, labels in found for label in labels.split("; ")}


def _shared(op, kind, dtype, n):
    with G.recording() as launches:
        fn = BY_NAME[op].functions[1 if kind == "forward" else 2]
        return max(ln.shared for ln in G.launches_of(G.frontend(), launches, fn, dtype, (2, n)))


# ---------------------------------------------------------------- the boundaries come from the launch code

def test_boundaries_are_where_the_launch_code_changes(knobs):
    knobs(**SMALL)
    found = _found("layer_norm", "float16")
    for kind in ("forward", "backward"):
        tag = f"({kind}, odd)"
        first, last = found[f"first staged {tag}"], found.get(f"last staged {tag}")
        assert _shared("layer_norm", kind, "float16", first - 2) == 0 < _shared("layer_norm", kind, "float16", first)
        if last is not None:
            assert _shared("layer_norm", kind, "float16", last) > 0 == _shared("layer_norm", kind, "float16", last + 2)
        under, over = found[f"dynamic <= 128 B {tag}"], found[f"dynamic > 128 B {tag}"]
        assert _shared("layer_norm", kind, "float16", under) <= 128 < _shared("layer_norm", kind, "float16", over)
        under = found[f"dynamic + 32 B static scratch <= 128 B {tag}"]
        assert _shared("layer_norm", kind, "float16", under) + 32 <= 128 < _shared(
            "layer_norm", kind, "float16", under + 2) + 32
    # written down nowhere: a larger staging capacity moves the last staged row
    knobs(STAGE_BYTES=512)
    moved = _found("layer_norm", "float16")
    assert moved["last staged (forward, odd)"] > found["last staged (forward, odd)"]


def test_groupnorm_forward_stages_long_groups_and_its_backward_loops(knobs):
    """GroupNorm's forward stages a long (sample, group) row in shared memory, as the row
    kernels do, then re-reads it from global memory past the stage; its backward's
    channel kernels hold a row in registers or loop over it, and stage nothing."""
    knobs(**SMALL)
    labels = list(_found("group_norm", "float32"))
    for what in ("last in registers", "first staged", "last staged", "first re-read loop"):
        assert f"{what} (forward, odd)" in labels, (what, labels)
    assert "last in registers (backward, odd)" in labels and "first loop (backward, odd)" in labels
    assert not any("staged (backward" in label for label in labels)


def test_the_default_launch_code_has_every_boundary():
    """Without the knobs: the 48 KB boundary (with and without the static scratch) and the
    staging boundaries are found for the 16-bit forward and backward, on both lattices."""
    labels = list(_found("rms_norm", "bfloat16", tiny=False))
    for kind in ("forward", "backward"):
        for lattice in ("words", "odd"):
            tag = f"({kind}, {lattice})"
            for what in ("last in registers", "first staged", "last staged", "first re-read loop",
                         "dynamic <= 49152 B", "dynamic > 49152 B"):
                assert f"{what} {tag}" in labels, (what, tag, labels)
            assert any(label.startswith("dynamic + ") and label.endswith(f"> 49152 B {tag}") for label in labels)


def test_plan_covers_every_function_dtype_and_library():
    cases = G.plan([op.name for op in G.OPERATIONS], G.DTYPES, list(G.LIBS))
    ids = {c["id"] for c in cases}
    assert len(ids) == len(cases)
    for op in G.OPERATIONS:
        for dtype in G.DTYPES:
            item = G.measure.ITEMSIZE[dtype]
            for lib in G.LIBS:
                mine = [c for c in cases if (c["op"], c["dtype"], c["lib"]) == (op.name, dtype, lib)]
                labels = {c["label"] for c in mine}
                variants = {c["variant"] for c in mine}
                layouts = {c["layout"] for c in mine}
                assert any(c["tier"] == 0 for c in mine)
                assert any("first loop" in la or "first staged" in la for la in labels), (op.name, dtype, lib)
                assert {f"offset{b}" for b in (2, 4, 8) if b % item == 0} <= layouts
                assert {"rows_strided", "cols_padded", "last_strided"} <= layouts
                if op.has_out:
                    assert {"out_is_x", "out_shift", "out_weight"} <= variants
                if item == 2:
                    assert "mixed" in variants
                if lib == "torch":
                    assert "side_stream" in variants
            if op.layout == "rows":
                assert any(c["shape"] == [7, 1] for c in cases if c["op"] == op.name)
            if op.name == "group_norm":  # channels whose words the y pass reads from other threads' copies
                assert any(c["label"].startswith("staged groups of 2 channels") and c["shape"][1] == 4
                           and c["shape"][2] // max(1, 16 // item) % 2 for c in cases
                           if (c["op"], c["dtype"]) == (op.name, dtype)), dtype
            striding = [c for c in cases if (c["op"], c["dtype"]) == (op.name, dtype) and "stride" in c["label"]]
            assert striding and all(c["shape"][0] > int(c["label"].rsplit(" ", 1)[1]) for c in striding)
    big = G.big_cases(G.DTYPES)
    assert big and all(math.prod(c["shape"]) > 2**31 for c in big)
    assert any(c["shape"][0] == 1 for c in big)  # one row of more than 2**31 elements


# ---------------------------------------------------------------- the cases run, in the simulator

# one of every kind of case: (operation, dtype, a regular expression its id or label matches)
SELECTION = [
    ("layer_norm", "float32", r"N = 1$|first staged \(forward, odd\)|static scratch > 128 B \(forward|"
                              r"last staged \(forward|first re-read loop \(forward|offset4|rows_strided|cols_padded|"
                              r"out_is_x|out_shift|out_weight"),
    ("add_rms_norm", "float16", r"odd N, short rows|offset2|last_strided|mixed"),
    ("group_norm", "float64", r"groups of 1 element|first loop \(forward, odd\)|offset8|rows stride"),
    ("group_norm", "float32", r"staged groups of 2 channels"),
    ("rms_norm", "bfloat16", r"odd N$|first staged \(backward, odd\)|long row|mixed|rows stride"),
]


def test_cases_of_every_kind_pass_in_the_simulator(knobs):
    """About 25 cases, each called three times per function, checked against the oracle
    and bit-identical across the calls (~40 s in the simulator)."""
    knobs(**SMALL)
    lib = G.NumbaLib()
    cases = [c for op, dtype, sel in SELECTION for c in G.plan([op], [dtype], ["numba"], tiny=True, select=sel)]
    assert len(cases) >= 20
    kinds = {(c["layout"], c["variant"]) for c in cases}
    assert {("contiguous", "out_shift"), ("contiguous", "mixed"), ("offset2", "standard"),
            ("last_strided", "standard")} <= kinds
    with racecheck() as hazards:
        records = [G.run_case(c, lib) for c in cases]
    bad = [(r["id"], r["status"], r.get("why"), r.get("errors")) for r in records if r["status"] != "pass"]
    assert not bad, bad
    assert not hazards, hazards
    for r in records:
        assert all(len(v) == G.CALLS for v in r["errors"].values()), r["id"]
        assert r["launches"] and all(len(ln) == 6 for ln in r["launches"])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_no_kernel_has_a_shared_memory_hazard(knobs, dtype):
    """Every operation's cases at every boundary of the launch code and with rows striding
    over the grid (contiguous and standard: the other layouts and variants copy first, or
    run the same kernel bodies at word widths odd lengths take too), under the simulated race
    check: no two threads of a block touch a shared byte, one of them writing, between the
    same two barriers, and none reads a byte its block did not write (compute-sanitizer's
    racecheck and initcheck on a GPU; the GroupNorm staged-group race showed here, read
    after write and write after read, before its barriers).  Both word widths: 4 and 8
    elements."""
    knobs(**SMALL)
    lib = G.NumbaLib()
    cases = [c for c in G.plan([op.name for op in G.OPERATIONS], [dtype], ["numba"], tiny=True)
             if (c["layout"], c["variant"]) == ("contiguous", "standard")]
    assert len(cases) >= 80
    found = {}
    for c in cases:
        with racecheck() as hazards:
            status = G.run_case(c, lib)["status"]
        if hazards or status != "pass":
            found[c["id"]] = (status, hazards)
    assert not found, found


def test_a_wrong_result_fails_its_case(monkeypatch):
    """An oracle off by one makes the case fail (and a crash is an error), and the targets say so."""
    from numbanorm import reference

    case = G._case("layer_norm", "float32", "numba", (3, 8), "N = 8", 0)
    real = reference.layer_norm_forward
    monkeypatch.setattr(reference, "layer_norm_forward",
                        lambda *a, **k: (real(*a, **k)[0] + 1, *real(*a, **k)[1:]))
    rec = G.run_case(case, G.NumbaLib())
    assert rec["status"] == "fail" and max(rec["errors"]["layer_norm_forward"]) > G.tolerance("float32")
    monkeypatch.undo()
    monkeypatch.setattr(G, "_run_standard", lambda *a: 1 / 0)
    crashed = G.run_case(case, G.NumbaLib())
    assert crashed["status"] == "error" and "ZeroDivisionError" in crashed["why"]
    report = G.Report(None)
    report.add_cases([rec, crashed])
    assert report.data["correctness"]["failed"] == 2
    assert G.targets(report.data)["correctness"]["holds"] is False


# ---------------------------------------------------------------- the JSON

def _check_schema(d):
    """The issue's shape: the keys and their types."""
    for key in ("device", "driver", "versions", "correctness", "sanitizer", "speed", "host_us", "cuda_graph",
                "model", "cpu_scaling"):
        assert key in d, key
    assert isinstance(d["versions"], dict)
    c = d["correctness"]
    assert set(c) == {"passed", "failed", "cases"} and isinstance(c["cases"], list)
    assert c["passed"] == sum(x["status"] == "pass" for x in c["cases"])
    assert c["failed"] == sum(x["status"] in ("fail", "error") for x in c["cases"])
    assert {"tools", "errors"} <= set(d["sanitizer"])
    for row in d["speed"]:
        assert set(row) == {"norm", "pass", "dtype", "shape", "impl", "gbps", "ms"}
        assert row["impl"] in ("numbanorm", "copy", "torch", "torch.compile", "liger")
    assert {"numbanorm", "torch", "shape"} <= set(d["host_us"])
    assert {"captured", "max_abs_diff"} <= set(d["cuda_graph"])
    assert isinstance(d["model"], list) and isinstance(d["cpu_scaling"], list)


def test_main_writes_its_json_and_skips_what_needs_a_gpu(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    G.main(["--tiny", "--jobs", "0", "--skip", "cpu_scaling", "--ops", "layer_norm", "--dtypes", "float32",
            "--select", "N = 1$", "--out", str(out)])
    d = json.loads(out.read_text())
    _check_schema(d)
    assert d["versions"]["numbanorm"] and d["versions"]["kernel_sources_sha256"]
    assert d["correctness"]["passed"] == 1 and d["correctness"]["failed"] == 0
    sections = d["sections"]
    assert sections["correctness"]["status"] == "ran"
    for name in ("speed", "host", "graph", "sanitizer"):
        assert sections[name]["status"] == "skipped" and "simulator" in sections[name]["reason"], name
    assert sections["model"]["status"] == "skipped" and sections["model"]["reason"]
    assert "cpu_scaling" not in sections
    assert d["targets"]["correctness"]["holds"] is True and d["targets"]["copy_fraction"]["holds"] is None
    printed = capsys.readouterr().out
    assert "every case passes: HOLDS" in printed and "[speed: skipped" in printed


def test_resume_counts_the_cases_an_earlier_run_of_the_same_kernels_passed(tmp_path, monkeypatch):
    """A lease reaches a third of the cases (756 of 2284 on the H200): --resume counts what an
    earlier run of the same kernels, sources and device passed, and runs only the rest --
    never when the package's sources differ."""
    first, second, third = (tmp_path / f"{k}.json" for k in "abc")
    common = ["--tiny", "--jobs", "0", "--only", "correctness", "--ops", "rms_norm", "--dtypes", "float32"]
    G.main(common + ["--select", "N = 1$", "--out", str(first)])
    a = json.loads(first.read_text())
    assert a["correctness"]["passed"] == 1 and a["versions"]["package_sources_sha256"]
    G.main(common + ["--select", "N = 1$|odd N$", "--resume", str(first), "--out", str(second)])
    b = json.loads(second.read_text())
    _check_schema(b)
    carried = [c for c in b["correctness"]["cases"] if c.get("carried_from")]
    assert [c["id"] for c in carried] == [c["id"] for c in a["correctness"]["cases"]]
    assert b["resumed"] == {"from": "a.json", "carried": 1, "why_not": ""}
    ran = [c for c in b["correctness"]["cases"] if not c.get("carried_from")]
    assert ran and all(c["status"] == "pass" for c in ran) and len({c["id"] for c in b["correctness"]["cases"]}) \
        == len(b["correctness"]["cases"])
    monkeypatch.setattr(G, "package_sources", lambda: "another tree")
    G.main(common + ["--select", "N = 1$", "--resume", str(first), "--out", str(third)])
    c = json.loads(third.read_text())
    assert c["resumed"]["carried"] == 0 and "package_sources_sha256 differs" in c["resumed"]["why_not"]
    assert c["correctness"]["passed"] == 1 and not c["correctness"]["cases"][0].get("carried_from")


def test_workers_run_the_cases_and_a_second_phase_goes_to_the_same_worker(tmp_path):
    """Two spawned workers (the device run's pool) take the cases and report them; a job's
    second phase goes to the worker that ran its first, and its error comes back (~15 s)."""
    cases = G.plan(["rms_norm", "add_layer_norm"], ["float32"], ["numba"], tiny=True, select="N = 1$")
    jobs = [{"kind": "correctness", "cases": [c], "deadline": time.time() + 600, "id": f"j{k}"}
            for k, c in enumerate(cases)]
    got = []
    pool = G.Pool(2, str(tmp_path / "cache"))
    try:
        left = pool.phase1(jobs, time.monotonic() + 600, lambda job, res, err: got.append((job["id"], res, err)))
        assert left == [] and len(got) == 2 and all(err is None for _, _, err in got)
        assert sorted(r[0]["status"] for _, r, _ in got) == ["pass", "pass"]
        assert set(pool.owner) == {"j0", "j1"} and set(pool.owner.values()) <= set(pool.workers)
        res, err = pool.phase2(jobs[0], timeout=60)  # correctness jobs have no second phase: an error, reported
        assert res is None and "TypeError" in err
        assert len(pool.workers) == 2
    finally:
        pool.close()


def test_targets_and_the_model_on_a_made_up_run():
    shape = [G.SPEED_ROWS, 4096]

    def row(norm, p, dtype, impl, ms):
        nbytes = G._arrays_moved(BY_NAME[norm], p) * math.prod(shape) * (4 if dtype == "float32" else 2)
        return {"norm": norm, "pass": p, "dtype": dtype, "shape": shape, "impl": impl,
                "gbps": round(nbytes / ms / 1e6, 1), "ms": ms}

    speed = [row("layer_norm", "forward", "bfloat16", "copy", 0.090), row("layer_norm", "forward", "bfloat16",
                                                                            "numbanorm", 0.100),
             row("layer_norm", "forward", "bfloat16", "torch", 0.150),
             row("rms_norm", "backward", "float32", "copy", 0.300), row("rms_norm", "backward", "float32",
                                                                        "numbanorm", 0.400),
             row("rms_norm", "backward", "float32", "liger", 0.350)]
    d = G.Report(None).data
    d.update(speed=speed, host_us={"numbanorm": {"layer_norm": [9.0, 16.0]}, "torch": {}, "shape": []},
             cuda_graph={"captured": True, "max_abs_diff": 1e-6, "output_scale": 2.0},
             cpu_scaling=[{"norm": "layer_norm", "pass": "forward", "dtype": "float32", "threads": 16,
                           "vs_copy": 1.1}])
    _check_schema(d)
    t = G.targets(d)
    assert (t["copy_fraction"]["met"], t["copy_fraction"]["of"]) == (1, 2)  # 0.90 >= 0.85; 0.75 < 0.80
    assert t["copy_fraction"]["holds"] is False and "rms_norm backward float32" in t["copy_fraction"]["misses"][0][2]
    assert t["vs_peers"]["torch"] == {"as_fast": 1, "of": 1} and t["vs_peers"]["liger"] == {"as_fast": 0, "of": 1}
    assert t["host"] == {"holds": False, "worst_us": 16.0}
    assert t["cuda_graph"]["holds"] is True and t["cpu"]["holds"] is True
    model = {(m["norm"], m["pass"], m["dtype"]): m for m in G.model_rows(speed)}
    m = model[("layer_norm", "forward", "bfloat16")]
    assert m["measured_fraction_of_copy"] == pytest.approx(0.9, abs=1e-3)
    assert 0 < m["model_fraction"] <= 1 and m["model_issue_memory_ratio"] > 0  # the committed model has N = 4096


def test_model_rows_of_group_norm_are_the_models_records_at_their_shape():
    """A GroupNorm speed row gets the committed model's records at its shape: the forward
    (one launch) its main launch's fraction and the calibrated curve's; the backward the
    fraction over all its launches, which read x and dy twice (channel sums, then dx): at
    most 3/5 of the copy's time for its bytes, and no curve fitted on one launch."""
    shape = list(G.GN_SHAPES[0])

    def row(p, impl, ms):
        nbytes = G._arrays_moved(BY_NAME["group_norm"], p) * math.prod(shape) * 2
        return {"norm": "group_norm", "pass": p, "dtype": "bfloat16", "shape": shape, "impl": impl,
                "gbps": round(nbytes / ms / 1e6, 1), "ms": ms}

    speed = [row(p, impl, ms) for p in ("forward", "backward") for impl, ms in (("copy", 0.05), ("numbanorm", 0.1))]
    fwd, bwd = sorted(G.model_rows(speed), key=lambda m: m["pass"] != "forward")
    assert fwd["measured_fraction_of_copy"] == pytest.approx(0.5, abs=1e-3)
    assert 0 < fwd["model_fraction"] <= 1 and 0 < fwd["calibrated_fraction"] < 1
    assert 0 < bwd["model_fraction"] <= 0.6 + 1e-3 and bwd["calibrated_fraction"] is None


def test_cpu_scaling_times_the_kernel_against_the_threaded_copy():
    """The device check's CPU section on a tiny shape: every norm and direction gives a row
    with its copy beside it (the section once called a floor argument that was gone, a
    TypeError on its first case that only a GPU session would have met)."""
    rows = G.cpu_scaling(time.monotonic() + 60, shape=(64, 256), threads=(1,), dtypes=("float32",))
    assert {(r["norm"], r["pass"]) for r in rows} == {(n, d) for n in G.CPU_NORMS for d in ("forward", "backward")}
    assert all(r["ms"] > 0 and r["copy_ms"] > 0 and r["threads"] == 1 for r in rows)


def test_per_sample_gradients_of_the_graph_sections_model():
    """The graph section's per-sample gradients (torch.func), on CPU tensors: numbanorm's norms
    against torch's give the same gradients; a model with other weights does not."""
    torch = pytest.importorskip("torch")
    import copy

    import numbanorm.torch as nt

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8),
                                torch.nn.RMSNorm(8))
    xs = torch.randn(3, 5, 8)
    assert G.per_sample_grad_diff(nt.replace_norms(copy.deepcopy(eager)), eager, xs) < 1e-5
    other = copy.deepcopy(eager)
    with torch.no_grad():
        other[1].weight.mul_(2)
    assert G.per_sample_grad_diff(nt.replace_norms(other), eager, xs) > 1e-3


def test_sanitizer_summaries_are_read_for_every_tool():
    """racecheck ends its log with a summary of its own, which the H200 run read as no
    summary at all (errors None for 53 clean cases)."""
    from benchmarks.gpu_check import summary_errors

    assert summary_errors("========= ERROR SUMMARY: 0 errors\n") == 0
    assert summary_errors("========= ERROR SUMMARY: 3 errors\n") == 3
    assert summary_errors("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n") == 0
    assert summary_errors("========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n") == 2
    assert summary_errors("========= Target application returned an error\n") is None


def test_host_profile_names_where_a_call_spends_its_time():
    """The host section profiles the public call (on the H200 it cost 39-51 us against
    torch's 12-21, which the stubbed driver did not show): the slow part comes first."""
    from benchmarks.gpu_check import host_profile

    def slow_part():
        t = 0
        for k in range(3000):  # (own time: no built-in does the work)
            t += k
        return t

    def call():
        return slow_part() + len(str(1))

    rows = host_profile(call, 50)
    assert rows[0][0].endswith("(slow_part)") and rows[0][1] == 1.0
    assert all(r[2] >= s[2] for r, s in zip(rows, rows[1:]))  # by own time
    assert next(r for r in rows if r[0].endswith("(call)"))[3] >= rows[0][2]  # cumulative holds it


def test_tune_sets_only_the_launch_codes_knobs_and_is_asked_for(monkeypatch, tmp_path):
    """The tune section (--only tune: the knobs tried on the device, each in a process and a
    numba cache of its own) is not in a default run; a knob that is not one is refused."""
    from numbanorm.cuda._kernels import common as C

    monkeypatch.setattr(C, "ROW_RESIDENT", C.ROW_RESIDENT)
    monkeypatch.setattr(C, "REG_ELEMS", C.REG_ELEMS)
    before = C.row_config(64, 4096, False, 8, C.ROW_RESIDENT, 2, 0)
    G.set_knobs({"ROW_RESIDENT": 1024, "REG_ELEMS": 8})
    assert C.ROW_RESIDENT == 1024 and C.REG_ELEMS == 8
    assert C.row_config(64, 4096, False, 8, C.ROW_RESIDENT, 2, 0).tpr > before.tpr  # (fewer elements per thread)
    with pytest.raises(ValueError, match="not a tuning knob"):
        G.set_knobs({"SIMULATED": 0})
    monkeypatch.undo()  # the knobs as they were, and no mapping made with the others kept
    C.row_config.cache_clear()
    assert "tune" not in G.DEFAULT_SECTIONS and all(k in G.TUNE_KNOBS_NAMES for kn in G.TUNE_KNOBS for k in kn)
    out = tmp_path / "t.json"
    G.main(["--tiny", "--jobs", "0", "--only", "tune", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["sections"]["tune"]["status"] == "skipped" and "simulator" in d["sections"]["tune"]["reason"]
    assert "correctness" not in d["sections"]


def test_a_worker_releases_the_frees_numba_holds_back(monkeypatch):
    """After each job a worker hands back what the libraries keep: numba's pending frees too
    (numba holds up to a fifth of the device's memory per process before it frees; the
    H200 runs' warm-ups were refused for memory the 15 workers held)."""
    import sys
    import types

    cleared = []
    ctx = types.SimpleNamespace(deallocations=types.SimpleNamespace(clear=lambda: cleared.append(1)))
    fake = types.SimpleNamespace(is_available=lambda: True, current_context=lambda: ctx)
    monkeypatch.setitem(sys.modules, "numba.cuda", fake)
    monkeypatch.setattr(G, "_simulated", lambda: False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    G._release()
    assert cleared == [1]


def test_every_speed_case_times_a_compiled_torch_compile(monkeypatch):
    """Every case's torch function is one code object, on which Dynamo counts recompiles:
    at its default limit (8 a process) the ninth case's ``torch.compile`` ran eagerly and
    was timed as torch.compile (the H200's speed-only run of 2026-12-04 hit it). Twelve
    cases in one process each compile their own graph (CPU tensors, a backend that counts)."""
    torch = pytest.importorskip("torch")
    import torch._dynamo as dynamo
    import torch._inductor.config as inductor

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(tuple(tuple(t.shape) for t in example_inputs))
        return gm.forward

    monkeypatch.setattr(G, "COMPILE_BACKEND", counting)
    monkeypatch.setattr(G.SpeedCase, "device", "cpu")
    # (torch's own patch restores what _compiled sets: monkeypatch's undo leaves a hidden
    # config entry unreadable, which broke torch.compile in later tests of the process)
    cfg = dynamo.config
    kept = cfg.patch(recompile_limit=cfg.recompile_limit, accumulated_recompile_limit=cfg.accumulated_recompile_limit,
                     fail_on_recompile_limit_hit=cfg.fail_on_recompile_limit_hit)
    dynamo.reset()
    try:
        with kept, inductor.patch(compile_threads=inductor.compile_threads):
            for dtype in ("float32", "float64", "bfloat16"):
                for n in (16, 24, 40, 72):
                    case = {"norm": "layer_norm", "pass": "forward", "dtype": dtype, "shape": [4, n],
                            "groups": None}
                    sc = G.SpeedCase(case)
                    v, grads = sc._tensors()
                    calls = sc.calls(v, grads)
                    got, want = calls["torch.compile"](), calls["torch"]()
                    assert torch.equal(got, want)
    finally:
        dynamo.reset()
    assert len(graphs) == 12


class _Timeline:
    """A stand-in for torch.cuda: a GPU that runs its queue in order and a host whose calls
    cost time, both in ms; a call launches when its host work ends."""

    def __init__(self):
        self.host = self.gpu = 0.0

    def enqueue(self, ms):
        self.gpu = max(self.gpu, self.host) + ms

    def call(self, host_ms, gpu_ms):
        def f():
            self.host += host_ms
            self.enqueue(gpu_ms)
        return f

    @property
    def cuda(self):
        line = self

        class Event:
            def __init__(self, enable_timing=True):
                self.t = None

            def record(self):
                self.t = max(line.gpu, line.host)
                line.gpu = self.t

            def synchronize(self):
                line.host = max(line.host, self.t)

            def elapsed_time(self, other):
                return other.t - self.t

        return types.SimpleNamespace(Event=Event, _sleep=lambda cycles: line.enqueue(cycles / 2e6),
                                     synchronize=lambda: setattr(line, "host", max(line.host, line.gpu)),
                                     empty_cache=lambda: None)


def test_a_speed_row_is_the_gpu_time_of_a_call_whose_host_cost_is_longer(monkeypatch):
    """A call of 0.03 ms on the GPU and 0.08 ms on the host (GroupNorm's on the H200) is timed
    at 0.03 ms, its host cost beside it: the calls wait behind a sleep while the host queues
    them. Timed back to back, as before, it took the host's 0.08 ms."""
    pytest.importorskip("torch")
    line = _Timeline()
    case = {"norm": "group_norm", "pass": "forward", "dtype": "float32", "shape": [8, 512, 64, 64], "groups": 32}
    sc = G.SpeedCase(case, peers=False)
    sc.torch, sc.clock = line, lambda: line.host / 1e3
    x = types.SimpleNamespace(numel=lambda: 8 * 512 * 64 * 64, element_size=lambda: 4)
    monkeypatch.setattr(sc, "_tensors", lambda: ({"x": x}, {}))
    monkeypatch.setattr(sc, "calls", lambda v, grads: {"numbanorm": line.call(0.08, 0.03),
                                                       "copy": line.call(0.01, 0.02)})
    rows, skipped = sc.time(rounds=5)
    got = {r["impl"]: r for r in rows}
    assert got["numbanorm"]["ms"] == pytest.approx(0.03) and got["copy"]["ms"] == pytest.approx(0.02)
    assert got["numbanorm"]["host_ms"] == pytest.approx(0.08)
    assert all(r["unqueued_samples"] == 0 for r in rows) and skipped == {}


def test_phase_one_leaves_the_later_sections_their_budgets():
    """Phase 1 (correctness and the warm-ups) ends, and its busy workers are killed, no later
    than the run's deadline less the budgets of the sections after it. A speed-only run on the
    H200 (--deadline 125, the correctness budget's default 120) spent it all warming up, its
    workers given a minute more, and was killed by its time limit with nothing timed."""
    args = G.parse(["--only", "speed", "host", "graph", "model", "--deadline", "125", "--budget", "speed=20",
                    "--out", "x.json"])
    run = G.Run(args, types.SimpleNamespace(data={"sections": {}}))
    end, kill_at = run.phase1_deadlines()
    after = 20 + G.BUDGET_S["host"] + G.BUDGET_S["graph"] + G.BUDGET_S["model"]
    assert end <= kill_at <= run.t0 + 125 - after + 1e-6
    assert end - run.t0 > 125 - after - 5  # and no sooner
    args = G.parse(["--deadline", "1000", "--out", "x.json"])  # a budget, not the deadline, ends it
    run = G.Run(args, types.SimpleNamespace(data={"sections": {}}))
    end, kill_at = run.phase1_deadlines()
    assert end <= run.t0 + G.BUDGET_S["correctness"] + 1 and kill_at > end + 60


def test_a_speed_run_warms_host_and_graph_before_its_speed_cases(monkeypatch):
    """In a run of the timed sections alone (the lease's second and fourth), the host and
    graph jobs come before the speed warm-ups, which may not all fit in phase 1."""
    monkeypatch.setattr(G, "_why_no_torch_cuda", lambda: "")
    args = G.parse(["--only", "speed", "host", "graph", "model", "--out", "x.json"])
    run = G.Run(args, types.SimpleNamespace(data={"sections": {}}))
    kinds = [j["kind"] for j in G.build_jobs(run, [op.name for op in G.OPERATIONS], list(G.DTYPES), list(G.LIBS))]
    assert kinds[:2] == ["host", "graph"] and set(kinds[2:]) == {"speed"} and len(kinds) > 50


def test_the_lease_script_runs_parse_and_fit_a_lease():
    """benchmarks/gpu_lease.sh's gpu_check runs parse with the script's own arguments; each
    run's time limit leaves its deadline room to write the JSON; and the two calls' limits
    with a machine's start (a minute) fit a 15-minute lease."""
    import os
    import re
    import shlex

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_lease.sh")
    text = open(path).read().replace("\\\n", " ")
    calls = {}
    for part, body in re.findall(r"^(\d)\)\n(.*?);;", text, re.S | re.M):
        for name, limit, rest in re.findall(r"^\s*check (\S+) (\d+) (.*)$", body, re.M):
            args = G.parse(shlex.split(rest) + ["--out", "x.json"])
            assert int(limit) >= args.deadline + 10, (name, limit, args.deadline)
            run = G.Run(args, types.SimpleNamespace(data={"sections": {}}))
            end = run.phase1_deadlines()[0] - run.t0
            if "correctness" in run.sections or "speed" in run.sections:
                assert end > 0.5 * args.deadline, (name, end)  # phase 1 keeps most of a run
            calls[part] = calls.get(part, 0) + int(limit)
    assert set(calls) == {"1", "2"}
    assert calls["1"] + 30 + calls["2"] + 60 <= 900, calls  # (call 1 installs wheels for about 20 s)
