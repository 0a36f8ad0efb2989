"""The test suite's own machinery (``conftest.py``): its units of work on the xdist workers,
and which tests' CPU calls stream their outputs or take the parallel kernels; the map of the
tests (``tests/README.md``) and the Markdown tables of the repository."""

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

import conftest

HERE = os.path.dirname(os.path.abspath(__file__))


def _unit_of(dist="loadscope"):
    config = SimpleNamespace(getvalue=lambda name: dist, option=SimpleNamespace())
    sched = conftest.pytest_xdist_make_scheduler(config, log=None)
    return sched, config


def test_the_variants_of_a_cpu_test_are_one_unit_and_a_gpu_test_a_unit_alone():
    sched, config = _unit_of()
    assert config.option.loadscopereorder is False  # collection order, the launch tests first
    unit = sched._split_scope
    cpu = [f"tests/test_half.py::test_group_norm[shape{i}-{g}-bfloat16]" for i, g in ((0, 1), (1, 3))]
    assert unit(cpu[0]) == unit(cpu[1]) == "tests/test_half.py::test_group_norm"
    assert unit("tests/test_layers.py::test_bad_eps") == "tests/test_layers.py::test_bad_eps"
    for gpu in ("tests/test_against_oracle.py::test_layer_norm[cuda-none-float16]",
                "tests/test_cuda.py::test_every_mapping_against_the_oracle[float32-default]",
                "tests/test_gpu_model.py::test_gate"):
        assert unit(gpu) == gpu
    assert unit("tests/test_against_oracle.py::test_layer_norm[cpu-none-float16]") != unit(
        "tests/test_against_oracle.py::test_layer_norm[cuda-none-float16]")
    assert _unit_of("load")[0] is None  # another --dist is xdist's own


@pytest.mark.slow
def test_two_workers_run_each_cpu_tests_variants_on_one_of_them():
    """End to end, as the README's command runs: pytest-xdist's own grouping by marker
    (loadgroup) stopped working with pytest 9.2 and nothing failed."""
    sel = ["tests/test_layers.py", "-k", "dtype or pickled or reusing"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *sel],
                         capture_output=True, text=True, cwd=os.path.dirname(HERE), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ran = re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED (\S+?)(?:\[|\s)", out.stdout)
    workers = {}
    for worker, test in ran:
        workers.setdefault(test, set()).add(worker)
    assert len(workers) >= 4 and len(ran) > len(workers), out.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), workers


def test_an_output_streams_and_a_call_takes_the_parallel_kernel_only_where_a_test_asks(request):
    from numbanorm.cpu._kernels import common, memory

    assert memory.STREAM_MIN_BYTES == common.SERIAL_BELOW == conftest._NEVER
    request.getfixturevalue("stream_everything")
    assert memory.STREAM_MIN_BYTES == 0


@pytest.mark.machine_streaming
@pytest.mark.parallel_kernels
def test_a_marked_test_takes_the_machines_thresholds():
    from numbanorm.cpu._kernels import common, memory

    assert memory.STREAM_MIN_BYTES == memory.stream_min_bytes(memory.CACHE_BYTES, memory.STREAM_FRACTION)
    assert common.SERIAL_BELOW == 32768  # PyTorch's grain size (common.py)


@pytest.mark.slow
def test_a_pytest_without_xdist_reads_the_conftest():
    """CI's book venv runs tests/test_book_numbers.py with pytest alone: the scheduler hook
    must not be refused there as an unknown hook."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-o", "addopts=", "-q",
                          "-p", "no:cacheprovider", "tests/test_layers.py", "-k", "pickled"],
                         capture_output=True, text=True, cwd=os.path.dirname(HERE), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def _table_cells(line):
    """The cells of a Markdown table row: split on each `|` outside backticks, not escaped."""
    cells, cell, code, i = [], "", False, 0
    while i < len(line):
        ch = line[i]
        if ch == "\\" and i + 1 < len(line):
            cell += line[i:i + 2]
            i += 2
            continue
        code ^= ch == "`"
        if ch == "|" and not code:
            cells.append(cell)
            cell = ""
        else:
            cell += ch
        i += 1
    return cells[1:]


def test_every_markdown_table_row_has_its_headers_cells():
    """A row with a cell too few or too many renders shifted or not at all, which a reader of
    the page sees and no other test does (the tests' map once lost a row that way)."""
    root = os.path.dirname(HERE)
    files = []  # (CI runs the tests from a copy of the repository's files, not a git checkout)
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_build")) and d not in ("build", "dist")
                   and not d.endswith(".egg-info")]
        files += [os.path.relpath(os.path.join(folder, n), root) for n in names if n.endswith(".md")]
    assert "tests/README.md" in files and "README.md" in files
    bad = []
    for name in files:
        header, fenced = None, False
        with open(os.path.join(root, name), encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                line = line.strip()
                if line.startswith("```"):
                    fenced, header = not fenced, None
                elif fenced or not line.startswith("|"):
                    header = None
                elif header is None:
                    header = len(_table_cells(line))
                elif len(_table_cells(line)) != header:
                    bad.append(f"{name}:{number}: {len(_table_cells(line))} cells, its header {header}")
    assert not bad, "\n".join(bad)


def test_the_tests_map_names_every_test_file_and_only_those():
    text = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    named = set(re.findall(r"`(test_\w+\.py)`", text))
    files = {name for name in os.listdir(HERE) if re.fullmatch(r"test_\w+\.py", name)}
    assert named == files, (sorted(files - named), sorted(named - files))
