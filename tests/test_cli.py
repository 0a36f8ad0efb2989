"""The ``numbanorm`` command: info, check, bench, the no-argument main job, bad arguments."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numbanorm.cpu as cpu
from numbanorm import __main__ as cli


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for word in ("numbanorm", "numba", "numpy", "threads", "cpu", "oracle", "gpu"):
        assert word in out


def test_check_passes_on_the_cpu_kernels(capsys):
    assert cli.main(["check", "--impl", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("cpu ")]
    # every operation of the table (fused ones included), group norm also with one group per
    # channel, x forward/backward x float16/32/64: counted, not assumed
    from numbanorm import operations

    n = sum(len(cli.CHECK_SHAPES[op.layout]) for op in operations.OPERATIONS) * 2 * 3
    assert n == 36 and len(lines) == n and all(line.endswith("pass") for line in lines)
    assert {line.split()[1] for line in lines} == {op.name for op in operations.OPERATIONS}
    assert f"{n} of {n} checks passed" in out


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
    # instance norm goes through group_norm_forward too: 2 crashes, 1 wrong gradient
    assert "3 FAILED" in out


def test_check_catches_nan(capsys, monkeypatch):
    monkeypatch.setattr(cpu, "group_norm_forward", _shifted_y(cpu.group_norm_forward, np.nan))
    assert cli.main(["check", "--impl", "cpu", "--dtype", "float32"]) == 1


def test_check_unknown_and_unusable_implementations(capsys, monkeypatch):
    assert cli.main(["check", "--impl", "nope"]) == 2
    from numbanorm import registry

    monkeypatch.setitem(registry.IMPLEMENTATIONS, "ghost", "numbanorm.no_such_module")
    assert cli.main(["check", "--impl", "ghost"]) == 1
    assert "not usable" in capsys.readouterr().out


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
    rows = [line for line in capsys.readouterr().out.splitlines() if " float32 " in line]
    assert len(rows) == 12 + 8  # numbanorm rows + one floor row per case
    assert not any(" torch " in line for line in rows)


def test_no_arguments_runs_check_then_bench(monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "check", lambda **kw: calls.append("check") or 0)
    monkeypatch.setattr(cli, "bench", lambda **kw: calls.append("bench") or 0)
    assert cli.main([]) == 0 and calls == ["check", "bench"]
    calls.clear()
    monkeypatch.setattr(cli, "check", lambda **kw: calls.append("check") or 1)
    assert cli.main([]) == 1 and calls == ["check"]  # no benchmark of a failing kernel


@pytest.mark.parametrize("argv", [["bogus"], ["check", "--dtype", "int8"], ["bench", "--threads", "0"],
                                  ["bench", "--threads", "100000"], ["bench", "--budget", "-1"],
                                  ["bench", "--repeats", "x"], ["info", "--what"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "usage: numbanorm" in capsys.readouterr().err


def test_module_and_console_script_entry_points():
    r = subprocess.run([sys.executable, "-m", "numbanorm", "info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "numbanorm" in r.stdout
    r = subprocess.run([sys.executable, "-m", "numbanorm", "--bad"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "usage" in r.stderr
    script = Path(sys.executable).with_name("numbanorm")
    if not script.exists():
        pytest.skip("the console script is installed only by pip install")
    r = subprocess.run([str(script), "info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "numbanorm" in r.stdout


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
