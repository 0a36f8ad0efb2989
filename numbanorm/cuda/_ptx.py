"""Compile every GPU kernel for a given architecture without a GPU, and check
what the compiler did with it.

    python -m numbanorm.cuda._ptx [--check] [--cc 9.0] [--shard i/n]

NVVM (numba-cuda's compiler) runs without a driver; ptxas, where installed,
reports registers and spills.  Checked for every kernel at the mapping an
H100 gets for rows of 64 ... 20000 elements:

* registers x threads per block fit the SM (65536 registers) -- a kernel over
  budget compiles but fails to launch;
* float16/bfloat16/float32 kernels keep their row in registers: no local
  memory (``.local``) in the PTX and at most a few spilled words;
* the static shared memory of the loop path's row kernels (their reductions' scratch)
  fits ``common.SCRATCH_BYTES``, the share a staged row's dynamic shared memory leaves
  it under the per-block maximum.

Exit status: 0 all good, 1 a check failed, 3 NVVM/NVRTC not installed
(``pip install nvidia-nvvm nvidia-cuda-nvrtc`` or a CUDA toolkit), so
the caller can skip.
"""

import argparse
import glob
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

SM_REGISTERS = 65536
# a few spilled words (an index or two outside the element loops, in L1) are
# tolerated; a spilled row is not.  The most measured (sm_90, CUDA 13.0): 68
# bytes in the bfloat16 LayerNorm backward with the fused ds, element by element
# (the fallback for rows that do not split into 8-byte words).
SPILL_BYTES = 96


def find_tool(name):
    """Path of a CUDA command-line tool (``ptxas``, ``nvdisasm``, ...): on PATH or
    in the ``nvidia-*`` wheels' ``bin`` folders; None when not installed."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia

        for root in nvidia.__path__:
            hits = glob.glob(os.path.join(root, "*", "bin", name))
            if hits:
                return hits[0]
    except ImportError:
        pass
    return None


def _ptxas():
    return find_tool("ptxas")


def assemble(ptx, cc, ptxas=None):
    """``(cubin bytes, ptxas -v log)`` of ``ptx`` for compute capability ``cc``
    (RuntimeError with ptxas' message when it fails)."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas or _ptxas(), f"-arch=sm_{cc[0]}{cc[1]}", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(out.stderr)
        with open(os.path.join(d, "k.cubin"), "rb") as f:
            return f.read(), out.stderr


def _resources(ptxas, ptx, cc):
    """``(registers, spilled bytes, static shared bytes)`` of ``ptx`` as ``ptxas -v`` reports them."""
    log = assemble(ptx, cc, ptxas)[1]
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    smem = re.search(r"(\d+) bytes smem", log)
    return regs, spills, int(smem.group(1)) if smem else 0


def static_shared(ptx):
    """The static shared memory of the kernel in ``ptx`` (bytes), as ``ptxas -v`` reports it
    for the architecture of the PTX's ``.target`` (what the driver reports for the loaded
    kernel as CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)."""
    cc = re.search(r"^\.target\s+sm_(\d)(\d+)", ptx, re.M).groups()
    return _resources(_ptxas(), re.sub(r"^(\.target\s+sm_\d+)a\b", r"\1", ptx, flags=re.M), cc)[2]


def _cases():
    """(name, kernel dispatcher, numba argument types, threads per block, wide)."""
    import ml_dtypes
    from numba.cuda import types as T

    from ._kernels import common as C

    # the submodules by their full names: the package's own attributes
    # layer_norm/rms_norm/group_norm are the public functions
    GN, RW = (importlib.import_module(f"numbanorm.cuda._kernels.{m}") for m in ("group_norm", "row_norm"))

    bf16 = np.dtype(ml_dtypes.bfloat16)
    elem = {np.dtype(np.float16): T.float16, np.dtype(np.float32): T.float32,
            np.dtype(np.float64): T.float64, bf16: T.uint16}
    i64 = T.int64

    def arr(t, nd):
        return T.Array(t, nd, "C")

    for dt in (np.dtype(np.float16), bf16, np.dtype(np.float32), np.dtype(np.float64)):
        X = elem[dt]
        A = T.float64 if dt == np.float64 else T.float32
        X1, A1, A2, A3 = arr(X, 1), arr(A, 1), arr(A, 2), arr(A, 3)
        wide = dt == np.float64
        full = 16 // dt.itemsize if dt.itemsize <= 4 else 1   # 16-byte words (row kernels)
        half = C.WORD.itemsize // dt.itemsize                   # 8-byte words (GroupNorm; fallback)
        # 10240, 20000: long rows staged in (dynamic) shared memory, forward and backward
        for n in (64, 2048, 8192, 10240, 20000):
            # rows moved in 16-byte words (the aligned case), and in 8-byte words and
            # element by element (rows that do not split, offset views) at one length
            for vec in sorted({full, half, 1} if n == 2048 else {full} if n == 10240 else {full, half}):
                R2 = arr(T.uint64, 2) if vec > 1 else arr(X, 2)
                cfg = C.row_config(32768, n, wide, vec, None, dt.itemsize, 1)   # forward: x (or s) staged
                bcfg = C.row_config(32768, n, wide, vec, None, dt.itemsize, 2)  # backward: x and dy
                tag = f"{dt.name} N={n} tpr={cfg.tpr} vpt={cfg.vpt} vec={vec} rows={cfg.rows} loop={cfg.loop}"
                for kind in RW.KINDS:
                    yield (f"{kind}_norm.forward {tag} stage={cfg.stage}",
                           RW.forward_kernel(kind, dt, dt, dt, cfg.code, True),
                           (R2, R2, X1, X1, A, R2, R2, A1, A1), cfg.block, wide)
                    yield (f"{kind}_norm.backward {tag} stage={bcfg.stage}",
                           RW.backward_kernel(kind, dt, dt, bcfg.code, True),
                           (R2, R2, A1, A1, X1, R2, R2, A3), bcfg.block, wide)
                if n == 10240 or (vec == full and full != half):
                    continue  # GroupNorm moves 8-byte words at most
                gcfg = C.row_config(4 * 32, n * 10, wide, vec)  # (4, 320 channels, 32 groups, S=n)
                yield (f"group_norm.forward {dt.name} L={n * 10} vec={vec}", GN._forward_kernel(dt, dt, dt, gcfg.code),
                       (R2, X1, X1, A, i64, i64, R2, A1, A1), gcfg.block, wide)
                ccfg = C.row_config(4 * 320, n, wide, vec)
                yield (f"group_norm.channel_sums {dt.name} S={n} vec={vec}", GN._channel_sums_kernel(dt, ccfg.code),
                       (R2, R2, A1, A1, i64, A2), ccfg.block, wide)
                yield (f"group_norm.dx {dt.name} S={n} vec={vec}", GN._dx_kernel(dt, dt, ccfg.code),
                       (R2, R2, A1, A1, X1, i64, A2, R2), ccfg.block, wide)
        yield (f"cast float32->{dt.name}", C._cast_kernel(np.dtype(np.float32), dt),
               (arr(T.float32, 1), X1), 256, wide)
    for acc, A in (("float32", T.float32), ("float64", T.float64)):
        yield (f"column_sums {acc}", C._column_sums_kernel(2, 32, 32, acc, np.dtype(acc)),
               (arr(A, 3), arr(A, 1), arr(A, 1)), 1024, acc == "float64")


def shard_of(cases, shard, shards):
    """The ``shard``-th of ``shards`` runs of consecutive ``cases``: neighbours (mostly one
    dtype's kernels) share device functions, which one process compiles once."""
    return cases[shard * len(cases) // shards:(shard + 1) * len(cases) // shards]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if a kernel breaks its budget")
    p.add_argument("--cc", default="9.0", help="compute capability (default 9.0, H100)")
    p.add_argument("--shard", default="0/1", help="i/n: the i-th of n runs of consecutive kernels (one "
                                                  "process per core; each compile is single-threaded)")
    args = p.parse_args(argv)
    shard, shards = (int(v) for v in args.shard.split("/"))
    cc = tuple(int(v) for v in args.cc.split("."))
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        print("the CUDA simulator is on: set NUMBA_ENABLE_CUDASIM=0")
        return 3

    from numba import cuda
    from numba.cuda import dispatcher

    from ._kernels import common as C

    class _Device:  # device functions ask the current device for its capability
        compute_capability = cc

    dispatcher.get_current_device = lambda: _Device()
    C.n_sm = lambda: 132  # an H100's SMs: the mapping it would get

    try:
        cuda.compile_ptx(lambda a: None, (cuda.types.float32[::1],), cc=cc)
    except Exception as e:  # libnvvm / libnvrtc missing
        print(f"cannot compile without the CUDA toolkit's NVVM/NVRTC: {type(e).__name__}: {str(e).splitlines()[0]}")
        return 3
    ptxas = _ptxas()
    failed = []
    # one compile per kernel and argument types: lengths that map to the same kernel
    # (every staged length of a dtype, GroupNorm's group lengths) share it
    unique = {}
    for case in _cases():
        unique.setdefault((id(case[1]), case[2]), case)
    for name, kern, sig, block, wide in shard_of(list(unique.values()), shard, shards):
        bounds = kern.targetoptions.get("launch_bounds")
        ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=cc, launch_bounds=bounds)
        line = f"{name:<72} block={block:<5}"
        problems = []
        if not wide and ".local" in ptx:
            problems.append("local memory")
        if ptxas:
            regs, spills, smem = _resources(ptxas, ptx, cc)
            line += f" regs={regs:<4} spill={spills} smem={smem}"
            if " loop=True" in name and smem > C.SCRATCH_BYTES:  # (the loop path's: it stages rows)
                problems.append(f"{smem} bytes of static shared memory > {C.SCRATCH_BYTES}")
            if regs * block > SM_REGISTERS:
                problems.append(f"{regs} registers x {block} threads > {SM_REGISTERS}")
            if spills > SPILL_BYTES and not wide:
                problems.append(f"{spills} bytes spilled")
        print(line + ("  FAIL: " + "; ".join(problems) if problems else ""))
        if problems:
            failed.append(name)
    if not ptxas:
        print("ptxas not found: registers and spills not checked")
    print(f"{len(failed)} kernel(s) over budget" if failed else "all kernels within budget")
    return 1 if failed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
