"""The ``numbanorm`` command: info, check, bench, compile, the no-argument main job, bad arguments."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numbanorm.cpu as cpu
from conftest import SIMULATED
from numbanorm import __main__ as cli


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for word in ("numbanorm", "numba", "numpy", "threads", "cpu", "oracle", "gpu"):
        assert word in out


@pytest.mark.slow
def test_check_passes_on_the_cpu_kernels(capsys):
    assert cli.main(["check", "--impl", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("cpu ")]
    # every operation of the table (fused ones included), group norm also with one group per
    # channel and at a size for its parallel kernel, x forward/backward x float16/32/64:
    # counted, not assumed
    from numbanorm import operations

    n = sum(len(cli.CHECK_SHAPES[op.layout]) for op in operations.OPERATIONS) * 2 * 3
    assert n == 42 and len(lines) == n and all(line.endswith("pass") for line in lines)
    assert {line.split()[1] for line in lines} == {op.name for op in operations.OPERATIONS}
    assert f"{n} of {n} checks passed" in out
    _tolerances_shown(lines)


@pytest.mark.parallel_kernels
def test_check_runs_the_parallel_kernels_not_their_stand_ins(monkeypatch):
    """With an empty kernel cache a first call runs a parallel kernel's row function on one
    thread while the kernel compiles in the background, so a newcomer's check checked no
    parallel kernel (and GroupNorm's shapes were all under the parallel size): check
    compiles them where it calls them, and has a group norm shape past common.SERIAL_BELOW."""
    import io

    from numbanorm.cpu._kernels import background, common

    seen = []
    run = common._run

    def recorded(kernel, size, args, optional):
        seen.append((kernel.rows.py_func.__module__.rsplit(".", 1)[-1], size >= common.SERIAL_BELOW,
                     getattr(background._local, "synchronous", False)))
        return run(kernel, size, args, optional)

    monkeypatch.setattr(common, "_run", recorded)
    assert cli.check(impls=["cpu"], dtypes=("float32",), out=io.StringIO()) == 0
    parallel = {module for module, big, synchronous in seen if big and synchronous}
    assert {"layer_norm", "rms_norm", "group_norm"} <= parallel, seen
    assert all(synchronous for _, _, synchronous in seen)


def _tolerances_shown(lines):
    """The tol column of check's lines is each dtype's tolerance as the table has it (a
    format of no decimals showed bfloat16's 1.6e-2 as 2e-02, over a failing error)."""
    from numbanorm import operations

    for line in lines:
        dtype, tol = line.split()[3], line.split()[-2]
        assert float(tol) == operations.tolerance(dtype), line


def _shifted_y(fn, delta):
    def broken(*args, **kw):
        y, *rest = fn(*args, **kw)
        return (y + np.asarray(delta, y.dtype), *rest)
    return broken


def test_check_detects_a_wrong_forward(capsys, monkeypatch):
    monkeypatch.setattr(cpu, "layer_norm_forward", _shifted_y(cpu.layer_norm_forward, 1e-3))
    assert cli.main(["check", "--impl", "cpu", "--dtype", "float32"]) == 1
    out = capsys.readouterr().out
    bad = [line for line in out.splitlines() if line.endswith("FAIL")]
    assert len(bad) == 1 and "layer_norm" in bad[0] and "forward" in bad[0] and " y " in bad[0]
    assert "1 FAILED" in out


@pytest.mark.slow
def test_check_detects_a_wrong_gradient_and_a_crash(capsys, monkeypatch):
    good = cpu.rms_norm_backward

    def wrong_dweight(*args, **kw):
        dx, dw = good(*args, **kw)
        return dx, dw * 1.001

    def crash(*args, **kw):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(cpu, "rms_norm_backward", wrong_dweight)
    monkeypatch.setattr(cpu, "group_norm_forward", crash)
    assert cli.main(["check", "--impl", "cpu", "--dtype", "float64"]) == 1
    out = capsys.readouterr().out
    assert any("rms_norm" in line and "dweight" in line and "FAIL" in line for line in out.splitlines())
    assert "RuntimeError: kernel exploded" in out
    # every group norm shape (instance norm's too) goes through group_norm_forward: a crash
    # each, and 1 wrong gradient
    assert f"{len(cli.CHECK_SHAPES['groups']) + 1} FAILED" in out


@pytest.mark.slow
def test_check_catches_nan(capsys, monkeypatch):
    monkeypatch.setattr(cpu, "group_norm_forward", _shifted_y(cpu.group_norm_forward, np.nan))
    assert cli.main(["check", "--impl", "cpu", "--dtype", "float32"]) == 1


def _usage_error(argv, capsys):
    """The error line argparse prints for ``argv`` (it must exit 2)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: numbanorm {argv[0]}" in err
    return next(line for line in err.splitlines() if ": error: " in line).split(": error: ", 1)[1]


@pytest.mark.parametrize("command", ["check", "bench"])
def test_an_unknown_implementation_is_named_with_the_valid_ones(command, capsys):
    """check and bench refuse a bad --impl alike: the value, the valid names, exit 2; the
    oracle is no kernel to check or time, and says so."""
    from numbanorm import registry

    kernels = [n for n in registry.IMPLEMENTATIONS if n != "oracle"]
    msg = _usage_error([command, "--impl", "bogus"], capsys)
    assert msg == f"argument --impl: invalid choice: 'bogus' (choose from {', '.join(map(repr, kernels))})"
    msg = _usage_error([command, "--impl", "oracle"], capsys)
    assert "'oracle'" in msg and "reference" in msg and all(repr(k) in msg for k in kernels)
    msg = _usage_error([command, "--dtype", "int8"], capsys)
    assert "'int8'" in msg and "'bfloat16'" in msg and "'float32'" in msg


@pytest.mark.parametrize("command", ["check", "bench"])
def test_an_unusable_implementation_is_said_alike(command, capsys, monkeypatch):
    from numbanorm import registry

    monkeypatch.setitem(registry.IMPLEMENTATIONS, "ghost", "numbanorm.no_such_module")
    assert cli.main([command, "--impl", "ghost"]) == 1
    assert "ghost: not usable here: ModuleNotFoundError" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["check", "bench"])
def test_bfloat16_needs_ml_dtypes_and_says_so(command, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # as if it were not installed
    msg = _usage_error([command, "--dtype", "bfloat16"], capsys)
    assert "bfloat16" in msg and "pip install ml-dtypes" in msg


@pytest.mark.slow
def test_check_and_bench_run_bfloat16(capsys, monkeypatch):
    """bfloat16 on the CPU kernels through both commands (LayerNorm only: each dtype compiles
    its own kernels)."""
    pytest.importorskip("ml_dtypes")
    from numbanorm import measure, operations

    monkeypatch.setattr(operations, "OPERATIONS", (operations.BY_NAME["layer_norm"],))
    assert cli.main(["check", "--impl", "cpu", "--dtype", "bfloat16"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cpu ")]
    assert len(lines) == 2 and all(" bfloat16 " in line and line.endswith("pass") for line in lines)
    _tolerances_shown(lines)
    monkeypatch.setattr(measure, "NORMS", ("layer_norm",))
    assert cli.main(["bench", "--tiny", "--repeats", "1", "--threads", "1", "--impl", "cpu", "--no-torch",
                     "--dtype", "bfloat16", "--no-progress"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if " numbanorm.cpu " in line]
    assert len(rows) == 3 and all(" bfloat16 " in line for line in rows)  # forward out=, forward, backward


def test_bench_tiny(capsys):
    rc = cli.main(["bench", "--tiny", "--repeats", "2", "--threads", "1", "--impl", "cpu", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("case "))
    assert "x floor" in head and "numbanorm.cpu" in out
    try:
        import torch  # noqa: F401
    except ImportError:
        assert "x torch" not in head and "torch is not installed" in out
    else:
        assert "x torch" in head and sum(bool(re.search(r" torch +alloc ", line)) for line in out.splitlines()) == 8
    # 4 norms x (forward out=, forward, backward) numbanorm rows
    assert sum(" numbanorm.cpu " in line for line in out.splitlines()) == 12


def test_bench_without_torch_says_so(capsys):
    assert cli.bench(threads=1, repeats=1, tiny=True, torch=False, impls=["cpu"], show_progress=False) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if " float32 " in line]
    assert len(rows) == 12 + 8  # numbanorm rows + one floor row per case
    assert not any(" torch " in line for line in rows)
    # the header and the footer explain no torch column; the floor is one thread's copy
    assert "torch" not in out.splitlines()[0] and "x torch" not in out and "np.copyto of the same bytes on one thread" in out


def test_an_interrupted_command_says_so_in_a_line(capsys, monkeypatch):
    """Ctrl-C (a compile waited for, a benchmark): one line and the shell's 130, not a traceback."""
    def interrupted(**kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "bench", interrupted)
    assert cli.main(["bench"]) == 130
    assert capsys.readouterr().err == "numbanorm: interrupted\n"


def test_no_arguments_runs_check_then_bench(monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "check", lambda **kw: calls.append("check") or 0)
    monkeypatch.setattr(cli, "bench", lambda **kw: calls.append("bench") or 0)
    assert cli.main([]) == 0 and calls == ["check", "bench"]
    calls.clear()
    monkeypatch.setattr(cli, "check", lambda **kw: calls.append("check") or 1)
    assert cli.main([]) == 1 and calls == ["check"]  # no benchmark of a failing kernel


@pytest.mark.parametrize("argv", [["bogus"], ["check", "--dtype", "int8"], ["bench", "--dtype", "int8"],
                                  ["check", "--impl", "bogus"], ["bench", "--impl", "bogus"], ["bench", "--threads", "0"],
                                  ["bench", "--threads", "100000"], ["bench", "--budget", "-1"],
                                  ["bench", "--repeats", "x"], ["info", "--what"]])
def test_bad_arguments_exit_2(argv, capsys):
    """Exit 2 with the command's own usage and a message that names the argument, never a
    function of the CLI's (argparse named ``_positive_int`` for --repeats x, and --threads
    above the limit got the top-level usage)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: numbanorm" in err
    assert "_positive" not in err and "_dtype_name" not in err and "_kernel_name" not in err
    if argv[0] == "bench" and argv[1] in ("--threads", "--budget", "--repeats"):
        assert "usage: numbanorm bench" in err and f"argument {argv[1]}:" in err


# forward and backward of every family with weights (the variants ``numbanorm compile``
# compiles), on calls that take the parallel kernels and the serial row functions: all
# their outputs, in one list (run in a new process and in this one)
_EVERY_FAMILY = """
import numpy as np
import numbanorm as nn

def every_family():
    x = np.linspace(-1, 1, 300 * 128, dtype=np.float32).reshape(300, 128)  # parallel: >= SERIAL_BELOW
    w, b = np.linspace(0.5, 1.5, 128, dtype=np.float32), np.linspace(-1, 1, 128, dtype=np.float32)
    outs = []
    for a in (x, x[:4]):  # and serial
        y, m, r = nn.layer_norm_forward(a, 128, w, b)
        outs += [y, m, r, *nn.layer_norm_backward(y, a, m, r, 128, w)]
        y, r = nn.rms_norm_forward(a, 128, w)
        outs += [y, r, *nn.rms_norm_backward(y, a, r, 128, w)]
        outs += [*nn.add_layer_norm(a, a, 128, w, b), *nn.add_rms_norm(a, a, 128, w)]
        g = a.reshape(a.shape[0] // 2, 16, 4, 4)
        y, m, r = nn.group_norm_forward(g, 4, w[:16], b[:16])
        outs += [y, m, r, *nn.group_norm_backward(y, g, m, r, w[:16])]
    return [o for o in outs if o is not None]
"""


@pytest.mark.slow
def test_compile_fills_the_cache_for_every_operation(tmp_path):
    """``numbanorm compile`` compiles every operation's row functions and parallel kernels,
    forward and backward, plain and streaming, into numba's cache: the same calls in a
    later process load every one of them and compile nothing (a kernel keyed on something
    that changes per process, such as a dispatcher in a closure, would recompile at every
    import: a cold-start regression no result would show).  The kernels it loaded give this
    process's bits, and loading them registers none of Numba's lowerings
    (cache.KernelCache.load_overload: ``numba.np.linalg`` is imported by that registration
    alone)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("NUMBA_DISABLE_JIT", None)
    r = subprocess.run([sys.executable, "-m", "numbanorm", "compile", "--no-progress"], env=env,
                       capture_output=True, text=True, timeout=3600)
    from numbanorm import operations

    calls = 2 * len(operations.OPERATIONS)
    assert r.returncode == 0 and f"{calls} of {calls} calls compiled or loaded" in r.stdout, r.stdout + r.stderr
    assert str(tmp_path) in r.stdout  # it says where the cache is
    code = _EVERY_FAMILY + """
import sys
from numbanorm import __main__ as cli
from numbanorm.cpu._kernels import add_norm, background, common, group_norm, layer_norm, rms_norm
assert cli.compile_cpu(("float32",), show_progress=False) == 0
np.savez(sys.argv[1], *every_family())
background.wait()
kernels = [k for m in (add_norm, group_norm, layer_norm, rms_norm) for k in vars(m).values()
           if isinstance(k, common.Kernel)]
kernels += [k.streaming() for k in kernels if k._stream_at is not None]
made = [f for k in kernels for f in (k.rows, k.parallel)]
print(sum(sum(f.stats.cache_misses.values()) for f in made),
      sum(sum(f.stats.cache_hits.values()) > 0 for f in made), len(made), "numba.np.linalg" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "loaded.npz")], env=env, capture_output=True,
                       text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    missed, loaded, total, registered = r.stdout.split()[-4:]
    # 8 kernels, each a row function and a parallel kernel: forward and backward of LayerNorm,
    # RMSNorm and GroupNorm, and the fused forwards (the fused backward is the norm's); the 6
    # that stream their output large, the same with the streaming stores; and GroupNorm's 4
    # in channels-last order (two passes each way), and the STREAMING variants of the
    # forward's two (rows read one after another, y streamed)
    assert (int(missed), int(loaded), int(total), registered) == (0, 40, 40, "False")
    here = {}
    exec(_EVERY_FAMILY, here)
    from numbanorm.cpu._kernels import background

    here["every_family"]()
    background.wait()
    mine = here["every_family"]()  # (on the parallel kernels)
    with np.load(tmp_path / "loaded.npz") as got:
        assert len(got.files) == len(mine) >= 30
        for k, want in enumerate(mine):
            np.testing.assert_array_equal(got[f"arr_{k}"], want, err_msg=f"output {k}")


def test_compile_without_a_writable_cache_compiles_nothing_and_fails(capsys, monkeypatch):
    """Where numba keeps nothing on disk (a read-only install, HOME read-only), compile says so
    and exits 1 at once: a job that runs it to fill an image's cache must not pass empty."""
    from numbanorm.cpu._kernels import background

    monkeypatch.setattr(cli, "_info_cache", lambda: "none: the kernels are compiled in memory in every process")
    monkeypatch.setattr(background, "synchronous", None)  # (any compile would fail on it)
    assert cli.main(["compile", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "none: the kernels are compiled in memory" in out and "nothing compiled" in out
    assert "NUMBA_CACHE_DIR" in out


def test_compile_refuses_a_cache_folder_numba_passed_over(capsys, monkeypatch):
    """NUMBA_CACHE_DIR set to a folder numba cannot use: numba fills another (the user-wide
    one), and compile exited 0 after filling it; an image built so would start cold."""
    from numbanorm.cpu._kernels import background

    monkeypatch.setattr(cli, "_info_cache", lambda: "/root/.cache/numba (UserWide; NUMBA_CACHE_DIR=/ro is "
                                                    "not usable, numba fell back to this)")
    monkeypatch.setattr(background, "synchronous", None)  # (any compile would fail on it)
    assert cli.main(["compile", "--no-progress"]) == 1
    assert "nothing compiled: NUMBA_CACHE_DIR is not usable" in capsys.readouterr().out


def test_compile_of_bfloat16_without_an_importable_ml_dtypes_is_a_usage_error(capsys, monkeypatch, tmp_path):
    """An ml_dtypes that is installed but fails to import passed compile's check (find_spec)
    and ended in a traceback; check and bench tried the import."""
    from numbanorm.cpu._kernels import background

    (tmp_path / "ml_dtypes").mkdir()
    (tmp_path / "ml_dtypes" / "__init__.py").write_text("raise ImportError('a broken ml_dtypes')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ml_dtypes", raising=False)
    monkeypatch.setattr(background, "synchronous", None)  # (any compile would fail on it)
    with pytest.raises(SystemExit) as e:
        cli.main(["compile", "--dtypes", "bfloat16", "--no-progress"])
    assert e.value.code == 2 and "bfloat16 needs ml_dtypes" in capsys.readouterr().err


def test_import_and_a_call_where_os_has_no_fork_and_no_load_average():
    """Windows' os has neither register_at_fork nor getloadavg: ``import numbanorm`` raised
    AttributeError at import (the fork handlers), and ``numbanorm bench`` at its load
    average; the README and the workflow's matrix name Windows."""
    code = """
import os
del os.register_at_fork, os.getloadavg
import numpy as np
import numbanorm
from numbanorm import machine, reference
assert machine.loadavg() is None
x = np.arange(8, dtype=np.float32).reshape(2, 4)
np.testing.assert_allclose(numbanorm.layer_norm(x, 4), reference.layer_norm(x, 4), rtol=1e-6, atol=1e-6)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.split()[-1:] == ["ok"], r.stderr[-3000:]


def test_a_threading_layer_that_cannot_load_is_a_message_not_a_traceback():
    """NUMBA_THREADING_LAYER naming a layer that is not installed: bench ended in an
    11-frame traceback; it prints numba's message and exits 1."""
    env = {**os.environ, "NUMBA_THREADING_LAYER": "tbb"}
    probe = subprocess.run([sys.executable, "-c", "import numba.np.ufunc.tbbpool"], env=env, capture_output=True)
    if probe.returncode == 0:
        pytest.skip("TBB is installed here")
    r = subprocess.run([sys.executable, "-m", "numbanorm", "bench", "--tiny", "--repeats", "1", "--threads", "1",
                        "--impl", "cpu", "--no-progress"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "numbanorm: No threading layer could be loaded" in r.stderr and "NUMBA_THREADING_LAYER=tbb" in r.stderr


def test_numbanorm_cuda_is_there_after_import_numbanorm():
    """The README's ``numbanorm.cuda.is_available()`` after ``import numbanorm`` raised
    AttributeError (numbanorm.cpu was there, numbanorm.cuda was not imported); it is
    imported on first use, not with numbanorm."""
    code = """
import sys
import numbanorm
assert "numbanorm.cuda" not in sys.modules
print(type(numbanorm.cuda.is_available()).__name__, "numbanorm.cuda" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.split() == ["bool", "True"], r.stderr[-3000:]


def test_numbas_own_cuda_module_is_not_numba_cuda():
    """With numba-cuda missing, numba's built-in numba.cuda answered, and numbanorm.cuda said
    no GPU was found and advised the simulator, which then failed: it says numba-cuda is
    not installed."""
    code = """
from numba import cuda
cuda.implementation = "Built-in"
import numbanorm.cuda
print(numbanorm.cuda.why_unavailable())
"""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and "numba-cuda is not installed" in r.stdout, (r.stdout, r.stderr[-3000:])


@pytest.mark.parametrize("argv", [["compile", "--dtypes", "int8"], ["compile", "--bogus"]])
def test_compile_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and "usage: numbanorm" in capsys.readouterr().err


def test_module_and_console_script_entry_points():
    """``--help``, which imports no kernels (test_info_follows_numbas_settings runs ``info`` in one)."""
    r = subprocess.run([sys.executable, "-m", "numbanorm", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: numbanorm")
    r = subprocess.run([sys.executable, "-m", "numbanorm", "--bad"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "usage" in r.stderr
    script = Path(sys.executable).with_name("numbanorm")
    if not script.exists():
        pytest.skip("the console script is installed only by pip install")
    r = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: numbanorm")


@pytest.mark.cudasim
def test_check_runs_the_gpu_kernels_when_usable(capsys, monkeypatch):
    """In numba's CUDA simulator (tests/conftest.py switches it on), on tiny inputs: the
    simulator runs every GPU thread in Python, so the default inputs would take minutes."""
    from numbanorm import registry

    if not registry.usable("cuda")[0]:
        pytest.skip("numbanorm.cuda is not usable here")
    monkeypatch.setattr(cli, "CHECK_SHAPES", {"rows": [((3, 40), None)], "groups": [((2, 4, 3), 2), ((2, 3, 5), 3)]})
    assert cli.main(["check", "--impl", "cuda", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("cuda ") and line.endswith("pass") for line in out.splitlines()) == 12
    assert "12 of 12 checks passed" in out


def test_check_covers_the_fused_operations(capsys, monkeypatch):
    monkeypatch.setattr(cpu, "add_rms_norm_forward", _shifted_y(cpu.add_rms_norm_forward, 1e-3))
    assert cli.main(["check", "--impl", "cpu", "--dtype", "float32"]) == 1
    bad = [line for line in capsys.readouterr().out.splitlines() if line.endswith("FAIL")]
    assert len(bad) == 1 and "add_rms_norm" in bad[0] and "forward" in bad[0] and " y " in bad[0]


# ------------------------------------------------------------------ info: what a bug report needs


def _info_fields(out):
    """``numbanorm info``'s lines as {label: value} (labels fill the first 15 columns)."""
    return {line[:15].strip(): line[15:] for line in out.splitlines() if line[:1].strip()}


@pytest.mark.machine_streaming
def test_info_reports_versions_threads_cache_cpu_and_gpu(capsys):
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import llvmlite
    import llvmlite.binding as ll
    import numba

    import numbanorm
    from numbanorm import registry

    assert cli.main(["info"]) == 0
    f = _info_fields(capsys.readouterr().out)
    assert f["numbanorm"] == f"{numbanorm.__version__} ({Path(numbanorm.__file__).parent})"
    assert f["python"].startswith(platform.python_version() + " ")
    assert f["numba"] == f"{numba.__version__}, llvmlite {llvmlite.__version__}, numpy {np.__version__}"
    for dist in ("numba-cuda", "ml_dtypes", "torch", "dask"):
        try:
            assert f"{dist} {version(dist)}" in f["optional"]
        except PackageNotFoundError:
            assert f"{dist} not installed" in f["optional"]
    # the layer numba started (info starts it, as the first parallel kernel would), and each layer's state
    assert f["threads"].startswith(f"{numba.get_num_threads()} ")
    assert f["threading"].startswith(f"{numba.threading_layer()} in use ")
    states = dict(part.split(": ", 1) for part in f["threading"].split("; ")[1:])
    assert set(states) == {"tbb", "omp", "workqueue"}
    assert states[numba.threading_layer()].startswith("available")
    assert all(s.startswith(("available", "not available (")) for s in states.values())
    cache, _, state = f["kernel cache"].rpartition(", ")
    assert state == "writable" and Path(cache.split(" (")[0]).is_dir()
    if platform.machine().lower() in ("x86_64", "amd64"):
        host = ll.get_host_cpu_features()
        for label, key in (("F16C", "f16c"), ("AVX2", "avx2"), ("AVX-512", "avx512f")):
            assert f" {label} {'yes' if host[key] else 'no'}" in f["cpu target"]
    from numbanorm.cpu._kernels.halves import BFLOAT16_BY_INSTRUCTION, WIDE_HALVES
    assert f["cpu target"].endswith(f"; 16-bit rows 512 bits wide {'yes' if WIDE_HALVES else 'no'}; bfloat16 "
                                    f"narrowed by {'vcvtneps2bf16' if BFLOAT16_BY_INSTRUCTION else 'integer code'}")
    from numba.core import config
    if platform.machine().lower() in ("x86_64", "amd64") and not (config.CPU_NAME or config.CPU_FEATURES):
        assert BFLOAT16_BY_INSTRUCTION == (host.get("avx512bf16", False) and host.get("avx512dq", False)
                                           and ll.llvm_version_info[0] >= 22)  # wherever this CPU has it
    from numbanorm.cpu._kernels import memory
    assert f["streaming"].startswith(f"outputs of {memory.STREAM_MIN_BYTES / 2**20:.1f} MiB or more "
                                     f"({memory.STREAM_FRACTION} x the {memory.CACHE_BYTES / 2**20:.1f} MiB ")
    assert f"{memory.CACHE_CPUS} usable CPU(s)" in f["streaming"]
    assert f["streaming"].endswith(f"more than the {memory.L1_DATA_BYTES // 1024} KiB L1 data cache")
    ok, why = registry.usable("cuda")
    assert f["gpu"].startswith("in use: " if ok else f"not in use: {why.splitlines()[0][:100]}")
    assert ("simulator" in f["gpu"]) == (ok and SIMULATED)


def _info_subprocess(**env):
    env = {**os.environ, **env}
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    r = subprocess.run([sys.executable, "-m", "numbanorm", "info"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    return _info_fields(r.stdout)


def test_info_follows_numbas_settings(tmp_path):
    f = _info_subprocess(NUMBA_CACHE_DIR=str(tmp_path), NUMBA_THREADING_LAYER="workqueue")
    assert f["kernel cache"].startswith(f"{tmp_path}{os.sep}")
    assert f["kernel cache"].endswith(", writable") and "UserProvided" in f["kernel cache"]
    assert f["threading"].startswith("workqueue in use (NUMBA_THREADING_LAYER=workqueue)")
    if os.environ.get("NUMBANORM_TEST_GPU") != "1":  # no GPU: says why, and of the simulator
        assert f["gpu"].startswith("not in use: ") and f["gpu"].endswith("(NUMBA_ENABLE_CUDASIM unset)")
    # a NUMBA_CACHE_DIR numba cannot write to (under a file): numba falls back, and info says so
    (tmp_path / "file").write_text("")
    f = _info_subprocess(NUMBA_CACHE_DIR=str(tmp_path / "file" / "cache"))
    assert "is not usable, numba fell back to this" in f["kernel cache"]


def test_info_says_which_sizes_it_could_not_read_from_the_os(capsys, monkeypatch):
    """Where the OS shows no caches (macOS, Windows, a masked /sys) the kernels count on
    defaults, and without /proc/meminfo the memory is unknown: info said so as if read
    ("a 32.0 MiB last-level cache", "None GiB")."""
    from numbanorm import machine
    from numbanorm.cpu._kernels import memory

    monkeypatch.setattr(memory, "_data_caches", lambda folder: [])
    monkeypatch.setattr(machine, "mem_total_bytes", lambda: None)
    assert cli.main(["info"]) == 0
    f = _info_fields(capsys.readouterr().out)
    assert f["cpu"].endswith("usable here), memory not read from the OS") and "None" not in f["cpu"]
    assert "last-level cache (none read from the OS: a default), " in f["streaming"]
    assert f["streaming"].endswith("L1 data cache (none read from the OS: a default)")


def test_info_says_when_the_cache_is_not_writable(capsys, monkeypatch):
    """Root writes anywhere, so a read-only folder is played by the write test failing."""
    import tempfile

    def refused(*a, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", refused)
    assert cli.main(["info"]) == 0
    assert "NOT writable (PermissionError" in _info_fields(capsys.readouterr().out)["kernel cache"]


def test_import_with_numbas_jit_disabled_says_why():
    """NUMBA_DISABLE_JIT=1 (a debugging switch) leaves the kernels' intrinsics nothing to run:
    ``import numbanorm`` says so in an ImportError (it was an AttributeError on py_func from
    deep in the kernel modules, ``info`` included)."""
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    r = subprocess.run([sys.executable, "-c", "import numbanorm"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and "NUMBA_DISABLE_JIT" in last, r.stderr[-2000:]
