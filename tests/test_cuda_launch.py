"""The hardware launch path, without a GPU: numba-cuda's real dispatcher, compiler and
argument marshalling, only the driver stubbed (``tests/_nosim_launch.py``)."""

import json
import os
import subprocess
import sys

import pytest
from _marks import EXHAUSTIVE

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def kernel_cache(request, tmp_path_factory):
    """One Numba cache for the launch-path tests that count no compiles: the first process
    to need a kernel compiles it with NVVM, the later ones load it (each test is a process
    of its own; the xdist workers share the folder, which Numba writes a file at a time,
    whole).  Kept in pytest's cache folder from run to run, so that the slow set's run
    loads what the default set's compiled (keyed on every kernel module's source: an
    edit compiles anew, common.source_stamp); in the run's temporary folder
    where pytest keeps no cache (``-p no:cacheprovider``).  The tests of compiling and
    caching keep a cache of their own."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return {"NUMBA_CACHE_DIR": str(cache.mkdir("launch-kernels"))}
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "launch-kernels"
    path.mkdir(exist_ok=True)
    return {"NUMBA_CACHE_DIR": str(path)}


def _run(*argv, env=None):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, os.path.join(HERE, "_nosim_launch.py"), *map(str, argv)],
                         capture_output=True, text=True, env=env, timeout=600)
    if out.returncode and ("libnvvm" in out.stderr.lower() or "nvvm" in out.stderr.lower()):
        pytest.skip("NVVM is not installed: " + out.stderr.strip().splitlines()[-1])
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.exhaustive
def test_repeated_launches_reach_the_driver_with_a_core_stream(kernel_cache):
    """The first launch dispatches; the later ones go straight to the compiled kernel
    (numbanorm's cached specialization) and must hand cuda.core a stream it accepts,
    with the same kernel, grid, block and arguments as the dispatcher's launch."""
    res = _run(64, 1024, env=kernel_cache)
    assert res["errors"] == [], res["errors"]
    assert res["resolved"] == 1
    first, *rest = res["launches"]
    assert len(rest) == 2
    for later in rest:
        assert later == first
    assert first["stream"] == 0 and first["block"][0] > 0
    # the direct launch marshals rows without their word views (common.Words): the
    # driver gets what numba's dispatcher gave it for the same views
    for name, per_call in (("backward", 2), ("bfloat16", 1), ("group", 1)):
        calls = [res[name][k:k + per_call] for k in range(0, len(res[name]), per_call)]
        assert len(calls) == 3 and calls[1] == calls[0] and calls[2] == calls[0], name


@pytest.mark.slow  # (the simulator's test_public_backward_is_two_launches_for_any_weight_dtype in the default set)
def test_a_backward_is_two_launches_whatever_the_weight_dtype(kernel_cache):
    """The public backward reaches the driver twice (row kernel, column sums) with float32
    and with float16 weights: the column sums store dweight/dbias in the weight's dtype
    (there were two cast launches after them for float16 weights)."""
    res = _run("count", 64, 1024, env=kernel_cache)
    for w in ("float32", "float16"):
        assert res[f"layer_forward_{w}"] == 1
        assert res[f"layer_backward_{w}"] == 2, res
        assert res[f"rms_backward_{w}"] == 2, res
        assert res[f"layer_backward_{w}_dtypes"] == ["float16", w, w]
        assert res[f"rms_backward_{w}_dtypes"] == ["float16", w]


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_new_row_count_compiles_no_new_kernel(tmp_path):
    """M = 1..4096 at N = 1024 float16, LayerNorm forward and backward: the grid (and the
    partial-row count) changes with M, the compiled code must not."""
    res = _run("sweep", 1024, 4096, env={"NUMBA_CACHE_DIR": str(tmp_path)})
    assert res["launches"] == 3 * 4096  # forward, backward, column sums
    # many launch configurations (the grid is one wave of resident blocks: at most 132 x 4
    # at N = 1024, so fewer distinct grids than the two waves of before) ...
    assert res["configs"] > 500 and res["grids"] > 100
    assert res["kernels"] <= 6, res  # ... a handful of kernels


@pytest.mark.slow
@pytest.mark.exhaustive
def test_kernels_cached_on_disk_keyed_on_all_their_sources(tmp_path):
    """A second process reads every kernel from numba-cuda's disk cache, without
    registering numba-cuda's lowerings (common._load_without_refresh), and launches them
    as the first did; the cache is keyed on the source of every module the kernels inline
    (reduce.py, common.py ...), not only on the file of the kernel itself (numba's own rule)."""
    import hashlib
    import importlib.util

    # the numbanorm the subprocess imports: the installed one in CI (the tests run from a
    # copy beside no source tree), the checkout in a development install
    pkg = importlib.util.find_spec("numbanorm").submodule_search_locations[0]
    kdir = os.path.join(pkg, "cuda", "_kernels")
    h = hashlib.sha256()
    for name in sorted(os.listdir(kdir)):
        if name.endswith(".py"):
            with open(os.path.join(kdir, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    env = {"NUMBA_CACHE_DIR": str(tmp_path)}
    first = _run("sweep", 1024, 140, env=env)
    again = _run("sweep", 1024, 140, env=env)
    assert first["cache_hits"] == 0 and again["cache_hits"] == again["kernels"] == first["kernels"]
    assert (first["lowerings_registered"], again["lowerings_registered"]) == (True, False)
    assert (again["launches"], again["configs"], again["grids"]) == (first["launches"], first["configs"], first["grids"])
    assert again["stamps"] == [h.hexdigest()]


@pytest.mark.slow
def test_a_replayed_call_hands_the_driver_what_the_full_path_does(kernel_cache):
    """The public functions replay a call seen before (``cuda._backend.Replays``): for every
    call -- each operation's forward and backward, and calls that differ from a learned
    one in one thing -- the driver gets from the public frontend exactly what the full
    path (validation, launchers, direct launch) gives it for the same arguments, and the
    same results come back; a call seen before is replayed by its third time at the
    latest; one that differs in shape, dtype, a parameter, eps, alignment (to 2, 8 or
    16 bytes: element, 8-byte or 16-byte words), out= (overlapping an input or not; a
    read-only one, refused by both paths, is never replayed), which
    arguments are the same array or the array type (numba's, another library's through
    the CUDA Array Interface) is not replayed from another call's plan; a strided x
    (copied first) is never replayed; the caller's stream (a numba array's, a producer's,
    torch's or CuPy's current one) is used as given -- for numba arrays, other CUDA Array
    Interface arrays, CUDA torch tensors and CuPy arrays alike."""
    res = _run("replay", 64, 1024, env=kernel_cache)
    for name, calls in res.items():
        for k, (public, full) in enumerate(calls):
            assert not full["replayed"], name
            assert public["launches"] == full["launches"], (name, k)
            assert public["results"] == full["results"], (name, k)
            assert public["error"] == full["error"], (name, k)
            assert public["launches"] or name in ("again", "torch requires_grad", "foreign_readonly_out"), name
    learned = [n for n in res if n != "again"]
    for name in learned:
        replayed = [public["replayed"] for public, _ in res[name]]
        if name == "foreign_readonly_out":  # a read-only out= refused by both paths, after a writable one learned
            assert replayed == [False] * 4, name
            assert all(p["error"] == f["error"] == "ValueError: `out` is read-only" for p, f in res[name])
        elif name == "torch requires_grad":  # refused by the full path (numbanorm's TypeError), never keyed
            assert replayed == [False] * 4
            assert res[name][0][0]["error"].startswith("TypeError: `x` is a torch.Tensor that requires grad")
        elif name.endswith("strided"):
            assert replayed == [False] * 4
            assert res[name][0][0]["launches"][0]["kernel"] == "numba setitem"
        elif name.startswith("out_overlaps"):  # computed apart and copied in: never replayed
            assert replayed == [False] * 4
            assert res[name][0][0]["launches"][-1]["kernel"] == "numba setitem"
        else:
            assert replayed[2:] == [True, True], name
    # a new key is never served by an earlier plan on its first call
    for name in ("dtype", "weight_dtype", "no_bias", "unaligned", "unaligned16", "layer_norm_backward", "foreign"):
        assert not res[name][0][0]["replayed"], name
    for name in ("shape", "rows", "eps", "eps_int", "out", "same_dy_and_x", "foreign_readonly_x"):  # (resolved)
        assert not res[name][0][0]["replayed"] and res[name][1][0]["replayed"], name
    # the caller's stream, not the stream of the call the plan was learned from
    assert {la["stream"] for public, _ in res["stream"] for la in public["launches"]} == {0x5EED}
    assert {la["stream"] for public, _ in res["layer_norm_forward"] for la in public["launches"]} == {0}
    # another library's arrays (CUDA Array Interface): its producer's stream, its own out=
    assert {la["stream"] for public, _ in res["foreign_stream"] for la in public["launches"]} == {0xBEEF}
    assert {la["stream"] for public, _ in res["foreign"] for la in public["launches"]} == {0x5EED}
    assert all(public["results"][0][0] == "Foreign" for public, _ in res["foreign_out"])
    # CUDA torch tensors and CuPy arrays (tests/_fake_libs.py): every operation forward and
    # backward, float16 and bfloat16 tensors, out= (x itself too), a float32 dy (cast), eps
    # ... replayed from their library's allocator, on the library's current stream
    libs = [n for n in learned if n.startswith(("torch", "cupy"))]
    assert len(libs) == 38
    for name in libs:
        want = 0x70C4 if name.startswith("torch") else 0xC0B1
        if "default stream" in name:
            want = 0
        for public, _ in res[name]:
            assert {la["stream"] for la in public["launches"]} <= {want}, name
            assert all(r[0] == ("Tensor" if name.startswith("torch") else "ndarray") for r in public["results"]), name
    # after all of them, each call is still its own (no plan overwritten by another's)
    assert all(public["replayed"] for public, _ in res["again"][:1])


@pytest.mark.parametrize("dtype", ["float32", pytest.param("float64", marks=EXHAUSTIVE),
                                   pytest.param("bfloat16", marks=EXHAUSTIVE)])
def test_every_operation_replayed_as_the_full_path_launches_it_in_every_dtype(kernel_cache, dtype):
    """The replayed launches are what the simulator's tests cannot see (the simulator
    launches through numba's dispatcher: no marshalled arguments, no replays), so the
    replay path is tested where the launches are real: with the driver stubbed, each
    operation's forward and backward in each dtype (float16 in the test above), with its
    weight and bias and LayerNorm/RMSNorm without a weight (absent arguments as dummies),
    hands the driver the same launches through a replay as through the full path, and
    returns the same results, call by call; replayed from the third call."""
    res = _run("every", 64, 1024, dtype, env=kernel_cache)
    assert len(res) == 12
    for name, calls in res.items():
        for k, (public, full) in enumerate(calls):
            assert public["error"] is None and public["launches"], (name, k)
            assert public["launches"] == full["launches"], (name, k)
            assert public["results"] == full["results"], (name, k)
        assert [public["replayed"] for public, _ in calls][2:] == [True, True], name
        assert dtype in str(calls[0][0]["results"][0]), name  # (dx, y: x's dtype)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_long_rows_get_their_dynamic_shared_memory_allowed_before_the_launch(kernel_cache):
    """Float16 rows of 32768 elements: the forward stages x (64 KB), the backward x and dy
    (128 KB) in dynamic shared memory, more than the 48 KB a kernel gets unless it opts in.
    Through numba's dispatcher, the direct launch and a replay alike, the driver sees the
    kernel's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES set to the row's bytes before
    its first launch (and once per kernel and context: again in a new context, before a
    replayed launch), and every launch carries those bytes."""
    res = _run("shared", 4, 32768, env=kernel_cache)
    assert res["bytes"] == {"forward": 65536, "backward": 131072}
    for name in ("forward", "backward"):
        nbytes, calls = res["bytes"][name], res[name]
        replayed = [c["replayed"] for c in calls]
        assert replayed[:4] == [False] * 4 and replayed[5:] == [True, True], name  # (full path, learned; replays)
        for k, call in enumerate(calls):
            events = call["events"]
            main = [e for e in events if e["kernel"].startswith(f"{name}_kernel")]
            attrs = [e for e in main if "attribute" in e]
            launched = [e for e in main if "attribute" not in e]
            assert [e["shared"] for e in launched] == [nbytes], (name, k)
            # the other launches (the backward's column sums) ask for none
            assert all(e.get("shared", 0) == 0 for e in events if e not in main), (name, k)
            if k in (0, 6):  # the kernel's first launch in its context: allowed first
                assert attrs == [{"attribute": "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES",
                                  "value": nbytes, "kernel": main[0]["kernel"], "lib": main[0]["lib"],
                                  "device": 0}], (name, k)
                assert main.index(attrs[0]) < main.index(launched[0]), (name, k)
            else:
                assert attrs == [], (name, k)


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_the_opt_in_counts_the_kernels_static_shared_memory(kernel_cache, direction):
    """The 48 KB a block gets without opting in covers static and dynamic shared memory
    together, and the row kernels carry static scratch for their reductions: at each side
    of the boundary (float16 and bfloat16 forward at N = 24448 | 24449 .. 24576, float32 at
    12224 | 12225 .. 12288, float64 at 6080 | 6081 .. 6144; the 16-bit backward, x and dy
    staged, at 12192 | 12193 .. 12288; rows in 16-byte words and element by element), the
    driver sees CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES set to the launch's dynamic
    bytes before the launch exactly where they and the kernel's static size as ``ptxas -v``
    reports it for sm_90 (what the driver reports for the loaded kernel) pass 48 KB -- on
    every path: numba's dispatcher, the direct launch, a replay, each in a new context."""
    if not __import__("numbanorm.cuda._ptx", fromlist=["find_tool"]).find_tool("ptxas"):
        pytest.skip("ptxas is not installed")
    res = _run("optin", direction, env=kernel_cache)
    assert len(res) >= 7
    over = 0
    for case, got in res.items():
        calls = got["calls"]
        assert [c["replayed"] for c in calls] == [False, False, False, True, True], case
        for k, call in enumerate(calls):
            events = call["events"]
            for e in events:
                if "attribute" in e or not e.get("shared"):
                    continue
                static = got["static"][str(e["lib"])]
                assert static > 0 and e["shared"] + static <= 232448, (case, static)  # the per-block maximum
                attrs = [a for a in events if "attribute" in a and a["lib"] == e["lib"]]
                if e["shared"] + static > 48 * 1024:
                    over += k == 0
                    assert attrs == [{"attribute": "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES",
                                      "value": e["shared"], "kernel": e["kernel"], "lib": e["lib"],
                                      "device": 0}], (case, k)
                    assert events.index(attrs[0]) < events.index(e), (case, k)
                else:
                    assert attrs == [], (case, k)
    # both sides of the boundary, the dynamic bytes alone under 48 KB on the far side of it
    assert 0 < over < len(res), over


@pytest.mark.slow
def test_a_call_on_torch_or_cupy_arrays_takes_their_memory_and_stream_only(kernel_cache):
    """Each operation's forward and backward on CUDA torch tensors (float16, bfloat16; on a
    stream of torch's and on its default stream) and CuPy arrays, by ``numbanorm.cuda`` and
    the top level, the first call included: every array of the call -- results, the
    backward's partial sums, a strided x's contiguous copy, a float32 dy's float16 cast --
    comes from the library's allocator (PyTorch's caching allocator, CuPy's pool: the
    stand-ins of tests/_fake_libs.py) on the caller's current stream; nothing from numba's
    (cuMemAlloc, and cuMemFree after it), no synchronization (numba's copy on stream 0
    would synchronize), no host-device copy, every launch on the caller's stream: what
    CUDA-graph capture (``torch.cuda.graph``) requires.  A plain call allocates its results
    alone (y, or y and s: no statistics), and the top level replays a call that
    ``numbanorm.cuda`` learned without checking the arrays' sides again."""
    res = _run("alloc", 64, 1024, env=kernel_cache)
    assert len(res) == 50
    for case, got in res.items():
        lib, name = case.split()[0], case.split()[-1]
        if name in ("layer_norm", "group_norm", "add_rms_norm"):
            assert all(len(c["lib_allocs"]) == c["n_results"] == (2 if name.startswith("add") else 1)
                       for c in got["calls"]), case
        top = got["calls"][3]  # (a strided x is copied by numba: never learned)
        assert top["sides"] == (1 if name == "strided_x" else 0), case
        for k, call in enumerate(got["calls"]):
            where = (case, k)
            assert call["numba_allocs"] == 0, where
            assert call["syncs"] == [], where
            assert call["launch_streams"] == [got["stream"]], where
            assert call["results"] == [{"torch": "_fake_libs.Tensor", "cupy": "_fake_libs.ndarray"}[lib]], where
            # the allocator's own tensors on every path (a wrapper of the full path's numba view
            # made record_stream a no-op: PyTorch records streams of its own allocations only)
            assert all(call["owned"]) and len(call["owned"]) == (call["n_results"] if lib == "torch" else 0), where
            assert call["lib_allocs"] and {tuple(a[1:]) for a in call["lib_allocs"]} == {(0, got["stream"])}, where
            if "backward" in case or "dy" in case:  # the partial sums beside the results (and dy's cast)
                assert len(call["lib_allocs"]) > call["n_results"], where
            if "strided" in case:
                assert call["kernels"][0] == "numba setitem", where


def test_the_edges_of_the_arrays_a_call_takes(kernel_cache):
    """A CUDA torch tensor with the negative bit (``z.conj().imag``) was read from its memory,
    which holds the values negated: its values are resolved into a copy on every call (no
    replay reads the memory), and such an ``out`` is refused; a float8 tensor got a bare
    KeyError from torch's interface, now numbanorm's TypeError naming it; a call on a numba
    array bound to a stream returned results bound to stream 0, now to the call's, on every
    path; bfloat16 through another library's interface (typestr ``<V2``) was refused as void;
    a first call on one row warned of the grid numbanorm chose ("Grid size 1 will likely
    result in GPU under-utilization")."""
    res = _run("edges", 64, 256, env=kernel_cache)
    assert res["neg_resolved"] == [1, 1, 1]
    assert res["neg_out"].startswith("TypeError: `out` is a torch.Tensor with the negative bit")  # (as the CPU's)
    assert res["float8"].startswith("TypeError: `x` has dtype torch.float8_e4m3fn")
    assert res["numba_result_streams"] == [[True] * 3] * 3
    assert res["bfloat16_interface"] == [None] * 3
    assert res["first_call_warnings"] == []


def test_a_plan_learned_with_two_arguments_one_object_serves_them_apart(kernel_cache):
    """A replay found its call's stream, and its out=, by object identity: learned with dy
    given as x, a call of the same memory through x bound to another stream replayed on
    dy's stream (0), its results bound there, where the full path runs on x's; learned with
    out= as x, a call whose out= is another object over x's memory got x back, not its
    out=.  Both by their roles' places now.  And with numbanorm.cuda loaded, a sparse CPU
    tensor got torch's RuntimeError from the replays' key, not numbanorm's TypeError."""
    res = _run("aliases", 64, 1024, env=kernel_cache)
    assert res["full"] == {"launch_streams": [0x5EED], "result_streams": [0x5EED] * 3, "out_returned": True}
    assert res["public"] == res["full"] and res["replayed"]
    assert res["sparse"].startswith("TypeError: `x` is a torch.Tensor of layout torch.sparse_coo")


@pytest.mark.slow
def test_the_arrays_device_runs_the_call_and_two_devices_are_refused(kernel_cache):
    """Two GPUs (132 and 114 SMs), device 0 current: a call on arrays of device 1 (numba's,
    torch's, another library's) is launched in device 1's context with a grid sized by its
    SMs, allocates there, and is replayed only from a plan learned there (its long row's
    shared-memory opt-in set in device 1's context too); the device scope is closed after
    every call; a stateful layer's copies of x and the weight are made there too.  Arrays on
    both devices: ValueError naming the odd one out, before anything is allocated or launched;
    a host array among them: TypeError before the driver is asked anything.  bfloat16 is
    refused on a GPU of capability under 8.0, by the array's GPU, not the current one."""
    res = _run("devices", 4096, 1024, env=kernel_cache)
    assert res.pop("current") == [0]
    for name in ("numba", "top_level"):  # a host weight: TypeError from the types, before any driver call
        host = res.pop(f"host {name}")
        assert host["error"].startswith("TypeError: ") and host["driver"] == 0 and not host["launches"], host
    graded = res.pop("requires_grad")  # numbanorm's TypeError, as for a CPU tensor, before anything runs
    assert graded["error"].startswith("TypeError: `weight` is a torch.Tensor that requires grad"), graded
    assert graded["launches"] == graded["numba_allocs"] == graded["lib_allocs"] == []
    # bfloat16 asks the capability of the array's GPU, not the current one's (device 1: 7.5)
    refused, ran = res.pop("bfloat16 on 1"), res.pop("bfloat16 on 0, 1 current")
    assert refused["error"] == ("TypeError: `x` is bfloat16: bfloat16 needs a GPU of compute capability 8.0 "
                                "or newer; GPU 1's is 7.5"), refused
    assert refused["launches"] == refused["numba_allocs"] == refused["lib_allocs"] == []
    assert ran["error"] is None and {la[0] for la in ran["launches"]} == {0}, ran
    grids = {0: set(), 1: set()}
    for case, calls in res.items():
        if case.startswith("mixed"):
            continue
        name, d = case.rsplit(" ", 1)
        d = int(d)
        for call in calls:
            assert call["error"] is None, case
            assert call["launches"] and {la[0] for la in call["launches"]} == {d}, case
            assert set(call["numba_allocs"]) | set(call["lib_allocs"]) == {d}, case
            assert {a[0] for a in call["attributes"]} <= {d}, case
            grids[d].add(call["launches"][0][1])
        if name == "staged":  # a plan per device: device 1's first call is not served by device 0's
            assert not calls[0]["replayed"] and calls[-1]["replayed"], case
            assert calls[0]["attributes"] == [[d, 65536]] and not any(c["attributes"] for c in calls[1:]), case
    # the row kernels' grid: a wave of resident blocks on each SM of the call's device
    assert {264, 4} <= grids[0] and {228, 4} <= grids[1] and 264 not in grids[1], grids
    for case in ("numba_weight", "numba_out", "torch_bias", "torch_backward_x"):
        for call in res["mixed " + case]:
            assert call["error"].startswith("ValueError: `") and "on GPU 1" in call["error"] \
                and "on GPU 0" in call["error"], (case, call["error"])
            assert call["launches"] == call["numba_allocs"] == call["lib_allocs"] == [], case


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=EXHAUSTIVE)])
def test_host_copies_and_strided_inputs_go_through_numbas_real_transfers(kernel_cache, dtype):
    """On a GPU numba copies a host array as a buffer (the buffer protocol has no format
    for ml_dtypes' bfloat16: "cannot include dtype 'E' in a buffer") and indexes a
    device array without Ellipsis (``a[...] = b`` raised TypeError); the simulator does
    both through NumPy and showed neither.  Both failed every bfloat16 host copy and
    every non-contiguous input on an H200 (benchmarks/results/gpu-h200.json's first run);
    float16 (which float32 and float64 copy as) is the exhaustive set's."""
    res = _run("transfers", 4, 64, dtype, env=kernel_cache)
    assert len(res) == 5
    assert {case: why for case, why in res.items() if why} == {}


@pytest.mark.slow
def test_the_host_cost_benchmark_times_every_path_and_takes_each_paths_own_stub(kernel_cache, tmp_path,
                                                                                 monkeypatch, capsys):
    """``benchmarks.gpu_host`` (two calls a round; callgrind left out): every path timed, and
    each path's share of the stubs from its own launches and allocations -- a plain LayerNorm
    allocates its y alone, by ``numbanorm.cuda``, by the top level and on torch and CuPy
    arrays, where its forward allocates y, mean and rstd."""
    import shutil

    from benchmarks import gpu_host

    monkeypatch.setenv("NUMBA_CACHE_DIR", kernel_cache["NUMBA_CACHE_DIR"])
    monkeypatch.setattr(shutil, "which", lambda name: None)  # (no valgrind: minutes under callgrind)
    out = tmp_path / "host.json"
    gpu_host.main(["--calls", "2", "--json", str(out)])
    res = json.loads(out.read_text())
    allocs, launches, t = res["allocations"], res["launches"], res["cpu_us"]
    assert allocs["layer_norm_forward"] == 3 and allocs["layer_norm_forward_torch"] == 3
    for name in ("layer_norm_cuda", "layer_norm_top", "layer_norm_top_torch", "layer_norm_top_cupy"):
        assert allocs[name] == 1 and launches[name] == 1, name
    assert t["layer_norm_top_torch_stub"] == round(t["stub_driver"] + t["torch_alloc"] + t["torch_stream"], 2)
    for name in launches:
        assert t[name + "_stub"] > 0 and (t.get(name) or t[name + "_replay"]) > 0, name
    assert "layer_norm_top_cupy" in capsys.readouterr().out
