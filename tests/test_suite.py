"""The test suite's own machinery (``conftest.py``): its units of work on the xdist workers,
and which tests' CPU calls stream their outputs or take the parallel kernels."""

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
