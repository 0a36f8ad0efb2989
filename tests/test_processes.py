"""numbanorm in the process models its users run it in (contract, "Where it runs").

Each case runs in a fresh interpreter under one Numba threading layer (both
OpenMP and workqueue, the layers without a third-party library), because
what failed was the process itself: a forked child killed by GNU OpenMP, a
``multiprocessing.Pool`` hung on its dead workers, the workqueue layer aborting
on two threads at once.  Every result must equal, bit for bit, the one the
parent computed on Numba's threads before (the serial variants that forked
children and concurrent callers run give the same bits).
"""

import os
import subprocess
import sys
import textwrap

import pytest

LAYERS = ["omp", "workqueue"]

# Defines `work(seed)`: forward and backward of every family on inputs large
# enough for the parallel kernels (common.SERIAL_BELOW), returning all outputs.
_PRELUDE = """
import os, sys
import numpy as np
import numba
import numbanorm as nn

def work(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((256, 512)).astype(np.float32)
    r = rng.standard_normal((256, 512)).astype(np.float32)
    w = rng.standard_normal(512).astype(np.float32)
    b = rng.standard_normal(512).astype(np.float32)
    g = rng.standard_normal((8, 16, 512)).astype(np.float32)
    y, mean, rstd = nn.layer_norm_forward(x, 512, w, b)
    out = [y, mean, rstd, *nn.layer_norm_backward(y, x, mean, rstd, 512, w)]
    y, rs = nn.rms_norm_forward(x, 512, w)
    out += [y, rs, *nn.rms_norm_backward(y, x, rs, 512, w)]
    y, gm, gr = nn.group_norm_forward(g, 4, w[:16], b[:16])
    out += [y, gm, gr, *nn.group_norm_backward(y, g, gm, gr, w[:16])]
    out += list(nn.add_layer_norm(x, r, 512, w, b)) + list(nn.add_rms_norm(x, r, 512, w))
    return out

def same(a, b):
    return len(a) == len(b) and all(np.array_equal(p, q, equal_nan=True) for p, q in zip(a, b))

REF = {s: work(s) for s in range(4)}   # on Numba's threads: the parent uses numbanorm first
assert numba.threading_layer() == os.environ["NUMBA_THREADING_LAYER"], numba.threading_layer()
"""

CASES = {
    "fork": """
        pid = os.fork()
        if pid == 0:
            os._exit(0 if all(same(work(s), REF[s]) for s in range(4)) else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert same(work(0), REF[0])  # and the parent still works
    """,
    "pool": """
        import multiprocessing as mp
        with mp.get_context("fork").Pool(2) as pool:
            got = pool.map(work, range(4))
        assert all(same(got[s], REF[s]) for s in range(4))
    """,
    "dataloader": """
        import torch
        class Data(torch.utils.data.Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, s):
                return work(s)[0]
        loader = torch.utils.data.DataLoader(Data(), batch_size=None, num_workers=2,
                                             multiprocessing_context="fork")
        got = [t.numpy() for t in loader]
        assert all(np.array_equal(got[s], REF[s][0]) for s in range(4))
    """,
    "threads": """
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(work, [s % 4 for s in range(16)]))
        assert all(same(g, REF[s % 4]) for s, g in enumerate(got))
    """,
    "dask": """
        import dask
        import dask.array as da
        import numbanorm.dask as nd
        x = np.random.default_rng(5).standard_normal((4096, 512)).astype(np.float32)
        want = nn.layer_norm(x, 512)
        xd = da.from_array(x, chunks=(256, 512))
        for _ in range(3):
            got = nd.layer_norm(xd, 512).compute(scheduler="threads", num_workers=4)
            assert np.array_equal(got, want)
    """,
}


def _run(case, layer):
    env = dict(os.environ, NUMBA_THREADING_LAYER=layer, NUMBA_NUM_THREADS="2")
    code = _PRELUDE + textwrap.dedent(CASES[case])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode and "No threading layer could be loaded" in proc.stderr:
        pytest.skip(f"Numba's {layer} threading layer is not available here")
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("case", ["fork", "pool", "threads"])
def test_process_models(case, layer):
    _run(case, layer)


@pytest.mark.parametrize("layer", LAYERS)
def test_torch_dataloader_workers(layer):
    pytest.importorskip("torch")
    _run("dataloader", layer)


@pytest.mark.parametrize("layer", LAYERS)
def test_dask_threaded_scheduler(layer):
    pytest.importorskip("dask.array")
    _run("dask", layer)
